"""MLA kernels (tvmkv.tir.mla) against the NumPy references of tvmkv.reference.mla.

Layouts: docs/layout.md ("MLA pages"). Kernels come from ``load_kernels(spec, family="mla")``; the
oracle is fp64 NumPy written from the definitions. Page tables use random, non-contiguous page ids and
unused slots hold random garbage, so a kernel that reads outside its sequence fails. One matrix: the
``target`` fixture (llvm; cuda where a GPU is present) x configuration (dtype, heads, latent / rope
dims, page size, self-attention dims).
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from conftest import assert_attention_close, to_dev

from tvmkv.build import BuildKey, load_kernels
from tvmkv.reference import mla as ref
from tvmkv.tir.spec import KernelSpec, MlaSpec

# (dtype, H, D_v, D_r, P, (Dq, Dv2)); the last one is DeepSeek-V2's latent shape with fewer heads
CONFIGS = [
    ("float16", 8, 32, 16, 4, (32, 16)),
    ("bfloat16", 8, 32, 16, 16, (48, 32)),
    ("float32", 8, 32, 16, 16, (32, 16)),
    ("bfloat16", 16, 64, 32, 4, (64, 32)),
    ("float16", 16, 512, 64, 16, (192, 128)),
    ("float16", 32, 64, 32, 8, (32, 16)),
    ("bfloat16", 64, 128, 32, 16, (32, 16)),
    ("bfloat16", 32, 128, 64, 4, (64, 32)),
]
# cuda: the last five on tensor cores (h32 / h64: blocks of 32 / 64 heads, two / four m16 tiles); on
# sm_90 deepseek-f16 and bf16-h32-d192 (D a multiple of 64) take warpgroup MMA (tvmkv.tir.mla_hopper)
IDS = ["f16-p4", "bf16-p16", "f32-p16", "bf16-h16-p4", "deepseek-f16", "f16-h32-p8", "bf16-h64", "bf16-h32-d192"]


def _spec(target, cfg) -> MlaSpec:
    dtype, H, Dv, Dr, P, (Dq, Dv2) = cfg
    return MlaSpec(H, Dv, Dr, P, dtype, target, self_qk_dim=Dq, self_v_dim=Dv2)


def _np_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _tol(dtype):
    return {"float32": 2e-4, "float16": 2e-2, "bfloat16": 4e-2}[dtype]


def _rand(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32).astype(_np_dtype(dtype))


def _check(o_dev, lse_dev, o_ref, lse_ref, dtype):
    tol = _tol(dtype)
    assert_attention_close(o_dev, lse_dev, o_ref, lse_ref, tol)


@pytest.fixture(params=CONFIGS, ids=IDS)
def cfg(request):
    return request.param


def _lib(target, cfg):
    return load_kernels(_spec(target, cfg), family="mla")


class MlaPaged:
    """MLA page pool [num_pages, P, D] + CSR page tables for sequences of ``kv_lens`` slots."""

    def __init__(self, rng, spec: MlaSpec, kv_lens, extra_pages=3):
        P = spec.page_size
        npages = [-(-L // P) for L in kv_lens]
        num_pages = sum(npages) + extra_pages + 1
        perm = rng.permutation(num_pages - 1).astype(np.int32)
        self.page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
        self.page_indices = perm[: sum(npages)].copy() if sum(npages) else np.zeros(1, np.int32)
        self.last_page_len = np.array(
            [L - (npg - 1) * P if npg else 0 for L, npg in zip(kv_lens, npages, strict=True)], np.int32
        )
        self.pages = _rand(rng, (num_pages, P, spec.head_dim), spec.dtype)
        self.kv_window = np.zeros((len(kv_lens), 3), np.int32)

    def tables(self):
        return [self.page_indptr, self.page_indices, self.last_page_len, self.kv_window]


def _attention(target, spec, lib, pg, q, q_indptr, q_pos, causal, sm_scale):
    """Run ``mla_attention`` and its reference on the same inputs; compare."""
    n, H = q.shape[:2]
    o = to_dev(np.zeros((n, H, spec.latent_dim), _np_dtype(spec.dtype)), target)
    lse = to_dev(np.zeros((n, H), np.float32), target)
    args = [q, q_indptr, q_pos, pg.pages, *pg.tables()]
    lib["mla_attention"](*[to_dev(a, target) for a in args], o, lse, np.float32(sm_scale), np.int32(causal))
    o_ref, lse_ref = ref.mla_attention_ref(*args, sm_scale, causal, spec.latent_dim)
    _check(o, lse, o_ref, lse_ref, spec.dtype)
    return lse_ref


# ------------------------------------------------------------------------------------ data movement


def test_append_gather_roundtrip(target, cfg, rng):
    spec = _spec(target, cfg)
    lib = _lib(target, cfg)
    P, D = spec.page_size, spec.head_dim
    num_pages = 6
    pages = _rand(rng, (num_pages, P, D), spec.dtype)
    n = 2 * P + 3
    slots = rng.permutation(num_pages * P)[:n].astype(np.int32)
    slots[1] = -1  # skipped
    kv = _rand(rng, (n, D), spec.dtype)
    pages_dev = to_dev(pages, target)
    lib["mla_append"](pages_dev, to_dev(kv, target), to_dev(slots, target))
    want = ref.mla_append_ref(pages, kv, slots)
    np.testing.assert_array_equal(pages_dev.numpy().astype(np.float32), want.astype(np.float32))
    # read back: the appended rows, a negative slot (zeros) and an untouched slot
    untouched = int(np.setdiff1d(np.arange(num_pages * P), slots)[0])
    read = np.concatenate([slots, [-5, untouched]]).astype(np.int32)
    out = to_dev(np.zeros((len(read), D), _np_dtype(spec.dtype)), target)
    lib["mla_gather"](pages_dev, to_dev(read, target), out)
    got = out.numpy().astype(np.float32)
    np.testing.assert_array_equal(got, ref.mla_gather_ref(want, read).astype(np.float32))
    keep = slots >= 0
    np.testing.assert_array_equal(got[:n][keep], kv[keep].astype(np.float32))
    assert not got[n].any()


def test_copy_page(target, cfg, rng):
    spec = _spec(target, cfg)
    lib = _lib(target, cfg)
    pages = _rand(rng, (4, spec.page_size, spec.head_dim), spec.dtype)
    for src, dst, num in ((0, 2, spec.page_size), (3, 1, max(1, spec.page_size - 1)), (1, 0, 0)):
        dev = to_dev(pages, target)
        lib["mla_copy_page"](dev, np.int32(src), np.int32(dst), np.int32(num))
        want = ref.mla_copy_page_ref(pages, src, dst, num)
        np.testing.assert_array_equal(dev.numpy().astype(np.float32), want.astype(np.float32))


# ------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_decode(target, cfg, rng, causal):
    """One query per sequence (n == B), sequences of many lengths, one without pages (o 0, lse -inf)."""
    spec = _spec(target, cfg)
    lib = _lib(target, cfg)
    P = spec.page_size
    kv_lens = [1, P, 3 * P + 1, 0, 37]
    B = len(kv_lens)
    pg = MlaPaged(rng, spec, kv_lens)
    q = _rand(rng, (B, spec.num_heads, spec.head_dim), spec.dtype)
    q_indptr = np.arange(B + 1, dtype=np.int32)
    q_pos = np.maximum(np.array(kv_lens, np.int32) - 1, 0)
    lse_ref = _attention(target, spec, lib, pg, q, q_indptr, q_pos, causal, spec.head_dim**-0.5)
    assert np.isneginf(lse_ref[3]).all() and np.isfinite(lse_ref[[0, 1, 2, 4]]).all()


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_prefill(target, cfg, rng, causal):
    """Several rows per sequence over history + new tokens, with a sink + gap window on one sequence and
    a sequence whose rows see no key under the causal mask (q_pos before every key)."""
    spec = _spec(target, cfg)
    lib = _lib(target, cfg)
    hist = [0, 5, 2 * spec.page_size + 3, 4]
    new = [3, 4, 2, 2]
    kv_lens = [h + m for h, m in zip(hist, new, strict=True)]
    pg = MlaPaged(rng, spec, kv_lens)
    # sequence 1: sink of 2 slots, slots 2..3 slid out (gap), positions of later slots shifted by -2
    pg.kv_window[1] = (2, 4, -2)
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    n = int(q_indptr[-1])
    q_pos = np.concatenate([np.arange(h, h + m) for h, m in zip(hist, new, strict=True)]).astype(np.int32)
    q_pos[q_indptr[1] : q_indptr[2]] -= 2  # kept-token positions of the windowed sequence
    q_pos[q_indptr[3] : q_indptr[4]] = -1  # sequence 3: no key at or before its rows
    q = _rand(rng, (n, spec.num_heads, spec.head_dim), spec.dtype)
    lse_ref = _attention(target, spec, lib, pg, q, q_indptr, q_pos, causal, spec.head_dim**-0.5)
    rows3 = slice(q_indptr[3], q_indptr[4])
    assert np.isneginf(lse_ref[rows3]).all() == bool(causal)


@pytest.mark.parametrize("kv_chunk", [20, 32])
def test_attention_split(target, cfg, rng, kv_chunk):
    """mla_attention_split per chunk (partial states against the reference restricted to the chunk's
    slots, empty chunks included), then mla_merge_splits against the unsplit reference: causal prefill
    rows over a windowed sequence and a sequence without pages."""
    spec = _spec(target, cfg)
    lib = _lib(target, cfg)
    hist = [40, 0, 5, 2 * spec.page_size + 3]
    new = [1, 0, 4, 2]
    kv_lens = [h + m for h, m in zip(hist, new, strict=True)]
    pg = MlaPaged(rng, spec, kv_lens)
    pg.kv_window[2] = (2, 4, -2)
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    n = int(q_indptr[-1])
    q_pos = np.concatenate([np.arange(h, h + m) for h, m in zip(hist, new, strict=True)]).astype(np.int32)
    q_pos[q_indptr[2] : q_indptr[3]] -= 2
    q = _rand(rng, (n, spec.num_heads, spec.head_dim), spec.dtype)
    S = -(-max(kv_lens) // kv_chunk) + 1  # one chunk past every sequence: empty everywhere
    H, Dv = spec.num_heads, spec.latent_dim
    o_part = to_dev(np.full((S, n, H, Dv), np.nan, np.float32), target)
    lse_part = to_dev(np.zeros((S, n, H), np.float32), target)
    args = [q, q_indptr, q_pos, pg.pages, *pg.tables()]
    sm_scale = spec.head_dim**-0.5
    lib["mla_attention_split"](
        *[to_dev(a, target) for a in args], o_part, lse_part, np.float32(sm_scale), np.int32(1), np.int32(kv_chunk)
    )
    o_ref, lse_ref = ref.mla_attention_split_ref(*args, sm_scale, 1, Dv, kv_chunk, S)
    _check(o_part, lse_part, o_ref, lse_ref, spec.dtype)
    assert np.isneginf(lse_ref[-1]).all()
    o = to_dev(np.zeros((n, H, Dv), _np_dtype(spec.dtype)), target)
    lse = to_dev(np.zeros((n, H), np.float32), target)
    lib["mla_merge_splits"](o_part, lse_part, o, lse)
    _check(o, lse, *ref.mla_attention_ref(*args, sm_scale, 1, Dv), spec.dtype)


def test_attention_window_reference():
    """The reference's window and causal rules on a hand-built case (independent of the kernels):
    slots 0..1 sink, 2..3 gap, 4.. at positions j - 2; row at position 3 sees slots 0, 1, 4, 5."""
    spec = MlaSpec(1, 16, 16, 4, "float32", "llvm")
    rng = np.random.default_rng(1)
    pg = MlaPaged(rng, spec, [8])
    pg.kv_window[0] = (2, 4, -2)
    q = rng.standard_normal((1, 1, spec.head_dim))
    o, lse = ref.mla_attention_ref(q, np.array([0, 1]), np.array([3]), pg.pages, *pg.tables(), 0.5, 1, 16)
    rows = np.stack([pg.pages[pg.page_indices[j // 4], j % 4] for j in (0, 1, 4, 5)]).astype(np.float64)
    s = 0.5 * rows @ q[0, 0]
    p = np.exp(s) / np.exp(s).sum()
    np.testing.assert_allclose(o[0, 0], p @ rows[:, :16], rtol=1e-12)
    np.testing.assert_allclose(lse[0, 0], np.log2(np.exp(s).sum()), rtol=1e-12)


def test_ragged_attention_dv(target, cfg, rng):
    spec = _spec(target, cfg)
    lib = _lib(target, cfg)
    H, Dq, Dv2 = spec.num_heads, spec.self_qk_dim, spec.self_v_dim
    lens = [1, 5, 40, 3]
    q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n = int(q_indptr[-1])
    q, k = _rand(rng, (n, H, Dq), spec.dtype), _rand(rng, (n, H, Dq), spec.dtype)
    v = _rand(rng, (n, H, Dv2), spec.dtype)
    o = to_dev(np.zeros((n, H, Dv2), _np_dtype(spec.dtype)), target)
    lse = to_dev(np.zeros((n, H), np.float32), target)
    sm_scale = Dq**-0.5
    lib["ragged_attention_dv"](*[to_dev(a, target) for a in (q, k, v, q_indptr)], o, lse, np.float32(sm_scale))
    o_ref, lse_ref = ref.ragged_attention_dv_ref(q, k, v, q_indptr, sm_scale)
    _check(o, lse, o_ref, lse_ref, spec.dtype)


# (dtype, H, (Dq, Dv2)) of the longer ragged_attention_dv test; cuda: all three on tensor cores
# (DeepSeek-V2's 192 / 128; 64 / 64; 80 / 48: 16-byte chunks per row not a multiple of 8)
RAGGED_DV = [("float16", 16, (192, 128)), ("bfloat16", 4, (64, 64)), ("float16", 2, (80, 48))]


@pytest.mark.parametrize("dv_cfg", RAGGED_DV, ids=["deepseek-f16", "bf16-64", "f16-80x48"])
def test_ragged_attention_dv_tiles(target, rng, dv_cfg):
    """ragged_attention_dv over sequences that end on, before and after the cuda schedule's 64-row tiles
    (query tiles and key tiles), an empty sequence and several tiles per sequence, against the NumPy
    reference."""
    dtype, H, (Dq, Dv2) = dv_cfg
    spec = MlaSpec(H, 32, 16, 16, dtype, target, self_qk_dim=Dq, self_v_dim=Dv2)
    lib = load_kernels(spec, family="mla")
    lens = [1, 63, 64, 0, 65, 150, 7]
    q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n = int(q_indptr[-1])
    q, k = _rand(rng, (n, H, Dq), dtype), _rand(rng, (n, H, Dq), dtype)
    v = _rand(rng, (n, H, Dv2), dtype)
    o = to_dev(np.full((n, H, Dv2), np.nan, _np_dtype(dtype)), target)
    lse = to_dev(np.full((n, H), np.nan, np.float32), target)
    sm_scale = Dq**-0.5
    lib["ragged_attention_dv"](*[to_dev(a, target) for a in (q, k, v, q_indptr)], o, lse, np.float32(sm_scale))
    _check(o, lse, *ref.ragged_attention_dv_ref(q, k, v, q_indptr, sm_scale), dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_merge_any(target, rng, dtype):
    """One kernel for every (n, H, Dm): rows where either side or both are -inf (garbage, even NaN, in
    the o of a -inf side is ignored)."""
    lib = load_kernels(MlaSpec(8, 32, 16, 4, dtype, target, 32, 16), family="mla")
    for n, H, Dm in ((3, 8, 32), (5, 2, 128), (2, 16, 576), (1, 3, 40)):
        o, o2 = _rand(rng, (n, H, Dm), dtype), _rand(rng, (n, H, Dm), dtype)
        lse = (3 * rng.standard_normal((n, H))).astype(np.float32)
        lse2 = (3 * rng.standard_normal((n, H))).astype(np.float32)
        lse[0, 0] = -np.inf
        o[0, 0] = np.nan
        lse2[0, -1] = -np.inf
        o2[0, -1] = np.nan
        lse[-1, 0] = lse2[-1, 0] = -np.inf
        o_dev, lse_dev = to_dev(o, target), to_dev(lse, target)
        lib["merge_any"](o_dev, lse_dev, to_dev(o2, target), to_dev(lse2, target))
        o_ref, lse_ref = ref.merge_any_ref(np.nan_to_num(o), lse, np.nan_to_num(o2), lse2)
        _check(o_dev, lse_dev, o_ref, lse_ref, dtype)
        assert not o_dev.numpy().astype(np.float32)[-1, 0].any()


# ------------------------------------------------------------------------------------ spec, build, nvcc


def test_spec_validation_and_tag():
    spec = MlaSpec(128, 512, 64, 16, "float16", "cuda")
    assert spec.head_dim == 576 and spec.tag == "mla_h128_c512_r64_p16_float16"
    assert MlaSpec(128, 512, 64, 16, "float16", "cuda", 192, 128).tag.endswith("_s192x128")
    for kwargs, word in (
        (dict(latent_dim=40), "latent_dim"),
        (dict(rope_dim=0), "rope_dim"),
        (dict(page_size=12), "page_size"),
        (dict(self_qk_dim=192), "self_v_dim"),
        (dict(dtype="int8"), "dtype"),
        (dict(num_heads=-1), "num_heads"),
    ):
        args = dict(num_heads=8, latent_dim=32, rope_dim=16, page_size=4, dtype="float16", target_kind="llvm")
        with pytest.raises(ValueError, match=word):
            MlaSpec(**{**args, **kwargs})
    with pytest.raises(ValueError, match="mla family takes an MlaSpec"):
        BuildKey(KernelSpec(8, 8, 64, 16, "float16", "llvm"), family="mla")
    with pytest.raises(ValueError, match="mla family takes an MlaSpec"):
        BuildKey(spec, arch="sm_90")
    assert BuildKey(spec, arch="sm_90", family="mla").name == spec.tag


def test_kernel_set_names():
    from tvmkv.tir import mla

    base = {
        "mla_append",
        "mla_attention",
        "mla_attention_split",
        "mla_merge_splits",
        "mla_gather",
        "mla_copy_page",
        "copy_page_layers",
        "merge_any",
    }
    assert set(mla.kernel_set(MlaSpec(8, 32, 16, 4, "float16", "llvm"))) == base
    assert set(mla.kernel_set(MlaSpec(8, 32, 16, 4, "float16", "cuda", 32, 16))) == base | {"ragged_attention_dv"}


def test_tensor_core_options():
    """The tensor-core schedule's block / stage options are checked, and the split granule
    follows the block: 64 heads per block where H allows, 16 for H 16, the SIMT blocks elsewhere."""
    from tvmkv.tir import mla, mla_layout

    spec = MlaSpec(128, 512, 64, 16, "float16", "cuda")
    for kwargs, word in (
        (dict(tc_heads=24), "tc_heads"),
        (dict(tc_stages=1), "tc_stages"),
    ):
        with pytest.raises(ValueError, match=word):
            mla.make_mla_attention(spec, **kwargs)
    assert mla_layout.mla_split_granule(spec) == (2, 32)
    assert mla_layout.mla_split_granule(MlaSpec(16, 512, 64, 16, "bfloat16", "cuda")) == (1, 32)
    assert mla_layout.mla_split_granule(MlaSpec(48, 512, 64, 16, "float16", "cuda")) == (1, 32)  # one 48-head block
    assert mla_layout.mla_split_granule(MlaSpec(24, 512, 64, 1, "float32", "cuda")) == (2, 32)  # SIMT: 12 heads


def test_blocks_per_sm_follow_the_kernels_shared_memory():
    """mla_blocks_per_sm (the split plan's occupancy) from the tensor-core kernel's shared memory. Nsight
    Compute on an H200 reported, for the H 16 split kernel at DeepSeek-V2's latent: 93.44 KB dynamic and
    768 B static shared memory per block, 1 KB reserved by the driver, "Block Limit Shared Mem: 2"."""
    from tvmkv.tir import mla_layout

    spec = MlaSpec(16, 512, 64, 16, "float16", "cuda")
    tile_words, q_words = mla_layout.tc_shared_words(spec, mla_layout.tc_head_tiles(spec))
    assert 4 * (mla_layout.TC_STAGES * tile_words + q_words) == 93_440
    assert mla_layout.mla_blocks_per_sm(spec, "9.0") == 2
    assert mla_layout.mla_blocks_per_sm(spec, "8.0") == 1  # 164 KiB per SM
    assert mla_layout.mla_blocks_per_sm(MlaSpec(128, 512, 64, 16, "float16", "cuda"), "9.0") == 1  # 64-head blocks
    assert mla_layout.mla_blocks_per_sm(MlaSpec(24, 512, 64, 1, "float32", "cuda"), "9.0") == 1  # SIMT


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_kernels_compile(tmp_path):
    """The cuda MLA kernel sets (DeepSeek-V2's shape in bf16: tensor-core mla_attention, plus its SIMT
    schedule; a small fp16 one and fp32 with 24 heads: SIMT) give CUDA source nvcc accepts for sm_80
    and sm_90; runs without a GPU."""
    from tvmkv.build import compile_funcs
    from tvmkv.tir import mla, mla_layout

    specs = [
        MlaSpec(128, 512, 64, 16, "bfloat16", "cuda", 192, 128),
        MlaSpec(8, 32, 16, 4, "float16", "cuda", 32, 16),
        MlaSpec(24, 512, 64, 1, "float32", "cuda"),
    ]
    funcs = {f"{name}_{k}": f for k, spec in enumerate(specs) for name, f in mla.kernel_set(spec).items()}
    funcs["mla_attention_simt"] = mla.make_mla_attention(specs[0], tensor_cores=False)
    funcs["mla_attention_split_simt"] = mla.make_mla_attention(specs[0], split=True, tensor_cores=False)
    assert mla_layout.use_tensor_cores(specs[0]) and not any(mla_layout.use_tensor_cores(s) for s in specs[1:])
    funcs["ragged_attention_dv_simt"] = mla.make_ragged_attention_dv(specs[0], tensor_cores=False)
    funcs["ragged_attention_dv_w8"] = mla.make_ragged_attention_dv(specs[0], num_warps=8)
    assert mla.ragged_dv_tensor_cores(specs[0]) and mla.ragged_dv_tensor_cores(specs[1])
    assert not mla.ragged_dv_tensor_cores(specs[2])  # fp32 (and no self attention dims)
    assert not mla.ragged_dv_tensor_cores(MlaSpec(8, 32, 16, 4, "float16", "cuda", 256, 128))  # too many registers
    src = compile_funcs(funcs, "cuda", "sm_90").mod.imports[0].inspect_source()
    assert all(f"{name}_kernel" in src for name in funcs) and "mma.sync.aligned.m16n8k16" in src
    path = tmp_path / "mla.cu"
    path.write_text(src)
    for arch in ("sm_80", "sm_90"):
        cmd = ["nvcc", f"-arch={arch}", "--cubin", "-diag-suppress=1046,177,550", "-o", str(path) + ".cubin", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
