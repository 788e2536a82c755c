"""PyTorch reference of :class:`tvmkv.relax.llama.TinyLlama`: full recompute, no cache.

Each call runs the whole token sequence through the model with a causal mask, so it shares nothing
with the paged cache (no pages, no forks, no chunking). It computes in float64 from the weights
rounded to the model dtype, so it is an oracle for both the fp32 and the fp16 model.
RoPE: rotate-half over the whole head dim at positions ``0 .. L-1`` (docs/layout.md, "RoPE").
"""

from __future__ import annotations

import numpy as np
import torch

from .llama_config import LlamaConfig


class TorchLlama:
    """``logits(tokens)`` of one sequence, recomputed from scratch.

    Parameters
    ----------
    cfg : LlamaConfig
    weights : dict of str to numpy.ndarray
        From :func:`tvmkv.relax.llama.make_weights`.
    """

    def __init__(self, cfg: LlamaConfig, weights: dict):
        self.cfg = cfg
        self.w = {k: torch.from_numpy(v.astype(cfg.dtype).astype(np.float64)) for k, v in weights.items()}

    def _rms_norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * weight

    def _rope(self, x, pos):
        """x: [L, H, D]; rotate-half at positions pos [L]."""
        cfg = self.cfg
        D = cfg.head_dim
        inv = cfg.rope_scale / cfg.rope_theta ** (torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
        ang = pos[:, None].to(torch.float64) * inv[None, :]  # [L, D/2]
        cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _attention(self, i: int, x):
        cfg, w = self.cfg, self.w
        L, D, Hq, Hkv = x.shape[0], cfg.head_dim, cfg.num_qo_heads, cfg.num_kv_heads
        qkv = (x @ w[f"layers.{i}.self_attn.qkv_proj.weight"].T).reshape(L, cfg.qkv_heads, D)
        q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
        pos = torch.arange(L)
        q, k = self._rope(q, pos), self._rope(k, pos)
        group = Hq // Hkv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        s = torch.einsum("ihd,jhd->hij", q, k) * cfg.sm_scale
        s = s.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v).reshape(L, Hq * D)
        return o @ w[f"layers.{i}.self_attn.o_proj.weight"].T

    def _mlp(self, i: int, x):
        w = self.w
        gate, up = (x @ w[f"layers.{i}.mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w[f"layers.{i}.mlp.down_proj.weight"].T

    @torch.no_grad()
    def logits(self, tokens) -> np.ndarray:
        """Logits ``[L, V]`` float64 of every position of the sequence ``tokens`` (``[L]`` ints)."""
        w = self.w
        x = w["embed_tokens.weight"][torch.as_tensor(np.asarray(tokens, np.int64))]
        for i in range(self.cfg.num_layers):
            x = x + self._attention(i, self._rms_norm(x, w[f"layers.{i}.input_layernorm.weight"]))
            x = x + self._mlp(i, self._rms_norm(x, w[f"layers.{i}.post_attention_layernorm.weight"]))
        return (self._rms_norm(x, w["norm.weight"]) @ w["lm_head.weight"].T).numpy()
