"""The tiny Gemma's shape and layer map (:class:`GemmaConfig`).

Its own module so that the model (``gemma_nn``), its driver (``gemma``) and the PyTorch reference
(``gemma_torch_ref``) all import it without importing each other.

The layer map is the point of this model: which layers attend within a sliding window ("local", as
Gemma 2/3 alternate them with "global" ones) and which layers own no K/V but reuse an earlier
layer's (cross-layer KV sharing, as Gemma 3n's last layers do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .llama_config import INTERFACES

LAYER_TYPES = ("local", "global")


@dataclass(frozen=True)
class GemmaConfig:
    """Shape and layer map of the tiny Gemma-style model (defaults: 6 layers, ~0.4M parameters).

    Parameters
    ----------
    layer_types : tuple of str
        One entry per layer: "local" (sliding window of ``sliding_window`` tokens, RoPE base
        ``rope_theta_local``) or "global" (full causal attention, RoPE base ``rope_theta_global``).
        Its length is the number of layers.
    kv_sources : tuple of int
        One entry per layer: -1 when the layer owns its K/V (``attention_with_fused_qkv``), else the
        earlier layer whose K/V it reads (``attention_with_shared_kv``; the layer then only projects
        queries). A source owns its K/V and has the same type, since the cache applies the source
        layer's window.
    sliding_window : int
        Window ``W`` of local layers: a query at position ``p`` sees keys at ``(p - W, p]``.
    query_pre_attn_scalar : float
        Gemma's softmax scale is ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``).
    final_logit_softcap : float
        Gemma 2's ``cap * tanh(logits / cap)`` on the LM head output; 0 turns it off.
    """

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256
    num_qo_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    layer_types: tuple = ("local", "global", "local", "global", "local", "global")
    kv_sources: tuple = (-1, -1, -1, -1, 2, 3)
    sliding_window: int = 8
    query_pre_attn_scalar: float = 24.0
    rope_theta_local: float = 1e4
    rope_theta_global: float = 1e6
    final_logit_softcap: float = 30.0
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self):
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads={self.num_qo_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotate-half RoPE)")
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'float16'")
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive")
        if not self.layer_types:
            raise ValueError("layer_types is empty; give one 'local' or 'global' per layer")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types has {bad[0]!r}; each entry must be one of {LAYER_TYPES}")
        if len(self.kv_sources) != len(self.layer_types):
            raise ValueError(
                f"kv_sources has {len(self.kv_sources)} entries but layer_types has {len(self.layer_types)}; "
                "give one per layer (-1: the layer owns its K/V)"
            )
        for i, src in enumerate(self.kv_sources):
            if src == -1:
                continue
            if not 0 <= src < i:
                raise ValueError(
                    f"kv_sources[{i}]={src}: a layer can only reuse the K/V of an earlier layer (0..{i - 1})"
                )
            if self.kv_sources[src] != -1:
                raise ValueError(
                    f"kv_sources[{i}]={src}, but layer {src} itself reuses layer {self.kv_sources[src]}'s K/V; "
                    f"name the owner ({self.kv_sources[src]})"
                )
            if self.layer_types[src] != self.layer_types[i]:
                raise ValueError(
                    f"layer {i} is {self.layer_types[i]!r} but its K/V source {src} is {self.layer_types[src]!r}; "
                    "the cache applies the source layer's window, so they must match"
                )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def qkv_heads(self) -> int:
        return self.num_qo_heads + 2 * self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar)

    def owns_kv(self, layer: int) -> bool:
        return self.kv_sources[layer] == -1

    def is_local(self, layer: int) -> bool:
        return self.layer_types[layer] == "local"

    def rope_theta(self, layer: int) -> float:
        return self.rope_theta_local if self.is_local(layer) else self.rope_theta_global

    @property
    def layer_windows(self) -> list:
        """tvmkv's ``PagedAttentionKVCache(layer_windows=...)``: the window of local layers, 0 for global."""
        return [self.sliding_window if self.is_local(i) else 0 for i in range(self.num_layers)]

    @property
    def attn_kinds(self) -> list:
        """TVM's ``TIRPagedKVCache(attn_kind=...)``: "mha_sliding" for local layers, "mha" for global."""
        return ["mha_sliding" if self.is_local(i) else "mha" for i in range(self.num_layers)]


__all__ = ["INTERFACES", "LAYER_TYPES", "GemmaConfig"]
