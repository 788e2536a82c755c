"""The nn.Module of the tiny Gemma (:mod:`tvmkv.relax.gemma` has its weights and compiler).

Needs TVM's compiler (``tvm.relax.frontend.nn``); the runner does not.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import relax as rx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .gemma_config import GemmaConfig
from .llama_nn import Linear


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)`` over the last axis (Gemma stores ``w`` offset by one)."""

    def __init__(self, n: int, eps: float, dtype: str):
        self.weight = nn.Parameter((n,), dtype)
        self.eps = eps

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return op.rms_norm(x, self.weight + 1.0, axes=-1, epsilon=self.eps)


class Rope:
    """Rotate-half RoPE at the open forward's query positions, one table per base ``theta``.

    ``cos``/``sin`` are ``[n, 1, D/2]``; :meth:`__call__` rotates ``[b, s, H, D]`` with ``b * s = n``.
    """

    def __init__(self, positions: nn.Tensor, theta: float, head_dim: int, dtype: str):
        half = head_dim // 2
        inv_freq = (1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / head_dim)).astype(np.float32)
        n = positions.shape[0]
        ang = op.reshape(positions.astype("float32"), (n, 1)) * nn.Tensor.from_const(inv_freq.reshape(1, half))
        self.cos = _unary(rx.op.cos, ang).astype(dtype).reshape(n, 1, half)
        self.sin = _unary(rx.op.sin, ang).astype(dtype).reshape(n, 1, half)

    def __call__(self, x: nn.Tensor) -> nn.Tensor:
        b, s, h, d = x.shape
        x1, x2 = op.split(op.reshape(x, (b * s, h, d)), 2, axis=-1)  # [n, H, D/2] each
        out = op.concat([x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin], dim=-1)
        return op.reshape(out, (b, s, h, d))


def _unary(relax_op, x: nn.Tensor) -> nn.Tensor:
    return nn.Tensor(_expr=rx.BlockBuilder.current().emit(relax_op(x._expr)))


