# ruff: noqa: F821
# (the macros below read the kernel's parameters by name, as documented by the signatures of
# tvmkv.tir.attention, which ruff cannot see)
"""The generic attention schedule: one builder behind the paged prefill, paged decode and ragged
prefill kernels, for llvm (tuned) and cuda (simple; the fast CUDA paths are :mod:`tvmkv.tir.decode_cuda`
and :mod:`tvmkv.tir.prefill_cuda`, which fall back to this one outside their shapes).

See docs/layout.md for every array. The three kernels differ only in where a query row's keys come
from (the page pool or the new tokens), which keys a row sees (the mask) and at which logical
position a key sits (for inline RoPE); :func:`build_attention` picks those pieces at parse time
(Python ``if`` on closure values) and wraps them in one of two schedules. The local-window variants
(``local``; docs/layout.md, "Per-layer sliding window") add the layer's window to the mask and start
the key scan at the tile of the first key that may lie in it:

* llvm: ``T.parallel`` over (kv head, block of ``RB`` query rows of one sequence; decode: one
  row); the ``M = RB * group`` query vectors of a block share every tile of ``C`` keys, which is
  gathered (and, for inline RoPE, rotated) once into fp32 local buffers ``Kt`` / ``Vt``. Scores
  ``S = Q K^T`` and ``O += P V`` are register-blocked products emitted statement by statement
  (``emit_qk`` / ``emit_pv``: immutable bound values, which LLVM keeps in vector registers, where TVM's
  local buffers are heap workspaces LLVM cannot promote); the online softmax (running max ``m``,
  running sum ``d``, base 2) uses a vectorizable polynomial ``exp2`` and tree reductions. Row
  blocks are visited from both ends alternately so T.parallel's static chunks get equal causal
  work.
* cuda: one thread block per (row, kv head, sub-group of at most 8 of its query heads), one warp
  per query head; lane ``c`` scores key ``c`` of a 32-key tile (serial dot product), warp
  reductions give the tile's max and sum, and the lanes then spread over the head dim to
  accumulate ``P V``. Correct and simple; not tuned.
"""

from __future__ import annotations

from collections import namedtuple

from tvm import tirx
from tvm.script import tirx as T

from ._kernel_common import LOG2E, WARP, macro, rope_inv_freq, slots
from .attention import decode_func, paged_prefill_func, ragged_prefill_func
from .fp8 import kv_scale_buffer, page_value, times_key_scale, times_value_scale
from .spec import KernelSpec

CPU_TILE = 32  # keys scored per tile on the CPU (a tile size, unrelated to the page size)
CPU_VEC = 8  # vector lanes of the q.k partial sums (emit_qk: MR x CR = 8 of them, one vector of scores)
CPU_ROWS = 64  # query vectors (rows x group heads) sharing each K/V tile in prefill (bench/RESULTS.md: 16 -> 64)
# 2^f on [0, 1), degree 5, fitted for relative error (< 2e-7)
EXP2_POLY = (0.99999994, 0.69315296, 0.24015455, 0.05582358, 0.008992595, 0.0018762343)


# Named slots of the small int32 / float32 state buffers (see _kernel_common.slots)
SEQ = slots("b", "lo", "hi")  # a row's sequence b; lo, hi: bounds of its binary search
# the keys of one query row (cuda) / of one block of rows (llvm): kv_len (the sequence's keys, or rows
# for ragged), end (of the key scan), base (first page entry, or first key row for ragged), the
# window (sink_end, window_start, window_offset) and the token tree (tree_start, tree_base)
ROW_KEYS = slots("kv_len", "end", "base", "sink_end", "window_start", "window_offset", "tree_start", "tree_base")
BLOCK_KEYS = slots("kv_len", "base", "sink_end", "window_start", "window_offset", "tree_start", "tree_base", "end")
# local-window kernels: the same, plus the first key that may lie in the layer's window (scan start)
ROW_KEYS_LOCAL = slots(*ROW_KEYS._fields, "start")
BLOCK_KEYS_LOCAL = slots(*BLOCK_KEYS._fields, "start")
KEY = slots("visible", "index", "pos")  # cuda: one key of a row (index: slot or row; pos: logical)
SOFTMAX = slots("m", "d_sum", "s", "m_new", "alpha")  # cuda: a warp's online softmax (s: its lane's score)
ROWS = slots("r0", "r1", "end")  # llvm: the rows r0 .. r1 - 1 of the work item being done, its end
RESCALE = slots("m_new", "alpha")  # llvm: new running max of a query vector, rescale factor of its O
# llvm: the local buffers of one work item, passed to its helper macros
CpuItem = namedtuple("CpuItem", "seq sq qm qt kok kid kpos kt vis kp Q O Kt Vt S m d_sum mx fr")


def _add(a, b):
    return a + b


def _lane_sums(vectors: list):
    """One vector whose lane ``x`` is the sum of the lanes of ``vectors[x]`` (as many vectors as lanes,
    a power of two), in registers: a butterfly of two-vector shuffles and adds. Each level adds the two
    halves of the lanes every vector still has to sum, and packs two vectors' results into one."""
    n = len(vectors)
    width = n  # lanes of each input vector still to add, per packed group
    while len(vectors) > 1:
        half = width // 2
        lo = [k for start in range(0, n, width) for k in range(start, start + half)]
        hi = [k + half for k in lo]
        vectors = [
            tirx.Shuffle([a, b], lo + [n + k for k in lo]) + tirx.Shuffle([a, b], hi + [n + k for k in hi])
            for a, b in zip(vectors[0::2], vectors[1::2], strict=True)
        ]
        width = half
    return vectors[0]


