# ruff: noqa: F821, F841
# (the TVMScript macros below name the kernel's buffers and variables, which ruff cannot see)
"""Bandwidth-oriented CUDA schedule of the paged decode kernel. See docs/layout.md.

Design (one query token per sequence, so the kernel is a pure stream over the sequence's K/V):

* One thread block per (sequence ``b``, kv head ``hk``, slice of ``GQ`` of its ``group`` query heads);
  usually ``GQ == group`` so every K/V row of a kv head is read from memory exactly once and used by
  all its query heads (GQA-aware).
* A key row (``D`` elements) is read by ``TPK`` lanes with 16-byte vector loads (``VEC`` = 8 fp16 /
  bf16 or 4 fp32 elements per load, ``E`` contiguous elements per lane). A warp therefore holds
  ``KPW = 32 // TPK`` keys at once, and each lane group ("sub-warp") issues ``U`` keys' K and V
  loads back to back before using any of them, so ``NW * 32 * U * 2 * 16`` bytes per block are in
  flight. The block's ``NW`` warps stream interleaved, consecutive key ranges of the sequence; the
  page ids of the next tile are fetched while the current one is in flight.
* By default (``stages >= 2``) those loads are ``cp.async`` copies into a ring of ``NS`` tiles in
  dynamic shared memory (each lane writes and later reads back only its own 16-byte slots, so no
  barrier is needed): tile ``t + NS - 1`` is issued before tile ``t`` is computed, so ``NS - 1``
  tiles per warp stay in flight during the math instead of none. ``stages=1`` loads into registers.
* Each sub-warp keeps its own online-softmax state (running max ``m`` in base 2, sum ``l``, the
  lane's ``E`` columns of ``O``) in registers; scores are reduced over the ``TPK`` lanes of a key
  with xor shuffles. At the end the sub-warps of a warp merge through shuffles, then the warps
  merge through shared memory, and the block writes ``o`` and the base-2 ``lse``.
* ``split`` (``paged_decode_split``, flash-decoding): the grid gains a chunk axis (fastest, so a
  sequence's chunks run side by side); block ``ch`` scans visited keys ``[ch * kv_chunk, (ch + 1) *
  kv_chunk)`` with the same tiles, and writes its normalized float32 partial ``o`` and ``lse`` for
  ``merge_splits`` (docs/layout.md, "Split decode"). The runtime chooses the split per step
  (:mod:`tvmkv.runtime.decode_split`).
* fp8 pages (:mod:`tvmkv.tir.fp8`): rows of 8 codes (8-byte ``cp.async.ca``); each key's and each
  value's codes of a lane are converted once, two at a time (``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2``,
  then widened to fp32), and used by all ``GQ`` query heads (the P V product runs key by key after the
  tile's probabilities). Their layout differs (``decode_layout.FP8_*``): 16 codes per lane, so half
  the lanes per key and half the shuffles summing each score, 4 warps per block. That CUDA-core
  schedule serves fp8 pages only where the tensor-core one does not apply (below).
* Tensor cores (fp8 pages under fp16 activations, head_dim 128, no sliding window, no inline
  RoPE: :func:`decode_layout.tensor_core_layout`). On the CUDA cores every fp8 element costs a
  conversion, a multiply-add per query head and its share of the score shuffles, too many instructions
  to read at the memory's rate (ncu, 64x4096 on an H200: 152 M warp instructions against 57 M here);
  here each warp computes ``S = Q K^T`` and ``O += P V`` with
  ``mma.sync.m16n8k16`` (fp16 inputs, fp32 accumulation), the block's ``GQ <= 8`` query heads as the
  rows of the A operand (rows ``GQ..15`` zero). A warp takes ``16 NK`` keys per tile. Its K and V rows
  are copied whole (32 lanes x 16 bytes per ``cp.async``, full 128-byte lines) into the warp's slots
  of a ring of ``NS`` stages, 16-byte chunks XOR-swizzled per row (``kswz`` / ``vswz``) so that the
  fragment reads hit distinct banks; ``__syncwarp`` orders the copies of one lane before the reads of
  another. Lane ``(g, c) = (lane // 4, lane % 4)`` then reads the codes of its fragments: K row ``g``
  of each 8-key n-tile, bytes ``64 q + 16 c`` (the k axis of the mma is a permutation of the head
  dims, and q's A fragments are read with the same permutation, ``tc_kdim``), converted in pairs
  straight into B registers; V rows ``2c, 2c+1, 2c+8, 2c+9`` of each 16-key group, whose codes of a
  dim are paired across two keys with ``__byte_perm`` and converted into the B fragment of
  ``O += P V`` (n-tile ``mm`` of column ``n`` is dim ``tc_vdim(n, mm)``). ``P`` is the scores'
  accumulator registers packed to fp16 (the C layout of one mma is the A layout of the next); the
  online softmax runs per row over the 4 lanes that hold it, against a reference max that moves only
  when a score passes it by more than ``LAZY_RESCALE`` (then two shuffles and a rescale; most tiles
  skip both). The K scale joins the fp32 factor applied to the scores, the V scale the output, as on
  the CUDA-core path; each warp's ``(m, l, O)`` goes through the same shared-memory merge, split and
  in-kernel merge of chunks. A warp is one long dependency chain (one warp per scheduler at the
  batches where this path is not bandwidth-bound), so the code avoids work on it: every mma keeps all
  four registers of its fragments (rows 8..15 of A are zero; rows 8..15 of C / D accumulate those
  zeros in place, never read), so no accumulator is moved or re-zeroed; a k step's conversions come
  before its mmas; the q fragments are the fp16 pairs as loaded (unless q is rotated here); and in the
  one-launch decode the first tiles' copies go out before the block stores the new token (whose
  values and slot were loaded at the start), unless its key is among them.
* ``sliding``: only valid slots are visited (the sink ``[0, sink_end)`` then ``[window_start,
  kv_len)``), so a window costs only its size. ``inline_rope``: q is rotated once at load; a key's
  rotate-half partner element lives in lane ``lt ^ TPK/2`` of the same sub-warp (one shuffle).

Shapes the fast path does not cover (``D / VEC`` without a power-of-two factor that leaves at most
32 elements per lane, e.g. D = 80) use the generic schedule of :mod:`tvmkv.tir.attention_generic`.
"""

from __future__ import annotations

import math
from collections import namedtuple

from tvm.script import tirx as T

from ._kernel_common import LOG2E, macro, rope_inv_freq, slots
from .attention import decode_func
from .decode_layout import MERGE_MAX_SPLITS, TC16_STAGES, WARP, decode_layout
from .fp8 import (
    PAIR_TO_HALF2,
    kv_scale_buffer,
    page_code,
    page_code_under,
    page_value,
    times_key_scale,
    times_value_scale,
)
from .spec import KernelSpec, dtype_bytes

# cp.async ring depth of the K/V staging in shared memory (1: loads into registers). 16-bit pages: 2
# measured faster than 3 on an H200 (through the API, fp16 32/8 heads, D 128: 32x1024 44.1-44.3 ->
# 42.3-42.4 us, 64x4096 / 128x4096 0.5-1% faster, 1x1024 the same; bench/RESULTS.md); fp8 pages on
# the CUDA cores keep 3 (not measured with 2)
DEFAULT_STAGES = 2
FP8_STAGES = 3
TC_STAGES = 3  # ... on the tensor-core path (fp8 pages)
TC_MIN_BLOCKS = 0  # its __launch_bounds__ blocks per SM (0: no register cap)
MMA_F16 = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
MMA_BF16 = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
CVT_F16X2 = "cvt.rn.f16x2.f32"  # (d, hi, lo)
CVT_BF16X2 = "cvt.rn.bf16x2.f32"
# __byte_perm selectors of 16-bit pages: two keys' elements of a dim side by side (even dim, odd dim)
PERM16_LO, PERM16_HI = 0x5410, 0x7632
# __byte_perm selectors: bytes (x0, y0, x1, y1) and (x2, y2, x3, y3) of words x, y: two keys' codes of a
# dim side by side, the pair order of an mma B fragment along its k (key) axis
PERM_LO, PERM_HI = 0x5140, 0x7362
STAGE_BYTES = 96 * 1024  # cap on the staging ring per block
OPT_IN_BYTES = 48 * 1024  # dynamic shared memory from which TVM's runtime opts a kernel into more than 48 KiB
CP16 = "cp.async.cg.shared.global"
CP8 = "cp.async.ca.shared.global"  # 8-byte copies (cg takes 16 only): fp8 pages' 8-code rows
MERGE_UNROLL = 4  # o_part loads of the in-kernel merge issued together
# the tensor-core path's reference max moves only for scores above it by more than this (base 2): its
# probabilities are at most 2^8 (rounded to fp16 with the same relative error as smaller ones), and most
# tiles skip the max reduction
LAZY_RESCALE = 8.0

