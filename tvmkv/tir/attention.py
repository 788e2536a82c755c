# ruff: noqa: F841
# (each signature binds the buffers its body macro reads by name, which ruff cannot see)
"""The attention kernels' signatures: one PrimFunc signature per attention role (paged prefill,
ragged prefill, paged decode and its split), shared by every schedule that implements the role.

Each ``*_func(spec, body, scale)`` declares the parameters once and expands ``body``, a
:func:`~tvmkv.tir._kernel_common.macro` without arguments, inside: the generic schedule
(:mod:`tvmkv.tir.attention_generic`, llvm and cuda), the tensor-core prefill
(:mod:`tvmkv.tir.prefill_cuda`), the CUDA decode (:mod:`tvmkv.tir.decode_cuda`) and the llvm split
decode (:mod:`tvmkv.tir.decode`) pass their bodies here. Every array is defined in docs/layout.md;
the parameters are documented by the factories (:func:`tvmkv.tir.prefill.make_paged_prefill`,
:func:`tvmkv.tir.ragged.make_ragged_prefill`, :func:`tvmkv.tir.decode.make_paged_decode`,
:func:`tvmkv.tir.decode.make_paged_decode_split`).

A role's local-window variant (``local=True``: ``paged_prefill_causal_local``,
``ragged_prefill_causal_local``, ``paged_decode_local``; docs/layout.md, "Per-layer sliding window")
is the same signature plus one trailing ``layer_window: int32`` parameter, which its body reads by
name like the others (:func:`_with_layer_window` appends it to the parsed function). With fp8 pages
(``spec.fp8_pages``) every signature with ``pages`` takes ``kv_scale [2, H_kv] float32`` right after
it: ``scale``, the buffer the body reads (:func:`tvmkv.tir.fp8.kv_scale_buffer`), inserted by
:func:`tvmkv.tir.fp8.with_kv_scale`.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ._kernel_common import func_attrs, qkv_view
from .append import append_body
from .decode_layout import MERGE_MAX_SPLITS
from .fp8 import with_kv_scale
from .spec import KernelSpec


def _decode_append_func(spec: KernelSpec, body, scale, *, split: bool):
    """``paged_decode_append`` / ``paged_decode_append_split`` (see :func:`decode_func`)."""
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    attrs = func_attrs(spec)
    if split:

        @T.prim_func(check_well_formed=False)  # checked once finished (with_kv_scale, _with_layer_window)
        def paged_decode_append_split(
            var_qkv: T.handle,
            var_q_pos: T.handle,
            var_pages: T.handle,
            var_page_indptr: T.handle,
            var_page_indices: T.handle,
            var_last_page_len: T.handle,
            var_kv_window: T.handle,
            var_slots: T.handle,
            var_o_part: T.handle,
            var_lse_part: T.handle,
            var_counter: T.handle,
            var_o: T.handle,
            var_lse: T.handle,
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
            ncount = T.int32()
            q = T.match_buffer(var_qkv, (B, H_qo + 2 * H_kv, D), dtype)
            q_pos = T.match_buffer(var_q_pos, (B,), "int32")
            pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), spec.page_dtype)
            page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
            page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
            last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
            kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
            new_slots = T.match_buffer(var_slots, (B,), "int32")
            o_part = T.match_buffer(var_o_part, (NSPLIT, B, H_qo, D), "float32")
            lse_part = T.match_buffer(var_lse_part, (NSPLIT, B, H_qo), "float32")
            counter = T.match_buffer(var_counter, (ncount,), "int32")
            o = T.match_buffer(var_o, (B, H_qo, D), dtype)
            lse = T.match_buffer(var_lse, (B, H_qo), "float32")
            assert NSPLIT <= MERGE_MAX_SPLITS, (
                "paged_decode_append_split merges at most 64 chunks; use split_rope_append, paged_decode_split and "
                "merge_splits"
            )
            body()

        return with_kv_scale(paged_decode_append_split, scale, 2)

    @T.prim_func(check_well_formed=False)  # checked once finished (with_kv_scale, _with_layer_window)
    def paged_decode_append(
        var_qkv: T.handle,
        var_q_pos: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_indices: T.handle,
        var_last_page_len: T.handle,
        var_kv_window: T.handle,
        var_slots: T.handle,
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
        q = T.match_buffer(var_qkv, (B, H_qo + 2 * H_kv, D), dtype)
        q_pos = T.match_buffer(var_q_pos, (B,), "int32")
        pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), spec.page_dtype)
        page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
        page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
        kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
        new_slots = T.match_buffer(var_slots, (B,), "int32")
        o = T.match_buffer(var_o, (B, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (B, H_qo), "float32")
        NSPLIT = T.meta_var(1)
        body()

    return with_kv_scale(paged_decode_append, scale, 2)


def _layer_window_var(local: bool):
    """The trailing ``layer_window`` parameter of a local-window variant (None without ``local``)."""
    return tirx.Var("layer_window", "int32") if local else None


def _with_layer_window(func, layer_window):
    """``func`` with the scalar ``layer_window`` appended to its parameters (``func`` itself when it
    is None). The body bound it by name (``T.meta_var``) before it was a parameter, so the signature
    was parsed without the well-formedness check, which runs here on the finished function (as in
    :func:`tvmkv.tir.fp8.with_kv_scale`, which adds fp8 pages' ``kv_scale`` after ``pages``)."""
    if layer_window is not None:
        func = tirx.PrimFunc([*func.params, layer_window], func.body, func.ret_type, func.attrs)
    tirx.analysis.verify_well_formed(func)
    return func


def paged_prefill_func(spec: KernelSpec, body, scale=None, *, local: bool = False, fused_qkv: bool = False):
    """The ``paged_prefill_<mask>`` PrimFunc of ``spec`` around ``body``, a macro without arguments;
    one signature for every mask, target and schedule. The parameters are those of
    :func:`tvmkv.tir.prefill.make_paged_prefill`; ``body`` reads them by name (sizes ``n`` and ``B``).
    ``local``: plus the trailing ``layer_window`` (int32). ``fused_qkv``: the first parameter is the
    fused ``qkv [n, H_qo + 2 H_kv, D]`` and ``q`` the view of its query heads (``*_qkv`` kernels)."""
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    attrs = func_attrs(spec)
    lw = _layer_window_var(local)
    QH = spec.qkv_heads if fused_qkv else H_qo  # heads of the first parameter
    q_view = qkv_view(spec, 0)

    @T.prim_func(check_well_formed=False)  # checked once finished (with_kv_scale, _with_layer_window)
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
        q_in = T.match_buffer(var_q, (n, QH, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (B + 1,), "int32")
        q_pos = T.match_buffer(var_q_pos, (n,), "int32")
        pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), spec.page_dtype)
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
        if fused_qkv:  # (a Python condition: resolved while parsing)
            q = T.decl_buffer((n, QH, D), dtype, data=q_in.data, **q_view)
        else:
            q = T.meta_var(q_in)
        layer_window = T.meta_var(lw)
        body()

    return _with_layer_window(with_kv_scale(paged_prefill, scale, 3, check=False), lw)


