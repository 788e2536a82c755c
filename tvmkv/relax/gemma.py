"""A tiny Gemma-style decoder in ``tvm.relax.frontend.nn`` on a paged KV cache with per-layer sliding
windows and cross-layer KV sharing.

Scaled token embedding -> ``num_layers`` x (RMSNorm -> attention through the cache -> RMSNorm, residual;
RMSNorm -> GeGLU MLP -> RMSNorm, residual) -> RMSNorm -> tied LM head -> logit soft-cap. Which layers
are local (sliding window) or global, and which reuse an earlier layer's K/V, is
:class:`~tvmkv.relax.gemma_config.GemmaConfig`'s layer map. Weights are random from a fixed seed
(:func:`make_weights`); the same weights drive :mod:`tvmkv.relax.gemma_torch_ref`.

The model applies RoPE itself (per-layer base, at ``paged_kv_cache.get_query_positions``), so the
cache runs with ``rope_mode="none"``; a layer owning its K/V calls ``attention_with_fused_qkv``, a
shared-KV layer ``attention_with_shared_kv(source_layer, q, k, v, sm_scale)``. Both interfaces:

- ``interface="tvmkv"``: the cache argument is a :class:`tvmkv.relax.TvmkvKVCache`; create the cache
  with :func:`cache_kwargs` (``layer_windows`` from the layer map).
- ``interface="tvm"``: TVM's ``PagedKVCache`` (``create_paged_kv_cache`` builds a ``TIRPagedKVCache``
  whose local layers are ``mha_sliding``); run it on tvmkv under :class:`tvmkv.relax.TvmBuiltinOverride`
  or on TVM's own cache without it.
"""

from __future__ import annotations

import math

import numpy as np

from .gemma_config import INTERFACES, GemmaConfig
from .llama import RelaxLlama, target_of

__all__ = ["INTERFACES", "GemmaConfig", "RelaxGemma", "cache_kwargs", "compile_gemma", "make_weights"]


def make_weights(cfg: GemmaConfig) -> dict[str, np.ndarray]:
    """Random float32 weights from ``cfg.seed``, keyed by the model's parameter names.

    Linear weights are ``[out_features, in_features]`` with std ``1 / sqrt(in_features)``; the embedding
    has std ``1 / sqrt(hidden)`` (the model scales it by ``sqrt(hidden)``); norm weights (used as
    ``1 + w``) are ``N(0, 0.1)``. A shared-KV layer has ``q_proj`` instead of ``qkv_proj`` and no ``k_norm``.
    """
    rng = np.random.default_rng(cfg.seed)
    H, D, V, I = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size  # noqa: E741

    def linear(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)

    def norm(n):
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"embed_tokens.weight": (rng.standard_normal((V, H)) / math.sqrt(H)).astype(np.float32)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        if cfg.owns_kv(i):
            w[p + "self_attn.qkv_proj.weight"] = linear(cfg.qkv_heads * D, H)
            w[p + "self_attn.k_norm.weight"] = norm(D)
        else:
            w[p + "self_attn.q_proj.weight"] = linear(cfg.num_qo_heads * D, H)
        w[p + "self_attn.q_norm.weight"] = norm(D)
        w[p + "self_attn.o_proj.weight"] = linear(H, cfg.num_qo_heads * D)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "pre_feedforward_layernorm.weight"] = norm(H)
        w[p + "mlp.gate_up_proj.weight"] = linear(2 * I, H)
        w[p + "mlp.down_proj.weight"] = linear(H, I)
        w[p + "post_feedforward_layernorm.weight"] = norm(H)
    w["norm.weight"] = norm(H)
    return w


def cache_kwargs(cfg: GemmaConfig) -> dict:
    """The model-shape arguments of :class:`tvmkv.PagedAttentionKVCache` for ``interface="tvmkv"``:
    every layer (shared-KV layers keep unused pages, as in TVM's cache), ``layer_windows`` from the
    layer map, no RoPE in the cache. Add the sizes and ``target``."""
    return dict(
        num_layers=cfg.num_layers,
        num_qo_heads=cfg.num_qo_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=cfg.dtype,
        rope_mode="none",
        layer_windows=cfg.layer_windows,
    )


def compile_gemma(
    cfg: GemmaConfig, *, interface: str = "tvmkv", target: str = "llvm", cuda_arch: str | None = None
) -> tuple:
    """Export and compile the model; returns ``(executable, param_names)``.

    ``param_names`` lists the weights in the order the compiled ``forward`` takes them (keys of
    :func:`make_weights`). For "cuda" the same Relax GPU pipeline as the tiny Llama's is used.
    """
    import tvm

    from .gemma_nn import TinyGemma
    from .llama import cuda_pipeline
    from .llama_nn import export_spec

    spec = export_spec(interface)  # same functions and argument specs as the tiny Llama's
    model = TinyGemma(cfg, target_kind=target)
    mod, named_params = model.export_tvm(spec=spec)
    tgt = target_of(target, cuda_arch)
    pipeline = cuda_pipeline(tgt) if target == "cuda" else "default"
    ex = tvm.compile(mod, target=tgt, relax_pipeline=pipeline)
    return ex, [name for name, _ in named_params]


class RelaxGemma(RelaxLlama):
    """A compiled :class:`~tvmkv.relax.gemma_nn.TinyGemma` on a Relax VM, with its weights on the device.

    The runner is the tiny Llama's (:class:`tvmkv.relax.llama.RelaxLlama`: same ``forward(token_ids,
    cache)`` and ``create_paged_kv_cache``); construct it after :func:`tvmkv.relax.register` (done there
    for ``interface="tvmkv"``) or inside :class:`tvmkv.relax.TvmBuiltinOverride` for "tvm" on tvmkv.
    """
