"""Swap to host (bit-exact round trips, page accounting, misuse) and the preempting scheduler.

Oracles: the NumPy references of the page kernels (tvmkv.reference.ops), the independent CacheModel
(through tvmkv.replay.Replayer, which also checks every attention output), and for the scheduler an
unconstrained run of the same workload plus the PyTorch recomputation of every step's logits.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tvm
from conftest import device_of, to_dev

import tvmkv
from tvmkv import OutOfPagesError, SequenceSwappedError, testing
from tvmkv.errors import ForwardStateError
from tvmkv.reference.ops import gather_pages_ref, scatter_pages_ref
from tvmkv.replay import Replayer
from tvmkv.runtime.scheduler import RUNNING, SWAPPED, Scheduler
from tvmkv.runtime.tensors import numpy_dtype

# The tiny Llama's shape (tvmkv.relax.llama.LlamaConfig): its kernel set is built once for all tests.
SHAPE = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64)


def make_cache(target, dtype="float32", *, num_pages=None, page_size=16, chunk=64, batch=8):
    """A cache of the tiny Llama's shape, RoPE "normal"; ``max_total_seq_len`` fills ``num_pages``."""
    return testing.make_cache(
        target,
        **SHAPE,
        dtype=dtype,
        rope_mode="normal",
        page_size=page_size,
        num_pages=num_pages,
        prefill_chunk_size=chunk,
        max_batch_size=batch,
    )


def state(cache) -> dict:
    """Everything a failed call must leave as it was: pages, ids, lengths, K/V, host copies."""
    out = {
        "free": cache.num_available_pages(),
        "ids": cache.sequence_ids(),
        "swapped": cache.swapped_sequence_ids(),
        "host": cache.swapped_host_bytes(),
        "swapped_len": [cache.sequence_length(s) for s in cache.swapped_sequence_ids()],
    }
    for sid in cache.sequence_ids():
        out[sid] = (cache.sequence_length(sid), *cache.debug_get_kv(sid))
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], tuple):
            assert a[key][0] == b[key][0]
            np.testing.assert_array_equal(a[key][1], b[key][1])
            np.testing.assert_array_equal(a[key][2], b[key][2])
        else:
            assert a[key] == b[key], key


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_page_kernels_match_reference(target, dtype, rng):
    cache = make_cache(target, dtype)
    cfg = cache.config
    L, N = cfg.num_layers, cfg.total_pages
    shape = (N, 2, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)
    pools = [rng.standard_normal(shape).astype(numpy_dtype(dtype)) for _ in range(L)]
    for layer in range(L):
        cache.pages[layer].copyfrom(pools[layer])
    ids = rng.permutation(N)[:7].astype(np.int32)
    staging = tvm.runtime.empty((len(ids), L, *shape[1:]), dtype, device_of(target))
    for layer in range(L):
        cache.kernels["gather_pages"](cache.pages[layer], to_dev(ids, target), staging, layer)
    np.testing.assert_array_equal(staging.numpy(), gather_pages_ref(pools, ids))
    rows = rng.standard_normal(staging.shape).astype(numpy_dtype(dtype))
    staging.copyfrom(rows)
    dst = rng.permutation(N)[:7].astype(np.int32)
    for layer in range(L):
        cache.kernels["scatter_pages"](cache.pages[layer], to_dev(dst, target), staging, layer)
        np.testing.assert_array_equal(cache.pages[layer].numpy(), scatter_pages_ref(pools[layer], dst, rows, layer))


