# ruff: noqa: F821, F841
# (the TVMScript macros below name the kernel's buffers and variables, which ruff cannot see)
"""Tensor-core CUDA schedule of the paged and ragged prefill kernels. See docs/layout.md.

A flash-attention-2 style forward written with raw PTX through ``T.ptx[...]`` (the route of
/work/shared/TENSORCORE.md): ``cp.async`` of 16-byte chunks into XOR-swizzled shared memory,
``ldmatrix`` into mma fragments, ``mma.sync.m16n8k16`` with fp32 accumulation, the scores ``S``
kept in the accumulator registers, the online softmax in base 2 on those registers, and ``P``
repacked in registers as the A operand of ``O += P V`` (no trip through shared memory).

Work decomposition
------------------
* One thread block = (query tile, kv head ``hk``), ``NW`` warps (default 4), ``BR = 16 NW`` query
  rows, key/value tiles of ``BC = 64`` keys double-buffered in dynamic shared memory (64 KiB for
  D 128); the Q tile is staged in the second buffer, which is first overwritten (by key tile 1)
  after every warp holds its Q fragments in registers. Ragged kernels are compiled with
  ``__launch_bounds__(128, 3)`` (3 blocks per SM), paged ones without a register cap
  (``DEFAULT_MIN_BLOCKS``).
* GQA: the ``group`` query heads of ``hk`` are packed as rows of the Q tile, row ``r`` = token
  ``r // group`` of the tile, head ``hk * group + r % group``; a tile holds ``RT = BR / group``
  tokens of one sequence, so every K/V tile is read once per kv head and used by all its heads.
* Query tiles never span sequences. Tile ids of sequence ``b`` start at
  ``start(b) = q_indptr[b] // RT + b`` (strictly increasing, each range holds the sequence's
  ``ceil(len / RT)`` tiles plus at most one idle id), so a block finds its sequence by binary
  search over ``q_indptr`` with no planning array: ``n // RT + B`` tile ids per kv head in all.
  Within a sequence the last (heaviest causal) tile runs first.
* K/V rows are gathered through the page table per tile (paged): each thread prefetches the page
  ids of its rows one tile ahead, then issues 16-byte ``cp.async`` per row chunk; keys past the
  sequence end re-read its last key and are masked. Ragged reads the new tokens' ``k`` / ``v``.
* Causal: a key ``j`` is visible to row ``i`` iff ``j <= q_pos[i]`` (paged; with history ``h``
  and no window ``q_pos = h + i``) or ``j <= i - q_indptr[b]`` (ragged). The key loop stops after
  the tile holding the largest visible key of the block; the per-element mask runs only on tiles
  past the smallest row bound (or past the sequence end). Positions are reduced through fp32, exact
  below 2^24.
* Output: ``o`` and the base-2 ``lse`` exactly as the generic schedule; a row that sees no key
  gets ``o = 0``, ``lse = -inf``. ``o`` is written as packed element pairs (32-bit stores).

Fast path (``prefill_layout`` returns a layout) — everything else uses the generic schedule of
:mod:`tvmkv.tir.attention_generic` explicitly:

* target cuda, dtype float16 or bfloat16 (fp32 falls back),
* head_dim 64 or 128 (others fall back),
* mask "none" or "causal" (tree falls back), no sliding window / attention sink, no inline RoPE
  (both fall back),
* ``group`` divides ``BR`` (with 4 warps: group in 1, 2, 4, 8, 16, 32, 64).

The NumPy model in tests/test_prefill_cuda_model.py replays this index math with the helpers below.
"""

from __future__ import annotations

from collections import namedtuple

from tvm.script import tirx as T

from ._kernel_common import LOG2E, WARP, macro, slots
from .attention import paged_prefill_func, ragged_prefill_func
from .fp8 import kv_scale_buffer, times_key_scale, times_value_scale, widen_pair
from .spec import KernelSpec

