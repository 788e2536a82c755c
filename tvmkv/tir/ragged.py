"""Ragged prefill attention: new tokens attend to each other only. See docs/layout.md."""

from __future__ import annotations

from .attention_generic import build_attention
from .spec import KernelSpec

RAGGED_MASKS = ("causal", "tree")


def make_ragged_prefill(
    spec: KernelSpec,
    *,
    mask: str = "causal",
    inline_rope: bool = False,
    local: bool = False,
    arch: str | None = None,
    fused_qkv: bool = False,
):
    """Attention of the new tokens over the new tokens of the same sequence (k/v not paged).

    On cuda, fp16/bf16 causal with head_dim 64 or 128, no inline RoPE and not ``local`` use a
    tensor-core schedule: warpgroup MMA (:mod:`tvmkv.tir.prefill_hopper`) when ``arch`` is "sm_90",
    else ``mma.sync`` (:mod:`tvmkv.tir.prefill_cuda`); everything else the shared attention builder.

    Parameters (of the returned PrimFunc, in order; layouts in docs/layout.md)
    ----------
    q : [n, H_qo, D] dtype
    k, v : [n, H_kv, D] dtype
    q_indptr : [B + 1] int32
    q_pos : [n] int32
        Logical position of each token (inline RoPE: rotates q and k rows).
    q_tree : [nt, 2] int32
        DFS interval of each row's node; read only when ``mask == "tree"`` (then nt == n).
    o : [n, H_qo, D] dtype, written
    lse : [n, H_qo] float32, written (base 2)
    sm_scale, rope_scale, rope_theta : float32
    layer_window : int32 (``local`` only)
        The layer's own window ``W``: row ``j`` is visible to row ``i`` only if ``i - j < W`` (rows of
        one causal forward are consecutive positions; ``W <= 0``: no window). docs/layout.md,
        "Per-layer sliding window".

    Keyword options
    ---------------
    mask : "causal" | "tree"
        "causal": row j of the sequence is visible to row i iff j <= i; "tree": iff j's interval
        contains i's.
    inline_rope : bool
        Rotate q and k on the fly by ``q_pos``.
    local : bool
        ``ragged_prefill_causal_local``: the layer's sliding window on top of the causal mask, with the
        trailing ``layer_window`` parameter (generic schedule on every target; mask "causal" only).
    fused_qkv : bool
        ``ragged_prefill_causal_qkv``: the first three parameters become the fused ``qkv [n, H_qo + 2
        H_kv, D]`` (docs/layout.md, "Fused qkv"), from which q, k and v are read in place (rope mode
        "none": the keys need no rotation), and ``pages [num_pages, 2, H_kv, P, D]`` / ``slot [n]``
        follow ``q_tree``: the kernel also stores each token's k and v at ``slot[i]`` (negative:
        skipped), as ``append`` does. Not with ``local``.
    """
    if mask not in RAGGED_MASKS:
        raise ValueError(f"mask={mask!r} is not one of {RAGGED_MASKS}")
    if local:
        if fused_qkv:
            raise ValueError("local=True has no fused-qkv variant; pass fused_qkv=False")
        if mask != "causal":
            raise ValueError(f"mask={mask!r} has no local-window variant; local=True needs mask='causal'")
        return build_attention(spec, source="ragged", mask=mask, sliding=False, inline_rope=inline_rope, local=True)
    if spec.target_kind == "cuda":
        from .prefill_cuda import make_prefill_cuda, prefill_layout
        from .prefill_hopper import hopper_layout, make_prefill_hopper

        if hopper_layout(spec, mask=mask, arch=arch, inline_rope=inline_rope) is not None:
            return make_prefill_hopper(spec, source="ragged", mask=mask, arch=arch, fused_qkv=fused_qkv)
        if prefill_layout(spec, mask=mask, inline_rope=inline_rope) is not None:
            return make_prefill_cuda(spec, source="ragged", mask=mask, fused_qkv=fused_qkv)
    return build_attention(
        spec, source="ragged", mask=mask, sliding=False, inline_rope=inline_rope, fused_qkv=fused_qkv
    )
