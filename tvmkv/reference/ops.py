"""Plain NumPy references of the data-movement kernels (append, split_rope, merge_state, page ops).

Written independently of ``tvmkv.tir``: direct loops / slicing over the layout of docs/layout.md,
fp64 math for RoPE and merging. Functions return new arrays (the kernels' in-place arguments are
copied first), so a test can compare a kernel's result against them directly.
"""

from __future__ import annotations

import numpy as np


def append_ref(pages: np.ndarray, k: np.ndarray, v: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """Pages after writing ``k, v [n, H_kv, D]`` at ``slot [n]`` (negative = skip).

    ``pages`` is ``[num_pages, 2, H_kv, P, D]``; returns a new array of the same shape and dtype.
    """
    out = pages.copy()
    P = pages.shape[3]
    for i, s in enumerate(np.asarray(slot)):
        if s < 0:
            continue
        out[s // P, 0, :, s % P, :] = k[i]
        out[s // P, 1, :, s % P, :] = v[i]
    return out


def rope_ref(x: np.ndarray, pos: np.ndarray, rope_scale: float, rope_theta: float) -> np.ndarray:
    """Rotate-half RoPE of ``x [n, H, D]`` at positions ``pos [n]``, in fp64 (returns fp64)."""
    x = np.asarray(x, np.float64)
    D = x.shape[-1]
    half = D // 2
    i = np.arange(half, dtype=np.float64)
    angle = np.asarray(pos, np.float64)[:, None] * rope_scale / rope_theta ** (2.0 * i / D)  # [n, D/2]
    cos = np.cos(angle)[:, None, :]
    sin = np.sin(angle)[:, None, :]
    lo, hi = x[..., :half], x[..., half:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def split_rope_ref(
    qkv: np.ndarray,
    pos: np.ndarray,
    num_qo_heads: int,
    num_kv_heads: int,
    *,
    rotate: bool,
    rope_scale: float = 1.0,
    rope_theta: float = 1e4,
):
    """``(q, k, v)`` split from fused ``qkv [n, H_qo + 2 H_kv, D]``; q and k rotated iff ``rotate``.

    Rotated outputs are fp64; unrotated ones keep ``qkv``'s dtype.
    """
    H_qo, H_kv = num_qo_heads, num_kv_heads
    assert qkv.shape[1] == H_qo + 2 * H_kv
    q = qkv[:, :H_qo].copy()
    k = qkv[:, H_qo : H_qo + H_kv].copy()
    v = qkv[:, H_qo + H_kv :].copy()
    if rotate:
        q = rope_ref(q, pos, rope_scale, rope_theta)
        k = rope_ref(k, pos, rope_scale, rope_theta)
    return q, k, v


def merge_state_ref(o_a, lse_a, o_b, lse_b):
    """Merged ``(o [n, H, D], lse [n, H])`` of two partial states, base-2 LSE, fp64 math.

    A side with ``lse = -inf`` contributes nothing (its ``o`` is ignored); both ``-inf`` gives
    ``o = 0, lse = -inf``. Returns fp64 arrays.
    """
    o_a = np.asarray(o_a, np.float64)
    o_b = np.asarray(o_b, np.float64)
    lse_a = np.asarray(lse_a, np.float64)
    lse_b = np.asarray(lse_b, np.float64)
    n, H, D = o_a.shape
    o = np.zeros((n, H, D))
    lse = np.full((n, H), -np.inf)
    for i in range(n):
        for h in range(H):
            a, b = lse_a[i, h], lse_b[i, h]
            if a == -np.inf and b == -np.inf:
                continue
            if a == -np.inf:
                o[i, h], lse[i, h] = o_b[i, h], b
            elif b == -np.inf:
                o[i, h], lse[i, h] = o_a[i, h], a
            else:
                lse[i, h] = np.logaddexp2(a, b)
                o[i, h] = o_a[i, h] * 2.0 ** (a - lse[i, h]) + o_b[i, h] * 2.0 ** (b - lse[i, h])
    return o, lse


def copy_page_ref(pages: np.ndarray, src_page: int, dst_page: int, num_slots: int) -> np.ndarray:
    """Pages after copying slots ``[0, num_slots)`` of ``src_page`` to ``dst_page`` (K and V, all heads)."""
    out = pages.copy()
    out[dst_page, :, :, :num_slots] = pages[src_page, :, :, :num_slots]
    return out


def compact_copy_ref(pages: np.ndarray, copy_indptr, src_slot, dst_slot) -> np.ndarray:
    """Pages after applying every entry ``dst_slot[e] <- src_slot[e]`` in order, segment by segment."""
    out = pages.copy()
    P = pages.shape[3]
    for s in range(len(copy_indptr) - 1):
        for e in range(copy_indptr[s], copy_indptr[s + 1]):
            src, dst = src_slot[e], dst_slot[e]
            out[dst // P, :, :, dst % P] = out[src // P, :, :, src % P]
    return out


def gather_ref(pages: np.ndarray, slots):
    """``(k [m, H_kv, D], v [m, H_kv, D])`` read at ``slots [m]``; a negative slot gives zeros."""
    _, _, H, P, D = pages.shape
    m = len(slots)
    k = np.zeros((m, H, D), pages.dtype)
    v = np.zeros((m, H, D), pages.dtype)
    for e, s in enumerate(slots):
        if s >= 0:
            k[e] = pages[s // P, 0, :, s % P]
            v[e] = pages[s // P, 1, :, s % P]
    return k, v
