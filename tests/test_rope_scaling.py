"""RoPE variants (``rope_scaling``) and a partial ``rotary_dim`` as TVM's PagedKVCache applies them.

Every variant x rotary_dim (full / partial) x dtype is checked against two oracles in this process:

* a NumPy fp64 reference written here from the formulas (Hugging Face's piecewise llama3, TVM's
  element-wise frequencies where TVM departs from Hugging Face; docs/layout.md "RoPE");
* TVM's own split kernel, ``llama_rope_with_position_map`` of the wheel's position_embedding.py,
  compiled for llvm with the same ``rope_scaling`` and run on the same qkv (the drop-in's yardstick).

The kernels alone (``split_rope``, ``rope_q``) run the whole matrix; the cache (the K it stores,
``debug_get_kv``, and its attention outputs) runs every variant x rotary_dim, one dtype each by
default and both under ``-m slow`` (a kernel set per case is the cost). CPU (llvm) here; the cuda
schedule of the variants is compiled by nvcc in ``test_variants_compile_for_cuda`` (the same kernels
were run on an H200 against both oracles once, by hand; no GPU-marked test, since TVM's own kernel
cannot be compiled on the runtime-only GPU machine).
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

import tvmkv
from tvmkv import build
from tvmkv.build import BuildKey, compile_funcs
from tvmkv.relax import TvmBuiltinOverride
from tvmkv.tir import rope
from tvmkv.tir.rope_scaling import RopeScaling, RopeScalingError, kernel_variant

H_QO, H_KV, D = 2, 1, 32
THETA, SCALE = 1e4, 2.0
ROTARY = {"full": D, "partial": 16}
EXT_SEED = 7

VARIANTS = {
    "default": {},
    "gptj": {"rope_type": "gptj"},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "llama4": {
        "rope_type": "llama4",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "llama4-step": {  # low == high: TVM's step branch
        "rope_type": "llama4",
        "factor": 4.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 2.0,
        "original_max_position_embeddings": 32,
    },
    "longrope": {"rope_type": "longrope", "max_position_embeddings": 128, "original_max_position_embeddings": 8},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 64,
    },
}
TOL = {"float32": 2e-5, "float16": 4e-3}  # relative to the largest |value|; fp16: one rounding each side


def ext_factors(R: int) -> np.ndarray:
    """TVM's ``rope_ext_factors`` tensor ``[R]``: long factors then short ones."""
    return np.random.default_rng(EXT_SEED).uniform(1.0, 4.0, R).astype(np.float32)


def variant(name: str, R: int) -> RopeScaling:
    rs = RopeScaling.from_dict(VARIANTS[name], rotary_dim=R)
    return rs.with_ext_factors(ext_factors(R)) if rs.rope_type == "longrope" else rs


