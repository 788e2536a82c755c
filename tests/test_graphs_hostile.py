"""Hostile tests of CUDA-graph replay (docs/cuda_graphs.md): ``graph_key``'s promise that a step's
recorded launches, captured in one forward, compute the right thing when replayed in any later forward
with an equal key, whatever happened to the sequences in between.

As in tests/test_graphs.py, a "graph" on llvm is the list of kernel calls (function and arguments) one
step makes, recorded without running and re-run later. Every replay is checked against the NumPy
:class:`tvmkv.reference.CacheModel` (or a NumPy attention for per-layer windows), and against the
documented rule that equal keys mean equal launches: the same kernels, the same buffers (device
address and shape) and the same scalars as the forward would launch now.
"""

from __future__ import annotations

import numpy as np
import pytest

from tvmkv.errors import ForwardStateError
from tvmkv.reference.cache_model import CacheModel
from tvmkv.testing import make_cache

LAYERS, HQ, HKV, D = 2, 8, 2, 64
RTOL = ATOL = 2e-2


def _static_layers(cache, rows: int):
    """Per-layer static qkv / out tensors of ``rows`` tokens (a CUDA graph's fixed inputs and outputs),
    and the step that runs every layer's attention on them."""
    import tvm

    qkv_t = [tvm.runtime.empty((rows, HQ + 2 * HKV, D), "float32", cache.device) for _ in range(LAYERS)]
    out_t = [tvm.runtime.empty((rows, HQ, D), "float32", cache.device) for _ in range(LAYERS)]

    def step():
        for layer in range(LAYERS):
            cache.attention_with_fused_qkv(layer, qkv_t[layer], out=out_t[layer])

    return qkv_t, out_t, step


def _arg(a):
    """What a CUDA graph keeps of one launch argument: a buffer's address and shape, a scalar's value."""
    if hasattr(a, "data_ptr") and hasattr(a, "shape"):
        return ("buffer", a.data_ptr(), tuple(a.shape), str(a.dtype))
    return ("scalar", a)


def _launches(calls: list) -> list:
    return [(id(f), tuple(map(_arg, args))) for f, args in calls]


class _Graphs:
    """Emulated CUDA graphs of ``step`` keyed by ``cache.graph_key()`` (the tape must be installed)."""

    def __init__(self, cache, tape, step):
        self.cache, self.tape, self.step = cache, tape, step
        self.recorded: dict = {}
        self.replays = self.captures = 0
        self.mismatches: list = []  # keys whose recording differs from the launches of a later forward
        self.compare = True  # record the forward's own launches to compare (runs step's Python, no kernel)

    def _record(self) -> list:
        self.tape.calls = []
        try:
            self.step()
            return self.tape.calls
        finally:
            self.tape.calls = None

    def __call__(self) -> bool:
        # StepGraphs' protocol: the key before the step; after an eager run the key again (ValueError for
        # a step a replay would get wrong) and the layers it appended; after a replay, mark_attended
        key = self.cache.graph_key()
        entry = self.recorded.get(key)
        if entry is None:
            self.step()
            self.cache.graph_key()
            self.recorded[key] = (self._record(), self.cache.attended_layers())
            self.captures += 1
            return False
        rec, layers = entry
        if self.compare and _launches(self._record()) != _launches(rec):
            self.mismatches.append(key)
        for f, args in rec:
            f(*args)
        self.cache.mark_attended(layers)
        self.replays += 1
        return True


