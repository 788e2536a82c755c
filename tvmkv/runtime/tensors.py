"""Conversions between the array kinds the cache accepts (NumPy, torch, tvm) and device tensors."""

from __future__ import annotations

import numpy as np

_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32}


def numpy_dtype(dtype: str):
    """NumPy dtype for a tvmkv dtype name (bfloat16 and the fp8 page dtypes through ml_dtypes)."""
    if dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return getattr(ml_dtypes, dtype)
    return _NP_DTYPES[dtype]


def array_kind(x) -> str:
    """ "numpy", "torch" or "tvm" for an accepted array; TypeError for anything else."""
    import tvm

    if isinstance(x, np.ndarray):
        return "numpy"
    if isinstance(x, tvm.runtime.Tensor):
        return "tvm"
    if type(x).__module__.startswith("torch") and hasattr(x, "__dlpack__"):
        return "torch"
    raise TypeError(
        f"expected a numpy.ndarray, torch.Tensor or tvm.runtime.Tensor, got {type(x).__name__}; "
        "convert the array to one of those kinds"
    )


def torch_module():
    """``torch`` (imported only once a caller has passed a torch tensor)."""
    import torch

    return torch


def device_name(device) -> str:
    """ "cpu" or "cuda:N" for a ``tvm.runtime.Device``."""
    return "cpu" if device.dlpack_device_type() == 1 else f"cuda:{device.index}"


def describe(x, kind: str):
    """(shape, dtype name, device "cpu" / "cuda:N") of an accepted array."""
    if kind == "numpy":
        return tuple(x.shape), str(x.dtype), "cpu"
    if kind == "torch":
        dev = "cpu" if x.device.type == "cpu" else f"{x.device.type}:{x.device.index}"
        return tuple(x.shape), str(x.dtype).removeprefix("torch."), dev
    return tuple(x.shape), str(x.dtype), device_name(x.device)


def is_contiguous(x, kind: str) -> bool:
    if kind == "numpy":
        return bool(x.flags.c_contiguous)
    if kind == "torch":
        return bool(x.is_contiguous())
    return bool(x.is_contiguous())


def overlaps(a, b, a_bytes: int, b_bytes: int) -> bool:
    """Whether the device tensors ``a`` and ``b`` (tvm or torch, contiguous, ``a_bytes`` and ``b_bytes``
    long) share memory."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b_bytes and b0 < a0 + a_bytes


# the kernels' buffers assume this alignment of their data (TVM's default; vector loads rely on it)
ALIGN = 64


def aligned_copy(t):
    """A fresh (aligned) tvm tensor on ``t``'s device holding ``t``'s data: for tvm tensors whose data is
    not :data:`ALIGN`-byte aligned (a NumPy array handed to a TVM global function arrives as one, zero-copy),
    which the kernels must not read or write in place."""
    import tvm

    out = tvm.runtime.empty(tuple(t.shape), t.dtype, t.device)
    out.copyfrom(t)
    return out


def to_device(x, kind: str, device):
    """A ``tvm.runtime.Tensor`` on ``device`` holding ``x`` (zero-copy for torch/tvm when possible).

    TVM's DLPack import rejects data not aligned to 64 bytes; such torch tensors are cloned first
    (a torch allocation is aligned), and such tvm tensors copied (:func:`aligned_copy`).
    """
    import tvm

    if kind == "tvm":
        return x if x.data_ptr() % ALIGN == 0 else aligned_copy(x)
    if kind == "numpy":
        return tvm.runtime.tensor(np.ascontiguousarray(x), device)
    try:
        return tvm.runtime.from_dlpack(x)
    except RuntimeError as err:
        if "aligned" not in str(err):
            raise
        return tvm.runtime.from_dlpack(x.clone())


def from_device(t, kind: str):
    """Give a result tensor back as the caller's kind."""
    if kind == "tvm":
        return t
    if kind == "numpy":
        return t.numpy()
    import torch

    return torch.from_dlpack(t)
