"""CUDA-graph replay (docs/cuda_graphs.md): ``graph_key``, stable decode splits, and replays of
recorded launches across decode steps whose page tables change, checked against the NumPy model.

On llvm a "graph" is the list of kernel calls (function and arguments) one step made, recorded
without running and re-run later: exactly what a CUDA graph keeps of a step. If the key's promise
holds (equal keys: a recording of one forward is correct in the other), replays match
:class:`tvmkv.reference.CacheModel`; on cuda the same scenario runs through
:class:`tvmkv.runtime.graphs.StepGraphs` and torch's CUDA graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import HAS_GPU

from tvmkv.errors import ForwardStateError
from tvmkv.reference.cache_model import CacheModel
from tvmkv.runtime.decode_split import plan_split
from tvmkv.testing import make_cache

LAYERS, HQ, HKV = 2, 8, 2


# ------------------------------------------------------------------------------------------------
# stable splits: pure arithmetic
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,tile,blocks", [(1, 64, 8), (2, 64, 8), (4, 32, 16), (1, 16, 2)])
def test_stable_split_covers_every_key_and_changes_only_at_powers_of_two(batch, tile, blocks):
    plans = {}
    for keys in range(1, 40000, 7):
        s = plan_split(batch, keys, blocks_per_seq=blocks, tile_keys=tile, num_sms=132, stable=True)
        if s.num_splits > 1:
            assert s.num_splits * s.kv_chunk >= keys, (keys, s)
            tiles = s.kv_chunk // tile
            assert s.kv_chunk % tile == 0 and tiles & (tiles - 1) == 0, s  # tile x a power of two
            assert s.num_splits & (s.num_splits - 1) == 0, s
            assert (s.num_splits * s.kv_chunk) // 2 < max(keys, s.num_splits * tile), (keys, s)  # < 2x the keys
        plans.setdefault(s, []).append(keys)
    # each plan holds on one interval of key counts, and there are about two per doubling
    for s, ks in plans.items():
        assert ks == list(range(ks[0], ks[-1] + 1, 7)), (s, ks[0], ks[-1])
    assert len(plans) <= 2 * (40000).bit_length() + 2, len(plans)
    exact = {plan_split(batch, k, blocks_per_seq=blocks, tile_keys=tile, num_sms=132) for k in range(1, 40000, 7)}
    assert len(exact) > len(plans)  # the default plan follows the keys closely


def test_stable_splits_option_is_validated():
    with pytest.raises(TypeError, match="stable_decode_splits"):
        make_cache("llvm", stable_decode_splits=1)


# ------------------------------------------------------------------------------------------------
# graph_key
# ------------------------------------------------------------------------------------------------


def _prefill(cache, model, rng, lengths: dict, chunk: int = 128):
    """Add and prefill each sequence (``lengths[sid]`` tokens, in forwards of ``chunk`` tokens)."""
    cfg = cache.config
    for sid, n in lengths.items():
        cache.add_sequence(sid)
        model.add(sid)
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            cache.begin_forward([sid], [m])
            model.begin([sid], [m])
            for layer in range(LAYERS):
                qkv = rng.standard_normal((m, HQ + 2 * HKV, cfg.head_dim)).astype(cfg.dtype)
                cache.attention_with_fused_qkv(layer, qkv)
                model.attention(layer, qkv)
            cache.end_forward()
            model.end()


def test_graph_key_follows_slot_batch_and_split():
    cache = make_cache("llvm", num_layers=LAYERS, decode_splits=4, stable_decode_splits=True)
    with pytest.raises(ForwardStateError, match="graph_key"):
        cache.graph_key()
    model = CacheModel(LAYERS, HQ, HKV, 64)
    _prefill(cache, model, np.random.default_rng(1), {0: 20, 1: 33, 2: 40})
    keys = []
    for _ in range(4):
        cache.begin_forward([0, 1, 2], [1, 1, 1])
        keys.append(cache.graph_key())
        hash(keys[-1])
        cache.end_forward()
    assert keys[0] == keys[2] and keys[1] == keys[3]  # one key per slot of the index buffer
    assert keys[0] != keys[1]
    cache.begin_forward([2, 0, 1], [1, 1, 1])  # a changed batch of the same size: the planner's path
    assert cache.graph_key() == keys[0]
    cache.end_forward()
    cache.begin_forward([0, 1], [1, 1])
    assert cache.graph_key() not in keys  # another batch size
    cache.end_forward()


# ------------------------------------------------------------------------------------------------
# replay of recorded launches (llvm) / of CUDA graphs (cuda) across changing page tables
# ------------------------------------------------------------------------------------------------


def _churn(cache, model, step: int, batch: list, next_id: list) -> None:
    """Between decode steps: sequences leave, arrive by fork (a shared partial page: copy-on-write) and
    roll back, keeping the batch size."""
    if step == 3:  # the middle sequence finishes; a fork of the first takes its row
        gone, child = batch[1], next_id[0]
        next_id[0] += 1
        cache.remove_sequence(gone)
        model.remove(gone)
        cache.fork_sequence(batch[0], child)
        model.fork(batch[0], child)
        batch[1] = child
    if step == 6:  # a rejected draft: roll the last sequence back two tokens
        cache.pop_n(batch[2], 2)
        model.pop(batch[2], 2)
    if step == 9:  # a new sequence replaces the first one (prefilled eagerly)
        gone, new = batch[0], next_id[0]
        next_id[0] += 1
        cache.remove_sequence(gone)
        model.remove(gone)
        batch[0] = new


def _run_scenario(cache, model, rng, replay_step, steps=14, lengths=(14, 31, 45)) -> int:
    """Decode ``steps`` steps of a 3-sequence batch with churn in between; ``replay_step(qkv_np)``
    runs the step (replay or capture) and returns the outputs per layer. Returns the number of steps
    whose outputs came from a replay."""
    batch, next_id = [0, 1, 2], [10]
    _prefill(cache, model, rng, dict(enumerate(lengths)))
    replays = 0
    for step in range(steps):
        _churn(cache, model, step, batch, next_id)
        for sid in batch:
            if sid not in cache.sequence_ids():
                _prefill(cache, model, rng, {sid: 5})
        cache.begin_forward(batch, [1] * len(batch))
        model.begin(batch, [1] * len(batch))
        qkv = rng.standard_normal((LAYERS, len(batch), HQ + 2 * HKV, cache.config.head_dim)).astype(np.float32)
        outs, replayed = replay_step(qkv)
        replays += replayed
        for layer in range(LAYERS):
            want, _ = model.attention(layer, qkv[layer].astype(cache.config.dtype))
            np.testing.assert_allclose(outs[layer], want, rtol=2e-2, atol=2e-2, err_msg=f"step {step} layer {layer}")
        cache.end_forward()
        model.end()
        cache.check_integrity()
    return replays


def test_recorded_launches_replay_across_changing_page_tables(tape):
    import tvm

    cache = make_cache("llvm", num_layers=LAYERS, decode_splits=4, stable_decode_splits=True)
    model = CacheModel(LAYERS, HQ, HKV, 64)
    qkv_t = [tvm.runtime.empty((3, HQ + 2 * HKV, 64), "float32", cache.device) for _ in range(LAYERS)]
    out_t = [tvm.runtime.empty((3, HQ, 64), "float32", cache.device) for _ in range(LAYERS)]
    graphs: dict = {}

    def step():
        for layer in range(LAYERS):
            cache.attention_with_fused_qkv(layer, qkv_t[layer], out=out_t[layer])

    def replay_step(qkv):
        for layer in range(LAYERS):
            qkv_t[layer].copyfrom(qkv[layer])
        key = cache.graph_key()
        replayed = key in graphs
        if replayed:
            for f, args in graphs[key]:
                f(*args)
        else:
            step()
            tape.calls = []
            step()  # recorded, not run
            graphs[key], tape.calls = tape.calls, None
        return [o.numpy() for o in out_t], replayed

    replays = _run_scenario(cache, model, np.random.default_rng(2), replay_step)
    assert replays >= 8, replays  # most steps replay a recording made in an earlier forward
    assert len(graphs) <= 6, len(graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
def test_cuda_graphs_replay_across_changing_page_tables():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from tvmkv.runtime.graphs import StepGraphs

    D = 128  # the fast cuda decode layout (split decode on the GPU)
    cache = make_cache(
        "cuda", num_layers=LAYERS, head_dim=D, dtype="float16", max_total_seq_len=4096, stable_decode_splits=True
    )
    model = CacheModel(LAYERS, HQ, HKV, D, dtype="float16")
    qkv_t = torch.empty(LAYERS, 3, HQ + 2 * HKV, D, device="cuda", dtype=torch.float16)
    out_t = torch.empty(LAYERS, 3, HQ, D, device="cuda", dtype=torch.float16)

    def step():
        for layer in range(LAYERS):
            cache.attention_with_fused_qkv(layer, qkv_t[layer], out=out_t[layer])

    graphs = StepGraphs(cache, step)

    def replay_step(qkv):
        qkv_t.copy_(torch.from_numpy(qkv.astype(np.float16)))
        before = graphs.replays
        graphs()
        torch.cuda.synchronize()
        return [o.float().cpu().numpy() for o in out_t], graphs.replays > before

    # long enough that the batch of 3 splits on the GPU (the split is part of what a replay reuses)
    replays = _run_scenario(cache, model, np.random.default_rng(3), replay_step, steps=20, lengths=(900, 1100, 1300))
    assert replays >= 12, (replays, graphs.captures)


def test_attended_layers_and_mark_attended_validate_first():
    cache = make_cache("llvm", num_layers=LAYERS)
    with pytest.raises(ForwardStateError, match="attended_layers"):
        cache.attended_layers()
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    assert cache.attended_layers() == ()
    cache.attention_with_fused_qkv(1, np.zeros((3, HQ + 2 * HKV, 64), np.float32))
    assert cache.attended_layers() == (1,)
    with pytest.raises(ValueError, match="out of range"):
        cache.mark_attended([0, LAYERS])  # one bad id: nothing is marked
    assert cache.attended_layers() == (1,)
    cache.mark_attended([0])
    assert cache.attended_layers() == (0, 1)
    cache.end_forward()
    with pytest.raises(ForwardStateError, match="mark_attended"):
        cache.mark_attended([0])


def test_attended_layers_of_a_pipeline_stage_are_the_model_ids():
    """A stage holding the model's layers 2 and 3: attended_layers names them as the attention calls and
    mark_attended do (a StepGraphs replay hands the one to the other)."""
    cache = make_cache("llvm", num_layers=2, first_layer=2)
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    cache.attention_with_fused_qkv(3, np.zeros((3, HQ + 2 * HKV, 64), np.float32))
    assert cache.attended_layers() == (3,)
    cache.mark_attended(cache.attended_layers() + (2,))
    assert cache.attended_layers() == (2, 3)
    with pytest.raises(ValueError, match=r"layer_id 0 is out of range \[2, 4\) \(this cache is the pipeline stage"):
        cache.mark_attended([0])
    cache.end_forward()