class _Driver:
    """A cache, its NumPy model, and decode steps of ``batch`` rows run through emulated graphs."""

    def __init__(self, tape, batch: int, seed: int = 0, **options):
        self.cache = make_cache("llvm", num_layers=LAYERS, **options)
        self.model = CacheModel.of(self.cache.config)
        self.rng = np.random.default_rng(seed)
        self.B = batch
        self.unchecked: set = set()  # layers whose eager outputs the model cannot check
        self.qkv_t, self.out_t, step = _static_layers(self.cache, batch)
        self.graphs = _Graphs(self.cache, tape, step)

    # sequence operations on both the cache and the model
    def add(self, sid, n: int, chunk: int = 64):
        self.cache.add_sequence(sid)
        self.model.add(sid)
        for start in range(0, n, chunk):
            self.eager([sid], [min(chunk, n - start)])

    def eager(self, seq_ids, lengths, parents=None):
        """One forward run without graphs (NumPy qkv), checked against the model."""
        flat = None if parents is None else [p for ps in parents for p in ps]
        self.cache.begin_forward(seq_ids, lengths, flat)
        self.model.begin(seq_ids, lengths, parents)
        for layer in range(LAYERS):
            qkv = self.rng.standard_normal((sum(lengths), HQ + 2 * HKV, D)).astype(np.float32)
            got = self.cache.attention_with_fused_qkv(layer, qkv)
            want, _ = self.model.attention(layer, qkv)
            if layer not in self.unchecked:  # (the model has no per-layer windows)
                np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"eager forward layer {layer}")
        self.cache.end_forward()
        self.model.end()

    def remove(self, sid):
        self.cache.remove_sequence(sid)
        self.model.remove(sid)

    def fork(self, parent, child):
        self.cache.fork_sequence(parent, child)
        self.model.fork(parent, child)

    def pop(self, sid, n):
        self.cache.pop_n(sid, n)
        self.model.pop(sid, n)

    def window(self, sid, size, sink=0):
        self.cache.enable_sliding_window_for_seq(sid, size, sink)
        self.model.enable_window(sid, size, sink)

    def decode(self, seq_ids, reference=None) -> bool:
        """One decode step of ``seq_ids`` through the graphs; outputs checked against the model (or
        ``reference(layer, qkv)`` after the model stored the layer's K/V). Returns whether it replayed."""
        assert len(seq_ids) == self.B
        self.cache.begin_forward(seq_ids, [1] * self.B)
        self.model.begin(seq_ids, [1] * self.B)
        qkv = self.rng.standard_normal((LAYERS, self.B, HQ + 2 * HKV, D)).astype(np.float32)
        for layer in range(LAYERS):
            self.qkv_t[layer].copyfrom(qkv[layer])
        replayed = self.graphs()
        for layer in range(LAYERS):
            want, _ = self.model.attention(layer, qkv[layer])
            if reference is not None:
                want = reference(layer, qkv[layer])
            np.testing.assert_allclose(
                self.out_t[layer].numpy(), want, rtol=RTOL, atol=ATOL, err_msg=f"layer {layer}, replayed={replayed}"
            )
        self.cache.end_forward()
        self.model.end()
        self.cache.check_integrity()
        return replayed

    def done(self, min_replays: int):
        assert not self.graphs.mismatches, "equal graph_key but different launches"
        assert self.graphs.replays >= min_replays, (self.graphs.replays, self.graphs.captures)


# ------------------------------------------------------------------------------------------------
# graph_key's error handling
# ------------------------------------------------------------------------------------------------


def test_graph_key_outside_and_after_a_forward():
    cache = make_cache("llvm", num_layers=LAYERS)
    with pytest.raises(ForwardStateError, match="graph_key"):
        cache.graph_key()
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    key = cache.graph_key()
    hash(key)
    assert cache.graph_key() == key  # a pure query: asking twice changes nothing
    cache.attention_with_fused_qkv(0, np.zeros((3, HQ + 2 * HKV, D), np.float32))
    cache.attention_with_fused_qkv(1, np.zeros((3, HQ + 2 * HKV, D), np.float32))
    cache.end_forward()
    with pytest.raises(ForwardStateError, match="graph_key"):
        cache.graph_key()
    cache.begin_forward([0], [1])
    cache.clear()  # closes the forward (documented)
    with pytest.raises(ForwardStateError, match="graph_key"):
        cache.graph_key()
    cache.check_integrity()


# ------------------------------------------------------------------------------------------------
# StepGraphs: argument validation (CPU: torch has no CUDA here) and its keying logic
# ------------------------------------------------------------------------------------------------


