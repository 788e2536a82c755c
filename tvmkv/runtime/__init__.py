"""The cache manager: page lists, the free list and the forward protocol (no kernels here)."""

from .cache import PagedAttentionKVCache
from .radix import PrefixCacheStats, RadixPrefixCache

__all__ = ["PagedAttentionKVCache", "PrefixCacheStats", "RadixPrefixCache"]
