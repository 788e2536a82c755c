"""Global functions through which a compiled Relax VM reaches tvmkv's cache.

Two routes (see README, "Relax VM"):

- **Own interface** — :func:`register` registers ``tvmkv.attention_with_fused_qkv`` (and the
  shared-KV, query-position and MLA globals), which the ``nn.Object`` :class:`tvmkv.relax.TvmkvKVCache`
  calls from each attention layer. The cache is created and driven in Python (``add_sequence``,
  ``begin_forward`` ...) and passed into the VM as an argument.
- **Drop-in for TVM's interface** — :class:`TvmBuiltinOverride` (a context manager) re-registers the
  ``vm.builtin.*`` functions that a model written against
  ``tvm.relax.frontend.nn.llm.kv_cache.PagedKVCache`` and its driver call, so that
  ``vm.builtin.paged_attention_kv_cache_create`` returns a tvmkv cache and every other function
  dispatches on ``isinstance(cache, PagedAttentionKVCache)``, delegating to TVM's original otherwise.

A Relax VM resolves the names it calls once, when it is constructed: register (or enter the
override) **before** ``relax.VirtualMachine(...)``. A VM built earlier keeps the functions it found.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import tvm_ffi

from ..runtime import checkpoint
from ..runtime.cache import PagedAttentionKVCache
from ..tir.rope_scaling import RopeScaling

ATTENTION_FUNC = "tvmkv.attention_with_fused_qkv"
SHARED_KV_FUNC = "tvmkv.attention_with_shared_kv"
QUERY_POSITIONS_FUNC = "tvmkv.get_query_positions"
# MLA (DeepSeek-V2) fine-grained attention of TvmkvKVCache: the cache's methods of the same names
APPEND_MLA_FUNC = "tvmkv.append_mla_kv"
SELF_ATTENTION_FUNC = "tvmkv.self_attention"
CROSS_ATTENTION_FUNC = "tvmkv.cross_attention"
MERGE_FUNC = "tvmkv.merge_attn_output"

_ROPE_MODES = {0: "none", 1: "normal", 2: "inline"}
_ATTN_KIND_MHA = 0  # tvm.relax.frontend.nn.llm.kv_cache.AttnKind.MHA
_ATTN_KIND_MLA = 1  # AttnKind.MLA: one latent row per token (DeepSeek-V2)
_ATTN_KIND_MHA_SLIDING = 3  # AttnKind.MHA_SLIDING: a layer attending within its own sliding window

CREATE = "vm.builtin.paged_attention_kv_cache_create"

# Functions whose tvmkv version exists, by TVM name; each receives the cache first.
_SUPPORTED = (
    "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
    "vm.builtin.kv_state_add_sequence",
    "vm.builtin.kv_state_remove_sequence",
    "vm.builtin.kv_state_fork_sequence",
    "vm.builtin.kv_state_popn",
    "vm.builtin.kv_state_begin_forward",
    "vm.builtin.kv_state_end_forward",
    "vm.builtin.kv_state_clear",
    "vm.builtin.attention_kv_cache_get_num_available_pages",
    "vm.builtin.attention_kv_cache_get_total_sequence_length",
    "vm.builtin.attention_kv_cache_get_sequence_length",
    "vm.builtin.attention_kv_cache_enable_sliding_window_for_seq",
    "vm.builtin.attention_kv_cache_commit_accepted_token_tree_nodes",
    "vm.builtin.attention_kv_cache_debug_get_kv",
    "vm.builtin.attention_kv_cache_get_query_positions",
    "vm.builtin.attention_kv_cache_empty",
    "vm.builtin.attention_kv_cache_attention_with_shared_kv",
    "vm.builtin.attention_kv_cache_self_attention",
    "vm.builtin.attention_kv_cache_cross_attention",
    "vm.builtin.attention_kv_cache_merge_attn_output_inplace",
    "vm.builtin.attention_kv_cache_append_mla_kv",
    "vm.builtin.attention_kv_cache_debug_get_kv_mla",
    # checkpoints (tvmkv.runtime.checkpoint): TVM's page-group format, any sequence id
    "vm.builtin.attention_kv_cache_get_checkpoint_metadata",
    "vm.builtin.attention_kv_cache_get_layout_hash",
    "vm.builtin.attention_kv_cache_export_page_group",
    "vm.builtin.attention_kv_cache_prepare_import",
    "vm.builtin.attention_kv_cache_import_page_group",
    "vm.builtin.attention_kv_cache_finish_import",
)

# Functions of TVM's interface that tvmkv does not implement, and why (also in the README).
UNSUPPORTED = {
    "vm.builtin.kv_cache_disagg_prepare_recv": "TVM's disaggregation needs NVSHMEM; tvmkv moves a sequence "
    "between caches with tvmkv.runtime.transfer (prepare_receive / send_sequence)",
    "vm.builtin.kv_cache_disagg_mark_send": "TVM's disaggregation needs NVSHMEM; tvmkv moves a sequence "
    "between caches with tvmkv.runtime.transfer (prepare_receive / send_sequence)",
}


def _attention(cache, layer_id, sm_scale, qkv, out) -> None:
    """``tvmkv.attention_with_fused_qkv(cache, layer_id, sm_scale, qkv, out)``: writes ``out`` in place."""
    if not isinstance(cache, PagedAttentionKVCache):
        raise TypeError(
            f"{ATTENTION_FUNC} got a {type(cache).__name__} as its cache; pass a tvmkv.PagedAttentionKVCache "
            "(for TVM's own caches use TVM's PagedKVCache interface)"
        )
    cache.attention_with_fused_qkv(layer_id, qkv, sm_scale, out=out)


def _attention_shared(cache, layer_id, sm_scale, q, k, v, out) -> None:
    """``tvmkv.attention_with_shared_kv(cache, source_layer_id, sm_scale, q, k, v, out)``: writes ``out``."""
    if not isinstance(cache, PagedAttentionKVCache):
        raise TypeError(
            f"{SHARED_KV_FUNC} got a {type(cache).__name__} as its cache; pass a tvmkv.PagedAttentionKVCache"
        )
    cache.attention_with_shared_kv(layer_id, q, k, v, out=out, sm_scale=sm_scale)


def _query_positions_own(cache):
    """``tvmkv.get_query_positions(cache)``: positions ``[n]`` int32 of the open forward's tokens."""
    if not isinstance(cache, PagedAttentionKVCache):
        raise TypeError(
            f"{QUERY_POSITIONS_FUNC} got a {type(cache).__name__} as its cache; pass a tvmkv.PagedAttentionKVCache"
        )
    return cache.query_positions()


