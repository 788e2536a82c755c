"""Stateful randomized differential testing of ``PagedAttentionKVCache`` against the NumPy ``CacheModel``.

The runner, the operation generator, the page shadow and the shrinker live in
:mod:`tvmkv.testing.stateful` (``bench/soak.py`` runs them for 100k+ operations); these tests run
short seeded episodes of :data:`tvmkv.testing.configs.STATEFUL_CONFIGS`, the shrinker, every
documented restriction in the state it needs, the extra operations (import/export into reused ids,
swap, prefix reuse) scripted, and faults planted in them that the runner must catch.
tests/test_stateful_debug.py runs a longer episode under CPython's debug allocator.
"""

from __future__ import annotations

import pytest

from tvmkv.runtime import interop
from tvmkv.testing import make_cache
from tvmkv.testing.configs import STATEFUL_CACHE, STATEFUL_CONFIGS
from tvmkv.testing.stateful import Mismatch, StatefulRunner, replay_fails, run_random, shrink

# what each extra operation family must have reached in a short episode ("!": a predicted rejection;
# "a|b": either; "!E": a rejection with E)
EXTRA_KINDS = {
    "interop": ("export", "import", "import@new", "import@reused", "export!|import!"),
    "swap": ("swap_out", "swap_in", "swap_out!|swap_in!|!SequenceSwappedError"),
    "prefix": ("prefix_add@hit", "prefix_add@partial_page", "insert", "finish", "prefix_add!|insert!|finish!"),
    "views": ("fwd@repeated",),
}


def _drawn(stats: dict, want: str) -> bool:
    return any(
        stats.get(alt, 0) > 0 or (alt.startswith("!") and any(k.endswith(alt) for k in stats))
        for alt in want.split("|")
    )


def _run_or_shrink(cache, seed, num_ops, **options):
    try:
        return run_random(cache, seed, num_ops, **options)
    except Mismatch as err:
        small = shrink(cache, err.ops, seed)
        pytest.fail(f"{err}\n\nshrunk counterexample ({len(small)} ops):\n{small!r}")


@pytest.mark.parametrize("config", [pytest.param(c, id=c.name) for c in STATEFUL_CONFIGS])
def test_random_operations(config):
    cache = make_cache(**config.cache)
    ops, runner = _run_or_shrink(cache, config.seed, config.num_ops, extras=config.extras, id_pool=config.id_pool)
    # the draw must reach the interesting states, not only trivial ones
    for kind in (
        "fork",
        "pop",
        "fwd",
        "tree",
        "commit",
        "remove",
        "fwd!",
        "pop!",
        "fork!",
        "commit!",
        "midfwd",
    ):
        assert runner.stats.get(kind, 0) > 0, f"no {kind!r} operation was drawn: {runner.stats}"
    if config.cache["sliding"]:
        assert runner.stats.get("window", 0) > 0
    for extra in config.extras:
        for kind in EXTRA_KINDS[extra]:
            assert _drawn(runner.stats, kind), f"no {kind!r} operation was drawn: {runner.stats}"
    assert cache.num_available_pages() == cache.config.total_pages


def test_shrink_finds_small_counterexample(monkeypatch):
    """The shrinker cuts a failing list to the operations that matter (here: a planted bad prediction)."""
    cache = make_cache(**STATEFUL_CACHE)
    ops = [
        ["add", 0],
        ["fwd", [[0, 5]]],
        ["add", 1],
        ["fwd", [[0, 1], [1, 3]]],
        ["add", 0],
        ["pop", 0, 2],
        ["fork", 0, 2, 3],
        ["fwd", [[2, 1]]],
        ["pop", 2, 9],
    ]
    planted = ops + [["remove", 7]]
    # a runner that wrongly predicts 'remove 7' succeeds fails at the last step; the shrinker keeps only it
    original = StatefulRunner.expected_errors
    with monkeypatch.context() as patch:
        patch.setattr(
            StatefulRunner, "expected_errors", lambda self, op: set() if op == ["remove", 7] else original(self, op)
        )
        assert shrink(cache, planted) == [["remove", 7]]
    assert replay_fails(cache, ops) is None


