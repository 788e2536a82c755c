"""TVM's cache semantics that the drop-in must reproduce, checked on tvmkv's native API against NumPy
written out here: sliding windows index the kept tokens (lengths, debug_get_kv, inline RoPE), forks
start without a window, ``is_empty``, TVM's commit of token trees grown over several forwards, and
the override entered before ``import tvm``. (TVM's own test file runs through the drop-in too: README,
"Running TVM's tests on tvmkv".)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tvmkv

H_QO, H_KV, D, P = 4, 2, 16, 4


def _cache(**kw):
    opts = dict(page_size=P, max_batch_size=4, max_total_seq_len=128, prefill_chunk_size=64, dtype="float32")
    opts.update(kw)
    return tvmkv.PagedAttentionKVCache(1, H_QO, H_KV, D, **opts)


def _rope(x, pos, theta=1e4):
    """Rotate-half RoPE of x [n, H, D] at positions pos [n] (float64)."""
    half = D // 2
    ang = np.asarray(pos, np.float64)[:, None] * theta ** (-np.arange(half) * 2.0 / D)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attend(q, k, v):
    """One query q [H_qo, D] over k, v [L, H_kv, D] (float64, GQA, all visible)."""
    g = H_QO // H_KV
    out = np.zeros((H_QO, D))
    for h in range(H_QO):
        s = k[:, h // g] @ q[h] * D**-0.5
        p = np.exp(s - s.max())
        out[h] = p @ v[:, h // g] / p.sum()
    return out


def _assert_attends(o, rows):
    """``o`` [H_qo, D] is the last of ``rows`` (fused qkv) attending to all of them: NumPy, float64."""
    x = np.asarray(rows, np.float64)
    np.testing.assert_allclose(o, _attend(x[-1, :H_QO], x[:, H_QO : H_QO + H_KV], x[:, H_QO + H_KV :]), atol=2e-5)


def _step(cache, sid, rows):
    cache.begin_forward([sid], [len(rows)])
    o = cache.attention_with_fused_qkv(0, rows)
    cache.end_forward()
    return o


def test_sliding_window_indexes_the_kept_tokens_and_rotates_inline_at_kept_positions():
    """Window 8 with sink 2 after 20 tokens keeps tokens 0, 1, 14..19 at positions 0..7; the next
    token sits at position 8, and inline RoPE rotates every kept key at its kept index."""
    rng = np.random.default_rng(0)
    cache = _cache(rope_mode="inline", support_sliding_window=True)
    cache.add_sequence(0)
    cache.enable_sliding_window_for_seq(0, 8, 2)
    rows = rng.standard_normal((21, H_QO + 2 * H_KV, D)).astype(np.float32)
    for t in range(20):
        _step(cache, 0, rows[t : t + 1])
    kept = [0, 1, *range(14, 20)]
    assert cache.sequence_length(0) == 8
    k, v = cache.debug_get_kv(0)
    np.testing.assert_array_equal(k[0], rows[kept, H_QO : H_QO + H_KV])
    np.testing.assert_array_equal(v[0], rows[kept, H_QO + H_KV :])
    with pytest.raises(ValueError):
        cache.debug_get_kv(0, 0, 9)
    o = _step(cache, 0, rows[20:21])
    keys = np.concatenate([rows[kept], rows[20:21]]).astype(np.float64)
    q = _rope(keys[-1:, :H_QO], [8])[0]
    k_all = _rope(keys[:, H_QO : H_QO + H_KV], np.arange(9))
    np.testing.assert_allclose(o[0], _attend(q, k_all, keys[:, H_QO + H_KV :]), atol=2e-5)
    cache.check_integrity()


def test_a_window_enabled_on_a_long_sequence_applies_from_the_end_of_its_next_forward():
    """TVM's EnableSlidingWindowForSeq records the window; the next forward's reservation slides. So a
    30-token sequence given window 10 / sink 2 keeps its length, may still pop_n 15, and its next token
    attends to every token it holds (TVM's C++ cache: all 31 keys, to 1.6e-7); tvmkv dropped 20 tokens
    at once, refused the pop and attended to 11 keys (1.0 off TVM's output)."""
    rng = np.random.default_rng(7)
    cache = _cache(support_sliding_window=True)
    cache.add_sequence(0)
    rows = rng.standard_normal((32, H_QO + 2 * H_KV, D)).astype(np.float32)
    _step(cache, 0, rows[:30])
    cache.enable_sliding_window_for_seq(0, 10, 2)
    assert cache.sequence_length(0) == 30
    cache.pop_n(0, 15)
    assert cache.sequence_length(0) == 15
    o = _step(cache, 0, rows[30:31])  # 15 held + 1 new: all 16 visible
    keys = np.concatenate([rows[:15], rows[30:31]])
    _assert_attends(o[0], keys)
    assert cache.sequence_length(0) == 10  # slid at the end of that forward: tokens 0, 1 and 8..15
    k, _ = cache.debug_get_kv(0)
    np.testing.assert_array_equal(k[0], keys[[0, 1, *range(8, 16)], H_QO : H_QO + H_KV])
    o = _step(cache, 0, rows[31:32])  # from now on the window: 10 kept + the new token
    _assert_attends(o[0], np.concatenate([keys[[0, 1, *range(8, 16)]], rows[31:32]]))
    cache.check_integrity()


def test_fork_starts_without_a_window():
    rng = np.random.default_rng(1)
    cache = _cache(support_sliding_window=True)
    cache.add_sequence(0)
    cache.enable_sliding_window_for_seq(0, 6, 1)
    _step(cache, 0, rng.standard_normal((5, H_QO + 2 * H_KV, D)).astype(np.float32))
    cache.fork_sequence(0, 1)
    assert cache.sequence_info(1).window == 0 and cache.sequence_info(0).window == 6
    for _ in range(4):  # the child grows past the parent's window and keeps everything
        _step(cache, 1, rng.standard_normal((1, H_QO + 2 * H_KV, D)).astype(np.float32))
    assert cache.sequence_length(1) == 9
    cache.check_integrity()


def test_is_empty():
    cache = _cache()
    assert cache.is_empty()
    cache.add_sequence(0)
    assert not cache.is_empty()
    _step(cache, 0, np.zeros((5, H_QO + 2 * H_KV, D), np.float32))
    prefix = tvmkv.RadixPrefixCache(cache)
    prefix.finish_sequence(0, list(range(5)))
    assert cache.sequence_ids() == [] and not cache.is_empty()  # the prefix cache holds pages
    prefix.reset()
    assert cache.is_empty()


def test_commit_last_forward_scope_is_tvms_rule():
    """A tree grown over two forwards: with scope="last_forward", the first forward's node stays, and
    of the last forward's 4 nodes the accepted path [0, 2] (indices over the whole tree) keeps the
    last forward's tokens 0 and 2; scope="tree" keeps the path itself."""
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((8, H_QO + 2 * H_KV, D)).astype(np.float32)
    k_of = rows[:, H_QO : H_QO + H_KV]
    for scope, kept in [("last_forward", [0, 1, 2, 3, 4, 6]), ("tree", [0, 1, 2, 3, 5])]:
        cache = _cache()
        cache.add_sequence(0)
        _step(cache, 0, rows[:3])
        cache.begin_forward([0], [1], [-1])  # node 0
        cache.attention_with_fused_qkv(0, rows[3:4])
        cache.end_forward()
        cache.begin_forward([0], [4], [0, 0, 1, 1])  # nodes 1..4
        cache.attention_with_fused_qkv(0, rows[4:8])
        cache.end_forward()
        cache.commit_accepted_token_tree_nodes([0], [2], scope=scope)  # node 2: path [0, 2]
        assert cache.sequence_length(0) == len(kept), scope
        np.testing.assert_array_equal(cache.debug_get_kv(0)[0][0], k_of[kept], err_msg=scope)
        cache.check_integrity()


def test_commit_last_forward_rejects_paths_into_earlier_forwards():
    cache = _cache()
    cache.add_sequence(0)
    cache.begin_forward([0], [2], [-1, 0])  # nodes 0, 1
    cache.attention_with_fused_qkv(0, np.zeros((2, H_QO + 2 * H_KV, D), np.float32))
    cache.end_forward()
    cache.begin_forward([0], [1], [1])  # node 2 (the last forward has one node)
    cache.attention_with_fused_qkv(0, np.zeros((1, H_QO + 2 * H_KV, D), np.float32))
    cache.end_forward()
    with pytest.raises(ValueError, match="earlier forward"):
        cache.commit_accepted_token_tree_nodes([0], [2], scope="last_forward")
    assert cache.sequence_length(0) == 3 and cache.sequence_info(0).num_tree_nodes == 3
    with pytest.raises(ValueError, match="scope"):
        cache.commit_accepted_token_tree_nodes([0], [2], scope="all")


def test_override_entered_before_import_tvm():
    """Entering the override before TVM's library is loaded used to abort the process (TVM registered
    the same names again while loading)."""
    code = (
        "import tvmkv.relax, sys; assert 'tvm' not in sys.modules\n"
        "o = tvmkv.relax.TvmBuiltinOverride(); o.__enter__()\n"
        "import tvm; f = tvm.get_global_func('vm.builtin.attention_kv_cache_empty'); o.__exit__(None, None, None)\n"
        "print('ok')"
    )
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


def _causal(q, k, v, past, window=0):
    """Rows q [n, H_qo, D] at positions past.. over k, v [past + n, H_kv, D]: causal, and within the last
    ``window`` positions when window > 0 (TVM's per-layer sliding window). float64."""
    g = H_QO // H_KV
    out = np.zeros(q.shape)
    for i in range(q.shape[0]):
        p = past + i
        keys = np.arange(k.shape[0])
        vis = (keys <= p) & ((keys > p - window) if window else True)
        for h in range(H_QO):
            s = k[vis, h // g] @ q[i, h] * D**-0.5
            w = np.exp(s - s.max())
            out[i, h] = w @ v[vis, h // g] / w.sum()
    return out


@pytest.mark.parametrize("window", [1, 3, 100])
def test_per_layer_window_and_shared_kv(window):
    """Layer 0 attends within its own window, layer 1 to everything; attention_with_shared_kv reads layer
    0's pages with layer 0's window, appending nothing. Prefill 3, then 2, then decode 1 (TVM's test
    shape), ragged and paged kernels both."""
    rng = np.random.default_rng(4)
    cache = tvmkv.PagedAttentionKVCache(
        2, H_QO, H_KV, D, page_size=P, max_batch_size=2, max_total_seq_len=64, prefill_chunk_size=16,
        dtype="float32", layer_windows=[window, 0],
    )  # fmt: skip
    cache.add_sequence(0)
    ks = [np.zeros((0, H_KV, D)) for _ in range(2)]
    vs = [np.zeros((0, H_KV, D)) for _ in range(2)]
    past = 0
    for n in (3, 2, 1):
        cache.begin_forward([0], [n])
        with pytest.raises(tvmkv.ForwardStateError, match="has not run"):
            cache.attention_with_shared_kv(0, np.zeros((n, H_QO, D), np.float32), *_kv(n))
        for layer in range(2):
            rows = rng.standard_normal((n, H_QO + 2 * H_KV, D)).astype(np.float32)
            o = cache.attention_with_fused_qkv(layer, rows)
            ks[layer] = np.concatenate([ks[layer], rows[:, H_QO : H_QO + H_KV]])
            vs[layer] = np.concatenate([vs[layer], rows[:, H_QO + H_KV :]])
            want = _causal(rows[:, :H_QO].astype(np.float64), ks[layer], vs[layer], past, window if layer == 0 else 0)
            np.testing.assert_allclose(o, want, atol=2e-5, err_msg=f"layer {layer}, {n} tokens")
        q = rng.standard_normal((n, H_QO, D)).astype(np.float32)
        o = cache.attention_with_shared_kv(0, q, *_kv(n))
        np.testing.assert_allclose(o, _causal(q.astype(np.float64), ks[0], vs[0], past, window), atol=2e-5)
        cache.end_forward()
        past += n
    np.testing.assert_array_equal(cache.debug_get_kv(0)[0][0], ks[0])  # the shared call appended nothing
    cache.check_integrity()


def _kv(n):
    return np.zeros((n, H_KV, D), np.float32), np.zeros((n, H_KV, D), np.float32)


def test_per_layer_window_arguments():
    with pytest.raises(ValueError, match="layer_windows"):
        tvmkv.PagedAttentionKVCache(2, H_QO, H_KV, D, dtype="float32", layer_windows=[3])
    with pytest.raises(ValueError, match="layer_windows"):
        tvmkv.PagedAttentionKVCache(2, H_QO, H_KV, D, dtype="float32", layer_windows=[3, -1])
    with pytest.raises(TypeError, match="layer_windows"):
        tvmkv.PagedAttentionKVCache(2, H_QO, H_KV, D, dtype="float32", layer_windows=3)
    cache = tvmkv.PagedAttentionKVCache(
        2, H_QO, H_KV, D, page_size=P, max_batch_size=2, max_total_seq_len=64, prefill_chunk_size=16,
        dtype="float32", layer_windows=[2, 0],
    )  # fmt: skip
    cache.add_sequence(0)
    with pytest.raises(ValueError, match="token trees"):
        cache.begin_forward([0], [1], [-1])
    assert not cache.forward_open


def test_shared_kv_uses_q_as_given_with_normal_rope():
    """TVM's attention_with_shared_kv passes q to the kernel as given (the model rotated it under "normal"
    RoPE); ``rotate_q=True`` rotates raw q first. Both equal NumPy attention with the rotated q over the
    rotated keys."""
    rng = np.random.default_rng(6)
    cache = _cache(rope_mode="normal")
    cache.add_sequence(0)
    rows = rng.standard_normal((5, H_QO + 2 * H_KV, D)).astype(np.float32)
    _step(cache, 0, rows)
    cache.begin_forward([0], [1])
    row = rng.standard_normal((1, H_QO + 2 * H_KV, D)).astype(np.float32)
    cache.attention_with_fused_qkv(0, row)
    q = rng.standard_normal((1, H_QO, D)).astype(np.float32)
    q_rot = _rope(q.astype(np.float64), [5]).astype(np.float32)
    given = cache.attention_with_shared_kv(0, q_rot, *_kv(1))
    rotated_here = cache.attention_with_shared_kv(0, q, *_kv(1), rotate_q=True)
    cache.end_forward()
    k = np.concatenate([rows[:, H_QO : H_QO + H_KV], row[:, H_QO : H_QO + H_KV]]).astype(np.float64)
    v = np.concatenate([rows[:, H_QO + H_KV :], row[:, H_QO + H_KV :]]).astype(np.float64)
    want = _attend(q_rot[0].astype(np.float64), _rope(k, np.arange(6)), v)
    np.testing.assert_allclose(given[0], want, atol=2e-5)
    np.testing.assert_allclose(rotated_here[0], want, atol=2e-5)


def test_a_window_on_a_fork_keeps_the_inherited_tokens_as_sinks():
    """TVM's EnableSlidingWindowForSeq makes a fork's inherited prefix (its parent's blocks, which never
    slide) attention sinks; tvmkv slid them out like any other token, and once the child's window was
    full its outputs left TVM's (0.2-0.7 apart). Window 20, sink 0, fork of 16 tokens: the child keeps
    tokens 0..15 plus its newest ones (NumPy); a window not above the prefix and sink == window are refused."""
    rng = np.random.default_rng(8)
    cache = _cache(support_sliding_window=True)
    cache.add_sequence(0)
    rows = rng.standard_normal((40, H_QO + 2 * H_KV, D)).astype(np.float32)
    _step(cache, 0, rows[:20])
    cache.fork_sequence(0, 1, 16)
    assert cache.sequence_info(1).fork_prefix == 16
    with pytest.raises(ValueError, match="must exceed 16"):
        cache.enable_sliding_window_for_seq(1, 16, 0)
    with pytest.raises(ValueError, match="attn_sink_size=20 must be in"):
        cache.enable_sliding_window_for_seq(1, 20, 20)
    cache.enable_sliding_window_for_seq(1, 20, 0)
    own = []
    for t in range(12):
        o = _step(cache, 1, rows[20 + t : 21 + t])
        own.append(20 + t)
        kept = list(range(16)) + own[-(20 - 16 + 1) :] if 16 + len(own) > 20 else list(range(16)) + own
        _assert_attends(o[0], rows[kept])  # (the new token is the last kept)
    assert cache.sequence_length(1) == 20
    k, _ = cache.debug_get_kv(1)
    np.testing.assert_array_equal(k[0, :16], rows[:16, H_QO : H_QO + H_KV])
    cache.check_integrity()


def test_the_pages_a_fork_shares_are_sinks_of_either_windows():
    """TVM's fork moves the whole pages both sequences share into a block neither's window slides: the
    parent's window keeps them too, a partial page copied into the child is the child's own, and a
    pop_n into them forks again at the new length (hostile testing found all three differing from TVM's
    C++ cache by 0.4-0.7). Pages of 4 here."""
    rng = np.random.default_rng(9)
    cache = _cache(support_sliding_window=True)
    cache.add_sequence(0)
    rows = rng.standard_normal((60, H_QO + 2 * H_KV, D)).astype(np.float32)
    _step(cache, 0, rows[:22])
    cache.fork_sequence(0, 1, 22)  # 5 whole pages shared (20 tokens); the partial page is copied
    assert cache.sequence_info(1).fork_prefix == 20 and cache.sequence_info(0).fork_prefix == 20
    cache.enable_sliding_window_for_seq(0, 24, 0)
    assert cache.sequence_info(0).sink == 20
    for t in range(22, 30):  # the parent's window: tokens 0..19 stay, then its newest
        o = _step(cache, 0, rows[t : t + 1])
        held = list(range(t + 1)) if t + 1 <= 25 else list(range(20)) + list(range(t - 4, t + 1))
        _assert_attends(o[0], rows[held])
    cache.pop_n(1, 9)  # 13 tokens left: 3 whole pages still shared
    assert cache.sequence_info(1).fork_prefix == 12
    cache.enable_sliding_window_for_seq(1, 16, 2)
    assert cache.sequence_info(1).sink == 12
    cache.check_integrity()
