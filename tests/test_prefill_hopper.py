"""The Hopper (sm_90, warpgroup MMA) prefill schedule, checked on the CPU: its shared-memory layout
against the hardware's 128-byte swizzle rule, the copies that fill it, when the schedule is chosen,
and that nvcc / ptxas accept it without serializing the wgmma pipeline or spilling.

Its outputs are checked on the GPU by tests/test_attention_kernels.py (the same batches as every
other prefill schedule, against the fp64 references) when the kernels are built for sm_90.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import assert_sm90a_clean

from tvmkv.tir import prefill_hopper as ph
from tvmkv.tir.prefill_cuda import kv_rc, load_rc
from tvmkv.tir.spec import KernelSpec


def _hw_swizzle_128b(byte_addr: int) -> int:
    """The 128-byte swizzle of the PTX ISA ("matrix descriptor" layouts): within every 1024-byte
    block, bits 4-6 of the address (the 16-byte chunk) are XORed with bits 7-9 (the 128-byte row)."""
    return byte_addr ^ (((byte_addr >> 7) & 7) << 4)


@pytest.mark.parametrize("rows", [64, 128, 256])
@pytest.mark.parametrize("D", [64, 128])
def test_shared_layout_is_the_hardware_128b_swizzle(rows, D):
    """``sw_off`` puts chunk c of row r where the tensor cores read it: column block c // 8 of
    ``rows`` x 128 bytes, row r at 128 r, then the hardware swizzle; every chunk has its own place."""
    seen = set()
    for r in range(rows):
        for c in range(D // 8):
            linear = ((c // 8) * rows + r) * 128 + (c % 8) * 16
            off = ph.sw_off(rows, r, c)
            assert 2 * off == _hw_swizzle_128b(linear), (r, c)
            seen.add(off)
    assert seen == set(range(0, rows * D, 8))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bc", [64, 128])
@pytest.mark.parametrize("wgs", [1, 2])
def test_copies_cover_every_chunk_once(D, bc, wgs):
    """The Q tile (BR rows) and each K / V tile (BC rows) are copied by the block's threads exactly
    once per 16-byte chunk."""
    spec = KernelSpec(8, 2, D, 16, "float16", "cuda")
    lay = ph.hopper_layout(
        spec, mask="causal", arch="sm_90", bc=bc, warpgroups=wgs, pingpong=wgs == 2, producer=wgs == 2
    )
    assert lay is not None
    CPR = lay["CPR"]
    q = sorted(load_rc(t, i, lay["NT"], CPR) for t in range(lay["NT"]) for i in range(lay["QI"]))
    assert q == [(r, c) for r in range(lay["BR"]) for c in range(CPR)]
    kv = sorted(kv_rc(t, i, lay["NT"], CPR) for t in range(lay["NT"]) for i in range(lay["KVI"]))
    assert kv == [(r, c) for r in range(bc) for c in range(CPR)]
    # the copying warpgroup's 128 threads, bc * CPR / 128 chunks each
    kv = sorted(kv_rc(t, i, 128, CPR) for t in range(128) for i in range(bc * CPR // 128))
    assert kv == [(r, c) for r in range(bc) for c in range(CPR)]


def test_when_the_schedule_is_chosen():
    fp16 = KernelSpec(32, 8, 128, 16, "float16", "cuda")
    assert ph.hopper_layout(fp16, mask="causal", arch="sm_90") is not None
    assert ph.hopper_layout(fp16, mask="none", arch="sm_90") is not None
    assert ph.hopper_layout(KernelSpec(8, 2, 64, 1, "bfloat16", "cuda"), mask="causal", arch="sm_90") is not None
    refused = [
        (fp16, dict(mask="causal", arch="sm_80")),  # no wgmma before Hopper
        (fp16, dict(mask="causal", arch=None)),
        (KernelSpec(32, 8, 128, 16, "float16", "llvm"), dict(mask="causal", arch="sm_90")),
        (KernelSpec(32, 8, 128, 16, "float32", "cuda"), dict(mask="causal", arch="sm_90")),
        (KernelSpec(8, 2, 256, 16, "float16", "cuda"), dict(mask="causal", arch="sm_90")),
        (KernelSpec(6, 2, 128, 16, "float16", "cuda"), dict(mask="causal", arch="sm_90")),  # group 3
        (fp16, dict(mask="tree", arch="sm_90")),
        (fp16, dict(mask="causal", arch="sm_90", sliding=True)),
        (fp16, dict(mask="causal", arch="sm_90", inline_rope=True)),
        (fp16, dict(mask="causal", arch="sm_90", bc=256, stages=3)),  # over the shared-memory limit
        (fp16, dict(mask="causal", arch="sm_90", bc=64, stages=2, overlap=True)),  # overlap needs 3 slots
        (fp16, dict(mask="causal", arch="sm_90", bc=64, stages=2)),  # so does the default ping-pong
        (fp16, dict(mask="causal", arch="sm_90", warpgroups=1)),  # ... and two warpgroups
        (fp16, dict(mask="causal", arch="sm_90", pingpong=False, overlap=True)),  # the producer feeds ping-pong
    ]
    for spec, kw in refused:
        assert ph.hopper_layout(spec, **kw) is None, (spec, kw)


def test_kernel_set_dispatches_on_arch():
    """Built for sm_90 the fp16 prefill kernels are the wgmma schedule; for sm_80 the mma.sync one;
    the tree and sliding-window variants keep the generic schedule on every arch."""
    from tvmkv.tir.prefill import make_paged_prefill
    from tvmkv.tir.ragged import make_ragged_prefill

    spec = KernelSpec(8, 2, 128, 16, "float16", "cuda")
    assert "T.ptx.wgmma(" in make_ragged_prefill(spec, mask="causal", arch="sm_90").script()
    assert "T.ptx.wgmma(" in make_paged_prefill(spec, mask="none", arch="sm_90").script()
    mma = make_paged_prefill(spec, mask="causal", arch="sm_80").script()
    assert "wgmma" not in mma and "T.ptx.mma(" in mma
    assert "wgmma" not in make_paged_prefill(spec, mask="tree", arch="sm_90").script()
    assert "wgmma" not in make_paged_prefill(spec, mask="causal", arch="sm_90", sliding=True).script()
    for fused in (make_ragged_prefill, make_paged_prefill):  # the *_qkv variants keep the schedule
        assert "T.ptx.wgmma(" in fused(spec, mask="causal", arch="sm_90", fused_qkv=True).script()
        assert "T.ptx.mma(" in fused(spec, mask="causal", arch="sm_80", fused_qkv=True).script()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvcc_accepts_without_serializing(tmp_path):
    """nvcc compiles the schedule for sm_90a (paged and ragged, fp16 D 128 and bf16 D 64, the default
    ping-pong loop fed by a copying warpgroup, the same without it, and the one-warpgroup overlapped
    loop); ptxas reports no spills and does not serialize the wgmma pipeline (its C7514 note: a
    register of an in-flight wgmma touched before the wait). With the copying warpgroup the kernel is
    compiled for 384 threads (168 registers) and ``setmaxnreg`` moves registers to the computing
    warpgroups at run time."""
    funcs = {}
    for k, (spec, kw) in enumerate(
        [
            (KernelSpec(32, 8, 128, 16, "float16", "cuda"), {}),
            (
                KernelSpec(8, 2, 64, 1, "bfloat16", "cuda"),
                dict(bc=64, stages=3, overlap=True, pingpong=False, warpgroups=1, producer=False),
            ),
            (KernelSpec(32, 8, 128, 16, "float16", "cuda"), dict(producer=False)),
        ]
    ):
        for source, mask in (("paged", "none"), ("paged", "causal"), ("ragged", "causal")):
            funcs[f"{source}_{mask}_{k}"] = ph.make_prefill_hopper(spec, source=source, mask=mask, arch="sm_90", **kw)
    for source in ("paged", "ragged"):  # the default schedule reading q (ragged: q, k, v) from the fused qkv
        funcs[f"{source}_causal_qkv"] = ph.make_prefill_hopper(
            KernelSpec(32, 8, 128, 16, "float16", "cuda"), source=source, mask="causal", arch="sm_90", fused_qkv=True
        )
    # ... and its ragged kernel storing fp8 codes from the copying warpgroup (40 registers after setmaxnreg)
    funcs["ragged_causal_qkv_fp8"] = ph.make_prefill_hopper(
        KernelSpec(32, 8, 128, 16, "float16", "cuda", kv_dtype="float8_e4m3fn"),
        source="ragged",
        mask="causal",
        arch="sm_90",
        fused_qkv=True,
    )
    assert_sm90a_clean(funcs, tmp_path, "hopper")


def test_fp8_ragged_prefill_stores_codes_itself_where_its_tiles_hold_them():
    """With fp8 pages the sm_90 ragged prefill that reads the fused qkv stores the new tokens' codes from
    its copying warpgroup (one kernel, no append schedule before it) in the default layouts; where the
    block's tokens may not all lie in its last key tile (key tiles narrower than the block's tokens, or
    no causal mask) the quantizing append runs first instead. (The stored codes themselves are checked
    against NumPy by tests/test_fp8_kernels.py::test_fp8_append_stores_codes.)"""

    def appends_first(spec, **kw):
        f = ph.make_prefill_hopper(spec, source="ragged", arch="sm_90", fused_qkv=True, **kw)
        return "T.thread_binding" in f.script()  # the append schedule's loops

    for h_qo, h_kv, d in ((32, 8, 128), (4, 2, 64), (16, 2, 128), (4, 4, 128)):
        spec = KernelSpec(h_qo, h_kv, d, 16, "float16", "cuda", kv_dtype="float8_e4m3fn")
        assert not appends_first(spec, mask="causal"), spec.tag
    mha = KernelSpec(4, 4, 128, 16, "float16", "cuda", kv_dtype="float8_e5m2")
    assert appends_first(mha, mask="causal", bc=64)  # 128 tokens a block, 64-key tiles
    assert not appends_first(KernelSpec(4, 4, 128, 16, "float16", "cuda"), mask="causal", bc=64)  # 16-bit: from qkv
