"""Shared fixtures: the ``target`` matrix (llvm always; cuda where a GPU is present, marked ``gpu``)."""

from __future__ import annotations

import numpy as np
import pytest

from tvmkv.payload import bootstrap

bootstrap()  # $TVMKV_PAYLOAD (GPU machine): the runtime-only TVM's CUDA backend, before tvm is imported

import tvm  # noqa: E402


def _has_gpu() -> bool:
    try:
        return tvm.cuda(0).exist
    except Exception:
        return False


HAS_GPU = _has_gpu()
TARGETS = [
    "llvm",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]),
]


@pytest.fixture(params=TARGETS)
def target(request) -> str:
    """Target kind of the kernels under test: "llvm" or "cuda"."""
    return request.param


def device_of(target_kind: str):
    return tvm.cpu(0) if target_kind == "llvm" else tvm.cuda(0)


def to_dev(array: np.ndarray, target_kind: str):
    """NumPy -> tvm.runtime.Tensor on the target's device (bfloat16 goes through ml_dtypes)."""
    return tvm.runtime.tensor(np.ascontiguousarray(array), device_of(target_kind))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def assert_attention_close(o_dev, lse_dev, o_ref, lse_ref, tol: float) -> None:
    """A kernel's output ``o`` and base-2 ``lse`` (device tensors) against the fp64 reference's: rows
    without keys (``lse`` -inf) exactly where the reference has them, the rest within ``tol``."""
    o = o_dev.numpy().astype(np.float64)
    lse = lse_dev.numpy().astype(np.float64)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)), "rows without keys differ"
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=tol, rtol=tol)
    np.testing.assert_allclose(o, o_ref, atol=tol, rtol=tol)


def assert_sm90a_clean(funcs: dict, tmp_path, name: str) -> str:
    """Compile ``{name: PrimFunc}`` for cuda sm_90 and check that nvcc builds the source for sm_90a with
    ptxas reporting no spills in any kernel and no serialized wgmma pipeline (its C7514 note: a
    register of an in-flight wgmma touched before the wait). Returns the CUDA source."""
    import subprocess

    from tvmkv.build import compile_funcs

    src = compile_funcs(funcs, "cuda", "sm_90").mod.imports[0].inspect_source()
    path = tmp_path / f"{name}.cu"
    path.write_text(src)
    cmd = ["nvcc", "--cubin", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v"]
    cmd += ["-diag-suppress=1046,177,550", "-o", str(tmp_path / f"{name}.cubin"), str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    log = done.stdout + done.stderr
    assert "C7514" not in log and "serialized" not in log, log[-3000:]
    assert log.count("0 bytes spill stores, 0 bytes spill loads") == len(funcs), log[-3000:]
    return src


class Tape:
    """Kernel calls, recorded instead of run while ``calls`` is a list of ``(function, args)``: what a
    CUDA graph keeps of a step, so llvm tests can replay a "graph" by re-running the calls."""

    def __init__(self):
        self.calls: list | None = None

    def wrap(self, f):
        def call(*args):
            if self.calls is None:
                return f(*args)
            self.calls.append((f, args))
            return None

        return call


@pytest.fixture
def tape(monkeypatch) -> Tape:
    """A :class:`Tape` every kernel looked up from a kernel library goes through (for the test's life)."""
    from tvmkv.build import KernelLibrary

    t = Tape()
    get = KernelLibrary.__getitem__
    monkeypatch.setattr(KernelLibrary, "__getitem__", lambda lib, name: t.wrap(get(lib, name)))
    return t
