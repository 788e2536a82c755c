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

from .builtins import ATTENTION_FUNC


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
