"""The nn.Module of the tiny DeepSeek-V2-shaped model (:mod:`tvmkv.relax.deepseek` has its weights,
compiler and runner).

Needs TVM's compiler (``tvm.relax.frontend.nn``); the runner does not.

Attention per layer, MLA as DeepSeek-V2 in MLC-LLM uses TVM's ``PagedKVCache``:

- ``q = q_proj(x)`` (or ``q_b_proj(RMSNorm(q_a_proj(x)))``) split per head into ``q_nope | q_pe``;
  ``kv_a_proj_with_mqa(x)`` split into the latent ``c`` (``kv_lora_rank``, RMSNorm'd) and ``k_pe``
  (``qk_rope_head_dim``, one for all heads). The model rotates ``q_pe`` and ``k_pe`` itself at
  ``get_query_positions`` (the cache has ``rope_mode`` "none") and appends ``[c | k_pe]``
  (``append_mla_kv``).
- "extend" (any forward: prompt chunks with or without history, decode tokens mixed in): non-absorbed
  ``self_attention`` among the new tokens (``k = [kv_b_proj(c)_nope | k_pe]``, ``v = kv_b_proj(c)_v``;
  Dq = ``qk_nope + qk_rope``, Dv = ``v_head_dim``) merged with the absorbed ``cross_attention`` over the
  history.
- "prefill" (no sequence of the forward has history): the ``self_attention`` alone. MLC-LLM uses it for
  first chunks; TVM's own cache needs it (its ``cross_attention`` over no history at all leaves the
  outputs unwritten, apache-tvm 0.27 on CUDA), tvmkv's returns ``o = 0, lse = -inf`` there.
- "decode" (one token per sequence): the absorbed ``cross_attention`` alone, over the history and the
  token just appended.
- absorbed: ``q_lat = q_nope W_UK`` and ``o = o_lat W_UV^T`` per head, with ``W_UK`` / ``W_UV`` the
  ``k_nope`` / ``v`` rows of ``kv_b_proj.weight`` (sliced in the graph; one parameter, not two).
"""

from __future__ import annotations

from typing import Any

from tvm import relax as rx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .deepseek_config import INTERFACES, DeepseekConfig
from .gemma_nn import Rope
from .llama_nn import Linear, SwiGLUMLP
from .nn_cache import TvmkvKVCache

NUM_KERNEL_SLOTS = 15  # arguments [13, 28) of TVM 0.27's create call: the cache's TIR kernels
MODES = ("prefill", "extend", "decode")