def build_attention(
    spec: KernelSpec,
    *,
    source: str,
    mask: str,
    sliding: bool,
    inline_rope: bool,
    local: bool = False,
    fused_qkv: bool = False,
):
    """Build one attention PrimFunc.

    Parameters
    ----------
    spec : KernelSpec
        Static shapes, dtype and target kind.
    source : str
        "paged" (prefill over the page pool), "decode" (one query per sequence over the page
        pool) or "ragged" (prefill over the new tokens' own k/v).
    mask : str
        "none", "causal" or "tree" (decode uses "none": every valid slot is visible).
    sliding : bool
        Honour ``kv_window`` (paged sources only; otherwise it is not read).
    inline_rope : bool
        Rotate q by ``q_pos`` and every key by its logical position, in fp32.
    local : bool
        The local-window variant (docs/layout.md, "Per-layer sliding window"): the signature gains the
        trailing ``layer_window``; a key is visible only if ``q_pos - pos(j) < layer_window`` (ragged:
        ``i - j < layer_window`` in rows of the sequence), and the key scan starts at the first key
        that can be. Causal prefill and decode only.
    fused_qkv : bool
        Read q (ragged: q, k and v) from the fused qkv (the ``*_qkv`` signatures of
        :mod:`tvmkv.tir.attention`). Prefill sources only, not with ``local``.
    """
    assert source in ("paged", "decode", "ragged") and mask in ("none", "causal", "tree")
    assert not local or mask == ("none" if source == "decode" else "causal")
    H_kv, D, P, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    group = spec.group
    HALF = D // 2
    LOGP = P.bit_length() - 1  # P is a power of two
    PMASK = P - 1
    paged = source != "ragged"
    decode = source == "decode"
    tree = mask == "tree"
    causal = mask == "causal"
    sliding = bool(sliding) and paged
    rope = bool(inline_rope)
    cpu = spec.is_cpu
    C = CPU_TILE
    VL = CPU_VEC
    RB = 1 if decode else max(1, CPU_ROWS // group)  # query rows per CPU work item
    M = RB * group
    MR = max(x for x in (4, 2, 1) if M % x == 0)  # query vectors per register block
    CR = VL // MR  # keys per register block of S = Q K^T (MR * CR == VL partial sums, emit_qk)
    if cpu and D % (2 * VL):
        raise ValueError(f"head_dim={D}: the CPU attention schedule takes multiples of {2 * VL}")
    ND = (D + WARP - 1) // WARP  # head-dim elements per lane on cuda
    GB = max(x for x in range(1, min(group, 8) + 1) if group % x == 0)  # query heads (warps) per block
    neg_inf = float("-inf")
    # LLVM lowering of bfloat16 vectors (stored as uint16) fails in the output store: keep it scalar
    out_loop = T.serial if dtype == "bfloat16" else T.vectorized
    NRK = len(ROW_KEYS_LOCAL if local else ROW_KEYS)  # state slots of a row's / a block's key range
    NBK = len(BLOCK_KEYS_LOCAL if local else BLOCK_KEYS)
    # fp8 pages: the kv_scale parameter (paged sources read the pages with it; the fused ragged
    # kernel only stores with it, its keys and values are read unquantized from qkv)
    scale = kv_scale_buffer(spec) if paged or fused_qkv else None
    read_scale = scale if paged else None

    # ---------------------------------------------------------------- pieces shared by both schedules
    @macro
    def find_sequence(seq, i):
        # seq[SEQ.b] = b with q_indptr[b] <= i < q_indptr[b + 1] (binary search; last such b)
        if decode:
            seq[SEQ.b] = i
        else:
            seq[SEQ.lo] = 0
            seq[SEQ.hi] = B
            while seq[SEQ.hi] - seq[SEQ.lo] > 1:
                if q_indptr[(seq[SEQ.lo] + seq[SEQ.hi]) // 2] <= i:
                    seq[SEQ.lo] = (seq[SEQ.lo] + seq[SEQ.hi]) // 2
                else:
                    seq[SEQ.hi] = (seq[SEQ.lo] + seq[SEQ.hi]) // 2
            seq[SEQ.b] = seq[SEQ.lo]

    def window_first_key(layer_window, qp, sink_end, offset):
        # the first key that may lie in the layer's window of a query at position qp (ragged: row qp
        # of the sequence), a key with pos(j) > qp - W: 0 when the window reaches back to position 0
        # (or W <= 0, no window); else qp - W + 1, in the sink (pos(j) = j) or after it (j + offset)
        lo = qp - layer_window + 1
        if sliding:
            lo = T.if_then_else(lo < sink_end, lo, lo - offset)
        return T.if_then_else(T.And(layer_window > 0, layer_window <= qp), T.max(lo, 0), 0)

    def first_tile(keys, slot, size):
        # the first tile of ``size`` keys the scan visits: the one holding keys[slot] (local), else 0
        return keys[slot] // size if local else 0

    @macro
    def key_range(rng, seq, i):
        # the keys of row i of sequence seq[SEQ.b] (ROW_KEYS)
        b = T.meta_var(seq[SEQ.b])
        if paged:
            rng[ROW_KEYS.base] = page_indptr[b]
            if page_indptr[b + 1] > page_indptr[b]:
                rng[ROW_KEYS.kv_len] = (page_indptr[b + 1] - page_indptr[b] - 1) * P + last_page_len[b]
            else:
                rng[ROW_KEYS.kv_len] = 0
            if sliding:
                rng[ROW_KEYS.sink_end] = kv_window[b, 0]
                rng[ROW_KEYS.window_start] = kv_window[b, 1]
                rng[ROW_KEYS.window_offset] = kv_window[b, 2]
            else:
                rng[ROW_KEYS.sink_end] = 0
                rng[ROW_KEYS.window_start] = 0
                rng[ROW_KEYS.window_offset] = 0
            if tree:
                rng[ROW_KEYS.tree_start] = kv_tree_start[b]
                rng[ROW_KEYS.tree_base] = kv_tree_indptr[b]
            if causal:
                if sliding:
                    # last visible j: j <= q_pos in the sink, j + offset <= q_pos after it
                    rng[ROW_KEYS.end] = T.min(
                        rng[ROW_KEYS.kv_len],
                        T.max(T.min(rng[ROW_KEYS.sink_end], q_pos[i] + 1), q_pos[i] - rng[ROW_KEYS.window_offset] + 1),
                    )
                else:
                    rng[ROW_KEYS.end] = T.min(rng[ROW_KEYS.kv_len], q_pos[i] + 1)
            else:
                rng[ROW_KEYS.end] = rng[ROW_KEYS.kv_len]
        else:
            rng[ROW_KEYS.base] = q_indptr[b]
            rng[ROW_KEYS.kv_len] = q_indptr[b + 1] - q_indptr[b]
            if causal:
                rng[ROW_KEYS.end] = i - q_indptr[b] + 1
            else:
                rng[ROW_KEYS.end] = rng[ROW_KEYS.kv_len]
        rng[ROW_KEYS.end] = T.max(rng[ROW_KEYS.end], 0)
        if local:
            if paged:
                rng[ROW_KEYS_LOCAL.start] = window_first_key(
                    layer_window, q_pos[i], rng[ROW_KEYS.sink_end], rng[ROW_KEYS.window_offset]
                )
            else:
                rng[ROW_KEYS_LOCAL.start] = window_first_key(layer_window, i - q_indptr[b], 0, 0)
            rng[ROW_KEYS_LOCAL.start] = T.min(rng[ROW_KEYS_LOCAL.start], rng[ROW_KEYS.end])

    @macro
    def key_info(kinfo, rng, i, j):
        # key j (< rng[ROW_KEYS.end]) of row i (key range rng) -> kinfo (KEY)
        if paged:
            kinfo[KEY.index] = page_indices[rng[ROW_KEYS.base] + (j >> LOGP)] * P + (j & PMASK)
            kinfo[KEY.visible] = 1
            kinfo[KEY.pos] = j
            if sliding:
                if j >= rng[ROW_KEYS.sink_end]:
                    kinfo[KEY.pos] = j + rng[ROW_KEYS.window_offset]
                    if j < rng[ROW_KEYS.window_start]:
                        kinfo[KEY.visible] = 0
            if causal:
                if kinfo[KEY.pos] > q_pos[i]:
                    kinfo[KEY.visible] = 0
            if local:
                if layer_window > 0 and q_pos[i] - kinfo[KEY.pos] >= layer_window:
                    kinfo[KEY.visible] = 0
            if tree:
                if j >= rng[ROW_KEYS.tree_start]:
                    kinfo[KEY.visible] = T.Cast(
                        "int32",
                        kv_tree[rng[ROW_KEYS.tree_base] + j - rng[ROW_KEYS.tree_start], 0] <= q_tree[i, 0]
                        and q_tree[i, 1] <= kv_tree[rng[ROW_KEYS.tree_base] + j - rng[ROW_KEYS.tree_start], 1],
                    )
                    kinfo[KEY.pos] = kv_tree[rng[ROW_KEYS.tree_base] + j - rng[ROW_KEYS.tree_start], 2]
        else:
            kinfo[KEY.index] = rng[ROW_KEYS.base] + j
            kinfo[KEY.visible] = 1
            kinfo[KEY.pos] = q_pos[rng[ROW_KEYS.base] + j]
            if local:
                if j < rng[ROW_KEYS_LOCAL.start]:
                    kinfo[KEY.visible] = 0
            if tree:
                kinfo[KEY.visible] = T.Cast(
                    "int32",
                    q_tree[rng[ROW_KEYS.base] + j, 0] <= q_tree[i, 0]
                    and q_tree[i, 1] <= q_tree[rng[ROW_KEYS.base] + j, 1],
                )

    # Parse-time helpers: ``K_src`` / ``V_src`` are the pages (paged) or k / v (ragged). fp8 pages
    # (tvmkv.tir.fp8): a key or value read from a page is its code's value before the scale; the K
    # scale joins the query's factor, the V scale multiplies the output
    def k_at(K_src, kid, hk, d):
        if paged:
            return page_value(spec, K_src[kid >> LOGP, 0, hk, kid & PMASK, d])
        return T.Cast("float32", K_src[kid, hk, d])

    def v_at(V_src, kid, hk, d):
        if paged:
            return page_value(spec, V_src[kid >> LOGP, 1, hk, kid & PMASK, d])
        return T.Cast("float32", V_src[kid, hk, d])

    def q_factor(sm_scale, hk):
        # what a query element is multiplied by: sm_scale in base 2 (and the K scale)
        return times_key_scale(sm_scale * T.float32(LOG2E), read_scale, hk)

    def out_value(x, hk):
        return times_value_scale(x, read_scale, hk)

    def freq(rope_scale, rope_theta, d):
        return rope_inv_freq(rope_scale, rope_theta, d, D)

    # ---------------------------------------------------------------- llvm schedule
    def exp2_neg(x):
        # 2^x for x <= 0 in fp32 (-inf -> 0, NaN -> NaN, as softmax propagates it): 2^floor(x) from
        # the exponent bits times a degree-5 polynomial of the fraction (relative error < 2e-7);
        # unlike T.exp2 (a libm call per element) it vectorizes. (The clamp's max drops a NaN.)
        xc = T.max(x, T.float32(-126.0))
        f = xc - T.floor(xc)
        p = T.float32(EXP2_POLY[5])
        for coef in EXP2_POLY[4::-1]:
            p = p * f + T.float32(coef)
        scale = T.reinterpret("float32", T.shift_left(T.Cast("int32", T.floor(xc)) + 127, 23))
        return T.if_then_else(x == T.float32(neg_inf), T.float32(0), T.if_then_else(T.isnan(x), x, p * scale))

    def tree_reduce(terms, op):
        # op over ``terms`` as a balanced tree (independent operations, unlike a serial loop)
        while len(terms) > 1:
            terms = [op(terms[k], terms[k + 1]) if k + 1 < len(terms) else terms[k] for k in range(0, len(terms), 2)]
        return terms[0]

    def emit_qk(Q, Kt, S, mb, cb):
        # S for block (mb, cb): MR query vectors x CR keys, each score a VL-lane partial sum over the head
        # dim, its lanes added at the end. Emitted statement by statement from Python (T.bind: immutable
        # values, which LLVM keeps in registers): per VL-wide chunk of the head dim, the MR q and CR key
        # vectors are loaded once and feed MR x CR multiply-adds. Written as buffer loops instead, every
        # partial sum would pass through memory (each local buffer is a heap workspace that may alias
        # the others, so LLVM keeps none in registers) and the products would be load-bound.
        accs = [tirx.Broadcast(tirx.FloatImm("float32", 0.0), VL)] * (MR * CR)
        for d0 in range(D // VL):
            qs = [T.bind(tirx.BufferLoad(Q, [mb * MR + i, tirx.Ramp(d0 * VL, 1, VL)])) for i in range(MR)]
            ks = [T.bind(tirx.BufferLoad(Kt, [cb * CR + j, tirx.Ramp(d0 * VL, 1, VL)])) for j in range(CR)]
            accs = [T.bind(a + qs[x // CR] * ks[x % CR]) for x, a in enumerate(accs)]
        sums = _lane_sums(accs)  # lane x: the score of query vector x // CR, key x % CR
        for i in range(MR):
            T.buffer_store(
                S, tirx.Shuffle([sums], list(range(i * CR, i * CR + CR))), [mb * MR + i, tirx.Ramp(cb * CR, 1, CR)]
            )

    def emit_pv(O, S, Vt, mb, dc):
        # O += P V for MR query vectors x 2 VL head dims (chunk dc) over the tile's keys, as emit_qk:
        # per key, its two V vectors and the MR probabilities (broadcast) are bound once and feed 2 MR
        # multiply-adds into sums held in registers; O is read before and written after the tile
        cols = [tirx.Ramp(dc * 2 * VL + j * VL, 1, VL) for j in range(2)]
        accs = [T.bind(tirx.BufferLoad(O, [mb * MR + x // 2, cols[x % 2]])) for x in range(2 * MR)]
        for c in range(C):
            vs = [T.bind(tirx.BufferLoad(Vt, [c, col])) for col in cols]
            ps = [T.bind(tirx.Broadcast(tirx.BufferLoad(S, [mb * MR + i, c]), VL)) for i in range(MR)]
            accs = [T.bind(a + ps[x // 2] * vs[x % 2]) for x, a in enumerate(accs)]
        for x, a in enumerate(accs):
            T.buffer_store(O, a, [mb * MR + x // 2, cols[x % 2]])

    @macro
    def cpu_rows(w, r0, r1):
        # key range (w.sq, BLOCK_KEYS) and per-row mask data of rows r0 .. r1 - 1 of work item w (one
        # sequence, w.seq[SEQ.b]): w.qm[r] = the row's causal bound, w.qt[r] its tree interval
        b = T.meta_var(w.seq[SEQ.b])
        if paged:
            w.sq[BLOCK_KEYS.base] = page_indptr[b]
            if page_indptr[b + 1] > page_indptr[b]:
                w.sq[BLOCK_KEYS.kv_len] = (page_indptr[b + 1] - page_indptr[b] - 1) * P + last_page_len[b]
            else:
                w.sq[BLOCK_KEYS.kv_len] = 0
            if sliding:
                w.sq[BLOCK_KEYS.sink_end] = kv_window[b, 0]
                w.sq[BLOCK_KEYS.window_start] = kv_window[b, 1]
                w.sq[BLOCK_KEYS.window_offset] = kv_window[b, 2]
            if tree:
                w.sq[BLOCK_KEYS.tree_start] = kv_tree_start[b]
                w.sq[BLOCK_KEYS.tree_base] = kv_tree_indptr[b]
        else:
            w.sq[BLOCK_KEYS.base] = q_indptr[b]
            w.sq[BLOCK_KEYS.kv_len] = q_indptr[b + 1] - q_indptr[b]
        w.sq[BLOCK_KEYS.end] = 0
        for r in T.serial(RB):
            # rows past r1 repeat row r1 - 1 (computed, never stored)
            if paged:
                w.qm[r] = q_pos[T.min(r0 + r, r1 - 1)]
            else:
                w.qm[r] = T.min(r0 + r, r1 - 1) - w.sq[BLOCK_KEYS.base]
            if tree:
                w.qt[r, 0] = q_tree[T.min(r0 + r, r1 - 1), 0]
                w.qt[r, 1] = q_tree[T.min(r0 + r, r1 - 1), 1]
            w.sq[BLOCK_KEYS.end] = T.max(w.sq[BLOCK_KEYS.end], w.qm[r])
        if causal:
            if paged:
                if sliding:
                    # last visible j: j <= q_pos in the sink, j + offset <= q_pos after it
                    w.sq[BLOCK_KEYS.end] = T.min(
                        w.sq[BLOCK_KEYS.kv_len],
                        T.max(
                            T.min(w.sq[BLOCK_KEYS.sink_end], w.sq[BLOCK_KEYS.end] + 1),
                            w.sq[BLOCK_KEYS.end] - w.sq[BLOCK_KEYS.window_offset] + 1,
                        ),
                    )
                else:
                    w.sq[BLOCK_KEYS.end] = T.min(w.sq[BLOCK_KEYS.kv_len], w.sq[BLOCK_KEYS.end] + 1)
            else:
                w.sq[BLOCK_KEYS.end] = w.sq[BLOCK_KEYS.end] + 1
            w.sq[BLOCK_KEYS.end] = T.max(w.sq[BLOCK_KEYS.end], 0)
        else:
            w.sq[BLOCK_KEYS.end] = w.sq[BLOCK_KEYS.kv_len]
        if local:
            # the scan starts at the first key that may lie in the window of one of the rows
            w.sq[BLOCK_KEYS_LOCAL.start] = w.sq[BLOCK_KEYS.end]
            for r in T.serial(RB):
                w.sq[BLOCK_KEYS_LOCAL.start] = T.min(
                    w.sq[BLOCK_KEYS_LOCAL.start],
                    window_first_key(layer_window, w.qm[r], w.sq[BLOCK_KEYS.sink_end], w.sq[BLOCK_KEYS.window_offset]),
                )

    @macro
    def cpu_keys(w, t, hk, K_src, V_src):
        # keys j = t * C + c of the tile of work item w: kok (in range and in the window), kid (slot
        # or row), kpos (causal position), kt (tree interval, committed keys contain every node);
        # Kt / Vt get the fp32 key (rotated for inline RoPE) and value rows, zero for keys not ok
        sq = T.meta_var(w.sq)
        for c in T.serial(C):
            w.kok[c] = T.Cast("int32", t * C + c < sq[BLOCK_KEYS.end])
            w.kid[c] = 0
            w.kpos[c] = t * C + c
            if tree:
                w.kt[c, 0] = -2147483647
                w.kt[c, 1] = 2147483647
            if w.kok[c] == 1:
                if paged:
                    w.kid[c] = page_indices[sq[BLOCK_KEYS.base] + ((t * C + c) >> LOGP)] * P + ((t * C + c) & PMASK)
                    if sliding:
                        if t * C + c >= sq[BLOCK_KEYS.sink_end]:
                            w.kpos[c] = t * C + c + sq[BLOCK_KEYS.window_offset]
                            if t * C + c < sq[BLOCK_KEYS.window_start]:
                                w.kok[c] = 0
                    if tree:
                        if t * C + c >= sq[BLOCK_KEYS.tree_start]:
                            node = T.meta_var(sq[BLOCK_KEYS.tree_base] + t * C + c - sq[BLOCK_KEYS.tree_start])
                            w.kt[c, 0] = kv_tree[node, 0]
                            w.kt[c, 1] = kv_tree[node, 1]
                            w.kpos[c] = kv_tree[node, 2]
                else:
                    w.kid[c] = sq[BLOCK_KEYS.base] + t * C + c
                    if tree:
                        w.kt[c, 0] = q_tree[sq[BLOCK_KEYS.base] + t * C + c, 0]
                        w.kt[c, 1] = q_tree[sq[BLOCK_KEYS.base] + t * C + c, 1]
            if w.kok[c] == 1:
                if rope:
                    # rotation angle: the key's logical position (paged) or its q_pos (ragged)
                    if paged:
                        w.kp[0] = T.Cast("float32", w.kpos[c])
                    else:
                        w.kp[0] = T.Cast("float32", q_pos[w.kid[c]])
                    for d in T.serial(HALF):
                        w.Kt[c, d] = k_at(K_src, w.kid[c], hk, d) * T.cos(w.kp[0] * w.fr[d]) - k_at(
                            K_src, w.kid[c], hk, d + HALF
                        ) * T.sin(w.kp[0] * w.fr[d])
                        w.Kt[c, d + HALF] = k_at(K_src, w.kid[c], hk, d + HALF) * T.cos(w.kp[0] * w.fr[d]) + k_at(
                            K_src, w.kid[c], hk, d
                        ) * T.sin(w.kp[0] * w.fr[d])
                else:
                    for d in T.vectorized(D):
                        w.Kt[c, d] = k_at(K_src, w.kid[c], hk, d)
                for d in T.vectorized(D):
                    w.Vt[c, d] = v_at(V_src, w.kid[c], hk, d)
            else:
                for d in T.vectorized(D):
                    w.Kt[c, d] = T.float32(0)
                    w.Vt[c, d] = T.float32(0)

    @macro
    def cpu_block(w, r0, r1, hk, K_src, V_src):
        # rows r0 .. r1 - 1 (at most RB, one sequence) x the group query heads of kv head hk:
        # M = RB * group query vectors (row r, head g at m = r * group + g) share every K/V tile
        Q = T.meta_var(w.Q)
        O = T.meta_var(w.O)
        S = T.meta_var(w.S)
        m = T.meta_var(w.m)
        d_sum = T.meta_var(w.d_sum)
        cpu_rows(w, r0, r1)
        for r in T.serial(RB):
            for g in T.serial(group):
                m[r * group + g] = T.float32(neg_inf)
                d_sum[r * group + g] = T.float32(0)
                for d in T.vectorized(D):
                    O[r * group + g, d] = T.float32(0)
                if rope:
                    w.kp[0] = T.Cast("float32", q_pos[T.min(r0 + r, r1 - 1)])
                    for d in T.serial(HALF):
                        Q[r * group + g, d] = (
                            T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d]) * T.cos(w.kp[0] * w.fr[d])
                            - T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d + HALF])
                            * T.sin(w.kp[0] * w.fr[d])
                        ) * q_factor(sm_scale, hk)
                        Q[r * group + g, d + HALF] = (
                            T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d + HALF])
                            * T.cos(w.kp[0] * w.fr[d])
                            + T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d]) * T.sin(w.kp[0] * w.fr[d])
                        ) * q_factor(sm_scale, hk)
                else:
                    for d in T.vectorized(D):
                        Q[r * group + g, d] = T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d]) * q_factor(
                            sm_scale, hk
                        )
        # the register blocks holding this sequence's rows (a work item spanning short sequences takes
        # them one sequence at a time): only those are computed
        blocks = T.meta_var(((r1 - r0) * group + MR - 1) // MR)
        for t in T.serial(first_tile(w.sq, BLOCK_KEYS_LOCAL.start, C), (w.sq[BLOCK_KEYS.end] + C - 1) // C):
            cpu_keys(w, t, hk, K_src, V_src)
            # S = Q K^T: MR x CR (query, key) pairs at a time (emit_qk)
            for mb in T.serial(blocks):
                for cb in T.serial(C // CR):
                    emit_qk(Q, w.Kt, S, mb, cb)
            # mask, then online softmax: m, d_sum, O rescaled to the new running max; S becomes P
            for mm in T.serial(blocks * MR):
                for c in T.vectorized(C):
                    w.vis[c] = w.kok[c]
                    if causal:
                        w.vis[c] = w.vis[c] * T.Cast("int32", w.kpos[c] <= w.qm[mm // group])
                    if tree:
                        w.vis[c] = w.vis[c] * T.Cast(
                            "int32", w.kt[c, 0] <= w.qt[mm // group, 0] and w.qt[mm // group, 1] <= w.kt[c, 1]
                        )
                    if local:
                        w.vis[c] = w.vis[c] * T.Cast(
                            "int32", layer_window <= 0 or w.qm[mm // group] - w.kpos[c] < layer_window
                        )
                    S[mm, c] = T.if_then_else(w.vis[c] == 1, S[mm, c], T.float32(neg_inf))
                w.mx[RESCALE.m_new] = T.max(m[mm], tree_reduce([S[mm, c] for c in range(C)], T.max))
                if w.mx[RESCALE.m_new] > T.float32(neg_inf):
                    w.mx[RESCALE.alpha] = exp2_neg(m[mm] - w.mx[RESCALE.m_new])
                    m[mm] = w.mx[RESCALE.m_new]
                    for c in T.vectorized(C):
                        S[mm, c] = exp2_neg(S[mm, c] - w.mx[RESCALE.m_new])
                    d_sum[mm] = d_sum[mm] * w.mx[RESCALE.alpha] + tree_reduce([S[mm, c] for c in range(C)], _add)
                    for d in T.vectorized(D):
                        O[mm, d] = O[mm, d] * w.mx[RESCALE.alpha]
                else:  # no key visible yet, or only NaN scores (the max drops NaN): those stay NaN
                    for c in T.vectorized(C):
                        S[mm, c] = T.if_then_else(T.isnan(S[mm, c]), S[mm, c], T.float32(0))
                    d_sum[mm] = d_sum[mm] + tree_reduce([S[mm, c] for c in range(C)], _add)  # (NaN or 0)
            # O += P V: MR query vectors x 2 VL head dims at a time (emit_pv)
            for mb in T.serial(blocks):
                for dc in T.serial(D // (2 * VL)):
                    emit_pv(O, S, w.Vt, mb, dc)
        for r in T.serial(RB):
            if r0 + r < r1:
                for g in T.serial(group):
                    # no key seen: d == 0 -> o = 0, lse = -inf; a NaN d (NaN input) propagates
                    if d_sum[r * group + g] == T.float32(0):
                        for d in out_loop(D):
                            o[r0 + r, hk * group + g, d] = T.Cast(dtype, T.float32(0))
                        lse[r0 + r, hk * group + g] = T.float32(neg_inf)
                    else:
                        for d in out_loop(D):
                            o[r0 + r, hk * group + g, d] = T.Cast(
                                dtype, out_value(O[r * group + g, d] / d_sum[r * group + g], hk)
                            )
                        lse[r0 + r, hk * group + g] = m[r * group + g] + T.log2(d_sum[r * group + g])

    @macro
    def cpu_body(N, ib, hk, K_src, V_src):
        # work item ib of ceil(N / RB) row blocks; blocks are visited from both ends alternately
        # (0, last, 1, last - 1, ...) so the static chunks of T.parallel get equal causal work.
        # A block that spans sequences is processed one sequence at a time.
        seq = T.alloc_buffer((len(SEQ),), "int32", scope="local")
        sq = T.alloc_buffer((NBK,), "int32", scope="local")
        rows = T.alloc_buffer((len(ROWS),), "int32", scope="local")
        qm = T.alloc_buffer((RB,), "int32", scope="local")
        qt = T.alloc_buffer((RB, 2), "int32", scope="local")
        kok = T.alloc_buffer((C,), "int32", scope="local")
        kid = T.alloc_buffer((C,), "int32", scope="local")
        kpos = T.alloc_buffer((C,), "int32", scope="local")
        kt = T.alloc_buffer((C, 2), "int32", scope="local")
        vis = T.alloc_buffer((C,), "int32", scope="local")
        kp = T.alloc_buffer((1,), "float32", scope="local")
        Q = T.alloc_buffer((M, D), "float32", scope="local")  # q * sm_scale * log2(e)
        O = T.alloc_buffer((M, D), "float32", scope="local")
        Kt = T.alloc_buffer((C, D), "float32", scope="local")
        Vt = T.alloc_buffer((C, D), "float32", scope="local")
        S = T.alloc_buffer((M, C), "float32", scope="local")  # scores, then probabilities
        m = T.alloc_buffer((M,), "float32", scope="local")
        d_sum = T.alloc_buffer((M,), "float32", scope="local")
        mx = T.alloc_buffer((len(RESCALE),), "float32", scope="local")
        fr = T.alloc_buffer((HALF,), "float32", scope="local")
        w = T.meta_var(
            CpuItem(
                seq=seq,
                sq=sq,
                qm=qm,
                qt=qt,
                kok=kok,
                kid=kid,
                kpos=kpos,
                kt=kt,
                vis=vis,
                kp=kp,
                Q=Q,
                O=O,
                Kt=Kt,
                Vt=Vt,
                S=S,
                m=m,
                d_sum=d_sum,
                mx=mx,
                fr=fr,
            )
        )
        if rope:
            for d in T.serial(HALF):
                fr[d] = freq(rope_scale, rope_theta, d)
        rows[ROWS.r0] = ib * RB
        rows[ROWS.end] = T.min(ib * RB + RB, N)
        while rows[ROWS.r0] < rows[ROWS.end]:
            find_sequence(seq, rows[ROWS.r0])
            if decode:
                rows[ROWS.r1] = rows[ROWS.r0] + 1
            else:
                rows[ROWS.r1] = T.min(rows[ROWS.end], q_indptr[seq[SEQ.b] + 1])
            cpu_block(w, rows[ROWS.r0], rows[ROWS.r1], hk, K_src, V_src)
            rows[ROWS.r0] = rows[ROWS.r1]

    @macro
    def cpu_kernel(N, K_src, V_src):
        # kv head outer, so that the items of one thread (static chunks) share their K/V in cache
        for ih in T.parallel((N + RB - 1) // RB * H_kv):
            cpu_body(
                N,
                T.if_then_else(
                    ih % ((N + RB - 1) // RB) % 2 == 0,
                    ih % ((N + RB - 1) // RB) // 2,
                    (N + RB - 1) // RB - 1 - ih % ((N + RB - 1) // RB) // 2,
                ),
                ih // ((N + RB - 1) // RB),
                K_src,
                V_src,
            )

    # ---------------------------------------------------------------- cuda schedule
    @macro
    def gpu_body(N, K_src, V_src):
        # block bx = (row i, kv head hk, sub-group gb); warp ty = query head h = hk * group + gb * GB + ty
        bx = T.launch_thread("blockIdx.x", N * H_kv * (group // GB))
        ty = T.launch_thread("threadIdx.y", GB)
        tx = T.launch_thread("threadIdx.x", WARP)
        i = T.meta_var(bx // (H_kv * (group // GB)))
        hk = T.meta_var(bx // (group // GB) % H_kv)
        h = T.meta_var(bx % (H_kv * (group // GB)) * GB + ty)
        Qs = T.alloc_buffer((GB, D), "float32", scope="shared")  # q * sm_scale * log2(e)
        Ps = T.alloc_buffer((GB, WARP), "float32", scope="shared")
        Ks = T.alloc_buffer((GB, WARP), "int32", scope="shared")  # key index, -1 = masked
        Fs = T.alloc_buffer((HALF,), "float32", scope="shared")  # RoPE frequencies (inline rope only)
        seq = T.alloc_buffer((len(SEQ),), "int32", scope="local")
        rng = T.alloc_buffer((NRK,), "int32", scope="local")
        kinfo = T.alloc_buffer((len(KEY),), "int32", scope="local")
        O = T.alloc_buffer((ND,), "float32", scope="local")
        st = T.alloc_buffer((len(SOFTMAX),), "float32", scope="local")
        find_sequence(seq, i)
        key_range(rng, seq, i)
        if rope:
            for r in T.unroll((HALF + WARP - 1) // WARP):
                if ty == 0 and r * WARP + tx < HALF:
                    Fs[r * WARP + tx] = freq(rope_scale, rope_theta, r * WARP + tx)
            T.tvm_storage_sync("shared")
        for r in T.unroll(ND):
            O[r] = T.float32(0)
            if r * WARP + tx < D:
                if rope:
                    if r * WARP + tx < HALF:
                        Qs[ty, r * WARP + tx] = (
                            T.Cast("float32", q[i, h, r * WARP + tx])
                            * T.cos(T.Cast("float32", q_pos[i]) * Fs[r * WARP + tx])
                            - T.Cast("float32", q[i, h, r * WARP + tx + HALF])
                            * T.sin(T.Cast("float32", q_pos[i]) * Fs[r * WARP + tx])
                        ) * q_factor(sm_scale, hk)
                    else:
                        Qs[ty, r * WARP + tx] = (
                            T.Cast("float32", q[i, h, r * WARP + tx])
                            * T.cos(T.Cast("float32", q_pos[i]) * Fs[r * WARP + tx - HALF])
                            + T.Cast("float32", q[i, h, r * WARP + tx - HALF])
                            * T.sin(T.Cast("float32", q_pos[i]) * Fs[r * WARP + tx - HALF])
                        ) * q_factor(sm_scale, hk)
                else:
                    Qs[ty, r * WARP + tx] = T.Cast("float32", q[i, h, r * WARP + tx]) * q_factor(sm_scale, hk)
        st[SOFTMAX.m] = T.float32(neg_inf)
        st[SOFTMAX.d_sum] = T.float32(0)
        T.tvm_storage_sync("shared")
        for t in T.serial(first_tile(rng, ROW_KEYS_LOCAL.start, WARP), (rng[ROW_KEYS.end] + WARP - 1) // WARP):
            # lane tx scores key t * 32 + tx
            st[SOFTMAX.s] = T.float32(neg_inf)
            Ks[ty, tx] = -1
            if t * WARP + tx < rng[ROW_KEYS.end]:
                key_info(kinfo, rng, i, t * WARP + tx)
                if kinfo[KEY.visible] == 1:
                    kid = T.meta_var(kinfo[KEY.index])
                    kpos = T.meta_var(T.Cast("float32", kinfo[KEY.pos]))
                    Ks[ty, tx] = kid
                    st[SOFTMAX.s] = T.float32(0)
                    if rope:
                        for d in T.serial(HALF):
                            st[SOFTMAX.s] = st[SOFTMAX.s] + Qs[ty, d] * (
                                k_at(K_src, kid, hk, d) * T.cos(kpos * Fs[d])
                                - k_at(K_src, kid, hk, d + HALF) * T.sin(kpos * Fs[d])
                            )
                            st[SOFTMAX.s] = st[SOFTMAX.s] + Qs[ty, d + HALF] * (
                                k_at(K_src, kid, hk, d + HALF) * T.cos(kpos * Fs[d])
                                + k_at(K_src, kid, hk, d) * T.sin(kpos * Fs[d])
                            )
                    else:
                        for d in T.serial(D):
                            st[SOFTMAX.s] = st[SOFTMAX.s] + Qs[ty, d] * k_at(K_src, kid, hk, d)
            # online softmax over the tile (uniform across the warp)
            st[SOFTMAX.m_new] = T.max(st[SOFTMAX.m], T.cuda.warp_reduce(st[SOFTMAX.s], "max", WARP))
            if st[SOFTMAX.m_new] > T.float32(neg_inf):
                st[SOFTMAX.alpha] = T.exp2(st[SOFTMAX.m] - st[SOFTMAX.m_new])
                st[SOFTMAX.s] = T.exp2(st[SOFTMAX.s] - st[SOFTMAX.m_new])
            else:
                st[SOFTMAX.alpha] = T.float32(1)
                st[SOFTMAX.s] = T.float32(0)
            st[SOFTMAX.d_sum] = st[SOFTMAX.d_sum] * st[SOFTMAX.alpha] + T.cuda.warp_reduce(st[SOFTMAX.s], "sum", WARP)
            st[SOFTMAX.m] = st[SOFTMAX.m_new]
            Ps[ty, tx] = st[SOFTMAX.s]
            T.tvm_storage_sync("shared")
            # O += P V, lanes spread over the head dim
            for r in T.unroll(ND):
                if r * WARP + tx < D:
                    O[r] = O[r] * st[SOFTMAX.alpha]
                    for c in T.serial(WARP):
                        if Ks[ty, c] >= 0:
                            O[r] = O[r] + Ps[ty, c] * v_at(V_src, Ks[ty, c], hk, r * WARP + tx)
            T.tvm_storage_sync("shared")
        # a row that saw no key has l == 0; a NaN l (NaN in q/k/v) must propagate, not read as empty
        for r in T.unroll(ND):
            if r * WARP + tx < D:
                if st[SOFTMAX.d_sum] == T.float32(0):
                    o[i, h, r * WARP + tx] = T.Cast(dtype, T.float32(0))
                else:
                    o[i, h, r * WARP + tx] = T.Cast(dtype, out_value(O[r] / st[SOFTMAX.d_sum], hk))
        if tx == 0:
            if st[SOFTMAX.d_sum] == T.float32(0):
                lse[i, h] = T.float32(neg_inf)
            else:
                lse[i, h] = st[SOFTMAX.m] + T.log2(st[SOFTMAX.d_sum])

    # ---------------------------------------------------------------- the kernel: one signature per role
    @macro
    def paged_body():
        if cpu:
            cpu_kernel(n, pages, pages)
        else:
            gpu_body(n, pages, pages)

    @macro
    def decode_body():
        if cpu:
            cpu_kernel(B, pages, pages)
        else:
            gpu_body(B, pages, pages)

    @macro
    def ragged_body():
        if cpu:
            cpu_kernel(n, k, v)
        else:
            gpu_body(n, k, v)

    if source == "paged":
        return paged_prefill_func(spec, paged_body, scale, local=local, fused_qkv=fused_qkv)
    if source == "decode":
        return decode_func(spec, decode_body, scale, split=False, local=local)
    return ragged_prefill_func(spec, ragged_body, scale, local=local, fused_qkv=fused_qkv)
