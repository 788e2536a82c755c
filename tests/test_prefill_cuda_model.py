"""A NumPy model of the tensor-core CUDA prefill (tvmkv.tir.prefill_cuda), run on the CPU.

The model replays the kernel's index math block by block with the module's own layout helpers
(tile ids and the binary search over ``q_indptr``, GQA row packing, the page-table gather of each
K/V row chunk, the swizzled shared-memory addresses, the ldmatrix lane addresses, the accumulator
register -> (row, col) map, the causal bounds and tile skipping, the online softmax in base 2, the
store of o / lse) and checks the result against the fp64 references of tvmkv.reference.attention.
ldmatrix is modelled at the level of its four 8x8 matrices (lanes 8i..8i+7 give the row addresses
of matrix i), mma.m16n8k16 as a 16x16 @ 16x8 product; the register-level facts behind that (which
matrix feeds which fragment register) were checked on a GPU (/work/shared/TENSORCORE.md section 5).
Unwritten shared memory is NaN, so a fragment that reads a chunk no thread copied fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tvmkv.reference import attention as ref
from tvmkv.tir import prefill_cuda as pc
from tvmkv.tir.spec import KernelSpec

H_KV = 2


def _ldsm(sm, addrs):
    """ldmatrix.x4 on shared rows ``sm`` [rows, D]: ``addrs`` = 32 (row, col) -> four 8x8 matrices."""
    rows = np.stack([sm[r, c : c + 8] for r, c in addrs])  # [32, 8]
    return [rows[8 * i : 8 * i + 8] for i in range(4)]


def _load_tile(sm, kt, source, kv, hk, kbase, kvlen, lay, spec):
    """cp.async of K/V tile kt into stage kt % 2: every thread's row chunks, page by page."""
    NT, CPR, KVI, BC, P = lay["NT"], lay["CPR"], lay["KVI"], pc.BC, spec.page_size
    st = kt % 2
    for tid in range(NT):
        for i in range(KVI):
            r, c = pc.kv_rc(tid, i, NT, CPR)
            j = min(kt * BC + r, kvlen - 1)
            col = pc.swz(r, c)
            if source == "paged":
                pages, _, page_indices, _ = kv
                page = page_indices[kbase + (j // P)]
                sm[pc.k_row(st, r), col : col + 8] = pages[page, 0, hk, j % P, c * 8 : c * 8 + 8]
                sm[pc.v_row(st, r), col : col + 8] = pages[page, 1, hk, j % P, c * 8 : c * 8 + 8]
            else:
                k, v = kv
                sm[pc.k_row(st, r), col : col + 8] = k[kbase + j, hk, c * 8 : c * 8 + 8]
                sm[pc.v_row(st, r), col : col + 8] = v[kbase + j, hk, c * 8 : c * 8 + 8]


def _model(spec, source, mask, q, q_indptr, q_pos, kv, sm_scale, num_warps=pc.DEFAULT_WARPS):
    """Run the kernel's schedule in NumPy; ``kv`` = (pages, page_indptr, page_indices, last_page_len)
    for paged, (k, v) for ragged. Returns (o [n, H_qo, D] float32, lse [n, H_qo], writes [n, H_qo])."""
    lay = pc.prefill_layout(spec, mask=mask, num_warps=num_warps)
    assert lay is not None
    NW, BR, RT, NT, CPR, QI, KVI = (lay[k] for k in ("NW", "BR", "RT", "NT", "CPR", "QI", "KVI"))
    BC, D, P, group = pc.BC, spec.head_dim, spec.page_size, spec.group
    paged = source == "paged"
    n, B = q.shape[0], len(q_indptr) - 1
    sl2 = np.float32(sm_scale * pc.LOG2E)
    o = np.zeros(q.shape, np.float32)
    lse = np.zeros((n, spec.num_qo_heads), np.float32)
    writes = np.zeros((n, spec.num_qo_heads), np.int32)
    o_flat = o.reshape(-1)  # a view: the kernel stores o as packed pairs of a flat array
    for bx in range((n // RT + B) * spec.num_kv_heads):
        tile, hk = bx // spec.num_kv_heads, bx % spec.num_kv_heads
        lo, hi = 0, B
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if pc.tile_start(int(q_indptr[mid]), mid, RT) <= tile else (lo, mid)
        b = lo
        qbase = int(q_indptr[b])
        ntile = (int(q_indptr[b + 1]) - qbase + RT - 1) // RT
        lt = ntile - 1 - (tile - pc.tile_start(qbase, b, RT))
        if lt < 0:
            continue
        assert lt < ntile
        t0 = qbase + lt * RT
        ntok = min(RT, int(q_indptr[b + 1]) - t0)
        if paged:
            _, page_indptr, _, last_page_len = kv
            kbase = int(page_indptr[b])
            npg = int(page_indptr[b + 1]) - kbase
            kvlen = (npg - 1) * P + int(last_page_len[b]) if npg > 0 else 0
        else:
            kbase, kvlen = qbase, int(q_indptr[b + 1]) - qbase

        toks = [t0 + min(R // group, ntok - 1) for R in range(BR)]  # row -> token (clamped)
        allpos = [int(q_pos[t]) if paged else t - qbase for t in toks]
        if mask == "causal":
            kend, kfull = min(kvlen, max(allpos) + 1), min(kvlen, min(allpos) + 1)
        else:
            kend = kfull = kvlen
        nkt = (max(kend, 0) + BC - 1) // BC
        kfull = max(kfull, 0)
        sm = np.full((pc.SMEM_ROWS, D), np.nan, np.float32)
        for tid in range(NT):
            for i in range(QI):
                r, c = pc.load_rc(tid, i, NT, CPR)
                col = pc.swz(r, c)
                sm[pc.q_row(r), col : col + 8] = q[
                    t0 + min(r // group, ntok - 1), hk * group + r % group, c * 8 : c * 8 + 8
                ]

        # prologue: Q (group 0) and K/V tile 0 (group 1) land, every warp reads its Q fragments
        if nkt > 0:
            _load_tile(sm, 0, source, kv, hk, kbase, kvlen, lay, spec)
        Qw = np.zeros((NW, 16, D), np.float32)
        for w in range(NW):
            for kk in range(D // 16):
                addrs = []
                for lane in range(32):
                    ar, ac = pc.lane_rowmajor16(lane)
                    addrs.append((pc.q_row(w * 16 + ar), pc.swz(w * 16 + ar, kk * 2 + ac)))
                m0, m1, m2, m3 = _ldsm(sm, addrs)
                Qw[w, :, kk * 16 : kk * 16 + 16] = np.block([[m0, m2], [m1, m3]])
        assert not np.isnan(Qw).any()
        # per-row state (the kernel holds rows g and g + 8 in every lane of a quad; same values)
        m = np.full((NW, 16), -np.inf, np.float32)
        lsum = np.zeros((NW, 16), np.float32)
        O = np.zeros((NW, 16, D), np.float32)
        for kt in range(nkt):
            if kt + 1 < nkt:
                _load_tile(sm, kt + 1, source, kv, hk, kbase, kvlen, lay, spec)  # streams in during tile kt
            st = kt % 2
            for w in range(NW):
                rpos = allpos[w * 16 : w * 16 + 16]
                S = np.zeros((16, BC), np.float32)
                for kk in range(D // 16):
                    for nj in range(BC // 16):
                        addrs = []
                        for lane in range(32):
                            kn, kc = pc.lane_kmajor_b(lane)
                            addrs.append((pc.k_row(st, nj * 16 + kn), pc.swz(nj * 16 + kn, kk * 2 + kc)))
                        m0, m1, m2, m3 = _ldsm(sm, addrs)
                        Kb = np.block([[m0, m1], [m2, m3]])  # [n 16, k 16]
                        S[:, nj * 16 : nj * 16 + 16] += Qw[w, :, kk * 16 : kk * 16 + 16] @ Kb.T
                assert not np.isnan(S).any()
                if (kt + 1) * BC > kfull:
                    for lane in range(32):
                        for ni in range(BC // 8):
                            for r in range(4):
                                rr, cc = pc.acc_rc(lane, r)
                                assert cc == lane % 4 * 2 + r % 2
                                key = kt * BC + ni * 8 + lane % 4 * 2 + r % 2
                                bound = min(kvlen, rpos[rr] + 1) if mask == "causal" else kvlen
                                if key >= bound:
                                    S[rr, ni * 8 + cc] = -np.inf
                mx = np.maximum(m[w], S.max(axis=1) * sl2)
                base = np.where(mx == -np.inf, 0, mx).astype(np.float32)
                alpha = np.exp2(m[w] - base)
                m[w] = mx
                Pm = np.exp2(S * sl2 - base[:, None]).astype(np.float32)
                lsum[w] = lsum[w] * alpha + Pm.sum(axis=1)
                O[w] *= alpha[:, None]
                Pm = Pm.astype(q.dtype).astype(np.float32)  # cvt.rn to the storage type
                for kk in range(BC // 16):
                    for nj in range(D // 16):
                        addrs = []
                        for lane in range(32):
                            vr, vc = pc.lane_rowmajor16(lane)
                            addrs.append((pc.v_row(st, kk * 16 + vr), pc.swz(kk * 16 + vr, nj * 2 + vc)))
                        m0, m1, m2, m3 = _ldsm(sm, addrs)
                        Vb = np.block([[m0, m2], [m1, m3]])  # [k 16, n 16] (.trans)
                        O[w, :, nj * 16 : nj * 16 + 16] += Pm[:, kk * 16 : kk * 16 + 16] @ Vb
        for w in range(NW):
            for lane in range(32):
                for h in range(2):
                    R = w * 16 + lane // 4 + 8 * h
                    if R // group >= ntok:
                        continue
                    tok, head = t0 + R // group, hk * group + R % group
                    rr = lane // 4 + 8 * h
                    rinv = 0 if lsum[w, rr] == 0 else 1 / lsum[w, rr]
                    for dn in range(D // 8):
                        pair = (tok * spec.num_qo_heads + head) * (D // 2) + dn * 4 + lane % 4  # 32-bit store
                        for c in range(2):  # lo = even column, hi = odd column
                            o_flat[2 * pair + c] = O[w, rr, dn * 8 + acc_col(lane, c)] * rinv
                    if lane % 4 == 0:
                        lse[tok, head] = -np.inf if lsum[w, rr] == 0 else m[w, rr] + np.log2(lsum[w, rr])
                        writes[tok, head] += 1
    return o, lse, writes


def acc_col(lane, c):
    """Column (in an n8 tile) of accumulator register 2h + c of ``lane``."""
    return pc.acc_rc(lane, c)[1]


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@pytest.mark.parametrize(
    "D,P,group,mask,nw",
    [
        (64, 1, 4, "causal", 4),
        (64, 16, 1, "causal", 4),
        (128, 16, 8, "causal", 4),
        (64, 64, 2, "none", 4),
        (128, 16, 4, "causal", 8),
    ],
)
def test_paged_model(D, P, group, mask, nw):
    rng = np.random.default_rng(1)
    spec = KernelSpec(group * H_KV, H_KV, D, P, "float16", "cuda")
    hist, new = [0, 70, 3, 0], [21, 5, 1, 66]
    kv_lens = [h + m for h, m in zip(hist, new, strict=True)]
    npages = [-(-L // P) for L in kv_lens]
    num_pages = sum(npages) + 2
    page_indices = rng.permutation(num_pages)[: sum(npages)].astype(np.int32)
    page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([L - (k - 1) * P for L, k in zip(kv_lens, npages, strict=True)], np.int32)
    pages = _rand(rng, (num_pages, 2, H_KV, P, D), np.float16)
    n = sum(new)
    q = _rand(rng, (n, spec.num_qo_heads, D), np.float16)
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q_pos = np.concatenate([np.arange(h, h + m) for h, m in zip(hist, new, strict=True)]).astype(np.int32)
    sm_scale = 1 / math.sqrt(D)
    kv = (pages, page_indptr, page_indices, last)
    o, lse, writes = _model(spec, "paged", mask, q, q_indptr, q_pos, kv, sm_scale, num_warps=nw)
    o_ref, lse_ref = ref.paged_prefill(
        q,
        q_indptr,
        q_pos,
        pages,
        page_indptr,
        page_indices,
        last,
        np.zeros((4, 3), np.int32),
        None,
        None,
        None,
        None,
        sm_scale,
        1.0,
        1e4,
        mask=mask,
    )
    assert (writes == 1).all()
    np.testing.assert_allclose(lse, lse_ref, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(o, o_ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("D,group", [(64, 4), (128, 1)])
def test_ragged_model(D, group):
    rng = np.random.default_rng(2)
    spec = KernelSpec(group * H_KV, H_KV, D, 16, "float16", "cuda")
    new = [1, 70, 0, 9]
    n = sum(new)
    q = _rand(rng, (n, spec.num_qo_heads, D), np.float16)
    k = _rand(rng, (n, H_KV, D), np.float16)
    v = _rand(rng, (n, H_KV, D), np.float16)
    q_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q_pos = np.arange(n, dtype=np.int32)
    sm_scale = 1 / math.sqrt(D)
    o, lse, writes = _model(spec, "ragged", "causal", q, q_indptr, q_pos, (k, v), sm_scale)
    o_ref, lse_ref = ref.ragged_prefill(q, k, v, q_indptr, q_pos, None, sm_scale, 1.0, 1e4, mask="causal")
    assert (writes == 1).all()
    np.testing.assert_allclose(lse, lse_ref, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(o, o_ref, atol=1e-2, rtol=1e-2)


def test_fast_path_conditions():
    """What goes to the tensor-core schedule and what falls back (see the module docstring)."""
    fp16 = KernelSpec(32, 8, 128, 16, "float16", "cuda")
    assert pc.prefill_layout(fp16, mask="causal") is not None
    assert pc.prefill_layout(fp16, mask="none") is not None
    assert pc.prefill_layout(KernelSpec(32, 8, 64, 1, "bfloat16", "cuda"), mask="causal") is not None
    assert pc.prefill_layout(fp16, mask="tree") is None
    assert pc.prefill_layout(fp16, mask="causal", sliding=True) is None
    assert pc.prefill_layout(fp16, mask="causal", inline_rope=True) is None
    assert pc.prefill_layout(KernelSpec(32, 8, 128, 16, "float32", "cuda"), mask="causal") is None
    assert pc.prefill_layout(KernelSpec(32, 8, 256, 16, "float16", "cuda"), mask="causal") is None
    assert pc.prefill_layout(KernelSpec(12, 1, 64, 16, "float16", "cuda"), mask="causal") is None  # group 12
    assert pc.prefill_layout(KernelSpec(32, 8, 128, 16, "float16", "llvm"), mask="causal") is None
