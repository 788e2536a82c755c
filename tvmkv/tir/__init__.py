"""TIR kernel factories, one module per family. See docs/layout.md for every array's layout.

Each factory is a pure function of a :class:`KernelSpec` (plus keyword-only variant flags) that
returns a ``tvm.tirx.PrimFunc`` with runtime sizes symbolic. Nothing here compiles or does I/O;
``tvmkv.build`` does that. Every kernel role has one signature (a ``*_func(spec, body)`` builder);
the llvm and cuda schedules are macros passed to it.

Modules:

* ``spec``: :class:`KernelSpec`, the static parameters.
* ``_kernel_common``: the helpers every family shares (the macro decorator, named state slots,
  function attributes, the data-movement CUDA block shape, the RoPE frequency).
* ``fp8``: fp8 pages (``KernelSpec.kv_dtype``): the quantize / dequantize expressions every kernel
  that writes or reads pages uses, and the ``kv_scale`` parameter it takes after ``pages``.
* attention: ``attention`` (the signatures of paged prefill, ragged prefill, paged decode and its
  split), ``attention_generic`` (the generic schedule, llvm and cuda), ``prefill_cuda``,
  ``prefill_hopper`` (sm_90: warpgroup MMA) and ``decode_cuda`` (the fast CUDA schedules),
  ``prefill`` / ``ragged`` / ``decode`` (the factories, which pick the schedule, by target and arch;
  ``decode`` also holds the llvm split decode), ``decode_layout`` (the CUDA decode's static layout
  and :func:`split_granule`, :func:`small_batch_granule`; no TVM import).
* data movement: ``append`` (and ``append_qkv``, reading the fused qkv), ``rope`` (``split_rope``,
  ``rope_q``, ``split_rope_append`` = split_rope + append in one kernel; their RoPE variants are described
  by ``rope_scaling``'s :class:`RopeScaling`, plain Python), ``merge`` (``merge_state``,
  ``merge_splits``), ``page_ops`` (``copy_page``, ``copy_page_layers``, ``compact_copy``, ``gather``, ``gather_pages``,
  ``scatter_pages``; with fp8 pages ``requantize_pages``).
* interop family (built lazily, not in :func:`kernel_set`): ``interop`` (copies to and from foreign
  layouts) and ``foreign_layouts`` (:data:`LAYOUTS`, :func:`foreign_shape`; no TVM import).

Importing this package does not import TVM's compiler: the exports below are plain Python.
"""

from __future__ import annotations

from .decode_layout import small_batch_granule, split_granule
from .foreign_layouts import LAYOUTS, foreign_shape
from .rope_scaling import RopeScaling
from .spec import KernelSpec, dtype_bytes

ROPE_MODES = ("none", "normal", "inline")


