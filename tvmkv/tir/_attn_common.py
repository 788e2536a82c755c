# ruff: noqa: F821, F841
# (the TVMScript macros below name the caller's buffers and variables, which ruff cannot see)
"""One builder behind the paged prefill, paged decode and ragged prefill attention kernels.

See docs/layout.md for every array. The three kernels differ only in where a query row's keys come
from (the page pool or the new tokens), which keys a row sees (the mask) and at which logical
position a key sits (for inline RoPE); :func:`build_attention` picks those pieces at parse time
(Python ``if`` on closure values) and wraps them in one of two schedules:

* llvm: ``T.parallel`` over (row, kv head); the ``group`` query heads of a kv head are processed
  together so each K/V row is loaded (and rotated) once; keys are scored a tile of ``C`` at a time
  into a local buffer, with an online softmax (running max ``m``, running sum ``d``) in base 2 and
  ``T.vectorized`` loops over the head dim.
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
CPU_VEC = 16  # vector lanes of the q.k partial sums (the tree reduction below assumes 16)
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


def _macro(func):
    source, closure_vars = scan_macro(func, utils.inspect_function_capture(func))
    obj = _OpenMacro(source, closure_vars, func, hygienic=False)

    def wrapper(*args, **kwargs):
        return obj(*args, **kwargs)

    return wrapper


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
    @_macro
    def cpu_body(i, hk):
        seq = T.alloc_buffer((3,), "int32", scope="local")
        rng = T.alloc_buffer((8,), "int32", scope="local")
        kinfo = T.alloc_buffer((3,), "int32", scope="local")
        vis = T.alloc_buffer((C,), "int32", scope="local")  # visible key of tile slot c
        kid = T.alloc_buffer((C,), "int32", scope="local")
        S = T.alloc_buffer((group, C), "float32", scope="local")  # scores, then probabilities
        Q = T.alloc_buffer((group, D), "float32", scope="local")  # q * sm_scale * log2(e)
        O = T.alloc_buffer((group, D), "float32", scope="local")
        m = T.alloc_buffer((group,), "float32", scope="local")
        d_sum = T.alloc_buffer((group,), "float32", scope="local")
        mx = T.alloc_buffer((1,), "float32", scope="local")
        kf = T.alloc_buffer((D,), "float32", scope="local")
        part = T.alloc_buffer((VL,), "float32", scope="local")
        fr = T.alloc_buffer((HALF,), "float32", scope="local")
        find_sequence(i)
        key_range(i)
        if rope:
            for d in T.serial(HALF):
                fr[d] = freq(rope_scale, rope_theta, d)
        for g in T.serial(group):
            m[g] = T.float32(neg_inf)
            d_sum[g] = T.float32(0)
            for d in T.vectorized(D):
                O[g, d] = T.float32(0)
            if rope:
                for d in T.serial(HALF):
                    Q[g, d] = (
                        T.Cast("float32", q[i, hk * group + g, d])
                        * T.cos(T.Cast("float32", q_pos[i]) * fr[d])
                        - T.Cast("float32", q[i, hk * group + g, d + HALF])
                        * T.sin(T.Cast("float32", q_pos[i]) * fr[d])
                    ) * (sm_scale * T.float32(LOG2E))
                    Q[g, d + HALF] = (
                        T.Cast("float32", q[i, hk * group + g, d + HALF])
                        * T.cos(T.Cast("float32", q_pos[i]) * fr[d])
                        + T.Cast("float32", q[i, hk * group + g, d])
                        * T.sin(T.Cast("float32", q_pos[i]) * fr[d])
                    ) * (sm_scale * T.float32(LOG2E))
            else:
                for d in T.vectorized(D):
                    Q[g, d] = T.Cast("float32", q[i, hk * group + g, d]) * (sm_scale * T.float32(LOG2E))
        for t in T.serial((rng[1] + C - 1) // C):
            # S = Q K^T for the tile's visible keys
            for c in T.serial(C):
                vis[c] = 0
                if t * C + c < rng[1]:
                    key_info(i, t * C + c)
                    vis[c] = kinfo[0]
                    kid[c] = kinfo[1]
                if vis[c] == 1:
                    if rope:
                        for d in T.serial(HALF):
                            kf[d] = k_at(K_src, kid[c], hk, d) * T.cos(
                                T.Cast("float32", kinfo[2]) * fr[d]
                            ) - k_at(K_src, kid[c], hk, d + HALF) * T.sin(T.Cast("float32", kinfo[2]) * fr[d])
                            kf[d + HALF] = k_at(K_src, kid[c], hk, d + HALF) * T.cos(
                                T.Cast("float32", kinfo[2]) * fr[d]
                            ) + k_at(K_src, kid[c], hk, d) * T.sin(T.Cast("float32", kinfo[2]) * fr[d])
                    else:
                        for d in T.vectorized(D):
                            kf[d] = k_at(K_src, kid[c], hk, d)
                    for g in T.serial(group):
                        for l in T.vectorized(VL):
                            part[l] = T.float32(0)
                        for d0 in T.serial(D // VL):
                            for l in T.vectorized(VL):
                                part[l] = part[l] + Q[g, d0 * VL + l] * kf[d0 * VL + l]
                        # tree reduction of the VL = 16 partial sums
                        for l in T.vectorized(VL // 2):
                            part[l] = part[l] + part[l + VL // 2]
                        for l in T.vectorized(VL // 4):
                            part[l] = part[l] + part[l + VL // 4]
                        for l in T.vectorized(VL // 8):
                            part[l] = part[l] + part[l + VL // 8]
                        S[g, c] = part[0] + part[1]
                else:
                    for g in T.serial(group):
                        S[g, c] = T.float32(neg_inf)
            # online softmax: m, d_sum, O rescaled to the new running max; S becomes P
            for g in T.serial(group):
                mx[0] = m[g]
                for c in T.serial(C):
                    mx[0] = T.max(mx[0], S[g, c])
                if mx[0] > T.float32(neg_inf):
                    d_sum[g] = d_sum[g] * T.exp2(m[g] - mx[0])
                    for d in T.vectorized(D):
                        O[g, d] = O[g, d] * T.exp2(m[g] - mx[0])
                    m[g] = mx[0]
                    for c in T.serial(C):
                        S[g, c] = T.exp2(S[g, c] - mx[0])
                        d_sum[g] = d_sum[g] + S[g, c]
                else:
                    for c in T.serial(C):
                        S[g, c] = T.float32(0)
            # O += P V, each V row loaded once for the whole group
            for c in T.serial(C):
                if vis[c] == 1:
                    for d in T.vectorized(D):
                        kf[d] = v_at(V_src, kid[c], hk, d)
                    for g in T.serial(group):
                        for d in T.vectorized(D):
                            O[g, d] = O[g, d] + S[g, c] * kf[d]
        for g in T.serial(group):
            if d_sum[g] > T.float32(0):
                for d in out_loop(D):
                    o[i, hk * group + g, d] = T.Cast(dtype, O[g, d] / d_sum[g])
                lse[i, hk * group + g] = m[g] + T.log2(d_sum[g])
            else:
                for d in out_loop(D):
                    o[i, hk * group + g, d] = T.Cast(dtype, T.float32(0))
                lse[i, hk * group + g] = T.float32(neg_inf)

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
                    Qs[ty, r * WARP + tx] = T.Cast("float32", q[i, h, r * WARP + tx]) * (
                        sm_scale * T.float32(LOG2E)
                    )
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
                                - k_at(K_src, kinfo[1], hk, d + HALF)
                                * T.sin(T.Cast("float32", kinfo[2]) * Fs[d])
                            )
                            st[2] = st[2] + Qs[ty, d + HALF] * (
                                k_at(K_src, kinfo[1], hk, d + HALF)
                                * T.cos(T.Cast("float32", kinfo[2]) * Fs[d])
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
        for r in T.unroll(ND):
            if r * WARP + tx < D:
                if st[1] > T.float32(0):
                    o[i, h, r * WARP + tx] = T.Cast(dtype, O[r] / st[1])
                else:
                    o[i, h, r * WARP + tx] = T.Cast(dtype, T.float32(0))
        if tx == 0:
            if st[1] > T.float32(0):
                lse[i, h] = st[0] + T.log2(st[1])
            else:
                lse[i, h] = T.float32(neg_inf)

    # ---------------------------------------------------------------- signatures
    if source == "paged":

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
            K_src = T.meta_var(pages)
            V_src = T.meta_var(pages)
            if cpu:
                for ih in T.parallel(n * H_kv):
                    cpu_body(ih // H_kv, ih % H_kv)
            else:
                gpu_body(n)

        return paged_prefill

    if source == "decode":

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
            K_src = T.meta_var(pages)
            V_src = T.meta_var(pages)
            if cpu:
                for ih in T.parallel(B * H_kv):
                    cpu_body(ih // H_kv, ih % H_kv)
            else:
                gpu_body(B)

        return paged_decode

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
        K_src = T.meta_var(k)
        V_src = T.meta_var(v)
        if cpu:
            for ih in T.parallel(n * H_kv):
                cpu_body(ih // H_kv, ih % H_kv)
        else:
            gpu_body(n)

    return ragged_prefill
