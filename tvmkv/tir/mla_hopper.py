# ruff: noqa: F821, F841
# (the TVMScript macros below name the kernel's buffers and variables, which ruff cannot see)
"""Hopper (sm_90) schedule of cuda ``mla_attention`` / ``mla_attention_split``: warpgroup MMA. See
docs/layout.md ("MLA kernels").

The forward of :mod:`tvmkv.tir.mla` (absorbed attention: every head scores the whole latent row, the
first ``D_v`` dims are V), with both products on Hopper's asynchronous warpgroup MMA (``wgmma``, fp32
accumulation), **transposed** so that a block of ``HB`` heads (16 or 32) needs no padding to wgmma's
64 rows (a decode row has one query per head):

* ``S^T[64 keys, HB] = L Q^T``: ``m64n{HB}k16``, ``D / 16`` steps; ``A`` = the latent tile, ``B`` = the
  block's queries, both K-major in shared memory;
* ``O^T[D_v, HB] += L_v^T P^T``: per 64-dim block of ``D_v``, one ``m64n{HB}k16`` per 16 keys;
  ``A`` = the same latent tile read MN-major (transposed by the instruction), ``B = P^T``, written by
  the threads into 2-4 KiB of shared memory.

Work decomposition
------------------
* One thread block = (query row, [chunk of the split,] ``HB`` heads), two warpgroups (FlashAttention-3's
  warp specialization): warpgroup 0 computes, warpgroup 1 copies. In warpgroup 0, warp ``w`` holds
  keys ``16 w .. 16 w + 15`` of ``S^T`` and dims ``16 w ..`` of each 64-dim block of ``O^T`` (wgmma's
  accumulator layout: ``mma.sync``'s m16n8 layout per warp), lane ``4 g + t`` keys / dims ``g, g + 8``
  and heads ``8 k + 2 t, 8 k + 2 t + 1``.
* Latent tiles of ``TK`` = ``WG_KEYS`` = 48 rows (54 KiB at DeepSeek-V2's ``D`` 576) in a ring of
  ``WG_STAGES`` = 3 stages. wgmma's M is 64: ``S^T`` also reads the 16 rows after a tile (the next
  column block, or a pad after the last stage) and those scores are masked; ``O^T`` takes only the
  tile's 3 k16 steps. (48 x 3 measured faster than 64 x 2 and 32 x 5, bench/RESULTS.md.)
* The copying warpgroup fills stage ``t % 3`` with tile ``t`` once the stage's "empty" mbarrier says
  tile ``t - 3`` is done. Threads ``u < TK`` write the tile's key visibility (window, causal mask, the
  chunk's end). With page size 16 (and a chunk starting on a page) one thread then issues bulk
  tensor copies (TMA, ``cp.async.bulk.tensor``) from a 3-D tensor map over the page pool that the
  kernel's host code encodes on every call (``[num_pages, P, D]``, boxes of ``[1, P, 64]``, the
  128-byte swizzle): one per page and 64-dim column block, landing exactly in the layout below and
  completing the stage's "full" phase by their byte count (``mbarrier.arrive.expect_tx``); every other
  copying thread arrives on "full" too, releasing its visibility entries. Otherwise (other page sizes,
  or a ``kv_chunk`` that is not a multiple of the page) every copying thread looks up the slots and
  issues ``D / 16`` 16-byte ``cp.async`` (8 consecutive threads fill one 128-byte row segment: no bank
  conflict); one tile later it waits for its own copies, makes them visible to wgmma
  (``fence.proxy.async``) and arrives. Issuing copies stalls a warp whenever the memory pipeline is
  full; with a warpgroup of its own those stalls no longer hold up the products (one warpgroup doing
  both: bench/RESULTS.md, ``wg_producer=False``), and the bulk copies take the per-thread issue out
  altogether (H 16 128 x 2048: 91 -> 83 us).
* The computing warpgroup waits for "full", runs both products and the online softmax, and arrives
  on "empty". Head maxima meet across the 8 lanes holding a head (shuffles) and the 4 warps (shared
  memory, one named barrier a tile); sums stay per thread to the end.
* The row/chunk search, key range, sliding-window and causal visibility, and the output stores are
  :mod:`tvmkv.tir.mla`'s (passed in as ``rows``).
* Shared memory, as wgmma's 128-byte swizzle reads it (see :mod:`tvmkv.tir.prefill_hopper`): a tile of
  ``R`` rows x ``D`` is ``D / 64`` column blocks of ``[R][64]``, 16-byte chunk ``c`` of row ``r`` at chunk
  ``c ^ (r % 8)``; order: Q (``HB`` rows), P^T (``HB`` rows of 64 keys), the latent stages, the pad,
  from the first 1024-byte boundary of the dynamic buffer.

Used where :func:`tvmkv.tir.mla_layout.wgmma_heads` allows it (cuda built for sm_90, fp16 / bf16,
``H`` a multiple of ``HB`` (32 where ``H`` allows, else 16), ``D`` and ``D_v`` multiples of 64); the
``mma.sync`` schedule of :mod:`tvmkv.tir.mla` serves sm_80 / sm_89 and every other shape. On an H200 at
DeepSeek-V2's latent shape (bench/RESULTS.md, the kernels alone): H 16 decode 128 x 2048 112 -> 83 us
(3.6 TB/s: 87% of a device copy's read + write rate, torch 193 us), H 128 64 x 4096 477 -> 311 us.
"""

