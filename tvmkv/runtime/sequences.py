"""The sequence table: each sequence's page list, length, sliding window and token-tree state.

Plain Python bookkeeping over a :class:`~tvmkv.runtime.pages.PagePool` (no device code). Slots are
indices within a sequence: slot ``j`` lives in page ``pages[j // P]`` at offset ``j % P``
(docs/layout.md, "Pages"). A sequence's page list is stored once, as an int32 NumPy array that the
step planner concatenates directly; it changes only through :class:`Sequence`'s methods, so there is
no second copy to go stale.

The table validates nothing the caller passes except ids (:func:`check_id`, the one id rule); the
cache facade validates a whole call first and then mutates through the methods here, which cannot
fail for reasons the caller controls.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import SequenceSwappedError
from .pages import PagePool


def as_int(value, name: str) -> int:
    """``value`` as a Python int (ints and NumPy integers; not bool, not float): TypeError names it."""
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an int") from None


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_id(seq_id, name: str = "seq_id") -> int:
    """The one id rule of every method: a sequence id is an int (not a bool or a float)."""
    return seq_id if type(seq_id) is int else as_int(seq_id, name)


def check_new_id_range(seq_id, name: str = "seq_id") -> int:
    """:func:`check_id`, and an id a new sequence may take: int64, as TVM's sequence ids (and the
    integrity digest's records) are. Ids outside it can then never be found, only refused."""
    seq_id = check_id(seq_id, name)
    if not _INT64_MIN <= seq_id <= _INT64_MAX:
        raise ValueError(f"{name} {seq_id} is outside int64 [{_INT64_MIN}, {_INT64_MAX}]; pick an id in that range")
    return seq_id


