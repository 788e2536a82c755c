"""Swap to host: move sequences' pages to host memory and back (an object the cache holds).

``swap_out(seq_ids)`` copies every page the sequences hold into one host buffer and frees their device
pages; ``swap_in(seq_ids)`` allocates fresh device pages (any free ones) and copies the K/V back,
bit-exact. Both are batched: the pages of all the sequences of one call are gathered, per layer, by the
``gather_pages`` kernel into one contiguous device staging buffer ``[m, L, 2, H_kv, P, D]`` (row ``i`` =
page ``i`` of the batch, all layers), then ONE device->host copy moves the whole buffer (swap-in: one
host->device copy, then ``scatter_pages`` per layer). Only when a batch exceeds ``max_staging_bytes``
is it split into several such copies. On the CPU target the kernels write the host buffer directly
when the batch fits one chunk.

Host memory: one buffer per ``swap_out`` call, rows in sequence order, shared by the sequences of that
call. It is released once none of them is still swapped out (``remove_sequence`` of a swapped sequence
or ``swap_in`` drops its reference); :meth:`HostSwap.host_bytes` reports what is held. The
largest released buffer is kept as a spare for the next ``swap_out`` that fits in it: writing into
freshly allocated memory costs a page fault per 4 KiB (on the CPU a fresh buffer made swap-out 4x
slower); :meth:`HostSwap.release_spare` frees the spare.

Shared (forked, ref-counted) pages: swapping a sequence out copies all its pages, shared ones included,
and drops its references (pages other sequences still hold stay on the device). A page shared by
several sequences of one ``swap_out`` call is stored once; when those sequences come back in one
``swap_in`` call they share one new page again (ref-counted, copy-on-write as before). Sequences
swapped out or in by separate calls get private copies.

A swapped sequence keeps its id, length, window and token-tree state; it cannot join a forward or be
forked, popped or read (:class:`tvmkv.errors.SequenceSwappedError` names the fix) until it is swapped
in; ``remove_sequence`` removes it. Layout of pages: docs/layout.md ("Pages").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import CacheConfig
from ..errors import OutOfPagesError
from . import tensors
from .pages import PagePool
from .sequences import SequenceTable, check_id

DEFAULT_STAGING_BYTES = 256 << 20  # largest device staging buffer (one copy each); kept for later swaps


@dataclass(eq=False)
class _HostBlock:
    """The host buffer of one ``swap_out`` call: ``tensor [m, L, 2, H_kv, P, D]`` (tvm, CPU), a view of
    the first rows of ``base``; ``users`` swapped sequences still hold rows of it."""

    tensor: object
    base: object
    rows: int
    users: int = 0


@dataclass(eq=False)
class _Swapped:
    """Where a swapped-out sequence's pages are: rows ``rows`` of ``block`` (page k is row rows[k])."""

    block: _HostBlock
    rows: np.ndarray  # int64 [ceil(kv_len / P)]


def _numpy_view(t, dtype: str) -> np.ndarray:
    """A NumPy array sharing the memory of the CPU tensor ``t`` (offset 0; bfloat16 via a uint16 view,
    fp8 pages via a uint8 view: DLPack has no NumPy dtype for them)."""
    if dtype == "bfloat16":
        return np.from_dlpack(t._create_view(tuple(t.shape), "uint16")).view(tensors.numpy_dtype(dtype))
    if dtype.startswith("float8"):
        return np.from_dlpack(t._create_view(tuple(t.shape), "uint8")).view(tensors.numpy_dtype(dtype))
    return np.from_dlpack(t)


