"""Plain NumPy references of the data-movement kernels (append, split_rope, rope_q, merge_state, page ops).

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


def rope_q_ref(
    q: np.ndarray, q_pos: np.ndarray, *, rotate: bool, rope_scale: float = 1.0, rope_theta: float = 1e4
) -> np.ndarray:
    """What ``rope_q`` writes to ``q_out``: ``q [n, H_qo, D]`` rotated at ``q_pos [n]`` (fp64) when
    ``rotate``, else a copy of q (its dtype)."""
    if rotate:
        return rope_ref(q, q_pos, rope_scale, rope_theta)
    return np.array(q, copy=True)


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


def gather_pages_ref(layers, page_ids) -> np.ndarray:
    """Staging rows ``[m, L, 2, H_kv, P, D]`` holding page ``page_ids[i]`` of every layer of ``layers``
    (a list of ``L`` page pools ``[num_pages, 2, H_kv, P, D]``), as ``gather_pages`` called per layer."""
    ids = np.asarray(page_ids, np.int64)
    return np.stack([pool[ids] for pool in layers], axis=1)


def scatter_pages_ref(pages: np.ndarray, page_ids, staging: np.ndarray, layer: int) -> np.ndarray:
    """One layer's pages after ``pages[page_ids[i]] = staging[i, layer]`` (returns a new array)."""
    out = pages.copy()
    for i, p in enumerate(page_ids):
        out[p] = staging[i, layer]
    return out


# ---------------------------------------------------------------------------------------------- interop


def gather_pa_kv_ref(key_cache, value_cache, block_tables, seq_lens, seq_offset=None, is_seq_lens_cumsum=False):
    """Ascend GatherPaKvCache ("Norm" mode): ``(k, v) [N, H_kv, D]`` of the rows of ``block_tables``.

    ``key_cache, value_cache`` are ``[num_blocks, P, H_kv, D]`` (the op's own layout, not tvmkv's);
    token ``j`` of row ``b`` is at block ``block_tables[b, seq_offset[b] // P + j // P]``, offset
    ``j % P``; ``seq_lens`` are lengths, or running sums from 0 when ``is_seq_lens_cumsum``.
    """
    P = key_cache.shape[1]
    lens = np.diff(seq_lens) if is_seq_lens_cumsum else np.asarray(seq_lens)
    k, v = [], []
    for b, n in enumerate(lens):
        start = 0 if seq_offset is None else seq_offset[b] // P
        for j in range(n):
            block = block_tables[b][start + j // P]
            k.append(key_cache[block, j % P])
            v.append(value_cache[block, j % P])
    H, D = key_cache.shape[2:]
    if not k:
        return np.zeros((0, H, D), key_cache.dtype), np.zeros((0, H, D), value_cache.dtype)
    return np.stack(k), np.stack(v)


def export_pages_ref(pages, page_ids, layout, *, num_tokens=None, out=None, block_ids=None):
    """One sequence's pages in a foreign layout (docs/layout.md, "Foreign layouts").

    ``pages`` stacks every layer's pool, ``[L, num_pages, 2, H_kv, P, D]``; the sequence owns
    ``page_ids`` in token order. Paged layouts ("ksana" ``[NB, 2, L, P, H, D]``, "nhd"
    ``[L, NB, 2, P, H, D]``, "hnd" ``[L, NB, 2, H, P, D]``) get whole page ``page_ids[e]`` in block
    ``block_ids[e]`` (default ``e``) of ``out`` (a copy is returned; default a new array of
    ``len(page_ids)`` blocks); "contiguous" returns ``[L, 2, num_tokens, H, D]``.
    """
    L, _, _, H, P, D = pages.shape
    if layout == "contiguous":
        res = np.zeros((L, 2, num_tokens, H, D), pages.dtype)
        for t in range(num_tokens):
            res[:, :, t] = pages[:, page_ids[t // P], :, :, t % P]
        return res
    m = len(page_ids)
    block_ids = range(m) if block_ids is None else block_ids
    if out is None:
        shape = {"ksana": (m, 2, L, P, H, D), "nhd": (L, m, 2, P, H, D), "hnd": (L, m, 2, H, P, D)}[layout]
        res = np.zeros(shape, pages.dtype)
    else:
        res = out.copy()
    for page, block in zip(page_ids, block_ids):
        for layer in range(L):
            for kv in range(2):
                hpd = pages[layer, page, kv]  # [H, P, D]
                if layout == "ksana":
                    res[block, kv, layer] = hpd.transpose(1, 0, 2)
                elif layout == "nhd":
                    res[layer, block, kv] = hpd.transpose(1, 0, 2)
                else:
                    res[layer, block, kv] = hpd
    return res


def import_pages_ref(pages, page_ids, foreign, layout, *, block_ids=None):
    """``pages [L, num_pages, 2, H_kv, P, D]`` after writing a sequence from a foreign layout into
    ``page_ids`` (inverse of :func:`export_pages_ref`; "contiguous" writes only its tokens' slots)."""
    res = pages.copy()
    P = pages.shape[4]
    if layout == "contiguous":
        for t in range(foreign.shape[2]):
            res[:, page_ids[t // P], :, :, t % P] = foreign[:, :, t]
        return res
    block_ids = range(len(page_ids)) if block_ids is None else block_ids
    for page, block in zip(page_ids, block_ids):
        for layer in range(pages.shape[0]):
            for kv in range(2):
                if layout == "ksana":
                    res[layer, page, kv] = foreign[block, kv, layer].transpose(1, 0, 2)
                elif layout == "nhd":
                    res[layer, page, kv] = foreign[layer, block, kv].transpose(1, 0, 2)
                else:
                    res[layer, page, kv] = foreign[layer, block, kv]
    return res


def merge_splits_ref(o_part, lse_part):
    """Merged ``(o [n, H, D], lse [n, H])`` of ``num_splits`` partial states ``o_part`` [S, n, H, D],
    ``lse_part`` [S, n, H] (base-2 LSE, fp64 math): chunks with ``lse = -inf`` are ignored; all of
    them ``-inf`` gives ``o = 0, lse = -inf``."""
    o_part = np.asarray(o_part, np.float64)
    lse_part = np.asarray(lse_part, np.float64)
    S, n, H, D = o_part.shape
    o = np.zeros((n, H, D))
    lse = np.full((n, H), -np.inf)
    for i in range(n):
        for h in range(H):
            live = [c for c in range(S) if lse_part[c, i, h] != -np.inf]
            if not live:
                continue
            lse[i, h] = np.logaddexp2.reduce(lse_part[live, i, h])
            for c in live:
                o[i, h] += o_part[c, i, h] * 2.0 ** (lse_part[c, i, h] - lse[i, h])
    return o, lse
