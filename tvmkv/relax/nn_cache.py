"""``TvmkvKVCache``: the ``nn.Object`` a ``tvm.relax.frontend.nn`` model holds to call tvmkv's cache.

The cache object (a :class:`tvmkv.PagedAttentionKVCache`) is an argument of the compiled function
(``nn.spec.Object(object_type=TvmkvKVCache)``); each attention layer emits one destination-passing
call of the global ``tvmkv.attention_with_fused_qkv`` (registered by :func:`tvmkv.relax.register`),
which receives the cache object itself, the layer id, the softmax scale, the fused qkv and the
VM-allocated output. Layout of qkv and the output: docs/layout.md ("Fused qkv").

An MLA model (DeepSeek-V2, :mod:`tvmkv.relax.deepseek_nn`) on a ``PagedAttentionKVCache.mla(...)``
calls instead ``append_mla_kv``, ``self_attention``, ``cross_attention`` and
``merge_attn_output_inplace`` (globals ``tvmkv.append_mla_kv`` ... ``tvmkv.merge_attn_output``).
"""

from __future__ import annotations

from tvm import relax as rx
from tvm.relax.frontend import nn

from .builtins import (
    APPEND_MLA_FUNC,
    ATTENTION_FUNC,
    CROSS_ATTENTION_FUNC,
    MERGE_FUNC,
    QUERY_POSITIONS_FUNC,
    SELF_ATTENTION_FUNC,
    SHARED_KV_FUNC,
)


