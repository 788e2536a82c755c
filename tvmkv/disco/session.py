"""The controller half: a Disco session whose workers run tvmkv, and ``DiscoKVCache``, the sharded cache
driven from the controller (docs/layout.md, "Tensor parallelism").

:func:`start_session` starts ``num_workers`` worker processes (:mod:`.worker`'s entry point) and keeps
their process handles, so that a worker that died is reported as :class:`WorkerDiedError` before the
next call instead of aborting the controller on a broken pipe. :class:`DiscoKVCache` creates one shard
per worker and issues every sequence operation to all of them in one Disco call each; the workers'
page tables then agree without communication (page allocation depends only on the operations), and
:meth:`DiscoKVCache.check_integrity` compares their digests.

Errors: a worker cannot raise to the controller (an exception in a worker function kills it), so each
call's outcome comes back from worker 0 as JSON and is raised here as the same exception; every
worker ran the same call on the same bookkeeping, so the others refused it alike (nothing changed on
any of them: the cache's calls are atomic). A worker that accepted what worker 0 refused shows up in
``check_integrity`` as :class:`~tvmkv.errors.ShardDivergenceError`.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import subprocess
import sys
import weakref
from dataclasses import replace

import numpy as np

from .. import errors
from ..runtime.cache import make_config
from ..runtime.sharding import ShardLayout
from ..target import parse_target
from . import worker as W
from .runtime import load

ENTRYPOINT = "tvmkv.disco"
_pool_ids = itertools.count()
# Sessions not shut down yet. Held here so that the garbage collector never finalizes one: Disco's
# destructor joins the session's worker 0 (a thread of this process) while the finalizing thread holds
# the GIL, and worker 0 may need the GIL to free what it still holds (cache shards), so a collection
# that drops a session's last reference, on another session's worker-0 thread or on any thread, can
# wait forever. A session dropped without shutdown() keeps its workers until the interpreter exits,
# when _shutdown_open_sessions stops it (a session still open then would end in Disco's destructor
# during finalization, which aborts).
_OPEN: set = set()


class WorkerDiedError(errors.TvmkvError, RuntimeError):
    """A Disco worker process exited; the session cannot be used any more (start a new one)."""

    def __init__(self, worker: int, returncode: int):
        self.worker = worker
        self.returncode = returncode
        super().__init__(
            f"Disco worker {worker} exited (return code {returncode}); its output is above. The session is "
            "unusable: drop it and start a new one"
        )


class _Pool:
    """The worker processes of one session (workers 1 .. n-1; worker 0 is a thread of this process)."""

    def __init__(self, num_workers: int, num_groups: int):
        self.num_workers, self.num_groups = num_workers, num_groups
        self.procs: dict = {}
        # this process keeps the read end of each worker's command pipe open too: Disco's destructor then
        # writes its short shutdown message into the pipe even after a worker died (writing to a pipe
        # nobody reads fails, and Disco aborts the process on that failure)
        self.held: list = []

    def __call__(self, worker_id: int):
        """What Disco's process session asks its pool function for: ``Shape([read_fd, write_fd])`` of a
        started worker ``worker_id`` > 0 (None for worker 0)."""
        from tvm_ffi import Shape

        if worker_id == 0:
            return None
        main_read, worker_write = os.pipe()
        worker_read, main_write = os.pipe()
        args = [worker_id, self.num_workers, self.num_groups, worker_read, worker_write]
        self.procs[worker_id] = subprocess.Popen(
            [sys.executable, "-m", ENTRYPOINT, *map(str, args)], pass_fds=(worker_read, worker_write)
        )
        self.held.append(worker_read)
        os.close(worker_write)
        return Shape((main_read, main_write))

    def check(self) -> None:
        for worker, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise WorkerDiedError(worker, code)


class TvmkvSession:
    """A Disco ``ProcessSession`` of ``num_workers`` workers that run :mod:`tvmkv.disco.worker`.

    ``session`` is the Disco session itself (for ``init_ccl``, ``load_vm_module``, tensors); call
    :meth:`check_workers` before a call that must not reach a dead worker (``DiscoKVCache`` does).
    :meth:`shutdown` (or leaving the ``with``) stops the workers.
    """

    def __init__(self, num_workers: int, *, num_groups: int = 1, nccl_plugin=None):
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be a positive int")
        if (
            not isinstance(num_groups, int)
            or isinstance(num_groups, bool)
            or num_groups < 1
            or num_workers % num_groups
        ):
            raise ValueError(f"num_groups={num_groups!r} must be a positive int dividing num_workers={num_workers}")
        disco = load()
        if nccl_plugin is not None:  # before the workers start: they load it from $TVMKV_DISCO_NCCL
            from . import nccl

            nccl.load(nccl_plugin)
        self.nccl = nccl_plugin is not None
        W.register()  # worker 0 is a thread of this process
        from tvm.runtime.disco import _ffi_api
        from tvm_ffi import register_global_func

        self.pool = pool = _Pool(num_workers, num_groups)
        name = self._pool_name = f"tvmkv.disco.process_pool.{next(_pool_ids)}"
        register_global_func(name, lambda n, g, entry: pool, override=True)
        session = disco.ProcessSession.__new__(disco.ProcessSession)
        session.__init_handle_by_constructor__(_ffi_api.SessionProcess, num_workers, num_groups, name, ENTRYPOINT)
        self.session = session
        self.num_workers, self.num_groups = num_workers, num_groups
        self.group_size = num_workers // num_groups  # workers per group: one pipeline stage's shards
        # objects holding DRefs of this session (DiscoKVCache, DiscoLlama): shutdown closes them
        self.holders: weakref.WeakSet = weakref.WeakSet()
        self.ccl = ""  # the collective backend once set up ("gloo")
        self._worker0_thread = None
        # DRefs that finalizers handed over (release_later): released by the next call, on the thread making calls
        self._later: list = []
        _OPEN.add(self)  # until shutdown(): never finalized by the collector, stopped at exit at the latest
        # each worker learns its group (worker.stage()); worker 0 is a thread of this process
        self._worker0_thread = int(self.fetch(self.call(W.SET_GROUPS, num_groups)))

    def install_tvm_override(self, **options) -> None:
        """Make every worker's ``vm.builtin.*`` cache functions tvmkv's: a model compiled against TVM's
        ``PagedKVCache`` and loaded on the workers (``session.load_vm_module``) then creates a tvmkv shard
        on each worker from its own create function, and the controller drives those shards with TVM's
        ``vm.builtin.kv_state_*`` functions through Disco, as MLC-LLM does (or wraps them in
        :meth:`DiscoKVCache.from_handle` for Python errors). ``options`` are
        :class:`~tvmkv.relax.TvmBuiltinOverride`'s (``num_pages``, ``build_dir``, ``cuda_arch``,
        ``rope_scaling``, ``rotary_dim``, ``mla_self_dims``); a worker group's cache holds the layers the
        create call's ``layer_partition`` gives that group. Worker 0 is a thread of this process, so this
        process's functions change too, until :meth:`shutdown`."""
        try:
            text = json.dumps(_plain(options))
        except TypeError as err:
            raise TypeError(f"install_tvm_override options must be plain values: {err}") from None
        result = self.call(W.INSTALL_OVERRIDE, text)
        texts = [str(self.fetch(result, w)) for w in range(self.num_workers)]
        del result  # no DRef in the traceback of what is raised below (see release_later)
        for w, text in enumerate(texts):
            raise_error(text, w)

    def init_nccl(self, device_ids=None) -> None:
        """Create the NCCL communicators (the session was started with ``nccl_plugin``): worker ``i`` on
        ``cuda:device_ids[i]`` (default ``i``), which also becomes its default device."""
        if not self.nccl:
            raise RuntimeError("init_nccl: start the TvmkvSession with nccl_plugin=<libtvm_disco_nccl.so>")
        ids = list(range(self.num_workers)) if device_ids is None else [int(d) for d in device_ids]
        if len(ids) != self.num_workers:
            raise ValueError(f"device_ids={ids} must name one GPU per worker ({self.num_workers})")
        self.check_workers()
        self.session.init_ccl("nccl", *ids)
        self.ccl = "nccl"

    def init_gloo(self, port: int | None = None) -> None:
        """Set up :mod:`tvmkv.disco.gloo`, the CPU collective backend, on every worker (once per session;
        ``port``: a free TCP port on this host, default one the OS picks)."""
        from . import gloo

        if self.pool.num_groups != 1:
            raise NotImplementedError(
                f"the gloo backend serves one group of workers; this session has {self.pool.num_groups} groups"
            )
        if port is None:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        result = self.call(gloo.INIT, f"tcp://127.0.0.1:{port}")
        problems = [str(self.fetch(result, w)) for w in range(self.num_workers)]
        del result  # no DRef in the traceback of what is raised below (see release_later)
        for w, problem in enumerate(problems):
            if problem:
                raise RuntimeError(f"worker {w} could not join the gloo group: {problem}")
        self.ccl = "gloo"

    def check_errors(self) -> None:
        """Raise, on this process, what a cache call made on the workers by a model or through Disco
        (``vm.builtin.*`` after :meth:`install_tvm_override`, the ``tvmkv.*`` globals) raised there since the
        last check: a worker keeps the first such error instead of raising it, which would end the worker
        (and worker 0's this process). The cache is as it was before the failed call."""
        ref = self.call(W.TAKE_ERROR)
        texts = [str(self.fetch(ref, w)) for w in range(self.num_workers)]
        del ref  # no DRef in the traceback of what is raised below (see release_later)
        for w, text in enumerate(texts):
            raise_error(text, w)

    def check_workers(self) -> None:
        """Raise :class:`WorkerDiedError` when a worker process has exited."""
        if self.session is None:
            raise RuntimeError("this session was shut down; start a new TvmkvSession")
        self.pool.check()

    def call(self, name: str, *args):
        """Call global function ``name`` on every worker (after :meth:`check_workers`); returns the DRef.
        The DRefs handed to :meth:`release_later` since the last call are released first, here."""
        self.check_workers()
        if self._later:
            self._release_held()
        return self.session.get_global_func(name)(*args)

    def release_later(self, *drefs) -> None:
        """Keep ``drefs`` until this session's next :meth:`call` (or :meth:`shutdown`), which releases them.

        For finalizers (``__del__``) of objects that hold DRefs. Releasing a DRef sends a message to every
        worker, and Disco's channels take messages from one thread at a time. The collector runs finalizers
        on whichever thread allocates: worker 0's (a thread of this process, running a worker function
        while the controller sends its next call) or any other. A DRef released there can corrupt the
        controller's message in flight, and the next reply never comes (the controller hangs). Handed
        here, the DRef is released on the thread that makes calls, between two of them."""
        if self.session is not None:  # (after shutdown they go now: no call would come to release them)
            self._later.extend(drefs)  # one list operation: atomic under the GIL, whichever thread runs it

    def _release_held(self) -> None:
        while self._later:
            self._later.pop()

    def fetch(self, dref, worker: int = 0):
        """The value ``dref`` holds on ``worker`` (waits for it); a worker that died meanwhile raises
        :class:`WorkerDiedError`."""
        self.check_workers()
        try:
            return dref.debug_get_from_remote(worker)
        except Exception:
            import time

            for _ in range(50):  # its pipe closed as it exited: let the exit show
                if any(p.poll() is not None for p in self.pool.procs.values()):
                    break
                time.sleep(0.01)
            self.pool.check()
            raise

    def shutdown(self) -> None:
        """Stop the workers; the session's ``DiscoKVCache`` and ``DiscoLlama`` objects are closed with it.
        Drop other ``DRef`` objects of the session (tensors you made) first: Disco ends a session when its
        last reference goes, and one that outlives this call ends at interpreter exit."""
        if self.session is None:
            return
        import gc

        for holder in list(self.holders):
            holder.close()  # drops its DRefs: Disco ends the session when the last one goes
        self._release_held()
        if self.ccl == "gloo":
            from . import gloo

            try:
                self.fetch(self.call(gloo.FINALIZE))
            except WorkerDiedError:
                pass  # a dead worker's group goes with it; stop the others below

        # Disco's Session caches the DPackedFuncs of its helper methods (empty, ...), each of which holds the
        # session: a cycle through objects the collector does not traverse; drop it
        cached = getattr(self.session, "_cache", None)
        if isinstance(cached, dict):
            cached.clear()
        gc.collect()  # DRefs held only by reference cycles (tracebacks) keep the session alive
        self._release_held()  # what the collection's finalizers handed over
        # worker 0 is a thread of this process that frees the registers of dropped DRefs, Python objects
        # among them (the cache shards), which takes the GIL; Disco's destructor joins that thread while
        # this thread holds the GIL, so let it finish its queue first (else the two wait on each other)
        self.session.sync_worker_0()
        self.session = None  # Disco's destructor tells the workers to stop and joins worker 0
        _OPEN.discard(self)
        if self._worker0_thread is not None:
            W.forget_thread(self._worker0_thread)  # worker 0's state in this process (its override too)
        import tvm_ffi

        tvm_ffi.remove_global_func(self._pool_name)
        # the held pipe ends stay open until this process exits: a session that outlives this call (a DRef
        # still held) may still write its shutdown message to a dead worker's pipe at exit
        try:
            for proc in self.pool.procs.values():
                proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            import warnings

            warnings.warn(
                "Disco workers still run after TvmkvSession.shutdown(): a DiscoKVCache or DRef of the session is "
                "still referenced; the workers stop when it goes",
                RuntimeWarning,
                stacklevel=2,
            )

    def __enter__(self) -> TvmkvSession:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


