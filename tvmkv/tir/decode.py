"""Paged decode attention: one query token per sequence over its pages. See docs/layout.md."""

from __future__ import annotations

from ._attn_common import build_attention
from .spec import KernelSpec


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