# Named slots (see _kernel_common.slots). DSEQ, the block's sequence: its first page entry
# (page_base), the end of the visited keys it scans, the sink keys visited first (n1), the first
# window slot (start2), sink_end (sink), the window's position offset and the first visited key it
# scans (x0; the chunk's when split), and the last visited key of the sequence (the new token's)
DSEQ = slots("page_base", "end", "n1", "start2", "sink", "offset", "x0", "last")
# st: SCRATCH float32 registers, named per phase: rotating a key (ROTATE), the online softmax of a
# tile (TILE: new max, the finite base it subtracts, rescale of the old state, a key's probability),
# merging lane groups (MERGE: ... the other group's rescale) and warps (FINAL: max, base, sum, weight)
SCRATCH = 4
ROTATE = slots("angle")
TILE = slots("m_new", "base", "alpha", "p")
MERGE = slots("m_new", "base", "alpha", "beta")
FINAL = slots("m", "base", "l_sum", "w")
# the thread's coordinates and local buffers, passed to the helper macros
DecodeThread = namedtuple("DecodeThread", "hk w sub lt tx seq pid kb vb stg Qr O m l_sum S st kr fr acc kb2 vb2 vr h2")
# ... on the tensor-core path: lane (g, c) of warp w
TcThread = namedtuple("TcThread", "hk w lane g c tx seq pid stg kc kc16 vc pr pr16 qa kf vf pa sc Oc tm st")


