"""``TvmkvKVCache``: the ``nn.Object`` a ``tvm.relax.frontend.nn`` model holds to call tvmkv's cache.

The cache object (a :class:`tvmkv.PagedAttentionKVCache`) is an argument of the compiled function
(``nn.spec.Object(object_type=TvmkvKVCache)``); each attention layer emits one destination-passing
call of the global ``tvmkv.attention_with_fused_qkv`` (registered by :func:`tvmkv.relax.register`),
which receives the cache object itself, the layer id, the softmax scale, the fused qkv and the
VM-allocated output. Layout of qkv and the output: docs/layout.md ("Fused qkv").
"""

from __future__ import annotations

from tvm import relax as rx
from tvm.relax.frontend import nn

from .builtins import ATTENTION_FUNC, QUERY_POSITIONS_FUNC, SHARED_KV_FUNC


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
