"""MLA caches (DeepSeek-V2 multi-head latent attention) through the public API, the way TVM's MLA test
drives TVM's cache: per layer ``append_mla_kv``, then in a prefill the non-absorbed ``self_attention``
over the new tokens merged with the absorbed ``cross_attention`` over the history, in a decode step
the absorbed ``cross_attention`` alone. Every output is checked against plain (non-absorbed) causal
attention in NumPy fp64 over all of a sequence's tokens, with forks, pop_n and removal in between;
``debug_get_kv_mla`` against the rows appended. Errors leave the cache unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import tvmkv
from tvmkv.errors import ForwardStateError
from tvmkv.runtime.tensors import numpy_dtype

H, LORA, ROPE, NOPE, V = 4, 32, 16, 16, 16  # heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
DQ = NOPE + ROPE
D = LORA + ROPE
P = 4
SM = DQ**-0.5


@dataclass(frozen=True)
class Dims:
    """An MLA layer's sizes (the module's constants by default)."""

    H: int = H
    LORA: int = LORA
    ROPE: int = ROPE
    NOPE: int = NOPE
    V: int = V
    P: int = P

    @property
    def DQ(self) -> int:
        return self.NOPE + self.ROPE

    @property
    def D(self) -> int:
        return self.LORA + self.ROPE


SMALL = Dims()
# D 192 = 3 x 64, H 16: the shapes cuda builds for sm_90 run on warpgroup MMA (tvmkv.tir.mla_hopper)
WIDE = Dims(H=16, LORA=128, ROPE=64, NOPE=64, V=64, P=16)


def _cache(target, dtype="float32", d: Dims = SMALL, **kw):
    opts = dict(page_size=d.P, max_batch_size=4, max_total_seq_len=96, prefill_chunk_size=32, dtype=dtype)
    opts.update(kw)
    return tvmkv.PagedAttentionKVCache.mla(2, d.H, d.LORA, d.ROPE, target=target, **opts)


class _Mla:
    """DeepSeek-V2's attention of one layer written out in NumPy fp64 (the reference), and its absorbed
    form's inputs (what the cache calls take)."""

    def __init__(self, rng, d: Dims = SMALL):
        self.d = d
        self.w_kv = rng.standard_normal((d.LORA, d.H, d.NOPE + d.V)) / np.sqrt(d.LORA)  # latent -> k_nope, v
        self.rows: dict = {}  # seq -> [L, D] stored rows (latent, k_pe)

    def kv_heads(self, rows):
        """Non-absorbed k [L, H, DQ] and v [L, H, V] of stored rows."""
        d = self.d
        kv = np.einsum("lc,chd->lhd", rows[:, : d.LORA], self.w_kv)
        k_pe = np.repeat(rows[:, None, d.LORA :], d.H, axis=1)
        return np.concatenate([kv[..., : d.NOPE], k_pe], -1), kv[..., d.NOPE :]

    def absorb(self, q):
        """Absorbed queries [n, H, D] of q [n, H, DQ]: q_nope through W_UK, then q_pe."""
        q_lat = np.einsum("nhd,chd->nhc", q[..., : self.d.NOPE], self.w_kv[..., : self.d.NOPE])
        return np.concatenate([q_lat, q[..., self.d.NOPE :]], -1)

    def unabsorb(self, o_lat):
        """o [n, H, V] of the absorbed output o_lat [n, H, LORA] (through W_UV)."""
        return np.einsum("nhc,chd->nhd", o_lat, self.w_kv[..., self.d.NOPE :])

    def attend(self, q, rows, q_pos):
        """Causal attention of q [m, H, DQ] at q_pos over a sequence's rows [L, D]."""
        d = self.d
        k, v = self.kv_heads(rows)
        o = np.zeros((len(q), d.H, d.V))
        for i, p in enumerate(q_pos):
            for h in range(d.H):
                s = k[: p + 1, h] @ q[i, h] * d.DQ**-0.5
                w = np.exp(s - s.max())
                o[i, h] = w @ v[: p + 1, h] / w.sum()
        return o


