"""fp8 pages (tvmkv.tir.fp8; docs/layout.md, "fp8 pages") kernel by kernel, on every target.

The oracle is ``tvmkv.reference.fp8`` (``ml_dtypes``' conversions) with the fp64 attention of
``tvmkv.reference.attention``: the kernels that write pages must store the same codes bit for bit,
the kernels that read them must compute attention over the dequantized values. Two accuracy checks
use the format itself: the error against attention over the unquantized values stays within the
bound that follows from fp8 rounding, and a key planted in a 32k-token context still takes the
softmax, as it does with fp16 pages.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shutil
import subprocess

import numpy as np
import pytest
from conftest import assert_attention_close, to_dev

from tvmkv.build import load_kernels
from tvmkv.reference import attention as ref
from tvmkv.reference import fp8 as fp8_ref
from tvmkv.runtime.tensors import numpy_dtype
from tvmkv.tir.spec import FP8_DTYPES, KernelSpec

H_QO, H_KV, D, P = 4, 2, 64, 16
NAN_CODE = 0x7F  # NaN in both formats (e5m2: one of its NaNs): what unused slots hold
ROPE = (1.0, 10000.0)  # rope_scale, rope_theta


def _spec(target, fmt, dtype="float16"):
    return KernelSpec(H_QO, H_KV, D, P, dtype, target, fmt)


def _codes(x, fmt):
    return np.asarray(x).view(np.uint8)


def _scales(rng):
    """kv_scale [2, H_kv]: a different scale per K / V and head (not powers of two)."""
    return (rng.uniform(0.5, 3.0, (2, H_KV)) / 448.0 * 4).astype(np.float32)


class Table:
    """Sequences of ``kv_lens`` slots over random, non-contiguous pages of a pool whose other slots
    hold NaN codes (a kernel reading outside its sequence returns NaN)."""

    def __init__(self, rng, kv_lens, fmt, scale, values=None, *, h_kv=H_KV, d=D, p=P):
        P = p
        npages = [-(-n // P) for n in kv_lens]
        num_pages = sum(npages) + 3
        perm = rng.permutation(num_pages).astype(np.int32)
        self.page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
        self.page_indices = perm[: sum(npages)].copy()
        self.last_page_len = np.array([n - (k - 1) * P if k else 0 for n, k in zip(kv_lens, npages)], np.int32)
        self.kv_window = np.zeros((len(kv_lens), 3), np.int32)
        shape = (num_pages, 2, h_kv, P, d)
        if values is None:
            values = rng.standard_normal(shape).astype(np.float32)
        self.pages = fp8_ref.quantize_pages(values, scale, fmt)
        used = np.zeros((num_pages, P), bool)
        for b, n in enumerate(kv_lens):
            ids = self.page_indices[self.page_indptr[b] : self.page_indptr[b + 1]]
            for j in range(n):
                used[ids[j // P], j % P] = True
        codes = self.pages.view(np.uint8)
        codes[np.broadcast_to(~used[:, None, None, :, None], shape)] = NAN_CODE
        self.values = fp8_ref.dequantize_pages(self.pages, scale)  # fp64; NaN where unused

    def tables(self):
        return [self.page_indptr, self.page_indices, self.last_page_len, self.kv_window]


def _check(o, lse, o_ref, lse_ref, tol=2e-2):
    assert_attention_close(o, lse, o_ref, lse_ref, tol)


def _edges(rng, shape, fmt, scale_k):
    """fp16 values over the whole range the format meets: normal values, zeros of both signs, values
    that land among the subnormals, halfway cases, values beyond saturation, fp16's largest."""
    x = (rng.standard_normal(shape) * 3).astype(np.float16)
    flat = x.reshape(-1)
    s = float(scale_k)
    tiny = float(fp8_ref.subnormal_half_step(fmt)) * 2 * s
    special = [
        0.0,
        -0.0,
        tiny,
        -tiny,
        1.5 * tiny,
        2.5 * tiny,
        7.3 * tiny,
        65504.0,
        -65504.0,
        fp8_ref.largest(fmt) * s * 1.05,
    ]
    flat[: len(special)] = np.array(special, np.float32).astype(np.float16)
    return x


