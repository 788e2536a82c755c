"""A tiny Llama-style decoder in ``tvm.relax.frontend.nn`` whose attention runs on a paged KV cache.

Token embedding -> ``num_layers`` x (RMSNorm -> GQA attention through the cache -> RMSNorm -> SwiGLU
MLP, both residual) -> RMSNorm -> LM head. Weights are random from a fixed seed (:func:`make_weights`);
the same weights drive :mod:`tvmkv.relax.torch_ref`.

The model calls ``paged_kv_cache.attention_with_fused_qkv(layer_id, qkv, H_qo, sm_scale)`` with raw
(unrotated) q/k/v; the cache applies RoPE (``rope_mode="normal"``). The method exists on both cache
classes, so one model class exports against either:

- ``interface="tvmkv"``: the cache argument is a :class:`tvmkv.relax.TvmkvKVCache` (tvmkv's own
  global ``tvmkv.attention_with_fused_qkv``); the caller creates a :class:`tvmkv.PagedAttentionKVCache`.
- ``interface="tvm"``: the cache argument is TVM's ``PagedKVCache`` and the module also exports
  ``create_paged_kv_cache`` (a ``TIRPagedKVCache``, as an MLC-LLM model does); run it on tvmkv under
  :class:`tvmkv.relax.TvmBuiltinOverride`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tvm import relax as rx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .nn_cache import TvmkvKVCache

INTERFACES = ("tvmkv", "tvm")


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of the tiny model (defaults: ~1.6M parameters, fast on 2 CPU cores)."""

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

    def __post_init__(self):
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads={self.num_qo_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'float16'")

    @property
    def qkv_heads(self) -> int:
        return self.num_qo_heads + 2 * self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def make_weights(cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Random float32 weights from ``cfg.seed``, keyed by the model's parameter names.

    Linear weights are ``[out_features, in_features]`` with std ``1 / sqrt(in_features)`` (activations
    and logits stay O(1)); norm weights are ``1 + N(0, 0.1)``.
    """
    rng = np.random.default_rng(cfg.seed)
    H, D, V, I = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size  # noqa: E741

    def linear(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "self_attn.qkv_proj.weight"] = linear(cfg.qkv_heads * D, H)
        w[p + "self_attn.o_proj.weight"] = linear(H, cfg.num_qo_heads * D)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "mlp.gate_up_proj.weight"] = linear(2 * I, H)
        w[p + "mlp.down_proj.weight"] = linear(H, I)
    w["norm.weight"] = norm(H)
    w["lm_head.weight"] = linear(V, H)
    return w


# ---------------------------------------------------------------------------- nn.Module
class Linear(nn.Linear):
    """``y = x W^T`` without bias, accumulated in float32 and returned in the model dtype.

    (fp16 models accumulate in fp32, as GPU GEMMs do; a float16 accumulator over 512 terms alone
    costs about 1e-2 of logit accuracy.)
    """

    def __init__(self, in_features: int, out_features: int, dtype: str):
        super().__init__(in_features, out_features, bias=False, dtype=dtype, out_dtype="float32")
        self.model_dtype = dtype

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = super().forward(x)
        return y if self.model_dtype == "float32" else y.astype(self.model_dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int):
        self.cfg = cfg
        self.layer_id = layer_id
        self.qkv_proj = Linear(cfg.hidden_size, cfg.qkv_heads * cfg.head_dim, cfg.dtype)
        self.o_proj = Linear(cfg.num_qo_heads * cfg.head_dim, cfg.hidden_size, cfg.dtype)

    def forward(self, x: nn.Tensor, paged_kv_cache) -> nn.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, cfg.qkv_heads, cfg.head_dim))  # [b, s, H_qo + 2 H_kv, D]
        o = paged_kv_cache.attention_with_fused_qkv(self.layer_id, qkv, cfg.num_qo_heads, cfg.sm_scale)
        return self.o_proj(op.reshape(o, (b, s, cfg.num_qo_heads * cfg.head_dim)))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int):
        eps = cfg.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, eps, bias=False, dtype=cfg.dtype)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, eps, bias=False, dtype=cfg.dtype)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: nn.Tensor, paged_kv_cache) -> nn.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), paged_kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """The decoder. ``forward(input_ids [1, n] int32, paged_kv_cache) -> logits [1, n, V] float32``.

    ``n`` is the number of new tokens of the cache's open forward, in ``begin_forward`` order (a
    prefill chunk, a batch of one-token decodes, or a mix).
    """

    def __init__(self, cfg: LlamaConfig, *, target_kind: str = "llvm"):
        self.cfg = cfg
        self.target_kind = target_kind
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=cfg.dtype)
        self.lm_head = nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=cfg.dtype, out_dtype="float32"
        )

    def forward(self, input_ids: nn.Tensor, paged_kv_cache) -> nn.Tensor:
        x = self.embed_tokens(input_ids)  # [1, n, H]
        for layer in self.layers:
            x = layer(x, paged_kv_cache)
        return self.lm_head(self.norm(x))  # [1, n, V] float32

    def create_paged_kv_cache(
        self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window
    ):
        """TVM's interface: a ``TIRPagedKVCache`` (RoPE "normal") sized at run time, as MLC-LLM models do."""
        import tvm
        from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

        cfg = self.cfg
        return TIRPagedKVCache(
            attn_kind="mha",
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
            rope_mode=RopeMode.NORMAL,
            rope_scale=cfg.rope_scale,
            rope_theta=cfg.rope_theta,
            rope_scaling={},
            rope_ext_factors=rx.prim_value(0),
            rotary_dim=cfg.head_dim,
            enable_disaggregation=False,
            dtype=cfg.dtype,
            target=tvm.target.Target(self.target_kind),
        )


def export_spec(interface: str) -> dict:
    """``export_tvm`` spec: ``forward`` (params packed), plus ``create_paged_kv_cache`` for "tvm"."""
    if interface not in INTERFACES:
        raise ValueError(f"interface={interface!r} is not one of {INTERFACES}")
    if interface == "tvmkv":
        cache_cls = TvmkvKVCache
    else:
        from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache as cache_cls
    spec = {
        "forward": {
            "input_ids": nn.spec.Tensor([1, "n"], "int32"),
            "paged_kv_cache": nn.spec.Object(object_type=cache_cls),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
    }
    if interface == "tvm":
        sizes = (
            "max_batch_size",
            "max_total_seq_len",
            "prefill_chunk_size",
            "page_size",
            "support_sliding_window",
        )
        spec["create_paged_kv_cache"] = {
            **{name: int for name in sizes},
            "$": {"param_mode": "none", "effect_mode": "none"},
        }
    return spec


# ---------------------------------------------------------------------------- compile + run
def target_of(target_kind: str, cuda_arch: str | None = None):
    """``tvm.target.Target`` for "llvm" or "cuda" (arch default: TVMKV's sm_90)."""
    import tvm

    if target_kind == "llvm":
        return tvm.target.Target("llvm")
    if target_kind == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": cuda_arch or "sm_90"})
    raise ValueError(f"target={target_kind!r} must be 'llvm' or 'cuda'")


def compile_llama(
    cfg: LlamaConfig, *, interface: str = "tvmkv", target: str = "llvm", cuda_arch: str | None = None
):
    """Export and compile the model; returns ``(executable, param_names)``.

    ``param_names`` lists the weights in the order the compiled ``forward`` takes them (keys of
    :func:`make_weights`). For "cuda" the Relax default GPU pipeline (DLight schedules) is used.
    """
    import tvm

    spec = export_spec(interface)
    model = TinyLlama(cfg, target_kind=target)
    mod, named_params = model.export_tvm(spec=spec)
    ex = tvm.compile(mod, target=target_of(target, cuda_arch))
    return ex, [name for name, _ in named_params]


class RelaxLlama:
    """A compiled :class:`TinyLlama` on a Relax VM, with its weights on the device.

    Construct it **after** the globals it calls are registered: :func:`tvmkv.relax.register` (done
    here for ``interface="tvmkv"``) or inside :class:`tvmkv.relax.TvmBuiltinOverride` for "tvm".

    Parameters
    ----------
    executable, param_names
        From :func:`compile_llama`.
    weights : dict of str to numpy.ndarray
        From :func:`make_weights` (cast to ``cfg.dtype`` here).
    cfg : LlamaConfig
    device : tvm.runtime.Device
    interface : str
        "tvmkv" or "tvm" (what the executable was compiled for).
    """

    def __init__(
        self, executable, param_names, weights, cfg: LlamaConfig, device, *, interface: str = "tvmkv"
    ):
        import tvm

        from .builtins import register

        if interface == "tvmkv":
            register()
        self.cfg = cfg
        self.device = device
        self.interface = interface
        missing = [n for n in param_names if n not in weights]
        if missing:
            raise KeyError(f"weights lack {missing[:3]}...; build them with make_weights(cfg)")
        self.params = [tvm.runtime.tensor(weights[n].astype(cfg.dtype), device) for n in param_names]
        self.vm = rx.VirtualMachine(executable, device)
        self._forward = self.vm["forward"]

    def create_paged_kv_cache(
        self, *, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window=0
    ):
        """Call the model's own ``create_paged_kv_cache`` (interface "tvm" only)."""
        if self.interface != "tvm":
            raise ValueError(
                "create_paged_kv_cache exists only for interface='tvm'; construct a "
                "tvmkv.PagedAttentionKVCache directly for interface='tvmkv'"
            )
        return self.vm["create_paged_kv_cache"](
            tvm_shape_int(max_batch_size),
            tvm_shape_int(max_total_seq_len),
            tvm_shape_int(prefill_chunk_size),
            tvm_shape_int(page_size),
            tvm_shape_int(support_sliding_window),
        )

    def forward(self, token_ids, cache) -> np.ndarray:
        """Logits ``[n, V]`` float32 (NumPy) of the ``n`` new tokens of the cache's open forward.

        ``token_ids`` : ``[n]`` int, in ``begin_forward`` order.
        """
        import tvm

        ids = np.asarray(token_ids, np.int32).reshape(1, -1)
        logits = self._forward(tvm.runtime.tensor(ids, self.device), cache, self.params)
        return logits.numpy()[0]


def tvm_shape_int(value: int):
    """An ``nn.spec`` ``int`` argument of a compiled function: it travels as a one-element Shape."""
    import tvm_ffi

    return tvm_ffi.Shape((int(value),))
