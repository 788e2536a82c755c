"""The sm_90 (warpgroup MMA) schedule of cuda ``mla_attention``, checked on the CPU: when it is chosen,
the split granule and occupancy the runtime plans with, the shared-memory places its copies and its
``P^T`` stores use against the hardware's 128-byte swizzle, and that nvcc / ptxas accept it without
serializing the wgmma pipeline or spilling.

Its outputs are checked on the GPU by tests/test_mla_kernels.py (decode, prefill rows with a sliding
window and the causal mask, split chunks and their merge, against the fp64 NumPy reference) for the
configurations it serves (``deepseek-f16``, ``bf16-h32-d192``) when the kernels are built for sm_90.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import assert_sm90a_clean

from tvmkv.tir import mla, mla_layout
from tvmkv.tir.prefill_hopper import sw_off
from tvmkv.tir.spec import MlaSpec

DEEPSEEK = MlaSpec(16, 512, 64, 16, "float16", "cuda", 192, 128)  # H 16: DeepSeek-V2's heads on 8 GPUs


def _hw_swizzle_128b(byte_addr: int) -> int:
    """PTX's 128-byte swizzle: within each 1024-byte block, address bits 4-6 XOR bits 7-9."""
    return byte_addr ^ (((byte_addr >> 7) & 7) << 4)


def test_when_the_schedule_is_chosen():
    assert mla_layout.wgmma_heads(DEEPSEEK, "sm_90") == 16
    assert mla_layout.wgmma_heads(MlaSpec(128, 512, 64, 16, "bfloat16", "cuda"), "sm_90") == 32
    assert mla_layout.wgmma_heads(MlaSpec(128, 512, 64, 16, "float16", "cuda"), "sm_90", 16) == 16
    assert mla_layout.wgmma_heads(MlaSpec(32, 128, 64, 4, "bfloat16", "cuda"), "sm_90") == 32
    assert mla_layout.wgmma_heads(MlaSpec(48, 128, 64, 4, "bfloat16", "cuda"), "sm_90") == 16
    assert mla_layout.wgmma_heads(DEEPSEEK, "sm_90", keys=32, stages=5) == 16
    refused = [
        (DEEPSEEK, "sm_80", None),  # no wgmma before Hopper
        (DEEPSEEK, "sm_89", None),
        (DEEPSEEK, None, None),
        (DEEPSEEK, "sm_90", 32),  # 32 heads a block do not divide 16
        (DEEPSEEK, "sm_90", 64),  # 128 O^T registers a thread at 32 heads; 64 is not offered
        (MlaSpec(16, 512, 64, 16, "float32", "cuda"), "sm_90", None),
        (MlaSpec(16, 512, 64, 16, "float16", "llvm"), "sm_90", None),
        (MlaSpec(16, 64, 32, 4, "float16", "cuda"), "sm_90", None),  # D 96: not whole swizzle atoms
        (MlaSpec(24, 512, 64, 16, "float16", "cuda"), "sm_90", None),  # H not a multiple of 16
    ]
    for spec, arch, heads in refused:
        assert mla_layout.wgmma_heads(spec, arch, heads) == 0, (spec, arch, heads)
    assert mla_layout.wgmma_heads(DEEPSEEK, "sm_90", keys=40) == 0  # tiles of 32, 48 or 64 keys
    assert mla_layout.wgmma_heads(DEEPSEEK, "sm_90", keys=64, stages=3) == 0  # 236 KB of shared memory
    assert mla_layout.wgmma_heads(DEEPSEEK, "sm_90", keys=64, stages=1) == 0
    with pytest.raises(ValueError, match="wg_heads=32"):
        mla.make_mla_attention(DEEPSEEK, arch="sm_90", wg_heads=32)
    with pytest.raises(ValueError, match="sm_90"):
        mla.make_mla_attention(DEEPSEEK, arch="sm_80", wg_heads=16)
    with pytest.raises(ValueError, match="wg_stages=1"):
        mla.make_mla_attention(DEEPSEEK, arch="sm_90", wg_stages=1)


def test_split_plan_follows_the_schedule():
    """Blocks per query row and keys per tile (the split granule) and blocks per SM (shared memory at
    D 576: 3 latent tiles of 48 rows (54 KiB each), 18 KiB Q, 2 KiB P^T, the 16 rows wgmma reads past
    the last tile and the alignment pad: one block per SM)."""
    assert mla_layout.mla_split_granule(DEEPSEEK, "sm_90") == (1, 48)
    assert mla_layout.mla_split_granule(DEEPSEEK, "sm_80") == (1, 32)  # mma.sync
    assert mla_layout.mla_split_granule(MlaSpec(128, 512, 64, 16, "float16", "cuda"), "sm_90") == (4, 48)
    assert mla_layout.wg_shared_bytes(DEEPSEEK, 16) == 2 * (16 * 576 + 16 * 64 + 3 * 48 * 576 + 16 * 64) + 1024
    assert mla_layout.wg_shared_bytes(DEEPSEEK, 16) == 189_440
    assert mla_layout.mla_blocks_per_sm(DEEPSEEK, "9.0", "sm_90") == 1
    assert mla_layout.mla_blocks_per_sm(DEEPSEEK, "9.0", "sm_80") == 2  # the mma.sync kernel's 93 KB
    # D 192, 32 heads a block: 74 KiB of dynamic shared memory, 2 blocks per SM
    assert mla_layout.mla_blocks_per_sm(MlaSpec(32, 128, 64, 4, "bfloat16", "cuda"), "9.0", "sm_90") == 2


