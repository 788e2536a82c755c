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
WG_ARCHS = ("sm_90",)  # archs whose mla_attention runs on warpgroup MMA (tvmkv.tir.mla_hopper)
WG_HEADS = (16, 32)  # heads per block it supports (wgmma's N; 32: 128 O^T registers a thread at D_v 512)
WG_KEYS = 48  # keys per latent tile (wgmma's M is 64: the rows past them are read and masked)
WG_STAGES = 3  # latent tiles in shared memory (stages - 1 on their way from memory while one is computed)
WG_TILE_KEYS = (32, 48, 64)
WG_PRODUCER = True  # a second warpgroup of the block issues the latent copies (warp specialization)
WG_TMA = True  # ... as bulk tensor copies (TMA) where the page size allows (tvmkv.tir.mla_hopper)
WG_SMEM_LIMIT = 227 * 1024  # dynamic shared memory an sm_90 block may opt into
WG_ALIGN = 1024  # the 128-byte swizzle repeats every 1024 bytes: tiles start on that boundary


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


def wg_shared_bytes(spec: MlaSpec, heads: int, keys: int = WG_KEYS, stages: int = WG_STAGES) -> int:
    """Dynamic shared memory of a warpgroup-MMA block of ``heads`` heads with ``stages`` latent tiles of
    ``keys`` rows: Q, P^T (64 keys a head), the tiles, the ``64 - keys`` rows wgmma reads past the last
    one, and the pad that moves them all to a 1024-byte boundary."""
    D = spec.head_dim
    return 2 * (heads * D + heads * 64 + stages * keys * D + (64 - keys) * 64) + WG_ALIGN


def wg_default_heads(spec: MlaSpec) -> int:
    """Heads per block of the warpgroup-MMA schedule by default: 32 where ``H`` allows (each latent
    tile is read by fewer blocks), else 16."""
    return 32 if spec.num_heads % 32 == 0 else 16


def wgmma_heads(
    spec: MlaSpec, arch: str | None, heads: int | None = None, keys: int = WG_KEYS, stages: int = WG_STAGES
) -> int:
    """Heads per block of the sm_90 warpgroup-MMA schedule of cuda ``mla_attention`` for ``spec`` built
    for ``arch`` (``heads``: a requested count, default :func:`wg_default_heads`; ``keys`` / ``stages``:
    the latent tiles), or 0 where another schedule runs: it needs the tensor-core shapes
    (:func:`use_tensor_cores`), ``D`` a multiple of 64 (whole 128-byte swizzle atoms) and the block's
    shared memory within the sm_90 limit."""
    if arch not in WG_ARCHS or not use_tensor_cores(spec) or spec.head_dim % 64:
        return 0
    hb = heads or wg_default_heads(spec)
    if (
        hb not in WG_HEADS
        or spec.num_heads % hb
        or keys not in WG_TILE_KEYS
        or stages < 2
        or wg_shared_bytes(spec, hb, keys, stages) > WG_SMEM_LIMIT
    ):
        return 0
    return hb


def tc_head_tiles(spec: MlaSpec) -> int:
    """16-head tiles per block of the default tensor-core schedule (at most ``TC_MAX_HEADS`` heads)."""
    return divisor_at_most(max(spec.num_heads // 16, 1), TC_MAX_HEADS // 16)


def tc_shared_words(spec: MlaSpec, head_tiles: int) -> tuple:
    """``(tile_words, q_words)``: 32-bit words of one latent tile stage (``TK`` rows padded to ``D + 8``)
    and of the block's queries (reused for the partial scores) in the tensor-core schedule's dynamic
    shared memory (``stages * tile_words + q_words`` in all)."""
    ks = spec.head_dim + 8
    return TK * ks // 2, max(16 * head_tiles * ks // 2, 4 * head_tiles * 16 * 32)


def mla_blocks_per_sm(spec: MlaSpec, compute_version: str, arch: str | None = None) -> int:
    """Thread blocks of the default cuda ``mla_attention`` (built for ``arch``) one SM holds at once
    (shared memory and threads; registers are assumed to fit), for the split plan: a grid of this many
    blocks per SM keeps every SM's latency hiding busy (mma.sync at H 16: 2 blocks of 4 warps; H 128: 1
    of 16; warpgroup MMA at D 576: 1 block of 8 warps, its three latent tiles take 162 KB)."""
    if not use_tensor_cores(spec):
        return 1
    hb = wgmma_heads(spec, arch)
    if hb:
        ring = WG_STAGES if WG_PRODUCER else WG_STAGES + 1
        static = 4 * (2 * ring * 64 + 2 * 4 * hb) + 8 * 2 * WG_STAGES  # slots, visibility, head exchange, mbarriers
        block_bytes = wg_shared_bytes(spec, hb) + static + SHARED_RESERVED
        threads = 256 if WG_PRODUCER else 128
        return max(1, min(SHARED_PER_SM.get(compute_version, 100) * 1024 // block_bytes, 2048 // threads))
    tiles = tc_head_tiles(spec)
    tile_words, q_words = tc_shared_words(spec, tiles)
    # dynamic shared memory, the static slot / visibility tables of the ring and the driver's reserve
    block_bytes = 4 * (TC_STAGES * tile_words + q_words) + 2 * 4 * (TC_STAGES + 1) * TK + SHARED_RESERVED
    threads = 4 * 32 * tiles  # 4 warps per 16-head tile
    return max(1, min(SHARED_PER_SM.get(compute_version, 100) * 1024 // block_bytes, 2048 // threads))


def mla_split_granule(spec: MlaSpec, arch: str | None = None) -> tuple:
    """``(blocks_per_seq, tile_keys)`` of cuda ``mla_attention_split`` for ``spec`` built for ``arch``: the
    thread blocks one query row's chunk runs and the keys per latent tile (what
    :func:`tvmkv.runtime.decode_split.plan_split` takes): blocks of :func:`wgmma_heads` heads over
    ``WG_KEYS``-key tiles on sm_90, of ``TC_MAX_HEADS`` heads at most on the mma.sync schedule, of
    ``GPU_HEADS`` heads (fewer when the fp32 queries would not fit ``QS_BYTES``) on the SIMT one."""
    hb = wgmma_heads(spec, arch)
    if hb:
        return spec.num_heads // hb, WG_KEYS
    if use_tensor_cores(spec):
        return spec.num_heads // (16 * tc_head_tiles(spec)), TK
    H, D = spec.num_heads, spec.head_dim
    return H // divisor_at_most(H, min(GPU_HEADS, max(1, QS_BYTES // (4 * D)))), TK
