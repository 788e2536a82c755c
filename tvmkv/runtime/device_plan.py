"""Decode and prefill steps planned on the device, from a page table that lives there.

A decode step whose batch changed (sequences arrived, finished, forked, were preempted or reordered)
cannot reuse the last step's arrays (``repeat_decode.RepeatDecode``); planning it on the host walks every
sequence several times in Python. :class:`DevicePlanner` keeps each sequence's page list in a device
table instead (``table[Sequence.row, k]``, docs/layout.md "Device page table") and writes, per step,
five integers per sequence into a small staging buffer — its row, kv length, first page the table
lacks, where those pages sit in the stage, its page_indptr — followed by the pages the table lacks
(a page a sequence opened this step, a new or forked sequence's list). One upload and one launch of
``plan_decode`` (:mod:`tvmkv.tir.plan_ops`) then patch the table and write the step's arrays into the
packed index buffer, exactly where the host planner would have put them (same layout, same slot), so
the attention kernels and their bound forwards are the same. A prefill or mixed step (no token tree, no
window) stages two more ints per sequence, its q_indptr and new tokens, and launches ``plan_prefill``,
which also writes every new token's position and slot.

Which pages the table holds for a sequence is ``Sequence.synced``: every change of a page list other
than an append lowers it (``sequences.Sequence``), and this planner raises it when the stage carries
the rest. The table grows (rows as sequences are added, width as the longest one grows) by
replacing it; every sequence is then rewritten at its next step.

Streams: ``plan_decode`` and ``plan_prefill`` run on TVM's current stream when ``begin_forward`` is
called, so the forward's attention calls must run on that stream too (or be ordered after it), as they
are when a whole step runs inside one ``tvm_ffi.use_torch_stream`` or outside any. The table is written
only by these two launches, in stream order; like the index buffer ring (see ``index_buffer``), a step on another
stream must not start before the last step's kernels finished, which any per-step readback
guarantees.
"""

from __future__ import annotations

from itertools import accumulate, compress
from operator import attrgetter, ne, sub
from struct import Struct

import numpy as np

from ..tir.decode_layout import PREFILL_STAGE_COLS, STAGE_COLS
from .index_buffer import IndexBuffers
from .sequences import SequenceTable

_ROW = attrgetter("row")
_SYNCED = attrgetter("synced")
_MIN_ROWS, _MIN_WIDTH = 64, 64
_MAX_LAYOUTS = 256  # offsets kept before starting over


