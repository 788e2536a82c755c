# ruff: noqa: F821, F841
# (the TVMScript macros below name the kernel's buffers and variables, which ruff cannot see)
"""Hopper (sm_90) schedule of the paged and ragged prefill kernels: warpgroup MMA. See docs/layout.md.

The same forward as :mod:`tvmkv.tir.prefill_cuda` (flash-attention-2: online softmax in base 2 on the
score registers, ``P`` kept in registers, one pass over the keys), with both products on Hopper's
asynchronous warpgroup MMA (``wgmma.mma_async``, fp32 accumulation) instead of ``mma.sync``:

* ``S = Q K^T``: one ``m64n{BC}k16`` per 16 head dims, both operands read by the tensor cores straight
  from shared memory through matrix descriptors (no ``ldmatrix``);
* ``O += P V``: one ``m64n{D}k16`` per 16 keys, ``A = P`` from registers (the score accumulators,
  converted to fp16 / bf16 pairs, are already laid out as wgmma's A fragment), ``B = V`` from shared
  memory read MN-major (transposed by the instruction).

Work decomposition
------------------
* One thread block = (query tile, kv head ``hk``), two computing warpgroups (256 threads) and, by
  default, a third that copies (FlashAttention-3's warp specialization; 384 threads). ``BR = 128``
  query rows (computing warpgroup ``g`` owns rows ``64 g .. 64 g + 63``, warp ``w`` rows ``16 w .. 16 w
  + 15``: the accumulator layout of ``m64nN`` is ``mma.sync``'s m16n8 layout per warp). GQA packing,
  tile ids, the binary search for the sequence, the causal key range and mask, the page-table gather
  and the output are those of :mod:`tvmkv.tir.prefill_cuda` (its helpers are reused).
* K/V tiles of ``BC`` keys (default 128) in a ring of ``STAGES`` shared-memory slots (default 3),
  filled by 16-byte ``cp.async``. Default (``producer``): the copying warpgroup fills slot ``j % 3``
  with tile ``j`` once the slot's "empty" mbarrier says tile ``j - 3`` is done (256 arrivals: every
  computing thread's ``P V`` of it), and one tile later waits for its own copies of tile ``j``, makes
  them visible to the tensor cores' async proxy (``fence.proxy.async``) and arrives on the slot's
  "full" mbarrier (128 arrivals). Its threads give registers back (``setmaxnreg.dec`` to
  ``PRODUCER_REGS`` = 40) and the computing ones take them (``setmaxnreg.inc`` to 232), so 384 threads
  fit the register file. Issuing copies stalls a warp while the memory pipeline is full; on a
  warpgroup of its own that no longer holds up the products (H200, fp16 32/8 heads, D 128: causal
  1x4096 304 -> 282 µs, 4x1024 over 2048 of history 407 -> 367 µs). Without it every
  computing thread issues copies: it waits for its own, fences, arrives on "full" (256 arrivals).
* Tile loop (:func:`make_prefill_hopper` ``pingpong``, the default; FlashAttention-3's two
  overlaps): step ``j`` issues ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` back to back, waits for
  ``S_j`` only, and runs tile ``j``'s softmax while the tensor cores do the ``P V`` product; the two
  warpgroups take turns issuing their products (named barriers 1 and 2), so one's softmax also runs
  under the other's products. The warpgroups hand shared memory over with the mbarriers above, not
  block-wide barriers, so they can run half a step apart (without the copying warpgroup, step ``j``
  refills the slot of tile ``j - 2`` with tile ``j + STAGES - 2`` while its products run). Knobs kept
  for tuning: ``producer=False``, ``overlap`` (the same loop with the warpgroups in step, block
  barriers), neither (serial: S, softmax, P V per tile), ``warpgroups=1`` (64-row blocks), ``bc`` 64.
* Shared-memory layout, the one wgmma's 128-byte swizzle reads: a tile of ``R`` rows x ``D`` dims is
  stored as ``D / 64`` column blocks of ``[R][64]`` (128 bytes a row); 16-byte chunk ``c`` of row ``r``
  sits at chunk ``c ^ (r % 8)`` of its row (:func:`sw_off`). Every tile starts 1024-byte aligned (the
  swizzle is a function of address bits 4-9), so the dynamic buffer is padded at run time to the next
  1024-byte boundary. K-major operands (``Q``, ``K``): stride between 8-row groups 1024 bytes, a k16
  step moves the start address 32 bytes inside the 128-byte atom (and to the next column block every
  4 steps). ``V`` (MN-major): 8-key groups 1024 bytes apart, the two 64-dim column blocks ``BC x 128``
  bytes apart, a k16 step moves 16 rows.

fp8 pages (paged): the copying warpgroup loads a tile's codes into registers (16-byte loads, a row's 16
codes each), converts them pair by pair to the 16-bit dtype (``cvt`` of two codes, exact), stores two
16-byte chunks into the slot (the two in an order that keeps a quarter warp's stores on distinct banks),
then fences and arrives on "full": the products run on 16-bit operands as over 16-bit pages, and K/V
cross the memory system at one byte an element. It keeps ``CODES_PRODUCER_REGS`` = 80 registers (the
computing threads 208). An earlier variant that copied the codes into shared memory and converted them
there loaded the shared-memory pipe the products read from, and was slower than converting all the
forward's pages in a separate pass first (bench/RESULTS.md, "fp8 pages").

Fast path (:func:`hopper_layout`): target cuda built for sm_90, fp16 or bf16, head_dim 64 or 128,
mask "none" or "causal", no sliding window, no inline RoPE, ``group`` dividing 128. On an H200 (fp16,
H_qo 32, H_kv 8, D 128, page 16; bench/RESULTS.md) causal 1x4096 runs at 487 TFLOP/s (mma.sync:
292; torch 514), 4x1024 new tokens over 2048 of history at 468 (264; torch 284). Everything else
keeps the ``mma.sync`` schedule of :mod:`tvmkv.tir.prefill_cuda` (sm_80 / sm_89, other shapes) or the
generic one.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._kernel_common import LOG2E, WARP, macro
from .attention import paged_prefill_func, ragged_prefill_func
from .fp8 import FLOAT2_TO_PAIR, code_pair_at, kv_scale_buffer, times_key_scale, widen_pair
from .prefill_cuda import BLOCK, CP16, CVT, block_macros, kv_rc, load_rc
from .spec import KernelSpec

HOPPER_ARCHS = ("sm_90",)
DEFAULT_WARPGROUPS = 2  # 64 query rows and 128 threads each
# The schedule the runtime builds; the other knobs are kept for tuning (bench/RESULTS.md has the
# measured alternatives: one warpgroup per block, 64-key tiles, the serial and overlapped loops)
DEFAULT_BC = 128  # keys per K/V tile
DEFAULT_STAGES = 3  # K/V tiles in the ring of shared-memory slots
DEFAULT_OVERLAP = False  # one warpgroup's softmax of tile j under its own P V of tile j - 1 (needs 3+ slots)
DEFAULT_PINGPONG = True  # the overlapped loop with the two warpgroups out of step (needs 3+ slots)
DEFAULT_PRODUCER = True  # ping-pong fed by a third warpgroup that issues the K/V copies
PRODUCER_REGS = 40  # registers a thread of the copying warpgroup keeps (setmaxnreg); the others get 232
# fp8 pages: the copying warpgroup holds a tile's codes in registers while it converts them (the computing
# threads then get 208; at 72 / 216 ptxas spills)
CODES_PRODUCER_REGS = 80
SMEM_LIMIT = 227 * 1024  # dynamic shared memory an sm_90 block may opt into
ALIGN = 1024  # bytes: the 128-byte swizzle repeats every 8 rows of 128 bytes
PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}


def wgmma_op(n: int, dtype: str) -> str:
    """The ``m64n{n}k16`` wgmma with fp32 accumulation for ``dtype`` operands."""
    t = PTX_TYPE[dtype]
    return f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t}"


def sw_off(rows, r, c):
    """Element offset of 16-byte chunk ``c`` of row ``r`` inside a tile of ``rows`` rows in the
    128-byte-swizzled layout (column blocks of 64 elements, chunk XOR row within 8-row groups)."""
    return ((c >> 3) * rows + r) * 64 + ((c & 7) ^ (r & 7)) * 8


@macro
def aligned_descriptors(sm, pad, dk, dv, v_lbo):
    """Move the dynamic buffer ``sm`` up to its first 1024-byte boundary (``pad[0]``, in elements of a
    2-byte type: the 128-byte swizzle is a function of address bits 4-9) and encode there the base
    matrix descriptors of the 128-byte swizzle: ``dk`` K-major (8-row groups 1024 bytes apart), ``dv``
    MN-major with ``v_lbo`` (16-byte units) between its 64-element column blocks."""
    T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dk[0]), sm.ptr_to([0]), 1, ALIGN // 16, 3)
    # (the descriptor's low 14 bits are the shared address / 16)
    pad[0] = T.Cast("int32", (T.uint64(ALIGN // 16) - (dk[0] & T.uint64(ALIGN // 16 - 1))) & T.uint64(ALIGN // 16 - 1))
    pad[0] = pad[0] * 8
    T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dk[0]), sm.ptr_to([pad[0]]), 1, ALIGN // 16, 3)
    T.cuda.wgmma.encode_matrix_descriptor(T.address_of(dv[0]), sm.ptr_to([pad[0]]), v_lbo, ALIGN // 16, 3)


def smem_elems(D: int, bc: int, stages: int, warpgroups: int) -> int:
    """Elements of the dynamic buffer before the alignment pad: Q tile, then ``stages`` x (K, V)."""
    return 64 * warpgroups * D + stages * 2 * bc * D


def hopper_layout(
    spec: KernelSpec,
    *,
    mask: str,
    arch: str | None,
    sliding: bool = False,
    inline_rope: bool = False,
    bc: int = DEFAULT_BC,
    stages: int = DEFAULT_STAGES,
    overlap: bool = DEFAULT_OVERLAP,
    pingpong: bool = DEFAULT_PINGPONG,
    warpgroups: int = DEFAULT_WARPGROUPS,
    producer: bool = DEFAULT_PRODUCER,
):
    """Static layout of the wgmma path, or ``None`` where another schedule is used.

    Returns a dict: BC (keys per tile), STAGES, RT (tokens per block), CPR (16-byte chunks per row),
    QI / KVI (chunks per thread of the Q / one K or V tile), SMEM (bytes of dynamic shared memory,
    with the alignment pad)."""
    D, group = spec.head_dim, spec.group
    CPR = D // 8
    BR, NT = 64 * warpgroups, 128 * warpgroups
    smem = smem_elems(D, bc, stages, warpgroups) * 2 + ALIGN
    if (
        spec.target_kind != "cuda"
        or arch not in HOPPER_ARCHS
        or spec.dtype not in PTX_TYPE
        or D not in (64, 128)
        or mask not in ("none", "causal")
        or sliding
        or inline_rope
        or BR % group
        or bc not in (64, 128, 192, 256)
        or stages < (3 if overlap or pingpong else 2)
        or warpgroups not in (1, 2)
        or (pingpong and warpgroups != 2)
        or (producer and not pingpong)
        or smem > SMEM_LIMIT
    ):
        return None
    return {
        "BR": BR,
        "NT": NT,
        "BC": bc,
        "STAGES": stages,
        "RT": BR // group,
        "CPR": CPR,
        "QI": BR * CPR // NT,
        "KVI": bc * CPR // NT,
        "SMEM": smem,
    }


def make_prefill_hopper(
    spec: KernelSpec,
    *,
    source: str,
    mask: str,
    arch: str | None,
    bc: int = DEFAULT_BC,
    stages: int = DEFAULT_STAGES,
    overlap: bool = DEFAULT_OVERLAP,
    pingpong: bool = DEFAULT_PINGPONG,
    warpgroups: int = DEFAULT_WARPGROUPS,
    producer: bool = DEFAULT_PRODUCER,
    fused_qkv: bool = False,
    producer_regs: int | None = None,
):
    """The wgmma PrimFunc for ``source`` "paged" or "ragged" (the signatures of
    :func:`tvmkv.tir.attention.paged_prefill_func` / ``ragged_prefill_func``). The caller checks
    :func:`hopper_layout` first; ``bc`` and ``stages`` are tuning knobs (defaults: what the runtime
    builds). ``fused_qkv``: the ``*_qkv`` signature (q, and for ragged k and v, read from the fused qkv;
    the ragged kernel also stores k and v at their slots, from the copying warpgroup once it has issued
    its copies: no separate append launch; fp8 pages: their codes, once its copies have landed, from
    shared memory, where the mask is causal and ``bc`` a multiple of the block's tokens, else the append
    runs first). Paged over fp8 pages: the copying warpgroup converts each tile's codes to the 16-bit
    dtype on their way into shared memory (``producer`` only), and the kernel takes the layer's
    ``kv_scale [2, H_kv]`` after ``pages`` (docs/layout.md, "fp8 pages"). ``producer_regs``: registers
    the copying warpgroup keeps (default ``PRODUCER_REGS``, ``CODES_PRODUCER_REGS`` over fp8 pages)."""
    assert source in ("paged", "ragged")
    lay = hopper_layout(
        spec,
        mask=mask,
        arch=arch,
        bc=bc,
        stages=stages,
        overlap=overlap,
        pingpong=pingpong,
        warpgroups=warpgroups,
        producer=producer,
    )
    assert lay is not None, "make_prefill_hopper called for a configuration outside its fast path"
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    group = spec.group
    BR, NT, BC, ST, RT, CPR, QI, KVI = (lay[k] for k in ("BR", "NT", "BC", "STAGES", "RT", "CPR", "QI", "KVI"))
    LOGP = P.bit_length() - 1
    PMASK = P - 1
    paged = source == "paged"
    # fp8 pages (paged): the copying warpgroup loads a tile's codes into registers (16 a load), widens
    # them to the 16-bit dtype (exact) and stores them to the ring slot; the kernel reads the layer's
    # kv_scale and folds it in (the K scale into the score factor, the V scale into the output)
    codes = paged and spec.fp8_pages
    if codes and not producer:
        raise ValueError(
            "paged prefill over fp8 pages on this schedule needs producer=True (its copying warpgroup "
            "converts the codes); pass producer=True"
        )
    wg_s = wgmma_op(BC, dtype)
    wg_o = wgmma_op(D, dtype)
    cvt = CVT[dtype]
    NI = BC // 8  # n8 column groups of the score accumulator
    DN = D // 8  # n8 column groups of the output accumulator
    KD = D // 16  # k16 steps of Q K^T
    KB = BC // 16  # k16 steps of P V
    NTH = NT + 128 if producer else NT  # threads of a block (the copying warpgroup last)
    NW = NTH // WARP
    PREGS = producer_regs or (CODES_PRODUCER_REGS if codes else PRODUCER_REGS)
    # setmaxnreg moves registers within the block's allocation (the launch bound's count per thread, 168
    # for 384 threads), so the computing threads may take (3 x 168 - PREGS) / 2 each (asking for more
    # would wait forever for registers the block does not have)
    ALLOC = (65536 // NTH) // 8 * 8  # (the copying warpgroup comes with ping-pong, hence 2 computing ones)
    CREGS = (ALLOC * (NTH // 128) - PREGS) // 2 // 8 * 8
    if producer and not (PREGS % 8 == 0 and 24 <= PREGS < ALLOC):
        raise ValueError(
            f"producer_regs={producer_regs} must be a multiple of 8 from 24 up to {ALLOC - 8} (setmaxnreg "
            f"moves registers within the block's {ALLOC} a thread); pass None for the default"
        )
    KVP = BC * CPR // 128  # chunks of a K or V tile each thread of the copying warpgroup issues
    PREFETCH = ST - 2 if overlap or pingpong else ST - 1  # tiles in flight ahead of the one computed
    # ragged_prefill_causal_qkv stores the new K/V itself: the copying warpgroup, once its copies are
    # issued, writes the block's own tokens (RT of them, kv head hk) at their slots. fp8 pages: their
    # codes, quantized as tvmkv.tir.append.append_body quantizes them, from the last K/V tile in shared
    # memory, which holds the block's tokens where the mask is causal (the block's keys end with its
    # tokens) and BC is a multiple of RT (no token past a tile boundary); else the append runs first
    stores_kv = fused_qkv and not paged and producer and (not spec.fp8_pages or (mask == "causal" and BC % RT == 0))
    # fp8 pages: the layer's scales, which the ragged kernel's stores quantize with and the paged one reads
    scale = kv_scale_buffer(spec) if fused_qkv or codes else None
    read_scale = scale if codes else None
    to_pair = FLOAT2_TO_PAIR.get(spec.page_dtype)
    SKV = (RT * CPR + 127) // 128  # 16-byte chunks of a K (and a V) row set per copying thread
    blk = block_macros(spec, source=source, mask=mask, RT=RT, NW=NW, BC=BC, scale=read_scale)
    Q_OFF = 0

    def k_off(st):  # element offset of ring slot st's K tile (V follows it)
        return BR * D + st * (2 * BC * D)

    def v_off(st):
        return BR * D + st * (2 * BC * D) + BC * D

    WORDS = (smem_elems(D, BC, ST, warpgroups) * 2 + ALIGN) // 4
    V_LBO = BC * 128 // 16  # MN-major V: the second 64-dim column block
    neg_inf = float("-inf")

    def desc_step(region, rows, kk):
        # 16-byte units from the buffer start to k16 step kk of a K-major tile of `rows` rows at
        # element offset `region` (a multiple of 512: 1024 bytes)
        return region // 8 + (kk // 4) * (rows * 8) + (kk % 4) * 2

    @macro
    def fetch_pid(kt, u, nthr, cnt):
        # page ids of the rows thread u (of nthr copying threads, cnt chunks each) copies of tile kt
        if paged:
            for i in T.unroll(cnt):
                kr, kc = T.meta_var(kv_rc(u, i, nthr, CPR))
                pid[i] = page_indices[sv[BLOCK.kbase] + (T.min(kt * BC + kr, sv[BLOCK.kv_len] - 1) >> LOGP)]

    @macro
    def issue_kv(kt, st, u, nthr, cnt):
        # cp.async the K and V rows of tile kt that thread u (of nthr, cnt chunks each) copies into ring
        # slot st (keys past the end re-read the last key; page ids from fetch_pid)
        for i in T.unroll(cnt):
            kr, kc = T.meta_var(kv_rc(u, i, nthr, CPR))
            j = T.meta_var(T.min(kt * BC + kr, sv[BLOCK.kv_len] - 1))
            if paged:
                T.ptx[CP16](
                    sm.ptr_to([pad[0] + k_off(st) + sw_off(BC, kr, kc)]),
                    pages.ptr_to([pid[i], 0, hk, j & PMASK, kc * 8]),
                    16,
                )
                T.ptx[CP16](
                    sm.ptr_to([pad[0] + v_off(st) + sw_off(BC, kr, kc)]),
                    pages.ptr_to([pid[i], 1, hk, j & PMASK, kc * 8]),
                    16,
                )
            else:
                T.ptx[CP16](
                    sm.ptr_to([pad[0] + k_off(st) + sw_off(BC, kr, kc)]),
                    k.ptr_to([sv[BLOCK.kbase] + j, hk, kc * 8]),
                    16,
                )
                T.ptx[CP16](
                    sm.ptr_to([pad[0] + v_off(st) + sw_off(BC, kr, kc)]),
                    v.ptr_to([sv[BLOCK.kbase] + j, hk, kc * 8]),
                    16,
                )

    CPR2 = CPR // 2  # 16-code pieces of a row (two 16-byte chunks once widened)
    KVC = BC * CPR2 // 128  # pieces of a K or V tile each copying thread loads
    widen = widen_pair(spec.page_dtype, dtype) if codes else None

    def code_rc(u, i):
        # the i-th piece copying thread u loads of a tile: (row, piece); rows 128 // CPR2 apart
        return u // CPR2 + i * (128 // CPR2), u % CPR2

    @macro
    def widen_tile(kt, st, u):
        # fp8 pages: tile kt's K, then V, codes of the rows thread u copies, loaded (16 a load) into
        # registers, widened pair by pair and stored as two 16-byte chunks into ring slot st
        page_words = T.decl_buffer((1,), "uint32", data=pages.data)  # the pool as 4-code words, flat
        sm_words = T.decl_buffer((WORDS,), "uint32", data=sm_raw.data, scope="shared.dyn")
        for i in T.unroll(KVC):
            kr, pc = T.meta_var(code_rc(u, i))
            pidc[i] = page_indices[sv[BLOCK.kbase] + (T.min(kt * BC + kr, sv[BLOCK.kv_len] - 1) >> LOGP)]
        for kv in T.unroll(2):
            for i in T.unroll(KVC):
                kr, pc = T.meta_var(code_rc(u, i))
                j = T.meta_var(T.min(kt * BC + kr, sv[BLOCK.kv_len] - 1))
                at = T.meta_var(
                    (((T.Cast("int64", pidc[i]) * 2 + kv) * H_kv + hk) * P + (j & PMASK)) * (D // 4) + pc * 4
                )
                for e in T.vectorized(4):
                    cw[i * 4 + e] = page_words[at + e]
            for i in T.unroll(KVC):
                kr, pc = T.meta_var(code_rc(u, i))
                for h in T.unroll(2):
                    # the two chunks in an order that keeps a quarter warp's stores on distinct banks
                    c = T.meta_var(2 * pc + (h ^ ((pc >> 2) & 1)))
                    for e in T.unroll(4):  # code pair e of the chunk: half e % 2 of its word e // 2
                        word = T.meta_var(  # (a select: a register array indexed by a thread's value spills)
                            T.if_then_else(c > 2 * pc, cw[i * 4 + 2 + e // 2], cw[i * 4 + e // 2])
                        )
                        cpair[0] = T.Cast("uint16", word >> T.uint32(16 * (e % 2)))
                        widen(hw[e], cpair[0], f2)
                    for e in T.vectorized(4):
                        sm_words[(pad[0] + k_off(st) + kv * (BC * D) + sw_off(BC, kr, c)) // 2 + e] = hw[e]

    @macro
    def issue_s(st):
        # S = Q K^T: this warpgroup's 64 rows x BC keys, operands from shared memory (one commit group)
        for kk in T.unroll(KD):
            da[0] = dkq[0] + T.uint64(desc_step(Q_OFF + wg * 64 * 64, BR, kk))
            db[0] = dkq[0] + T.uint64(desc_step(k_off(st), BC, kk))
            T.ptx[wg_s](*[s[i // 4, i % 4] for i in range(NI * 4)], da[0], db[0], kk > 0, 1, 1, 0, 0)
        T.ptx["wgmma.commit_group.sync.aligned"]()

    @macro
    def issue_pv(st):
        # O += P V: A = P from registers, V read MN-major (transposed) from shared memory (one commit group)
        for kk in T.unroll(KB):
            db[0] = dv[0] + T.uint64((v_off(st) + kk * 16 * 64) // 8)
            T.ptx[wg_o](
                *[o_acc[i // 4, i % 4] for i in range(DN * 4)],
                pf[kk, 0],
                pf[kk, 1],
                pf[kk, 2],
                pf[kk, 3],
                db[0],
                True,
                1,
                1,
                1,
            )
        T.ptx["wgmma.commit_group.sync.aligned"]()

    @macro
    def rescale_o():
        for h in T.unroll(2):
            for dn in T.unroll(DN):
                for c in T.unroll(2):
                    o_acc[dn, 2 * h + c] = o_acc[dn, 2 * h + c] * alpha[h]

    @macro
    def to_p():
        # P as wgmma A fragments: score groups (2kk, 2kk + 1) are key step kk
        for kk in T.unroll(KB):
            T.ptx[cvt](pf[kk, 0], s[2 * kk, 1], s[2 * kk, 0])  # hi, lo
            T.ptx[cvt](pf[kk, 1], s[2 * kk, 3], s[2 * kk, 2])
            T.ptx[cvt](pf[kk, 2], s[2 * kk + 1, 1], s[2 * kk + 1, 0])
            T.ptx[cvt](pf[kk, 3], s[2 * kk + 1, 3], s[2 * kk + 1, 2])

    @macro
    def land(kt, ahead):
        # tile kt is in shared memory for everyone (and visible to wgmma); then refill the slot of tile
        # kt + ahead (if any) and fetch the page ids of the tile after it
        T.ptx["cp.async.wait_group"](ahead - 1)  # this thread's copies of tile kt (and Q) landed
        T.ptx["fence.proxy.async.shared::cta"]()  # ... and are visible to the async proxy
        T.tvm_storage_sync("shared")  # everyone's copies; everyone is done with the slot refilled below
        if kt + ahead < sv[BLOCK.nkt]:
            issue_kv(kt + ahead, (kt + ahead) % ST, tx, NT, KVI)
            fetch_pid(kt + ahead + 1, tx, NT, KVI)
        T.ptx["cp.async.commit_group"]()

    @macro
    def tiles_serial():
        # tiles kt + 1 .. kt + ST - 1 stream in while tile kt is computed; per tile: S, softmax, P V
        for kt in T.serial(sv[BLOCK.nkt]):
            land(kt, ST - 1)
            T.ptx["wgmma.fence.sync.aligned"]()
            issue_s(kt % ST)
            T.ptx["wgmma.wait_group.sync.aligned"](0)
            blk.softmax(kt, lane, sv, rpos, s, m, lsum, mx, base, alpha, sl2, o_acc, False)
            rescale_o()
            to_p()
            T.ptx["wgmma.fence.sync.aligned"]()
            issue_pv(kt % ST)
            T.ptx["wgmma.wait_group.sync.aligned"](0)

    @macro
    def tiles_overlapped():
        # step kt issues S of tile kt and P V of tile kt - 1 back to back, then runs tile kt's softmax
        # while the tensor cores do P V (FlashAttention-3's intra-warpgroup overlap). Tiles kt + 1 ..
        # kt + ST - 2 are in flight; the slot refilled at step kt held tile kt - 2, whose P V every
        # warpgroup waited for in step kt - 1 (tile kt - 1's slot is still read by this step's P V).
        # First and last steps are peeled so that the loop body has no branch around a wgmma (ptxas
        # would serialize the pipeline).
        if sv[BLOCK.nkt] > 0:
            land(0, ST - 2)
            T.ptx["wgmma.fence.sync.aligned"]()
            issue_s(0)
            T.ptx["wgmma.wait_group.sync.aligned"](0)
            blk.softmax(0, lane, sv, rpos, s, m, lsum, mx, base, alpha, sl2, o_acc, False)
            to_p()
            for kt in T.serial(1, sv[BLOCK.nkt]):
                land(kt, ST - 2)
                T.ptx["wgmma.fence.sync.aligned"]()
                issue_s(kt % ST)
                issue_pv((kt + ST - 1) % ST)
                T.ptx["wgmma.wait_group.sync.aligned"](1)  # S of tile kt (groups complete in order)
                blk.softmax(kt, lane, sv, rpos, s, m, lsum, mx, base, alpha, sl2, o_acc, False)
                T.ptx["wgmma.wait_group.sync.aligned"](0)  # P V of tile kt - 1: O and P are free again
                rescale_o()
                to_p()
            T.ptx["wgmma.fence.sync.aligned"]()
            issue_pv((sv[BLOCK.nkt] - 1) % ST)
            T.ptx["wgmma.wait_group.sync.aligned"](0)

    @macro
    def full_wait(kt):
        # tile kt is in shared memory for everyone: this thread's copies landed and are made visible to
        # the async proxy, it arrives on the slot's "full" barrier and waits for the other 255 (with a
        # copying warpgroup: waits for its 128 arrivals)
        if not producer:
            T.ptx["cp.async.wait_group"](PREFETCH - 1)
            T.ptx["fence.proxy.async.shared::cta"]()
            T.ptx["mbarrier.arrive.shared::cta.b64"](mbar.ptr_to([kt % ST]))
        T.cuda.mbarrier_wait(mbar.ptr_to([kt % ST]), (kt // ST) % 2)

    @macro
    def refill(kt):
        # copy tile kt + PREFETCH into its slot once every thread is done with the slot's previous tile
        # (its "empty" barrier), and fetch the page ids of the tile after it; one commit group per step
        # (with a copying warpgroup: nothing)
        if not producer and kt + PREFETCH < sv[BLOCK.nkt]:
            if kt + PREFETCH >= ST:
                T.cuda.mbarrier_wait(mbar.ptr_to([ST + (kt + PREFETCH) % ST]), ((kt + PREFETCH) // ST - 1) % 2)
            issue_kv(kt + PREFETCH, (kt + PREFETCH) % ST, tx, NT, KVI)
            fetch_pid(kt + PREFETCH + 1, tx, NT, KVI)
        T.ptx["cp.async.commit_group"]()

    @macro
    def tiles_pingpong():
        # tiles_overlapped with the two warpgroups out of step (FlashAttention-3's ping-pong): a
        # warpgroup issues its wgmmas (S of tile kt, P V of tile kt - 1) only after the other one has
        # issued its own (named barriers 1 and 2), so one warpgroup's softmax runs under the other's
        # products. Shared memory is handed over with mbarriers instead of block-wide barriers, so the
        # warpgroups can drift apart: slot s's "full" barrier (256 arrivals: every thread's copies of
        # the slot's tile landed) and "empty" barrier (256 arrivals: every thread's P V of it is done).
        # A slot is refilled with tile kt + ST - 2 during step kt, after its tile kt - 2 is released.
        if wg == 1:
            T.ptx["barrier.arrive.aligned"](T.uint32(1), T.uint32(NT))  # warpgroup 0 issues first
        if sv[BLOCK.nkt] > 0:
            full_wait(0)
            T.ptx["barrier.sync.aligned"](T.uint32(1 + wg), T.uint32(NT))
            T.ptx["wgmma.fence.sync.aligned"]()
            issue_s(0)
            T.ptx["barrier.arrive.aligned"](T.uint32(2 - wg), T.uint32(NT))
            refill(0)
            T.ptx["wgmma.wait_group.sync.aligned"](0)
            blk.softmax(0, lane, sv, rpos, s, m, lsum, mx, base, alpha, sl2, o_acc, False)
            to_p()
            for kt in T.serial(1, sv[BLOCK.nkt]):
                full_wait(kt)
                T.ptx["barrier.sync.aligned"](T.uint32(1 + wg), T.uint32(NT))
                T.ptx["wgmma.fence.sync.aligned"]()
                issue_s(kt % ST)
                issue_pv((kt + ST - 1) % ST)
                T.ptx["barrier.arrive.aligned"](T.uint32(2 - wg), T.uint32(NT))
                refill(kt)
                T.ptx["wgmma.wait_group.sync.aligned"](1)  # S of tile kt
                blk.softmax(kt, lane, sv, rpos, s, m, lsum, mx, base, alpha, sl2, o_acc, False)
                T.ptx["wgmma.wait_group.sync.aligned"](0)  # P V of tile kt - 1
                T.ptx["mbarrier.arrive.shared::cta.b64"](mbar.ptr_to([ST + (kt + ST - 1) % ST]))
                rescale_o()
                to_p()
            T.ptx["barrier.sync.aligned"](T.uint32(1 + wg), T.uint32(NT))
            T.ptx["wgmma.fence.sync.aligned"]()
            issue_pv((sv[BLOCK.nkt] - 1) % ST)
            if wg == 0:
                # the last sync of warpgroup 1 (whose own last arrive is skipped: the counts balance)
                T.ptx["barrier.arrive.aligned"](T.uint32(2), T.uint32(NT))
            T.ptx["wgmma.wait_group.sync.aligned"](0)
        else:
            if wg == 0:
                T.ptx["barrier.sync.aligned"](T.uint32(1), T.uint32(NT))  # consume warpgroup 1's first arrive

    @macro
    def store_codes(kv, t, c, kx, pairs):
        # fp8 pages: chunk c (8 elements) of token t's K (kv 0) or V (1) row, read from the ring slot of
        # the block's last key tile (its keys end with the block's tokens, none past a tile boundary),
        # divided by the head's scale, quantized two per instruction and stored as 4 code pairs (8 bytes)
        kr = T.meta_var(t - sv[BLOCK.qbase] - (sv[BLOCK.nkt] - 1) * BC)  # its row in that tile
        base = T.meta_var(k_off((sv[BLOCK.nkt] - 1) % ST) + kv * (BC * D))  # (v_off: K's plus BC * D)
        for e in T.unroll(8):  # (shared-memory loads; TVM cannot vectorize an index that reads locals)
            kx[e] = sm[pad[0] + base + sw_off(BC, kr, c) + e]
        for p in T.unroll(4):
            T.ptx[to_pair](
                pairs[p],
                T.Cast("float32", kx[2 * p + 1]) / scale[kv, hk],
                T.Cast("float32", kx[2 * p]) / scale[kv, hk],
            )
        page_pairs = T.decl_buffer((1,), "uint16", data=pages.data)  # the pool as code pairs, flat
        for p in T.vectorized(4):
            page_pairs[code_pair_at(spec, slot[t] >> LOGP, kv, hk, slot[t] & PMASK, c * 4 + p)] = pairs[p]

    @macro
    def store_kv():
        # K and V rows of the block's tokens (kv head hk) to their slots (slot < 0: skipped), from qkv
        # (fp8 pages: from shared memory, store_codes); every (token, kv head) is one block's: the tile
        # of the token, the block of the head
        if spec.fp8_pages:  # (resolved while parsing) wait until every copying thread's copies landed
            T.ptx["barrier.sync.aligned"](T.uint32(4), T.uint32(128))
        for i in T.unroll(SKV):
            u = T.meta_var(tx - NT + i * 128)
            j = T.meta_var(u // CPR)  # the token (of the block's), its 16-byte chunk c
            c = T.meta_var(u % CPR)
            t = T.meta_var(sv[BLOCK.t0] + j)
            if u < RT * CPR and j < sv[BLOCK.ntok]:
                if slot[t] >= 0:
                    if spec.fp8_pages:  # (resolved while parsing) codes, quantized as append stores them
                        store_codes(0, t, c, kx, pairs)
                        store_codes(1, t, c, kx, pairs)
                    else:
                        for e in T.vectorized(8):
                            pages[slot[t] >> LOGP, 0, hk, slot[t] & PMASK, c * 8 + e] = k[t, hk, c * 8 + e]
                        for e in T.vectorized(8):
                            pages[slot[t] >> LOGP, 1, hk, slot[t] & PMASK, c * 8 + e] = v[t, hk, c * 8 + e]

    @macro
    def load_q():
        # the computing threads copy the Q tile (one cp.async commit group)
        for i in T.unroll(QI):
            qr, qc = T.meta_var(load_rc(tx, i, NT, CPR))
            T.ptx[CP16](
                sm.ptr_to([pad[0] + Q_OFF + sw_off(BR, qr, qc)]),
                q.ptr_to([sv[BLOCK.t0] + T.min(qr // group, sv[BLOCK.ntok] - 1), hk * group + qr % group, qc * 8]),
                16,
            )
        T.ptx["cp.async.commit_group"]()

    @macro
    def fa_body():
        bx = T.launch_thread("blockIdx.x", (n // RT + B) * H_kv)
        tx = T.launch_thread("threadIdx.x", NTH)
        lane = T.meta_var(tx % WARP)
        w = T.meta_var(tx // WARP)
        wg = T.meta_var(tx // 128)
        hk = T.meta_var(bx % H_kv)
        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)
        # dynamic shared memory as float32 words (kernels of several dtypes in one module declare the
        # same extern __shared__ array); tiles start at pad[0], the first 1024-byte boundary
        sm_raw = T.alloc_buffer((WORDS,), "float32", scope="shared.dyn")
        sm = T.decl_buffer((WORDS * 2,), dtype, data=sm_raw.data, scope="shared.dyn")
        red = T.alloc_buffer((2, NW), "float32", scope="shared")
        mbar = T.alloc_buffer((2 * ST if pingpong else 1,), "uint64", scope="shared")  # pingpong: full, empty
        sv = T.alloc_buffer((len(BLOCK),), "int32", scope="local")
        pad = T.alloc_buffer((1,), "int32", scope="local")
        dkq = T.alloc_buffer((1,), "uint64", scope="local")
        dv = T.alloc_buffer((1,), "uint64", scope="local")
        da = T.alloc_buffer((1,), "uint64", scope="local")
        db = T.alloc_buffer((1,), "uint64", scope="local")
        rpos = T.alloc_buffer((2,), "int32", scope="local")  # causal bound of rows g, g + 8
        pid = T.alloc_buffer((KVP if producer else KVI,), "int32", scope="local")
        pidc = T.alloc_buffer((KVC,), "int32", scope="local")  # fp8 pages: a tile's codes and their widening
        cw = T.alloc_buffer((KVC * 4,), "uint32", scope="local")
        cpair = T.alloc_buffer((1,), "uint16", scope="local")
        hw = T.alloc_buffer((4,), "uint32", scope="local")
        f2 = T.alloc_buffer((2,), "float32", scope="local")
        pf = T.alloc_buffer((KB, 4), "uint32", scope="local")
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
        kx = T.alloc_buffer((8,), dtype, scope="local")  # fp8 pages' stores: a chunk of K / V, its code pairs
        pairs = T.alloc_buffer((4,), "uint16", scope="local")
        o_pairs = T.decl_buffer((n * H_qo * D // 2,), "uint32", data=o.data)  # o as packed element pairs

        # ---- which sequence and tile; its tokens and key range (shared with prefill_cuda)
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
            # ---- descriptors of the buffer start, moved up to the first 1024-byte boundary: K-major
            # (Q and K: 8-row groups 1024 bytes apart) and MN-major V (column blocks BC x 128 bytes apart)
            aligned_descriptors(sm, pad, dkq, dv, V_LBO)

            if pingpong:
                if tx == 0:
                    # "full": 256 arrivals (every computing thread's own copies), or the copying
                    # warpgroup's 128; "empty": the 256 computing threads
                    for i in T.unroll(ST):
                        T.ptx["mbarrier.init.shared::cta.b64"](mbar.ptr_to([i]), T.uint32(128 if producer else NT))
                    for i in T.unroll(ST):
                        T.ptx["mbarrier.init.shared::cta.b64"](mbar.ptr_to([ST + i]), T.uint32(NT))
                T.tvm_storage_sync("shared")
            if producer:
                if tx >= NT:
                    # ---- the copying warpgroup: tile kt into slot kt % ST once the slot's previous
                    # tile is released; a thread's copies of tile kt are waited for (and made visible
                    # to wgmma) one tile later, then it arrives on the slot's "full" barrier
                    T.ptx["setmaxnreg.dec.sync.aligned.u32"](PREGS)
                    if codes:  # (resolved while parsing) each tile widened, then made visible, in turn
                        for kt in T.serial(sv[BLOCK.nkt]):
                            if kt >= ST:
                                T.cuda.mbarrier_wait(mbar.ptr_to([ST + kt % ST]), (kt // ST - 1) % 2)
                            widen_tile(kt, kt % ST, tx - NT)
                            T.ptx["fence.proxy.async.shared::cta"]()
                            T.ptx["mbarrier.arrive.shared::cta.b64"](mbar.ptr_to([kt % ST]))
                    else:
                        for kt in T.serial(sv[BLOCK.nkt]):
                            if kt >= ST:
                                T.cuda.mbarrier_wait(mbar.ptr_to([ST + kt % ST]), (kt // ST - 1) % 2)
                            fetch_pid(kt, tx - NT, 128, KVP)
                            issue_kv(kt, kt % ST, tx - NT, 128, KVP)
                            T.ptx["cp.async.commit_group"]()
                            if kt > 0:
                                T.ptx["cp.async.wait_group"](1)
                                T.ptx["fence.proxy.async.shared::cta"]()
                                T.ptx["mbarrier.arrive.shared::cta.b64"](mbar.ptr_to([(kt - 1) % ST]))
                        if sv[BLOCK.nkt] > 0:
                            T.ptx["cp.async.wait_group"](0)
                            T.ptx["fence.proxy.async.shared::cta"]()
                            T.ptx["mbarrier.arrive.shared::cta.b64"](mbar.ptr_to([(sv[BLOCK.nkt] - 1) % ST]))
                    if stores_kv:  # (resolved while parsing) while the computing warpgroups finish
                        store_kv()
                else:
                    T.ptx["setmaxnreg.inc.sync.aligned.u32"](CREGS)
                    load_q()
                    T.ptx["cp.async.wait_group"](0)
                    T.ptx["fence.proxy.async.shared::cta"]()
                    T.ptx["barrier.sync.aligned"](T.uint32(3), T.uint32(NT))  # every row of Q landed
                    tiles_pingpong()
                    blk.store(lane, w, hk, sv, o_acc, m, lsum, rinv, pk, o_pairs)
            else:
                # ---- Q tile (own cp.async group), then K/V tiles 0 .. PREFETCH - 1
                load_q()
                fetch_pid(0, tx, NT, KVI)
                for p in T.unroll(PREFETCH):
                    if p < sv[BLOCK.nkt]:
                        issue_kv(p, p, tx, NT, KVI)
                        fetch_pid(p + 1, tx, NT, KVI)
                    T.ptx["cp.async.commit_group"]()

                # ---- key tiles
                if pingpong:
                    tiles_pingpong()
                elif overlap:
                    tiles_overlapped()
                else:
                    tiles_serial()
                T.ptx["cp.async.wait_group"](0)

                # ---- o = O / l, lse = m + log2(l)
                blk.store(lane, w, hk, sv, o_acc, m, lsum, rinv, pk, o_pairs)

    if paged:
        return paged_prefill_func(spec, fa_body, read_scale, fused_qkv=fused_qkv)
    return ragged_prefill_func(spec, fa_body, scale, fused_qkv=fused_qkv, body_stores_kv=stores_kv)
