"""Data-movement kernels (append, split_rope, rope_q, merge_state, copy_page, compact_copy, gather) vs NumPy.

Kernels come from ``tvmkv.build.load_kernels`` (prebuilt libraries on the GPU machine); oracles from
``tvmkv.reference.ops``. Copies must match bit for bit; RoPE and merging within fp tolerances.
Layout: docs/layout.md.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import to_dev

from tvmkv.build import load_kernels
from tvmkv.reference import ops as ref
from tvmkv.tir.spec import KernelSpec

NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Relative tolerance of one rounding to the storage dtype (plus fp32 math slack).
TOL = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}

# (H_qo, H_kv, D, P, dtype): a covering set of the matrix dtype x head_dim x page_size x group
# (every value of each axis appears; each distinct spec compiles one kernel set, so keep it short).
CONFIGS = [
    (4, 4, 64, 16, "float32"),  # group 1
    (8, 2, 128, 16, "float16"),  # group 4
    (8, 1, 64, 1, "float16"),  # group 8, P = 1
    (16, 4, 128, 64, "float32"),  # group 4, P = 64
    (8, 2, 128, 16, "bfloat16"),
    (2, 2, 16, 256, "float16"),  # smallest D, largest P
    (8, 1, 256, 16, "float32"),  # largest D, group 8
]
CONFIG_IDS = [f"q{q}kv{kv}-d{d}-p{p}-{dt}" for q, kv, d, p, dt in CONFIGS]


def _kernels(target, cfg, rope_mode="normal"):
    """The kernel library of one configuration (the whole kernel set, prebuilt on the GPU machine)."""
    return load_kernels(KernelSpec(*cfg, target), rope_mode=rope_mode)


def _rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(NP_DTYPE[dtype])


def _assert_bits_equal(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))


def _slots_of(pages_list, P):
    """Flat slots of a sequence that owns ``pages_list`` in order (docs/layout.md, page tables)."""
    return (np.asarray(pages_list)[:, None] * P + np.arange(P)[None, :]).reshape(-1).astype(np.int32)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_append(target, cfg, rng):
    _, H_kv, D, P, dtype = cfg
    num_pages = 6 if P > 1 else 32
    n = 3 * P + 5
    pages = _rand(rng, (num_pages, 2, H_kv, P, D), dtype)
    k, v = _rand(rng, (n, H_kv, D), dtype), _rand(rng, (n, H_kv, D), dtype)
    slot = rng.permutation((num_pages - 1) * P)[:n].astype(np.int32)
    slot[rng.random(n) < 0.2] = -1  # skipped tokens
    slot[0] = -1
    pages_d = to_dev(pages, target)
    _kernels(target, cfg)["append"](pages_d, to_dev(k, target), to_dev(v, target), to_dev(slot, target))
    out = pages_d.numpy()
    _assert_bits_equal(out, ref.append_ref(pages, k, v, slot))
    untouched = np.setdiff1d(np.arange(num_pages * P), slot[slot >= 0])
    _assert_bits_equal(out[untouched // P, :, :, untouched % P], pages[untouched // P, :, :, untouched % P])


# configurations whose rope-mode "none" kernel set the attention tests build too (append_qkv is in it)
QKV_CONFIGS = [CONFIGS[1], CONFIGS[4], (8, 2, 64, 16, "float32")]


@pytest.mark.parametrize("cfg", QKV_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_append_qkv(target, cfg, rng):
    """``append_qkv`` stores the k / v heads of a fused qkv (docs/layout.md, "Fused qkv") exactly as
    ``append`` stores separate k / v, and touches nothing else (q heads are NaN: never read)."""
    H_qo, H_kv, D, P, dtype = cfg
    num_pages = 6
    n = 3 * P + 5
    pages = _rand(rng, (num_pages, 2, H_kv, P, D), dtype)
    k, v = _rand(rng, (n, H_kv, D), dtype), _rand(rng, (n, H_kv, D), dtype)
    qkv = np.concatenate([np.full((n, H_qo, D), np.nan, np.float32).astype(NP_DTYPE[dtype]), k, v], axis=1)
    slot = rng.permutation((num_pages - 1) * P)[:n].astype(np.int32)
    slot[rng.random(n) < 0.2] = -1
    pages_d = to_dev(pages, target)
    _kernels(target, cfg, "none")["append_qkv"](pages_d, to_dev(qkv, target), to_dev(slot, target))
    _assert_bits_equal(pages_d.numpy(), ref.append_ref(pages, k, v, slot))


def test_append_no_tokens(target, rng):
    cfg = CONFIGS[1]
    _, H_kv, D, P, dtype = cfg
    pages = _rand(rng, (3, 2, H_kv, P, D), dtype)
    empty = np.zeros((0, H_kv, D), NP_DTYPE[dtype])
    pages_d = to_dev(pages, target)
    _kernels(target, cfg)["append"](
        pages_d, to_dev(empty, target), to_dev(empty, target), to_dev(np.zeros(0, np.int32), target)
    )
    _assert_bits_equal(pages_d.numpy(), pages)


def _run_split_rope(target, cfg, qkv, pos, rope_mode, scale, theta):
    H_qo, H_kv, D, _, dtype = cfg
    n = qkv.shape[0]
    q = to_dev(np.zeros((n, H_qo, D), NP_DTYPE[dtype]), target)
    k = to_dev(np.zeros((n, H_kv, D), NP_DTYPE[dtype]), target)
    v = to_dev(np.zeros((n, H_kv, D), NP_DTYPE[dtype]), target)
    _kernels(target, cfg, rope_mode)["split_rope"](to_dev(qkv, target), to_dev(pos, target), q, k, v, scale, theta)
    return q.numpy(), k.numpy(), v.numpy()


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_split_rope(target, cfg, rng):
    H_qo, H_kv, D, _, dtype = cfg
    n = 37
    qkv = _rand(rng, (n, H_qo + 2 * H_kv, D), dtype)
    pos = rng.integers(0, 4096, n).astype(np.int32)
    pos[:3] = [0, 1, 2]
    scale, theta = 0.5, 5e5
    q, k, v = _run_split_rope(target, cfg, qkv, pos, "normal", scale, theta)
    q_ref, k_ref, v_ref = ref.split_rope_ref(qkv, pos, H_qo, H_kv, rotate=True, rope_scale=scale, rope_theta=theta)
    # fp32 angles: pos * inv_freq carries ~pos * 2^-22 absolute error, on top of the output rounding
    atol = (TOL[dtype] + 4 * 2.0**-23 * 4096 * scale) * np.abs(qkv.astype(np.float32)).max()
    np.testing.assert_allclose(q.astype(np.float64), q_ref, rtol=0, atol=atol)
    np.testing.assert_allclose(k.astype(np.float64), k_ref, rtol=0, atol=atol)
    _assert_bits_equal(v, v_ref)
    _assert_bits_equal(q[0], qkv[0, :H_qo])  # position 0: identity rotation


def test_split_rope_large_positions(target, rng):
    cfg = CONFIGS[0]  # fp32
    H_qo, H_kv, D, _, dtype = cfg
    pos = np.array([0, 65535, 131072, 500_000, 1_000_000, 2**24 - 1], np.int32)
    qkv = _rand(rng, (len(pos), H_qo + 2 * H_kv, D), dtype)
    scale, theta = 1.0, 1e4
    q, k, v = _run_split_rope(target, cfg, qkv, pos, "normal", scale, theta)
    q_ref, k_ref, _ = ref.split_rope_ref(qkv, pos, H_qo, H_kv, rotate=True, rope_scale=scale, rope_theta=theta)
    # absolute angle error of fp32 ~ angle * 2^-22 (pow and product roundings), per row
    atol = (1e-5 + 4 * 2.0**-23 * pos.astype(np.float64) * scale)[:, None, None] * np.abs(qkv).max()
    assert np.all(np.isfinite(q)) and np.all(np.isfinite(k))
    assert np.all(np.abs(q - q_ref) <= atol) and np.all(np.abs(k - k_ref) <= atol)
    # a rotation keeps each (i, i + D/2) pair's norm
    norm = lambda x: x[..., : D // 2] ** 2 + x[..., D // 2 :] ** 2  # noqa: E731
    np.testing.assert_allclose(norm(q.astype(np.float64)), norm(qkv[:, :H_qo].astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", [CONFIGS[4]], ids=[CONFIG_IDS[4]])
def test_split_no_rotation(target, cfg, rng):
    H_qo, H_kv, D, _, dtype = cfg
    qkv = _rand(rng, (9, H_qo + 2 * H_kv, D), dtype)
    pos = rng.integers(1, 1000, 9).astype(np.int32)
    q, k, v = _run_split_rope(target, cfg, qkv, pos, "none", 1.0, 1e4)
    for got, want in zip((q, k, v), ref.split_rope_ref(qkv, pos, H_qo, H_kv, rotate=False), strict=True):
        _assert_bits_equal(got, want)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("rope_mode", ["normal", "none"])
def test_split_rope_append(target, cfg, rope_mode, rng):
    """split_rope_append (split + rotate + append in one launch) against the NumPy split/rotation and
    append references: q rotated as split_rope's, k (rotated) and v at their slots, skipped tokens
    (slot < 0) and every other slot untouched."""
    H_qo, H_kv, D, P, dtype = cfg
    num_pages = 6 if P > 1 else 48
    n = 2 * P + 3 if P > 1 else 37
    qkv = _rand(rng, (n, H_qo + 2 * H_kv, D), dtype)
    pos = rng.integers(0, 4096, n).astype(np.int32)
    slot = rng.permutation((num_pages - 1) * P)[:n].astype(np.int32)
    slot[rng.random(n) < 0.2] = -1
    slot[0] = -1
    pages = _rand(rng, (num_pages, 2, H_kv, P, D), dtype)
    scale, theta = 0.5, 5e5
    q = to_dev(np.zeros((n, H_qo, D), NP_DTYPE[dtype]), target)
    pages_d = to_dev(pages, target)
    _kernels(target, cfg, rope_mode)["split_rope_append"](
        to_dev(qkv, target), to_dev(pos, target), q, pages_d, to_dev(slot, target), scale, theta
    )
    rotate = rope_mode == "normal"
    q_ref, k_ref, v_ref = ref.split_rope_ref(qkv, pos, H_qo, H_kv, rotate=rotate, rope_scale=scale, rope_theta=theta)
    atol = (TOL[dtype] + 4 * 2.0**-23 * 4096 * scale) * np.abs(qkv.astype(np.float32)).max()
    got = pages_d.numpy()
    want = ref.append_ref(pages, k_ref.astype(pages.dtype), v_ref.astype(pages.dtype), slot)
    if rotate:
        np.testing.assert_allclose(q.numpy().astype(np.float64), q_ref, rtol=0, atol=atol)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0, atol=atol)
    else:
        _assert_bits_equal(q.numpy(), q_ref)
        _assert_bits_equal(got, want)
    live = slot[slot >= 0]
    _assert_bits_equal(got[live // P, 1, :, live % P], v_ref[slot >= 0])  # v is copied, never rotated
    untouched = np.setdiff1d(np.arange(num_pages * P), live)
    _assert_bits_equal(got[untouched // P, :, :, untouched % P], pages[untouched // P, :, :, untouched % P])


def _run_rope_q(target, cfg, q, q_pos, rope_mode, scale, theta):
    q_out = to_dev(np.zeros_like(q), target)
    _kernels(target, cfg, rope_mode)["rope_q"](to_dev(q, target), to_dev(q_pos, target), q_out, scale, theta)
    return q_out.numpy()


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_rope_q(target, cfg, rng):
    """rope_q (q alone, for shared-KV attention) rotates as split_rope rotates q: against the
    reference and bit for bit against split_rope's q of the same rows."""
    H_qo, H_kv, D, _, dtype = cfg
    n = 37
    qkv = _rand(rng, (n, H_qo + 2 * H_kv, D), dtype)
    q = np.ascontiguousarray(qkv[:, :H_qo])
    q_pos = rng.integers(0, 4096, n).astype(np.int32)
    q_pos[:3] = [0, 1, 2]
    scale, theta = 0.5, 5e5
    got = _run_rope_q(target, cfg, q, q_pos, "normal", scale, theta)
    want = ref.rope_q_ref(q, q_pos, rotate=True, rope_scale=scale, rope_theta=theta)
    atol = (TOL[dtype] + 4 * 2.0**-23 * 4096 * scale) * np.abs(q.astype(np.float32)).max()
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=atol)
    _assert_bits_equal(got, _run_split_rope(target, cfg, qkv, q_pos, "normal", scale, theta)[0])
    _assert_bits_equal(got[0], q[0])  # position 0: identity rotation


