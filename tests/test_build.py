"""The build cache: artifact names, manifests, cache hits, staleness, the CLI and CUDA fatbin libraries.

CPU only (no GPU needed); the CUDA part needs nvcc and is skipped without it. Cache logic runs on a
one-kernel set (monkeypatched ``kernel_set``) to stay fast; the CLI tests build the full set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tvmkv.tir as tir
from tvmkv import build
from tvmkv.build import BuildKey, KernelSpec

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16")
HAS_NVCC = True
try:
    build.find_nvcc()
except build.NvccNotFoundError:
    HAS_NVCC = False


def _tiny_kernel_set(spec, *, rope_mode="none", sliding=False, local=False, arch=None):
    """One real kernel, so cache tests compile in about a second."""
    from tvmkv.tir import page_ops

    return {"copy_page": page_ops.make_copy_page(spec)}


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A fresh build dir, an empty in-process cache and the one-kernel set."""
    monkeypatch.setattr(tir, "kernel_set", _tiny_kernel_set)
    monkeypatch.delenv("TVM_USE_RUNTIME_LIB", raising=False)
    build.clear_loaded()
    yield tmp_path
    build.clear_loaded()


def _spec(target="llvm"):
    return KernelSpec(**SMALL, target_kind=target)


def _counts():
    return dict(build.STATS)


def _delta(before):
    return {k: build.STATS[k] - before[k] for k in before}


def test_names_are_deterministic_and_readable():
    key = BuildKey(_spec())
    assert key.name == "kvcache_q4_kv2_d64_p16_float16" and key.target_dir == "llvm"
    assert BuildKey(_spec(), "inline", True).name == "kvcache_q4_kv2_d64_p16_float16_rope-inline_sw"
    cuda = BuildKey(_spec("cuda"), "normal", False, "sm_80")
    assert cuda.target_dir == "cuda-sm_80" and cuda.name == "kvcache_q4_kv2_d64_p16_float16_rope-normal"
    assert BuildKey(_spec()) == BuildKey(_spec()) and hash(BuildKey(_spec())) == hash(BuildKey(_spec()))


def test_local_kernel_sets_have_their_own_name_and_manifest(tiny):
    """``local`` (the per-layer sliding window kernels) keys a library of its own; without it the
    names stay as they were."""
    key = BuildKey(_spec(), "inline", True, local=True)
    assert key.name == "kvcache_q4_kv2_d64_p16_float16_rope-inline_sw_local"
    assert key != BuildKey(_spec(), "inline", True) and not BuildKey(_spec()).local
    lib = build.load_kernels(_spec(), rope_mode="inline", sliding=True, local=True, build_dir=tiny)
    assert lib.key == key and lib.path.name == f"{key.name}.so"
    assert build.load_kernels(_spec(), build_dir=tiny).key.name == "kvcache_q4_kv2_d64_p16_float16"
    assert json.loads(lib.path.with_suffix(".json").read_text())["local"] is True
    keys = build.expand_configs([{"local": [False, True]}], dict(SMALL, rope_mode="none", sliding=False, target="llvm"))
    assert [k.local for k in keys] == [False, True]
    assert build.arg_parser().parse_args(["--local"]).local


def test_local_kernel_set_names_and_signatures():
    """``kernel_set(local=True)`` adds the three *_local kernels, each with its base kernel's
    parameters plus a trailing int32 ``layer_window``; rope_q is in every set."""
    spec = _spec()
    base = tir.kernel_set(spec)
    local = tir.kernel_set(spec, local=True)
    assert "rope_q" in base and not any(name.endswith("_local") for name in base)
    assert set(local) - set(base) == {"paged_prefill_causal_local", "ragged_prefill_causal_local", "paged_decode_local"}
    for name in ("paged_prefill_causal", "ragged_prefill_causal", "paged_decode"):
        params = [p.name for p in local[f"{name}_local"].params]
        assert params == [p.name for p in base[name].params] + ["layer_window"]
        assert str(local[f"{name}_local"].params[-1].ty) == "int32"
    assert [p.name for p in base["rope_q"].params] == ["q", "q_pos", "q_out", "rope_scale", "rope_theta"]


def test_second_load_is_a_cache_hit(tiny):
    before = _counts()
    lib = build.load_kernels(_spec(), build_dir=tiny)
    assert _delta(before)["compiles"] == 1 and _delta(before)["disk_loads"] == 1
    assert lib.path == tiny / "llvm" / "kvcache_q4_kv2_d64_p16_float16.so" and "copy_page" in lib
    assert build.load_kernels(_spec(), build_dir=tiny) is lib  # in-process hit
    assert _delta(before)["memory_hits"] == 1 and _delta(before)["compiles"] == 1
    build.clear_loaded()  # a cleared cache reads the artifact from disk, no compiling
    lib2 = build.load_kernels(_spec(), build_dir=tiny)
    assert lib2 is not lib and _delta(before)["compiles"] == 1 and _delta(before)["disk_loads"] == 2


