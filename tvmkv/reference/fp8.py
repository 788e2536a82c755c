"""NumPy reference of fp8 pages (docs/layout.md, "fp8 pages"): quantize and dequantize with
per-KV-head scales, and the format's rounding constants that error bounds are made of.

Independent of ``tvmkv.tir.fp8``: the conversions are ``ml_dtypes``' (round to nearest even), with the
saturation the pages use (a value beyond the largest finite one is stored as that value).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FORMATS = ("float8_e4m3fn", "float8_e5m2")


def np_dtype(fmt: str):
    """The ``ml_dtypes`` NumPy dtype of ``fmt``."""
    return np.dtype(getattr(ml_dtypes, fmt))


def largest(fmt: str) -> float:
    """Largest finite value of ``fmt`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(ml_dtypes.finfo(np_dtype(fmt)).max)


def unit_roundoff(fmt: str) -> float:
    """Relative error bound of rounding a value in the normal range: half an ulp, ``2^-(m+1)`` for
    ``m`` mantissa bits (e4m3fn: 2^-4, e5m2: 2^-3)."""
    return float(ml_dtypes.finfo(np_dtype(fmt)).eps) / 2


def subnormal_half_step(fmt: str) -> float:
    """Absolute error bound of rounding a value below the smallest normal: half the subnormal step
    (e4m3fn: 2^-10, e5m2: 2^-17)."""
    return float(ml_dtypes.finfo(np_dtype(fmt)).smallest_subnormal) / 2


def quantize(x: np.ndarray, scale: np.ndarray, fmt: str, head_axis: int = -2) -> np.ndarray:
    """fp8 codes of ``x / scale`` (computed in fp32, as the kernels do) with ``scale [H_kv]`` along
    ``head_axis`` of ``x``; saturating."""
    x = np.asarray(x, np.float32)
    shape = [1] * x.ndim
    shape[head_axis] = -1
    y = x / np.asarray(scale, np.float32).reshape(shape)
    top = largest(fmt)
    return np.clip(y, -top, top).astype(np_dtype(fmt))


def dequantize(codes: np.ndarray, scale: np.ndarray, head_axis: int = -2) -> np.ndarray:
    """fp64 values of fp8 ``codes`` times ``scale [H_kv]`` along ``head_axis``."""
    codes = np.asarray(codes)
    shape = [1] * codes.ndim
    shape[head_axis] = -1
    return codes.astype(np.float64) * np.asarray(scale, np.float64).reshape(shape)


def dequantize_pages(pages: np.ndarray, kv_scale: np.ndarray) -> np.ndarray:
    """fp64 values of fp8 ``pages [num_pages, 2, H_kv, P, D]`` under ``kv_scale [2, H_kv]``."""
    out = np.asarray(pages).astype(np.float64)
    return out * np.asarray(kv_scale, np.float64)[None, :, :, None, None]


def quantize_pages(values: np.ndarray, kv_scale: np.ndarray, fmt: str) -> np.ndarray:
    """fp8 pages holding ``values [num_pages, 2, H_kv, P, D]`` under ``kv_scale [2, H_kv]``."""
    values = np.asarray(values, np.float32)
    scale = np.asarray(kv_scale, np.float32)[None, :, :, None, None]
    top = largest(fmt)
    return np.clip(values / scale, -top, top).astype(np_dtype(fmt))