def ragged_prefill_func(
    spec: KernelSpec, body, scale=None, *, local: bool = False, fused_qkv: bool = False, body_stores_kv: bool = False
):
    """The ``ragged_prefill_<mask>`` PrimFunc of ``spec`` around ``body``, a macro without arguments;
    one signature for every mask, target and schedule. The parameters are those of
    :func:`tvmkv.tir.ragged.make_ragged_prefill`; ``body`` reads them by name (sizes ``n`` and ``B``,
    the number of sequences). ``local``: plus the trailing ``layer_window`` (int32). ``fused_qkv``
    (not with ``local``): ``ragged_prefill_causal_qkv``, which also appends: the fused ``qkv [n, H_qo +
    2 H_kv, D]`` replaces the parameters ``q``, ``k`` and ``v`` (the body reads them as views of its
    heads), and ``pages`` / ``slot`` follow ``q_tree``: the kernel stores each token's k and v at its
    slot as ``append`` does (a body that does so itself says ``body_stores_kv``; otherwise the append
    schedule of :func:`tvmkv.tir.append.append_body` runs before it)."""
    H_qo, H_kv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    attrs = func_attrs(spec)
    if fused_qkv:
        assert not local, "ragged_prefill_func: no fused-qkv variant of a local-window kernel"
        return _ragged_prefill_qkv(spec, body, scale, body_stores_kv)
    lw = _layer_window_var(local)

    @T.prim_func(check_well_formed=False)  # checked once finished (with_kv_scale, _with_layer_window)
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
        layer_window = T.meta_var(lw)
        body()

    return _with_layer_window(ragged_prefill, lw)