@dataclass(slots=True)
class Sequence:
    """One sequence: pages, slots used and window / token-tree state.

    Window fields (docs/layout.md, "Sliding window with attention sink"): slots ``[0, sink_end)`` are
    the attention sink, ``[sink_end, window_start)`` slid out; positions index the kept tokens (TVM's
    rule), so slot ``j >= window_start`` sits at position ``j - (window_start - sink_end)``. Tree
    fields: the last ``len(tree_parent)`` slots are uncommitted token-tree nodes (parent index among
    them or -1, depth).
    """

    kv_len: int = 0  # slots used
    sink_end: int = 0
    window_start: int = 0
    dropped: bool = False  # the window has dropped tokens (then forks and imports are refused)
    window: int = 0  # sliding window size (0 = none)
    sink: int = 0
    # tokens in the whole pages a fork shares between parent and child (lowered by pop_n): TVM's cache keeps
    # them in a block both descend from, which never slides, so a window makes them attention sinks
    fork_prefix: int = 0
    tree_parent: list = field(default_factory=list)
    tree_depth: list = field(default_factory=list)
    tree_last: int = 0  # nodes the last token-tree forward appended (the last of tree_parent)
    # the decode plan (plan.Planner's step number) this record is exactly as that plan left it for,
    # advanced by repeated steps; 0 once anything else changes it (its pages, length or window)
    stamp: int = 0
    # its row of the device page table (device_plan.DevicePlanner; assigned by SequenceTable.add) and how many
    # of its first pages that row holds as they are now (every change of the page list but an append
    # lowers it; the device planner raises it when it writes the row)
    row: int = -1
    synced: int = 0
    _buf: np.ndarray = field(default_factory=lambda: np.zeros(16, np.int32), repr=False)
    _n: int = 0
    pages: np.ndarray = field(init=False, repr=False)  # int32 view _buf[:_n]; change it only by methods
    last_page: int = field(init=False, default=-1)

    def __post_init__(self):
        self._set(self._n)

    # ------------------------------------------------------------------ derived
    @property
    def num_pages(self) -> int:
        return self._n

    @property
    def tree_start(self) -> int:
        """First slot of the uncommitted token-tree nodes."""
        return self.kv_len - len(self.tree_parent)

    @property
    def slid(self) -> bool:
        """Whether the window has dropped tokens (pop_n is then limited to the window's tokens)."""
        return self.dropped

    @property
    def shared_prefix(self) -> int:
        """The tokens of ``fork_prefix`` the sequence still holds: a window's sinks at least."""
        return min(self.fork_prefix, self.kv_len)

    @property
    def gap(self) -> int:
        """Slots between the sink and the window's first kept slot (slid out, not yet freed)."""
        return self.window_start - self.sink_end

    def position(self, slot: int) -> int:
        """Position of a kept slot: its index among the kept tokens."""
        return slot if slot < self.sink_end else slot - self.gap

    @property
    def committed_length(self) -> int:
        """Committed tokens held (tokens a window dropped do not count)."""
        return self.position(self.tree_start)

    @property
    def length(self) -> int:
        return self.committed_length + len(self.tree_parent)

    @property
    def poppable(self) -> int:
        """Most tokens ``pop_n`` may drop: all of them, or, once a window slid, those after its start."""
        return self.kv_len - self.window_start if self.slid else self.length

    # ------------------------------------------------------------------ page list (the only writers)
    def _set(self, n: int) -> None:
        self._n, self.pages, self.stamp = n, self._buf[:n], 0
        self.last_page = int(self._buf[n - 1]) if n else -1
        if self.synced > n:
            self.synced = n

    def set_pages(self, pages) -> None:
        self.synced = 0
        pages = np.asarray(pages, np.int32)
        if len(pages) > len(self._buf):
            self._buf = np.zeros(max(16, 2 * len(pages)), np.int32)
        self._buf[: len(pages)] = pages
        self._set(len(pages))

    def append_pages(self, pages) -> None:
        n = self._n + len(pages)
        if n > len(self._buf):
            buf = np.zeros(2 * n, np.int32)
            buf[: self._n] = self.pages
            self._buf = buf
        self._buf[self._n : n] = pages
        self._set(n)

    def append_page(self, page: int) -> None:
        """:meth:`append_pages` of one page (the planner's decode step: no list, no slice copy)."""
        n = self._n
        if n == len(self._buf):
            buf = np.zeros(max(16, 2 * n), np.int32)
            buf[:n] = self.pages
            self._buf = buf
        self._buf[n] = page
        self._n, self.pages, self.last_page, self.stamp = n + 1, self._buf[: n + 1], page, 0

    def replace_last_page(self, page: int) -> None:
        self._buf[self._n - 1] = page
        self.last_page, self.stamp = page, 0
        if self.synced >= self._n:
            self.synced = self._n - 1

    def truncate_pages(self, keep: int) -> list:
        """Keep the first ``keep`` pages; return the dropped ones."""
        dropped = self.pages[keep:].tolist()
        self._set(min(keep, self._n))
        return dropped

    def cut_pages(self, first: int, last: int) -> list:
        """Remove pages ``[first, last)`` (a slid-out window); return them."""
        dropped = self.pages[first:last].tolist()
        if self.synced > first:
            self.synced = first
        rest = self._buf[last : self._n].copy()
        self._buf[first : first + len(rest)] = rest
        self._set(self._n - len(dropped))
        return dropped


@dataclass(frozen=True)
class SequenceInfo:
    """A read-only snapshot of one sequence (``PagedAttentionKVCache.sequence_info``)."""

    length: int  # tokens held: appended, not popped, not dropped by a window (tree nodes included)
    kv_len: int  # slots used in ``pages`` (what the pages hold)
    pages: tuple  # page ids in slot order
    window: int  # sliding window size, 0 for none
    sink: int  # attention sink in effect: at least fork_prefix until the window first slides, then fixed
    slid: bool  # whether the window has dropped tokens (slots are no longer positions)
    num_tree_nodes: int  # uncommitted token-tree nodes at the end
    poppable: int  # most tokens pop_n may drop now (fewer than length once a window slid)
    fork_prefix: int = 0  # tokens in whole pages shared with a fork (parent or child): a window keeps them as sinks