# --------------------------------------------------------------------------------------------- swap
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_swap_round_trip_is_bit_exact(target, dtype):
    cache = make_cache(target, dtype)
    r = Replayer(cache, seed=3)
    r.run(
        [
            ("add", 0),
            ("fwd", [(0, 37)]),
            ("add", 1),
            ("fwd", [(1, 16)]),
            ("fork", 0, 2, 32),  # shares pages 0-1 of seq 0
            ("fork", 0, 3, 20),  # shares page 0, copies half of page 1
            ("fwd", [(2, 3), (3, 5), (1, 1)]),
            ("add", 4),
            ("fwd", [(4, 1)]),
            ("add", 5),  # empty: nothing to copy
            ("tree", [(1, [-1, 0, 0])]),  # uncommitted token-tree nodes are swapped too
        ]
    )
    before = {sid: cache.debug_get_kv(sid) for sid in cache.sequence_ids()}
    lengths = {sid: cache.sequence_length(sid) for sid in cache.sequence_ids()}
    total = cache.config.total_pages

    # seq 0 and its fork 2 together: their shared page 1 is released, page 0 (also held by 3) is not
    free = cache.num_available_pages()
    released = cache.num_pages_released_by([0, 2, 5])
    assert released == 3  # seq 0's pages 1 and 2, seq 2's own page
    cache.swap_out([0, 2, 5])
    assert cache.num_available_pages() == free + released
    assert cache.swapped_sequence_ids() == [0, 2, 5] and cache.is_swapped(0) and not cache.is_swapped(3)
    assert cache.num_swapped_pages() == 4  # pages 0, 1, 2 of seq 0 (shared ones once) + seq 2's own
    assert cache.swapped_host_bytes() == 4 * cache.config.num_layers * cache.config.page_bytes
    assert [cache.sequence_length(s) for s in (0, 2, 5)] == [lengths[0], lengths[2], lengths[5]]
    assert sorted(cache.sequence_ids()) == [1, 3, 4]
    cache.check_integrity()
    r.check_kv()  # the sequences left on the device are untouched
    cache.swap_out(
        [1], max_staging_bytes=cache.config.num_layers * cache.config.page_bytes
    )  # one page per copy: the staging path
    assert cache.swapped_host_bytes() == 6 * cache.config.num_layers * cache.config.page_bytes  # + 20 tokens
    cache.check_integrity()

    # back in: 0 and 2 in one call share their first two pages again; tiny staging forces 4 chunks
    free = cache.num_available_pages()
    assert cache.num_pages_needed(0, 0) == 3
    cache.swap_in([2, 0], max_staging_bytes=cache.config.num_layers * cache.config.page_bytes)
    assert cache.num_available_pages() == free - 4
    assert cache.num_pages_released_by([0]) == 1 and cache.num_pages_released_by([0, 2]) == 4
    cache.swap_in([5])
    cache.swap_in([1])
    assert cache.swapped_sequence_ids() == [] and cache.swapped_host_bytes() == 0
    cache.check_integrity()
    for sid, (k, v) in before.items():
        k2, v2 = cache.debug_get_kv(sid)
        np.testing.assert_array_equal(k2, k, err_msg=f"K of sequence {sid} after swap")
        np.testing.assert_array_equal(v2, v, err_msg=f"V of sequence {sid} after swap")
        assert cache.sequence_length(sid) == lengths[sid]
    r.check_kv()  # and against the oracle
    # again, into the spare host buffer the first swap left (a view of its first rows)
    assert cache.spare_host_bytes() == 4 * cache.config.num_layers * cache.config.page_bytes
    cache.swap_out([3])
    assert (
        cache.spare_host_bytes() == 0
        and cache.swapped_host_bytes() == 4 * cache.config.num_layers * cache.config.page_bytes
    )
    cache.swap_in([3])
    np.testing.assert_array_equal(cache.debug_get_kv(3)[0], before[3][0])
    cache.release_host_memory()
    assert cache.spare_host_bytes() == 0

    # the swapped-in sequences take part in forwards: appends into re-shared pages copy on write,
    # the token tree commits, pop_n works; every attention output is checked against the oracle
    r.run(
        [
            ("fwd", [(0, 2), (2, 1), (3, 1), (4, 18), (5, 4)]),
            ("commit", [(1, 2)]),
            ("fwd", [(1, 1)]),
            ("pop", 0, 5),
            ("fwd", [(0, 3), (2, 17)]),
        ]
    )
    for sid in list(cache.sequence_ids()):
        r.apply(("remove", sid))
    assert cache.num_available_pages() == total


