"""The Llama-family model's shape (:class:`LlamaConfig`) and the two cache interfaces it compiles against.

Its own module so that the model (``llama_nn``), its driver (``llama``) and the PyTorch reference
(``torch_ref``) all import it without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INTERFACES = ("tvmkv", "tvm")


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family decoder. The defaults are the tiny model of the main job (~1.6M parameters,
    fast on 2 CPU cores); :func:`tvmkv.relax.hf.read_config` maps a Hugging Face checkpoint's onto it.

    Beyond Llama's own: ``qkv_bias`` (Qwen2; Llama's ``attention_bias``), ``o_bias`` (Llama's
    ``attention_bias``), ``qk_norm`` (Qwen3: an RMSNorm over each head's q and k before RoPE),
    ``layer_windows`` (Mistral's / Qwen2's sliding windows: a query sees the last ``W`` positions of its
    layer's window, 0 for full attention), ``rope_scaling`` (Hugging Face's dict, which the cache applies:
    docs/layout.md "RoPE"). ``tie_word_embeddings`` only says where the LM head's weight comes from.
    """

    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_qo_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e4
    rope_scale: float = 1.0
    dtype: str = "float32"
    seed: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple = ()
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads={self.num_qo_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'float16'")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows={self.layer_windows!r} must give one window per layer ({self.num_layers})")

    @property
    def qkv_heads(self) -> int:
        return self.num_qo_heads + 2 * self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


__all__ = ["INTERFACES", "LlamaConfig"]
