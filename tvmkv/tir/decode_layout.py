"""Static thread layout of the CUDA decode kernel (:mod:`tvmkv.tir.decode_cuda`), and the granule of
its split (flash-decoding, docs/layout.md "Split decode"), and the stage of a decode step planned on
the device (:data:`STAGE_COLS`, docs/layout.md "Device page table"). Plain Python, no TVM import: the
runtime (:mod:`tvmkv.runtime.decode_split`, :mod:`tvmkv.runtime.device_plan`) plans on a runtime-only
TVM with these (``split_granule`` exported as ``tvmkv.tir.split_granule``), and the kernels are built
from the same layout."""

from __future__ import annotations

from .spec import KernelSpec, dtype_bytes

WARP = 32  # lanes per warp (the kernels take it from here through _kernel_common)
DEFAULT_WARPS = 8
REG_FLOATS = 32  # per-lane q (and O) floats: GQ * E <= REG_FLOATS
LOAD_BYTES = 64  # per-lane K (and V) bytes loaded per tile: U * E * dtype_bytes ~ LOAD_BYTES
# fp8 pages: a byte is a whole element to convert and multiply, so half the bytes per tile (U = 4 keys
# of 8 codes at D 128) keep the work per tile of 16-bit pages; measured on an H200 (paged_decode
# alone, 32x1024 .. 256x2048, two runs): 0.83-0.95x the time of 64 bytes (U = 8), and fewer registers
FP8_LOAD_BYTES = 32
SMEM_FLOATS = 8192  # the warps' partial O kept in shared memory for the final merge (32 KiB)

MERGE_MAX_SPLITS = 64  # most chunks paged_decode_split_merge merges in-kernel (more: split + merge_splits)
# ints per sequence in plan_decode's stage (tvmkv.tir.plan_ops): row, kv length before the step, first
# page new to the device table, where its new pages start, page_indptr
STAGE_COLS = 5


def decode_layout(
    spec: KernelSpec,
    num_warps: int = DEFAULT_WARPS,
    unroll: int | None = None,
    max_tpk: int = WARP,
    reg_floats: int = REG_FLOATS,
    load_bytes: int | None = None,
):
    """Static thread layout of the CUDA decode kernel, or ``None`` where it does not apply.

    Returns a dict: VEC (elements per 16-byte load), TPK (lanes per key), E (elements per lane),
    KPW (keys per warp), U (keys per lane group per tile), GQ (query heads per block), NW (warps),
    KB (keys per block per tile), NGB (blocks per kv head).
    """
    D, group = spec.head_dim, spec.group
    eb = dtype_bytes(spec.page_dtype)
    # elements per vector load of a page row: 16 bytes; fp8 pages 8 bytes (8 codes: the widest fp8
    # vector TVM's CUDA codegen has)
    vec = (8 if spec.fp8_pages else 16) // eb
    if D % vec:
        return None
    chunks = D // vec
    tpk = 1
    while tpk < min(WARP, max_tpk) and chunks % (tpk * 2) == 0:
        tpk *= 2
    E = D // tpk
    if tpk < 2 or E > reg_floats:
        return None
    if load_bytes is None:
        load_bytes = FP8_LOAD_BYTES if spec.fp8_pages else LOAD_BYTES
    U = unroll if unroll is not None else max(1, min(8, load_bytes // (E * eb)))
    cap = max(1, min(reg_floats // E, SMEM_FLOATS // (num_warps * D)))
    GQ = max(x for x in range(1, min(group, cap) + 1) if group % x == 0)
    KPW = WARP // tpk
    return {
        "VEC": vec,
        "TPK": tpk,
        "E": E,
        "KPW": KPW,
        "U": U,
        "GQ": GQ,
        "NW": num_warps,
        "KB": num_warps * KPW * U,
        "NGB": group // GQ,
    }


def split_granule(spec: KernelSpec) -> tuple:
    """``(blocks per sequence, keys per tile)`` of ``paged_decode_split`` for ``spec``, or ``None``
    where the target has no split kernel (cuda shapes without the fast layout). On llvm the split
    kernel loops key by key: one block per (sequence, kv head), one key per tile."""
    if spec.target_kind == "llvm":
        return spec.num_kv_heads, 1
    lay = decode_layout(spec)
    if lay is None:
        return None
    return spec.num_kv_heads * lay["NGB"], lay["KB"]
