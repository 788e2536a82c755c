# ruff: noqa: F821, F841
# (the TVMScript macros below name the caller's buffers and variables, which ruff cannot see)
"""One builder behind the paged prefill, paged decode and ragged prefill attention kernels.

See docs/layout.md for every array. The three kernels differ only in where a query row's keys come
from (the page pool or the new tokens), which keys a row sees (the mask) and at which logical
position a key sits (for inline RoPE); :func:`build_attention` picks those pieces at parse time
(Python ``if`` on closure values) and wraps them in one of two schedules:

* llvm: ``T.parallel`` over (kv head, block of ``RB`` query rows of one sequence; decode: one
  row); the ``M = RB * group`` query vectors of a block share every tile of ``C`` keys, which is
  gathered (and, for inline RoPE, rotated) once into fp32 local buffers ``Kt`` / ``Vt``. Scores
  ``S = Q K^T`` and ``O += P V`` are written as single expressions of independent FMA chains
  (``dot_lanes`` / ``pv_lanes``) so LLVM keeps the partial sums in vector registers (TVM's local
  buffers are heap workspaces LLVM cannot promote); the online softmax (running max ``m``,
  running sum ``d``, base 2) uses a vectorizable polynomial ``exp2`` and tree reductions. Row
  blocks are visited from both ends alternately so T.parallel's static chunks get equal causal
  work.
* cuda: one thread block per (row, kv head, sub-group of at most 8 of its query heads), one warp
  per query head; lane ``c`` scores key ``c`` of a 32-key tile (serial dot product), warp
  reductions give the tile's max and sum, and the lanes then spread over the head dim to
  accumulate ``P V``. Correct and simple; not tuned.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T
from tvm.script.parser._core import scan_macro, utils
from tvm.tirx.script.parser.entry import TIRMacro

from .spec import KernelSpec

LOG2E = math.log2(math.e)
CPU_TILE = 32  # keys scored per tile on the CPU (a tile size, unrelated to the page size)
CPU_VEC = 8  # vector lanes of the q.k partial sums (the tree reduction below assumes 8)
CPU_ROWS = 16  # query vectors (rows x group heads) that share each K/V tile in prefill
# 2^f on [0, 1), degree 5, fitted for relative error (< 2e-7)
EXP2_POLY = (0.99999994, 0.69315296, 0.24015455, 0.05582358, 0.008992595, 0.0018762343)
WARP = 32


class _OpenMacro(TIRMacro):
    """A non-hygienic ``T.macro`` (sees the caller's buffers and variables) that also sees the
    Python values of its own closure (the factory's static sizes and flags); plain non-hygienic
    macros see only the caller's scope."""

    def __call__(self, *args, **kwargs):
        parser = self._find_parser_def()
        with parser.var_table.with_frame():
            for name, value in self.closure_vars.items():
                parser.var_table.add(name, value)
            return super().__call__(*args, **kwargs)


def _add(a, b):
    return a + b


def _macro(func):
    source, closure_vars = scan_macro(func, utils.inspect_function_capture(func))
    obj = _OpenMacro(source, closure_vars, func, hygienic=False)

    def wrapper(*args, **kwargs):
        return obj(*args, **kwargs)

    return wrapper


def paged_prefill_func(spec: KernelSpec, body):
    """The ``paged_prefill_<mask>`` PrimFunc of ``spec`` around ``body``, a :func:`_macro` without
    arguments; one signature for every mask, target and schedule. The parameters are those of
    :func:`tvmkv.tir.prefill.make_paged_prefill`; ``body`` reads them by name (sizes ``n`` and ``B``)."""
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype

    @T.prim_func
    def paged_prefill(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_q_pos: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_indices: T.handle,
        var_last_page_len: T.handle,
        var_kv_window: T.handle,
        var_q_tree: T.handle,
        var_kv_tree_indptr: T.handle,
        var_kv_tree: T.handle,
        var_kv_tree_start: T.handle,
        var_o: T.handle,
        var_lse: T.handle,
        sm_scale: T.float32,
        rope_scale: T.float32,
        rope_theta: T.float32,
    ):
        T.func_attr({"tir.noalias": True})
        n = T.int32()
        B = T.int32()
        num_pages = T.int32()
        nnz = T.int32()
        nt = T.int32()
        bt = T.int32()
        m_tree = T.int32()
        bs = T.int32()
        q = T.match_buffer(var_q, (n, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (B + 1,), "int32")
        q_pos = T.match_buffer(var_q_pos, (n,), "int32")
        pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
        page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
        kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
        q_tree = T.match_buffer(var_q_tree, (nt, 2), "int32")
        kv_tree_indptr = T.match_buffer(var_kv_tree_indptr, (bt,), "int32")
        kv_tree = T.match_buffer(var_kv_tree, (m_tree, 3), "int32")
        kv_tree_start = T.match_buffer(var_kv_tree_start, (bs,), "int32")
        o = T.match_buffer(var_o, (n, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (n, H_qo), "float32")
        body()

    return paged_prefill


def ragged_prefill_func(spec: KernelSpec, body):
    """The ``ragged_prefill_<mask>`` PrimFunc of ``spec`` around ``body``, a :func:`_macro` without
    arguments; one signature for every mask, target and schedule. The parameters are those of
    :func:`tvmkv.tir.ragged.make_ragged_prefill`; ``body`` reads them by name (sizes ``n`` and ``B``,
    the number of sequences)."""
    H_qo, H_kv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype

    @T.prim_func
    def ragged_prefill(
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_q_indptr: T.handle,
        var_q_pos: T.handle,
        var_q_tree: T.handle,
        var_o: T.handle,
        var_lse: T.handle,
        sm_scale: T.float32,
        rope_scale: T.float32,
        rope_theta: T.float32,
    ):
        T.func_attr({"tir.noalias": True})
        n = T.int32()
        B1 = T.int32()
        nt = T.int32()
        q = T.match_buffer(var_q, (n, H_qo, D), dtype)
        k = T.match_buffer(var_k, (n, H_kv, D), dtype)
        v = T.match_buffer(var_v, (n, H_kv, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (B1,), "int32")
        q_pos = T.match_buffer(var_q_pos, (n,), "int32")
        q_tree = T.match_buffer(var_q_tree, (nt, 2), "int32")
        o = T.match_buffer(var_o, (n, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (n, H_qo), "float32")
        B = T.meta_var(B1 - 1)
        body()

    return ragged_prefill


def decode_func(spec: KernelSpec, body, *, split: bool):
    """The ``paged_decode`` PrimFunc of ``spec`` (with ``split``: ``paged_decode_split``) around
    ``body``, a :func:`_macro` without arguments; one signature for every target and schedule.

    The parameters are those of :func:`tvmkv.tir.decode.make_paged_decode` (``split``:
    ``make_paged_decode_split``); ``body`` reads them by name: the sizes ``B`` and ``NSPLIT`` (1 without
    split), the buffers ``q`` ... ``kv_window``, ``o`` / ``lse`` (``o_part`` / ``lse_part``), the scalars
    ``sm_scale``, ``rope_scale``, ``rope_theta`` (and ``kv_chunk``).
    """
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    if split:

        @T.prim_func
        def paged_decode_split(
            var_q: T.handle,
            var_q_pos: T.handle,
            var_pages: T.handle,
            var_page_indptr: T.handle,
            var_page_indices: T.handle,
            var_last_page_len: T.handle,
            var_kv_window: T.handle,
            var_o_part: T.handle,
            var_lse_part: T.handle,
            sm_scale: T.float32,
            rope_scale: T.float32,
            rope_theta: T.float32,
            kv_chunk: T.int32,
        ):
            T.func_attr({"tir.noalias": True})
            B = T.int32()
            NSPLIT = T.int32()
            num_pages = T.int32()
            nnz = T.int32()
            q = T.match_buffer(var_q, (B, H_qo, D), dtype)
            q_pos = T.match_buffer(var_q_pos, (B,), "int32")
            pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), dtype)
            page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
            page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
            last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
            kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
            o_part = T.match_buffer(var_o_part, (NSPLIT, B, H_qo, D), "float32")
            lse_part = T.match_buffer(var_lse_part, (NSPLIT, B, H_qo), "float32")
            body()

        return paged_decode_split

    @T.prim_func
    def paged_decode(
        var_q: T.handle,
        var_q_pos: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_indices: T.handle,
        var_last_page_len: T.handle,
        var_kv_window: T.handle,
        var_o: T.handle,
        var_lse: T.handle,
        sm_scale: T.float32,
        rope_scale: T.float32,
        rope_theta: T.float32,
    ):
        T.func_attr({"tir.noalias": True})
        B = T.int32()
        num_pages = T.int32()
        nnz = T.int32()
        q = T.match_buffer(var_q, (B, H_qo, D), dtype)
        q_pos = T.match_buffer(var_q_pos, (B,), "int32")
        pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
        page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
        kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
        o = T.match_buffer(var_o, (B, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (B, H_qo), "float32")
        NSPLIT = T.meta_var(1)
        body()

    return paged_decode


def build_attention(spec: KernelSpec, *, source: str, mask: str, sliding: bool, inline_rope: bool):
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
    """
    assert source in ("paged", "decode", "ragged") and mask in ("none", "causal", "tree")
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
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
    CR = 8 // MR  # keys per register block of the q.k partial sums
    DC = max(x for x in (16, 32, 64) if D % x == 0)  # head-dim lanes of one P V expression
    PV_CHAINS = 64 // DC  # its partial sums over the keys: 8 vector accumulators in all
    ND = (D + WARP - 1) // WARP  # head-dim elements per lane on cuda
    GB = max(x for x in range(1, min(group, 8) + 1) if group % x == 0)  # query heads (warps) per block
    neg_inf = float("-inf")
    # LLVM lowering of bfloat16 vectors (stored as uint16) fails in the output store: keep it scalar
    out_loop = T.serial if dtype == "bfloat16" else T.vectorized

    # ---------------------------------------------------------------- pieces shared by both schedules
    @_macro
    def find_sequence(i):
        # seq[0] = b with q_indptr[b] <= i < q_indptr[b + 1] (binary search; last such b)
        if decode:
            seq[0] = i
        else:
            seq[1] = 0
            seq[2] = B
            while seq[2] - seq[1] > 1:
                if q_indptr[(seq[1] + seq[2]) // 2] <= i:
                    seq[1] = (seq[1] + seq[2]) // 2
                else:
                    seq[2] = (seq[1] + seq[2]) // 2
            seq[0] = seq[1]

    @_macro
    def key_range(i):
        # rng = [kv_len (or rows of the sequence), end of the key scan, first key row, ...window/tree]
        b = T.meta_var(seq[0])
        if paged:
            rng[2] = page_indptr[b]
            if page_indptr[b + 1] > page_indptr[b]:
                rng[0] = (page_indptr[b + 1] - page_indptr[b] - 1) * P + last_page_len[b]
            else:
                rng[0] = 0
            if sliding:
                rng[3] = kv_window[b, 0]  # sink_end
                rng[4] = kv_window[b, 1]  # window_start
                rng[5] = kv_window[b, 2]  # window_pos_offset
            else:
                rng[3] = 0
                rng[4] = 0
                rng[5] = 0
            if tree:
                rng[6] = kv_tree_start[b]
                rng[7] = kv_tree_indptr[b]
            if causal:
                if sliding:
                    # last visible j: j <= q_pos in the sink, j + offset <= q_pos after it
                    rng[1] = T.min(rng[0], T.max(T.min(rng[3], q_pos[i] + 1), q_pos[i] - rng[5] + 1))
                else:
                    rng[1] = T.min(rng[0], q_pos[i] + 1)
            else:
                rng[1] = rng[0]
        else:
            rng[2] = q_indptr[b]
            rng[0] = q_indptr[b + 1] - q_indptr[b]
            if causal:
                rng[1] = i - q_indptr[b] + 1
            else:
                rng[1] = rng[0]
        rng[1] = T.max(rng[1], 0)

    @_macro
    def key_info(i, j):
        # key j (< rng[1]) of row i -> kinfo = [visible, key index (slot or row), logical position]
        if paged:
            kinfo[1] = page_indices[rng[2] + (j >> LOGP)] * P + (j & PMASK)
            kinfo[0] = 1
            kinfo[2] = j
            if sliding:
                if j >= rng[3]:
                    kinfo[2] = j + rng[5]
                    if j < rng[4]:
                        kinfo[0] = 0
            if causal:
                if kinfo[2] > q_pos[i]:
                    kinfo[0] = 0
            if tree:
                if j >= rng[6]:
                    kinfo[0] = T.Cast(
                        "int32",
                        kv_tree[rng[7] + j - rng[6], 0] <= q_tree[i, 0]
                        and q_tree[i, 1] <= kv_tree[rng[7] + j - rng[6], 1],
                    )
                    kinfo[2] = kv_tree[rng[7] + j - rng[6], 2]
        else:
            kinfo[1] = rng[2] + j
            kinfo[0] = 1
            kinfo[2] = q_pos[rng[2] + j]
            if tree:
                kinfo[0] = T.Cast(
                    "int32", q_tree[rng[2] + j, 0] <= q_tree[i, 0] and q_tree[i, 1] <= q_tree[rng[2] + j, 1]
                )

    # Parse-time helpers: ``K_src`` / ``V_src`` are the pages (paged) or k / v (ragged)
    def k_at(K_src, kid, hk, d):
        if paged:
            return T.Cast("float32", K_src[kid >> LOGP, 0, hk, kid & PMASK, d])
        return T.Cast("float32", K_src[kid, hk, d])

    def v_at(V_src, kid, hk, d):
        if paged:
            return T.Cast("float32", V_src[kid >> LOGP, 1, hk, kid & PMASK, d])
        return T.Cast("float32", V_src[kid, hk, d])

    def freq(rope_scale, rope_theta, d):
        # rope_scale / rope_theta ** (2 d / D), fp32
        return rope_scale / T.pow(rope_theta, T.Cast("float32", 2 * d) / T.float32(D))

    # ---------------------------------------------------------------- llvm schedule
    def exp2_neg(x):
        # 2^x for x <= 0 in fp32 (-inf -> 0): 2^floor(x) from the exponent bits times a degree-5
        # polynomial of the fraction (relative error < 2e-7); unlike T.exp2 (a libm call per
        # element) it vectorizes
        xc = T.max(x, T.float32(-126.0))
        f = xc - T.floor(xc)
        p = T.float32(EXP2_POLY[5])
        for coef in EXP2_POLY[4::-1]:
            p = p * f + T.float32(coef)
        scale = T.reinterpret("float32", T.shift_left(T.Cast("int32", T.floor(xc)) + 127, 23))
        return T.if_then_else(x == T.float32(neg_inf), T.float32(0), p * scale)

    def tree_reduce(terms, op):
        # op over ``terms`` as a balanced tree (independent operations, unlike a serial loop)
        while len(terms) > 1:
            terms = [op(terms[k], terms[k + 1]) if k + 1 < len(terms) else terms[k] for k in range(0, len(terms), 2)]
        return terms[0]

    def chains(terms, n):
        # sum of ``terms`` as n interleaved partial sums (independent FMA chains), then a tree
        parts = [None] * n
        for k, t in enumerate(terms):
            parts[k % n] = t if parts[k % n] is None else parts[k % n] + t
        return tree_reduce([x for x in parts if x is not None], _add)

    def dot_lanes(Q, Kt, mq, c, l):
        # lane l of the VL-lane partial sums of Q[mq] . Kt[c]: sum over d0 of Q[mq, d0 VL + l] Kt[c, ...]
        return chains([Q[mq, d0 * VL + l] * Kt[c, d0 * VL + l] for d0 in range(D // VL)], 4)

    def pv_lanes(O, S, Vt, mq, d):
        # O[mq, d] + sum over the tile's keys c of S[mq, c] Vt[c, d]
        return O[mq, d] + chains([S[mq, c] * Vt[c, d] for c in range(C)], PV_CHAINS)

    @_macro
    def cpu_rows(r0, r1):
        # per-sequence key range and per-row mask data of rows r0 .. r1 - 1 (one sequence, seq[0]);
        # sq = [kv_len (or rows), first key row / page entry, sink_end, window_start, window offset,
        #       tree start, tree node base, end of the key scan]; qm[r] = the row's causal bound
        b = T.meta_var(seq[0])
        if paged:
            sq[1] = page_indptr[b]
            if page_indptr[b + 1] > page_indptr[b]:
                sq[0] = (page_indptr[b + 1] - page_indptr[b] - 1) * P + last_page_len[b]
            else:
                sq[0] = 0
            if sliding:
                sq[2] = kv_window[b, 0]
                sq[3] = kv_window[b, 1]
                sq[4] = kv_window[b, 2]
            if tree:
                sq[5] = kv_tree_start[b]
                sq[6] = kv_tree_indptr[b]
        else:
            sq[1] = q_indptr[b]
            sq[0] = q_indptr[b + 1] - q_indptr[b]
        sq[7] = 0
        for r in T.serial(RB):
            # rows past r1 repeat row r1 - 1 (computed, never stored)
            if paged:
                qm[r] = q_pos[T.min(r0 + r, r1 - 1)]
            else:
                qm[r] = T.min(r0 + r, r1 - 1) - sq[1]
            if tree:
                qt[r, 0] = q_tree[T.min(r0 + r, r1 - 1), 0]
                qt[r, 1] = q_tree[T.min(r0 + r, r1 - 1), 1]
            sq[7] = T.max(sq[7], qm[r])
        if causal:
            if paged:
                if sliding:
                    # last visible j: j <= q_pos in the sink, j + offset <= q_pos after it
                    sq[7] = T.min(sq[0], T.max(T.min(sq[2], sq[7] + 1), sq[7] - sq[4] + 1))
                else:
                    sq[7] = T.min(sq[0], sq[7] + 1)
            else:
                sq[7] = sq[7] + 1
            sq[7] = T.max(sq[7], 0)
        else:
            sq[7] = sq[0]

    @_macro
    def cpu_keys(t):
        # keys j = t * C + c of the tile: kok (in range and in the window), kid (slot or row),
        # kpos (causal position), kt (tree interval, committed keys contain every node); Kt / Vt get
        # the fp32 key (rotated for inline RoPE) and value rows, zero for keys that are not ok
        for c in T.serial(C):
            kok[c] = T.Cast("int32", t * C + c < sq[7])
            kid[c] = 0
            kpos[c] = t * C + c
            if tree:
                kt[c, 0] = -2147483647
                kt[c, 1] = 2147483647
            if kok[c] == 1:
                if paged:
                    kid[c] = page_indices[sq[1] + ((t * C + c) >> LOGP)] * P + ((t * C + c) & PMASK)
                    if sliding:
                        if t * C + c >= sq[2]:
                            kpos[c] = t * C + c + sq[4]
                            if t * C + c < sq[3]:
                                kok[c] = 0
                    if tree:
                        if t * C + c >= sq[5]:
                            kt[c, 0] = kv_tree[sq[6] + t * C + c - sq[5], 0]
                            kt[c, 1] = kv_tree[sq[6] + t * C + c - sq[5], 1]
                            kpos[c] = kv_tree[sq[6] + t * C + c - sq[5], 2]
                else:
                    kid[c] = sq[1] + t * C + c
                    if tree:
                        kt[c, 0] = q_tree[sq[1] + t * C + c, 0]
                        kt[c, 1] = q_tree[sq[1] + t * C + c, 1]
            if kok[c] == 1:
                if rope:
                    # rotation angle: the key's logical position (paged) or its q_pos (ragged)
                    if paged:
                        kp[0] = T.Cast("float32", kpos[c])
                    else:
                        kp[0] = T.Cast("float32", q_pos[kid[c]])
                    for d in T.serial(HALF):
                        Kt[c, d] = k_at(K_src, kid[c], hk, d) * T.cos(kp[0] * fr[d]) - k_at(
                            K_src, kid[c], hk, d + HALF
                        ) * T.sin(kp[0] * fr[d])
                        Kt[c, d + HALF] = k_at(K_src, kid[c], hk, d + HALF) * T.cos(kp[0] * fr[d]) + k_at(
                            K_src, kid[c], hk, d
                        ) * T.sin(kp[0] * fr[d])
                else:
                    for d in T.vectorized(D):
                        Kt[c, d] = k_at(K_src, kid[c], hk, d)
                for d in T.vectorized(D):
                    Vt[c, d] = v_at(V_src, kid[c], hk, d)
            else:
                for d in T.vectorized(D):
                    Kt[c, d] = T.float32(0)
                    Vt[c, d] = T.float32(0)

    @_macro
    def cpu_block(r0, r1, hk):
        # rows r0 .. r1 - 1 (at most RB, one sequence) x the group query heads of kv head hk:
        # M = RB * group query vectors (row r, head g at m = r * group + g) share every K/V tile
        cpu_rows(r0, r1)
        for r in T.serial(RB):
            for g in T.serial(group):
                m[r * group + g] = T.float32(neg_inf)
                d_sum[r * group + g] = T.float32(0)
                for d in T.vectorized(D):
                    O[r * group + g, d] = T.float32(0)
                if rope:
                    kp[0] = T.Cast("float32", q_pos[T.min(r0 + r, r1 - 1)])
                    for d in T.serial(HALF):
                        Q[r * group + g, d] = (
                            T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d]) * T.cos(kp[0] * fr[d])
                            - T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d + HALF])
                            * T.sin(kp[0] * fr[d])
                        ) * (sm_scale * T.float32(LOG2E))
                        Q[r * group + g, d + HALF] = (
                            T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d + HALF]) * T.cos(kp[0] * fr[d])
                            + T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d]) * T.sin(kp[0] * fr[d])
                        ) * (sm_scale * T.float32(LOG2E))
                else:
                    for d in T.vectorized(D):
                        Q[r * group + g, d] = T.Cast("float32", q[T.min(r0 + r, r1 - 1), hk * group + g, d]) * (
                            sm_scale * T.float32(LOG2E)
                        )
        for t in T.serial((sq[7] + C - 1) // C):
            cpu_keys(t)
            # S = Q K^T: MR x CR (query, key) pairs at a time, each a VL-lane partial sum over D
            # written as one expression (dot_lanes), so the sums stay in registers
            for mb in T.serial(M // MR):
                for cb in T.serial(C // CR):
                    for x in T.unroll(MR * CR):
                        for l in T.vectorized(VL):
                            acc[x, l] = dot_lanes(Q, Kt, mb * MR + x // CR, cb * CR + x % CR, l)
                    for x in T.unroll(MR * CR):
                        for l in T.vectorized(VL // 2):
                            acc[x, l] = acc[x, l] + acc[x, l + VL // 2]
                        for l in T.vectorized(VL // 4):
                            acc[x, l] = acc[x, l] + acc[x, l + VL // 4]
                        S[mb * MR + x // CR, cb * CR + x % CR] = acc[x, 0] + acc[x, 1]
            # mask, then online softmax: m, d_sum, O rescaled to the new running max; S becomes P
            for mm in T.serial(M):
                for c in T.vectorized(C):
                    vis[c] = kok[c]
                    if causal:
                        vis[c] = vis[c] * T.Cast("int32", kpos[c] <= qm[mm // group])
                    if tree:
                        vis[c] = vis[c] * T.Cast(
                            "int32", kt[c, 0] <= qt[mm // group, 0] and qt[mm // group, 1] <= kt[c, 1]
                        )
                    S[mm, c] = T.if_then_else(vis[c] == 1, S[mm, c], T.float32(neg_inf))
                mx[0] = T.max(m[mm], tree_reduce([S[mm, c] for c in range(C)], T.max))
                if mx[0] > T.float32(neg_inf):
                    mx[1] = exp2_neg(m[mm] - mx[0])
                    m[mm] = mx[0]
                    for c in T.vectorized(C):
                        S[mm, c] = exp2_neg(S[mm, c] - mx[0])
                    d_sum[mm] = d_sum[mm] * mx[1] + tree_reduce([S[mm, c] for c in range(C)], _add)
                    for d in T.vectorized(D):
                        O[mm, d] = O[mm, d] * mx[1]
                else:
                    for c in T.vectorized(C):
                        S[mm, c] = T.float32(0)
            # O += P V: MR query rows x DC head-dim lanes, summed over the tile's keys in one
            # expression (pv_lanes) per row
            for mb in T.serial(M // MR):
                for dc in T.serial(D // DC):
                    for mi in T.unroll(MR):
                        for l in T.vectorized(DC):
                            O[mb * MR + mi, dc * DC + l] = pv_lanes(O, S, Vt, mb * MR + mi, dc * DC + l)
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
                            o[r0 + r, hk * group + g, d] = T.Cast(dtype, O[r * group + g, d] / d_sum[r * group + g])
                        lse[r0 + r, hk * group + g] = m[r * group + g] + T.log2(d_sum[r * group + g])

    @_macro
    def cpu_body(N, ib, hk):
        # work item ib of ceil(N / RB) row blocks; blocks are visited from both ends alternately
        # (0, last, 1, last - 1, ...) so the static chunks of T.parallel get equal causal work.
        # A block that spans sequences is processed one sequence at a time.
        seq = T.alloc_buffer((3,), "int32", scope="local")
        sq = T.alloc_buffer((8,), "int32", scope="local")
        rows = T.alloc_buffer((3,), "int32", scope="local")  # current r0, r1, block end
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
        mx = T.alloc_buffer((2,), "float32", scope="local")  # new max, rescale factor
        acc = T.alloc_buffer((MR * CR, VL), "float32", scope="local")
        fr = T.alloc_buffer((HALF,), "float32", scope="local")
        if rope:
            for d in T.serial(HALF):
                fr[d] = freq(rope_scale, rope_theta, d)
        rows[0] = ib * RB
        rows[2] = T.min(ib * RB + RB, N)
        while rows[0] < rows[2]:
            find_sequence(rows[0])
            if decode:
                rows[1] = rows[0] + 1
            else:
                rows[1] = T.min(rows[2], q_indptr[seq[0] + 1])
            cpu_block(rows[0], rows[1], hk)
            rows[0] = rows[1]

    @_macro
    def cpu_kernel(N):
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
            )

    # ---------------------------------------------------------------- cuda schedule
    @_macro
    def gpu_body(N):
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
        seq = T.alloc_buffer((3,), "int32", scope="local")
        rng = T.alloc_buffer((8,), "int32", scope="local")
        kinfo = T.alloc_buffer((3,), "int32", scope="local")
        O = T.alloc_buffer((ND,), "float32", scope="local")
        st = T.alloc_buffer((5,), "float32", scope="local")  # m, d_sum, s, new m, alpha
        find_sequence(i)
        key_range(i)
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
                        ) * (sm_scale * T.float32(LOG2E))
                    else:
                        Qs[ty, r * WARP + tx] = (
                            T.Cast("float32", q[i, h, r * WARP + tx])
                            * T.cos(T.Cast("float32", q_pos[i]) * Fs[r * WARP + tx - HALF])
                            + T.Cast("float32", q[i, h, r * WARP + tx - HALF])
                            * T.sin(T.Cast("float32", q_pos[i]) * Fs[r * WARP + tx - HALF])
                        ) * (sm_scale * T.float32(LOG2E))
                else:
                    Qs[ty, r * WARP + tx] = T.Cast("float32", q[i, h, r * WARP + tx]) * (sm_scale * T.float32(LOG2E))
        st[0] = T.float32(neg_inf)
        st[1] = T.float32(0)
        T.tvm_storage_sync("shared")
        for t in T.serial((rng[1] + WARP - 1) // WARP):
            # lane tx scores key t * 32 + tx
            st[2] = T.float32(neg_inf)
            Ks[ty, tx] = -1
            if t * WARP + tx < rng[1]:
                key_info(i, t * WARP + tx)
                if kinfo[0] == 1:
                    Ks[ty, tx] = kinfo[1]
                    st[2] = T.float32(0)
                    if rope:
                        for d in T.serial(HALF):
                            st[2] = st[2] + Qs[ty, d] * (
                                k_at(K_src, kinfo[1], hk, d) * T.cos(T.Cast("float32", kinfo[2]) * Fs[d])
                                - k_at(K_src, kinfo[1], hk, d + HALF) * T.sin(T.Cast("float32", kinfo[2]) * Fs[d])
                            )
                            st[2] = st[2] + Qs[ty, d + HALF] * (
                                k_at(K_src, kinfo[1], hk, d + HALF) * T.cos(T.Cast("float32", kinfo[2]) * Fs[d])
                                + k_at(K_src, kinfo[1], hk, d) * T.sin(T.Cast("float32", kinfo[2]) * Fs[d])
                            )
                    else:
                        for d in T.serial(D):
                            st[2] = st[2] + Qs[ty, d] * k_at(K_src, kinfo[1], hk, d)
            # online softmax over the tile (uniform across the warp)
            st[3] = T.max(st[0], T.cuda.warp_reduce(st[2], "max", WARP))
            if st[3] > T.float32(neg_inf):
                st[4] = T.exp2(st[0] - st[3])
                st[2] = T.exp2(st[2] - st[3])
            else:
                st[4] = T.float32(1)
                st[2] = T.float32(0)
            st[1] = st[1] * st[4] + T.cuda.warp_reduce(st[2], "sum", WARP)
            st[0] = st[3]
            Ps[ty, tx] = st[2]
            T.tvm_storage_sync("shared")
            # O += P V, lanes spread over the head dim
            for r in T.unroll(ND):
                if r * WARP + tx < D:
                    O[r] = O[r] * st[4]
                    for c in T.serial(WARP):
                        if Ks[ty, c] >= 0:
                            O[r] = O[r] + Ps[ty, c] * v_at(V_src, Ks[ty, c], hk, r * WARP + tx)
            T.tvm_storage_sync("shared")
        # a row that saw no key has l == 0; a NaN l (NaN in q/k/v) must propagate, not read as empty
        for r in T.unroll(ND):
            if r * WARP + tx < D:
                if st[1] == T.float32(0):
                    o[i, h, r * WARP + tx] = T.Cast(dtype, T.float32(0))
                else:
                    o[i, h, r * WARP + tx] = T.Cast(dtype, O[r] / st[1])
        if tx == 0:
            if st[1] == T.float32(0):
                lse[i, h] = T.float32(neg_inf)
            else:
                lse[i, h] = st[0] + T.log2(st[1])

    # ---------------------------------------------------------------- signatures
    if source == "paged":

        @_macro
        def paged_body():
            K_src = T.meta_var(pages)
            V_src = T.meta_var(pages)
            if cpu:
                cpu_kernel(n)
            else:
                gpu_body(n)

        return paged_prefill_func(spec, paged_body)

    if source == "decode":

        @_macro
        def decode_body():
            K_src = T.meta_var(pages)
            V_src = T.meta_var(pages)
            if cpu:
                cpu_kernel(B)
            else:
                gpu_body(B)

        return decode_func(spec, decode_body, split=False)

    @_macro
    def ragged_body():
        K_src = T.meta_var(k)
        V_src = T.meta_var(v)
        if cpu:
            cpu_kernel(n)
        else:
            gpu_body(n)

    return ragged_prefill_func(spec, ragged_body)
