"""An independent page accounting of a paged KV cache, for the stateful runner (:mod:`tvmkv.testing.stateful`)."""

from __future__ import annotations

import numpy as np


class PageShadow:
    """Independent page accounting, in logical block indices (block ``i`` holds positions ``[iP, iP+P)``).

    Each sequence maps block index -> page identity (a fresh int per allocated page). Forks share the
    identities of whole blocks and get a fresh one for a partial block; appending into a shared
    partial block copies it (a fresh identity); a slide drops blocks that lie wholly before the end of
    the sequence and hold no kept token; pops and commits drop blocks past the new end. The cache's
    free-page count must equal ``total - (distinct identities)``.

    Parameters
    ----------
    page_size, total_pages : int
        The cache's ``P`` and page-pool size.
    """

    def __init__(self, page_size: int, total_pages: int):
        self.P, self.total = page_size, total_pages
        self.blocks: dict = {}
        self._next = 0

    def _fresh(self) -> int:
        self._next += 1
        return self._next

    def free(self) -> int:
        """Pages the cache must report as available."""
        return self.total - len({b for seq in self.blocks.values() for b in seq.values()})

    def _refs(self, ident: int) -> int:
        return sum(ident in seq.values() for seq in self.blocks.values())

    def add(self, sid) -> None:
        self.blocks[sid] = {}

    def remove(self, sid) -> None:
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
