"""PyTorch reference of :class:`tvmkv.relax.gemma_nn.TinyGemma`: full recompute, no cache.

Each call runs a whole token sequence through the model with an explicit mask per layer (causal;
local layers also drop keys at or before ``p - sliding_window``), and a shared-KV layer attends over
the K/V its source layer computed in the same pass. It shares nothing with the paged cache (no
pages, no per-layer window bookkeeping). Computes in float64 from the weights rounded to the model
dtype. RoPE: rotate-half over the whole head dim at positions ``0 .. L-1``, base per layer type.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .gemma_config import GemmaConfig


class TorchGemma:
    """``logits(tokens)`` of one sequence, recomputed from scratch.

    Parameters
    ----------
    cfg : GemmaConfig
    weights : dict of str to numpy.ndarray
        From :func:`tvmkv.relax.gemma.make_weights`.
    """

    def __init__(self, cfg: GemmaConfig, weights: dict):
        self.cfg = cfg
        self.w = {k: torch.from_numpy(v.astype(cfg.dtype).astype(np.float64)) for k, v in weights.items()}

    def _norm(self, x, name: str):
        """Gemma RMSNorm over the last axis: ``x / rms(x) * (1 + w)``."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * (1.0 + self.w[name])

    def _rope(self, x, theta: float):
        """x: [L, H, D]; rotate-half at positions 0 .. L-1."""
        L, D = x.shape[0], self.cfg.head_dim
        inv = 1.0 / theta ** (torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
        ang = torch.arange(L, dtype=torch.float64)[:, None] * inv[None, :]  # [L, D/2]
        cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _mask(self, i: int, L: int):
        """[L, L] bool, True where query p may see key j: j <= p, and j > p - W on local layers."""
        p, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        keep = j <= p
        if self.cfg.is_local(i):
            keep &= j > p - self.cfg.sliding_window
        return keep

    def _attention(self, i: int, x, kv: dict):
        cfg, w = self.cfg, self.w
        L, D, Hq, Hkv = x.shape[0], cfg.head_dim, cfg.num_qo_heads, cfg.num_kv_heads
        p = f"layers.{i}.self_attn."
        theta = cfg.rope_theta(i)
        if cfg.owns_kv(i):
            qkv = (x @ w[p + "qkv_proj.weight"].T).reshape(L, cfg.qkv_heads, D)
            q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
            k = self._rope(self._norm(k, p + "k_norm.weight"), theta)
            kv[i] = (k, v)
        else:
            q = (x @ w[p + "q_proj.weight"].T).reshape(L, Hq, D)
            k, v = kv[cfg.kv_sources[i]]
        q = self._rope(self._norm(q, p + "q_norm.weight"), theta)
        group = Hq // Hkv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        s = torch.einsum("ihd,jhd->hij", q, k) * cfg.sm_scale
        s = s.masked_fill(~self._mask(i, L), float("-inf"))
        o = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v).reshape(L, Hq * D)
        return o @ w[p + "o_proj.weight"].T

    def _mlp(self, i: int, x):
        w = self.w
        gate, up = (x @ w[f"layers.{i}.mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        return (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ w[f"layers.{i}.mlp.down_proj.weight"].T

    @torch.no_grad()
    def logits(self, tokens) -> np.ndarray:
        """Logits ``[L, V]`` float64 of every position of the sequence ``tokens`` (``[L]`` ints)."""
        cfg, w = self.cfg, self.w
        x = w["embed_tokens.weight"][torch.as_tensor(np.asarray(tokens, np.int64))] * math.sqrt(cfg.hidden_size)
        kv: dict = {}
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            x = x + self._norm(
                self._attention(i, self._norm(x, p + "input_layernorm.weight"), kv),
                p + "post_attention_layernorm.weight",
            )
            x = x + self._norm(
                self._mlp(i, self._norm(x, p + "pre_feedforward_layernorm.weight")),
                p + "post_feedforward_layernorm.weight",
            )
        logits = self._norm(x, "norm.weight") @ w["embed_tokens.weight"].T
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits.numpy()
