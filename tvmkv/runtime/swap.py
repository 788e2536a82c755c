"""Swap to host: move sequences' pages to host memory and back (a mixin of ``PagedAttentionKVCache``).

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
or ``swap_in`` drops its reference); :meth:`HostSwap.swapped_host_bytes` reports what is held. The
largest released buffer is kept as a spare for the next ``swap_out`` that fits in it: writing into
freshly allocated memory costs a page fault per 4 KiB (on the CPU a fresh buffer made swap-out 4x
slower); :meth:`HostSwap.release_host_memory` frees the spare.

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

from ..errors import ForwardStateError, OutOfPagesError, SequenceSwappedError
from . import tensors

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
    """A swapped-out sequence: its bookkeeping (``seq.pages`` empty) and its pages' rows in ``block``."""

    seq: object  # runtime.cache._Sequence
    block: _HostBlock
    rows: np.ndarray  # int64 [ceil(kv_len / P)]: page k of the sequence is row rows[k] of block


def _numpy_view(t, dtype: str) -> np.ndarray:
    """A NumPy array sharing the memory of the CPU tensor ``t`` (offset 0; bfloat16 via a uint16 view)."""
    if dtype == "bfloat16":
        return np.from_dlpack(t._create_view(tuple(t.shape), "uint16")).view(tensors.numpy_dtype(dtype))
    return np.from_dlpack(t)