# Each documented restriction, in the state it needs; the runner predicts the rejection ("!" ops) and
# checks that nothing changed, then that the cache keeps working.
RESTRICTIONS = [
    ["add", 0],
    ["window", 0, 6, 2],
    ["fwd", [[0, 5]]],
    ["fork", 0, 1, 3],  # a windowed sequence that has not slid: the child starts without a window (TVM)
    ["window", 1, 6, 2],
    ["tree", [[1, [-1]]]],  # ! token trees on a window
    ["fwd", [[0, 3], [1, 5]]],  # both slide now
    ["fork", 0, 2, 1],  # ! fork of a slid sequence (tokens were dropped)
    ["fork", 1, 2, -1],  # ! same, for the forked child
    ["pop", 0, 5],  # ! into dropped tokens (only 4 window tokens are kept)
    ["pop", 0, 4],
    ["window", 0, 8, 1],  # ! window of a slid sequence cannot change
    ["fwd", [[0, 2]]],
    ["add", 3],
    ["fwd", [[3, 6]]],
    ["tree", [[3, [-1, 0, 0]]]],
    ["fwd", [[3, 1]]],  # ! plain forward with uncommitted tree nodes
    ["pop", 3, 0],  # ! pop_n with uncommitted tree nodes
    ["window", 3, 8, 0],  # ! window with uncommitted tree nodes
    ["fork", 3, 4, 7],  # ! inside the uncommitted tree
    ["fork", 3, 4, -1],
    ["tree", [[3, [2, -1]], [4, [-1]]]],
    ["commit", [[4, 0], [3, 3]]],
    ["fwd", [[3, 1], [4, 1], [0, 1], [1, 1]]],
]


def test_documented_restrictions():
    cache = make_cache(**{**STATEFUL_CACHE, "page_size": 2, "num_pages": 40})
    runner = StatefulRunner(cache)
    runner.run(RESTRICTIONS)
    assert runner.rejected == 9, runner.stats
    assert runner.drain() == 0


# The extra operations, scripted: issue 14's import into an emptied (reused) id, exports in every
# layout, swap of shared pages, every call on a swapped sequence, calls inside an open forward.
EXTRA_OPS = [
    ["add", 0],
    ["fwd", [[0, 8]]],  # sequence 0 holds two pages
    ["pop", 0, 8],  # empty again: both pages are free
    ["add", 1],
    ["fwd", [[1, 8]]],  # sequence 1 now holds them
    ["import", 0, "contiguous", ["rand", 7, 0], None],  # into the reused id 0: fresh pages
    ["fwd", [[0, 1], [1, 1]]],  # 0 reads and writes only its new pages; 1's K/V stay
    ["export", 0, "nhd", 2],  # into a larger foreign array at shuffled blocks
    ["export", 1, "hnd", None],
    ["import", 2, "ksana", ["seq", 1, 1], None],  # an export of 1 into a new id, at shuffled blocks
    ["import", 1, "hnd", ["rand", 3, 0], None],  # ! 1 holds tokens
    ["import", 3, "nhd", ["rand", 5, 1], "no_num_tokens"],  # ! a paged layout needs num_tokens
    ["import", 3, "ksana", ["rand", 5, 0], "short"],  # ! fewer blocks than tokens
    ["import", 3, "hnd", ["rand", 5, 2], "dtype"],  # ! float64 data
    ["import", 3, "nhd", ["rand", 5, 0], "block_range"],  # ! a block id past the array
    ["import", 3, "bogus", ["rand", 2, 0], None],  # ! unknown layout
    ["import", 3, "contiguous", ["rand", 40, 0], None],  # ! 10 pages, 5 free
    ["import", 3, "contiguous", ["rand", 5, 0], "no_num_tokens"],  # the contiguous layout needs none
    ["fork", 1, 4, 5],  # shares 1's first page
    ["swap_out", [1, 4]],  # the shared page is stored once ...
    ["swap_in", [4, 1]],  # ... and shared again
    ["swap_out", [0, 2]],
    ["fwd", [[0, 1]]],  # ! swapped
    ["pop", 0, 1],  # ! swapped
    ["fork", 2, 5, 0],  # ! swapped
    ["export", 2, "hnd", None],  # ! swapped
    ["import", 2, "contiguous", ["rand", 1, 0], None],  # ! the id is taken (swapped out)
    ["add", 2],  # ! the id is taken (swapped out)
    ["swap_out", [2]],  # ! already swapped
    ["swap_in", [1]],  # ! not swapped
    ["swap_in", [0, 0]],  # ! twice
    ["swap_in", [0]],
    ["remove", 2],  # a swapped sequence is removed with its host copy
    ["midfwd", [[0, 1]], "import"],  # each must raise ForwardStateError and change nothing
    ["midfwd", [[0, 1]], "export"],
    ["midfwd", [[0, 1]], "swap_out"],
    ["midfwd", [[0, 1]], "swap_in"],
    ["pop", 3, 5],
    ["import", 3, "ksana", ["seq", 4, 0], None],  # another reused id
    ["fwd", [[3, 2], [4, 1]]],
]


