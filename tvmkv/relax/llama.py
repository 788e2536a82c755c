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

import numpy as np

from .llama_config import INTERFACES, LlamaConfig

__all__ = ["INTERFACES", "LlamaConfig", "RelaxLlama", "compile_llama", "make_weights", "param_dtype", "shard_weights"]


def param_dtype(name: str, cfg: LlamaConfig) -> str:
    """The dtype the compiled model takes parameter ``name`` in: a projection's bias is added to its float32
    accumulator (:class:`~tvmkv.relax.llama_nn.Linear`), so it stays float32; the rest are ``cfg.dtype``."""
    return "float32" if name.endswith("_proj.bias") else cfg.dtype


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
        if cfg.qkv_bias:
            w[p + "self_attn.qkv_proj.bias"] = (0.1 * rng.standard_normal(cfg.qkv_heads * D)).astype(np.float32)
        if cfg.o_bias:
            w[p + "self_attn.o_proj.bias"] = (0.1 * rng.standard_normal(H)).astype(np.float32)
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(D)
            w[p + "self_attn.k_norm.weight"] = norm(D)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "mlp.gate_up_proj.weight"] = linear(2 * I, H)
        w[p + "mlp.down_proj.weight"] = linear(H, I)
    w["norm.weight"] = norm(H)
    w["lm_head.weight"] = linear(V, H)
    return w


def shard_weights(weights: dict, cfg: LlamaConfig, shards: int, shard: int) -> dict:
    """Shard ``shard`` of ``shards`` of :func:`make_weights`'s weights, for the model compiled with
    ``tensor_parallel=shards``: the QKV projection's rows of its heads (:meth:`ShardLayout.qkv_rows`:
    its query heads, then its KV heads' k and v, a KV head repeated where it is replicated), the output
    projection's columns of its query heads, the MLP's ``intermediate_size / shards`` gate, up and down
    columns; the rest whole."""
    from ..runtime.sharding import ShardLayout

    lay = ShardLayout(cfg.num_qo_heads, cfg.num_kv_heads, shards)
    D, I = cfg.head_dim, cfg.intermediate_size  # noqa: E741
    if I % shards:
        raise ValueError(f"intermediate_size={I} does not split over {shards} shards")
    rows = (lay.qkv_rows(shard)[:, None] * D + np.arange(D)).reshape(-1)
    q_cols = slice(lay.qo_heads(shard).start * D, lay.qo_heads(shard).stop * D)
    i0, i1 = shard * I // shards, (shard + 1) * I // shards
    out = {}
    for name, w in weights.items():
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            w = w[rows]
        elif name.endswith("self_attn.o_proj.weight"):
            w = w[:, q_cols]
        elif name.endswith("mlp.gate_up_proj.weight"):
            w = np.concatenate([w[i0:i1], w[I + i0 : I + i1]])
        elif name.endswith("mlp.down_proj.weight"):
            w = w[:, i0:i1]
        out[name] = np.ascontiguousarray(w)
    return out


# ---------------------------------------------------------------------------- compile + run
def target_of(target_kind: str, cuda_arch: str | None = None):
    """``tvm.target.Target`` for "llvm" (generic CPU: a portable model library) or "cuda" (arch default:
    :func:`tvmkv.target.default_cuda_arch`)."""
    import tvm

    from ..target import make_target

    if target_kind == "llvm":
        return tvm.target.Target("llvm")
    if target_kind == "cuda":
        return make_target("cuda", cuda_arch)
    raise ValueError(f"target={target_kind!r} must be 'llvm' or 'cuda'")


def compile_llama(
    cfg: LlamaConfig,
    *,
    interface: str = "tvmkv",
    target: str = "llvm",
    cuda_arch: str | None = None,
    tensor_parallel: int = 1,
):
    """Export and compile the model; returns ``(executable, param_names)``.

    ``param_names`` lists the weights in the order the compiled ``forward`` takes them (keys of
    :func:`make_weights`). For "cuda" the Relax default GPU pipeline (DLight schedules) is used.
    ``tensor_parallel`` > 1 compiles one shard of the model (:class:`~tvmkv.relax.llama_nn.TinyLlama`),
    which runs on every worker of a Disco session.
    """
    import tvm

    from .llama_nn import TinyLlama, export_spec

    spec = export_spec(interface)
    model = TinyLlama(cfg, target_kind=target, tensor_parallel=tensor_parallel)
    mod, named_params = model.export_tvm(spec=spec)
    tgt = target_of(target, cuda_arch)
    pipeline = cuda_pipeline(tgt) if target == "cuda" else "default"
    ex = tvm.compile(mod, target=tgt, relax_pipeline=pipeline)
    return ex, [name for name, _ in named_params]


def cuda_pipeline(target):
    """TVM's default CUDA Relax pipeline, with DLight's tensor-core matmul rule switched off.

    In apache-tvm 0.27 ``tensorize`` segfaults (shared/TENSORCORE.md), and DLight's ``gpu.Matmul``
    hands fp16 matmuls to it; the PrimFunc attribute ``dlight.do_not_tensorize`` makes it fall back to
    its SIMT schedule.
    """
    import tvm
    from tvm.relax.backend.cuda import pipeline as cuda

    @tvm.transform.module_pass(opt_level=0)
    def no_tensorize(mod, _ctx):
        for gv, func in list(mod.functions.items()):
            if isinstance(func, tvm.tirx.PrimFunc):
                mod[gv] = func.with_attr("dlight.do_not_tensorize", True)
        return mod

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod, _ctx):
        legalize = cuda.legalize_passes(target)
        with target:
            seq = tvm.transform.Sequential(
                cuda.library_dispatch_passes(target)
                + legalize[:-1]  # all but DLight's ApplyDefaultSchedule, which runs after the attribute
                + [no_tensorize, legalize[-1]]
                + cuda.dataflow_lower_passes(target)
                + cuda.finalize_passes(target)
            )
            return seq(mod)

    return _pipeline


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

    def __init__(self, executable, param_names, weights, cfg: LlamaConfig, device, *, interface: str = "tvmkv"):
        import tvm
        from tvm.runtime.vm import VirtualMachine  # no compiler needed (runtime-only TVM on a GPU machine)

        from .builtins import register

        if interface == "tvmkv":
            register()
        self.cfg = cfg
        self.device = device
        self.interface = interface
        missing = [n for n in param_names if n not in weights]
        if missing:
            raise KeyError(f"weights lack {missing[:3]}...; build them with make_weights(cfg)")
        self.params = [tvm.runtime.tensor(weights[n].astype(param_dtype(n, cfg)), device) for n in param_names]
        self.vm = VirtualMachine(executable, device)
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
