"""tvmkv: a paged-attention KV cache on TVM (TIR kernels + a Python cache manager).

Data layout of every array: docs/layout.md.
"""

from .config import CacheConfig
from .errors import ForwardStateError, IntegrityError, OutOfPagesError, TvmkvError
from .runtime.cache import PagedAttentionKVCache
from .tir.spec import KernelSpec

__all__ = [
    "CacheConfig",
    "ForwardStateError",
    "IntegrityError",
    "KernelSpec",
    "OutOfPagesError",
    "PagedAttentionKVCache",
    "TvmkvError",
]
