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
  tile's probabilities); half the bytes per tile of 16-bit pages (``decode_layout.FP8_LOAD_BYTES``).
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
from .decode_layout import DEFAULT_WARPS, MERGE_MAX_SPLITS, REG_FLOATS, WARP, decode_layout
from .fp8 import PAIR_TO_HALF2, kv_scale_buffer, page_code, page_value, times_key_scale, times_value_scale
from .spec import KernelSpec, dtype_bytes

DEFAULT_STAGES = 3  # cp.async ring depth of the K/V staging in shared memory (1: loads into registers)
STAGE_BYTES = 96 * 1024  # cap on the staging ring per block
CP16 = "cp.async.cg.shared.global"
CP8 = "cp.async.ca.shared.global"  # 8-byte copies (cg takes 16 only): fp8 pages' 8-code rows
MERGE_UNROLL = 4  # o_part loads of the in-kernel merge issued together

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


def make_paged_decode_cuda(
    spec: KernelSpec,
    *,
    sliding: bool = False,
    inline_rope: bool = False,
    num_warps: int = DEFAULT_WARPS,
    unroll: int | None = None,
    double_buffer: bool = False,
    max_tpk: int = WARP,
    reg_floats: int = REG_FLOATS,
    load_bytes: int | None = None,
    stages: int = DEFAULT_STAGES,
    split: bool = False,
    merge: bool = False,
    append: bool = False,
    rotate: bool = False,
):
    """The CUDA ``paged_decode`` PrimFunc (same signature as ``decode.make_paged_decode``), or with
    ``split`` the ``paged_decode_split`` one (``decode.make_paged_decode_split``; ``None`` for shapes
    without the fast layout).

    ``num_warps`` (warps per block) and ``unroll`` (keys per lane group per tile) are tuning knobs;
    the defaults are what the runtime uses. ``double_buffer`` (experimental) issues tile t+1's
    K/V loads into a second register buffer before computing tile t. ``merge`` (with ``split``): the
    ``paged_decode_split_merge`` PrimFunc (``decode.make_paged_decode_split_merge``), whose last block
    of each (sequence, kv head, query-head slice) merges the chunks' partial states. ``append``: the
    ``paged_decode_append`` PrimFunc (``decode.make_paged_decode_append``; with ``split`` and ``merge``
    its split form), which reads q, k and v from the fused ``qkv`` and appends the new K/V itself
    (``rotate``: rope mode "normal", q and the new k rotated here as ``split_rope`` would).
    """
    lay = decode_layout(spec, num_warps, unroll, max_tpk, reg_floats, load_bytes)
    if lay is None:
        if split:
            return None
        from .attention_generic import build_attention

        return build_attention(spec, source="decode", mask="none", sliding=sliding, inline_rope=inline_rope)
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    page_dtype = spec.page_dtype
    group = spec.group
    VEC, TPK, E, KPW, U, GQ, NW = (lay[k] for k in ("VEC", "TPK", "E", "KPW", "U", "GQ", "NW"))
    # fp8 pages (tvmkv.tir.fp8): K / V registers hold codes, converted where they are used; the K scale
    # joins q's factor, the V scale the output; the new token's K / V are quantized as append stores them
    scale = kv_scale_buffer(spec)
    packed = spec.fp8_pages  # codes converted in pairs (fp8.PAIR_TO_HALF2; E is a multiple of VEC = 8)
    NC = E // VEC  # vector loads (16 bytes; fp8 pages 8) per lane per key row
    NGB = group // GQ  # blocks per kv head
    NT = NW * WARP
    KB = NW * KPW * U  # keys per block per tile
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
    # cp.async staging: each lane copies its own 16-byte chunks into its own slots of a ring of NS
    # tiles in shared memory and reads back only those, so no barrier is needed
    CHUNK = VEC * dtype_bytes(page_dtype)  # bytes of one load: 16 (fp8 pages: 8, with cp.async.ca)
    COPY = CP16 if CHUNK == 16 else CP8
    NS = 1 if double_buffer else max(1, min(stages, STAGE_BYTES // (NT * U * 2 * NC * CHUNK)))
    if NS < 2:
        NS = 1
    CPA = NS >= 2
    STG_SHAPE = (NS, U, 2, NC, NT, VEC) if CPA else (1, 1, 1, 1, 1, VEC)
    STG_WORDS = max(1, math.prod(STG_SHAPE) * dtype_bytes(page_dtype) // 4)
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

    def new_k(q, b, hk, d, angle):
        # element d of sequence b's new key (kv head hk) as the pages store it: rotated by its position
        # in rope mode "normal" (float32, as split_rope), raw otherwise
        if rotate:
            return T.Cast(
                dtype,
                T.Cast("float32", q[b, H_qo + hk, d]) * T.cos(angle)
                + T.if_then_else(
                    d < HALF,
                    T.float32(0) - T.Cast("float32", q[b, H_qo + hk, d + HALF]),
                    T.Cast("float32", q[b, H_qo + hk, d - HALF]),
                )
                * T.sin(angle),
            )
        return q[b, H_qo + hk, d]

    @macro
    def put_new_kv(b, hk, tx):
        # the new token's k and v into its slot (skipped where the slot is negative), one element a thread
        if new_slots[b] >= 0:
            for r in T.unroll(-(-D // NT)):
                if r * NT + tx < D:
                    pages[new_slots[b] // P, 0, hk, new_slots[b] % P, r * NT + tx] = page_code(
                        spec,
                        new_k(
                            q,
                            b,
                            hk,
                            r * NT + tx,
                            T.Cast("float32", q_pos[b])
                            * rope_inv_freq(rope_scale, rope_theta, (r * NT + tx) % HALF, D),
                        ),
                        scale,
                        0,
                        hk,
                    )
                    pages[new_slots[b] // P, 1, hk, new_slots[b] % P, r * NT + tx] = page_code(
                        spec, q[b, H_qo + H_kv + hk, r * NT + tx], scale, 1, hk
                    )

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
        stg = T.decl_buffer(STG_SHAPE, page_dtype, data=stg_raw.data, scope="shared.dyn")
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
        if append:
            if bx // NSPLIT % NGB == 0 and ch == 0:  # one block per (sequence, kv head) stores the new K/V
                put_new_kv(b, hk, tx)

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
                st[MERGE.base] = T.if_then_else(st[MERGE.m_new] == T.float32(neg_inf), T.float32(0), st[MERGE.m_new])
                st[MERGE.alpha] = T.exp2(m[g] - st[MERGE.base])
                st[MERGE.beta] = T.exp2(acc[0] - st[MERGE.base])
                l_sum[g] = (
                    l_sum[g] * st[MERGE.alpha] + shfl_xor(T.uint32(FULL), l_sum[g], TPK << r, WARP) * st[MERGE.beta]
                )
                for e in T.unroll(E):
                    O[g, e] = (
                        O[g, e] * st[MERGE.alpha] + shfl_xor(T.uint32(FULL), O[g, e], TPK << r, WARP) * st[MERGE.beta]
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