def _step(cache, ref, rng, batch, dtype, layers=(0, 1)):
    """One forward of ``batch`` [(seq, n)] through every layer as TVM's MLA test does; checks outputs."""
    d = ref.d
    H, D, DQ, SM = d.H, d.D, d.DQ, d.DQ**-0.5  # noqa: N806
    seq_ids, lens = [s for s, _ in batch], [n for _, n in batch]
    hist = {s: len(ref.rows.get(s, np.zeros((0, D)))) for s in seq_ids}
    decode = all(n == 1 for n in lens)
    total = sum(lens)
    np_dtype = numpy_dtype(dtype)
    tol = dict(atol=2e-4, rtol=1e-3) if dtype == "float32" else dict(atol=2e-2, rtol=2e-2)
    cache.begin_forward(seq_ids, lens)
    new_rows = (rng.standard_normal((total, D)) * 0.5).astype(np_dtype)
    q = (rng.standard_normal((total, H, DQ)) * 0.5).astype(np_dtype)
    for layer in layers:
        cache.append_mla_kv(layer, new_rows)
        q_abs = ref.absorb(q.astype(np.float64)).astype(np_dtype)
        if decode:
            o_lat, _ = cache.cross_attention(layer, q_abs, sm_scale=SM)
            o = ref.unabsorb(o_lat.astype(np.float64))
        else:
            rows = new_rows.astype(np.float64)
            k, v = ref.kv_heads(rows)
            o_self, lse_self = cache.self_attention(layer, q, k.astype(np_dtype), v.astype(np_dtype), sm_scale=SM)
            o_lat, lse_cross = cache.cross_attention(layer, q_abs, sm_scale=SM)
            o_cross = ref.unabsorb(o_lat.astype(np.float64)).astype(np_dtype)
            cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
            o = o_self.astype(np.float64)
        at = 0
        for s, n in batch:
            rows = np.concatenate([ref.rows.get(s, np.zeros((0, D))), new_rows[at : at + n].astype(np.float64)])
            want = ref.attend(q[at : at + n].astype(np.float64), rows, np.arange(hist[s], hist[s] + n))
            np.testing.assert_allclose(o[at : at + n], want, **tol)
            at += n
    cache.end_forward()
    at = 0
    for s, n in batch:
        ref.rows[s] = np.concatenate([ref.rows.get(s, np.zeros((0, D))), new_rows[at : at + n].astype(np.float64)])
        at += n


@pytest.mark.parametrize(
    ("dtype", "d"), [("float32", SMALL), ("float16", SMALL), ("float16", WIDE)], ids=["f32", "f16", "f16-d192"]
)
def test_mla_prefill_decode_fork_popn(target, dtype, d):
    rng = np.random.default_rng(0)
    cache = _cache(target, dtype, d)
    ref = _Mla(rng, d)
    for s in (0, 1, 2):
        cache.add_sequence(s)
    _step(cache, ref, rng, [(0, 5), (1, 3)], dtype)  # all new: self attention only (cross sees nothing)
    _step(cache, ref, rng, [(0, 4), (1, 2), (2, 3)], dtype)  # history + a new sequence: merged
    for _ in range(2):
        _step(cache, ref, rng, [(0, 1), (1, 1), (2, 1)], dtype)  # decode: absorbed cross alone
    cache.fork_sequence(0, 3, 6)  # a partial page: copied on write
    ref.rows[3] = ref.rows[0][:6].copy()
    _step(cache, ref, rng, [(3, 2), (0, 1)], dtype)
    _step(cache, ref, rng, [(3, 1), (0, 1)], dtype)
    cache.pop_n(1, 2)
    ref.rows[1] = ref.rows[1][:-2]
    cache.remove_sequence(2)
    del ref.rows[2]
    _step(cache, ref, rng, [(1, 1), (3, 1)], dtype)
    for s, rows in ref.rows.items():
        got = cache.debug_get_kv_mla(s)
        assert got.shape == (2, len(rows), d.D) and cache.sequence_length(s) == len(rows)
        np.testing.assert_allclose(got[0].astype(np.float64), rows, atol=0, rtol=0)
    cache.check_integrity()


def test_mla_self_dims_inferred_not_from_a_refused_call(target):
    """Without mla_self_dims the first self_attention call names the dims; a zero-width one is refused
    (it would name the kernel set without self attention) and names nothing: a prefill afterwards
    matches the NumPy reference."""
    rng = np.random.default_rng(4)
    cache = _cache(target)
    ref = _Mla(rng)
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    digest = cache.table_digest()
    z = np.zeros((3, H, 0), np.float32)
    with pytest.raises(ValueError, match="head dim 0 and v 0; MLA self attention needs both > 0"):
        cache.self_attention(0, z, z, z, sm_scale=SM)
    assert cache.table_digest() == digest
    cache.end_forward()
    cache.remove_sequence(0)
    cache.add_sequence(1)
    _step(cache, ref, rng, [(1, 5)], "float32")  # self attention with the real dims, against NumPy


