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


def mla_split_granule(spec: MlaSpec) -> tuple:
    """``(blocks_per_seq, tile_keys)`` of cuda ``mla_attention_split`` for ``spec``: the thread blocks one
    query row's chunk runs and the keys per latent tile (what :func:`tvmkv.runtime.decode_split.plan_split`
    takes): blocks of ``TC_MAX_HEADS`` heads at most on tensor cores, of ``GPU_HEADS`` heads (fewer when
    the fp32 queries would not fit ``QS_BYTES``) on the SIMT schedule."""
    if use_tensor_cores(spec):
        return spec.num_heads // (16 * divisor_at_most(spec.num_heads // 16, TC_MAX_HEADS // 16)), TK
    H, D = spec.num_heads, spec.head_dim
    return H // divisor_at_most(H, min(GPU_HEADS, max(1, QS_BYTES // (4 * D)))), TK
