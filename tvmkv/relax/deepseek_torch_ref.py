"""PyTorch reference of :class:`tvmkv.relax.deepseek_nn.TinyDeepseek`: full recompute, no cache, no
absorption.

Each call runs a whole token sequence through the model with a causal mask and DeepSeek-V2's attention
written out plainly: every head's key is ``[kv_b_proj(c)_nope | k_pe]`` and its value
``kv_b_proj(c)_v``, recomputed from the latent ``c`` of every token; nothing is multiplied into the
query (``W_UK``) or applied after the attention (``W_UV``), so the reference is independent of the
absorption trick the model uses against the cache, and of pages, chunks and merges. Computes in
float64 from the weights rounded to the model dtype.

RoPE (DeepSeek-V2's): the ``qk_rope_head_dim`` dims of ``q_pe`` / ``k_pe`` are de-interleaved (even
dims, then odd dims) and rotated rotate-half at positions ``0 .. L-1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .deepseek_config import DeepseekConfig


class TorchDeepseek:
    """``logits(tokens)`` of one sequence, recomputed from scratch.

    Parameters
    ----------
    cfg : DeepseekConfig
    weights : dict of str to numpy.ndarray
        From :func:`tvmkv.relax.deepseek.make_weights`.
    """

    def __init__(self, cfg: DeepseekConfig, weights: dict):
        self.cfg = cfg
        self.w = {k: torch.from_numpy(v.astype(cfg.dtype).astype(np.float64)) for k, v in weights.items()}

    def _rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * self.w[name]

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """x: [L, h, d] (d = qk_rope_head_dim) at positions 0 .. L-1: de-interleave, rotate half."""
        L, h, d = x.shape
        x = x.reshape(L, h, d // 2, 2).transpose(-1, -2).reshape(L, h, d)
        inv = 1.0 / self.cfg.rope_theta ** (torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
        ang = torch.arange(L, dtype=torch.float64)[:, None] * inv[None, :]  # [L, d/2]
        cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _attention(self, i: int, x: torch.Tensor, rows: list) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        p = f"layers.{i}.self_attn."
        L, H = x.shape[0], cfg.num_heads
        nope, rope, lora, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            q = x @ w[p + "q_proj.weight"].T
        else:
            q = self._rms_norm(x @ w[p + "q_a_proj.weight"].T, p + "q_a_layernorm.weight") @ w[p + "q_b_proj.weight"].T
        q = q.reshape(L, H, cfg.q_head_dim)
        q = torch.cat([q[..., :nope], self._rope(q[..., nope:])], dim=-1)  # [L, H, nope + rope]
        ckv = x @ w[p + "kv_a_proj_with_mqa.weight"].T  # [L, lora + rope]
        c = self._rms_norm(ckv[:, :lora], p + "kv_a_layernorm.weight")  # [L, lora]
        k_pe = self._rope(ckv[:, None, lora:])  # [L, 1, rope]
        rows.append(torch.cat([c, k_pe[:, 0]], dim=-1))
        kv = (c @ w[p + "kv_b_proj.weight"].T).reshape(L, H, nope + dv)
        k = torch.cat([kv[..., :nope], k_pe.expand(L, H, rope)], dim=-1)  # [L, H, nope + rope]
        v = kv[..., nope:]  # [L, H, dv]
        s = torch.einsum("ihd,jhd->hij", q, k) * cfg.sm_scale
        s = s.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v).reshape(L, H * dv)
        return o @ w[p + "o_proj.weight"].T

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        gate, up = (x @ w[f"layers.{i}.mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w[f"layers.{i}.mlp.down_proj.weight"].T

    @torch.no_grad()
    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits ``[L, V]`` float64 of every position of the sequence ``tokens`` (``[L]`` ints)."""
        return self._run(tokens)[0]

    @torch.no_grad()
    def mla_rows(self, tokens: Sequence[int]) -> np.ndarray:
        """``[num_layers, L, kv_lora_rank + qk_rope_head_dim]`` float64: what an MLA cache should hold
        for ``tokens`` (each token's normalized latent, then its rotated ``k_pe``)."""
        return self._run(tokens)[1]

    def _run(self, tokens: Sequence[int]) -> tuple:
        w = self.w
        rows: list = []
        x = w["embed_tokens.weight"][torch.as_tensor(np.asarray(tokens, np.int64))]
        for i in range(self.cfg.num_layers):
            x = x + self._attention(i, self._rms_norm(x, f"layers.{i}.input_layernorm.weight"), rows)
            x = x + self._mlp(i, self._rms_norm(x, f"layers.{i}.post_attention_layernorm.weight"))
        logits = self._rms_norm(x, "norm.weight") @ w["lm_head.weight"].T
        return logits.numpy(), torch.stack(rows).numpy()