def test_mla_self_dims_given_and_errors(target):
    rng = np.random.default_rng(1)
    cache = _cache(target, mla_self_dims=(DQ, V))
    cache.add_sequence(0)
    with pytest.raises(ForwardStateError, match="outside begin_forward"):
        cache.append_mla_kv(0, np.zeros((1, D), np.float32))
    cache.begin_forward([0], [3])
    with pytest.raises(ValueError, match=r"kv has shape \(3, 40\)"):
        cache.append_mla_kv(0, np.zeros((3, D - 8), np.float32))
    with pytest.raises(TypeError, match="MLA cache"):
        cache.attention_with_fused_qkv(0, np.zeros((3, H + 2, D), np.float32))
    with pytest.raises(ValueError, match=r"v has shape"):
        cache.self_attention(0, *(np.zeros((3, H, DQ), np.float32),) * 3)  # v of the q/k dim
    with pytest.raises(ValueError, match=r"q has shape"):
        cache.cross_attention(0, np.zeros((3, H, DQ), np.float32))  # not absorbed
    with pytest.raises(ForwardStateError, match="call append_mla_kv for that layer first"):
        cache.cross_attention(0, np.zeros((3, H, D), np.float32), include_new=True)
    q = rng.standard_normal((3, H, DQ)).astype(np.float32)
    kv = rng.standard_normal((3, D)).astype(np.float32)
    cache.append_mla_kv(0, kv)
    o, lse = cache.self_attention(0, q, q, rng.standard_normal((3, H, V)).astype(np.float32))
    assert o.shape == (3, H, V) and lse.shape == (3, H)
    cache.end_forward()
    with pytest.raises(TypeError, match="debug_get_kv_mla"):
        cache.debug_get_kv(0)
    with pytest.raises(NotImplementedError, match="MLA"):
        cache.swap_out([0])
    np.testing.assert_array_equal(cache.debug_get_kv_mla(0)[0], kv)
    assert cache.sequence_length(0) == 3
    cache.check_integrity()
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        tvmkv.PagedAttentionKVCache(2, H, 2, D, kv_lora_rank=LORA, qk_rope_head_dim=ROPE, target=target)
    with pytest.raises(ValueError, match="sliding windows"):
        _cache(target, support_sliding_window=True)


def test_mla_drop_in_globals(target):
    """TVM's create call with AttnKind.MLA layers makes a tvmkv MLA cache; append_mla_kv returns the cache,
    debug_get_kv_mla fills the tensor given."""
    import tvm

    from tvmkv.relax import TvmBuiltinOverride

    dev = tvm.cpu() if target == "llvm" else tvm.cuda()
    g = tvm.get_global_func
    rng = np.random.default_rng(2)
    with TvmBuiltinOverride(mla_self_dims=(DQ, V)) as override:
        ref = tvm.runtime.tensor(np.zeros((), "float32"), dev)
        cache = g("vm.builtin.paged_attention_kv_cache_create")(
            [4, 96, 32, P, 0], [0, 2], H, 1, D, LORA, [1, 1], False, 0, 1.0, 1e4, None, ref, *[None] * 15
        )
        assert override.created == [cache] and cache.config.is_mla and cache.config.kv_lora_rank == LORA
        g("vm.builtin.kv_state_add_sequence")(cache, 5)
        g("vm.builtin.kv_state_begin_forward")(cache, [5], [3], None)
        kv = rng.standard_normal((3, D)).astype(np.float32)
        for layer in (0, 1):
            assert g("vm.builtin.attention_kv_cache_append_mla_kv")(cache, layer, tvm.runtime.tensor(kv, dev)) is cache
        g("vm.builtin.kv_state_end_forward")(cache)
        out = tvm.runtime.empty((2, 3, D), "float32", dev)
        g("vm.builtin.attention_kv_cache_debug_get_kv_mla")(cache, 5, 0, 3, out)
    np.testing.assert_array_equal(out.numpy()[1], kv)


@pytest.mark.parametrize(("dtype", "d"), [("float32", SMALL), ("float16", WIDE)], ids=["f32", "f16-d192"])
def test_mla_split_decode(target, dtype, d):
    """Flash-decoding over the latent rows (decode_splits=4: chunks of the kernel's tile keys, merged)
    equals plain attention; the repeat-decode fast path keeps the split."""
    rng = np.random.default_rng(3)
    cache = _cache(target, dtype, d, decode_splits=4)
    ref = _Mla(rng, d)
    for s in (0, 1):
        cache.add_sequence(s)
    _step(cache, ref, rng, [(0, 25), (1, 7)], dtype)
    _step(cache, ref, rng, [(0, 25), (1, 2)], dtype)
    for _ in range(3):
        cache.begin_forward([0, 1], [1, 1])
        info = cache.debug_forward()
        cache.end_forward()
        cache.pop_n(0, 1)
        cache.pop_n(1, 1)
        assert info.num_splits > 1
        _step(cache, ref, rng, [(0, 1), (1, 1)], dtype)
    cache.check_integrity()
