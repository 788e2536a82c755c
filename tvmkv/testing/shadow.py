"""An independent page accounting of a paged KV cache, for the stateful runner (:mod:`tvmkv.testing.stateful`)."""

from __future__ import annotations

import numpy as np


class PageShadow:
    """Independent page accounting, in logical block indices (block ``i`` holds positions ``[iP, iP+P)``).

    Each sequence maps block index -> page identity (a fresh int per allocated page). Forks share the
    identities of whole blocks and get a fresh one for a partial block; appending into a shared
    partial block copies it (a fresh identity); a slide drops blocks that lie wholly before the end of
    the sequence and hold no kept token; pops and commits drop blocks past the new end; an import
    takes fresh identities. A swapped-out sequence holds no identity: it keeps one host row per block,
    keyed by (swap call, identity), so blocks shared within one ``swap_out`` call are stored once and
    come back shared when swapped in together (fresh identities). ``holder`` is the set of identities
    a page holder (the radix prefix cache) keeps; the runner sets it from what it observes, since
    eviction is the holder's policy. The cache's free-page count must equal
    ``total - (distinct identities of sequences and holder)``.

    Parameters
    ----------
    page_size, total_pages : int
        The cache's ``P`` and page-pool size.
    """

    def __init__(self, page_size: int, total_pages: int):
        self.P, self.total = page_size, total_pages
        self.blocks: dict = {}  # resident sequence -> {block index: identity}
        self.swapped: dict = {}  # swapped sequence -> {block index: (swap call, identity)}
        self.holder: set = set()  # identities the page holder keeps (observed)
        self._next = 0

    def _fresh(self) -> int:
        self._next += 1
        return self._next

    def free(self) -> int:
        """Pages the cache must report as available."""
        return self.total - len({b for seq in self.blocks.values() for b in seq.values()} | self.holder)

    def _refs(self, ident: int) -> int:
        return sum(ident in seq.values() for seq in self.blocks.values()) + (ident in self.holder)

    def idents(self, sid) -> list:
        """Identities of ``sid``'s blocks in block order (= the cache's page list order)."""
        seq = self.blocks[sid]
        return [seq[i] for i in sorted(seq)]

    def add(self, sid) -> None:
        self.blocks[sid] = {}

    def add_blocks(self, sid, idents) -> None:
        """``sid`` holds blocks ``0..len(idents)-1`` with these identities (a prefix-cache hit)."""
        self.blocks[sid] = dict(enumerate(idents))

    def import_(self, sid, n: int) -> None:
        """``sid`` (new, or replacing an empty sequence) holds ``n`` tokens in fresh pages."""
        self.blocks[sid] = {i: self._fresh() for i in range(-(-n // self.P))}

    def remove(self, sid) -> None:
        if sid in self.swapped:
            del self.swapped[sid]
        else:
            del self.blocks[sid]

    def fork(self, parent, child, pos: int) -> None:
        full, partial = divmod(pos, self.P)
        blocks = {i: b for i, b in self.blocks[parent].items() if i < full}
        if partial:
            blocks[full] = self._fresh()
        self.blocks[child] = blocks

    def truncate(self, sid, length: int) -> None:
        keep = -(-length // self.P)
        self.blocks[sid] = {i: b for i, b in self.blocks[sid].items() if i < keep}

    def needed(self, sid, length: int, n: int) -> int:
        """Pages an append of ``n`` tokens at logical length ``length`` takes from the free list."""
        P, seq = self.P, self.blocks[sid]
        cow = length % P != 0 and self._refs(seq[length // P]) > 1
        return -(-(length + n) // P) - -(-length // P) + int(cow)

    def append(self, sid, length: int, n: int) -> None:
        P, seq = self.P, self.blocks[sid]
        if length % P and self._refs(seq[length // P]) > 1:
            seq[length // P] = self._fresh()
        for i in range(-(-length // P), -(-(length + n) // P)):
            seq[i] = self._fresh()

    def slide(self, sid, length: int, kept_pos) -> None:
        held = set((np.asarray(kept_pos, np.int64) // self.P).tolist())
        self.blocks[sid] = {i: b for i, b in self.blocks[sid].items() if i in held or (i + 1) * self.P > length}

    # ------------------------------------------------------------------ swap to host
    def swap_out(self, sids) -> None:
        """One ``swap_out`` call of ``sids``: their identities go to host rows, shared ones once."""
        call = self._fresh()
        for sid in sids:
            self.swapped[sid] = {i: (call, b) for i, b in self.blocks.pop(sid).items()}

    def swap_in_pages(self, sids) -> int:
        """Pages ``swap_in(sids)`` allocates: one per distinct host row."""
        return len({key for sid in sids for key in self.swapped[sid].values()})

    def swap_in(self, sids) -> None:
        fresh: dict = {}
        for sid in sids:
            rows = self.swapped.pop(sid)
            self.blocks[sid] = {i: fresh.setdefault(key, self._fresh()) for i, key in rows.items()}

    def swapped_pages(self) -> int:
        """Pages swapping every swapped sequence in (in one call) would allocate."""
        return self.swap_in_pages(list(self.swapped))
