"""Plain NumPy references of the attention kernels (fp64 accumulation). See docs/layout.md.

Each function takes the same arrays as the kernel of the same name (NumPy instead of device
tensors) and returns ``(o, lse)``: ``o`` [rows, H_qo, D] float64, ``lse`` [rows, H_qo] float64 in
base 2 (``-inf`` and ``o = 0`` for a row that sees no key). Written sequence by sequence and row by
row for clarity, not speed. ``layer_window=W > 0`` is the reference of the ``*_local`` kernels
(docs/layout.md, "Per-layer sliding window"); 0, the default, is no window.
"""

from __future__ import annotations

import numpy as np


def rope(x: np.ndarray, pos: np.ndarray, rope_scale: float, rope_theta: float) -> np.ndarray:
    """Rotate-half RoPE of ``x`` [..., tokens, heads, D] at positions ``pos`` [tokens] (float64)."""
    x = np.asarray(x, np.float64)
    D = x.shape[-1]
    half = D // 2
    inv = rope_scale / rope_theta ** (2.0 * np.arange(half) / D)  # [D/2]
    ang = np.asarray(pos, np.float64)[:, None] * inv[None, :]  # [tokens, D/2]
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attend(q_row: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray, sm_scale: float):
    """One query token. q_row [H_qo, D], k/v [L, H_kv, D], visible [L] bool -> (o [H_qo, D], lse [H_qo])."""
    H_qo, D = q_row.shape
    H_kv = k.shape[1]
    group = H_qo // H_kv
    o = np.zeros((H_qo, D))
    lse = np.full(H_qo, -np.inf)
    idx = np.nonzero(visible)[0]
    if len(idx) == 0:
        return o, lse
    for h in range(H_qo):
        kh = k[idx, h // group, :]  # [L', D]
        vh = v[idx, h // group, :]
        s = sm_scale * (kh @ q_row[h])  # natural-log units
        mx = s.max()
        p = np.exp(s - mx)
        o[h] = (p @ vh) / p.sum()
        lse[h] = (mx + np.log(p.sum())) / np.log(2.0)
    return o, lse


def _sequence_kv(pages, page_indptr, page_indices, last_page_len, b):
    """K and V [kv_len, H_kv, D] (float64) of sequence b, slot by slot."""
    P = pages.shape[3]
    ids = page_indices[page_indptr[b] : page_indptr[b + 1]]
    kv_len = 0 if len(ids) == 0 else (len(ids) - 1) * P + int(last_page_len[b])
    k = np.stack([pages[ids[j // P], 0, :, j % P, :] for j in range(kv_len)]) if kv_len else None
    v = np.stack([pages[ids[j // P], 1, :, j % P, :] for j in range(kv_len)]) if kv_len else None
    if kv_len == 0:
        H_kv, D = pages.shape[2], pages.shape[4]
        k = v = np.zeros((0, H_kv, D))
    return np.asarray(k, np.float64), np.asarray(v, np.float64), kv_len


def _window(kv_window, b, kv_len, sliding):
    """(valid [kv_len] bool, logical position [kv_len] int) of sequence b's slots."""
    j = np.arange(kv_len)
    if not sliding:
        return np.ones(kv_len, bool), j
    sink_end, window_start, offset = (int(x) for x in kv_window[b])
    valid = (j < sink_end) | (j >= window_start)
    pos = np.where(j < sink_end, j, j + offset)
    return valid, pos


def paged_prefill(
    q,
    q_indptr,
    q_pos,
    pages,
    page_indptr,
    page_indices,
    last_page_len,
    kv_window,
    q_tree,
    kv_tree_indptr,
    kv_tree,
    kv_tree_start,
    sm_scale,
    rope_scale,
    rope_theta,
    *,
    mask="causal",
    sliding=False,
    inline_rope=False,
    layer_window=0,
):
    """Reference of ``paged_prefill_<mask>``: q [n, H_qo, D], pages [num_pages, 2, H_kv, P, D].
    ``layer_window=W > 0`` (``paged_prefill_causal_local``): slot j is visible only if
    ``q_pos[i] - pos(j) < W``."""
    n, H_qo, D = q.shape
    o = np.zeros((n, H_qo, D))
    lse = np.full((n, H_qo), -np.inf)
    qf = np.asarray(q, np.float64)
    if inline_rope:
        qf = rope(qf, q_pos, rope_scale, rope_theta)
    for b in range(len(q_indptr) - 1):
        k, v, kv_len = _sequence_kv(pages, page_indptr, page_indices, last_page_len, b)
        valid, pos = _window(kv_window, b, kv_len, sliding)
        in_tree = np.zeros(kv_len, bool)
        node = None
        if mask == "tree":
            start = int(kv_tree_start[b])
            node = kv_tree[kv_tree_indptr[b] : kv_tree_indptr[b + 1]]  # [m_b, 3]
            in_tree = np.arange(kv_len) >= start
            pos = pos.copy()
            pos[start:] = node[: kv_len - start, 2]
        if inline_rope:
            k = rope(k, pos, rope_scale, rope_theta)
        for i in range(q_indptr[b], q_indptr[b + 1]):
            if mask == "none":
                visible = valid
            elif mask == "causal":
                visible = valid & (pos <= q_pos[i])
            else:
                enter, exit_ = q_tree[i]
                visible = valid.copy()
                for j in np.nonzero(in_tree)[0]:
                    e, x, _ = node[j - start]
                    visible[j] = e <= enter and exit_ <= x
            if layer_window > 0:
                visible = visible & (q_pos[i] - pos < layer_window)
            o[i], lse[i] = _attend(qf[i], k, v, visible, sm_scale)
    return o, lse


def paged_decode(
    q,
    q_pos,
    pages,
    page_indptr,
    page_indices,
    last_page_len,
    kv_window,
    sm_scale,
    rope_scale,
    rope_theta,
    *,
    sliding=False,
    inline_rope=False,
    layer_window=0,
):
    """Reference of ``paged_decode``: q [B, H_qo, D]; every valid slot is visible (with
    ``layer_window=W > 0``, ``paged_decode_local``: only those with ``q_pos[b] - pos(j) < W``)."""
    B, H_qo, D = q.shape
    o = np.zeros((B, H_qo, D))
    lse = np.full((B, H_qo), -np.inf)
    tables = (page_indptr, page_indices, last_page_len, kv_window)
    rows = _decode_rows(q, q_pos, pages, tables, rope_scale, rope_theta, sliding, inline_rope)
    for b, (q_row, k, v, valid) in enumerate(rows):
        if layer_window > 0:
            _, pos = _window(kv_window, b, len(valid), sliding)
            valid = valid & (q_pos[b] - pos < layer_window)
        o[b], lse[b] = _attend(q_row, k, v, valid, sm_scale)
    return o, lse


def _decode_rows(q, q_pos, pages, tables, rope_scale, rope_theta, sliding, inline_rope):
    """Per decode sequence ``(q row, K, V, valid slots)`` in fp64 (K rotated to its logical positions
    with inline RoPE); ``tables`` = (page_indptr, page_indices, last_page_len, kv_window)."""
    page_indptr, page_indices, last_page_len, kv_window = tables
    qf = np.asarray(q, np.float64)
    if inline_rope:
        qf = rope(qf, q_pos, rope_scale, rope_theta)
    for b in range(q.shape[0]):
        k, v, kv_len = _sequence_kv(pages, page_indptr, page_indices, last_page_len, b)
        valid, pos = _window(kv_window, b, kv_len, sliding)
        if inline_rope:
            k = rope(k, pos, rope_scale, rope_theta)
        yield qf[b], k, v, valid


def paged_decode_split(
    q,
    q_pos,
    pages,
    page_indptr,
    page_indices,
    last_page_len,
    kv_window,
    sm_scale,
    rope_scale,
    rope_theta,
    kv_chunk,
    num_splits,
    *,
    sliding=False,
    inline_rope=False,
):
    """Reference of ``paged_decode_split``: ``(o_part [S, B, H_qo, D], lse_part [S, B, H_qo])``, chunk
    ``c`` attending to the visited keys ``[c * kv_chunk, (c + 1) * kv_chunk)`` (the valid slots in
    slot order)."""
    B, H_qo, D = q.shape
    o = np.zeros((num_splits, B, H_qo, D))
    lse = np.full((num_splits, B, H_qo), -np.inf)
    tables = (page_indptr, page_indices, last_page_len, kv_window)
    rows = _decode_rows(q, q_pos, pages, tables, rope_scale, rope_theta, sliding, inline_rope)
    for b, (q_row, k, v, valid) in enumerate(rows):
        visited = np.nonzero(valid)[0]
        for c in range(num_splits):
            chunk = np.zeros(len(valid), bool)
            chunk[visited[c * kv_chunk : (c + 1) * kv_chunk]] = True
            o[c, b], lse[c, b] = _attend(q_row, k, v, chunk, sm_scale)
    return o, lse


def ragged_prefill(
    q,
    k,
    v,
    q_indptr,
    q_pos,
    q_tree,
    sm_scale,
    rope_scale,
    rope_theta,
    *,
    mask="causal",
    inline_rope=False,
    layer_window=0,
):
    """Reference of ``ragged_prefill_<mask>``: q [n, H_qo, D], k/v [n, H_kv, D] (new tokens only).
    ``layer_window=W > 0`` (``ragged_prefill_causal_local``): row j is visible to row i of the same
    sequence only if ``i - j < W``."""
    n, H_qo, D = q.shape
    o = np.zeros((n, H_qo, D))
    lse = np.full((n, H_qo), -np.inf)
    qf, kf, vf = (np.asarray(x, np.float64) for x in (q, k, v))
    if inline_rope:
        qf = rope(qf, q_pos, rope_scale, rope_theta)
        kf = rope(kf, q_pos, rope_scale, rope_theta)
    for b in range(len(q_indptr) - 1):
        lo, hi = int(q_indptr[b]), int(q_indptr[b + 1])
        for i in range(lo, hi):
            rows = np.arange(lo, hi)
            if mask == "causal":
                visible = rows <= i
            else:
                visible = (q_tree[lo:hi, 0] <= q_tree[i, 0]) & (q_tree[i, 1] <= q_tree[lo:hi, 1])
            if layer_window > 0:
                visible = visible & (i - rows < layer_window)
            o[i], lse[i] = _attend(qf[i], kf[lo:hi], vf[lo:hi], visible, sm_scale)
    return o, lse
