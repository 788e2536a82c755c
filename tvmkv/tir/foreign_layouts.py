"""Names, shapes and element index of the foreign KV layouts ``tvmkv.interop`` converts to and from
(docs/layout.md, "Foreign layouts"). Plain Python, no TVM import, so the runtime can use it on a
runtime-only TVM (``LAYOUTS`` and ``foreign_shape`` are exported as ``tvmkv.tir.LAYOUTS`` /
``tvmkv.tir.foreign_shape``); the copy kernels of :mod:`tvmkv.tir.interop` index with the same
:func:`foreign_index`."""

from __future__ import annotations

from .spec import KernelSpec

PAGED_LAYOUTS = ("ksana", "nhd", "hnd")
LAYOUTS = PAGED_LAYOUTS + ("contiguous",)


def foreign_index(layout: str, layer, b, kv, h, j, d) -> tuple:
    """Index into a paged foreign array of element (block ``b``, kv, head ``h``, offset ``j``, ``d``)."""
    if layout == "ksana":
        return (b, kv, layer, j, h, d)
    if layout == "nhd":
        return (layer, b, kv, j, h, d)
    if layout == "hnd":
        return (layer, b, kv, h, j, d)
    raise ValueError(f"layout={layout!r} is not a paged layout; use one of {PAGED_LAYOUTS}")


def foreign_shape(layout: str, num_blocks, num_layers, spec: KernelSpec) -> tuple:
    """Shape of a paged foreign array of ``num_blocks`` blocks (or the contiguous one of
    ``num_blocks`` tokens) holding ``num_layers`` layers."""
    H, P, D = spec.num_kv_heads, spec.page_size, spec.head_dim
    if layout == "contiguous":
        return (num_layers, 2, num_blocks, H, D)
    return tuple(  # the index order of foreign_index, applied to the axis sizes
        {"b": num_blocks, "kv": 2, "l": num_layers, "h": H, "j": P, "d": D}[axis]
        for axis in foreign_index(layout, "l", "b", "kv", "h", "j", "d")
    )
