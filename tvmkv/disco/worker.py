"""The worker half of a tensor-parallel cache on Disco: the functions every worker runs on its own shard,
and the worker process's entry point.

Disco starts workers ``1 .. n-1`` as ``python -m tvmkv.disco <worker_id> <num_workers>
<num_groups> <read_fd> <write_fd>``; worker 0 is a thread of the controller process, which imports
this module too. Each worker's shard is an ordinary :class:`~tvmkv.PagedAttentionKVCache` over the
heads :class:`~tvmkv.ShardLayout` gives its rank; the controller holds a ``DRef`` to it and passes
that to every later call (and to a Relax VM's functions, which then see the worker's own cache).

An exception escaping a Disco worker function kills that worker and aborts the controller, so every
function here catches what the cache raises and returns it as a JSON string (``""`` when the call
succeeded), which the controller turns back into the same exception (:mod:`.session`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import asdict
from typing import Callable

import numpy as np

# the global function names (the controller calls them by these names)
CREATE = "tvmkv.disco.create_shard"
APPLY = "tvmkv.disco.apply"
DIGEST = "tvmkv.disco.digest"
GET_KV = "tvmkv.disco.debug_get_kv"
ERROR = "tvmkv.disco.creation_error"
QUERY = "tvmkv.disco.query"
DESCRIBE = "tvmkv.disco.describe"
SET_GROUPS = "tvmkv.disco.set_groups"
INSTALL_OVERRIDE = "tvmkv.disco.install_override"
TAKE_ERROR = "tvmkv.disco.take_error"

# the cache methods APPLY may call: the sequence operations, issued to every worker alike
METHODS = frozenset(
    {
        "add_sequence",
        "remove_sequence",
        "fork_sequence",
        "pop_n",
        "enable_sliding_window_for_seq",
        "begin_forward",
        "end_forward",
        "commit_accepted_token_tree_nodes",
        "clear",
        "swap_out",
        "swap_in",
    }
)

# the cache queries QUERY answers (worker 0's answer is the controller's)
QUERIES = frozenset(
    {
        "sequence_ids",
        "sequence_length",
        "num_available_pages",
        "total_sequence_length",
        "is_empty",
        "num_pages_needed",
        "num_pages_released_by",
        "is_swapped",
        "swapped_sequence_ids",
        "reserved_sequence_ids",
        "require_no_forward",
    }
)

_creation_errors: dict = {}  # worker thread -> the JSON error of its last failed create_shard
# worker thread -> its session's number of worker groups (pipeline stages), set by set_groups. Worker 0 of
# every session is a thread of the controller process, the others the main thread of their own process.
# (Keyed by thread ident: Disco's threads are C++ threads, whose Python thread state, threading.local's
# data with it, goes after each call into Python.)
_groups: dict = {}
# the TvmBuiltinOverride installed in this process while some worker thread uses it, and each such thread's
# own (its session's options, which its create calls take)
_installed = None
_overrides: dict = {}
# worker thread -> the JSON error of the first vm.builtin call on a tvmkv cache that failed on it since the
# controller last took it (a raise would end the worker): keyed by thread, so that sessions sharing this
# process (each one's worker 0 is a thread of the controller) never see each other's
_pending: dict = {}


def stage():
    """``(group, num_groups, rank_in_group, group_size)`` of the Disco worker this thread runs, or None outside
    a tvmkv Disco worker. Disco numbers workers group by group: worker ``w`` is rank ``w % group_size`` of
    group ``w // group_size``; a group is one pipeline stage, its workers the stage's tensor-parallel shards."""
    groups = _groups.get(threading.get_ident())
    if groups is None:
        return None
    rank, world = _rank()
    size = world // groups
    return rank // size, groups, rank % size, size


def _set_groups(num_groups: int) -> int:
    """``set_groups(num_groups)``: record this worker's session layout (:func:`stage`); returns the thread's
    ident, for :func:`forget_thread` when the session ends."""
    _groups[threading.get_ident()] = int(num_groups)
    return threading.get_ident()


def forget_thread(ident: int) -> None:
    """Drop what this module keeps for thread ``ident`` (a session's worker 0, at its shutdown): its group
    count, an error it left, its override."""
    _groups.pop(ident, None)
    _pending.pop(ident, None)
    _creation_errors.pop(ident, None)
    release_override(ident)


def encode_error(err: BaseException) -> str:
    """A caught exception as the JSON the controller decodes (:func:`tvmkv.disco.session.raise_error`)."""
    fields = {"type": type(err).__name__, "message": str(err.args[0]) if len(err.args) == 1 else str(err)}
    for name in ("needed", "available", "what", "seq_id"):  # OutOfPagesError, SequenceSwappedError
        if hasattr(err, name):
            fields[name] = getattr(err, name)
    return json.dumps(fields)