def test_extra_operations_scripted():
    cache = make_cache(**{**STATEFUL_CACHE, "num_pages": 12})
    runner = StatefulRunner(cache, observe_forwards=True)
    runner.run(EXTRA_OPS)
    assert runner.rejected == 16, runner.stats
    assert runner.stats["import@reused"] == 2 and runner.stats["import@new"] == 2, runner.stats
    assert runner.drain() == 0


def test_prefix_operations_scripted():
    """Prefix reuse: the model takes the reused K/V from the sequence they were inserted from."""
    cache = make_cache(**{**STATEFUL_CACHE, "num_pages": 16})
    runner = StatefulRunner(cache)
    runner.run([["add", 0], ["fwd", [[0, 9]]], ["fwd", [[0, 1]]], ["insert", 0, 10], ["fwd", [[0, 2]]]])
    tokens = runner.tokens[0]
    runner.run(
        [
            ["finish", 0, 12],  # 0 leaves; the tree keeps its 12 tokens
            ["prefix_add", 1, tokens[:6] + [-1], None],  # reuses 6: its second page is copied on write
            ["fwd", [[1, 3]]],
            ["prefix_add", 2, tokens, None],  # reuses 11 of 12 (the last token is prefilled)
            ["prefix_add", 3, tokens, 12],
            ["fork", 3, 4, 10],
            ["fwd", [[2, 1], [3, 1], [4, 2]]],
            ["insert", 4, 12],
            ["insert", 4, 13],  # ! more tokens than it holds
            ["prefix_add", 2, [-1], None],  # ! the id is in use
            ["prefix_add", 5, [-1, -1], 3],  # ! max_reuse past the prompt
            ["midfwd", [[1, 1]], "insert"],
            ["midfwd", [[1, 1]], "prefix_add"],
            ["prefix_twice"],  # ! one prefix cache per cache
            ["swap_out", [1, 2]],
            ["insert", 1, 0],  # ! swapped
            ["prefix_add", 5, tokens[:4], None],  # reuses 3, in the tree's first page
            ["remove", 3],
            ["remove", 4],  # the tree's pages past the first are only the tree's now
            ["add", 6],
            ["fwd", [[6, 24]]],
            ["fwd", [[5, 29]]],  # 8 pages, 6 free: the tree evicts 2
            ["swap_in", [1, 2]],  # ! 5 pages, none free, 2 evictable
        ]
    )
    assert runner.stats["prefix_add@hit"] == 4 and runner.stats["prefix_add@partial_page"] == 3, runner.stats
    assert runner.stats.get("prefix@evicted_pages", 0) > 0 and runner.rejected == 6, runner.stats
    assert runner.drain() == 0


def _corrupt_export(monkeypatch):
    original = interop.export_sequence

    def export(cache, seq_id, layout, **kw):
        out = original(cache, seq_id, layout, **kw)
        out.reshape(-1)[0] += 1  # one element of the first block
        return out

    monkeypatch.setattr(interop, "export_sequence", export)


def _corrupt_import(monkeypatch):
    original = interop.import_sequence
    monkeypatch.setattr(
        interop, "import_sequence", lambda cache, sid, data, *a, **kw: original(cache, sid, data * 2, *a, **kw)
    )


@pytest.mark.parametrize(
    "plant, message", [(_corrupt_export, "exported K of sequence 0"), (_corrupt_import, "stored K/V differ")]
)
def test_runner_catches_corrupted_interop(monkeypatch, plant, message):
    """The oracle of the extra operations is independent: a wrong export or import is a Mismatch."""
    cache = make_cache(**STATEFUL_CACHE)
    runner = StatefulRunner(cache)
    runner.run([["add", 0], ["fwd", [[0, 6]]]])
    plant(monkeypatch)
    with pytest.raises(Mismatch, match=message):
        runner.run([["export", 0, "nhd", None], ["import", 1, "hnd", ["rand", 5, 0], None]])