from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from ._kernel_common import LOG2E, WARP, macro
from .mla_layout import WG_KEYS, WG_PRODUCER, WG_STAGES, WG_TMA, wg_shared_bytes
from .prefill_cuda import CP16
from .prefill_hopper import aligned_descriptors, sw_off, wgmma_op
from .spec import MlaSpec

NT = 128  # threads of a warpgroup (the computing one; the copying one, if any, has as many)
NEG_INF = float("-inf")


def make_body(
    spec: MlaSpec,
    rows: SimpleNamespace,
    heads: int,
    keys: int = WG_KEYS,
    stages: int = WG_STAGES,
    producer: bool = WG_PRODUCER,
    tma: bool = WG_TMA,
):
    """The TVMScript body of cuda ``mla_attention`` (or ``_split``) on warpgroup MMA, ``heads`` heads a
    block, ``stages`` latent tiles of ``keys`` rows in shared memory (the caller checks them with
    :func:`tvmkv.tir.mla_layout.wgmma_heads`). ``rows`` holds :mod:`tvmkv.tir.mla`'s macros
    ``find_sequence``, ``key_range``, ``key_slot``, ``store_o``, ``store_lse`` and its ``KEYS`` slots; the
    body reads the signature's buffers by name. ``producer``: a second warpgroup issues the copies
    (the default); else the one warpgroup copies and computes. ``tma``: the copying warpgroup uses
    bulk tensor copies where the page size allows (the default)."""
    H, D, Dv, P, dtype = spec.num_heads, spec.head_dim, spec.latent_dim, spec.page_size, spec.dtype
    HB, TK, ST, KEYS = heads, keys, stages, rows.KEYS
    assert H % HB == 0 and D % 64 == 0 and Dv % 64 == 0, "make_body called outside its shapes"
    LOGP = P.bit_length() - 1
    PMASK = P - 1
    NBH = H // HB  # blocks per query row
    CPR = D // 8  # 16-byte chunks of a latent row
    KD = D // 16  # k16 steps of S^T
    MT = Dv // 64  # m64 tiles of O^T
    NG = HB // 8  # n8 groups of the accumulators
    NH = 2 * NG  # heads a thread holds
    CPT = TK * CPR // NT  # chunks a thread copies per tile
    QC = HB * CPR  # chunks of Q
    Q_OFF = 0
    P_OFF = HB * D
    T_OFF = HB * D + HB * 64  # latent tile 0; the others follow
    WORDS = wg_shared_bytes(spec, HB, TK, ST) // 4
    # entries of the slot / visibility ring: one per stage with a producer (refilled after the stage's
    # "empty" barrier); else tiles t .. t + ST - 1 in use and t + ST being written
    RING = ST if producer else ST + 1
    NTH = 2 * NT if producer else NT  # threads of a block
    # the copying warpgroup's bulk tensor copies (TMA): one per page and 64-dim column block, from a 3-D
    # tensor map over the page pool [num_pages, P, D] with wgmma's 128-byte swizzle; tiles whose first
    # key starts a page (every tile of a chunk that does) take it, other chunks the 16-byte copies
    use_tma = producer and tma and P == 16 and TK % P == 0  # (the page size measured and tested on a GPU)
    TBYTES = TK * D * 2  # bytes of a latent tile
    tmap = T.Var("pages_tensormap", ty=T.handle("tensormap").ty)
    wg = wgmma_op(HB, dtype)
    V_LBO = TK * 128 // 16  # MN-major A: the next 64-dim column block (one block per m64 tile: unused)

    def kdesc(region, nrows, kk):
        # 16-byte units from the descriptor base to k16 step kk of a K-major tile of nrows rows at
        # element offset region (1024-byte aligned)
        return region // 8 + (kk // 4) * (nrows * 8) + (kk % 4) * 2

    def tile_off(s):
        return T_OFF + s * (TK * D)

    def head(tx, r):  # block head of thread tx's accumulator register r (n8 group r // 4)
        return (r // 4) * 8 + 2 * (tx % 4) + r % 2

    def row16(tx, r):  # row (key of S^T, dim of O^T's m64 tile) of thread tx's accumulator register r
        return tx // WARP * 16 + tx % WARP // 4 + 8 * (r // 2 % 2)

    def hreg(hh):  # the first accumulator register of the thread's head hh
        return 4 * (hh // 2) + hh % 2

    @macro
    def tile_slots(kr, Kid, Kvis, i, t, e, u):
        # threads u < TK (of the copying warpgroup): slot and visibility of key u of tile t into ring
        # entry e (keys past the chunk's end read the last key, masked)
        if u < TK:
            rows.key_slot(kr, i, T.min(kr[KEYS.start] + t * TK + u, kr[KEYS.end] - 1))
            Kvis[e, u] = T.Cast("int32", kr[KEYS.start] + t * TK + u < kr[KEYS.end] and kr[KEYS.slot] >= 0)
            Kid[e, u] = page_indices[
                kr[KEYS.base] + (T.min(kr[KEYS.start] + t * TK + u, kr[KEYS.end] - 1) >> LOGP)
            ] * P + (T.min(kr[KEYS.start] + t * TK + u, kr[KEYS.end] - 1) & PMASK)

    @macro
    def tile_vis(kr, Kvis, i, t, e, u):
        # threads u < TK: visibility of key u of tile t into ring entry e (tile_slots without the page
        # lookup: the bulk copies fetch whole pages)
        if u < TK:
            kr[KEYS.slot] = kr[KEYS.start] + t * TK + u
            kr[KEYS.pos] = T.if_then_else(
                kr[KEYS.slot] < kr[KEYS.sink_end], kr[KEYS.slot], kr[KEYS.slot] + kr[KEYS.window_offset]
            )
            Kvis[e, u] = T.Cast(
                "int32",
                kr[KEYS.slot] < kr[KEYS.end]
                and (kr[KEYS.slot] < kr[KEYS.sink_end] or kr[KEYS.slot] >= kr[KEYS.window_start])
                and (causal == 0 or kr[KEYS.pos] <= q_pos[i]),
            )

    @macro
    def issue_tile_tma(kr, t, s):
        # one thread: the pages of tile t (past the sequence's last page: the last page, masked) into
        # latent stage s, a 2 KiB [P][64] slab per page and column block, on the stage's "full" barrier
        T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](mbar.ptr_to([s]), T.uint32(TBYTES))
        for pg in T.unroll(TK // P):
            for cb in T.unroll(D // 64):
                T.ptx["cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"](
                    sm.ptr_to([pad[0] + tile_off(s) + (cb * TK + pg * P) * 64]),
                    T.address_of(tmap),
                    cb * 64,
                    0,
                    page_indices[
                        kr[KEYS.base] + T.min(((kr[KEYS.start] + t * TK) >> LOGP) + pg, (kr[KEYS.kv_len] - 1) >> LOGP)
                    ],
                    mbar.ptr_to([s]),
                )

    @macro
    def issue_tile(Kid, e, s, u):
        # cp.async the rows of ring entry e into latent tile s: 8 consecutive threads per 128-byte segment
        for c in T.unroll(CPT):
            T.ptx[CP16](
                sm.ptr_to([pad[0] + tile_off(s) + sw_off(TK, (c * NT + u) // CPR, (c * NT + u) % CPR)]),
                pages.ptr_to(
                    [
                        Kid[e, (c * NT + u) // CPR] >> LOGP,
                        Kid[e, (c * NT + u) // CPR] & PMASK,
                        (c * NT + u) % CPR * 8,
                    ]
                ),
                16,
            )

    @macro
    def issue_q(i, h0):
        for c in T.unroll((QC + NT - 1) // NT):
            if c * NT + tx < QC:
                T.ptx[CP16](
                    sm.ptr_to([pad[0] + Q_OFF + sw_off(HB, (c * NT + tx) // CPR, (c * NT + tx) % CPR)]),
                    q.ptr_to([i, h0 + (c * NT + tx) // CPR, (c * NT + tx) % CPR * 8]),
                    16,
                )

    @macro
    def compute_tile(s, e):
        # S^T, online softmax, P^T and O^T of the tile in stage s (visibility at ring entry e)
        # ---- S^T = L Q^T
        T.ptx["wgmma.fence.sync.aligned"]()
        for kk in T.unroll(KD):
            da[0] = dk[0] + T.uint64(kdesc(tile_off(s), TK, kk))
            db[0] = dk[0] + T.uint64(kdesc(Q_OFF, HB, kk))
            T.ptx[wg](*[sacc[r] for r in range(NG * 4)], da[0], db[0], kk > 0, 1, 1, 0, 0)
        T.ptx["wgmma.commit_group.sync.aligned"]()
        T.ptx["wgmma.wait_group.sync.aligned"](0)
        # ---- online softmax (log2 units); keys that are not visible (and rows past TK): -inf
        for r in T.unroll(NG * 4):
            sacc[r] = T.if_then_else(
                Kvis[e, row16(tx, r)] == 1, sacc[r] * (sm_scale * T.float32(LOG2E)), T.float32(NEG_INF)
            )
        for hh in T.unroll(NH):
            mx[hh] = T.max(sacc[hreg(hh)], sacc[hreg(hh) + 2])
        # head maxima over the block: the lanes of a head (xor 4, 8, 16), then the 4 warps through X[0]
        for hh in T.unroll(NH):
            mx[hh] = T.max(mx[hh], T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), mx[hh], 4, 32))
            mx[hh] = T.max(mx[hh], T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), mx[hh], 8, 32))
            mx[hh] = T.max(mx[hh], T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), mx[hh], 16, 32))
            if tx % WARP < 4:
                X[0, tx // WARP, head(tx, hreg(hh))] = mx[hh]
        if producer:  # the computing warpgroup's barrier
            T.ptx["barrier.sync.aligned"](T.uint32(1), T.uint32(NT))
        else:
            T.tvm_storage_sync("shared")
        for hh in T.unroll(NH):
            mx[hh] = T.max(
                T.max(X[0, 0, head(tx, hreg(hh))], X[0, 1, head(tx, hreg(hh))]),
                T.max(X[0, 2, head(tx, hreg(hh))], X[0, 3, head(tx, hreg(hh))]),
            )
        for hh in T.unroll(NH):
            # a head with no visible key so far subtracts a finite base (p = 0, alpha = 0 on a zero state)
            mx[hh] = T.max(m[hh], mx[hh])
            base[hh] = T.if_then_else(mx[hh] == T.float32(NEG_INF), T.float32(0), mx[hh])
            alpha[hh] = T.exp2(m[hh] - base[hh])
            m[hh] = mx[hh]
            lsum[hh] = lsum[hh] * alpha[hh]
            for half in T.unroll(2):
                sacc[hreg(hh) + 2 * half] = T.exp2(sacc[hreg(hh) + 2 * half] - base[hh])
                lsum[hh] = lsum[hh] + sacc[hreg(hh) + 2 * half]
        for mt in T.unroll(MT):
            for r in T.unroll(NG * 4):
                o_acc[mt, r] = o_acc[mt, r] * alpha[2 * (r // 4) + r % 2]
        # ---- P^T into shared memory (K-major B of O^T: head rows of 64 keys, swizzled)
        for r in T.unroll(NG * 4):
            sm[pad[0] + P_OFF + sw_off(HB, head(tx, r), row16(tx, r) // 8) + row16(tx, r) % 8] = T.Cast(dtype, sacc[r])
        T.ptx["fence.proxy.async.shared::cta"]()
        if producer:
            T.ptx["barrier.sync.aligned"](T.uint32(1), T.uint32(NT))
        else:
            T.tvm_storage_sync("shared")
        # ---- O^T += L_v^T P^T
        T.ptx["wgmma.fence.sync.aligned"]()
        for mt in T.unroll(MT):
            for kk in T.unroll(TK // 16):
                da[0] = dv[0] + T.uint64((tile_off(s) + mt * TK * 64 + kk * 16 * 64) // 8)
                db[0] = dk[0] + T.uint64(kdesc(P_OFF, HB, kk))
                T.ptx[wg](*[o_acc[mt, r] for r in range(NG * 4)], da[0], db[0], True, 1, 1, 1, 0)
        T.ptx["wgmma.commit_group.sync.aligned"]()
        T.ptx["wgmma.wait_group.sync.aligned"](0)

    @macro
    def body():
        if use_tma:
            T.Bind(T.tvm_stack_alloca("tensormap", 1), var=tmap)
            T.tensormap_encode_tiled(
                tmap,
                pages.data,
                D,
                P,
                num_pages,
                D * 2,
                P * D * 2,
                64,
                P,
                1,
                1,
                1,
                1,
                descriptor_dtype=dtype,
                rank=3,
                swizzle=3,
            )
        bx = T.launch_thread("blockIdx.x", T.max(n * NBH * NSPLIT, 1))  # max: no empty grid when n == 0
        tx = T.launch_thread("threadIdx.x", NTH)
        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)
        ch = T.meta_var(bx % NSPLIT)  # the chunk (split; chunks of a row side by side)
        i = T.meta_var(bx // NSPLIT // NBH)
        h0 = T.meta_var(bx // NSPLIT % NBH * HB)
        # dynamic shared memory as float32 words (kernels of several dtypes in one module declare the
        # same extern __shared__ array); tiles start at pad[0], the first 1024-byte boundary
        sm_raw = T.alloc_buffer((WORDS,), "float32", scope="shared.dyn")
        sm = T.decl_buffer((WORDS * 2,), dtype, data=sm_raw.data, scope="shared.dyn")
        Kid = T.alloc_buffer((RING, 64), "int32", scope="shared")  # slots of the keys of a tile
        Kvis = T.alloc_buffer((RING, 64), "int32", scope="shared")  # 0 past TK: the rows wgmma reads beyond
        X = T.alloc_buffer((2, 4, HB), "float32", scope="shared")  # per-warp head maxima / sums
        mbar = T.alloc_buffer((2 * ST,), "uint64", scope="shared")  # producer: per stage "full", "empty"
        seq = T.alloc_buffer((len(rows.SEQ),), "int32", scope="local")
        kr = T.alloc_buffer((len(KEYS),), "int32", scope="local")
        nt = T.alloc_buffer((1,), "int32", scope="local")
        pad = T.alloc_buffer((1,), "int32", scope="local")
        dk = T.alloc_buffer((1,), "uint64", scope="local")
        dv = T.alloc_buffer((1,), "uint64", scope="local")
        da = T.alloc_buffer((1,), "uint64", scope="local")
        db = T.alloc_buffer((1,), "uint64", scope="local")
        sacc = T.alloc_buffer((NG * 4,), "float32", scope="local")  # S^T, then P^T
        o_acc = T.alloc_buffer((MT, NG * 4), "float32", scope="local")  # O^T
        m = T.alloc_buffer((NH,), "float32", scope="local")  # running max of the thread's heads (log2 units)
        lsum = T.alloc_buffer((NH,), "float32", scope="local")  # this thread's part of their sums
        mx = T.alloc_buffer((NH,), "float32", scope="local")
        base = T.alloc_buffer((NH,), "float32", scope="local")
        alpha = T.alloc_buffer((NH,), "float32", scope="local")

        # ---- descriptors of the buffer start, moved up to the first 1024-byte boundary: K-major (Q,
        # the tiles for S^T, P^T) and MN-major (the tiles for O^T)
        aligned_descriptors(sm, pad, dk, dv, V_LBO)

        if i < n:
            rows.find_sequence(seq, i)
            rows.key_range(kr, seq, i, ch)
        else:
            kr[KEYS.start] = 0
            kr[KEYS.end] = 0
        nt[0] = (kr[KEYS.end] - kr[KEYS.start] + TK - 1) // TK
        for hh in T.unroll(NH):
            m[hh] = T.float32(NEG_INF)
            lsum[hh] = T.float32(0)
        for mt in T.unroll(MT):
            for r in T.unroll(NG * 4):
                o_acc[mt, r] = T.float32(0)
        if TK < 64:
            if tx < 64 - TK:
                for e in T.unroll(RING):
                    Kvis[e, TK + tx] = 0
        if producer:
            if tx == 0:
                # "full": the copying threads (with bulk copies, one of them also waits for their
                # bytes); "empty": the computing threads
                for b in T.unroll(ST):
                    T.ptx["mbarrier.init.shared::cta.b64"](mbar.ptr_to([b]), T.uint32(NT))
                for b in T.unroll(ST):
                    T.ptx["mbarrier.init.shared::cta.b64"](mbar.ptr_to([ST + b]), T.uint32(NT))
        # Q: its own commit group, waited for before the first tile
        if tx < NT:
            if i < n:
                issue_q(i, h0)
        T.ptx["cp.async.commit_group"]()
        if producer:
            T.tvm_storage_sync("shared")  # barriers and the visibility padding
            if tx < NT:
                # warpgroup 0 computes each tile once its stage's "full" barrier completes, then
                # releases the stage ("empty")
                T.ptx["cp.async.wait_group"](0)
                T.ptx["fence.proxy.async.shared::cta"]()
                T.ptx["barrier.sync.aligned"](T.uint32(1), T.uint32(NT))  # Q
                for t in T.serial(nt[0]):
                    T.cuda.mbarrier_wait(mbar.ptr_to([t % ST]), (t // ST) % 2)
                    compute_tile(t % ST, t % ST)
                    T.ptx["mbarrier.arrive.shared::cta.b64"](mbar.ptr_to([ST + t % ST]))
            elif use_tma and kr[KEYS.start] % P == 0:
                # warpgroup 1, bulk copies: tile t's visibility, then (one thread) its pages into stage
                # t % ST once the stage's previous tile is released (the copies complete the stage's
                # "full" phase through their byte count; nothing to fence: they are async-proxy writes)
                for t in T.serial(nt[0]):
                    if t >= ST:
                        T.cuda.mbarrier_wait(mbar.ptr_to([ST + t % ST]), (t // ST - 1) % 2)
                    tile_vis(kr, Kvis, i, t, t % ST, tx - NT)
                    # every copying thread arrives (releasing its visibility entries); the first one
                    # with the tile's byte count, before its copies
                    if tx == NT:
                        issue_tile_tma(kr, t, t % ST)
                    else:
                        T.ptx["mbarrier.arrive.shared::cta.b64"](mbar.ptr_to([t % ST]))
            else:
                # warpgroup 1 copies tile t into stage t % ST once the stage's previous tile is released;
                # each thread waits for its own copies of a tile one tile later (two in flight), makes
                # them visible to wgmma and arrives on the stage's "full" barrier
                for t in T.serial(nt[0]):
                    if t >= ST:
                        T.cuda.mbarrier_wait(mbar.ptr_to([ST + t % ST]), (t // ST - 1) % 2)
                    tile_slots(kr, Kid, Kvis, i, t, t % ST, tx - NT)
                    T.ptx["barrier.sync.aligned"](T.uint32(2), T.uint32(NT))  # the tile's slots are written
                    issue_tile(Kid, t % ST, t % ST, tx - NT)
                    T.ptx["cp.async.commit_group"]()
                    if t > 0:
                        T.ptx["cp.async.wait_group"](1)
                        T.ptx["fence.proxy.async.shared::cta"]()
                        T.ptx["mbarrier.arrive.shared::cta.b64"](mbar.ptr_to([(t - 1) % ST]))
                if nt[0] > 0:
                    T.ptx["cp.async.wait_group"](0)
                    T.ptx["fence.proxy.async.shared::cta"]()
                    T.ptx["mbarrier.arrive.shared::cta.b64"](mbar.ptr_to([(nt[0] - 1) % ST]))
        else:
            # one warpgroup: tiles t + 1 .. t + ST - 1 on their way while tile t is computed
            for s2 in T.unroll(ST):
                if s2 < nt[0]:
                    tile_slots(kr, Kid, Kvis, i, s2, s2, tx)
            T.tvm_storage_sync("shared")
            # tiles 0 .. ST - 2, one commit group each (empty ones too: wait_group(ST - 2) at step t then
            # always means "tile t has landed")
            for s2 in T.unroll(ST - 1):
                if s2 < nt[0]:
                    issue_tile(Kid, s2, s2, tx)
                T.ptx["cp.async.commit_group"]()
            for t in T.serial(nt[0]):
                # tile t landed for everyone and is visible to wgmma; tile t - 1's stage is free
                T.ptx["cp.async.wait_group"](ST - 2)
                T.ptx["fence.proxy.async.shared::cta"]()
                T.tvm_storage_sync("shared")
                if t + ST - 1 < nt[0]:
                    issue_tile(Kid, (t + ST - 1) % RING, (t + ST - 1) % ST, tx)
                T.ptx["cp.async.commit_group"]()
                if t + ST < nt[0]:
                    tile_slots(kr, Kid, Kvis, i, t + ST, (t + ST) % RING, tx)
                compute_tile(t % ST, t % RING)
        T.ptx["cp.async.wait_group"](0)

        # ---- o = O / l, lse = m + log2(l); a head without keys (l = 0): o = 0, lse = -inf
        if tx < NT:
            # head sums over the block: the lanes of a head, then the 4 warps through X[1]
            for hh in T.unroll(NH):
                lsum[hh] = lsum[hh] + T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), lsum[hh], 4, 32)
                lsum[hh] = lsum[hh] + T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), lsum[hh], 8, 32)
                lsum[hh] = lsum[hh] + T.cuda.__shfl_xor_sync(T.uint32(0xFFFFFFFF), lsum[hh], 16, 32)
                if tx % WARP < 4:
                    X[1, tx // WARP, head(tx, hreg(hh))] = lsum[hh]
            if producer:
                T.ptx["barrier.sync.aligned"](T.uint32(1), T.uint32(NT))
            else:
                T.tvm_storage_sync("shared")
            for hh in T.unroll(NH):
                lsum[hh] = (X[1, 0, head(tx, hreg(hh))] + X[1, 1, head(tx, hreg(hh))]) + (
                    X[1, 2, head(tx, hreg(hh))] + X[1, 3, head(tx, hreg(hh))]
                )
            if i < n:
                if tx < 4:
                    for hh in T.unroll(NH):
                        rows.store_lse(
                            ch,
                            i,
                            h0 + head(tx, hreg(hh)),
                            T.if_then_else(lsum[hh] == T.float32(0), T.float32(NEG_INF), m[hh] + T.log2(lsum[hh])),
                        )
                for mt in T.unroll(MT):
                    for r in T.unroll(NG * 4):
                        rows.store_o(
                            ch,
                            i,
                            h0 + head(tx, r),
                            mt * 64 + row16(tx, r),
                            T.if_then_else(
                                lsum[2 * (r // 4) + r % 2] == T.float32(0),
                                T.float32(0),
                                o_acc[mt, r] / lsum[2 * (r // 4) + r % 2],
                            ),
                        )

    return body
