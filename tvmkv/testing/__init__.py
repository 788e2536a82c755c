"""What the tests, ``python -m tvmkv replay`` and ``bench/soak.py`` share (never imported by the library).

- :mod:`tvmkv.testing.caches`: :func:`make_cache`, the one cache factory (options: :func:`cache_kwargs`),
  and :func:`make_sharded_cache` (its tensor-parallel shards in one process);
- :mod:`tvmkv.testing.configs`: the configuration tables (replay covering set, stateful runs, the
  kernel sets they need on the GPU machine);
- :mod:`tvmkv.testing.stateful`: the randomized stateful runner, its operation generator and shrinker
  (import it from there: it uses :class:`tvmkv.replay.Replayer`, and ``tvmkv.replay`` imports this
  package);
- :mod:`tvmkv.testing.shadow`: the runner's independent page accounting.

NumPy and tvmkv only (no torch).
"""

from .caches import cache_kwargs, make_cache, make_sharded_cache

__all__ = ["cache_kwargs", "make_cache", "make_sharded_cache"]