DEFAULT_WARPS = 4
# __launch_bounds__(NT, min blocks per SM) by source: ragged 3 (3 blocks of 64 KiB shared memory per SM,
# registers capped at 168: 1x4096 causal 512 -> 461 us, 8x512 98 -> 89 us on an H200), paged none
# (the cap cost 12% on 4x1024 new tokens over 2048 of history: 644 -> 730 us)
DEFAULT_MIN_BLOCKS = {"ragged": 3, "paged": None}
BC = 64  # keys per K/V tile
CP16 = "cp.async.cg.shared.global"
LDSM = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
LDSM_T = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
MMA = {
    "float16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    "bfloat16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
}
CVT = {"float16": "cvt.rn.f16x2.f32", "bfloat16": "cvt.rn.bf16x2.f32"}


# ---- layout helpers: plain functions of ints or TIR expressions (the NumPy model in
# tests/test_prefill_cuda_model.py calls the same ones)
def swz(row, chunk):
    """Column of 16-byte chunk ``chunk`` of shared row ``row`` (XOR swizzle of the low 3 chunk bits,
    so the 8 rows an ldmatrix phase reads hit 8 different bank groups)."""
    return (chunk ^ (row & 7)) * 8


def lane_rowmajor16(lane):
    """ldmatrix.x4 address of a lane for an A operand [m][k] (or a ``.trans`` B stored [k][n]):
    (row, chunk) inside a 16x16 block."""
    return lane % 16, lane // 16


