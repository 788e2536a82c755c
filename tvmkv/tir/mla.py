# ruff: noqa: F821, F841
# (each signature binds the buffers its body macros read by name, which ruff cannot see)
"""Kernels of MLA caches (multi-head latent attention, DeepSeek-V2). See docs/layout.md ("MLA pages").

An MLA layer stores one vector of ``D = D_v + D_r`` per token: the compressed latent (``D_v``,
kv_lora_rank) followed by the rotated key part (``D_r``); ``pages: [num_pages, P, D]``, slots as for
MHA (``slot = page_id * P + offset``). Kernels (TVM's names in parentheses):

* ``mla_append`` (``kv_cache_transpose_append_mla``), ``mla_gather`` (``debug_get_kv_mla``),
  ``mla_copy_page`` (``copy_single_page_mla``): data movement.
* ``mla_attention`` (absorbed attention, TVM's MLA "cross attention"): every head of a query row
  scores the whole stored row (``s_j = sm_scale * q . row_j``, all ``D`` dims) and averages its first
  ``D_v`` dims (V is the latent). The page tables and ``kv_window`` are those of the MHA paged kernels;
  ``causal`` is a runtime flag.
* ``ragged_attention_dv``: the prefill's non-absorbed causal self attention among the new tokens,
  with q/k head dim ``Dq`` and v head dim ``Dv2`` (DeepSeek-V2: 192 and 128).
* ``merge_any``: TVM's ``merge_attn_output_inplace``, with every size symbolic.

Schedules. llvm: ``T.parallel`` over work items; a key row is converted to fp32 once and used by all
heads of the item. cuda ``mla_attention``, fp16 / bf16 with heads a multiple of 16 and ``D_v`` a
multiple of 64 (:func:`use_tensor_cores`): tensor cores (``mma.sync.m16n8k16``, fp32 accumulation),
one block per (query row, up to ``TC_MAX_HEADS`` = 64 heads), P kept in registers, see the comment
above ``gpu_tc_body`` (docs/layout.md, "MLA kernels"); on an H200 at DeepSeek-V2's shape (H 128, fp16,
bench/gpu_mla_kernels.py) decode 64 x 4096 787 -> 476 us, 128 x 2048 799 -> 488 us (16-head blocks
before; torch bmm 505 / 482 us). Built for sm_90, the tensor-core shapes with ``D`` a multiple of 64
take the warpgroup-MMA schedule of :mod:`tvmkv.tir.mla_hopper` instead (its ``make_body``, with this
module's row / key-range macros; at H 128 311 us, at H 16 128 x 2048 83 us). The SIMT schedule serves
every other shape: one thread block per (query row, ``HB`` heads); each tile
of ``TK = 32`` latent rows is copied into shared memory once (``cp.async``, double buffered: tile
``t + 1`` is in flight while tile ``t`` is used; rows padded so lane-per-key reads are conflict-free)
and read by all ``HB`` heads: warp ``w`` owns ``HPW`` heads, lane ``c`` scores key ``c`` for each of
them (register blocking over the heads), then the lanes spread over ``D_v`` and accumulate ``P V``
for the warp's heads. fp32 accumulation throughout; SIMT only (no tensor cores), and no split over
the keys, so a decode of few sequences runs ``B * H / HB`` blocks. cuda ``ragged_attention_dv``, fp16 /
bf16 (:func:`ragged_dv_tensor_cores`): a FlashAttention-2 style tensor-core forward (block = 64 query
rows of one sequence and head, 64-key K/V tiles double buffered by ``cp.async``; see the comment above
its ``gpu_tc_body``), on an H200 at H 128, 1x4096, fp16 2.18 ms (SIMT 892 ms, TVM's ragged kernel
105 ms, torch SDPA 1.18 ms); the SIMT fallback (fp32, larger head dims): one warp per (row, head),
lane-per-key scores, then lanes over ``Dv2``.
"""

from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from . import mla_hopper
from ._kernel_common import LOG2E, MAX_THREADS, NOALIAS, WARP, macro
from ._kernel_common import slots as state_slots
from .mla_layout import (
    GPU_HEADS,
    QS_BYTES,
    TC_STAGES,
    TK,
    WG_KEYS,
    WG_PRODUCER,
    WG_SMEM_LIMIT,
    WG_STAGES,
    WG_TILE_KEYS,
    WG_TMA,
    divisor_at_most,
    tc_head_tiles,
    tc_shared_words,
    use_tensor_cores,
    wgmma_heads,
)
from .page_ops import make_copy_page_layers
from .prefill_cuda import CVT as RDV_CVT
from .prefill_cuda import lane_kmajor_b, lane_rowmajor16, load_rc, tile_start
from .spec import MlaSpec, dtype_bytes

NEG_INF = float("-inf")
CPU_VL = 8  # vector lanes of the CPU dot products (D is a multiple of 16)
CPU_HEADS = 16  # heads per CPU work item (they share every key row)
GPU_WARPS = 4  # warps per CUDA thread block of mla_attention
KVEC = 4  # elements per vector load of a latent tile (8 bytes of fp16 / bf16, 16 of fp32)
KPAD = 4  # padding elements per shared latent row: lane-per-key reads hit distinct banks
CP16 = "cp.async.cg.shared.global"
LDSM = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
LDSM2 = "ldmatrix.sync.aligned.m8n8.x2.shared.b16"
LDSM_T = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
MMA = {
    "float16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    "bfloat16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
}
CVT = {"float16": "cvt.rn.f16x2.f32", "bfloat16": "cvt.rn.bf16x2.f32"}  # two fp32 -> one packed register
SMEM_BYTES = 200 * 1024  # double-buffer the latent tiles when both fit in this much shared memory
MERGE_ROWS = 8  # (row, head) pairs per CUDA block of merge_any (one warp each)
MERGE_THREADS = 128  # threads per (row, head) of cuda mla_merge_splits (over its Dm elements)
MERGE_UNROLL = 8  # chunks per step of cuda mla_merge_splits (independent loads in flight per thread)

SEQ = state_slots("b", "lo", "hi")  # a row's sequence b; lo, hi: bounds of its binary search
# keys of a query row: kv_len, base (first page entry), window (sink_end, window_start, offset), the scan
# [start, end) (split: the chunk's part of it), and the slot and position of the key at hand
KEYS = state_slots("kv_len", "base", "sink_end", "window_start", "window_offset", "end", "slot", "pos", "start")
SOFT = state_slots("s", "m_new", "alpha", "p")  # one score's online-softmax update
MERGE = state_slots("la", "lb", "wa", "wb", "lse")  # merge_any: inputs, weights, merged lse
# tensor-core ragged_attention_dv: keys per K/V tile, default warps per block (16 query rows each), and the
# cap on the registers a thread holds across the key loop for its Q fragments and O accumulators
# (Dq / 4 + Dv2 / 2: DeepSeek-V2's 192 / 128 is 112; larger shapes take the SIMT schedule)
RDV_BC = 64
RDV_WARPS = 4
RDV_REGS = 112
# default block order (head_major=None): head-major from this many heads on. Measured on an H200 (fp16,
# 192 / 128): H 128 1x4096 2.59 -> 2.18 ms head-major (K/V tiles shared in L2), 4x1024 equal; H 16
# 1x4096 282 -> 336 us and 4x1024 89 -> 105 us (few waves: the global heaviest-tile-first order of
# head-minor balances better)
RDV_HEAD_MAJOR_MIN = 64
# the block's scalars: its sequence b, tile lt within the sequence, first token t0 and token count ntok,
# the sequence's first row qbase and tile count ntile, keys to scan klen (t0 - qbase + ntok) and their
# tiles nkt, lo / hi of the binary search for b
RDV = state_slots("b", "lt", "t0", "ntok", "qbase", "ntile", "klen", "nkt", "lo", "hi")


def _attrs(spec: MlaSpec) -> dict:
    """Function attributes: the no-alias promise on cuda only (as ``_kernel_common.func_attrs``)."""
    return {NOALIAS: not spec.is_cpu}


def _row_threads(D: int) -> tuple:
    """CUDA ``(threads, rounds)`` of a data-movement kernel that copies rows of ``D`` elements: one
    block per row, ``threadIdx.x`` over the row in ``rounds`` passes."""
    threads = min(MAX_THREADS, (D + WARP - 1) // WARP * WARP)
    return threads, (D + threads - 1) // threads


# ---------------------------------------------------------------------------------------------------
# data movement
# ---------------------------------------------------------------------------------------------------


def mla_append_func(spec: MlaSpec, body):
    """The ``mla_append`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which reads
    the parameters of :func:`make_mla_append` by name (size ``n``)."""
    D, P, dtype = spec.head_dim, spec.page_size, spec.dtype
    attrs = _attrs(spec)

    @T.prim_func
    def mla_append(var_pages: T.handle, var_kv: T.handle, var_slots: T.handle):
        T.func_attr(attrs)
        num_pages = T.int32()
        n = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, P, D), dtype)
        kv = T.match_buffer(var_kv, (n, D), dtype)
        slot = T.match_buffer(var_slots, (n,), "int32")
        body()

    return mla_append


def make_mla_append(spec: MlaSpec):
    """``mla_append(pages, kv, slots)``: write token ``i``'s row at ``slots[i]``; a negative slot skips it.

    Parameters
    ----------
    pages : [num_pages, P, D], spec.dtype
        The layer's MLA page pool, **written in place**: ``pages[s // P, s % P] = kv[i]`` for
        ``s = slots[i] >= 0``.
    kv : [n, D], spec.dtype
        The new tokens' latent ``c`` (first ``D_v``) and rotated ``k_pe`` (last ``D_r``).
    slots : [n], int32
        ``page_id * P + offset`` of each token, or negative to skip it.
    """
    D, P = spec.head_dim, spec.page_size
    TX, NR = _row_threads(D)

    @macro
    def cpu_body():
        for i in T.parallel(n):
            if slot[i] >= 0:
                for d in T.vectorized(D):
                    pages[slot[i] // P, slot[i] % P, d] = kv[i, d]

    @macro
    def gpu_body():
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                for r in T.serial(NR):
                    if i < n and r * TX + tx < D:
                        if slot[i] >= 0:
                            pages[slot[i] // P, slot[i] % P, r * TX + tx] = kv[i, r * TX + tx]

    return mla_append_func(spec, cpu_body if spec.is_cpu else gpu_body)


def mla_gather_func(spec: MlaSpec, body):
    """The ``mla_gather`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which reads
    the parameters of :func:`make_mla_gather` by name (size ``m``)."""
    D, P, dtype = spec.head_dim, spec.page_size, spec.dtype
    attrs = _attrs(spec)

    @T.prim_func
    def mla_gather(var_pages: T.handle, var_slots: T.handle, var_out: T.handle):
        T.func_attr(attrs)
        num_pages = T.int32()
        m = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, P, D), dtype)
        slot = T.match_buffer(var_slots, (m,), "int32")
        out = T.match_buffer(var_out, (m, D), dtype)
        body()

    return mla_gather


def make_mla_gather(spec: MlaSpec):
    """``mla_gather(pages, slots, out)``: copy the rows at the given slots into a contiguous array.

    Parameters
    ----------
    pages : [num_pages, P, D], spec.dtype
        MLA page pool (read only).
    slots : [m], int32
        Slots to read; a negative slot yields zeros.
    out : [m, D], spec.dtype
        **Written**: ``out[e] = pages[slots[e] // P, slots[e] % P]``.
    """
    D, P, dtype = spec.head_dim, spec.page_size, spec.dtype
    TX, NR = _row_threads(D)

    @macro
    def cpu_body():
        for e in T.parallel(m):
            if slot[e] >= 0:
                for d in T.vectorized(D):
                    out[e, d] = pages[slot[e] // P, slot[e] % P, d]
            else:
                for d in T.serial(D):  # serial: a vectorized bf16 constant store fails to legalize
                    out[e, d] = T.cast(0, dtype)

    @macro
    def gpu_body():
        for e in T.thread_binding(T.max(m, 1), thread="blockIdx.x"):  # max: no empty grid when m == 0
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                for r in T.serial(NR):
                    if e < m and r * TX + tx < D:
                        if slot[e] >= 0:
                            out[e, r * TX + tx] = pages[slot[e] // P, slot[e] % P, r * TX + tx]
                        else:
                            out[e, r * TX + tx] = T.cast(0, dtype)

    return mla_gather_func(spec, cpu_body if spec.is_cpu else gpu_body)


def mla_copy_page_func(spec: MlaSpec, body):
    """The ``mla_copy_page`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which
    reads the parameters of :func:`make_mla_copy_page` by name."""
    D, P, dtype = spec.head_dim, spec.page_size, spec.dtype
    attrs = _attrs(spec)

    @T.prim_func
    def mla_copy_page(var_pages: T.handle, src_page: T.int32, dst_page: T.int32, num_slots: T.int32):
        T.func_attr(attrs)
        num_pages = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, P, D), dtype)
        body()

    return mla_copy_page


