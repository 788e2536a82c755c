"""The static parameters every kernel factory takes (see docs/layout.md for the data layout)."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
TARGET_KINDS = ("llvm", "cuda")


@dataclass(frozen=True)
class KernelSpec:
    """Static shape parameters of one kernel set. Runtime sizes (tokens, pages, batch) stay symbolic.

    Parameters
    ----------
    num_qo_heads, num_kv_heads : int
        Query heads ``H_qo`` and key/value heads ``H_kv``; ``H_qo`` must be a multiple of ``H_kv``.
    head_dim : int
        ``D``, a multiple of 16 up to 256 (even, for RoPE).
    page_size : int
        ``P``, a power of two from 1 to 256.
    dtype : str
        Storage dtype of q/k/v/o and the pages: "float32", "float16" or "bfloat16".
    target_kind : str
        "llvm" (CPU) or "cuda".
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    target_kind: str

    def __post_init__(self):
        for name in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads={self.num_qo_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs H_qo = group * H_kv"
            )
        if self.head_dim % 16 or self.head_dim > 256:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of 16 in [16, 256]")
        if self.page_size > 256 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two in [1, 256]")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
        if self.target_kind not in TARGET_KINDS:
            raise ValueError(f"target_kind={self.target_kind!r} is not supported; use one of {TARGET_KINDS}")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def qkv_heads(self) -> int:
        """Heads of the fused qkv input: H_qo + 2 H_kv."""
        return self.num_qo_heads + 2 * self.num_kv_heads

    @property
    def is_cpu(self) -> bool:
        return self.target_kind == "llvm"

    @property
    def tag(self) -> str:
        """Readable part of artifact names, e.g. ``q32_kv8_d128_p16_float16``."""
        return f"q{self.num_qo_heads}_kv{self.num_kv_heads}_d{self.head_dim}_p{self.page_size}_{self.dtype}"
