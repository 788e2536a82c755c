"""The nn.Module of the tiny Llama (:mod:`tvmkv.relax.llama` has its config, weights and runner).

Needs TVM's compiler (``tvm.relax.frontend.nn``); the runner in ``llama.py`` does not.
"""

from __future__ import annotations

from tvm import relax as rx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .llama_config import INTERFACES, LlamaConfig
from .nn_cache import TvmkvKVCache


class Linear(nn.Linear):
    """``y = x W^T`` without bias, accumulated in float32 and returned in the model dtype.

    (fp16 models accumulate in fp32, as GPU GEMMs do; a float16 accumulator over 512 terms alone
    costs about 1e-2 of logit accuracy.)
    """

    def __init__(self, in_features: int, out_features: int, dtype: str, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, out_dtype="float32")
        self.model_dtype = dtype

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = super().forward(x)
        return y if self.model_dtype == "float32" else y.astype(self.model_dtype)


def _all_reduce(y: nn.Tensor, shards: int) -> nn.Tensor:
    """The sum over the tensor-parallel shards of their partial ``y`` (``R.ccl.allreduce``; none for 1)."""
    return y if shards == 1 else op.ccl_allreduce(y, "sum")


class LlamaAttention(nn.Module):
    """GQA attention through the cache. With ``shards`` > 1 this is one shard's part
    (:class:`tvmkv.ShardLayout`: its query heads and the KV heads they read, the output projection's
    matching columns), the partial outputs summed over the shards."""

    def __init__(self, cfg: LlamaConfig, layer_id: int, shards: int = 1):
        from ..runtime.sharding import ShardLayout

        lay = ShardLayout(cfg.num_qo_heads, cfg.num_kv_heads, shards)
        if shards > 1 and cfg.o_bias:
            raise NotImplementedError(
                "an output projection bias with tensor_parallel > 1 (it would be summed per shard)"
            )
        self.cfg, self.layer_id, self.shards = cfg, layer_id, shards
        self.num_qo_heads, self.num_kv_heads = lay.qo_per_shard, lay.kv_per_shard
        self.qkv_heads = lay.qo_per_shard + 2 * lay.kv_per_shard
        self.qkv_proj = Linear(cfg.hidden_size, self.qkv_heads * cfg.head_dim, cfg.dtype, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.num_qo_heads * cfg.head_dim, cfg.hidden_size, cfg.dtype, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: each head's q and k normalized (one weight of head_dim each) before RoPE
            self.q_norm = nn.RMSNorm(cfg.head_dim, -1, cfg.rms_norm_eps, bias=False, dtype=cfg.dtype)
            self.k_norm = nn.RMSNorm(cfg.head_dim, -1, cfg.rms_norm_eps, bias=False, dtype=cfg.dtype)

    def forward(self, x: nn.Tensor, paged_kv_cache) -> nn.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, self.qkv_heads, cfg.head_dim))  # [b, s, H_qo + 2 H_kv, D]
        if cfg.qk_norm:
            q, k, v = op.split(qkv, [self.num_qo_heads, self.num_qo_heads + self.num_kv_heads], axis=2)
            qkv = op.concat([self.q_norm(q), self.k_norm(k), v], dim=2)
        o = paged_kv_cache.attention_with_fused_qkv(self.layer_id, qkv, self.num_qo_heads, cfg.sm_scale)
        return _all_reduce(self.o_proj(op.reshape(o, (b, s, self.num_qo_heads * cfg.head_dim))), self.shards)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused (Llama's MLP; DeepSeek-V2's dense layers).
    With ``shards`` > 1, one shard's ``intermediate_size / shards`` columns, the outputs summed."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: str, shards: int = 1):
        if intermediate_size % shards:
            raise ValueError(f"intermediate_size={intermediate_size} does not split over {shards} shards")
        self.shards = shards
        self.gate_up_proj = Linear(hidden_size, 2 * (intermediate_size // shards), dtype)
        self.down_proj = Linear(intermediate_size // shards, hidden_size, dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return _all_reduce(self.down_proj(op.silu(gate) * up), self.shards)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, shards: int = 1):
        eps = cfg.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, eps, bias=False, dtype=cfg.dtype)
        self.self_attn = LlamaAttention(cfg, layer_id, shards)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, eps, bias=False, dtype=cfg.dtype)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.dtype, shards)

    def forward(self, x: nn.Tensor, paged_kv_cache) -> nn.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), paged_kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """The decoder. ``forward(input_ids [1, n] int32, paged_kv_cache) -> logits [1, n, V] float32``.

    ``n`` is the number of new tokens of the cache's open forward, in ``begin_forward`` order (a
    prefill chunk, a batch of one-token decodes, or a mix).

    ``tensor_parallel`` > 1: one shard of the model (attention heads and MLP columns split, the two
    projections of each layer summed over the shards with ``R.ccl.allreduce``; embedding, norms and LM
    head whole on every shard), run on every worker of a Disco session (:mod:`tvmkv.disco.model`)
    with that worker's cache shard; the weights are :func:`tvmkv.relax.llama.shard_weights`.
    """

    def __init__(self, cfg: LlamaConfig, *, target_kind: str = "llvm", tensor_parallel: int = 1):
        self.cfg = cfg
        self.target_kind = target_kind
        self.tensor_parallel = tensor_parallel
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i, tensor_parallel) for i in range(cfg.num_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=cfg.dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=cfg.dtype, out_dtype="float32")

    def forward(self, input_ids: nn.Tensor, paged_kv_cache) -> nn.Tensor:
        x = self.embed_tokens(input_ids)  # [1, n, H]
        for layer in self.layers:
            x = layer(x, paged_kv_cache)
        return self.lm_head(self.norm(x))  # [1, n, V] float32

    def create_paged_kv_cache(
        self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window
    ):
        """TVM's interface: a ``TIRPagedKVCache`` (RoPE "normal") sized at run time, as MLC-LLM models do;
        a tensor-parallel shard's holds the heads of its shard (:class:`tvmkv.ShardLayout`)."""
        import tvm
        from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

        from ..runtime.sharding import ShardLayout

        cfg = self.cfg
        lay = ShardLayout(cfg.num_qo_heads, cfg.num_kv_heads, self.tensor_parallel)
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, cfg.num_layers]),
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=lay.qo_per_shard,
            num_key_value_heads=lay.kv_per_shard,
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
