# ruff: noqa: F821
# (the split kernel's body is a macro naming the buffers of the shared signature, which ruff cannot see)
"""Paged decode attention: one query token per sequence over its pages. See docs/layout.md
("Split decode" for ``paged_decode_split``)."""

from __future__ import annotations

import math

from tvm.script import tirx as T

from ._attn_common import _macro, build_attention, decode_func
from .spec import KernelSpec

LOG2E = math.log2(math.e)


def make_paged_decode(spec: KernelSpec, *, sliding: bool = False, inline_rope: bool = False):
    """Attention of one query per sequence over every valid slot of its pages.

    On cuda this is the bandwidth-oriented schedule of :mod:`tvmkv.tir.decode_cuda`; on llvm the
    shared attention builder.

    Parameters (of the returned PrimFunc, in order; layouts in docs/layout.md)
    ----------
    q : [B, H_qo, D] dtype
    q_pos : [B] int32
        Logical position of each query (inline RoPE only; the query is the sequence's last token).
    pages : [num_pages, 2, H_kv, P, D] dtype
    page_indptr : [B + 1] int32
    page_indices : [nnz] int32
    last_page_len : [B] int32
    kv_window : [B, 3] int32
        (sink_end, window_start, window_pos_offset); read only when ``sliding``.
    o : [B, H_qo, D] dtype, written
    lse : [B, H_qo] float32, written
        Base-2 log-sum-exp; -inf (and o = 0) for a sequence without visible slots.
    sm_scale, rope_scale, rope_theta : float32
    """
    if spec.target_kind == "cuda":
        from .decode_cuda import make_paged_decode_cuda

        return make_paged_decode_cuda(spec, sliding=sliding, inline_rope=inline_rope)
    return build_attention(spec, source="decode", mask="none", sliding=sliding, inline_rope=inline_rope)


def make_paged_decode_split(spec: KernelSpec, *, sliding: bool = False, inline_rope: bool = False):
    """``paged_decode`` cut along the keys (flash-decoding): one partial state per chunk, merged by
    ``merge_splits`` (:mod:`tvmkv.tir.merge`). ``None`` where the target has no split kernel (cuda
    shapes outside the fast layout of :mod:`tvmkv.tir.decode_plan`).

    Chunk ``c`` covers the visited keys ``[c * kv_chunk, (c + 1) * kv_chunk)`` of each sequence, the
    visited keys being its valid slots in slot order (the sink, then the window). On cuda it is the
    kernel of :mod:`tvmkv.tir.decode_cuda`; on llvm a plain key-by-key loop, there so that the
    runtime's split path runs (and is tested) on the CPU too.

    Parameters (of the returned PrimFunc, in order)
    ----------
    q, q_pos, pages, page_indptr, page_indices, last_page_len, kv_window
        As :func:`make_paged_decode`.
    o_part : [num_splits, B, H_qo, D] float32, written
        Each chunk's normalized partial output (0 for a chunk without keys).
    lse_part : [num_splits, B, H_qo] float32, written
        Each chunk's base-2 log-sum-exp (-inf for a chunk without keys).
    sm_scale, rope_scale, rope_theta : float32
    kv_chunk : int32
        Visited keys per chunk (> 0).
    """
    if spec.target_kind == "cuda":
        from .decode_cuda import make_paged_decode_cuda

        return make_paged_decode_cuda(spec, sliding=sliding, inline_rope=inline_rope, split=True)
    return _cpu_decode_split(spec, sliding=bool(sliding), rope=bool(inline_rope))


