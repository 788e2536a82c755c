# ruff: noqa: F841
# (each signature binds the buffers its body macro reads by name, which ruff cannot see)
"""The attention kernels' signatures: one PrimFunc signature per attention role (paged prefill,
ragged prefill, paged decode and its split), shared by every schedule that implements the role.

Each ``*_func(spec, body)`` declares the parameters once and expands ``body``, a
:func:`~tvmkv.tir._kernel_common.macro` without arguments, inside: the generic schedule
(:mod:`tvmkv.tir.attention_generic`, llvm and cuda), the tensor-core prefill
(:mod:`tvmkv.tir.prefill_cuda`), the CUDA decode (:mod:`tvmkv.tir.decode_cuda`) and the llvm split
decode (:mod:`tvmkv.tir.decode`) pass their bodies here. Every array is defined in docs/layout.md;
the parameters are documented by the factories (:func:`tvmkv.tir.prefill.make_paged_prefill`,
:func:`tvmkv.tir.ragged.make_ragged_prefill`, :func:`tvmkv.tir.decode.make_paged_decode`,
:func:`tvmkv.tir.decode.make_paged_decode_split`).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._kernel_common import func_attrs
from .spec import KernelSpec


def paged_prefill_func(spec: KernelSpec, body):
    """The ``paged_prefill_<mask>`` PrimFunc of ``spec`` around ``body``, a macro without arguments;
    one signature for every mask, target and schedule. The parameters are those of
    :func:`tvmkv.tir.prefill.make_paged_prefill`; ``body`` reads them by name (sizes ``n`` and ``B``)."""
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    attrs = func_attrs(spec)

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
        T.func_attr(attrs)
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
    """The ``ragged_prefill_<mask>`` PrimFunc of ``spec`` around ``body``, a macro without arguments;
    one signature for every mask, target and schedule. The parameters are those of
    :func:`tvmkv.tir.ragged.make_ragged_prefill`; ``body`` reads them by name (sizes ``n`` and ``B``,
    the number of sequences)."""
    H_qo, H_kv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    attrs = func_attrs(spec)

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
        T.func_attr(attrs)
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
    ``body``, a macro without arguments; one signature for every target and schedule.

    The parameters are those of :func:`tvmkv.tir.decode.make_paged_decode` (``split``:
    ``make_paged_decode_split``); ``body`` reads them by name: the sizes ``B`` and ``NSPLIT`` (1 without
    split), the buffers ``q`` ... ``kv_window``, ``o`` / ``lse`` (``o_part`` / ``lse_part``), the scalars
    ``sm_scale``, ``rope_scale``, ``rope_theta`` (and ``kv_chunk``).
    """
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    attrs = func_attrs(spec)
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
            T.func_attr(attrs)
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
        T.func_attr(attrs)
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
