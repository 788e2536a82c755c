"""Relax VM integration: models written with ``tvm.relax.frontend.nn`` call tvmkv's cache.

- :class:`TvmkvKVCache` + :func:`register`: tvmkv's own interface (the cache travels into the VM as
  an argument; each attention layer calls ``tvmkv.attention_with_fused_qkv``).
- :class:`TvmBuiltinOverride`: drop-in for TVM's ``PagedKVCache`` interface (``vm.builtin.*``).
- :mod:`tvmkv.relax.llama` / :mod:`tvmkv.relax.torch_ref`: a tiny Llama-style decoder and its
  cache-free PyTorch reference.
- :mod:`tvmkv.relax.gemma` (per-layer sliding windows, shared-KV layers) and
  :mod:`tvmkv.relax.deepseek` (MLA: append_mla_kv, self / cross attention, merge), each with its
  config module, ``*_nn`` model and ``*_torch_ref`` reference, on both interfaces.
"""

from .builtins import ATTENTION_FUNC, UNSUPPORTED, TvmBuiltinOverride, register

__all__ = ["ATTENTION_FUNC", "UNSUPPORTED", "TvmBuiltinOverride", "TvmkvKVCache", "register"]


def __getattr__(name):
    # TvmkvKVCache needs TVM's compiler (tvm.relax.frontend.nn); running a prebuilt model does not.
    if name == "TvmkvKVCache":
        from .nn_cache import TvmkvKVCache

        return TvmkvKVCache
    raise AttributeError(f"module 'tvmkv.relax' has no attribute {name!r}")