class SequenceTable:
    """Sequences by id, on the device (``resident``) or swapped out to host memory (``swapped``).

    Every page a resident sequence lists holds one reference of the pool for it; a swapped sequence
    lists no pages. ``version`` changes with every change of a page list, length or window, so the
    planner's repeat-decode step (``repeat_decode.RepeatDecode``) knows when its plan went stale.
    """

    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self.resident: dict = {}
        self.swapped: dict = {}  # seq id -> Sequence (no pages), in swap order
        # ids claimed by something in progress (an import): seq id -> (what, abandon callback)
        self.reserved: dict = {}
        self.version = 0
        self.num_windowed = 0  # resident sequences with a sliding window (the planner skips windows at 0)
        # rows of the device page table: one per sequence (resident or swapped), reused after removal
        self.num_rows = 0
        self._free_rows: list = []

    # ------------------------------------------------------------------ lookups (ids checked)
    def get(self, seq_id) -> Sequence:
        """The resident sequence ``seq_id``: KeyError (unknown), SequenceSwappedError, TypeError."""
        seq = self.resident.get(seq_id) if type(seq_id) is int else None
        if seq is None:
            seq_id = check_id(seq_id)
            seq = self.resident.get(seq_id)
            if seq is None:
                if seq_id in self.swapped:
                    raise SequenceSwappedError(seq_id)
                if seq_id in self.reserved:
                    raise KeyError(f"sequence {seq_id} is not usable yet: {self.reserved[seq_id][0]}")
                raise KeyError(f"sequence {seq_id!r} is not in the cache; add it with add_sequence first")
        return seq

    def knows(self, seq_id) -> bool:
        seq_id = check_id(seq_id)
        return seq_id in self.resident or seq_id in self.swapped

    def is_swapped(self, seq_id) -> bool:
        """Whether ``seq_id`` is swapped out (KeyError when the table does not know it)."""
        seq_id = check_id(seq_id)
        if seq_id in self.swapped:
            return True
        self.get(seq_id)
        return False

    def check_new(self, seq_id, name: str = "seq_id") -> int:
        seq_id = check_new_id_range(seq_id, name)
        if seq_id in self.resident or seq_id in self.swapped:
            raise KeyError(f"{name} {seq_id} is already in the cache; remove it first or pick another id")
        if seq_id in self.reserved:
            raise KeyError(f"{name} {seq_id} is taken: {self.reserved[seq_id][0]}; pick another id")
        return seq_id

    def tree_pages(self) -> dict:
        """``{page: seq_id}`` of the pages that hold uncommitted token-tree nodes (a commit compacts
        them in place, so no other sequence may share them)."""
        P, out = self.page_size, {}
        for sid, seq in self.resident.items():
            if seq.tree_parent:
                out.update(dict.fromkeys(seq.pages[seq.tree_start // P :].tolist(), sid))
        return out

    def info(self, seq_id) -> SequenceInfo:
        seq_id = check_id(seq_id)
        seq = self.swapped[seq_id] if seq_id in self.swapped else self.get(seq_id)
        return SequenceInfo(
            seq.length,
            seq.kv_len,
            tuple(seq.pages.tolist()),
            seq.window,
            seq.sink_end if seq.window else 0,  # the sink in effect (a fork's shared pages may lengthen it)
            seq.slid,
            len(seq.tree_parent),
            seq.poppable,
            seq.shared_prefix,
        )

    # ------------------------------------------------------------------ changes (validated by the caller)
    def add(self, seq_id: int, pages=(), length: int = 0) -> Sequence:
        """A new resident sequence over ``pages`` (the caller holds one reference on each for it)."""
        seq = self.resident[seq_id] = Sequence()
        if self._free_rows:
            seq.row = self._free_rows.pop()
        else:
            seq.row, self.num_rows = self.num_rows, self.num_rows + 1
        seq.set_pages(list(pages))
        seq.kv_len = length
        self.version += 1
        return seq

    def remove(self, seq_id: int) -> None:
        """Remove a resident sequence (its references are released) or a swapped one."""
        if seq_id in self.swapped:
            seq = self.swapped.pop(seq_id)
        else:
            seq = self.resident.pop(seq_id)
            seq.stamp = 0
            self.num_windowed -= seq.window > 0
            self.pool.release(seq.pages)
        self._free_rows.append(seq.row)
        seq.row, seq.synced = -1, 0
        self.version += 1

    def fork(self, parent: Sequence, child_id: int, fork_pos: int, copy_partial: Callable) -> None:
        """``child_id`` shares the full pages of ``parent``'s first ``fork_pos`` slots; a partial last
        page is copied into a new page by ``copy_partial(src, dst, num_slots)`` (one free page is
        needed then). The child starts without a sliding window (TVM's rule; the parent has not slid)."""
        P = self.page_size
        full, partial = divmod(fork_pos, P)
        shared = parent.pages[:full].tolist()
        self.pool.hold(shared)
        if partial:
            page = self.pool.alloc(1)[0]
            copy_partial(int(parent.pages[full]), page, partial)
            shared.append(page)
        # TVM's cache moves the shared whole pages into a block both sequences descend from, which never
        # slides: a window of either keeps those tokens as sinks (the copied partial page is the child's own)
        child = self.add(child_id, shared, fork_pos)
        child.fork_prefix = full * P
        parent.fork_prefix = max(parent.fork_prefix, full * P)
        self._sinks(parent)

    def truncate(self, seq: Sequence, kv_len: int) -> None:
        """Keep the first ``kv_len`` slots; pages no longer used are released."""
        self.pool.release(seq.truncate_pages(-(-kv_len // self.page_size)))
        seq.kv_len, seq.stamp = kv_len, 0
        # popped into the inherited prefix: TVM forks again at the new length (whole pages shared)
        seq.fork_prefix = min(seq.fork_prefix, kv_len // self.page_size * self.page_size)
        self._sinks(seq)
        if seq.window_start > max(kv_len, seq.sink_end):
            seq.window_start = max(kv_len, seq.sink_end)
        self.version += 1

    def set_window(self, seq: Sequence, window: int, sink: int) -> None:
        self.num_windowed += (window > 0) - (seq.window > 0)
        seq.window, seq.sink = window, sink
        seq.stamp = 0
        self._sinks(seq)
        self.version += 1  # (the window applies from the end of the next forward on, as in TVM's cache)

    @staticmethod
    def _sinks(seq: Sequence) -> None:
        """The attention sink of a window that has not slid yet: ``sink`` tokens, or the tokens it shares with a
        fork where those are more (TVM's cache never slides a block that forks share), and fewer than the window
        (a fork of a windowed sequence may share more; TVM's cache breaks there, tvmkv keeps window - 1)."""
        if seq.window and not seq.dropped:
            sink = min(max(seq.sink, seq.shared_prefix), seq.window - 1)
            if (seq.sink_end, seq.window_start) != (sink, sink):
                seq.sink_end = seq.window_start = sink
                seq.stamp = 0  # (a kept decode plan's record of it is out of date)

    def slide(self, seq: Sequence) -> None:
        """Drop tokens beyond the window (keep sink + the last window - sink) and free whole stale pages."""
        if not seq.window:
            return
        P = self.page_size
        kept = min(seq.kv_len, seq.sink_end) + max(0, seq.kv_len - seq.window_start)
        excess = kept - seq.window
        if excess <= 0:
            return
        seq.window_start += excess
        seq.dropped, seq.stamp = True, 0
        self.version += 1
        first, last = -(-seq.sink_end // P), seq.window_start // P
        if last > first:
            self.pool.release(seq.cut_pages(first, last))
            drop = (last - first) * P
            seq.window_start -= drop
            seq.kv_len -= drop

    def grow(self, seq: Sequence, pages: list) -> None:
        """Append freshly allocated ``pages`` to ``seq``'s page list."""
        seq.append_pages(pages)
        self.version += 1

    def grow_many(self, seqs: list, page_lists: list) -> None:
        """Append ``page_lists[i]`` (freshly allocated) to ``seqs[i]``'s page list, for every ``i``."""
        for seq, pages in zip(seqs, page_lists):
            if len(pages) == 1:
                seq.append_page(pages[0])
            else:
                seq.append_pages(pages)
        self.version += 1

    def grow_each(self, seqs: list, pages: list) -> None:
        """Append ``pages[i]`` (freshly allocated) to ``seqs[i]``'s page list, for every ``i``."""
        for seq, page in zip(seqs, pages):
            seq.append_page(page)
        self.version += 1

    def copy_on_write(self, seq: Sequence, page: int) -> None:
        """``page`` (freshly allocated, a copy of the shared last page) replaces that page."""
        self.pool.release([seq.last_page])
        seq.replace_last_page(page)
        self.version += 1

    def swap_out(self, seq_id: int) -> Sequence:
        """Move ``seq_id`` to the swapped table; its page references are released."""
        seq = self.resident.pop(seq_id)
        self.num_windowed -= seq.window > 0
        self.pool.release(seq.truncate_pages(0))
        self.swapped[seq_id] = seq
        self.version += 1
        return seq

    def swap_in(self, seq_id: int, pages: list) -> None:
        """Back on the device over ``pages`` (the caller holds one reference on each for it)."""
        seq = self.swapped.pop(seq_id)
        seq.set_pages(pages)
        self.resident[seq_id] = seq
        self.num_windowed += seq.window > 0
        self.version += 1

    def clear(self) -> None:
        for seq in self.resident.values():
            seq.stamp = 0
        self.resident.clear()
        self.swapped.clear()
        self.reserved.clear()
        self.num_windowed = 0
        self.num_rows, self._free_rows = 0, []
        self.version += 1

    # ------------------------------------------------------------------ integrity
    def digest(self, h) -> None:
        """Feed every sequence's record to the hashlib object ``h`` in id order: resident ones (page
        list, slots, window, token tree) then swapped ones (no pages); not the device-table rows."""
        for table, tag in ((self.resident, b"R"), (self.swapped, b"S")):
            for sid in sorted(table):
                seq = table[sid]
                window = (seq.sink_end, seq.window_start, int(seq.dropped), seq.window, seq.sink, seq.fork_prefix)
                fields = (sid, seq.kv_len, *window)
                sizes = (len(seq.tree_parent), seq.tree_last, seq.num_pages)
                h.update(tag + np.asarray(fields + sizes + tuple(seq.tree_parent), np.int64).tobytes())
                h.update(seq.pages.tobytes())
        h.update(np.asarray(sorted(self.reserved), np.int64).tobytes())  # ids claimed by imports

    def check(self) -> list:
        """Problems (strings) of the table: page counts, lengths, windows, trees, stored page lists."""
        P, problems = self.page_size, []
        for sid, seq in self.resident.items():
            pages = seq.pages.tolist()
            if len(set(pages)) != len(pages):
                problems.append(f"sequence {sid} holds a page twice")
            if len(pages) != -(-seq.kv_len // P):
                problems.append(f"sequence {sid}: {len(pages)} pages for {seq.kv_len} slots")
            if seq.last_page != (pages[-1] if pages else -1):
                problems.append(f"sequence {sid}: its stored page list is out of step")
            if any(not 0 <= p < self.pool.num_pages for p in pages):
                problems.append(f"sequence {sid} lists a page id outside [0, {self.pool.num_pages})")
            if not (seq.tree_start >= 0 and len(seq.tree_depth) == len(seq.tree_parent)):
                problems.append(f"sequence {sid}: inconsistent token tree")
            if seq.window and not (seq.sink_end <= seq.window_start <= max(seq.kv_len, seq.sink_end)):
                problems.append(f"sequence {sid}: window bounds {seq.sink_end}, {seq.window_start}, {seq.kv_len}")
        windowed = sum(seq.window > 0 for seq in self.resident.values())
        if windowed != self.num_windowed:
            problems.append(f"{windowed} resident sequences have a window, num_windowed says {self.num_windowed}")
        both = set(self.swapped) & set(self.resident)
        if both:
            problems.append(f"sequences {sorted(both)} are both on the device and swapped out")
        for sid, seq in self.swapped.items():
            if seq.num_pages:
                problems.append(f"swapped sequence {sid} still holds device pages")
        rows = [seq.row for seq in (*self.resident.values(), *self.swapped.values())]
        if (
            len(set(rows)) != len(rows)
            or any(not 0 <= r < self.num_rows for r in rows)
            or set(rows) & set(self._free_rows)
        ):
            problems.append(
                f"device page table rows {sorted(rows)} are not distinct rows in use of [0, {self.num_rows})"
            )
        for sid, seq in self.resident.items():
            if not 0 <= seq.synced <= seq.num_pages:
                problems.append(f"sequence {sid}: {seq.synced} pages in the device table for {seq.num_pages}")
        return problems