def test_swap_misuse_is_rejected_without_change(target):
    cache = make_cache(target, num_pages=8)
    r = Replayer(cache, seed=5)
    r.run([("add", 0), ("fwd", [(0, 40)]), ("add", 1), ("fwd", [(1, 20)])])  # 3 + 2 pages
    before = state(cache)
    with pytest.raises(KeyError, match="9"):
        cache.swap_out([1, 9])
    with pytest.raises(ValueError, match="twice"):
        cache.swap_out([0, 0])
    with pytest.raises(ValueError, match="not swapped out"):
        cache.swap_in([0])
    with pytest.raises(KeyError, match="9"):
        cache.swap_in([9])
    with pytest.raises(ValueError, match="smaller than one page"):
        cache.swap_out([0], max_staging_bytes=16)
    assert_same(state(cache), before)

    cache.swap_out([0])
    assert cache.num_available_pages() == 6
    with pytest.raises(SequenceSwappedError):
        cache.swap_out([0])
    with pytest.raises(SequenceSwappedError, match=r"swap_in\(\[0\]\)"):
        cache.begin_forward([1, 0], [1, 1])
    for misuse in (
        lambda: cache.fork_sequence(0, 5),
        lambda: cache.pop_n(0, 1),
        lambda: cache.debug_get_kv(0),
        lambda: cache.commit_accepted_token_tree_nodes([0], [-1]),
    ):
        with pytest.raises(SequenceSwappedError):
            misuse()
    with pytest.raises(KeyError, match="already in the cache"):
        cache.add_sequence(0)
    with pytest.raises(KeyError, match="already in the cache"):
        cache.fork_sequence(1, 0)
    assert cache.sequence_length(0) == 40

    # swap_in that cannot fit raises before anything changes
    r.run([("add", 2), ("fwd", [(2, 64)]), ("add", 3), ("fwd", [(3, 8)])])  # 4 + 1 pages: 1 free
    before = state(cache)
    with pytest.raises(OutOfPagesError) as err:
        cache.swap_in([0])
    assert (err.value.needed, err.value.available) == (3, 1)
    assert_same(state(cache), before)
    cache.check_integrity()

    # no swap while a forward is open
    cache.begin_forward([1], [1])
    with pytest.raises(ForwardStateError):
        cache.swap_out([2])
    with pytest.raises(ForwardStateError):
        cache.swap_in([0])
    with pytest.raises(ForwardStateError):
        cache.remove_sequence(0)
    cache.end_forward()  # (seq 1 now holds one token the oracle does not know: no K/V checks below)

    # removing a swapped sequence frees its host copy
    assert cache.swapped_host_bytes() == 3 * cache.config.num_layers * cache.config.page_bytes
    cache.remove_sequence(0)
    assert cache.swapped_sequence_ids() == [] and cache.swapped_host_bytes() == 0
    with pytest.raises(KeyError):
        cache.sequence_length(0)
    cache.check_integrity()
    cache.swap_out([1, 2, 3])
    cache.clear()
    assert cache.swapped_sequence_ids() == [] and cache.num_available_pages() == 8
    cache.check_integrity()


# ----------------------------------------------------------------------------------------- scheduler
class _OracleOps:
    """Scheduler lifecycle calls applied to the cache and the Replayer's CacheModel together."""

    def __init__(self, replayer):
        self.r = replayer

    def add_sequence(self, sid):
        self.r.apply(("add", sid))

    def remove_sequence(self, sid):
        self.r.cache.remove_sequence(sid)
        self.r.model.seqs.pop(sid, None)  # a swapped sequence is in the model too

    def fork_sequence(self, parent, child, pos):
        self.r.apply(("fork", parent, child, pos))


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_scheduler_policy_against_the_oracle(target, preemption):
    """Random K/V through the scheduler under scarce pages: every attention output and stored K/V is
    checked against CacheModel; budget, batch size, FIFO resumption and victim choice are checked."""
    rng = np.random.default_rng(11)
    cache = make_cache(target, num_pages=6, chunk=32, batch=4)
    r = Replayer(cache, seed=2)
    sched = Scheduler(cache, preemption=preemption, ops=_OracleOps(r))
    prompts = rng.integers(3, 40, 7).tolist()
    gen = dict(enumerate(rng.integers(3, 14, 7).tolist()))
    for sid, n in enumerate(prompts):
        sched.add_request(sid, n)
    produced = dict.fromkeys(gen, 0)
    steps = 0
    while sched.has_unfinished():
        swapped = sched.queue_ids(SWAPPED)
        running = sched.queue_ids(RUNNING)
        plan = sched.schedule()
        assert plan.num_tokens <= 32 and len(plan.parts) <= 4
        assert plan.swapped_in == swapped[: len(plan.swapped_in)]  # FIFO resumption
        victims = [sid for sid, _ in plan.preempted]
        if victims:  # the newest running sequences go first
            assert sorted(victims) == sorted(running[len(running) - len(victims) :])
            assert not plan.swapped_in and not plan.admitted
        r.forward(plan.seq_ids, plan.lengths, None, None)
        finished = []
        for part in plan.parts:
            if part.samples:
                produced[part.seq_id] += 1
                if produced[part.seq_id] == gen[part.seq_id]:
                    finished.append(part.seq_id)
        sched.step_done(plan, finished)
        cache.check_integrity()
        r.check_kv()
        steps += 1
        assert steps < 500
    st = sched.stats
    assert (st.preempted_swap if preemption == "swap" else st.preempted_recompute) > 0
    assert st.swapped_in == st.preempted_swap
    assert cache.num_available_pages() == 6 and not cache.swapped_sequence_ids()


