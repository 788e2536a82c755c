"""The tiny DeepSeek-V2-shaped model's shape (:class:`DeepseekConfig`).

Its own module so that the model (``deepseek_nn``), its driver (``deepseek``) and the PyTorch
reference (``deepseek_torch_ref``) all import it without importing each other.

MLA names (DeepSeek-V2): ``kv_lora_rank`` is the width of the compressed latent ``c`` each token
stores, ``qk_rope_head_dim`` the width of its rotated key part ``k_pe`` (shared by all heads);
``qk_nope_head_dim`` / ``v_head_dim`` are the per-head widths that ``kv_b_proj`` expands ``c`` into.
"""

from __future__ import annotations

from dataclasses import dataclass

INTERFACES = ("tvmkv", "tvm")


@dataclass(frozen=True)
class DeepseekConfig:
    """Shape of the tiny model (defaults: ~0.3M parameters; head dims multiples of 16).

    ``q_lora_rank=None`` projects q directly (``q_proj``, as DeepSeek-V2-Lite); an int compresses
    it first (``q_a_proj`` -> RMSNorm -> ``q_b_proj``, as DeepSeek-V2).
    """

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    q_lora_rank: int | None = 48
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e4
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if value <= 0 or value % 2:
                raise ValueError(f"{name}={value} must be a positive even number")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank={self.q_lora_rank} must be positive, or None (no q compression)")
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'float16'")

    @property
    def q_head_dim(self) -> int:
        """Per-head width of the non-absorbed q and k: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of the row each token stores per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_self_dims(self) -> tuple[int, int]:
        """``(Dq, Dv)`` of the prefill's non-absorbed self attention."""
        return (self.q_head_dim, self.v_head_dim)

    @property
    def sm_scale(self) -> float:
        """Softmax scale of both attention forms: ``q_head_dim ** -0.5`` (absorption keeps the scores)."""
        return self.q_head_dim**-0.5


__all__ = ["INTERFACES", "DeepseekConfig"]
