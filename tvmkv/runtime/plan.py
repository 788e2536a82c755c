"""The step planner: every index array of one forward, written into one packed host buffer.

``begin_forward`` (the facade) validates a step and reserves its pages; :func:`plan_step` then writes
the step's index arrays (docs/layout.md, "Page tables", "Ragged queries", "Token trees") into the
packed int32 host buffer of :class:`~tvmkv.runtime.index_buffer.IndexBuffers`, vectorized over tokens
and pages, and returns a :class:`StepPlan` naming where each array sits (:class:`PackedLayout`).
The facade uploads the used prefix in one copy.

A decode step of the same batch as the decode step before it (same ids in the same order, one token
each, nothing changed in between) needs no planning: :class:`RepeatDecode` keeps the previous step's
arrays and advances them in place (positions, slots and last-page fill + 1; a sequence whose new
token opens a page gets one). It is kept flat on purpose: NumPy views into the host buffer and a few
ints, no objects to walk per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from .index_buffer import IndexBuffers, align
from .pages import PagePool
from .sequences import SequenceTable

# Index arrays of a forward in the order they are packed (docs/layout.md). page_indices comes last: its
# length changes from step to step, the others' offsets depend only on (B, n, tree nodes), so their
# device views are reused across steps of the same shape. q_pos, slots and last_page_len sit next to
# each other: a repeated decode step advances all three with one add.
PACKED = (
    "q_indptr",
    "q_pos",
    "slots",
    "last_page_len",
    "page_indptr",
    "kv_window",
    "q_tree",
    "kv_tree_indptr",
    "kv_tree",
    "kv_tree_start",
)

_KV_LEN = attrgetter("kv_len")
_PAGES = attrgetter("pages")


@dataclass(frozen=True)
class PackedLayout:
    """Where each index array of a forward sits in the packed buffer: ``arrays[name] = (offset,
    shape)`` in int32 elements, each on a 64-byte boundary; ``page_indices`` (variable length)
    starts at ``page_indices_at``."""

    arrays: dict
    page_indices_at: int

    @classmethod
    def of(cls, batch: int, total: int, tree_rows: int) -> PackedLayout:
        """The layout of a forward of ``batch`` sequences, ``total`` new tokens, ``tree_rows``
        token-tree rows (at least 1)."""
        B, n, m = batch, total, tree_rows
        shapes = ((B + 1,), (n,), (n,), (B,), (B + 1,), (B, 3), (max(n, 1), 2), (B + 1,), (m, 3), (B,))
        arrays, at = {}, 0
        for name, shape in zip(PACKED, shapes):
            arrays[name] = (at, shape)
            at += align(math.prod(shape))
        return cls(arrays, at)

    def array(self, host: np.ndarray, name: str) -> np.ndarray:
        """The host view of array ``name``."""
        off, shape = self.arrays[name]
        return host[off : off + math.prod(shape)].reshape(shape)

    def used(self, nnz: int) -> int:
        """Elements of the buffer a forward with ``nnz`` page_indices entries uses."""
        return self.page_indices_at + max(nnz, 1)


@dataclass
class StepPlan:
    """One planned forward: its batch, the attention kernel it runs and where its arrays are."""

    seq_ids: list
    lengths: list
    total: int  # new tokens
    kernel: str  # paged_decode | paged_prefill_causal | paged_prefill_tree | ragged_prefill_causal
    slides: list  # Sequence records whose window slides at end_forward
    layout: PackedLayout
    slot: int  # device slot of the index buffer ring
    nnz: int  # page_indices entries
    max_keys: int  # the longest sequence's kv length after the step (plans the decode split)

    @property
    def used(self) -> int:
        return self.layout.used(self.nnz)


def choose_kernel(tree: bool, total: int, batch: int, has_history: bool) -> str:
    """The attention kernel of a forward (names of ``tvmkv.tir.kernel_set``)."""
    if tree:
        return "paged_prefill_tree"
    if total == batch:
        return "paged_decode"
    if not has_history:
        return "ragged_prefill_causal"
    return "paged_prefill_causal"


def plan_step(ib: IndexBuffers, page_size: int, seq_ids, seqs, lens, history, npages, windowed, parents) -> StepPlan:
    """Write the index arrays of one forward (docs/layout.md) into ``ib.host``.

    Called once the pages are reserved: ``seqs`` list their pages after the step. ``lens`` (new
    tokens), ``history`` (slots before this forward) and ``npages`` (pages after it) are int64
    ``[B]``; ``windowed`` the indices of sequences with a window; ``parents`` per sequence (new
    parents, new depths) of a token-tree forward, else None. Vectorized over tokens and pages; Python
    loops only over windowed sequences and, in a tree forward, over its sequences.
    """
    P = page_size
    B, total = len(seqs), int(lens.sum())
    tree = parents is not None
    tree_rows = sum(len(seq.tree_parent) + len(p) for seq, (p, _) in zip(seqs, parents)) if tree else 0
    layout = PackedLayout.of(B, total, max(tree_rows, 1))
    nnz = int(npages.sum())
    slot = ib.next_slot(layout.used(nnz))
    host = ib.host
    arr = layout.array

    q_indptr, page_indptr = arr(host, "q_indptr"), arr(host, "page_indptr")
    q_indptr[0] = page_indptr[0] = 0
    np.cumsum(lens, out=q_indptr[1:])
    np.cumsum(npages, out=page_indptr[1:])
    pi = layout.page_indices_at
    page_indices = host[pi : pi + max(nnz, 1)]
    if nnz:
        np.concatenate(list(map(_PAGES, seqs)), out=page_indices)
    else:
        page_indices[0] = 0
    end = history + lens
    arr(host, "last_page_len")[:] = np.where(npages > 0, end - (npages - 1) * P, 0)
    kv_window = arr(host, "kv_window")
    kv_window[:] = 0
    # token t of sequence b sits at slot history[b] + (t - q_indptr[b]) of that sequence
    seq_of: slice | np.ndarray
    if total == B:
        seq_of, pos = slice(None), history
    else:
        seq_of = np.repeat(np.arange(B), lens)
        pos = np.arange(total) - np.repeat(q_indptr[:-1] - history, lens)
    arr(host, "slots")[:] = page_indices[page_indptr[:-1][seq_of] + pos // P] * P + pos % P
    q_pos = arr(host, "q_pos")
    q_pos[:] = pos
    for b in windowed.tolist():
        seq = seqs[b]
        kv_window[b] = (seq.sink_end, seq.window_start, -seq.gap)
        lo, hi = q_indptr[b], q_indptr[b + 1]
        q_pos[lo:hi] = np.where(q_pos[lo:hi] < seq.sink_end, q_pos[lo:hi], q_pos[lo:hi] - seq.gap)
    q_tree, kv_tree_indptr, kv_tree, kv_tree_start = (arr(host, n) for n in PACKED[6:])
    q_tree[:] = 0
    kv_tree_indptr[:] = 0
    kv_tree[:] = 0
    kv_tree_start[:] = 0
    if tree:
        at = 0
        for b, (seq, (new_parents, new_depths)) in enumerate(zip(seqs, parents)):
            all_parents = seq.tree_parent + new_parents
            all_depths = np.asarray(seq.tree_depth + new_depths, np.int32)
            enter, exit_ = dfs_intervals(all_parents)
            old = len(seq.tree_parent)
            committed = seq.committed_length
            lo, hi = q_indptr[b], q_indptr[b + 1]
            q_tree[lo:hi, 0], q_tree[lo:hi, 1] = enter[old:], exit_[old:]
            q_pos[lo:hi] = committed + all_depths[old:]
            rows = len(all_parents)
            kv_tree[at : at + rows] = np.stack([enter, exit_, committed + all_depths], axis=1)
            at += rows
            kv_tree_indptr[b + 1] = at
            kv_tree_start[b] = history[b] - old
    return StepPlan(
        seq_ids=seq_ids,
        lengths=[int(n) for n in lens.tolist()],
        total=total,
        kernel=choose_kernel(tree, total, B, bool(history.any())),
        slides=[seqs[i] for i in windowed.tolist()],
        layout=layout,
        slot=slot,
        nnz=nnz,
        max_keys=int(end.max()),
    )


def history_tables(seqs, lengths, page_size: int) -> tuple:
    """``(page_indptr [B+1], page_indices [nnz], last_page_len [B])`` int32 page tables of the keys the
    sequences held **before** the open forward (its new tokens excluded), for attention over the
    history alone (``cross_attention``; docs/layout.md, "Fine-grained attention"). ``seqs`` are the
    forward's sequences after ``begin_forward`` grew them, ``lengths`` its new tokens per sequence.
    A sequence's history pages are a prefix of its page list; one with no history has no pages."""
    P = page_size
    history = np.fromiter(map(_KV_LEN, seqs), np.int64, len(seqs)) - np.asarray(lengths, np.int64)
    npages = -(-history // P)
    page_indptr = np.zeros(len(seqs) + 1, np.int32)
    np.cumsum(npages, out=page_indptr[1:])
    parts = [seq.pages[:k] for seq, k in zip(seqs, npages.tolist())]
    page_indices = np.concatenate(parts).astype(np.int32) if page_indptr[-1] else np.zeros(1, np.int32)
    last_page_len = np.where(npages > 0, history - (npages - 1) * P, 0).astype(np.int32)
    return page_indptr, page_indices, last_page_len


def dfs_intervals(parents: list) -> tuple:
    """(enter, exit) preorder intervals of a forest given parent indices (parent < child)."""
    n = len(parents)
    children: list = [[] for _ in range(n)]
    roots: list = []
    for i, p in enumerate(parents):
        (roots if p < 0 else children[p]).append(i)
    enter = np.zeros(n, np.int32)
    exit_ = np.zeros(n, np.int32)
    counter = 0
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            exit_[node] = counter - 1
            continue
        enter[node] = counter
        counter += 1
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children[node]))
    return enter, exit_


