"""The cache manager, in reading order: ``pages`` (free list, ref counts) -> ``sequences`` (page lists,
windows, token trees) -> ``plan`` (one step's index arrays) -> ``cache`` (the facade: validation,
uploads, launches) -> ``launch`` (what one layer launches); ``swap``, ``radix``, ``interop`` and
``scheduler`` build on the cache's public API."""

from .cache import PagedAttentionKVCache
from .pages import PageHolder, PagePool
from .radix import PrefixCacheStats, RadixPrefixCache
from .sequences import SequenceInfo

__all__ = ["PageHolder", "PagePool", "PagedAttentionKVCache", "PrefixCacheStats", "RadixPrefixCache", "SequenceInfo"]
