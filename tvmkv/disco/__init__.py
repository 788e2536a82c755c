"""Tensor parallelism on TVM's Disco: one cache shard per worker (docs/layout.md, "Tensor parallelism").

- :mod:`.runtime`: load Disco in any TVM 0.27 install (full wheel or the GPU machine's runtime-only payload);
- :mod:`.worker`: what each worker runs on its shard, and the worker process's entry point;
- :mod:`.session`: the controller: :class:`TvmkvSession` (workers whose death is reported, not fatal) and
  :class:`DiscoKVCache` (the sharded cache, driven from the controller).

Which heads each shard holds is :class:`tvmkv.ShardLayout`; :class:`tvmkv.ShardedKVCache` runs the same
shards in one process.
"""

from .session import DiscoKVCache, TvmkvSession, WorkerDiedError

__all__ = ["DiscoKVCache", "TvmkvSession", "WorkerDiedError"]