class HostSwap:
    """Swap of one cache: host buffers of swapped sequences, the device staging buffer, the spare.

    The cache facade checks the forward state and calls :meth:`swap_out` / :meth:`swap_in`; these
    validate their ids against the sequence table, then move pages through the pool and the table's
    public methods. ``page_arrays`` is the cache's list of per-layer page pools (device tensors).
    """

    def __init__(self, config: CacheConfig, device, pool: PagePool, table: SequenceTable, kernels, page_arrays):
        self.config, self.device = config, device
        self.pool, self.table, self.kernels, self.page_arrays = pool, table, kernels, page_arrays
        self.records: dict = {}  # seq id -> _Swapped, in swap order (mirrors table.swapped)
        self._staging_buf = None  # device staging buffer (allocated by the first swap, kept)
        self._host_spare = None  # a released host buffer, kept for reuse

    # ------------------------------------------------------------------ moves
    def swap_out(self, seq_ids, max_staging_bytes: int) -> None:
        """Move the K/V of ``seq_ids`` to host memory and free their device pages (see the cache's
        ``swap_out``). Raises before changing anything."""
        seq_ids = _distinct_ids(seq_ids, "swap_out")
        seqs = [self.table.get(s) for s in seq_ids]  # raises for unknown or swapped ids
        rows_of: dict = {}  # device page -> row of the host buffer (a shared page is stored once)
        order: list = []
        seq_rows = []
        for seq in seqs:
            pages = seq.pages.tolist()
            for p in pages:
                if p not in rows_of:
                    rows_of[p] = len(order)
                    order.append(p)
            seq_rows.append(np.fromiter((rows_of[p] for p in pages), np.int64, len(pages)))
        self._chunks(len(order), max_staging_bytes)  # validates max_staging_bytes
        block = self._host_block(len(order))
        if order:
            self._pages_to_host(order, block.tensor, max_staging_bytes)
        # ---- copied: from here on nothing raises
        for sid, rows in zip(seq_ids, seq_rows):
            self.table.swap_out(sid)
            self.records[sid] = _Swapped(block, rows)
            block.users += 1

    def swap_in(self, seq_ids, max_staging_bytes: int) -> None:
        """Bring swapped-out ``seq_ids`` back into free device pages with identical K/V (see the
        cache's ``swap_in``). Raises before changing anything."""
        seq_ids = _distinct_ids(seq_ids, "swap_in")
        for s in seq_ids:
            if s not in self.records:
                self.table.get(s)  # KeyError for an unknown id
                raise ValueError(f"sequence {s} is on the device, not swapped out; swap_in only swapped sequences")
        recs = [self.records[s] for s in seq_ids]
        keys: list = []  # distinct (block, row) in first-use order
        index_of: dict = {}  # (id(block), row) -> index in keys (the new page)
        users: list = []  # sequences sharing each
        for rec in recs:
            for r in rec.rows.tolist():
                key = (id(rec.block), r)
                if key not in index_of:
                    index_of[key] = len(keys)
                    keys.append((rec.block, r))
                    users.append(0)
                users[index_of[key]] += 1
        needed = len(keys)
        self._chunks(needed, max_staging_bytes)  # validates max_staging_bytes
        if not self.pool.ensure_free(needed):  # page holders (prefix cache) may evict first
            raise OutOfPagesError(needed, self.pool.num_free, f"swap_in of sequences {seq_ids}")
        src, lo = self._host_source(keys)  # rows [lo, lo + needed) of the tensor src, in key order
        # ---- validated: allocate and copy
        pages = self.pool.alloc(needed)
        if needed:
            try:
                self._pages_from_host(pages, src, lo, max_staging_bytes)
            except BaseException:
                self.pool.undo_alloc(pages)
                raise
            extra = [p for p, n in zip(pages, users) for _ in range(n - 1)]
            if extra:
                self.pool.hold(extra)
        for sid, rec in zip(seq_ids, recs):
            self.table.swap_in(sid, [pages[index_of[(id(rec.block), r)]] for r in rec.rows.tolist()])
            self.drop(sid)

    def drop(self, seq_id: int) -> None:
        """Forget a swapped record (swap_in or remove); a buffer no record uses may become the spare."""
        block = self.records.pop(seq_id).block
        block.users -= 1
        if (
            block.users == 0
            and block.rows
            and (self._host_spare is None or self._host_spare.shape[0] < block.base.shape[0])
        ):
            self._host_spare = block.base

    def clear(self) -> None:
        self.records.clear()

    # ------------------------------------------------------------------ queries
    def num_pages(self, seq_ids=None) -> int:
        """Device pages ``swap_in(seq_ids)`` would allocate (default: every swapped sequence)."""
        if seq_ids is None:
            recs = list(self.records.values())
        else:
            recs = []
            for s in seq_ids:
                s = check_id(s, "seq_ids[i]")
                if s not in self.records:
                    self.table.get(s)
                    raise ValueError(f"sequence {s} is on the device, not swapped out")
                recs.append(self.records[s])
        return len({(id(rec.block), r) for rec in recs for r in rec.rows.tolist()})

    def host_bytes(self) -> int:
        """Bytes of host memory held for swapped-out sequences (whole buffers of ``swap_out`` calls)."""
        blocks = {id(rec.block): rec.block for rec in self.records.values()}
        return sum(b.base.shape[0] for b in blocks.values()) * self._row_bytes()

    def spare_bytes(self) -> int:
        """Bytes of the spare host buffer kept for the next ``swap_out`` (0 when none)."""
        return 0 if self._host_spare is None else self._host_spare.shape[0] * self._row_bytes()

    def release_spare(self) -> None:
        """Free the spare host buffer kept for reuse (buffers of swapped sequences stay)."""
        self._host_spare = None

    def check(self) -> list:
        """Problems of the swapped records, for ``check_integrity``."""
        P, problems = self.config.page_size, []
        if list(self.records) != list(self.table.swapped):
            problems.append("swap records and the table's swapped sequences differ")
        users: dict = {}
        blocks: dict = {}
        for rec in self.records.values():
            users[id(rec.block)] = users.get(id(rec.block), 0) + 1
            blocks[id(rec.block)] = rec.block
        for key, block in blocks.items():
            if block.users != users[key]:
                problems.append(f"a host buffer counts {block.users} users but {users[key]} sequences use it")
        for sid, rec in self.records.items():
            seq = self.table.swapped.get(sid)
            if seq is None:
                continue
            if len(rec.rows) != -(-seq.kv_len // P):
                problems.append(f"swapped sequence {sid}: {len(rec.rows)} host rows for {seq.kv_len} slots")
            if len(rec.rows) and not (0 <= rec.rows.min() and rec.rows.max() < rec.block.rows):
                problems.append(f"swapped sequence {sid}: host rows outside its buffer")
        return problems

    # ------------------------------------------------------------------ internals
    def _host_block(self, m: int) -> _HostBlock:
        """A host buffer of ``m`` rows: the spare when it is large enough, else a new one."""
        spare = self._host_spare
        if spare is not None and spare.shape[0] >= m:
            self._host_spare = None
            view = spare if spare.shape[0] == m else spare._create_view((m, *spare.shape[1:]))
            return _HostBlock(view, spare, m)
        t = self._empty_rows(m, self._host_device())
        return _HostBlock(t, t, m)

    def _sync_device(self) -> None:
        if self.config.target_kind != "llvm":
            self.device.sync()

    def _host_device(self):
        import tvm

        return tvm.cpu(0)

    def _empty_rows(self, m: int, device):
        """A tensor ``[m, L, 2, H_kv, P, D]`` of the page dtype on ``device``."""
        import tvm

        cfg = self.config
        shape = (m, cfg.num_layers, 2, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)
        return tvm.runtime.empty(shape, cfg.page_dtype, device)

    def _row_bytes(self) -> int:
        return self.config.num_layers * self.config.page_bytes

    def _chunks(self, m: int, max_staging_bytes: int):
        if max_staging_bytes < self._row_bytes():
            raise ValueError(
                f"max_staging_bytes={max_staging_bytes} is smaller than one page of all layers "
                f"({self._row_bytes()} bytes); raise it"
            )
        row_elems = self._row_bytes() // self.config.page_itemsize
        step = min(max_staging_bytes // self._row_bytes(), (2**31 - 1) // row_elems)  # int32 kernel indices
        return [(a, min(m, a + step)) for a in range(0, m, step)]

    def _staging(self, rows: int):
        """The device staging buffer's first ``rows`` rows (allocated once, grown when needed)."""
        buf = self._staging_buf
        if buf is None or buf.shape[0] < rows:
            buf = self._staging_buf = self._empty_rows(rows, self.device)
        return buf if buf.shape[0] == rows else buf._create_view((rows, *buf.shape[1:]))

    def _kernel(self, name: str):
        lib = self.kernels
        if name not in lib:
            raise RuntimeError(
                f"the kernel library {getattr(lib, 'path', '')} has no {name!r} (built before swap support); "
                "rebuild it (python -m tvmkv build ...)"
            )
        return lib[name]

    def _pages_to_host(self, page_ids: list, host, max_staging_bytes: int) -> None:
        """``host[i] = pages of page_ids[i]`` (all layers): per chunk, one kernel per layer into the
        staging buffer, then one device->host copy."""
        import tvm

        gather = self._kernel("gather_pages")
        chunks = self._chunks(len(page_ids), max_staging_bytes)
        direct = self.config.target_kind == "llvm" and len(chunks) == 1  # write the host buffer itself
        ids = np.asarray(page_ids, np.int32)
        for a, b in chunks:
            ids_dev = tvm.runtime.tensor(ids[a:b], self.device)
            staging = host if direct else self._staging(b - a)
            for layer in range(self.config.num_layers):
                gather(self.page_arrays[layer], ids_dev, staging, layer)
            if not direct:
                self._sync_device()  # the kernels may run on another stream than the copy (torch's)
                staging.copyto(host._create_view(tuple(staging.shape), relative_byte_offset=a * self._row_bytes()))

    def _pages_from_host(self, page_ids: list, host, lo: int, max_staging_bytes: int) -> None:
        """Pages ``page_ids[i]`` (all layers) ``= host[lo + i]``: per chunk, one host->device copy into
        the staging buffer, then one kernel per layer."""
        import tvm

        scatter = self._kernel("scatter_pages")
        chunks = self._chunks(len(page_ids), max_staging_bytes)
        direct = self.config.target_kind == "llvm" and len(chunks) == 1 and lo == 0 and host.shape[0] == len(page_ids)
        ids = np.asarray(page_ids, np.int32)
        for a, b in chunks:
            ids_dev = tvm.runtime.tensor(ids[a:b], self.device)
            if direct:
                staging = host
            else:
                staging = self._staging(b - a)
                if a:
                    self._sync_device()  # the previous chunk's kernels still read the staging buffer
                src = host._create_view(tuple(staging.shape), relative_byte_offset=(lo + a) * self._row_bytes())
                src.copyto(staging)
            for layer in range(self.config.num_layers):
                scatter(self.page_arrays[layer], ids_dev, staging, layer)

    def _host_source(self, keys: list) -> tuple:
        """``(tensor, lo)`` whose rows ``[lo, lo + len(keys))`` are the host rows ``keys`` in order: a
        buffer of ``swap_out`` itself when they are a contiguous run of it, else a gathered copy."""
        if not keys:
            return None, 0
        block, lo = keys[0]
        if all(k[0] is block and k[1] == lo + i for i, k in enumerate(keys)):
            return block.tensor, lo
        out = self._empty_rows(len(keys), self._host_device())
        dst = _numpy_view(out, self.config.page_dtype)
        views = {}
        at = 0
        while at < len(keys):  # copy runs of consecutive rows of one buffer with one slice each
            block, r = keys[at]
            end = at + 1
            while end < len(keys) and keys[end][0] is block and keys[end][1] == r + (end - at):
                end += 1
            if id(block) not in views:
                views[id(block)] = _numpy_view(block.tensor, self.config.page_dtype)
            dst[at:end] = views[id(block)][r : r + (end - at)]
            at = end
        return out, 0


def _distinct_ids(seq_ids, what: str) -> list:
    seq_ids = [check_id(s, "seq_ids[i]") for s in seq_ids]
    if len(set(seq_ids)) != len(seq_ids):
        dup = next(s for s in seq_ids if seq_ids.count(s) > 1)
        raise ValueError(f"seq_id {dup} appears twice in {what}; pass each sequence once")
    return seq_ids
