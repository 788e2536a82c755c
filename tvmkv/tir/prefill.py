"""Paged prefill attention: new tokens attend to their sequence's pages. See docs/layout.md."""

from __future__ import annotations

from .attention_generic import build_attention
from .spec import KernelSpec

PREFILL_MASKS = ("none", "causal", "tree")


def uses_warpgroup_mma(
    spec: KernelSpec, *, mask: str, sliding: bool = False, inline_rope: bool = False, arch: str | None = None
) -> bool:
    """Whether :func:`make_paged_prefill` builds the warpgroup-MMA schedule
    (:mod:`tvmkv.tir.prefill_hopper`) for these options: cuda, sm_90 and its shapes (16-bit or fp8 pages)."""
    if spec.target_kind != "cuda":
        return False
    from .prefill_hopper import hopper_layout

    return hopper_layout(spec, mask=mask, arch=arch, sliding=sliding, inline_rope=inline_rope) is not None


def make_paged_prefill(
    spec: KernelSpec,
    *,
    mask: str = "causal",
    sliding: bool = False,
    inline_rope: bool = False,
    local: bool = False,
    arch: str | None = None,
    fused_qkv: bool = False,
):
    """Attention of ragged queries over paged K/V (history + this forward's tokens, already appended).

    On cuda, fp16/bf16 with head_dim 64 or 128, mask "none"/"causal", no sliding window, no
    inline RoPE and not ``local`` use a tensor-core schedule: warpgroup MMA
    (:mod:`tvmkv.tir.prefill_hopper`) when ``arch`` is "sm_90", else ``mma.sync``
    (:mod:`tvmkv.tir.prefill_cuda`); everything else the shared attention builder.

    Parameters (of the returned PrimFunc, in order; layouts in docs/layout.md)
    ----------
    q : [n, H_qo, D] dtype
    q_indptr : [B + 1] int32
    q_pos : [n] int32
        Logical position of each query row (causal mask, inline RoPE).
    pages : [num_pages, 2, H_kv, P, D] dtype
    page_indptr : [B + 1] int32
    page_indices : [nnz] int32
    last_page_len : [B] int32
    kv_window : [B, 3] int32
        (sink_end, window_start, window_pos_offset); read only when ``sliding``.
    q_tree : [nt, 2] int32
    kv_tree_indptr : [bt] int32
    kv_tree : [m, 3] int32
    kv_tree_start : [bs] int32
        Token-tree arrays, read only when ``mask == "tree"`` (then nt == n, bt == B + 1, bs == B);
        other variants accept 1-element dummies.
    o : [n, H_qo, D] dtype, written
    lse : [n, H_qo] float32, written
        Base-2 log-sum-exp of the scaled scores; -inf (and o = 0) for a row that sees no key.
    sm_scale, rope_scale, rope_theta : float32
    layer_window : int32 (``local`` only)
        The layer's own window ``W``: slot ``j`` is visible only if ``q_pos[i] - pos(j) < W``
        (``W <= 0``: no window). docs/layout.md, "Per-layer sliding window".

    Keyword options
    ---------------
    mask : "none" | "causal" | "tree"
        "none": every valid slot; "causal": valid slots with pos(j) <= q_pos[i]; "tree": committed
        slots plus the ancestors-or-self of the row's node.
    sliding : bool
        Honour the sliding window / attention sink of ``kv_window``.
    inline_rope : bool
        Rotate q and K on the fly (K stored raw).
    local : bool
        ``paged_prefill_causal_local``: the layer's sliding window on top of the causal mask, with the
        trailing ``layer_window`` parameter (generic schedule on every target; mask "causal" only).
    fused_qkv : bool
        ``paged_prefill_<mask>_qkv``: the first parameter is the fused ``qkv [n, H_qo + 2 H_kv, D]``
        (docs/layout.md, "Fused qkv") and q is read from its query heads in place. Not with ``local``.
    """
    if mask not in PREFILL_MASKS:
        raise ValueError(f"mask={mask!r} is not one of {PREFILL_MASKS}")
    if local:
        if fused_qkv:
            raise ValueError("local=True has no fused-qkv variant; pass fused_qkv=False")
        if mask != "causal":
            raise ValueError(f"mask={mask!r} has no local-window variant; local=True needs mask='causal'")
        return build_attention(spec, source="paged", mask=mask, sliding=sliding, inline_rope=inline_rope, local=True)
    if spec.target_kind == "cuda":
        from .prefill_cuda import make_prefill_cuda, prefill_layout
        from .prefill_hopper import make_prefill_hopper

        # (fp8 pages: both schedules convert the codes on their way into shared memory)
        if uses_warpgroup_mma(spec, mask=mask, sliding=sliding, inline_rope=inline_rope, arch=arch):
            return make_prefill_hopper(spec, source="paged", mask=mask, arch=arch, fused_qkv=fused_qkv)
        if prefill_layout(spec, mask=mask, sliding=sliding, inline_rope=inline_rope) is not None:
            return make_prefill_cuda(spec, source="paged", mask=mask, fused_qkv=fused_qkv)
    return build_attention(
        spec, source="paged", mask=mask, sliding=sliding, inline_rope=inline_rope, fused_qkv=fused_qkv
    )