@pytest.mark.parametrize("cfg", [CONFIGS[4]], ids=[CONFIG_IDS[4]])
def test_rope_q_no_rotation(target, cfg, rng):
    """rope modes "none" (and "inline", whose attention kernels rotate q): rope_q copies."""
    H_qo, _, D, _, dtype = cfg
    q = _rand(rng, (9, H_qo, D), dtype)
    q_pos = rng.integers(1, 1000, 9).astype(np.int32)
    _assert_bits_equal(_run_rope_q(target, cfg, q, q_pos, "none", 1.0, 1e4), ref.rope_q_ref(q, q_pos, rotate=False))
    empty = np.zeros((0, H_qo, D), NP_DTYPE[dtype])
    assert _run_rope_q(target, cfg, empty, np.zeros(0, np.int32), "none", 1.0, 1e4).shape == empty.shape


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_merge_state(target, cfg, rng):
    H_qo, _, D, _, dtype = cfg
    n = 23
    o_a, o_b = _rand(rng, (n, H_qo, D), dtype), _rand(rng, (n, H_qo, D), dtype)
    lse_a = (rng.standard_normal((n, H_qo)) * 8).astype(np.float32)
    lse_b = (lse_a + rng.standard_normal((n, H_qo)) * 4).astype(np.float32)
    lse_a[0, :] = -np.inf  # only b
    lse_b[1, :] = -np.inf  # only a
    lse_a[2, :] = lse_b[2, :] = -np.inf  # neither
    lse_a[3, 0] = -np.inf
    lse_b[3, 1] = -np.inf
    lse_a[4, :] = lse_b[4, :] = 100.0  # equal, large
    lse_b[5, :] = lse_a[5, :] - 60  # b negligible
    o_a[0], o_b[1] = 1e4, -1e4  # garbage on the -inf side must not leak in
    o_a_d, lse_a_d = to_dev(o_a, target), to_dev(lse_a, target)
    o_b_d, lse_b_d = to_dev(o_b, target), to_dev(lse_b, target)
    _kernels(target, cfg)["merge_state"](o_a_d, lse_a_d, o_b_d, lse_b_d)
    o, lse = o_a_d.numpy(), lse_a_d.numpy()
    o_ref, lse_ref = ref.merge_state_ref(o_a, lse_a, o_b, lse_b)
    assert not np.isnan(o.astype(np.float32)).any() and not np.isnan(lse).any()
    assert np.all(lse[2] == -np.inf) and np.all(o[2].astype(np.float32) == 0)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(o.astype(np.float64), o_ref, rtol=TOL[dtype], atol=TOL[dtype] * 4)
    _assert_bits_equal(o_b_d.numpy(), o_b)  # b is read only
    _assert_bits_equal(lse_b_d.numpy(), lse_b)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_merge_splits(target, cfg, rng):
    """The merge of a split decode's chunks against the fp64 reference, with empty chunks (garbage
    o there must not leak in), rows whose every chunk is empty, and a dominating chunk."""
    H_qo, _, D, _, dtype = cfg
    S, n = 5, 7
    o_part = rng.standard_normal((S, n, H_qo, D)).astype(np.float32)
    lse_part = (rng.standard_normal((S, n, H_qo)) * 8).astype(np.float32)
    lse_part[1:, 0] = -np.inf  # one live chunk
    lse_part[:, 1] = -np.inf  # none
    lse_part[::2, 2, 0] = -np.inf
    lse_part[3, 3] = lse_part[:, 3].max(axis=0) + 80  # one chunk dominates
    o_part[np.isneginf(lse_part)] = np.nan  # garbage on the empty chunks
    o = to_dev(np.ones((n, H_qo, D), NP_DTYPE[dtype]), target)
    lse = to_dev(np.zeros((n, H_qo), np.float32), target)
    parts = (to_dev(o_part, target), to_dev(lse_part, target))
    _kernels(target, cfg)["merge_splits"](*parts, o, lse)
    o_ref, lse_ref = ref.merge_splits_ref(np.nan_to_num(o_part, nan=0.0), lse_part)
    got_o, got_lse = o.numpy().astype(np.float64), lse.numpy()
    assert not np.isnan(got_o).any() and not np.isnan(got_lse).any()
    assert np.all(got_lse[1] == -np.inf) and np.all(got_o[1] == 0)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(got_lse[finite], lse_ref[finite], rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(got_o, o_ref, rtol=TOL[dtype], atol=TOL[dtype] * 4)
    _assert_bits_equal(parts[0].numpy(), o_part)  # the chunks are read only


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_copy_page(target, cfg, rng):
    _, H_kv, D, P, dtype = cfg
    pages = _rand(rng, (5, 2, H_kv, P, D), dtype)
    kernel = _kernels(target, cfg)["copy_page"]
    for src, dst, num_slots in [(3, 1, P), (0, 4, 0), (2, 0, max(P // 2, 1)), (4, 2, P - 1)]:
        pages_d = to_dev(pages, target)
        kernel(pages_d, src, dst, num_slots)
        out = pages_d.numpy()
        _assert_bits_equal(out, ref.copy_page_ref(pages, src, dst, num_slots))
        _assert_bits_equal(out[dst, :, :, num_slots:], pages[dst, :, :, num_slots:])


def _tree_commit_segments(rng, P, num_pages, shapes):
    """Segments of an in-place tree commit: per segment, dst = consecutive slots from the segment's
    start, src = increasing slots at or after them (accepted nodes). Segments use disjoint pages."""
    perm = rng.permutation(num_pages - 1)
    indptr, src, dst, used = [0], [], [], 0
    for npages, accepted in shapes:
        seq = _slots_of(perm[used : used + npages], P)  # the segment's slots, in sequence order
        used += npages
        start = int(rng.integers(0, max(len(seq) - 2 * accepted, 0) + 1))
        picks = np.sort(rng.choice(len(seq) - start, size=accepted, replace=False))
        assert np.all(picks >= np.arange(accepted))  # dst position <= src position, both increasing
        dst.extend(seq[start : start + accepted])
        src.extend(seq[start + picks])
        indptr.append(len(src))
    return np.array(indptr, np.int32), np.array(src, np.int32), np.array(dst, np.int32)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_compact_copy(target, cfg, rng):
    _, H_kv, D, P, dtype = cfg
    num_pages = 12 if P > 1 else 64
    pages = _rand(rng, (num_pages, 2, H_kv, P, D), dtype)
    # (pages owned, accepted nodes); empty segments included
    shapes = [(2, 0), (3, 5 if P > 1 else 2), (1, 0), (2, min(P, 3)), (3, 2 * P if P > 1 else 3)]
    indptr, src, dst = _tree_commit_segments(rng, P, num_pages, shapes)
    assert np.any(src != dst)
    pages_d = to_dev(pages, target)
    _kernels(target, cfg)["compact_copy"](pages_d, to_dev(indptr, target), to_dev(src, target), to_dev(dst, target))
    _assert_bits_equal(pages_d.numpy(), ref.compact_copy_ref(pages, indptr, src, dst))


def test_compact_copy_shift_chain(target, rng):
    """Entries (j+1 -> j) of one segment only give a shift when applied in order."""
    cfg = CONFIGS[2]  # P = 1: every slot on its own page
    _, H_kv, D, P, dtype = cfg
    pages = _rand(rng, (40, 2, H_kv, P, D), dtype)
    chain = np.arange(3, 30, dtype=np.int32)
    indptr = np.array([0, 0, len(chain) - 1, len(chain) - 1], np.int32)  # empty, chain, empty
    src, dst = chain[1:], chain[:-1]
    pages_d = to_dev(pages, target)
    _kernels(target, cfg)["compact_copy"](pages_d, to_dev(indptr, target), to_dev(src, target), to_dev(dst, target))
    out = pages_d.numpy()
    expected = pages.copy()
    expected[chain[:-1]] = pages[chain[1:]]  # each slot took its successor's original value
    _assert_bits_equal(out, expected)
    _assert_bits_equal(out, ref.compact_copy_ref(pages, indptr, src, dst))


def test_compact_copy_no_segments(target, rng):
    cfg = CONFIGS[0]
    _, H_kv, D, P, dtype = cfg
    pages = _rand(rng, (3, 2, H_kv, P, D), dtype)
    pages_d = to_dev(pages, target)
    none = to_dev(np.zeros(0, np.int32), target)
    _kernels(target, cfg)["compact_copy"](pages_d, to_dev(np.zeros(1, np.int32), target), none, none)
    _assert_bits_equal(pages_d.numpy(), pages)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_gather(target, cfg, rng):
    _, H_kv, D, P, dtype = cfg
    num_pages = 6
    pages = _rand(rng, (num_pages, 2, H_kv, P, D), dtype)
    slots = rng.integers(0, num_pages * P, 2 * P + 3).astype(np.int32)  # repeats allowed
    slots[1] = -1
    k = to_dev(np.full((len(slots), H_kv, D), 7, NP_DTYPE[dtype]), target)
    v = to_dev(np.full((len(slots), H_kv, D), 7, NP_DTYPE[dtype]), target)
    pages_d = to_dev(pages, target)
    _kernels(target, cfg)["gather"](pages_d, to_dev(slots, target), k, v)
    k_ref, v_ref = ref.gather_ref(pages, slots)
    _assert_bits_equal(k.numpy(), k_ref)
    _assert_bits_equal(v.numpy(), v_ref)
    _assert_bits_equal(pages_d.numpy(), pages)


def _plan_layout(batch: int, total: int, zeros: int) -> tuple:
    """A packed layout of a step as plan.PackedLayout places arrays (64-byte boundaries, padding between
    them): ``(offsets by name, where page_indices starts)`` for ``total`` new tokens and ``zeros``
    elements of the region the plan kernels zero."""
    at, off = 0, {}
    for name, size in [
        ("q_indptr", batch + 1),
        ("q_pos", total),
        ("slots", total),
        ("lpl", batch),
        ("page_indptr", batch + 1),
        ("zero", zeros),
    ]:
        off[name], at = at, at + -(-size // 16) * 16
    return off, at


def _plan_offsets(off: dict, zeros: int, pi: int) -> list:
    """The 8 offset arguments of plan_decode / plan_prefill for :func:`_plan_layout`'s layout."""
    names = ("q_indptr", "q_pos", "slots", "lpl", "page_indptr", "zero")
    return [off[name] for name in names] + [off["zero"] + zeros, pi]


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2], CONFIGS[5]], ids=[CONFIG_IDS[0], CONFIG_IDS[2], CONFIG_IDS[5]])
@pytest.mark.parametrize("batch", [1, 7, 70])
def test_plan_decode(target, cfg, batch, rng):
    """``plan_decode`` (tvmkv.tir.plan_ops) against docs/layout.md's decode arrays built in NumPy from
    the same page lists: sequences whose rows the table holds whole, in part (new pages from the
    stage, a replaced last page), or not at all; other rows, the padding and the rest of the packed
    buffer untouched; kv_window and the tree arrays zeroed over garbage."""
    P = cfg[3]
    rows, width = batch + 5, 40
    table = rng.integers(0, 1000, (rows, width)).astype(np.int32)
    kv = rng.integers(0, (width - 1) * P, batch)  # kv length before the step (the new token's slot)
    npages = kv // P + 1
    row = rng.permutation(rows)[:batch]
    pages = [rng.permutation(5000)[:n].astype(np.int32) for n in npages]  # each sequence's pages after the step
    first = np.array([rng.choice([0, n, max(n - 1, 0), int(rng.integers(0, n + 1))]) for n in npages])
    for r, p, f in zip(row, pages, first):
        table[r, :f] = p[:f]  # the table holds the first ``first`` pages
    new = [p[f:] for p, f in zip(pages, first)]
    delta = np.concatenate([[0], np.cumsum([len(x) for x in new])])[:-1]
    starts = np.concatenate([[0], np.cumsum(npages)])
    stage = np.concatenate([row, kv, first, delta, starts[:-1], *new]).astype(np.int32)
    off, pi = _plan_layout(batch, batch, 9 * batch + 5)
    out = rng.integers(-9, 9, pi + starts[-1] + 37).astype(np.int32)
    want, want_table = out.copy(), table.copy()
    want[off["q_indptr"] : off["q_indptr"] + batch + 1] = np.arange(batch + 1)
    want[off["q_pos"] : off["q_pos"] + batch] = kv
    want[off["slots"] : off["slots"] + batch] = [p[-1] * P + k % P for p, k in zip(pages, kv)]
    want[off["lpl"] : off["lpl"] + batch] = kv % P + 1
    want[off["page_indptr"] : off["page_indptr"] + batch + 1] = starts
    want[off["zero"] : off["zero"] + 9 * batch + 5] = 0
    want[pi : pi + starts[-1]] = np.concatenate(pages)
    for r, p in zip(row, pages):
        want_table[r, : len(p)] = p
    table_d, out_d = to_dev(table, target), to_dev(out, target)
    offsets = _plan_offsets(off, 9 * batch + 5, pi)
    _kernels(target, cfg)["plan_decode"](to_dev(stage, target), table_d, out_d, batch, *offsets)
    np.testing.assert_array_equal(out_d.numpy(), want)
    np.testing.assert_array_equal(table_d.numpy(), want_table)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2], CONFIGS[5]], ids=[CONFIG_IDS[0], CONFIG_IDS[2], CONFIG_IDS[5]])