def _deinterleave(x: nn.Tensor) -> nn.Tensor:
    """``[b, s, h, d]`` -> the even dims, then the odd dims (DeepSeek-V2 rotates that order half-wise)."""
    b, s, h, d = x.shape
    y = op.permute_dims(op.reshape(x, (b, s, h, d // 2, 2)), [0, 1, 2, 4, 3])
    return op.reshape(y, (b, s, h, d))


def _per_head_matmul(x: nn.Tensor, w: nn.Tensor, dtype: str) -> nn.Tensor:
    """``[n, H, a] x [H, a, c] -> [n, H, c]`` (one matrix per head), accumulated in float32."""
    y = op.matmul(op.permute_dims(x, [1, 0, 2]), w, out_dtype="float32")  # [H, n, c]
    y = op.permute_dims(y, [1, 0, 2])
    return y if dtype == "float32" else y.astype(dtype)


class DeepseekAttention(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int):
        self.cfg = cfg
        self.layer_id = layer_id
        H, dt, eps = cfg.hidden_size, cfg.dtype, cfg.rms_norm_eps
        q_out = cfg.num_heads * cfg.q_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(H, q_out, dt)
        else:
            self.q_a_proj = Linear(H, cfg.q_lora_rank, dt)
            self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank, -1, eps, bias=False, dtype=dt)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, dt)
        self.kv_a_proj_with_mqa = Linear(H, cfg.latent_dim, dt)
        self.kv_a_layernorm = nn.RMSNorm(cfg.kv_lora_rank, -1, eps, bias=False, dtype=dt)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), dt)
        self.o_proj = Linear(cfg.num_heads * cfg.v_head_dim, H, dt)

    def forward(self, x: nn.Tensor, paged_kv_cache: Any, rope: Rope, mode: str) -> tuple[nn.Tensor, Any]:
        """``x [b, s, hidden]`` -> ``([b, s, hidden], the cache after this layer's append)``; ``mode`` is
        one of :data:`MODES`."""
        cfg, layer = self.cfg, self.layer_id
        b, s, _ = x.shape
        Hn, nope, lora = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = op.split(op.reshape(q, (b, s, Hn, cfg.q_head_dim)), [nope], axis=-1)
        c, k_pe = op.split(op.reshape(self.kv_a_proj_with_mqa(x), (b, s, 1, cfg.latent_dim)), [lora], axis=-1)
        c = self.kv_a_layernorm(c)  # [b, s, 1, lora]
        q_pe, k_pe = rope(_deinterleave(q_pe)), rope(_deinterleave(k_pe))  # [b, s, Hn | 1, rope]
        paged_kv_cache = paged_kv_cache.append_mla_kv(layer, op.concat([c, k_pe], dim=-1))
        if mode == "decode":
            o = self._absorbed(q_nope, q_pe, paged_kv_cache)[0]
        elif mode == "prefill":
            o = self._plain(q_nope, q_pe, c, k_pe, paged_kv_cache)[0]
        else:
            o_self, lse_self = self._plain(q_nope, q_pe, c, k_pe, paged_kv_cache)
            o_cross, lse_cross = self._absorbed(q_nope, q_pe, paged_kv_cache)
            o = paged_kv_cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)[0]
        return self.o_proj(op.reshape(o, (b, s, Hn * cfg.v_head_dim))), paged_kv_cache

    def _plain(
        self, q_nope: nn.Tensor, q_pe: nn.Tensor, c: nn.Tensor, k_pe: nn.Tensor, paged_kv_cache: Any
    ) -> tuple[nn.Tensor, nn.Tensor]:
        """Non-absorbed self attention among the new tokens: ``(o [b, s, Hn, v], lse [b, s, Hn])``."""
        cfg = self.cfg
        b, s, Hn, nope = q_nope.shape
        kv = op.reshape(self.kv_b_proj(c), (b, s, Hn, nope + cfg.v_head_dim))
        k_nope, v = op.split(kv, [nope], axis=-1)
        k = op.concat([k_nope, op.broadcast_to(k_pe, (b, s, Hn, cfg.qk_rope_head_dim))], dim=-1)
        q = op.concat([q_nope, q_pe], dim=-1)
        return paged_kv_cache.self_attention(self.layer_id, q, k, v, cfg.sm_scale)

    def _absorbed(self, q_nope: nn.Tensor, q_pe: nn.Tensor, paged_kv_cache: Any) -> tuple[nn.Tensor, nn.Tensor]:
        """Absorbed attention over the cache's rows: ``(o [b, s, Hn, v], lse [b, s, Hn])``."""
        cfg = self.cfg
        b, s, Hn, nope = q_nope.shape
        lora, dv = cfg.kv_lora_rank, cfg.v_head_dim
        w = op.reshape(self.kv_b_proj.weight, (Hn, nope + dv, lora))
        w_uk, w_uv = op.split(w, [nope], axis=1)  # [Hn, nope, lora], [Hn, dv, lora]
        q_lat = _per_head_matmul(op.reshape(q_nope, (b * s, Hn, nope)), w_uk, cfg.dtype)  # [n, Hn, lora]
        q_abs = op.concat([op.reshape(q_lat, (b, s, Hn, lora)), q_pe], dim=-1)
        o_lat, lse = paged_kv_cache.cross_attention(self.layer_id, q_abs, lora, cfg.sm_scale)
        o = _per_head_matmul(op.reshape(o_lat, (b * s, Hn, lora)), op.permute_dims(w_uv, [0, 2, 1]), cfg.dtype)
        return op.reshape(o, (b, s, Hn, dv)), lse


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int):
        H, eps, dt = cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype
        self.input_layernorm = nn.RMSNorm(H, -1, eps, bias=False, dtype=dt)
        self.self_attn = DeepseekAttention(cfg, layer_id)
        self.post_attention_layernorm = nn.RMSNorm(H, -1, eps, bias=False, dtype=dt)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.dtype)  # dense (no experts here)

    def forward(self, x: nn.Tensor, paged_kv_cache: Any, rope: Rope, mode: str) -> tuple[nn.Tensor, Any]:
        o, paged_kv_cache = self.self_attn(self.input_layernorm(x), paged_kv_cache, rope, mode)
        x = x + o
        return x + self.mlp(self.post_attention_layernorm(x)), paged_kv_cache


