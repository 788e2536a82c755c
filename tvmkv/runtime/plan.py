"""The step planner: every index array of one forward, written into one packed host buffer.

``begin_forward`` (the facade) validates a step; :meth:`Planner.plan` then reserves its pages (new
pages, copy-on-write of shared partial pages), writes the step's index arrays (docs/layout.md, "Page
tables", "Ragged queries", "Token trees") into the packed int32 host buffer of
:class:`~tvmkv.runtime.index_buffer.IndexBuffers`, vectorized over tokens and pages, grows the
sequences, and returns a :class:`StepPlan` naming where each array sits (:class:`PackedLayout`). The
facade uploads the used prefix in one copy. A decode step whose batch changed in more than a few rows
is planned on the device instead where the kernel library allows
(:class:`~tvmkv.runtime.device_plan.DevicePlanner`: the same arrays, written into the same slot by one
launch from a device-resident page table; nothing to upload but five ints per sequence), and so is a
prefill or mixed forward without token trees or windows (:meth:`Planner._prefill_device`, seven ints).

The planner keeps, per shape ``(B, n, tree rows)`` of a forward, its layout, the host views of its
arrays, their device views per ring slot and, for a decode shape, the constant part of its arrays
(:class:`StepShape`; not even copied while the host buffer still holds it) and the forward last
bound over each slot (``launch.Forward``: ``begin_forward`` rebinds only its batch), so a step builds
no layout, no view and no kernel binding. A decode step of a changed batch (one token per sequence,
no token tree: what a server runs between arrivals, departures, forks and preemptions) has paths of
its own: up to :data:`FEW` sequences over Python ints written as one int32 run through a memoryview
(a NumPy call costs more than the Python for a few sequences), above that about a dozen whole-batch
NumPy calls; Python per sequence only for those that get a page. Copy-on-write is looked for only
when some sequence's last page is shared (``PagePool.shared``, one set test). Without device planning
a prefill or mixed forward of up to :data:`FEW` sequences without token trees or windows (a chunked
prefill beside decodes) is planned over Python ints per sequence and NumPy per new token
(:meth:`Planner._prefill_few`); other forwards take the general path, :func:`plan_step`, which is
vectorized over sequences too. Every path writes the same arrays for the same input
(tests/test_planner.py checks them against docs/layout.md). A decode step that repeats the last one,
or replaces a few of its rows, is not planned here: the kept plan of the last decode step
(:class:`~tvmkv.runtime.repeat_decode.RepeatDecode`) is advanced or patched in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate, compress, repeat
from operator import add, attrgetter, floordiv, mod, ne, not_, sub
from struct import Struct
from typing import Any

import numpy as np

from ..errors import OutOfPagesError
from .device_plan import DevicePlanner
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
_LAST_PAGE = attrgetter("last_page")
_WINDOW = attrgetter("window")
_SYNCED = attrgetter("synced")
_NONE = np.zeros(0, np.int64)
FEW = 64  # decode and prefill batches up to this size are planned over Python ints (_decode_few, _prefill_few)
_MAX_SHAPES = 256  # shapes the planner keeps before it starts over (a prefill's totals vary)


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


@dataclass(slots=True)
class StepShape:
    """One forward shape's :class:`PackedLayout`, with host views of its arrays in the buffer ``host``
    (rebound when the buffer grows) and, for a decode shape, ``template``: the part of the buffer before
    ``page_indices`` as a decode step of this shape writes it before its per-sequence arrays
    (``q_indptr = 0..B``, every other array 0)."""

    layout: PackedLayout
    host: np.ndarray | None = None
    views: dict | None = None  # name -> host view
    prefix: np.ndarray | None = None  # host[:page_indices_at]
    zero: np.ndarray | None = None  # kv_window .. kv_tree_start (contiguous): zeroed by every plan
    template: np.ndarray | None = None
    rows: np.ndarray | None = None  # decode: [4, B] view of q_pos, slots, last_page_len, page_indptr[:B]
    rows_at: int = 0  # decode: offset of q_pos in ``host`` (slots, last_page_len, page_indptr follow)
    pad: list = field(default_factory=list)  # decode: zeros between two of those arrays
    dev: dict | None = None  # device slot -> device views (launch.device_views), for ``generation``
    fwds: dict | None = None  # (device slot, kernel) -> the launch.Forward last bound over them
    generation: int = -1

    def bind(self, host: np.ndarray) -> None:
        """Take the views of this shape's arrays in ``host`` (the buffer of ``IndexBuffers``)."""
        layout = self.layout
        self.host = host
        self.views = {name: layout.array(host, name) for name in PACKED}
        self.prefix = host[: layout.page_indices_at]
        lo, hi = layout.arrays["kv_window"][0], layout.arrays["kv_tree_start"][0]
        self.zero = host[lo : hi + math.prod(layout.arrays["kv_tree_start"][1])]
        B = layout.arrays["last_page_len"][1][0]
        at = [layout.arrays[name][0] for name in ("q_pos", "slots", "last_page_len", "page_indptr")]
        stride = at[1] - at[0]
        if layout.arrays["q_pos"][1] == (B,) and at == [at[0] + k * stride for k in range(4)]:  # decode
            self.rows = host[at[0] : at[0] + 4 * stride].reshape(4, stride)[:, :B]
            self.rows_at, self.pad = at[0], [0] * (stride - B)