def lane_kmajor_b(lane):
    """ldmatrix.x4 address for a B operand stored [n][k] (K rows): two n8 tiles of one k16 step."""
    return (lane // 16) * 8 + lane % 8, (lane // 8) % 2


def acc_rc(lane, r):
    """m16n8 accumulator register ``r`` of ``lane`` -> (row, col) in the 16x8 tile."""
    return lane // 4 + 8 * (r // 2), 2 * (lane % 4) + r % 2


def k_row(st, r):
    """Shared row of key ``r`` of stage ``st``: stages are [K (BC rows), V (BC rows)] back to back."""
    return st * 2 * BC + r


def v_row(st, r):
    """Shared row of value ``r`` of stage ``st``."""
    return st * 2 * BC + BC + r


def q_row(r):
    """Shared row of Q tile row ``r``: the Q tile aliases stage 1, which is first written (tile 1)
    after every warp has read its Q fragments into registers."""
    return 2 * BC + r


SMEM_ROWS = 4 * BC  # two stages of K and V

# sv, the block's scalars (uniform across the block; see _kernel_common.slots): its sequence b, its
# tile lt within the sequence, the tile's first token t0 and token count ntok, the sequence's kv_len
# and first page entry (paged) or key row (ragged) kbase, the key tiles to scan (nkt), the first key
# that needs the mask (kfull), the sequence's first row qbase and tile count ntile, and lo / hi of the
# binary search for b
BLOCK = slots("b", "lt", "t0", "ntok", "kv_len", "kbase", "nkt", "kfull", "qbase", "lo", "hi", "ntile")
# the thread's coordinates and local buffers, passed to the helper macros
PrefillThread = namedtuple(
    "PrefillThread", "tx lane hk sv sm pid qf kf vf pf s o_acc m lsum mx base alpha sl2 rpos sm_pairs c8 c8_pairs h4 f2"
)


def tile_start(q_indptr_b, b, RT):
    """First tile id of sequence ``b``: strictly increasing in ``b`` and leaving room for
    ``ceil(len_b / RT)`` tiles."""
    return q_indptr_b // RT + b


def load_rc(tid, i, NT, CPR):
    """The ``i``-th 16-byte chunk copied by thread ``tid`` of a tile with ``CPR`` chunks per row:
    (row, chunk)."""
    return (tid + i * NT) // CPR, (tid + i * NT) % CPR


def kv_rc(tid, i, NT, CPR):
    """The ``i``-th 16-byte chunk thread ``tid`` copies of a K or V tile: (row within the tile,
    chunk). The chunk is the same for every ``i``, so a thread's rows are ``NT // CPR`` apart."""
    return tid // CPR + i * (NT // CPR), tid % CPR


def prefill_layout(
    spec: KernelSpec, *, mask: str, sliding: bool = False, inline_rope: bool = False, num_warps: int = DEFAULT_WARPS
):
    """Static layout of the tensor-core path, or ``None`` where the generic schedule is used.

    Returns a dict: NW (warps), BR (query rows per block), RT (tokens per block), NT (threads),
    CPR (16-byte chunks per row), QI / KVI (chunks per thread of the Q / one K or V tile).
    """
    D, group = spec.head_dim, spec.group
    BR = 16 * num_warps
    NT = WARP * num_warps
    CPR = D // 8
    if (
        spec.target_kind != "cuda"
        or spec.dtype not in MMA
        or D not in (64, 128)
        or mask not in ("none", "causal")
        or sliding
        or inline_rope
        or BR % group
        or BR > 2 * BC
        or NT % CPR
        or (BR * CPR) % NT
        or (BC * CPR) % NT
    ):
        return None
    return {
        "NW": num_warps,
        "BR": BR,
        "RT": BR // group,
        "NT": NT,
        "CPR": CPR,
        "QI": BR * CPR // NT,
        "KVI": BC * CPR // NT,
    }


# What the tensor-core schedules share (this module's mma.sync one and tvmkv.tir.prefill_hopper's
# wgmma one): the same work decomposition, GQA packing, causal range, score-register layout (per warp
# m16n8 groups: regs 0, 1 -> row g, regs 2, 3 -> row g + 8) and output.
BlockMacros = namedtuple("BlockMacros", "locate key_range softmax store")


def block_macros(spec: KernelSpec, *, source: str, mask: str, RT: int, NW: int, BC: int, scale=None) -> BlockMacros:
    """The TVMScript macros of a prefill block both tensor-core schedules expand (``RT`` tokens and
    ``NW`` warps a block, ``BC`` keys a tile); they read the signature's buffers by name and take the
    kernel's state as arguments:

    * ``locate(bx, sv)``: the block's sequence (binary search over ``q_indptr``) and tile ``lt``
      (``< 0``: an idle tile id);
    * ``key_range(tx, lane, w, sv, rpos, red, pf32)``: the tile's tokens, the sequence's keys, the
      causal bound of the thread's rows, the key tiles to scan (``nkt``) and the first key that needs
      the mask (``kfull``); block-wide (a barrier in paged causal);
    * ``softmax(kt, lane, sv, rpos, s, m, lsum, mx, base, alpha, sl2, o_acc, rescale)``: mask tile
      ``kt``'s scores and turn them into ``P``; ``alpha`` holds the factor ``O`` is scaled by, here when
      ``rescale`` (a Python bool), else by the caller once no wgmma is accumulating into ``O``;
    * ``store(lane, w, hk, sv, o_acc, m, lsum, rinv, pk, o_pairs)``: ``o = O / l`` as packed pairs and
      ``lse = m + log2(l)``; a row without keys gets ``o = 0``, ``lse = -inf``.
    """
    H_qo, H_kv, D, P, group = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.group
    paged = source == "paged"
    causal = mask == "causal"
    cvt = CVT[spec.dtype]
    NI = BC // 8  # n8 score groups of a warp
    DN = D // 8  # n8 output groups of a warp
    neg_inf = float("-inf")

    @macro
    def locate(bx, sv):
        # largest b with tile_start(b) <= tile id; the last (heaviest causal) tile of a sequence first
        sv[BLOCK.lo] = 0
        sv[BLOCK.hi] = B
        while sv[BLOCK.hi] - sv[BLOCK.lo] > 1:
            if (
                tile_start(q_indptr[(sv[BLOCK.lo] + sv[BLOCK.hi]) // 2], (sv[BLOCK.lo] + sv[BLOCK.hi]) // 2, RT)
                <= bx // H_kv
            ):
                sv[BLOCK.lo] = (sv[BLOCK.lo] + sv[BLOCK.hi]) // 2
            else:
                sv[BLOCK.hi] = (sv[BLOCK.lo] + sv[BLOCK.hi]) // 2
        sv[BLOCK.b] = sv[BLOCK.lo]
        sv[BLOCK.qbase] = q_indptr[sv[BLOCK.b]]
        sv[BLOCK.ntile] = (q_indptr[sv[BLOCK.b] + 1] - sv[BLOCK.qbase] + RT - 1) // RT
        sv[BLOCK.lt] = sv[BLOCK.ntile] - 1 - (bx // H_kv - tile_start(sv[BLOCK.qbase], sv[BLOCK.b], RT))

    @macro
    def key_range(tx, lane, w, sv, rpos, red, pf32):
        sv[BLOCK.t0] = sv[BLOCK.qbase] + sv[BLOCK.lt] * RT
        sv[BLOCK.ntok] = T.min(RT, q_indptr[sv[BLOCK.b] + 1] - sv[BLOCK.t0])
        if paged:
            sv[BLOCK.kbase] = page_indptr[sv[BLOCK.b]]
            sv[BLOCK.kv_len] = 0
            if page_indptr[sv[BLOCK.b] + 1] > page_indptr[sv[BLOCK.b]]:
                sv[BLOCK.kv_len] = (page_indptr[sv[BLOCK.b] + 1] - page_indptr[sv[BLOCK.b]] - 1) * P + last_page_len[
                    sv[BLOCK.b]
                ]
        else:
            sv[BLOCK.kbase] = sv[BLOCK.qbase]
            sv[BLOCK.kv_len] = q_indptr[sv[BLOCK.b] + 1] - sv[BLOCK.qbase]
        # causal bound of this thread's rows (w * 16 + g and + 8), token clamped into the tile
        for h in T.unroll(2):
            if paged:
                rpos[h] = q_pos[sv[BLOCK.t0] + T.min((w * 16 + lane // 4 + 8 * h) // group, sv[BLOCK.ntok] - 1)]
            else:
                rpos[h] = (
                    sv[BLOCK.t0] - sv[BLOCK.qbase] + T.min((w * 16 + lane // 4 + 8 * h) // group, sv[BLOCK.ntok] - 1)
                )
        # key range of the block: scan [0, kend), mask from kfull on
        if causal:
            if paged:
                pf32[0] = T.Cast("float32", q_pos[sv[BLOCK.t0] + T.min(tx % RT, sv[BLOCK.ntok] - 1)])
                pf32[1] = T.cuda.warp_reduce(pf32[0], "max", WARP)
                pf32[0] = T.cuda.warp_reduce(-pf32[0], "max", WARP)
                if lane == 0:
                    red[0, w] = pf32[1]
                    red[1, w] = pf32[0]
                T.tvm_storage_sync("shared")
                pf32[1] = red[0, 0]
                pf32[0] = red[1, 0]
                for k2 in T.unroll(1, NW):
                    pf32[1] = T.max(pf32[1], red[0, k2])
                    pf32[0] = T.max(pf32[0], red[1, k2])
                sv[BLOCK.nkt] = T.max(T.min(sv[BLOCK.kv_len], T.Cast("int32", pf32[1]) + 1), 0)
                sv[BLOCK.kfull] = T.max(T.min(sv[BLOCK.kv_len], 1 - T.Cast("int32", pf32[0])), 0)
            else:
                sv[BLOCK.nkt] = sv[BLOCK.t0] - sv[BLOCK.qbase] + sv[BLOCK.ntok]
                sv[BLOCK.kfull] = sv[BLOCK.t0] - sv[BLOCK.qbase] + 1
        else:
            sv[BLOCK.nkt] = sv[BLOCK.kv_len]
            sv[BLOCK.kfull] = sv[BLOCK.kv_len]
        sv[BLOCK.nkt] = (sv[BLOCK.nkt] + BC - 1) // BC

    @macro
    def softmax(kt, lane, sv, rpos, s, m, lsum, mx, base, alpha, sl2, o_acc, rescale):
        # ---- mask (only tiles past the smallest row bound or the sequence end)
        if (kt + 1) * BC > sv[BLOCK.kfull]:
            for ni in T.unroll(NI):
                for r in T.unroll(4):
                    if causal:
                        s[ni, r] = T.if_then_else(
                            kt * BC + ni * 8 + lane % 4 * 2 + r % 2 < T.min(sv[BLOCK.kv_len], rpos[r // 2] + 1),
                            s[ni, r],
                            T.float32(neg_inf),
                        )
                    else:
                        s[ni, r] = T.if_then_else(
                            kt * BC + ni * 8 + lane % 4 * 2 + r % 2 < sv[BLOCK.kv_len], s[ni, r], T.float32(neg_inf)
                        )
        # ---- online softmax on the accumulators in base 2
        for h in T.unroll(2):
            mx[h] = T.max(s[0, 2 * h], s[0, 2 * h + 1])
            for ni in T.unroll(1, NI):
                mx[h] = T.max(mx[h], T.max(s[ni, 2 * h], s[ni, 2 * h + 1]))
            mx[h] = T.max(m[h], T.cuda.warp_reduce(mx[h], "max", 4) * sl2[0])  # 4 lanes share a row
            # subtract a finite base: a row with no visible key so far keeps p = 0, alpha = 0
            base[h] = T.if_then_else(mx[h] == T.float32(neg_inf), T.float32(0), mx[h])
            alpha[h] = T.exp2(m[h] - base[h])
            m[h] = mx[h]
            lsum[h] = lsum[h] * alpha[h]
            for ni in T.unroll(NI):
                for c in T.unroll(2):
                    s[ni, 2 * h + c] = T.exp2(s[ni, 2 * h + c] * sl2[0] - base[h])
                    lsum[h] = lsum[h] + s[ni, 2 * h + c]
            if rescale:  # (a Python bool) O *= alpha here; else the caller does it when O is free
                for dn in T.unroll(DN):
                    for c in T.unroll(2):
                        o_acc[dn, 2 * h + c] = o_acc[dn, 2 * h + c] * alpha[h]

    @macro
    def store(lane, w, hk, sv, o_acc, m, lsum, rinv, pk, o_pairs):
        # one reciprocal per row (a NaN l, from NaN inputs, propagates); o leaves as packed element pairs
        for h in T.unroll(2):
            lsum[h] = T.cuda.warp_reduce(lsum[h], "sum", 4)
            rinv[h] = T.if_then_else(
                lsum[h] == T.float32(0), T.float32(0), times_value_scale(T.float32(1), scale, hk) / lsum[h]
            )
        for h in T.unroll(2):
            if (w * 16 + lane // 4 + 8 * h) // group < sv[BLOCK.ntok]:
                for dn in T.unroll(DN):
                    T.ptx[cvt](pk[0], o_acc[dn, 2 * h + 1] * rinv[h], o_acc[dn, 2 * h] * rinv[h])  # hi, lo
                    o_pairs[
                        (
                            (sv[BLOCK.t0] + (w * 16 + lane // 4 + 8 * h) // group) * H_qo
                            + hk * group
                            + (w * 16 + lane // 4 + 8 * h) % group
                        )
                        * (D // 2)
                        + dn * 4
                        + lane % 4
                    ] = pk[0]
                if lane % 4 == 0:
                    lse[
                        sv[BLOCK.t0] + (w * 16 + lane // 4 + 8 * h) // group,
                        hk * group + (w * 16 + lane // 4 + 8 * h) % group,
                    ] = T.if_then_else(lsum[h] == T.float32(0), T.float32(neg_inf), m[h] + T.log2(lsum[h]))

    return BlockMacros(locate, key_range, softmax, store)


def make_prefill_cuda(
    spec: KernelSpec,
    *,
    source: str,
    mask: str,
    num_warps: int = DEFAULT_WARPS,
    min_blocks: int | None | str = "auto",
    fused_qkv: bool = False,
):
    """The tensor-core PrimFunc for ``source`` "paged" (signature of ``prefill.make_paged_prefill``)
    or "ragged" (signature of ``ragged.make_ragged_prefill``). The caller checks
    :func:`prefill_layout` first.

    ``num_warps`` (query rows per block = 16 x warps) and ``min_blocks`` (the second argument of
    ``__launch_bounds__``, None for no register cap, "auto" for ``DEFAULT_MIN_BLOCKS[source]``) are
    tuning knobs; the defaults are what the runtime uses. ``fused_qkv``: the ``*_qkv`` signature (q,
    and for ragged k and v, read from the fused qkv)."""
    assert source in ("paged", "ragged")
    lay = prefill_layout(spec, mask=mask, num_warps=num_warps)
    assert lay is not None, "make_prefill_cuda called for a configuration outside the fast path"
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    group = spec.group
    NW, BR, RT, NT, CPR, QI, KVI = (lay[k] for k in ("NW", "BR", "RT", "NT", "CPR", "QI", "KVI"))
    LOGP = P.bit_length() - 1
    PMASK = P - 1
    paged = source == "paged"
    # fp8 pages (tvmkv.tir.fp8): a K/V row is loaded (8 codes), converted to the 16-bit dtype (exact) and
    # stored to shared memory by the thread, in place of its 16-byte cp.async; the K scale joins the
    # score factor and the V scale the output's reciprocal
    fp8 = paged and spec.fp8_pages
    scale = kv_scale_buffer(spec) if paged or fused_qkv else None  # (ragged: its append quantizes with it)
    read_scale = scale if paged else None  # the pages this kernel reads
    mma = MMA[dtype]
    cvt = CVT[dtype]
    widen = widen_pair(spec.page_dtype, dtype) if fp8 else None  # a code pair -> a dtype pair
    NI = BC // 8  # n8 score tiles per warp
    DN = D // 8  # n8 output tiles per warp
    KD = D // 16  # k16 steps of Q K^T
    SMEM_WORDS = SMEM_ROWS * D // 2  # fp16 / bf16 pairs as float32 words
    neg_inf = float("-inf")
    if min_blocks == "auto":
        min_blocks = DEFAULT_MIN_BLOCKS[source]
    MIN_BLOCKS = int(min_blocks or 0)  # __launch_bounds__(NT, MIN_BLOCKS): caps registers per thread
    bound_blocks = MIN_BLOCKS > 0
    blk = block_macros(spec, source=source, mask=mask, RT=RT, NW=NW, BC=BC, scale=read_scale)

    @macro
    def fetch_pid(th, kt):
        # page ids of this thread's K/V rows of tile kt (keys clamped into the sequence)
        tx = T.meta_var(th.tx)
        sv = T.meta_var(th.sv)
        pid = T.meta_var(th.pid)
        if paged:
            for i in T.unroll(KVI):
                kr, kc = T.meta_var(kv_rc(tx, i, NT, CPR))
                pid[i] = page_indices[sv[BLOCK.kbase] + (T.min(kt * BC + kr, sv[BLOCK.kv_len] - 1) >> LOGP)]

    @macro
    def issue_kv(th, kt, st):
        # cp.async the K and V rows of tile kt into stage st (keys past the end re-read the last key)
        tx = T.meta_var(th.tx)
        sv = T.meta_var(th.sv)
        pid = T.meta_var(th.pid)
        sm = T.meta_var(th.sm)
        hk = T.meta_var(th.hk)
        for i in T.unroll(KVI):
            kr, kc = T.meta_var(kv_rc(tx, i, NT, CPR))
            j = T.meta_var(T.min(kt * BC + kr, sv[BLOCK.kv_len] - 1))
            if fp8:  # 8 codes in one load, converted in pairs, 16 bytes stored
                for kv in T.unroll(2):
                    for e in T.vectorized(8):
                        th.c8[e] = pages[pid[i], kv, hk, j & PMASK, kc * 8 + e]
                    for c in T.unroll(4):
                        widen(th.h4[c], th.c8_pairs[c], th.f2)
                    for c in T.vectorized(4):
                        th.sm_pairs[k_row(st, kr) + kv * BC, swz(kr, kc) // 2 + c] = th.h4[c]
            elif paged:
                T.ptx[CP16](
                    sm.ptr_to([k_row(st, kr), swz(kr, kc)]), pages.ptr_to([pid[i], 0, hk, j & PMASK, kc * 8]), 16
                )
                T.ptx[CP16](
                    sm.ptr_to([v_row(st, kr), swz(kr, kc)]), pages.ptr_to([pid[i], 1, hk, j & PMASK, kc * 8]), 16
                )
            else:
                T.ptx[CP16](sm.ptr_to([k_row(st, kr), swz(kr, kc)]), k.ptr_to([sv[BLOCK.kbase] + j, hk, kc * 8]), 16)
                T.ptx[CP16](sm.ptr_to([v_row(st, kr), swz(kr, kc)]), v.ptr_to([sv[BLOCK.kbase] + j, hk, kc * 8]), 16)

    @macro
    def tile_body(th, kt):
        lane = T.meta_var(th.lane)
        sv = T.meta_var(th.sv)
        sm = T.meta_var(th.sm)
        rpos = T.meta_var(th.rpos)
        sl2 = T.meta_var(th.sl2)
        qf = T.meta_var(th.qf)
        kf = T.meta_var(th.kf)
        vf = T.meta_var(th.vf)
        pf = T.meta_var(th.pf)
        s = T.meta_var(th.s)
        o_acc = T.meta_var(th.o_acc)
        m = T.meta_var(th.m)
        lsum = T.meta_var(th.lsum)
        mx = T.meta_var(th.mx)
        base = T.meta_var(th.base)
        alpha = T.meta_var(th.alpha)
        # ---- S = Q K^T for this warp's 16 rows x BC keys (stage kt % 2)
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
                    sm.ptr_to([k_row(kt % 2, nj * 16 + kn), swz(nj * 16 + kn, kk * 2 + kc)]),
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
        blk.softmax(kt, lane, sv, rpos, s, m, lsum, mx, base, alpha, sl2, o_acc, True)
        # ---- O += P V: S tiles (2kk, 2kk+1) are the A fragment of key step kk
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
                    sm.ptr_to([v_row(kt % 2, kk * 16 + vr), swz(kk * 16 + vr, nj * 2 + vc)]),
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

    @macro
    def fa_body():
        bx = T.launch_thread("blockIdx.x", (n // RT + B) * H_kv)
        tx = T.launch_thread("threadIdx.x", NT)
        lane = T.meta_var(tx % WARP)
        w = T.meta_var(tx // WARP)
        hk = T.meta_var(bx % H_kv)
        if bound_blocks:
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MIN_BLOCKS)
        # shared memory: K/V stages 0 and 1, Q aliasing stage 1 (float32 words so that kernels of
        # several dtypes in one module declare the same extern __shared__ array)
        sm_raw = T.alloc_buffer((SMEM_WORDS,), "float32", scope="shared.dyn")
        sm = T.decl_buffer((SMEM_ROWS, D), dtype, data=sm_raw.data, scope="shared.dyn")
        red = T.alloc_buffer((2, NW), "float32", scope="shared")
        sv = T.alloc_buffer((len(BLOCK),), "int32", scope="local")
        rpos = T.alloc_buffer((2,), "int32", scope="local")  # causal bound of rows g, g + 8
        pid = T.alloc_buffer((KVI,), "int32", scope="local")
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
        pf32 = T.alloc_buffer((2,), "float32", scope="local")
        rinv = T.alloc_buffer((2,), "float32", scope="local")
        pk = T.alloc_buffer((1,), "uint32", scope="local")
        # fp8 pages: shared rows as element pairs, a row chunk's 8 codes (and as 4 code pairs), converted
        sm_pairs = T.decl_buffer((SMEM_ROWS, D // 2), "uint32", data=sm_raw.data, scope="shared.dyn")
        c8 = T.alloc_buffer((8,), spec.page_dtype, scope="local")
        c8_pairs = T.decl_buffer((4,), "uint16", data=c8.data, scope="local")
        h4 = T.alloc_buffer((4,), "uint32", scope="local")
        f2 = T.alloc_buffer((2,), "float32", scope="local")
        o_pairs = T.decl_buffer((n * H_qo * D // 2,), "uint32", data=o.data)  # o as packed element pairs
        th = T.meta_var(
            PrefillThread(
                tx=tx,
                lane=lane,
                hk=hk,
                sv=sv,
                sm=sm,
                pid=pid,
                qf=qf,
                kf=kf,
                vf=vf,
                pf=pf,
                s=s,
                o_acc=o_acc,
                m=m,
                lsum=lsum,
                mx=mx,
                base=base,
                alpha=alpha,
                sl2=sl2,
                rpos=rpos,
                sm_pairs=sm_pairs,
                c8=c8,
                c8_pairs=c8_pairs,
                h4=h4,
                f2=f2,
            )
        )

        # ---- which sequence and tile; its tokens and key range
        blk.locate(bx, sv)
        if sv[BLOCK.lt] >= 0:
            blk.key_range(tx, lane, w, sv, rpos, red, pf32)
            sl2[0] = times_key_scale(sm_scale * T.float32(LOG2E), read_scale, hk)
            for h in T.unroll(2):
                m[h] = T.float32(neg_inf)
                lsum[h] = T.float32(0)
            for dn in T.unroll(DN):
                for r in T.unroll(4):
                    o_acc[dn, r] = T.float32(0)

            # ---- Q tile (own cp.async group), then K/V tile 0
            for i in T.unroll(QI):
                qr, qc = T.meta_var(load_rc(tx, i, NT, CPR))
                T.ptx[CP16](
                    sm.ptr_to([q_row(qr), swz(qr, qc)]),
                    q.ptr_to([sv[BLOCK.t0] + T.min(qr // group, sv[BLOCK.ntok] - 1), hk * group + qr % group, qc * 8]),
                    16,
                )
            T.ptx["cp.async.commit_group"]()
            if sv[BLOCK.nkt] > 0:
                fetch_pid(th, 0)
                issue_kv(th, 0, 0)
                fetch_pid(th, 1)
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
                    sm.ptr_to([q_row(w * 16 + ar), swz(w * 16 + ar, kk * 2 + ac)]),
                )

            # ---- key tiles: tile kt + 1 streams in while tile kt is computed
            for kt in T.serial(sv[BLOCK.nkt]):
                T.tvm_storage_sync("shared")  # everyone is done with stage (kt + 1) % 2
                if kt + 1 < sv[BLOCK.nkt]:
                    issue_kv(th, kt + 1, (kt + 1) % 2)
                    fetch_pid(th, kt + 2)
                T.ptx["cp.async.commit_group"]()
                T.ptx["cp.async.wait_group"](1)
                T.tvm_storage_sync("shared")
                tile_body(th, kt)
            T.ptx["cp.async.wait_group"](0)

            # ---- o = O / l, lse = m + log2(l)
            blk.store(lane, w, hk, sv, o_acc, m, lsum, rinv, pk, o_pairs)

    if paged:
        return paged_prefill_func(spec, fa_body, scale, fused_qkv=fused_qkv)
    return ragged_prefill_func(spec, fa_body, scale, fused_qkv=fused_qkv)
