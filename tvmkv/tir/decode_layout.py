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
# fp8 pages: a byte is a whole element to convert and multiply, so the per-key work (the shuffles that
# sum a score over the TPK lanes of a key, once per query head) weighs more than with 16-bit pages; 16
# codes per lane (TPK = D / 16, twice the registers for q and O), 4 warps and 4 keys of 16 codes per
# lane group per tile measured 0.80-0.85x the time of the 16-bit pages' layout (8 codes per lane, 8
# warps, 4 keys per tile) on an H200 (paged_decode alone, 32x1024 .. 256x2048, fp16 activations,
# H_qo 32, H_kv 8, D 128; 4, 8 and 16 lanes per key, 2, 4 and 8 warps, 2, 4 and 8 keys per tile tried)
FP8_LANE_ELEMS = 16
FP8_REG_FLOATS = 64
FP8_WARPS = 4
FP8_LOAD_BYTES = 64
# fp8 pages under fp16 activations, head_dim 128: the tensor-core layout (decode_cuda, "Tensor
# cores"): a warp takes TC_GROUPS x 16 keys per tile, up to TC_MAX_HEADS query heads as the rows of
# its mma.sync m16n8k16 tiles. 2 warps of 32 keys (3 stages, decode_cuda.TC_STAGES) measured fastest
# of 1, 2, 4, 8 warps x 16, 32 keys x 2, 3, 4, 6 stages on an H200 (same shapes; bench/RESULTS.md)
TC_WARPS = 2
TC_GROUPS = 2
TC_MAX_HEADS = 8
# ... but where a decode step's blocks fill the SMs at most once (batch x blocks per sequence <= SMs,
# after the split: small batches, one long sequence), 2 warps a block leave an SM too little to keep its
# copies and products going: there 8 warps of 16 keys (128-key tiles) measured 1.3-1.9x faster through
# the public API (H200, H_qo 32, H_kv 8, D 128: 1x1024 20.6 -> 12.9 us, 1x16384 40.4 -> 20.9, 16x1024
# 22.8 -> 16.7) and slower beyond (32x1024 28.7 -> 33.1; bench/RESULTS.md). sm_90 kernel sets with
# the tensor-core decode carry both layouts; the runtime picks per step (small_batch_granule)
TC_SMALL_WARPS = 8
TC_SMALL_GROUPS = 1
# head_dim 256 stays on the CUDA cores: there the tensor-core kernel spilled registers (ptxas) and
# measured 0.93-1.15x the CUDA-core time on an H100 (32x1024, 64x4096, 128x2048; bench/RESULTS.md), and its
# 96 KiB ring would not fit sm_89's shared memory
TC_HEAD_DIMS = (128,)
# 16-bit pages (fp16 / bf16, the activation dtype) at head_dim 128 take the tensor cores too, with the
# elements as staged (no conversion; V's key pairs by __byte_perm). Twice fp8's bytes a key, so a warp
# takes TC16_GROUPS 16-key groups a tile (the fp8 layout's registers for its K / V fragments), a block
# TC16_WARPS warps, a ring of TC16_STAGES stages. Through the API on an H100 (fp16, H_qo 32, H_kv 8, page
# 16; bench/RESULTS.md) 2 warps x 16 keys, 3 stages took 0.92-1.00x SDPA's time from 32x1024 to 256x128
# and at 64x4096, where the CUDA-core decode took 1.03-1.29x; 4 warps x 16 keys (2 stages) was 5% slower
# at 64x4096, 2 warps x 32 keys 6-18% slower from 64x512 to 256x128
TC16_WARPS = 2
TC16_GROUPS = 1
TC16_STAGES = 3
SMEM_FLOATS = 8192  # the warps' partial O kept in shared memory for the final merge (32 KiB)

MERGE_MAX_SPLITS = 64  # most chunks paged_decode_split_merge merges in-kernel (more: split + merge_splits)
# ints per sequence in plan_decode's stage (tvmkv.tir.plan_ops): row, kv length before the step, first
# page new to the device table, where its new pages start, page_indptr
STAGE_COLS = 5
# ints per sequence in plan_prefill's stage: plan_decode's five, then q_indptr[b] and the new tokens
PREFILL_STAGE_COLS = 7