def kernel_set(
    spec: KernelSpec,
    *,
    rope_mode: str = "none",
    sliding: bool = False,
    local: bool = False,
    rope_scaling=None,
    arch: str | None = None,
) -> dict:
    """Every kernel one cache configuration needs, by name (the names ``tvmkv.runtime`` calls).

    ``rope_mode`` "normal" makes ``split_rope`` (and ``rope_q``) rotate q and k; "inline" makes the
    attention kernels rotate inside; ``sliding`` selects the sliding-window/attention-sink attention
    variants; ``local`` adds ``paged_prefill_causal_local``, ``ragged_prefill_causal_local`` and
    ``paged_decode_local``, the per-layer sliding window variants (docs/layout.md, "Per-layer sliding
    window"; each takes its base kernel's arguments plus a trailing int32 ``layer_window``).
    ``rope_scaling`` (a resolved :class:`tvmkv.tir.rope_scaling.RopeScaling`, with rope mode "normal"
    only; None: the default RoPE over the whole head) is the RoPE variant ``split_rope`` and
    ``rope_q`` bake in. ``arch`` (cuda only, e.g. "sm_90") lets the prefill kernels use the
    instructions of that architecture (sm_90: warpgroup MMA, :mod:`tvmkv.tir.prefill_hopper`).
    Rope mode "none" adds ``append_qkv``, ``paged_prefill_causal_qkv`` and
    ``ragged_prefill_causal_qkv``: a prefill that reads q (and, ragged, k and v) straight from the
    fused qkv, so it needs no ``split_rope``; the ragged one also stores the new K/V (docs/layout.md,
    "Fused qkv"). On cuda, ``paged_decode_append[_split]`` run a decode layer in one launch; where that
    decode runs on the tensor cores (fp8 pages under fp16, fp16 / bf16 pages at head_dim 128) and
    ``arch`` is sm_90, ``paged_decode_append[_split]_small_batch`` do the same with the layout of steps
    whose blocks fill the SMs at most once (:func:`small_batch_granule`).
    """
    from . import append, decode, merge, page_ops, plan_ops, prefill, ragged, rope
    from ._kernel_common import func_attrs

    if rope_mode not in ROPE_MODES:
        raise ValueError(f"rope_mode={rope_mode!r} is not one of {ROPE_MODES}")
    inline = rope_mode == "inline"
    if rope_scaling is not None and rope_mode != "normal":
        raise NotImplementedError(
            f"rope_scaling {rope_scaling.tag} with rope_mode={rope_mode!r}: RoPE variants are applied by split_rope "
            "in rope_mode 'normal' only; use rope_mode='normal'"
        )
    kernels = {
        "append": append.make_append(spec),
        "split_rope": rope.make_split_rope(spec, rotate=rope_mode == "normal", rope_scaling=rope_scaling),
        "rope_q": rope.make_rope_q(spec, rotate=rope_mode == "normal", rope_scaling=rope_scaling),
        "paged_prefill_none": prefill.make_paged_prefill(
            spec, mask="none", sliding=sliding, inline_rope=inline, arch=arch
        ),
        "paged_prefill_causal": prefill.make_paged_prefill(
            spec, mask="causal", sliding=sliding, inline_rope=inline, arch=arch
        ),
        "paged_prefill_tree": prefill.make_paged_prefill(spec, mask="tree", sliding=sliding, inline_rope=inline),
        "paged_decode": decode.make_paged_decode(spec, sliding=sliding, inline_rope=inline),
        "ragged_prefill_causal": ragged.make_ragged_prefill(spec, mask="causal", inline_rope=inline, arch=arch),
        "ragged_prefill_tree": ragged.make_ragged_prefill(spec, mask="tree", inline_rope=inline),
        "paged_decode_split": decode.make_paged_decode_split(spec, sliding=sliding, inline_rope=inline),
        "paged_decode_split_merge": decode.make_paged_decode_split_merge(spec, sliding=sliding, inline_rope=inline),
        "merge_state": merge.make_merge_state(spec),
        "merge_splits": merge.make_merge_splits(spec),
        "copy_page": page_ops.make_copy_page(spec),
        "copy_page_layers": page_ops.make_copy_page_layers(
            2 * spec.num_kv_heads,
            spec.page_size,
            spec.head_dim * dtype_bytes(spec.page_dtype),
            is_cpu=spec.is_cpu,
            attrs=func_attrs(spec),
        ),
        "compact_copy": page_ops.make_compact_copy(spec),
        "gather": page_ops.make_gather(spec),
        "gather_pages": page_ops.make_gather_pages(spec),
        "scatter_pages": page_ops.make_scatter_pages(spec),
        "plan_decode": plan_ops.make_plan_decode(spec),
        "plan_prefill": plan_ops.make_plan_prefill(spec),
    }
    if spec.fp8_pages:  # re-encode stored codes under new scales (calibration, imports)
        kernels["requantize_pages"] = page_ops.make_requantize_pages(spec)
    if rope_scaling is None:  # split + rotate + append in one launch (forwards whose attention reads the pages)
        kernels["split_rope_append"] = rope.make_split_rope(spec, rotate=rope_mode == "normal", into_pages=True)
        for name, split in (("paged_decode_append", False), ("paged_decode_append_split", True)):
            f = decode.make_paged_decode_append(
                spec, sliding=sliding, inline_rope=inline, rotate=rope_mode == "normal", split=split
            )
            # cuda, fast decode layout: 16-bit pages, fp8 pages on the tensor cores (the other fp8 layouts:
            # None, split_rope_append + paged_decode)
            if f is not None and kernels["paged_decode_split"] is not None:
                kernels[name] = f
                # the tensor-core decode's layout for steps of few blocks: sm_90 only (measured there; its
                # 96 KiB ring plus the warps' partial states pass sm_89's 99 KiB of shared memory a block)
                small = (
                    decode.make_paged_decode_append(
                        spec,
                        sliding=sliding,
                        inline_rope=inline,
                        rotate=rope_mode == "normal",
                        split=split,
                        small_batch=True,
                    )
                    if arch == "sm_90"
                    else None
                )
                if small is not None:
                    kernels[name + "_small_batch"] = small
    if rope_mode == "none":  # prefill reading q / k / v from the fused qkv in place (no split_rope)
        kernels["append_qkv"] = append.make_append(spec, fused_qkv=True)
        kernels["paged_prefill_causal_qkv"] = prefill.make_paged_prefill(
            spec, mask="causal", sliding=sliding, arch=arch, fused_qkv=True
        )
        kernels["ragged_prefill_causal_qkv"] = ragged.make_ragged_prefill(
            spec, mask="causal", arch=arch, fused_qkv=True
        )
    if kernels["paged_decode_split"] is None:  # cuda shapes without the fast decode layout: no split
        del kernels["paged_decode_split"]
    if kernels["paged_decode_split_merge"] is None:  # llvm, or no split: split + merge_splits
        del kernels["paged_decode_split_merge"]
    if local:
        kernels["paged_prefill_causal_local"] = prefill.make_paged_prefill(
            spec, mask="causal", sliding=sliding, inline_rope=inline, local=True
        )
        kernels["ragged_prefill_causal_local"] = ragged.make_ragged_prefill(
            spec, mask="causal", inline_rope=inline, local=True
        )
        kernels["paged_decode_local"] = decode.make_paged_decode(spec, sliding=sliding, inline_rope=inline, local=True)
    return kernels


__all__ = [
    "KernelSpec",
    "RopeScaling",
    "kernel_set",
    "ROPE_MODES",
    "split_granule",
    "small_batch_granule",
    "LAYOUTS",
    "foreign_shape",
]
