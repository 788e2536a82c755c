# ruff: noqa: F821, F841
# (each signature binds the buffers its body macros read by name, which ruff cannot see)
"""Slot-level copies inside the page pool: fork a page, compact committed tree tokens, gather K/V;
whole-page copies between the pool and a staging buffer (swap to host).

Pages and slots are defined in docs/layout.md ("Pages"): ``slot = page_id * P + offset``. Every op
copies K and V of all ``H_kv`` heads. CUDA mapping: ``threadIdx.x`` over the head dim, ``threadIdx.y``
over a few heads (:func:`tvmkv.tir._kernel_common.heads_per_block`), ``blockIdx`` over slots / segments.
Each kernel role has one signature (``*_func(spec, body)``); the llvm and cuda bodies are macros.
The pages (and what ``gather`` / ``gather_pages`` write) are of ``spec.page_dtype``: fp8 pages are
copied as their codes, never converted (:mod:`tvmkv.tir.fp8`).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from ._kernel_common import MAX_THREADS, func_attrs, heads_per_block, macro
from .fp8 import kv_scale_buffer, page_code, page_value, with_kv_scale, zero
from .spec import KernelSpec


def copy_page_func(spec: KernelSpec, body):
    """The ``copy_page`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which reads
    the parameters of :func:`make_copy_page` by name."""
    H, D, P, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.page_dtype
    attrs = func_attrs(spec)

    @T.prim_func
    def copy_page(var_pages: T.handle, src_page: T.int32, dst_page: T.int32, num_slots: T.int32):
        T.func_attr(attrs)
        num_pages = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, H, P, D), dtype)
        body()

    return copy_page


def make_copy_page(spec: KernelSpec):
    """``copy_page(pages, src_page, dst_page, num_slots)``: copy slots ``[0, num_slots)`` of a page.

    Parameters
    ----------
    pages : [num_pages, 2, H_kv, P, D], spec.page_dtype
        Page pool, **written in place**:
        ``pages[dst_page, :, :, :num_slots] = pages[src_page, :, :, :num_slots]``.
    src_page, dst_page : int32
        Page ids (``src_page != dst_page``; the caller checks the range).
    num_slots : int32
        Slots to copy, ``0 <= num_slots <= P`` (larger values are clipped to ``P``).
    """
    H, D, P = spec.num_kv_heads, spec.head_dim, spec.page_size
    HY = heads_per_block(H, D)
    HB = (H + HY - 1) // HY

    @macro
    def cpu_body():
        for kh in T.parallel(2 * H):
            for j in T.serial(P):
                if j < num_slots:
                    for d in T.vectorized(D):
                        pages[dst_page, kh // H, kh % H, j, d] = pages[src_page, kh // H, kh % H, j, d]

    @macro
    def gpu_body():
        for j in T.thread_binding(P, thread="blockIdx.x"):
            for hb in T.thread_binding(2 * HB, thread="blockIdx.y"):  # (K or V) x head chunk
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        h = T.meta_var(hb % HB * HY + hy)
                        if j < num_slots and h < H:
                            pages[dst_page, hb // HB, h, j, d] = pages[src_page, hb // HB, h, j, d]

    return copy_page_func(spec, cpu_body if spec.is_cpu else gpu_body)


def make_copy_page_layers(rows: int, page_size: int, row_bytes: int, *, is_cpu: bool, attrs: dict):
    """``copy_page_layers(layer_pages, src_page, dst_page, num_slots)``: :func:`make_copy_page`'s copy in
    every layer at once, one launch instead of one per layer (copy-on-write of a forked sequence's
    last page happens in every layer).

    A page of one layer is ``rows`` runs of ``page_size`` slots of ``row_bytes`` bytes each (the
    paged layout: ``rows = 2 H_kv``, ``row_bytes = D x element size``; MLA pages: ``rows = 1``);
    docs/layout.md, "Pages". The kernel copies bytes, so it serves every page dtype (fp8 codes are
    copied as they are).

    Parameters
    ----------
    layer_pages : [num_layers], uint64
        The device address of each layer's page array (``Tensor.data_ptr()``, start of page 0), on the
        pages' device; every array is **written in place**:
        ``pages[dst_page, ..., :num_slots, :] = pages[src_page, ..., :num_slots, :]``.
    src_page, dst_page : int32
        Page ids (``src_page != dst_page``; the caller checks the range).
    num_slots : int32
        Slots to copy, ``0 <= num_slots <= page_size`` (larger values are clipped).
    """
    P = page_size
    unit, U = ("uint32", 4) if row_bytes % 16 == 0 else ("uint32", 1) if row_bytes % 4 == 0 else ("uint8", 1)
    W = row_bytes // (4 if unit == "uint32" else 1)  # units per slot row
    page_units = rows * P * W
    ptr_type = tvm.ir.PointerType(tvm.ir.PrimType(unit), "global")
    TX = max(1, W // U)  # threads over one slot row (U units each)
    if TX > MAX_THREADS:
        raise ValueError(
            f"copy_page_layers: slot rows of {row_bytes} bytes need {TX} threads, more than a block's {MAX_THREADS}"
        )
    TY = max(1, min(rows, MAX_THREADS // TX))
    RB = (rows + TY - 1) // TY

    @T.prim_func
    def copy_page_layers(var_layer_pages: T.handle, src_page: T.int32, dst_page: T.int32, num_slots: T.int32):
        T.func_attr(attrs)
        L = T.int32()
        layer_pages = T.match_buffer(var_layer_pages, (L,), "uint64")
        if is_cpu:
            for lr in T.parallel(L * rows):
                base: T.let[T.handle(unit, "global")] = T.reinterpret(ptr_type, layer_pages[lr // rows])
                pages = T.decl_buffer((1,), unit, data=base)
                src = T.meta_var(T.int64(src_page) * page_units + lr % rows * (P * W))
                dst = T.meta_var(T.int64(dst_page) * page_units + lr % rows * (P * W))
                for j in T.serial(T.min(num_slots, P)):
                    for w in T.vectorized(W):
                        pages[dst + j * W + w] = pages[src + j * W + w]
        else:
            for layer in T.thread_binding(L, thread="blockIdx.z"):
                for j in T.thread_binding(P, thread="blockIdx.x"):
                    for rb in T.thread_binding(RB, thread="blockIdx.y"):
                        for ty in T.thread_binding(TY, thread="threadIdx.y"):
                            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                                base: T.let[T.handle(unit, "global")] = T.reinterpret(ptr_type, layer_pages[layer])
                                pages = T.decl_buffer((1,), unit, data=base)
                                r = T.meta_var(rb * TY + ty)
                                at = T.meta_var(r * (P * W) + j * W + tx * U)
                                if j < num_slots and r < rows:
                                    for u in T.vectorized(U):
                                        pages[T.int64(dst_page) * page_units + at + u] = pages[
                                            T.int64(src_page) * page_units + at + u
                                        ]

    return copy_page_layers


def compact_copy_func(spec: KernelSpec, body):
    """The ``compact_copy`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which
    reads the parameters of :func:`make_compact_copy` by name (sizes ``S1``, segments + 1, and ``m``)."""
    H, D, P, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.page_dtype
    attrs = func_attrs(spec)

    @T.prim_func
    def compact_copy(var_pages: T.handle, var_indptr: T.handle, var_src: T.handle, var_dst: T.handle):
        T.func_attr(attrs)
        num_pages = T.int32()
        S1 = T.int32()
        m = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, H, P, D), dtype)
        copy_indptr = T.match_buffer(var_indptr, (S1,), "int32")
        src_slot = T.match_buffer(var_src, (m,), "int32")
        dst_slot = T.match_buffer(var_dst, (m,), "int32")
        body()

    return compact_copy


def make_compact_copy(spec: KernelSpec):
    """``compact_copy(pages, copy_indptr, src_slot, dst_slot)``: segment-wise in-order slot copies.

    Segment ``s`` owns entries ``e`` in ``[copy_indptr[s], copy_indptr[s+1])``; they are applied one
    after another: ``pages[slot dst_slot[e]] = pages[slot src_slot[e]]`` (K and V, all heads).
    Segments run in parallel, so they must not touch each other's slots. Within a segment the order
    is kept, which makes in-place compaction (``dst_slot[e] <= src_slot[e]``, both increasing) safe.

    Parameters
    ----------
    pages : [num_pages, 2, H_kv, P, D], spec.page_dtype
        Page pool, **written in place**.
    copy_indptr : [S + 1], int32
        CSR offsets of the segments (non-decreasing; empty segments allowed).
    src_slot, dst_slot : [m], int32
        Source and destination slot of each entry.
    """
    H, D, P = spec.num_kv_heads, spec.head_dim, spec.page_size
    HY = heads_per_block(H, D)
    HB = (H + HY - 1) // HY

    @macro
    def cpu_body():
        for s in T.parallel(S1 - 1):
            for e in T.serial(copy_indptr[s], copy_indptr[s + 1]):  # in order
                src = T.meta_var(src_slot[e])
                dst = T.meta_var(dst_slot[e])
                for kv, h in T.grid(2, H):
                    for d in T.vectorized(D):
                        pages[dst // P, kv, h, dst % P, d] = pages[src // P, kv, h, src % P, d]

    @macro
    def gpu_body():
        # One block per segment and head chunk. Each thread owns one (K/V, head, d) element and walks
        # the entries in order; entries only depend on each other through the same element, so
        # program order inside the thread is all the ordering needed (no barrier).
        for s in T.thread_binding(T.max(S1 - 1, 1), thread="blockIdx.x"):  # max: no empty grid
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        h = T.meta_var(hb * HY + hy)
                        if s < S1 - 1 and h < H:
                            for e in T.serial(copy_indptr[s], copy_indptr[s + 1]):
                                src = T.meta_var(src_slot[e])
                                dst = T.meta_var(dst_slot[e])
                                for kv in T.unroll(2):
                                    pages[dst // P, kv, h, dst % P, d] = pages[src // P, kv, h, src % P, d]

    return compact_copy_func(spec, cpu_body if spec.is_cpu else gpu_body)


def gather_func(spec: KernelSpec, body):
    """The ``gather`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which reads the
    parameters of :func:`make_gather` by name (size ``m``, the number of slots)."""
    H, D, P, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.page_dtype
    attrs = func_attrs(spec)

    @T.prim_func
    def gather(var_pages: T.handle, var_slots: T.handle, var_k: T.handle, var_v: T.handle):
        T.func_attr(attrs)
        num_pages = T.int32()
        m = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, H, P, D), dtype)
        slots = T.match_buffer(var_slots, (m,), "int32")
        k_out = T.match_buffer(var_k, (m, H, D), dtype)
        v_out = T.match_buffer(var_v, (m, H, D), dtype)
        body()

    return gather


def make_gather(spec: KernelSpec):
    """``gather(pages, slots, k_out, v_out)``: copy the K/V at the given slots into contiguous arrays.

    Parameters
    ----------
    pages : [num_pages, 2, H_kv, P, D], spec.page_dtype
        Page pool (read only).
    slots : [m], int32
        Slots to read; a negative slot yields zeros.
    k_out, v_out : [m, H_kv, D], spec.page_dtype
        **Written**: ``k_out[e] = pages[slots[e] // P, 0, :, slots[e] % P]``, ``v_out`` likewise with index 1.
    """
    H, D, P, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.page_dtype
    HY = heads_per_block(H, D)
    HB = (H + HY - 1) // HY

    @macro
    def cpu_body():
        for e in T.parallel(m):
            for h in T.serial(H):
                if slots[e] >= 0:
                    for d in T.vectorized(D):
                        k_out[e, h, d] = pages[slots[e] // P, 0, h, slots[e] % P, d]
                        v_out[e, h, d] = pages[slots[e] // P, 1, h, slots[e] % P, d]
                else:
                    for d in T.serial(D):  # serial: a vectorized bf16 constant store fails to legalize
                        k_out[e, h, d] = zero(dtype)
                        v_out[e, h, d] = zero(dtype)

    @macro
    def gpu_body():
        for e in T.thread_binding(T.max(m, 1), thread="blockIdx.x"):  # max: no empty grid when m == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        h = T.meta_var(hb * HY + hy)
                        if e < m and h < H:
                            if slots[e] >= 0:
                                k_out[e, h, d] = pages[slots[e] // P, 0, h, slots[e] % P, d]
                                v_out[e, h, d] = pages[slots[e] // P, 1, h, slots[e] % P, d]
                            else:
                                k_out[e, h, d] = zero(dtype)
                                v_out[e, h, d] = zero(dtype)

    return gather_func(spec, cpu_body if spec.is_cpu else gpu_body)


def make_gather_pages(spec: KernelSpec):
    """``gather_pages(pages, page_ids, staging, layer)``: copy whole pages of one layer into rows of a
    contiguous staging buffer (swap-out: one device->host copy of the staging buffer follows).

    Parameters
    ----------
    pages : [num_pages, 2, H_kv, P, D], spec.page_dtype
        One layer's page pool (read only).
    page_ids : [m], int32
        Pages to copy (the caller checks the range).
    staging : [m, L, 2, H_kv, P, D], spec.page_dtype
        **Written** at ``layer``: ``staging[i, layer] = pages[page_ids[i]]`` for every ``i``; the rest
        is untouched (the other layers' calls fill it).
    layer : int32
        Layer index in ``[0, L)``.
    """
    return _make_page_transfer(spec, to_staging=True)


def make_scatter_pages(spec: KernelSpec):
    """``scatter_pages(pages, page_ids, staging, layer)``: the reverse of :func:`make_gather_pages`
    (swap-in: after one host->device copy into the staging buffer).

    Parameters
    ----------
    pages : [num_pages, 2, H_kv, P, D], spec.page_dtype
        One layer's page pool, **written in place**: ``pages[page_ids[i]] = staging[i, layer]``.
    page_ids : [m], int32
        Destination pages, all distinct (the caller checks the range).
    staging : [m, L, 2, H_kv, P, D], spec.page_dtype
        Source rows (read only).
    layer : int32
        Layer index in ``[0, L)``.
    """
    return _make_page_transfer(spec, to_staging=False)


def page_transfer_func(spec: KernelSpec, body):
    """The ``gather_pages`` / ``scatter_pages`` PrimFunc of ``spec`` around ``body``, a macro without
    arguments, which reads the parameters of :func:`make_gather_pages` by name (sizes ``m``, the
    number of pages, and ``L``, the layers of the staging buffer); both kernels share this signature."""
    H, D, P, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.page_dtype
    attrs = func_attrs(spec)

    @T.prim_func
    def page_transfer(var_pages: T.handle, var_ids: T.handle, var_staging: T.handle, layer: T.int32):
        T.func_attr(attrs)
        num_pages = T.int32()
        m = T.int32()
        L = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, H, P, D), dtype)
        page_ids = T.match_buffer(var_ids, (m,), "int32")
        staging = T.match_buffer(var_staging, (m, L, 2, H, P, D), dtype)
        body()

    return page_transfer


def listed_page_body(spec: KernelSpec, element, lanes=T.vectorized):
    """The body (a macro without arguments) visiting every element of the ``m`` pages ``page_ids``
    lists, reading those two names where it is expanded, and expanding ``element(i, page, kv, h, j, d)``
    (a macro: element ``(kv, h, j, d)`` of page ``page = page_ids[i]``) at each. CUDA mapping: one block
    per listed page and (K or V) x head chunk, ``threadIdx`` over a few heads and the head dim, the
    page's slots in a loop. ``lanes``: the llvm schedule's innermost loop over the head dim."""
    H, D, P = spec.num_kv_heads, spec.head_dim, spec.page_size
    HY = heads_per_block(H, D)
    HB = (H + HY - 1) // HY

    @macro
    def cpu_body():
        for i in T.parallel(m):
            for kv, h, j in T.grid(2, H, P):
                for d in lanes(D):
                    element(i, page_ids[i], kv, h, j, d)

    @macro
    def gpu_body():
        for i in T.thread_binding(T.max(m, 1), thread="blockIdx.x"):  # max: no empty grid when m == 0
            for hb in T.thread_binding(2 * HB, thread="blockIdx.y"):  # (K or V) x head chunk
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        h = T.meta_var(hb % HB * HY + hy)
                        if i < m and h < H:
                            for j in T.serial(P):
                                element(i, page_ids[i], hb // HB, h, j, d)

    return cpu_body if spec.is_cpu else gpu_body


def _make_page_transfer(spec: KernelSpec, *, to_staging: bool):
    """The one body of ``gather_pages`` (``to_staging``) and ``scatter_pages``: only which side of the
    element copy is the destination differs."""

    def route(pages, staging, layer, i, page, kv, h, j, d):
        """(destination, its index, source, its index) of one element."""
        ours, row = (page, kv, h, j, d), (i, layer, kv, h, j, d)
        return (staging, row, pages, ours) if to_staging else (pages, ours, staging, row)

    @macro
    def copy(i, page, kv, h, j, d):
        dst, di, src, si = T.meta_var(route(pages, staging, layer, i, page, kv, h, j, d))
        dst[di] = src[si]

    return page_transfer_func(spec, listed_page_body(spec, copy))


def make_requantize_pages(spec: KernelSpec):
    """``requantize_pages(pages, kv_scale, page_ids, from_scale)``: fp8 pages only (None otherwise).
    Re-encode the codes of whole pages stored under the scales ``from_scale`` to the layer's scales
    ``kv_scale`` (docs/layout.md, "fp8 pages"): each element becomes the code of
    ``dequantize(code) * from_scale[kv, h] / kv_scale[kv, h]``, rounded and saturated as
    :func:`tvmkv.tir.fp8.quantize` does (equal scales give every finite code back unchanged; NaN stays
    NaN, e5m2's infinities saturate). The cache runs
    it when a layer's scales grow during calibration and when imported pages were stored under other
    scales.

    Parameters
    ----------
    pages : [num_pages, 2, H_kv, P, D], spec.page_dtype
        One layer's page pool, **written in place** at the listed pages.
    kv_scale : [2, H_kv], float32
        The scales the codes are converted to.
    page_ids : [m], int32
        Pages to convert, all distinct (the caller checks the range).
    from_scale : [2, H_kv], float32
        The scales the codes were stored under.
    """
    if not spec.fp8_pages:
        return None
    H, D, P, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.page_dtype
    scale = kv_scale_buffer(spec)
    attrs = func_attrs(spec)

    def convert(pages, from_scale, page, kv, h, j, d):
        """The new code of one element."""
        return page_code(spec, page_value(spec, pages[page, kv, h, j, d]) * from_scale[kv, h], scale, kv, h)

    @macro
    def convert_element(i, page, kv, h, j, d):
        pages[page, kv, h, j, d] = convert(pages, from_scale, page, kv, h, j, d)

    body = listed_page_body(spec, convert_element, T.serial)

    @T.prim_func(check_well_formed=False)  # checked by with_kv_scale
    def requantize_pages(var_pages: T.handle, var_ids: T.handle, var_from: T.handle):
        T.func_attr(attrs)
        num_pages = T.int32()
        m = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, H, P, D), dtype)
        page_ids = T.match_buffer(var_ids, (m,), "int32")
        from_scale = T.match_buffer(var_from, (2, H), "float32")
        body()

    return with_kv_scale(requantize_pages, scale, 0)