def test_fresh_process_loads_without_compiling(tiny):
    build.build_kernel_set(BuildKey(_spec()), tiny)
    code = (
        "import json; from tvmkv import build; import tvmkv.tir as t; "
        "t.kernel_set = lambda *a, **k: (_ for _ in ()).throw(AssertionError('recompiled')); "
        f"spec = build.KernelSpec(**{SMALL!r}, target_kind='llvm'); "
        f"lib = build.load_kernels(spec, build_dir={str(tiny)!r}); "
        "print(json.dumps(build.STATS))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["compiles"] == 0 and stats["disk_loads"] == 1


def test_manifests_record_config_target_version_kernels_hashes(tiny):
    import tvm

    key = BuildKey(_spec(), "inline", True)
    path = build.build_kernel_set(key, tiny)
    entry = json.loads(path.with_suffix(".json").read_text())
    assert entry["config"] == {**SMALL, "target_kind": "llvm", "kv_dtype": ""}
    assert (entry["rope_mode"], entry["sliding"], entry["target"]) == ("inline", True, "llvm")
    assert entry["tvm_version"] == tvm.__version__ and entry["kernels"] == ["copy_page"]
    assert entry["sources_hash"] == build.sources_hash() and len(entry["sha256"]) == 64
    assert entry["library"] == path.name and entry["nbytes"] == path.stat().st_size
    top = json.loads((tiny / "llvm" / "manifest.json").read_text())
    assert top["target"] == "llvm" and top["tvm_version"] == tvm.__version__
    assert [a["name"] for a in top["artifacts"]] == [key.name] and top["artifacts"][0] == entry


def test_stale_sources_hash_triggers_rebuild(tiny):
    key = BuildKey(_spec())
    path = build.build_kernel_set(key, tiny)
    man = path.with_suffix(".json")
    before = _counts()
    assert build.build_kernel_set(key, tiny) == path and _delta(before)["compiles"] == 0
    man.write_text(man.read_text().replace(build.sources_hash(), "0000stale0000000"))
    build.build_kernel_set(key, tiny)
    assert _delta(before)["compiles"] == 1
    assert json.loads(man.read_text())["sources_hash"] == build.sources_hash()
    build.build_kernel_set(key, tiny, force=True)
    assert _delta(before)["compiles"] == 2


def test_runtime_only_trusts_carried_artifacts(tiny, monkeypatch):
    key = BuildKey(_spec())
    path = build.build_kernel_set(key, tiny)
    man = path.with_suffix(".json")
    man.write_text(man.read_text().replace(build.sources_hash(), "0000stale0000000"))
    monkeypatch.setenv("TVM_USE_RUNTIME_LIB", "1")
    before = _counts()
    assert build.build_kernel_set(key, tiny) == path and _delta(before)["compiles"] == 0
    with pytest.raises(RuntimeError, match="runtime-only"):
        build.build_kernel_set(BuildKey(_spec(), "normal"), tiny)


def test_runtime_imports_no_compiler():
    """The runtime (the cache and everything it imports) must load on a runtime-only TVM, which has no
    TVMScript: importing it must not import ``tvm.script`` nor any kernel module (a kernel constant the
    runtime needs lives in a plain ``*_layout`` module)."""
    code = (
        "import sys, tvmkv, tvmkv.runtime.cache, tvmkv.runtime.graphs; "
        "bad = sorted(m for m in sys.modules if m.startswith(('tvm.script', 'tvm.tirx.lang')) "
        "or m.startswith('tvmkv.tir.') and not m.endswith(('_layout', '.spec', '.foreign_layouts', '.rope_scaling'))); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dir_manifest_stays_consistent_with_concurrent_writers(tmp_path):
    target_dir = tmp_path / "llvm"
    target_dir.mkdir()
    names = [f"kvcache_fake{i}" for i in range(8)]

    def writer(name):
        (target_dir / f"{name}.so").write_bytes(b"x")
        (target_dir / f"{name}.json").write_text(json.dumps({"name": name, "library": f"{name}.so"}))
        build.write_dir_manifest(target_dir)

    threads = [threading.Thread(target=writer, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    top = json.loads((target_dir / "manifest.json").read_text())
    assert [a["name"] for a in top["artifacts"]] == sorted(names)


def test_concurrent_builds_of_one_library_compile_it_once(tiny, monkeypatch):
    """Processes or threads that want the same library at once (pytest workers, servers started
    together) take turns on its lock: one compiles, the others load what it wrote."""
    calls = []

    def slow_kernel_set(spec, **kw):
        calls.append(spec)
        time.sleep(1.0)  # every other builder is waiting by now
        return _tiny_kernel_set(spec, **kw)

    monkeypatch.setattr(tir, "kernel_set", slow_kernel_set)
    key, paths = BuildKey(_spec()), []
    threads = [threading.Thread(target=lambda: paths.append(build.build_kernel_set(key, tiny))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1, f"{len(calls)} compiles of one library"
    assert len(paths) == 3 and len(set(paths)) == 1 and paths[0].is_file()
    top = json.loads((tiny / "llvm" / "manifest.json").read_text())
    assert [a["name"] for a in top["artifacts"]] == [key.name]


def test_config_file_expansion_and_errors():
    defaults = dict(SMALL, rope_mode="none", sliding=False, target="cuda", arch="sm_90")
    keys = build.expand_configs([{"dtype": ["float16", "float32"], "rope_mode": ["none", "inline"]}], defaults)
    assert len(keys) == 4 and {k.arch for k in keys} == {"sm_90"}
    assert len(build.expand_configs([{}, {}], defaults)) == 1  # duplicates removed
    with pytest.raises(ValueError, match="unknown keys"):
        build.expand_configs([{"head_dims": 64}], defaults)
    with pytest.raises(ValueError, match="rope_mode"):
        build.expand_configs([{"rope_mode": "yarn"}], defaults)
    mla = build.expand_configs(
        [
            {
                "family": "mla",
                "num_qo_heads": 8,
                "kv_lora_rank": 32,
                "qk_rope_head_dim": 16,
                "self_qk_dim": 32,
                "self_v_dim": 16,
            }
        ],
        defaults,
    )
    assert [k.name for k in mla] == [f"mla_h8_c32_r16_p{SMALL['page_size']}_{SMALL['dtype']}_s32x16"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        build.expand_configs([{"family": "mla"}], defaults)
    with pytest.raises(ValueError, match="arch"):
        build.gencode_flags("sm_70")
    assert build.gencode_flags("sm_90") == ["-gencode=arch=compute_90a,code=sm_90a"]


def test_imports_blob_round_trip():
    tree = (3).to_bytes(8, "little") + bytes(8) + (1).to_bytes(8, "little") * 2
    tree += (1).to_bytes(8, "little") * 2
    table = (1).to_bytes(8, "little") + build.pack_str(b"k") + build.pack_str(b"k")  # {k: FunctionInfo}
    table += (1).to_bytes(8, "little") + bytes([3, 64, 1, 0])  # arg_types: one handle
    table += (1).to_bytes(8, "little") + build.pack_str(b"threadIdx.x") + (1).to_bytes(8, "little") + bytes(4)
    cuda = build.pack_str(b"fatbin") + table + build.pack_str(b"\xba\x55payload" + bytes(16))
    modules = [("_lib", None), ("cuda", cuda)]
    blob = build.pack_imports_blob(tree, modules)
    assert build.parse_imports_blob(blob) == (tree, modules)
    assert build.split_cuda_module_bytes(cuda) == ("fatbin", table, b"\xba\x55payload" + bytes(16))


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "tvmkv", "build", *args], cwd=ROOT, capture_output=True, text=True, env=env
    )


def test_cli_rejects_bad_config_with_a_named_error(tmp_path):
    bad = _cli("--target", "llvm", "--dtype", "int8", "--build-dir", str(tmp_path))
    assert bad.returncode == 2 and "dtype='int8'" in bad.stderr
    bad = _cli("--target", "cuda", "--arch", "sm_70", "--build-dir", str(tmp_path))
    assert bad.returncode == 2 and "arch='sm_70'" in bad.stderr


@pytest.mark.skipif(not HAS_NVCC, reason="nvcc not found: CUDA libraries would keep source")
def test_cli_cuda_sm80_sm90_builds_fatbins(tmp_path):
    """Every kernel's CUDA source compiles with nvcc for sm_80 and sm_90a; the libraries carry fatbins."""
    config = tmp_path / "configs.json"
    config.write_text(json.dumps([dict(SMALL)]))
    env = dict(os.environ, TVMKV_NVCC_CACHE=str(tmp_path / "nvcc"))  # really run nvcc, no cached fatbins
    out = _cli(
        "--target",
        "cuda",
        "--arch",
        "sm_80,sm_90",
        "--config",
        str(config),
        "-j",
        "2",
        "--build-dir",
        str(tmp_path),
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for arch in ("sm_80", "sm_90"):
        lib = tmp_path / f"cuda-{arch}" / "kvcache_q4_kv2_d64_p16_float16.so"
        mods = build.inspect_library(lib)
        assert [m["kind"] for m in mods] == ["_lib", "cuda"] and mods[1]["format"] == "fatbin", mods
        fatbin = build.extract_fatbin(lib)
        assert fatbin[:4] == b"\x50\xed\x55\xba"  # fatbin magic 0xBA55ED50
        entry = json.loads(lib.with_suffix(".json").read_text())
        assert entry["device_format"] == "fatbin" and entry["arch"] == arch
        top = json.loads((tmp_path / f"cuda-{arch}" / "manifest.json").read_text())
        assert [a["name"] for a in top["artifacts"]] == ["kvcache_q4_kv2_d64_p16_float16"]
    again = _cli("--target", "cuda", "--arch", "sm_90", "--config", str(config), "--build-dir", str(tmp_path))
    assert again.returncode == 0 and "cache hit" in again.stdout and "1 kernel set(s)" in again.stdout
    sm90_flags = json.loads((tmp_path / "cuda-sm_90" / "kvcache_q4_kv2_d64_p16_float16.json").read_text())
    assert "-gencode=arch=compute_90a,code=sm_90a" in sm90_flags["nvcc_flags"]


def test_default_build_dir(tmp_path, monkeypatch):
    """$TVMKV_BUILD_DIR wins; else a source checkout's build/; else the per-user cache (never site-packages)."""
    checkout, site = tmp_path / "clone", tmp_path / "site-packages"
    for root in (checkout, site):
        (root / "tvmkv").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text('[project]\nname = "tvmkv"\n')
    monkeypatch.delenv("TVMKV_BUILD_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.default_build_dir(checkout / "tvmkv") == checkout / "build"
    assert build.default_build_dir(site / "tvmkv") == tmp_path / "xdg" / "tvmkv"
    (site / "pyproject.toml").write_text('[project]\nname = "another"\n')  # not tvmkv's checkout
    assert build.default_build_dir(site / "tvmkv") == tmp_path / "xdg" / "tvmkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.default_build_dir(site / "tvmkv") == tmp_path / "home" / ".cache" / "tvmkv"
    assert build.default_build_dir() == ROOT / "build"  # the tests run from a checkout
    monkeypatch.setenv("TVMKV_BUILD_DIR", str(tmp_path / "mine"))
    assert build.default_build_dir(checkout / "tvmkv") == tmp_path / "mine"
    assert build.default_build_dir() == tmp_path / "mine"
    assert "TVMKV_BUILD_DIR" in build.arg_parser().format_help()


@pytest.mark.parametrize("target", ["llvm", "cuda"])
def test_every_kernel_states_its_noalias_choice(target):
    """Every kernel of both families sets the no-alias attribute explicitly under the key TVM 0.27
    reads (the pre-0.27 "tir.noalias" is ignored silently): True on cuda, False on llvm (see
    tvmkv.tir._kernel_common.func_attrs)."""
    from tvmkv.tir import interop
    from tvmkv.tir._kernel_common import NOALIAS

    spec = _spec(target)
    funcs = {**tir.kernel_set(spec, rope_mode="inline", sliding=True), **interop.kernel_set(spec)}
    for name, func in funcs.items():
        attrs = dict(func.attrs)
        assert NOALIAS == "tirx.noalias" and "tir.noalias" not in attrs, f"{name}: {attrs}"
        assert NOALIAS in attrs and bool(attrs[NOALIAS]) == (target == "cuda"), f"{name}: {attrs}"


def test_noalias_key_reaches_the_llvm_ir():
    """The key the kernels use is the one TVM's codegen reads: with it set, the compiled kernel's
    pointer arguments are noalias in the LLVM IR; as built for llvm (False) they are not."""
    from tvmkv.tir import page_ops
    from tvmkv.tir._kernel_common import NOALIAS

    gather = page_ops.make_gather(_spec())

    def llvm_ir(func):
        module = build.compile_funcs({"gather": func}, "llvm")
        return (module.mod if hasattr(module, "mod") else module).inspect_source("ll")

    assert "ptr noalias" in llvm_ir(gather.with_attr(NOALIAS, True))
    assert "ptr noalias" not in llvm_ir(gather)