_compiled: dict = {}


def _model(target, interface="tvmkv"):
    from tvmkv.relax.llama import LlamaConfig, RelaxLlama, compile_llama, make_weights

    cfg = LlamaConfig()
    key = (target, interface)
    if key not in _compiled:
        if target == "cuda" and os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
            pytest.skip("this TVM is runtime-only: compiling the Relax model for cuda needs the full TVM")
        arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "") if target == "cuda" else None
        _compiled[key] = compile_llama(cfg, interface=interface, target=target, cuda_arch=arch)
    ex, names = _compiled[key]
    return cfg, RelaxLlama(ex, names, make_weights(cfg), cfg, device_of(target), interface=interface)


def _run_generate(target, num_pages, preemption, *, check, system=0, prefix=False):
    """The workload of five prompts and a fork; ``system`` tokens shared at the start of every
    prompt; ``prefix``: through a RadixPrefixCache (returned as ``report.prefix``, integrity-checked
    after every step)."""
    from tvmkv.generate import TOLERANCE, DirectOps, Request, generate
    from tvmkv.relax.llama import make_weights
    from tvmkv.relax.torch_ref import TorchLlama

    cfg, model = _model(target)
    cache = make_cache(target, num_pages=num_pages, chunk=32, batch=8)
    rng = np.random.default_rng(21)
    spec = [(0, 40, 8), (1, 9, 12), (2, 27, 6), (3, 18, 10), (4, 33, 7)]
    shared = np.random.default_rng(5).integers(0, cfg.vocab_size, system).tolist()
    requests = [Request(sid, shared + rng.integers(0, cfg.vocab_size, n).tolist(), m) for sid, n, m in spec]
    tree = tvmkv.RadixPrefixCache(cache) if prefix else None
    report = generate(
        model,
        DirectOps(cache),
        requests,
        prefill_chunk_size=32,
        max_batch_size=8,
        total_pages=cache.config.total_pages,
        reference=TorchLlama(cfg, make_weights(cfg)) if check else None,
        tolerance=TOLERANCE[cfg.dtype],
        fork=(0, 5, 5),
        check_integrity=cache.check_integrity if tree is None else tree.check_integrity,
        preemption=preemption,
        prefix_cache=tree,
        log=None,
    )
    assert not cache.sequence_ids() and not cache.swapped_sequence_ids()
    if tree is not None:  # what is left is the tree's, and all of it can be evicted
        assert tree.num_evictable_pages() == tree.num_cached_pages() > 0
        tree.reset()
    assert cache.num_available_pages() == cache.config.total_pages
    report.prefix = tree
    return report


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_scheduler_workload_larger_than_memory_matches_unconstrained(target, preemption):
    """Five prompts and a fork need more than 6 pages at once; with 6 the scheduler preempts, and the
    greedy outputs equal an unconstrained run's (the logits checks run in test_generate_with_scarce_memory)."""
    key = ("free", target)
    if key not in _compiled:
        _compiled[key] = _run_generate(target, None, "swap", check=False)
    free = _compiled[key]
    assert max(s.pages_used for s in free.steps) > 6 and free.stats.preempted_swap == 0
    scarce = _run_generate(target, 6, preemption, check=False)
    assert scarce.outputs == free.outputs
    st = scarce.stats
    assert st.preempted_swap + st.preempted_recompute > 0
    assert (st.swapped_in > 0) if preemption == "swap" else (st.recomputed_tokens > 0)
    assert max(s.pages_used for s in scarce.steps) <= 6


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-pages", "6"],
        ["--num-pages", "5", "--interface", "tvm", "--preemption", "recompute"],
        ["--num-pages", "6", "--prefix-cache"],
    ],
    ids=["tvmkv-swap", "tvm-recompute", "tvmkv-swap-prefix"],
)
def test_generate_with_scarce_memory(argv, capsys):
    """``tvmkv generate`` with a pool too small for its workload: preemption happens and every step's
    logits still match the PyTorch reference (exit status 0)."""
    import torch

    from tvmkv.generate import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference's small matmuls: threads only contend with TVM's pool
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "check: OK" in out and "preempt" in out
    assert "0 preemptions" not in out
    if "--prefix-cache" in argv:  # admissions after the first reuse the shared system prompt
        assert "reuses 32" in out and "prefix cache (system prompt of 32 tokens)" in out


