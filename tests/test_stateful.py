"""Stateful randomized differential testing of ``PagedAttentionKVCache`` against the NumPy ``CacheModel``.

The runner, the operation generator, the page shadow and the shrinker live in
:mod:`tvmkv.testing.stateful` (``bench/soak.py`` runs them for 100k+ operations); these tests run
short seeded episodes of :data:`tvmkv.testing.configs.STATEFUL_CONFIGS`, the shrinker, and every
documented restriction in the state it needs.
"""

from __future__ import annotations

import pytest

from tvmkv.testing import make_cache
from tvmkv.testing.configs import STATEFUL_CACHE, STATEFUL_CONFIGS
from tvmkv.testing.stateful import Mismatch, StatefulRunner, replay_fails, run_random, shrink


def _run_or_shrink(cache, seed, num_ops):
    try:
        return run_random(cache, seed, num_ops)
    except Mismatch as err:
        small = shrink(cache, err.ops, seed)
        pytest.fail(f"{err}\n\nshrunk counterexample ({len(small)} ops):\n{small!r}")


@pytest.mark.parametrize("config", [pytest.param(c, id=c.name) for c in STATEFUL_CONFIGS])
def test_random_operations(config):
    cache = make_cache(**config.cache)
    ops, runner = _run_or_shrink(cache, config.seed, config.num_ops)
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
