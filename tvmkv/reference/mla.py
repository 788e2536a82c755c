"""Plain NumPy references of the MLA kernels (:mod:`tvmkv.tir.mla`), fp64 math. See docs/layout.md
("MLA pages", "Page tables", "Sliding window with attention sink", "Outputs and the log-sum-exp").

Written from the definitions, row by row and head by head, for clarity, not speed. Attention
functions return ``(o, lse)`` in float64, ``lse`` in base 2 (``-inf`` and ``o = 0`` for a row that
sees no key); the data-movement functions return new arrays and leave their inputs unchanged.
"""

from __future__ import annotations

import numpy as np


def mla_append_ref(pages: np.ndarray, kv: np.ndarray, slots) -> np.ndarray:
    """``pages`` [num_pages, P, D] after ``mla_append``: row ``i`` of ``kv`` [n, D] at ``slots[i]``
    (page ``slot // P``, offset ``slot % P``); negative slots are skipped."""
    out = pages.copy()
    P = pages.shape[1]
    for i, s in enumerate(np.asarray(slots)):
        if s >= 0:
            out[s // P, s % P] = kv[i]
    return out


def mla_gather_ref(pages: np.ndarray, slots) -> np.ndarray:
    """``[m, D]``: the row at each slot of ``pages`` [num_pages, P, D]; zeros for a negative slot."""
    P, D = pages.shape[1], pages.shape[2]
    slots = np.asarray(slots)
    out = np.zeros((len(slots), D), pages.dtype)
    for e, s in enumerate(slots):
        if s >= 0:
            out[e] = pages[s // P, s % P]
    return out


def mla_copy_page_ref(pages: np.ndarray, src_page: int, dst_page: int, num_slots: int) -> np.ndarray:
    """``pages`` after copying slots ``[0, min(num_slots, P))`` of ``src_page`` onto ``dst_page``."""
    out = pages.copy()
    k = min(int(num_slots), pages.shape[1])
    out[dst_page, :k] = pages[src_page, :k]
    return out


def _softmax_rows(s: np.ndarray, values: np.ndarray):
    """``s`` [L] scores (natural-log units), ``values`` [L, Dv] -> (o [Dv], lse base 2); L == 0: (0, -inf)."""
    if len(s) == 0:
        return np.zeros(values.shape[1]), -np.inf
    mx = s.max()
    p = np.exp(s - mx)
    return (p @ values) / p.sum(), (mx + np.log(p.sum())) / np.log(2.0)


def mla_attention_ref(
    q,
    q_indptr,
    q_pos,
    pages,
    page_indptr,
    page_indices,
    last_page_len,
    kv_window,
    sm_scale: float,
    causal: int,
    latent_dim: int,
    *,
    slot_range=None,
):
    """Reference of ``mla_attention``: q [n, H, D], pages [num_pages, P, D] -> o [n, H, latent_dim], lse [n, H].

    Sequence ``b`` has ``kv_len = (npages - 1) * P + last_page_len[b]`` slots; slot ``j`` is valid iff
    ``j < sink_end or j >= window_start`` and sits at position ``j`` (sink) or ``j + window_pos_offset``;
    with ``causal`` it is visible to row ``i`` iff also ``pos <= q_pos[i]``. Each head scores the whole
    row (``sm_scale * q . row``) and averages the row's first ``latent_dim`` entries.
    ``slot_range=(lo, hi)``: only slots ``lo <= j < hi`` are seen (one chunk of ``mla_attention_split``).
    """
    q = np.asarray(q, np.float64)
    n, H, _ = q.shape
    P = pages.shape[1]
    o = np.zeros((n, H, latent_dim))
    lse = np.full((n, H), -np.inf)
    for b in range(len(q_indptr) - 1):
        ids = page_indices[page_indptr[b] : page_indptr[b + 1]]
        kv_len = 0 if len(ids) == 0 else (len(ids) - 1) * P + int(last_page_len[b])
        rows = np.zeros((kv_len, pages.shape[2]))
        for slot_index in range(kv_len):
            rows[slot_index] = pages[ids[slot_index // P], slot_index % P]
        sink_end, window_start, offset = (int(x) for x in kv_window[b])
        j = np.arange(kv_len)
        valid = (j < sink_end) | (j >= window_start)
        pos = np.where(j < sink_end, j, j + offset)
        for i in range(q_indptr[b], q_indptr[b + 1]):
            visible = valid & (pos <= q_pos[i]) if causal else valid
            if slot_range is not None:
                visible = visible & (j >= slot_range[0]) & (j < slot_range[1])
            keys = rows[visible]
            for h in range(H):
                o[i, h], lse[i, h] = _softmax_rows(sm_scale * (keys @ q[i, h]), keys[:, :latent_dim])
    return o, lse


def mla_attention_split_ref(
    q,
    q_indptr,
    q_pos,
    pages,
    page_indptr,
    page_indices,
    last_page_len,
    kv_window,
    sm_scale: float,
    causal: int,
    latent_dim: int,
    kv_chunk: int,
    num_splits: int,
):
    """Reference of ``mla_attention_split``: chunk ``c`` attends to slots ``[c kv_chunk, (c + 1) kv_chunk)``
    only -> (o_part [S, n, H, latent_dim], lse_part [S, n, H]), ``S = num_splits``."""
    args = (q, q_indptr, q_pos, pages, page_indptr, page_indices, last_page_len, kv_window, sm_scale, causal)
    parts = [
        mla_attention_ref(*args, latent_dim, slot_range=(c * kv_chunk, (c + 1) * kv_chunk)) for c in range(num_splits)
    ]
    return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])


def mla_merge_splits_ref(o_part, lse_part):
    """Reference of ``mla_merge_splits``: the ``S`` states of ``o_part`` [S, n, H, Dm] / ``lse_part``
    [S, n, H] merged one after another with :func:`merge_any_ref` (float64)."""
    o, lse = np.zeros(o_part.shape[1:]), np.full(lse_part.shape[1:], -np.inf)
    for c in range(len(o_part)):
        o, lse = merge_any_ref(o, lse, o_part[c], lse_part[c])
    return o, lse


def ragged_attention_dv_ref(q, k, v, q_indptr, sm_scale: float):
    """Reference of ``ragged_attention_dv``: causal attention of each sequence's rows among themselves.

    q, k [n, H, Dq], v [n, H, Dv2] -> o [n, H, Dv2], lse [n, H]; row ``i`` of sequence ``b`` sees rows
    ``q_indptr[b] .. i``, head ``h`` with k/v head ``h``.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, H, _ = q.shape
    o = np.zeros((n, H, v.shape[2]))
    lse = np.full((n, H), -np.inf)
    for b in range(len(q_indptr) - 1):
        start = int(q_indptr[b])
        for i in range(start, int(q_indptr[b + 1])):
            for h in range(H):
                s = sm_scale * (k[start : i + 1, h] @ q[i, h])
                o[i, h], lse[i, h] = _softmax_rows(s, v[start : i + 1, h])
    return o, lse


def merge_any_ref(o, lse, o2, lse2):
    """Reference of ``merge_any`` (docs/layout.md merge rule, base 2): the merged ``(o, lse)`` in
    float64; a side with ``lse = -inf`` contributes nothing (its ``o`` is ignored, even if NaN), both
    ``-inf`` give ``o = 0``, ``lse = -inf``."""
    o, o2 = np.asarray(o, np.float64), np.asarray(o2, np.float64)
    lse, lse2 = np.asarray(lse, np.float64), np.asarray(lse2, np.float64)
    out_o = np.zeros_like(o)
    out_lse = np.full(lse.shape, -np.inf)
    for idx in np.ndindex(*lse.shape):
        a, b = lse[idx], lse2[idx]
        if a == -np.inf and b == -np.inf:
            continue
        merged = np.logaddexp2(a, b)
        out_lse[idx] = merged
        if a != -np.inf:
            out_o[idx] += o[idx] * 2.0 ** (a - merged)
        if b != -np.inf:
            out_o[idx] += o2[idx] * 2.0 ** (b - merged)
    return out_o, out_lse
