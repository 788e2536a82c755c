"""Stateful randomized differential testing of ``PagedAttentionKVCache`` against the NumPy ``CacheModel``.

A seeded :class:`Generator` draws random interleavings of every public operation — add,
fork (anywhere, forks of forks), pop_n, remove, sliding windows, prefill/decode steps, multi-round
token trees with commits — and deliberate misuse (unknown or duplicate ids, fork past the end, pops
that are too long, out-of-pages forwards on caches with few pages, bad tree parents, calls that the
forward protocol forbids, ...). Operation families beyond that base mix are turned on per run
(``extras``, :data:`EXTRAS`), so the streams of runs without them stay as they were:

- ``"interop"``: ``interop.export_sequence`` (every layout, into a larger foreign array at shuffled
  blocks) checked against the model, and ``interop.import_sequence`` of an export or of random data
  into a new id or into a REUSED one (an existing sequence emptied by ``pop_n``), with flawed data;
- ``"swap"``: ``swap_out`` / ``swap_in`` of random subsets, and every call on a swapped sequence;
- ``"prefix"``: a :class:`tvmkv.RadixPrefixCache` on the cache (``add_sequence_with_prefix``,
  ``insert``, ``finish_sequence``, ``reset``); the model copies the K/V of the reused tokens from the
  sequences they were inserted from;
- ``"views"``: consecutive decode steps of one batch (the repeat-decode fast path) among forwards of
  varied shapes; on a cache with large batches this makes an index-buffer slot cache more than 512
  device views (:meth:`StatefulRunner.max_views` counts them from ``debug_forward()``).

Operations are plain lists in the :mod:`tvmkv.replay` format plus the kinds above and a few
misuse-only ones, so a failing sequence can be pasted into a regression test.

:class:`StatefulRunner` runs one operation at a time. Before each call it predicts, from the model
and from an independent page-accounting shadow (:class:`PageShadow`), whether the call must succeed
or which exceptions it may raise. After a successful call the attention outputs, lengths, stored
K/V, exported K/V and free-page count must match; after a rejected call nothing may have changed (free
pages, lengths, stored K/V, the prefix tree). ``check_integrity()`` runs after every operation, and the
pages of every sequence must be shared exactly as the shadow shares its pages (same shadow page <=>
same page id). Because every call's outcome is predicted, any sub-list of a failing list is itself a
runnable test, which :func:`shrink` uses to cut counterexamples down by deleting operations.

:func:`run_random` draws and runs one episode; tests/test_stateful.py runs a few short ones
(:data:`tvmkv.testing.configs.STATEFUL_CONFIGS`), ``bench/soak.py`` drives the same machinery for
100k+ operations. The runner reads the cache only through its public API (free pages, sequence ids,
lengths and pages, ``check_integrity()``, ``debug_get_kv``, ``debug_forward``, the prefix cache's
``held_pages`` / ``num_evictable_pages`` / ``stats``); what it knows about pages comes from the shadow,
except which pages the prefix cache keeps (eviction is its policy: the runner observes it).
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import ForwardStateError, OutOfPagesError, SequenceSwappedError
from ..replay import STORED_TOL, Replayer
from ..runtime import interop
from ..runtime.plan import PackedLayout
from ..runtime.radix import RadixPrefixCache
from ..runtime.tensors import numpy_dtype
from .shadow import PageShadow

ID_POOL = 8  # sequence ids are drawn from [0, ID_POOL) so collisions (misuse) happen often
NEW_ID = 10**6  # an id no run uses (calls injected into an open forward)
EXTRAS = ("interop", "swap", "prefix", "views")
LAYOUTS = ("nhd", "hnd", "ksana", "contiguous")
# flawed import data (each a ValueError): paged layout without num_tokens, too few blocks or tokens, a
# float64 array, a block id out of range, negative num_tokens
IMPORT_FLAWS = ("no_num_tokens", "short", "dtype", "block_range", "negative")
HARMLESS_EMPTY = ("short", "block_range")  # no block is needed for 0 tokens: nothing to get wrong


class Mismatch(AssertionError):
    """The cache disagreed with the model or with the predicted outcome of an operation.

    :func:`run_random` sets, on the one it raises: ``ops`` (the operations run so far, the failing one
    last; a leak's also ends with the removes), ``runner`` (its counters) and ``leaked`` (pages that
    did not come back after every sequence was removed; 0 unless that was the failure).
    """

    ops: list | None = None
    runner: StatefulRunner | None = None
    leaked: int = 0


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


# ------------------------------------------------------------------------------ foreign layouts (oracle)
def foreign_shape(layout: str, num_blocks: int, L: int, H: int, P: int, D: int) -> tuple:
    """Shape of a foreign array of ``layout`` (docs/layout.md, "Foreign layouts"), written out here."""
    return {
        "ksana": (num_blocks, 2, L, P, H, D),
        "nhd": (L, num_blocks, 2, P, H, D),
        "hnd": (L, num_blocks, 2, H, P, D),
        "contiguous": (L, 2, num_blocks, H, D),
    }[layout]


def foreign_to_tokens(data: np.ndarray, layout: str, n: int, P: int, blocks=None) -> tuple:
    """K and V ``[L, n, H_kv, D]`` (float64) of the first ``n`` tokens of a foreign array whose
    sequence sits in blocks ``blocks`` (default ``0..m-1``) of ``layout``."""
    data = np.asarray(data, np.float64)
    if layout == "contiguous":
        return data[:, 0, :n], data[:, 1, :n]
    m = -(-n // P)
    blocks = np.arange(m) if blocks is None else np.asarray(blocks, np.int64)
    if layout == "hnd":  # [L, NB, 2, H, P, D] -> [L, 2, m, P, H, D]
        x = data[:, blocks].transpose(0, 2, 1, 4, 3, 5)
    elif layout == "nhd":  # [L, NB, 2, P, H, D]
        x = data[:, blocks].transpose(0, 2, 1, 3, 4, 5)
    else:  # ksana [NB, 2, L, P, H, D]
        x = data[blocks].transpose(2, 1, 0, 3, 4, 5)
    L, _, _, _, H, D = x.shape
    x = x.reshape(L, 2, m * P, H, D)[:, :, :n]
    return x[:, 0], x[:, 1]


def _lcp(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class StatefulRunner:
    """Run operations on a cache, predicting each call's outcome and checking it against the model.

    Parameters
    ----------
    cache : PagedAttentionKVCache
        A fresh (or ``clear()``-ed) cache. A :class:`tvmkv.RadixPrefixCache` attached to it is used
        (and one is attached by the first prefix operation).
    seed : int
        Seed of the random q/k/v values (and of imported data).
    kv_every : int
        Compare every sequence's stored K/V with the model after every ``kv_every``-th operation
        (1 = always). Integrity, lengths, page sharing and free pages are checked after every
        operation; sequences an import, prefix hit or swap-in just filled are compared at once; a
        rejected call is always followed by a full K/V comparison when ``kv_every == 1``.
    observe_forwards : bool
        Read every forward back with ``debug_forward()``: its page tables must be the sequences'
        pages, and the device views it uses are counted per index-buffer slot (:meth:`max_views`).
    """

    def __init__(self, cache, *, seed: int = 0, kv_every: int = 1, observe_forwards: bool = False):
        self.cache = cache
        self.cfg = cache.config
        self.driver = Replayer(cache, seed=seed)
        self.model = self.driver.model
        self.shadow = PageShadow(self.cfg.page_size, self.cfg.total_pages)
        self.kv_every = kv_every
        self.observe = observe_forwards
        self.steps = 0
        self.rejected = 0
        self.stats: dict = {}
        self.swapped: dict = {}  # sid -> the model's record of a swapped-out sequence
        self.tokens: dict = {}  # sid -> token ids of its committed positions (fresh ids per appended token)
        self.kv_of: dict = {}  # token id -> (K [L, H_kv, D], V) of the sequence it was inserted from
        self.inserted: list = []  # token tuples inserted into the prefix cache since it was last emptied
        self.certain_from = 0  # inserted[certain_from:] are wholly in the tree (nothing evicted since)
        self.prefix = next((h for h in cache.pool.holders if isinstance(h, RadixPrefixCache)), None)
        self.evicted = self.prefix.stats.evicted_pages if self.prefix is not None else 0
        self.page_ident: dict = {}  # page id -> shadow identity, as of the last check
        self.view_keys: dict = {}  # index-buffer slot -> {(offset, shape)} of the views its forwards used
        self.data_rng = np.random.default_rng(seed + 1)
        self._next_token = 0

    # ---------------------------------------------------------------- model queries
    def ids(self) -> list:
        """Sequences on the device (``swapped`` holds the others)."""
        return list(self.model.seqs)

    def committed(self, sid) -> int:
        return self.model.seqs[sid].length

    def length(self, sid) -> int:
        return self.model.length(sid)

    def slots(self, sid) -> int:
        """Tokens in append order (those a window dropped included): where the page shadow appends."""
        s = self.model.seqs[sid]
        return s.appended + len(s.tparent)

    def tree_nodes(self, sid) -> int:
        return len(self.model.seqs[sid].tparent)

    def window(self, sid) -> int:
        return self.model.seqs[sid].window

    def slid(self, sid) -> bool:
        return self.model.seqs[sid].slid

    def poppable(self, sid) -> int:
        """Most tokens ``pop_n`` may drop (the window's kept tokens once a window slid)."""
        s = self.model.seqs[sid]
        return int((s.index >= s.sink).sum()) if s.slid else s.length

    def plain(self, sid) -> bool:
        """Whether ``sid`` holds tokens ``[0, length)`` in its slots (export and insert need it)."""
        return not self.tree_nodes(sid) and not self.slid(sid)

    def max_views(self) -> int:
        """The most distinct device views the observed forwards used in one index-buffer slot (the
        cache keeps at most 512 per slot: more means its view cache was dropped while in use)."""
        return max(map(len, self.view_keys.values()), default=0)

    def _prefix(self) -> RadixPrefixCache:
        if self.prefix is None:
            self.prefix = RadixPrefixCache(self.cache)
            self.evicted = self.prefix.stats.evicted_pages
        return self.prefix

    def _count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    # ---------------------------------------------------------------- prediction
    def _lookup(self, sid) -> set:
        """The exception a call taking the resident sequence ``sid`` raises for the id (none: resident)."""
        if not _is_int(sid):
            return {TypeError}
        if sid in self.model.seqs:
            return set()
        return {SequenceSwappedError} if sid in self.swapped else {KeyError}

    def _out_of_pages(self, need: int) -> bool:
        """Whether ``need`` pages exceed the free ones and what the prefix cache could evict."""
        free = self.shadow.free()
        if need <= free:
            return False
        return self.prefix is None or need > free + self.prefix.num_evictable_pages()

    def _forward_errors(self, ids, lengths, parents) -> set:
        """Exceptions begin_forward may raise for this batch (empty: it must succeed)."""
        cfg = self.cfg
        errs: set[type[Exception]] = set()
        known = [s for s in ids if _is_int(s) and s in self.model.seqs]
        if len(known) != len(ids):
            for s in ids:
                errs |= self._lookup(s)
        if not ids or len(lengths) != len(ids) or len(set(ids)) != len(ids) or any(n <= 0 for n in lengths):
            errs.add(ValueError)
        if len(ids) > cfg.max_batch_size or sum(lengths) > cfg.prefill_chunk_size:
            errs.add(ValueError)
        if parents is not None:
            if len(parents) != sum(lengths):
                errs.add(ValueError)
            else:
                at = 0
                for s, n in zip(ids, lengths, strict=False):
                    old = self.tree_nodes(s) if s in known else 0
                    if s in known and self.window(s):
                        errs.add(ValueError)
                    if any(not -1 <= parents[at + i] < old + i for i in range(n)):
                        errs.add(ValueError)
                    at += n
        elif any(self.tree_nodes(s) for s in known):
            errs.add(ValueError)
        if not errs:
            need = sum(self.shadow.needed(s, self.slots(s), n) for s, n in zip(ids, lengths, strict=False))
            if self._out_of_pages(need):
                errs.add(OutOfPagesError)
        return errs

    def _export_errors(self, sid, layout) -> set:
        if layout not in LAYOUTS:
            return {ValueError}
        errs = self._lookup(sid)
        if not errs and not self.plain(sid):
            errs.add(ValueError)
        return errs

    def _import_errors(self, op) -> set:
        _, sid, layout, source, flaw = op
        if source[0] == "seq":  # the runner exports the source first
            errs = self._export_errors(source[1], layout)
            if errs:
                return errs
            n = self.length(source[1])
        elif layout not in LAYOUTS:
            return {ValueError}
        else:
            n = source[1]
        if not _is_int(sid):
            return {TypeError}
        errs: set[type[Exception]] = set()
        if sid in self.swapped:
            errs.add(KeyError)
        elif sid in self.model.seqs and (self.length(sid) or self.window(sid)):
            errs.add(ValueError)  # only an empty sequence (no tokens, no window) can be imported into
        paged = layout != "contiguous"
        if (
            flaw is not None
            and (paged or flaw != "no_num_tokens")
            and not (paged and n == 0 and flaw in HARMLESS_EMPTY)
        ):
            errs.add(ValueError)
        if not errs and self._out_of_pages(-(-n // self.cfg.page_size)):
            errs.add(OutOfPagesError)
        return errs

    @staticmethod
    def _id_list_errors(ids) -> set:
        if any(not _is_int(s) for s in ids):
            return {TypeError}
        return {ValueError} if len(set(ids)) != len(ids) else set()

    def expected_errors(self, op) -> set:
        """The exception classes ``op`` may raise; an empty set means it must succeed."""
        kind, seqs = op[0], self.model.seqs
        errs: set[type[Exception]] = set()
        if kind == "add":
            if not _is_int(op[1]):
                errs.add(TypeError)
            elif op[1] in seqs or op[1] in self.swapped:
                errs.add(KeyError)
        elif kind == "remove":
            if op[1] not in seqs and op[1] not in self.swapped:
                errs.add(KeyError)
        elif kind == "fork":
            parent, child, pos = op[1:]
            errs |= self._lookup(parent)
            if child in seqs or child in self.swapped:
                errs.add(KeyError)
            if parent in seqs:
                committed = self.committed(parent)
                pos = committed if pos == -1 else pos
                if pos < 0 or pos > committed or self.slid(parent):
                    errs.add(ValueError)
                elif not errs and pos % self.cfg.page_size and self._out_of_pages(1):
                    errs.add(OutOfPagesError)
        elif kind == "pop":
            sid, n = op[1:]
            lookup = self._lookup(sid)
            if lookup:
                errs |= lookup
            elif n < 0 or self.tree_nodes(sid) or n > self.length(sid) or n > self.poppable(sid):
                errs.add(ValueError)
        elif kind == "window":
            sid, size, sink = op[1:]
            errs |= self._lookup(sid)
            if not self.cfg.support_sliding_window or size <= 0 or not 0 <= sink < size:
                errs.add(ValueError)
            if sid in seqs and (self.tree_nodes(sid) or self.slid(sid)):
                errs.add(ValueError)
            if sid in seqs and min(self.model.seqs[sid].fork_prefix, self.length(sid)) >= size:
                errs.add(ValueError)  # a fork's inherited tokens are sinks (TVM): the window must exceed them
        elif kind in ("fwd", "midfwd"):
            ids, lengths = [x[0] for x in op[1]], [x[1] for x in op[1]]
            errs = self._forward_errors(ids, lengths, None)
        elif kind == "tree":
            ids = [x[0] for x in op[1]]
            lengths = [len(x[1]) for x in op[1]]
            errs = self._forward_errors(ids, lengths, [p for x in op[1] for p in x[1]])
        elif kind == "begin_raw":
            errs = self._forward_errors(op[1], op[2], op[3]) | {ValueError}
        elif kind == "commit":
            ids, leaves = [x[0] for x in op[1]], [x[1] for x in op[1]]
            for s in ids:
                errs |= self._lookup(s)
            if len(set(ids)) != len(ids):
                errs.add(ValueError)
            if any(s in seqs and not -1 <= leaf < self.tree_nodes(s) for s, leaf in zip(ids, leaves, strict=False)):
                errs.add(ValueError)
        elif kind in ("end", "attn"):
            errs.add(ForwardStateError)
        elif kind == "export":
            errs = self._export_errors(op[1], op[2])
        elif kind == "import":
            errs = self._import_errors(op)
        elif kind == "swap_out":
            errs = self._id_list_errors(op[1])
            for s in op[1] if not errs else ():
                errs |= self._lookup(s)
        elif kind == "swap_in":
            errs = self._id_list_errors(op[1])
            for s in op[1] if not errs else ():
                if s not in self.swapped:
                    errs |= self._lookup(s) or {ValueError}  # a resident sequence: not swapped out
            if not errs and self._out_of_pages(self.shadow.swap_in_pages(op[1])):
                errs.add(OutOfPagesError)
        elif kind == "prefix_add":
            sid, tokens, max_reuse = op[1:]
            if max_reuse is not None and not 0 <= max_reuse <= len(tokens):
                errs.add(ValueError)
            if not _is_int(sid):
                errs.add(TypeError)
            elif sid in seqs or sid in self.swapped:
                errs.add(KeyError)
        elif kind in ("insert", "finish"):
            sid, n = op[1:]
            errs = self._lookup(sid)
            if not errs and (self.window(sid) or self.tree_nodes(sid) or n > self.length(sid)):
                errs.add(ValueError)
        elif kind == "prefix_twice":
            errs.add(ValueError)  # one prefix cache per cache
        elif kind != "prefix_reset":
            raise ValueError(f"unknown operation {op!r}")
        return errs

    # ---------------------------------------------------------------- execution
    def _call(self, op):
        """Perform ``op`` on the cache (and, when it succeeds, on the model)."""
        kind, cache = op[0], self.cache
        if kind == "begin_raw":
            cache.begin_forward(op[1], op[2], op[3])
            cache.end_forward()  # only reached when the cache wrongly accepted the call
        elif kind == "end":
            cache.end_forward()
        elif kind == "attn":
            cfg = self.cfg
            cache.attention_with_fused_qkv(0, np.zeros((1, cfg.qkv_heads, cfg.head_dim), numpy_dtype(cfg.dtype)))
        elif kind in ("fwd", "midfwd"):  # midfwd: a plain forward with a forbidden call inside it
            ids, lengths = [x[0] for x in op[1]], [x[1] for x in op[1]]
            hooks = [self._observer(ids)] if self.observe else []
            if kind == "midfwd":
                hooks.append(self._injector(op[2]))
            self.driver.forward(ids, lengths, None, None, after_begin=_chain(hooks))
        elif kind == "tree":
            ids, parents = [x[0] for x in op[1]], [list(x[1]) for x in op[1]]
            hook = self._observer(ids) if self.observe else None
            flat = [p for ps in parents for p in ps]
            self.driver.forward(ids, [len(p) for p in parents], parents, flat, after_begin=hook)
        elif kind == "remove" and op[1] in self.swapped:
            cache.remove_sequence(op[1])
            del self.swapped[op[1]]
        elif kind == "export":
            self._export_op(*op[1:])
        elif kind == "import":
            self._import_op(*op[1:])
        elif kind == "swap_out":
            cache.swap_out(op[1])
            for s in op[1]:
                self.swapped[s] = self.model.seqs.pop(s)
        elif kind == "swap_in":
            cache.swap_in(op[1])
            for s in op[1]:
                self.model.seqs[s] = self.swapped.pop(s)
        elif kind == "prefix_add":
            self._prefix_add_op(*op[1:])
        elif kind in ("insert", "finish"):
            self._insert_op(kind, *op[1:])
        elif kind == "prefix_reset":
            self._prefix().reset()
            self.inserted, self.certain_from = [], 0
        elif kind == "prefix_twice":
            self._prefix()
            RadixPrefixCache(cache)  # must raise: the cache has one
        else:
            self.driver.apply(op)

    # ---- interop
    def _foreign(self, layout: str, num_blocks: int, dtype=None) -> np.ndarray:
        cfg = self.cfg
        shape = foreign_shape(layout, num_blocks, cfg.num_layers, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)
        return self.data_rng.uniform(-1, 1, shape).astype(dtype or numpy_dtype(cfg.dtype))

    def _export(self, sid, layout: str, spare):
        """Export ``sid``: no ``out`` (spare None), else into a foreign array with ``spare`` more blocks
        than it needs, at shuffled blocks. Returns (data, block ids or None); checks that blocks it
        was not given are untouched."""
        P = self.cfg.page_size
        n = self.length(sid) if sid in self.model.seqs else 0
        if spare is None:
            return interop.export_sequence(self.cache, sid, layout), None
        m = -(-n // P)
        if layout == "contiguous":
            out = self._foreign(layout, n)
            return interop.export_sequence(self.cache, sid, layout, out=out), None
        out = self._foreign(layout, m + spare)
        before = out.copy()
        blocks = self.data_rng.permutation(m + spare)[:m]
        interop.export_sequence(self.cache, sid, layout, out=out, block_ids=blocks)
        others = np.setdiff1d(np.arange(m + spare), blocks)
        axis = 0 if layout == "ksana" else 1
        if not np.array_equal(np.take(out, others, axis), np.take(before, others, axis)):
            raise Mismatch(f"export of sequence {sid} ({layout}) wrote blocks outside block_ids {blocks.tolist()}")
        return out, blocks

    def _export_op(self, sid, layout: str, spare) -> None:
        data, blocks = self._export(sid, layout, spare)
        n = self.length(sid)
        k, v = foreign_to_tokens(data, layout, n, self.cfg.page_size, blocks)
        _, k_ref, v_ref = self.model.kept_kv(sid)
        tol = STORED_TOL[self.cfg.dtype]
        np.testing.assert_allclose(k, k_ref, **tol, err_msg=f"exported K of sequence {sid} ({layout})")
        np.testing.assert_allclose(v, v_ref, **tol, err_msg=f"exported V of sequence {sid} ({layout})")

    def _import_op(self, sid, layout: str, source, flaw) -> None:
        P, kwargs = self.cfg.page_size, {}
        if source[0] == "seq":
            n = self.length(source[1]) if source[1] in self.model.seqs else 0
            data, blocks = self._export(source[1], layout, source[2])
            tokens = list(self.tokens[source[1]][:n])
            kwargs["num_tokens"] = None if layout == "contiguous" else n
        else:
            n, spare = source[1], source[2]
            shaped = layout if layout in LAYOUTS else "contiguous"  # a bad layout name: contiguous data
            m = -(-n // P)
            nb = n if shaped == "contiguous" else m + spare - (flaw == "short") * (spare + 1)
            data = self._foreign(shaped, max(nb, 0), np.float64 if flaw == "dtype" else None)
            blocks = None
            if shaped != "contiguous":
                blocks = self.data_rng.permutation(max(nb, 0))[:m] if spare and flaw != "short" else None
                kwargs["num_tokens"] = n
            elif flaw == "short":
                kwargs["num_tokens"] = n + 1
            if flaw == "block_range":
                blocks = np.arange(m) if shaped != "contiguous" else np.zeros(1, np.int64)
                if m:
                    blocks[0] = max(nb, 0)
            if flaw == "no_num_tokens":
                kwargs.pop("num_tokens", None)
            if flaw == "negative":
                kwargs["num_tokens"] = -1
            tokens = self._fresh_tokens(n)
        existed = sid in self.model.seqs
        interop.import_sequence(self.cache, sid, data, layout, block_ids=blocks, **kwargs)
        k, v = foreign_to_tokens(data, layout, n, P, blocks)
        if existed:
            self.model.remove(sid)
        self._model_add(sid, k, v)
        self.tokens[sid] = tokens
        self._count("import@reused" if existed else "import@new")

    def _model_add(self, sid, k, v) -> None:
        """A new model sequence holding ``k``/``v`` ``[L, n, H_kv, D]`` at positions ``0..n-1``."""
        self.model.add(sid)
        s = self.model.seqs[sid]
        s.k, s.v = np.array(k, np.float64), np.array(v, np.float64)
        n = s.k.shape[1]
        s.pos, s.index, s.length, s.appended, s.slid = np.arange(n), np.arange(n), n, n, False

    def _fresh_tokens(self, n: int) -> list:
        out = list(range(self._next_token, self._next_token + n))
        self._next_token += n
        return out

    # ---- prefix cache
    def _match_bounds(self, tokens) -> tuple:
        """(lower, upper) bound of the tokens the prefix tree matches: it holds every list inserted
        since its last eviction, and nothing that is not a prefix of an inserted list."""
        hi = max((_lcp(tokens, t) for t in self.inserted), default=0)
        lo = max((_lcp(tokens, t) for t in self.inserted[self.certain_from :]), default=0)
        return lo, hi

    def _prefix_add_op(self, sid, tokens, max_reuse) -> None:
        prefix = self._prefix()
        lo, hi = self._match_bounds(tokens)
        limit = max(len(tokens) - 1, 0) if max_reuse is None else max_reuse
        reused = prefix.add_sequence_with_prefix(sid, tokens, max_reuse=max_reuse)
        if not min(lo, limit) <= reused <= min(hi, limit):
            raise Mismatch(f"reused {reused} tokens; the tree holds between {lo} and {hi} of them (limit {limit})")
        unknown = [t for t in tokens[:reused] if t not in self.kv_of]
        if unknown:
            raise Mismatch(f"reused tokens {unknown[:4]} that were never inserted")
        cfg = self.cfg
        kv = [self.kv_of[t] for t in tokens[:reused]]
        empty = np.zeros((cfg.num_layers, 0, cfg.num_kv_heads, cfg.head_dim))
        k = np.stack([x[0] for x in kv], axis=1) if kv else empty
        v = np.stack([x[1] for x in kv], axis=1) if kv else empty
        self._model_add(sid, k, v)
        self.tokens[sid] = list(tokens[:reused])
        self._count("prefix_add@hit" if reused else "prefix_add@miss")
        if reused % cfg.page_size:
            self._count("prefix_add@partial_page")

    def _insert_op(self, kind: str, sid, n: int) -> None:
        prefix = self._prefix()
        tokens = self.tokens[sid][:n] if sid in self.tokens else []
        tokens = tokens + [-1] * (n - len(tokens))  # asking for more than the sequence holds (misuse)
        lo, hi = self._match_bounds(tokens)
        added = (prefix.insert if kind == "insert" else prefix.finish_sequence)(sid, tokens)
        if not n - hi <= added <= n - lo:
            raise Mismatch(f"{kind} added {added} of {n} tokens; the tree held between {lo} and {hi} of them")
        _, k, v = self.model.kept_kv(sid)
        for i, t in enumerate(tokens):
            self.kv_of.setdefault(t, (k[:, i].copy(), v[:, i].copy()))
        if tokens:
            self.inserted.append(tuple(tokens))
        if kind == "finish":
            self.model.remove(sid)

    # ---- forwards
    def _observer(self, ids):
        """Read the open forward back: its page tables are the sequences' pages; count its views."""

        def observe(cache):
            info = cache.debug_forward()
            a = info.arrays
            layout = PackedLayout.of(len(a["q_indptr"]) - 1, len(a["q_pos"]), a["kv_tree"].shape[0])
            for name, (_, shape) in layout.arrays.items():
                if a[name].shape != shape:
                    raise Mismatch(f"debug_forward's {name} has shape {a[name].shape}, its layout says {shape}")
            keys = self.view_keys.setdefault(info.slot, set())
            keys.update((off, shape) for off, shape in layout.arrays.values())
            keys.add((layout.page_indices_at, a["page_indices"].shape))
            indptr, indices = a["page_indptr"], a["page_indices"]
            for b, sid in enumerate(ids):
                got, want = indices[indptr[b] : indptr[b + 1]].tolist(), cache.sequence_pages(sid)
                if got != want:
                    raise Mismatch(f"the forward reads pages {got} of sequence {sid}, which holds {want}")
            if info.repeated:
                self._count("fwd@repeated")

        return observe

    def _injector(self, what: str):
        """A forbidden call made while a forward is open; it must fail and change nothing."""
        plain = [s for s in self.model.seqs if self.plain(s)]
        cfg = self.cfg
        tiny = np.zeros((cfg.num_layers, 2, 1, cfg.num_kv_heads, cfg.head_dim), numpy_dtype(cfg.dtype))
        calls = {
            "add": (ForwardStateError, lambda c: c.add_sequence(NEW_ID)),
            "remove": (ForwardStateError, lambda c: c.remove_sequence(c.sequence_ids()[0])),
            "fork": (ForwardStateError, lambda c: c.fork_sequence(c.sequence_ids()[0], NEW_ID, 0)),
            "pop": (ForwardStateError, lambda c: c.pop_n(c.sequence_ids()[0], 0)),
            "window": (
                ForwardStateError,
                lambda c: c.enable_sliding_window_for_seq(c.sequence_ids()[0], 4, 0),
            ),
            "commit": (ForwardStateError, lambda c: c.commit_accepted_token_tree_nodes([], [])),
            "begin": (ForwardStateError, lambda c: c.begin_forward(c.sequence_ids()[:1], [1])),
            "layer": (
                ValueError,
                lambda c: c.attention_with_fused_qkv(
                    c.config.num_layers, np.zeros((1, c.config.qkv_heads, c.config.head_dim), np.float32)
                ),
            ),
            "export": (
                ForwardStateError if plain else KeyError,
                lambda c: interop.export_sequence(c, plain[0] if plain else NEW_ID, "nhd"),
            ),
            "import": (ForwardStateError, lambda c: interop.import_sequence(c, NEW_ID, tiny, "contiguous")),
            "swap_out": (ForwardStateError, lambda c: c.swap_out(c.sequence_ids()[:1])),
            "swap_in": (ForwardStateError, lambda c: c.swap_in(c.sequence_ids()[:1])),
            "insert": (ForwardStateError, lambda c: self._prefix().insert(c.sequence_ids()[0], [])),
            "prefix_add": (ForwardStateError, lambda c: self._prefix().add_sequence_with_prefix(NEW_ID, [1, 2])),
            "prefix_reset": (ForwardStateError, lambda c: self._prefix().reset()),
        }
        exc, call = calls[what]

        def inject(cache):
            free = cache.num_available_pages()
            lengths = {s: cache.sequence_length(s) for s in cache.sequence_ids()}
            edges = self.prefix.edges() if self.prefix is not None else None
            try:
                call(cache)
            except exc as err:
                assert str(err), f"{exc.__name__} without a message"
            else:
                raise Mismatch(f"{what} during an open forward was accepted")
            if cache.num_available_pages() != free or lengths != {
                s: cache.sequence_length(s) for s in cache.sequence_ids()
            }:
                raise Mismatch(f"rejected {what} during an open forward changed the cache")
            if edges is not None and self.prefix.edges() != edges:
                raise Mismatch(f"rejected {what} during an open forward changed the prefix tree")

        return inject

    def _update_shadow(self, op) -> None:
        kind, shadow = op[0], self.shadow
        if kind == "add":
            shadow.add(op[1])
        elif kind in ("remove", "finish"):
            shadow.remove(op[1])
        elif kind == "fork":
            shadow.fork(op[1], op[2], self.committed(op[2]))
        elif kind in ("pop", "commit"):
            for sid in [op[1]] if kind == "pop" else [x[0] for x in op[1]]:
                shadow.truncate(sid, self.slots(sid))
        elif kind == "window":
            s = self.model.seqs[op[1]]
            shadow.slide(op[1], s.appended, s.index)
        elif kind == "import":
            shadow.import_(op[1], self.length(op[1]))
        elif kind == "swap_out":
            shadow.swap_out(op[1])
        elif kind == "swap_in":
            shadow.swap_in(op[1])
        elif kind == "prefix_add":
            sid = op[1]
            pages = self.cache.sequence_pages(sid)
            if len(pages) != -(-self.length(sid) // self.cfg.page_size) or any(p not in self.page_ident for p in pages):
                raise Mismatch(f"{op}: sequence {sid} got pages {pages}, not the tree's pages of its prefix")
            shadow.add_blocks(sid, [self.page_ident[p] for p in pages])

    def _update_tokens(self, op) -> None:
        """Token ids of every resident sequence's committed positions: forks share their parent's,
        removes drop theirs, every other change keeps a prefix and appends fresh ids."""
        kind = op[0]
        if kind == "fork":
            self.tokens[op[2]] = self.tokens[op[1]][: self.committed(op[2])]
        elif kind in ("remove", "finish"):
            self.tokens.pop(op[1], None)
        for sid, s in self.model.seqs.items():
            tokens = self.tokens.setdefault(sid, [])
            if len(tokens) > s.length:
                del tokens[s.length :]
            elif len(tokens) < s.length:
                tokens += self._fresh_tokens(s.length - len(tokens))

    def _pre_forward_shadow(self, op) -> list:
        """Lengths before a forward, so the shadow can append after the call."""
        if op[0] in ("fwd", "midfwd"):
            return [(x[0], self.slots(x[0]), x[1]) for x in op[1]]
        if op[0] == "tree":
            return [(x[0], self.slots(x[0]), len(x[1])) for x in op[1]]
        return []

    def step(self, op) -> None:
        """Run one operation and check its outcome; raises :class:`Mismatch` (or the model's assertion)."""
        errs = self.expected_errors(op)
        self._count(op[0] + ("!" if errs else ""))
        free_before = self.cache.num_available_pages()
        edges_before = self.prefix.edges() if errs and self.prefix is not None else None
        appends = [] if errs else self._pre_forward_shadow(op)
        self.steps += 1
        try:
            self._call(op)
        except Mismatch:
            raise
        except AssertionError as err:
            raise Mismatch(f"{op}: output mismatch: {err}") from err
        except Exception as err:  # noqa: BLE001 - every exception is compared with the prediction
            if not errs:
                raise Mismatch(f"{op}: expected success, got {type(err).__name__}: {err}") from err
            if not isinstance(err, tuple(errs)):
                want = sorted(e.__name__ for e in errs)
                raise Mismatch(f"{op}: expected one of {want}, got {type(err).__name__}: {err}") from err
            if not str(err):
                raise Mismatch(f"{op}: {type(err).__name__} without a message") from err
            self.rejected += 1
            self._count(f"{op[0]}!{type(err).__name__}")
            if edges_before is not None and self.prefix.edges() != edges_before:
                raise Mismatch(f"{op}: rejected call changed the prefix tree") from err
            self._check_state(op, free_before, force_kv=self.kv_every == 1, rejected=True)
            return
        if errs:
            want = sorted(e.__name__ for e in errs)
            raise Mismatch(f"{op}: expected one of {want}, but the call succeeded")
        for sid, length, n in appends:
            self.shadow.append(sid, length, n)
            s = self.model.seqs[sid]
            if s.window:
                self.shadow.slide(sid, s.appended, s.index)
        self._update_shadow(op)
        self._update_tokens(op)
        self._check_state(op, free_before, force_kv=False, rejected=False)
        if self.steps % self.kv_every and op[0] in ("import", "prefix_add", "swap_in"):
            self.check_kv(op, op[1] if op[0] == "swap_in" else [op[1]])  # what the call just filled

    def _sync_pages(self, op) -> None:
        """The cache shares pages exactly as the shadow shares identities (same identity <=> same page
        id, sequence by sequence in page order), and the shadow learns which identities the prefix
        cache keeps (tree-only pages keep the identity they had when a sequence held them)."""
        ident_of: dict = {}
        page_of: dict = {}
        for sid in self.model.seqs:
            pages, idents = self.cache.sequence_pages(sid), self.shadow.idents(sid)
            if len(pages) != len(idents):
                raise Mismatch(f"{op}: sequence {sid} holds {len(pages)} pages, the page shadow expects {len(idents)}")
            for p, i in zip(pages, idents, strict=True):
                if ident_of.setdefault(p, i) != i or page_of.setdefault(i, p) != p:
                    raise Mismatch(f"{op}: page {p} of sequence {sid} is shared unlike the page shadow's pages")
        if self.prefix is not None:
            holder = set()
            for p in self.prefix.held_pages():
                i = ident_of.get(p, self.page_ident.get(p))
                if i is None or page_of.setdefault(i, p) != p:
                    raise Mismatch(f"{op}: the prefix cache holds page {p}, which no sequence held")
                ident_of[p] = i
                holder.add(i)
            self.shadow.holder = holder
            evicted = self.prefix.stats.evicted_pages
            if evicted != self.evicted:  # lists inserted before may have lost their tails
                self.stats["prefix@evicted_pages"] = self.stats.get("prefix@evicted_pages", 0) + evicted - self.evicted
                self.evicted, self.certain_from = evicted, len(self.inserted)
        self.page_ident = ident_of

    def _check_state(self, op, free_before: int, *, force_kv: bool, rejected: bool) -> None:
        cache = self.cache
        try:
            (self.prefix or cache).check_integrity()
        except AssertionError as err:
            raise Mismatch(f"{op}: check_integrity failed: {err}") from err
        self._sync_pages(op)
        free = cache.num_available_pages()
        if rejected and free != free_before:
            raise Mismatch(f"{op}: rejected call changed free pages {free_before} -> {free}")
        if free != self.shadow.free():
            raise Mismatch(f"{op}: {free} free pages, the page shadow expects {self.shadow.free()}")
        if sorted(cache.sequence_ids()) != sorted(self.model.seqs):
            raise Mismatch(f"{op}: sequence ids {sorted(cache.sequence_ids())} != {sorted(self.model.seqs)}")
        if sorted(cache.swapped_sequence_ids()) != sorted(self.swapped):
            raise Mismatch(f"{op}: swapped ids {sorted(cache.swapped_sequence_ids())} != {sorted(self.swapped)}")
        for sid in self.model.seqs:
            if cache.sequence_length(sid) != self.length(sid):
                raise Mismatch(f"{op}: length of {sid} is {cache.sequence_length(sid)}, want {self.length(sid)}")
        for sid, s in self.swapped.items():
            if cache.sequence_length(sid) != s.length + len(s.tparent):
                raise Mismatch(f"{op}: length of swapped {sid} is {cache.sequence_length(sid)}")
        if self.swapped and cache.num_swapped_pages() != self.shadow.swapped_pages():
            raise Mismatch(f"{op}: {cache.num_swapped_pages()} swapped pages, want {self.shadow.swapped_pages()}")
        if force_kv or self.steps % self.kv_every == 0:
            self.check_kv(op)

    def check_kv(self, op=None, sids=None) -> None:
        """Compare the stored K/V of ``sids`` (default every resident sequence) with the model now;
        raises :class:`Mismatch` (naming ``op``)."""
        try:
            if sids is None:
                self.driver.check_kv()
            else:
                for sid in sids:
                    self._compare_kv(sid)
        except AssertionError as err:
            raise Mismatch(f"{op}: stored K/V differ from the model: {err}") from err

    def _compare_kv(self, sid) -> None:
        """One sequence's stored K/V against the model (as :meth:`tvmkv.replay.Replayer.check_kv`)."""
        pos, k_ref, v_ref = self.model.kept_kv(sid)
        tol = STORED_TOL[self.cfg.dtype]
        for run in np.split(np.arange(len(pos)), np.nonzero(np.diff(pos) != 1)[0] + 1) if len(pos) else []:
            k, v = self.cache.debug_get_kv(sid, int(pos[run[0]]), int(pos[run[-1]]) + 1)
            np.testing.assert_allclose(np.asarray(k, np.float64), k_ref[:, run], **tol, err_msg=f"stored K of {sid}")
            np.testing.assert_allclose(np.asarray(v, np.float64), v_ref[:, run], **tol, err_msg=f"stored V of {sid}")

    def run(self, ops) -> None:
        """Run ``ops``; a failure is re-raised as :class:`Mismatch` naming the step."""
        for i, op in enumerate(ops):
            try:
                self.step(op)
            except Mismatch as err:
                raise Mismatch(f"step {i}: {err}") from err

    def drain_ops(self) -> list:
        """The operations that empty the cache: remove every sequence (swapped ones too), then drop
        the prefix tree."""
        ops = [["remove", s] for s in [*self.model.seqs, *self.swapped]]
        return ops + ([["prefix_reset"]] if self.prefix is not None else [])

    def drain(self) -> int:
        """Run :meth:`drain_ops`; return how many pages did not come back (should be 0)."""
        for op in self.drain_ops():
            self.step(op)
        return self.cfg.total_pages - self.cache.num_available_pages()


def _chain(hooks: list):
    """One ``after_begin`` hook running ``hooks`` in order (None when there are none)."""
    if not hooks:
        return None

    def run(cache):
        for hook in hooks:
            hook(cache)

    return run


# ------------------------------------------------------------------------------------------ generator
class Generator:
    """Draw operations for a runner's current state: mostly valid ones, some misuse.

    Parameters
    ----------
    runner : StatefulRunner
        Queried for the model's state (the next operation depends on the outcome of the last).
    seed : int
        Seed of the draw.
    misuse : float
        Probability that an operation is drawn as a deliberate misuse.
    extras : iterable of str
        Operation families beyond the base mix (:data:`EXTRAS`); without them the draw is the same
        as before they existed.
    id_pool : int
        Sequence ids are drawn from ``[0, id_pool)`` (a batch holds at most that many sequences).
    """

    def __init__(self, runner: StatefulRunner, seed: int, misuse: float = 0.15, *, extras=(), id_pool: int = ID_POOL):
        self.r = runner
        self.rng = np.random.default_rng(seed)
        self.misuse = misuse
        self.extras = frozenset(extras)
        unknown = sorted(self.extras - set(EXTRAS))
        if unknown:
            raise ValueError(f"unknown extras {unknown}; choose from {EXTRAS}")
        self.id_pool = id_pool
        self.pending: list = []  # operations promised by an earlier draw (an import after its pop, decodes)
        cfg = runner.cfg
        self.max_new = min(cfg.prefill_chunk_size, 3 * cfg.page_size + 5)

    def _int(self, lo: int, hi: int) -> int:
        """Uniform int in [lo, hi]."""
        return int(self.rng.integers(lo, hi + 1))

    def _pick(self, items):
        return items[self._int(0, len(items) - 1)]

    def _subset(self, items, lo=1):
        items = list(items)
        self.rng.shuffle(items)
        return items[: self._int(min(lo, len(items)), len(items))]

    def _free_id(self):
        free = [i for i in range(self.id_pool) if i not in self.r.model.seqs and i not in self.r.swapped]
        return self._pick(free) if free else None

    def next(self) -> list:
        if self.pending:
            return self.pending.pop(0)
        r, rng = self.r, self.rng
        ids = r.ids()
        if not ids:
            if r.swapped and rng.random() < 0.5:
                return self._swap_in()
            return ["add", self._free_id()] if rng.random() > self.misuse else self._misuse()
        if rng.random() < self.misuse:
            return self._misuse()
        pressure = r.shadow.free() < 0.25 * r.cfg.total_pages
        weights = {
            "add": 6,
            "remove": 14 if pressure else 3,
            "fork": 8,
            "pop": 12 if pressure else 5,
            "window": 3 if r.cfg.support_sliding_window else 0,
            "fwd": 22,
            "tree": 12,
            "commit": 10,
            "midfwd": 2,
        }
        if "interop" in self.extras:
            weights.update(export=3, import_=8)
        if "swap" in self.extras:
            weights.update(swap_out=6 if pressure else 2, swap_in=4 if r.swapped else 0)
        if "prefix" in self.extras:
            weights.update(prefix_add=6, insert=3, finish=4 if pressure else 2, prefix_reset=0.2)
        if "views" in self.extras:
            weights.update(decode=8, varied=12)
        if len(ids) + len(r.swapped) >= self.id_pool:
            weights["add"] = weights["fork"] = 0
            if "prefix_add" in weights:
                weights["prefix_add"] = 0
        if any(r.tree_nodes(s) for s in ids):
            weights["commit"] = 25
        kinds = list(weights)
        p = np.asarray([weights[k] for k in kinds], float)
        kind = kinds[rng.choice(len(kinds), p=p / p.sum())]
        return getattr(self, "_" + kind)()

    # ---- valid (as far as the generator knows; out-of-pages is left to chance)
    def _add(self):
        return ["add", self._free_id()]

    def _remove(self):
        return ["remove", self._pick(self.r.ids())]

    def _fork(self):
        r = self.r
        parents = [s for s in r.ids() if not r.slid(s)] or r.ids()
        parent = self._pick(parents)
        c = r.committed(parent)
        pos = -1 if self.rng.random() < 0.3 else self._int(0, c)
        return ["fork", parent, self._free_id(), pos]

    def _pop(self):
        r = self.r
        cands = [s for s in r.ids() if not r.tree_nodes(s)] or r.ids()
        sid = self._pick(cands)
        limit = r.poppable(sid)
        n = limit if self.rng.random() < 0.1 else self._int(0, min(limit, r.cfg.page_size * 2 + 1))
        return ["pop", sid, n]

    def _window(self):
        r = self.r
        cands = [s for s in r.ids() if not r.tree_nodes(s) and not r.slid(s)] or r.ids()
        size = self._int(1, 3 * r.cfg.page_size + 2)
        return ["window", self._pick(cands), size, self._int(0, min(size - 1, r.cfg.page_size + 1))]

    def _batch(self, cands):
        batch = self._subset(cands)[: self.r.cfg.max_batch_size]
        budget = self.r.cfg.prefill_chunk_size
        out = []
        for sid in batch:
            n = 1 if self.rng.random() < 0.5 else self._int(1, self.max_new)
            n = min(n, budget - (len(batch) - len(out) - 1))
            if n <= 0:
                break
            out.append([sid, n])
            budget -= n
        return out

    def _need(self, batch) -> int:
        r = self.r
        return sum(r.shadow.needed(s, r.slots(s), n if isinstance(n, int) else len(n)) for s, n in batch)

    def _fit(self, batch) -> list:
        """Usually (80%) trim a batch until it fits the free pages; else leave out-of-pages to chance."""
        if self.rng.random() < 0.2:
            return batch
        batch = [list(x) for x in batch]
        while batch and self._need(batch) > self.r.shadow.free():
            last = batch[-1]
            size = last[1] if isinstance(last[1], int) else len(last[1])
            if size <= 1:
                batch.pop()
            elif isinstance(last[1], int):
                last[1] = size // 2
            else:
                last[1] = last[1][: size // 2]
        return batch or [[self.r.ids()[0], 1]]

    def _fwd(self):
        r = self.r
        cands = [s for s in r.ids() if not r.tree_nodes(s)]
        if not cands:
            return self._commit()
        return ["fwd", self._fit(self._batch(cands))]

    def _midfwd(self):
        op = self._fwd()
        if op[0] != "fwd":
            return op
        what = ["add", "remove", "fork", "pop", "window", "commit", "begin", "layer"]
        what += ["export", "import"] if "interop" in self.extras else []
        what += ["swap_out", "swap_in"] if "swap" in self.extras else []
        what += ["insert", "prefix_add", "prefix_reset"] if "prefix" in self.extras else []
        return ["midfwd", op[1], self._pick(what)]

    def _tree_parents(self, old: int, n: int) -> list:
        return [-1 if self.rng.random() < 0.2 else self._int(-1, old + i - 1) for i in range(n)]

    def _tree(self):
        r = self.r
        cands = [s for s in r.ids() if not r.window(s)]
        if not cands:
            return self._fwd()
        batch = []
        budget = r.cfg.prefill_chunk_size
        for sid in self._subset(cands)[: r.cfg.max_batch_size]:
            n = min(self._int(1, 6), budget)
            if n <= 0:
                break
            batch.append([sid, self._tree_parents(r.tree_nodes(sid), n)])
            budget -= n
        batch = self._fit(batch)
        if not isinstance(batch[-1][1], list):  # nothing fitted: one root node
            batch = [[batch[-1][0], [-1]]]
        return ["tree", batch]

    def _commit(self):
        r = self.r
        with_tree = [s for s in r.ids() if r.tree_nodes(s)]
        pool = with_tree + self._subset(r.ids(), lo=0)[:1]
        ids = self._subset(dict.fromkeys(pool))
        return ["commit", [[s, self._int(-1, r.tree_nodes(s) - 1)] for s in ids]]

    # ---- extras (valid)
    def _decode(self):
        """A decode step of a random batch, then 1-6 more of the same batch (the repeat-decode path)."""
        r = self.r
        cands = [s for s in r.ids() if not r.tree_nodes(s)]
        if not cands:
            return self._commit()
        batch = self._fit([[s, 1] for s in self._subset(cands)[: r.cfg.max_batch_size]])
        self.pending += [["fwd", [list(x) for x in batch]] for _ in range(self._int(1, 6))]
        return ["fwd", batch]

    def _varied(self):
        """A forward of a uniformly drawn batch size and total token count (many distinct step shapes)."""
        r = self.r
        cands = [s for s in r.ids() if not r.tree_nodes(s)]
        if not cands:
            return self._commit()
        B = self._int(1, min(len(cands), r.cfg.max_batch_size))
        total = self._int(B, r.cfg.prefill_chunk_size)
        cuts = np.sort(self.rng.choice(np.arange(1, total), B - 1, replace=False)) if B > 1 else []
        sizes = np.diff(np.r_[0, cuts, total]).tolist()
        self.rng.shuffle(cands)
        return ["fwd", self._fit([[s, int(n)] for s, n in zip(cands[:B], sizes, strict=True)])]

    def _export(self):
        r = self.r
        plain = [s for s in r.ids() if r.plain(s)]
        sid = self._pick(plain) if plain and self.rng.random() < 0.9 else self._pick(r.ids())
        spare = None if self.rng.random() < 0.5 else self._int(0, 2)
        return ["export", sid, self._pick(LAYOUTS), spare]

    def _import_(self):
        """An import of an export or of random data, into a new id or (60%) into a reused one: an
        empty sequence, or one the draw empties first with ``pop_n`` (the import follows the pop)."""
        r = self.r
        layout = self._pick(LAYOUTS)
        sources = [s for s in r.ids() if r.plain(s) and r.length(s)]
        if sources and self.rng.random() < 0.6:
            source = ["seq", self._pick(sources), None if self.rng.random() < 0.5 else self._int(0, 2)]
        else:
            source = ["rand", 0 if self.rng.random() < 0.05 else self._int(1, self.max_new), self._int(0, 2)]
        src = source[1] if source[0] == "seq" else None
        free = self._free_id()
        if free is not None and self.rng.random() < 0.4:
            return ["import", free, layout, source, None]
        empty = [s for s in r.ids() if not r.length(s) and not r.window(s)]
        if empty:
            return ["import", self._pick(empty), layout, source, None]
        cands = [
            s for s in r.ids() if not r.window(s) and not r.tree_nodes(s) and s != src and r.poppable(s) == r.length(s)
        ]
        if not cands:
            return ["import", free, layout, source, None] if free is not None else self._pop()
        target = self._pick(cands)
        self.pending.append(["import", target, layout, source, None])
        return ["pop", target, r.length(target)]

    def _swap_out(self):
        return ["swap_out", self._subset(self.r.ids())[:3]]

    def _swap_in(self):
        """Swap in a few swapped sequences; usually (80%) only as many as the free pages hold."""
        r = self.r
        if not r.swapped:
            return self._swap_out()
        ids = self._subset(r.swapped)[:4]
        while len(ids) > 1 and self.rng.random() < 0.8 and r.shadow.swap_in_pages(ids) > r.shadow.free():
            ids.pop()
        return ["swap_in", ids]

    def _prompt(self) -> list:
        """A prompt: a prefix of an inserted list or of a sequence's tokens (or nothing), then tokens
        no sequence holds."""
        r, u = self.r, self.rng.random()
        if r.inserted and u < 0.75:
            base = list(self._pick(r.inserted))
        elif u < 0.9:
            base = list(r.tokens.get(self._pick(r.ids()), []))
        else:
            base = []
        cut = len(base) if self.rng.random() < 0.4 else self._int(0, len(base))
        return base[:cut] + [-1] * self._int(0, 3)

    def _prefix_add(self):
        sid = self._free_id()
        if sid is None:
            return self._remove()
        prompt = self._prompt()
        max_reuse = None if self.rng.random() < 0.7 else self._int(0, len(prompt))
        return ["prefix_add", sid, prompt, max_reuse]

    def _insert(self, kind: str = "insert"):
        r = self.r
        cands = [s for s in r.ids() if not r.window(s) and not r.tree_nodes(s)] or r.ids()
        sid = self._pick(cands)
        n = r.committed(sid) if self.rng.random() < 0.5 else self._int(0, r.committed(sid))
        return [kind, sid, n]

    def _finish(self):
        return self._insert("finish")

    def _prefix_reset(self):
        return ["prefix_reset"]

    # ---- misuse
    def _misuse(self):
        r, ids = self.r, self.r.ids()
        some = self._pick(ids) if ids else 0
        unknown = self._pick([i for i in range(self.id_pool + 2) if i not in r.model.seqs and i not in r.swapped])
        kinds = [
            lambda: ["add", some] if ids else ["add", "x"],
            lambda: ["add", "x"],
            lambda: ["remove", unknown],
            lambda: ["fork", unknown, self._free_id() or self.id_pool, 0],
            lambda: ["fork", some, some, 0],
            lambda: ["fork", some, self._free_id() or self.id_pool, r.length(some) + self._int(1, 3)],
            lambda: ["fork", some, self._free_id() or self.id_pool, -self._int(2, 5)],
            lambda: ["pop", some, r.length(some) + self._int(1, 3)],
            lambda: ["pop", some, -self._int(1, 3)],
            lambda: ["pop", some, r.poppable(some) + 1],
            lambda: ["pop", unknown, 1],
            lambda: ["window", some, 0, 0],
            lambda: ["window", some, 4, 5],
            lambda: ["window", unknown, 4, 0],
            lambda: ["fwd", [[some, 1], [unknown, 2]]],
            lambda: ["fwd", [[some, 1], [some, 2]]],
            lambda: ["fwd", [[some, 0]]],
            lambda: ["fwd", [[some, r.cfg.prefill_chunk_size + 1]]],
            lambda: ["fwd", [[some, self._int(r.cfg.page_size, r.cfg.prefill_chunk_size)]]],
            lambda: ["fwd", []],
            lambda: ["begin_raw", [some], [1, 1], None],
            lambda: ["begin_raw", [some], [2], [-1]],
            lambda: ["tree", [[some, [self._int(r.tree_nodes(some), r.tree_nodes(some) + 2)]]]],
            lambda: ["tree", [[some, [-1, -2]]]],
            lambda: ["tree", [[some, []]]],
            lambda: ["tree", [[some, [-1, 1]]]],
            lambda: ["commit", [[some, r.tree_nodes(some) + self._int(0, 2)]]],
            lambda: ["commit", [[some, -2]]],
            lambda: ["commit", [[some, -1], [some, -1]]],
            lambda: ["commit", [[unknown, -1]]],
            lambda: ["end"],
            lambda: ["attn"],
            lambda: self._midfwd() if ids and any(not r.tree_nodes(s) for s in ids) else ["end"],
        ]
        if not ids:
            kinds = kinds[1:4] + kinds[-3:-1]
        kinds += self._restricted()
        if self.extras:
            kinds += self._extra_misuse(some if ids else None, unknown)
        return self._pick(kinds)()

    def _restricted(self) -> list:
        """Misuse aimed at the cache's documented restrictions, for sequences in the needed state."""
        r, out = self.r, []
        slid = [s for s in r.ids() if r.slid(s)]
        windowed = [s for s in r.ids() if r.window(s)]
        tree = [s for s in r.ids() if r.tree_nodes(s)]
        child = self._free_id() or self.id_pool
        if slid:
            out.append(lambda: ["fork", self._pick(slid), child, self._int(-1, r.committed(slid[0]))])
            out.append(lambda: ["window", self._pick(slid), 8, 1])
            out.append(lambda: ["pop", slid[0], r.poppable(slid[0]) + self._int(1, 3)])
        if windowed:
            out.append(lambda: ["tree", [[self._pick(windowed), [-1]]]])
        if tree:
            sid = self._pick(tree)
            out.append(lambda: ["fwd", [[sid, 1]]])
            out.append(lambda: ["pop", sid, 0])
            out.append(lambda: ["window", sid, 8, 0])
            out.append(lambda: ["fork", sid, child, r.committed(sid) + self._int(1, r.tree_nodes(sid))])
        return out

    def _extra_misuse(self, some, unknown) -> list:
        """Misuse of the extra operation families (and of every call on a swapped-out sequence)."""
        r, x, out = self.r, self.extras, []
        new = self._free_id()
        new = unknown if new is None else new
        layout = self._pick(LAYOUTS)
        slid = [s for s in r.ids() if r.slid(s)]
        windowed = [s for s in r.ids() if r.window(s)]
        tree = [s for s in r.ids() if r.tree_nodes(s)]
        if "interop" in x:
            out += [
                lambda: ["export", unknown, layout, None],
                lambda: ["import", new, "bogus", ["rand", 2, 0], None],
                lambda: ["import", new, layout, ["rand", self._int(1, 9), self._int(0, 2)], self._pick(IMPORT_FLAWS)],
                lambda: ["import", "x", "contiguous", ["rand", 1, 0], None],
                lambda: ["import", new, layout, ["seq", unknown, None], None],
            ]
            if some is not None:
                out.append(lambda: ["export", some, "bogus", None])
                if r.length(some):
                    out.append(lambda: ["import", some, layout, ["rand", 2, 0], None])  # not empty
            for bad in (slid, tree):  # only plain sequences export
                if bad:
                    out.append(lambda bad=bad: ["export", self._pick(bad), layout, None])
                    out.append(lambda bad=bad: ["import", new, layout, ["seq", self._pick(bad), None], None])
            empty_windowed = [s for s in windowed if not r.length(s)]
            if empty_windowed:
                out.append(lambda: ["import", self._pick(empty_windowed), layout, ["rand", 3, 0], None])
        if "swap" in x:
            out += [
                lambda: ["swap_out", [unknown]],
                lambda: ["swap_in", [unknown]],
                lambda: ["swap_out", ["x"]],
            ]
            if some is not None:
                out += [lambda: ["swap_out", [some, some]], lambda: ["swap_in", [some]]]
            if r.swapped:
                s = self._pick(list(r.swapped))
                out += [
                    lambda: ["swap_out", [s]],
                    lambda: ["swap_in", [s, s]],
                    lambda: ["fwd", [[s, 1]]],
                    lambda: ["tree", [[s, [-1]]]],
                    lambda: ["pop", s, 0],
                    lambda: ["fork", s, new, 0],
                    lambda: ["window", s, 4, 0],
                    lambda: ["commit", [[s, -1]]],
                    lambda: ["add", s],
                    lambda: ["export", s, layout, None],
                    lambda: ["import", s, layout, ["rand", 1, 0], None],
                ]
                if "prefix" in x:
                    out.append(lambda: ["insert", s, 0])
        if "prefix" in x:
            out += [
                lambda: ["prefix_add", new, [-1, -1], 3],  # max_reuse past the prompt
                lambda: ["insert", unknown, 0],
                lambda: ["finish", unknown, 0],
                lambda: ["prefix_twice"],
            ]
            if some is not None:
                out += [
                    lambda: ["prefix_add", some, [-1], None],  # an id in use
                    lambda: ["insert", some, r.length(some) + self._int(1, 3)],  # more tokens than it holds
                ]
            for bad in (windowed, tree):  # a window drops pages; a tree is not a chain of tokens yet
                if bad:
                    out.append(lambda bad=bad: ["insert", self._pick(bad), 0])
                    out.append(lambda bad=bad: ["finish", self._pick(bad), 0])
        return out


def run_random(
    cache, seed: int, num_ops: int, *, kv_every: int = 1, misuse: float = 0.15, extras=(), id_pool: int = ID_POOL
):
    """One episode: draw and run ``num_ops`` operations on a cleared ``cache``, compare every stored
    K/V with the model, remove every sequence (and drop the prefix tree) and check that every page
    came back. ``extras`` and ``id_pool``: :class:`Generator`'s; forwards are read back
    (``observe_forwards``) whenever ``extras`` are on.

    Returns (the operations run, the final removes included; the runner). A failure raises
    :class:`Mismatch` with ``ops``, ``runner`` and ``leaked`` set.
    """
    cache.clear()
    runner = StatefulRunner(cache, seed=seed, kv_every=kv_every, observe_forwards=bool(extras))
    gen = Generator(runner, seed, misuse, extras=extras, id_pool=id_pool)
    ops = []
    try:
        for _ in range(num_ops):
            op = gen.next()
            ops.append(op)
            runner.step(op)
        runner.check_kv("end of the episode")  # whatever kv_every skipped
        for op in runner.drain_ops():
            ops.append(op)
            runner.step(op)
        leaked = runner.cfg.total_pages - cache.num_available_pages()
        if leaked:
            err = Mismatch(f"{leaked} pages leaked after removing every sequence")
            err.leaked = leaked
            raise err
    except Mismatch as err:
        err.ops, err.runner = ops, runner
        raise
    return ops, runner


def replay_fails(cache, ops, seed: int = 0):
    """Replay ``ops`` on a cleared cache (forwards read back); return the Mismatch it raises (or None)."""
    cache.clear()
    runner = StatefulRunner(cache, seed=seed, observe_forwards=True)
    try:
        runner.run(ops)
        if runner.drain():
            return Mismatch("pages leaked after removing every sequence")
    except Mismatch as err:
        return err
    return None


def _signature(err) -> str:
    """The kind of a failure, without the step, the operation or any number."""
    text = str(err)
    text = text.split(": ", 1)[1] if text.startswith("step ") else text
    return re.sub(r"-?\d+", "#", text.split("]: ", 1)[-1])[:30]


def shrink(cache, ops, seed: int = 0, budget: int = 400) -> list:
    """Delta-debug ``ops`` down to a short list that still fails the same way (by deleting operations)."""
    first = replay_fails(cache, ops, seed)
    if first is None:
        return ops
    want = _signature(first)

    def fails(candidate):
        err = replay_fails(cache, candidate, seed)
        return err is not None and _signature(err) == want

    # the failing prefix is enough
    step = int(str(first).split(":")[0].split()[1]) if str(first).startswith("step ") else len(ops) - 1
    ops = ops[: step + 1]
    chunk, tries = max(1, len(ops) // 2), 0
    while chunk >= 1 and tries < budget:
        i, changed = 0, False
        while i < len(ops) and tries < budget:
            candidate = ops[:i] + ops[i + chunk :]
            tries += 1
            if candidate and fails(candidate):
                ops, changed = candidate, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return ops
