"""The cache manager: page lists, the free list and the forward protocol (no kernels here)."""

from .cache import PagedAttentionKVCache

__all__ = ["PagedAttentionKVCache"]