class GemmaAttention(nn.Module):
    """Per-head q/k RMSNorm (Gemma 3), RoPE in the model, attention through the cache.

    A layer that owns its K/V sends fused ``[q | k | v]`` (rotated q and k) to
    ``attention_with_fused_qkv`` and returns its rotated ``k``/``v`` for the layers that share them;
    a shared-KV layer projects only ``q`` and calls ``attention_with_shared_kv`` with its source's.
    """

    def __init__(self, cfg: GemmaConfig, layer_id: int):
        self.cfg = cfg
        self.layer_id = layer_id
        D = cfg.head_dim
        if cfg.owns_kv(layer_id):
            self.qkv_proj = Linear(cfg.hidden_size, cfg.qkv_heads * D, cfg.dtype)
            self.k_norm = GemmaRMSNorm(D, cfg.rms_norm_eps, cfg.dtype)
        else:
            self.q_proj = Linear(cfg.hidden_size, cfg.num_qo_heads * D, cfg.dtype)
        self.q_norm = GemmaRMSNorm(D, cfg.rms_norm_eps, cfg.dtype)
        self.o_proj = Linear(cfg.num_qo_heads * D, cfg.hidden_size, cfg.dtype)

    def forward(self, x: nn.Tensor, paged_kv_cache, rope: Rope, shared_kv: dict) -> nn.Tensor:
        cfg, layer = self.cfg, self.layer_id
        b, s, _ = x.shape
        Hq, Hkv, D = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.owns_kv(layer):
            qkv = op.reshape(self.qkv_proj(x), (b, s, cfg.qkv_heads, D))  # [b, s, H_qo + 2 H_kv, D]
            q, k, v = op.split(qkv, [Hq, Hq + Hkv], axis=2)
            q, k = rope(self.q_norm(q)), rope(self.k_norm(k))
            shared_kv[layer] = (k, v)
            qkv = op.concat([q, k, v], dim=2)
            o = paged_kv_cache.attention_with_fused_qkv(layer, qkv, Hq, cfg.sm_scale)
        else:
            src = cfg.kv_sources[layer]
            q = rope(self.q_norm(op.reshape(self.q_proj(x), (b, s, Hq, D))))
            k, v = shared_kv[src]
            o = paged_kv_cache.attention_with_shared_kv(src, q, k, v, cfg.sm_scale)
        return self.o_proj(op.reshape(o, (b, s, Hq * D)))


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate) * up)``."""

    def __init__(self, cfg: GemmaConfig):
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Gemma 2/3 sandwich norms: pre- and post-norm around both attention and MLP."""

    def __init__(self, cfg: GemmaConfig, layer_id: int):
        H, eps, dt = cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype
        self.input_layernorm = GemmaRMSNorm(H, eps, dt)
        self.self_attn = GemmaAttention(cfg, layer_id)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps, dt)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps, dt)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps, dt)

    def forward(self, x: nn.Tensor, paged_kv_cache, rope: Rope, shared_kv: dict) -> nn.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), paged_kv_cache, rope, shared_kv))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class TinyGemma(nn.Module):
    """The decoder. ``forward(input_ids [1, n] int32, paged_kv_cache) -> logits [1, n, V] float32``.

    ``n`` is the number of new tokens of the cache's open forward, in ``begin_forward`` order. The
    cache has no RoPE of its own (``rope_mode`` "none"): the model rotates q and k at the positions
    the cache reports (``get_query_positions``), with the base of each layer's type, as Gemma 3
    does. The LM head is tied to the embedding.
    """

    def __init__(self, cfg: GemmaConfig, *, target_kind: str = "llvm"):
        self.cfg = cfg
        self.target_kind = target_kind
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList([GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, input_ids: nn.Tensor, paged_kv_cache) -> nn.Tensor:
        cfg = self.cfg
        n = input_ids.shape[1]
        positions = paged_kv_cache.get_query_positions(n)  # [n] int32
        ropes = {
            t: Rope(positions, cfg.rope_theta_local if t == "local" else cfg.rope_theta_global, cfg.head_dim, cfg.dtype)
            for t in sorted(set(cfg.layer_types))
        }
        x = self.embed_tokens(input_ids) * math.sqrt(cfg.hidden_size)  # [1, n, H]
        shared_kv: dict = {}  # layer -> its rotated (k, v) of this forward
        for i, layer in enumerate(self.layers):
            x = layer(x, paged_kv_cache, ropes[cfg.layer_types[i]], shared_kv)
        x = self.norm(x)
        logits = op.matmul(x, op.permute_dims(self.embed_tokens.weight), out_dtype="float32")  # [1, n, V]
        if cfg.final_logit_softcap:
            cap = cfg.final_logit_softcap
            logits = op.tanh(logits * (1.0 / cap)) * cap
        return logits

    def create_paged_kv_cache(
        self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window
    ):
        """TVM's interface: a ``TIRPagedKVCache`` with per-layer kinds ("mha_sliding" for local layers)
        and window ``layer_sliding_window_size``, no RoPE (the model applies it)."""
        import tvm
        from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

        cfg = self.cfg
        return TIRPagedKVCache(
            attn_kind=cfg.attn_kinds,
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, cfg.num_layers]),
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_qo_heads,
            num_key_value_heads=cfg.num_kv_heads,
            qk_head_dim=cfg.head_dim,
            v_head_dim=cfg.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE,
            rope_scale=1,
            rope_theta=cfg.rope_theta_global,
            rope_scaling={},
            rope_ext_factors=rx.prim_value(0),
            rotary_dim=cfg.head_dim,
            enable_disaggregation=False,
            dtype=cfg.dtype,
            target=tvm.target.Target(self.target_kind),
            layer_sliding_window_size=cfg.sliding_window,
        )