# ---------------------------------------------------------------------------- NumPy fp64 reference
def ref_freq(cfg: dict, R: int, n_tokens: int) -> np.ndarray:
    """Frequency of each rotated dim ``[R]`` from the formulas (fp64)."""
    t = cfg.get("rope_type", "default")
    e = np.arange(R)
    if t in ("gptj", "llama4"):  # TVM's exponent 2 (e // 2) / R (llama4: also on rotate-half pairs)
        inv = THETA ** -(2.0 * (e // 2) / R)
    else:  # rotate-half: dims e and e + R/2 share pair e mod R/2
        inv = THETA ** -(2.0 * (e % (R // 2)) / R)
    if t in ("default", "gptj"):
        return inv
    if t in ("llama3", "llama4"):
        factor, lo, hi = (cfg[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
        L = cfg["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > L / lo, inv / factor, inv)  # Hugging Face's piecewise form
        if hi > lo:
            smooth = (L / wavelen - lo) / (hi - lo)
            medium = (wavelen >= L / hi) & (wavelen <= L / lo)
            out = np.where(medium, (1 - smooth) * inv / factor + smooth * inv, out)
        return out
    if t == "longrope":
        ext = ext_factors(R).astype(np.float64)
        half = R // 2
        use = ext[:half] if n_tokens > cfg["original_max_position_embeddings"] else ext[half:]
        return inv / use[e % half]
    # yarn, as TVM: correction range without floor/ceil, the ramp at the dim index e
    L, factor = cfg["original_max_position_embeddings"], cfg["factor"]

    def corr(rot):
        return R * math.log(L / (rot * 2 * math.pi)) / (2 * math.log(THETA))

    low, high = max(corr(cfg["beta_fast"]), 0.0), min(corr(cfg["beta_slow"]), R - 1.0)
    extrapolate = 1.0 - np.clip((e - low) / (high - low), 0.0, 1.0)
    return inv / factor * (1 - extrapolate) + inv * extrapolate


def ref_magnitude(cfg: dict) -> float:
    if cfg.get("rope_type") != "longrope":
        return 1.0
    s = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(s) / math.log(cfg["original_max_position_embeddings"])) if s > 1 else 1.0


def ref_rope(x, pos, cfg: dict, R: int, n_tokens: int) -> np.ndarray:
    """``x [n, H, D]`` rotated at ``pos [n]`` (fp64): dims < R rotate, the rest are copied."""
    x = np.asarray(x, np.float64)
    out = x.copy()
    angle = np.asarray(pos, np.float64)[:, None] * SCALE * ref_freq(cfg, R, n_tokens)[None, :]  # [n, R]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    xr = x[..., :R]
    if cfg.get("rope_type") == "gptj":
        partner = np.empty_like(xr)
        partner[..., 0::2], partner[..., 1::2] = -xr[..., 1::2], xr[..., 0::2]
    else:
        partner = np.concatenate([-xr[..., R // 2 :], xr[..., : R // 2]], axis=-1)
    out[..., :R] = ref_magnitude(cfg) * (xr * cos + partner * sin)
    return out


def ref_attention(q, k_hist, v_hist, q_pos, sm_scale) -> np.ndarray:
    """Causal attention of ``q [n, H_qo, D]`` (positions ``q_pos``) over one sequence's ``k/v [m, H_kv, D]``."""
    group = q.shape[1] // k_hist.shape[1]
    o = np.zeros(q.shape)
    for i, p in enumerate(q_pos):
        for h in range(q.shape[1]):
            kk, vv = k_hist[: p + 1, h // group], v_hist[: p + 1, h // group]
            s = kk @ q[i, h] * sm_scale
            w = np.exp(s - s.max())
            o[i, h] = w @ vv / w.sum()
    return o


# ---------------------------------------------------------------------------- TVM's own kernel
def tvm_dict(name: str) -> dict:
    cfg = dict(VARIANTS[name])
    if cfg.get("rope_type") == "yarn":  # what TVM's PagedKVCache adds before building its kernels
        cfg["inv_theta_log_scale"] = 1.0 / (2 * math.log(THETA))
    return cfg


@functools.lru_cache(maxsize=None)
def tvm_split(name: str, R: int, dtype: str):
    """TVM's ``tir_split_rotary`` for this variant, compiled for llvm: ``f(qkv, pos) -> (q, k, v)``."""
    longrope = VARIANTS[name].get("rope_type") == "longrope"
    # TVM 0.27's longrope kernel tests ``if ext_factors:`` on a Buffer, which raises (a Buffer is an
    # expression here): the wheel cannot build it as shipped; truthiness patched while it is built
    with mock.patch.object(tvm.tirx.Buffer, "__bool__", lambda self: True) if longrope else contextlib.nullcontext():
        func = llama_rope_with_position_map(THETA, SCALE, D, H_QO, H_KV, dtype, tvm_dict(name), R)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    dev = tvm.cpu()

    def run(qkv, pos):
        n = qkv.shape[0]
        outs = [tvm.runtime.empty((n, h, D), dtype, dev) for h in (H_QO, H_KV, H_KV)]
        args = [tvm.runtime.tensor(qkv, dev), tvm.runtime.tensor(pos.astype(np.int32), dev), *outs]
        last = tvm.runtime.tensor(ext_factors(R), dev) if longrope else 1  # ext factors, or apply_rope
        lib["main"](*args, last)
        return [as64(o.numpy()) for o in outs]

    return run


def as64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def np_dtype(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def assert_close(got, want, dtype, what):
    got, want = as64(got), as64(want)
    scale = max(1.0, np.abs(want).max())
    err = np.abs(got - want).max() / scale
    assert err <= TOL[dtype], f"{what}: max error {err:.2e} (relative to {scale:.2f}) > {TOL[dtype]}"


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("rotary", ROTARY)
def test_inv_freq_matches_the_formulas(name, rotary):
    """RopeScaling.inv_freq / magnitude (what the docs state) equal the reference written here."""
    R = ROTARY[rotary]
    rs = variant(name, R)
    for n_tokens in (1, 12):
        np.testing.assert_allclose(rs.inv_freq(THETA, num_tokens=n_tokens), ref_freq(VARIANTS[name], R, n_tokens))
    assert math.isclose(rs.magnitude, ref_magnitude(VARIANTS[name]))


@functools.lru_cache(maxsize=None)
def tvmkv_kernels(name: str, R: int, dtype: str):
    spec = tvmkv.KernelSpec(H_QO, H_KV, D, 4, dtype, "llvm")
    rs = kernel_variant(variant(name, R), D, "normal")
    funcs = {
        "split_rope": rope.make_split_rope(spec, rotate=True, rope_scaling=rs),
        "rope_q": rope.make_rope_q(spec, rotate=True, rope_scaling=rs),
    }
    return compile_funcs(funcs, "llvm")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("rotary", ROTARY)
@pytest.mark.parametrize("name", VARIANTS)
def test_split_rope_and_rope_q_match_numpy_and_tvm(name, rotary, dtype):
    R = ROTARY[rotary]
    lib = tvmkv_kernels(name, R, dtype)
    dev = tvm.cpu()
    rng = np.random.default_rng(1)
    for n in (5, 12):  # longrope: short factors for 5 <= 8 tokens, long ones for 12
        qkv = rng.standard_normal((n, H_QO + 2 * H_KV, D)).astype(np_dtype(dtype))
        pos = rng.integers(0, 40, n).astype(np.int32)
        outs = [tvm.runtime.empty((n, h, D), dtype, dev) for h in (H_QO, H_KV, H_KV)]
        lib["split_rope"](tvm.runtime.tensor(qkv, dev), tvm.runtime.tensor(pos, dev), *outs, SCALE, THETA)
        q, k, v = (o.numpy() for o in outs)
        q_out = tvm.runtime.empty((n, H_QO, D), dtype, dev)
        lib["rope_q"](tvm.runtime.tensor(qkv[:, :H_QO].copy(), dev), tvm.runtime.tensor(pos, dev), q_out, SCALE, THETA)
        cfg = VARIANTS[name]
        want_q = ref_rope(qkv[:, :H_QO], pos, cfg, R, n)
        want_k = ref_rope(qkv[:, H_QO : H_QO + H_KV], pos, cfg, R, n)
        tq, tk, tv = tvm_split(name, R, dtype)(qkv, pos)
        for got, ref, tvm_out, what in [
            (q, want_q, tq, "q"),
            (k, want_k, tk, "k"),
            (q_out.numpy(), want_q, tq, "rope_q"),
        ]:
            assert_close(got, ref, dtype, f"{what} vs NumPy (n={n})")
            assert_close(got, tvm_out, dtype, f"{what} vs TVM (n={n})")
        assert_close(tvm_out, ref, dtype, "TVM vs NumPy")  # the two oracles agree
        np.testing.assert_array_equal(v, qkv[:, H_QO + H_KV :])
        np.testing.assert_array_equal(tv, as64(qkv[:, H_QO + H_KV :]))


CACHE_CASES = [
    pytest.param(name, rotary, dtype, marks=[pytest.mark.slow] if slow else [])
    for name in VARIANTS
    if name != "llama4-step"  # the kernels' test covers it
    for i, rotary in enumerate(ROTARY)
    for dtype, slow in (("float32", i == 1), ("float16", i == 0))
]


@pytest.mark.parametrize("name,rotary,dtype", CACHE_CASES)
def test_cache_stores_and_attends_like_numpy_and_tvm(name, rotary, dtype):
    """Prefill two sequences (12 tokens: longrope's long factors), then decode one token each (2 tokens:
    short factors): the K the cache stores and its attention outputs match both oracles."""
    R = ROTARY[rotary]
    cache = tvmkv.PagedAttentionKVCache(
        1, H_QO, H_KV, D, page_size=4, max_batch_size=2, max_total_seq_len=64, prefill_chunk_size=16,
        dtype=dtype, rope_mode="normal", rope_scale=SCALE, rope_theta=THETA, rope_scaling=variant(name, R),
        rotary_dim=R,
    )  # fmt: skip
    assert cache.config.rotary_dim == R
    cfg, rng, sm_scale = VARIANTS[name], np.random.default_rng(2), D**-0.5
    hist: dict = {0: ([], [], []), 1: ([], [], [])}  # seq -> (K NumPy, K TVM, V) of each forward
    cache.add_sequence(0)
    cache.add_sequence(1)
    for lengths in ([5, 7], [1, 1]):
        n = sum(lengths)
        qkv = rng.standard_normal((n, H_QO + 2 * H_KV, D)).astype(np_dtype(dtype))
        pos = np.concatenate(
            [sum(len(x) for x in hist[s][0]) + np.arange(m) for s, m in zip(hist, lengths, strict=True)]
        ).astype(np.int32)
        cache.begin_forward([0, 1], lengths)
        o = cache.attention_with_fused_qkv(0, qkv)
        cache.end_forward()
        q_ref, k_ref = (ref_rope(qkv[:, a:b], pos, cfg, R, n) for a, b in ((0, H_QO), (H_QO, H_QO + H_KV)))
        q_tvm, k_tvm, _ = tvm_split(name, R, dtype)(qkv, pos)
        start = 0
        for s, m in zip(hist, lengths, strict=True):
            rows = slice(start, start + m)
            hist[s][0].append(k_ref[rows])
            hist[s][1].append(k_tvm[rows])
            hist[s][2].append(as64(qkv[rows, H_QO + H_KV :]))
            k_all, k_all_tvm, v_all = (np.concatenate(h) for h in hist[s])
            k_stored, v_stored = cache.debug_get_kv(s)
            assert_close(k_stored[0], k_all, dtype, f"stored K of seq {s} vs NumPy")
            assert_close(k_stored[0], k_all_tvm, dtype, f"stored K of seq {s} vs TVM")
            np.testing.assert_array_equal(as64(v_stored[0]), v_all)
            p = pos[rows]
            want = ref_attention(q_ref[rows], k_all, v_all, p, sm_scale)
            want_tvm = ref_attention(q_tvm[rows], k_all_tvm, v_all, p, sm_scale)
            assert_close(o[rows], want, dtype, f"attention of seq {s} vs NumPy")
            assert_close(o[rows], want_tvm, dtype, f"attention of seq {s} vs TVM's rotation")
            start += m


# ---------------------------------------------------------------------------- errors, build key, drop-in
@pytest.mark.parametrize(
    "rope_scaling,rotary_dim,error,match",
    [
        ({"rope_type": "ntk"}, None, RopeScalingError, "rope_type='ntk' is not supported"),
        ({"rope_type": "linear", "factor": 2.0}, None, RopeScalingError, "rope_scale=1/factor"),
        ({"type": "yarn", "factor": 2.0}, None, RopeScalingError, "rename the key"),
        ({**VARIANTS["llama3"], "factor": None}, None, RopeScalingError, "needs rope_scaling\\['factor'\\]"),
        ({k: v for k, v in VARIANTS["yarn"].items() if k != "beta_fast"}, None, RopeScalingError, "beta_fast"),
        ({**VARIANTS["llama3"], "factor": -1.0}, None, RopeScalingError, "positive finite"),
        ({**VARIANTS["llama3"], "high_freq_factor": 1.0}, None, RopeScalingError, "must exceed low_freq_factor"),
        ({**VARIANTS["longrope"], "long_factor": [1.0] * 8}, 16, RopeScalingError, "both long_factor and short"),
        (
            {**VARIANTS["longrope"], "long_factor": [1.0] * 4, "short_factor": [1.0] * 4},
            16,
            RopeScalingError,
            "needs 8",
        ),
        ({"rope_type": "gptj"}, 15, RopeScalingError, "rotary_dim=15 must be a positive even int"),
        ({"rope_type": "gptj"}, 0, RopeScalingError, "positive even int"),
        ({"rope_type": "gptj"}, 48, RopeScalingError, "rotary_dim=48 exceeds head_dim=32"),
        (VARIANTS["longrope"], None, RopeScalingError, "needs its extension factors"),
        ("yarn", None, RopeScalingError, "must be a dict"),
    ],
)
def test_invalid_rope_scaling_is_refused_at_cache_creation(rope_scaling, rotary_dim, error, match):
    with pytest.raises(error, match=match):
        tvmkv.CacheConfig(1, H_QO, H_KV, D, rope_mode="normal", rope_scaling=rope_scaling, rotary_dim=rotary_dim)


@pytest.mark.parametrize("rope_scaling,rotary_dim", [(VARIANTS["gptj"], None), (None, 16), (VARIANTS["yarn"], 16)])
def test_inline_rope_refuses_variants_before_compiling(rope_scaling, rotary_dim):
    with pytest.raises(NotImplementedError, match="use rope_mode='normal'"):
        tvmkv.PagedAttentionKVCache(
            1,
            H_QO,
            H_KV,
            D,
            rope_mode="inline",
            rope_scaling=rope_scaling,
            rotary_dim=rotary_dim,
            build_dir="/nonexistent",
        )
    # the default variant (whole head) is fine with inline RoPE; rope mode "none" ignores any variant
    assert tvmkv.CacheConfig(1, H_QO, H_KV, D, rope_mode="inline", rotary_dim=D).rope_variant is None
    assert tvmkv.CacheConfig(1, H_QO, H_KV, D, rope_mode="none", rope_scaling=rope_scaling).rope_variant is None


def test_build_key_names_keep_the_default_and_separate_variants():
    spec = tvmkv.KernelSpec(H_QO, H_KV, D, 4, "float32", "llvm")
    assert BuildKey(spec, "normal").name == "kvcache_q2_kv1_d32_p4_float32_rope-normal"  # unchanged
    assert kernel_variant({}, D, "normal", rotary_dim=D) is None  # the default over the whole head: no variant
    keys = {
        BuildKey(spec, "normal", rope_scaling=kernel_variant(variant(name, R), D, "normal"))
        for name in VARIANTS
        for R in ROTARY.values()
        if not (name == "default" and R == D)
    }
    assert len({k.name for k in keys}) == len(keys) == 2 * len(VARIANTS) - 1
    other = kernel_variant({**VARIANTS["llama3"], "factor": 4.0}, D, "normal")
    assert other.tag != kernel_variant(VARIANTS["llama3"], D, "normal").tag  # parameters are in the name
    gptj = kernel_variant(VARIANTS["gptj"], D, "normal", rotary_dim=16)
    assert BuildKey(spec, "normal", rope_scaling=gptj).name == "kvcache_q2_kv1_d32_p4_float32_rope-normal_gptj-r16"
    with pytest.raises(ValueError, match="rope_mode 'normal'"):
        BuildKey(spec, "inline", rope_scaling=gptj)
    # prebuilding (python -m tvmkv build --config ...): the config keys rope_scaling / rotary_dim
    base = dict(num_qo_heads=H_QO, num_kv_heads=H_KV, head_dim=D, page_size=4, dtype="float32", sliding=False)
    keys = build.expand_configs(
        [{"rope_mode": "normal", "rope_scaling": VARIANTS["gptj"], "rotary_dim": [16, D]}, {"rope_mode": "normal"}],
        dict(base, rope_mode="none", target="llvm", arch=None),
    )
    assert [k.name for k in keys] == [
        "kvcache_q2_kv1_d32_p4_float32_rope-normal_gptj-r16",
        "kvcache_q2_kv1_d32_p4_float32_rope-normal_gptj-r32",
        "kvcache_q2_kv1_d32_p4_float32_rope-normal",
    ]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_variants_compile_for_cuda():
    """The cuda schedule of the variants (partial rotary: the copy lanes too) gives source nvcc accepts
    for sm_90 (runs here without a GPU; docs/layout.md "RoPE")."""
    funcs = {}
    for name, R in (("gptj", 16), ("yarn", 16), ("longrope", 16), ("llama4", D)):
        spec = tvmkv.KernelSpec(4, 1, 64, 4, "float16", "cuda")  # D 64: the 2-slot copy lanes (R < D/2)
        rs = kernel_variant(variant(name, R), 64, "normal")
        funcs[f"split_rope_{name}"] = rope.make_split_rope(spec, rotate=True, rope_scaling=rs)
        funcs[f"rope_q_{name}"] = rope.make_rope_q(spec, rotate=True, rope_scaling=rs)
    src = compile_funcs(funcs, "cuda", "sm_90").mod.imports[0].inspect_source()
    assert all(f"{f}_kernel" in src for f in funcs)
    assert build.nvcc_fatbin(src, "sm_90")


def _create_args(rope=1, ext=0, dtype="float32"):
    """``paged_attention_kv_cache_create``'s arguments as TVM 0.27's TIRPagedKVCache passes them."""
    ref = tvm.runtime.tensor(np.zeros((), dtype), tvm.cpu())
    head = [[2, 64, 16, 4, 0, 1024], [0, 1], H_QO, H_KV, D, D, [0], False, rope, SCALE, THETA, ext, ref]
    return head + [None] * 15


def test_drop_in_takes_rope_scaling_and_the_ext_factors_tensor():
    R = 16
    ext = tvm.runtime.tensor(ext_factors(R), tvm.cpu())
    override = TvmBuiltinOverride(rope_scaling=VARIANTS["longrope"], rotary_dim=R)
    kw = override.cache_kwargs(*_create_args(ext=ext))
    assert kw["rope_scaling"] == variant("longrope", R) and kw["rope_mode"] == "normal"
    cfg = tvmkv.CacheConfig(1, H_QO, H_KV, D, rope_mode="normal", rope_scaling=kw["rope_scaling"], rotary_dim=R)
    assert cfg.rope_variant.long_factor == tuple(ext_factors(R)[: R // 2].tolist())
    with pytest.raises(ValueError, match="rope_mode 1"):  # TVM: extension factors need normal RoPE
        override.cache_kwargs(*_create_args(rope=2, ext=ext))
    with pytest.raises(RopeScalingError, match="'longrope' only"):
        TvmBuiltinOverride().cache_kwargs(*_create_args(ext=ext))
    with pytest.raises(RopeScalingError, match="rotary_dim=16 needs as many"):
        override.cache_kwargs(*_create_args(ext=tvm.runtime.tensor(ext_factors(D), tvm.cpu())))
    gptj = TvmBuiltinOverride(rope_scaling=VARIANTS["gptj"], rotary_dim=R).cache_kwargs(*_create_args())
    assert gptj["rope_scaling"].rope_type == "gptj" and gptj["rope_scaling"].rotary_dim == R
    with pytest.raises(RopeScalingError, match="not supported"):
        TvmBuiltinOverride(rope_scaling={"rope_type": "dynamic"})
