# ruff: noqa: F821
# (the split kernel's body is a macro reading the parameters of its signature, tvmkv.tir.attention,
# by name, which ruff cannot see)
"""Paged decode attention: one query token per sequence over its pages. See docs/layout.md
("Split decode" for ``paged_decode_split``)."""

from __future__ import annotations

from tvm.script import tirx as T

from ._kernel_common import LOG2E, macro, rope_inv_freq, slots
from .attention import decode_func
from .attention_generic import build_attention
from .fp8 import kv_scale_buffer, page_value, times_key_scale, times_value_scale
from .spec import KernelSpec

# Named slots of the llvm split kernel's state (see _kernel_common.slots): the sequence's visited keys
# are its slots [0, n1) then [start2, kv_len) (the sink, then the window; all of them without one);
# this chunk visits keys [x0, x1) of them; sink / offset: the window's sink_end and position offset
SPLIT_SEQ = slots("kv_len", "n1", "start2", "sink", "offset", "x0", "x1")
SPLIT_KEY = slots("j", "page")  # the visited key: its slot j in the sequence, its page id
SPLIT_SOFTMAX = slots("s", "m_new", "alpha", "p")  # score, new running max, rescale factor, probability


def make_paged_decode(spec: KernelSpec, *, sliding: bool = False, inline_rope: bool = False, local: bool = False):
    """Attention of one query per sequence over every valid slot of its pages.

    On cuda this is the bandwidth-oriented schedule of :mod:`tvmkv.tir.decode_cuda` (``local``: the
    generic one); on llvm the shared attention builder.

    Parameters (of the returned PrimFunc, in order; layouts in docs/layout.md)
    ----------
    q : [B, H_qo, D] dtype
    q_pos : [B] int32
        Logical position of each query (inline RoPE and ``local``; the query is the sequence's last
        token).
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
    layer_window : int32 (``local`` only)
        The layer's own window ``W``: slot ``j`` is visible only if ``q_pos[b] - pos(j) < W``
        (``W <= 0``: no window). docs/layout.md, "Per-layer sliding window".

    Keyword option ``local``: ``paged_decode_local``, the layer's sliding window with the trailing
    ``layer_window`` parameter (there is no split variant: the runtime does not split local layers).
    """
    if local:
        return build_attention(spec, source="decode", mask="none", sliding=sliding, inline_rope=inline_rope, local=True)
    if spec.target_kind == "cuda":
        from .decode_cuda import make_paged_decode_cuda

        return make_paged_decode_cuda(spec, sliding=sliding, inline_rope=inline_rope)
    return build_attention(spec, source="decode", mask="none", sliding=sliding, inline_rope=inline_rope)