# ------------------------------------------------------------------------------ scheduler + prefix
SYSTEM = 37  # shared system prompt: 2 full pages + 5 tokens (partial-page reuse, copy-on-write)


def _shared_prompt_run(target, prefix):
    """Unconstrained runs of the shared-system-prompt workload, every step's logits checked against
    the PyTorch reference (once per process)."""
    import torch

    key = ("system", target, prefix)
    if key not in _compiled:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the reference's small matmuls: threads only contend with TVM's pool
        try:
            _compiled[key] = _run_generate(target, None, "swap", check=True, system=SYSTEM, prefix=prefix)
        finally:
            torch.set_num_threads(threads)
        assert _compiled[key].ok, _compiled[key].failures[:3]
    return _compiled[key]


def test_scheduler_prefix_cache_reuses_shared_prompt(target):
    """With the prefix cache the shared system prompt is prefilled fewer times, every step still
    matches the PyTorch reference, and the outputs equal the run without it."""
    plain = _shared_prompt_run(target, False)
    shared = _shared_prompt_run(target, True)
    assert shared.outputs == plain.outputs
    st, ps = shared.stats, shared.prefix.stats
    assert plain.stats.reused_tokens == 0 and st.preempted_swap == st.preempted_recompute == 0
    # seq 0 prefills its prompt in chunks and its full pages enter the tree after each one, so each
    # of sequences 1-4 reuses the system prompt's 37 tokens (the last 5 from a page the match ends
    # inside, copied on write); the fork (5) shares seq 0's pages and is not admitted
    assert st.reused_tokens == ps.reused_tokens == 4 * SYSTEM
    assert ps.requests == 5 and ps.partial_page_reuses == 4
    computed = sum(s.tokens for s in shared.steps)
    assert computed == sum(s.tokens for s in plain.steps) - 4 * SYSTEM  # prefilled fewer tokens
    first = {}  # each sequence's first part: where its prefill started
    for rec in shared.steps:
        for sid, start, _ in rec.parts:
            first.setdefault(sid, start)
    assert first == {0: 0, 1: SYSTEM, 2: SYSTEM, 3: SYSTEM, 4: SYSTEM, 5: first[5]} and first[5] > SYSTEM


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_scheduler_prefix_cache_scarce_pages(target, preemption):
    """Six pages for a workload that needs many more, with the prefix cache: preemption and eviction
    happen, the tree's integrity holds after every step, and the greedy outputs equal the
    reference-checked run without the prefix cache."""
    plain = _shared_prompt_run(target, False)
    scarce = _run_generate(target, 6, preemption, check=False, system=SYSTEM, prefix=True)
    assert scarce.outputs == plain.outputs
    st, ps = scarce.stats, scarce.prefix.stats
    assert st.preempted_swap + st.preempted_recompute > 0
    assert st.reused_tokens > 0 and ps.evicted_pages > 0
    assert max(s.pages_used for s in scarce.steps) <= 6
    if preemption == "recompute":  # victims were re-admitted through the tree
        assert ps.requests > 5


