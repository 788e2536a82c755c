"""Merge partial attention states: two in place (``merge_state``), or the chunks of a split decode
(``merge_splits``). See docs/layout.md ("Outputs and the log-sum-exp").

The log-sum-exp is base 2: ``lse = log2(2^lse_a + 2^lse_b)`` and
``o = o_a * 2^(lse_a - lse) + o_b * 2^(lse_b - lse)``. A side with ``lse = -inf`` contributes nothing
(its ``o`` is not read into the result, so garbage there is harmless); if both are ``-inf`` the
result is ``o = 0``, ``lse = -inf``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .append import heads_per_block
from .spec import KernelSpec


def make_merge_state(spec: KernelSpec):
    """``merge_state(o_a, lse_a, o_b, lse_b)``: merge state b into state a, **in place**.

    Parameters
    ----------
    o_a : [n, H_qo, D], spec.dtype
        Partial output a; **overwritten** with the merged output (math in float32).
    lse_a : [n, H_qo], float32
        Base-2 log-sum-exp of a; **overwritten** with the merged one.
    o_b : [n, H_qo, D], spec.dtype
        Partial output b (read only).
    lse_b : [n, H_qo], float32
        Base-2 log-sum-exp of b (read only).
    """
    H, D, dtype = spec.num_qo_heads, spec.head_dim, spec.dtype
    HY = heads_per_block(H, D)
    HB = (H + HY - 1) // HY
    NEG_INF = T.float32("-inf")

    if spec.is_cpu:

        @T.prim_func
        def merge_state(var_o_a: T.handle, var_lse_a: T.handle, var_o_b: T.handle, var_lse_b: T.handle):
            T.func_attr({"tir.noalias": True})
            n = T.int32()
            o_a = T.match_buffer(var_o_a, (n, H, D), dtype)
            lse_a = T.match_buffer(var_lse_a, (n, H), "float32")
            o_b = T.match_buffer(var_o_b, (n, H, D), dtype)
            lse_b = T.match_buffer(var_lse_b, (n, H), "float32")
            for i in T.parallel(n):
                for h in T.serial(H):
                    # wa, wb: weights 2^(lse - lse_merged); lse: the merged lse
                    st = T.alloc_buffer((3,), "float32", scope="local")
                    la = T.meta_var(lse_a[i, h])
                    lb = T.meta_var(lse_b[i, h])
                    m = T.meta_var(T.max(la, lb))
                    if m == NEG_INF:
                        st[0] = T.float32(0)
                        st[1] = T.float32(0)
                        st[2] = NEG_INF
                    else:
                        st[2] = m + T.log2(T.exp2(la - m) + T.exp2(lb - m))
                        st[0] = T.exp2(la - st[2])
                        st[1] = T.exp2(lb - st[2])
                    for d in T.vectorized(D):
                        part_a = T.meta_var(T.cast(o_a[i, h, d], "float32") * st[0])
                        part_b = T.meta_var(T.cast(o_b[i, h, d], "float32") * st[1])
                        o_a[i, h, d] = T.cast(
                            T.if_then_else(la == NEG_INF, T.float32(0), part_a)
                            + T.if_then_else(lb == NEG_INF, T.float32(0), part_b),
                            dtype,
                        )
                    lse_a[i, h] = st[2]

        return merge_state

    @T.prim_func
    def merge_state(var_o_a: T.handle, var_lse_a: T.handle, var_o_b: T.handle, var_lse_b: T.handle):
        T.func_attr({"tir.noalias": True})
        n = T.int32()
        o_a = T.match_buffer(var_o_a, (n, H, D), dtype)
        lse_a = T.match_buffer(var_lse_a, (n, H), "float32")
        o_b = T.match_buffer(var_o_b, (n, H, D), dtype)
        lse_b = T.match_buffer(var_lse_b, (n, H), "float32")
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        # la, lb: the inputs, read once into registers before anyone writes lse_a[i, h]
                        st = T.alloc_buffer((5,), "float32", scope="local")
                        h = T.meta_var(hb * HY + hy)
                        if i < n and h < H:
                            st[3] = lse_a[i, h]
                            st[4] = lse_b[i, h]
                            m = T.meta_var(T.max(st[3], st[4]))
                            if m == NEG_INF:
                                st[0] = T.float32(0)
                                st[1] = T.float32(0)
                                st[2] = NEG_INF
                            else:
                                st[2] = m + T.log2(T.exp2(st[3] - m) + T.exp2(st[4] - m))
                                st[0] = T.exp2(st[3] - st[2])
                                st[1] = T.exp2(st[4] - st[2])
                            o_a[i, h, d] = T.cast(
                                T.if_then_else(st[3] == NEG_INF, T.float32(0), T.cast(o_a[i, h, d], "float32") * st[0])
                                + T.if_then_else(
                                    st[4] == NEG_INF, T.float32(0), T.cast(o_b[i, h, d], "float32") * st[1]
                                ),
                                dtype,
                            )
                        T.tvm_storage_sync("shared")  # every thread has read lse_a[i, h] before it changes
                        if i < n and h < H and d == 0:
                            lse_a[i, h] = st[2]

    return merge_state


def make_merge_splits(spec: KernelSpec):
    """``merge_splits(o_part, lse_part, o, lse)``: combine the ``num_splits`` partial states of a split
    decode (``paged_decode_split``) into one, as repeated :func:`make_merge_state` would.

    ``lse = log2(sum_c 2^lse_c)``, ``o = sum_c o_c * 2^(lse_c - lse)``; a chunk with ``lse_c = -inf``
    contributes nothing (its ``o_c`` is not read); all ``-inf`` gives ``o = 0``, ``lse = -inf``.

    Parameters
    ----------
    o_part : [num_splits, n, H_qo, D] float32
    lse_part : [num_splits, n, H_qo] float32
    o : [n, H_qo, D] spec.dtype, written
    lse : [n, H_qo] float32, written
    """
    H, D, dtype = spec.num_qo_heads, spec.head_dim, spec.dtype
    HY = heads_per_block(H, D)
    HB = (H + HY - 1) // HY
    NEG_INF = T.float32("-inf")

    if spec.is_cpu:

        @T.prim_func
        def merge_splits(var_o_part: T.handle, var_lse_part: T.handle, var_o: T.handle, var_lse: T.handle):
            T.func_attr({"tir.noalias": True})
            S = T.int32()
            n = T.int32()
            o_part = T.match_buffer(var_o_part, (S, n, H, D), "float32")
            lse_part = T.match_buffer(var_lse_part, (S, n, H), "float32")
            o = T.match_buffer(var_o, (n, H, D), dtype)
            lse = T.match_buffer(var_lse, (n, H), "float32")
            for ih in T.parallel(n * H):
                st = T.alloc_buffer((3,), "float32", scope="local")  # max lse, sum of weights, weight
                acc = T.alloc_buffer((D,), "float32", scope="local")
                i = T.meta_var(ih // H)
                h = T.meta_var(ih % H)
                st[0] = NEG_INF
                for c in T.serial(S):
                    st[0] = T.max(st[0], lse_part[c, i, h])
                st[1] = T.float32(0)
                for d in T.serial(D):
                    acc[d] = T.float32(0)
                if st[0] != NEG_INF:
                    for c in T.serial(S):
                        if lse_part[c, i, h] != NEG_INF:
                            st[2] = T.exp2(lse_part[c, i, h] - st[0])
                            st[1] = st[1] + st[2]
                            for d in T.serial(D):
                                acc[d] = acc[d] + o_part[c, i, h, d] * st[2]
                if st[1] == T.float32(0):  # every chunk empty (a NaN sum propagates)
                    for d in T.serial(D):
                        o[i, h, d] = T.cast(T.float32(0), dtype)
                    lse[i, h] = NEG_INF
                else:
                    for d in T.serial(D):
                        o[i, h, d] = T.cast(acc[d] / st[1], dtype)
                    lse[i, h] = st[0] + T.log2(st[1])

        return merge_splits

    @T.prim_func
    def merge_splits(var_o_part: T.handle, var_lse_part: T.handle, var_o: T.handle, var_lse: T.handle):
        T.func_attr({"tir.noalias": True})
        S = T.int32()
        n = T.int32()
        o_part = T.match_buffer(var_o_part, (S, n, H, D), "float32")
        lse_part = T.match_buffer(var_lse_part, (S, n, H), "float32")
        o = T.match_buffer(var_o, (n, H, D), dtype)
        lse = T.match_buffer(var_lse, (n, H), "float32")
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        st = T.alloc_buffer((4,), "float32", scope="local")  # max lse, sum of weights, weight, o
                        h = T.meta_var(hb * HY + hy)
                        if i < n and h < H:
                            st[0] = NEG_INF
                            for c in T.serial(S):
                                st[0] = T.max(st[0], lse_part[c, i, h])
                            st[1] = T.float32(0)
                            st[3] = T.float32(0)
                            if st[0] != NEG_INF:
                                for c in T.serial(S):
                                    if lse_part[c, i, h] != NEG_INF:
                                        st[2] = T.exp2(lse_part[c, i, h] - st[0])
                                        st[1] = st[1] + st[2]
                                        st[3] = st[3] + o_part[c, i, h, d] * st[2]
                            if st[1] == T.float32(0):  # every chunk empty (a NaN sum propagates)
                                o[i, h, d] = T.cast(T.float32(0), dtype)
                                if d == 0:
                                    lse[i, h] = NEG_INF
                            else:
                                o[i, h, d] = T.cast(st[3] / st[1], dtype)
                                if d == 0:
                                    lse[i, h] = st[0] + T.log2(st[1])

    return merge_splits