def _own_cache(cache: Any, name: str) -> PagedAttentionKVCache:
    if not isinstance(cache, PagedAttentionKVCache):
        raise TypeError(f"{name} got a {type(cache).__name__} as its cache; pass a tvmkv.PagedAttentionKVCache")
    return cache


def _append_mla_own(cache: Any, layer_id: int, kv: Any) -> PagedAttentionKVCache:
    """``tvmkv.append_mla_kv(cache, layer_id, kv [n, D])``: returns the cache."""
    return _own_cache(cache, APPEND_MLA_FUNC).append_mla_kv(layer_id, kv)


def _self_attention_own(cache: Any, layer_id: int, sm_scale: float, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
    """``tvmkv.self_attention(cache, layer_id, sm_scale, q, k, v, out, lse)``: writes ``out`` and ``lse``."""
    _own_cache(cache, SELF_ATTENTION_FUNC).self_attention(layer_id, q, k, v, out, lse, sm_scale)


def _cross_attention_own(cache: Any, layer_id: int, sm_scale: float, q: Any, out: Any, lse: Any) -> None:
    """``tvmkv.cross_attention(cache, layer_id, sm_scale, q, out, lse)`` (TVM's include-new rule)."""
    _own_cache(cache, CROSS_ATTENTION_FUNC).cross_attention(layer_id, q, out, lse, sm_scale)


def _merge_own(cache: Any, o_a: Any, lse_a: Any, o_b: Any, lse_b: Any, out: Any, lse_out: Any) -> None:
    """``tvmkv.merge_attn_output(cache, o_a, lse_a, o_b, lse_b, out, lse_out)``: the merged state of
    ``a`` and ``b`` into the fresh ``out``/``lse_out``; the inputs are not modified."""
    _own_cache(cache, MERGE_FUNC)
    out.copyfrom(o_a)
    lse_out.copyfrom(lse_a)
    cache.merge_attn_output_inplace(out, lse_out, o_b, lse_b)


def register() -> None:
    """Register the ``tvmkv.*`` globals of :class:`tvmkv.relax.TvmkvKVCache` (idempotent): attention with
    fused qkv, attention with shared KV, query positions, and MLA's append / self / cross attention /
    merge. Call before constructing the VM."""
    funcs = {
        ATTENTION_FUNC: _attention,
        SHARED_KV_FUNC: _attention_shared,
        QUERY_POSITIONS_FUNC: _query_positions_own,
        APPEND_MLA_FUNC: _append_mla_own,
        SELF_ATTENTION_FUNC: _self_attention_own,
        CROSS_ATTENTION_FUNC: _cross_attention_own,
        MERGE_FUNC: _merge_own,
    }
    for name, func in funcs.items():
        tvm_ffi.register_global_func(name, _reporting(name, func), override=True)


_error_sink = None  # route_worker_calls's
_stage = None


def route_worker_calls(error_sink, stage) -> None:
    """What a Disco worker process (:mod:`tvmkv.disco.worker`) supplies. ``error_sink(name, exception)``
    receives what tvmkv's globals and :class:`TvmBuiltinOverride`'s functions raise and either takes it (the
    call then returns None: on a worker thread a raise would end the worker, and worker 0's the controller
    process) or raises it again. ``stage()`` is ``(group, num_groups, ...)`` of the worker thread calling it
    (None elsewhere): a create call's ``layer_partition`` picks that group's layers. None, None: every error
    raises, one stage."""
    global _error_sink, _stage
    _error_sink, _stage = error_sink, stage


def _reporting(name: str, func):
    """``func`` with what it raises given to the :func:`route_worker_calls` sink, when one is set."""

    def call(*args):
        try:
            return func(*args)
        except Exception as err:
            if _error_sink is None:
                raise
            _error_sink(name, err)
            return None

    return call


def cuda_target(arch: str | None):
    """The cache's ``target`` for CUDA kernels of ``arch``.

    Plain ``"cuda"`` when ``arch`` is tvmkv's default (``TVMKV_CUDA_ARCH`` or sm_90): the only spelling
    a runtime-only TVM (no ``Target`` constructor) accepts; otherwise a ``tvm.target.Target``.
    """
    from ..target import default_cuda_arch, make_target

    if arch is None or arch == default_cuda_arch():
        return "cuda"
    return make_target("cuda", arch)


# ---------------------------------------------------------------------------- drop-in route
def _begin_forward(cache: PagedAttentionKVCache, seq_ids, append_lengths, token_tree_parent_ptr=None):
    parents = None if token_tree_parent_ptr is None else list(token_tree_parent_ptr)
    cache.begin_forward(list(seq_ids), list(append_lengths), parents)


def _debug_get_kv(cache: PagedAttentionKVCache, seq_id, start_pos, end_pos, k_data, v_data):
    """TVM's DebugGetKV: fill ``k_data``/``v_data`` ``[num_layers, end - start, H_kv, D]`` in place."""
    k, v = cache.debug_get_kv(seq_id, start_pos, end_pos)
    _fill([("k_data", k_data, k), ("v_data", v_data, v)], "debug_get_kv")


def _debug_get_kv_mla(cache: PagedAttentionKVCache, seq_id, start_pos, end_pos, kv_data):
    """TVM's DebugGetKVMLA: fill ``kv_data`` ``[num_layers, end - start, qk_head_dim]`` in place."""
    _fill([("kv_data", kv_data, cache.debug_get_kv_mla(seq_id, start_pos, end_pos))], "debug_get_kv_mla")


def _fill(targets: list, what: str) -> None:
    """Copy each ``(name, tensor, values)``'s NumPy values into the caller's tensor, once every tensor
    is checked to be a tvm tensor of the values' shape and dtype (nothing is written otherwise)."""
    for name, t, values in targets:
        shape, dtype = tuple(getattr(t, "shape", ())), str(getattr(t, "dtype", type(t).__name__))
        if not hasattr(t, "copyfrom") or shape != values.shape or dtype != str(values.dtype):
            raise ValueError(
                f"{what}: {name} is {dtype} {list(shape)}; it must be a tvm tensor of {values.dtype} "
                f"{list(values.shape)} ([num_layers, end_pos - start_pos, ...] of the cache's dtype)"
            )
    for _, t, values in targets:
        t.copyfrom(np.ascontiguousarray(values))


def _merge(cache: PagedAttentionKVCache, o_self, lse_self, o_cross, lse_cross):
    """TVM's MergeAttnOutputInplace: merge the cross state into the self state in place; returns both."""
    cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
    return [o_self, lse_self]


def _query_positions(cache: PagedAttentionKVCache):
    """Logical positions ``[n]`` int32 of the open forward's tokens (a device tensor)."""
    return cache.query_positions()


def _impls() -> dict:
    C = PagedAttentionKVCache
    return {
        "vm.builtin.attention_kv_cache_attention_with_fused_qkv": _attention,
        "vm.builtin.kv_state_add_sequence": C.add_sequence,
        "vm.builtin.kv_state_remove_sequence": C.remove_sequence,
        "vm.builtin.kv_state_fork_sequence": C.fork_sequence,
        "vm.builtin.kv_state_popn": C.pop_n,
        "vm.builtin.kv_state_begin_forward": _begin_forward,
        "vm.builtin.kv_state_end_forward": C.end_forward,
        "vm.builtin.kv_state_clear": C.clear,
        "vm.builtin.attention_kv_cache_get_num_available_pages": C.num_available_pages,
        "vm.builtin.attention_kv_cache_get_total_sequence_length": C.total_sequence_length,
        "vm.builtin.attention_kv_cache_get_sequence_length": C.sequence_length,
        "vm.builtin.attention_kv_cache_enable_sliding_window_for_seq": C.enable_sliding_window_for_seq,
        "vm.builtin.attention_kv_cache_commit_accepted_token_tree_nodes": (
            lambda c, seq_ids, leaves: c.commit_accepted_token_tree_nodes(
                list(seq_ids), list(leaves), scope="last_forward"
            )
        ),
        "vm.builtin.attention_kv_cache_empty": C.is_empty,
        "vm.builtin.attention_kv_cache_attention_with_shared_kv": (
            lambda c, layer, sm_scale, q, k, v, o: c.attention_with_shared_kv(layer, q, k, v, out=o, sm_scale=sm_scale)
        ),
        "vm.builtin.attention_kv_cache_debug_get_kv": _debug_get_kv,
        "vm.builtin.attention_kv_cache_self_attention": (
            lambda c, layer, sm_scale, q, k, v, o, lse: c.self_attention(layer, q, k, v, o, lse, sm_scale)
        ),
        "vm.builtin.attention_kv_cache_cross_attention": (
            lambda c, layer, sm_scale, q, o, lse: c.cross_attention(layer, q, o, lse, sm_scale)
        ),
        "vm.builtin.attention_kv_cache_merge_attn_output_inplace": _merge,
        "vm.builtin.attention_kv_cache_append_mla_kv": C.append_mla_kv,
        "vm.builtin.attention_kv_cache_debug_get_kv_mla": _debug_get_kv_mla,
        "vm.builtin.attention_kv_cache_get_query_positions": _query_positions,
        "vm.builtin.attention_kv_cache_get_checkpoint_metadata": checkpoint.checkpoint_metadata,
        "vm.builtin.attention_kv_cache_get_layout_hash": checkpoint.layout_hash,
        "vm.builtin.attention_kv_cache_export_page_group": checkpoint.export_page_group,
        "vm.builtin.attention_kv_cache_prepare_import": checkpoint.prepare_import,
        "vm.builtin.attention_kv_cache_import_page_group": checkpoint.import_page_group,
        "vm.builtin.attention_kv_cache_finish_import": checkpoint.finish_import,
    }


def _stage_layers(partition: list, num_kinds: int) -> tuple:
    """``(first, end)``: the model's layers the cache being created holds, from the create call's
    ``layer_partition`` (TVM's ``layer_indptr``) and the Disco worker group this thread runs (one stage
    outside Disco)."""
    group, groups = ((_stage and _stage()) or (0, 1))[:2]
    if len(partition) != groups + 1:
        where = f"a Disco session of {groups} worker groups" if groups > 1 else "one stage (no Disco worker groups)"
        raise ValueError(
            f"layer_partition {partition} gives {len(partition) - 1} pipeline stages but the cache is created in "
            f"{where}; pass {groups + 1} layer boundaries, one stage per group (TVM's layer_indptr)"
        )
    if partition[0] != 0 or any(b <= a for a, b in zip(partition, partition[1:])):
        raise ValueError(f"layer_partition {partition} must start at 0 and increase (each stage holds a layer)")
    if num_kinds not in (1, partition[-1]):
        raise ValueError(
            f"attention kinds give {num_kinds} layers but layer_partition {partition} ends at layer {partition[-1]}"
        )
    return partition[group], partition[group + 1]


def _is_tensor(x) -> bool:
    return hasattr(x, "__dlpack__") or type(x).__name__ in ("Tensor", "NDArray")


def _unsupported(name: str, why: str):
    def impl(cache, *args):
        raise NotImplementedError(f"{name} is not supported by tvmkv's cache: {why}")

    return impl


def _dispatching(name: str, impl, original):
    """A global that runs ``impl`` for a tvmkv cache and TVM's ``original`` for anything else."""

    def func(*args):
        if args and isinstance(args[0], PagedAttentionKVCache):
            return impl(*args)
        if original is None:
            raise TypeError(f"{name}: no TVM implementation to delegate a {type(args[0]).__name__} to")
        return original(*args)

    return func


# [override, the functions it restores when uninstalled] of each installed TvmBuiltinOverride, in install order
# (the last one's functions are live)
_INSTALLED: list = []


class TvmBuiltinOverride:
    """Run a model written against TVM's ``PagedKVCache`` interface on tvmkv's cache, unchanged.

    While installed (``with TvmBuiltinOverride(): ...`` or ``install()`` / ``uninstall()``):

    - ``vm.builtin.paged_attention_kv_cache_create`` builds a :class:`tvmkv.PagedAttentionKVCache`
      from its 28 arguments (sizes, heads, head dims, RoPE mode/scale/theta, the dtype and device of
      its 0-d tensor) and ignores the TIR kernels it is handed (tvmkv brings its own, compiled for the
      device of that tensor). There is nothing to dispatch on here, hence the explicit mode.
    - the ``vm.builtin.kv_state_*`` / ``attention_kv_cache_*`` functions listed in ``_SUPPORTED``
      dispatch on the cache's type: tvmkv's cache goes to tvmkv, any other object to TVM's original;
      those in :data:`UNSUPPORTED` raise ``NotImplementedError`` for a tvmkv cache.

    ``uninstall`` (or leaving the ``with``) re-registers TVM's originals. The registry is
    process-wide: construct the VM inside the override, and note that a VM constructed inside keeps
    calling tvmkv's functions after ``uninstall`` (it resolved the names at construction), which is
    harmless since they delegate every non-tvmkv cache.

    Parameters
    ----------
    num_pages : int, optional
        Pages per layer of the caches created (default: tvmkv's default for the sizes given).
    build_dir : path, optional
        Kernel build cache of the created caches (default :func:`tvmkv.build.default_build_dir`).
    cuda_arch : str, optional
        ``sm_XX`` of the kernels when the model runs on CUDA (default: the device's compute version).
    rope_scaling : dict or tvmkv.tir.RopeScaling, optional
        The ``rope_scaling`` dict the model passed to TVM's ``PagedKVCache`` (TVM bakes it into the
        kernels it hands the create call, which tvmkv ignores, so it is given here); longrope's factors
        come from the create call's ``rope_ext_factors`` tensor (or the dict's ``long_factor`` /
        ``short_factor``). Default: the plain RoPE.
    rotary_dim : int, optional
        The model's ``rotary_dim`` (only the first ``rotary_dim`` dims of a head rotate); default all.
    mla_self_dims : (int, int), optional
        ``(Dq, Dv)`` of an MLA model's prefill self attention (DeepSeek-V2: ``(192, 128)``), which TVM's
        create call does not carry; default: inferred from the first ``self_attention`` call.
    select : callable, optional
        ``select()`` returns the override whose options a create call takes (None: this one's): a Disco
        worker process installs one override and gives each session's worker thread its own options.

    On a Disco worker of a session with several worker groups (pipeline stages), the create call's
    ``layer_partition`` (TVM's ``layer_indptr``, one entry more than the groups) gives the worker's
    group its layers, as TVM's does: the cache holds layers ``[layer_partition[g], layer_partition[g +
    1])`` of group ``g`` and its calls take the model's layer ids (``first_layer``).
    """

    def __init__(
        self,
        *,
        num_pages=None,
        build_dir=None,
        cuda_arch=None,
        rope_scaling=None,
        rotary_dim=None,
        mla_self_dims=None,
        select=None,
    ):
        self.select = select
        self.mla_self_dims = mla_self_dims
        self.num_pages = num_pages
        self.build_dir = build_dir
        self.cuda_arch = cuda_arch
        self.rope_scaling = RopeScaling.parse(rope_scaling, rotary_dim=rotary_dim)  # resolved at create
        self._created: list = []  # weak references to the caches created while installed
        self._originals: dict | None = None

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> TvmBuiltinOverride:
        if self._originals is not None:
            raise RuntimeError("this TvmBuiltinOverride is already installed")
        # TVM's library registers these names when it loads: load it first, or its registration would
        # collide with ours later (the process aborted when the override was entered before `import tvm`)
        import tvm  # noqa: F401

        names = [CREATE, *_SUPPORTED, *UNSUPPORTED]
        self._originals = {n: tvm_ffi.get_global_func(n, allow_missing=True) for n in names}
        impls = _impls()
        register()
        _INSTALLED.append([self, self._originals])
        tvm_ffi.register_global_func(CREATE, _reporting(CREATE, self._create), override=True)
        for name in _SUPPORTED:
            func = _dispatching(name, _reporting(name, impls[name]), self._originals[name])
            tvm_ffi.register_global_func(name, func, override=True)
        for name, why in UNSUPPORTED.items():
            func = _dispatching(name, _reporting(name, _unsupported(name, why)), self._originals[name])
            tvm_ffi.register_global_func(name, func, override=True)
        return self

    def uninstall(self) -> None:
        """Put back the functions :meth:`install` replaced. Overrides may be uninstalled in any order: one
        installed later on top of this one keeps its functions and takes this one's originals, so the
        last one uninstalled restores TVM's."""
        if self._originals is None:
            return
        at = next(i for i, (override, _) in enumerate(_INSTALLED) if override is self)
        originals = _INSTALLED[at][1]  # TVM's functions, or those of an override uninstalled under this one
        if at + 1 < len(_INSTALLED):  # another override sits on top: it restores these originals later
            _INSTALLED[at + 1][1] = originals
        else:
            for name, original in originals.items():
                if original is None:
                    tvm_ffi.remove_global_func(name)
                else:
                    tvm_ffi.register_global_func(name, original, override=True)
        del _INSTALLED[at]
        self._originals = None

    def __enter__(self) -> TvmBuiltinOverride:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # ------------------------------------------------------------------ create
    @property
    def created(self) -> list:
        """The caches created while installed that are still alive, oldest first (held weakly: a cache the
        model drops frees its pages)."""
        return [c for c in (r() for r in self._created) if c is not None]

    def _create(self, *args) -> PagedAttentionKVCache:
        options = (self.select() if self.select is not None else None) or self
        cache = PagedAttentionKVCache(**options.cache_kwargs(*args))
        self._created = [r for r in self._created if r() is not None] + [weakref.ref(cache)]
        return cache

    def cache_kwargs(self, *args) -> dict[str, Any]:
        """tvmkv constructor arguments from ``paged_attention_kv_cache_create``'s arguments.

        Raises NotImplementedError for what tvmkv lacks: MLA layers mixed with other kinds,
        ``qk_head_dim != v_head_dim`` outside MLA, disaggregation.
        """
        if len(args) < 13:
            raise TypeError(f"{CREATE} expects TVM 0.27's 28 arguments, got {len(args)}")
        sizes, partition, hq, hkv, qk_dim, v_dim, kinds, disagg, rope, scale, theta, ext, ref = args[:13]
        sizes = [int(x) for x in sizes]
        if len(sizes) < 5:
            raise ValueError(
                f"{CREATE}: its first argument has {len(sizes)} entries {sizes}; TVM's cache config starts with "
                "[max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window]"
            )
        max_batch, max_total, chunk, page_size, sliding = sizes[:5]
        kinds = [int(k) for k in kinds]
        first, end = _stage_layers([int(x) for x in partition], len(kinds))
        mla: dict = {}
        if _ATTN_KIND_MLA in kinds:
            if any(k != _ATTN_KIND_MLA for k in kinds):
                raise NotImplementedError(f"attention kinds {kinds}: MLA layers mixed with other kinds (TVM too)")
            if int(hkv) != 1 or int(v_dim) >= int(qk_dim):
                raise ValueError(
                    f"an MLA cache has num_kv_heads 1 and qk_head_dim (kv_lora_rank + qk_rope_head_dim) > "
                    f"v_head_dim (kv_lora_rank); got num_kv_heads {hkv}, qk_head_dim {qk_dim}, v_head_dim {v_dim}"
                )
            mla = dict(
                kv_lora_rank=int(v_dim),
                qk_rope_head_dim=int(qk_dim) - int(v_dim),
                mla_self_dims=self.mla_self_dims,
            )
            v_dim = qk_dim  # one stored row per token: the checks below are MHA's
        elif any(k not in (_ATTN_KIND_MHA, _ATTN_KIND_MHA_SLIDING) for k in kinds):
            raise NotImplementedError(
                f"attention kinds {kinds} (0=MHA, 1=MLA, 3=per-layer sliding window): tvmkv supports MHA/GQA "
                "layers with or without a per-layer sliding window, or MLA layers"
            )
        layer_windows = None
        if _ATTN_KIND_MHA_SLIDING in kinds:
            if len(sizes) < 6 or sizes[5] <= 0:
                raise ValueError(
                    f"attention kinds {kinds} have a per-layer sliding window layer, but the cache config {sizes} "
                    "gives no positive layer_sliding_window_size (its 6th entry)"
                )
            mine = kinds[first:end] if len(kinds) > 1 else kinds * (end - first)  # this stage's layers
            layer_windows = [sizes[5] if k == _ATTN_KIND_MHA_SLIDING else 0 for k in mine]
        if int(qk_dim) != int(v_dim):
            raise NotImplementedError(f"qk_head_dim {qk_dim} != v_head_dim {v_dim}: tvmkv uses one head_dim")
        if bool(disagg):
            raise NotImplementedError("enable_disaggregation=True: disaggregated serving is not in tvmkv")
        rope_scaling = self.rope_scaling
        if _is_tensor(ext):  # TVM treats anything but a tensor (None, 0) as "no extension factors"
            if int(rope) != 1:
                raise ValueError(f"rope_ext_factors need rope_mode 1 (normal), got {rope} (TVM refuses it too)")
            rope_scaling = rope_scaling.with_ext_factors(ext.numpy())
        if int(rope) not in _ROPE_MODES:
            raise ValueError(f"rope_mode {rope} is not 0 (none), 1 (normal) or 2 (inline)")
        if bool(sliding) and int(rope) != 0 and not rope_scaling.is_default(int(qk_dim)):
            raise NotImplementedError(
                "a cache that supports sliding windows rotates K inline (TVM's rule), and tvmkv's inline RoPE is the "
                f"default RoPE over the whole head, not {rope_scaling.rope_type} "
                f"(rotary_dim {rope_scaling.rotary_dim}): create the cache without support_sliding_window, or without "
                "rope_scaling / rotary_dim"
            )
        dev_type = ref.device.dlpack_device_type()
        if dev_type == 1:
            target = "llvm"
        elif dev_type == 2:
            import tvm

            arch = self.cuda_arch or "sm_" + tvm.cuda(ref.device.index).compute_version.replace(".", "")
            target = cuda_target(arch)
        else:
            raise NotImplementedError(f"device {ref.device}: tvmkv runs on CPU (llvm) and CUDA only")
        return dict(
            num_layers=end - first,
            first_layer=first,
            num_qo_heads=int(hq),
            num_kv_heads=int(hkv),
            head_dim=int(qk_dim),
            page_size=page_size,
            max_batch_size=max_batch,
            max_total_seq_len=max_total,
            prefill_chunk_size=chunk,
            dtype=str(ref.dtype),
            # as TVM's cache: a cache that supports sliding windows rotates K inline (at attention time), never
            # at append, so that keys which slide keep their original positions' rotation
            rope_mode="inline" if bool(sliding) and int(rope) != 0 else _ROPE_MODES[int(rope)],
            rope_scale=float(scale),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            support_sliding_window=bool(sliding),
            layer_windows=layer_windows,
            target=target,
            device_id=int(ref.device.index) if dev_type == 2 else 0,
            num_pages=self.num_pages,
            build_dir=self.build_dir,
            **mla,
        )