@atexit.register
def _shutdown_open_sessions() -> None:
    for session in list(_OPEN):
        try:
            session.shutdown()
        except Exception as err:  # the others must still stop: an open one would abort at finalization
            print(f"tvmkv.disco: shutting a session down at exit failed: {err!r}", file=sys.stderr)


_ERROR_TYPES = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        RuntimeError,
        NotImplementedError,
        MemoryError,
        errors.ForwardStateError,
        errors.IntegrityError,
    )
}


def raise_error(text: str, worker: int = 0) -> None:
    """Raise the exception a worker encoded (:func:`tvmkv.disco.worker.encode_error`); no-op for ""."""
    if not text:
        return
    e = json.loads(text)
    kind, message = e["type"], e["message"]
    err: Exception
    if kind == "OutOfPagesError":
        err = errors.OutOfPagesError(e["needed"], e["available"], e.get("what", "this forward"))
    elif kind == "SequenceSwappedError":
        err = errors.SequenceSwappedError(e["seq_id"])
    elif kind in _ERROR_TYPES:
        err = _ERROR_TYPES[kind](message)
    else:
        err = RuntimeError(f"worker {worker} raised {kind}: {message}")
    try:
        raise err
    finally:
        del err  # no cycle through this frame: the caller's DRefs (and the session) go with the exception


