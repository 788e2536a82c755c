"""The static parameters every kernel factory takes (see docs/layout.md for the data layout)."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # page dtypes of fp8 pages (tvmkv.tir.fp8)
TARGET_KINDS = ("llvm", "cuda")


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (a tvmkv activation or page dtype)."""
    return 4 if dtype == "float32" else 1 if dtype in FP8_DTYPES else 2


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
        Dtype of q/k/v/o (and of the pages unless ``kv_dtype`` says otherwise): "float32", "float16"
        or "bfloat16".
    target_kind : str
        "llvm" (CPU) or "cuda".
    kv_dtype : str
        Page dtype when it differs from ``dtype``: "float8_e4m3fn" or "float8_e5m2" (fp8 pages, with
        ``dtype`` float16 or bfloat16; :mod:`tvmkv.tir.fp8`). "" (default): the pages are ``dtype``.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    target_kind: str
    kv_dtype: str = ""

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
        if self.kv_dtype == self.dtype:  # one spelling of "pages of dtype" (equal specs, one tag)
            object.__setattr__(self, "kv_dtype", "")
        if self.kv_dtype not in ("",) + FP8_DTYPES:
            raise ValueError(
                f"kv_dtype={self.kv_dtype!r} is not supported; use one of {FP8_DTYPES} (fp8 pages) or leave it "
                f"empty (pages of dtype {self.dtype!r})"
            )
        if self.kv_dtype in FP8_DTYPES and self.dtype == "float32":
            raise ValueError(
                f"kv_dtype={self.kv_dtype!r} with dtype='float32': fp8 pages take 16-bit activations; use "
                "dtype='float16' or 'bfloat16'"
            )

    @property
    def page_dtype(self) -> str:
        """Dtype of the pages: ``kv_dtype`` when given, else ``dtype``."""
        return self.kv_dtype or self.dtype

    @property
    def fp8_pages(self) -> bool:
        """The pages hold fp8 values scaled per layer and KV head (tvmkv.tir.fp8): kernels that write
        them quantize, kernels that read them dequantize, with the ``kv_scale`` argument."""
        return self.page_dtype in FP8_DTYPES

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
        tag = f"q{self.num_qo_heads}_kv{self.num_kv_heads}_d{self.head_dim}_p{self.page_size}_{self.dtype}"
        return tag + (f"_pages_{self.page_dtype}" if self.page_dtype != self.dtype else "")


@dataclass(frozen=True)
class MlaSpec:
    """Static shape parameters of an MLA (multi-head latent attention, DeepSeek-V2) kernel set.

    An MLA cache stores one vector of ``D = latent_dim + rope_dim`` per token and layer: the compressed
    latent ``c`` (``D_v = latent_dim``) followed by the rotated key part ``k_pe`` (``D_r = rope_dim``);
    see docs/layout.md ("MLA pages"). Runtime sizes (tokens, pages, batch) stay symbolic.

    Parameters
    ----------
    num_heads : int
        Query heads ``H`` (all read the same latent row of a token).
    latent_dim : int
        ``D_v`` (kv_lora_rank, e.g. 512): the output dim of absorbed attention, a multiple of 16 up to 1024.
    rope_dim : int
        ``D_r`` (qk_rope_head_dim, e.g. 64), a multiple of 16 up to 256.
    page_size : int
        ``P``, a power of two from 1 to 256.
    dtype : str
        Storage dtype of q/o and the pages: "float32", "float16" or "bfloat16".
    target_kind : str
        "llvm" (CPU) or "cuda".
    self_qk_dim, self_v_dim : int
        ``Dq`` and ``Dv2`` of the non-absorbed self attention of prefill (DeepSeek-V2: 192 and 128),
        multiples of 16 up to 256; both 0 (the default) when the kernel set has no
        ``ragged_attention_dv``.
    """

    num_heads: int
    latent_dim: int
    rope_dim: int
    page_size: int
    dtype: str
    target_kind: str
    self_qk_dim: int = 0
    self_v_dim: int = 0

    def __post_init__(self):
        for name in ("num_heads", "latent_dim", "rope_dim", "page_size", "self_qk_dim", "self_v_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative int")
        for name in ("num_heads", "latent_dim", "rope_dim", "page_size"):
            if getattr(self, name) == 0:
                raise ValueError(f"{name}=0 must be positive")
        if self.latent_dim % 16 or self.latent_dim > 1024:
            raise ValueError(f"latent_dim={self.latent_dim} must be a multiple of 16 in [16, 1024]")
        if self.rope_dim % 16 or self.rope_dim > 256:
            raise ValueError(f"rope_dim={self.rope_dim} must be a multiple of 16 in [16, 256]")
        if self.page_size > 256 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two in [1, 256]")
        if (self.self_qk_dim == 0) != (self.self_v_dim == 0):
            raise ValueError(
                f"self_qk_dim={self.self_qk_dim} and self_v_dim={self.self_v_dim}: give both (the self "
                "attention's q/k and v head dims) or neither"
            )
        for name in ("self_qk_dim", "self_v_dim"):
            value = getattr(self, name)
            if value % 16 or value > 256:
                raise ValueError(f"{name}={value} must be a multiple of 16 in [16, 256] (or 0 for none)")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
        if self.target_kind not in TARGET_KINDS:
            raise ValueError(f"target_kind={self.target_kind!r} is not supported; use one of {TARGET_KINDS}")

    @property
    def head_dim(self) -> int:
        """``D = latent_dim + rope_dim``: the stored vector per token, and the dim of q and the scores."""
        return self.latent_dim + self.rope_dim

    @property
    def has_self_attention(self) -> bool:
        """Whether ``self_qk_dim`` / ``self_v_dim`` are set (the set has ``ragged_attention_dv``)."""
        return self.self_qk_dim > 0

    @property
    def is_cpu(self) -> bool:
        return self.target_kind == "llvm"

    @property
    def tag(self) -> str:
        """Readable part of artifact names, e.g. ``mla_h128_c512_r64_p16_float16`` (``_s192x128`` with
        self attention dims)."""
        tag = f"mla_h{self.num_heads}_c{self.latent_dim}_r{self.rope_dim}_p{self.page_size}_{self.dtype}"
        if self.has_self_attention:
            tag += f"_s{self.self_qk_dim}x{self.self_v_dim}"
        return tag