class TvmkvKVCache(nn.Object):
    """Relax-side handle of a tvmkv cache (same method signature as TVM's ``PagedKVCache``)."""

    def attention_with_fused_qkv(self, layer_id: int, qkv: nn.Tensor, num_qo_heads: int, sm_scale: float):
        """Append this layer's K/V of the new tokens and attend over each sequence's cache.

        Parameters
        ----------
        layer_id : int
            Layer in ``[0, num_layers)`` of the cache.
        qkv : nn.Tensor
            ``[b, s, H_qo + 2 H_kv, D]`` in the cache dtype; ``b * s`` equals the tokens of the open
            forward, in ``begin_forward`` order (prefill: ``b = 1``; batched decode: ``s = 1``).
        num_qo_heads : int
            ``H_qo``.
        sm_scale : float
            Softmax scale (usually ``D ** -0.5``).

        Returns
        -------
        nn.Tensor
            ``[b, s, H_qo, D]`` attention output, same dtype as ``qkv``.
        """
        b, s, h, d = qkv.shape
        flat = qkv.reshape(b * s, h, d)
        call = rx.call_dps_packed(
            ATTENTION_FUNC,
            [self._expr, rx.prim_value(layer_id), rx.prim_value(float(sm_scale)), flat._expr],
            out_ty=rx.TensorType((b * s, num_qo_heads, d), qkv.dtype),
        )
        out = nn.Tensor(_expr=rx.BlockBuilder.current().emit(call))
        return out.reshape(b, s, num_qo_heads, d)

    def attention_with_shared_kv(
        self, source_layer_id: int, q: nn.Tensor, current_k: nn.Tensor, current_v: nn.Tensor, sm_scale: float
    ):
        """Attend over layer ``source_layer_id``'s K/V, appending nothing (cross-layer KV sharing).

        Same signature as TVM's ``PagedKVCache.attention_with_shared_kv``; calls the global
        ``tvmkv.attention_with_shared_kv`` (:meth:`tvmkv.PagedAttentionKVCache.attention_with_shared_kv`).
        The source layer's ``attention_with_fused_qkv`` must come first in the same forward.

        Parameters
        ----------
        source_layer_id : int
            The layer that owns the K/V (its per-layer window applies).
        q : nn.Tensor
            ``[b, s, H_qo, D]`` queries, as ``attention_with_fused_qkv`` takes them (rotated by the
            cache when its ``rope_mode`` is "normal"/"inline").
        current_k, current_v : nn.Tensor
            ``[b, s, H_kv, D]``: the source layer's K/V of the new tokens (checked for shape only; the
            source layer's pages hold them).
        sm_scale : float

        Returns
        -------
        nn.Tensor
            ``[b, s, H_qo, D]`` attention output, same dtype as ``q``.
        """
        b, s, h_qo, d = q.shape
        h_kv = current_k.shape[2]
        call = rx.call_dps_packed(
            SHARED_KV_FUNC,
            [
                self._expr,
                rx.prim_value(source_layer_id),
                rx.prim_value(float(sm_scale)),
                q.reshape(b * s, h_qo, d)._expr,
                current_k.reshape(b * s, h_kv, d)._expr,
                current_v.reshape(b * s, h_kv, d)._expr,
            ],
            out_ty=rx.TensorType((b * s, h_qo, d), q.dtype),
        )
        out = nn.Tensor(_expr=rx.BlockBuilder.current().emit(call))
        return out.reshape(b, s, h_qo, d)

    def get_query_positions(self, total_length):
        """``[total_length]`` int32 positions of the open forward's tokens (for RoPE in the model).

        Same signature as TVM's ``PagedKVCache.get_query_positions``; calls the global
        ``tvmkv.get_query_positions`` (:meth:`tvmkv.PagedAttentionKVCache.query_positions`).
        """
        call = rx.call_pure_packed(QUERY_POSITIONS_FUNC, self._expr, ty_args=rx.TensorType((total_length,), "int32"))
        return nn.Tensor(_expr=rx.BlockBuilder.current().emit(call))

    # ------------------------------------------------------------------ MLA (DeepSeek-V2)
    # Same signatures as TVM's PagedKVCache; the cache is a tvmkv.PagedAttentionKVCache.mla(...).
    def append_mla_kv(self, layer_id: int, kv: nn.Tensor) -> TvmkvKVCache:
        """Write the new tokens' MLA rows into layer ``layer_id``'s pages (``tvmkv.append_mla_kv``).

        Parameters
        ----------
        layer_id : int
        kv : nn.Tensor
            ``[b, s, 1, kv_lora_rank + qk_rope_head_dim]``: each token's normalized latent, then its
            rotated ``k_pe``; ``b * s`` tokens in ``begin_forward`` order.

        Returns
        -------
        TvmkvKVCache
            The cache after the append. Pass **it** to the layer's attention calls: that data
            dependence keeps the append (a pure call to the compiler) alive and ordered before them.
        """
        b, s, _, d = kv.shape
        call = rx.call_pure_packed(
            APPEND_MLA_FUNC, self._expr, rx.prim_value(layer_id), kv.reshape(b * s, d)._expr, ty_args=rx.AnyType()
        )
        return TvmkvKVCache(_expr=rx.BlockBuilder.current().emit(call), _name="paged_kv_cache")

    def self_attention(
        self, layer_id: int, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, sm_scale: float
    ) -> tuple[nn.Tensor, nn.Tensor]:
        """Causal attention among the forward's new tokens over the ``k`` / ``v`` given
        (``tvmkv.self_attention``; MLA's non-absorbed prefill attention).

        Parameters
        ----------
        layer_id : int
        q, k : nn.Tensor
            ``[b, s, H, Dq]``.
        v : nn.Tensor
            ``[b, s, H, Dv]``.
        sm_scale : float

        Returns
        -------
        (nn.Tensor, nn.Tensor)
            ``o [b, s, H, Dv]`` (dtype of ``q``) and ``lse [b, s, H]`` float32 (base 2; docs/layout.md).
        """
        b, s, h, dq = q.shape
        dv = v.shape[3]
        qkv = [q.reshape(b * s, h, dq), k.reshape(b * s, h, dq), v.reshape(b * s, h, dv)]
        args = [self._expr, rx.prim_value(layer_id), rx.prim_value(float(sm_scale)), *(t._expr for t in qkv)]
        return self._dps_pair(SELF_ATTENTION_FUNC, args, (b, s, h, dv), q.dtype)

    def cross_attention(
        self, layer_id: int, q: nn.Tensor, v_head_dim: int, sm_scale: float
    ) -> tuple[nn.Tensor, nn.Tensor]:
        """Absorbed MLA attention over layer ``layer_id``'s pages (``tvmkv.cross_attention``): in a
        prefill the history only, in a decode step (one token per sequence) the history and the token
        just appended (TVM's rule, :meth:`tvmkv.PagedAttentionKVCache.cross_attention`).

        Parameters
        ----------
        layer_id : int
        q : nn.Tensor
            ``[b, s, H, kv_lora_rank + qk_rope_head_dim]``: ``q_nope W_UK`` then the rotated ``q_pe``.
        v_head_dim : int
            ``kv_lora_rank`` (the output is the attention-weighted latent).
        sm_scale : float

        Returns
        -------
        (nn.Tensor, nn.Tensor)
            ``o [b, s, H, v_head_dim]`` and ``lse [b, s, H]`` float32.
        """
        b, s, h, d = q.shape
        args = [self._expr, rx.prim_value(layer_id), rx.prim_value(float(sm_scale)), q.reshape(b * s, h, d)._expr]
        return self._dps_pair(CROSS_ATTENTION_FUNC, args, (b, s, h, v_head_dim), q.dtype)

    def merge_attn_output_inplace(
        self, o_a: nn.Tensor, lse_a: nn.Tensor, o_b: nn.Tensor, lse_b: nn.Tensor
    ) -> tuple[nn.Tensor, nn.Tensor]:
        """The attention state over both key sets of ``(o_a, lse_a)`` and ``(o_b, lse_b)``
        (``tvmkv.merge_attn_output``; docs/layout.md, "Outputs and the log-sum-exp").

        TVM's method of this name merges into ``o_a`` / ``lse_a`` and returns them through a pure
        call, which Relax's memory planner cannot see as an alias; this one writes fresh
        destination-passing outputs and leaves its inputs alone. The values returned are the same.

        Parameters
        ----------
        o_a, o_b : nn.Tensor
            ``[b, s, H, D]``.
        lse_a, lse_b : nn.Tensor
            ``[b, s, H]`` float32.

        Returns
        -------
        (nn.Tensor, nn.Tensor)
            ``o [b, s, H, D]`` and ``lse [b, s, H]``.
        """
        b, s, h, d = o_a.shape
        args = [o_a.reshape(b * s, h, d), lse_a.reshape(b * s, h), o_b.reshape(b * s, h, d), lse_b.reshape(b * s, h)]
        return self._dps_pair(MERGE_FUNC, [self._expr, *(t._expr for t in args)], (b, s, h, d), o_a.dtype)

    def _dps_pair(self, func: str, args: list, o_shape: tuple, dtype: str) -> tuple[nn.Tensor, nn.Tensor]:
        """Emit the destination-passing ``func(*args, o, lse)``; returns ``o [b, s, h, d]``, ``lse [b, s, h]``."""
        b, s, h, d = o_shape
        bb = rx.BlockBuilder.current()
        out_ty = [rx.TensorType((b * s, h, d), dtype), rx.TensorType((b * s, h), "float32")]
        res = bb.emit(rx.call_dps_packed(func, args, out_ty=out_ty))
        o = nn.Tensor(_expr=bb.emit(rx.TupleGetItem(res, 0))).reshape(b, s, h, d)
        lse = nn.Tensor(_expr=bb.emit(rx.TupleGetItem(res, 1))).reshape(b, s, h)
        return o, lse
