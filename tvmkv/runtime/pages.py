"""The page pool: a free list and one reference count per page, shared by every layer.

A page id names the same slot range in every layer's pool array (docs/layout.md, "Pages"), so the
bookkeeping is one free list and one ref-count array for all layers. Holders of references are
sequence page tables (:mod:`tvmkv.runtime.sequences`) and *page holders* outside any sequence (the
radix prefix cache), which the pool asks to evict before it reports a shortage.

No tensors here: page ids are Python ints, ref counts one NumPy int32 array.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import numpy as np

from ..errors import OutOfPagesError


class PageHolder(Protocol):
    """Something that holds page references outside any sequence (e.g. the radix prefix cache)."""

    def held_pages(self) -> list:
        """Every page it holds a reference on, once per reference (``check`` counts them)."""

    def evict_pages(self, count: int) -> int:
        """Release at least ``count`` pages only it holds and return how many, or release nothing."""

    def forget_pages(self) -> None:
        """Every reference was dropped at once (the cache was cleared): forget them, release nothing."""


class PagePool:
    """``num_pages`` pages: a free list (low ids handed out first) and a ref count per page.

    ``version`` changes with every allocation, hold or release, so a plan that depends on ref counts
    (copy-on-write decisions) can tell whether it is still valid. ``shared`` is the set of pages held
    more than once: the step planner looks for copy-on-write only when some sequence's last page is
    in it (one C-level set test per step).
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._ref = np.zeros(num_pages, np.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._holders: list = []
        self.version = 0
        self.shared: set = set()  # pages whose ref count is > 1 (read it; the pool alone writes it)

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_shared(self) -> int:
        """Pages whose ref count is > 1."""
        return len(self.shared)

    def ref_count(self, page: int) -> int:
        return int(self._ref[page])

    def ref_counts(self) -> np.ndarray:
        """Every page's ref count, int32 ``[num_pages]`` (a read-only view; copy it to modify)."""
        view = self._ref.view()
        view.flags.writeable = False
        return view

    def ref_counts_of(self, pages: np.ndarray) -> np.ndarray:
        """The ref counts of ``pages`` (int64 ``[k]``; negative ids index from the end, as NumPy
        does: mask them out), a new int32 ``[k]`` array."""
        return self._ref[pages]

    @property
    def holders(self) -> tuple:
        return tuple(self._holders)

    # ------------------------------------------------------------------ changes
    def alloc(self, count: int) -> list:
        """``count`` free pages, each with ref count 1. Callers check :meth:`ensure_free` first."""
        if count > len(self._free):
            raise OutOfPagesError(count, len(self._free))
        if count <= 0:  # nothing taken, nothing changed
            return []
        self.version += 1
        if count == 1:  # a decode step's usual request: no list comprehension, no fancy indexing
            page = self._free.pop()
            self._ref[page] = 1
            return [page]
        free, ref = self._free, self._ref
        pages = free[: -count - 1 : -1]  # the last ``count`` entries, last first: the order pop() takes them
        del free[len(free) - count :]
        if count <= 8:  # a decode step's few pages: item writes beat converting the list for NumPy
            for page in pages:
                ref[page] = 1
        else:
            ref[pages] = 1
        return pages

    def hold(self, pages: Iterable[int]) -> None:
        """One more reference on each entry of ``pages`` (already referenced; repeats add up)."""
        pages = np.asarray(pages, np.int64)
        ref, once = self._ref, np.unique(pages)
        single = ref[once] <= 1
        np.add.at(ref, pages, 1)
        self.shared.update(once[single & (ref[once] > 1)].tolist())
        self.version += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference per entry of ``pages``; a page whose count reaches 0 is free again."""
        self.version += 1
        ref, free = self._ref, self._free
        for p in pages.tolist() if isinstance(pages, np.ndarray) else pages:
            ref[p] -= 1
            left = ref[p]
            if left == 0:
                free.append(p)
            elif left == 1:
                self.shared.discard(p)

    def undo_alloc(self, pages: list) -> None:
        """Give back ``pages`` that :meth:`alloc` just handed out (each still at ref count 1), in reverse, so
        that the free list is as it was before (the order later allocations hand pages out in, which
        ``table_digest`` covers): what a failed operation does with the pages it took."""
        self.release(pages[::-1])

    def ensure_free(self, needed: int) -> bool:
        """True when ``needed`` pages are free, after asking page holders to evict pages only they
        hold (a holder evicts nothing when it cannot cover the shortfall)."""
        for holder in self._holders:
            if needed <= len(self._free):
                break
            holder.evict_pages(needed - len(self._free))
        return needed <= len(self._free)

    def attach_holder(self, holder: PageHolder) -> None:
        if holder in self._holders:
            raise ValueError("this page holder is already attached")
        self._holders.append(holder)

    def reset(self) -> None:
        """Every page free, every reference gone; holders forget theirs."""
        self._ref[:] = 0
        self._free = list(range(self.num_pages - 1, -1, -1))
        self.shared = set()
        self.version += 1
        for holder in self._holders:
            holder.forget_pages()

    # ------------------------------------------------------------------ integrity
    def digest(self, h) -> None:
        """Feed the pool's state to the hashlib object ``h``: the free list in hand-out order and every
        ref count (two pools that digest alike hand out the same pages for the same requests)."""
        h.update(len(self._free).to_bytes(8, "little"))
        h.update(np.asarray(self._free, np.int32).tobytes())
        h.update(self._ref.tobytes())

    def check(self, page_lists: Iterable) -> list:
        """Problems (strings) of the accounting, given every sequence's page list: each page's ref
        count must equal the page lists plus holder references holding it; free + used == total."""
        counts = np.zeros(self.num_pages, np.int64)
        problems = []
        for holder in self._holders:
            np.add.at(counts, np.asarray(holder.held_pages(), np.int64), 1)
        for pages in page_lists:
            np.add.at(counts, np.asarray(pages, np.int64), 1)
        if not np.array_equal(counts, self._ref):
            bad = np.nonzero(counts != self._ref)[0][:5].tolist()
            problems.append(f"ref counts disagree with page tables at pages {bad}")
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("a page is on the free list twice")
        if any(self._ref[p] for p in free):
            problems.append("a page on the free list is referenced")
        shared = set(np.flatnonzero(self._ref > 1).tolist())
        if shared != self.shared:
            problems.append(
                f"pages {sorted(shared ^ self.shared)[:5]} disagree between the ref counts and the shared set"
            )
        used = int((self._ref > 0).sum())
        if used + len(self._free) != self.num_pages:
            problems.append(f"free {len(self._free)} + used {used} != total {self.num_pages}")
        return problems
