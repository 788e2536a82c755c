"""tvmkv.target (what a user may pass as ``target``) and tvmkv.payload (the runtime-only TVM bootstrap)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tvm

from tvmkv import payload
from tvmkv.target import CUDA_ARCHS, default_cuda_arch, make_target, parse_target


@pytest.fixture
def fresh_arch(monkeypatch):
    """``default_cuda_arch`` read again from the (monkeypatched) environment, and again afterwards."""
    default_cuda_arch.cache_clear()
    yield monkeypatch
    default_cuda_arch.cache_clear()


@pytest.mark.parametrize(
    "target, expected",
    [
        ("llvm", ("llvm", None)),
        ("cpu", ("llvm", None)),
        ("cuda", ("cuda", None)),
        ({"kind": "llvm", "mcpu": "znver3"}, ("llvm", None)),
        ({"kind": "cuda"}, ("cuda", None)),
        ({"kind": "cuda", "arch": "sm_80"}, ("cuda", "sm_80")),
    ],
)
def test_parse_target(target, expected):
    assert parse_target(target) == expected


def test_parse_tvm_target():
    assert parse_target(tvm.target.Target("llvm")) == ("llvm", None)
    assert parse_target(tvm.target.Target({"kind": "cuda", "arch": "sm_86"})) == ("cuda", "sm_86")


@pytest.mark.parametrize("target", ["rocm", "", 7, tvm.target.Target("c")])
def test_parse_target_rejects(target):
    with pytest.raises(ValueError) as err:
        parse_target(target)
    assert str(err.value) == f"target={target!r} is not supported; use 'llvm', 'cuda' or a tvm.target.Target"


@pytest.mark.parametrize(
    "target, words",
    [
        ({"kind": "rocm"}, "needs 'kind' 'llvm' or 'cuda'"),
        ({"arch": "sm_90"}, "needs 'kind'"),
        ({"kind": "cuda", "arch": 90}, "'arch' must be a string"),
    ],
)
def test_parse_target_rejects_dicts(target, words):
    with pytest.raises(ValueError, match=words):
        parse_target(target)


def test_default_cuda_arch(fresh_arch):
    fresh_arch.delenv("TVMKV_CUDA_ARCH", raising=False)
    assert default_cuda_arch() == "sm_90"
    fresh_arch.setenv("TVMKV_CUDA_ARCH", "sm_80")
    assert default_cuda_arch() == "sm_90"  # read once per process
    default_cuda_arch.cache_clear()
    assert default_cuda_arch() == "sm_80"
    assert str(make_target("cuda").attrs["arch"]) == "sm_80"
    assert str(make_target("cuda", "sm_86").attrs["arch"]) == "sm_86"
    fresh_arch.setenv("TVMKV_CUDA_ARCH", "sm_70")
    default_cuda_arch.cache_clear()
    with pytest.raises(ValueError, match="TVMKV_CUDA_ARCH='sm_70' is not supported"):
        default_cuda_arch()
    assert "sm_90" in CUDA_ARCHS


def test_make_target_llvm(monkeypatch):
    monkeypatch.setenv("TVMKV_LLVM_MCPU", "generic")
    assert make_target("llvm").kind.name == "llvm" and "mcpu" not in make_target("llvm").attrs
    monkeypatch.setenv("TVMKV_LLVM_MCPU", "skylake")
    assert str(make_target("llvm").attrs["mcpu"]) == "skylake"
    with pytest.raises(ValueError, match="target kind 'rocm' is not supported"):
        make_target("rocm")


def test_bootstrap(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("TVMKV_PAYLOAD", raising=False)
    assert payload.bootstrap() is None
    monkeypatch.setenv("TVMKV_PAYLOAD", str(tmp_path))
    with pytest.raises(ImportError, match="has no tvm_cuda_runtime.py"):
        payload.bootstrap()
    (tmp_path / "tvm_cuda_runtime.py").write_text("LOADED = True\n")
    monkeypatch.delitem(sys.modules, "tvm_cuda_runtime", raising=False)
    assert payload.bootstrap() == str(tmp_path)
    assert sys.modules["tvm_cuda_runtime"].LOADED and sys.path[0] == str(tmp_path)
    assert payload.bootstrap() == str(tmp_path) and sys.path.count(str(tmp_path)) == 1  # idempotent
    monkeypatch.delitem(sys.modules, "tvm_cuda_runtime")


def test_bootstrap_runs_before_tvm():
    """``import tvmkv`` and the bootstrap must not import tvm themselves (the payload's goes first)."""
    code = (
        "import sys, tvmkv, tvmkv.payload, tvmkv.target, tvmkv.build; "
        "print(sorted(m for m in sys.modules if m == 'tvm' or m.startswith('tvm.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
