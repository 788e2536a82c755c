"""Attention kernels (paged prefill, paged decode, ragged prefill) against the NumPy references.

Layouts: docs/layout.md. Kernels come from ``tvmkv.build.load_kernels`` (compiled once per
configuration into build/); the oracle is ``tvmkv.reference.attention`` (fp64, written
independently of the kernels). Page tables use random, non-contiguous page ids and the unused
slots of the pool hold random garbage, so a kernel that reads outside its sequence fails.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import numpy as np
import pytest
from conftest import assert_attention_close, to_dev

from tvmkv.build import load_kernels
from tvmkv.reference import attention as ref
from tvmkv.reference import ops as ops_ref
from tvmkv.tir import split_granule
from tvmkv.tir.decode_layout import MERGE_MAX_SPLITS
from tvmkv.tir.spec import KernelSpec

H_KV = 2
ROPE_SCALE = 1.0
ROPE_THETA = 10000.0

# Pairwise cover of dtype x head_dim x page_size x group (every pair of values appears).
CORE = [
    ("float32", 64, 1, 1),
    ("float16", 128, 1, 4),
    ("float32", 128, 1, 8),
    ("float16", 128, 16, 1),
    ("float32", 64, 16, 4),
    ("float16", 64, 16, 8),
    ("float32", 128, 64, 1),
    ("float16", 64, 64, 4),
    ("float32", 64, 64, 8),
]
EXTRA = [
    ("bfloat16", 64, 16, 4),
    ("float16", 256, 16, 2),
    ("float32", 16, 8, 4),
    ("float16", 64, 256, 2),
]


def _spec(target, cfg) -> KernelSpec:
    dtype, D, P, group = cfg
    return KernelSpec(group * H_KV, H_KV, D, P, dtype, target)


def _np_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _tol(dtype, rope=False):
    if dtype == "float32":
        return 1e-3 if rope else 2e-4
    return 2e-2 if dtype == "float16" else 4e-2


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(_np_dtype(dtype))


def _kernels(spec, *, rope=False, sliding=False, local=False):
    return load_kernels(spec, rope_mode="inline" if rope else "none", sliding=sliding, local=local)


def _check(o_dev, lse_dev, o_ref, lse_ref, dtype, rope=False):
    tol = _tol(dtype, rope)
    assert_attention_close(o_dev, lse_dev, o_ref, lse_ref, tol)


class Paged:
    """Page pool + CSR page tables for sequences of ``kv_lens`` slots (docs/layout.md)."""

    def __init__(self, rng, spec, kv_lens, extra_pages=3):
        P = spec.page_size
        npages = [-(-L // P) for L in kv_lens]
        num_pages = sum(npages) + extra_pages + 1  # the last page is never handed out
        perm = rng.permutation(num_pages - 1).astype(np.int32)
        self.page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
        self.page_indices = perm[: sum(npages)].copy() if sum(npages) else np.zeros(1, np.int32)
        self.last_page_len = np.array(
            [L - (npg - 1) * P if npg else 0 for L, npg in zip(kv_lens, npages, strict=True)], np.int32
        )
        shape = (num_pages, 2, spec.num_kv_heads, P, spec.head_dim)
        self.pages = _rand(rng, shape, spec.dtype)
        self.kv_window = np.zeros((len(kv_lens), 3), np.int32)

    def tables(self):
        return [self.page_indptr, self.page_indices, self.last_page_len, self.kv_window]


def _random_forest(rng, n):
    """Random forest of n nodes (parents before children): DFS intervals [n, 2] and depths [n]."""
    parent = [-1] + [int(rng.integers(-1, k)) for k in range(1, n)]
    children = [[] for _ in range(n)]
    for k, p in enumerate(parent):
        if p >= 0:
            children[p].append(k)
    interval = np.zeros((n, 2), np.int32)
    depth = np.zeros(n, np.int32)
    clock = 0

    def visit(k, d):
        nonlocal clock
        interval[k, 0] = clock
        depth[k] = d
        clock += 1
        for c in children[k]:
            visit(c, d + 1)
        interval[k, 1] = clock - 1

    for k in range(n):
        if parent[k] < 0:
            visit(k, 0)
    return interval, depth


def _fused(spec, q, k=None, v=None):
    """The fused ``qkv [n, H_qo + 2 H_kv, D]`` holding ``q`` / ``k`` / ``v`` (docs/layout.md, "Fused
    qkv"); heads not given are NaN, so a kernel that reads them instead of its own fails."""
    n = q.shape[0]
    nan = np.full((n, spec.num_kv_heads, spec.head_dim), np.nan, np.float32).astype(q.dtype)
    return np.concatenate([q, nan if k is None else k, nan if v is None else v], axis=1)


def _run_paged_prefill(
    target,
    spec,
    lib,
    mask,
    hist,
    new,
    *,
    rng,
    sliding=False,
    rope=False,
    tree=False,
    pos_shift=None,
    layer_window=None,
    fused=False,
):
    """Build a batch (history ``hist[b]`` + ``new[b]`` tokens), run both sides, compare.
    ``pos_shift[b]`` is added to the q_pos of sequence b (a negative shift empties causal rows).
    ``layer_window`` (an int): the ``_local`` kernel with that window. ``fused``: the ``_qkv`` kernel,
    q given inside a fused qkv whose k / v heads are NaN."""
    B = len(hist)
    kv_lens = [h + m for h, m in zip(hist, new, strict=True)]
    pg = Paged(rng, spec, kv_lens)
    n = sum(new)
    q = _rand(rng, (n, spec.num_qo_heads, spec.head_dim), spec.dtype)
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q_pos = np.concatenate([np.arange(h, h + m) for h, m in zip(hist, new, strict=True)]).astype(np.int32)
    if pos_shift is not None:
        q_pos += np.repeat(np.asarray(pos_shift, np.int32), new)
    if sliding:
        for b in range(B):
            if b % 3 == 2 or hist[b] == 0:
                continue  # keep some sequences without a window
            sink = int(rng.integers(0, min(4, hist[b]) + 1))
            start = int(rng.integers(sink, hist[b] + 1))
            offset = int(rng.integers(0, 40))
            pg.kv_window[b] = (sink, start, offset)
            q_pos[q_indptr[b] : q_indptr[b + 1]] += offset
    q_tree = np.zeros((1, 2), np.int32)
    kv_tree_indptr = np.zeros(1, np.int32)
    kv_tree = np.zeros((1, 3), np.int32)
    kv_tree_start = np.zeros(1, np.int32)
    if tree:
        q_tree = np.zeros((n, 2), np.int32)
        kv_tree = np.zeros((n, 3), np.int32)
        for b in range(B):
            lo, hi = q_indptr[b], q_indptr[b + 1]
            interval, depth = _random_forest(rng, hi - lo)
            q_tree[lo:hi] = interval
            kv_tree[lo:hi, :2] = interval
            kv_tree[lo:hi, 2] = hist[b] + depth + (pg.kv_window[b, 2] if hist[b] >= pg.kv_window[b, 0] else 0)
            q_pos[lo:hi] = kv_tree[lo:hi, 2]
        kv_tree_indptr = q_indptr.copy()
        kv_tree_start = np.array(hist, np.int32)
    sm_scale = 1.0 / math.sqrt(spec.head_dim)
    o_ref, lse_ref = ref.paged_prefill(
        q,
        q_indptr,
        q_pos,
        pg.pages,
        *pg.tables(),
        q_tree,
        kv_tree_indptr,
        kv_tree,
        kv_tree_start,
        sm_scale,
        ROPE_SCALE,
        ROPE_THETA,
        mask=mask,
        sliding=sliding,
        inline_rope=rope,
        layer_window=layer_window or 0,
    )
    o = to_dev(np.zeros_like(q), target)
    lse = to_dev(np.zeros((n, spec.num_qo_heads), np.float32), target)
    args = [_fused(spec, q) if fused else q, q_indptr, q_pos, pg.pages, *pg.tables()]
    args += [q_tree, kv_tree_indptr, kv_tree, kv_tree_start]
    local = () if layer_window is None else (layer_window,)
    kernel = lib[f"paged_prefill_{mask}" + ("_local" if local else "") + ("_qkv" if fused else "")]
    kernel(*[to_dev(a, target) for a in args], o, lse, sm_scale, ROPE_SCALE, ROPE_THETA, *local)
    _check(o, lse, o_ref, lse_ref, spec.dtype, rope)
    return lse_ref


def _edge_batch(P):
    """(history, new) per sequence: empty history, history ending on a page boundary, a single
    token, and sequences of different lengths."""
    boundary = P * max(1, 32 // P)
    return [0, boundary, 37, 13, 2 * P + 5], [5, 4, 1, 7, 3]


# ---------------------------------------------------------------- core matrix


@pytest.mark.parametrize("cfg", CORE + EXTRA, ids=lambda c: "-".join(map(str, c)))
def test_paged_prefill(target, cfg, rng):
    spec = _spec(target, cfg)
    lib = _kernels(spec)
    hist, new = _edge_batch(spec.page_size)
    for mask in ("causal", "none"):
        lse_ref = _run_paged_prefill(target, spec, lib, mask, hist, new, rng=rng)
        assert np.isfinite(lse_ref).all()


@pytest.mark.parametrize("cfg", CORE + EXTRA, ids=lambda c: "-".join(map(str, c)))
def test_paged_decode(target, cfg, rng):
    spec = _spec(target, cfg)
    lib = _kernels(spec)
    P = spec.page_size
    kv_lens = [1, P, 2 * P + 3, 37, 0, 100]  # the empty sequence sees no key
    B = len(kv_lens)
    pg = Paged(rng, spec, kv_lens)
    q = _rand(rng, (B, spec.num_qo_heads, spec.head_dim), spec.dtype)
    q_pos = np.maximum(np.array(kv_lens, np.int32) - 1, 0)
    sm_scale = 1.0 / math.sqrt(spec.head_dim)
    o_ref, lse_ref = ref.paged_decode(q, q_pos, pg.pages, *pg.tables(), sm_scale, ROPE_SCALE, ROPE_THETA)
    o = to_dev(np.ones_like(q), target)
    lse = to_dev(np.zeros((B, spec.num_qo_heads), np.float32), target)
    args = [q, q_pos, pg.pages, *pg.tables()]
    lib["paged_decode"](*[to_dev(a, target) for a in args], o, lse, sm_scale, ROPE_SCALE, ROPE_THETA)
    _check(o, lse, o_ref, lse_ref, spec.dtype)
    assert np.isneginf(lse.numpy()[4]).all() and (o.numpy()[4].astype(np.float32) == 0).all()


SPLIT_CFGS = [  # dtype, D, P, group, sliding, inline rope (kernel sets the other tests build too)
    ("float16", 128, 16, 4, False, False),
    ("float32", 64, 8, 2, False, False),
    ("bfloat16", 64, 16, 4, False, False),
    ("float16", 128, 1, 2, True, False),
    ("float32", 64, 8, 2, True, True),
    ("float16", 128, 1, 2, False, True),
]


@pytest.mark.parametrize("cfg", SPLIT_CFGS, ids=lambda c: "-".join(map(str, c)))
def test_paged_decode_split(target, cfg, rng):
    """Flash-decoding: each chunk's partial state against the reference, then merge_splits against
    the unsplit decode, for chunk sizes below a tile, of several tiles and beyond every sequence."""
    *core, sliding, rope = cfg
    spec = _spec(target, tuple(core))
    lib = _kernels(spec, rope=rope, sliding=sliding)
    P = spec.page_size
    kv_lens = [0, 1, 2 * P + 3, 37, 300, 777]  # the empty sequence sees no key in any chunk
    B = len(kv_lens)
    pg = Paged(rng, spec, kv_lens)
    if sliding:
        pg.kv_window[:] = [(0, 0, 0), (1, 0, 0), (4, 2 * P, 9), (0, 0, 0), (3, 200, 40), (16, 500, 7)]
    q = _rand(rng, (B, spec.num_qo_heads, spec.head_dim), spec.dtype)
    q_pos = np.array([max(L - 1, 0) + w[2] for L, w in zip(kv_lens, pg.kv_window, strict=True)], np.int32)
    sm_scale = 1.0 / math.sqrt(spec.head_dim)
    kw = dict(sliding=sliding, inline_rope=rope)
    o_full, lse_full = ref.paged_decode(q, q_pos, pg.pages, *pg.tables(), sm_scale, ROPE_SCALE, ROPE_THETA, **kw)
    args = [to_dev(a, target) for a in (q, q_pos, pg.pages, *pg.tables())]
    for kv_chunk in (5, 64, 200, 1000):
        S = -(-max(kv_lens) // kv_chunk)
        o_ref, lse_ref = ref.paged_decode_split(
            q, q_pos, pg.pages, *pg.tables(), sm_scale, ROPE_SCALE, ROPE_THETA, kv_chunk, S, **kw
        )
        o_part = to_dev(np.full((S, B, spec.num_qo_heads, spec.head_dim), np.nan, np.float32), target)
        lse_part = to_dev(np.full((S, B, spec.num_qo_heads), np.nan, np.float32), target)
        lib["paged_decode_split"](*args, o_part, lse_part, sm_scale, ROPE_SCALE, ROPE_THETA, kv_chunk)
        _check(o_part, lse_part, o_ref, lse_ref, "float32", rope)  # the partial states are float32
        o = to_dev(np.ones_like(q), target)
        lse = to_dev(np.zeros((B, spec.num_qo_heads), np.float32), target)
        lib["merge_splits"](o_part, lse_part, o, lse)
        _check(o, lse, o_full, lse_full, spec.dtype, rope)
        if "paged_decode_split_merge" in lib:  # cuda: the same in one launch; twice on one counter array
            blocks = split_granule(spec, sliding=sliding, inline_rope=rope)[0]
            counter = to_dev(np.zeros(B * blocks + 3, np.int32), target)
            if S > MERGE_MAX_SPLITS:  # more chunks than the in-kernel merge takes: refused, nothing written
                with pytest.raises(Exception, match="at most 64 chunks"):
                    lib["paged_decode_split_merge"](
                        *args, o_part, lse_part, counter, o, lse, sm_scale, ROPE_SCALE, ROPE_THETA, kv_chunk
                    )
                continue
            for _ in range(2):
                o = to_dev(np.ones_like(q), target)
                lse = to_dev(np.zeros((B, spec.num_qo_heads), np.float32), target)
                lib["paged_decode_split_merge"](
                    *args, o_part, lse_part, counter, o, lse, sm_scale, ROPE_SCALE, ROPE_THETA, kv_chunk
                )
                _check(o, lse, o_full, lse_full, spec.dtype, rope)
                assert not counter.numpy().any()  # every merging block reset its arrival count
    assert np.isneginf(lse.numpy()[0]).all() and (o.numpy()[0].astype(np.float32) == 0).all()


APPEND_CFGS = [  # dtype, D, P, group, sliding, rope mode (kernel sets other tests build too)
    ("float16", 128, 16, 4, False, "none"),
    ("float32", 64, 8, 2, True, "inline"),
    ("float16", 128, 1, 2, True, "none"),
    ("bfloat16", 64, 16, 4, False, "normal"),
    ("float32", 64, 8, 2, False, "normal"),
]


@pytest.mark.parametrize("cfg", APPEND_CFGS, ids=lambda c: "-".join(map(str, c)))
def test_paged_decode_append(target, cfg, rng):
    """A decode layer in one launch (split_rope_append folded into the decode kernel, split or not):
    the new K/V (k rotated in rope mode "normal") land in their slots, and the output matches the
    NumPy decode over pages that hold them, though the pages held NaN there when the kernel started
    (no block may read the new key from the pages)."""
    *core, sliding, mode = cfg
    spec = _spec(target, tuple(core))
    lib = load_kernels(spec, rope_mode=mode, sliding=sliding)
    if "paged_decode_append" not in lib:
        assert target == "llvm"  # the CPU runs split_rope_append + paged_decode
        pytest.skip("no append-fused decode on llvm")
    P, Hq, Hkv, D = spec.page_size, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    kv_lens = [1, P, 2 * P + 3, 37, 300, 777]  # the new token included (each sequence's last slot)
    B = len(kv_lens)
    pg = Paged(rng, spec, kv_lens)
    if sliding:
        pg.kv_window[:] = [(0, 0, 0), (1, 0, 0), (4, 2 * P, 9), (0, 0, 0), (3, 200, 40), (16, 500, 7)]
    qkv = _rand(rng, (B, Hq + 2 * Hkv, D), spec.dtype)
    q_pos = np.array([L - 1 + w[2] for L, w in zip(kv_lens, pg.kv_window, strict=True)], np.int32)
    last = pg.page_indices[pg.page_indptr[1:] - 1]
    slot = (last * P + pg.last_page_len - 1).astype(np.int32)
    k_new = qkv[:, Hq : Hq + Hkv]
    q = qkv[:, :Hq]
    if mode == "normal":  # stored rotated (rounded to the cache dtype, as split_rope stores it)
        k_new = ref.rope(k_new, q_pos, ROPE_SCALE, ROPE_THETA).astype(np.float32).astype(_np_dtype(spec.dtype))
        q = ref.rope(q, q_pos, ROPE_SCALE, ROPE_THETA)
    want_pages = pg.pages.copy()
    want_pages[slot // P, 0, :, slot % P] = k_new
    want_pages[slot // P, 1, :, slot % P] = qkv[:, Hq + Hkv :]
    sm_scale = 1.0 / math.sqrt(D)
    o_ref, lse_ref = ref.paged_decode(
        q,
        q_pos,
        want_pages,
        *pg.tables(),
        sm_scale,
        ROPE_SCALE,
        ROPE_THETA,
        sliding=sliding,
        inline_rope=mode == "inline",
    )
    stale = pg.pages.copy()
    stale[slot // P, :, :, slot % P] = np.nan
    tables = [to_dev(a, target) for a in pg.tables()]
    q_pos_d, qkv_d, slot_d = to_dev(q_pos, target), to_dev(qkv, target), to_dev(slot, target)
    tol = _tol(spec.dtype, mode != "none")
    blocks = split_granule(spec, sliding=sliding, inline_rope=mode == "inline")[0]
    for kv_chunk in (None, 64, 200):
        pages = to_dev(stale, target)
        o = to_dev(np.ones((B, Hq, D), _np_dtype(spec.dtype)), target)
        lse = to_dev(np.zeros((B, Hq), np.float32), target)
        if kv_chunk is None:
            lib["paged_decode_append"](qkv_d, q_pos_d, pages, *tables, slot_d, o, lse, sm_scale, ROPE_SCALE, ROPE_THETA)
        else:
            S = -(-max(kv_lens) // kv_chunk)
            parts = (
                to_dev(np.full((S, B, Hq, D), np.nan, np.float32), target),
                to_dev(np.full((S, B, Hq), np.nan, np.float32), target),
            )
            counter = to_dev(np.zeros(B * blocks, np.int32), target)
            lib["paged_decode_append_split"](
                qkv_d,
                q_pos_d,
                pages,
                *tables,
                slot_d,
                *parts,
                counter,
                o,
                lse,
                sm_scale,
                ROPE_SCALE,
                ROPE_THETA,
                kv_chunk,
            )
            assert not counter.numpy().any()
        _check(o, lse, o_ref, lse_ref, spec.dtype, mode != "none")
        got = pages.numpy().astype(np.float64)
        np.testing.assert_allclose(got, want_pages.astype(np.float64), atol=tol, rtol=tol)


TC16_SHAPES = [  # H_qo, H_kv, D, P, dtype, rope mode: the tensor-core decode of 16-bit pages
    (32, 8, 128, 16, "float16", "none"),
    (32, 8, 128, 16, "float16", "normal"),
    (8, 2, 128, 1, "float16", "none"),
    (2, 2, 128, 64, "float16", "none"),
    (16, 2, 128, 1, "float16", "none"),
    (16, 1, 128, 16, "float16", "none"),
    (8, 2, 128, 16, "bfloat16", "none"),
    (8, 2, 128, 16, "bfloat16", "normal"),
]


@pytest.mark.parametrize("shape", TC16_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_tensor_core_decode_of_16bit_pages(target, shape, rng):
    """The decode of fp16 / bf16 pages at head_dim 128 on the tensor cores (cuda): every layer kernel
    (``paged_decode``, ``paged_decode_split`` + ``merge_splits``, ``paged_decode_split_merge``, and the
    one-launch ``paged_decode_append[_split]`` in the default and small-batch layouts) against the fp64
    decode; the one-launch kernels store the new token's K / V bit for bit where it held NaN (the blocks
    whose keys reach it store it first, then read it back). Page sizes 1 / 16 / 64, query-head groups
    1 / 4 / 8 / 16 (two blocks per kv head), contexts up to 1000 keys, chunks of 64 / 200 / 256 keys."""
    if target != "cuda":
        pytest.skip("the tensor-core decode is a cuda schedule")
    h_qo, h_kv, d, p, dtype, mode = shape
    spec = KernelSpec(h_qo, h_kv, d, p, dtype, target)
    from tvmkv.tir.decode_layout import decode_layout

    assert decode_layout(spec)["TC"]
    lib = load_kernels(spec, rope_mode=mode)
    kv_lens = [1, p, 2 * p + 3, 37, 300, 1000]
    B = len(kv_lens)
    pg = Paged(rng, spec, kv_lens)
    qkv = _rand(rng, (B, h_qo + 2 * h_kv, d), dtype)
    q_pos = np.array(kv_lens, np.int32) - 1
    last = pg.page_indices[pg.page_indptr[1:] - 1]
    slot = (last * p + pg.last_page_len - 1).astype(np.int32)
    q, k_new = qkv[:, :h_qo], qkv[:, h_qo : h_qo + h_kv]
    if mode == "normal":
        k_new = ref.rope(k_new, q_pos, ROPE_SCALE, ROPE_THETA).astype(np.float32).astype(_np_dtype(dtype))
        q = ref.rope(q, q_pos, ROPE_SCALE, ROPE_THETA)
    want = pg.pages.copy()
    want[slot // p, 0, :, slot % p] = k_new
    want[slot // p, 1, :, slot % p] = qkv[:, h_qo + h_kv :]
    sm_scale = 1.0 / math.sqrt(d)
    rope_args = (ROPE_SCALE, ROPE_THETA)
    o_ref, lse_ref = ref.paged_decode(q, q_pos, want, *pg.tables(), sm_scale, *rope_args)
    tables = [to_dev(a, target) for a in pg.tables()]
    blocks = split_granule(spec)[0]
    rope = mode != "none"

    def outputs():
        return (
            to_dev(np.ones((B, h_qo, d), _np_dtype(dtype)), target),
            to_dev(np.zeros((B, h_qo), np.float32), target),
        )

    def parts(kv_chunk):
        S = -(-max(kv_lens) // kv_chunk)
        return (
            to_dev(np.full((S, B, h_qo, d), np.nan, np.float32), target),
            to_dev(np.full((S, B, h_qo), np.nan, np.float32), target),
        )

    if mode == "none":  # the layer kernels read the pages as they are (q as given)
        q_d, q_pos_d, pages = to_dev(np.ascontiguousarray(q), target), to_dev(q_pos, target), to_dev(want, target)
        args = (q_d, q_pos_d, pages, *tables)
        o, lse = outputs()
        lib["paged_decode"](*args, o, lse, sm_scale, *rope_args)
        _check(o, lse, o_ref, lse_ref, dtype)
        for kv_chunk in (64, 200):
            o_part, lse_part = parts(kv_chunk)
            lib["paged_decode_split"](*args, o_part, lse_part, sm_scale, *rope_args, kv_chunk)
            o, lse = outputs()
            lib["merge_splits"](o_part, lse_part, o, lse)
            _check(o, lse, o_ref, lse_ref, dtype)
            counter = to_dev(np.zeros(B * blocks, np.int32), target)
            o, lse = outputs()
            lib["paged_decode_split_merge"](*args, o_part, lse_part, counter, o, lse, sm_scale, *rope_args, kv_chunk)
            _check(o, lse, o_ref, lse_ref, dtype)
            assert not counter.numpy().any()
    stale = want.copy()
    stale[slot // p, :, :, slot % p] = np.nan
    layouts = ("", "_small_batch") if "paged_decode_append_small_batch" in lib else ("",)
    for layout in layouts:
        for kv_chunk in (None, 64, 200, 256):
            pages = to_dev(stale, target)
            args = (to_dev(qkv, target), to_dev(q_pos, target), pages, *tables, to_dev(slot, target))
            o, lse = outputs()
            if kv_chunk is None:
                lib["paged_decode_append" + layout](*args, o, lse, sm_scale, *rope_args)
            else:
                counter = to_dev(np.zeros(B * blocks, np.int32), target)
                kernel = lib["paged_decode_append_split" + layout]
                kernel(*args, *parts(kv_chunk), counter, o, lse, sm_scale, *rope_args, kv_chunk)
                assert not counter.numpy().any()
            got = pages.numpy()
            if rope:  # the kernel rotates the new key in fp32 with its own sin / cos: a rounding apart
                tol = _tol(dtype, True)
                np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), atol=tol, rtol=tol)
            else:  # stored as given, bit for bit
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (layout, kv_chunk)
            _check(o, lse, o_ref, lse_ref, dtype, rope)


def _run_ragged(target, spec, lib, mask, new, *, rng, rope=False, layer_window=None, fused=False):
    """Ragged prefill of sequences of ``new[b]`` tokens against the reference; ``fused``: the
    ``_qkv`` kernel, reading q, k and v from one fused qkv and storing k / v at random slots of a page
    pool of garbage (some tokens skipped), checked bit for bit against the NumPy append."""
    n = sum(new)
    q = _rand(rng, (n, spec.num_qo_heads, spec.head_dim), spec.dtype)
    k = _rand(rng, (n, spec.num_kv_heads, spec.head_dim), spec.dtype)
    v = _rand(rng, (n, spec.num_kv_heads, spec.head_dim), spec.dtype)
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    hist = rng.integers(0, 50, len(new))
    q_pos = np.concatenate([np.arange(h, h + m) for h, m in zip(hist, new, strict=True)]).astype(np.int32)
    q_tree = np.zeros((1, 2), np.int32)
    if mask == "tree":
        q_tree = np.zeros((n, 2), np.int32)
        for b in range(len(new)):
            lo, hi = q_indptr[b], q_indptr[b + 1]
            q_tree[lo:hi], depth = _random_forest(rng, hi - lo)
            q_pos[lo:hi] = hist[b] + depth
    sm_scale = 1.0 / math.sqrt(spec.head_dim)
    o_ref, lse_ref = ref.ragged_prefill(
        q,
        k,
        v,
        q_indptr,
        q_pos,
        q_tree,
        sm_scale,
        ROPE_SCALE,
        ROPE_THETA,
        mask=mask,
        inline_rope=rope,
        layer_window=layer_window or 0,
    )
    o = to_dev(np.zeros_like(q), target)
    lse = to_dev(np.zeros((n, spec.num_qo_heads), np.float32), target)
    args = [_fused(spec, q, k, v)] if fused else [q, k, v]
    args += [q_indptr, q_pos, q_tree]
    if fused:
        P = spec.page_size
        num_pages = -(-n // P) + 2
        pages = _rand(rng, (num_pages, 2, spec.num_kv_heads, P, spec.head_dim), spec.dtype)
        slot = rng.permutation(num_pages * P)[:n].astype(np.int32)
        slot[rng.random(n) < 0.2] = -1
        args += [pages, slot]
    dev = [to_dev(a, target) for a in args]
    local = () if layer_window is None else (layer_window,)
    kernel = lib[f"ragged_prefill_{mask}" + ("_local" if local else "") + ("_qkv" if fused else "")]
    kernel(*dev, o, lse, sm_scale, ROPE_SCALE, ROPE_THETA, *local)
    _check(o, lse, o_ref, lse_ref, spec.dtype, rope)
    if fused:
        want = ops_ref.append_ref(pages, k, v, slot)
        np.testing.assert_array_equal(dev[-2].numpy().view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("cfg", CORE[:6] + EXTRA[:2], ids=lambda c: "-".join(map(str, c)))
def test_ragged_prefill_causal(target, cfg, rng):
    spec = _spec(target, cfg)
    lib = _kernels(spec)
    _run_ragged(target, spec, lib, "causal", [1, 9, 40, 3], rng=rng)
    _run_ragged(target, spec, lib, "causal", [1, 9, 40, 3], rng=rng, fused=True)
    _run_paged_prefill(target, spec, lib, "causal", *_edge_batch(spec.page_size), rng=rng, fused=True)


LONG_CFGS = [CORE[0], CORE[1], EXTRA[0]]


@pytest.mark.parametrize("cfg", LONG_CFGS, ids=lambda c: "-".join(map(str, c)))
def test_long_prefill(target, cfg, rng):
    """Longer sequences: many key tiles and query-row blocks (the CPU schedule groups up to 64 / group
    rows of one sequence), blocks that straddle sequence boundaries and a block cut short at the end."""
    spec = _spec(target, cfg)
    lib = _kernels(spec)
    hist, new = [0, 70, 5, 130], [150, 37, 19, 2]
    for mask in ("causal", "none"):
        _run_paged_prefill(target, spec, lib, mask, hist, new, rng=rng)
    _run_ragged(target, spec, lib, "causal", [150, 37, 19, 2], rng=rng)


@pytest.mark.parametrize(
    "h_qo, d, dtype",
    [(2, 32, "float32"), (4, 48, "bfloat16"), (6, 80, "float16"), (36, 32, "float32")],
    ids=lambda v: str(v),
)
def test_cpu_register_blocks_of_every_shape(h_qo, d, dtype, rng):
    """The CPU schedule's register blocks of S = Q K^T (MR query vectors x CR keys) and O += P V take
    MR = 4, 2 or 1 by the block's query vectors: groups 1, 2 (decode: MR 1, 2), 3 (prefill: 63 vectors,
    MR 1) and 18 (prefill: 54 vectors, MR 2), head dims with an odd number of 16-wide chunks, and work
    items that span many short sequences (each computes only its own rows' blocks), against the fp64
    reference."""
    spec = KernelSpec(h_qo, 2, d, 4, dtype, "llvm")
    lib = _kernels(spec)
    for hist, new in (([0, 9, 40], [70, 5, 33]), ([3, 0, 17, 8, 30, 1, 12], [4, 2, 4, 1, 3, 4, 2])):
        for mask in ("causal", "none"):
            _run_paged_prefill("llvm", spec, lib, mask, hist, new, rng=rng)
        _run_ragged("llvm", spec, lib, "causal", new, rng=rng)
    kv_lens = [1, 37, 100]
    pg = Paged(rng, spec, kv_lens)
    q = _rand(rng, (3, h_qo, d), dtype)
    q_pos = np.array(kv_lens, np.int32) - 1
    o_ref, lse_ref = ref.paged_decode(q, q_pos, pg.pages, *pg.tables(), d**-0.5, ROPE_SCALE, ROPE_THETA)
    o, lse = to_dev(np.ones_like(q), "llvm"), to_dev(np.zeros((3, h_qo), np.float32), "llvm")
    args = [to_dev(a, "llvm") for a in (q, q_pos, pg.pages, *pg.tables())]
    lib["paged_decode"](*args, o, lse, d**-0.5, ROPE_SCALE, ROPE_THETA)
    _check(o, lse, o_ref, lse_ref, dtype)


# Configurations of the cuda tensor-core prefill (tvmkv.tir.prefill_cuda): fp16 D 64/128 x page
# size 1/16/64 x group 1/4/8, plus bf16; on llvm they run the CPU schedule on the same batches.
TC_CFGS = [
    ("float16", 64, 1, 1),
    ("float16", 128, 1, 8),
    ("float16", 64, 16, 4),
    ("float16", 128, 16, 4),
    ("float16", 128, 64, 1),
    ("float16", 64, 64, 8),
    ("bfloat16", 128, 16, 4),
]


@pytest.mark.parametrize("cfg", TC_CFGS, ids=lambda c: "-".join(map(str, c)))
def test_prefill_tensor_core(target, cfg, rng):
    """Many key tiles and query tiles per sequence, a history that is not a multiple of the tile,
    a sequence without new tokens (its tile ids stay idle), one new token on a long history, nine
    sequences (the tile search over q_indptr) and rows that see no key (q_pos shifted below 0:
    o = 0, lse = -inf)."""
    spec = _spec(target, cfg)
    lib = _kernels(spec)
    hist, new = [0, 200, 17, 5, 1000, 0, 64, 3, 90], [150, 70, 0, 64, 1, 9, 33, 2, 17]
    for mask in ("causal", "none"):
        _run_paged_prefill(target, spec, lib, mask, hist, new, rng=rng)
    shift = [0, 0, 0, -40, 0, -4, 0, 0, 0]  # sequence 3: its first 35 rows see nothing; 5: 4 rows
    for fused in (False, True):
        lse_ref = _run_paged_prefill(target, spec, lib, "causal", hist, new, rng=rng, pos_shift=shift, fused=fused)
        assert np.isneginf(lse_ref).any() and np.isfinite(lse_ref).any()
        _run_ragged(target, spec, lib, "causal", [150, 1, 0, 64, 33, 9, 17, 2, 130], rng=rng, fused=fused)


# ---------------------------------------------------------------- targeted variants

TREE_CFGS = [CORE[1], CORE[4], CORE[8], EXTRA[0]]


@pytest.mark.parametrize("cfg", TREE_CFGS, ids=lambda c: "-".join(map(str, c)))
def test_tree(target, cfg, rng):
    spec = _spec(target, cfg)
    lib = _kernels(spec)
    _run_paged_prefill(target, spec, lib, "tree", [0, 20, 3 * spec.page_size], [6, 11, 1], rng=rng, tree=True)
    _run_ragged(target, spec, lib, "tree", [6, 11, 1, 30], rng=rng)


SLIDING_CFGS = [("float32", 64, 16, 4), ("float16", 128, 1, 2), ("float32", 64, 4, 1)]


@pytest.mark.parametrize("cfg", SLIDING_CFGS, ids=lambda c: "-".join(map(str, c)))
def test_sliding_window(target, cfg, rng):
    spec = _spec(target, cfg)
    lib = _kernels(spec, sliding=True)
    hist, new = [40, 0, 50, 33, 64, 70], [5, 3, 1, 9, 2, 1]
    for mask in ("causal", "none"):
        _run_paged_prefill(target, spec, lib, mask, hist, new, rng=rng, sliding=True)
    _run_paged_prefill(target, spec, lib, "causal", hist, new, rng=rng, sliding=True, fused=True)
    _run_paged_prefill(target, spec, lib, "tree", hist, new, rng=rng, sliding=True, tree=True)
    # decode: the window hides the middle slots; q_pos is the last slot's logical position
    P = spec.page_size
    kv_lens = [70, 2 * P + 1, 45, 5]
    pg = Paged(rng, spec, kv_lens)
    pg.kv_window[:] = [(4, 30, 17), (1, 2 * P, 5), (0, 0, 0), (0, 3, 9)]
    B = len(kv_lens)
    q = _rand(rng, (B, spec.num_qo_heads, spec.head_dim), spec.dtype)
    q_pos = np.array([L - 1 + w[2] for L, w in zip(kv_lens, pg.kv_window, strict=True)], np.int32)
    sm_scale = 1.0 / math.sqrt(spec.head_dim)
    o_ref, lse_ref = ref.paged_decode(q, q_pos, pg.pages, *pg.tables(), sm_scale, ROPE_SCALE, ROPE_THETA, sliding=True)
    o_full, lse_full = ref.paged_decode(q, q_pos, pg.pages, *pg.tables(), sm_scale, ROPE_SCALE, ROPE_THETA)
    assert not np.allclose(lse_ref[0], lse_full[0])  # the window matters in this case
    o = to_dev(np.zeros_like(q), target)
    lse = to_dev(np.zeros((B, spec.num_qo_heads), np.float32), target)
    args = [q, q_pos, pg.pages, *pg.tables()]
    lib["paged_decode"](*[to_dev(a, target) for a in args], o, lse, sm_scale, ROPE_SCALE, ROPE_THETA)
    _check(o, lse, o_ref, lse_ref, spec.dtype)


ROPE_CFGS = [("float32", 64, 16, 4, False), ("float16", 128, 1, 2, False), ("float32", 64, 8, 2, True)]


@pytest.mark.parametrize("cfg", ROPE_CFGS, ids=lambda c: "-".join(map(str, c)))
def test_inline_rope(target, cfg, rng):
    *core, sliding = cfg
    spec = _spec(target, tuple(core))
    lib = _kernels(spec, rope=True, sliding=sliding)
    hist, new = [0, 30, 17, 64], [4, 6, 1, 3]
    for mask in ("causal", "tree"):
        _run_paged_prefill(target, spec, lib, mask, hist, new, rng=rng, sliding=sliding, rope=True, tree=mask == "tree")
    for mask in ("causal", "tree"):
        _run_ragged(target, spec, lib, mask, [5, 1, 12], rng=rng, rope=True)
    kv_lens = [1, 33, 70]
    pg = Paged(rng, spec, kv_lens)
    if sliding:
        pg.kv_window[2] = (2, 40, 11)
    B = len(kv_lens)
    q = _rand(rng, (B, spec.num_qo_heads, spec.head_dim), spec.dtype)
    q_pos = np.array([L - 1 + w[2] for L, w in zip(kv_lens, pg.kv_window, strict=True)], np.int32)
    sm_scale = 1.0 / math.sqrt(spec.head_dim)
    o_ref, lse_ref = ref.paged_decode(
        q, q_pos, pg.pages, *pg.tables(), sm_scale, ROPE_SCALE, ROPE_THETA, sliding=sliding, inline_rope=True
    )
    o = to_dev(np.zeros_like(q), target)
    lse = to_dev(np.zeros((B, spec.num_qo_heads), np.float32), target)
    args = [q, q_pos, pg.pages, *pg.tables()]
    lib["paged_decode"](*[to_dev(a, target) for a in args], o, lse, sm_scale, ROPE_SCALE, ROPE_THETA)
    _check(o, lse, o_ref, lse_ref, spec.dtype, rope=True)


# ---------------------------------------------------------------- per-layer sliding window (*_local)

LOCAL_CFGS = [  # dtype, D, P, group, per-sequence sliding window, inline rope
    ("float32", 64, 16, 4, False, False),
    ("float16", 128, 1, 2, True, False),
    ("float32", 64, 16, 1, True, True),
]
# 1 and 3: a few keys (3 straddles page and tile boundaries); 42: into the sink of the decode case
# below; 10_000: past every sequence (= no window); 0: no window (the documented W <= 0)
LOCAL_WINDOWS = (1, 3, 42, 10_000, 0)


def _run_decode_local(target, spec, lib, *, rng, sliding, rope, layer_window):
    """``paged_decode_local`` against the reference: an empty sequence, page-boundary lengths and,
    with ``sliding``, per-sequence windows with sinks (offsets as the runtime sets them)."""
    P = spec.page_size
    kv_lens = [70, 2 * P + 1, 45, 5, 0, 1, 300]
    pg = Paged(rng, spec, kv_lens)
    if sliding:  # (sink_end, window_start, sink_end - window_start): positions index the kept tokens
        pg.kv_window[:] = [
            (4, 30, -26),
            (1, 2 * P, 1 - 2 * P),
            (0, 0, 0),
            (0, 3, -3),
            (0, 0, 0),
            (0, 0, 0),
            (2, 250, -248),
        ]
    B = len(kv_lens)
    q = _rand(rng, (B, spec.num_qo_heads, spec.head_dim), spec.dtype)
    q_pos = np.array([max(L - 1, 0) + w[2] for L, w in zip(kv_lens, pg.kv_window, strict=True)], np.int32)
    sm_scale = 1.0 / math.sqrt(spec.head_dim)
    kw = dict(sliding=sliding, inline_rope=rope, layer_window=layer_window)
    o_ref, lse_ref = ref.paged_decode(q, q_pos, pg.pages, *pg.tables(), sm_scale, ROPE_SCALE, ROPE_THETA, **kw)
    o = to_dev(np.ones_like(q), target)
    lse = to_dev(np.zeros((B, spec.num_qo_heads), np.float32), target)
    args = [to_dev(a, target) for a in (q, q_pos, pg.pages, *pg.tables())]
    lib["paged_decode_local"](*args, o, lse, sm_scale, ROPE_SCALE, ROPE_THETA, layer_window)
    _check(o, lse, o_ref, lse_ref, spec.dtype, rope)
    assert np.isneginf(lse.numpy()[4]).all() and (o.numpy()[4].astype(np.float32) == 0).all()
    return lse_ref


@pytest.mark.parametrize("cfg", LOCAL_CFGS, ids=lambda c: "-".join(map(str, c)))
def test_local_window(target, cfg, rng):
    """The per-layer sliding window kernels (paged_prefill_causal_local, ragged_prefill_causal_local,
    paged_decode_local; docs/layout.md, "Per-layer sliding window") against the reference, for several
    windows: paged prefill with history (long sequences: many key tiles and row blocks), ragged
    prefill without, decode; with and without per-sequence sliding windows, with inline RoPE."""
    *core, sliding, rope = cfg
    spec = _spec(target, tuple(core))
    lib = _kernels(spec, rope=rope, sliding=sliding, local=True)
    hist, new = [40, 0, 50, 33, 70, 2 * spec.page_size], [5, 3, 1, 9, 45, 37]
    decode_lse = {}
    for W in LOCAL_WINDOWS:
        kw = dict(rope=rope, layer_window=W)
        _run_paged_prefill(target, spec, lib, "causal", hist, new, rng=rng, sliding=sliding, **kw)
        _run_ragged(target, spec, lib, "causal", [1, 9, 40, 3, 70], rng=rng, **kw)
        # the same decode batch for every window (its own generator)
        decode_lse[W] = _run_decode_local(target, spec, lib, rng=np.random.default_rng(7), sliding=sliding, **kw)
    assert not np.allclose(decode_lse[3][0], decode_lse[0][0])  # the window matters
    np.testing.assert_allclose(decode_lse[10_000], decode_lse[0])


def test_local_factories_refuse_other_masks():
    from tvmkv.tir.prefill import make_paged_prefill
    from tvmkv.tir.ragged import make_ragged_prefill

    spec = KernelSpec(4, 2, 64, 16, "float16", "llvm")
    with pytest.raises(ValueError, match="local=True needs mask='causal'"):
        make_paged_prefill(spec, mask="tree", local=True)
    with pytest.raises(ValueError, match="local=True needs mask='causal'"):
        make_ragged_prefill(spec, mask="tree", local=True)


def test_reference_local_window_matches_dense_softmax(rng):
    """The oracle of the local kernels: one sequence, keys at positions 0..9, a query at 9 with
    window 3 sees keys 7, 8, 9 (paged and decode) and, ragged, rows 7..9 of 10."""
    spec = KernelSpec(2, 1, 16, 4, "float32", "llvm")
    pg = Paged(rng, spec, [10])
    ids = pg.page_indices
    k = np.stack([pg.pages[ids[j // 4], 0, :, j % 4] for j in range(10)]).astype(np.float64)  # [10, 1, 16]
    v = np.stack([pg.pages[ids[j // 4], 1, :, j % 4] for j in range(10)]).astype(np.float64)
    q = _rand(rng, (1, 2, 16), "float32")
    q_pos = np.array([9], np.int32)
    dummies = (None, None, None, None)
    outs = [
        ref.paged_prefill(
            q, np.array([0, 1], np.int32), q_pos, pg.pages, *pg.tables(), *dummies, 0.25, 1.0, 1e4, layer_window=3
        ),
        ref.paged_decode(q, q_pos, pg.pages, *pg.tables(), 0.25, 1.0, 1e4, layer_window=3),
    ]
    q10 = np.concatenate([np.zeros((9, 2, 16), np.float32), q])
    o_rg, lse_rg = ref.ragged_prefill(
        q10, k, v, np.array([0, 10], np.int32), np.arange(10, dtype=np.int32), None, 0.25, 1.0, 1e4, layer_window=3
    )
    outs.append((o_rg[9:], lse_rg[9:]))
    for o_ref, lse_ref in outs:
        for h in range(2):
            s = 0.25 * k[7:10, 0] @ q[0, h]
            p = np.exp(s) / np.exp(s).sum()
            np.testing.assert_allclose(o_ref[0, h], p @ v[7:10, 0], rtol=1e-12)
            np.testing.assert_allclose(lse_ref[0, h], np.log2(np.exp(s).sum()), rtol=1e-12)


def test_reference_matches_dense_softmax(rng):
    """The oracle itself: one sequence, no paging subtleties, against a dense causal softmax."""
    spec = KernelSpec(4, 2, 16, 4, "float32", "llvm")
    pg = Paged(rng, spec, [10])
    q = _rand(rng, (3, 4, 16), "float32")
    o_ref, lse_ref = ref.paged_prefill(
        q,
        np.array([0, 3], np.int32),
        np.array([7, 8, 9], np.int32),
        pg.pages,
        *pg.tables(),
        None,
        None,
        None,
        None,
        0.25,
        1.0,
        1e4,
        mask="causal",
    )
    ids = pg.page_indices
    k = np.stack([pg.pages[ids[j // 4], 0, :, j % 4] for j in range(10)]).astype(np.float64)  # [10, 2, 16]
    v = np.stack([pg.pages[ids[j // 4], 1, :, j % 4] for j in range(10)]).astype(np.float64)
    for r, pos in enumerate([7, 8, 9]):
        for h in range(4):
            s = 0.25 * k[: pos + 1, h // 2] @ q[r, h]
            p = np.exp(s) / np.exp(s).sum()
            np.testing.assert_allclose(o_ref[r, h], p @ v[: pos + 1, h // 2], rtol=1e-12)
            np.testing.assert_allclose(lse_ref[r, h], np.log2(np.exp(s).sum()), rtol=1e-12)


def _assert_nvcc_accepts(src: str, path, diag_suppress: str) -> None:
    """nvcc compiles the CUDA source ``src`` (written to ``path``) to a cubin for sm_80 and sm_90."""
    path.write_text(src)
    for arch in ("sm_80", "sm_90"):
        cubin = path.with_suffix(f".{arch}.cubin")
        cmd = ["nvcc", f"-arch={arch}", "--cubin", f"-diag-suppress={diag_suppress}", "-o", str(cubin), str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_codegen_compiles(tmp_path):
    """The cuda schedules (all six kernels, sliding + inline RoPE) give CUDA source nvcc accepts for
    sm_80 and sm_90; runs on a machine without a GPU."""
    from tvmkv.build import compile_funcs
    from tvmkv.tir.decode import make_paged_decode
    from tvmkv.tir.prefill import make_paged_prefill
    from tvmkv.tir.ragged import make_ragged_prefill

    spec = KernelSpec(12, 1, 80, 8, "bfloat16", "cuda")  # group 12: two blocks of 6 warps per kv head
    funcs = {
        f"paged_prefill_{m}": make_paged_prefill(spec, mask=m, sliding=True, inline_rope=True)
        for m in ("none", "causal", "tree")
    }
    funcs["paged_decode"] = make_paged_decode(spec, sliding=True, inline_rope=True)
    for m in ("causal", "tree"):
        funcs[f"ragged_prefill_{m}"] = make_ragged_prefill(spec, mask=m, inline_rope=True)
    src = compile_funcs(funcs, "cuda", "sm_80").mod.imports[0].inspect_source()
    assert all(f"{name}_kernel" in src for name in funcs)
    _assert_nvcc_accepts(src, tmp_path / "attn.cu", "1046,177")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_prefill_cuda_fast_path_compiles(tmp_path):
    """The tensor-core prefill (tvmkv.tir.prefill_cuda) is what prefill/ragged dispatch to for
    fp16/bf16 D 64/128 (mask none/causal, no window, no inline RoPE), and nvcc accepts it for sm_80
    and sm_90."""
    from tvmkv.build import compile_funcs
    from tvmkv.tir.prefill import make_paged_prefill
    from tvmkv.tir.ragged import make_ragged_prefill

    specs = [
        KernelSpec(32, 8, 128, 16, "float16", "cuda"),
        KernelSpec(8, 1, 64, 1, "bfloat16", "cuda"),
        KernelSpec(2, 2, 128, 64, "float16", "cuda"),
    ]
    funcs = {}
    for k, spec in enumerate(specs):
        for m in ("none", "causal"):
            funcs[f"pp_{m}_{k}"] = make_paged_prefill(spec, mask=m)
        funcs[f"rg_causal_{k}"] = make_ragged_prefill(spec, mask="causal")
    src = compile_funcs(funcs, "cuda", "sm_80").mod.imports[0].inspect_source()
    assert src.count("mma.sync.aligned.m16n8k16") >= 2 and "ldmatrix" in src and "cp.async" in src
    _assert_nvcc_accepts(src, tmp_path / "pf.cu", "1046,177,550")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_decode_cuda_fast_path_compiles(tmp_path):
    """The bandwidth-oriented cuda decode schedule (tvmkv.tir.decode_cuda) for shapes the codegen
    test above leaves to the generic path: GQA group 4 and 16, fp32 head_dim 256, page size 1,
    sliding + inline RoPE, the double-buffered variant, and the split (flash-decoding) kernel with
    the merge of its chunks; nvcc must accept it for sm_80/sm_90."""
    from tvmkv.build import compile_funcs
    from tvmkv.tir.decode_cuda import decode_layout, make_paged_decode_cuda
    from tvmkv.tir.merge import make_merge_splits

    specs = [
        KernelSpec(32, 8, 128, 16, "float16", "cuda"),
        KernelSpec(32, 2, 128, 1, "bfloat16", "cuda"),
        KernelSpec(2, 1, 256, 64, "float32", "cuda"),
    ]
    funcs = {}
    for k, spec in enumerate(specs):
        assert decode_layout(spec) is not None
        funcs[f"decode_{k}"] = make_paged_decode_cuda(spec, sliding=k > 0, inline_rope=k == 1)
        funcs[f"split_{k}"] = make_paged_decode_cuda(spec, sliding=k > 0, inline_rope=k == 1, split=True)
        funcs[f"split_merge_{k}"] = make_paged_decode_cuda(
            spec, sliding=k > 0, inline_rope=k == 1, split=True, merge=True
        )
        for split in (False, True):  # split_rope_append folded in (rope mode "normal" rotates q and k)
            funcs[f"append_{k}_{split}"] = make_paged_decode_cuda(
                spec, sliding=k > 0, inline_rope=k == 1, split=split, merge=split, append=True, rotate=k != 1
            )
    funcs["decode_db"] = make_paged_decode_cuda(specs[0], double_buffer=True, unroll=2)
    funcs["merge_splits"] = make_merge_splits(specs[0])
    src = compile_funcs(funcs, "cuda", "sm_80").mod.imports[0].inspect_source()
    assert "int kv_chunk" in src and "cp.async.cg.shared.global" in src and "__ldcg" in src
    _assert_nvcc_accepts(src, tmp_path / "dec.cu", "1046,177,550")
    # outside the fast layout (D 80: 40 elements per lane) there is no split kernel
    assert make_paged_decode_cuda(KernelSpec(12, 1, 80, 8, "bfloat16", "cuda"), split=True) is None


def _shared_bytes(script: str) -> tuple:
    """(static, dynamic) shared-memory bytes a kernel's TIR script allocates (float32 words: the decode's
    buffers)."""
    static = dynamic = 0
    for shape, scope in re.findall(r"T\.alloc_(?:shared|buffer)\(\(([\d, ]+)\)(?:, scope=\"([\w.]+)\")?", script):
        size = 4 * math.prod(int(x) for x in shape.split(",") if x.strip())
        if scope == "shared.dyn":
            dynamic += size
        elif scope in ("", "shared"):
            static += size
    return static, dynamic


@pytest.mark.parametrize("unroll, stages", [(2, 2), (4, 2), (2, 3), (1, 2)])
def test_decode_cuda_shared_memory_launches(unroll, stages):
    """TVM's CUDA runtime lets a kernel use more than 48 KiB of shared memory only when its dynamic part
    alone reaches 48 KiB: the decode's staging ring is never below that while its total with the static
    buffers passes it (8 warps x 2 keys x 2 stages had failed to launch with CUDA_ERROR_INVALID_VALUE on
    an H200)."""
    from tvmkv.tir.decode_cuda import OPT_IN_BYTES, make_paged_decode_cuda

    for spec in (KernelSpec(32, 8, 128, 16, "float16", "cuda"), KernelSpec(16, 2, 64, 16, "float32", "cuda")):
        for kw in ({}, {"split": True, "merge": True}):
            f = make_paged_decode_cuda(spec, num_warps=8, unroll=unroll, stages=stages, **kw)
            static, dynamic = _shared_bytes(f.script())
            assert static and dynamic, (static, dynamic)
            assert dynamic >= OPT_IN_BYTES or static + dynamic <= OPT_IN_BYTES, (spec.tag, kw, static, dynamic)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_local_cuda_codegen_compiles(tmp_path):
    """The per-layer sliding window kernels (the generic cuda schedule, also for shapes whose base
    kernels take the fast paths) and rope_q give CUDA source nvcc accepts for sm_80 and sm_90."""
    from tvmkv.build import compile_funcs
    from tvmkv.tir.decode import make_paged_decode
    from tvmkv.tir.prefill import make_paged_prefill
    from tvmkv.tir.ragged import make_ragged_prefill
    from tvmkv.tir.rope import make_rope_q

    cases = [  # spec, per-sequence sliding window + inline rope
        (KernelSpec(12, 1, 80, 8, "bfloat16", "cuda"), True),
        (KernelSpec(32, 8, 128, 16, "float16", "cuda"), False),
    ]
    funcs = {}
    for k, (spec, both) in enumerate(cases):
        funcs[f"pp_local_{k}"] = make_paged_prefill(spec, mask="causal", sliding=both, inline_rope=both, local=True)
        funcs[f"rg_local_{k}"] = make_ragged_prefill(spec, mask="causal", inline_rope=both, local=True)
        funcs[f"dec_local_{k}"] = make_paged_decode(spec, sliding=both, inline_rope=both, local=True)
        funcs[f"rope_q_{k}"] = make_rope_q(spec, rotate=not both)
    src = compile_funcs(funcs, "cuda", "sm_80").mod.imports[0].inspect_source()
    assert all(f"{name}_kernel" in src for name in funcs) and "int layer_window" in src
    _assert_nvcc_accepts(src, tmp_path / "local.cu", "1046,177")