@pytest.mark.parametrize("fmt", FP8_DTYPES)
@pytest.mark.parametrize("lens", [(9,), (70, 1, 129, 400)], ids=["one", "four"])
@pytest.mark.parametrize("hq, d", [(H_QO, D), (8, 128)], ids=["d64", "d128"])
def test_fp8_append_stores_codes(target, fmt, lens, hq, d, rng):
    """``append``, ``append_qkv`` and the prefill that appends (``ragged_prefill_causal_qkv``) store
    ``quantize(x / scale)`` bit for bit (rounding to nearest even, saturation, zeros and subnormals),
    skip negative slots, leave every other slot alone; the pages' other kernels copy codes unchanged
    (``copy_page``, ``gather``). ``lens``: the prefill's sequences (several query tiles, whose blocks
    each store their own tokens on sm_90, from key tiles 0-3 and every slot of the copy ring);
    ``hq, d``: query heads and head_dim (128: both 64-element column blocks of the Hopper kernel's
    swizzled tiles; cuda only, llvm runs the same schedule as for 64)."""
    if d != D and target == "llvm":
        pytest.skip("head_dim 128 checks the sm_90 kernel's tiles; llvm has no such schedule")
    spec = KernelSpec(hq, H_KV, d, P, "float16", target, fmt)
    lib = load_kernels(spec, rope_mode="none")
    n = sum(lens)
    scale = _scales(rng)
    k = _edges(rng, (n, H_KV, d), fmt, scale[0, 0])
    v = _edges(rng, (n, H_KV, d), fmt, scale[1, 0])
    k.reshape(-1)[20:23] = [np.nan, np.inf, -np.inf]  # NaN stays NaN, infinities saturate
    v.reshape(-1)[-3:] = [np.nan, np.inf, -np.inf]
    num_pages = -(-n // P) + 5
    slot = rng.permutation(num_pages * P)[:n].astype(np.int32)
    slot[4] = slot[n // 2 + 1] = -1
    before = rng.integers(0, 256, (num_pages, 2, H_KV, P, d), dtype=np.uint8)
    want = before.copy()
    for i in np.flatnonzero(slot >= 0):
        s = slot[i]
        want[s // P, 0, :, s % P] = _codes(fp8_ref.quantize(k[i], scale[0], fmt), fmt)
        want[s // P, 1, :, s % P] = _codes(fp8_ref.quantize(v[i], scale[1], fmt), fmt)
    qkv = np.concatenate([np.full((n, hq, d), np.nan, np.float16), k, v], axis=1)
    q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q_pos = np.concatenate([np.arange(m) for m in lens]).astype(np.int32)
    prefill_args = [q_indptr, q_pos, np.zeros((n, 2), np.int32)]
    for name in ("append", "append_qkv", "ragged_prefill_causal_qkv"):
        pages = to_dev(before.view(fp8_ref.np_dtype(fmt)), target)
        scale_d, slot_d = to_dev(scale, target), to_dev(slot, target)
        if name == "append":
            lib[name](pages, scale_d, to_dev(k, target), to_dev(v, target), slot_d)
        elif name == "append_qkv":
            lib[name](pages, scale_d, to_dev(qkv, target), slot_d)
        else:  # a prefill without history stores the new K/V as it attends (cuda sm_90: its copying warps)
            o = to_dev(np.zeros((n, hq, d), np.float16), target)
            lse = to_dev(np.zeros((n, hq), np.float32), target)
            args = [to_dev(a, target) for a in (qkv, *prefill_args)]
            lib[name](*args, pages, scale_d, slot_d, o, lse, 1.0, *ROPE)
        got = pages.numpy().view(np.uint8)
        nan = np.isnan(want.view(fp8_ref.np_dtype(fmt)).astype(np.float32))  # (NaN codes may differ in bits)
        assert np.isnan(got.view(fp8_ref.np_dtype(fmt))[nan].astype(np.float32)).all()
        bad = np.argwhere((got != want) & ~nan)
        assert not len(bad), f"{name}: {len(bad)} codes differ, first at {bad[0].tolist()}"
    want = got.copy()  # (as stored, NaN codes included)
    # copies move codes: copy_page of the first 5 slots of page 1 onto page 2, gather of 3 slots
    lib["copy_page"](pages, 1, 2, 5)
    want[2, :, :, :5] = want[1, :, :, :5]
    assert np.array_equal(pages.numpy().view(np.uint8), want)
    slots = np.array([3, 2 * P + 1, 5 * P + P - 1], np.int32)
    kd = to_dev(np.zeros((3, H_KV, d), np.uint8).view(fp8_ref.np_dtype(fmt)), target)
    vd = to_dev(np.zeros((3, H_KV, d), np.uint8).view(fp8_ref.np_dtype(fmt)), target)
    lib["gather"](pages, to_dev(slots, target), kd, vd)
    assert np.array_equal(kd.numpy().view(np.uint8), want[slots // P, 0, :, slots % P])
    assert np.array_equal(vd.numpy().view(np.uint8), want[slots // P, 1, :, slots % P])


@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_fp8_requantize_pages_re_encodes_listed_pages(target, fmt, rng):
    """``requantize_pages`` turns each code of the listed pages into ``quantize(value * from / to)``
    bit for bit (to larger and to smaller scales: rounding, saturation, subnormals), leaves every
    other page alone, and gives every code back under equal scales (NaN codes aside)."""
    lib = load_kernels(_spec(target, fmt), rope_mode="none")
    frm = _scales(rng)
    to = (frm * rng.choice([0.3, 1.0, 2.7], frm.shape)).astype(np.float32)
    values = (rng.standard_normal((7, 2, H_KV, P, D)) * 200).astype(np.float32) * frm[None, :, :, None, None]
    values[0, 0, 0, 0, :4] = [0.0, -0.0, 1e-30, -1e-30]
    codes = fp8_ref.quantize_pages(values, frm, fmt)
    codes.view(np.uint8)[5, 1, 0, 3, :3] = [0x7F, 0xFF, 0x7F]  # NaN codes (both formats) stay NaN
    ids = np.array([5, 0, 3], np.int32)
    want = codes.copy()
    for i in ids:
        back = fp8_ref.dequantize_pages(codes[i : i + 1], frm).astype(np.float32)  # exact values
        want[i] = fp8_ref.quantize_pages(back, to, fmt)[0]
    pages = to_dev(codes, target)
    lib["requantize_pages"](pages, to_dev(to, target), to_dev(ids, target), to_dev(frm, target))
    got = pages.numpy()
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan) and nan.sum() == 3
    bad = np.argwhere((got.view(np.uint8) != want.view(np.uint8)) & ~nan)
    assert not len(bad), f"{len(bad)} codes differ, first at {bad[0].tolist()}"
    pages = to_dev(codes, target)
    lib["requantize_pages"](pages, to_dev(frm, target), to_dev(ids, target), to_dev(frm, target))
    got, same = pages.numpy(), ~np.isnan(codes.astype(np.float32))
    assert np.isnan(got.astype(np.float32)[~same]).all()  # (a NaN's sign is not kept)
    assert np.array_equal(got.view(np.uint8)[same], codes.view(np.uint8)[same])


def test_fp8_split_rope_append_stores_rotated_codes(target, rng):
    """``split_rope_append`` (rope mode "normal") stores the rotated key, rounded to fp16 as
    ``split_rope`` would give it, then quantized, and the value quantized, at each slot."""
    fmt = "float8_e4m3fn"
    spec = _spec(target, fmt)
    lib = load_kernels(spec, rope_mode="normal")
    n = 7
    scale = _scales(rng)
    qkv = (rng.standard_normal((n, H_QO + 2 * H_KV, D)) * 2).astype(np.float16)
    pos = rng.integers(0, 5000, n).astype(np.int32)
    slot = rng.permutation(4 * P)[:n].astype(np.int32)
    k = ref.rope(qkv[:, H_QO : H_QO + H_KV], pos, *ROPE).astype(np.float32).astype(np.float16)
    before = np.zeros((4, 2, H_KV, P, D), np.uint8)
    want = before.copy()
    want[slot // P, 0, :, slot % P] = _codes(fp8_ref.quantize(k, scale[0], fmt), fmt)
    want[slot // P, 1, :, slot % P] = _codes(fp8_ref.quantize(qkv[:, H_QO + H_KV :], scale[1], fmt), fmt)
    pages = to_dev(before.view(fp8_ref.np_dtype(fmt)), target)
    q = to_dev(np.zeros((n, H_QO, D), np.float16), target)
    args = (to_dev(qkv, target), to_dev(pos, target), q, pages, to_dev(scale, target), to_dev(slot, target))
    lib["split_rope_append"](*args, *ROPE)
    got = pages.numpy().view(np.uint8)
    # a rotated key within an fp16 rounding of a code boundary may land on the neighbouring code
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


@pytest.mark.parametrize(
    "fmt, dtype", [("float8_e4m3fn", "float16"), ("float8_e5m2", "float16"), ("float8_e4m3fn", "bfloat16")]
)
def test_fp8_attention_reads_dequantized(target, fmt, dtype, rng):
    """Paged prefill (causal and not, q separate or in the fused qkv), paged decode and the split decode
    (chunks merged by ``merge_splits``) over fp8 pages compute attention over the dequantized values
    (fp64 reference); the pool's other slots hold NaN codes. bfloat16 activations: the codes become
    bfloat16 (exactly) where the kernels convert them."""
    spec = _spec(target, fmt, dtype)
    lib = load_kernels(spec, rope_mode="none")
    act = numpy_dtype(dtype)
    scale = _scales(rng)
    sm_scale = 1.0 / math.sqrt(D)
    hist, new = [0, 2 * P, 37, 5], [5, 4, 1, 9]
    kv_lens = [h + m for h, m in zip(hist, new)]
    tab = Table(rng, kv_lens, fmt, scale)
    n = sum(new)
    q = rng.standard_normal((n, H_QO, D)).astype(act)
    _check_paged_prefills(target, lib, tab, scale, q, hist, new)
    dev_pages, dev_scale = to_dev(tab.pages, target), to_dev(scale, target)
    tables = [to_dev(a, target) for a in tab.tables()]
    # decode: one query per sequence at its last position
    B = len(kv_lens)
    qd = rng.standard_normal((B, H_QO, D)).astype(act)
    qd_pos = np.array(kv_lens, np.int32) - 1
    o_ref, lse_ref = ref.paged_decode(qd, qd_pos, tab.values, *tab.tables(), sm_scale, *ROPE)
    o = to_dev(np.zeros_like(qd), target)
    lse = to_dev(np.zeros((B, H_QO), np.float32), target)
    lib["paged_decode"](
        to_dev(qd, target), to_dev(qd_pos, target), dev_pages, dev_scale, *tables, o, lse, sm_scale, *ROPE
    )
    _check(o, lse, o_ref, lse_ref)
    # the split decode: 3 chunks of 16 keys and more, merged by merge_splits
    S = 3
    o_part = to_dev(np.full((S, B, H_QO, D), np.nan, np.float32), target)
    lse_part = to_dev(np.full((S, B, H_QO), np.nan, np.float32), target)
    args = (to_dev(qd, target), to_dev(qd_pos, target), dev_pages, dev_scale, *tables)
    lib["paged_decode_split"](*args, o_part, lse_part, sm_scale, *ROPE, 16)
    o = to_dev(np.zeros_like(qd), target)
    lib["merge_splits"](o_part, lse_part, o, lse)
    _check(o, lse, o_ref, lse_ref)


@pytest.mark.parametrize(
    "fmt, dtype, hq, d",
    [("float8_e4m3fn", "float16", 8, 128), ("float8_e5m2", "float16", 8, 128), ("float8_e4m3fn", "bfloat16", 4, 64)],
)
def test_fp8_prefill_over_long_history(target, fmt, dtype, hq, d, rng):
    """Paged prefill over fp8 pages whose history spans many key tiles (on sm_90 the warpgroup-MMA
    schedule, whose copying warpgroup converts each tile's codes into a ring of three shared-memory slots:
    700 keys are six 128-key tiles, so every slot is refilled), chunks of 1 to 129 new tokens, causal
    and not, q separate and in the fused qkv, against the fp64 attention over the dequantized values.
    The codes cover the format's range: saturated values, subnormals and zeros; then a pool of only
    subnormal V codes under a V scale that makes them 1 to 3 (keys all zero: each output is a mean of
    those values), where a conversion flushing subnormals would be off by 1 or more."""
    h_kv = H_KV
    spec = KernelSpec(hq, h_kv, d, P, dtype, target, fmt)
    lib = load_kernels(spec, rope_mode="none")
    act = numpy_dtype(dtype)
    scale = (rng.uniform(0.5, 3.0, (2, h_kv)) / 448.0 * 4).astype(np.float32)
    hist, new = [700, 0, 389, 130], [64, 129, 1, 33]
    kv_lens = [h + m for h, m in zip(hist, new)]
    num_pages = sum(-(-n // P) for n in kv_lens) + 3  # (Table's pool)
    values = rng.standard_normal((num_pages, 2, h_kv, P, d)).astype(np.float32)
    top = fp8_ref.largest(fmt) * scale[1, 0]
    values[::3, 1, 0, ::5, :3] = top * np.array([1.5, -4.0, 0.9])  # V beyond (saturated) and near the top
    tiny = float(fp8_ref.subnormal_half_step(fmt)) * scale[:, :, None] * np.array([0, 1.0, 3.0, 7.0])
    values[1::4, :, :, 3, 4:8] = tiny  # K and V among the subnormals (and zero)
    values[2::4, :, :, 7, 8:12] = -tiny
    tab = Table(rng, kv_lens, fmt, scale, values, h_kv=h_kv, d=d)
    n = sum(new)
    q = rng.standard_normal((n, hq, d)).astype(act)
    _check_paged_prefills(target, lib, tab, scale, q, hist, new)
    step = 2 * float(fp8_ref.subnormal_half_step(fmt))  # the smallest subnormal
    sub_scale = np.stack([np.ones(h_kv), np.full(h_kv, 1 / step)]).astype(np.float32)
    sub = np.zeros((num_pages, 2, h_kv, P, d), np.float32)
    sub[:, 1] = rng.integers(1, 4, sub[:, 1].shape) * np.array([1, -1] * (h_kv // 2))[None, :, None, None]
    tab = Table(rng, kv_lens, fmt, sub_scale, sub, h_kv=h_kv, d=d)
    (o_ref,) = _check_paged_prefills(target, lib, tab, sub_scale, q, hist, new, variants=(("causal", False),))
    assert np.abs(o_ref).min() >= 1


def _check_paged_prefills(target, lib, tab, scale, q, hist, new, variants=None):
    """Run ``lib``'s paged prefills over ``tab``'s fp8 pages (``variants``: (mask, fused qkv) pairs; default
    causal, none, causal fused) for queries ``q`` of sequences with ``hist`` tokens of history and
    ``new`` new tokens each, and check each against the fp64 reference over the dequantized values.
    Returns the reference outputs."""
    n, hq, d = q.shape
    h_kv = tab.pages.shape[2]
    sm_scale = 1.0 / math.sqrt(d)
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q_pos = np.concatenate([np.arange(h, h + m) for h, m in zip(hist, new)]).astype(np.int32)
    trees = [np.zeros((1, 2), np.int32), np.zeros(1, np.int32), np.zeros((1, 3), np.int32), np.zeros(1, np.int32)]
    dev_pages, dev_scale = to_dev(tab.pages, target), to_dev(scale, target)
    tables = [to_dev(a, target) for a in tab.tables()]
    refs = []
    for mask, fused in variants or (("causal", False), ("none", False), ("causal", True)):
        o_ref, lse_ref = ref.paged_prefill(
            q, q_indptr, q_pos, tab.values, *tab.tables(), *trees, sm_scale, *ROPE, mask=mask
        )
        qin = np.concatenate([q, np.full((n, 2 * h_kv, d), np.nan, q.dtype)], axis=1) if fused else q
        o = to_dev(np.zeros_like(q), target)
        lse = to_dev(np.zeros((n, hq), np.float32), target)
        head = [to_dev(a, target) for a in (qin, q_indptr, q_pos)]
        kernel = lib[f"paged_prefill_{mask}" + ("_qkv" if fused else "")]
        kernel(*head, dev_pages, dev_scale, *tables, *[to_dev(a, target) for a in trees], o, lse, sm_scale, *ROPE)
        _check(o, lse, o_ref, lse_ref)
        refs.append(o_ref)
    return refs


def _decode_vs_format_bound(target, lib, fmt, values, scale, rng):
    """Decode over fp8 pages holding ``values`` under ``scale`` against decode over ``values`` itself:
    per (sequence, query head), the error and the bound the format gives (see
    :func:`test_fp8_decode_error_within_format_bound`); returns [(err, bound, o_exact)]."""
    kv_lens = [300, 1000, 33]
    B = len(kv_lens)
    tab = Table(rng, kv_lens, fmt, scale, values)
    exact = values.astype(np.float64)
    q = rng.standard_normal((B, H_QO, D)).astype(np.float16)
    q_pos = np.array(kv_lens, np.int32) - 1
    sm_scale = 1.0 / math.sqrt(D)
    o_exact, _ = ref.paged_decode(q, q_pos, exact, *tab.tables(), sm_scale, *ROPE)
    o = to_dev(np.zeros_like(q), target)
    lse = to_dev(np.zeros((B, H_QO), np.float32), target)
    args = [to_dev(a, target) for a in (q, q_pos)] + [to_dev(tab.pages, target), to_dev(scale, target)]
    lib["paged_decode"](*args, *[to_dev(a, target) for a in tab.tables()], o, lse, sm_scale, *ROPE)
    got = o.numpy().astype(np.float64)
    u, half_sub = fp8_ref.unit_roundoff(fmt), fp8_ref.subnormal_half_step(fmt)
    group = H_QO // H_KV
    out = []
    for b, n in enumerate(kv_lens):
        ids = tab.page_indices[tab.page_indptr[b] : tab.page_indptr[b + 1]]
        k = np.stack([exact[ids[j // P], 0, :, j % P] for j in range(n)])  # [n, H_kv, D]
        v = np.stack([exact[ids[j // P], 1, :, j % P] for j in range(n)])
        for h in range(H_QO):
            hk = h // group
            qh = q[b, h].astype(np.float64)
            a_k, a_v = half_sub * scale[0, hk], half_sub * scale[1, hk]
            s = sm_scale * (k[:, hk] @ qh)
            p = np.exp(s - s.max())
            p /= p.sum()
            var_s = sm_scale**2 * ((u * k[:, hk]) ** 2 + a_k**2) @ qh**2 / 3  # [n]
            var_o = (p**2) @ ((u * v[:, hk]) ** 2 + a_v**2) / 3 + (p**2 * var_s) @ (v[:, hk] - o_exact[b, h]) ** 2
            bound = 6 * np.sqrt(var_o) + 2.0**-11 * np.abs(o_exact[b, h]) + 1e-4
            out.append((np.abs(got[b, h] - o_exact[b, h]), bound, o_exact[b, h]))
    return out


@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_fp8_decode_error_within_format_bound(target, fmt, rng):
    """On N(0, 1) keys and values with per-head scales ``amax / largest`` (what calibration picks),
    decode over fp8 pages stays within the error that fp8 rounding explains, element by element of
    the output, against decode over the unquantized values. The bound, from the format:

    * rounding to nearest moves a stored value ``x`` by at most half an ulp: ``|dx| <= u |x|`` in the
      normal range (``u`` the unit roundoff: 2^-4 for e4m3fn, 2^-3 for e5m2) and ``a``, half the
      subnormal step times the scale, below it; over values that are not aligned with the format's
      grid the errors are independent, zero-mean, of variance at most ``(u^2 x^2 + a^2) / 3``;
    * to first order the output moves by ``do = sum_j p_j dv_j + sum_j p_j (v_j - o) ds_j`` with
      ``ds_j = sm_scale q . dk_j``, so its variance is at most ``sum_j p_j^2 (u^2 v_j^2 + a_v^2) / 3 +
      sum_j p_j^2 (v_j - o)^2 sm_scale^2 sum_d q_d^2 (u^2 k_jd^2 + a_k^2) / 3``;
    * the bound is 6 of those standard deviations, plus the fp16 rounding of the output
      (``2^-11 |o|``) and fp32 accumulation (``1e-4``).

    (The worst case, every rounding error aligned, is a thousand times looser on this data and says
    nothing.) The bound must hold everywhere, and on average stay well under the outputs' rms."""
    lib = load_kernels(_spec(target, fmt), rope_mode="none")
    values = rng.standard_normal((88, 2, H_KV, P, D)).astype(np.float16).astype(np.float32)
    scale = (np.abs(values).max(axis=(0, 3, 4)) / fp8_ref.largest(fmt)).astype(np.float32)
    worst = 0.0
    for err, bound, o_exact in _decode_vs_format_bound(target, lib, fmt, values, scale, rng):
        assert (err <= bound).all(), f"error {err.max():.4g} over the bound {bound.min():.4g}"
        worst = max(worst, float(bound.mean() / np.sqrt((o_exact**2).mean())))
    # 6 sigma of u = 2^-4 (2^-3) relative rounding: about a third (two thirds) of the outputs' rms
    assert worst < (0.4 if fmt == "float8_e4m3fn" else 0.8), f"the bound ({worst:.3g} of the outputs' rms) says little"


@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_fp8_calibrated_scales_keep_outlier_channels(target, fmt, rng):
    """Keys and values with outlier channels (three channels of every head 20x larger, as large
    activations of real models are) and one KV head 4x larger than the other, quantized with per-head
    scales calibrated from the data (``amax / largest``, what a calibration over the first tokens
    computes): decode stays within the format's bound (:func:`test_fp8_decode_error_within_format_bound`)
    on every output element, and for the median row the bound stays well under the outputs' rms."""
    lib = load_kernels(_spec(target, fmt), rope_mode="none")
    values = rng.standard_normal((88, 2, H_KV, P, D)).astype(np.float32)
    values[..., :3] *= 20  # outlier channels
    values[:, :, 1] *= 4  # a louder head
    values = values.astype(np.float16).astype(np.float32)
    calibrated = (np.abs(values).max(axis=(0, 3, 4)) / fp8_ref.largest(fmt)).astype(np.float32)
    assert calibrated[:, 1].min() > 2 * calibrated[:, 0].max()  # the heads need scales of their own
    ratios = []
    for err, bound, o_exact in _decode_vs_format_bound(target, lib, fmt, values, calibrated, rng):
        assert (err <= bound).all(), f"error {err.max():.4g} over the bound {bound.min():.4g}"
        ratios.append(float(bound.mean() / np.sqrt((o_exact**2).mean())))
    # the outliers make some rows' softmax peaked (a few keys' scores decide it), and their bound loose;
    # the typical row's stays a small part of its output
    median = float(np.median(ratios))
    assert median < (0.3 if fmt == "float8_e4m3fn" else 0.6), (
        f"the bound ({median:.3g} of the outputs' rms) says little"
    )


def _needle_weight(lib, target, fmt, rng_seed):
    """Decode of one sequence of 32768 keys over pages of ``fmt`` (None: fp16 pages) with a key
    planted at a random position, aligned with query head 0 so that its score beats the others by
    about 10 (natural log units); returns (attention weight of the planted key on head 0, its
    position). The planted value is 1 in dim 0 where every other value is 0, so ``o[0]`` is that
    weight times the stored value."""
    rng = np.random.default_rng(rng_seed)
    n = 32768
    npg = n // P
    keys = rng.standard_normal((npg, H_KV, P, D)).astype(np.float32)
    vals = rng.standard_normal((npg, H_KV, P, D)).astype(np.float32)
    vals[..., 0] = 0.0
    q = rng.standard_normal((1, H_QO, D)).astype(np.float16)
    at = int(rng.integers(0, n))
    sm_scale = 1.0 / math.sqrt(D)
    q0 = q[0, 0].astype(np.float64)
    keys[at // P, 0, at % P] = 14.0 * q0 / (sm_scale * (q0 @ q0))
    vals[at // P, 0, at % P, 0] = 1.0
    pages = np.stack([keys, vals], axis=1).astype(np.float16)
    page_indices = rng.permutation(npg).astype(np.int32)
    shuffled = np.empty_like(pages)
    shuffled[page_indices] = pages
    if fmt is None:
        stored, scale_args, v_at = shuffled, (), 1.0
    else:
        amax = np.abs(shuffled.astype(np.float32)).max(axis=(0, 3, 4))
        scale = (amax / fp8_ref.largest(fmt)).astype(np.float32)
        stored = fp8_ref.quantize_pages(shuffled, scale, fmt)
        scale_args = (to_dev(scale, target),)
        v_at = float(fp8_ref.dequantize_pages(stored, scale)[page_indices[at // P], 1, 0, at % P, 0])
    tables = [np.array([0, npg], np.int32), page_indices, np.array([P], np.int32), np.zeros((1, 3), np.int32)]
    o = to_dev(np.zeros((1, H_QO, D), np.float16), target)
    lse = to_dev(np.zeros((1, H_QO), np.float32), target)
    head = [to_dev(q, target), to_dev(np.array([n - 1], np.int32), target), to_dev(stored, target)]
    lib["paged_decode"](*head, *scale_args, *[to_dev(a, target) for a in tables], o, lse, sm_scale, *ROPE)
    return float(o.numpy()[0, 0, 0]) / v_at, at


def test_fp8_needle_in_32k_context(target):
    """A key planted at a random position of a 32k-token context keeps the softmax with fp8 pages as
    with fp16 pages: its weight is above 1/2 (so it is the top-1 key) and within a few percent of the
    fp16 weight (fp32 accumulation: an fp8 or fp16 accumulator over 32k terms would lose it)."""
    fp16 = load_kernels(KernelSpec(H_QO, H_KV, D, P, "float16", target), rope_mode="none")
    for seed in (1, 2):
        w16, at = _needle_weight(fp16, target, None, seed)
        assert w16 > 0.5, f"fp16 pages: planted key at {at} has weight {w16:.3f}"
        for fmt in FP8_DTYPES:
            w8, _ = _needle_weight(load_kernels(_spec(target, fmt), rope_mode="none"), target, fmt, seed)
            assert w8 > 0.5 and abs(w8 - w16) < 0.05 * w16, f"{fmt}: weight {w8:.3f} vs fp16 {w16:.3f} (key at {at})"


@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_fp8_decode_layer_as_the_runtime_launches_it(target, fmt, rng):
    """A decode layer over fp8 pages as the runtime launches it: ``split_rope_append`` (q out, the new
    token's K/V quantized into its slot, the codes ``append`` stores) then ``paged_decode`` (and the
    split decode merged by ``merge_splits``): attention over the dequantized pages holding the new
    token, though its slots held NaN codes before. fp8 kernel sets on the CUDA-core decode (here head_dim
    64) have no one-launch ``paged_decode_append`` (slower for them than the two launches; the
    tensor-core one has it: test_fp8_tensor_core_decode_with_append)."""
    spec = _spec(target, fmt)
    lib = load_kernels(spec, rope_mode="none")
    assert "paged_decode_append" not in lib and "paged_decode_append_split" not in lib
    scale = _scales(rng)
    kv_lens = [1, P, 2 * P + 3, 37, 300]  # the new token is each sequence's last slot
    B = len(kv_lens)
    tab = Table(rng, kv_lens, fmt, scale)
    qkv = rng.standard_normal((B, H_QO + 2 * H_KV, D)).astype(np.float16)
    q_pos = np.array(kv_lens, np.int32) - 1
    last = tab.page_indices[tab.page_indptr[1:] - 1]
    slot = (last * P + tab.last_page_len - 1).astype(np.int32)
    want = tab.pages.view(np.uint8).copy()
    want[slot // P, 0, :, slot % P] = _codes(fp8_ref.quantize(qkv[:, H_QO : H_QO + H_KV], scale[0], fmt), fmt)
    want[slot // P, 1, :, slot % P] = _codes(fp8_ref.quantize(qkv[:, H_QO + H_KV :], scale[1], fmt), fmt)
    values = fp8_ref.dequantize_pages(want.view(fp8_ref.np_dtype(fmt)), scale)
    sm_scale = 1.0 / math.sqrt(D)
    o_ref, lse_ref = ref.paged_decode(qkv[:, :H_QO], q_pos, values, *tab.tables(), sm_scale, *ROPE)
    stale = want.copy()
    stale[slot // P, :, :, slot % P] = NAN_CODE
    tables = [to_dev(a, target) for a in tab.tables()]
    dev_scale, dev_pos = to_dev(scale, target), to_dev(q_pos, target)
    for split in (False, True):
        pages = to_dev(stale.view(fp8_ref.np_dtype(fmt)), target)
        q = to_dev(np.zeros((B, H_QO, D), np.float16), target)
        lib["split_rope_append"](to_dev(qkv, target), dev_pos, q, pages, dev_scale, to_dev(slot, target), *ROPE)
        assert np.array_equal(pages.numpy().view(np.uint8), want)
        o = to_dev(np.ones((B, H_QO, D), np.float16), target)
        lse = to_dev(np.zeros((B, H_QO), np.float32), target)
        args = (q, dev_pos, pages, dev_scale, *tables)
        if split:
            S = -(-max(kv_lens) // 64)
            o_part = to_dev(np.full((S, B, H_QO, D), np.nan, np.float32), target)
            lse_part = to_dev(np.full((S, B, H_QO), np.nan, np.float32), target)
            lib["paged_decode_split"](*args, o_part, lse_part, sm_scale, *ROPE, 64)
            lib["merge_splits"](o_part, lse_part, o, lse)
        else:
            lib["paged_decode"](*args, o, lse, sm_scale, *ROPE)
        _check(o, lse, o_ref, lse_ref)


def test_fp8_decode_with_inline_rope_and_window(target, rng):
    """The decode over fp8 pages with inline RoPE (each key rotated after its codes are widened) and a
    sliding window with attention sink (only visited slots read), unsplit and split + merged, against the
    fp64 reference over the dequantized values."""
    fmt = "float8_e4m3fn"
    lib = load_kernels(_spec(target, fmt), rope_mode="inline", sliding=True)
    scale = _scales(rng)
    kv_lens = [1, 33, 70, 300]
    tab = Table(rng, kv_lens, fmt, scale)
    tab.kv_window[2] = (2, 40, 11)  # sink 2 slots, window from slot 40, positions shifted by 11
    tab.kv_window[3] = (4, 150, 30)
    B = len(kv_lens)
    q = rng.standard_normal((B, H_QO, D)).astype(np.float16)
    q_pos = np.array([n - 1 + w[2] for n, w in zip(kv_lens, tab.kv_window, strict=True)], np.int32)
    sm_scale = 1.0 / math.sqrt(D)
    o_ref, lse_ref = ref.paged_decode(
        q, q_pos, tab.values, *tab.tables(), sm_scale, *ROPE, sliding=True, inline_rope=True
    )
    args = [to_dev(a, target) for a in (q, q_pos)] + [to_dev(tab.pages, target), to_dev(scale, target)]
    args += [to_dev(a, target) for a in tab.tables()]
    o = to_dev(np.zeros_like(q), target)
    lse = to_dev(np.zeros((B, H_QO), np.float32), target)
    lib["paged_decode"](*args, o, lse, sm_scale, *ROPE)
    _check(o, lse, o_ref, lse_ref, tol=3e-2)
    S = -(-max(kv_lens) // 64)
    o_part = to_dev(np.full((S, B, H_QO, D), np.nan, np.float32), target)
    lse_part = to_dev(np.full((S, B, H_QO), np.nan, np.float32), target)
    lib["paged_decode_split"](*args, o_part, lse_part, sm_scale, *ROPE, 64)
    o = to_dev(np.zeros_like(q), target)
    lib["merge_splits"](o_part, lse_part, o, lse)
    _check(o, lse, o_ref, lse_ref, tol=3e-2)


def _check_unsplit_decode(lib, target, q, q_pos, tab, scale, sm_scale, o_ref, lse_ref):
    """Run ``paged_decode`` over ``tab``'s pages and check it against the reference; returns the kernel's
    device arguments up to the outputs and the device ``lse`` buffer, for the split runs that follow."""
    args = [to_dev(a, target) for a in (q, q_pos)] + [to_dev(tab.pages, target), to_dev(scale, target)]
    args += [to_dev(a, target) for a in tab.tables()]
    o = to_dev(np.ones_like(q), target)
    lse = to_dev(np.zeros(q.shape[:2], np.float32), target)
    lib["paged_decode"](*args, o, lse, sm_scale, *ROPE)
    _check(o, lse, o_ref, lse_ref)
    return args, lse


# the tensor-core decode (decode_cuda, "Tensor cores"): H_qo, H_kv, D, P, format
TC_SHAPES = [
    (8, 2, 128, 16, "float8_e4m3fn"),  # group 4: mma rows 4..15 idle; a 16-key group in one or two pages
    (16, 1, 128, 8, "float8_e5m2"),  # group 16: two blocks of 8 heads; pages of 8 slots (a page id a row)
]


@pytest.mark.parametrize("shape", TC_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_fp8_tensor_core_decode(target, shape, rng):
    """The cuda decode of fp8 pages under fp16 activations at head_dim 128 runs on the tensor cores
    (q's heads as mma rows, K and V codes converted into B fragments, P from the score accumulators):
    unsplit, split (chunks below a 16-key group, not a multiple of it, of several tiles, beyond every
    sequence; the empty sequence included) + merge_splits, and split + merge in one launch, against the
    fp64 reference over the dequantized values. cuda only: llvm has one schedule, tested above."""
    if target != "cuda":
        pytest.skip("the tensor-core decode is a cuda schedule")
    from tvmkv.tir.decode_layout import MERGE_MAX_SPLITS, split_granule, tensor_core_layout

    h_qo, h_kv, d, p, fmt = shape
    spec = KernelSpec(h_qo, h_kv, d, p, "float16", target, fmt)
    assert tensor_core_layout(spec) is not None
    lib = load_kernels(spec, rope_mode="none")
    scale = (rng.uniform(0.5, 3.0, (2, h_kv)) / 448.0 * 4).astype(np.float32)
    kv_lens = [0, 1, 15, 16, 17, 31, 100, 300, 1000]
    B = len(kv_lens)
    tab = Table(rng, kv_lens, fmt, scale, h_kv=h_kv, d=d, p=p)
    q = rng.standard_normal((B, h_qo, d)).astype(np.float16)
    q_pos = np.array([max(n - 1, 0) for n in kv_lens], np.int32)
    sm_scale = 1.0 / math.sqrt(d)
    o_ref, lse_ref = ref.paged_decode(q, q_pos, tab.values, *tab.tables(), sm_scale, *ROPE)
    args, lse = _check_unsplit_decode(lib, target, q, q_pos, tab, scale, sm_scale, o_ref, lse_ref)
    blocks = split_granule(spec)[0]
    for kv_chunk in (5, 48, 64, 1000):
        S = -(-max(kv_lens) // kv_chunk)
        part_ref = ref.paged_decode_split(q, q_pos, tab.values, *tab.tables(), sm_scale, *ROPE, kv_chunk, S)
        o_part = to_dev(np.full((S, B, h_qo, d), np.nan, np.float32), target)
        lse_part = to_dev(np.full((S, B, h_qo), np.nan, np.float32), target)
        lib["paged_decode_split"](*args, o_part, lse_part, sm_scale, *ROPE, kv_chunk)
        _check(o_part, lse_part, *part_ref)  # each chunk's normalized state (V scale applied), float32
        o = to_dev(np.ones_like(q), target)
        lse = to_dev(np.zeros((B, h_qo), np.float32), target)
        lib["merge_splits"](o_part, lse_part, o, lse)
        _check(o, lse, o_ref, lse_ref)
        if S <= MERGE_MAX_SPLITS:
            counter = to_dev(np.zeros(B * blocks, np.int32), target)
            o = to_dev(np.ones_like(q), target)
            lib["paged_decode_split_merge"](*args, o_part, lse_part, counter, o, lse, sm_scale, *ROPE, kv_chunk)
            _check(o, lse, o_ref, lse_ref)
            assert not counter.numpy().any()


def test_fp8_tensor_core_decode_when_the_max_moves(target):
    """The tensor-core decode moves a warp's reference max (and rescales its state) only in tiles where
    some query head's score passes it by more than LAZY_RESCALE (8, base 2). Keys along a staircase
    whose every step, each 48 keys, raises the scores by about 10 in base 2: a climbing sequence moves
    the reference in most tiles of each warp, after its first, in each 256-key chunk too; a falling one
    has its max in the first tile, and later tiles skip the rescale; a third climbs for one query head
    of each group while another falls. Unsplit and split + merge in one launch, against the fp64
    reference."""
    if target != "cuda":
        pytest.skip("the tensor-core decode is a cuda schedule")
    from tvmkv.tir.decode_layout import split_granule

    h_qo, h_kv, d, p, fmt = TC_SHAPES[0]
    spec = KernelSpec(h_qo, h_kv, d, p, "float16", target, fmt)
    lib = load_kernels(spec, rope_mode="none")
    kv_lens = [1000, 1000, 700]
    B, group = len(kv_lens), h_qo // h_kv
    rng = np.random.default_rng(11)
    q = rng.standard_normal((B, h_qo, d)).astype(np.float16)
    layout = Table(np.random.default_rng(5), kv_lens, fmt, np.ones((2, h_kv), np.float32), h_kv=h_kv, d=d, p=p)
    values = rng.standard_normal((len(layout.pages), 2, h_kv, p, d)).astype(np.float32) * 0.3
    unit = q.astype(np.float32) / np.linalg.norm(q.astype(np.float32), axis=-1, keepdims=True)
    # a step of 7 along a query's unit vector adds 7 |q| / sqrt(d) * log2(e), about 10, to its base-2 score
    step, every = 7.0, 48
    for b, n in enumerate(kv_lens):
        ids = layout.page_indices[layout.page_indptr[b] : layout.page_indptr[b + 1]]
        top = (n - 1) // every * step
        for j in range(n):
            up = j // every * step
            up, down = (up, 0.0) if b == 0 else (0.0, top - up) if b == 1 else (up, top - up)
            for hk in range(h_kv):  # head 0 of the group climbs or falls (sequence 2: head 1 climbs)
                h0 = hk * group
                toward = unit[b, h0 + 1] if b == 2 else unit[b, h0]
                values[ids[j // p], 0, hk, j % p] += up * toward + down * unit[b, h0]
    scale = (np.abs(values).max(axis=(0, 3, 4)) / 440.0).astype(np.float32)  # [K | V, kv head]: no saturation
    tab = Table(np.random.default_rng(5), kv_lens, fmt, scale, values, h_kv=h_kv, d=d, p=p)
    assert np.array_equal(tab.page_indices, layout.page_indices)
    q_pos = np.array(kv_lens, np.int32) - 1
    sm_scale = 1.0 / math.sqrt(d)
    o_ref, lse_ref = ref.paged_decode(q, q_pos, tab.values, *tab.tables(), sm_scale, *ROPE)
    args, lse = _check_unsplit_decode(lib, target, q, q_pos, tab, scale, sm_scale, o_ref, lse_ref)
    kv_chunk = 256
    S = -(-max(kv_lens) // kv_chunk)
    o_part = to_dev(np.full((S, B, h_qo, d), np.nan, np.float32), target)
    lse_part = to_dev(np.full((S, B, h_qo), np.nan, np.float32), target)
    counter = to_dev(np.zeros(B * split_granule(spec)[0], np.int32), target)
    o = to_dev(np.ones_like(q), target)
    lib["paged_decode_split_merge"](*args, o_part, lse_part, counter, o, lse, sm_scale, *ROPE, kv_chunk)
    _check(o, lse, o_ref, lse_ref)


@pytest.mark.parametrize(
    "shape, mode", [(TC_SHAPES[0], "none"), (TC_SHAPES[0], "normal"), (TC_SHAPES[1], "none")], ids=str
)
def test_fp8_tensor_core_decode_with_append(target, shape, mode, rng):
    """A decode layer in one launch on the tensor cores (``paged_decode_append``, split or not, in both
    layouts: the default and the small-batch one, ``*_small_batch``): the new
    token's K / V codes (k rotated in rope mode "normal", rounded to fp16 first, as split_rope_append
    stores it) land in their slots bit for bit, and the output matches the fp64 decode over the pages
    holding them, though those slots held NaN codes when the kernel started (the blocks that read the
    new key store it first). cuda only: the CUDA-core fp8 decode keeps two launches."""
    if target != "cuda":
        pytest.skip("the tensor-core decode is a cuda schedule")
    from tvmkv.tir.decode_layout import split_granule

    h_qo, h_kv, d, p, fmt = shape
    spec = KernelSpec(h_qo, h_kv, d, p, "float16", target, fmt)
    lib = load_kernels(spec, rope_mode=mode)
    assert "paged_decode_append_small_batch" in lib and "paged_decode_append_split_small_batch" in lib
    scale = (rng.uniform(0.5, 3.0, (2, h_kv)) / 448.0 * 4).astype(np.float32)
    kv_lens = [1, p, 2 * p + 3, 37, 300, 1000]  # the new token is each sequence's last slot
    B = len(kv_lens)
    tab = Table(rng, kv_lens, fmt, scale, h_kv=h_kv, d=d, p=p)
    qkv = rng.standard_normal((B, h_qo + 2 * h_kv, d)).astype(np.float16)
    q_pos = np.array(kv_lens, np.int32) - 1
    last = tab.page_indices[tab.page_indptr[1:] - 1]
    slot = (last * p + tab.last_page_len - 1).astype(np.int32)
    q, k_new = qkv[:, :h_qo].astype(np.float64), qkv[:, h_qo : h_qo + h_kv]
    if mode == "normal":
        k_new = ref.rope(k_new, q_pos, *ROPE).astype(np.float32).astype(np.float16)
        q = ref.rope(q, q_pos, *ROPE)
    want = tab.pages.view(np.uint8).copy()
    want[slot // p, 0, :, slot % p] = _codes(fp8_ref.quantize(k_new, scale[0], fmt), fmt)
    want[slot // p, 1, :, slot % p] = _codes(fp8_ref.quantize(qkv[:, h_qo + h_kv :], scale[1], fmt), fmt)
    values = fp8_ref.dequantize_pages(want.view(fp8_ref.np_dtype(fmt)), scale)
    sm_scale = 1.0 / math.sqrt(d)
    o_ref, lse_ref = ref.paged_decode(q, q_pos, values, *tab.tables(), sm_scale, *ROPE)
    stale = want.copy()
    stale[slot // p, :, :, slot % p] = NAN_CODE
    tables = [to_dev(a, target) for a in tab.tables()]
    head = (to_dev(qkv, target), to_dev(q_pos, target))
    blocks = split_granule(spec)[0]
    for layout, kv_chunk in itertools.product(("", "_small_batch"), (None, 64, 200, 256)):
        pages = to_dev(stale.view(fp8_ref.np_dtype(fmt)), target)
        args = (*head, pages, to_dev(scale, target), *tables, to_dev(slot, target))
        o = to_dev(np.ones((B, h_qo, d), np.float16), target)
        lse = to_dev(np.zeros((B, h_qo), np.float32), target)
        if kv_chunk is None:
            lib["paged_decode_append" + layout](*args, o, lse, sm_scale, *ROPE)
        else:
            S = -(-max(kv_lens) // kv_chunk)
            o_part = to_dev(np.full((S, B, h_qo, d), np.nan, np.float32), target)
            lse_part = to_dev(np.full((S, B, h_qo), np.nan, np.float32), target)
            counter = to_dev(np.zeros(B * blocks, np.int32), target)
            kernel = lib["paged_decode_append_split" + layout]
            kernel(*args, o_part, lse_part, counter, o, lse, sm_scale, *ROPE, kv_chunk)
            assert not counter.numpy().any()
        assert np.array_equal(pages.numpy().view(np.uint8), want), (layout, kv_chunk)
        _check(o, lse, o_ref, lse_ref)


def test_fp8_split_granule_follows_the_decode_layout():
    """The runtime sizes the split's block grid and the in-kernel merge's arrival counters from
    split_granule: for fp8 kernel sets it must describe the decode the set holds, tensor-core (plain) or
    CUDA-core (sliding window, inline RoPE), whose blocks per sequence differ at a group of 8 or 16."""
    from tvmkv.tir.decode_layout import decode_layout, split_granule

    for h_qo, h_kv, d in [(32, 8, 128), (64, 8, 128), (32, 2, 128), (16, 1, 128)]:
        spec = KernelSpec(h_qo, h_kv, d, 16, "float16", "cuda", "float8_e4m3fn")
        tc, simt = decode_layout(spec), decode_layout(spec, tensor_cores=False)
        assert tc["TC"] and not simt["TC"]
        assert split_granule(spec) == (h_kv * tc["NGB"], tc["KB"])
        for kw in ({"sliding": True}, {"inline_rope": True}):
            assert split_granule(spec, **kw) == (h_kv * simt["NGB"], simt["KB"])
    spec = KernelSpec(64, 8, 128, 16, "float16", "cuda", "float8_e4m3fn")  # group 8: one block vs two
    assert split_granule(spec)[0] == 8 and split_granule(spec, sliding=True)[0] == 16
    for spec in (
        KernelSpec(32, 8, 256, 16, "float16", "cuda", "float8_e4m3fn"),
        KernelSpec(4, 2, 64, 16, "float16", "cuda", "float8_e4m3fn"),
        KernelSpec(32, 8, 128, 16, "bfloat16", "cuda", "float8_e4m3fn"),
    ):
        assert decode_layout(spec)["TC"] is False  # head_dim 64 / bf16 activations: the CUDA-core layout
        with pytest.raises(ValueError, match="tensor_cores=True.*head_dim in"):
            decode_layout(spec, tensor_cores=True)


def test_fp8_small_batch_decode_layout_for_steps_of_few_blocks(monkeypatch):
    """sm_90 kernel sets with the tensor-core decode carry a second one-launch layout (8 warps of 16
    keys: ``paged_decode_append[_split]_small_batch``; not for sm_89, whose shared memory a block of it
    would exceed); the runtime picks it for a decode step whose blocks, its split's chunks included,
    fill the SMs at most once, with the split the default layout would take (what was measured; the
    kernels take any chunk), and keeps the default layout above that (a forced split included, and
    beyond the in-kernel merge's 64 chunks), without those kernels, and where the step does not launch
    once."""
    import tvm

    from tvmkv.config import CacheConfig
    from tvmkv.runtime import launch
    from tvmkv.tir import kernel_set, small_batch_granule, split_granule

    spec = KernelSpec(32, 8, 128, 16, "float16", "cuda", "float8_e4m3fn")
    assert small_batch_granule(spec) == (8, 128) and split_granule(spec) == (8, 64)
    # 16-bit pages of the activation dtype take the tensor cores too (2 warps of 16 keys a block by default)
    assert small_batch_granule(KernelSpec(32, 8, 128, 16, "float16", "cuda")) == (8, 128)
    assert split_granule(KernelSpec(32, 8, 128, 16, "bfloat16", "cuda")) == (8, 32)
    assert small_batch_granule(KernelSpec(32, 8, 64, 16, "float16", "cuda")) is None  # head_dim 64: CUDA cores
    assert small_batch_granule(KernelSpec(32, 8, 128, 16, "bfloat16", "cuda", "float8_e4m3fn")) is None
    names = set(kernel_set(spec, rope_mode="none", arch="sm_90"))
    small = {"paged_decode_append_small_batch", "paged_decode_append_split_small_batch"}
    assert small <= names
    assert not small & set(kernel_set(spec, rope_mode="none", arch="sm_89"))  # (measured on sm_90 only)
    assert not small & set(kernel_set(spec, rope_mode="inline", arch="sm_90"))  # CUDA-core fp8 decode
    cfg = CacheConfig(1, 32, 8, 128, kv_dtype="float8_e4m3fn", target_kind="cuda", max_batch_size=64)
    L = launch.Launcher(cfg, tvm.cpu(0), dict.fromkeys(names), 132)
    for batch, keys in [(1, 1024), (1, 16384), (4, 1024), (16, 1024)]:
        split = L.decode_split(batch, keys)
        assert split.layout == "_small_batch", (batch, keys)
        assert batch * 8 * split.num_splits <= 132
        assert split.num_splits * split.kv_chunk >= keys or split.num_splits == 1
    assert L.decode_split(1, 1024) == (8, 128, "_small_batch")  # plan_split over 64-key tiles
    assert L.decode_split(16, 1024) == (1, 0, "_small_batch")
    for batch, keys in [(17, 1024), (32, 1024), (64, 4096)]:
        assert L.decode_split(batch, keys).layout == ""
    monkeypatch.setattr(launch, "ONE_LAUNCH_DECODE", False)
    assert L.decode_split(1, 1024) == (8, 128, "")  # two launches: the default layout's kernels
    monkeypatch.undo()
    without = launch.Launcher(cfg, tvm.cpu(0), dict.fromkeys(names - small), 132)
    assert without.decode_split(1, 1024) == (8, 128, "")
    # forced splits: the layout follows the grid they make, and the one-launch merge's 64 chunks
    forced = launch.Launcher(dataclasses.replace(cfg, decode_splits=4), tvm.cpu(0), dict.fromkeys(names), 132)
    assert forced.decode_split(4, 16384) == (4, 4096, "_small_batch")  # 128 blocks
    assert forced.decode_split(16, 16384) == (4, 4096, "")  # 512 blocks: the default layout
    wide = launch.Launcher(dataclasses.replace(cfg, decode_splits=128), tvm.cpu(0), dict.fromkeys(names), 132)
    assert wide.decode_split(1, 16384) == (128, 128, "")  # merged by merge_splits: two launches


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_fp8_cuda_decode_compiles(tmp_path):
    """The CUDA decode over fp8 pages (unsplit, split, split + merge, and on the tensor cores the
    one-launch layer with its append, in both layouts; both formats) gives source nvcc
    accepts for sm_89 and sm_90 (the pair conversions need sm_89): the tensor-core schedule (fp16
    activations, head_dim 128, with pages of 8 slots too) and the CUDA-core one (head_dim 64 and 256; a
    sliding window with attention sink at 256; bf16 activations at 128: the tensor-core layout does not
    apply), each kernel on its own schedule (mma only on the tensor-core one), the group's query heads
    spread over as few blocks as the layout allows (up to 8 a block on tensor cores, 4 on CUDA cores);
    runs on a machine without a GPU. (Inline RoPE over fp8 pages runs in
    test_fp8_decode_with_inline_rope_and_window on the GPU.)"""
    from tvmkv.build import compile_funcs
    from tvmkv.tir.decode import make_paged_decode_append
    from tvmkv.tir.decode_cuda import decode_layout, make_paged_decode_cuda

    funcs = {}
    cases = [  # format, H_qo, H_kv, D, P, activations, extra, tensor cores
        ("float8_e4m3fn", 32, 8, 128, 16, "float16", {}, True),
        ("float8_e5m2", 16, 1, 128, 8, "float16", {}, True),
        ("float8_e5m2", 16, 1, 256, 8, "float16", {}, False),
        ("float8_e5m2", 32, 8, 64, 16, "float16", {}, False),
        ("float8_e4m3fn", 32, 8, 256, 16, "float16", {"sliding": True}, False),
        ("float8_e4m3fn", 32, 8, 128, 16, "bfloat16", {}, False),
    ]
    for k, (fmt, h_qo, h_kv, d, p, dtype, extra, tc) in enumerate(cases):
        spec = KernelSpec(h_qo, h_kv, d, p, dtype, "cuda", fmt)
        lay = decode_layout(spec, tensor_cores=None if not extra else False)
        assert (
            lay["TC"] == tc and lay["GQ"] * lay["NGB"] == spec.group and lay["GQ"] >= min(spec.group, 8 if tc else 4)
        ), lay
        assert tc or lay["E"] == 16, lay  # CUDA-core fp8 layout: 16 codes per lane
        funcs[f"decode_{k}"] = make_paged_decode_cuda(spec, **extra)
        funcs[f"split_{k}"] = make_paged_decode_cuda(spec, split=True, **extra)
        funcs[f"split_merge_{k}"] = make_paged_decode_cuda(spec, split=True, merge=True, **extra)
        names = [f"decode_{k}", f"split_{k}", f"split_merge_{k}"]
        if tc:  # the one-launch decode layer (rope mode "normal": q and the new key rotated), split + merge,
            # in the default layout and the small-batch one
            funcs[f"append_{k}"] = make_paged_decode_cuda(spec, split=True, merge=True, append=True, rotate=True)
            funcs[f"append_small_{k}"] = make_paged_decode_append(spec, rotate=True, split=True, small_batch=True)
            names += [f"append_{k}", f"append_small_{k}"]
        for name in names:  # each kernel on its own schedule
            assert ("T.ptx.mma(" in funcs[name].script()) == tc, name
    with pytest.raises(ValueError, match="tensor_cores=True"):
        make_paged_decode_cuda(
            KernelSpec(32, 8, 128, 16, "float16", "cuda", "float8_e4m3fn"), sliding=True, tensor_cores=True
        )
    src = compile_funcs(funcs, "cuda", "sm_90").mod.imports[0].inspect_source()
    assert "cvt.rn.f16x2.e4m3x2" in src and "cvt.rn.f16x2.e5m2x2" in src and "mma.sync.aligned.m16n8k16" in src
    path = tmp_path / "fp8_decode.cu"
    path.write_text(src)
    for arch in ("sm_89", "sm_90"):
        cmd = [
            "nvcc",
            f"-arch={arch}",
            "--cubin",
            "-diag-suppress=1046,177,550",
            "-o",
            str(path.with_suffix(".cubin")),
            str(path),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]


def test_fp8_prefill_on_warpgroup_mma_converts_the_codes(tmp_path):
    """A cuda sm_90 kernel set of fp8 pages builds its paged prefills (causal and not, q separate and in
    the fused qkv) on the warpgroup-MMA schedule, which converts the codes itself (its copying
    warpgroup), taking ``kv_scale`` after ``pages``; nothing widens pages beforehand any more. Other
    archs and variants keep their schedules, and the schedule without a copying warpgroup refuses fp8
    pages. nvcc compiles the kernels for sm_90a: no spills, no serialized wgmma (runs without a GPU)."""
    from conftest import assert_sm90a_clean

    from tvmkv.tir import kernel_set
    from tvmkv.tir.prefill import make_paged_prefill, uses_warpgroup_mma
    from tvmkv.tir.prefill_hopper import make_prefill_hopper

    spec = KernelSpec(32, 8, 128, 16, "float16", "cuda", "float8_e4m3fn")
    assert uses_warpgroup_mma(spec, mask="causal", arch="sm_90")
    assert not uses_warpgroup_mma(spec, mask="causal", arch="sm_89")
    assert not uses_warpgroup_mma(spec, mask="causal", arch="sm_90", sliding=True)
    assert not uses_warpgroup_mma(spec, mask="causal", arch="sm_90", inline_rope=True)
    with pytest.raises(ValueError, match="producer=True"):
        make_prefill_hopper(spec, source="paged", mask="causal", arch="sm_90", producer=False)
    with pytest.raises(ValueError, match="producer_regs=172"):
        make_prefill_hopper(spec, source="paged", mask="causal", arch="sm_90", producer_regs=172)
    lib = kernel_set(spec, rope_mode="none", arch="sm_90")
    assert not any("widen" in name for name in lib)
    for name in ("paged_prefill_causal", "paged_prefill_none", "paged_prefill_causal_qkv"):
        names = [p.name for p in lib[name].params]
        assert "wgmma" in lib[name].script() and names[names.index("pages") + 1] == "kv_scale", names
    funcs = {
        "e4m3_fp16_d128": lib["paged_prefill_causal_qkv"],
        "e5m2_bf16_d128": make_paged_prefill(
            KernelSpec(32, 8, 128, 16, "bfloat16", "cuda", "float8_e5m2"), mask="causal", arch="sm_90"
        ),
        "e4m3_fp16_d64": make_paged_prefill(
            KernelSpec(8, 2, 64, 16, "float16", "cuda", "float8_e4m3fn"), mask="none", arch="sm_90"
        ),
    }
    src = assert_sm90a_clean(funcs, tmp_path, "fp8_prefill")
    assert "cvt.rn.f16x2.e4m3x2" in src and "cvt.rn.f16x2.e5m2x2" in src and "cvt.rn.bf16x2.f32" in src
    # sm_89 keeps the mma.sync schedule, which converts the codes itself too: nvcc builds it
    from tvmkv.build import compile_funcs

    sm89 = make_paged_prefill(spec, mask="causal", arch="sm_89", fused_qkv=True)
    assert "wgmma" not in sm89.script() and "T.ptx.mma(" in sm89.script()
    src = compile_funcs({"sm89": sm89}, "cuda", "sm_89").mod.imports[0].inspect_source()
    path = tmp_path / "fp8_prefill_sm89.cu"
    path.write_text(src)
    cmd = ["nvcc", "-arch=sm_89", "--cubin", "-diag-suppress=1046,177,550", "-o", str(path.with_suffix(".cubin"))]
    done = subprocess.run([*cmd, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
