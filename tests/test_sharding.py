"""Tensor parallelism over heads (issue 18, the part that needs no GPU): ``ShardLayout`` against an
independent head-by-head construction, and ``ShardedKVCache`` (the shards in one process) against the
unsharded NumPy model and the unsharded cache, with the output projection's all-reduce done in NumPy."""

from __future__ import annotations

import numpy as np
import pytest

import tvmkv
from tvmkv.reference.cache_model import CacheModel
from tvmkv.replay import NEEDS_SLIDING, SCENARIOS, Replayer
from tvmkv.testing import cache_kwargs, make_cache, make_sharded_cache

# (H_qo, H_kv, shards): split KV heads, replicated KV heads (fewer than shards), MQA, one shard
LAYOUTS = [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8), (32, 8, 4), (32, 8, 16), (16, 1, 4), (12, 4, 2), (12, 2, 6)]


@pytest.mark.parametrize("hq,hkv,shards", LAYOUTS)
def test_layout_gives_each_query_head_its_kv_head_once(hq, hkv, shards):
    lay = tvmkv.ShardLayout(hq, hkv, shards)
    group = hq // hkv
    owner = {}
    for s in range(shards):
        q, kv = list(lay.qo_heads(s)), list(lay.kv_heads(s))
        assert len(q) == hq // shards and len(kv) == lay.kv_per_shard
        for h in q:
            assert h not in owner, f"query head {h} on two shards"
            owner[h] = s
            # the kv head query head h reads, at the same position within the shard as in GQA
            assert h // group in kv
            assert kv.index(h // group) == (h - q[0]) // (len(q) // len(kv))
        rows = lay.qkv_rows(s)
        assert rows.tolist() == q + [hq + k for k in kv] + [hq + hkv + k for k in kv]
    assert sorted(owner) == list(range(hq))
    copies = [sum(k in lay.kv_heads(s) for s in range(shards)) for k in range(hkv)]
    assert copies == [max(1, shards // hkv)] * hkv
    assert lay.kv_memory_factor == max(1, shards // hkv)
    for k in range(hkv):
        assert k in lay.kv_heads(lay.shard_of_kv_head(k))


@pytest.mark.parametrize(
    "hq,hkv,shards,words",
    [
        (8, 2, 3, "does not divide num_qo_heads=8"),
        (24, 6, 4, "does not divide num_kv_heads=6"),
        (24, 3, 6, None),  # 2 replicas: fine
        (16, 4, 8, None),  # 2 replicas: fine
        (16, 2, 0, "num_shards=0 must be a positive int"),
        (12, 5, 2, "multiple of num_kv_heads=5"),
    ],
)
def test_layout_refuses_what_cannot_shard(hq, hkv, shards, words):
    if words is None:
        assert tvmkv.ShardLayout(hq, hkv, shards).replicas == 2
        return
    with pytest.raises(ValueError, match=words):
        tvmkv.ShardLayout(hq, hkv, shards)


def test_layout_refuses_replication_that_is_not_whole():
    with pytest.raises(ValueError, match="num_shards=6 is not a multiple of num_kv_heads=4"):
        tvmkv.ShardLayout(12, 4, 6)
    lay = tvmkv.ShardLayout(8, 2, 4)
    with pytest.raises(ValueError, match=r"shard=4 must be an int in \[0, 4\)"):
        lay.qo_heads(4)
    with pytest.raises(ValueError, match="must end in num_kv_heads=2"):
        lay.shard_kv_scales(np.ones(3), 0)


@pytest.mark.parametrize("shards", [2, 4, 8])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_replay_on_shards(scenario, shards):
    """Every replay scenario on the shards in lockstep, against the unsharded NumPy model (outputs of
    every layer, stored K/V of every head), the shards' page tables compared after every operation."""
    cache = make_sharded_cache(shards, rope_mode="normal", sliding=scenario in NEEDS_SLIDING)
    assert [s.config.num_kv_heads for s in cache.shards] == [max(1, 2 // shards)] * shards
    r = Replayer(cache, seed=shards)
    r.run(SCENARIOS[scenario])
    r.check_drained()


def _o_proj(o, w):
    # [n, H_qo, D] x [H_qo * D, hidden] -> [n, hidden]
    return o.reshape(o.shape[0], -1).astype(np.float64) @ w


@pytest.mark.parametrize("shards,rope_mode", [(2, "normal"), (4, "inline"), (8, "none")])
def test_shards_with_reduced_projection_equal_the_unsharded_cache(shards, rope_mode):
    """A random stream of forwards, forks, pops and removals on the unsharded cache and on the shards with
    the same qkv: each shard's output through its rows of the output projection, summed in NumPy (the
    all-reduce of a tensor-parallel model), equals the unsharded cache's, and both the NumPy model's."""
    rng = np.random.default_rng(shards)
    kw = dict(rope_mode=rope_mode, num_pages=40)
    full, sharded = make_cache(**kw), make_sharded_cache(shards, **kw)
    cfg = full.config
    lay = sharded.layout
    model = CacheModel(cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, rope_mode=rope_mode)
    hidden = 24
    w = rng.standard_normal((cfg.num_qo_heads * cfg.head_dim, hidden))
    D = cfg.head_dim
    live, next_id = [], 0
    for _ in range(40):
        op = rng.choice(["add", "fwd", "fwd", "fork", "pop", "remove"])
        if op == "add" or not live:
            for c in (full, sharded):
                c.add_sequence(next_id)
            model.add(next_id)
            live.append(next_id)
            next_id += 1
        elif op == "fork" and len(live) < 6:
            parent = int(rng.choice(live))
            pos = int(rng.integers(0, full.sequence_length(parent) + 1))
            for c in (full, sharded):
                c.fork_sequence(parent, next_id, pos)
            model.fork(parent, next_id, pos)
            live.append(next_id)
            next_id += 1
        elif op == "pop" and any(full.sequence_length(s) for s in live):
            sid = int(rng.choice([s for s in live if full.sequence_length(s)]))
            n = int(rng.integers(1, full.sequence_length(sid) + 1))
            for c in (full, sharded):
                c.pop_n(sid, n)
            model.pop(sid, n)
        elif op == "remove" and len(live) > 1:
            sid = live.pop(int(rng.integers(len(live))))
            for c in (full, sharded):
                c.remove_sequence(sid)
            model.remove(sid)
        else:
            ids = [int(x) for x in rng.permutation(live)[: int(rng.integers(1, len(live) + 1))]]
            lens = [int(rng.integers(1, 9)) if rng.random() < 0.5 else 1 for _ in ids]
            if full.num_pages_needed(ids[0], lens[0]) * len(ids) > full.num_available_pages():
                continue
            for c in (full, sharded):
                c.begin_forward(ids, lens)
            model.begin(ids, lens)
            for layer in range(cfg.num_layers):
                qkv = rng.uniform(-1, 1, (sum(lens), cfg.qkv_heads, D)).astype(np.float32)
                o_full = full.attention_with_fused_qkv(layer, qkv)
                parts = [
                    shard.attention_with_fused_qkv(layer, np.ascontiguousarray(qkv[:, lay.qkv_rows(s)]))
                    for s, shard in enumerate(sharded.shards)
                ]
                rows = [slice(s * lay.qo_per_shard * D, (s + 1) * lay.qo_per_shard * D) for s in range(shards)]
                reduced = sum(_o_proj(o, w[r]) for o, r in zip(parts, rows))
                ref, _ = model.attention(layer, qkv)
                np.testing.assert_allclose(reduced, _o_proj(o_full, w), atol=1e-4, rtol=1e-4)
                np.testing.assert_allclose(reduced, _o_proj(ref, w), atol=1e-3, rtol=1e-3)
            for c in (full, sharded):
                c.end_forward()
            model.end()
        sharded.check_integrity()
        assert sharded.shards[0].table_digest() == full.table_digest()
    for sid in live:
        k_full, v_full = full.debug_get_kv(sid)
        k_sh, v_sh = sharded.debug_get_kv(sid)
        np.testing.assert_array_equal(k_sh, k_full)
        np.testing.assert_array_equal(v_sh, v_full)
        for s in range(shards):  # replicas of a KV head store the same values
            k_s, _ = sharded.shards[s].debug_get_kv(sid)
            np.testing.assert_array_equal(k_s, k_full[:, :, list(lay.kv_heads(s))])


def test_a_shard_driven_alone_is_caught():
    cache = make_sharded_cache(2)
    for sid in (0, 1):
        cache.add_sequence(sid)
    cache.begin_forward([0, 1], [20, 3])
    for layer in range(cache.config.num_layers):
        cache.attention_with_fused_qkv(layer, np.zeros((23, cache.config.qkv_heads, 64), np.float32))
    cache.end_forward()
    cache.check_integrity()
    cache.shards[1].pop_n(1, 2)
    with pytest.raises(tvmkv.ShardDivergenceError, match=r"shard 1 diverged .*sequence 1 differs") as err:
        cache.check_integrity()
    assert err.value.shard == 1
    cache.shards[1].remove_sequence(1)
    with pytest.raises(tvmkv.ShardDivergenceError, match=r"\[1\] held by one shard only"):
        cache.check_integrity()
    # the same sequences, the pages handed out in another order: only the free lists differ
    other = make_sharded_cache(2)
    a, b = other.shards
    for c in (a, b):
        c.add_sequence(0)
        c.add_sequence(1)
    for c, order in ((a, [0, 1]), (b, [1, 0])):
        c.begin_forward(order, [16, 16])
        c.end_forward()
    with pytest.raises(tvmkv.ShardDivergenceError, match="sequence 0 differs"):
        other.check_integrity()


def test_a_refused_call_changes_no_shard():
    cache = make_sharded_cache(4, num_pages=6, max_total_seq_len=64)
    cache.add_sequence(0)
    before = [s.table_digest() for s in cache.shards]
    with pytest.raises(KeyError, match="sequence 7"):
        cache.begin_forward([0, 7], [1, 1])
    with pytest.raises(tvmkv.OutOfPagesError):
        cache.begin_forward([0], [7 * 16])
    with pytest.raises(ValueError, match="fork_pos"):
        cache.fork_sequence(0, 1, 5)
    with pytest.raises(ValueError, match=r"qkv of shape \(3, 8, 64\) must be \[num_tokens, 12, 64\]"):
        cache.begin_forward([0], [3])
        try:
            cache.attention_with_fused_qkv(0, np.zeros((3, 8, 64), np.float32))
        finally:
            cache.end_forward()
    cache.pop_n(0, 3)
    assert not cache.forward_open and not any(s.forward_open for s in cache.shards)
    assert [s.table_digest() for s in cache.shards] == before
    cache.check_integrity()
    # one-shot iterators reach every shard whole
    cache.begin_forward(iter([0]), (n for n in [5]))
    out = cache.attention_with_fused_qkv(0, np.ones((5, 12, 64), np.float32))
    assert out.shape == (5, 8, 64)
    cache.attention_with_fused_qkv(1, np.ones((5, 12, 64), np.float32))
    cache.end_forward()
    assert [s.sequence_length(0) for s in cache.shards] == [5] * 4
    cache.check_integrity()


def test_swap_and_tvm_and_torch_arrays_on_shards():
    torch = pytest.importorskip("torch")
    import tvm

    cache = make_sharded_cache(2, rope_mode="normal")
    model_cfg = cache.config
    model = CacheModel(model_cfg.num_layers, 8, 2, 64, rope_mode="normal")
    rng = np.random.default_rng(3)
    for sid in (0, 1):
        cache.add_sequence(sid)
        model.add(sid)
    for step, kind in enumerate(["numpy", "torch", "tvm", "numpy"]):
        if step == 2:
            cache.swap_out([1])
            assert all(s.is_swapped(1) for s in cache.shards)
            cache.check_integrity()
            cache.swap_in([1])
        lens = [9, 1] if step == 0 else [1, 2]
        cache.begin_forward([0, 1], lens)
        model.begin([0, 1], lens)
        for layer in range(model_cfg.num_layers):
            qkv = rng.uniform(-1, 1, (sum(lens), 12, 64)).astype(np.float32)
            if kind == "torch":
                out = torch.zeros((sum(lens), 8, 64))
                got = cache.attention_with_fused_qkv(layer, torch.from_numpy(qkv), out=out)
                assert got is out
                o = out.numpy()
            elif kind == "tvm":
                o = cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv)).numpy()
            else:
                o = cache.attention_with_fused_qkv(layer, qkv)
            ref, _ = model.attention(layer, qkv)
            np.testing.assert_allclose(o, ref, atol=1e-4, rtol=1e-4)
        cache.end_forward()
        model.end()
        cache.check_integrity()
    for sid in (0, 1):
        _, k_ref, v_ref = model.kept_kv(sid)
        k, v = cache.debug_get_kv(sid)
        np.testing.assert_allclose(k, k_ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(v, v_ref, atol=1e-5, rtol=1e-5)


def test_fp8_scales_are_cut_per_shard():
    scales = np.array([[0.5, 2.0], [1.5, 0.25]], np.float32)  # [K | V, H_kv]
    kw = cache_kwargs(dtype="float16", kv_dtype="float8_e4m3fn")
    cache = tvmkv.ShardedKVCache(**kw, num_shards=4, kv_scales=scales)
    for s, shard in enumerate(cache.shards):
        head = cache.layout.kv_heads(s).start
        np.testing.assert_array_equal(shard.kv_scales(1), scales[:, [head]])
    np.testing.assert_array_equal(cache.kv_scales(0), scales)
    cache.set_kv_scales(1, [3.0, 4.0], 0.5)
    np.testing.assert_array_equal(cache.kv_scales(1), [[3.0, 4.0], [0.5, 0.5]])
    np.testing.assert_array_equal(cache.shards[3].kv_scales(1), [[4.0], [0.5]])
    with pytest.raises(ValueError, match=r"k_scale of shape \(3,\) must be one float or \[2\]"):
        cache.set_kv_scales(0, [1.0, 2.0, 3.0], 1.0)
    # a bad scale of a later shard's head: refused before shard 0 takes its part, the head named globally
    with pytest.raises(ValueError, match=r"k_scale\[1\]=-1.0 must be a positive finite float"):
        cache.set_kv_scales(0, [2.0, -1.0], 1.0)
    np.testing.assert_array_equal(cache.kv_scales(0), scales)
    cache.check_integrity()


def test_out_must_match_qkv_and_stay_apart_from_it():
    cache = make_sharded_cache(2)
    cache.add_sequence(0)
    cache.begin_forward([0], [4])
    qkv = np.zeros((4, 12, 64), np.float32)
    with pytest.raises(ValueError, match=r"must be a numpy array of shape \[4, 8, 64\] and dtype float32"):
        cache.attention_with_fused_qkv(0, qkv, out=np.zeros((4, 8, 64), np.float64))
    with pytest.raises(ValueError, match="out overlaps qkv"):
        cache.attention_with_fused_qkv(0, qkv, out=qkv[:, :8])
    out = np.zeros((4, 8, 64), np.float32)
    assert cache.attention_with_fused_qkv(0, qkv, out=out) is out
    cache.attention_with_fused_qkv(1, qkv)
    cache.end_forward()
    cache.check_integrity()


def test_a_refused_output_leaves_the_shards_alike():
    """out problems are found before any shard appends (a read-only NumPy out, a tvm out of the wrong
    shape), so every shard's K/V stays the unsharded cache's."""
    import tvm

    cache, full = make_sharded_cache(2), make_cache()
    for c in (cache, full):
        c.add_sequence(0)
        c.begin_forward([0], [3])
    qkv = np.random.default_rng(0).uniform(-1, 1, (3, 12, 64)).astype(np.float32)
    ro = np.zeros((3, 8, 64), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        cache.attention_with_fused_qkv(0, qkv, out=ro)
    with pytest.raises(ValueError, match="must be a tvm tensor of shape"):
        cache.attention_with_fused_qkv(
            0, tvm.runtime.tensor(qkv), out=tvm.runtime.tensor(np.zeros((3, 4, 64), np.float32))
        )
    for layer in range(2):
        np.testing.assert_array_equal(
            cache.attention_with_fused_qkv(layer, qkv), full.attention_with_fused_qkv(layer, qkv)
        )
    for c in (cache, full):
        c.end_forward()
    np.testing.assert_array_equal(cache.debug_get_kv(0)[0], full.debug_get_kv(0)[0])
    cache.check_integrity()


def test_memory_fraction_sizes_every_shard_alike():
    cache = make_sharded_cache(2, memory_fraction=0.002, max_total_seq_len=64)
    pages = {s.config.total_pages for s in cache.shards}
    assert len(pages) == 1 and pages.pop() >= 4
    cache.check_integrity()


def test_scheduler_runs_on_shards():
    """The preempting scheduler drives a ShardedKVCache as it drives one cache: the same plans as over
    an unsharded cache, step after step, with swaps when pages run out."""
    from tvmkv import Scheduler

    kw = dict(num_pages=6, max_total_seq_len=96)
    plans = []
    for cache in (make_sharded_cache(2, **kw), make_cache(**kw)):
        sched, steps = Scheduler(cache, token_budget=32), []
        for sid, n in ((0, 40), (1, 30), (2, 20)):
            sched.add_request(sid, n)
        while sched.has_unfinished() and len(steps) < 40:
            plan = sched.schedule()
            cache.begin_forward(plan.seq_ids, plan.lengths)
            cache.end_forward()
            done = [p.seq_id for p in plan.parts if p.samples and cache.sequence_length(p.seq_id) >= 72]
            sched.step_done(plan, finished=done)
            steps.append((tuple(plan.seq_ids), tuple(plan.lengths), tuple(sorted(cache.swapped_sequence_ids()))))
            cache.check_integrity()
        plans.append((steps, sched.stats.preempted_swap, sched.stats.swapped_in))
    assert plans[0] == plans[1] and plans[0][1] > 0 and plans[0][2] > 0  # identical, with swaps out and in


class _Stage:
    """A pipeline stage's cache as the Replayer drives a whole model: the Replayer's layers ``0 ..`` are
    the stage's ``first_layer ..`` (the model's ids, which the stage's calls take)."""

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def attention_with_fused_qkv(self, layer, qkv, *args, **kwargs):
        return self._cache.attention_with_fused_qkv(self._cache.config.first_layer + layer, qkv, *args, **kwargs)


@pytest.mark.parametrize("scenario", ["tvm_operation_seq", "fork"])
def test_pipeline_stage_holds_its_layers_under_the_model_ids(scenario):
    """A cache of layers [2, 4) of a model (TVM's layer_indptr stage): attention named by the model's layer
    ids, every output and stored K/V against the NumPy model of those layers."""
    cache = make_cache(first_layer=2)
    assert cache.config.first_layer == 2 and cache.config.num_layers == 2
    Replayer(_Stage(cache)).run(SCENARIOS[scenario])
    cache.add_sequence(7)
    cache.begin_forward([7], [3])
    qkv = np.zeros((3, cache.config.qkv_heads, cache.config.head_dim), np.float32)
    for layer in (0, 1, 4, -1):  # not this stage's: named with the range and the stage
        with pytest.raises(ValueError, match=r"layer_id .* out of range \[2, 4\) \(this cache is the pipeline stage"):
            cache.attention_with_fused_qkv(layer, qkv)
    cache.attention_with_fused_qkv(2, qkv)
    cache.end_forward()
    from tvmkv.runtime.checkpoint import layout_descriptor

    assert "layer_begin=2;layer_end=4;" in layout_descriptor(cache)  # TVM's checkpoint fields of a stage
    with pytest.raises(ValueError, match="first_layer=-1 must be an int >= 0"):
        make_cache(first_layer=-1)


def test_sharded_cache_digest_and_subsystems_that_take_one_cache():
    """``table_digest`` is the shards' common digest, and the subsystems that take one
    PagedAttentionKVCache (checkpoints, transfers, interop, the prefix cache) say so when given the
    sharded cache (they failed with "'ShardedKVCache' object has no attribute 'pool'")."""
    from tvmkv.runtime import checkpoint, transfer

    sharded = make_sharded_cache(2)
    sharded.add_sequence(0)
    assert sharded.table_digest() == sharded.shards[0].table_digest() == sharded.shards[1].table_digest()
    single = make_cache()
    for call in (
        lambda: checkpoint.export_checkpoint(sharded, 0),
        lambda: transfer.move_sequence(sharded, 0, single),
        lambda: tvmkv.RadixPrefixCache(sharded),
    ):
        with pytest.raises(AttributeError, match=r"pass each shard \(sharded.shards\[i\]"):
            call()
    assert single.sequence_ids() == [] and sharded.sequence_ids() == [0]
    checkpoint.export_checkpoint(sharded.shards[1], 0)  # what the message asks for works


def _causal_gqa(q, k, v):
    """Causal softmax attention in float64: q [n, H_qo, D] over k, v [n, H_kv, D] (the tokens of one
    sequence, query i sees keys 0..i)."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros((n, hq, d))
    for i in range(n):
        for h in range(hq):
            s = k[: i + 1, h // group].astype(np.float64) @ q[i, h].astype(np.float64) * d**-0.5
            p = np.exp(s - s.max())
            out[i, h] = p @ v[: i + 1, h // group] / p.sum()
    return out


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_sharded_rows_to_spare_and_shared_kv(kind):
    """Across 2 shards, as on one cache: qkv and out with rows to spare (TVM's rule: the first rows are
    read and written, the rest of out left as it was), and attention_with_shared_kv over another
    layer's pages; against NumPy attention. (The spare rows raised after every shard had appended.)"""
    HQ, HK, D = 4, 2, 16
    rng = np.random.default_rng(3)
    sh = make_sharded_cache(2, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=4)
    sh.add_sequence(0)
    sh.begin_forward([0], [5])
    qkv = rng.standard_normal((8, HQ + 2 * HK, D)).astype(np.float32)
    q2 = rng.standard_normal((5, HQ, D)).astype(np.float32)
    out = np.full((9, HQ, D), 7, np.float32)
    k, v = qkv[:5, HQ : HQ + HK], qkv[:5, HQ + HK :]
    if kind == "torch":
        torch = pytest.importorskip("torch")
        qkv, out, q2, k, v = (torch.from_numpy(np.ascontiguousarray(x)) for x in (qkv, out, q2, k, v))
    assert sh.attention_with_fused_qkv(0, qkv, out=out) is out
    o2 = sh.attention_with_shared_kv(0, q2, k, v)
    sh.end_forward()
    out, o2, qkv, q2 = (np.asarray(x) for x in (out, o2, qkv, q2))
    want = _causal_gqa(qkv[:5, :HQ], qkv[:5, HQ : HQ + HK], qkv[:5, HQ + HK :])
    np.testing.assert_allclose(out[:5], want, atol=1e-5, rtol=1e-5)
    assert (out[5:] == 7).all()
    np.testing.assert_allclose(o2, _causal_gqa(q2, qkv[:5, HQ : HQ + HK], qkv[:5, HQ + HK :]), atol=1e-5, rtol=1e-5)
    sh.check_integrity()
    with pytest.raises(AttributeError, match="'self_attention' .* not offered across shards"):
        sh.self_attention  # noqa: B018