def _cpu_decode_split(spec: KernelSpec, *, sliding: bool, rope: bool):
    H_kv, D, P = spec.num_kv_heads, spec.head_dim, spec.page_size
    group = spec.group
    HALF = D // 2
    LOGP = P.bit_length() - 1
    PMASK = P - 1
    neg_inf = T.float32("-inf")

    def rotated(buf, row, d, pos, rope_scale, rope_theta):
        # rotate-half RoPE of element d of the row buf[*row, :] at position pos, in fp32
        def at(e):
            return T.Cast("float32", buf[(*row, e)])

        ang = T.Cast("float32", pos) * (
            rope_scale / T.pow(rope_theta, T.Cast("float32", 2 * (d % HALF)) / T.float32(D))
        )
        other = T.if_then_else(d < HALF, -at(T.min(d + HALF, D - 1)), at(T.max(d - HALF, 0)))
        return at(d) * T.cos(ang) + other * T.sin(ang)

    @_macro
    def body():
        for it in T.parallel(NSPLIT * B * H_kv):
            # it = (chunk ch, sequence b, kv head hk); the work item keeps the group's query heads
            seq = T.alloc_buffer((7,), "int32", scope="local")  # kv_len, n1, start2, sink, offset, x0, x1
            Q = T.alloc_buffer((group, D), "float32", scope="local")  # q * sm_scale * log2(e), rotated
            O = T.alloc_buffer((group, D), "float32", scope="local")
            m = T.alloc_buffer((group,), "float32", scope="local")
            l_sum = T.alloc_buffer((group,), "float32", scope="local")
            Kf = T.alloc_buffer((D,), "float32", scope="local")
            st = T.alloc_buffer((4,), "float32", scope="local")  # score, new max, rescale, p
            ks = T.alloc_buffer((2,), "int32", scope="local")  # slot j, key row in the pool
            ch = T.meta_var(it % NSPLIT)
            b = T.meta_var(it // NSPLIT // H_kv)
            hk = T.meta_var(it // NSPLIT % H_kv)
            seq[0] = 0
            if page_indptr[b + 1] > page_indptr[b]:
                seq[0] = (page_indptr[b + 1] - page_indptr[b] - 1) * P + last_page_len[b]
            if sliding:  # visited keys: slots [0, n1) then [start2, kv_len)
                seq[3] = kv_window[b, 0]
                seq[4] = kv_window[b, 2]
                seq[1] = T.max(T.min(seq[3], seq[0]), 0)
                seq[2] = T.max(kv_window[b, 1], seq[1])
                seq[6] = seq[1] + T.max(seq[0] - seq[2], 0)
            else:
                seq[1] = seq[0]
                seq[2] = seq[0]
                seq[3] = 0
                seq[4] = 0
                seq[6] = seq[0]
            seq[5] = ch * kv_chunk
            seq[6] = T.min(seq[6], seq[5] + kv_chunk)
            for g, d in T.grid(group, D):
                if rope:
                    Q[g, d] = rotated(q, (b, hk * group + g), d, q_pos[b], rope_scale, rope_theta) * (
                        sm_scale * T.float32(LOG2E)
                    )
                else:
                    Q[g, d] = T.Cast("float32", q[b, hk * group + g, d]) * (sm_scale * T.float32(LOG2E))
                O[g, d] = T.float32(0)
            for g in T.serial(group):
                m[g] = neg_inf
                l_sum[g] = T.float32(0)
            for x in T.serial(T.max(seq[6] - seq[5], 0)):
                ks[0] = T.if_then_else(seq[5] + x < seq[1], seq[5] + x, seq[5] + x - seq[1] + seq[2])
                ks[1] = page_indices[page_indptr[b] + (ks[0] >> LOGP)]
                for d in T.serial(D):
                    if rope:
                        Kf[d] = rotated(
                            pages,
                            (ks[1], 0, hk, ks[0] & PMASK),
                            d,
                            T.if_then_else(ks[0] < seq[3], ks[0], ks[0] + seq[4]),
                            rope_scale,
                            rope_theta,
                        )
                    else:
                        Kf[d] = T.Cast("float32", pages[ks[1], 0, hk, ks[0] & PMASK, d])
                for g in T.serial(group):
                    st[0] = T.float32(0)
                    for d in T.serial(D):
                        st[0] = st[0] + Q[g, d] * Kf[d]
                    st[1] = T.max(m[g], st[0])
                    st[2] = T.exp2(m[g] - st[1])
                    st[3] = T.exp2(st[0] - st[1])
                    l_sum[g] = l_sum[g] * st[2] + st[3]
                    for d in T.serial(D):
                        O[g, d] = O[g, d] * st[2] + st[3] * T.Cast("float32", pages[ks[1], 1, hk, ks[0] & PMASK, d])
                    m[g] = st[1]
            for g in T.serial(group):
                # no key: l == 0 -> o = 0, lse = -inf
                if l_sum[g] == T.float32(0):
                    for d in T.serial(D):
                        o_part[ch, b, hk * group + g, d] = T.float32(0)
                    lse_part[ch, b, hk * group + g] = neg_inf
                else:
                    for d in T.serial(D):
                        o_part[ch, b, hk * group + g, d] = O[g, d] / l_sum[g]
                    lse_part[ch, b, hk * group + g] = m[g] + T.log2(l_sum[g])

    return decode_func(spec, body, split=True)
