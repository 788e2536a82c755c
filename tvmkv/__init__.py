"""tvmkv: a paged-attention KV cache on TVM (TIR kernels + a Python cache manager)."""

from .tir.spec import KernelSpec

__all__ = ["KernelSpec"]