def make_mla_copy_page(spec: MlaSpec):
    """``mla_copy_page(pages, src_page, dst_page, num_slots)``: copy slots ``[0, num_slots)`` of a page
    (copy-on-write of a forked sequence's last page; the MLA twin of ``copy_page``).

    Parameters
    ----------
    pages : [num_pages, P, D], spec.dtype
        MLA page pool, **written in place**:
        ``pages[dst_page, :num_slots] = pages[src_page, :num_slots]``.
    src_page, dst_page : int32
        Page ids (``src_page != dst_page``; the caller checks the range).
    num_slots : int32
        Slots to copy, ``0 <= num_slots <= P`` (larger values are clipped to ``P``).
    """
    D, P = spec.head_dim, spec.page_size
    TX, NR = _row_threads(D)

    @macro
    def cpu_body():
        for j in T.parallel(P):
            if j < num_slots:
                for d in T.vectorized(D):
                    pages[dst_page, j, d] = pages[src_page, j, d]

    @macro
    def gpu_body():
        for j in T.thread_binding(P, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                for r in T.serial(NR):
                    if j < num_slots and r * TX + tx < D:
                        pages[dst_page, j, r * TX + tx] = pages[src_page, j, r * TX + tx]

    return mla_copy_page_func(spec, cpu_body if spec.is_cpu else gpu_body)


# ---------------------------------------------------------------------------------------------------
# merge of two attention states, any shape
# ---------------------------------------------------------------------------------------------------


def merge_any_func(spec: MlaSpec, body):
    """The ``merge_any`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which reads
    the parameters of :func:`make_merge_any` by name (sizes ``n``, ``H`` and ``Dm``, all symbolic)."""
    dtype = spec.dtype
    attrs = _attrs(spec)

    @T.prim_func
    def merge_any(var_o: T.handle, var_lse: T.handle, var_o2: T.handle, var_lse2: T.handle):
        T.func_attr(attrs)
        n = T.int32()
        H = T.int32()
        Dm = T.int32()
        o = T.match_buffer(var_o, (n, H, Dm), dtype)
        lse = T.match_buffer(var_lse, (n, H), "float32")
        o2 = T.match_buffer(var_o2, (n, H, Dm), dtype)
        lse2 = T.match_buffer(var_lse2, (n, H), "float32")
        body()

    return merge_any


def make_merge_any(spec: MlaSpec):
    """``merge_any(o, lse, o2, lse2)``: merge state 2 into state 1 **in place**, for any ``n``, ``H``
    and ``Dm`` (only the dtype is static; TVM's ``merge_attn_output_inplace``).

    docs/layout.md's rule in base 2: ``lse = log2(2^lse + 2^lse2)``,
    ``o = o * 2^(lse_old - lse) + o2 * 2^(lse2 - lse)``, float32 math; a side with ``-inf`` contributes
    nothing (its ``o`` is not read into the result); both ``-inf`` give ``o = 0``, ``lse = -inf``.

    Parameters
    ----------
    o : [n, H, Dm], spec.dtype
        State 1's output, **overwritten** with the merged output.
    lse : [n, H], float32
        State 1's base-2 log-sum-exp, **overwritten** with the merged one.
    o2 : [n, H, Dm], spec.dtype
        State 2's output (read only).
    lse2 : [n, H], float32
        State 2's base-2 log-sum-exp (read only).
    """
    dtype = spec.dtype
    neg_inf = T.float32(NEG_INF)
    RY = MERGE_ROWS

    @macro
    def weights(st):
        # st[MERGE.la], st[MERGE.lb] read -> the weights of both sides and the merged lse
        if T.max(st[MERGE.la], st[MERGE.lb]) == neg_inf:
            st[MERGE.wa] = T.float32(0)
            st[MERGE.wb] = T.float32(0)
            st[MERGE.lse] = neg_inf
        else:
            st[MERGE.lse] = T.max(st[MERGE.la], st[MERGE.lb]) + T.log2(
                T.exp2(st[MERGE.la] - T.max(st[MERGE.la], st[MERGE.lb]))
                + T.exp2(st[MERGE.lb] - T.max(st[MERGE.la], st[MERGE.lb]))
            )
            st[MERGE.wa] = T.exp2(st[MERGE.la] - st[MERGE.lse])
            st[MERGE.wb] = T.exp2(st[MERGE.lb] - st[MERGE.lse])

    def merged(o, o2, st, i, h, d):
        # parse-time helper: the merged element (i, h, d), in the output dtype
        return T.cast(
            T.if_then_else(st[MERGE.la] == neg_inf, T.float32(0), T.cast(o[i, h, d], "float32") * st[MERGE.wa])
            + T.if_then_else(st[MERGE.lb] == neg_inf, T.float32(0), T.cast(o2[i, h, d], "float32") * st[MERGE.wb]),
            dtype,
        )

    @macro
    def cpu_body():
        for ih in T.parallel(n * H):
            st = T.alloc_buffer((len(MERGE),), "float32", scope="local")
            st[MERGE.la] = lse[ih // H, ih % H]
            st[MERGE.lb] = lse2[ih // H, ih % H]
            weights(st)
            for d in T.serial(Dm):
                o[ih // H, ih % H, d] = merged(o, o2, st, ih // H, ih % H, d)
            lse[ih // H, ih % H] = st[MERGE.lse]

    @macro
    def gpu_body():
        # one warp per (row, head) pair: lanes over Dm
        bx = T.launch_thread("blockIdx.x", T.max((n * H + RY - 1) // RY, 1))  # max: no empty grid
        ty = T.launch_thread("threadIdx.y", RY)
        tx = T.launch_thread("threadIdx.x", WARP)
        st = T.alloc_buffer((len(MERGE),), "float32", scope="local")
        ih = T.meta_var(bx * RY + ty)
        if ih < n * H:
            st[MERGE.la] = lse[ih // H, ih % H]
            st[MERGE.lb] = lse2[ih // H, ih % H]
            weights(st)
            for r in T.serial((Dm + WARP - 1) // WARP):
                if r * WARP + tx < Dm:
                    o[ih // H, ih % H, r * WARP + tx] = merged(o, o2, st, ih // H, ih % H, r * WARP + tx)
        T.tvm_storage_sync("shared")  # every lane has read lse[i, h] before it changes
        if ih < n * H and tx == 0:
            lse[ih // H, ih % H] = st[MERGE.lse]

    return merge_any_func(spec, cpu_body if spec.is_cpu else gpu_body)


def mla_merge_splits_func(spec: MlaSpec, body):
    """The ``mla_merge_splits`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which
    reads the parameters of :func:`make_mla_merge_splits` by name (sizes ``S``, ``n``, ``H``, ``Dm``)."""
    dtype = spec.dtype
    attrs = _attrs(spec)

    @T.prim_func
    def mla_merge_splits(var_o_part: T.handle, var_lse_part: T.handle, var_o: T.handle, var_lse: T.handle):
        T.func_attr(attrs)
        S = T.int32()
        n = T.int32()
        H = T.int32()
        Dm = T.int32()
        o_part = T.match_buffer(var_o_part, (S, n, H, Dm), "float32")
        lse_part = T.match_buffer(var_lse_part, (S, n, H), "float32")
        o = T.match_buffer(var_o, (n, H, Dm), dtype)
        lse = T.match_buffer(var_lse, (n, H), "float32")
        body()

    return mla_merge_splits


def make_mla_merge_splits(spec: MlaSpec):
    """``mla_merge_splits(o_part, lse_part, o, lse)``: fold the chunks of ``mla_attention_split`` into
    one state, as repeated merges would (docs/layout.md merge rule, base 2); every size is symbolic.

    ``lse = log2(sum_c 2^lse_c)``, ``o = sum_c o_c 2^(lse_c - lse)``; a chunk with ``lse_c = -inf`` is
    skipped (its ``o_c`` is ignored, whatever it holds); all ``-inf`` give ``o = 0``, ``lse = -inf``.

    Parameters
    ----------
    o_part : [S, n, H, Dm], float32
    lse_part : [S, n, H], float32
    o : [n, H, Dm], spec.dtype, **written**
    lse : [n, H], float32, **written**
    """
    dtype = spec.dtype
    neg_inf = T.float32(NEG_INF)
    RY = MERGE_ROWS
    MS = state_slots("m", "w_sum", "acc")

    @macro
    def max_and_sum(st, i, h):
        # st[MS.m] = max_c lse_c, st[MS.w_sum] = sum_c 2^(lse_c - m) (0 when every chunk is empty)
        st[MS.m] = neg_inf
        for c in T.serial(S):
            st[MS.m] = T.max(st[MS.m], lse_part[c, i, h])
        st[MS.w_sum] = T.float32(0)
        if st[MS.m] != neg_inf:
            for c in T.serial(S):
                if lse_part[c, i, h] != neg_inf:
                    st[MS.w_sum] = st[MS.w_sum] + T.exp2(lse_part[c, i, h] - st[MS.m])

    @macro
    def element(st, i, h, d):
        st[MS.acc] = T.float32(0)
        if st[MS.w_sum] != T.float32(0):
            for c in T.serial(S):
                if lse_part[c, i, h] != neg_inf:
                    st[MS.acc] = st[MS.acc] + o_part[c, i, h, d] * T.exp2(lse_part[c, i, h] - st[MS.m])
            o[i, h, d] = T.Cast(dtype, st[MS.acc] / st[MS.w_sum])
        else:
            o[i, h, d] = T.Cast(dtype, T.float32(0))

    @macro
    def cpu_body():
        for ih in T.parallel(n * H):
            st = T.alloc_buffer((len(MS),), "float32", scope="local")
            max_and_sum(st, ih // H, ih % H)
            for d in T.serial(Dm):
                element(st, ih // H, ih % H, d)
            lse[ih // H, ih % H] = T.if_then_else(
                st[MS.w_sum] == T.float32(0), neg_inf, st[MS.m] + T.log2(st[MS.w_sum])
            )

    @macro
    def gpu_body():
        # one block of MERGE_THREADS per (row, head): each warp finds m and the weight sum over the
        # chunks (lane c, c + 32, ...), then the threads spread over Dm, each summing its elements over
        # the chunks MERGE_UNROLL at a time: the lse and o loads of a step are issued together (indices
        # clamped into the buffer, nothing depends on a loaded value), then a chunk with lse -inf is
        # dropped by a select, so its o (which may hold anything) never reaches the sum
        bx = T.launch_thread("blockIdx.x", T.max(n * H, 1))  # max: no empty grid
        tx = T.launch_thread("threadIdx.x", MERGE_THREADS)
        st = T.alloc_buffer((len(MS),), "float32", scope="local")
        lv = T.alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
        ov = T.alloc_buffer((MERGE_UNROLL,), "float32", scope="local")
        i = T.meta_var(bx // H)
        h = T.meta_var(bx % H)
        lane = T.meta_var(tx % WARP)
        if bx < n * H:
            st[MS.m] = neg_inf
            for c0 in T.serial((S + WARP - 1) // WARP):
                if c0 * WARP + lane < S:
                    st[MS.m] = T.max(st[MS.m], lse_part[c0 * WARP + lane, i, h])
            st[MS.m] = T.cuda.warp_reduce(st[MS.m], "max", WARP)
            st[MS.w_sum] = T.float32(0)
            if st[MS.m] != neg_inf:
                for c0 in T.serial((S + WARP - 1) // WARP):
                    if c0 * WARP + lane < S:
                        if lse_part[c0 * WARP + lane, i, h] != neg_inf:
                            st[MS.w_sum] = st[MS.w_sum] + T.exp2(lse_part[c0 * WARP + lane, i, h] - st[MS.m])
            st[MS.w_sum] = T.cuda.warp_reduce(st[MS.w_sum], "sum", WARP)
            for r in T.serial((Dm + MERGE_THREADS - 1) // MERGE_THREADS):
                if r * MERGE_THREADS + tx < Dm:
                    st[MS.acc] = T.float32(0)
                    if st[MS.w_sum] != T.float32(0):
                        for c0 in T.serial((S + MERGE_UNROLL - 1) // MERGE_UNROLL):
                            for u in T.unroll(MERGE_UNROLL):
                                lv[u] = lse_part[T.min(c0 * MERGE_UNROLL + u, S - 1), i, h]
                                ov[u] = o_part[T.min(c0 * MERGE_UNROLL + u, S - 1), i, h, r * MERGE_THREADS + tx]
                            for u in T.unroll(MERGE_UNROLL):
                                st[MS.acc] = st[MS.acc] + T.if_then_else(
                                    c0 * MERGE_UNROLL + u < S and lv[u] != neg_inf,
                                    ov[u] * T.exp2(lv[u] - st[MS.m]),
                                    T.float32(0),
                                )
                        o[i, h, r * MERGE_THREADS + tx] = T.Cast(dtype, st[MS.acc] / st[MS.w_sum])
                    else:
                        o[i, h, r * MERGE_THREADS + tx] = T.Cast(dtype, T.float32(0))
            if tx == 0:
                lse[i, h] = T.if_then_else(st[MS.w_sum] == T.float32(0), neg_inf, st[MS.m] + T.log2(st[MS.w_sum]))

    return mla_merge_splits_func(spec, cpu_body if spec.is_cpu else gpu_body)


# ---------------------------------------------------------------------------------------------------
# absorbed attention over the latent pages
# ---------------------------------------------------------------------------------------------------


def mla_attention_func(spec: MlaSpec, body, *, split: bool = False):
    """The ``mla_attention`` PrimFunc of ``spec`` (``split``: ``mla_attention_split``) around ``body``, a
    macro without arguments, which reads the parameters of :func:`make_mla_attention` by name (sizes
    ``n``, ``B`` and ``NSPLIT``, 1 without ``split``)."""
    H, D, Dv, P, dtype = spec.num_heads, spec.head_dim, spec.latent_dim, spec.page_size, spec.dtype
    attrs = _attrs(spec)
    if split:

        @T.prim_func
        def mla_attention_split(
            var_q: T.handle,
            var_q_indptr: T.handle,
            var_q_pos: T.handle,
            var_pages: T.handle,
            var_page_indptr: T.handle,
            var_page_indices: T.handle,
            var_last_page_len: T.handle,
            var_kv_window: T.handle,
            var_o_part: T.handle,
            var_lse_part: T.handle,
            sm_scale: T.float32,
            causal: T.int32,
            kv_chunk: T.int32,
        ):
            T.func_attr(attrs)
            n = T.int32()
            B = T.int32()
            NSPLIT = T.int32()
            num_pages = T.int32()
            nnz = T.int32()
            q = T.match_buffer(var_q, (n, H, D), dtype)
            q_indptr = T.match_buffer(var_q_indptr, (B + 1,), "int32")
            q_pos = T.match_buffer(var_q_pos, (n,), "int32")
            pages = T.match_buffer(var_pages, (num_pages, P, D), dtype)
            page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
            page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
            last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
            kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
            o_part = T.match_buffer(var_o_part, (NSPLIT, n, H, Dv), "float32")
            lse_part = T.match_buffer(var_lse_part, (NSPLIT, n, H), "float32")
            body()

        return mla_attention_split

    @T.prim_func
    def mla_attention(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_q_pos: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_indices: T.handle,
        var_last_page_len: T.handle,
        var_kv_window: T.handle,
        var_o: T.handle,
        var_lse: T.handle,
        sm_scale: T.float32,
        causal: T.int32,
    ):
        T.func_attr(attrs)
        n = T.int32()
        B = T.int32()
        num_pages = T.int32()
        nnz = T.int32()
        q = T.match_buffer(var_q, (n, H, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (B + 1,), "int32")
        q_pos = T.match_buffer(var_q_pos, (n,), "int32")
        pages = T.match_buffer(var_pages, (num_pages, P, D), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
        page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
        kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
        o = T.match_buffer(var_o, (n, H, Dv), dtype)
        lse = T.match_buffer(var_lse, (n, H), "float32")
        NSPLIT = T.meta_var(1)
        body()

    return mla_attention


def make_mla_attention(
    spec: MlaSpec,
    *,
    split: bool = False,
    tensor_cores: bool = True,
    tc_heads: int | None = None,
    tc_stages: int | None = None,
    arch: str | None = None,
    wg_heads: int | None = None,
    wg_keys: int = WG_KEYS,
    wg_stages: int = WG_STAGES,
    wg_producer: bool = WG_PRODUCER,
    wg_tma: bool = WG_TMA,
):
    """``mla_attention(q, q_indptr, q_pos, pages, page_indptr, page_indices, last_page_len, kv_window,
    o, lse, sm_scale, causal)``: absorbed MLA attention of ragged query rows over the paged latent rows.

    Row ``i`` of sequence ``b`` (``q_indptr[b] <= i < q_indptr[b + 1]``), head ``h``: over the visible
    slots ``j`` of ``b`` (docs/layout.md, "Page tables", "Sliding window with attention sink"),
    ``s_j = sm_scale * q[i, h] . row_j`` (all ``D`` dims), ``o[i, h] = sum_j softmax(s)_j row_j[:D_v]``,
    ``lse[i, h] = log2(sum_j exp(s_j))``; no visible slot: ``o = 0``, ``lse = -inf``. Decode is
    ``n == B`` with ``q_indptr = arange(B + 1)``.

    Parameters
    ----------
    q : [n, H, D], spec.dtype
        Absorbed queries (``q_nope`` times the latent up-projection, then ``q_pe``).
    q_indptr : [B + 1], int32
        Rows of each sequence.
    q_pos : [n], int32
        Position of each row (the causal mask).
    pages : [num_pages, P, D], spec.dtype
        MLA page pool (read only).
    page_indptr, page_indices, last_page_len : [B + 1], [nnz], [B], int32
        Page tables, including this forward's appended tokens.
    kv_window : [B, 3], int32
        ``(sink_end, window_start, window_pos_offset)`` per sequence; ``(0, 0, 0)`` for none.
    o : [n, H, D_v], spec.dtype
        **Written**: the output.
    lse : [n, H], float32
        **Written**: base-2 log-sum-exp.
    sm_scale : float32
        Score scale.
    causal : int32
        1: slot ``j`` is visible iff valid and ``pos(j) <= q_pos[i]``; 0: every valid slot.

    ``split=True`` gives ``mla_attention_split(q, q_indptr, q_pos, pages, page_indptr, page_indices,
    last_page_len, kv_window, o_part, lse_part, sm_scale, causal, kv_chunk)`` (flash-decoding, for
    few rows over long sequences): chunk ``c`` of row ``i`` attends only to the slots ``j`` with
    ``c * kv_chunk <= j < (c + 1) * kv_chunk`` (slot indices, gap slots of a window included in the
    count) and writes its normalized float32 ``o_part[c, i]`` ([S, n, H, D_v]) and base-2
    ``lse_part[c, i]`` ([S, n, H]; ``-inf`` and ``o_part = 0`` when it sees no key);
    ``mla_merge_splits`` folds the ``S`` chunks into ``o`` / ``lse``. The caller chooses ``S`` and
    ``kv_chunk`` with ``S * kv_chunk >= kv_len`` of every sequence (``kv_chunk`` a multiple of 32 keeps
    the tiles full). ``tensor_cores=False`` forces the SIMT cuda schedule; ``tc_heads`` (a multiple of 16
    dividing H) and ``tc_stages`` (>= 2) override the tensor-core schedule's heads per block (default: the
    largest of at most ``TC_MAX_HEADS``) and latent-tile stages (``TC_STAGES``); :func:`mla_split_granule`
    gives the split granule of the defaults. ``arch`` is the CUDA arch the kernel is built for: sm_90
    takes the warpgroup-MMA schedule of :mod:`tvmkv.tir.mla_hopper` where
    :func:`tvmkv.tir.mla_layout.wgmma_heads` allows (``wg_heads``, ``wg_keys``, ``wg_stages``,
    ``wg_producer``, ``wg_tma``: its heads per block, 16 or 32, latent tiles, whether a second warpgroup
    copies and whether with bulk tensor copies; defaults: what the runtime plans for).
    """
    H, D, Dv, P, dtype = spec.num_heads, spec.head_dim, spec.latent_dim, spec.page_size, spec.dtype
    LOGP = P.bit_length() - 1
    PMASK = P - 1
    VL = CPU_VL
    out_loop = T.serial if dtype == "bfloat16" else T.vectorized  # LLVM: no bf16 vector stores

    @macro
    def find_sequence(seq, i):
        # seq[SEQ.b] = the last b with q_indptr[b] <= i (binary search)
        seq[SEQ.lo] = 0
        seq[SEQ.hi] = B
        while seq[SEQ.hi] - seq[SEQ.lo] > 1:
            if q_indptr[(seq[SEQ.lo] + seq[SEQ.hi]) // 2] <= i:
                seq[SEQ.lo] = (seq[SEQ.lo] + seq[SEQ.hi]) // 2
            else:
                seq[SEQ.hi] = (seq[SEQ.lo] + seq[SEQ.hi]) // 2
        seq[SEQ.b] = seq[SEQ.lo]

    @macro
    def key_range(kr, seq, i, ch):
        # kr[KEYS.*] of row i: the sequence's slots, window, and the key scan [start, end) (split: the
        # part of it in chunk ch)
        b = T.meta_var(seq[SEQ.b])
        kr[KEYS.base] = page_indptr[b]
        if page_indptr[b + 1] > page_indptr[b]:
            kr[KEYS.kv_len] = (page_indptr[b + 1] - page_indptr[b] - 1) * P + last_page_len[b]
        else:
            kr[KEYS.kv_len] = 0
        kr[KEYS.sink_end] = kv_window[b, 0]
        kr[KEYS.window_start] = kv_window[b, 1]
        kr[KEYS.window_offset] = kv_window[b, 2]
        if causal != 0:
            # last visible j: j <= q_pos in the sink, j + offset <= q_pos after it
            kr[KEYS.end] = T.max(
                T.min(
                    kr[KEYS.kv_len],
                    T.max(T.min(kr[KEYS.sink_end], q_pos[i] + 1), q_pos[i] - kr[KEYS.window_offset] + 1),
                ),
                0,
            )
        else:
            kr[KEYS.end] = kr[KEYS.kv_len]
        kr[KEYS.start] = 0
        if split:
            kr[KEYS.start] = T.min(ch * kv_chunk, kr[KEYS.end])
            kr[KEYS.end] = T.min(kr[KEYS.end], kr[KEYS.start] + kv_chunk)

    @macro
    def store_o(ch, i, h, d, value):
        # the output element (float32 value): o, or chunk ch's partial (split)
        if split:
            o_part[ch, i, h, d] = value
        else:
            o[i, h, d] = T.Cast(dtype, value)

    @macro
    def store_lse(ch, i, h, value):
        if split:
            lse_part[ch, i, h] = value
        else:
            lse[i, h] = value

    @macro
    def key_slot(kr, i, j):
        # kr[KEYS.slot] = slot of key j (< kr[KEYS.end]) of row i, or -1 when it is not visible
        kr[KEYS.pos] = T.if_then_else(j < kr[KEYS.sink_end], j, j + kr[KEYS.window_offset])
        if (j < kr[KEYS.sink_end] or j >= kr[KEYS.window_start]) and (causal == 0 or kr[KEYS.pos] <= q_pos[i]):
            kr[KEYS.slot] = page_indices[kr[KEYS.base] + (j >> LOGP)] * P + (j & PMASK)
        else:
            kr[KEYS.slot] = -1

    # ------------------------------------------------------------------ llvm
    HC = divisor_at_most(H, CPU_HEADS)  # heads per work item
    NC = H // HC

    @macro
    def cpu_body():
        for icc in T.parallel(n * NC * NSPLIT):
            seq = T.alloc_buffer((len(SEQ),), "int32", scope="local")
            kr = T.alloc_buffer((len(KEYS),), "int32", scope="local")
            Q = T.alloc_buffer((HC, D), "float32", scope="local")  # q * sm_scale * log2(e)
            O = T.alloc_buffer((HC, Dv), "float32", scope="local")
            Kt = T.alloc_buffer((D,), "float32", scope="local")  # the key row, fp32
            acc = T.alloc_buffer((VL,), "float32", scope="local")
            m = T.alloc_buffer((HC,), "float32", scope="local")
            d_sum = T.alloc_buffer((HC,), "float32", scope="local")
            st = T.alloc_buffer((len(SOFT),), "float32", scope="local")
            ch = T.meta_var(icc % NSPLIT)
            i = T.meta_var(icc // NSPLIT // NC)
            h0 = T.meta_var(icc // NSPLIT % NC * HC)
            find_sequence(seq, i)
            key_range(kr, seq, i, ch)
            for h in T.serial(HC):
                m[h] = T.float32(NEG_INF)
                d_sum[h] = T.float32(0)
                for d in T.vectorized(D):
                    Q[h, d] = T.Cast("float32", q[i, h0 + h, d]) * (sm_scale * T.float32(LOG2E))
                for d in T.vectorized(Dv):
                    O[h, d] = T.float32(0)
            for j in T.serial(kr[KEYS.start], kr[KEYS.end]):
                key_slot(kr, i, j)
                if kr[KEYS.slot] >= 0:
                    for d in T.vectorized(D):
                        Kt[d] = T.Cast("float32", pages[kr[KEYS.slot] >> LOGP, kr[KEYS.slot] & PMASK, d])
                    for h in T.serial(HC):
                        for l in T.vectorized(VL):
                            acc[l] = T.float32(0)
                        for d0 in T.serial(D // VL):
                            for l in T.vectorized(VL):
                                acc[l] = acc[l] + Q[h, d0 * VL + l] * Kt[d0 * VL + l]
                        st[SOFT.s] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
                        st[SOFT.m_new] = T.max(m[h], st[SOFT.s])
                        st[SOFT.alpha] = T.exp2(m[h] - st[SOFT.m_new])
                        st[SOFT.p] = T.exp2(st[SOFT.s] - st[SOFT.m_new])
                        d_sum[h] = d_sum[h] * st[SOFT.alpha] + st[SOFT.p]
                        m[h] = st[SOFT.m_new]
                        for d in T.vectorized(Dv):
                            O[h, d] = O[h, d] * st[SOFT.alpha] + st[SOFT.p] * Kt[d]
            for h in T.serial(HC):
                # no key seen: d == 0 -> o = 0, lse = -inf; a NaN d (NaN input) propagates
                if d_sum[h] == T.float32(0):
                    for d in out_loop(Dv):
                        store_o(ch, i, h0 + h, d, T.float32(0))
                    store_lse(ch, i, h0 + h, T.float32(NEG_INF))
                else:
                    for d in out_loop(Dv):
                        store_o(ch, i, h0 + h, d, O[h, d] / d_sum[h])
                    store_lse(ch, i, h0 + h, m[h] + T.log2(d_sum[h]))

    # ------------------------------------------------------------------ cuda
    HB = divisor_at_most(H, min(GPU_HEADS, max(1, QS_BYTES // (4 * D))))  # heads per block
    NW = divisor_at_most(HB, GPU_WARPS)  # warps per block
    HPW = HB // NW  # heads per warp (register blocking of the scores and of O)
    NBH = H // HB  # blocks per query row
    NT = NW * WARP
    KS = D + KPAD  # row stride of the shared latent tile
    ebytes = dtype_bytes(dtype)
    TILE_WORDS = TK * KS * ebytes // 4
    NS = 2 if (2 * TILE_WORDS + HB * D) * 4 <= SMEM_BYTES else 1  # tile stages (2: double buffered)
    NDV = (Dv + WARP - 1) // WARP  # output elements per lane
    NKV = D // KVEC  # vector copies per latent row
    CP_BYTES = KVEC * ebytes
    CP = "cp.async.cg.shared.global" if CP_BYTES == 16 else "cp.async.ca.shared.global"

    @macro
    def tile_slots(kr, Kid, Kvis, i, t, slot_stage):
        # warp 0: slot (always a real slot of the sequence: keys past the end repeat the last key) and
        # visibility of the keys of tile t, into stage slot_stage of Kid / Kvis
        if tid < TK:
            key_slot(kr, i, T.min(kr[KEYS.start] + t * TK + tid, kr[KEYS.end] - 1))
            Kvis[slot_stage, tid] = T.Cast("int32", kr[KEYS.start] + t * TK + tid < kr[KEYS.end] and kr[KEYS.slot] >= 0)
            Kid[slot_stage, tid] = page_indices[
                kr[KEYS.base] + (T.min(kr[KEYS.start] + t * TK + tid, kr[KEYS.end] - 1) >> LOGP)
            ] * P + (T.min(kr[KEYS.start] + t * TK + tid, kr[KEYS.end] - 1) & PMASK)

    @macro
    def issue_tile(Ks, Kid, slot_stage, stage):
        # cp.async of every row of a tile (slots in Kid[slot_stage]) into tile stage ``stage``
        for r in T.serial((TK * NKV + NT - 1) // NT):
            if r * NT + tid < TK * NKV:
                T.ptx[CP](
                    Ks.ptr_to([stage, (r * NT + tid) // NKV, (r * NT + tid) % NKV * KVEC]),
                    pages.ptr_to(
                        [
                            Kid[slot_stage, (r * NT + tid) // NKV] >> LOGP,
                            Kid[slot_stage, (r * NT + tid) // NKV] & PMASK,
                            (r * NT + tid) % NKV * KVEC,
                        ]
                    ),
                    CP_BYTES,
                )
        T.ptx["cp.async.commit_group"]()

    @macro
    def gpu_body():
        bx = T.launch_thread("blockIdx.x", T.max(n * NBH * NSPLIT, 1))  # max: no empty grid when n == 0
        ty = T.launch_thread("threadIdx.y", NW)
        tx = T.launch_thread("threadIdx.x", WARP)
        ch = T.meta_var(bx % NSPLIT)  # the chunk (split; chunks of a row side by side)
        i = T.meta_var(bx // NSPLIT // NBH)
        h0 = T.meta_var(bx // NSPLIT % NBH * HB)  # first head of the block
        tid = T.meta_var(ty * WARP + tx)
        # one dynamic shared allocation (float32 words, so kernels of different dtypes in one module
        # declare the same ``extern __shared__`` array): NS latent tiles, viewed in the cache dtype,
        # then the block's queries (q * sm_scale * log2(e)). Static shared memory stays small: the
        # runtime raises the block's limit past 48 KiB only for the dynamic part.
        smem = T.alloc_buffer((NS * TILE_WORDS + HB * D,), "float32", scope="shared.dyn")
        Ks = T.decl_buffer((NS, TK, KS), dtype, data=smem.data, scope="shared.dyn")
        Qs = T.decl_buffer((HB, D), "float32", data=smem.data, elem_offset=NS * TILE_WORDS, scope="shared.dyn")
        Ps = T.alloc_buffer((HB, TK), "float32", scope="shared")  # probabilities of the tile
        Kid = T.alloc_buffer((3, TK), "int32", scope="shared")  # slots of the keys of tiles t % 3
        Kvis = T.alloc_buffer((3, TK), "int32", scope="shared")  # and whether each is visible
        seq = T.alloc_buffer((len(SEQ),), "int32", scope="local")
        kr = T.alloc_buffer((len(KEYS),), "int32", scope="local")
        kv = T.alloc_buffer((KVEC,), dtype, scope="local")
        qv = T.alloc_buffer((KVEC,), "float32", scope="local")
        S = T.alloc_buffer((HPW,), "float32", scope="local")
        m = T.alloc_buffer((HPW,), "float32", scope="local")
        d_sum = T.alloc_buffer((HPW,), "float32", scope="local")
        alpha = T.alloc_buffer((HPW,), "float32", scope="local")
        pr = T.alloc_buffer((HPW,), "float32", scope="local")
        O = T.alloc_buffer((HPW, NDV), "float32", scope="local")
        st = T.alloc_buffer((len(SOFT),), "float32", scope="local")
        if i < n:
            find_sequence(seq, i)
            key_range(kr, seq, i, ch)
            for r in T.serial((HB * D + NT - 1) // NT):
                if r * NT + tid < HB * D:
                    Qs[(r * NT + tid) // D, (r * NT + tid) % D] = T.Cast(
                        "float32", q[i, h0 + (r * NT + tid) // D, (r * NT + tid) % D]
                    ) * (sm_scale * T.float32(LOG2E))
        else:
            kr[KEYS.start] = 0
            kr[KEYS.end] = 0
        for g in T.unroll(HPW):
            m[g] = T.float32(NEG_INF)
            d_sum[g] = T.float32(0)
            for e in T.unroll(NDV):
                O[g, e] = T.float32(0)
        # prologue: the slots of tiles 0 and 1, the rows of tile 0 in flight
        if kr[KEYS.end] > kr[KEYS.start]:
            tile_slots(kr, Kid, Kvis, i, 0, 0)
            tile_slots(kr, Kid, Kvis, i, 1, 1)
        T.tvm_storage_sync("shared")
        if kr[KEYS.end] > kr[KEYS.start]:
            issue_tile(Ks, Kid, 0, 0)
        for t in T.serial((kr[KEYS.end] - kr[KEYS.start] + TK - 1) // TK):
            # tile t + 1 in flight while tile t is used; the slots of tile t + 2 are looked up
            if NS == 2:
                if kr[KEYS.start] + (t + 1) * TK < kr[KEYS.end]:
                    issue_tile(Ks, Kid, (t + 1) % 3, (t + 1) % 2)
                    T.ptx["cp.async.wait_group"](1)
                else:
                    T.ptx["cp.async.wait_group"](0)
            else:
                T.ptx["cp.async.wait_group"](0)
            if kr[KEYS.start] + (t + 2) * TK < kr[KEYS.end]:
                tile_slots(kr, Kid, Kvis, i, t + 2, (t + 2) % 3)
            T.tvm_storage_sync("shared")
            ks = T.meta_var(t % NS)
            ss = T.meta_var(t % 3)
            # scores: lane tx = key tx of the tile, for the warp's HPW heads
            for g in T.unroll(HPW):
                S[g] = T.float32(0)
            for d0 in T.serial(NKV):
                for v in T.vectorized(KVEC):
                    kv[v] = Ks[ks, tx, d0 * KVEC + v]
                for g in T.unroll(HPW):
                    for v in T.vectorized(KVEC):
                        qv[v] = Qs[ty * HPW + g, d0 * KVEC + v]
                    for v in T.unroll(KVEC):
                        S[g] = S[g] + qv[v] * T.Cast("float32", kv[v])
            # online softmax of each head over the tile (warp-uniform)
            for g in T.unroll(HPW):
                st[SOFT.s] = T.if_then_else(Kvis[ss, tx] == 1, S[g], T.float32(NEG_INF))
                st[SOFT.m_new] = T.max(m[g], T.cuda.warp_reduce(st[SOFT.s], "max", WARP))
                if st[SOFT.m_new] > T.float32(NEG_INF):
                    alpha[g] = T.exp2(m[g] - st[SOFT.m_new])
                    st[SOFT.p] = T.exp2(st[SOFT.s] - st[SOFT.m_new])
                else:
                    alpha[g] = T.float32(1)
                    st[SOFT.p] = T.float32(0)
                d_sum[g] = d_sum[g] * alpha[g] + T.cuda.warp_reduce(st[SOFT.p], "sum", WARP)
                m[g] = st[SOFT.m_new]
                Ps[ty * HPW + g, tx] = st[SOFT.p]
            T.tvm_storage_sync("shared")
            # O += P V: lanes over D_v, the warp's heads share every element of the tile; masked keys
            # are skipped (their rows may hold anything, even NaN)
            for g in T.unroll(HPW):
                for e in T.unroll(NDV):
                    O[g, e] = O[g, e] * alpha[g]
            for c in T.serial(TK):
                if Kvis[ss, c] == 1:
                    for g in T.unroll(HPW):
                        pr[g] = Ps[ty * HPW + g, c]
                    for e in T.unroll(NDV):
                        if e * WARP + tx < Dv:
                            st[SOFT.s] = T.Cast("float32", Ks[ks, c, e * WARP + tx])
                            for g in T.unroll(HPW):
                                O[g, e] = O[g, e] + pr[g] * st[SOFT.s]
            T.tvm_storage_sync("shared")
            if NS == 1:
                if kr[KEYS.start] + (t + 1) * TK < kr[KEYS.end]:
                    issue_tile(Ks, Kid, (t + 1) % 3, 0)
        if i < n:
            for g in T.unroll(HPW):
                for e in T.unroll(NDV):
                    if e * WARP + tx < Dv:
                        if d_sum[g] == T.float32(0):
                            store_o(ch, i, h0 + ty * HPW + g, e * WARP + tx, T.float32(0))
                        else:
                            store_o(ch, i, h0 + ty * HPW + g, e * WARP + tx, O[g, e] / d_sum[g])
                if tx == 0:
                    if d_sum[g] == T.float32(0):
                        store_lse(ch, i, h0 + ty * HPW + g, T.float32(NEG_INF))
                    else:
                        store_lse(ch, i, h0 + ty * HPW + g, m[g] + T.log2(d_sum[g]))

    # ------------------------------------------------------------------ cuda, tensor cores
    # Block = (query row, HBT = 16 * TCM heads: TCM m16 tiles), 4 * TCM warps; warp w = (head tile
    # mg = w // 4, quarter cq = w % 4). Latent tiles of TK = 32 rows by cp.async into an NST-stage ring
    # (rows padded to D + 8 so ldmatrix phases hit distinct banks), shared by every head of the block.
    # Per tile: warp (mg, cq) computes the partial S[16 heads, 32 keys] = Q K^T over k16 steps cq,
    # cq + 4, ... of D with mma.m16n8k16 (A = its Q fragments, in registers for the whole kernel), and
    # stores it in fragment order (conflict-free); after one barrier each of the 4 warps of a head tile
    # sums the 4 partials of its own fragment positions, so all of them hold the same scores in the
    # mma accumulator layout and run the same online softmax in registers (rows g, g + 8 of a thread;
    # 4 lanes share a row: two shuffles, the row sum stays per thread until the end); P stays in
    # registers as the A fragment of O[16 heads, D_v / 4 columns of quarter cq] += P V (B = the same
    # latent rows through ldmatrix.trans). Two barriers per tile.
    if tc_heads is not None and (tc_heads <= 0 or tc_heads % 16 or H % tc_heads):
        raise ValueError(f"tc_heads={tc_heads}: give a multiple of 16 that divides num_heads {H}, e.g. 16")
    if tc_stages is not None and tc_stages < 2:
        raise ValueError(f"tc_stages={tc_stages}: the tensor-core schedule needs at least 2 stages; pass 2")
    TCM = tc_heads // 16 if tc_heads else tc_head_tiles(spec)
    NST = tc_stages or TC_STAGES
    HBT = 16 * TCM  # heads per block
    NBT = H // HBT  # blocks per query row
    NWT = 4 * TCM  # warps
    NTT = NWT * WARP
    DVW = Dv // 4  # output columns per warp
    DNT = DVW // 8  # n8 output tiles per warp
    KD = D // 16  # k16 steps of Q K^T
    KQ = (KD + 3) // 4  # k16 steps per warp (quarter cq takes steps cq, cq + 4, ...)
    CPRT = D // 8  # 16-byte chunks per row
    KS2 = D + 8  # shared row stride (elements) of the latent tiles and of Q
    TILE2_WORDS, QS_WORDS = tc_shared_words(spec, TCM)  # a tile stage; Q, then the partial scores
    mma = MMA.get(dtype)
    cvt = CVT.get(dtype)

    @macro
    def issue_tile_tc(Ks, Kid, slot_stage, stage):
        for r in T.serial((TK * CPRT + NTT - 1) // NTT):
            if r * NTT + tx < TK * CPRT:
                T.ptx[CP16](
                    Ks.ptr_to([stage, (r * NTT + tx) // CPRT, (r * NTT + tx) % CPRT * 8]),
                    pages.ptr_to(
                        [
                            Kid[slot_stage, (r * NTT + tx) // CPRT] >> LOGP,
                            Kid[slot_stage, (r * NTT + tx) // CPRT] & PMASK,
                            (r * NTT + tx) % CPRT * 8,
                        ]
                    ),
                    16,
                )

    @macro
    def gpu_tc_body():
        bx = T.launch_thread("blockIdx.x", T.max(n * NBT * NSPLIT, 1))  # max: no empty grid
        tx = T.launch_thread("threadIdx.x", NTT)
        ch = T.meta_var(bx % NSPLIT)  # the chunk (split; chunks of a row side by side)
        i = T.meta_var(bx // NSPLIT // NBT)
        h0 = T.meta_var(bx // NSPLIT % NBT * HBT)
        w = T.meta_var(tx // WARP)
        mg = T.meta_var(tx // WARP // 4)
        cq = T.meta_var(tx // WARP % 4)
        lane = T.meta_var(tx % WARP)
        tid = T.meta_var(tx)
        smem = T.alloc_buffer((NST * TILE2_WORDS + QS_WORDS,), "float32", scope="shared.dyn")
        Ks = T.decl_buffer((NST, TK, KS2), dtype, data=smem.data, scope="shared.dyn")
        Qs = T.decl_buffer((HBT, KS2), dtype, data=smem.data, elem_offset=NST * TILE2_WORDS * 2, scope="shared.dyn")
        # partial scores [quarter, head tile, n8 tile * 4 + reg, lane] over Q's space
        Ss = T.decl_buffer(
            (4, TCM, 16, WARP), "float32", data=smem.data, elem_offset=NST * TILE2_WORDS, scope="shared.dyn"
        )
        Kid = T.alloc_buffer((NST + 1, TK), "int32", scope="shared")  # slots of tile t at t % (NST + 1)
        Kvis = T.alloc_buffer((NST + 1, TK), "int32", scope="shared")
        seq = T.alloc_buffer((len(SEQ),), "int32", scope="local")
        kr = T.alloc_buffer((len(KEYS),), "int32", scope="local")
        bf = T.alloc_buffer((4,), "uint32", scope="local")
        pf = T.alloc_buffer((TK // 16, 4), "uint32", scope="local")  # P as the A fragments of P V
        sacc = T.alloc_buffer((TK // 8, 4), "float32", scope="local")  # scores, then probabilities
        qf = T.alloc_buffer((KQ, 4), "uint32", scope="local")  # this warp's Q fragments, for every tile
        o_acc = T.alloc_buffer((DNT, 4), "float32", scope="local")
        m = T.alloc_buffer((2,), "float32", scope="local")  # running max of rows g, g + 8 (log2 units)
        lsum = T.alloc_buffer((2,), "float32", scope="local")  # this thread's part of the row sums
        mx = T.alloc_buffer((2,), "float32", scope="local")
        base = T.alloc_buffer((2,), "float32", scope="local")
        alpha = T.alloc_buffer((2,), "float32", scope="local")
        if i < n:
            find_sequence(seq, i)
            key_range(kr, seq, i, ch)
            for r in T.serial((HBT * CPRT + NTT - 1) // NTT):
                if r * NTT + tx < HBT * CPRT:
                    T.ptx[CP16](
                        Qs.ptr_to([(r * NTT + tx) // CPRT, (r * NTT + tx) % CPRT * 8]),
                        q.ptr_to([i, h0 + (r * NTT + tx) // CPRT, (r * NTT + tx) % CPRT * 8]),
                        16,
                    )
        else:
            kr[KEYS.start] = 0
            kr[KEYS.end] = 0
        T.ptx["cp.async.commit_group"]()
        for h in T.unroll(2):
            m[h] = T.float32(NEG_INF)
            lsum[h] = T.float32(0)
        for dn in T.unroll(DNT):
            for r in T.unroll(4):
                o_acc[dn, r] = T.float32(0)
        for s in T.unroll(NST):
            if kr[KEYS.start] + s * TK < kr[KEYS.end]:
                tile_slots(kr, Kid, Kvis, i, s, s)
        T.tvm_storage_sync("shared")
        # tiles 0 .. NST - 2 in flight; one commit group per tile, empty ones too, so that
        # wait_group(NST - 2) at tile t always means "tile t has landed"
        for s in T.unroll(NST - 1):
            if kr[KEYS.start] + s * TK < kr[KEYS.end]:
                issue_tile_tc(Ks, Kid, s, s)
            T.ptx["cp.async.commit_group"]()
        T.ptx["cp.async.wait_group"](NST - 1)  # Q has landed
        T.tvm_storage_sync("shared")
        for c in T.unroll(KQ):
            if c * 4 + cq < KD:
                T.ptx[LDSM](
                    qf[c, 0],
                    qf[c, 1],
                    qf[c, 2],
                    qf[c, 3],
                    Qs.ptr_to([mg * 16 + lane % 16, (c * 4 + cq) * 16 + lane // 16 * 8]),
                )
        for t in T.serial((kr[KEYS.end] - kr[KEYS.start] + TK - 1) // TK):
            T.ptx["cp.async.wait_group"](NST - 2)
            # every thread's copies of tile t have landed; after the barrier: everyone's, and tile
            # t - 1 (its stage, slots and the partial scores) is no longer read
            T.tvm_storage_sync("shared")
            if kr[KEYS.start] + (t + NST - 1) * TK < kr[KEYS.end]:
                issue_tile_tc(Ks, Kid, (t + NST - 1) % (NST + 1), (t + NST - 1) % NST)
            T.ptx["cp.async.commit_group"]()
            if kr[KEYS.start] + (t + NST) * TK < kr[KEYS.end]:
                tile_slots(kr, Kid, Kvis, i, t + NST, (t + NST) % (NST + 1))
            ks = T.meta_var(t % NST)
            ss = T.meta_var(t % (NST + 1))
            for nt in T.unroll(TK // 8):
                for r in T.unroll(4):
                    sacc[nt, r] = T.float32(0)
            for c in T.unroll(KQ):
                if c * 4 + cq < KD:
                    for np2 in T.unroll(TK // 16):
                        T.ptx[LDSM](
                            bf[0],
                            bf[1],
                            bf[2],
                            bf[3],
                            Ks.ptr_to(
                                [ks, np2 * 16 + lane // 16 * 8 + lane % 8, (c * 4 + cq) * 16 + lane // 8 % 2 * 8]
                            ),
                        )
                        for half in T.unroll(2):
                            T.ptx[mma](
                                sacc[np2 * 2 + half, 0],
                                sacc[np2 * 2 + half, 1],
                                sacc[np2 * 2 + half, 2],
                                sacc[np2 * 2 + half, 3],
                                qf[c, 0],
                                qf[c, 1],
                                qf[c, 2],
                                qf[c, 3],
                                bf[half * 2],
                                bf[half * 2 + 1],
                                sacc[np2 * 2 + half, 0],
                                sacc[np2 * 2 + half, 1],
                                sacc[np2 * 2 + half, 2],
                                sacc[np2 * 2 + half, 3],
                            )
            for nt in T.unroll(TK // 8):
                for r in T.unroll(4):
                    Ss[cq, mg, nt * 4 + r, lane] = sacc[nt, r]
            T.tvm_storage_sync("shared")
            # the summed scores of this thread's fragment positions (key nt * 8 + 2 (lane % 4) + r % 2),
            # scaled to log2 units; keys that are not visible: -inf
            for nt in T.unroll(TK // 8):
                for r in T.unroll(4):
                    sacc[nt, r] = T.if_then_else(
                        Kvis[ss, nt * 8 + lane % 4 * 2 + r % 2] == 1,
                        (
                            (Ss[0, mg, nt * 4 + r, lane] + Ss[1, mg, nt * 4 + r, lane])
                            + (Ss[2, mg, nt * 4 + r, lane] + Ss[3, mg, nt * 4 + r, lane])
                        )
                        * (sm_scale * T.float32(LOG2E)),
                        T.float32(NEG_INF),
                    )
            # online softmax: regs 0, 1 -> row g, regs 2, 3 -> row g + 8; a row with no visible key so far
            # subtracts a finite base (p = 0, alpha = 0 on an all-zero state)
            for h in T.unroll(2):
                mx[h] = T.max(sacc[0, 2 * h], sacc[0, 2 * h + 1])
                for nt in T.unroll(1, TK // 8):
                    mx[h] = T.max(mx[h], T.max(sacc[nt, 2 * h], sacc[nt, 2 * h + 1]))
                mx[h] = T.max(m[h], T.cuda.warp_reduce(mx[h], "max", 4))  # 4 lanes share a row
                base[h] = T.if_then_else(mx[h] == T.float32(NEG_INF), T.float32(0), mx[h])
                alpha[h] = T.exp2(m[h] - base[h])
                m[h] = mx[h]
                lsum[h] = lsum[h] * alpha[h]
                for nt in T.unroll(TK // 8):
                    for c in T.unroll(2):
                        sacc[nt, 2 * h + c] = T.exp2(sacc[nt, 2 * h + c] - base[h])
                        lsum[h] = lsum[h] + sacc[nt, 2 * h + c]
                for dn in T.unroll(DNT):
                    for c in T.unroll(2):
                        o_acc[dn, 2 * h + c] = o_acc[dn, 2 * h + c] * alpha[h]
            # O += P V: S tiles (2kk, 2kk + 1) are the A fragment of key step kk
            for kk in T.unroll(TK // 16):
                T.ptx[cvt](pf[kk, 0], sacc[2 * kk, 1], sacc[2 * kk, 0])  # hi, lo
                T.ptx[cvt](pf[kk, 1], sacc[2 * kk, 3], sacc[2 * kk, 2])
                T.ptx[cvt](pf[kk, 2], sacc[2 * kk + 1, 1], sacc[2 * kk + 1, 0])
                T.ptx[cvt](pf[kk, 3], sacc[2 * kk + 1, 3], sacc[2 * kk + 1, 2])
            for kk in T.unroll(TK // 16):
                for nj in T.unroll(DNT // 2):
                    T.ptx[LDSM_T](
                        bf[0],
                        bf[1],
                        bf[2],
                        bf[3],
                        Ks.ptr_to([ks, kk * 16 + lane % 16, cq * DVW + nj * 16 + lane // 16 * 8]),
                    )
                    for half in T.unroll(2):
                        T.ptx[mma](
                            o_acc[nj * 2 + half, 0],
                            o_acc[nj * 2 + half, 1],
                            o_acc[nj * 2 + half, 2],
                            o_acc[nj * 2 + half, 3],
                            pf[kk, 0],
                            pf[kk, 1],
                            pf[kk, 2],
                            pf[kk, 3],
                            bf[half * 2],
                            bf[half * 2 + 1],
                            o_acc[nj * 2 + half, 0],
                            o_acc[nj * 2 + half, 1],
                            o_acc[nj * 2 + half, 2],
                            o_acc[nj * 2 + half, 3],
                        )
        T.ptx["cp.async.wait_group"](0)
        # o = O / l, lse = m + log2(l); a head without keys (l = 0): o = 0, lse = -inf
        for h in T.unroll(2):
            lsum[h] = T.cuda.warp_reduce(lsum[h], "sum", 4)
        if i < n:
            if cq == 0 and lane % 4 == 0:
                for h in T.unroll(2):
                    store_lse(
                        ch,
                        i,
                        h0 + mg * 16 + lane // 4 + 8 * h,
                        T.if_then_else(lsum[h] == T.float32(0), T.float32(NEG_INF), m[h] + T.log2(lsum[h])),
                    )
            for dn in T.unroll(DNT):
                for r in T.unroll(4):
                    store_o(
                        ch,
                        i,
                        h0 + mg * 16 + lane // 4 + 8 * (r // 2),
                        cq * DVW + dn * 8 + lane % 4 * 2 + r % 2,
                        T.if_then_else(lsum[r // 2] == T.float32(0), T.float32(0), o_acc[dn, r] / lsum[r // 2]),
                    )

    hb = wgmma_heads(spec, arch, wg_heads, wg_keys, wg_stages)
    if not hb and (wg_heads is not None or (wg_keys, wg_stages) != (WG_KEYS, WG_STAGES)):
        raise ValueError(
            f"wg_heads={wg_heads}, wg_keys={wg_keys}, wg_stages={wg_stages}: the warpgroup-MMA schedule needs arch "
            f"sm_90 (got {arch!r}), fp16 / bf16, 16 or 32 heads a block dividing num_heads {H}, head_dim / "
            f"latent_dim multiples of 64, tiles of {WG_TILE_KEYS} keys, 2+ stages within {WG_SMEM_LIMIT} bytes of "
            "shared memory; pass the defaults"
        )
    if spec.is_cpu:
        body = cpu_body
    elif tensor_cores and hb:
        rows = SimpleNamespace(
            find_sequence=find_sequence,
            key_range=key_range,
            key_slot=key_slot,
            store_o=store_o,
            store_lse=store_lse,
            SEQ=SEQ,
            KEYS=KEYS,
        )
        body = mla_hopper.make_body(spec, rows, hb, wg_keys, wg_stages, wg_producer, wg_tma)
    elif tensor_cores and use_tensor_cores(spec):
        body = gpu_tc_body
    else:
        body = gpu_body
    return mla_attention_func(spec, body, split=split)


# ---------------------------------------------------------------------------------------------------
# non-absorbed self attention of the prefill (q/k head dim != v head dim)
# ---------------------------------------------------------------------------------------------------


def ragged_attention_dv_func(spec: MlaSpec, body):
    """The ``ragged_attention_dv`` PrimFunc of ``spec`` around ``body``, a macro without arguments,
    which reads the parameters of :func:`make_ragged_attention_dv` by name (sizes ``n`` and ``B = B1 - 1``)."""
    H, Dq, Dv, dtype = spec.num_heads, spec.self_qk_dim, spec.self_v_dim, spec.dtype
    attrs = _attrs(spec)

    @T.prim_func
    def ragged_attention_dv(
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_q_indptr: T.handle,
        var_o: T.handle,
        var_lse: T.handle,
        sm_scale: T.float32,
    ):
        T.func_attr(attrs)
        n = T.int32()
        B1 = T.int32()
        q = T.match_buffer(var_q, (n, H, Dq), dtype)
        k = T.match_buffer(var_k, (n, H, Dq), dtype)
        v = T.match_buffer(var_v, (n, H, Dv), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (B1,), "int32")
        o = T.match_buffer(var_o, (n, H, Dv), dtype)
        lse = T.match_buffer(var_lse, (n, H), "float32")
        B = T.meta_var(B1 - 1)
        body()

    return ragged_attention_dv


def ragged_dv_tensor_cores(spec: MlaSpec) -> bool:
    """Whether cuda ``ragged_attention_dv`` of ``spec`` takes the tensor-core schedule: fp16 / bf16 and
    ``Dq / 4 + Dv2 / 2 <= 112`` (the Q fragments and O accumulators a thread keeps in registers;
    DeepSeek-V2's 192 / 128 is exactly 112). fp32 and larger shapes use the SIMT schedule."""
    return (
        spec.target_kind == "cuda"
        and spec.dtype in MMA
        and spec.has_self_attention
        and spec.self_qk_dim // 4 + spec.self_v_dim // 2 <= RDV_REGS
    )


def _swz_mask(chunks: int) -> int:
    """XOR mask of the shared-row swizzle of a row of ``chunks`` 16-byte chunks (an even count): the
    largest of 7, 3, 1 that keeps ``chunk ^ (row & mask)`` inside the row (7: the 8 rows one ldmatrix
    phase reads hit 8 bank groups; smaller masks stay correct with some conflicts)."""
    return 7 if chunks % 8 == 0 else 3 if chunks % 4 == 0 else 1


def _rdv_block(bx, ntiles, H: int, head_major: bool):
    """``(head, tile id)`` of block ``bx`` of the tensor-core ``ragged_attention_dv`` (``ntiles`` tile ids
    per head). Head-major: the blocks in flight at once cover few heads, so the K/V tiles they all read
    are shared in L2 (head-minor, every head of a tile side by side, streams each head's K/V from DRAM
    for a few blocks only)."""
    if head_major:
        return bx // T.max(ntiles, 1), bx % T.max(ntiles, 1)
    return bx % H, bx // H


def _swz(row, chunk, mask: int):
    """Element column of 16-byte chunk ``chunk`` of shared row ``row`` (swizzled by ``mask``)."""
    return (chunk ^ (row & mask)) * 8


def make_ragged_attention_dv(
    spec: MlaSpec,
    *,
    tensor_cores: bool = True,
    num_warps: int = RDV_WARPS,
    min_blocks: int | None = None,
    head_major: bool | None = None,
):
    """``ragged_attention_dv(q, k, v, q_indptr, o, lse, sm_scale)``: causal attention among the new
    tokens of each sequence, q/k head dim ``Dq`` and v head dim ``Dv2`` (MLA prefill's self attention).

    Row ``i`` of sequence ``b`` sees rows ``q_indptr[b] .. i`` (docs/layout.md, "Ragged queries",
    causal mask); head ``h`` attends with k/v head ``h``. No RoPE inside.

    Parameters
    ----------
    q, k : [n, H, Dq], spec.dtype
    v : [n, H, Dv2], spec.dtype
    q_indptr : [B + 1], int32
    o : [n, H, Dv2], spec.dtype, **written**
    lse : [n, H], float32, **written** (base 2)
    sm_scale : float32

    cuda schedules: tensor cores where :func:`ragged_dv_tensor_cores` (see ``gpu_tc_body``), else
    SIMT; ``tensor_cores=False`` forces SIMT. ``num_warps`` (query rows per block = 16 x warps) and
    ``min_blocks`` (second argument of ``__launch_bounds__``; None: no register cap) and
    ``head_major`` (block ids run over the query tiles of head 0 first, then head 1, ...; False: over
    the heads of tile 0 first; None: head-major when ``H >= RDV_HEAD_MAJOR_MIN``) are tuning knobs of
    the tensor-core schedule; the defaults are what the cache uses.
    """
    if not spec.has_self_attention:
        raise ValueError(f"{spec.tag} has no self attention dims; give MlaSpec(self_qk_dim=..., self_v_dim=...)")
    if num_warps not in (2, 4, 8):
        raise ValueError(f"num_warps={num_warps} must be 2, 4 or 8")
    H, Dq, Dv, dtype = spec.num_heads, spec.self_qk_dim, spec.self_v_dim, spec.dtype
    VL = CPU_VL
    out_loop = T.serial if dtype == "bfloat16" else T.vectorized

    @macro
    def find_sequence(seq, i):
        seq[SEQ.lo] = 0
        seq[SEQ.hi] = B
        while seq[SEQ.hi] - seq[SEQ.lo] > 1:
            if q_indptr[(seq[SEQ.lo] + seq[SEQ.hi]) // 2] <= i:
                seq[SEQ.lo] = (seq[SEQ.lo] + seq[SEQ.hi]) // 2
            else:
                seq[SEQ.hi] = (seq[SEQ.lo] + seq[SEQ.hi]) // 2
        seq[SEQ.b] = seq[SEQ.lo]

    @macro
    def cpu_body():
        for ih in T.parallel(n * H):
            seq = T.alloc_buffer((len(SEQ),), "int32", scope="local")
            Q = T.alloc_buffer((Dq,), "float32", scope="local")
            O = T.alloc_buffer((Dv,), "float32", scope="local")
            acc = T.alloc_buffer((VL,), "float32", scope="local")
            st = T.alloc_buffer((len(SOFT) + 2,), "float32", scope="local")  # + running max, sum
            i = T.meta_var(ih // H)
            h = T.meta_var(ih % H)
            mm = T.meta_var(len(SOFT))
            ds = T.meta_var(len(SOFT) + 1)
            find_sequence(seq, i)
            for d in T.vectorized(Dq):
                Q[d] = T.Cast("float32", q[i, h, d]) * (sm_scale * T.float32(LOG2E))
            for d in T.vectorized(Dv):
                O[d] = T.float32(0)
            st[mm] = T.float32(NEG_INF)
            st[ds] = T.float32(0)
            for j in T.serial(q_indptr[seq[SEQ.b]], i + 1):
                for l in T.vectorized(VL):
                    acc[l] = T.float32(0)
                for d0 in T.serial(Dq // VL):
                    for l in T.vectorized(VL):
                        acc[l] = acc[l] + Q[d0 * VL + l] * T.Cast("float32", k[j, h, d0 * VL + l])
                st[SOFT.s] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
                st[SOFT.m_new] = T.max(st[mm], st[SOFT.s])
                st[SOFT.alpha] = T.exp2(st[mm] - st[SOFT.m_new])
                st[SOFT.p] = T.exp2(st[SOFT.s] - st[SOFT.m_new])
                st[ds] = st[ds] * st[SOFT.alpha] + st[SOFT.p]
                st[mm] = st[SOFT.m_new]
                for d in T.vectorized(Dv):
                    O[d] = O[d] * st[SOFT.alpha] + st[SOFT.p] * T.Cast("float32", v[j, h, d])
            if st[ds] == T.float32(0):
                for d in out_loop(Dv):
                    o[i, h, d] = T.Cast(dtype, T.float32(0))
                lse[i, h] = T.float32(NEG_INF)
            else:
                for d in out_loop(Dv):
                    o[i, h, d] = T.Cast(dtype, O[d] / st[ds])
                lse[i, h] = st[mm] + T.log2(st[ds])

    GB = divisor_at_most(H, 4)  # heads (warps) per block
    NQ = (Dq + WARP - 1) // WARP
    NDV = (Dv + WARP - 1) // WARP

    @macro
    def gpu_body():
        # block = (row i, GB heads); warp ty = head h; lane tx scores key t * 32 + tx, then lanes
        # spread over Dv2 for P V
        bx = T.launch_thread("blockIdx.x", T.max(n * (H // GB), 1))
        ty = T.launch_thread("threadIdx.y", GB)
        tx = T.launch_thread("threadIdx.x", WARP)
        i = T.meta_var(bx // (H // GB))
        h = T.meta_var(bx % (H // GB) * GB + ty)
        Qs = T.alloc_buffer((GB, Dq), "float32", scope="shared")
        Ps = T.alloc_buffer((GB, WARP), "float32", scope="shared")
        seq = T.alloc_buffer((len(SEQ),), "int32", scope="local")
        rng = T.alloc_buffer((2,), "int32", scope="local")  # first key row, number of keys
        O = T.alloc_buffer((NDV,), "float32", scope="local")
        st = T.alloc_buffer((len(SOFT) + 2,), "float32", scope="local")  # + running max, sum
        mm = T.meta_var(len(SOFT))
        ds = T.meta_var(len(SOFT) + 1)
        rng[1] = 0
        if i < n:
            find_sequence(seq, i)
            rng[0] = q_indptr[seq[SEQ.b]]
            rng[1] = i - rng[0] + 1
            for r in T.unroll(NQ):
                if r * WARP + tx < Dq:
                    Qs[ty, r * WARP + tx] = T.Cast("float32", q[i, h, r * WARP + tx]) * (sm_scale * T.float32(LOG2E))
        for r in T.unroll(NDV):
            O[r] = T.float32(0)
        st[mm] = T.float32(NEG_INF)
        st[ds] = T.float32(0)
        T.tvm_storage_sync("shared")
        for t in T.serial((rng[1] + WARP - 1) // WARP):
            st[SOFT.s] = T.float32(NEG_INF)
            if t * WARP + tx < rng[1]:
                st[SOFT.s] = T.float32(0)
                for d in T.serial(Dq):
                    st[SOFT.s] = st[SOFT.s] + Qs[ty, d] * T.Cast("float32", k[rng[0] + t * WARP + tx, h, d])
            st[SOFT.m_new] = T.max(st[mm], T.cuda.warp_reduce(st[SOFT.s], "max", WARP))
            if st[SOFT.m_new] > T.float32(NEG_INF):
                st[SOFT.alpha] = T.exp2(st[mm] - st[SOFT.m_new])
                st[SOFT.p] = T.exp2(st[SOFT.s] - st[SOFT.m_new])
            else:
                st[SOFT.alpha] = T.float32(1)
                st[SOFT.p] = T.float32(0)
            st[ds] = st[ds] * st[SOFT.alpha] + T.cuda.warp_reduce(st[SOFT.p], "sum", WARP)
            st[mm] = st[SOFT.m_new]
            Ps[ty, tx] = st[SOFT.p]
            T.tvm_storage_sync("shared")
            for r in T.unroll(NDV):
                if r * WARP + tx < Dv:
                    O[r] = O[r] * st[SOFT.alpha]
                    for c in T.serial(WARP):
                        if t * WARP + c < rng[1]:
                            O[r] = O[r] + Ps[ty, c] * T.Cast("float32", v[rng[0] + t * WARP + c, h, r * WARP + tx])
            T.tvm_storage_sync("shared")
        if i < n:
            for r in T.unroll(NDV):
                if r * WARP + tx < Dv:
                    if st[ds] == T.float32(0):
                        o[i, h, r * WARP + tx] = T.Cast(dtype, T.float32(0))
                    else:
                        o[i, h, r * WARP + tx] = T.Cast(dtype, O[r] / st[ds])
            if tx == 0:
                if st[ds] == T.float32(0):
                    lse[i, h] = T.float32(NEG_INF)
                else:
                    lse[i, h] = st[mm] + T.log2(st[ds])

    # ---- tensor-core schedule (FlashAttention-2 forward; the approach of tvmkv.tir.prefill_cuda with
    # group 1 and separate q/k and v head dims). Block = (query tile of BR = 16 NW rows of one sequence,
    # head h), NW warps of 16 rows each. Tile ids of sequence b start at tile_start(q_indptr[b], b, BR)
    # (binary search, no planning array; the last, heaviest causal tile of a sequence runs first). K / V
    # tiles of RDV_BC keys stream through two stages of dynamic shared memory by cp.async (16-byte
    # chunks, XOR-swizzled rows): tile kt + 1 is in flight while tile kt is used. The Q tile is staged
    # in stage 1, read into registers (ldmatrix, KD k16 fragments per warp) before tile 1 overwrites it.
    # S = Q K^T (mma m16n8k16, fp32) stays in the accumulators; the causal mask runs on the tiles past
    # the block's first row; online softmax in base 2 on the registers; P is repacked as the A operand
    # of O += P V (V by ldmatrix.trans). Keys past the block's last row re-read that row's key (masked).
    NW = num_warps
    BR = 16 * NW
    NT = WARP * NW
    BC = RDV_BC
    CQ, CV = Dq // 8, Dv // 8  # 16-byte chunks of a q/k row and of a v row
    MQ, MV = _swz_mask(CQ), _swz_mask(CV)
    KD, DN, NI = Dq // 16, Dv // 8, BC // 8  # k16 steps of Q K^T, n8 tiles of O, n8 tiles of S
    STAGE = BC * (Dq + Dv)  # elements of one stage: K rows, then V rows
    SM_ELEMS = max(2 * STAGE, STAGE + BR * Dq)  # Q (BR rows) staged from element STAGE on
    QI, KI, VI = (-(-(rows * c) // NT) for rows, c in ((BR, CQ), (BC, CQ), (BC, CV)))
    mma = MMA.get(dtype, MMA["float16"])
    cvt = RDV_CVT.get(dtype, RDV_CVT["float16"])
    neg_inf = NEG_INF
    bound_blocks = bool(min_blocks)
    by_head = H >= RDV_HEAD_MAJOR_MIN if head_major is None else bool(head_major)
    MIN_BLOCKS = int(min_blocks or 0)

    @macro
    def tc_issue_kv(sm, sv, tx, h, kt, stg):
        # cp.async of the K and V rows of key tile kt into stage stg (keys past klen: the last key)
        for i in T.unroll(KI):
            if tx + i * NT < BC * CQ:
                kr, kc = T.meta_var(load_rc(tx, i, NT, CQ))
                T.ptx[CP16](
                    sm.ptr_to([stg * STAGE + kr * Dq + _swz(kr, kc, MQ)]),
                    k.ptr_to([sv[RDV.qbase] + T.min(kt * BC + kr, sv[RDV.klen] - 1), h, kc * 8]),
                    16,
                )
        for i in T.unroll(VI):
            if tx + i * NT < BC * CV:
                vr, vc = T.meta_var(load_rc(tx, i, NT, CV))
                T.ptx[CP16](
                    sm.ptr_to([stg * STAGE + BC * Dq + vr * Dv + _swz(vr, vc, MV)]),
                    v.ptr_to([sv[RDV.qbase] + T.min(kt * BC + vr, sv[RDV.klen] - 1), h, vc * 8]),
                    16,
                )

    @macro
    def gpu_tc_body():
        bx = T.launch_thread("blockIdx.x", T.max((n // BR + B) * H, 1))  # max: no empty grid
        tx = T.launch_thread("threadIdx.x", NT)
        lane = T.meta_var(tx % WARP)
        w = T.meta_var(tx // WARP)
        h, tile = T.meta_var(_rdv_block(bx, n // BR + B, H, by_head))
        if bound_blocks:
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MIN_BLOCKS)
        # float32 words: kernels of several dtypes in one module declare the same extern __shared__ array
        sm_raw = T.alloc_buffer((SM_ELEMS // 2,), "float32", scope="shared.dyn")
        sm = T.decl_buffer((SM_ELEMS,), dtype, data=sm_raw.data, scope="shared.dyn")
        sv = T.alloc_buffer((len(RDV),), "int32", scope="local")
        rpos = T.alloc_buffer((2,), "int32", scope="local")  # last visible key of rows g, g + 8
        qf = T.alloc_buffer((KD, 4), "uint32", scope="local")
        kf = T.alloc_buffer((4,), "uint32", scope="local")
        vf = T.alloc_buffer((4,), "uint32", scope="local")
        pf = T.alloc_buffer((4,), "uint32", scope="local")
        s = T.alloc_buffer((NI, 4), "float32", scope="local")
        o_acc = T.alloc_buffer((DN, 4), "float32", scope="local")
        m = T.alloc_buffer((2,), "float32", scope="local")
        lsum = T.alloc_buffer((2,), "float32", scope="local")
        mx = T.alloc_buffer((2,), "float32", scope="local")
        base = T.alloc_buffer((2,), "float32", scope="local")
        alpha = T.alloc_buffer((2,), "float32", scope="local")
        sl2 = T.alloc_buffer((1,), "float32", scope="local")
        rinv = T.alloc_buffer((2,), "float32", scope="local")
        pk = T.alloc_buffer((1,), "uint32", scope="local")
        o_pairs = T.decl_buffer((n * H * Dv // 2,), "uint32", data=o.data)  # o as packed element pairs
        if tile < n // BR + B:
            # ---- the block's sequence: largest b with tile_start(b) <= tile
            sv[RDV.lo] = 0
            sv[RDV.hi] = B
            while sv[RDV.hi] - sv[RDV.lo] > 1:
                if tile_start(q_indptr[(sv[RDV.lo] + sv[RDV.hi]) // 2], (sv[RDV.lo] + sv[RDV.hi]) // 2, BR) <= tile:
                    sv[RDV.lo] = (sv[RDV.lo] + sv[RDV.hi]) // 2
                else:
                    sv[RDV.hi] = (sv[RDV.lo] + sv[RDV.hi]) // 2
            sv[RDV.b] = sv[RDV.lo]
            sv[RDV.qbase] = q_indptr[sv[RDV.b]]
            sv[RDV.ntile] = (q_indptr[sv[RDV.b] + 1] - sv[RDV.qbase] + BR - 1) // BR
            sv[RDV.lt] = sv[RDV.ntile] - 1 - (tile - tile_start(sv[RDV.qbase], sv[RDV.b], BR))  # last tile first
            if sv[RDV.lt] >= 0:
                sv[RDV.t0] = sv[RDV.qbase] + sv[RDV.lt] * BR
                sv[RDV.ntok] = T.min(BR, q_indptr[sv[RDV.b] + 1] - sv[RDV.t0])
                sv[RDV.klen] = sv[RDV.t0] - sv[RDV.qbase] + sv[RDV.ntok]
                sv[RDV.nkt] = (sv[RDV.klen] + BC - 1) // BC
                for hh in T.unroll(2):  # rows past the tile's tokens repeat its last token (not stored)
                    rpos[hh] = sv[RDV.t0] - sv[RDV.qbase] + T.min(w * 16 + lane // 4 + 8 * hh, sv[RDV.ntok] - 1)
                sl2[0] = sm_scale * T.float32(LOG2E)
                for hh in T.unroll(2):
                    m[hh] = T.float32(neg_inf)
                    lsum[hh] = T.float32(0)
                for dn in T.unroll(DN):
                    for r in T.unroll(4):
                        o_acc[dn, r] = T.float32(0)
                # ---- Q tile (own cp.async group, staged in stage 1), then K/V tile 0 into stage 0
                for i in T.unroll(QI):
                    if tx + i * NT < BR * CQ:
                        qr, qc = T.meta_var(load_rc(tx, i, NT, CQ))
                        T.ptx[CP16](
                            sm.ptr_to([STAGE + qr * Dq + _swz(qr, qc, MQ)]),
                            q.ptr_to([sv[RDV.t0] + T.min(qr, sv[RDV.ntok] - 1), h, qc * 8]),
                            16,
                        )
                T.ptx["cp.async.commit_group"]()
                tc_issue_kv(sm, sv, tx, h, 0, 0)
                T.ptx["cp.async.commit_group"]()
                T.ptx["cp.async.wait_group"](1)
                T.tvm_storage_sync("shared")
                for kk in T.unroll(KD):
                    ar, ac = T.meta_var(lane_rowmajor16(lane))
                    T.ptx[LDSM](
                        qf[kk, 0],
                        qf[kk, 1],
                        qf[kk, 2],
                        qf[kk, 3],
                        sm.ptr_to([STAGE + (w * 16 + ar) * Dq + _swz(w * 16 + ar, kk * 2 + ac, MQ)]),
                    )
                # ---- key tiles: tile kt + 1 streams in while tile kt is computed
                for kt in T.serial(sv[RDV.nkt]):
                    T.tvm_storage_sync("shared")  # every warp is done with stage (kt + 1) % 2 (and with Q)
                    if kt + 1 < sv[RDV.nkt]:
                        tc_issue_kv(sm, sv, tx, h, kt + 1, (kt + 1) % 2)
                    T.ptx["cp.async.commit_group"]()
                    T.ptx["cp.async.wait_group"](1)
                    T.tvm_storage_sync("shared")
                    # S = Q K^T: the warp's 16 rows x BC keys
                    for ni in T.unroll(NI):
                        for r in T.unroll(4):
                            s[ni, r] = T.float32(0)
                    for kk in T.unroll(KD):
                        for nj in T.unroll(NI // 2):
                            kn, kc = T.meta_var(lane_kmajor_b(lane))
                            T.ptx[LDSM](
                                kf[0],
                                kf[1],
                                kf[2],
                                kf[3],
                                sm.ptr_to([kt % 2 * STAGE + (nj * 16 + kn) * Dq + _swz(nj * 16 + kn, kk * 2 + kc, MQ)]),
                            )
                            for half in T.unroll(2):
                                T.ptx[mma](
                                    s[nj * 2 + half, 0],
                                    s[nj * 2 + half, 1],
                                    s[nj * 2 + half, 2],
                                    s[nj * 2 + half, 3],
                                    qf[kk, 0],
                                    qf[kk, 1],
                                    qf[kk, 2],
                                    qf[kk, 3],
                                    kf[half * 2],
                                    kf[half * 2 + 1],
                                    s[nj * 2 + half, 0],
                                    s[nj * 2 + half, 1],
                                    s[nj * 2 + half, 2],
                                    s[nj * 2 + half, 3],
                                )
                    # causal mask, only on tiles that reach past the block's first row
                    if (kt + 1) * BC > sv[RDV.t0] - sv[RDV.qbase] + 1:
                        for ni in T.unroll(NI):
                            for r in T.unroll(4):
                                s[ni, r] = T.if_then_else(
                                    kt * BC + ni * 8 + lane % 4 * 2 + r % 2 <= rpos[r // 2],
                                    s[ni, r],
                                    T.float32(neg_inf),
                                )
                    # online softmax: regs 0, 1 -> row g, regs 2, 3 -> row g + 8; 4 lanes share a row
                    for hh in T.unroll(2):
                        mx[hh] = T.max(s[0, 2 * hh], s[0, 2 * hh + 1])
                        for ni in T.unroll(1, NI):
                            mx[hh] = T.max(mx[hh], T.max(s[ni, 2 * hh], s[ni, 2 * hh + 1]))
                        mx[hh] = T.max(m[hh], T.cuda.warp_reduce(mx[hh], "max", 4) * sl2[0])
                        base[hh] = T.if_then_else(mx[hh] == T.float32(neg_inf), T.float32(0), mx[hh])
                        alpha[hh] = T.exp2(m[hh] - base[hh])
                        m[hh] = mx[hh]
                        lsum[hh] = lsum[hh] * alpha[hh]
                        for ni in T.unroll(NI):
                            for c in T.unroll(2):
                                s[ni, 2 * hh + c] = T.exp2(s[ni, 2 * hh + c] * sl2[0] - base[hh])
                                lsum[hh] = lsum[hh] + s[ni, 2 * hh + c]
                        for dn in T.unroll(DN):
                            for c in T.unroll(2):
                                o_acc[dn, 2 * hh + c] = o_acc[dn, 2 * hh + c] * alpha[hh]
                    # O += P V: S tiles (2kk, 2kk + 1) are the A fragment of key step kk
                    for kk in T.unroll(BC // 16):
                        T.ptx[cvt](pf[0], s[2 * kk, 1], s[2 * kk, 0])  # hi, lo
                        T.ptx[cvt](pf[1], s[2 * kk, 3], s[2 * kk, 2])
                        T.ptx[cvt](pf[2], s[2 * kk + 1, 1], s[2 * kk + 1, 0])
                        T.ptx[cvt](pf[3], s[2 * kk + 1, 3], s[2 * kk + 1, 2])
                        for nj in T.unroll(DN // 2):
                            vr, vc = T.meta_var(lane_rowmajor16(lane))
                            T.ptx[LDSM_T](
                                vf[0],
                                vf[1],
                                vf[2],
                                vf[3],
                                sm.ptr_to(
                                    [
                                        kt % 2 * STAGE
                                        + BC * Dq
                                        + (kk * 16 + vr) * Dv
                                        + _swz(kk * 16 + vr, nj * 2 + vc, MV)
                                    ]
                                ),
                            )
                            for half in T.unroll(2):
                                T.ptx[mma](
                                    o_acc[nj * 2 + half, 0],
                                    o_acc[nj * 2 + half, 1],
                                    o_acc[nj * 2 + half, 2],
                                    o_acc[nj * 2 + half, 3],
                                    pf[0],
                                    pf[1],
                                    pf[2],
                                    pf[3],
                                    vf[half * 2],
                                    vf[half * 2 + 1],
                                    o_acc[nj * 2 + half, 0],
                                    o_acc[nj * 2 + half, 1],
                                    o_acc[nj * 2 + half, 2],
                                    o_acc[nj * 2 + half, 3],
                                )
                T.ptx["cp.async.wait_group"](0)
                # ---- o = O / l, lse = m + log2(l) (a row without keys: o = 0, lse = -inf); o leaves as
                # packed element pairs (32-bit stores)
                for hh in T.unroll(2):
                    lsum[hh] = T.cuda.warp_reduce(lsum[hh], "sum", 4)
                    rinv[hh] = T.if_then_else(lsum[hh] == T.float32(0), T.float32(0), T.float32(1) / lsum[hh])
                for hh in T.unroll(2):
                    if w * 16 + lane // 4 + 8 * hh < sv[RDV.ntok]:
                        for dn in T.unroll(DN):
                            T.ptx[cvt](pk[0], o_acc[dn, 2 * hh + 1] * rinv[hh], o_acc[dn, 2 * hh] * rinv[hh])
                            o_pairs[
                                ((sv[RDV.t0] + w * 16 + lane // 4 + 8 * hh) * H + h) * (Dv // 2) + dn * 4 + lane % 4
                            ] = pk[0]
                        if lane % 4 == 0:
                            lse[sv[RDV.t0] + w * 16 + lane // 4 + 8 * hh, h] = T.if_then_else(
                                lsum[hh] == T.float32(0), T.float32(neg_inf), m[hh] + T.log2(lsum[hh])
                            )

    if spec.is_cpu:
        return ragged_attention_dv_func(spec, cpu_body)
    if tensor_cores and ragged_dv_tensor_cores(spec):
        return ragged_attention_dv_func(spec, gpu_tc_body)
    return ragged_attention_dv_func(spec, gpu_body)


# ---------------------------------------------------------------------------------------------------
# the kernel set
# ---------------------------------------------------------------------------------------------------


def kernel_set(spec: MlaSpec, arch: str | None = None) -> dict:
    """Every kernel of an MLA cache configuration, by name: ``mla_append``, ``mla_attention``,
    ``mla_attention_split`` and ``mla_merge_splits`` (flash-decoding over key chunks), ``mla_gather``,
    ``mla_copy_page``, ``copy_page_layers`` (every layer's copy in one launch), ``merge_any``, and
    ``ragged_attention_dv`` when ``spec`` has self attention dims. ``arch``: the CUDA arch they are built
    for (sm_90: warpgroup-MMA attention)."""
    if not isinstance(spec, MlaSpec):
        raise TypeError(f"tvmkv.tir.mla.kernel_set takes an MlaSpec, got {type(spec).__name__}")
    kernels = {
        "mla_append": make_mla_append(spec),
        "mla_attention": make_mla_attention(spec, arch=arch),
        "mla_gather": make_mla_gather(spec),
        "mla_copy_page": make_mla_copy_page(spec),
        "copy_page_layers": make_copy_page_layers(
            1, spec.page_size, spec.head_dim * dtype_bytes(spec.dtype), is_cpu=spec.is_cpu, attrs=_attrs(spec)
        ),
        "merge_any": make_merge_any(spec),
        "mla_attention_split": make_mla_attention(spec, split=True, arch=arch),
        "mla_merge_splits": make_mla_merge_splits(spec),
    }
    if spec.has_self_attention:
        kernels["ragged_attention_dv"] = make_ragged_attention_dv(spec)
    return kernels