class _ModelOps:
    """Scheduler removals and forks applied to the cache and to a test_prefix.Driver's CacheModel."""

    def __init__(self, driver):
        self.d = driver

    def remove_sequence(self, sid):
        self.d.cache.remove_sequence(sid)
        self.d.model.remove(sid)
        self.d.tokens.pop(sid)

    def fork_sequence(self, parent, child, pos):
        self.d.fork(parent, child, pos)


def _run_plan(d, plan, toks: dict) -> None:
    """The forward of ``plan`` through a test_prefix.Driver (every output against its CacheModel, which
    shares nothing): the model first prefills what each admission reused from the tree."""
    for sid in plan.admitted:
        part = next(p for p in plan.parts if p.seq_id == sid)
        d.model.add(sid)
        d.tokens[sid] = toks[sid][: part.start]
        if part.start:
            d.model.begin([sid], [part.start])
            for layer in range(d.cache.config.num_layers):
                d.model.attention(layer, d.rows(layer, d.tokens[sid], 0))
            d.model.end()
    for p in plan.parts:
        assert len(d.tokens[p.seq_id]) == p.start
    d.forward({p.seq_id: toks[p.seq_id][p.start : p.start + p.num_tokens] for p in plan.parts})


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_scheduler_prefix_cache_against_the_oracle(target, preemption):
    """Token-determined K/V (test_prefix.Driver: the same token at the same position gets the same
    qkv, as in a model) through the scheduler with a prefix cache and 8 pages: every attention output
    and stored K/V equals a CacheModel that shares nothing; integrity of the cache and the tree after
    every step; a swapped sequence whose pages the tree also held comes back bit-exact."""
    from test_prefix import Driver

    rng = np.random.default_rng(7)
    cache = make_cache(target, num_pages=8, chunk=32, batch=4)
    d = Driver(cache, vocab=50, seed=3)  # d.prefix: the RadixPrefixCache; d.model: CacheModel
    sched = Scheduler(cache, preemption=preemption, ops=_ModelOps(d), prefix_cache=d.prefix)
    system = rng.integers(0, 50, 21).tolist()
    toks, gen = {}, {}
    for sid in range(8):
        tail = toks[sid - 2][21:30] if sid in (3, 6) else rng.integers(0, 50, int(rng.integers(1, 30))).tolist()
        toks[sid] = system + tail  # 3 and 6 also share a longer prefix with an earlier request
        gen[sid] = int(rng.integers(2, 12))
        sched.add_request(sid, tokens=toks[sid])
    produced = dict.fromkeys(gen, 0)
    saved, exact, tree_shared, steps = {}, 0, 0, 0
    while sched.has_unfinished():
        running = sched.queue_ids(RUNNING)
        kv = {sid: cache.debug_get_kv(sid) for sid in running}
        held = set(d.prefix.held_pages())
        tree_pages = {sid: len(held.intersection(cache.sequence_pages(sid))) for sid in running}
        plan = sched.schedule()
        for sid, mode in plan.preempted:
            if mode == "swap":
                saved[sid] = kv[sid]
                tree_shared += tree_pages[sid] > 0
        for sid in plan.swapped_in:  # bit-exact, also the pages the tree held
            k, v = cache.debug_get_kv(sid)
            np.testing.assert_array_equal(k, saved[sid][0])
            np.testing.assert_array_equal(v, saved[sid][1])
            exact += 1
        _run_plan(d, plan, toks)
        sampled, finished = {}, []
        for p in plan.parts:
            if p.samples:
                sampled[p.seq_id] = int(rng.integers(0, 50))
                toks[p.seq_id].append(sampled[p.seq_id])
                produced[p.seq_id] += 1
                if produced[p.seq_id] == gen[p.seq_id]:
                    finished.append(p.seq_id)
        sched.step_done(plan, finished, sampled=sampled)
        d.prefix.check_integrity()  # the tree, then the cache's (which counts the tree's references)
        for sid in sched.queue_ids(RUNNING):
            d.check_kv(sid)
        steps += 1
        assert steps < 300
    st = sched.stats
    assert st.reused_tokens > 0 and d.prefix.stats.evicted_pages > 0
    if preemption == "swap":
        assert st.preempted_swap > 0 and exact == st.swapped_in == st.preempted_swap and tree_shared > 0
    else:
        assert st.preempted_recompute > 0
    assert d.prefix.num_evictable_pages() == d.prefix.num_cached_pages()
    d.prefix.reset()
    assert cache.num_available_pages() == 8