class DevicePlanner:
    """The device page table of one cache and the ``plan_decode`` / ``plan_prefill`` launches that read it."""

    def __init__(self, device, kernel, table: SequenceTable, prefill_kernel=None):
        self.device, self.kernel, self.seqs = device, kernel, table
        self.prefill_kernel = prefill_kernel  # plan_prefill (None: a library built before it, or MLA)
        self.stage = IndexBuffers(device, 1024)
        self.table = None  # [rows, width] int32 on the device
        self.rows = self.width = 0
        self._offsets: dict = {}  # (batch, new tokens) -> the layout offsets plan_decode / plan_prefill take
        self._packers: dict = {}  # ints per stage head -> struct.Struct writing them

    def ensure(self, max_pages: int) -> None:
        """Room for every sequence's row and for ``max_pages`` pages in a row (called before a step
        changes anything). A bigger table starts unwritten, so every sequence is rewritten at its next
        step."""
        if self.seqs.num_rows <= self.rows and max_pages <= self.width:
            return
        import tvm

        rows = max(self.seqs.num_rows, 2 * self.rows, _MIN_ROWS)
        width = max(max_pages, 2 * self.width, _MIN_WIDTH)
        self.table = tvm.runtime.tensor(np.zeros((rows, width), np.int32), self.device)
        self.rows, self.width = rows, width
        for seq in self.seqs.resident.values():
            seq.synced = 0

    def offsets(self, layout) -> tuple:
        """The offset arguments plan_decode / plan_prefill take for ``layout`` (docs/layout.md, "Page
        tables"), a layout of one token-tree row (``plan.PackedLayout``)."""
        a = layout.arrays
        B, total = a["last_page_len"][1][0], a["q_pos"][1][0]
        off = self._offsets.get((B, total))
        if off is None:
            if len(self._offsets) >= _MAX_LAYOUTS:  # (a prefill's totals vary)
                self._offsets = {}
            zero_end = a["kv_tree_start"][0] + B
            off = self._offsets[(B, total)] = (
                a["q_indptr"][0],
                a["q_pos"][0],
                a["slots"][0],
                a["last_page_len"][0],
                a["page_indptr"][0],
                a["kv_window"][0],
                zero_end,
                layout.page_indices_at,
            )
        return off

    def plan(self, out, layout, seqs: list, hist: list, npages: list, starts: list) -> None:
        """Write a decode step's index arrays into ``out`` (the index buffer's slot) for ``seqs``,
        whose pages are reserved (``npages`` each; :meth:`ensure` was called for them), ``hist`` their
        kv lengths before the step, ``starts`` the page_indptr (``B + 1`` entries)."""
        self._launch(self.kernel, STAGE_COLS, out, layout, seqs, hist, npages, (starts,))

    def plan_prefill(
        self, out, layout, seqs: list, hist: list, npages: list, starts: list, q_starts: list, lengths: list, pages
    ) -> None:
        """:meth:`plan` of a prefill or mixed step (no token tree, no window) by ``plan_prefill``:
        ``lengths`` new tokens each, ``q_starts`` the q_indptr (``B + 1`` entries). ``pages``: the pages
        the table lacks, in batch order, where the caller knows them (it then sets every sequence's
        ``synced`` to its ``npages``), else None."""
        cols = (starts, q_starts, lengths)
        self._launch(self.prefill_kernel, PREFILL_STAGE_COLS, out, layout, seqs, hist, npages, cols, pages)

    def _launch(self, kernel, ncols: int, out, layout, seqs: list, hist: list, npages: list, cols: tuple, pages=None):
        """Stage each sequence's row, ``hist``, first page the table lacks, where its pages sit, and
        ``cols`` (the first ``B`` entries of each: ``ncols`` columns in all, as ``kernel`` reads them),
        then the pages the table lacks (``pages``, or read from the sequences, whose ``synced`` is then
        raised); upload; launch."""
        B = len(seqs)
        synced = list(map(_SYNCED, seqs))
        run = list(map(_ROW, seqs))
        run += hist
        run += synced
        new = None
        if synced == npages:  # the table holds every page of the batch
            run += [0] * B
            extra = 0
        else:
            at = list(accumulate(map(sub, npages, synced), initial=0))
            run += at[:B]
            extra = at[B]
            if pages is None:
                new = list(compress(seqs, map(ne, synced, npages)))
        for col in cols:
            run += col[:B]
        head = len(run)
        assert head == ncols * B
        sb = self.stage
        slot = sb.next_slot(head + extra)
        packer = self._packers.get(head)
        if packer is None:  # (struct packs a list of ints about 3x faster than array or NumPy do)
            packer = self._packers[head] = Struct(f"{head}i")
        packer.pack_into(sb.host.data, 0, *run)
        if pages is not None and extra:
            assert len(pages) == extra
            sb.host[head : head + extra] = pages
        elif new:
            sb.write_concatenated(head, extra, [seq.pages[seq.synced :] for seq in new])
            for seq in new:
                seq.synced = seq.num_pages
        sb.upload(slot, head + extra)
        kernel(sb.tail(slot, 0), self.table, out, B, *self.offsets(layout))

    def check(self) -> list:
        """Problems of the device table against the sequences' page lists (reads it back)."""
        if self.table is None:
            return []
        table = self.table.numpy()
        problems = []
        for sid, seq in self.seqs.resident.items():
            if seq.synced and not np.array_equal(table[seq.row, : seq.synced], seq.pages[: seq.synced]):
                problems.append(f"sequence {sid}: the device page table's row {seq.row} differs from its page list")
        return problems