def make_paged_decode_cuda(
    spec: KernelSpec,
    *,
    sliding: bool = False,
    inline_rope: bool = False,
    num_warps: int | None = None,
    unroll: int | None = None,
    double_buffer: bool = False,
    max_tpk: int | None = None,
    reg_floats: int | None = None,
    load_bytes: int | None = None,
    stages: int | None = None,
    split: bool = False,
    merge: bool = False,
    append: bool = False,
    rotate: bool = False,
    tensor_cores: bool | None = None,
    tc_groups: int | None = None,
    tc_min_blocks: int | None = None,
):
    """The CUDA ``paged_decode`` PrimFunc (same signature as ``decode.make_paged_decode``), or with
    ``split`` the ``paged_decode_split`` one (``decode.make_paged_decode_split``; ``None`` for shapes
    without the fast layout).

    ``num_warps`` (warps per block), ``unroll`` (keys per lane group per tile), ``max_tpk`` (lanes per
    key), ``reg_floats`` and ``load_bytes`` are tuning knobs (:func:`decode_layout.decode_layout`); the
    defaults, those of the page dtype, are what the runtime uses. ``double_buffer`` (experimental) issues tile t+1's
    K/V loads into a second register buffer before computing tile t. ``merge`` (with ``split``): the
    ``paged_decode_split_merge`` PrimFunc (``decode.make_paged_decode_split_merge``), whose last block
    of each (sequence, kv head, query-head slice) merges the chunks' partial states. ``append``: the
    ``paged_decode_append`` PrimFunc (``decode.make_paged_decode_append``; with ``split`` and ``merge``
    its split form), which reads q, k and v from the fused ``qkv`` and appends the new K/V itself
    (``rotate``: rope mode "normal", q and the new k rotated here as ``split_rope`` would). On the
    tensor-core path the blocks whose keys reach the new token store it, wait for the block's stores,
    then copy it from the pages with the other keys (the codes ``append`` stores, bit for bit).
    """
    if tensor_cores and (sliding or inline_rope or double_buffer):
        raise ValueError(
            "tensor_cores=True: the tensor-core decode has no sliding window, inline RoPE or double buffer; "
            "leave tensor_cores unset"
        )
    lay = decode_layout(
        spec,
        num_warps,
        unroll,
        max_tpk,
        reg_floats,
        load_bytes,
        tensor_cores=False if (sliding or inline_rope or double_buffer) else tensor_cores,
        tc_groups=tc_groups,
    )
    if lay is None:
        if split:
            return None
        from .attention_generic import build_attention

        return build_attention(spec, source="decode", mask="none", sliding=sliding, inline_rope=inline_rope)
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    page_dtype = spec.page_dtype
    group = spec.group
    tc = lay["TC"]  # the tensor-core path (fp8 pages; module docstring, "Tensor cores")
    GQ, NW, KB = lay["GQ"], lay["NW"], lay["KB"]  # KB: keys per block per tile
    # the CUDA-core layout (placeholders on the tensor-core path, which does not read them)
    VEC, TPK, E, KPW, U = (8, 4, 8, 8, 1) if tc else (lay[k] for k in ("VEC", "TPK", "E", "KPW", "U"))
    # fp8 pages (tvmkv.tir.fp8): K / V registers hold codes, converted where they are used; the K scale
    # joins q's factor, the V scale the output; the new token's K / V are quantized as append stores them
    scale = kv_scale_buffer(spec)
    packed = spec.fp8_pages  # codes converted in pairs (fp8.PAIR_TO_HALF2; E is a multiple of VEC = 8)
    NC = E // VEC  # vector loads (16 bytes; fp8 pages 8) per lane per key row
    NGB = group // GQ  # blocks per kv head
    NT = NW * WARP
    split = bool(split)
    merge = bool(merge) and split
    append, rotate = bool(append), bool(rotate) and bool(append)
    if append and split and not merge:
        raise ValueError("the append-fused split decode merges its chunks itself: pass merge=True")
    HALF = D // 2
    HT = TPK // 2  # xor distance of the rotate-half partner lane
    LOGP = P.bit_length() - 1
    PMASK = P - 1
    NOUT = (GQ * D + NT - 1) // NT
    rope = bool(inline_rope)
    rot_q = rope or rotate  # q rotated at load (inline RoPE, or rope mode "normal" when fused with the append)
    sliding = bool(sliding)
    NB = 2 if double_buffer else 1
    # tensor-core path: each warp's K and V rows of a tile, whole, in its slots of a ring of NS stages; a lane
    # reads back its fragments' elements (per 16-key group: D / 4 of 2 K rows, D / 8 of 4 V rows); fp8 pages
    # convert them, 16-bit pages (EB 2) are the mma operands as stored
    EB = dtype_bytes(page_dtype)
    CE = 16 // EB  # elements of a 16-byte chunk
    NK = lay.get("NK", 1)  # 16-key groups per warp per tile
    KT = 16 * NK  # keys per warp per tile
    KBY, VBY = D // 4 * EB, D // 8 * EB  # bytes of a K / V row one lane reads
    KCH, VCH = KBY // 16, VBY // 16
    CPR = D * EB // 16  # 16-byte chunks of a row
    MMA = MMA_BF16 if dtype == "bfloat16" else MMA_F16
    CVT_PAIR = CVT_BF16X2 if dtype == "bfloat16" else CVT_F16X2
    NI = CPR // 2  # copy instructions of a 16-key group's K (or V) rows
    NJ, NM = D // 16, D // 8  # k16 steps of S = Q K^T, n8 tiles of O += P V
    QH = H_qo + 2 * H_kv if append else H_qo  # heads of a q row (append: the fused qkv's)
    NEW_ROWS = -(-D // NT)  # elements of the new K (and V) row per thread (append)
    TC_MB = TC_MIN_BLOCKS if tc_min_blocks is None else tc_min_blocks  # __launch_bounds__ (0: none)
    # CUDA-core path: each lane copies its own 16-byte chunks into its own slots of a ring of NS tiles in
    # shared memory and reads back only those, so no barrier is needed
    CHUNK = VEC * dtype_bytes(page_dtype)  # bytes of one load: 16 (fp8 pages: 8, with cp.async.ca)
    COPY = CP16 if CHUNK == 16 else CP8
    if tc:
        if stages is None:
            stages = TC_STAGES if spec.fp8_pages else TC16_STAGES
        NS = max(2, min(stages, STAGE_BYTES // (NW * 2 * KT * D * EB)))
        STG_SHAPE = (NS, NW, 2, KT, CPR, 4)  # uint32 words: stage, warp, K | V, row, chunk
        STG_WORDS = math.prod(STG_SHAPE)
    else:
        if stages is None:
            stages = FP8_STAGES if spec.fp8_pages else DEFAULT_STAGES
        NS = 1 if double_buffer else max(1, min(stages, STAGE_BYTES // (NT * U * 2 * NC * CHUNK)))
        if NS < 2:
            NS = 1
        STG_SHAPE = (NS, U, 2, NC, NT, VEC) if NS >= 2 else (1, 1, 1, 1, 1, VEC)
        STG_WORDS = max(1, math.prod(STG_SHAPE) * dtype_bytes(page_dtype) // 4)
    # TVM's CUDA runtime opts a kernel into more than 48 KiB of shared memory only when its dynamic part
    # alone reaches 48 KiB: a smaller ring whose total with the static buffers (the warps' Ms, Ls, Os; the
    # in-kernel merge's Lw) passes 48 KiB would not launch (CUDA_ERROR_INVALID_VALUE; e.g. 8 warps x 2
    # keys x 2 stages), so it is padded to 48 KiB
    static_bytes = 4 * NW * GQ * (D + 2) + (4 * GQ * MERGE_MAX_SPLITS if merge else 0)
    if STG_WORDS * 4 < OPT_IN_BYTES < STG_WORDS * 4 + static_bytes:
        STG_WORDS = OPT_IN_BYTES // 4
    CPA = NS >= 2
    neg_inf = float("-inf")
    shfl_xor = getattr(T.cuda, "__shfl_xor_sync")
    FULL = 0xFFFFFFFF

    def x_base(seq):
        # first visited key this block scans
        return seq[DSEQ.x0] if split else 0

    def x_of(t, u, w, sub, seq):
        # visited-key index of key u of lane group (w, sub) in tile t (tiles start at the chunk's
        # first key seq[DSEQ.x0] when split)
        return x_base(seq) + t * KB + w * (KPW * U) + u * KPW + sub

    def xc(t, u, w, sub, seq):
        # the same, clamped to the last visited key (loads past the end re-read it; masked later)
        return T.min(x_of(t, u, w, sub, seq), seq[DSEQ.end] - 1)

    def key_slot(x, n1, start2):
        # x-th visited key -> slot index j within the sequence
        if sliding:
            return T.if_then_else(x < n1, x, x - n1 + start2)
        return x

    def slot_of(t, u, w, sub, seq):
        # slot index j (within the sequence) of that key, clamped
        return key_slot(xc(t, u, w, sub, seq), seq[DSEQ.n1], seq[DSEQ.start2])

    def key_pos(j, sink, offset):
        if sliding:
            return T.if_then_else(j < sink, j, j + offset)
        return j

    @macro
    def load_tile(th, buf, t):
        # issue every K and V load of tile t into buffer buf (keys past the end re-read the last
        # key), then fetch the page ids of tile t + NB (same buffer) behind them
        for u in T.unroll(U):
            for c in T.unroll(NC):
                for v in T.vectorized(VEC):
                    th.kb[buf, u, c * VEC + v] = pages[
                        th.pid[buf, u],
                        0,
                        th.hk,
                        slot_of(t, u, th.w, th.sub, th.seq) & PMASK,
                        th.lt * E + c * VEC + v,
                    ]
            for c in T.unroll(NC):
                for v in T.vectorized(VEC):
                    th.vb[buf, u, c * VEC + v] = pages[
                        th.pid[buf, u],
                        1,
                        th.hk,
                        slot_of(t, u, th.w, th.sub, th.seq) & PMASK,
                        th.lt * E + c * VEC + v,
                    ]
        for u in T.unroll(U):
            th.pid[buf, u] = page_indices[th.seq[DSEQ.page_base] + (slot_of(t + NB, u, th.w, th.sub, th.seq) >> LOGP)]

    @macro
    def issue_tile(th, t, s):
        # cp.async every K and V chunk of tile t into ring stage s, commit, then fetch the next page ids
        for u in T.unroll(U):
            j = T.meta_var(slot_of(t, u, th.w, th.sub, th.seq) & PMASK)
            for c in T.unroll(NC):
                T.ptx[COPY](
                    th.stg.ptr_to([s, u, 0, c, th.tx, 0]),
                    pages.ptr_to([th.pid[0, u], 0, th.hk, j, th.lt * E + c * VEC]),
                    CHUNK,
                )
            for c in T.unroll(NC):
                T.ptx[COPY](
                    th.stg.ptr_to([s, u, 1, c, th.tx, 0]),
                    pages.ptr_to([th.pid[0, u], 1, th.hk, j, th.lt * E + c * VEC]),
                    CHUNK,
                )
        T.ptx["cp.async.commit_group"]()
        for u in T.unroll(U):
            th.pid[0, u] = page_indices[th.seq[DSEQ.page_base] + (slot_of(t + 1, u, th.w, th.sub, th.seq) >> LOGP)]

    @macro
    def read_stage(th, s):
        for u in T.unroll(U):
            for c in T.unroll(NC):
                for v in T.vectorized(VEC):
                    th.kb[0, u, c * VEC + v] = th.stg[s, u, 0, c, th.tx, v]
            for c in T.unroll(NC):
                for v in T.vectorized(VEC):
                    th.vb[0, u, c * VEC + v] = th.stg[s, u, 1, c, th.tx, v]

    @macro
    def widen(th, pairs, buf, u, out):
        # fp8 pages: key u's E codes of this lane (read as E / 2 code pairs) -> out[e] float32, one
        # conversion per pair (the fp16 halves widen exactly)
        for c in T.unroll(E // 2):
            T.ptx[PAIR_TO_HALF2[page_dtype]](th.h2[0], pairs[buf, u, c])
            out[2 * c] = T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", th.h2[0] & T.uint32(0xFFFF))))
            out[2 * c + 1] = T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", th.h2[0] >> T.uint32(16))))

    @macro
    def compute_tile(th, buf, t):
        seq = T.meta_var(th.seq)
        st = T.meta_var(th.st)
        kr = T.meta_var(th.kr)
        acc = T.meta_var(th.acc)
        # scores S[g, u] (reduced over the TPK lanes of a key; -inf past the end)
        for u in T.unroll(U):
            if packed:
                widen(th, th.kb2, buf, u, kr)
            elif rope:
                for e in T.unroll(E):
                    kr[e] = page_value(spec, th.kb[buf, u, e])
            if rope:
                for e in T.unroll(E):
                    acc[0] = shfl_xor(T.uint32(FULL), kr[e], HT, WARP)
                    st[ROTATE.angle] = (
                        T.Cast("float32", key_pos(slot_of(t, u, th.w, th.sub, seq), seq[DSEQ.sink], seq[DSEQ.offset]))
                        * th.fr[e]
                    )
                    if th.lt < HT:
                        kr[e] = kr[e] * T.cos(st[ROTATE.angle]) - acc[0] * T.sin(st[ROTATE.angle])
                    else:
                        kr[e] = kr[e] * T.cos(st[ROTATE.angle]) + acc[0] * T.sin(st[ROTATE.angle])
            for g in T.unroll(GQ):
                acc[0] = T.float32(0)
                for e in T.unroll(E):
                    if rope or packed:
                        acc[0] = acc[0] + th.Qr[g, e] * kr[e]
                    else:
                        acc[0] = acc[0] + th.Qr[g, e] * page_value(spec, th.kb[buf, u, e])
                acc[0] = T.cuda.warp_reduce(acc[0], "sum", TPK)  # every lane: no divergence
                th.S[g, u] = T.if_then_else(x_of(t, u, th.w, th.sub, seq) < seq[DSEQ.end], acc[0], T.float32(neg_inf))
        # online softmax (base 2) and O += P V
        for g in T.unroll(GQ):
            st[TILE.m_new] = th.m[g]
            for u in T.unroll(U):
                st[TILE.m_new] = T.max(st[TILE.m_new], th.S[g, u])
            st[TILE.base] = T.if_then_else(st[TILE.m_new] == T.float32(neg_inf), T.float32(0), st[TILE.m_new])
            st[TILE.alpha] = T.exp2(th.m[g] - st[TILE.base])
            th.l_sum[g] = th.l_sum[g] * st[TILE.alpha]
            for e in T.unroll(E):
                th.O[g, e] = th.O[g, e] * st[TILE.alpha]
            for u in T.unroll(U):
                st[TILE.p] = T.exp2(th.S[g, u] - st[TILE.base])
                th.l_sum[g] = th.l_sum[g] + st[TILE.p]
                if packed:  # P V below, each value row widened once for all GQ heads
                    th.S[g, u] = st[TILE.p]
                else:
                    for e in T.unroll(E):
                        th.O[g, e] = th.O[g, e] + st[TILE.p] * page_value(spec, th.vb[buf, u, e])
            th.m[g] = st[TILE.m_new]
        if packed:
            for u in T.unroll(U):
                widen(th, th.vb2, buf, u, th.vr)
                for g in T.unroll(GQ):
                    for e in T.unroll(E):
                        th.O[g, e] = th.O[g, e] + th.S[g, u] * th.vr[e]

    # ---- tensor-core path (fp8 pages, fp16 activations): lane = 4 g + c of a warp. S = Q K^T and
    # O += P V are mma.sync m16n8k16 tiles whose rows are the block's GQ query heads (row g; rows GQ..15
    # are zero). K as the B operand: lane (g, c) holds key g of each 8-key tile, the 16-byte chunks
    # 64 q + 16 c of its row, so k step jj pairs dims tc_kdim(c, jj) + (0, 1) | (2, 3), and q's A
    # fragment is read the same way. V as the B operand of O += P V: lane (g, c) holds keys 2c, 2c+1,
    # 2c+8, 2c+9 of each 16-key group, chunks 128 q + 16 g of their rows; two keys' codes of a dim are
    # paired with __byte_perm and converted to one f16x2, so n8 tile mm of column n is dim tc_vdim(n, mm).
    # P comes from S's accumulator registers (the C layout of one mma is the A layout of the next).
    def tc_key(t, w, i, seq):
        # visited-key index of key i of warp w's keys in tile t, clamped to the last visited key
        return T.min(x_base(seq) + t * KB + w * KT + i, seq[DSEQ.end] - 1)

    def tc_kdim(c, jj):
        # first of the 4 dims of k step jj in lane column c's K elements: the lane's 16-byte chunk jj // (CE / 4)
        # is chunk 4 (jj // (CE / 4)) + c of the row (fp8: bytes [64 (jj // 4) + 16 c, +16)), so the 4 lanes of
        # a key read 64 contiguous bytes per load
        return jj // (CE // 4) * 4 * CE + c * CE + jj % (CE // 4) * 4

    def tc_vdim(n, mm):
        # dim of n8 tile mm, column n, of O += P V: lane row n's V chunk mm // CE is chunk 8 (mm // CE) + n of
        # the row (fp8: bytes [128 (mm // 16) + 16 n, +16))
        return (mm // CE * 8 + n) * CE + mm % CE

    def tc_vkey(kk, r, c):
        # key (within the warp's tile) of V row r (0..3) of 16-key group kk of lane column c
        return kk * 16 + r // 2 * 8 + 2 * c + r % 2

    def kswz(key, j):
        # 16-byte chunk j of staged K row key -> its slot in the row: the 8 lanes of a shared-memory phase
        # (rows g, g + 1; chunks 4 q + c) hit distinct banks
        return j ^ ((key & 1) << 2)

    def vswz(key, j):
        # ... of a staged V row (lanes of a phase: rows 2c + ..., chunks 8 q + g for g in 0, 1)
        return j ^ (((key >> 1) & 3) << 1)

    def tc_wkey(kk, i, lane):
        # key (within the warp's tile) whose chunk lane copies in copy instruction i of 16-key group kk:
        # each instruction copies whole rows (32 lanes x 16 bytes = 512 / D rows)
        return kk * 16 + (i * WARP + lane) // CPR

    @macro
    def tc_pages(th, t):
        # page ids of the rows this lane copies in tile t: pages of at least 16 slots hold a 16-key group
        # in at most two pages, those of its first and last keys; smaller pages: one id per instruction
        for kk in T.unroll(NK):
            if P >= 16:
                for h in T.unroll(2):
                    th.pid[kk * NI + h] = page_indices[
                        th.seq[DSEQ.page_base] + (tc_key(t, th.w, kk * 16 + h * 15, th.seq) >> LOGP)
                    ]
            else:
                for i in T.unroll(NI):
                    th.pid[kk * NI + i] = page_indices[
                        th.seq[DSEQ.page_base] + (tc_key(t, th.w, tc_wkey(kk, i, th.lane), th.seq) >> LOGP)
                    ]

    def tc_pid(th, t, kk, i):
        # page id of the row this lane copies in instruction i of 16-key group kk
        if P >= 16:
            return T.if_then_else(
                tc_key(t, th.w, tc_wkey(kk, i, th.lane), th.seq) >> LOGP == tc_key(t, th.w, kk * 16, th.seq) >> LOGP,
                th.pid[kk * NI],
                th.pid[kk * NI + 1],
            )
        return th.pid[kk * NI + i]

    @macro
    def tc_issue(th, t, s):
        # cp.async the warp's K and V rows of tile t into ring stage s (whole rows per instruction, chunks
        # swizzled), commit, fetch tile t + 1's page ids
        for kk in T.unroll(NK):
            for i in T.unroll(NI):
                key = T.meta_var(tc_wkey(kk, i, th.lane))
                j = T.meta_var((i * WARP + th.lane) % CPR)
                slot = T.meta_var(tc_key(t, th.w, key, th.seq) & PMASK)
                T.ptx[CP16](
                    th.stg.ptr_to([s, th.w, 0, key, kswz(key, j), 0]),
                    pages.ptr_to([tc_pid(th, t, kk, i), 0, th.hk, slot, j * CE]),
                    16,
                )
                T.ptx[CP16](
                    th.stg.ptr_to([s, th.w, 1, key, vswz(key, j), 0]),
                    pages.ptr_to([tc_pid(th, t, kk, i), 1, th.hk, slot, j * CE]),
                    16,
                )
        T.ptx["cp.async.commit_group"]()
        tc_pages(th, t + 1)

    @macro
    def tc_prefetch(th):
        # the copies of tiles 0 .. NS - 2, ahead of the loop
        tc_pages(th, 0)
        for p in T.unroll(NS - 1):
            tc_issue(th, p, p)

    @macro
    def tc_read(th, s):
        # this lane's fragments' codes: K rows g, g + 8 (chunks 4 q + c), V rows 2c, 2c+1, 2c+8, 2c+9
        # (chunks 8 q + g) of each 16-key group
        for kk in T.unroll(NK):
            for h in T.unroll(2):
                for q in T.unroll(KCH):
                    for v in T.vectorized(4):
                        th.kc[kk, h, q * 4 + v] = th.stg[
                            s, th.w, 0, kk * 16 + h * 8 + th.g, kswz(kk * 16 + h * 8 + th.g, q * 4 + th.c), v
                        ]
            for r in T.unroll(4):
                for q in T.unroll(VCH):
                    for v in T.vectorized(4):
                        th.vc[kk, r, q * 4 + v] = th.stg[
                            s, th.w, 1, tc_vkey(kk, r, th.c), vswz(tc_vkey(kk, r, th.c), q * 8 + th.g), v
                        ]

    def k_operand(th, n, jj, r):
        # register r of the B fragment of 8-key tile n in k step jj of S = Q K^T: converted codes (fp8 pages)
        # or the word of two 16-bit elements as staged
        if EB == 1:
            return th.kf[n, r]
        return th.kc[n // 2, n % 2, 2 * jj + r]

    @macro
    def pv_mma(th, m, b0, b1):
        # O += P V on n8 tile m of O: P (th.pa, the probabilities of a 16-key group) times the B fragment
        # (b0, b1) of that tile's V columns, accumulated in place
        T.ptx[MMA](
            th.Oc[m, 0],
            th.Oc[m, 1],
            th.Oc[m, 2],
            th.Oc[m, 3],
            th.pa[0],
            th.pa[1],
            th.pa[2],
            th.pa[3],
            b0,
            b1,
            th.Oc[m, 0],
            th.Oc[m, 1],
            th.Oc[m, 2],
            th.Oc[m, 3],
        )

    @macro
    def tc_compute(th, t):
        seq = T.meta_var(th.seq)
        st = T.meta_var(th.st)
        sc = T.meta_var(th.sc)
        # S (rows: query heads; each lane keys 2c, 2c+1 of every 8-key tile n), scaled, masked past the end
        for n in T.unroll(2 * NK):
            sc[n, 0] = T.float32(0)
            sc[n, 1] = T.float32(0)
        for jj in T.unroll(NJ):  # the 2 NK accumulators advance side by side
            # a k step's conversions first, then its mmas: no mma waits on the conversion just before it
            if EB == 1:
                for n in T.unroll(2 * NK):
                    T.ptx[PAIR_TO_HALF2[page_dtype]](th.kf[n, 0], th.kc16[n // 2, n % 2, 2 * jj])
                    T.ptx[PAIR_TO_HALF2[page_dtype]](th.kf[n, 1], th.kc16[n // 2, n % 2, 2 * jj + 1])
            for n in T.unroll(2 * NK):
                T.ptx[MMA](
                    sc[n, 0],
                    sc[n, 1],
                    sc[n, 2],
                    sc[n, 3],
                    th.qa[jj, 0],
                    th.qa[jj, 1],
                    th.qa[jj, 2],
                    th.qa[jj, 3],
                    k_operand(th, n, jj, 0),
                    k_operand(th, n, jj, 1),
                    sc[n, 0],
                    sc[n, 1],
                    sc[n, 2],
                    sc[n, 3],
                )
        if x_base(seq) + t * KB + th.w * KT + KT <= seq[DSEQ.end]:  # every key of the warp's tile is visited
            for n in T.unroll(2 * NK):
                for e in T.unroll(2):
                    sc[n, e] = sc[n, e] * th.tm[2]
        else:
            for n in T.unroll(2 * NK):
                for e in T.unroll(2):
                    sc[n, e] = T.if_then_else(
                        x_base(seq) + t * KB + th.w * KT + n * 8 + 2 * th.c + e < seq[DSEQ.end],
                        sc[n, e] * th.tm[2],
                        T.float32(neg_inf),
                    )
        # online softmax (base 2) of row g against a reference max tm[0], which the 4 lanes of the row
        # share: it moves only when some score of the warp's rows passes it by more than LAZY_RESCALE
        # (then the row maxima are reduced and the state rescaled), so most tiles neither shuffle nor
        # rescale, and every probability is at most 2^LAZY_RESCALE (fp16 rounds it as it rounds smaller ones)
        st[TILE.m_new] = T.float32(neg_inf)
        for n in T.unroll(2 * NK):
            st[TILE.m_new] = T.max(st[TILE.m_new], T.max(sc[n, 0], sc[n, 1]))
        if (
            T.call_extern(
                "int32",
                "__any_sync",
                T.uint32(FULL),
                T.Cast("int32", st[TILE.m_new] > th.tm[0] + T.float32(LAZY_RESCALE)),
            )
            != 0
        ):
            st[TILE.m_new] = T.max(st[TILE.m_new], th.tm[0])
            st[TILE.m_new] = T.max(st[TILE.m_new], shfl_xor(T.uint32(FULL), st[TILE.m_new], 1, WARP))
            st[TILE.m_new] = T.max(st[TILE.m_new], shfl_xor(T.uint32(FULL), st[TILE.m_new], 2, WARP))
            st[TILE.base] = T.if_then_else(st[TILE.m_new] == T.float32(neg_inf), T.float32(0), st[TILE.m_new])
            st[TILE.alpha] = T.exp2(th.tm[0] - st[TILE.base])  # 0 while the old reference is -inf
            th.tm[1] = th.tm[1] * st[TILE.alpha]
            for mm in T.unroll(NM):
                th.Oc[mm, 0] = th.Oc[mm, 0] * st[TILE.alpha]
                th.Oc[mm, 1] = th.Oc[mm, 1] * st[TILE.alpha]
            th.tm[0] = st[TILE.m_new]
        st[TILE.base] = T.if_then_else(th.tm[0] == T.float32(neg_inf), T.float32(0), th.tm[0])
        for n in T.unroll(2 * NK):
            for e in T.unroll(2):
                sc[n, e] = T.exp2(sc[n, e] - st[TILE.base])
                th.tm[1] = th.tm[1] + sc[n, e]
        # O += P V, one 16-key group at a time
        for kk in T.unroll(NK):
            T.ptx[CVT_PAIR](th.pa[0], sc[2 * kk, 1], sc[2 * kk, 0])
            T.ptx[CVT_PAIR](th.pa[2], sc[2 * kk + 1, 1], sc[2 * kk + 1, 0])
            if EB == 2:  # a word of a V row is two dims: two keys' elements of a dim paired with __byte_perm
                for w2 in T.unroll(VBY // 4):
                    for r2 in T.unroll(2):  # keys (2c, 2c+1), then (2c+8, 2c+9)
                        th.pr[r2] = T.call_extern(
                            "uint32",
                            "__byte_perm",
                            th.vc[kk, 2 * r2, w2],
                            th.vc[kk, 2 * r2 + 1, w2],
                            T.uint32(PERM16_LO),
                        )
                        th.pr[2 + r2] = T.call_extern(
                            "uint32",
                            "__byte_perm",
                            th.vc[kk, 2 * r2, w2],
                            th.vc[kk, 2 * r2 + 1, w2],
                            T.uint32(PERM16_HI),
                        )
                    for dd in T.unroll(2):
                        pv_mma(th, w2 * 2 + dd, th.pr[2 * dd], th.pr[2 * dd + 1])
            else:
                for w4 in T.unroll(VBY // 4):
                    for r2 in T.unroll(2):  # keys (2c, 2c+1), then (2c+8, 2c+9)
                        th.pr[2 * r2] = T.call_extern(
                            "uint32", "__byte_perm", th.vc[kk, 2 * r2, w4], th.vc[kk, 2 * r2 + 1, w4], T.uint32(PERM_LO)
                        )
                        th.pr[2 * r2 + 1] = T.call_extern(
                            "uint32", "__byte_perm", th.vc[kk, 2 * r2, w4], th.vc[kk, 2 * r2 + 1, w4], T.uint32(PERM_HI)
                        )
                    for dd in T.unroll(4):  # (conversions first, as for S)
                        T.ptx[PAIR_TO_HALF2[page_dtype]](th.vf[dd, 0], th.pr16[dd])
                        T.ptx[PAIR_TO_HALF2[page_dtype]](th.vf[dd, 1], th.pr16[4 + dd])
                    for dd in T.unroll(4):
                        pv_mma(th, w4 * 4 + dd, th.vf[dd, 0], th.vf[dd, 1])

    def q_value(q, q_pos, rope_scale, rope_theta, b, h, d):
        # element d of query head h of sequence b, float32: rotated by its position where the kernel
        # rotates q (rope mode "normal" fused with the append; the tensor-core path rounds it to fp16,
        # as split_rope stores it)
        x = T.Cast("float32", q[b, h, d])
        if not rotate:
            return x
        angle = T.Cast("float32", q_pos[b]) * rope_inv_freq(rope_scale, rope_theta, d % HALF, D)
        partner = T.if_then_else(
            d < HALF, T.float32(0) - T.Cast("float32", q[b, h, d + HALF]), T.Cast("float32", q[b, h, d - HALF])
        )
        return x * T.cos(angle) + partner * T.sin(angle)

    def partner_dim(d):
        # the rotate-half partner of dim d (its sign is that of rotated_k)
        return T.if_then_else(d < HALF, d + HALF, d - HALF)

    def rotated_k(x, partner, d, angle):
        # a new key's element d (raw value x, its partner dim's raw value partner) rotated by its position,
        # in float32 as split_rope, in the activation dtype
        return T.Cast(
            dtype,
            T.Cast("float32", x) * T.cos(angle)
            + T.if_then_else(d < HALF, T.float32(0) - T.Cast("float32", partner), T.Cast("float32", partner))
            * T.sin(angle),
        )

    def new_k(q, b, hk, d, angle):
        # element d of sequence b's new key (kv head hk) as the pages store it: rotated by its position
        # in rope mode "normal", raw otherwise
        if rotate:
            return rotated_k(q[b, H_qo + hk, d], q[b, H_qo + hk, partner_dim(d)], d, angle)
        return q[b, H_qo + hk, d]

    def new_k_angle(q_pos, rope_scale, rope_theta, b, d):
        # the rotation angle of a new key's dim d: its position times the dim's frequency
        return T.Cast("float32", q_pos[b]) * rope_inv_freq(rope_scale, rope_theta, d % HALF, D)

    @macro
    def load_new_kv(b, hk, tx, raw, slot, kv_scales):
        # this thread's elements of the new token's k (and partner dims) and v, its slot and the K / V
        # scales into registers: loads only, issued at the block's start, used by store_new_kv once the
        # first copies are out
        slot[0] = new_slots[b]
        if spec.fp8_pages:
            kv_scales[0] = scale[0, hk]
            kv_scales[1] = scale[1, hk]
        for r in T.unroll(NEW_ROWS):
            if r * NT + tx < D:
                raw[0, r] = q[b, H_qo + hk, r * NT + tx]
                raw[1, r] = q[b, H_qo + H_kv + hk, r * NT + tx]
                if rotate:
                    raw[2, r] = q[b, H_qo + hk, partner_dim(r * NT + tx)]

    def loaded_k(raw, r, angle, d):
        # element d of the new key from load_new_kv's registers (row r), as new_k
        if rotate:
            return rotated_k(raw[0, r], raw[2, r], d, angle)
        return raw[0, r]

    @macro
    def store_new_kv(b, hk, tx, raw, slot, kv_scales):
        # the new token's k (rotated in rope mode "normal") and v into its slot, fp8 pages quantized with
        # the K / V scales, from the registers load_new_kv filled (nothing where the slot is negative)
        if slot[0] >= 0:
            for r in T.unroll(NEW_ROWS):
                if r * NT + tx < D:
                    pages[slot[0] // P, 0, hk, slot[0] % P, r * NT + tx] = page_code_under(
                        spec,
                        loaded_k(raw, r, new_k_angle(q_pos, rope_scale, rope_theta, b, r * NT + tx), r * NT + tx),
                        kv_scales[0],
                    )
                    pages[slot[0] // P, 1, hk, slot[0] % P, r * NT + tx] = page_code_under(
                        spec, raw[1, r], kv_scales[1]
                    )

    @macro
    def tc_stream(b, hk, h0, tx, seq, st, Ms, Ls, Os, stg):
        # the tensor-core path of one block: q as A fragments, the key stream, each warp's (m, l, O) of its
        # GQ heads into Ms / Ls / Os for the final merge
        w = T.meta_var(tx // WARP)
        g = T.meta_var(tx % WARP // 4)
        c = T.meta_var(tx % 4)
        pid = T.alloc_buffer((NK * NI,), "int32", scope="local")
        kc = T.alloc_buffer((NK, 2, KBY // 4), "uint32", scope="local")  # K codes, 4 per word
        kc16 = T.decl_buffer((NK, 2, KBY // 2), "uint16", data=kc.data, scope="local")  # ... code pairs
        vc = T.alloc_buffer((NK, 4, VBY // 4), "uint32", scope="local")
        pr = T.alloc_buffer((4,), "uint32", scope="local")  # two keys' codes paired per dim
        pr16 = T.decl_buffer((8,), "uint16", data=pr.data, scope="local")
        # the mma operands keep all four registers of a fragment: A rows 8..15 (q's, P's) are zero, and the
        # C / D rows 8..15 (sc[:, 2:], Oc[:, 2:]) accumulate those zero rows in place, never read, so that
        # no accumulator is moved or re-zeroed around an mma
        qa = T.alloc_buffer((NJ, 4), "uint32", scope="local")  # q's A fragments (row g)
        kf = T.alloc_buffer((2 * NK, 2), "uint32", scope="local")  # B fragments of a k step of S
        vf = T.alloc_buffer((4, 2), "uint32", scope="local")  # ... of 4 n8 tiles of O += P V
        pa = T.alloc_buffer((4,), "uint32", scope="local")
        sc = T.alloc_buffer((2 * NK, 4), "float32", scope="local")
        Oc = T.alloc_buffer((NM, 4), "float32", scope="local")
        tm = T.alloc_buffer((3,), "float32", scope="local")  # reference max, lane's partial sum, q factor
        # q as fp16 pairs, flat (4-byte loads: TVM's DLPack import refuses data not aligned to 64 bytes)
        q_words = T.decl_buffer((B * QH * D // 2,), "uint32", data=q.data)
        new_raw = T.alloc_buffer((3, NEW_ROWS), dtype, scope="local")  # the new token's k, v, k's partners
        new_slot = T.alloc_buffer((1,), "int32", scope="local")
        new_scales = T.alloc_buffer((2,), "float32", scope="local")  # K, V scales of the kv head (fp8)
        if append:
            load_new_kv(b, hk, tx, new_raw, new_slot, new_scales)
        th = T.meta_var(
            TcThread(hk, w, tx % WARP, g, c, tx, seq, pid, stg, kc, kc16, vc, pr, pr16, qa, kf, vf, pa, sc, Oc, tm, st)
        )
        tm[0] = T.float32(neg_inf)
        tm[1] = T.float32(0)
        tm[2] = times_key_scale(sm_scale * T.float32(LOG2E), scale, hk)
        for mm in T.unroll(NM):
            for e in T.unroll(4):
                Oc[mm, e] = T.float32(0)
        for n in T.unroll(2 * NK):
            sc[n, 2] = T.float32(0)
            sc[n, 3] = T.float32(0)
        pa[1] = T.uint32(0)
        pa[3] = T.uint32(0)
        for jj in T.unroll(NJ):
            for e in T.unroll(2):
                qa[jj, 2 * e] = T.uint32(0)
                qa[jj, 2 * e + 1] = T.uint32(0)
                if g < GQ:
                    if rotate:
                        T.ptx[CVT_PAIR](
                            qa[jj, 2 * e],
                            q_value(q, q_pos, rope_scale, rope_theta, b, h0 + g, tc_kdim(c, jj) + 2 * e + 1),
                            q_value(q, q_pos, rope_scale, rope_theta, b, h0 + g, tc_kdim(c, jj) + 2 * e),
                        )
                    else:  # the fp16 pair as it is (one 4-byte load)
                        qa[jj, 2 * e] = q_words[((b * QH + h0 + g) * D + tc_kdim(c, jj) + 2 * e) // 2]
        # the first NS - 1 tiles' copies go out before the block stores the new token (append), unless
        # that token's key is among them: then after the store, as the copies read it back from the pages
        if append:  # the blocks whose keys reach the new token store it
            reach = T.meta_var(seq[DSEQ.end] > x_base(seq) and seq[DSEQ.end] - 1 == seq[DSEQ.last])
            late = T.meta_var((seq[DSEQ.end] - 1 - x_base(seq)) // KB < NS - 1)  # its key in the first tiles
            if seq[DSEQ.end] > x_base(seq) and not (reach and late):
                tc_prefetch(th)
            if reach:
                store_new_kv(b, hk, tx, new_raw, new_slot, new_scales)
            T.tvm_storage_sync("shared")  # (and the block's global stores before its copies)
            if reach and late:
                tc_prefetch(th)
        elif seq[DSEQ.end] > x_base(seq):
            tc_prefetch(th)
        ntiles = T.meta_var(T.max(seq[DSEQ.end] - x_base(seq) + KB - 1, 0) // KB)
        for t in T.serial(ntiles):
            T.cuda.warp_sync()  # every lane has read the stage the next copies overwrite
            if t + NS - 1 < ntiles:
                tc_issue(th, t + NS - 1, (t + NS - 1) % NS)
            else:  # past the last tile: an empty group keeps wait_group's count
                T.ptx["cp.async.commit_group"]()
            T.ptx["cp.async.wait_group"](NS - 1)
            T.cuda.warp_sync()  # ... and every lane's copies of tile t have landed
            tc_read(th, t % NS)
            tc_compute(th, t)
        T.ptx["cp.async.wait_group"](0)
        tm[1] = tm[1] + shfl_xor(T.uint32(FULL), tm[1], 1, WARP)
        tm[1] = tm[1] + shfl_xor(T.uint32(FULL), tm[1], 2, WARP)
        if g < GQ:
            if c == 0:
                Ms[w, g] = tm[0]
                Ls[w, g] = tm[1]
            for mm in T.unroll(NM):
                for e in T.unroll(2):
                    Os[w, g, tc_vdim(2 * c + e, mm)] = Oc[mm, e]

    @macro
    def store(ch, b, h, d, value, lse_value):
        # o / lse of (sequence b, query head h, element d) of this block (split: of its chunk ch)
        if split:
            o_part[ch, b, h, d] = times_value_scale(value, scale, h // group)
            if d == 0:
                lse_part[ch, b, h] = lse_value
        else:
            o[b, h, d] = T.Cast(dtype, times_value_scale(value, scale, h // group))
            if d == 0:
                lse[b, h] = lse_value

    @macro
    def put_new_kv(b, hk, tx):
        # the new token's k and v into its slot (skipped where the slot is negative), one element a thread:
        # load_new_kv's loads and store_new_kv's stores back to back (the CUDA-core path has no copies to
        # issue between them)
        raw = T.alloc_buffer((3, NEW_ROWS), dtype, scope="local")
        slot = T.alloc_buffer((1,), "int32", scope="local")
        kv_scales = T.alloc_buffer((2,), "float32", scope="local")
        load_new_kv(b, hk, tx, raw, slot, kv_scales)
        store_new_kv(b, hk, tx, raw, slot, kv_scales)

    @macro
    def take_new_kv(th, b, buf, t):
        # the new token's key is read from qkv, not from the pages another block may still be writing;
        # so are the loads past the end clamped to it (masked, but their V must not be NaN or inf)
        for u in T.unroll(U):
            if xc(t, u, th.w, th.sub, th.seq) == th.seq[DSEQ.last]:
                for e in T.unroll(E):
                    th.kb[buf, u, e] = page_code(
                        spec, new_k(q, b, th.hk, th.lt * E + e, T.Cast("float32", q_pos[b]) * th.fr[e]), scale, 0, th.hk
                    )
                    th.vb[buf, u, e] = page_code(spec, q[b, H_qo + H_kv + th.hk, th.lt * E + e], scale, 1, th.hk)

    @macro
    def merge_chunks(grp, b, h0, tx, st, acc):
        # the last block of group grp (its NSPLIT chunks) to arrive merges them: every thread fences its
        # partial-state stores at device scope, then (after a barrier) thread 0 counts the block's
        # arrival and fences again (the other blocks' states, fenced before their counts, are read
        # after it), and the block learns whether it was last
        Lw = T.alloc_buffer((GQ, MERGE_MAX_SPLITS), "float32", scope="shared")  # the chunks' lse per head
        arrived = T.alloc_buffer((1,), "int32", scope="local")
        T.cuda.thread_fence()
        T.tvm_storage_sync("shared")
        arrived[0] = 0
        if tx == 0:
            arrived[0] = T.cuda.atomic_add(counter.ptr_to([grp]), T.int32(1))
            T.cuda.thread_fence()
        if T.cuda.syncthreads_or(T.Cast("int32", tx == 0 and arrived[0] == NSPLIT - 1)) != 0:
            # the other blocks' partial states are read through L2 (ld.global.cg): this SM's L1 may
            # hold stale lines of lse_part shared with groups merged here earlier. The lse of every
            # (head, chunk) is staged in shared memory by one load per thread, all in flight at once.
            for r in T.unroll(-(-GQ * MERGE_MAX_SPLITS // NT)):
                if r * NT + tx < GQ * NSPLIT:
                    Lw[(r * NT + tx) // NSPLIT, (r * NT + tx) % NSPLIT] = T.call_extern(
                        "float32",
                        "__ldcg",
                        lse_part.ptr_to([(r * NT + tx) % NSPLIT, b, h0 + (r * NT + tx) // NSPLIT]),
                    )
            T.tvm_storage_sync("shared")
            for r in T.unroll(NOUT):
                if r * NT + tx < GQ * D:
                    st[FINAL.m] = T.float32(neg_inf)
                    for c in T.serial(NSPLIT):
                        st[FINAL.m] = T.max(st[FINAL.m], Lw[(r * NT + tx) // D, c])
                    st[FINAL.base] = T.if_then_else(st[FINAL.m] == T.float32(neg_inf), T.float32(0), st[FINAL.m])
                    st[FINAL.l_sum] = T.float32(0)
                    acc[0] = T.float32(0)
                    for c4 in T.serial((NSPLIT + MERGE_UNROLL - 1) // MERGE_UNROLL):
                        for u in T.unroll(MERGE_UNROLL):  # independent o_part loads, issued together
                            if c4 * MERGE_UNROLL + u < NSPLIT:
                                st[FINAL.w] = T.exp2(Lw[(r * NT + tx) // D, c4 * MERGE_UNROLL + u] - st[FINAL.base])
                                st[FINAL.l_sum] = st[FINAL.l_sum] + st[FINAL.w]
                                acc[0] = acc[0] + st[FINAL.w] * T.call_extern(
                                    "float32",
                                    "__ldcg",
                                    o_part.ptr_to(
                                        [c4 * MERGE_UNROLL + u, b, h0 + (r * NT + tx) // D, (r * NT + tx) % D]
                                    ),
                                )
                    if st[FINAL.l_sum] == T.float32(0):
                        o[b, h0 + (r * NT + tx) // D, (r * NT + tx) % D] = T.Cast(dtype, T.float32(0))
                        if (r * NT + tx) % D == 0:
                            lse[b, h0 + (r * NT + tx) // D] = T.float32(neg_inf)
                    else:
                        o[b, h0 + (r * NT + tx) // D, (r * NT + tx) % D] = T.Cast(dtype, acc[0] / st[FINAL.l_sum])
                        if (r * NT + tx) % D == 0:
                            lse[b, h0 + (r * NT + tx) // D] = st[FINAL.base] + T.log2(st[FINAL.l_sum])
            if tx == 0:
                counter[grp] = 0  # ready for the next launch (a CUDA graph replays it as it is)

    @macro
    def body():
        # block bx = (sequence b, kv head hk, query-head slice, chunk ch): ch fastest, so the chunks of
        # one sequence run side by side
        bx = T.launch_thread("blockIdx.x", B * H_kv * NGB * NSPLIT)
        tx = T.launch_thread("threadIdx.x", NT)
        if tc and TC_MB > 0:
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", TC_MB)
        ch = T.meta_var(bx % NSPLIT)
        b = T.meta_var(bx // NSPLIT // (H_kv * NGB))
        hk = T.meta_var(bx // NSPLIT // NGB % H_kv)
        h0 = T.meta_var(hk * group + bx // NSPLIT % NGB * GQ)  # first query head of the block
        w = T.meta_var(tx // WARP)
        sub = T.meta_var(tx % WARP // TPK)
        lt = T.meta_var(tx % TPK)

        Ms = T.alloc_buffer((NW, GQ), "float32", scope="shared")
        Ls = T.alloc_buffer((NW, GQ), "float32", scope="shared")
        Os = T.alloc_buffer((NW, GQ, D), "float32", scope="shared")
        # cp.async ring; allocated as float32 so kernels of different dtypes in one module declare the
        # same ``extern __shared__`` array, and viewed in the cache dtype
        stg_raw = T.alloc_buffer((STG_WORDS,), "float32", scope="shared.dyn")
        stg = T.decl_buffer(STG_SHAPE, "uint32" if tc else page_dtype, data=stg_raw.data, scope="shared.dyn")
        seq = T.alloc_buffer((len(DSEQ),), "int32", scope="local")
        pid = T.alloc_buffer((NB, U), "int32", scope="local")  # page id of each key of the tile
        kb = T.alloc_buffer((NB, U, E), page_dtype, scope="local")
        vb = T.alloc_buffer((NB, U, E), page_dtype, scope="local")
        kb2 = T.decl_buffer((NB, U, E // 2), "uint16", data=kb.data, scope="local")  # fp8: code pairs
        vb2 = T.decl_buffer((NB, U, E // 2), "uint16", data=vb.data, scope="local")
        vr = T.alloc_buffer((E,), "float32", scope="local")  # fp8: a value row widened
        h2 = T.alloc_buffer((1,), "uint32", scope="local")  # fp8: two fp16 of a converted pair
        Qr = T.alloc_buffer((GQ, E), "float32", scope="local")  # q * sm_scale * log2(e), rotated
        O = T.alloc_buffer((GQ, E), "float32", scope="local")
        m = T.alloc_buffer((GQ,), "float32", scope="local")
        l_sum = T.alloc_buffer((GQ,), "float32", scope="local")
        S = T.alloc_buffer((GQ, U), "float32", scope="local")
        st = T.alloc_buffer((SCRATCH,), "float32", scope="local")  # named per phase: ROTATE, TILE, MERGE
        kr = T.alloc_buffer((E,), "float32", scope="local")  # rotated key (inline rope)
        fr = T.alloc_buffer((E,), "float32", scope="local")  # RoPE frequency of each lane element
        acc = T.alloc_buffer((1,), "float32", scope="local")
        th = T.meta_var(
            DecodeThread(
                hk=hk,
                w=w,
                sub=sub,
                lt=lt,
                tx=tx,
                seq=seq,
                pid=pid,
                kb=kb,
                vb=vb,
                stg=stg,
                Qr=Qr,
                O=O,
                m=m,
                l_sum=l_sum,
                S=S,
                st=st,
                kr=kr,
                fr=fr,
                acc=acc,
                kb2=kb2,
                vb2=vb2,
                vr=vr,
                h2=h2,
            )
        )

        # ---- sequence extent: visited keys are [0, n1) then [start2, kv_len)
        seq[DSEQ.page_base] = page_indptr[b]
        seq[DSEQ.end] = 0
        if page_indptr[b + 1] > page_indptr[b]:
            seq[DSEQ.end] = (page_indptr[b + 1] - page_indptr[b] - 1) * P + last_page_len[b]
        if sliding:
            seq[DSEQ.sink] = kv_window[b, 0]
            seq[DSEQ.offset] = kv_window[b, 2]
            seq[DSEQ.n1] = T.max(T.min(seq[DSEQ.sink], seq[DSEQ.end]), 0)
            seq[DSEQ.start2] = T.max(kv_window[b, 1], seq[DSEQ.n1])
            seq[DSEQ.end] = seq[DSEQ.n1] + T.max(seq[DSEQ.end] - seq[DSEQ.start2], 0)
        else:
            seq[DSEQ.n1] = seq[DSEQ.end]
            seq[DSEQ.start2] = seq[DSEQ.end]
            seq[DSEQ.sink] = 0
            seq[DSEQ.offset] = 0
        seq[DSEQ.last] = seq[DSEQ.end] - 1  # the new token's key, the last visited one
        if split:  # this block's chunk of the visited keys: [x0, end)
            seq[DSEQ.x0] = ch * kv_chunk
            seq[DSEQ.end] = T.min(seq[DSEQ.end], seq[DSEQ.x0] + kv_chunk)
        if append and not tc:  # (on the tensor-core path the blocks whose keys reach the new token store it)
            if bx // NSPLIT % NGB == 0 and ch == 0:  # one block per (sequence, kv head) stores the new K/V
                put_new_kv(b, hk, tx)

        if tc:
            tc_stream(b, hk, h0, tx, seq, st, Ms, Ls, Os, stg)
        else:
            # ---- q (pre-scaled, rotated once) and the running state
            q_factor = T.meta_var(times_key_scale(sm_scale * T.float32(LOG2E), scale, hk))
            if rot_q:
                for e in T.unroll(E):
                    fr[e] = rope_inv_freq(rope_scale, rope_theta, (lt * E + e) % HALF, D)
            for g in T.unroll(GQ):
                m[g] = T.float32(neg_inf)
                l_sum[g] = T.float32(0)
                for e in T.unroll(E):
                    O[g, e] = T.float32(0)
                    if rot_q:
                        if lt < HT:
                            Qr[g, e] = (
                                T.Cast("float32", q[b, h0 + g, lt * E + e]) * T.cos(T.Cast("float32", q_pos[b]) * fr[e])
                                - T.Cast("float32", q[b, h0 + g, lt * E + e + HALF])
                                * T.sin(T.Cast("float32", q_pos[b]) * fr[e])
                            ) * q_factor
                        else:
                            Qr[g, e] = (
                                T.Cast("float32", q[b, h0 + g, lt * E + e]) * T.cos(T.Cast("float32", q_pos[b]) * fr[e])
                                + T.Cast("float32", q[b, h0 + g, lt * E + e - HALF])
                                * T.sin(T.Cast("float32", q_pos[b]) * fr[e])
                            ) * q_factor
                    else:
                        Qr[g, e] = T.Cast("float32", q[b, h0 + g, lt * E + e]) * q_factor

            # ---- stream the keys: tile t, lane group (w, sub) takes keys t*KB + w*KPW*U + u*KPW + sub
            if CPA:
                if seq[DSEQ.end] > x_base(seq):
                    for u in T.unroll(U):
                        pid[0, u] = page_indices[seq[DSEQ.page_base] + (slot_of(0, u, w, sub, seq) >> LOGP)]
                    for p in T.unroll(NS - 1):
                        issue_tile(th, p, p)
                for t in T.serial(T.max(seq[DSEQ.end] - x_base(seq) + KB - 1, 0) // KB):
                    issue_tile(th, t + NS - 1, (t + NS - 1) % NS)
                    T.ptx["cp.async.wait_group"](NS - 1)
                    read_stage(th, t % NS)
                    if append:
                        take_new_kv(th, b, 0, t)
                    compute_tile(th, 0, t)
                T.ptx["cp.async.wait_group"](0)
            else:
                if seq[DSEQ.end] > x_base(seq):
                    for par in T.unroll(NB):
                        for u in T.unroll(U):
                            pid[par, u] = page_indices[seq[DSEQ.page_base] + (slot_of(par, u, w, sub, seq) >> LOGP)]
                    if double_buffer:
                        load_tile(th, 0, 0)
                for t2 in T.serial(T.max(seq[DSEQ.end] - x_base(seq) + KB * NB - 1, 0) // (KB * NB)):
                    for par in T.unroll(NB):
                        if double_buffer:
                            load_tile(th, 1 - par, t2 * 2 + par + 1)  # the next tile, into the other buffer
                        else:
                            load_tile(th, 0, t2)
                        if append:
                            take_new_kv(th, b, par, t2 * NB + par)
                        compute_tile(th, par, t2 * NB + par)

            # ---- merge the lane groups of a warp (xor shuffles), then the warps (shared memory)
            for r in T.unroll(KPW.bit_length() - 1):
                for g in T.unroll(GQ):
                    acc[0] = shfl_xor(T.uint32(FULL), m[g], TPK << r, WARP)
                    st[MERGE.m_new] = T.max(m[g], acc[0])
                    st[MERGE.base] = T.if_then_else(
                        st[MERGE.m_new] == T.float32(neg_inf), T.float32(0), st[MERGE.m_new]
                    )
                    st[MERGE.alpha] = T.exp2(m[g] - st[MERGE.base])
                    st[MERGE.beta] = T.exp2(acc[0] - st[MERGE.base])
                    l_sum[g] = (
                        l_sum[g] * st[MERGE.alpha] + shfl_xor(T.uint32(FULL), l_sum[g], TPK << r, WARP) * st[MERGE.beta]
                    )
                    for e in T.unroll(E):
                        O[g, e] = (
                            O[g, e] * st[MERGE.alpha]
                            + shfl_xor(T.uint32(FULL), O[g, e], TPK << r, WARP) * st[MERGE.beta]
                        )
                    m[g] = st[MERGE.m_new]
            if sub == 0:
                for g in T.unroll(GQ):
                    if lt == 0:
                        Ms[w, g] = m[g]
                        Ls[w, g] = l_sum[g]
                    for e in T.unroll(E):
                        Os[w, g, lt * E + e] = O[g, e]
        T.tvm_storage_sync("shared")
        for r in T.unroll(NOUT):
            if r * NT + tx < GQ * D:
                st[FINAL.m] = T.float32(neg_inf)
                for k in T.unroll(NW):
                    st[FINAL.m] = T.max(st[FINAL.m], Ms[k, (r * NT + tx) // D])
                st[FINAL.base] = T.if_then_else(st[FINAL.m] == T.float32(neg_inf), T.float32(0), st[FINAL.m])
                st[FINAL.l_sum] = T.float32(0)
                acc[0] = T.float32(0)
                for k in T.unroll(NW):
                    st[FINAL.w] = T.exp2(Ms[k, (r * NT + tx) // D] - st[FINAL.base])
                    st[FINAL.l_sum] = st[FINAL.l_sum] + Ls[k, (r * NT + tx) // D] * st[FINAL.w]
                    acc[0] = acc[0] + Os[k, (r * NT + tx) // D, (r * NT + tx) % D] * st[FINAL.w]
                # no key seen: l == 0 -> o = 0, lse = -inf; a NaN l (NaN input) propagates
                if st[FINAL.l_sum] == T.float32(0):
                    store(ch, b, h0 + (r * NT + tx) // D, (r * NT + tx) % D, T.float32(0), T.float32(neg_inf))
                else:
                    store(
                        ch,
                        b,
                        h0 + (r * NT + tx) // D,
                        (r * NT + tx) % D,
                        acc[0] / st[FINAL.l_sum],
                        st[FINAL.m] + T.log2(st[FINAL.l_sum]),
                    )
        if merge:
            merge_chunks(bx // NSPLIT, b, h0, tx, st, acc)

    return decode_func(spec, body, scale, split=split, merge=merge, append=append)
