"""tvmkv: a paged-attention KV cache on TVM (TIR kernels + a Python cache manager).

Data layout of every array: docs/layout.md.
"""

from .config import CacheConfig
from .errors import (
    ForwardStateError,
    IntegrityError,
    OutOfPagesError,
    SequenceSwappedError,
    ShardDivergenceError,
    TvmkvError,
)
from .runtime import interop  # gather_kv, store_kv, export/import_sequence (docs/layout.md)
from .runtime.cache import PagedAttentionKVCache
from .runtime.radix import PrefixCacheStats, RadixPrefixCache
from .runtime.scheduler import Scheduler
from .runtime.sharded import ShardedKVCache
from .runtime.sharding import ShardLayout
from .tir.spec import KernelSpec

__all__ = [
    "CacheConfig",
    "ForwardStateError",
    "IntegrityError",
    "KernelSpec",
    "OutOfPagesError",
    "PagedAttentionKVCache",
    "PrefixCacheStats",
    "RadixPrefixCache",
    "Scheduler",
    "SequenceSwappedError",
    "ShardDivergenceError",
    "ShardLayout",
    "ShardedKVCache",
    "TvmkvError",
    "interop",
]