class _FakeDevice:
    def __init__(self, kind):
        self.kind = kind

    def dlpack_device_type(self):
        return self.kind


class _FakeCache:
    def __init__(self, kind=2):
        self.device = _FakeDevice(kind)
        self.key = None

    def graph_key(self):
        if self.key is None:
            raise ForwardStateError("graph_key called outside begin_forward/end_forward")
        return self.key

    def attended_layers(self):
        return (0,)

    def mark_attended(self, layers):
        self.marked = tuple(layers)


def test_step_graphs_validates_its_arguments():
    pytest.importorskip("torch")
    from tvmkv.runtime.graphs import StepGraphs

    with pytest.raises(ValueError, match="cuda cache"):
        StepGraphs(make_cache("llvm", num_layers=LAYERS), lambda: None)
    with pytest.raises(ValueError, match="cuda cache"):
        StepGraphs(object(), lambda: None)
    with pytest.raises(TypeError, match="step must be callable"):
        StepGraphs(_FakeCache(), 3, pool=object())
    for bad in (0, -1, True, 1.5, "2", None):
        with pytest.raises(ValueError, match="max_graphs"):
            StepGraphs(_FakeCache(), lambda: None, max_graphs=bad, pool=object())


def test_step_graphs_captures_once_per_key_replays_and_evicts(monkeypatch):
    pytest.importorskip("torch")
    from tvmkv.runtime.graphs import StepGraphs

    ran: list = []

    class _Graph:
        def __init__(self, key):
            self.key = key

        def replay(self):
            ran.append(("replay", self.key))

    cache = _FakeCache()
    graphs = StepGraphs(cache, lambda: ran.append(("eager", cache.key)), max_graphs=2, pool=object())
    monkeypatch.setattr(graphs, "_capture", lambda: _Graph(cache.key))
    with pytest.raises(ForwardStateError):
        graphs()  # outside a forward: the cache's error, nothing captured
    assert len(graphs) == 0 and not ran
    for key in ["a", "b", "a", "c", "b", "a"]:
        cache.key = key
        graphs()
    # a, b captured; a replayed (most recent); c captured evicts b (least recent); b recaptured evicts a
    assert ran == [("eager", "a"), ("eager", "b"), ("replay", "a"), ("eager", "c"), ("eager", "b"), ("eager", "a")]
    assert (graphs.captures, graphs.replays, len(graphs)) == (5, 1, 2)
    graphs.clear()
    assert len(graphs) == 0


# ------------------------------------------------------------------------------------------------
# replays across hostile changes between decode steps
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stable,compare", [(True, True), (False, True), (True, False)])
def test_replay_across_swap_fork_pop_readd(tape, stable, compare):
    d = _Driver(tape, 3, seed=1, decode_splits=4, stable_decode_splits=stable)
    d.graphs.compare = compare  # False: a replay runs no Python of the step, as a CUDA graph's
    for sid, n in ((0, 20), (1, 33), (2, 47)):
        d.add(sid, n)
    batch = [0, 1, 2]
    for step in range(16):
        if step == 2:  # swap a row out and back in: its pages move
            d.cache.swap_out([1])
            d.add(9, 40)  # takes pages meanwhile
            d.cache.swap_in([1])
        if step == 4:  # swap the whole batch out and in, in another order
            d.cache.swap_out([2, 0])
            d.cache.swap_in([0, 2])
        if step == 5:  # a fork of a sequence with a partial last page takes a row (copy-on-write)
            d.fork(0, 10)
            batch = [10, 1, 2]
        if step == 7:  # the parent of the fork comes back in the fork's row; the fork is swapped out
            d.cache.swap_out([10])
            batch = [0, 1, 2]
        if step == 8:
            d.pop(2, 3)
            d.pop(0, 1)
        if step == 10:  # the same id removed and added again with another history
            d.remove(1)
            d.add(1, 5)
        if step == 12:
            d.cache.swap_in([10])
            d.remove(0)
            d.fork(10, 0)  # id 0 again: a fork of the fork
            d.remove(9)
        d.decode(batch)
    d.done(min_replays=6)