@pytest.mark.parametrize("D", [192, 576])
@pytest.mark.parametrize("keys", [32, 48, 64])
def test_tile_copies_land_where_the_swizzle_reads(D, keys):
    """Copy ``e`` of thread ``u`` (of the copying warpgroup) fills chunk ``(e * 128 + u) % (D / 8)`` of
    row ``(e * 128 + u) // (D / 8)``: every chunk of a tile once, at the byte the 128-byte swizzle reads
    it from, and 8 consecutive threads write one 128-byte row segment (no bank conflict)."""
    cpr = D // 8
    places = {}
    for u in range(128):
        for e in range(keys * cpr // 128):
            f = e * 128 + u
            r, c = f // cpr, f % cpr
            linear = ((c // 8) * keys + r) * 128 + (c % 8) * 16
            off = sw_off(keys, r, c)
            assert 2 * off == _hw_swizzle_128b(linear)
            places[(r, c)] = off
            if u % 8 == 0:
                segment = {2 * sw_off(keys, (f + k) // cpr, (f + k) % cpr) // 128 for k in range(8)}
                assert len(segment) == 1, (u, e)
    assert sorted(places) == [(r, c) for r in range(keys) for c in range(cpr)]
    assert len(set(places.values())) == len(places)


@pytest.mark.parametrize("heads", [16, 32])
def test_p_transpose_stores(heads):
    """Each thread's ``S^T`` registers (warp w: keys 16 w + g (+ 8); lane pair t: heads 8 k + 2 t (+ 1))
    go to distinct elements of ``P^T`` (head rows of 64 keys), placed as a K-major B operand of the
    128-byte swizzle; together they cover it."""
    seen = set()
    for tx in range(128):
        w, g, t = tx // 32, tx % 32 // 4, tx % 4
        for r in range(heads // 8 * 4):
            key = w * 16 + g + 8 * (r // 2 % 2)
            head = (r // 4) * 8 + 2 * t + r % 2
            off = sw_off(heads, head, key // 8) + key % 8
            assert 2 * off == _hw_swizzle_128b(head * 128 + key * 2)
            seen.add(off)
    assert seen == set(range(heads * 64))


def test_kernel_set_dispatches_on_arch():
    """Built for sm_90, DeepSeek-V2's attention kernels (whole and split) are the wgmma schedule, fed by
    bulk tensor copies (page size 16) with the 16-byte copies kept for chunks that do not start a page;
    for sm_80 the mma.sync one; the SIMT request still gets SIMT."""
    k90 = mla.kernel_set(DEEPSEEK, arch="sm_90")
    for name in ("mla_attention", "mla_attention_split"):
        script = k90[name].script()
        assert "T.ptx.wgmma(" in script and "tensormap_encode_tiled" in script
        assert "T.address_of(pages_tensormap)" in script  # the bulk copies' operand
    p4 = mla.make_mla_attention(MlaSpec(32, 128, 64, 4, "bfloat16", "cuda"), arch="sm_90").script()
    assert "T.ptx.wgmma(" in p4 and "tensormap" not in p4  # page size 4: 16-byte copies only
    no_tma = mla.make_mla_attention(DEEPSEEK, arch="sm_90", wg_tma=False).script()
    assert "tensormap" not in no_tma
    # the bulk copy is one more copy instruction beside the 16-byte copies kept for unaligned chunks
    assert k90["mla_attention"].script().count("T.ptx.cp(") == no_tma.count("T.ptx.cp(") + 1
    k80 = mla.make_mla_attention(DEEPSEEK, arch="sm_80").script()
    assert "wgmma" not in k80 and "T.ptx.mma(" in k80
    assert "wgmma" not in mla.make_mla_attention(DEEPSEEK, arch="sm_90", tensor_cores=False).script()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvcc_accepts_without_serializing(tmp_path):
    """nvcc compiles the schedule for sm_90a (16 heads at D 576 fp16, 32 heads at H 128, bf16 at D 192
    with 64-key tiles, one warpgroup without the producer, the producer without bulk copies; whole and
    split); ptxas reports no spills and does not serialize the wgmma pipeline (C7514); the bulk-copy
    kernels take their tensor map as a ``__grid_constant__`` parameter."""
    funcs = {}
    for k, (spec, kw) in enumerate(
        [
            (DEEPSEEK, {}),
            (MlaSpec(128, 512, 64, 16, "float16", "cuda"), {}),  # 32 heads a block: 255 registers
            (MlaSpec(32, 128, 64, 4, "bfloat16", "cuda"), dict(wg_heads=16, wg_keys=64, wg_stages=2)),
            (DEEPSEEK, dict(wg_producer=False)),
            (DEEPSEEK, dict(wg_tma=False)),
        ]
    ):
        for split in (False, True):
            funcs[f"mla_{k}_{int(split)}"] = mla.make_mla_attention(spec, split=split, arch="sm_90", **kw)
    src = assert_sm90a_clean(funcs, tmp_path, "mla_hopper")
    assert "const __grid_constant__ CUtensorMap pages_tensormap" in src