def decode_layout(
    spec: KernelSpec,
    num_warps: int | None = None,
    unroll: int | None = None,
    max_tpk: int | None = None,
    reg_floats: int | None = None,
    load_bytes: int | None = None,
    tensor_cores: bool | None = None,
    tc_groups: int | None = None,
):
    """Static thread layout of the CUDA decode kernel, or ``None`` where it does not apply.

    ``tensor_cores`` (default: where it applies, :func:`tensor_core_layout`: fp8 pages under fp16, fp16 /
    bf16 pages of the activation dtype, head_dim 128) picks the tensor-core layout; ``False`` the
    CUDA-core one (the kernels with a sliding window or inline RoPE).

    The knobs left ``None`` take the defaults of the page dtype: :data:`DEFAULT_WARPS`, up to 32 lanes
    per key, :data:`REG_FLOATS` and :data:`LOAD_BYTES` for 16-bit pages; the ``FP8_*`` ones for fp8.

    Returns a dict: VEC (elements per 16-byte load), TPK (lanes per key), E (elements per lane),
    KPW (keys per warp), U (keys per lane group per tile), GQ (query heads per block), NW (warps),
    KB (keys per block per tile), NGB (blocks per kv head); the tensor-core layout has TC True and
    NK (16-key groups per warp per tile), GQ, NW, KB and NGB.
    """
    if tensor_cores is not False:
        lay = tensor_core_layout(spec, num_warps, tc_groups)
        if lay is not None:
            return lay
        if tensor_cores:
            raise ValueError(
                f"tensor_cores=True for {spec.tag}: the tensor-core decode needs head_dim in {TC_HEAD_DIMS} on cuda "
                "and fp8 pages under float16 activations or float16 / bfloat16 pages of the activation dtype; leave "
                "tensor_cores unset"
            )
    D, group = spec.head_dim, spec.group
    eb = dtype_bytes(spec.page_dtype)
    fp8 = spec.fp8_pages
    if num_warps is None:
        num_warps = FP8_WARPS if fp8 else DEFAULT_WARPS
    if max_tpk is None:
        max_tpk = max(2, D // FP8_LANE_ELEMS) if fp8 else WARP
    # admission: at most REG_FLOATS elements per lane (unless given), so every page dtype takes the fast
    # path on the same head dims (fp8 pages' larger register budget only widens GQ)
    most_e = REG_FLOATS if reg_floats is None else reg_floats
    if reg_floats is None:
        reg_floats = FP8_REG_FLOATS if fp8 else REG_FLOATS
    if load_bytes is None:
        load_bytes = FP8_LOAD_BYTES if fp8 else LOAD_BYTES
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
    if tpk < 2 or E > most_e:
        return None
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
        "TC": False,
    }


def tensor_core_layout(spec: KernelSpec, num_warps: int | None = None, tc_groups: int | None = None):
    """The tensor-core decode layout of ``spec`` (cuda, head_dim in :data:`TC_HEAD_DIMS`; fp8 pages
    under fp16 activations, or pages of the activation dtype, fp16 or bf16), else ``None``: ``GQ``
    query heads per block (the largest divisor of the group up to :data:`TC_MAX_HEADS`), ``NW`` warps
    of ``16 NK`` keys per tile each."""
    if spec.target_kind != "cuda" or spec.head_dim not in TC_HEAD_DIMS:
        return None
    if spec.fp8_pages:
        if spec.dtype != "float16":
            return None
        nw = TC_WARPS if num_warps is None else num_warps
        nk = TC_GROUPS if tc_groups is None else tc_groups
    else:
        if spec.page_dtype != spec.dtype or spec.dtype not in ("float16", "bfloat16"):
            return None
        nw = TC16_WARPS if num_warps is None else num_warps
        nk = TC16_GROUPS if tc_groups is None else tc_groups
    group = spec.group
    GQ = max(x for x in range(1, min(group, TC_MAX_HEADS) + 1) if group % x == 0)
    return {"TC": True, "NK": nk, "GQ": GQ, "NW": nw, "KB": nw * 16 * nk, "NGB": group // GQ}


def small_batch_granule(spec: KernelSpec) -> tuple | None:
    """``(blocks per sequence, keys per tile)`` of the tensor-core decode's small-batch layout
    (:data:`TC_SMALL_WARPS` warps of ``16 TC_SMALL_GROUPS`` keys: the ``*_small_batch`` one-launch
    kernels), or ``None`` where ``spec`` has no tensor-core decode."""
    lay = tensor_core_layout(spec, TC_SMALL_WARPS, TC_SMALL_GROUPS)
    return None if lay is None else (spec.num_kv_heads * lay["NGB"], lay["KB"])


def split_granule(spec: KernelSpec, *, sliding: bool = False, inline_rope: bool = False) -> tuple:
    """``(blocks per sequence, keys per tile)`` of ``paged_decode_split`` for ``spec`` (of the kernel set
    with a sliding window / inline RoPE, whose fp8 decode takes the CUDA-core layout), or ``None`` where
    the target has no split kernel (cuda shapes without the fast layout). On llvm the split kernel loops
    key by key: one block per (sequence, kv head), one key per tile."""
    if spec.target_kind == "llvm":
        return spec.num_kv_heads, 1
    lay = decode_layout(spec, tensor_cores=False if (sliding or inline_rope) else None)
    if lay is None:
        return None
    return spec.num_kv_heads * lay["NGB"], lay["KB"]