def _rank() -> tuple:
    from tvm_ffi import get_global_func

    return int(get_global_func("runtime.disco.worker_rank")()), int(get_global_func("runtime.disco.world_size")())


def _create(spec: str):
    """``create_shard(spec)``: this worker's cache, or None (then ``creation_error()`` says why).

    ``spec`` is JSON: ``shape`` (num_layers, num_qo_heads, num_kv_heads, head_dim of the whole
    model), ``options`` (the cache's keyword options; ``kv_scales`` for the whole model) and
    ``device_ids`` (the GPU of each worker, on cuda)."""
    try:
        from ..runtime.cache import PagedAttentionKVCache
        from ..runtime.sharding import ShardLayout

        rank = _rank()[0]
        _creation_errors.pop(threading.get_ident(), None)
        group, _, shard, size = stage() or (0, 1, *_rank())
        s = json.loads(spec)
        layers, hq, hkv, head_dim = s["shape"]
        layout = ShardLayout(hq, hkv, size)
        options = dict(s["options"])
        partition = s.get("layer_partition") or [0, layers]
        first, end = partition[group], partition[group + 1]
        if options.get("kv_scales") is not None:
            scales = np.asarray(options["kv_scales"], np.float32)
            options["kv_scales"] = layout.shard_kv_scales(scales[first:end] if scales.ndim == 3 else scales, shard)
        if options.get("layer_windows") is not None:
            options["layer_windows"] = list(options["layer_windows"])[first:end]
        if options["target"]["kind"] == "cuda":  # the controller sends the target as {"kind", "arch"}
            options["device_id"] = s["device_ids"][rank]
        return PagedAttentionKVCache(
            end - first, layout.qo_per_shard, layout.kv_per_shard, head_dim, first_layer=first, **options
        )
    except Exception as err:  # noqa: BLE001  (a raise here would kill the worker)
        _creation_errors[threading.get_ident()] = encode_error(err)
        return None


def _creation_error() -> str:
    """``creation_error()``: why this worker's last ``create_shard`` returned None ("" if it did not)."""
    try:
        return _creation_errors.get(threading.get_ident(), "")
    except Exception as err:  # noqa: BLE001
        return encode_error(err)


def _apply(cache, calls: str) -> str:
    """``apply(cache, calls)``: run the JSON list of ``[method, args, kwargs]`` calls on this worker's
    cache in order, stopping at the first that raises; returns its error as JSON, or "" when all ran."""
    try:
        for method, args, kwargs in json.loads(calls):
            if method not in METHODS:
                raise ValueError(f"{method!r} is not a sequence operation a worker runs; one of {sorted(METHODS)}")
            getattr(cache, method)(*args, **kwargs)
        return ""
    except Exception as err:  # noqa: BLE001
        return encode_error(err)


def _query(cache, method: str, args: str) -> str:
    """``query(cache, method, args)``: ``{"value": ...}`` of the cache query ``method`` (JSON args), or
    the error it raised."""
    try:
        if method not in QUERIES:
            raise ValueError(f"{method!r} is not a query a worker answers; one of {sorted(QUERIES)}")
        return json.dumps({"value": getattr(cache, method)(*json.loads(args))})
    except Exception as err:  # noqa: BLE001
        return encode_error(err)


def _describe(cache) -> str:
    """``describe(cache)``: the JSON ``{"config": ...}`` of this worker's cache (its configuration's plain
    fields), or the error saying why the object is not a tvmkv cache (a failed drop-in creation)."""
    try:
        from ..runtime.cache import PagedAttentionKVCache

        if not isinstance(cache, PagedAttentionKVCache):
            why = _take_error()
            if why:  # the model's create call failed on this worker
                return why
            raise TypeError(f"the worker holds a {type(cache).__name__}, not a tvmkv.PagedAttentionKVCache")
        fields = asdict(cache.config)
        fields.pop("rope_scaling")  # a RopeScaling: the controller's copy keeps the plain RoPE's fields only
        return json.dumps({"config": fields})
    except Exception as err:  # noqa: BLE001
        return encode_error(err)