@dataclass(slots=True)
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
    longest: int  # the longest sequence's kv length after the step (-1: from ``hist``, on first use)
    shape: StepShape | None = None
    npages: Any = None  # [B] pages of each sequence after the step (int array or list of ints)
    hist: Any = None  # decode: kv lengths before the step, [B] (int32 array or list of ints)
    stamp: int = 0  # decode: the stamp its sequences carry after it (Sequence.stamp)
    on_device: bool = False  # written into the device slot by DevicePlanner (nothing to upload)

    @property
    def used(self) -> int:
        return self.layout.used(self.nnz)

    @property
    def max_keys(self) -> int:
        """The longest sequence's kv length after the step (plans the decode split; a CPU cache
        never asks, so a decode step does not compute it unless asked)."""
        if self.longest < 0:
            hist = self.hist
            self.longest = int(hist.max() if isinstance(hist, np.ndarray) else max(hist)) + 1
        return self.longest


class Planner:
    """Plans the forwards of one cache into ``ib`` (see the module docstring); keeps a
    :class:`StepShape` per forward shape, the device views of each (slot, shape) and, for decode
    shapes, the forward last bound over them."""

    def __init__(self, ib: IndexBuffers, page_size: int):
        self.ib, self.page_size = ib, page_size
        self._shapes: dict = {}
        self.few = FEW
        # the decode shape whose constant arrays (StepShape.template) the host buffer holds now: the
        # last forward planned was a decode step of that shape without windows (the repeat-decode
        # step changes only per-sequence arrays), so the next one of that shape skips the copy
        self._clean: StepShape | None = None
        self.decodes = 0  # decode plans made: the stamp (Sequence.stamp) of the last one's records
        # plans decode steps of a changed batch, and prefill steps without trees or windows, on the device
        # (device_plan.DevicePlanner), if the kernel library has plan_decode (and plan_prefill); the batch
        # of the last decode step it planned (a repeat of it is planned here, so that the repeat-decode
        # fast path takes over from the step after)
        self.device: DevicePlanner | None = None
        self._device_ids: list | None = None
        self._packers: dict = {}  # ints per decode run -> struct.Struct writing them (_decode_few)
        self._arange = np.arange(256, dtype=np.int32)  # (_iota)

    def shape(self, batch: int, total: int, tree_rows: int) -> StepShape:
        """The :class:`StepShape` of a forward (views not bound: :meth:`bound`)."""
        key = (batch, total, tree_rows)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= _MAX_SHAPES:
                self._shapes = {}
                self._clean = None
            shape = self._shapes[key] = StepShape(PackedLayout.of(batch, total, tree_rows))
        return shape

    def bound(self, shape: StepShape) -> StepShape:
        """``shape`` with its views bound to the current host buffer (call after ``ib.next_slot``)."""
        if shape.host is not self.ib.host:
            shape.bind(self.ib.host)
        return shape

    def device_views(self, plan: StepPlan) -> dict:
        """Device views of every packed array of ``plan`` (:func:`launch.device_views`, kept per slot
        and shape while the buffers' view cache stands)."""
        shape, ib = plan.shape, self.ib
        assert shape is not None
        if shape.generation != ib.generation or shape.dev is None:
            shape.dev, shape.fwds, shape.generation = {}, {}, ib.generation
        dev = shape.dev.get(plan.slot)
        if dev is None:
            layout = shape.layout
            dev = {name: ib.view(plan.slot, off, shp) for name, (off, shp) in layout.arrays.items()}
            dev["page_indices"] = ib.tail(plan.slot, layout.page_indices_at)
            shape.dev[plan.slot] = dev
        return dev

    def kept_forward(self, plan: StepPlan):
        """The forward (``launch.Forward``) last kept by :meth:`keep_forward` for ``plan``'s shape, slot
        and kernel while the buffers' view cache stands, else None. Its arguments are the device views
        of that shape and slot and the scratch views of its token count, which is all a forward binds
        besides the batch (``seq_ids``, ``lengths``, ``slides``: the caller sets them) and a decode's
        split (the caller compares it)."""
        shape = plan.shape
        if shape is None or shape.fwds is None or shape.generation != self.ib.generation:
            return None
        return shape.fwds.get((plan.slot, plan.kernel))

    def keep_forward(self, plan: StepPlan, forward) -> None:
        """Keep ``forward``, bound over :meth:`device_views` of ``plan`` (called first)."""
        assert plan.shape is not None and plan.shape.fwds is not None
        plan.shape.fwds[(plan.slot, plan.kernel)] = forward

    def plan(self, seq_ids: list, seqs: list, lengths: list, parents, pool: PagePool, table: SequenceTable, copy_page):
        """Reserve the pages of a validated forward, write its index arrays and grow its sequences.

        ``seqs`` are the records of ``seq_ids``, ``lengths`` their new tokens (ints > 0), ``parents``
        per sequence (new parents, new depths) of a token-tree forward, else None. Pages: each sequence
        gets the pages its new tokens need, in batch order; one whose partial last page is shared (ref
        count > 1) first gets a copy of it (``copy_page(src, dst, num_slots)``). Raises
        OutOfPagesError, having changed nothing, when too few pages are free. Afterwards every
        sequence's ``kv_len`` (and token tree) includes the new tokens.
        """
        if parents is None and len(lengths) == sum(lengths):
            if (
                self.device is not None
                and self._on_device(seq_ids)
                and not (table.num_windowed and any(map(_WINDOW, seqs)))
            ):
                return self._decode_device(seq_ids, seqs, pool, table, copy_page)
            if len(seqs) <= self.few:
                return self._decode_few(seq_ids, seqs, pool, table, copy_page)
            return self._decode(seq_ids, seqs, pool, table, copy_page)
        self._clean = None  # the host prefill paths write the whole packed region (the device path: none of it)
        if parents is None and not (table.num_windowed and any(map(_WINDOW, seqs))):
            if self.device is not None and self.device.prefill_kernel is not None:
                return self._prefill_device(seq_ids, seqs, lengths, pool, table, copy_page)
            if len(seqs) <= self.few:
                return self._prefill_few(seq_ids, seqs, lengths, pool, table, copy_page)
        P, B = self.page_size, len(seqs)
        history = np.fromiter(map(_KV_LEN, seqs), np.int64, B)
        lens = np.array(lengths, np.int64)
        have = -(-history // P)  # pages held now (== seq.num_pages, an invariant check_integrity checks)
        end = history + lens  # kv length of each sequence after the step
        want = -(-end // P)
        windowed = np.flatnonzero(np.fromiter(map(_WINDOW, seqs), np.int64, B))
        partial = np.flatnonzero(history % P)
        last = np.fromiter(map(_LAST_PAGE, seqs), np.int64, B)
        cow = partial[pool.ref_counts_of(last[partial]) > 1]
        grow = want - have
        needed = int(grow.sum()) + len(cow)
        if not pool.ensure_free(needed):
            raise OutOfPagesError(needed, pool.num_free)
        reserve(seqs, cow.tolist(), grow.tolist(), pool, table, copy_page, P)
        plan = plan_step(self, seq_ids, seqs, lens, history, want, windowed, parents)
        for seq, n in zip(seqs, end.tolist()):
            seq.kv_len, seq.stamp = n, 0
        if parents is not None:
            for seq, (p, d) in zip(seqs, parents):
                seq.tree_parent.extend(p)
                seq.tree_depth.extend(d)
                seq.tree_last = len(p)
        return plan

    def _decode_few(self, seq_ids: list, seqs: list, pool: PagePool, table: SequenceTable, copy_page) -> StepPlan:
        """:meth:`_decode` for a few sequences, over Python ints (a NumPy call costs more than the Python
        for a few sequences): the same arrays, written as one int32 run (q_pos, slots, last_page_len,
        page_indptr and the padding between them) through a memoryview of the host buffer."""
        P, B, ib = self.page_size, len(seqs), self.ib
        hist = list(map(_KV_LEN, seqs))
        off = list(map(mod, hist, repeat(P)))  # the new token's offset in its page; 0: it opens a page
        _decode_reserve(seqs, off, pool, table, copy_page, P)
        npages = list(map(add, map(floordiv, hist, repeat(P)), repeat(1)))  # pages after the step
        starts = list(accumulate(npages, initial=0))  # page_indptr
        nnz = starts[B]
        shape = self._shapes.get((B, B, 1)) or self.shape(B, B, 1)
        pi = shape.layout.page_indices_at
        slot = ib.next_slot(pi + max(nnz, 1))
        v = self._decode_views(shape)
        pad = shape.pad
        run = hist + pad + [page * P + o for page, o in zip(map(_LAST_PAGE, seqs), off)] + pad
        run += [o + 1 for o in off]
        run += pad
        run += starts
        at = shape.rows_at
        packer = self._packers.get(len(run))
        if packer is None:  # (struct packs a list of ints about 3x faster than array or NumPy do)
            packer = self._packers[len(run)] = Struct(f"{len(run)}i")
        packer.pack_into(shape.host.data, 4 * at, *run)  # type: ignore[union-attr]
        ib.write_concatenated(pi, nnz, map(_PAGES, seqs))
        return self._decode_plan(seq_ids, seqs, table, v, shape, slot, nnz, -1, npages, hist)

    def _prefill_few(self, seq_ids: list, seqs: list, lengths: list, pool: PagePool, table: SequenceTable, copy_page):
        """:func:`plan_step`'s forward (prefill or mixed, no token tree, no window) for up to :data:`FEW`
        sequences: the per-sequence work over Python ints (pages to reserve, copy-on-write, indptrs,
        last-page fill), NumPy only over the new tokens (their positions and slots)."""
        P, B, ib = self.page_size, len(seqs), self.ib
        hist, end, want, _, cow, grow = self._prefill_pages(seqs, lengths, pool)
        reserve(seqs, cow, grow, pool, table, copy_page, P)
        total = sum(lengths)
        shape = self.shape(B, total, 1)
        layout = shape.layout
        starts = list(accumulate(want, initial=0))  # page_indptr
        nnz = starts[B]
        slot = ib.next_slot(layout.used(nnz))
        v = self.bound(shape).views
        assert v is not None and shape.zero is not None
        shape.zero[:] = 0  # kv_window and the token-tree arrays
        q_starts = list(accumulate(lengths, initial=0))
        v["q_indptr"][:] = q_starts
        v["page_indptr"][:] = starts
        v["last_page_len"][:] = [e - (w - 1) * P for e, w in zip(end, want)]  # (every sequence holds a token)
        pi = layout.page_indices_at
        ib.write_concatenated(pi, nnz, map(_PAGES, seqs))
        # token t of sequence b sits at position hist[b] + t - q_starts[b], in page row starts[b] + pos // P
        q_pos, slots = v["q_pos"], v["slots"]
        iota = self._iota(total)
        if B == 1:
            pos = np.add(iota, hist[0], out=q_pos)
            rows = pos // P
        else:
            pos = np.add(iota, np.repeat(np.array(list(map(sub, hist, q_starts)), np.int32), lengths), out=q_pos)
            rows = pos // P + np.repeat(np.array(starts[:B], np.int32), lengths)
        np.add(ib.host[pi : pi + nnz][rows] * P, pos % P, out=slots)
        for seq, n in zip(seqs, end):
            seq.kv_len, seq.stamp = n, 0
        return StepPlan(
            seq_ids,
            lengths,
            total,
            "paged_prefill_causal" if any(hist) else "ragged_prefill_causal",
            [],
            layout,
            slot,
            nnz,
            max(end),
            shape,
            want,
        )

    def _prefill_pages(self, seqs: list, lengths: list, pool: PagePool) -> tuple:
        """What a prefill or mixed step (no token tree, no window) of ``seqs`` needs, over Python ints:
        ``(hist, end, want, have, cow, grow)``: kv lengths before and after the step, pages after it and
        now, the rows whose shared partial last page gets a copy, new pages per row. Raises
        OutOfPagesError, having changed nothing, when the pool cannot free enough pages."""
        P = self.page_size
        hist = list(map(_KV_LEN, seqs))
        end = list(map(add, hist, lengths))
        want = list(map(floordiv, map(add, end, repeat(P - 1)), repeat(P)))
        have = list(map(floordiv, map(add, hist, repeat(P - 1)), repeat(P)))
        shared = pool.shared  # a partial last page that is shared gets a copy first
        cow = [i for i, (h, seq) in enumerate(zip(hist, seqs)) if h % P and seq.last_page in shared] if shared else []
        grow = list(map(sub, want, have))
        needed = sum(grow) + len(cow)
        if needed and not pool.ensure_free(needed):
            raise OutOfPagesError(needed, pool.num_free)
        return hist, end, want, have, cow, grow

    def _prefill_device(
        self, seq_ids: list, seqs: list, lengths: list, pool: PagePool, table: SequenceTable, copy_page
    ) -> StepPlan:
        """:meth:`_prefill_few`'s forward, any batch, with its arrays written on the device
        (``DevicePlanner.plan_prefill``): the pages reserved here over Python ints per sequence, nothing
        per new token, one upload and one launch."""
        P, B, ib, device = self.page_size, len(seqs), self.ib, self.device
        assert device is not None
        hist, end, want, have, cow, grow = self._prefill_pages(seqs, lengths, pool)
        device.ensure(max(want))  # (a bigger table, before anything changes)
        # the pages the device table lacks: where it held every page before this step and no page is
        # copied, those just handed out, in batch order (else DevicePlanner gathers them)
        fresh = not cow and list(map(_SYNCED, seqs)) == have
        new = reserve(seqs, cow, grow, pool, table, copy_page, P)
        total = sum(lengths)
        shape = self.shape(B, total, 1)
        starts = list(accumulate(want, initial=0))  # page_indptr
        nnz = starts[B]
        slot = ib.next_slot(shape.layout.used(nnz))
        q_starts = list(accumulate(lengths, initial=0))
        device.plan_prefill(
            ib.tail(slot, 0), shape.layout, seqs, hist, want, starts, q_starts, lengths, new if fresh else None
        )
        for seq, n, w in zip(seqs, end, want):  # (the device table holds all their pages now)
            seq.kv_len, seq.stamp, seq.synced = n, 0, w
        kernel = "paged_prefill_causal" if any(hist) else "ragged_prefill_causal"
        return StepPlan(
            seq_ids, lengths, total, kernel, [], shape.layout, slot, nnz, max(end), shape, npages=want, on_device=True
        )

    def _iota(self, n: int) -> np.ndarray:
        """``0 .. n - 1`` (int32; a view of one array kept and grown)."""
        if len(self._arange) < n:
            self._arange = np.arange(max(n, 2 * len(self._arange)), dtype=np.int32)
        return self._arange[:n]

    def _on_device(self, seq_ids: list) -> bool:
        """Whether a decode step of ``seq_ids`` (its batch changed since the last decode step, or that
        step was planned on the device) is planned on the device. Not when it repeats the last step
        planned there, or replaces only a few rows of it in place: the host plans it then, and its plan
        is kept (``RepeatDecode``), so that the steps after it repeat or patch that plan on the host,
        which is cheaper for such steps than planning them anew on the device."""
        last = self._device_ids
        if last is None or len(last) != len(seq_ids):
            return True
        return sum(map(ne, seq_ids, last)) > max(2, len(seq_ids) >> 3)

    def _decode_device(self, seq_ids: list, seqs: list, pool: PagePool, table: SequenceTable, copy_page) -> StepPlan:
        """:meth:`_decode_few`'s step with its arrays written on the device (``self.device``, a
        :class:`~tvmkv.runtime.device_plan.DevicePlanner`): the pages are reserved here, the rest is
        C-level passes over the batch, one upload and one launch."""
        P, B, ib, device = self.page_size, len(seqs), self.ib, self.device
        assert device is not None
        hist = list(map(_KV_LEN, seqs))
        npages = list(map(add, map(floordiv, hist, repeat(P)), repeat(1)))  # pages after the step
        device.ensure(max(npages))  # (a bigger table, before anything changes)
        _decode_reserve(seqs, list(map(mod, hist, repeat(P))), pool, table, copy_page, P)
        starts = list(accumulate(npages, initial=0))  # page_indptr
        nnz = starts[B]
        shape = self._shapes.get((B, B, 1)) or self.shape(B, B, 1)
        slot = ib.next_slot(shape.layout.page_indices_at + max(nnz, 1))
        device.plan(ib.tail(slot, 0), shape.layout, seqs, hist, npages, starts)
        for seq in seqs:  # (no stamps: a device plan is not kept for the repeat-decode path)
            seq.kv_len += 1
        self._device_ids = seq_ids
        return StepPlan(
            seq_ids, [1] * B, B, "paged_decode", [], shape.layout, slot, nnz, -1, shape, npages, hist, 0, True
        )

    def _decode_plan(
        self, seq_ids, seqs, table: SequenceTable, v: dict, shape: StepShape, slot, nnz, longest, npages, hist
    ):
        """The end of both decode paths: windows into ``v``, every sequence one token longer, the plan."""
        slides = []
        if table.num_windowed and any(map(_WINDOW, seqs)):
            slides = self._decode_windows(seqs, v)
            self._clean = None  # kv_window rows written
        stamp = self.decodes = self.decodes + 1
        for seq in seqs:
            seq.kv_len += 1
            seq.stamp = stamp
        B = len(seqs)
        return StepPlan(
            seq_ids, [1] * B, B, "paged_decode", slides, shape.layout, slot, nnz, longest, shape, npages, hist, stamp
        )

    def _decode_views(self, shape: StepShape) -> dict:
        """The host views of a decode ``shape`` with everything but its per-sequence arrays written:
        q_indptr = 0..B, kv_window and the tree arrays 0 (one copy of its template, skipped when the
        buffer still holds it)."""
        if shape.host is not self.ib.host:
            shape.bind(self.ib.host)
        elif self._clean is shape:
            assert shape.views is not None
            return shape.views
        layout = shape.layout
        if shape.template is None:
            shape.template = np.zeros(layout.page_indices_at, np.int32)
            q_indptr = layout.array(shape.template, "q_indptr")
            q_indptr[:] = np.arange(len(q_indptr))
        assert shape.prefix is not None and shape.views is not None
        shape.prefix[:] = shape.template
        self._clean = shape
        return shape.views

    @staticmethod
    def _decode_windows(seqs: list, v: dict) -> list:
        """kv_window and q_pos of a decode step's windowed sequences; returns them (they slide)."""
        slides, kv_window, q_pos = [], v["kv_window"], v["q_pos"]
        for b, seq in enumerate(seqs):
            if seq.window:
                slides.append(seq)
                kv_window[b] = (seq.sink_end, seq.window_start, -seq.gap)
                if q_pos[b] >= seq.sink_end:
                    q_pos[b] -= seq.gap
        return slides

    def _decode(self, seq_ids: list, seqs: list, pool: PagePool, table: SequenceTable, copy_page) -> StepPlan:
        """:meth:`plan` of one new token per sequence, no token tree: the arrays of :func:`plan_step`
        for ``lens = 1`` (page_indptr = cumsum(kv_len // P + 1), last_page_len = kv_len % P + 1, slot
        = last page * P + kv_len % P, q_pos = kv_len, shifted by a window's gap), whole-batch, in
        int32 (what the arrays hold): two passes over the records, a dozen NumPy calls."""
        P, B, ib = self.page_size, len(seqs), self.ib
        hist = np.fromiter(map(_KV_LEN, seqs), np.int32, B)  # slots before the step = the new token's
        last = np.fromiter(map(_LAST_PAGE, seqs), np.int32, B)  # -1 without pages (then off == 0)
        off = hist % P  # the new token's offset in its page; 0: it opens a page
        shared = pool.shared  # copy-on-write only when some last page is shared (a set test)
        if np.count_nonzero(off) < B or (shared and not shared.isdisjoint(last.tolist())):
            opens = (off == 0).nonzero()[0]
            cow = _NONE
            if shared:  # some last page is shared: partial ones get a copy (copy-on-write)
                refs = pool.ref_counts_of(last)  # (a sequence without pages has off 0)
                refs -= 1
                refs *= off  # > 0: shared and partial
                cow = refs.nonzero()[0]
            if len(opens) or len(cow):
                rows, new = decode_pages(seqs, opens.tolist(), cow.tolist(), pool, table, copy_page, P)
                last[rows] = new
        npages = hist // P
        npages += 1  # pages after the step
        ends = npages.cumsum()
        nnz = int(ends[-1])
        shape = self._shapes.get((B, B, 1)) or self.shape(B, B, 1)
        pi = shape.layout.page_indices_at
        slot = ib.next_slot(pi + max(nnz, 1))
        v = self._decode_views(shape)
        rows = shape.rows  # q_pos, slots, last_page_len, page_indptr[:B]
        assert rows is not None
        rows[0] = hist
        slots = rows[1]
        np.multiply(last, P, out=slots)
        slots += off
        np.add(off, 1, out=rows[2])
        v["page_indptr"][1:] = ends
        ib.write_concatenated(pi, nnz, map(_PAGES, seqs))
        return self._decode_plan(seq_ids, seqs, table, v, shape, slot, nnz, -1, npages, hist)


def _decode_reserve(seqs: list, off: list, pool: PagePool, table: SequenceTable, copy_page, P: int) -> None:
    """:func:`decode_pages` of a decode step over Python ints (``off``: each new token's offset in its
    page, 0 where it opens one): a new page where a token opens one, a copy where a partial last page
    is shared; a set test and ``0 in off`` when neither is needed."""
    shared = pool.shared  # copy-on-write only when some last page is shared (a set test)
    if 0 in off or (shared and not shared.isdisjoint(map(_LAST_PAGE, seqs))):
        opens = list(compress(range(len(off)), map(not_, off)))
        cow = [i for i, (o, seq) in enumerate(zip(off, seqs)) if o and seq.last_page in shared] if shared else []
        if opens or cow:
            decode_pages(seqs, opens, cow, pool, table, copy_page, P)


def decode_pages(seqs: list, opens: list, cow: list, pool: PagePool, table: SequenceTable, copy_page, P: int):
    """Reserve a decode step's pages: a new page for the rows ``opens``, a copy of the shared partial
    last page for the rows ``cow`` (:func:`reserve`'s order and ids). Returns (rows, their new last
    pages); raises OutOfPagesError, having changed nothing, when too few pages are free."""
    needed = len(opens) + len(cow)
    if not pool.ensure_free(needed):
        raise OutOfPagesError(needed, pool.num_free)
    new = pool.alloc(needed)  # handed out in batch order, as reserve() does (a copy frees no page)
    if not cow:
        table.grow_each([seqs[i] for i in opens], new)
        return opens, new
    rows = sorted(cow + opens)
    grown, pages = [], []
    for i, page in zip(rows, new):
        seq = seqs[i]
        if seq.kv_len % P:
            copy_page(seq.last_page, page, seq.kv_len % P)
            table.copy_on_write(seq, page)
        else:
            grown.append(seq)
            pages.append(page)
    if grown:
        table.grow_each(grown, pages)
    return rows, new


def reserve(seqs: list, cow: list, grow: list, pool: PagePool, table: SequenceTable, copy_page, P: int) -> list:
    """Give the sequences at rows ``cow`` a copy of their shared partial last page (``copy_page(src,
    dst, num_slots)``) and each ``seqs[i]`` ``grow[i]`` new pages, in batch order (a copy before the
    new pages of its sequence); returns the pages handed out, in that order. The caller checked that
    enough pages are free."""
    if not cow and not any(grow):
        return []
    new = pool.alloc(len(cow) + sum(grow))  # handed out in the order one allocation per row would take
    if not cow:
        rows = list(compress(range(len(grow)), grow))
        if len(rows) == len(new):  # a page each (a prefill chunk of at most a page per sequence)
            table.grow_each([seqs[i] for i in rows], new)
            return new
    cow_set = set(cow)
    changed = sorted(cow_set.union(compress(range(len(grow)), grow)))
    k, grown, their = 0, [], []
    for i in changed:
        seq, g = seqs[i], grow[i]
        if i in cow_set:  # copy-on-write of a shared partial page (a copy frees no page)
            copy_page(seq.last_page, new[k], seq.kv_len % P)
            table.copy_on_write(seq, new[k])
            k += 1
        if g:
            grown.append(seq)
            their.append(new[k : k + g])
            k += g
    table.grow_many(grown, their)
    return new


def choose_kernel(tree: bool, total: int, batch: int, has_history: bool) -> str:
    """The attention kernel of a forward (names of ``tvmkv.tir.kernel_set``)."""
    if tree:
        return "paged_prefill_tree"
    if total == batch:
        return "paged_decode"
    if not has_history:
        return "ragged_prefill_causal"
    return "paged_prefill_causal"


def plan_step(planner: Planner, seq_ids, seqs, lens, history, npages, windowed, parents) -> StepPlan:
    """Write the index arrays of one forward (docs/layout.md) into ``planner.ib.host``.

    Called once the pages are reserved: ``seqs`` list their pages after the step. ``lens`` (new
    tokens), ``history`` (slots before this forward) and ``npages`` (pages after it) are int64
    ``[B]``; ``windowed`` the indices of sequences with a window; ``parents`` per sequence (new
    parents, new depths) of a token-tree forward, else None. Vectorized over tokens and pages; Python
    loops only over windowed sequences and, in a tree forward, over its sequences.
    """
    ib, P = planner.ib, planner.page_size
    B, total = len(seqs), int(lens.sum())
    tree = parents is not None
    tree_rows = sum(len(seq.tree_parent) + len(p) for seq, (p, _) in zip(seqs, parents)) if tree else 0
    shape = planner.shape(B, total, max(tree_rows, 1))
    layout = shape.layout
    nnz = int(npages.sum())
    slot = ib.next_slot(layout.used(nnz))
    host = ib.host
    v = planner.bound(shape).views
    assert v is not None and shape.zero is not None
    shape.zero[:] = 0  # kv_window and the token-tree arrays (and the padding between them)

    q_indptr, page_indptr = v["q_indptr"], v["page_indptr"]
    q_indptr[0] = page_indptr[0] = 0
    np.cumsum(lens, out=q_indptr[1:])
    np.cumsum(npages, out=page_indptr[1:])
    pi = layout.page_indices_at
    page_indices = host[pi : pi + max(nnz, 1)]
    if nnz:
        ib.write_concatenated(pi, nnz, map(_PAGES, seqs))
    else:
        page_indices[0] = 0
    end = history + lens
    v["last_page_len"][:] = np.where(npages > 0, end - (npages - 1) * P, 0)
    kv_window = v["kv_window"]
    # token t of sequence b sits at slot history[b] + (t - q_indptr[b]) of that sequence
    seq_of: slice | np.ndarray
    if total == B:
        seq_of, pos = slice(None), history
    else:
        seq_of = np.repeat(np.arange(B), lens)
        pos = np.arange(total) - np.repeat(q_indptr[:-1] - history, lens)
    v["slots"][:] = page_indices[page_indptr[:-1][seq_of] + pos // P] * P + pos % P
    q_pos = v["q_pos"]
    q_pos[:] = pos
    for b in windowed.tolist():
        seq = seqs[b]
        kv_window[b] = (seq.sink_end, seq.window_start, -seq.gap)
        lo, hi = q_indptr[b], q_indptr[b + 1]
        q_pos[lo:hi] = np.where(q_pos[lo:hi] < seq.sink_end, q_pos[lo:hi], q_pos[lo:hi] - seq.gap)
    q_tree, kv_tree_indptr, kv_tree, kv_tree_start = (v[n] for n in PACKED[6:])
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
        longest=int(end.max()),
        shape=shape,
        npages=npages,
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