def _ragged_prefill_qkv(spec: KernelSpec, body, scale, body_stores_kv: bool):
    """``ragged_prefill_causal_qkv`` (see :func:`ragged_prefill_func`)."""
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    attrs = func_attrs(spec)
    store_kv = append_body(spec, scale)
    QH = spec.qkv_heads
    q_view, k_view, v_view = (qkv_view(spec, 0), qkv_view(spec, H_qo), qkv_view(spec, H_qo + H_kv))

    @T.prim_func(check_well_formed=False)  # checked once finished (with_kv_scale, _with_layer_window)
    def ragged_prefill_qkv(
        var_qkv: T.handle,
        var_q_indptr: T.handle,
        var_q_pos: T.handle,
        var_q_tree: T.handle,
        var_pages: T.handle,
        var_slot: T.handle,
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
        num_pages = T.int32()
        qkv = T.match_buffer(var_qkv, (n, QH, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (B1,), "int32")
        q_pos = T.match_buffer(var_q_pos, (n,), "int32")
        q_tree = T.match_buffer(var_q_tree, (nt, 2), "int32")
        pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), spec.page_dtype)
        slot = T.match_buffer(var_slot, (n,), "int32")
        o = T.match_buffer(var_o, (n, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (n, H_qo), "float32")
        q = T.decl_buffer((n, QH, D), dtype, data=qkv.data, **q_view)
        k = T.decl_buffer((n, QH, D), dtype, data=qkv.data, **k_view)
        v = T.decl_buffer((n, QH, D), dtype, data=qkv.data, **v_view)
        B = T.meta_var(B1 - 1)
        if not body_stores_kv:  # (resolved while parsing) the append schedule first, then attention
            store_kv()
        body()

    return with_kv_scale(ragged_prefill_qkv, scale, 4)


def decode_func(
    spec: KernelSpec,
    body,
    scale=None,
    *,
    split: bool,
    local: bool = False,
    merge: bool = False,
    append: bool = False,
):
    """The ``paged_decode`` PrimFunc of ``spec`` (with ``split``: ``paged_decode_split``; with ``merge``
    too: ``paged_decode_split_merge``) around ``body``, a macro without arguments; one signature for
    every target and schedule.

    The parameters are those of :func:`tvmkv.tir.decode.make_paged_decode` (``split``:
    ``make_paged_decode_split``; ``merge``: ``make_paged_decode_split_merge``); ``body`` reads them by
    name: the sizes ``B`` and ``NSPLIT`` (1 without split), the buffers ``q`` ... ``kv_window``, ``o`` /
    ``lse`` (``o_part`` / ``lse_part``; with ``merge`` both, and ``counter``), the scalars ``sm_scale``,
    ``rope_scale``, ``rope_theta`` (and ``kv_chunk``). ``local`` (without ``split``):
    ``paged_decode_local``, plus the trailing ``layer_window`` (int32). ``append``:
    ``paged_decode_append`` (with ``split`` and ``merge``: ``paged_decode_append_split``), whose ``q``
    is the fused ``[B, H_qo + 2 H_kv, D]`` qkv and which takes the new tokens' ``slots`` after
    ``kv_window``.
    """
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    attrs = func_attrs(spec)
    if split and local:
        raise ValueError("paged_decode_split has no local-window variant (local layers are not split)")
    lw = _layer_window_var(local)
    if append:
        return _decode_append_func(spec, body, scale, split=split and merge)
    if merge:
        if not split:
            raise ValueError("merge=True is the split decode with its merge; pass split=True")

        @T.prim_func(check_well_formed=False)  # checked once finished (with_kv_scale, _with_layer_window)
        def paged_decode_split_merge(
            var_q: T.handle,
            var_q_pos: T.handle,
            var_pages: T.handle,
            var_page_indptr: T.handle,
            var_page_indices: T.handle,
            var_last_page_len: T.handle,
            var_kv_window: T.handle,
            var_o_part: T.handle,
            var_lse_part: T.handle,
            var_counter: T.handle,
            var_o: T.handle,
            var_lse: T.handle,
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
            ncount = T.int32()
            q = T.match_buffer(var_q, (B, H_qo, D), dtype)
            q_pos = T.match_buffer(var_q_pos, (B,), "int32")
            pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), spec.page_dtype)
            page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
            page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
            last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
            kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
            o_part = T.match_buffer(var_o_part, (NSPLIT, B, H_qo, D), "float32")
            lse_part = T.match_buffer(var_lse_part, (NSPLIT, B, H_qo), "float32")
            counter = T.match_buffer(var_counter, (ncount,), "int32")
            o = T.match_buffer(var_o, (B, H_qo, D), dtype)
            lse = T.match_buffer(var_lse, (B, H_qo), "float32")
            assert NSPLIT <= MERGE_MAX_SPLITS, (
                "paged_decode_split_merge merges at most 64 chunks; use paged_decode_split + merge_splits"
            )
            body()

        return with_kv_scale(paged_decode_split_merge, scale, 2)
    if split:

        @T.prim_func(check_well_formed=False)  # checked once finished (with_kv_scale, _with_layer_window)
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
            pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), spec.page_dtype)
            page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
            page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
            last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
            kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
            o_part = T.match_buffer(var_o_part, (NSPLIT, B, H_qo, D), "float32")
            lse_part = T.match_buffer(var_lse_part, (NSPLIT, B, H_qo), "float32")
            body()

        return with_kv_scale(paged_decode_split, scale, 2)

    @T.prim_func(check_well_formed=False)  # checked once finished (with_kv_scale, _with_layer_window)
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
        pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), spec.page_dtype)
        page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32")
        page_indices = T.match_buffer(var_page_indices, (nnz,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (B,), "int32")
        kv_window = T.match_buffer(var_kv_window, (B, 3), "int32")
        o = T.match_buffer(var_o, (B, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (B, H_qo), "float32")
        NSPLIT = T.meta_var(1)
        layer_window = T.meta_var(lw)
        body()

    return _with_layer_window(with_kv_scale(paged_decode, scale, 2, check=False), lw)