def test_scheduler_prefix_cache_api(target):
    """add_request / step_done / fork with token ids, and their errors."""
    cache = make_cache(target, num_pages=8)
    prefix = tvmkv.RadixPrefixCache(cache)
    with pytest.raises(ValueError, match="another cache"):
        Scheduler(make_cache(target, num_pages=8), prefix_cache=prefix)
    sched = Scheduler(cache, prefix_cache=prefix)
    with pytest.raises(ValueError, match="len\\(tokens\\)=3"):
        sched.add_request(0, 4, tokens=[1, 2, 3])
    with pytest.raises(TypeError, match="num_prompt_tokens or tokens"):
        sched.add_request(0)
    sched.add_request(0, tokens=list(range(20)))
    sched.add_request(1, 5)  # without token ids: no reuse, not inserted
    plan = sched.schedule()
    assert plan.seq_ids == [0, 1] and plan.lengths == [20, 5]
    cache.begin_forward(plan.seq_ids, plan.lengths)
    cache.end_forward()
    with pytest.raises(ValueError, match=r"sampled=\{seq_id: token\}"):
        sched.step_done(plan)
    assert sched.seqs[0].num_computed == 0  # nothing recorded
    with pytest.raises(TypeError, match="sequence 0"):
        sched.step_done(plan, sampled={0: 1.5})
    sched.step_done(plan, sampled={0: 99})
    assert sched.seqs[0].tokens == [*range(20), 99] and prefix.num_cached_tokens() == 16  # its full page
    with pytest.raises(ValueError, match="21 tokens"):
        sched.fork(0, 2, tokens=[1, 2])
    assert sched.fork(0, 2, tokens=[*range(20), 98])
    sched.finish(0)
    sched.finish(2)
    sched.finish(1)
    assert prefix.match_prefix([*range(20), 7]) == 20 and not cache.sequence_ids()
    prefix.check_integrity()


def _prefix_scheduler(target, num_pages, preemption="swap"):
    from test_prefix import Driver

    cache = make_cache(target, num_pages=num_pages, page_size=4, chunk=32, batch=4)
    d = Driver(cache, vocab=50, seed=5)
    return cache, d, Scheduler(cache, preemption=preemption, ops=_ModelOps(d), prefix_cache=d.prefix)


def test_scheduler_admits_past_a_partially_matched_page(target):
    """The tree holds a full page and a partly filled one of a finished prompt; a new prompt needs
    every page of the cache. Reusing the partial page would pin it as its copy's source (one page
    too many, and nothing runs that could free it: the queue would wait forever), so the admission
    reuses the full page alone. Outputs against the CacheModel."""
    cache, d, sched = _prefix_scheduler(target, num_pages=4)
    toks = {1: [1, 2, 3, 4, 5, 6, 7], 2: [1, 2, 3, 4, 5, 6] + [9] * 10}  # 2: 16 tokens, the cache's 4 pages
    sched.add_request(1, tokens=toks[1])
    plan = sched.schedule()
    _run_plan(d, plan, toks)
    sched.step_done(plan, finished=[1], sampled={1: 8})
    toks[1].append(8)
    assert d.prefix.match_prefix(toks[2]) == 6 and cache.num_available_pages() == 2  # 4 tokens + 2 of 3
    sched.add_request(2, tokens=toks[2])
    plan = sched.schedule()
    assert plan.admitted == [2] and [(p.seq_id, p.start, p.num_tokens) for p in plan.parts] == [(2, 4, 12)]
    _run_plan(d, plan, toks)
    sched.step_done(plan, sampled={2: 3})
    d.prefix.check_integrity()
    assert cache.sequence_length(2) == 16 and sched.stats.reused_tokens == 4