def _install_override(options: str) -> str:
    """``install_override(options)``: make this process's ``vm.builtin.*`` cache functions tvmkv's
    (:class:`tvmkv.relax.TvmBuiltinOverride`); the create calls this worker thread makes take the JSON
    ``options`` (another session's worker 0 in the same process keeps its own). A call on a tvmkv cache that
    fails (a create among them) returns None instead of raising, which would end the worker (worker 0: the
    controller process); its error waits in :func:`_take_error`."""
    global _installed
    try:
        from ..relax.builtins import TvmBuiltinOverride

        mine = TvmBuiltinOverride(**json.loads(options))
        if _installed is None:
            _installed = TvmBuiltinOverride(select=lambda: _overrides.get(threading.get_ident())).install()
        _overrides[threading.get_ident()] = mine
        return ""
    except Exception as err:  # noqa: BLE001
        return encode_error(err)


def release_override(ident: int) -> None:
    """Thread ``ident`` (a session's worker 0, at its shutdown) no longer uses the override; the last thread
    to go gives this process back the ``vm.builtin.*`` functions it had before."""
    global _installed
    if _overrides.pop(ident, None) is not None and not _overrides and _installed is not None:
        _installed.uninstall()
        _installed = None


def _record_error(name: str, err: BaseException) -> None:
    """On a worker thread: keep the first failed call's error (later ones usually follow from it) until the
    controller takes it. Elsewhere (the controller's own calls): raise it."""
    if threading.get_ident() not in _groups:
        raise err
    fields = json.loads(encode_error(err))
    fields["message"] = f"{name} on worker {_rank()[0]}: {fields['message']}"
    _pending.setdefault(threading.get_ident(), json.dumps(fields))


def _take_error() -> str:
    """``take_error()``: the error a ``vm.builtin`` call on this worker left (:func:`_record_error`), "" if none;
    cleared by taking it."""
    try:
        return _pending.pop(threading.get_ident(), "")
    except Exception as err:  # noqa: BLE001
        return encode_error(err)


def _digest(cache) -> str:
    """``digest(cache)``: :meth:`~tvmkv.PagedAttentionKVCache.table_digest` after the cache's own
    integrity check (``"error: ..."`` when that fails)."""
    try:
        cache.check_integrity()
        return cache.table_digest()
    except Exception as err:  # noqa: BLE001
        return "error: " + encode_error(err)


def _get_kv(cache, seq_id: int, start: int, end: int):
    """``debug_get_kv(cache, seq_id, start, end)``: this shard's K and V of those tokens as one float32
    CPU tensor ``[2, num_layers, n, kv_per_shard, D]`` (empty ``[0]`` when the read fails)."""
    import tvm

    try:
        k, v = cache.debug_get_kv(seq_id, start, end)
        return tvm.runtime.tensor(np.stack([k, v]).astype(np.float32))
    except Exception:  # noqa: BLE001
        return tvm.runtime.tensor(np.zeros(0, np.float32))


def register() -> None:
    """Register the worker functions and tvmkv's Relax globals in this process (idempotent)."""
    import tvm_ffi

    from ..relax.builtins import register as register_relax
    from ..relax.builtins import route_worker_calls
    from . import gloo, model

    funcs: dict[str, Callable] = {
        CREATE: _create,
        APPLY: _apply,
        QUERY: _query,
        DIGEST: _digest,
        GET_KV: _get_kv,
        ERROR: _creation_error,
        DESCRIBE: _describe,
        SET_GROUPS: _set_groups,
        INSTALL_OVERRIDE: _install_override,
        TAKE_ERROR: _take_error,
    }
    for name, func in funcs.items():
        tvm_ffi.register_global_func(name, func, override=True)
    register_relax()
    route_worker_calls(_record_error, stage)  # a raise in a worker ends it: its errors wait for take_error
    gloo.register()
    model.register()


def main(argv=None) -> None:
    """Entry point of a worker process: load Disco, register the functions, serve the controller."""
    from ..payload import bootstrap

    bootstrap()  # the GPU machine's runtime-only TVM: its CUDA backend first
    from .runtime import load

    load()
    from . import nccl

    if os.environ.get(nccl.ENV):
        nccl.load()  # the controller started with an NCCL plugin: runtime.disco.nccl.* here too
    register()
    for name in filter(None, os.environ.get("TVMKV_DISCO_IMPORTS", "").split(",")):
        __import__(name)  # e.g. a collective backend's module
    argv = sys.argv[1:] if argv is None else argv
    worker_id, num_workers, num_groups, reader, writer = (int(x) for x in argv)
    from tvm_ffi import get_global_func

    try:
        get_global_func("runtime.disco.WorkerProcess")(worker_id, num_workers, num_groups, reader, writer)
    except (OSError, KeyboardInterrupt):
        pass


if __name__ == "__main__":
    main()
