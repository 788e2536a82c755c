"""TVM's fine-grained attention calls on an MHA/GQA cache — ``self_attention``, ``cross_attention``,
``merge_attn_output_inplace`` — against NumPy written out here: self over the new tokens (causal),
cross over the history (TVM's rule: a prefill sees only the keys held before the forward, a decode
step also its own appended token), and their merge equal to attention over everything. Errors leave
the cache as it was."""

from __future__ import annotations

import numpy as np
import pytest

import tvmkv
from tvmkv.errors import ForwardStateError

H_QO, H_KV, D, P = 4, 2, 16, 4
G = H_QO // H_KV
THETA = 1e4


def _cache(target, dtype="float32", **kw):
    opts = dict(page_size=P, max_batch_size=4, max_total_seq_len=128, prefill_chunk_size=64, dtype=dtype)
    opts.update(kw)
    return tvmkv.PagedAttentionKVCache(2, H_QO, H_KV, D, target=target, **opts)


def _rope(x, pos):
    half = D // 2
    ang = np.asarray(pos, np.float64)[:, None] * THETA ** (-np.arange(half) * 2.0 / D)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    return np.concatenate([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)


def _attend(q, q_pos, k, v, k_pos, sm_scale=D**-0.5):
    """Rows q [m, H_qo, D] at q_pos over keys k, v [L, H_kv, D] at k_pos (key visible iff k_pos <= q_pos):
    (o [m, H_qo, D], base-2 lse [m, H_qo]); no visible key: o 0, lse -inf."""
    m = len(q)
    o, lse = np.zeros((m, H_QO, D)), np.full((m, H_QO), -np.inf)
    for i in range(m):
        vis = np.asarray(k_pos) <= q_pos[i]
        if not vis.any():
            continue
        for h in range(H_QO):
            s = k[vis, h // G] @ q[i, h] * sm_scale
            p = np.exp(s - s.max())
            o[i, h] = p @ v[vis, h // G] / p.sum()
            lse[i, h] = (s.max() + np.log(p.sum())) / np.log(2)
    return o, lse


class _Model:
    """Per sequence: raw K/V and positions of every token appended so far (no windows here)."""

    def __init__(self):
        self.k, self.v = {}, {}

    def history(self, s):
        k = self.k.get(s, np.zeros((0, H_KV, D)))
        return k, self.v.get(s, np.zeros((0, H_KV, D)))

    def extend(self, s, k, v):
        hk, hv = self.history(s)
        self.k[s], self.v[s] = np.concatenate([hk, k]), np.concatenate([hv, v])


def _rows(rng, n, heads):
    return rng.standard_normal((n, heads, D)).astype(np.float32)


@pytest.mark.parametrize("rope_mode", ["none", "inline"])
def test_self_cross_merge_equal_full_attention(target, rope_mode):
    """A prefill with history: cross (history only) + self (new tokens, causal), merged, equals attention
    over everything, which also equals attention_with_fused_qkv; a sequence without history gets
    o = 0, lse = -inf from cross. Then a decode step: cross includes the appended token (TVM's rule)."""
    rng = np.random.default_rng(0)
    cache = _cache(target, rope_mode=rope_mode)
    model = _Model()
    inline = rope_mode == "inline"

    def fused(seq_ids, lens, layer=0):
        n = sum(lens)
        q, k, v = _rows(rng, n, H_QO), _rows(rng, n, H_KV), _rows(rng, n, H_KV)
        qkv = np.concatenate([q, k, v], axis=1)
        return q, k, v, cache.attention_with_fused_qkv(layer, qkv)

    for s in (0, 1, 2):
        cache.add_sequence(s)
    cache.begin_forward([0, 1], [5, 3])
    for layer in (0, 1):
        q, k, v, _ = fused([0, 1], [5, 3], layer)
        if layer == 0:
            model.extend(0, k[:5], v[:5])
            model.extend(1, k[5:], v[5:])
    cache.end_forward()

    seq_ids, lens = [0, 1, 2], [3, 2, 4]
    n = sum(lens)
    cache.begin_forward(seq_ids, lens)
    q, k, v = _rows(rng, n, H_QO), _rows(rng, n, H_KV), _rows(rng, n, H_KV)
    o_c, lse_c = cache.cross_attention(0, q)
    o_s, lse_s = cache.self_attention(0, q, k, v)
    q_pos = np.concatenate(
        [np.arange(len(model.history(s)[0]), len(model.history(s)[0]) + m) for s, m in zip(seq_ids, lens)]
    )
    want_o, want_lse = np.zeros((n, H_QO, D)), np.zeros((n, H_QO))  # over history + new tokens
    at = 0
    for s, m in zip(seq_ids, lens):
        hk, hv = model.history(s)
        L = len(hk)
        qs, qp = q[at : at + m], q_pos[at : at + m]
        rq = _rope(qs, qp) if inline else qs
        hk_r = _rope(hk, np.arange(L)) if inline else hk
        nk = _rope(k[at : at + m], qp) if inline else k[at : at + m]
        want_c = _attend(rq, qp, hk_r, hv, np.arange(L))
        want_s = _attend(rq, qp, nk, v[at : at + m], qp)
        want_all = _attend(rq, qp, np.concatenate([hk_r, nk]), np.concatenate([hv, v[at : at + m]]), np.arange(L + m))
        np.testing.assert_allclose(o_c[at : at + m], want_c[0], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(lse_c[at : at + m], want_c[1], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(o_s[at : at + m], want_s[0], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(lse_s[at : at + m], want_s[1], atol=2e-5, rtol=1e-4)
        want_o[at : at + m], want_lse[at : at + m] = want_all
        at += m
        if s == 2:
            assert L == 0 and np.all(o_c[at - m : at] == 0) and np.all(np.isneginf(lse_c[at - m : at]))
    # merge (in place) equals attention over history + new tokens, and attention_with_fused_qkv
    merged_o, merged_lse = o_c.copy(), lse_c.copy()
    ret = cache.merge_attn_output_inplace(merged_o, merged_lse, o_s, lse_s)
    assert ret[0] is merged_o and ret[1] is merged_lse
    np.testing.assert_allclose(merged_o, want_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(merged_lse, want_lse, atol=2e-5, rtol=1e-4)
    fused_o = cache.attention_with_fused_qkv(0, np.concatenate([q, k, v], axis=1))
    np.testing.assert_allclose(merged_o, fused_o, atol=2e-5, rtol=1e-4)
    # with the layer appended, include_new=True sees history + new tokens: the same result
    o_all, lse_all = cache.cross_attention(0, q, include_new=True)
    np.testing.assert_allclose(o_all, fused_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse_all, merged_lse, atol=2e-5, rtol=1e-4)
    cache.end_forward()
    at = 0
    for s, m in zip(seq_ids, lens):
        model.extend(s, k[at : at + m], v[at : at + m])
        at += m

    # a decode step: by TVM's rule cross reads this forward's appended token too
    cache.begin_forward([0, 1], [1, 1])
    q1 = _rows(rng, 2, H_QO)
    with pytest.raises(ForwardStateError, match="include_new=False"):
        cache.cross_attention(1, q1)  # layer 1 has not appended this step's tokens
    o_hist, _ = cache.cross_attention(1, q1, include_new=False)  # history alone needs no append
    k1, v1 = _rows(rng, 2, H_KV), _rows(rng, 2, H_KV)
    fused_o = cache.attention_with_fused_qkv(0, np.concatenate([q1, k1, v1], axis=1))
    o_dec, lse_dec = cache.cross_attention(0, q1)
    np.testing.assert_allclose(o_dec, fused_o, atol=2e-5, rtol=1e-4)
    for i, s in enumerate((0, 1)):
        hk, hv = model.history(s)
        L = len(hk)
        qp = np.array([L])
        rq = _rope(q1[i : i + 1], qp) if inline else q1[i : i + 1]
        kk = np.concatenate([hk, k1[i : i + 1]])
        want = _attend(
            rq, qp, _rope(kk, np.arange(L + 1)) if inline else kk, np.concatenate([hv, v1[i : i + 1]]), np.arange(L + 1)
        )
        np.testing.assert_allclose(o_dec[i : i + 1], want[0], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(lse_dec[i : i + 1], want[1], atol=2e-5, rtol=1e-4)
    assert o_hist.shape == (2, H_QO, D)
    cache.end_forward()
    cache.check_integrity()


def test_outputs_written_in_place_and_torch(target):
    """``out`` / ``lse`` given are written in place, for NumPy and torch arrays alike."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    cache = _cache(target)
    cache.add_sequence(0)
    cache.begin_forward([0], [4])
    q, k, v = _rows(rng, 4, H_QO), _rows(rng, 4, H_KV), _rows(rng, 4, H_KV)
    out, lse = np.zeros((4, H_QO, D), np.float32), np.zeros((4, H_QO), np.float32)
    o, l2 = cache.self_attention(0, q, k, v, out=out, lse=lse)
    assert o is out and l2 is lse
    want = _attend(q, np.arange(4), k, v, np.arange(4))
    np.testing.assert_allclose(out, want[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse, want[1], atol=2e-5, rtol=1e-4)
    dev = "cpu" if target == "llvm" else "cuda"
    tq, tk, tv = (torch.from_numpy(x).to(dev) for x in (q, k, v))
    tout, tlse = torch.zeros((4, H_QO, D), device=dev), torch.zeros((4, H_QO), device=dev)
    cache.self_attention(0, tq, tk, tv, out=tout, lse=tlse)
    np.testing.assert_allclose(tout.cpu().numpy(), want[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(tlse.cpu().numpy(), want[1], atol=2e-5, rtol=1e-4)
    cache.end_forward()


def test_merge_rule_with_empty_rows(target):
    """merge_attn_output_inplace against the log-sum-exp rule, with rows where either side is empty."""
    rng = np.random.default_rng(2)
    cache = _cache(target)
    n = 5
    oa, ob = _rows(rng, n, H_QO), _rows(rng, n, H_QO)
    la, lb = rng.standard_normal((n, H_QO)).astype(np.float32), rng.standard_normal((n, H_QO)).astype(np.float32)
    la[0], lb[1] = -np.inf, -np.inf
    la[2], lb[2] = -np.inf, -np.inf
    oa[0] = 0
    ob[1] = 0
    oa[2] = ob[2] = 0
    m = np.maximum(la, lb)
    with np.errstate(invalid="ignore"):
        lse = np.where(np.isneginf(m), -np.inf, m + np.log2(np.exp2(la - m) + np.exp2(lb - m)))
        wa = np.where(np.isneginf(la), 0, np.exp2(la - lse))
        wb = np.where(np.isneginf(lb), 0, np.exp2(lb - lse))
    want = np.nan_to_num(oa * wa[..., None]) + np.nan_to_num(ob * wb[..., None])
    o, lse_got = oa.copy(), la.copy()
    cache.merge_attn_output_inplace(o, lse_got, ob, lb)
    np.testing.assert_allclose(o, want, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(lse_got, lse, atol=1e-6, rtol=1e-5)


def test_errors_leave_the_cache_unchanged(target):
    rng = np.random.default_rng(3)
    cache = _cache(target)
    cache.add_sequence(0)
    q = _rows(rng, 3, H_QO)
    with pytest.raises(ForwardStateError, match="outside begin_forward"):
        cache.cross_attention(0, q)
    with pytest.raises(ForwardStateError, match="outside begin_forward"):
        cache.self_attention(0, q, _rows(rng, 3, H_KV), _rows(rng, 3, H_KV))
    cache.begin_forward([0], [3])
    with pytest.raises(ValueError, match="layer_id 5 is out of range"):
        cache.cross_attention(5, q)
    with pytest.raises(ValueError, match=r"q has shape \(2, 4, 16\)"):
        cache.cross_attention(0, q[:2])
    with pytest.raises(ValueError, match="lse has dtype float16; expected float32"):
        cache.self_attention(0, q, _rows(rng, 3, H_KV), _rows(rng, 3, H_KV), lse=np.zeros((3, H_QO), np.float16))
    with pytest.raises(ValueError, match=r"k has shape"):
        cache.self_attention(0, q, _rows(rng, 3, H_QO), _rows(rng, 3, H_KV))
    with pytest.raises(TypeError, match="include_new"):
        cache.cross_attention(0, q, include_new=1)
    with pytest.raises(ValueError, match=r"o has shape"):
        cache.merge_attn_output_inplace(np.zeros((3, H_QO, 8), np.float32), np.zeros((3, H_QO), np.float32), q, q)
    with pytest.raises(ValueError, match="lse_other has shape"):
        cache.merge_attn_output_inplace(q.copy(), np.zeros((3, H_QO), np.float32), q, np.zeros((2, H_QO), np.float32))
    cache.end_forward()
    assert cache.sequence_length(0) == 3
    cache.check_integrity()


def test_drop_in_globals(target):
    """TVM's globals on a tvmkv cache made by TVM's create call: cross (history) + self, merged by
    ``merge_attn_output_inplace`` (which returns both arrays, as TVM's does), equal NumPy attention
    over everything."""
    import tvm

    from tvmkv.relax import TvmBuiltinOverride

    rng = np.random.default_rng(4)
    dev = tvm.cpu() if target == "llvm" else tvm.cuda()
    g = tvm.get_global_func
    with TvmBuiltinOverride():
        create = g("vm.builtin.paged_attention_kv_cache_create")
        ref = tvm.runtime.tensor(np.zeros((), "float32"), dev)
        with pytest.raises(ValueError, match=r"first argument has 3 entries \[4, 128, 32\]; TVM's cache config"):
            create([4, 128, 32], [0, 1], H_QO, H_KV, D, D, [0], False, 0, 1.0, THETA, None, ref, *[None] * 15)
        cache = create(
            [4, 128, 32, P, 0, 1024], [0, 1], H_QO, H_KV, D, D, [0], False, 0, 1.0, THETA, None, ref, *[None] * 15
        )
        t = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
        g("vm.builtin.kv_state_add_sequence")(cache, 7)
        g("vm.builtin.kv_state_begin_forward")(cache, [7], [5], None)
        q0, k0, v0 = _rows(rng, 5, H_QO), _rows(rng, 5, H_KV), _rows(rng, 5, H_KV)
        o0 = tvm.runtime.empty((5, H_QO, D), "float32", dev)
        g("vm.builtin.attention_kv_cache_attention_with_fused_qkv")(
            cache, 0, D**-0.5, t(np.concatenate([q0, k0, v0], 1)), o0
        )
        g("vm.builtin.kv_state_end_forward")(cache)
        g("vm.builtin.kv_state_begin_forward")(cache, [7], [3], None)
        q, k, v = _rows(rng, 3, H_QO), _rows(rng, 3, H_KV), _rows(rng, 3, H_KV)
        o_s, l_s = tvm.runtime.empty((3, H_QO, D), "float32", dev), tvm.runtime.empty((3, H_QO), "float32", dev)
        o_c, l_c = tvm.runtime.empty((3, H_QO, D), "float32", dev), tvm.runtime.empty((3, H_QO), "float32", dev)
        g("vm.builtin.attention_kv_cache_self_attention")(cache, 0, D**-0.5, t(q), t(k), t(v), o_s, l_s)
        g("vm.builtin.attention_kv_cache_cross_attention")(cache, 0, D**-0.5, t(q), o_c, l_c)
        merged = g("vm.builtin.attention_kv_cache_merge_attn_output_inplace")(cache, o_s, l_s, o_c, l_c)
        g("vm.builtin.kv_state_end_forward")(cache)
        # DebugGetKV fills the caller's tensors after checking both (a wrong one: neither is written)
        get_kv = g("vm.builtin.attention_kv_cache_debug_get_kv")
        shape = (1, 5, H_KV, D)
        kd, vd = tvm.runtime.empty(shape, "float32", dev), tvm.runtime.empty(shape, "float32", dev)
        for bad_k, bad_v in ((tvm.runtime.empty(shape, "int32", dev), vd), (kd, t(np.zeros((1, 4, H_KV, D))))):
            kd.copyfrom(np.full((1, 5, H_KV, D), 9, np.float32))
            with pytest.raises(ValueError, match="debug_get_kv: [kv]_data is .*; it must be a tvm tensor of float32"):
                get_kv(cache, 7, 0, 5, bad_k, bad_v)
            assert (kd.numpy() == 9).all()
        get_kv(cache, 7, 0, 5, kd, vd)
    np.testing.assert_array_equal(kd.numpy()[0], k0)  # rope none: the keys as given
    np.testing.assert_array_equal(vd.numpy()[0], v0)
    assert len(merged) == 2
    want_o, want_lse = _attend(q, np.arange(5, 8), np.concatenate([k0, k]), np.concatenate([v0, v]), np.arange(8))
    np.testing.assert_allclose(o_s.numpy(), want_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(l_s.numpy(), want_lse, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(merged[0].numpy(), want_o, atol=2e-5, rtol=1e-4)


def test_local_layer_and_sliding_cache(target):
    """A layer with a per-layer window: self and cross attend within it (NumPy); a cache built with
    support_sliding_window reads only the history in a decode step too (TVM's rule)."""
    rng = np.random.default_rng(5)
    W = 3
    cache = _cache(target, layer_windows=[W, 0])
    cache.add_sequence(0)
    cache.begin_forward([0], [6])
    q, k, v = _rows(rng, 6, H_QO), _rows(rng, 6, H_KV), _rows(rng, 6, H_KV)
    cache.attention_with_fused_qkv(0, np.concatenate([q, k, v], 1))
    cache.end_forward()
    cache.begin_forward([0], [4])
    q2, k2, v2 = _rows(rng, 4, H_QO), _rows(rng, 4, H_KV), _rows(rng, 4, H_KV)
    o_s, _ = cache.self_attention(0, q2, k2, v2)
    o_c, _ = cache.cross_attention(0, q2)
    cache.end_forward()
    for i in range(4):
        p = 6 + i
        lo = p - W + 1
        ks, vs = np.arange(6, p + 1), np.arange(max(lo, 0), 6)  # new keys / history keys in the window
        want_s = _attend(q2[i : i + 1], [p], k2[ks[ks >= lo] - 6], v2[ks[ks >= lo] - 6], ks[ks >= lo])
        np.testing.assert_allclose(o_s[i : i + 1], want_s[0], atol=2e-5, rtol=1e-4)
        want_c = _attend(q2[i : i + 1], [p], k[vs], v[vs], vs) if len(vs) else (np.zeros((1, H_QO, D)), None)
        np.testing.assert_allclose(o_c[i : i + 1], want_c[0], atol=2e-5, rtol=1e-4)

    sw = _cache(target, support_sliding_window=True)
    sw.add_sequence(0)
    sw.begin_forward([0], [5])
    q, k, v = _rows(rng, 5, H_QO), _rows(rng, 5, H_KV), _rows(rng, 5, H_KV)
    sw.attention_with_fused_qkv(0, np.concatenate([q, k, v], 1))
    sw.end_forward()
    sw.begin_forward([0], [1])
    q1 = _rows(rng, 1, H_QO)
    o1, _ = sw.cross_attention(0, q1)  # a decode step, but the cache supports sliding windows: history only
    sw.end_forward()
    np.testing.assert_allclose(o1, _attend(q1, [5], k, v, np.arange(5))[0], atol=2e-5, rtol=1e-4)