class HostSwap:
    """Swap methods of :class:`tvmkv.PagedAttentionKVCache`.

    State (set by the cache's ``__init__``): ``self._swapped`` (seq id -> :class:`_Swapped`, in swap
    order), ``self._staging_buf`` (the device staging buffer, allocated by the first swap) and
    ``self._host_spare`` (a released host buffer kept for reuse, or None).
    """

    # ------------------------------------------------------------------ public
    def swap_out(self, seq_ids, *, max_staging_bytes=DEFAULT_STAGING_BYTES) -> None:
        """Move the K/V of ``seq_ids`` to host memory and free their device pages.

        Parameters
        ----------
        seq_ids : list of int
            Sequences on the device (distinct). An empty list does nothing.
        max_staging_bytes : int
            Largest device staging buffer; a larger batch is copied in several chunks.

        Raises before changing anything: KeyError (unknown id), SequenceSwappedError (already
        swapped out), ValueError (duplicate id), ForwardStateError (a forward is open).
        """
        seq_ids = self._swap_ids(seq_ids, "swap_out")
        seqs = [self._get(s) for s in seq_ids]  # raises for unknown or swapped ids
        rows_of, order = {}, []  # device page -> row of the host buffer (a shared page is stored once)
        seq_rows = []
        for seq in seqs:
            for p in seq.pages:
                if p not in rows_of:
                    rows_of[p] = len(order)
                    order.append(p)
            seq_rows.append(np.fromiter((rows_of[p] for p in seq.pages), np.int64, len(seq.pages)))
        block = self._host_block(len(order))
        if order:
            self._pages_to_host(order, block.tensor, max_staging_bytes)
        # ---- copied: from here on nothing raises
        for sid, seq, rows in zip(seq_ids, seqs, seq_rows):
            self._release(seq.pages)
            seq.pages = []
            seq.mirror.rebuild(seq.pages, seq.pos_offset)
            del self._seqs[sid]
            self._swapped[sid] = _Swapped(seq, block, rows)
            block.users += 1

    def swap_in(self, seq_ids, *, max_staging_bytes=DEFAULT_STAGING_BYTES) -> None:
        """Bring swapped-out ``seq_ids`` back into free device pages with identical K/V.

        Pages shared by several of these sequences when they were swapped out together are shared
        again. Raises before changing anything: KeyError (unknown id), ValueError (a sequence that is
        not swapped out, duplicate id), ForwardStateError (a forward is open), OutOfPagesError
        (``needed`` / ``available`` pages).
        """
        seq_ids = self._swap_ids(seq_ids, "swap_in")
        for s in seq_ids:
            if s not in self._swapped:
                self._get(s)  # KeyError for an unknown id
                raise ValueError(f"sequence {s} is on the device, not swapped out; swap_in only swapped sequences")
        recs = [self._swapped[s] for s in seq_ids]
        keys, index_of, users = [], {}, []  # distinct (block, row) -> new page index, sharers
        for rec in recs:
            for r in rec.rows.tolist():
                key = (id(rec.block), r)
                if key not in index_of:
                    index_of[key] = len(keys)
                    keys.append((rec.block, r))
                    users.append(0)
                users[index_of[key]] += 1
        needed = len(keys)
        if not self._make_room(needed):  # page holders (prefix cache) may evict unreferenced pages first
            raise OutOfPagesError(needed, self.num_available_pages(), f"swap_in of sequences {seq_ids}")
        src, lo = self._host_source(keys)  # rows [lo, lo + needed) of the tensor src, in key order
        # ---- validated: allocate and copy
        pages = self._alloc(needed)
        if needed:
            try:
                self._pages_from_host(pages, src, lo, max_staging_bytes)
            except BaseException:
                self._release(pages)
                raise
            self._ref[pages] = users
        for sid, rec in zip(seq_ids, recs):
            seq = rec.seq
            seq.pages = [pages[index_of[(id(rec.block), r)]] for r in rec.rows.tolist()]
            seq.mirror.rebuild(seq.pages, seq.pos_offset)
            self._drop_swapped(sid)
            self._seqs[sid] = seq

    def is_swapped(self, seq_id) -> bool:
        """Whether ``seq_id`` is swapped out (KeyError if the cache does not know it)."""
        if self._swapped_id(seq_id):
            return True
        self._get(seq_id)
        return False

    def swapped_sequence_ids(self) -> list:
        """Ids of the swapped-out sequences, oldest swap first (``sequence_ids()`` lists the others)."""
        return list(self._swapped)

    def num_swapped_pages(self, seq_ids=None) -> int:
        """Device pages ``swap_in(seq_ids)`` would allocate (default: every swapped sequence)."""
        recs = self._swapped.values() if seq_ids is None else [self._swapped_record(s) for s in seq_ids]
        return len({(id(rec.block), r) for rec in recs for r in rec.rows.tolist()})

    def swapped_host_bytes(self) -> int:
        """Bytes of host memory held for swapped-out sequences (whole buffers of ``swap_out`` calls)."""
        blocks = {id(rec.block): rec.block for rec in self._swapped.values()}
        return sum(b.base.shape[0] for b in blocks.values()) * self._row_bytes()

    def release_host_memory(self) -> None:
        """Free the spare host buffer kept for reuse (buffers of swapped sequences stay)."""
        self._host_spare = None

    def num_pages_needed(self, seq_id, num_tokens) -> int:
        """Free pages a forward appending ``num_tokens`` to ``seq_id`` takes (new pages plus the
        copy-on-write of a shared partial last page); for a swapped sequence, its ``swap_in`` plus that."""
        P = self.config.page_size
        if self._swapped_id(seq_id):
            return -(-(self._swapped[seq_id].seq.kv_len + num_tokens) // P)
        seq = self._get(seq_id)
        grow = -(-(seq.kv_len + num_tokens) // P) - len(seq.pages)
        cow = bool(seq.kv_len % P) and self._ref[seq.pages[-1]] > 1
        return grow + cow

    def num_pages_released_by(self, seq_ids) -> int:
        """Pages that would return to the free list if every sequence of ``seq_ids`` left the device
        (``remove_sequence`` or ``swap_out``): pages no other sequence holds."""
        held = {}
        for s in seq_ids:
            for p in self._get(s).pages:
                held[p] = held.get(p, 0) + 1
        return sum(1 for p, n in held.items() if self._ref[p] == n)

    # ------------------------------------------------------------------ hooks used by the cache
    def _swapped_id(self, seq_id) -> bool:
        try:
            return seq_id in self._swapped
        except TypeError:  # unhashable: not an id at all
            return False

    def _swapped_record(self, seq_id) -> _Swapped:
        if self._swapped_id(seq_id):
            return self._swapped[seq_id]
        self._get(seq_id)
        raise ValueError(f"sequence {seq_id} is on the device, not swapped out")

    def _raise_if_swapped(self, seq_id) -> None:
        """Called where a sequence must be on the device: the error says how to get it back."""
        if self._swapped_id(seq_id):
            raise SequenceSwappedError(seq_id)

    def _remove_swapped(self, seq_id) -> bool:
        """``remove_sequence`` of a swapped sequence: drop it (and its host rows). False if not swapped."""
        if not self._swapped_id(seq_id):
            return False
        self._check_no_forward("remove_sequence")
        self._drop_swapped(seq_id)
        return True

    def _check_swapped(self) -> list:
        """Problems of the swapped-out sequences, for ``check_integrity``."""
        P, problems = self.config.page_size, []
        both = set(self._swapped) & set(self._seqs)
        if both:
            problems.append(f"sequences {sorted(both)} are both on the device and swapped out")
        users, blocks = {}, {}
        for rec in self._swapped.values():
            users[id(rec.block)] = users.get(id(rec.block), 0) + 1
            blocks[id(rec.block)] = rec.block
        for key, block in blocks.items():
            if block.users != users[key]:
                problems.append(f"a host buffer counts {block.users} users but {users[key]} sequences use it")
        for sid, rec in self._swapped.items():
            seq = rec.seq
            if seq.pages:
                problems.append(f"swapped sequence {sid} still holds device pages")
            if len(rec.rows) != -(-seq.kv_len // P):
                problems.append(f"swapped sequence {sid}: {len(rec.rows)} host rows for {seq.kv_len} slots")
            if len(rec.rows) and not (0 <= rec.rows.min() and rec.rows.max() < rec.block.rows):
                problems.append(f"swapped sequence {sid}: host rows outside its buffer")
        return problems

    # ------------------------------------------------------------------ internals
    def _swap_ids(self, seq_ids, what: str) -> list:
        from .cache import _as_int

        seq_ids = [_as_int(s, "seq_ids[i]") for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            dup = next(s for s in seq_ids if seq_ids.count(s) > 1)
            raise ValueError(f"seq_id {dup} appears twice in {what}; pass each sequence once")
        if self._fwd is not None:
            raise ForwardStateError(f"{what} is not allowed while a forward is open; call end_forward first")
        return seq_ids

    def _host_block(self, m: int) -> _HostBlock:
        """A host buffer of ``m`` rows: the spare when it is large enough, else a new one."""
        spare = self._host_spare
        if spare is not None and spare.shape[0] >= m:
            self._host_spare = None
            view = spare if spare.shape[0] == m else spare._create_view((m, *spare.shape[1:]))
            return _HostBlock(view, spare, m)
        t = self._empty_rows(m, self._host_device())
        return _HostBlock(t, t, m)

    def _drop_swapped(self, seq_id) -> None:
        """Forget a swapped record; a buffer no record uses any more may become the spare."""
        block = self._swapped.pop(seq_id).block
        block.users -= 1
        if (
            block.users == 0
            and block.rows
            and (self._host_spare is None or self._host_spare.shape[0] < block.base.shape[0])
        ):
            self._host_spare = block.base

    def _sync_device(self) -> None:
        if self.config.target_kind != "llvm":
            self.device.sync()

    def _host_device(self):
        import tvm

        return tvm.cpu(0)

    def _empty_rows(self, m: int, device):
        """A tensor ``[m, L, 2, H_kv, P, D]`` of the cache dtype on ``device``."""
        import tvm

        cfg = self.config
        shape = (m, cfg.num_layers, 2, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)
        return tvm.runtime.empty(shape, cfg.dtype, device)

    def _row_bytes(self) -> int:
        return self.config.num_layers * self.config.page_bytes

    def _chunks(self, m: int, max_staging_bytes: int):
        if max_staging_bytes < self._row_bytes():
            raise ValueError(
                f"max_staging_bytes={max_staging_bytes} is smaller than one page of all layers "
                f"({self._row_bytes()} bytes); raise it"
            )
        row_elems = self._row_bytes() // (4 if self.config.dtype == "float32" else 2)
        step = min(max_staging_bytes // self._row_bytes(), (2**31 - 1) // row_elems)  # int32 kernel indices
        return [(a, min(m, a + step)) for a in range(0, m, step)]

    def _staging(self, rows: int):
        """The device staging buffer's first ``rows`` rows (allocated once, grown when needed)."""
        buf = self._staging_buf
        if buf is None or buf.shape[0] < rows:
            buf = self._staging_buf = self._empty_rows(rows, self.device)
        return buf if buf.shape[0] == rows else buf._create_view((rows, *buf.shape[1:]))

    def _kernel(self, name: str):
        lib = self._kernels
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
                gather(self.pages[layer], ids_dev, staging, layer)
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
                scatter(self.pages[layer], ids_dev, staging, layer)

    def _host_source(self, keys: list) -> tuple:
        """``(tensor, lo)`` whose rows ``[lo, lo + len(keys))`` are the host rows ``keys`` in order: a
        buffer of ``swap_out`` itself when they are a contiguous run of it, else a gathered copy."""
        if not keys:
            return None, 0
        block, lo = keys[0]
        if all(k[0] is block and k[1] == lo + i for i, k in enumerate(keys)):
            return block.tensor, lo
        out = self._empty_rows(len(keys), self._host_device())
        dst = _numpy_view(out, self.config.dtype)
        views = {}
        at = 0
        while at < len(keys):  # copy runs of consecutive rows of one buffer with one slice each
            block, r = keys[at]
            end = at + 1
            while end < len(keys) and keys[end][0] is block and keys[end][1] == r + (end - at):
                end += 1
            if id(block) not in views:
                views[id(block)] = _numpy_view(block.tensor, self.config.dtype)
            dst[at:end] = views[id(block)][r : r + (end - at)]
            at = end
        return out, 0