@pytest.mark.parametrize("rope_mode", ["none", "inline"])
def test_replay_with_sliding_windows_and_sinks(tape, rope_mode):
    """Windows that slide (positions of kept tokens renumbered: with inline RoPE the keys rotate anew)."""
    d = _Driver(tape, 3, seed=2, sliding=True, decode_splits=4, stable_decode_splits=True, rope_mode=rope_mode)
    for sid, n in ((0, 30), (1, 12), (2, 50)):
        d.add(sid, n)
    d.window(0, 24, 4)  # slides after the next step and every step after it
    d.window(2, 40)
    batch = [0, 1, 2]
    for step in range(16):
        if step == 3:  # a fork (copy-on-write of the partial page) takes a row; its 15 inherited tokens
            d.fork(1, 5)  # are its window's sink (TVM's rule), so it keeps them and its newest token
            d.window(5, 16, 2)
            batch = [0, 5, 2]
        if step == 6:  # the parent gets a window that slides at the end of the next step
            d.window(1, 8, 2)
            batch = [0, 1, 2]
        if step == 9:
            d.cache.swap_out([0])
            d.cache.swap_in([0])
        if step == 11:
            d.pop(1, 2)
        d.decode(batch)
    d.done(min_replays=6)


def test_replay_across_prefill_and_token_tree_forwards(tape):
    """Forwards of other kinds in between decode steps change which slot a decode step gets."""
    d = _Driver(tape, 2, seed=3, decode_splits=4, stable_decode_splits=True)
    d.add(0, 18)
    d.add(1, 35)
    for step in range(14):
        if step % 3 == 1:  # a prefill of another sequence (one forward: the slot parity flips)
            d.add(100 + step, 7)
        if step == 5:  # a token tree in between, committed
            d.eager([1], [4], parents=[[-1, 0, 0, 1]])
            d.cache.commit_accepted_token_tree_nodes([1], [3])
            d.model.commit([1], [3])
        if step == 8:  # a chunk appended to a batch row
            d.eager([0], [20])
        d.decode([0, 1])
    d.done(min_replays=5)


def test_replay_after_the_index_buffer_grows(tape):
    """Sixteen forks of one long sequence: a decode batch with many more page-table entries than the
    buffer was sized for (shared pages count once per sequence), after graphs of a short batch of the
    same size and with the same ids were captured."""
    opts = dict(max_total_seq_len=1024, num_pages=120, prefill_chunk_size=64, decode_splits=2)
    d = _Driver(tape, 16, seed=4, stable_decode_splits=True, **opts)
    tail = []  # page_indices' view runs to the end of the index buffer: at one batch size its length
    step = d.graphs.step  # follows the buffer's capacity (docs/layout.md; debug_forward)

    def sized_step():
        tail.append(len(d.cache.debug_forward().arrays["page_indices"]))
        step()

    d.graphs.step = sized_step
    d.add(0, 1000)
    d.add(1, 20)
    children = list(range(100, 115))
    for child in children:
        d.fork(1, child)
    for _ in range(3):
        d.decode([1, *children])
    first = tail[-1]
    for child in children:  # the same ids again, forks of the long sequence
        d.remove(child)
        d.fork(0, child)
    for _ in range(6):
        d.decode([0, *children])
    assert tail[-1] > first  # the buffer grew
    d.done(min_replays=5)


def test_replay_after_clear(tape):
    d = _Driver(tape, 2, seed=5, decode_splits=4, stable_decode_splits=True)
    for round_ in range(2):
        d.add(0, 25 + round_)
        d.add(1, 40 - round_)
        for _ in range(4):
            d.decode([0, 1])
        d.cache.clear()
        d.model.seqs.clear()
    d.done(min_replays=5)


