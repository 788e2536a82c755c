# ruff: noqa: F821, F841
# (the signature binds the buffers its body macros read by name, which ruff cannot see)
"""Append new tokens' K and V into the page pool. See docs/layout.md ("Pages") for the layout."""

from __future__ import annotations

from tvm.script import tirx as T

from ._kernel_common import copy_vector, func_attrs, heads_per_block, macro, qkv_view
from .fp8 import FLOAT2_TO_PAIR, code_pair_at, kv_scale_buffer, page_code, store_lanes, with_kv_scale
from .spec import KernelSpec


def append_func(spec: KernelSpec, body, scale=None, *, fused_qkv: bool = False):
    """The ``append`` PrimFunc of ``spec`` around ``body``, a macro without arguments; one signature
    for every target. The parameters are those of :func:`make_append`; ``body`` reads them by name
    (size ``n``, the number of tokens). ``fused_qkv``: ``append_qkv(pages, qkv, slot)``, whose ``k``
    and ``v`` are views of the fused ``qkv [n, H_qo + 2 H_kv, D]`` (docs/layout.md, "Fused qkv").
    ``scale``: the ``kv_scale`` buffer ``body`` reads (fp8 pages: :mod:`tvmkv.tir.fp8`), added after
    ``pages``."""
    H, D, P, dtype, page_dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype, spec.page_dtype
    attrs = func_attrs(spec)
    if fused_qkv:
        QH = spec.qkv_heads
        k_view, v_view = qkv_view(spec, spec.num_qo_heads), qkv_view(spec, spec.num_qo_heads + H)

        @T.prim_func(check_well_formed=False)  # checked by with_kv_scale
        def append_qkv(var_pages: T.handle, var_qkv: T.handle, var_slot: T.handle):
            T.func_attr(attrs)
            num_pages = T.int32()
            n = T.int32()
            pages = T.match_buffer(var_pages, (num_pages, 2, H, P, D), page_dtype)
            qkv = T.match_buffer(var_qkv, (n, QH, D), dtype)
            slot = T.match_buffer(var_slot, (n,), "int32")
            k = T.decl_buffer((n, QH, D), dtype, data=qkv.data, **k_view)
            v = T.decl_buffer((n, QH, D), dtype, data=qkv.data, **v_view)
            body()

        return with_kv_scale(append_qkv, scale, 0)

    @T.prim_func(check_well_formed=False)  # checked by with_kv_scale
    def append(var_pages: T.handle, var_k: T.handle, var_v: T.handle, var_slot: T.handle):
        T.func_attr(attrs)
        num_pages = T.int32()
        n = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, H, P, D), page_dtype)
        k = T.match_buffer(var_k, (n, H, D), dtype)
        v = T.match_buffer(var_v, (n, H, D), dtype)
        slot = T.match_buffer(var_slot, (n,), "int32")
        body()

    return with_kv_scale(append, scale, 0)


def make_append(spec: KernelSpec, *, fused_qkv: bool = False):
    """``append(pages, k, v, slot)``: write token ``i``'s K and V at ``slot[i]``; ``slot[i] < 0`` skips it.
    ``fused_qkv``: ``append_qkv(pages, qkv, slot)``, reading ``k`` and ``v`` from the fused qkv (rope
    mode "none": the keys are stored as given).

    Parameters
    ----------
    pages : [num_pages, 2, H_kv, P, D], spec.page_dtype
        The layer's page pool, **written in place**: ``pages[s // P, 0, h, s % P] = k[i, h]`` and
        ``pages[s // P, 1, h, s % P] = v[i, h]`` for ``s = slot[i] >= 0`` (fp8 pages: their codes,
        :mod:`tvmkv.tir.fp8`).
    kv_scale : [2, H_kv], float32
        fp8 pages only: the layer's K and V scale per KV head (the value stored is ``k / kv_scale[0, h]``).
    k, v : [n, H_kv, D], spec.dtype
        The new tokens' keys and values (already rotated when RoPE mode is "normal").
    slot : [n], int32
        ``page_id * P + offset`` of each token, or negative to skip it.
    """
    scale = kv_scale_buffer(spec)
    return append_func(spec, append_body(spec, scale), scale, fused_qkv=fused_qkv)


def append_body(spec: KernelSpec, scale=None):
    """The append schedule of ``spec``'s target: a macro without arguments that stores ``k[i]`` /
    ``v[i]`` at ``slot[i]`` of ``pages`` for each of the ``n`` tokens, reading those names where it is
    expanded (the ``append`` signature, or a kernel that also appends: ``ragged_prefill_causal_qkv``).
    ``scale``: fp8 pages' ``kv_scale`` buffer (:func:`tvmkv.tir.fp8.kv_scale_buffer`), which the
    expanding kernel takes as a parameter."""
    H, D, P = spec.num_kv_heads, spec.head_dim, spec.page_size
    V = copy_vector(spec.dtype, D)  # elements a cuda thread moves (one vector access)
    HY = heads_per_block(H, D // V)
    HB = (H + HY - 1) // HY  # head chunks (blockIdx.y)
    lanes = store_lanes(spec)

    def code(x, kv, h):
        return page_code(spec, x, scale, kv, h)

    @macro
    def cpu_body():
        for i in T.parallel(n):
            if slot[i] >= 0:
                for h in T.serial(H):
                    for d in T.vectorized(D):
                        pages[slot[i] // P, 0, h, slot[i] % P, d] = code(k[i, h, d], 0, h)
                        pages[slot[i] // P, 1, h, slot[i] % P, d] = code(v[i, h, d], 1, h)

    @macro
    def gpu_body():
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for c in T.thread_binding(D // V, thread="threadIdx.x"):
                        if i < n and hb * HY + hy < H:
                            if slot[i] >= 0:
                                h = T.meta_var(hb * HY + hy)
                                for e in lanes(V):
                                    pages[slot[i] // P, 0, h, slot[i] % P, c * V + e] = code(k[i, h, c * V + e], 0, h)
                                    pages[slot[i] // P, 1, h, slot[i] % P, c * V + e] = code(v[i, h, c * V + e], 1, h)

    if spec.is_cpu:
        return cpu_body
    if not spec.fp8_pages:
        return gpu_body
    to_pair = FLOAT2_TO_PAIR[spec.page_dtype]

    @macro
    def store_pairs(x, kv, i, h, c, pairs, page_pairs):
        # fp8 pages: a thread's V elements of token i's K (kv 0) or V (1), quantized two per
        # instruction, stored as one vector of code pairs
        for p in T.unroll(V // 2):
            T.ptx[to_pair](
                pairs[p],
                T.Cast("float32", x[i, h, c * V + 2 * p + 1]) / scale[kv, h],
                T.Cast("float32", x[i, h, c * V + 2 * p]) / scale[kv, h],
            )
        for p in T.vectorized(V // 2):
            page_pairs[code_pair_at(spec, slot[i] // P, kv, h, slot[i] % P, c * (V // 2) + p)] = pairs[p]

    @macro
    def gpu_pairs_body():
        page_pairs = T.decl_buffer((1,), "uint16", data=pages.data)  # the pool as code pairs, flat
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for c in T.thread_binding(D // V, thread="threadIdx.x"):
                        pairs = T.alloc_buffer((V // 2,), "uint16", scope="local")
                        if i < n and hb * HY + hy < H:
                            if slot[i] >= 0:
                                store_pairs(k, 0, i, hb * HY + hy, c, pairs, page_pairs)
                                store_pairs(v, 1, i, hb * HY + hy, c, pairs, page_pairs)

    return gpu_pairs_body
