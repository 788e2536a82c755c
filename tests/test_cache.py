"""PagedAttentionKVCache: scenario replays against the NumPy model, and every misuse rejected atomically."""

from __future__ import annotations

import numpy as np
import pytest

import tvmkv
from tvmkv.replay import NEEDS_SLIDING, SCENARIOS, Replayer
from tvmkv.runtime.tensors import numpy_dtype
from tvmkv.testing import make_cache
from tvmkv.testing.configs import REPLAY_CONFIGS


@pytest.mark.parametrize("dtype,head_dim,rope_mode,group,page_size", REPLAY_CONFIGS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_replay(target, scenario, dtype, head_dim, rope_mode, group, page_size):
    cache = make_cache(
        target,
        dtype=dtype,
        head_dim=head_dim,
        rope_mode=rope_mode,
        group=group,
        page_size=page_size,
        sliding=scenario in NEEDS_SLIDING,
    )
    r = Replayer(cache, seed=hash((scenario, head_dim, page_size)) % 1000)
    rows = r.run(SCENARIOS[scenario])
    assert len(rows) == len(SCENARIOS[scenario])
    assert not cache.sequence_ids()
    assert cache.num_available_pages() == r.initial_free == cache.config.total_pages


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_replay_split_decode(target, scenario):
    """Every scenario with flash-decoding forced (decode_splits=4; inline RoPE, page size 1 and, where
    the scenario needs it, sliding windows ride along): outputs still match the model."""
    cache = make_cache(
        target, dtype="float16", rope_mode="inline", page_size=1, sliding=scenario in NEEDS_SLIDING, decode_splits=4
    )
    r = Replayer(cache, seed=7)
    assert len(r.run(SCENARIOS[scenario])) == len(SCENARIOS[scenario])
    assert cache.num_available_pages() == cache.config.total_pages


def test_bfloat16_replay(target):
    cache = make_cache(target, dtype="bfloat16", rope_mode="normal")
    Replayer(cache).run(SCENARIOS["fork"])
    assert cache.num_available_pages() == cache.config.total_pages


@pytest.mark.parametrize("kv_dtype", ["", "float8_e4m3fn"])
def test_fork_inside_a_page_copies_every_layer(target, kv_dtype):
    """Copy-on-write of a fork's shared partial page (one ``copy_page_layers`` launch for all layers)
    gives every layer of the child the parent's K/V, and leaves the parent's page alone: checked
    against the K/V each layer was given, after both sequences wrote their own next token."""
    cache = make_cache(target, num_layers=3, page_size=8, dtype="float16" if kv_dtype else "float32", kv_dtype=kv_dtype)
    cfg, rng = cache.config, np.random.default_rng(3)
    H, D = cfg.num_kv_heads, cfg.head_dim

    def step(ids, lengths):
        cache.begin_forward(ids, lengths)
        given = []
        for layer in range(cfg.num_layers):
            qkv = rng.uniform(-1, 1, (sum(lengths), cfg.qkv_heads, D)).astype(numpy_dtype(cfg.dtype))
            cache.attention_with_fused_qkv(layer, qkv)
            given.append(qkv[:, cfg.num_qo_heads :].astype(np.float32))  # [n, 2 H, D]: K heads, V heads
        cache.end_forward()
        return np.stack(given)  # [layers, n, 2 H, D]

    cache.add_sequence(0)
    history = step([0], [13])  # pages: 8 + 5 slots
    cache.fork_sequence(0, 1, 11)  # shares page 0 whole and 3 of page 1's slots
    new = step([1, 0], [1, 1])  # the child copies its 3 shared slots, then both append
    child = np.concatenate([history[:, :11], new[:, :1]], axis=1)
    parent = np.concatenate([history, new[:, 1:]], axis=1)
    tol = {"atol": 0.07, "rtol": 0} if kv_dtype else {"atol": 0, "rtol": 0}  # e4m3: 3 mantissa bits
    for sid, want in ((1, child), (0, parent)):
        k, v = cache.debug_get_kv(sid)
        assert k.shape == (cfg.num_layers, want.shape[1], H, D)
        np.testing.assert_allclose(k, want[:, :, :H], **tol, err_msg=f"K of sequence {sid}")
        np.testing.assert_allclose(v, want[:, :, H:], **tol, err_msg=f"V of sequence {sid}")
    cache.check_integrity()


# ------------------------------------------------------------------------------------------- misuse
def snapshot(cache, start=0):
    """Free pages, lengths and stored K/V from position ``start`` on of every sequence."""
    state = {"free": cache.num_available_pages(), "total": cache.total_sequence_length()}
    for sid in cache.sequence_ids():
        state[sid] = (cache.sequence_length(sid), *cache.debug_get_kv(sid, start))
    return state


def assert_same(cache, before, start=0):
    cache.check_integrity()
    after = snapshot(cache, start)
    assert after.keys() == before.keys()
    for key, value in before.items():
        if isinstance(value, tuple):
            assert value[0] == after[key][0], f"length of sequence {key} changed"
            np.testing.assert_array_equal(value[1], after[key][1])
            np.testing.assert_array_equal(value[2], after[key][2])
        else:
            assert value == after[key], key


@pytest.fixture
def filled(target):
    """A cache with sequences 0 (21 tokens) and 1 (forked from 0 at 10, plus 3)."""
    cache = make_cache(target, group=2, page_size=8, num_pages=40, max_total_seq_len=256, prefill_chunk_size=512)
    rng = np.random.default_rng(1)
    cache.add_sequence(0)
    run_forward(cache, rng, [0], [21])
    cache.fork_sequence(0, 1, 10)
    run_forward(cache, rng, [1], [3])
    return cache


def run_forward(cache, rng, ids, lengths, parents=None):
    cfg = cache.config
    cache.begin_forward(ids, lengths, parents)
    n = sum(lengths)
    for layer in range(cfg.num_layers):
        qkv = rng.uniform(-1, 1, (n, cfg.qkv_heads, cfg.head_dim)).astype(numpy_dtype(cfg.dtype))
        cache.attention_with_fused_qkv(layer, qkv)
    cache.end_forward()


MISUSES = {
    "add duplicate": (KeyError, lambda c: c.add_sequence(0)),
    "add non-int id": (TypeError, lambda c: c.add_sequence("x")),
    "remove unknown": (KeyError, lambda c: c.remove_sequence(7)),
    "fork unknown parent": (KeyError, lambda c: c.fork_sequence(7, 8)),
    "fork existing child": (KeyError, lambda c: c.fork_sequence(0, 1)),
    "fork past end": (ValueError, lambda c: c.fork_sequence(0, 5, 22)),
    "fork negative pos": (ValueError, lambda c: c.fork_sequence(0, 5, -2)),
    "pop more than length": (ValueError, lambda c: c.pop_n(1, 14)),
    "pop negative": (ValueError, lambda c: c.pop_n(0, -1)),
    "pop unknown": (KeyError, lambda c: c.pop_n(9, 1)),
    "attention outside forward": (
        tvmkv.ForwardStateError,
        lambda c: c.attention_with_fused_qkv(0, np.zeros((1, 6, 64), np.float32)),
    ),
    "end without forward": (tvmkv.ForwardStateError, lambda c: c.end_forward()),
    "begin unknown seq": (KeyError, lambda c: c.begin_forward([0, 9], [1, 1])),
    "begin repeated seq": (ValueError, lambda c: c.begin_forward([0, 0], [1, 1])),
    "begin zero length": (ValueError, lambda c: c.begin_forward([0, 1], [1, 0])),
    "begin negative length": (ValueError, lambda c: c.begin_forward([0], [-3])),
    "begin length mismatch": (ValueError, lambda c: c.begin_forward([0, 1], [1])),
    "begin empty": (ValueError, lambda c: c.begin_forward([], [])),
    "begin over chunk": (ValueError, lambda c: c.begin_forward([0], [513])),
    "begin over batch": (
        ValueError,
        lambda c: [c.add_sequence(i) for i in range(2, 17)] and c.begin_forward(list(range(17)), [1] * 17),
    ),
    "begin out of pages": (tvmkv.OutOfPagesError, lambda c: c.begin_forward([0, 1], [250, 50])),
    "window without support": (ValueError, lambda c: c.enable_sliding_window_for_seq(0, 8, 2)),
    "tree bad parent": (ValueError, lambda c: c.begin_forward([0], [2], [-1, 1])),
    "tree wrong count": (ValueError, lambda c: c.begin_forward([0], [2], [-1])),
    "commit bad leaf": (ValueError, lambda c: c.commit_accepted_token_tree_nodes([0], [0])),
    "debug_get_kv out of range": (ValueError, lambda c: c.debug_get_kv(0, 0, 99)),
}


@pytest.mark.parametrize("name", list(MISUSES))
def test_misuse_leaves_state(filled, name):
    exc, call = MISUSES[name]
    before = snapshot(filled)
    with pytest.raises(exc) as info:
        call(filled)
    assert str(info.value)
    if name == "begin over batch":  # the call added sequences 2..16 before failing: drop them again
        for i in range(2, 17):
            filled.remove_sequence(i)
    assert_same(filled, before)
    # the cache still works afterwards
    run_forward(filled, np.random.default_rng(2), [0, 1], [1, 2])
    filled.check_integrity()


ATTENTION_MISUSES = {
    "layer out of range": (ValueError, lambda c, q: c.attention_with_fused_qkv(2, q)),
    "layer negative": (ValueError, lambda c, q: c.attention_with_fused_qkv(-1, q)),
    "too few rows": (ValueError, lambda c, q: c.attention_with_fused_qkv(0, q[:-1])),  # (more: TVM takes them)
    "wrong heads": (ValueError, lambda c, q: c.attention_with_fused_qkv(0, q[:, :5])),
    "wrong dtype": (ValueError, lambda c, q: c.attention_with_fused_qkv(0, q.astype(np.float16))),
    "not an array": (TypeError, lambda c, q: c.attention_with_fused_qkv(0, q.tolist())),
    "non-contiguous": (ValueError, lambda c, q: c.attention_with_fused_qkv(0, np.asfortranarray(q))),
    "nan sm_scale": (ValueError, lambda c, q: c.attention_with_fused_qkv(0, q, sm_scale=float("nan"))),
    "nested begin": (tvmkv.ForwardStateError, lambda c, q: c.begin_forward([0], [1])),
    "remove during forward": (tvmkv.ForwardStateError, lambda c, q: c.remove_sequence(0)),
    "wrong device": (ValueError, lambda c, q: c.attention_with_fused_qkv(0, _meta_tensor(q))),
    "out wrong shape": (
        ValueError,
        lambda c, q: c.attention_with_fused_qkv(0, q, out=np.zeros((3, 5, 64), np.float32)),
    ),
}


def _meta_tensor(q):
    import torch

    return torch.empty(q.shape, dtype=torch.float32, device="meta")


@pytest.mark.parametrize("name", list(ATTENTION_MISUSES))
def test_attention_misuse(filled, name):
    exc, call = ATTENTION_MISUSES[name]
    cfg = filled.config
    rng = np.random.default_rng(3)
    filled.begin_forward([0, 1], [1, 2])
    qkv = rng.uniform(-1, 1, (3, cfg.qkv_heads, cfg.head_dim)).astype(np.float32)
    with pytest.raises(exc) as info:
        call(filled, qkv)
    assert str(info.value)
    for layer in range(cfg.num_layers):  # the forward is still usable
        o = filled.attention_with_fused_qkv(layer, qkv)
        assert o.shape == (3, cfg.num_qo_heads, cfg.head_dim) and np.isfinite(o).all()
    filled.end_forward()
    filled.check_integrity()
    assert filled.sequence_length(0) == 22 and filled.sequence_length(1) == 15


def test_out_of_pages_then_retry(target):
    cache = make_cache(target, group=1, num_pages=32, max_total_seq_len=512, prefill_chunk_size=512)
    rng = np.random.default_rng(4)
    for sid in range(3):
        cache.add_sequence(sid)
    run_forward(cache, rng, [0, 1], [200, 200])  # 26 pages
    free = cache.num_available_pages()
    with pytest.raises(tvmkv.OutOfPagesError) as info:
        cache.begin_forward([2, 0], [100, 1])
    assert info.value.needed == 7 and info.value.available == free == 6
    cache.check_integrity()
    assert cache.num_available_pages() == free
    cache.remove_sequence(1)  # preempt, then the same step succeeds
    run_forward(cache, rng, [2, 0], [100, 1])
    cache.check_integrity()


def test_torch_and_tvm_arrays_and_out(target):
    import torch
    import tvm

    cache = make_cache(target, group=2)
    rng = np.random.default_rng(5)
    cfg = cache.config
    ref_cache = make_cache(target, group=2)
    for c in (cache, ref_cache):
        c.add_sequence(0)
        c.begin_forward([0], [5])
    qkv = rng.uniform(-1, 1, (5, cfg.qkv_heads, cfg.head_dim)).astype(np.float32)
    want = ref_cache.attention_with_fused_qkv(0, qkv)
    # torch in -> torch out; an unaligned view is accepted (copied), `out` written in place
    dev = "cpu" if target == "llvm" else "cuda"
    base = torch.zeros(qkv.size + 1, dtype=torch.float32, device=dev)
    unaligned = base[1:].view(qkv.shape)
    unaligned.copy_(torch.from_numpy(qkv))
    out = torch.zeros((5, cfg.num_qo_heads, cfg.head_dim), dtype=torch.float32, device=dev)
    got = cache.attention_with_fused_qkv(0, unaligned, out=out)
    assert got is out
    np.testing.assert_allclose(out.cpu().numpy(), want, atol=1e-6)
    got_tvm = cache.attention_with_fused_qkv(1, tvm.runtime.tensor(qkv, cache.device))
    assert isinstance(got_tvm, tvm.runtime.Tensor)
    np.testing.assert_allclose(got_tvm.numpy(), want, atol=1e-6)
    # the next torch calls take the fast path (torch tensors of a class already checked): same output,
    # and a tensor of the wrong dtype, shape or layout is still refused with the general path's errors
    aligned = torch.from_numpy(qkv).to(dev)
    out2 = torch.full_like(out, 7.0)
    assert cache.attention_with_fused_qkv(0, aligned, out=out2) is out2
    np.testing.assert_allclose(out2.cpu().numpy(), want, atol=1e-6)
    for bad, word in (
        (aligned.double(), "dtype"),
        (aligned[:4], "shape"),
        (aligned.transpose(0, 1).contiguous().transpose(0, 1), "contiguous"),
    ):
        with pytest.raises(ValueError, match=word):
            cache.attention_with_fused_qkv(0, bad, out=out2)
    with pytest.raises(ValueError, match="shape"):
        cache.attention_with_fused_qkv(0, aligned, out=out2[:4])
    np.testing.assert_allclose(out2.cpu().numpy(), want, atol=1e-6)  # refused calls wrote nothing


def test_sliding_window_misuse(target):
    cache = make_cache(target, group=1, page_size=4, sliding=True)
    rng = np.random.default_rng(6)
    cache.add_sequence(0)
    with pytest.raises(ValueError):
        cache.enable_sliding_window_for_seq(0, 0, 0)
    with pytest.raises(ValueError):
        cache.enable_sliding_window_for_seq(0, 4, 5)
    cache.enable_sliding_window_for_seq(0, 8, 2)
    run_forward(cache, rng, [0], [20])
    # kept: the sink (tokens 0, 1) and the window's last 6 (tokens 14..19), at positions 0..7 (TVM's rule)
    assert cache.sequence_length(0) == 8
    before = snapshot(cache, start=0)
    np.testing.assert_array_equal(cache.debug_get_kv(0, 0, 2)[0].shape, (2, 2, 2, 64))
    for call in (
        lambda: cache.fork_sequence(0, 1),
        lambda: cache.pop_n(0, 7),
        lambda: cache.debug_get_kv(0, 0, 20),
        lambda: cache.begin_forward([0], [1], [-1]),
    ):
        with pytest.raises(ValueError):
            call()
        assert_same(cache, before, start=0)
    assert cache.num_available_pages() == cache.config.total_pages - 3  # sink page + 2 window pages


def test_constructor_errors():
    with pytest.raises(ValueError, match="num_kv_heads"):
        tvmkv.PagedAttentionKVCache(1, 6, 4, 64)
    with pytest.raises(ValueError, match="page_size"):
        tvmkv.PagedAttentionKVCache(1, 4, 2, 64, page_size=12)
    with pytest.raises(ValueError, match="num_pages"):
        tvmkv.PagedAttentionKVCache(1, 4, 2, 64, num_pages=3, max_total_seq_len=128)
    with pytest.raises(ValueError, match="rope_mode"):
        tvmkv.PagedAttentionKVCache(1, 4, 2, 64, rope_mode="yarn")
    with pytest.raises(ValueError, match="target"):
        tvmkv.PagedAttentionKVCache(1, 4, 2, 64, target="rocm")


def test_capacity_sizing():
    cache = tvmkv.PagedAttentionKVCache(
        2, 4, 2, 64, page_size=16, dtype="float32", memory_fraction=0.001, max_total_seq_len=64
    )
    from tvmkv.runtime.cache import available_bytes

    want = int(available_bytes(cache.device) * 0.001) // (cache.config.page_bytes * 2)
    assert abs(cache.config.total_pages - want) <= want // 20 + 1  # free memory moves a little
    assert cache.num_available_pages() == cache.config.total_pages
    with pytest.raises(ValueError, match="memory_fraction"):
        tvmkv.PagedAttentionKVCache(2, 4, 2, 64, memory_fraction=1e-12)
    with pytest.raises(ValueError, match="not both"):
        tvmkv.PagedAttentionKVCache(2, 4, 2, 64, memory_fraction=0.1, num_pages=100)
    with pytest.raises(ValueError, match="GiB"):
        tvmkv.PagedAttentionKVCache(64, 4, 2, 256, page_size=256, dtype="float32", num_pages=1 << 20)


def test_seq_ids_any_int64_and_bool_rejected(target):
    """Any int64 is an id (TVM's ids are int64), NumPy integers too; bools, floats and ints beyond int64
    are refused."""
    cache = make_cache(target, group=1)
    rng = np.random.default_rng(7)
    for sid in (-5, 2**63 - 1, np.int64(3)):
        cache.add_sequence(sid)
    run_forward(cache, rng, [-5, 2**63 - 1, 3], [2, 1, 3])
    assert cache.sequence_length(2**63 - 1) == 1
    with pytest.raises(TypeError):
        cache.add_sequence(True)
    with pytest.raises(TypeError):
        cache.add_sequence(1.5)
    with pytest.raises(ValueError, match="outside int64"):
        cache.add_sequence(2**70)


def test_nan_stays_in_its_sequence(target):
    cache = make_cache(target, group=2, page_size=4)
    cfg = cache.config
    rng = np.random.default_rng(8)
    for sid in (0, 1):
        cache.add_sequence(sid)
    run_forward(cache, rng, [0, 1], [6, 5])
    clean_k, clean_v = cache.debug_get_kv(1)
    cache.begin_forward([0, 1], [2, 1])
    qkv = rng.uniform(-1, 1, (3, cfg.qkv_heads, cfg.head_dim)).astype(np.float32)
    qkv[0, :, 3] = np.nan
    for layer in range(cfg.num_layers):
        o = cache.attention_with_fused_qkv(layer, qkv)
        assert np.isnan(o[:2]).any() and np.isfinite(o[2]).all()
    cache.end_forward()
    k, v = cache.debug_get_kv(1, 0, 5)
    np.testing.assert_array_equal(k, clean_k)
    np.testing.assert_array_equal(v, clean_v)
    assert np.isfinite(cache.debug_get_kv(1)[0]).all()
    # decode step (the decode kernel): Inf in sequence 0's token, sequence 1 stays clean
    cache.begin_forward([0, 1], [1, 1])
    qkv = rng.uniform(-1, 1, (2, cfg.qkv_heads, cfg.head_dim)).astype(np.float32)
    qkv[0, :, 5] = np.inf
    for layer in range(cfg.num_layers):
        o = cache.attention_with_fused_qkv(layer, qkv)
        assert not np.isfinite(o[0]).all() and np.isfinite(o[1]).all()
    cache.end_forward()
    assert all(np.isfinite(x).all() for x in cache.debug_get_kv(1))
