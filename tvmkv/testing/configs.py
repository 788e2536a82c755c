"""Configuration tables shared by the tests, ``python -m tvmkv replay`` and ``bench/soak.py``.

Every entry is a set of :func:`tvmkv.testing.make_cache` keywords (options it leaves out take its
defaults, the replay shape). ``scripts/gpu_configs.json`` lists the kernel sets the GPU machine needs;
:func:`kernel_configs` gives the ones these tables need, in the same format, so a test can check that
the file covers them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from ..tir import ROPE_MODES


class ReplayConfig(NamedTuple):
    """One cache configuration the replay scenarios run on (the other options: make_cache's defaults)."""

    dtype: str
    head_dim: int
    rope_mode: str
    group: int
    page_size: int

    def cache_options(self) -> dict:
        """The :func:`~tvmkv.testing.make_cache` keywords of this configuration."""
        return dict(
            dtype=self.dtype,
            head_dim=self.head_dim,
            rope_mode=self.rope_mode,
            group=self.group,
            page_size=self.page_size,
        )


# A covering set for the scenario replays (tests/test_cache.py): every value of every axis appears
# (dtype x head_dim x rope x group x page), over 2 KV heads.
REPLAY_CONFIGS = [
    ReplayConfig("float32", 64, "none", 1, 16),
    ReplayConfig("float32", 128, "normal", 4, 1),
    ReplayConfig("float32", 64, "inline", 8, 64),
    ReplayConfig("float16", 64, "normal", 4, 16),
    ReplayConfig("float16", 128, "none", 8, 16),
    ReplayConfig("float16", 128, "inline", 1, 64),
    ReplayConfig("float16", 64, "inline", 4, 1),
    ReplayConfig("float32", 128, "normal", 8, 64),
]

# The cache of the randomized stateful runs (tests/test_stateful.py, bench/soak.py): tiny shapes and
# few pages (``max_total_seq_len`` fills the pool), so that out-of-pages happens.
STATEFUL_CACHE = MappingProxyType(
    dict(
        num_layers=1,
        num_qo_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=4,
        num_pages=16,
        dtype="float32",
        rope_mode="normal",
        sliding=True,
        max_batch_size=4,
        prefill_chunk_size=32,
    )
)


class StatefulConfig(NamedTuple):
    """One randomized stateful run: the cache, how many operations, the seed of the draw, the operation
    families beyond the base mix (``tvmkv.testing.stateful.EXTRAS``) and the pool of sequence ids."""

    name: str
    cache: Mapping  # make_cache keywords
    num_ops: int
    seed: int
    extras: tuple = ()
    id_pool: int = 8


def _stateful(**changes) -> Mapping:
    return MappingProxyType({**STATEFUL_CACHE, **changes})


STATEFUL_CONFIGS = [
    StatefulConfig("p4-normal-window", _stateful(), 700, 11),
    StatefulConfig(
        "p1-inline-window",
        _stateful(
            page_size=1,
            num_pages=24,
            rope_mode="inline",
            num_qo_heads=4,
            num_kv_heads=2,
            num_layers=2,
            max_batch_size=3,
            prefill_chunk_size=16,
        ),
        500,
        12,
    ),
    StatefulConfig(
        "p8-none-nowindow",
        _stateful(
            page_size=8,
            num_pages=10,
            rope_mode="none",
            num_kv_heads=2,
            sliding=False,
            max_batch_size=6,
            prefill_chunk_size=48,
        ),
        600,
        13,
    ),
    # the operations that found issue 14's memory-safety bugs, on STATEFUL_CACHE's kernel set: import /
    # export (into reused ids), swap, prefix reuse; "views": batches up to 16 and chunks up to 128 with
    # runs of repeated decode steps, so an index-buffer slot caches more than 512 views in a long run
    StatefulConfig("p4-interop-swap", _stateful(num_pages=20), 600, 14, ("interop", "swap")),
    StatefulConfig("p4-prefix", _stateful(num_pages=24), 600, 15, ("prefix", "interop", "swap")),
    StatefulConfig(
        "p4-views-all",
        _stateful(num_pages=160, max_batch_size=16, prefill_chunk_size=128),
        500,
        16,
        ("views", "interop", "swap", "prefix"),
        24,
    ),
]


def kernel_configs() -> list:
    """The kernel sets the GPU runs of these tables need, as ``tvmkv build --config`` entries.

    The scenario replays on every :data:`REPLAY_CONFIGS` entry (with and without sliding-window
    kernels: the "sliding" scenario needs them), ``python -m tvmkv replay`` on the default shape in
    every RoPE mode, and ``bench/soak.py`` on :data:`STATEFUL_CACHE` (``--configs`` naming the
    :data:`STATEFUL_CONFIGS` entries of its kernel set; their import/export operations also need that
    set's "interop" family, which this list does not name yet).
    """
    from .caches import cache_kwargs

    def entry(options, **axes) -> dict:
        kw = cache_kwargs(**options)
        out = {k: kw[k] for k in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype", "rope_mode")}
        return {**out, "sliding": kw["support_sliding_window"], **axes}

    entries = [entry(c.cache_options(), sliding=[False, True]) for c in REPLAY_CONFIGS]
    entries.append(entry({}, rope_mode=list(ROPE_MODES), sliding=[False, True]))
    entries.append(entry(STATEFUL_CACHE))
    return entries
