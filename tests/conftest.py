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
