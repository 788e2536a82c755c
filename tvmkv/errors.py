"""Named exceptions. Each message names the value, what was expected and what to do."""

from __future__ import annotations


class TvmkvError(Exception):
    """Base class of tvmkv's own exceptions."""


class OutOfPagesError(TvmkvError, RuntimeError):
    """``begin_forward`` (or a fork) needs more free pages than the cache has.

    Raised before anything is allocated, so the caller can preempt a sequence and retry.

    Attributes
    ----------
    needed : int
        Pages the operation needs.
    available : int
        Pages free when it was attempted.
    what : str
        The operation ("this forward", "fork of sequence 3 at 40", ...).
    """

    def __init__(self, needed: int, available: int, what: str = "this forward"):
        self.needed = needed
        self.available = available
        self.what = what
        super().__init__(
            f"{what} needs {needed} free pages but only {available} are free; "
            "remove, pop or preempt a sequence and retry, or build the cache with more pages"
        )


class ForwardStateError(TvmkvError, RuntimeError):
    """A forward-protocol call out of order (attention outside begin/end, nested begin, ...)."""


class SequenceSwappedError(TvmkvError, RuntimeError):
    """The sequence is swapped out to host memory (``swap_out``): it cannot join a forward, be forked,
    popped or read until ``swap_in`` brings it back. ``seq_id`` names it."""

    def __init__(self, seq_id):
        self.seq_id = seq_id
        super().__init__(
            f"sequence {seq_id} is swapped out to host memory; call swap_in([{seq_id}]) first "
            "(or remove_sequence to drop it)"
        )


class IntegrityError(TvmkvError, AssertionError):
    """``check_integrity`` found the page accounting inconsistent (a bug in tvmkv)."""


class ShardDivergenceError(IntegrityError):
    """The shards of a tensor-parallel cache no longer hold the same page tables (docs/layout.md,
    "Tensor parallelism"): every sequence operation must be issued to every shard, in the same order.
    ``shard`` names the first shard that differs from shard 0."""

    def __init__(self, shard: int, detail: str):
        self.shard = shard
        super().__init__(
            f"shard {shard} diverged from shard 0: {detail}; issue every sequence operation to all shards in the "
            "same order, and rebuild the cache (its shards cannot be reconciled)"
        )
