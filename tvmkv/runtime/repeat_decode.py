"""The repeat-decode fast path: the last decode step's plan, advanced or patched in place.

A decode step of the same batch as the decode step before it (same ids in the same order, one token
each, nothing changed in between) needs no planning: :class:`RepeatDecode` keeps the previous step's
arrays and advances them in place (positions, slots and last-page fill + 1; a sequence whose new
token opens a page gets one). It is kept flat on purpose: NumPy views into the host buffer and a few
ints, no objects to walk per step. A step of the same size in which a few rows hold another sequence
(an arrival in a departed sequence's row, a fork in its parent's) patches those arrays instead: the
kept rows advance in place, only the changed rows are written, and page_indptr / page_indices from
the first changed row on. The kept rows' records must be exactly as the last step left them: each
decode plan stamps its records (``Sequence.stamp``), and every change of a record's pages, length or
window clears the stamp, so one C-level pass over the stamps proves it.

A :class:`RepeatDecode` is made by the facade after every decode step the planner
(:class:`~tvmkv.runtime.plan.Planner`) planned anew on the host; ``begin_forward`` offers it the next
step first and plans anew only when it declines.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

from .index_buffer import IndexBuffers
from .pages import PagePool
from .plan import FEW, StepPlan, decode_pages
from .sequences import SequenceTable

_KV_LEN = attrgetter("kv_len")
_PAGES = attrgetter("pages")
_LAST_PAGE = attrgetter("last_page")
_STAMP = attrgetter("stamp")
_INT = {int}


@dataclass(slots=True)
class RepeatDecode:
    """The last decode step's plan, kept so that a decode step of the same batch (same ids in the same
    order, one token each, nothing changed in between: the pool's and the table's versions) advances it
    in place (:meth:`advance`), and one of the same size with a few rows replaced patches it
    (:meth:`_patch`; the module docstring). The arrays are views of the packed host buffer, which still
    holds that step's index arrays. Made after every decode step planned anew, so it records only what
    it is given; the views and counts it advances are taken on its first use (:meth:`ready`): a batch
    that changes every step pays nothing for them."""

    seq_ids: list
    seqs: list
    ones: list  # [1] * B, compared with the next step's append_lengths
    pool_version: int  # pool.version after the step
    table_version: int  # table.version after the step
    host: np.ndarray  # the packed host buffer the views below point into
    plan: StepPlan
    page_size: int
    generation: int  # IndexBuffers.generation the cached forwards' views belong to
    forwards: dict  # device slot -> bound launch.Forward
    pool: PagePool
    table: SequenceTable
    ib: IndexBuffers
    npages: Any  # int64 [B] pages of each sequence
    copy_page: Any = None  # copy_page(src, dst, num_slots) of the cache (copy-on-write of a new row)
    moves: bool = True  # whether rows that moved are patched too (False: a device planner plans those)
    # taken from ``plan`` by ready():
    q_pos: Any = None
    block: Any = None  # [3, B] view of q_pos, slots, last_page_len (rows moved together)
    slots: Any = None
    last_page_len: Any = None
    advance_view: Any = None  # one view from q_pos to the end of last_page_len (padding included)
    page_indptr: Any = None
    layout: Any = None  # PackedLayout
    pi: int = 0  # offset of page_indices in the packed buffer
    nnz: int = 0  # page_indices entries
    max_keys: int = 0  # the longest sequence's kv length after the step
    room: int = 0  # steps before some sequence's last page is full (P - max(last_page_len))
    is_ready: bool = False

    @classmethod
    def after(
        cls,
        plan: StepPlan,
        seqs: list,
        npages,
        ib: IndexBuffers,
        pool: PagePool,
        table: SequenceTable,
        forward,
        copy_page=None,
        moves: bool = True,
    ) -> RepeatDecode:
        """Remember the decode step ``plan`` (just bound as ``forward``; ``npages`` its pages per
        sequence, which the kept plan then owns). ``copy_page``: the cache's page copy, for a step
        that replaces rows (:meth:`advance`); without it such a step takes the general path.
        ``moves``: whether a step whose rows moved is patched too (False where a device planner
        plans such steps: only rows replaced in place are patched here)."""
        return cls(
            plan.seq_ids,
            seqs,
            plan.lengths,  # [1] * B (a decode plan's)
            pool.version,
            table.version,
            ib.host,
            plan,
            table.page_size,
            ib.generation,
            {plan.slot: forward},
            pool,
            table,
            ib,
            npages,
            copy_page,
            moves,
        )

    def ready(self) -> None:
        """Take the views and counts :meth:`advance` updates from the plan (once)."""
        plan, host = self.plan, self.host
        layout, shape = plan.layout, plan.shape
        views = shape.views if shape is not None and shape.host is host else None
        if views is None:
            views = {name: layout.array(host, name) for name in ("q_pos", "slots", "last_page_len", "page_indptr")}
        lpl = self.last_page_len = views["last_page_len"]
        self.slots, self.page_indptr = views["slots"], views["page_indptr"]
        self.q_pos = views["q_pos"] if "q_pos" in views else layout.array(host, "q_pos")
        self.npages = np.asarray(self.npages, np.int64)
        self.advance_view = host[layout.arrays["q_pos"][0] : layout.arrays["last_page_len"][0] + len(self.seqs)]
        q0 = layout.arrays["q_pos"][0]
        stride = layout.arrays["slots"][0] - q0  # q_pos, slots, last_page_len: one [3, stride] block
        self.block = host[q0 : q0 + 3 * stride].reshape(3, stride)[:, : len(self.seqs)]
        self.layout, self.pi, self.nnz, self.max_keys = layout, layout.page_indices_at, plan.nnz, plan.max_keys
        self.room = self.page_size - int(lpl.max())
        self.is_ready = True

    def advance(self, seq_ids, append_lengths) -> bool:
        """Advance the kept plan by one decode step when ``(seq_ids, append_lengths)`` repeats it, or
        repeats it but for a few rows whose sequence changed (:meth:`_patch`).

        Returns False, having changed nothing, when the step is not such a step or needs what the
        general path handles (a new page with too few free pages: the general path raises
        OutOfPagesError; a bigger index buffer). The batch was validated at the step this one repeats.
        """
        pool, table, ib = self.pool, self.table, self.ib
        if self.host is not ib.host:
            return False
        same = pool.version == self.pool_version and table.version == self.table_version
        if not same and self.copy_page is None:
            return False
        ids, lens = list(seq_ids), list(append_lengths)
        if lens != self.ones:
            return False
        same = same and ids == self.seq_ids
        # == also lets 1.0 and True through: only ints (and NumPy integers) repeat the step; anything
        # else takes the general path, whose validation refuses it
        kinds = set(map(type, ids)).union(map(type, lens))
        if kinds != _INT and (not same or not all(k is int or issubclass(k, np.integer) for k in kinds)):
            return False
        if not self.is_ready:
            self.ready()
        if not same:
            return self._patch(ids)
        seqs, P, lpl = self.seqs, self.page_size, self.last_page_len
        opens = np.flatnonzero(lpl == P) if self.room == 0 else np.zeros(0, np.int64)  # new tokens opening a page
        pi = self.pi
        if len(opens):
            if len(opens) > pool.num_free or pi + self.nnz + len(opens) > ib.capacity:
                return False
            new = pool.alloc(len(opens))
            stamp = self.plan.stamp
            for i, page in zip(opens.tolist(), new):
                table.grow(seqs[i], [page])
                seqs[i].stamp = stamp  # grown as this plan grows it
            self.npages[opens] += 1
            self.nnz += len(opens)
            np.cumsum(self.npages, out=self.page_indptr[1:])
            ib.write_concatenated(pi, self.nnz, map(_PAGES, seqs))
        # every token is one slot and one position further than its sequence's previous one, and every
        # last page one slot fuller: q_pos, slots, last_page_len (+ unread padding) += 1
        self.advance_view += 1
        if len(opens):
            lpl[opens] = 1
            self.slots[opens] = np.asarray(new, np.int32) * P
            self.room = P - int(lpl.max())
        else:
            self.room -= 1
        for seq in seqs:
            seq.kv_len += 1
        self.max_keys += 1
        self.pool_version, self.table_version = pool.version, table.version
        return True

    def _patch(self, ids: list) -> bool:
        """:meth:`advance` of a batch of the same size in which a few rows hold another sequence (an
        arrival in a departed sequence's row, a fork replacing its parent): the other rows advance as
        in a repeated step, the changed rows are written anew (their pages, copy-on-write of a shared
        partial last page included), page_indptr and page_indices rewritten. Taken only when every
        kept row's record is exactly as the last step left it (``Sequence.stamp``: any change of its
        pages, length or window clears it) and no kept row's partial last page became shared; the new
        rows are checked as the general path checks them (resident ints, no duplicate, no window or
        token tree: anything else takes the general path, which raises what it must)."""
        old, B, P = self.seq_ids, len(self.seq_ids), self.page_size
        if len(ids) != B or type(ids[0]) is not int:  # (mixed kinds were sent back by advance)
            return False
        limit = max(2, B >> 3)  # rows new to the batch (more: the planner's paths are as fast)
        diff = [i for i, (a, b) in enumerate(zip(ids, old)) if a != b]
        if not diff or len(set(ids)) != B:
            return False
        src = None  # rows moved: the old row of each row's sequence (None: new to the batch)
        if len(diff) > limit:
            if B > FEW or not self.moves:  # moving many rows in Python costs more than the other paths
                return False
            row_of = {s: i for i, s in enumerate(old)}
            src = list(map(row_of.get, ids))
            diff = [i for i, j in enumerate(src) if j is None]
            if len(diff) > limit:
                return False
        pool, table, ib, stamp = self.pool, self.table, self.ib, self.plan.stamp
        resident = table.resident
        seqs: list = self.seqs.copy() if src is None else [None if j is None else self.seqs[j] for j in src]
        for i in diff:
            seq = resident.get(ids[i])
            if seq is None or seq.stamp == stamp or seq.window or seq.tree_parent:
                return False
            seqs[i] = seq
        if list(map(_STAMP, seqs)).count(stamp) != B - len(diff):  # a kept row's record changed
            return False
        hist = [seqs[i].kv_len for i in diff]
        cow: list = []
        shared = pool.shared
        hits = shared.intersection(map(_LAST_PAGE, seqs)) if shared else shared
        if hits:  # some last page is shared: the new rows' partial ones get a copy
            cow = [i for i in diff if seqs[i].last_page in hits and seqs[i].kv_len % P]
            # a kept row may share one of those pages (with a new row, or with a sequence outside the
            # batch): when more rows end in a shared page than get a copy, look at every kept row
            if sum(map(hits.__contains__, map(_LAST_PAGE, seqs))) > len(cow):
                for i, seq in enumerate(seqs):
                    if seq.last_page in hits and seq.kv_len % P and i not in diff:
                        return False  # a kept row's partial last page is shared now: the general path
        lpl, npages = self.last_page_len, self.npages  # (Python on a list beats NumPy on a few elements)
        if src is None:
            kept_opens = [i for i, n in enumerate(lpl.tolist()) if n == P and i not in diff] if self.room <= 0 else []
            nnz = self.nnz + len(kept_opens) + sum(h // P + 1 - int(npages[i]) for i, h in zip(diff, hist))
        else:
            was, had = lpl.tolist(), npages.tolist()
            kept_opens = [i for i, j in enumerate(src) if j is not None and was[j] == P] if self.room <= 0 else []
            nnz = sum(had[j] for j in src if j is not None) + len(kept_opens) + sum(h // P + 1 for h in hist)
        new_opens = [i for i, h in zip(diff, hist) if not h % P]
        needed = len(kept_opens) + len(new_opens) + len(cow)
        if self.pi + max(nnz, 1) > ib.capacity or (needed and not pool.ensure_free(needed)):
            return False
        if needed:
            decode_pages(seqs, sorted(kept_opens + new_opens), cow, pool, table, self.copy_page, P)
        # the kept rows as in a repeated step (moved first), then the new rows and the kept rows that
        # opened a page
        if src is not None:
            keep = [i if j is None else j for i, j in enumerate(src)]
            block = self.block
            block[...] = block[:, keep]
            npages[:] = npages[keep]
        self.advance_view += 1
        q_pos, slots = self.q_pos, self.slots
        for i, h in zip(diff, hist):
            seq = seqs[i]
            q_pos[i], slots[i], lpl[i], npages[i] = h, seq.last_page * P + h % P, h % P + 1, h // P + 1
        for i in kept_opens:
            slots[i], lpl[i] = seqs[i].last_page * P, 1
            npages[i] += 1
        np.add.accumulate(npages, out=self.page_indptr[1:])
        self.nnz = nnz
        first = 0 if src is not None else min(diff + kept_opens)  # rows before it: the same page lists
        at = int(self.page_indptr[first])
        ib.write_concatenated(self.pi + at, nnz - at, map(_PAGES, seqs[first:]))
        for seq in seqs:
            seq.kv_len += 1
            seq.stamp = stamp
        self.room = P - max(lpl.tolist())
        self.max_keys = max(map(_KV_LEN, seqs))
        self.seq_ids, self.seqs = ids, seqs
        self.pool_version, self.table_version = pool.version, table.version
        return True

    @property
    def used(self) -> int:
        return self.pi + max(self.nnz, 1)

    def check(self) -> list:
        """Problems of the kept plan against the page tables, while it is still valid (it will be
        reused by the next repeated decode step)."""
        pool, table = self.pool, self.table
        if (pool.version, table.version) != (self.pool_version, self.table_version):
            return []
        if not self.is_ready:
            self.ready()
        problems = []
        host, layout, P = self.host, self.layout, self.page_size
        pi = layout.page_indices_at
        want = np.concatenate([s.pages for s in self.seqs] + [np.zeros(0, np.int32)])
        if not np.array_equal(host[pi : pi + self.nnz], want):
            problems.append("the repeat-decode plan's page_indices differ from the sequences' page lists")
        kv = np.fromiter(map(_KV_LEN, self.seqs), np.int64, len(self.seqs))
        npages = np.array([s.num_pages for s in self.seqs], np.int64)
        if not np.array_equal(self.npages, npages):
            problems.append("the repeat-decode plan's page counts differ from the sequences'")
        elif len(kv):
            lpl = kv - (npages - 1) * P
            last = want[np.cumsum(npages) - 1].astype(np.int64)
            if not np.array_equal(self.last_page_len, lpl) or not np.array_equal(self.slots, last * P + lpl - 1):
                problems.append("the repeat-decode plan's slots / last_page_len differ from the sequences'")
        for sid, seq in zip(self.seq_ids, self.seqs):
            if table.resident.get(sid) is not seq:
                problems.append(f"the repeat-decode plan holds a stale record of sequence {sid}")
        return problems