@pytest.mark.parametrize("stable", [True, False])
def test_same_batch_size_different_split_plans(tape, stable):
    """Batches of one size whose longest sequence differs widely: different splits, hence different
    launches; a replay must only ever use a recording of the same split."""
    d = _Driver(tape, 2, seed=6, decode_splits=4, stable_decode_splits=stable)
    d.add(0, 3)
    d.add(1, 5)
    d.add(2, 200)
    d.add(3, 90)
    order = [[0, 1], [2, 0], [0, 1], [1, 2], [3, 0], [0, 1], [2, 3], [0, 1], [1, 3], [2, 0]]
    for batch in order + order:
        d.decode(batch)
    d.done(min_replays=6)


def test_replay_with_per_layer_windows(tape):
    W = 6

    d = _Driver(tape, 2, seed=7, layer_windows=[W, 0], decode_splits=4, stable_decode_splits=True)
    d.unchecked = {0}
    d.add(0, 20)
    d.add(1, 9)

    def windowed(batch):
        def reference(layer, qkv):
            out = np.zeros((len(batch), HQ, D))
            for row, sid in enumerate(batch):
                pos, k, v = d.model.kept_kv(sid)
                keep = pos >= pos[-1] - W + 1 if layer == 0 else np.ones(len(pos), bool)
                k, v = k[layer][keep], v[layer][keep]
                for h in range(HQ):
                    sc = (k[:, h // (HQ // HKV)] @ qkv[row, h].astype(np.float64)) * D**-0.5
                    p = np.exp(sc - sc.max())
                    out[row, h] = p @ v[:, h // (HQ // HKV)] / p.sum()
            return out

        return reference

    batch = [0, 1]
    for step in range(10):
        if step == 4:
            d.fork(0, 2)
            batch = [2, 1]
        if step == 6:
            d.pop(1, 4)
        d.decode(batch, reference=windowed(batch))
    d.done(min_replays=4)


# ------------------------------------------------------------------------------------------------
# steps other than fused decode
# ------------------------------------------------------------------------------------------------


def test_prefill_graphs_with_equal_token_counts(tape):
    """Prefill forwards of 8 tokens over two sequences, cut differently: equal keys must mean a replay
    computes each forward's own attention."""

    cache = make_cache("llvm", num_layers=LAYERS)
    model = CacheModel(LAYERS, HQ, HKV, D)
    rng = np.random.default_rng(8)
    T = 8
    qkv_t, out_t, step = _static_layers(cache, T)
    graphs = _Graphs(cache, tape, step)
    for sid, n in ((0, 5), (1, 21), (2, 1), (3, 40)):
        cache.add_sequence(sid)
        model.add(sid)
        cache.begin_forward([sid], [n])
        model.begin([sid], [n])
        for layer in range(LAYERS):
            qkv = rng.standard_normal((n, HQ + 2 * HKV, D)).astype(np.float32)
            cache.attention_with_fused_qkv(layer, qkv)
            model.attention(layer, qkv)
        cache.end_forward()
        model.end()
    cuts = [([0, 1], [3, 5]), ([1, 0], [5, 3]), ([2, 3], [1, 7]), ([0, 1], [4, 4]), ([3, 2], [7, 1]), ([1, 2], [6, 2])]
    for seq_ids, lengths in cuts * 2:
        cache.begin_forward(seq_ids, lengths)
        model.begin(seq_ids, lengths)
        qkv = rng.standard_normal((LAYERS, T, HQ + 2 * HKV, D)).astype(np.float32)
        for layer in range(LAYERS):
            qkv_t[layer].copyfrom(qkv[layer])
        graphs()
        for layer in range(LAYERS):
            want, _ = model.attention(layer, qkv[layer])
            np.testing.assert_allclose(
                out_t[layer].numpy(), want, rtol=RTOL, atol=ATOL, err_msg=f"{seq_ids} {lengths} {layer}"
            )
        cache.end_forward()
        model.end()
    assert not graphs.mismatches
    assert graphs.replays >= 4, (graphs.replays, graphs.captures)


def _attend(q, k, v):
    """fp64 softmax attention of ``q [H_qo, D]`` over ``k, v [n, H_kv, D]`` (GQA), ``(o, lse base 2)``."""
    o, lse = np.zeros((HQ, D)), np.full(HQ, -np.inf)
    for h in range(HQ):
        kv = h // (HQ // HKV)
        sc = (k[:, kv] @ np.asarray(q[h], np.float64)) * D**-0.5
        if sc.size:
            m = sc.max()
            p = np.exp(sc - m)
            o[h] = p @ v[:, kv] / p.sum()
            lse[h] = (m + np.log(p.sum())) / np.log(2)
    return o, lse


def test_cross_attention_over_history_in_a_graphed_decode_step(tape):
    """cross_attention(include_new=False) uploads this forward's history page tables from Python, which
    a replay would not do again: the step runs eagerly (right results) and its capture is refused."""
    import tvm

    cache = make_cache("llvm", num_layers=LAYERS)
    model = CacheModel(LAYERS, HQ, HKV, D)
    rng = np.random.default_rng(9)
    dev, B = cache.device, 2
    qkv_t = [tvm.runtime.empty((B, HQ + 2 * HKV, D), "float32", dev) for _ in range(LAYERS)]
    q_t = tvm.runtime.empty((B, HQ, D), "float32", dev)
    out_t = [tvm.runtime.empty((B, HQ, D), "float32", dev) for _ in range(LAYERS)]
    hist_o = [tvm.runtime.empty((B, HQ, D), "float32", dev) for _ in range(LAYERS)]
    hist_lse = [tvm.runtime.empty((B, HQ), "float32", dev) for _ in range(LAYERS)]

    def step():
        for layer in range(LAYERS):
            cache.attention_with_fused_qkv(layer, qkv_t[layer], out=out_t[layer])
            cache.cross_attention(layer, q_t, out=hist_o[layer], lse=hist_lse[layer], include_new=False)

    graphs = _Graphs(cache, tape, step)
    for sid, n in ((0, 10), (1, 23)):
        cache.add_sequence(sid)
        model.add(sid)
        cache.begin_forward([sid], [n])
        model.begin([sid], [n])
        for layer in range(LAYERS):
            qkv = rng.standard_normal((n, HQ + 2 * HKV, D)).astype(np.float32)
            cache.attention_with_fused_qkv(layer, qkv)
            model.attention(layer, qkv)
        cache.end_forward()
        model.end()
    for _ in range(6):
        history = [model.kept_kv(sid) for sid in (0, 1)]
        cache.begin_forward([0, 1], [1, 1])
        model.begin([0, 1], [1, 1])
        qkv = rng.standard_normal((LAYERS, B, HQ + 2 * HKV, D)).astype(np.float32)
        q = rng.standard_normal((B, HQ, D)).astype(np.float32)
        q_t.copyfrom(q)
        for layer in range(LAYERS):
            qkv_t[layer].copyfrom(qkv[layer])
        with pytest.raises(ValueError, match="cannot be captured in a CUDA graph: an attention over the history"):
            graphs()  # the step ran eagerly, then its capture was refused
        for layer in range(LAYERS):
            model.attention(layer, qkv[layer])
            for row, (_, k, v) in enumerate(history):
                want_o, want_lse = _attend(q[row], k[layer], v[layer])
                np.testing.assert_allclose(hist_o[layer].numpy()[row], want_o, rtol=RTOL, atol=ATOL)
                np.testing.assert_allclose(hist_lse[layer].numpy()[row], want_lse, rtol=RTOL, atol=ATOL)
        cache.end_forward()
        model.end()
    assert graphs.replays == graphs.captures == 0
    cache.begin_forward([0, 1], [1, 1])  # a forward without the history call is captured as usual
    assert cache.graph_key()
    cache.end_forward()


def test_token_tree_graphs_with_equal_token_counts(tape):
    """Token-tree forwards of 6 nodes over two sequences, trees of different shapes, each committed
    after its forward: a replay must use this forward's tree."""

    cache = make_cache("llvm", num_layers=LAYERS)
    model = CacheModel(LAYERS, HQ, HKV, D)
    rng = np.random.default_rng(10)
    T = 6
    qkv_t, out_t, step = _static_layers(cache, T)
    graphs = _Graphs(cache, tape, step)
    for sid, n in ((0, 14), (1, 31)):
        cache.add_sequence(sid)
        model.add(sid)
        cache.begin_forward([sid], [n])
        model.begin([sid], [n])
        for layer in range(LAYERS):
            qkv = rng.standard_normal((n, HQ + 2 * HKV, D)).astype(np.float32)
            cache.attention_with_fused_qkv(layer, qkv)
            model.attention(layer, qkv)
        cache.end_forward()
        model.end()
    trees = [
        ([[-1, 0, 1], [-1, 0, 0]], [2, 1]),  # a chain and a fork
        ([[-1, 0, 0], [-1, 0, 1]], [1, 2]),
        ([[-1, -1, 0], [-1, 0, 1]], [2, 0]),  # two roots
        ([[-1, 0, 1], [-1, -1, -1]], [0, 1]),
        ([[-1, 0, 0], [-1, 0, 1]], [2, 2]),
    ]
    for parents, leaves in trees * 2:
        cache.begin_forward([0, 1], [3, 3], [p for ps in parents for p in ps])
        model.begin([0, 1], [3, 3], parents)
        qkv = rng.standard_normal((LAYERS, T, HQ + 2 * HKV, D)).astype(np.float32)
        for layer in range(LAYERS):
            qkv_t[layer].copyfrom(qkv[layer])
        graphs()
        for layer in range(LAYERS):
            want, _ = model.attention(layer, qkv[layer])
            np.testing.assert_allclose(
                out_t[layer].numpy(), want, rtol=RTOL, atol=ATOL, err_msg=f"{parents} layer {layer}"
            )
        cache.end_forward()
        model.end()
        cache.commit_accepted_token_tree_nodes([0, 1], leaves)
        model.commit([0, 1], leaves)
        cache.check_integrity()
    assert not graphs.mismatches
    assert graphs.replays >= 4, (graphs.replays, graphs.captures)


def test_replay_with_prefix_cache_sharing_and_eviction(tape):
    """Rows that start from a radix prefix cache's pages (a partial page: copy-on-write at the first
    forward), and the tree evicting pages under pressure between replays."""
    from tvmkv.runtime.radix import RadixPrefixCache

    d = _Driver(tape, 2, seed=11, num_pages=26, decode_splits=4, stable_decode_splits=True)
    prefix = RadixPrefixCache(d.cache)
    tokens = list(range(1000, 1045))
    d.add(0, 45)
    d.add(1, 10)
    prefix.insert(0, tokens)
    batch = [0, 1]
    for step in range(12):
        if step == 3:  # a request sharing 37 tokens of sequence 0 replaces it
            reused = prefix.add_sequence_with_prefix(2, tokens[:37] + [7, 8, 9])
            assert reused == 37
            d.model.fork(0, 2, 37)
            d.remove(0)
            batch = [2, 1]
        if step == 6:  # sequence 1 finishes into the tree; a new one takes its row, evicting pages
            prefix.finish_sequence(1, list(range(2000, 2000 + d.model.length(1))))
            d.model.remove(1)
            held = prefix.num_cached_pages()
            d.add(3, 340)
            assert prefix.num_cached_pages() < held  # pages were evicted to make room
            batch = [2, 3]
        if step == 9:  # a request sharing 20 tokens (a partial page) takes a row at its first forward
            assert prefix.add_sequence_with_prefix(4, tokens[:20] + [5]) == 20
            d.model.fork(2, 4, 20)
            batch = [4, 3]
        d.decode(batch)
    d.cache.check_integrity()
    d.done(min_replays=6)


def test_shared_kv_after_a_replayed_step(tape):
    """A replay runs no attention_with_fused_qkv; StepGraphs' mark_attended tells the cache which layers'
    K/V it appended, so an eager attention_with_shared_kv after it reads them."""
    d = _Driver(tape, 2, seed=12)
    d.graphs.compare = False  # a replay runs no Python of the step, as a CUDA graph's
    d.add(0, 9)
    d.add(1, 21)
    for _ in range(3):
        d.decode([0, 1])
    assert d.graphs.replays >= 1
    # one more replayed step, then an eager call that reads layer 0's pages (this forward's tokens included)
    d.cache.begin_forward([0, 1], [1, 1])
    d.model.begin([0, 1], [1, 1])
    qkv = d.rng.standard_normal((LAYERS, 2, HQ + 2 * HKV, D)).astype(np.float32)
    for layer in range(LAYERS):
        d.qkv_t[layer].copyfrom(qkv[layer])
    assert d.graphs()
    for layer in range(LAYERS):
        d.model.attention(layer, qkv[layer])
    q = d.rng.standard_normal((2, HQ, D)).astype(np.float32)
    k = np.zeros((2, HKV, D), np.float32)
    got = d.cache.attention_with_shared_kv(0, q, k, k)
    for row, sid in enumerate([0, 1]):
        _, keys, values = d.model.kept_kv(sid)
        np.testing.assert_allclose(got[row], _attend(q[row], keys[0], values[0])[0], rtol=RTOL, atol=ATOL)
    d.cache.end_forward()
    d.model.end()


def test_every_forward_of_a_swapping_scheduler_graphed(tape):
    """A scheduler's workload (chunked prefills mixed with decodes, swap preemption under a tight page
    pool, sequences finishing and arriving) with every forward, of any shape, run through graphs keyed
    by graph_key: static tensors per token count."""

    from tvmkv.runtime.scheduler import Scheduler

    cache = make_cache("llvm", num_layers=LAYERS, num_pages=10, decode_splits=4, stable_decode_splits=True)
    model = CacheModel(LAYERS, HQ, HKV, D)
    rng = np.random.default_rng(13)
    sched = Scheduler(cache, token_budget=24, max_batch_size=4, preemption="swap")
    static: dict = {}

    def tensors(total):
        if total not in static:
            static[total] = _static_layers(cache, total)
        return static[total]

    total_now = [0]

    def step():
        tensors(total_now[0])[2]()

    graphs = _Graphs(cache, tape, step)
    budget = {sid: 20 + 4 * sid for sid in range(8)}  # tokens each request generates
    prompts = [30, 7, 55, 12, 40, 3, 25, 18]
    arrived, swaps = 0, 0
    for it in range(400):
        if arrived < len(prompts) and it % 2 == 0:
            sched.add_request(arrived, prompts[arrived])
            arrived += 1
        if not sched.has_unfinished():
            if arrived == len(prompts):
                break
            continue
        plan = sched.schedule()
        swaps += len(plan.preempted)
        for sid in plan.admitted:
            model.add(sid)
        total_now[0] = plan.num_tokens
        cache.begin_forward(plan.seq_ids, plan.lengths)
        model.begin(plan.seq_ids, plan.lengths)
        qkv = rng.standard_normal((LAYERS, plan.num_tokens, HQ + 2 * HKV, D)).astype(np.float32)
        qkv_t, out_t, _ = tensors(plan.num_tokens)
        for layer in range(LAYERS):
            qkv_t[layer].copyfrom(qkv[layer])
        graphs()
        for layer in range(LAYERS):
            want, _ = model.attention(layer, qkv[layer])
            np.testing.assert_allclose(
                out_t[layer].numpy(), want, rtol=RTOL, atol=ATOL, err_msg=f"{plan.parts} layer {layer}"
            )
        cache.end_forward()
        model.end()
        done = []
        for part in plan.parts:
            if part.samples:
                budget[part.seq_id] -= 1
                if budget[part.seq_id] == 0:
                    done.append(part.seq_id)
        sched.step_done(plan, finished=done)
        for sid in done:
            model.remove(sid)
        cache.check_integrity()
    assert arrived == len(prompts) and not sched.has_unfinished()
    assert swaps >= 1, "the workload should preempt"
    assert not graphs.mismatches
    assert graphs.replays >= 10, (graphs.replays, graphs.captures)
