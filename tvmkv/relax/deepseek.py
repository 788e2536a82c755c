"""A tiny DeepSeek-V2-shaped decoder (MLA attention) in ``tvm.relax.frontend.nn`` on tvmkv's MLA cache.

Token embedding -> ``num_layers`` x (RMSNorm -> MLA attention through the cache -> RMSNorm -> SwiGLU MLP,
both residual) -> RMSNorm -> LM head. The attention and its cache calls are described in
:mod:`tvmkv.relax.deepseek_nn`; weights are random from a fixed seed (:func:`make_weights`) and drive
:mod:`tvmkv.relax.deepseek_torch_ref` too. Three compiled functions, as MLC-LLM's DeepSeek-V2 has:
``prefill`` (no sequence has history: self attention), ``extend`` (any forward: self + cross attention
+ merge) and ``decode`` (one token per sequence: absorbed cross attention alone).

- ``interface="tvmkv"``: the cache argument is a :class:`tvmkv.relax.TvmkvKVCache` (globals
  ``tvmkv.append_mla_kv`` / ``self_attention`` / ``cross_attention`` / ``merge_attn_output``); create
  the cache with ``tvmkv.PagedAttentionKVCache.mla(**cache_kwargs(cfg), ...)``.
- ``interface="tvm"``: TVM's ``PagedKVCache`` (``vm.builtin.attention_kv_cache_*``) and
  ``create_paged_kv_cache`` (``AttnKind.MLA`` layers); run it on tvmkv inside
  ``TvmBuiltinOverride(mla_self_dims=cfg.mla_self_dims)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .deepseek_config import INTERFACES, DeepseekConfig
from .llama import cuda_pipeline, target_of, tvm_shape_int

__all__ = ["INTERFACES", "DeepseekConfig", "RelaxDeepseek", "cache_kwargs", "compile_deepseek", "make_weights"]


def make_weights(cfg: DeepseekConfig) -> dict[str, np.ndarray]:
    """Random float32 weights from ``cfg.seed``, keyed by the model's parameter names.

    Linear weights are ``[out_features, in_features]`` with std ``1 / sqrt(in_features)``; norm weights
    are ``1 + N(0, 0.1)``. ``kv_b_proj.weight`` is ``[num_heads * (qk_nope + v), kv_lora_rank]``, each
    head's ``qk_nope_head_dim`` key rows then its ``v_head_dim`` value rows (HF DeepSeek-V2's order).
    """
    rng = np.random.default_rng(cfg.seed)
    H, V, I, Hn = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_heads  # noqa: E741

    def linear(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = norm(H)
        if cfg.q_lora_rank is None:
            w[a + "q_proj.weight"] = linear(Hn * cfg.q_head_dim, H)
        else:
            w[a + "q_a_proj.weight"] = linear(cfg.q_lora_rank, H)
            w[a + "q_a_layernorm.weight"] = norm(cfg.q_lora_rank)
            w[a + "q_b_proj.weight"] = linear(Hn * cfg.q_head_dim, cfg.q_lora_rank)
        w[a + "kv_a_proj_with_mqa.weight"] = linear(cfg.latent_dim, H)
        w[a + "kv_a_layernorm.weight"] = norm(cfg.kv_lora_rank)
        w[a + "kv_b_proj.weight"] = linear(Hn * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        w[a + "o_proj.weight"] = linear(H, Hn * cfg.v_head_dim)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "mlp.gate_up_proj.weight"] = linear(2 * I, H)
        w[p + "mlp.down_proj.weight"] = linear(H, I)
    w["norm.weight"] = norm(H)
    w["lm_head.weight"] = linear(V, H)
    return w


def cache_kwargs(cfg: DeepseekConfig) -> dict:
    """The model-shape arguments of :meth:`tvmkv.PagedAttentionKVCache.mla` for ``interface="tvmkv"``
    (no RoPE in the cache: the model rotates ``k_pe``). Add the sizes and ``target``."""
    return dict(
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        mla_self_dims=cfg.mla_self_dims,
        dtype=cfg.dtype,
        rope_mode="none",
    )


def compile_deepseek(
    cfg: DeepseekConfig, *, interface: str = "tvmkv", target: str = "llvm", cuda_arch: str | None = None
) -> tuple:
    """Export and compile the model; returns ``(executable, param_names)``.

    ``param_names`` lists the weights in the order the compiled functions take them (keys of
    :func:`make_weights`). For "cuda" the tiny Llama's Relax GPU pipeline is used.
    """
    import tvm

    from .deepseek_nn import TinyDeepseek, export_spec

    model = TinyDeepseek(cfg, target_kind=target)
    mod, named_params = model.export_tvm(spec=export_spec(interface))
    tgt = target_of(target, cuda_arch)
    pipeline = cuda_pipeline(tgt) if target == "cuda" else "default"
    ex = tvm.compile(mod, target=tgt, relax_pipeline=pipeline)
    return ex, [name for name, _ in named_params]


class RelaxDeepseek:
    """A compiled :class:`~tvmkv.relax.deepseek_nn.TinyDeepseek` on a Relax VM, with its weights on the
    device.

    Construct it **after** the globals it calls are registered: :func:`tvmkv.relax.register` (done
    here for ``interface="tvmkv"``) or inside ``TvmBuiltinOverride(mla_self_dims=cfg.mla_self_dims)``
    for "tvm".

    Parameters
    ----------
    executable, param_names
        From :func:`compile_deepseek`.
    weights : dict of str to numpy.ndarray
        From :func:`make_weights` (cast to ``cfg.dtype`` here).
    cfg : DeepseekConfig
    device : tvm.runtime.Device
    interface : str
        "tvmkv" or "tvm" (what the executable was compiled for).
    """

    def __init__(
        self,
        executable: Any,
        param_names: list,
        weights: dict,
        cfg: DeepseekConfig,
        device: Any,
        *,
        interface: str = "tvmkv",
    ):
        import tvm
        from tvm.runtime.vm import VirtualMachine

        from .builtins import register

        if interface not in INTERFACES:
            raise ValueError(f"interface={interface!r} is not one of {INTERFACES}")
        if interface == "tvmkv":
            register()
        self.cfg = cfg
        self.device = device
        self.interface = interface
        missing = [n for n in param_names if n not in weights]
        if missing:
            raise KeyError(f"weights lack {missing[:3]}...; build them with make_weights(cfg)")
        self.params = [tvm.runtime.tensor(weights[n].astype(cfg.dtype), device) for n in param_names]
        self.vm = VirtualMachine(executable, device)
        self._functions = {mode: self.vm[mode] for mode in ("prefill", "extend", "decode")}

    def create_paged_kv_cache(
        self, *, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window=0
    ):
        """Call the model's own ``create_paged_kv_cache`` (interface "tvm" only; on llvm only inside
        :class:`tvmkv.relax.TvmBuiltinOverride`, see :meth:`TinyDeepseek.create_paged_kv_cache`)."""
        if self.interface != "tvm":
            raise ValueError(
                "create_paged_kv_cache exists only for interface='tvm'; construct "
                "tvmkv.PagedAttentionKVCache.mla(**cache_kwargs(cfg), ...) for interface='tvmkv'"
            )
        sizes = (max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window)
        return self.vm["create_paged_kv_cache"](*(tvm_shape_int(x) for x in sizes))

    def prefill(self, token_ids: Sequence[int], cache: Any) -> np.ndarray:
        """Logits ``[n, V]`` float32 (NumPy) of the ``n`` new tokens of the cache's open forward, in
        which no sequence has history (``token_ids`` ``[n]`` in ``begin_forward`` order)."""
        return self._call("prefill", np.asarray(token_ids, np.int32).reshape(1, -1), cache)[0]

    def extend(self, token_ids: Sequence[int], cache: Any) -> np.ndarray:
        """Logits ``[n, V]`` float32 of the ``n`` new tokens of the cache's open forward (any forward)."""
        return self._call("extend", np.asarray(token_ids, np.int32).reshape(1, -1), cache)[0]

    def decode(self, token_ids: Sequence[int], cache: Any) -> np.ndarray:
        """Logits ``[b, V]`` float32 of a forward of one token per sequence (``token_ids`` ``[b]``)."""
        return self._call("decode", np.asarray(token_ids, np.int32).reshape(-1, 1), cache)[:, 0]

    def _call(self, mode: str, ids: np.ndarray, cache: Any) -> np.ndarray:
        import tvm

        return self._functions[mode](tvm.runtime.tensor(ids, self.device), cache, self.params).numpy()