@pytest.mark.parametrize("batch", [1, 7, 70])
def test_plan_prefill(target, cfg, batch, rng):
    """``plan_prefill`` (tvmkv.tir.plan_ops) against docs/layout.md's arrays of a prefill / mixed step
    built in NumPy token by token from the same page lists: new tokens from 1 (a decode row) to more
    than a CUDA block's threads, onto no history, a partial page or a page boundary; rows the table
    holds whole, in part or not at all; the rest of the packed buffer untouched; kv_window and the
    tree arrays zeroed over garbage."""
    from tvmkv.tir.decode_layout import PREFILL_STAGE_COLS

    P = cfg[3]
    m = rng.choice([1, 2, P, 3 * P + 1, 300], batch)  # new tokens
    m[0] = 300 if batch > 1 else m[0]
    hist = np.array([rng.choice([0, P, 5 * P + 3, int(rng.integers(0, 20 * P))]) for _ in range(batch)])
    end = hist + m
    npages = -(-end // P)
    rows, width = batch + 5, int(npages.max()) + 3
    table = rng.integers(0, 1000, (rows, width)).astype(np.int32)
    row = rng.permutation(rows)[:batch]
    pages = [rng.permutation(5000)[:n].astype(np.int32) for n in npages]  # its pages after the step
    have = -(-hist // P)
    first = np.array([rng.choice([0, n, h, max(h - 1, 0), int(rng.integers(0, n + 1))]) for n, h in zip(npages, have)])
    for r, p, f in zip(row, pages, first):
        table[r, :f] = p[:f]
    new = [p[f:] for p, f in zip(pages, first)]
    delta = np.concatenate([[0], np.cumsum([len(x) for x in new])])[:-1]
    starts = np.concatenate([[0], np.cumsum(npages)])
    q_starts = np.concatenate([[0], np.cumsum(m)])
    cols = [row, hist, first, delta, starts[:-1], q_starts[:-1], m]
    assert len(cols) == PREFILL_STAGE_COLS
    stage = np.concatenate([*cols, *new]).astype(np.int32)
    total = int(q_starts[-1])
    nz = 3 * batch + 2 * total + 4 * batch + 1
    off, pi = _plan_layout(batch, total, nz)
    out = rng.integers(-9, 9, pi + starts[-1] + 37).astype(np.int32)
    want, want_table = out.copy(), table.copy()
    q_pos, slots = [], []
    for b in range(batch):
        for t in range(m[b]):
            j = hist[b] + t
            q_pos.append(j)
            slots.append(pages[b][j // P] * P + j % P)
    want[off["q_indptr"] : off["q_indptr"] + batch + 1] = q_starts
    want[off["q_pos"] : off["q_pos"] + total] = q_pos
    want[off["slots"] : off["slots"] + total] = slots
    want[off["lpl"] : off["lpl"] + batch] = [e - (n - 1) * P for e, n in zip(end, npages)]
    want[off["page_indptr"] : off["page_indptr"] + batch + 1] = starts
    want[off["zero"] : off["zero"] + nz] = 0
    want[pi : pi + starts[-1]] = np.concatenate(pages)
    for r, p in zip(row, pages):
        want_table[r, : len(p)] = p
    table_d, out_d = to_dev(table, target), to_dev(out, target)
    offsets = _plan_offsets(off, nz, pi)
    _kernels(target, cfg)["plan_prefill"](to_dev(stage, target), table_d, out_d, batch, *offsets)
    np.testing.assert_array_equal(out_d.numpy(), want)
    np.testing.assert_array_equal(table_d.numpy(), want_table)
