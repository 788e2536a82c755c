"""Static thread layout of the CUDA MLA attention kernels (:mod:`tvmkv.tir.mla`) and the granule of
their split (flash-decoding over latent rows). Plain Python, no TVM import: the runtime plans a decode
step's split in ``begin_forward`` on a runtime-only TVM with :func:`mla_split_granule`, and the kernels
are built from the same constants (as :mod:`tvmkv.tir.decode_layout` does for MHA decode)."""

from __future__ import annotations

from .spec import MlaSpec

TK = 32  # keys per tile of the cuda kernels (one per lane)
GPU_HEADS = 16  # heads per CUDA thread block of the SIMT mla_attention (they share every latent tile)
TC_MAX_HEADS = 64  # heads per block of the tensor-core mla_attention (a multiple of 16 dividing H)
QS_BYTES = 64 * 1024  # cap on the shared memory of the block's fp32 queries
TC_STAGES = 2  # latent tiles in flight or in use per block of the tensor-core mla_attention
SHARED_PER_SM = {"8.0": 164, "8.7": 164, "9.0": 228}  # KiB of shared memory per SM by compute capability (else 100)
SHARED_RESERVED = 1024  # bytes of shared memory the driver reserves per block
TENSOR_CORE_DTYPES = ("float16", "bfloat16")  # the mma.sync m16n8k16 operand types


def divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap``."""
    return max(x for x in range(1, min(n, cap) + 1) if n % x == 0)


def use_tensor_cores(spec: MlaSpec) -> bool:
    """Whether cuda ``mla_attention`` of ``spec`` takes the tensor-core schedule (fp16 / bf16, heads a
    multiple of 16, ``D_v`` a multiple of 64); other shapes use the SIMT schedule."""
    return (
        spec.target_kind == "cuda"
        and spec.dtype in TENSOR_CORE_DTYPES
        and spec.num_heads % 16 == 0
        and spec.latent_dim % 64 == 0
    )


def tc_head_tiles(spec: MlaSpec) -> int:
    """16-head tiles per block of the default tensor-core schedule (at most ``TC_MAX_HEADS`` heads)."""
    return divisor_at_most(max(spec.num_heads // 16, 1), TC_MAX_HEADS // 16)


def tc_shared_words(spec: MlaSpec, head_tiles: int) -> tuple:
    """``(tile_words, q_words)``: 32-bit words of one latent tile stage (``TK`` rows padded to ``D + 8``)
    and of the block's queries (reused for the partial scores) in the tensor-core schedule's dynamic
    shared memory (``stages * tile_words + q_words`` in all)."""
    ks = spec.head_dim + 8
    return TK * ks // 2, max(16 * head_tiles * ks // 2, 4 * head_tiles * 16 * 32)


def mla_blocks_per_sm(spec: MlaSpec, compute_version: str) -> int:
    """Thread blocks of the default cuda ``mla_attention`` one SM holds at once (shared memory and
    threads; registers are assumed to fit), for the split plan: a grid of this many blocks per SM keeps
    every SM's latency hiding busy (H 16 at sm_90: 2 blocks of 4 warps; H 128: 1 of 16)."""
    if not use_tensor_cores(spec):
        return 1
    tiles = tc_head_tiles(spec)
    tile_words, q_words = tc_shared_words(spec, tiles)
    # dynamic shared memory, the static slot / visibility tables of the ring and the driver's reserve
    block_bytes = 4 * (TC_STAGES * tile_words + q_words) + 2 * 4 * (TC_STAGES + 1) * TK + SHARED_RESERVED
    threads = 4 * 32 * tiles  # 4 warps per 16-head tile
    return max(1, min(SHARED_PER_SM.get(compute_version, 100) * 1024 // block_bytes, 2048 // threads))


def mla_split_granule(spec: MlaSpec) -> tuple:
    """``(blocks_per_seq, tile_keys)`` of cuda ``mla_attention_split`` for ``spec``: the thread blocks one
    query row's chunk runs and the keys per latent tile (what :func:`tvmkv.runtime.decode_split.plan_split`
    takes): blocks of ``TC_MAX_HEADS`` heads at most on tensor cores, of ``GPU_HEADS`` heads (fewer when
    the fp32 queries would not fit ``QS_BYTES``) on the SIMT schedule."""
    if use_tensor_cores(spec):
        return spec.num_heads // (16 * tc_head_tiles(spec)), TK
    H, D = spec.num_heads, spec.head_dim
    return H // divisor_at_most(H, min(GPU_HEADS, max(1, QS_BYTES // (4 * D)))), TK