@dataclass(slots=True)
class RepeatDecode:
    """The last decode step's plan, kept so that a decode step of the same batch (same ids in the same
    order, one token each, nothing changed in between: the pool's and the table's versions) advances it
    in place (:meth:`advance`). The arrays are views of the packed host buffer, which still holds that
    step's index arrays."""

    seq_ids: list
    seqs: list
    ones: list  # [1] * B, compared with the next step's append_lengths
    pool_version: int  # pool.version after the step
    table_version: int  # table.version after the step
    npages: np.ndarray  # int64 [B] pages of each sequence
    host: np.ndarray  # the packed host buffer the views below point into
    slots: np.ndarray
    last_page_len: np.ndarray
    advance_view: np.ndarray  # one view from q_pos to the end of last_page_len (padding included)
    page_indptr: np.ndarray
    layout: PackedLayout
    pi: int  # offset of page_indices in the packed buffer
    nnz: int  # page_indices entries
    max_keys: int  # the longest sequence's kv length after the step
    room: int  # steps before some sequence's last page is full (P - max(last_page_len))
    page_size: int
    generation: int  # IndexBuffers.generation the cached forwards' views belong to
    forwards: dict  # device slot -> bound launch.Forward
    pool: PagePool
    table: SequenceTable
    ib: IndexBuffers

    @classmethod
    def after(
        cls, plan: StepPlan, seqs: list, npages, ib: IndexBuffers, pool: PagePool, table: SequenceTable, forward
    ) -> RepeatDecode:
        """Remember the decode step ``plan`` (just bound as ``forward``)."""
        page_size = table.page_size
        host, layout = ib.host, plan.layout
        lpl = layout.array(host, "last_page_len")
        return cls(
            seq_ids=plan.seq_ids,
            seqs=seqs,
            ones=[1] * len(seqs),
            pool_version=pool.version,
            table_version=table.version,
            npages=npages.astype(np.int64),
            host=host,
            slots=layout.array(host, "slots"),
            last_page_len=lpl,
            advance_view=host[layout.arrays["q_pos"][0] : layout.arrays["last_page_len"][0] + len(seqs)],
            page_indptr=layout.array(host, "page_indptr"),
            layout=layout,
            pi=layout.page_indices_at,
            nnz=plan.nnz,
            max_keys=plan.max_keys,
            room=page_size - int(lpl.max()),
            page_size=page_size,
            generation=ib.generation,
            forwards={plan.slot: forward},
            pool=pool,
            table=table,
            ib=ib,
        )

    def advance(self, seq_ids, append_lengths) -> bool:
        """Advance the kept plan by one decode step when ``(seq_ids, append_lengths)`` repeats it.

        Returns False, having changed nothing, when the step is not such a step or needs what the
        general path handles (a new page with too few free pages: the general path raises
        OutOfPagesError; a bigger index buffer). The batch was validated at the step this one repeats.
        """
        pool, table, ib = self.pool, self.table, self.ib
        if pool.version != self.pool_version or table.version != self.table_version or self.host is not ib.host:
            return False
        if list(seq_ids) != self.seq_ids or list(append_lengths) != self.ones:
            return False
        seqs, P, lpl = self.seqs, self.page_size, self.last_page_len
        opens = np.flatnonzero(lpl == P) if self.room == 0 else np.zeros(0, np.int64)  # new tokens opening a page
        pi = self.pi
        if len(opens):
            if len(opens) > pool.num_free or pi + self.nnz + len(opens) > ib.capacity:
                return False
            new = pool.alloc(len(opens))
            for i, page in zip(opens.tolist(), new):
                table.grow(seqs[i], [page])
            self.npages[opens] += 1
            self.nnz += len(opens)
            np.cumsum(self.npages, out=self.page_indptr[1:])
            np.concatenate(list(map(_PAGES, seqs)), out=self.host[pi : pi + self.nnz])
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

    @property
    def used(self) -> int:
        return self.pi + max(self.nnz, 1)

    def check(self) -> list:
        """Problems of the kept plan against the page tables, while it is still valid (it will be
        reused by the next repeated decode step)."""
        pool, table = self.pool, self.table
        if (pool.version, table.version) != (self.pool_version, self.table_version):
            return []
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