class TinyDeepseek(nn.Module):
    """The decoder, with MLC-LLM's three entry points (see the module docstring for the attention of each):

    - ``prefill(input_ids [1, n] int32, paged_kv_cache) -> logits [1, n, V] float32``: a forward in
      which no sequence has history (self attention only);
    - ``extend(input_ids [1, n] int32, paged_kv_cache) -> logits [1, n, V]``: any forward (self + cross
      attention + merge);
    - ``decode(input_ids [b, 1] int32, paged_kv_cache) -> logits [b, 1, V]``: one token per sequence
      (absorbed cross attention alone). For any other forward it is wrong: the cross attention then
      reads the history only (TVM's rule).

    Tokens are those of the cache's open forward, in ``begin_forward`` order.
    """

    def __init__(self, cfg: DeepseekConfig, *, target_kind: str = "llvm"):
        self.cfg = cfg
        self.target_kind = target_kind
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList([DeepseekDecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False, dtype=cfg.dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=cfg.dtype, out_dtype="float32")

    def prefill(self, input_ids: nn.Tensor, paged_kv_cache: Any) -> nn.Tensor:
        return self._forward(input_ids, paged_kv_cache, "prefill")

    def extend(self, input_ids: nn.Tensor, paged_kv_cache: Any) -> nn.Tensor:
        return self._forward(input_ids, paged_kv_cache, "extend")

    def decode(self, input_ids: nn.Tensor, paged_kv_cache: Any) -> nn.Tensor:
        return self._forward(input_ids, paged_kv_cache, "decode")

    def _forward(self, input_ids: nn.Tensor, paged_kv_cache: Any, mode: str) -> nn.Tensor:
        cfg = self.cfg
        b, s = input_ids.shape
        rope = Rope(paged_kv_cache.get_query_positions(b * s), cfg.rope_theta, cfg.qk_rope_head_dim, cfg.dtype)
        x = self.embed_tokens(input_ids)  # [b, s, hidden]
        for layer in self.layers:
            x, paged_kv_cache = layer(x, paged_kv_cache, rope, mode)
        return self.lm_head(self.norm(x))  # [b, s, V] float32

    def create_paged_kv_cache(
        self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window
    ):
        """TVM's interface: an MLA ``PagedKVCache`` (every layer ``AttnKind.MLA``, one KV head of
        ``kv_lora_rank + qk_rope_head_dim``, v dim ``kv_lora_rank``, no RoPE in the cache), as MLC-LLM's
        DeepSeek-V2 creates it.

        On cuda it is TVM's ``TIRPagedKVCache`` (with TVM's MLA kernels). TVM 0.27 has no MLA kernels
        for llvm (``TIRPagedKVCache`` raises "MLA is not supported in TIR kernels for now"), so for
        llvm the same ``vm.builtin.paged_attention_kv_cache_create`` call is emitted here with every
        kernel slot an empty tuple: only :class:`tvmkv.relax.TvmBuiltinOverride` (which ignores the
        kernels) can run it; TVM's own create would reject it.
        """
        import tvm
        from tvm.relax.frontend.nn.llm.kv_cache import AttnKind, PagedKVCache, RopeMode, TIRPagedKVCache

        cfg = self.cfg
        if self.target_kind != "llvm":
            return TIRPagedKVCache(
                attn_kind="mla",
                max_batch_size=max_batch_size,
                max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size,
                page_size=page_size,
                support_sliding_window=support_sliding_window,
                layer_partition=rx.ShapeExpr([0, cfg.num_layers]),
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                num_key_value_heads=1,
                qk_head_dim=cfg.latent_dim,
                v_head_dim=cfg.kv_lora_rank,
                mla_original_qk_head_dim=cfg.q_head_dim,
                mla_original_v_head_dim=cfg.v_head_dim,
                rope_mode=RopeMode.NONE,
                rope_scale=1,
                rope_theta=cfg.rope_theta,
                rope_scaling={},
                rope_ext_factors=rx.prim_value(0),
                rotary_dim=cfg.qk_rope_head_dim,
                enable_disaggregation=False,
                dtype=cfg.dtype,
                target=tvm.target.Target(self.target_kind),
            )
        sizes = [max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window, 0]
        args = [
            rx.ShapeExpr(sizes),  # the 6th entry: per-layer sliding window size (no such layers)
            rx.ShapeExpr([0, cfg.num_layers]),  # layer partition: one pipeline stage
            rx.prim_value(cfg.num_heads),
            rx.prim_value(1),  # num_kv_heads: one latent row per token
            rx.prim_value(cfg.latent_dim),  # qk_head_dim
            rx.prim_value(cfg.kv_lora_rank),  # v_head_dim
            rx.ShapeExpr([int(AttnKind.MLA)] * cfg.num_layers),
            rx.prim_value(False),  # enable_disaggregation
            rx.prim_value(int(RopeMode.NONE)),
            rx.prim_value(1.0),  # rope_scale
            rx.prim_value(float(cfg.rope_theta)),
            rx.prim_value(0),  # rope_ext_factors: none
            rx.op.zeros((), cfg.dtype),  # gives the cache's dtype and device
            *[rx.Tuple([]) for _ in range(NUM_KERNEL_SLOTS)],
        ]
        call = rx.call_pure_packed("vm.builtin.paged_attention_kv_cache_create", *args, ty_args=rx.AnyType())
        return PagedKVCache(_expr=call, _name="paged_kv_cache")


def export_spec(interface: str) -> dict:
    """``export_tvm`` spec: ``prefill``, ``extend`` and ``decode`` (params packed), plus
    ``create_paged_kv_cache`` for "tvm"."""
    if interface not in INTERFACES:
        raise ValueError(f"interface={interface!r} is not one of {INTERFACES}")
    from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

    cache_cls = TvmkvKVCache if interface == "tvmkv" else PagedKVCache
    spec: dict = {
        mode: {
            "input_ids": nn.spec.Tensor(["batch_size", 1] if mode == "decode" else [1, "n"], "int32"),
            "paged_kv_cache": nn.spec.Object(object_type=cache_cls),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
        for mode in MODES
    }
    if interface == "tvm":
        sizes = ("max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size", "support_sliding_window")
        spec["create_paged_kv_cache"] = {
            **{name: int for name in sizes},
            "$": {"param_mode": "none", "effect_mode": "none"},
        }
    return spec
