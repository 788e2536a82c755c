"""The tiny Llama sharded over a Disco session: each worker runs the model compiled with
``tensor_parallel=N`` (:func:`tvmkv.relax.llama.compile_llama`) on its weight shard
(:func:`tvmkv.relax.llama.shard_weights`) and its cache shard (:class:`~tvmkv.disco.DiscoKVCache`).

``DiscoLlama.forward(token_ids, cache)`` has the signature of :class:`tvmkv.relax.llama.RelaxLlama`'s:
the token ids go to every worker as bytes, each worker's VM runs ``forward`` (the two all-reduces per
layer inside), and the logits come back from worker 0.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np

LOAD = "tvmkv.disco.load_llama_shard"
TENSOR = "tvmkv.disco.tensor_from_bytes"
LENGTH = "tvmkv.disco.length"


def _device(device_type: str, device_ids: str):
    import tvm
    from tvm_ffi import get_global_func

    if device_type == "cpu":
        return tvm.cpu(0)
    rank = int(get_global_func("runtime.disco.worker_rank")())
    return tvm.cuda(json.loads(device_ids)[rank])


def _load_shard(weights_path: str, config: str, names: str, device_type: str, device_ids: str):
    """``load_llama_shard(...)``: this worker's weights, in ``names`` order, on its device (a list of
    tensors), from the full ``.npz`` of :func:`tvmkv.relax.llama.make_weights` (the error text on failure)."""
    try:
        import tvm
        from tvm_ffi import get_global_func

        from ..relax.llama import param_dtype, shard_weights
        from ..relax.llama_config import LlamaConfig

        cfg = LlamaConfig(**json.loads(config))
        rank, world = (int(get_global_func(f"runtime.disco.{f}")()) for f in ("worker_rank", "world_size"))
        with np.load(weights_path) as npz:
            full = {k: npz[k] for k in npz.files}
        mine = shard_weights(full, cfg, world, rank)
        dev = _device(device_type, device_ids)
        return [tvm.runtime.tensor(mine[n].astype(param_dtype(n, cfg)), dev) for n in json.loads(names)]
    except Exception as err:  # noqa: BLE001  (a raise would kill the worker)
        return f"{type(err).__name__}: {err}"  # LENGTH reports -1; the controller fetches this text


def _tensor(data: bytes, shape, dtype: str, device_type: str, device_ids: str):
    """``tensor_from_bytes(...)``: a tensor of ``shape`` and ``dtype`` holding ``data`` on this worker's device."""
    import tvm

    host = np.frombuffer(data, dtype=dtype).reshape(tuple(shape))
    return tvm.runtime.tensor(host, _device(device_type, device_ids))


def register() -> None:
    import tvm_ffi

    tvm_ffi.register_global_func(LOAD, _load_shard, override=True)
    tvm_ffi.register_global_func(TENSOR, _tensor, override=True)
    tvm_ffi.register_global_func(LENGTH, lambda x: -1 if isinstance(x, str) else len(x), override=True)


class DiscoLlama:
    """The sharded tiny Llama on every worker of ``session``.

    Parameters
    ----------
    session : tvmkv.disco.TvmkvSession
        With a collective backend set up (:meth:`~tvmkv.disco.TvmkvSession.init_gloo` on the CPU).
    library : path
        The model compiled with ``tensor_parallel=session.num_workers`` and exported (``export_library``).
    param_names : list of str
        From :func:`~tvmkv.relax.llama.compile_llama`.
    weights_path : path
        ``.npz`` of the whole model's weights (:func:`~tvmkv.relax.llama.make_weights`); each worker
        reads it and keeps its shard.
    cfg : LlamaConfig
    target : str
        "llvm" (CPU workers) or "cuda" (``device_ids``: each worker's GPU).
    """

    def __init__(self, session, library, param_names, weights_path, cfg, *, target="llvm", device_ids=None):
        import tvm_ffi

        self.session, self.cfg = session, cfg
        if target not in ("llvm", "cpu", "cuda"):
            raise ValueError(f"target={target!r} must be 'llvm' (CPU workers) or 'cuda'")
        ids = list(range(session.num_workers)) if device_ids is None else list(device_ids)
        self._where = ("cpu" if target in ("llvm", "cpu") else "cuda", json.dumps(ids))
        self.module = session.session.load_vm_module(str(library))
        self.params = session.call(
            LOAD, str(weights_path), json.dumps(asdict(cfg)), json.dumps(list(param_names)), *self._where
        )
        lengths = session.call(LENGTH, self.params)
        counts = [int(session.fetch(lengths, w)) for w in range(session.num_workers)]
        del lengths
        for w, count in enumerate(counts):
            if count != len(param_names):
                why = session.fetch(self.params, w)  # the worker's error text
                self.module = self.params = None  # no DRef in the traceback keeps the session from ending
                raise RuntimeError(
                    f"worker {w} could not load its {len(param_names)} weights from {weights_path}: {why}"
                )
        self._forward = self.module["forward"]
        self._shape = tvm_ffi.Shape
        session.holders.add(self)

    def close(self) -> None:
        """Drop the workers' module and weights (:meth:`TvmkvSession.shutdown` does this)."""
        self.module = self.params = self._forward = None

    def __del__(self):
        # dropped without close(): its DRefs go at the session's next call (TvmkvSession.release_later)
        held = [d for d in (getattr(self, name, None) for name in ("module", "params", "_forward")) if d is not None]
        if held:
            self.module = self.params = self._forward = None
            self.session.release_later(*held)

    def create_paged_kv_cache(
        self, *, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window=0
    ):
        """The model's own ``create_paged_kv_cache`` (a model compiled with ``interface="tvm"``) on every
        worker: the ``DRef`` of each worker's cache, a tvmkv shard where
        :meth:`~tvmkv.disco.TvmkvSession.install_tvm_override` ran first (wrap it with
        :meth:`~tvmkv.disco.DiscoKVCache.from_handle`)."""
        from ..relax.llama import tvm_shape_int

        if self._forward is None:
            raise RuntimeError("this DiscoLlama is closed (its session was shut down)")
        sizes = (max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window)
        self.session.check_workers()
        return self.module["create_paged_kv_cache"](*(tvm_shape_int(x) for x in sizes))

    def forward(self, token_ids, cache) -> np.ndarray:
        """Logits ``[n, V]`` float32 of the ``n`` new tokens of ``cache``'s open forward (worker 0's)."""
        if self._forward is None:
            raise RuntimeError("this DiscoLlama is closed (its session was shut down)")
        ids = np.ascontiguousarray(np.asarray(token_ids, np.int32).reshape(1, -1))
        ids_ref = self.session.call(TENSOR, ids.tobytes(), self._shape(ids.shape), "int32", *self._where)
        self.session.check_workers()
        logits = self._forward(ids_ref, cache.handle, self.params)
        del ids_ref
        try:
            self.session.check_errors()  # what the cache's calls inside the model raised on a worker
        except BaseException:
            logits = None  # no DRef in the traceback keeps the session from ending
            raise
        # worker 0 is a thread of this process: its register holds the logits tensor itself, on its device
        # (Disco's copy_from_worker_0 staged 32 MB of logits at a few GB/s, 20-30 ms a step at batch 256)
        return self.session.fetch(logits, 0).numpy()[0]
