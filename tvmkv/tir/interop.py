# ruff: noqa: F821, F841
# (each signature binds the buffers its body macros read by name, which ruff cannot see)
"""Copies between tvmkv's pages and foreign KV layouts (interop; docs/layout.md, "Foreign layouts").

Not part of a cache's kernel set: ``tvmkv.runtime.interop`` compiles this family lazily on first use
(``tvmkv.build.load_kernels(spec, family="interop")``).

Ours, per layer: ``pages [num_pages, 2, H_kv, P, D]``. The foreign layouts hold every layer in one
array; a kernel call copies one layer (``layer``, a runtime argument) of ``m`` pages:

======================  ===================================  ==========================================
layout                  foreign array                        element of (page row ``b``, kv, h, j, d)
======================  ===================================  ==========================================
``ksana`` (KsanaLLM)    ``[NB, 2, L, P, H_kv, D]``           ``[b, kv, layer, j, h, d]``
``nhd`` (FlashInfer)    ``[L, NB, 2, P, H_kv, D]``           ``[layer, b, kv, j, h, d]``
``hnd`` (FlashInfer)    ``[L, NB, 2, H_kv, P, D]``           ``[layer, b, kv, h, j, d]``
``contiguous``          ``[L, 2, n, H_kv, D]``               ``[layer, kv, t, h, d]``, token ``t``
======================  ===================================  ==========================================

Paged layouts copy whole pages: entry ``e`` pairs our page ``page_ids[e]`` with foreign block
``block_ids[e]``. The contiguous layout copies tokens: token ``t < n`` lives at our page
``page_ids[t // P]``, offset ``t % P``. ``NB``, ``L``, ``m``, ``n`` and ``num_pages`` are symbolic.
CUDA mapping as in ``page_ops``: ``threadIdx.x`` over ``D``, ``threadIdx.y`` over a few heads,
``blockIdx`` over (page, offset) or tokens and head chunks. One signature per kernel role
(``page_copy_func``, ``token_copy_func``); the llvm and cuda bodies are macros.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._kernel_common import func_attrs, heads_per_block, macro
from .foreign_layouts import LAYOUTS, PAGED_LAYOUTS, foreign_index, foreign_shape  # noqa: F401 (re-exported)
from .spec import KernelSpec

DIRECTIONS = ("export", "import")


def _check(layout: str, direction: str, allowed: tuple) -> None:
    if layout not in allowed:
        raise ValueError(f"layout={layout!r} is not one of {allowed}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not one of {DIRECTIONS}")


def _check_page_dtype(spec: KernelSpec) -> None:
    if spec.fp8_pages:
        raise NotImplementedError(
            f"foreign-layout copies of fp8 pages (kv_dtype={spec.kv_dtype!r}) are not built yet: their values are "
            "codes under per-head scales; read K/V with debug_get_kv (dequantized) or use a cache without kv_dtype"
        )


def page_copy_func(spec: KernelSpec, layout: str, body):
    """The ``<direction>_<layout>`` PrimFunc of ``spec`` for a paged ``layout`` around ``body``, a
    macro without arguments, which reads the parameters of :func:`make_page_copy` by name (sizes
    ``m``, the entries, ``NB``, the foreign blocks, and ``L``, the layers); both directions share it."""
    H, D, P, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    attrs = func_attrs(spec)

    @T.prim_func
    def page_copy(var_pages: T.handle, var_ids: T.handle, var_foreign: T.handle, var_blocks: T.handle, layer: T.int32):
        T.func_attr(attrs)
        num_pages = T.int32()
        m = T.int32()
        NB = T.int32()
        L = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, H, P, D), dtype)
        page_ids = T.match_buffer(var_ids, (m,), "int32")
        foreign = T.match_buffer(var_foreign, foreign_shape(layout, NB, L, spec), dtype)
        block_ids = T.match_buffer(var_blocks, (m,), "int32")
        body()

    return page_copy


def token_copy_func(spec: KernelSpec, body):
    """The ``<direction>_contiguous`` PrimFunc of ``spec`` around ``body``, a macro without arguments,
    which reads the parameters of :func:`make_token_copy` by name (sizes ``m``, the pages, ``n``, the
    tokens, and ``L``, the layers); both directions share it."""
    H, D, P, dtype = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    attrs = func_attrs(spec)

    @T.prim_func
    def token_copy(var_pages: T.handle, var_ids: T.handle, var_seq: T.handle, layer: T.int32):
        T.func_attr(attrs)
        num_pages = T.int32()
        m = T.int32()
        n = T.int32()
        L = T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, H, P, D), dtype)
        page_ids = T.match_buffer(var_ids, (m,), "int32")
        seq = T.match_buffer(var_seq, (L, 2, n, H, D), dtype)
        body()

    return token_copy


def make_page_copy(spec: KernelSpec, layout: str, *, direction: str):
    """``<direction>_<layout>(pages, page_ids, foreign, block_ids, layer)``: copy whole pages of one layer.

    Parameters
    ----------
    pages : [num_pages, 2, H_kv, P, D], spec.dtype
        The layer's page pool; **written** when ``direction == "import"``.
    page_ids : [m], int32
        Our pages, in range (the caller checks).
    foreign : see the module table, spec.dtype
        The foreign array (all layers); **written** (only the ``layer`` slice of ``block_ids``'s
        blocks) when ``direction == "export"``.
    block_ids : [m], int32
        Foreign block of each entry; distinct when exporting (the caller checks).
    layer : int32
        Which layer of ``foreign`` this call copies, ``0 <= layer < L``.
    """
    _check_page_dtype(spec)
    _check(layout, direction, PAGED_LAYOUTS)
    H, D, P = spec.num_kv_heads, spec.head_dim, spec.page_size
    HY = heads_per_block(H, D)
    HB = (H + HY - 1) // HY
    export = direction == "export"

    def route(pages, foreign, layer, page, block, kv, h, j, d):
        """(destination, its index, source, its index) of one element."""
        ours, theirs = (page, kv, h, j, d), foreign_index(layout, layer, block, kv, h, j, d)
        return (foreign, theirs, pages, ours) if export else (pages, ours, foreign, theirs)

    @macro
    def cpu_body():
        for ek in T.parallel(m * 2):  # (entry, K or V)
            for h, j in T.grid(H, P):
                for d in T.vectorized(D):
                    e = T.meta_var(ek // 2)
                    dst, di, src, si = T.meta_var(
                        route(pages, foreign, layer, page_ids[e], block_ids[e], ek % 2, h, j, d)
                    )
                    dst[di] = src[si]

    @macro
    def gpu_body():
        for ej in T.thread_binding(T.max(m * P, 1), thread="blockIdx.x"):  # (entry, offset); max: no empty grid
            for hb in T.thread_binding(2 * HB, thread="blockIdx.y"):  # (K or V) x head chunk
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        h = T.meta_var(hb % HB * HY + hy)
                        e = T.meta_var(ej // P)
                        if ej < m * P and h < H:
                            dst, di, src, si = T.meta_var(
                                route(pages, foreign, layer, page_ids[e], block_ids[e], hb // HB, h, ej % P, d)
                            )
                            dst[di] = src[si]

    return page_copy_func(spec, layout, cpu_body if spec.is_cpu else gpu_body)


def make_token_copy(spec: KernelSpec, *, direction: str):
    """``<direction>_contiguous(pages, page_ids, seq, layer)``: copy one layer of a sequence's tokens.

    Parameters
    ----------
    pages : [num_pages, 2, H_kv, P, D], spec.dtype
        The layer's page pool; **written** (slots of tokens ``t < n`` only) when importing.
    page_ids : [m], int32
        The sequence's pages in token order, ``m >= ceil(n / P)``, in range (the caller checks).
    seq : [L, 2, n, H_kv, D], spec.dtype
        Contiguous K (``[:, 0]``) and V (``[:, 1]``) of ``n`` tokens; **written** (the ``layer``
        slice) when exporting.
    layer : int32
        Which layer of ``seq`` this call copies.
    """
    _check_page_dtype(spec)
    _check("contiguous", direction, ("contiguous",))
    H, D, P = spec.num_kv_heads, spec.head_dim, spec.page_size
    HY = heads_per_block(H, D)
    HB = (H + HY - 1) // HY
    export = direction == "export"

    def route(pages, seq, layer, page, t, kv, h, d):
        ours, theirs = (page, kv, h, t % P, d), (layer, kv, t, h, d)
        return (seq, theirs, pages, ours) if export else (pages, ours, seq, theirs)

    @macro
    def cpu_body():
        for t in T.parallel(n):
            for kv, h in T.grid(2, H):
                for d in T.vectorized(D):
                    dst, di, src, si = T.meta_var(route(pages, seq, layer, page_ids[t // P], t, kv, h, d))
                    dst[di] = src[si]

    @macro
    def gpu_body():
        for t in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(2 * HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D, thread="threadIdx.x"):
                        h = T.meta_var(hb % HB * HY + hy)
                        if t < n and h < H:
                            dst, di, src, si = T.meta_var(route(pages, seq, layer, page_ids[t // P], t, hb // HB, h, d))
                            dst[di] = src[si]

    return token_copy_func(spec, cpu_body if spec.is_cpu else gpu_body)


def kernel_set(spec: KernelSpec) -> dict:
    """The interop family: ``export_<layout>`` and ``import_<layout>`` for every layout in :data:`LAYOUTS`."""
    funcs = {}
    for direction in DIRECTIONS:
        for layout in PAGED_LAYOUTS:
            funcs[f"{direction}_{layout}"] = make_page_copy(spec, layout, direction=direction)
        funcs[f"{direction}_contiguous"] = make_token_copy(spec, direction=direction)
    return funcs