def test_scheduler_fork_under_recompute_preemption_with_a_prefix_cache(target):
    """A fork shares its parent's pages; preempted for recomputation, it is not inserted into the tree
    (its node would hang below pages the running parent holds, so its own last page could be neither
    freed nor evicted, though planning counted it free): every plan then fits (no OutOfPagesError),
    and every output matches the CacheModel."""
    cache, d, sched = _prefix_scheduler(target, num_pages=8, preemption="recompute")
    toks = {1: [9, 9, 9, 9, 1], 2: [9, 9, 9, 9] + [2] * 9}  # admitted together: no page shared
    for sid in (1, 2):
        sched.add_request(sid, tokens=toks[sid])
    preempted = []
    for step in range(14):
        plan = sched.schedule()
        preempted += [sid for sid, _ in plan.preempted]
        _run_plan(d, plan, toks)
        sampled = {p.seq_id: 7 for p in plan.parts if p.samples}
        for sid, t in sampled.items():
            toks[sid].append(t)
        sched.step_done(plan, sampled=sampled)
        if step == 0:
            toks[3] = toks[2][:-1] + [8]
            assert sched.fork(2, 3, tokens=toks[3])
        d.prefix.check_integrity()
    assert 3 in preempted  # the fork (the newest) went first


def test_scheduler_finish_between_schedule_and_step_done(target):
    """A request cancelled after its forward ran: step_done skips its part and records the others; a
    plan whose forward ran but was never reported stops the next schedule() instead of appending its
    tokens twice; finish during an open forward raises and changes nothing."""
    cache = make_cache(target, num_pages=8, chunk=32, batch=4)
    sched = Scheduler(cache)
    for sid in (1, 2):
        sched.add_request(sid, 5)
    plan = sched.schedule()
    cache.begin_forward(plan.seq_ids, plan.lengths)
    with pytest.raises(ForwardStateError, match="Scheduler.finish"):
        sched.finish(2)
    with pytest.raises(ForwardStateError, match="Scheduler.step_done"):
        sched.step_done(plan, finished=[2])
    assert sched.queue_ids(RUNNING) == [1, 2] and cache.sequence_ids() == [1, 2] and not plan.done
    assert sched.seqs[1].num_computed == 0
    cache.end_forward()
    sched.finish(1)
    sched.add_request(1, 3)  # the id again, a new request: not the plan's part
    sched.step_done(plan)
    assert sched.seqs[2].num_computed == 5 and sched.seqs[1].num_computed == 0
    plan = sched.schedule()
    assert [(p.seq_id, p.start, p.num_tokens) for p in plan.parts] == [(2, 5, 1), (1, 0, 3)]
    cache.begin_forward(plan.seq_ids, plan.lengths)
    cache.end_forward()
    with pytest.raises(ValueError, match="sequence 2 holds 6 tokens but 5 were computed .* step_done"):
        sched.schedule()  # the forward ran, unreported
    sched.step_done(plan)
    assert sched.schedule().seq_ids == [2, 1]


def test_scheduler_refuses_ids_an_import_reserved(target):
    """An id a pending import holds is refused by add_request, and by schedule() for a request that
    was queued before the import reserved it; aborting the import frees the id."""
    from tvmkv.runtime import transfer

    cache = make_cache(target, num_pages=8, chunk=32, batch=4)
    sched = Scheduler(cache)
    recv = transfer.prepare_receive(cache, 7, 5)
    with pytest.raises(KeyError, match="seq_id 7 is reserved by an import"):
        sched.add_request(7, 3)
    sched.add_request(8, 3)
    recv8 = transfer.prepare_receive(cache, 8, 5)
    digest = cache.table_digest()
    with pytest.raises(KeyError, match="request 8 is waiting, but an import .* reserved id 8"):
        sched.schedule()
    assert cache.table_digest() == digest and sched.queue_ids("waiting") == [8]
    recv8.abort()
    recv.abort()
    assert sched.schedule().seq_ids == [8]


def test_scheduler_watermark_only_while_something_runs(target):
    """The watermark is headroom for running sequences to grow: with nothing running, a request whose
    pages fit is admitted even when they leave less than the watermark free (else it would wait
    forever); the next request, with one running now, keeps the watermark."""
    cache = make_cache(target, num_pages=8, page_size=4, chunk=32, batch=4)
    sched = Scheduler(cache, watermark_pages=2)
    sched.add_request(1, 28)  # 7 of the 8 pages
    sched.add_request(2, 4)  # 1 page: fits, but not with 2 pages of watermark
    plan = sched.schedule()
    assert plan.admitted == [1] and plan.seq_ids == [1]
