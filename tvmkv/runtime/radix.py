"""``RadixPrefixCache``: a radix tree over token ids whose nodes hold ref-counted pages of a
:class:`~tvmkv.runtime.cache.PagedAttentionKVCache`, so requests that share a prefix (a system
prompt, earlier turns of a chat) reuse its K/V instead of prefilling it again.

Tree
    Each node holds an edge of token ids and the pages that store them: a node starts at a page
    boundary (absolute position ``start``, a multiple of ``P``) and holds ``ceil(len / P)`` pages,
    page ``i`` storing positions ``[start + i P, start + (i + 1) P)`` (docs/layout.md, "Pages").
    Only a leaf may end inside a page. Nodes split at page boundaries only, so two children of a
    node may share their first few tokens (they diverge inside their first page); children are
    keyed by their first page of tokens (``tokens[:P]``).

Reuse
    ``match_prefix`` walks the tree token by token (not page by page): a request that shares 37
    tokens with a cached sequence at ``P = 16`` reuses 37, not 32. The new sequence shares every
    matched page; when the match ends inside a page, that page is shared too and the cache's
    copy-on-write copies its matched slots into a fresh page at the sequence's first forward, so the
    tokens are copied, not recomputed, and the tree's page stays intact.

References
    The tree takes one reference (``cache.pool``, :class:`~tvmkv.runtime.pages.PagePool`) on each
    page it holds; a page is *evictable* when the tree's reference is its only one. The pool asks the
    tree to evict (LRU order of last use, leaves first) before an ``OutOfPagesError`` is raised
    (``PagePool.ensure_free``), and the cache's ``check_integrity`` counts the tree's references.

Limits
    Sequences with a sliding window and sequences with uncommitted token-tree nodes are not inserted
    (ValueError): a window drops pages from the middle of a sequence and tree nodes are not yet a
    chain of tokens. Reused K/V is valid because it is reused at the same positions: with RoPE mode
    "normal" K is stored rotated at its absolute position, which a request with the same prefix
    shares. The tree cannot check that the tokens passed to ``insert`` are the ones whose K/V the
    sequence holds; that is the caller's contract (token ``i`` has its K/V at position ``i``).

The module uses the cache's public API only: ``sequence_info`` / ``sequence_pages`` to read a
sequence, ``pool.ref_counts`` to read references, ``add_sequence_with_pages``, ``pool.hold`` and
``pool.release`` to change them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..errors import IntegrityError
from .sequences import as_int


class _Node:
    """One edge of the tree: ``tokens`` at positions ``[start, start + len(tokens))`` in ``pages``."""

    __slots__ = ("parent", "children", "tokens", "pages", "start", "last_use")

    def __init__(self, parent, tokens: tuple, pages: list, start: int, last_use: int = 0):
        self.parent = parent
        self.children: dict = {}  # tokens[:P] -> _Node
        self.tokens = tokens
        self.pages = pages
        self.start = start
        self.last_use = last_use

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class PrefixCacheStats:
    """Counters of a :class:`RadixPrefixCache` since it was created."""

    requests: int = 0  # add_sequence_with_prefix calls that succeeded
    requested_tokens: int = 0  # their prompt tokens
    reused_tokens: int = 0  # of which were served from the tree
    partial_page_reuses: int = 0  # requests whose reuse ends inside a page (that page is copied)
    inserted_tokens: int = 0  # tokens added to the tree by insert / finish_sequence
    evicted_pages: int = 0
    evicted_nodes: int = 0

    @property
    def hit_rate(self) -> float:
        """Reused / requested prompt tokens (0 before any request)."""
        return self.reused_tokens / self.requested_tokens if self.requested_tokens else 0.0


class RadixPrefixCache:
    """A radix prefix cache over ``cache`` (see the module docstring).

    Parameters
    ----------
    cache : PagedAttentionKVCache
        The cache whose pages the tree holds. The prefix cache registers itself as a page holder of
        ``cache`` (``attach_page_holder``); one cache may have one prefix cache.

    Examples
    --------
    >>> prefix = RadixPrefixCache(cache)
    >>> reused = prefix.add_sequence_with_prefix(1, prompt)   # sequence 1 holds prompt[:reused]
    >>> cache.begin_forward([1], [len(prompt) - reused])      # prefill only the rest
    >>> ...
    >>> prefix.finish_sequence(1, prompt + generated)         # cache its pages, remove sequence 1
    """

    def __init__(self, cache):
        if any(isinstance(h, RadixPrefixCache) for h in cache.pool.holders):
            raise ValueError("this cache already has a RadixPrefixCache; use that one")
        self.cache = cache
        self.page_size = cache.config.page_size
        self.stats = PrefixCacheStats()
        self._root = _Node(None, (), [], 0)
        self._clock = 0
        self._num_pages = 0
        cache.attach_page_holder(self)

    # ------------------------------------------------------------------ queries
    def match_prefix(self, token_ids) -> int:
        """Number of leading tokens of ``token_ids`` whose K/V the tree holds (read-only).

        Parameters
        ----------
        token_ids : sequence of int or 1-D integer NumPy array
        """
        tokens = token_ids_tuple(token_ids, "token_ids")
        path, _, common = self._walk(tokens)
        return (path[-1].end if path else 0) + common

    def num_cached_pages(self) -> int:
        """Pages the tree holds a reference on (some may be shared with running sequences)."""
        return self._num_pages

    def edges(self) -> list:
        """Every edge of the tree as ``(start, tokens, pages)`` tuples (read-only; root excluded)."""
        return [(n.start, n.tokens, tuple(n.pages)) for n in self._nodes() if n is not self._root]

    def num_cached_tokens(self) -> int:
        return sum(len(node.tokens) for node in self._nodes())

    def num_evictable_pages(self, *, without=(), pinned=()) -> int:
        """Pages eviction could free now: those of subtrees that no sequence holds a page of.

        ``without`` (sequence ids on the device) and ``pinned`` (page ids, repeats allowed) ask the
        same question of a state that does not exist yet, as a scheduler planning a step needs: the
        references of the ``without`` sequences dropped (they leave: remove or swap out) and one more
        reference on each ``pinned`` page (a new sequence shares it: :meth:`prefix_pages`). Read-only.
        """
        ref = self.cache.pool.ref_counts()
        if not without and not len(pinned):
            return sum(len(node.pages) for node in self._evictable_nodes())
        ref = ref.copy()
        for sid in without:
            ref[self.cache.sequence_pages(sid)] -= 1  # a sequence holds a page at most once
        np.add.at(ref, np.asarray(pinned, np.int64), 1)
        free = {id(node) for node in self._evictable_nodes(ref)}
        pinned = set(np.asarray(pinned, np.int64).tolist())
        count = 0
        for node in self._nodes():
            if id(node) in free:
                count += len(node.pages)
            elif node is not self._root and all(id(c) in free for c in node.children.values()):
                # a matched prefix of the node pinned by a new sequence: add_sequence_with_prefix
                # splits the node where the pinned pages end, and the lower part is evictable
                q = max((i + 1 for i, p in enumerate(node.pages) if p in pinned), default=0)
                if 0 < q < len(node.pages) and bool((ref[node.pages[q:]] == 1).all()):
                    count += len(node.pages) - q
        return count

    def prefix_pages(self, token_ids, *, max_reuse=None) -> tuple:
        """``(reused, pages)``: how many tokens ``add_sequence_with_prefix(seq_id, token_ids,
        max_reuse=max_reuse)`` would reuse now and the ``ceil(reused / P)`` pages the new sequence
        would share (the last one copied on its first write when ``reused % P``). Read-only."""
        tokens = token_ids_tuple(token_ids, "token_ids")
        reused, nodes = self._match(tokens, max_reuse)
        return reused, [p for node in nodes for p in node.pages][: -(-reused // self.page_size)]

    def holds_cached_prefix(self, seq_id, token_ids) -> bool:
        """Whether ``seq_id`` holds the tree's pages of every full page of the cached prefix of
        ``token_ids`` (read-only). Then ``insert(seq_id, token_ids)`` while it keeps running only
        pins pages it holds anyway; otherwise the new leaf would hang below pages of another
        sequence's, which could not be evicted while ``seq_id`` runs."""
        tokens = token_ids_tuple(token_ids, "token_ids")
        reused, pages = self.prefix_pages(tokens, max_reuse=len(tokens))
        full = reused // self.page_size
        return self.cache.sequence_pages(seq_id)[:full] == pages[:full]

    # ------------------------------------------------------------------ sequences
    def add_sequence_with_prefix(self, seq_id, token_ids, *, max_reuse=None) -> int:
        """Add ``seq_id`` holding the longest cached prefix of ``token_ids``; return its length.

        The caller then appends (prefills) ``token_ids[reused:]``. Matched pages are shared; a page
        the match ends inside is shared until the sequence's first forward copies it (copy-on-write).

        Parameters
        ----------
        seq_id : int
            A new sequence id.
        token_ids : sequence of int or 1-D integer NumPy array
            The request's prompt.
        max_reuse : int, optional
            Reuse at most this many tokens; default ``len(token_ids) - 1``, so at least one token
            is prefilled and yields the logits of the next token.

        Raises KeyError / TypeError (seq_id), ValueError, ForwardStateError before changing anything.
        """
        tokens = token_ids_tuple(token_ids, "token_ids")
        P = self.page_size
        reused, nodes = self._match(tokens, max_reuse)
        pages = [p for node in nodes for p in node.pages][: -(-reused // P)]
        self.cache.add_sequence_with_pages(seq_id, pages, reused)  # validates seq_id / forward state
        # ---- the sequence exists: split where its full pages end and where its partially matched
        # page ends, so the pages after them stay evictable (the partial page is released again by
        # the copy-on-write of the sequence's first forward)
        for cut in sorted({reused // P * P, -(-reused // P) * P}):
            for i, node in enumerate(nodes):
                if node.start < cut < node.end:
                    nodes[i : i + 1] = [self._split(node, cut - node.start), node]  # upper, lower part
                    break
        self._touch([n for n in nodes if n.start < reused])
        s = self.stats
        s.requests += 1
        s.requested_tokens += len(tokens)
        s.reused_tokens += reused
        s.partial_page_reuses += bool(reused % P)
        return reused

    def insert(self, seq_id, token_ids) -> int:
        """Cache the pages of ``seq_id`` that hold ``token_ids`` (its first ``len(token_ids)``
        tokens; token ``i`` has its K/V at position ``i``). The sequence stays in the cache; pages
        it shares with the tree are copied on write when it appends into them.

        Returns the number of tokens that were new to the tree.
        Raises KeyError, ValueError, ForwardStateError before changing anything.
        """
        cache, P = self.cache, self.page_size
        seq_pages = cache.sequence_pages(seq_id)  # KeyError / SequenceSwappedError
        seq = cache.sequence_info(seq_id)
        cache.require_no_forward("insert")
        tokens = token_ids_tuple(token_ids, "token_ids")
        n = len(tokens)
        if seq.window:
            raise ValueError(
                f"sequence {seq_id} has a sliding window: its pages are not inserted into the prefix cache "
                "(a window drops pages); remove it with remove_sequence instead"
            )
        if seq.num_tree_nodes:
            raise ValueError(
                f"sequence {seq_id} has {seq.num_tree_nodes} uncommitted token-tree nodes; commit them "
                "(commit_accepted_token_tree_nodes) before inserting it into the prefix cache"
            )
        if n > seq.length:
            raise ValueError(
                f"token_ids has {n} tokens but sequence {seq_id} holds {seq.length}; pass at most its "
                "first sequence_length tokens (those whose K/V are in the cache)"
            )
        path, child, common = self._walk(tokens)
        parent = path[-1] if path else self._root
        matched = parent.end + common
        if matched == n:
            self._touch(path + ([child] if common else []))
            return 0
        start = parent.end + common // P * P  # the new leaf starts at the last page boundary matched
        # a cached leaf that ends inside its last page and is a prefix of tokens is replaced by them
        replaced = child if child is not None and common == len(child.tokens) else None
        pages = seq_pages[start // P : -(-n // P)]
        held = {p for node in self._nodes() for p in node.pages}
        if replaced is not None:
            held.discard(replaced.pages[-1])
        clash = [p for p in pages if p in held]
        if clash:
            raise ValueError(
                f"pages {clash[:4]} of sequence {seq_id} are cached under other tokens: token_ids do not "
                "match the tokens whose K/V the sequence holds"
            )
        # ---- validated
        if child is not None and start > parent.end:
            parent = self._split(child, start - parent.end)
            child = next(iter(parent.children.values()))
        if replaced is not None:  # now `child`: one partial page, a prefix of tokens[start:]
            self._remove(child)
        leaf = _Node(parent, tokens[start:n], list(pages), start)
        assert tokens[start : start + P] not in parent.children, "walk would have matched it"
        parent.children[leaf.tokens[:P]] = leaf
        self.cache.pool.hold(pages)
        self._num_pages += len(pages)
        self._touch(path + [parent, leaf])
        self.stats.inserted_tokens += n - matched
        return n - matched

    def finish_sequence(self, seq_id, token_ids) -> int:
        """:meth:`insert` ``seq_id``, then remove it from the cache. Returns the tokens new to the tree."""
        added = self.insert(seq_id, token_ids)
        self.cache.remove_sequence(seq_id)
        return added

    def reset(self) -> None:
        """Drop the whole tree (its references are released; pages no sequence holds become free)."""
        self.cache.require_no_forward("reset")
        pages = [p for node in self._nodes() for p in node.pages]
        self._root = _Node(None, (), [], 0)
        self._num_pages = 0
        self.cache.pool.release(pages)

    # ------------------------------------------------------------------ page holder protocol
    def held_pages(self) -> list:
        """Every page the tree holds a reference on (``check_integrity`` counts them)."""
        return [p for node in self._nodes() for p in node.pages]

    def evict_pages(self, count: int) -> int:
        """Free at least ``count`` pages by evicting least recently used unreferenced leaves; evict
        nothing when fewer than ``count`` are evictable. Returns the pages freed."""
        ref = self.cache.pool.ref_counts()
        if count <= 0 or self.num_evictable_pages() < count:
            return 0

        def free_leaf(node) -> bool:
            return node is not self._root and not node.children and bool((ref[node.pages] == 1).all())

        heap = [(n.last_use, id(n), n) for n in self._nodes() if free_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < count and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += len(node.pages)
            self._remove(node)
            self.stats.evicted_nodes += 1
            if free_leaf(parent):
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        self.stats.evicted_pages += freed
        return freed

    def forget_pages(self) -> None:
        """The cache was cleared (every reference dropped): forget the tree without releasing."""
        self._root = _Node(None, (), [], 0)
        self._num_pages = 0

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the tree is well formed (page boundaries, keys, page counts,
        no page twice, every page referenced), then run the cache's ``check_integrity`` (which counts
        the tree's references)."""
        P, ref = self.page_size, self.cache.pool.ref_counts()
        problems: list = []
        seen: set = set()
        for node in self._nodes():
            if node is self._root:
                continue
            where = f"node at [{node.start}, {node.end})"
            if node.start != node.parent.end or node.start % P:
                problems.append(f"{where} does not start at its parent's end on a page boundary")
            if not node.tokens or node.parent.children.get(node.tokens[:P]) is not node:
                problems.append(f"{where} is not its parent's child under its first page")
            if len(node.pages) != -(-len(node.tokens) // P):
                problems.append(f"{where} holds {len(node.pages)} pages")
            if node.end % P and node.children:
                problems.append(f"{where} ends inside a page but has children")
            if seen.intersection(node.pages) or len(set(node.pages)) != len(node.pages):
                problems.append(f"{where} holds a page another node holds")
            seen.update(node.pages)
            if node.pages and (ref[node.pages] < 1).any():
                problems.append(f"{where} holds a page with ref count 0")
        if len(seen) != self._num_pages:
            problems.append(f"the tree holds {len(seen)} pages but counts {self._num_pages}")
        if problems:
            raise IntegrityError("prefix cache: " + "; ".join(problems))
        self.cache.check_integrity()

    # ------------------------------------------------------------------ internals
    def _nodes(self):
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evictable_nodes(self, ref=None) -> list:
        """Non-root nodes whose whole subtree holds only pages no sequence holds (by the ref counts
        ``ref``, default the cache's)."""
        ref = self.cache.pool.ref_counts() if ref is None else ref
        order = list(self._nodes())  # parents before children
        free: dict = {}
        for node in reversed(order):
            free[id(node)] = bool((ref[node.pages] == 1).all()) and all(free[id(c)] for c in node.children.values())
        return [node for node in order if node is not self._root and free[id(node)]]

    def _match(self, tokens: tuple, max_reuse) -> tuple:
        """``(reused, nodes)``: the tokens a new sequence reuses (capped by ``max_reuse``, default
        ``len(tokens) - 1``) and the nodes of the walk whose pages it would share (a prefix of them)."""
        limit = max(len(tokens) - 1, 0) if max_reuse is None else as_int(max_reuse, "max_reuse")
        if not 0 <= limit <= len(tokens):
            raise ValueError(f"max_reuse={limit} must be in [0, len(token_ids)={len(tokens)}]")
        path, child, common = self._walk(tokens)
        reused = min((path[-1].end if path else 0) + common, limit)
        return reused, path + ([child] if child is not None else [])

    def _walk(self, tokens: tuple) -> tuple:
        """``(path, child, common)``: ``path`` the nodes fully matched that end on a page boundary
        (root excluded), ``child`` the child of the last of them (or of the root) sharing the most
        tokens with the rest of ``tokens``, ``common`` how many (0 and None when no child does)."""
        P, n = self.page_size, len(tokens)
        node, pos = self._root, 0
        path: list = []
        while pos < n:
            first = tokens[pos : pos + P]
            child = node.children.get(first) if len(first) == P else None
            if child is not None:
                common = _common_prefix(child.tokens, tokens, pos, P)
            else:  # the rest diverges inside its first page from every child (or ends there)
                common = 0
                for c in node.children.values():
                    k = _common_prefix(c.tokens[:P], first, 0, P)
                    if k > common:
                        child, common = c, k
                if child is None:
                    break
            if common < len(child.tokens) or child.end % P:
                return path, child, common
            path.append(child)
            node, pos = child, child.end
        return path, None, 0

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node`` after its first ``k`` tokens (``0 < k < len``, a multiple of P); return the
        upper part, which takes the node's place under its parent."""
        P = self.page_size
        assert 0 < k < len(node.tokens) and k % P == 0
        upper = _Node(node.parent, node.tokens[:k], node.pages[: k // P], node.start, node.last_use)
        node.parent.children[upper.tokens[:P]] = upper  # the same key as node's
        node.tokens, node.pages, node.start, node.parent = node.tokens[k:], node.pages[k // P :], node.start + k, upper
        upper.children[node.tokens[:P]] = node
        return upper

    def _remove(self, node: _Node) -> None:
        """Remove leaf ``node`` and release its pages."""
        assert not node.children and node is not self._root
        del node.parent.children[node.tokens[: self.page_size]]
        self._num_pages -= len(node.pages)
        self.cache.pool.release(node.pages)

    def _touch(self, nodes) -> None:
        self._clock += 1
        for node in nodes:
            node.last_use = self._clock


def _common_prefix(edge: tuple, tokens: tuple, pos: int, P: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[pos:]`` (compared a page at a time)."""
    L = min(len(edge), len(tokens) - pos)
    i = 0
    while i < L:
        j = min(i + P, L)
        if edge[i:j] != tokens[pos + i : pos + j]:
            return next(k for k in range(i, j) if edge[k] != tokens[pos + k])
        i = j
    return L


def token_ids_tuple(token_ids, name: str) -> tuple:
    """``token_ids`` as a tuple of Python ints (TypeError / ValueError name the argument)."""
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of int token ids, not {type(token_ids).__name__}")
    arr = np.asarray(token_ids)
    if arr.size == 0:
        return ()
    if arr.ndim != 1:
        raise ValueError(f"{name} has shape {arr.shape}; pass a 1-D sequence of token ids")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} has dtype {arr.dtype}; token ids must be ints")
    return tuple(arr.tolist())