def make_paged_decode_split(spec: KernelSpec, *, sliding: bool = False, inline_rope: bool = False):
    """``paged_decode`` cut along the keys (flash-decoding): one partial state per chunk, merged by
    ``merge_splits`` (:mod:`tvmkv.tir.merge`). ``None`` where the target has no split kernel (cuda
    shapes outside the fast layout of :mod:`tvmkv.tir.decode_layout`).

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


def make_paged_decode_split_merge(spec: KernelSpec, *, sliding: bool = False, inline_rope: bool = False):
    """``paged_decode_split`` and ``merge_splits`` in one launch: the last block to finish a
    (sequence, kv head) merges that group's chunks (cuda, fast decode layout only; ``None`` elsewhere:
    the runtime then launches the two kernels).

    Parameters (of the returned PrimFunc, in order)
    ----------
    q, q_pos, pages, page_indptr, page_indices, last_page_len, kv_window, o_part, lse_part
        As :func:`make_paged_decode_split` (``o_part`` / ``lse_part`` are the kernel's workspace).
    counter : [n] int32, all zero before the launch and left all zero after it
        One arrival count per block group (``n >= B * blocks_per_sequence`` of
        :func:`tvmkv.tir.split_granule`); the merging block resets its entry.
    o : [B, H_qo, D] cache dtype, written
    lse : [B, H_qo] float32, written
        As :func:`make_paged_decode` (what ``merge_splits`` of the partial states writes).
    sm_scale, rope_scale, rope_theta, kv_chunk
        As :func:`make_paged_decode_split`.
    """
    if spec.target_kind != "cuda":
        return None
    from .decode_cuda import make_paged_decode_cuda

    return make_paged_decode_cuda(spec, sliding=sliding, inline_rope=inline_rope, split=True, merge=True)


def make_paged_decode_append(
    spec: KernelSpec,
    *,
    sliding: bool = False,
    inline_rope: bool = False,
    rotate: bool = False,
    split: bool = False,
    small_batch: bool = False,
):
    """A decode step's whole layer in one launch: ``split_rope_append`` folded into ``paged_decode``
    (``split``: into ``paged_decode_split_merge``). cuda with the fast decode layout: 16-bit pages, and
    fp8 pages where the decode runs on the tensor cores (:func:`~tvmkv.tir.decode_layout.tensor_core_layout`);
    ``None`` elsewhere (the runtime then launches
    ``split_rope_append`` and the attention kernel; fp8 pages on the CUDA-core decode: the two launches
    are faster, measured on an H200, bench/RESULTS.md "fp8 pages").

    On the CUDA cores (16-bit pages outside the tensor-core layout): one block per (sequence, kv head)
    stores the new token's k (rotated by its position when ``rotate``: rope mode "normal", as
    ``split_rope`` does) and v at its slot; every block reads q and that new key from ``qkv`` rather than
    from the pages, so no block waits for the store. On the tensor cores (fp8 pages under fp16; fp16 /
    bf16 pages at head_dim 128): each block whose keys reach the new token stores it (fp8: its codes),
    waits for its own stores and copies them back with the other keys.

    Parameters (of the returned PrimFunc, in order)
    ----------
    qkv : [B, H_qo + 2 H_kv, D] cache dtype
        The step's fused q, k, v (docs/layout.md, "Fused qkv"), one token per sequence.
    q_pos, pages, page_indptr, page_indices, last_page_len, kv_window
        As :func:`make_paged_decode`; the page tables already hold the new token (its slot is the
        sequence's last).
    slots : [B] int32
        The new token's slot (``page * P + offset``; negative: not stored).
    o_part, lse_part, counter (``split`` only)
        As :func:`make_paged_decode_split_merge`.
    o, lse, sm_scale, rope_scale, rope_theta, kv_chunk (``split`` only)
        As :func:`make_paged_decode` / :func:`make_paged_decode_split`.

    ``small_batch``: the tensor-core layout for steps whose blocks fill the SMs at most once
    (``decode_layout.TC_SMALL_WARPS`` warps a block; the ``*_small_batch`` kernels); ``None`` where the
    decode does not run on the tensor cores.
    """
    if spec.target_kind != "cuda":
        return None
    layout = {}
    if spec.fp8_pages or small_batch:
        from .decode_layout import TC_SMALL_GROUPS, TC_SMALL_WARPS, decode_layout

        lay = None if sliding or inline_rope else decode_layout(spec)
        if lay is None or not lay["TC"]:
            return None
        if small_batch:
            layout = dict(num_warps=TC_SMALL_WARPS, tc_groups=TC_SMALL_GROUPS)
    from .decode_cuda import make_paged_decode_cuda

    return make_paged_decode_cuda(
        spec, sliding=sliding, inline_rope=inline_rope, split=split, merge=split, append=True, rotate=rotate, **layout
    )


def _cpu_decode_split(spec: KernelSpec, *, sliding: bool, rope: bool):
    H_kv, D, P = spec.num_kv_heads, spec.head_dim, spec.page_size
    group = spec.group
    HALF = D // 2
    LOGP = P.bit_length() - 1
    PMASK = P - 1
    neg_inf = T.float32("-inf")

    scale = kv_scale_buffer(spec)  # fp8 pages (tvmkv.tir.fp8): read as in the generic schedule

    def rotated(buf, row, d, pos, rope_scale, rope_theta):
        # rotate-half RoPE of element d of the row buf[*row, :] (q, or a page row) at position pos, in fp32
        def at(e):
            return T.Cast("float32", buf[(*row, e)]) if buf.dtype == spec.dtype else page_value(spec, buf[(*row, e)])

        ang = T.Cast("float32", pos) * rope_inv_freq(rope_scale, rope_theta, d % HALF, D)
        other = T.if_then_else(d < HALF, -at(T.min(d + HALF, D - 1)), at(T.max(d - HALF, 0)))
        return at(d) * T.cos(ang) + other * T.sin(ang)

    @macro
    def body():
        for it in T.parallel(NSPLIT * B * H_kv):
            # it = (chunk ch, sequence b, kv head hk); the work item keeps the group's query heads
            seq = T.alloc_buffer((len(SPLIT_SEQ),), "int32", scope="local")
            Q = T.alloc_buffer((group, D), "float32", scope="local")  # q * sm_scale * log2(e), rotated
            O = T.alloc_buffer((group, D), "float32", scope="local")
            m = T.alloc_buffer((group,), "float32", scope="local")
            l_sum = T.alloc_buffer((group,), "float32", scope="local")
            Kf = T.alloc_buffer((D,), "float32", scope="local")
            st = T.alloc_buffer((len(SPLIT_SOFTMAX),), "float32", scope="local")
            ks = T.alloc_buffer((len(SPLIT_KEY),), "int32", scope="local")
            ch = T.meta_var(it % NSPLIT)
            b = T.meta_var(it // NSPLIT // H_kv)
            hk = T.meta_var(it // NSPLIT % H_kv)
            seq[SPLIT_SEQ.kv_len] = 0
            if page_indptr[b + 1] > page_indptr[b]:
                seq[SPLIT_SEQ.kv_len] = (page_indptr[b + 1] - page_indptr[b] - 1) * P + last_page_len[b]
            if sliding:  # visited keys: slots [0, n1) then [start2, kv_len)
                seq[SPLIT_SEQ.sink] = kv_window[b, 0]
                seq[SPLIT_SEQ.offset] = kv_window[b, 2]
                seq[SPLIT_SEQ.n1] = T.max(T.min(seq[SPLIT_SEQ.sink], seq[SPLIT_SEQ.kv_len]), 0)
                seq[SPLIT_SEQ.start2] = T.max(kv_window[b, 1], seq[SPLIT_SEQ.n1])
                seq[SPLIT_SEQ.x1] = seq[SPLIT_SEQ.n1] + T.max(seq[SPLIT_SEQ.kv_len] - seq[SPLIT_SEQ.start2], 0)
            else:
                seq[SPLIT_SEQ.n1] = seq[SPLIT_SEQ.kv_len]
                seq[SPLIT_SEQ.start2] = seq[SPLIT_SEQ.kv_len]
                seq[SPLIT_SEQ.sink] = 0
                seq[SPLIT_SEQ.offset] = 0
                seq[SPLIT_SEQ.x1] = seq[SPLIT_SEQ.kv_len]
            seq[SPLIT_SEQ.x0] = ch * kv_chunk
            seq[SPLIT_SEQ.x1] = T.min(seq[SPLIT_SEQ.x1], seq[SPLIT_SEQ.x0] + kv_chunk)
            for g, d in T.grid(group, D):
                if rope:
                    Q[g, d] = rotated(q, (b, hk * group + g), d, q_pos[b], rope_scale, rope_theta) * times_key_scale(
                        sm_scale * T.float32(LOG2E), scale, hk
                    )
                else:
                    Q[g, d] = T.Cast("float32", q[b, hk * group + g, d]) * times_key_scale(
                        sm_scale * T.float32(LOG2E), scale, hk
                    )
                O[g, d] = T.float32(0)
            for g in T.serial(group):
                m[g] = neg_inf
                l_sum[g] = T.float32(0)
            for x in T.serial(T.max(seq[SPLIT_SEQ.x1] - seq[SPLIT_SEQ.x0], 0)):
                ks[SPLIT_KEY.j] = T.if_then_else(
                    seq[SPLIT_SEQ.x0] + x < seq[SPLIT_SEQ.n1],
                    seq[SPLIT_SEQ.x0] + x,
                    seq[SPLIT_SEQ.x0] + x - seq[SPLIT_SEQ.n1] + seq[SPLIT_SEQ.start2],
                )
                ks[SPLIT_KEY.page] = page_indices[page_indptr[b] + (ks[SPLIT_KEY.j] >> LOGP)]
                j = T.meta_var(ks[SPLIT_KEY.j])
                page = T.meta_var(ks[SPLIT_KEY.page])
                for d in T.serial(D):
                    if rope:
                        Kf[d] = rotated(
                            pages,
                            (page, 0, hk, j & PMASK),
                            d,
                            T.if_then_else(j < seq[SPLIT_SEQ.sink], j, j + seq[SPLIT_SEQ.offset]),
                            rope_scale,
                            rope_theta,
                        )
                    else:
                        Kf[d] = page_value(spec, pages[page, 0, hk, j & PMASK, d])
                for g in T.serial(group):
                    st[SPLIT_SOFTMAX.s] = T.float32(0)
                    for d in T.serial(D):
                        st[SPLIT_SOFTMAX.s] = st[SPLIT_SOFTMAX.s] + Q[g, d] * Kf[d]
                    st[SPLIT_SOFTMAX.m_new] = T.max(m[g], st[SPLIT_SOFTMAX.s])
                    st[SPLIT_SOFTMAX.alpha] = T.exp2(m[g] - st[SPLIT_SOFTMAX.m_new])
                    st[SPLIT_SOFTMAX.p] = T.exp2(st[SPLIT_SOFTMAX.s] - st[SPLIT_SOFTMAX.m_new])
                    l_sum[g] = l_sum[g] * st[SPLIT_SOFTMAX.alpha] + st[SPLIT_SOFTMAX.p]
                    for d in T.serial(D):
                        O[g, d] = O[g, d] * st[SPLIT_SOFTMAX.alpha] + st[SPLIT_SOFTMAX.p] * page_value(
                            spec, pages[page, 1, hk, j & PMASK, d]
                        )
                    m[g] = st[SPLIT_SOFTMAX.m_new]
            for g in T.serial(group):
                # no key: l == 0 -> o = 0, lse = -inf
                if l_sum[g] == T.float32(0):
                    for d in T.serial(D):
                        o_part[ch, b, hk * group + g, d] = T.float32(0)
                    lse_part[ch, b, hk * group + g] = neg_inf
                else:
                    for d in T.serial(D):
                        o_part[ch, b, hk * group + g, d] = times_value_scale(O[g, d] / l_sum[g], scale, hk)
                    lse_part[ch, b, hk * group + g] = m[g] + T.log2(l_sum[g])

    return decode_func(spec, body, scale, split=True)