class DiscoKVCache:
    """A tensor-parallel cache: one :class:`~tvmkv.PagedAttentionKVCache` shard per Disco worker.

    Parameters
    ----------
    session : TvmkvSession
        Its workers each hold one shard (``ShardLayout(num_qo_heads, num_kv_heads, session.group_size)``
        within each worker group).
    num_layers, num_qo_heads, num_kv_heads, head_dim : int
        The whole model's shape.
    device_ids : list of int, optional
        cuda: the GPU of each worker (default ``0 .. num_workers - 1``, as ``init_ccl("nccl", *ids)``).
    layer_partition : list of int, optional
        A session of several worker groups (pipeline stages): the layer boundaries, one more than the
        groups (TVM's ``layer_indptr``, e.g. ``[0, 2, 4]``); group ``g``'s shards hold layers
        ``[layer_partition[g], layer_partition[g + 1])`` under their model ids. Default: one group, all layers.
    **options
        The cache's keyword options, for every shard (``kv_scales`` and ``layer_windows`` for the whole model).

    ``handle`` is the ``DRef`` of the shards: pass it to a Relax VM's functions in place of a cache.
    Sequence operations are those of :class:`~tvmkv.PagedAttentionKVCache` and raise what it raises;
    ``calls`` issues several in one Disco call (one per step: ``[("end_forward", ()), ("begin_forward",
    (ids, lengths))]``). :meth:`from_handle` wraps the shards a model created through TVM's interface.
    """

    def __init__(
        self,
        session: TvmkvSession,
        num_layers,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        *,
        device_ids=None,
        layer_partition=None,
        **options,
    ):
        self.session = session
        self.layout = ShardLayout(num_qo_heads, num_kv_heads, session.group_size)
        self.layer_partition = _partition(layer_partition, num_layers, session.num_groups)
        if device_ids is None:
            device_ids = list(range(session.num_workers))
        device_ids = list(device_ids)
        if len(device_ids) != session.num_workers or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in device_ids
        ):
            raise ValueError(
                f"device_ids={device_ids} must name one GPU per worker ({session.num_workers} ints >= 0, cuda:N)"
            )
        if options.get("memory_fraction") is not None:
            raise NotImplementedError(
                "memory_fraction on a DiscoKVCache: the workers' free memory may differ; size the pool with num_pages"
            )
        if options.get("first_layer"):
            raise ValueError("first_layer on a DiscoKVCache: give the stages' layers as layer_partition")
        # the whole model's configuration, from the shards' (validates the options here, before any worker)
        own = {k: v for k, v in options.items() if k not in ("kv_scales", "calibrate", "build_dir")}
        shard = make_config(num_layers, self.layout.qo_per_shard, self.layout.kv_per_shard, head_dim, **own)
        self.config = replace(shard, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads)
        if options.get("kv_scales") is not None:
            options["kv_scales"] = np.asarray(options["kv_scales"], np.float32).tolist()
        kind, arch = parse_target(options.get("target", "llvm"))
        options["target"] = {"kind": kind, **({"arch": arch} if arch else {})}  # JSON, whatever form was given
        options = {k: str(v) if isinstance(v, os.PathLike) else v for k, v in options.items()}
        try:
            spec = json.dumps(
                {
                    "shape": [num_layers, num_qo_heads, num_kv_heads, head_dim],
                    "options": _plain(options),
                    "device_ids": device_ids,
                    "layer_partition": self.layer_partition,
                }
            )
        except TypeError as err:
            raise TypeError(f"cache options must be plain values (numbers, strings, lists, dicts): {err}") from None
        self.handle = session.call(W.CREATE, spec)
        problems = session.call(W.ERROR)
        texts = [str(session.fetch(problems, w)) for w in range(session.num_workers)]
        del problems
        try:
            for w, text in enumerate(texts):  # a shard that failed on any worker fails the whole cache
                raise_error(text, w)
        except BaseException:
            self.handle = None  # no DRef in the traceback keeps the session from ending
            raise
        session.holders.add(self)

    @classmethod
    def from_handle(cls, session: TvmkvSession, handle, num_qo_heads, num_kv_heads) -> DiscoKVCache:
        """The shards ``handle`` (a ``DRef``) holds, made on the workers by a model's own create function
        through TVM's interface (:meth:`TvmkvSession.install_tvm_override`), as a ``DiscoKVCache``: its
        sequence operations raise Python errors on this process instead of ending a worker, and its
        queries, ``check_integrity`` and ``debug_get_kv`` work as on a cache made here. ``num_qo_heads`` /
        ``num_kv_heads`` are the whole model's; each worker's shard must have the heads
        :class:`~tvmkv.ShardLayout` gives its rank. A creation that failed on a worker is raised here."""
        self = cls.__new__(cls)
        self.session, self.handle = session, handle
        described = session.call(W.DESCRIBE, handle)
        texts = [str(session.fetch(described, w)) for w in range(session.num_workers)]
        del described
        try:
            self._adopt(texts, num_qo_heads, num_kv_heads)
        except BaseException:
            self.handle = handle = None  # no DRef in the traceback keeps the session from ending
            raise
        session.holders.add(self)
        return self

    def _adopt(self, texts: list, num_qo_heads, num_kv_heads) -> None:
        """``from_handle``'s checks of the workers' descriptions; sets the layout and configuration."""
        session = self.session
        self.layout = lay = ShardLayout(num_qo_heads, num_kv_heads, session.group_size)
        configs = []
        for w, text in enumerate(texts):
            answer = json.loads(text)
            if "config" not in answer:
                raise_error(text, w)
            configs.append(answer["config"])
        stages = sorted({(c["first_layer"], c["first_layer"] + c["num_layers"]) for c in configs})
        self.layer_partition = [0] + [end for _, end in stages]
        for w, c in enumerate(configs):
            g = w // session.group_size
            want = (lay.qo_per_shard, lay.kv_per_shard, *self.layer_partition[g : g + 2])
            have = (c["num_qo_heads"], c["num_kv_heads"], c["first_layer"], c["first_layer"] + c["num_layers"])
            if have != want or len(stages) != session.num_groups:
                raise ValueError(
                    f"worker {w} holds {have[0]} query / {have[1]} KV heads of layers [{have[2]}, {have[3]}) where "
                    f"{num_qo_heads} / {num_kv_heads} heads over {session.group_size} shards per group and the "
                    f"groups' layers {stages} give {want[0]} / {want[1]} of layers [{want[2]}, {want[3]}): was the "
                    f"model compiled for this session (tensor_parallel={session.group_size}, "
                    f"{session.num_groups} stages)?"
                )
        from ..config import CacheConfig

        as_tuples = {k: tuple(configs[0][k] or ()) for k in ("layer_windows", "mla_self_dims")}
        shard = CacheConfig(**{**configs[0], **as_tuples})  # worker 0's, its RoPE the plain one
        windows: tuple = ()
        if any(c["layer_windows"] for c in configs):  # each group's first worker's, in layer order
            heads = [configs[g * session.group_size] for g in range(session.num_groups)]
            windows = tuple(x for c in heads for x in (c["layer_windows"] or [0] * c["num_layers"]))
        self.config = replace(
            shard,
            num_layers=self.layer_partition[-1],
            first_layer=0,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            layer_windows=windows,
        )

    def close(self) -> None:
        """Drop the shards (:meth:`TvmkvSession.shutdown` does this); the cache cannot be used after."""
        self.handle = None

    def __del__(self):
        # a cache dropped without close() frees its shards at the session's next call, not on the thread that
        # happens to finalize it (TvmkvSession.release_later says why)
        handle = getattr(self, "handle", None)
        if handle is not None:
            self.handle = None
            self.session.release_later(handle)

    def _handle(self):
        if self.handle is None:
            raise RuntimeError("this DiscoKVCache is closed (its session was shut down); create a new one")
        return self.handle

    # ------------------------------------------------------------------ calls
    def calls(self, calls) -> None:
        """Issue ``calls`` (``(method, args)`` or ``(method, args, kwargs)``) to every shard in one Disco call;
        the first that worker 0 refuses is raised (the calls before it ran, on every shard)."""
        packed = []
        if isinstance(calls, (str, bytes)) or not hasattr(calls, "__iter__"):
            raise TypeError(f"calls={calls!r} must be a list of (method, args) or (method, args, kwargs) tuples")
        for c in calls:
            if not isinstance(c, (list, tuple)) or len(c) not in (2, 3) or not isinstance(c[1], (list, tuple)):
                raise TypeError(f"{c!r} is not a (method, args) or (method, args, kwargs) tuple, args a tuple")
            method, args, kwargs = (c[0], c[1], c[2] if len(c) > 2 else {})
            if method not in W.METHODS:
                raise ValueError(f"{method!r} is not a sequence operation; one of {sorted(W.METHODS)}")
            packed.append([method, _plain(args), _plain(kwargs)])
        try:
            text = json.dumps(packed)
        except TypeError as err:
            raise TypeError(f"arguments must be ints, lists of ints or None: {err}") from None
        raise_error(self.session.fetch(self.session.call(W.APPLY, self._handle(), text)))

    def add_sequence(self, seq_id) -> None:
        self.calls([("add_sequence", (seq_id,))])

    def remove_sequence(self, seq_id) -> None:
        self.calls([("remove_sequence", (seq_id,))])

    def fork_sequence(self, parent_seq_id, child_seq_id, fork_pos=-1) -> None:
        self.calls([("fork_sequence", (parent_seq_id, child_seq_id, fork_pos))])

    def pop_n(self, seq_id, n) -> None:
        self.calls([("pop_n", (seq_id, n))])

    def enable_sliding_window_for_seq(self, seq_id, sliding_window_size, attn_sink_size=0) -> None:
        self.calls([("enable_sliding_window_for_seq", (seq_id, sliding_window_size, attn_sink_size))])

    def begin_forward(self, seq_ids, append_lengths, token_tree_parent_ptr=None) -> None:
        self.calls([("begin_forward", (seq_ids, append_lengths, token_tree_parent_ptr))])

    def end_forward(self) -> None:
        self.calls([("end_forward", ())])

    def commit_accepted_token_tree_nodes(self, seq_ids, leaf_indices, *, scope="tree") -> None:
        self.calls([("commit_accepted_token_tree_nodes", (seq_ids, leaf_indices), {"scope": scope})])

    def clear(self) -> None:
        self.calls([("clear", ())])

    def swap_out(self, seq_ids, **options) -> None:
        self.calls([("swap_out", (seq_ids,), options)])

    def swap_in(self, seq_ids, **options) -> None:
        self.calls([("swap_in", (seq_ids,), options)])

    # ------------------------------------------------------------------ reads (worker 0 answers)
    def _query(self, method: str, *args):
        text = str(self.session.fetch(self.session.call(W.QUERY, self._handle(), method, json.dumps(_plain(args)))))
        answer = json.loads(text)
        if "value" not in answer:
            raise_error(text)
        return answer["value"]

    def sequence_ids(self) -> list:
        return self._query("sequence_ids")

    def sequence_length(self, seq_id) -> int:
        return self._query("sequence_length", seq_id)

    def num_available_pages(self) -> int:
        return self._query("num_available_pages")

    def total_sequence_length(self) -> int:
        return self._query("total_sequence_length")

    def is_empty(self) -> bool:
        return self._query("is_empty")

    def num_pages_needed(self, seq_id, num_tokens) -> int:
        return self._query("num_pages_needed", seq_id, num_tokens)

    def is_swapped(self, seq_id) -> bool:
        return self._query("is_swapped", seq_id)

    def swapped_sequence_ids(self) -> list:
        return self._query("swapped_sequence_ids")

    def reserved_sequence_ids(self) -> list:
        return self._query("reserved_sequence_ids")

    def num_pages_released_by(self, seq_ids) -> int:
        return self._query("num_pages_released_by", seq_ids)

    def require_no_forward(self, what: str) -> None:
        self._query("require_no_forward", what)

    def digests(self) -> list:
        """Every worker's :meth:`~tvmkv.PagedAttentionKVCache.table_digest`, in worker order."""
        d = self.session.call(W.DIGEST, self._handle())
        return [str(self.session.fetch(d, w)) for w in range(self.session.num_workers)]

    def check_integrity(self) -> None:
        """Each shard's own integrity check, then that all shards' bookkeeping digests alike:
        :class:`~tvmkv.errors.ShardDivergenceError` names the first worker that differs."""
        digests = self.digests()
        for w, d in enumerate(digests):
            if d.startswith("error: "):
                raise errors.IntegrityError(f"worker {w}: {json.loads(d[7:])['message']}")
        for w, d in enumerate(digests[1:], 1):
            if d != digests[0]:
                raise errors.ShardDivergenceError(w, "its page tables digest differently from worker 0's")

    def debug_get_kv(self, seq_id, start_pos=0, end_pos=None):
        """K and V of tokens ``[start_pos, end_pos)`` of ``seq_id``, every layer and KV head of the model,
        float32 NumPy ``[num_layers, n, H_kv, D]`` each, gathered from the workers (a replicated head from the
        first worker of its stage holding it); the range is checked as the cache checks it."""
        from ..runtime.sequences import check_id

        seq_id = check_id(seq_id)
        length = self.sequence_length(seq_id)  # raises for an unknown or swapped-out sequence
        end = length if end_pos is None else end_pos
        for name, v in (("start_pos", start_pos), ("end_pos", end)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise TypeError(f"{name}={v!r} must be an int")
        if not 0 <= start_pos <= end <= length:
            raise ValueError(f"debug_get_kv range [{start_pos}, {end}) is outside sequence {seq_id} of length {length}")
        lay, cfg = self.layout, self.config
        shape = (cfg.num_layers, int(end - start_pos), lay.num_kv_heads, cfg.head_dim)
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        if end == start_pos:
            return k, v
        ref = self.session.call(W.GET_KV, self._handle(), seq_id, int(start_pos), int(end))
        parts = [self.session.fetch(ref, w).numpy() for w in range(self.session.num_workers)]
        if any(p.ndim != 5 for p in parts):
            raise RuntimeError(f"debug_get_kv({seq_id}, {start_pos}, {end}) failed on a worker")
        bounds, size = self.layer_partition, self.session.group_size
        for g in range(len(bounds) - 1):  # each stage's layers from that worker group
            layers = slice(bounds[g], bounds[g + 1])
            for h in range(lay.num_kv_heads):
                shard = lay.shard_of_kv_head(h)
                part, j = parts[g * size + shard], h - lay.kv_heads(shard).start
                k[layers, :, h] = part[0][:, :, j]
                v[layers, :, h] = part[1][:, :, j]
        return k, v


def _partition(layer_partition, num_layers: int, num_groups: int) -> list:
    """The checked layer boundaries of the session's worker groups (``[0, num_layers]`` for one group)."""
    if layer_partition is None:
        if num_groups != 1:
            raise ValueError(
                f"the session has {num_groups} worker groups (pipeline stages): pass layer_partition, "
                f"{num_groups + 1} layer boundaries from 0 to {num_layers} (e.g. TVM's layer_indptr)"
            )
        return [0, num_layers]
    try:
        bounds = [int(x) for x in layer_partition]
    except (TypeError, ValueError):
        raise TypeError(f"layer_partition={layer_partition!r} must be a list of ints") from None
    if (
        len(bounds) != num_groups + 1
        or bounds[0] != 0
        or bounds[-1] != num_layers
        or any(b <= a for a, b in zip(bounds, bounds[1:]))
    ):
        raise ValueError(
            f"layer_partition={bounds} must be {num_groups + 1} increasing layer boundaries from 0 to {num_layers}, "
            f"one stage per worker group of the session ({num_groups})"
        )
    return bounds


def _plain(x):
    """Arguments as JSON-ready Python values: NumPy / torch scalars (0-d arrays too) become Python
    scalars, arrays and other iterables lists; the cache's own checks then judge them."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if getattr(x, "ndim", None) == 0 and hasattr(x, "item"):  # np.int64(3), np.array(3), torch.tensor(3)
        return x.item()
    if isinstance(x, (list, tuple)) or (hasattr(x, "__iter__") and not isinstance(x, (str, bytes))):
        return [_plain(v) for v in x]
    return x
