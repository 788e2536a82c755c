# ruff: noqa: F821, F841
# (each signature binds the buffers its body macros read by name, which ruff cannot see)
"""Merge partial attention states: two in place (``merge_state``), or the chunks of a split decode
(``merge_splits``). See docs/layout.md ("Outputs and the log-sum-exp").

The log-sum-exp is base 2: ``lse = log2(2^lse_a + 2^lse_b)`` and
``o = o_a * 2^(lse_a - lse) + o_b * 2^(lse_b - lse)``. A side with ``lse = -inf`` contributes nothing
(its ``o`` is not read into the result, so garbage there is harmless); if both are ``-inf`` the
result is ``o = 0``, ``lse = -inf``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._kernel_common import func_attrs, heads_per_block, macro, slots
from .spec import KernelSpec

# Named slots of the per-thread float32 state (see _kernel_common.slots)
MERGE_CPU = slots("wa", "wb", "lse")  # weights 2^(lse_x - lse) of a and b, the merged lse
MERGE_GPU = slots("wa", "wb", "lse", "la", "lb")  # the same, and the inputs lse_a / lse_b read once
SPLITS_CPU = slots("m", "w_sum", "w")  # max lse over the chunks, sum of the weights, a chunk's weight
SPLITS_GPU = slots("m", "w_sum", "w", "o")  # the same, and the thread's element of o (before / w_sum)


def merge_state_func(spec: KernelSpec, body):
    """The ``merge_state`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which reads
    the parameters of :func:`make_merge_state` by name (size ``n``, the rows)."""
    H, D, dtype = spec.num_qo_heads, spec.head_dim, spec.dtype
    attrs = func_attrs(spec)

    @T.prim_func
    def merge_state(var_o_a: T.handle, var_lse_a: T.handle, var_o_b: T.handle, var_lse_b: T.handle):
        T.func_attr(attrs)
        n = T.int32()
        o_a = T.match_buffer(var_o_a, (n, H, D), dtype)
        lse_a = T.match_buffer(var_lse_a, (n, H), "float32")
        o_b = T.match_buffer(var_o_b, (n, H, D), dtype)
        lse_b = T.match_buffer(var_lse_b, (n, H), "float32")
        body()

    return merge_state


def merge_splits_func(spec: KernelSpec, body):
    """The ``merge_splits`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which
    reads the parameters of :func:`make_merge_splits` by name (sizes ``S``, the chunks, and ``n``)."""
    H, D, dtype = spec.num_qo_heads, spec.head_dim, spec.dtype
    attrs = func_attrs(spec)

    @T.prim_func
    def merge_splits(var_o_part: T.handle, var_lse_part: T.handle, var_o: T.handle, var_lse: T.handle):
        T.func_attr(attrs)
        S = T.int32()
        n = T.int32()
        o_part = T.match_buffer(var_o_part, (S, n, H, D), "float32")
        lse_part = T.match_buffer(var_lse_part, (S, n, H), "float32")
        o = T.match_buffer(var_o, (n, H, D), dtype)
        lse = T.match_buffer(var_lse, (n, H), "float32")
        body()

    return merge_splits


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

    @macro
    def cpu_body():
        for i in T.parallel(n):
            for h in T.serial(H):
                st = T.alloc_buffer((len(MERGE_CPU),), "float32", scope="local")
                la = T.meta_var(lse_a[i, h])
                lb = T.meta_var(lse_b[i, h])
                m = T.meta_var(T.max(la, lb))
                if m == NEG_INF:
                    st[MERGE_CPU.wa] = T.float32(0)
                    st[MERGE_CPU.wb] = T.float32(0)
                    st[MERGE_CPU.lse] = NEG_INF
                else:
                    st[MERGE_CPU.lse] = m + T.log2(T.exp2(la - m) + T.exp2(lb - m))
                    st[MERGE_CPU.wa] = T.exp2(la - st[MERGE_CPU.lse])
                    st[MERGE_CPU.wb] = T.exp2(lb - st[MERGE_CPU.lse])
                for d in T.vectorized(D):
                    part_a = T.meta_var(T.cast(o_a[i, h, d], "float32") * st[MERGE_CPU.wa])
                    part_b = T.meta_var(T.cast(o_b[i, h, d], "float32") * st[MERGE_CPU.wb])
                    o_a[i, h, d] = T.cast(
                        T.if_then_else(la == NEG_INF, T.float32(0), part_a)
                        + T.if_then_else(lb == NEG_INF, T.float32(0), part_b),
                        dtype,
                    )
                lse_a[i, h] = st[MERGE_CPU.lse]

    @macro
    def gpu_body():
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        # la, lb: the inputs, read once into registers before anyone writes lse_a[i, h]
                        st = T.alloc_buffer((len(MERGE_GPU),), "float32", scope="local")
                        h = T.meta_var(hb * HY + hy)
                        if i < n and h < H:
                            st[MERGE_GPU.la] = lse_a[i, h]
                            st[MERGE_GPU.lb] = lse_b[i, h]
                            m = T.meta_var(T.max(st[MERGE_GPU.la], st[MERGE_GPU.lb]))
                            if m == NEG_INF:
                                st[MERGE_GPU.wa] = T.float32(0)
                                st[MERGE_GPU.wb] = T.float32(0)
                                st[MERGE_GPU.lse] = NEG_INF
                            else:
                                st[MERGE_GPU.lse] = m + T.log2(
                                    T.exp2(st[MERGE_GPU.la] - m) + T.exp2(st[MERGE_GPU.lb] - m)
                                )
                                st[MERGE_GPU.wa] = T.exp2(st[MERGE_GPU.la] - st[MERGE_GPU.lse])
                                st[MERGE_GPU.wb] = T.exp2(st[MERGE_GPU.lb] - st[MERGE_GPU.lse])
                            o_a[i, h, d] = T.cast(
                                T.if_then_else(
                                    st[MERGE_GPU.la] == NEG_INF,
                                    T.float32(0),
                                    T.cast(o_a[i, h, d], "float32") * st[MERGE_GPU.wa],
                                )
                                + T.if_then_else(
                                    st[MERGE_GPU.lb] == NEG_INF,
                                    T.float32(0),
                                    T.cast(o_b[i, h, d], "float32") * st[MERGE_GPU.wb],
                                ),
                                dtype,
                            )
                        T.tvm_storage_sync("shared")  # every thread has read lse_a[i, h] before it changes
                        if i < n and h < H and d == 0:
                            lse_a[i, h] = st[MERGE_GPU.lse]

    return merge_state_func(spec, cpu_body if spec.is_cpu else gpu_body)


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

    @macro
    def cpu_body():
        for ih in T.parallel(n * H):
            st = T.alloc_buffer((len(SPLITS_CPU),), "float32", scope="local")
            acc = T.alloc_buffer((D,), "float32", scope="local")
            i = T.meta_var(ih // H)
            h = T.meta_var(ih % H)
            st[SPLITS_CPU.m] = NEG_INF
            for c in T.serial(S):
                st[SPLITS_CPU.m] = T.max(st[SPLITS_CPU.m], lse_part[c, i, h])
            st[SPLITS_CPU.w_sum] = T.float32(0)
            for d in T.serial(D):
                acc[d] = T.float32(0)
            if st[SPLITS_CPU.m] != NEG_INF:
                for c in T.serial(S):
                    if lse_part[c, i, h] != NEG_INF:
                        st[SPLITS_CPU.w] = T.exp2(lse_part[c, i, h] - st[SPLITS_CPU.m])
                        st[SPLITS_CPU.w_sum] = st[SPLITS_CPU.w_sum] + st[SPLITS_CPU.w]
                        for d in T.serial(D):
                            acc[d] = acc[d] + o_part[c, i, h, d] * st[SPLITS_CPU.w]
            if st[SPLITS_CPU.w_sum] == T.float32(0):  # every chunk empty (a NaN sum propagates)
                for d in T.serial(D):
                    o[i, h, d] = T.cast(T.float32(0), dtype)
                lse[i, h] = NEG_INF
            else:
                for d in T.serial(D):
                    o[i, h, d] = T.cast(acc[d] / st[SPLITS_CPU.w_sum], dtype)
                lse[i, h] = st[SPLITS_CPU.m] + T.log2(st[SPLITS_CPU.w_sum])

    @macro
    def gpu_body():
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        st = T.alloc_buffer((len(SPLITS_GPU),), "float32", scope="local")
                        h = T.meta_var(hb * HY + hy)
                        if i < n and h < H:
                            st[SPLITS_GPU.m] = NEG_INF
                            for c in T.serial(S):
                                st[SPLITS_GPU.m] = T.max(st[SPLITS_GPU.m], lse_part[c, i, h])
                            st[SPLITS_GPU.w_sum] = T.float32(0)
                            st[SPLITS_GPU.o] = T.float32(0)
                            if st[SPLITS_GPU.m] != NEG_INF:
                                for c in T.serial(S):
                                    if lse_part[c, i, h] != NEG_INF:
                                        st[SPLITS_GPU.w] = T.exp2(lse_part[c, i, h] - st[SPLITS_GPU.m])
                                        st[SPLITS_GPU.w_sum] = st[SPLITS_GPU.w_sum] + st[SPLITS_GPU.w]
                                        st[SPLITS_GPU.o] = st[SPLITS_GPU.o] + o_part[c, i, h, d] * st[SPLITS_GPU.w]
                            if st[SPLITS_GPU.w_sum] == T.float32(0):  # every chunk empty (a NaN sum propagates)
                                o[i, h, d] = T.cast(T.float32(0), dtype)
                                if d == 0:
                                    lse[i, h] = NEG_INF
                            else:
                                o[i, h, d] = T.cast(st[SPLITS_GPU.o] / st[SPLITS_GPU.w_sum], dtype)
                                if d == 0:
                                    lse[i, h] = st[SPLITS_GPU.m] + T.log2(st[SPLITS_GPU.w_sum])

    return merge_splits_func(spec, cpu_body if spec.is_cpu else gpu_body)
