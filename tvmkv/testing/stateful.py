"""Stateful randomized differential testing of ``PagedAttentionKVCache`` against the NumPy ``CacheModel``.

A seeded :class:`Generator` draws random interleavings of every public operation — add,
fork (anywhere, forks of forks), pop_n, remove, sliding windows, prefill/decode steps, multi-round
token trees with commits — and deliberate misuse (unknown or duplicate ids, fork past the end, pops
that are too long, out-of-pages forwards on caches with few pages, bad tree parents, calls that the
forward protocol forbids, ...). Operations are plain lists in the :mod:`tvmkv.replay` format plus a
few misuse-only kinds, so a failing sequence can be pasted into a regression test.

:class:`StatefulRunner` runs one operation at a time. Before each call it predicts, from the model
and from an independent page-accounting shadow (:class:`PageShadow`), whether the call must succeed
or which exceptions it may raise. After a successful call the attention outputs, lengths, stored
K/V and free-page count must match; after a rejected call nothing may have changed (free pages,
lengths, stored K/V). ``check_integrity()`` runs after every operation. Because every call's outcome
is predicted, any sub-list of a failing list is itself a runnable test, which :func:`shrink` uses to
cut counterexamples down by deleting operations.

:func:`run_random` draws and runs one episode; tests/test_stateful.py runs a few short ones
(:data:`tvmkv.testing.configs.STATEFUL_CONFIGS`), ``bench/soak.py`` drives the same machinery for
100k+ operations. The runner reads the cache only through its public API (free pages, sequence ids
and lengths, ``check_integrity()``, ``debug_get_kv``); what it knows about pages comes from the shadow.
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import ForwardStateError, OutOfPagesError
from ..replay import Replayer
from ..runtime.tensors import numpy_dtype
from .shadow import PageShadow

ID_POOL = 8  # sequence ids are drawn from [0, ID_POOL) so collisions (misuse) happen often


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


class StatefulRunner:
    """Run operations on a cache, predicting each call's outcome and checking it against the model.

    Parameters
    ----------
    cache : PagedAttentionKVCache
        A fresh (or ``clear()``-ed) cache.
    seed : int
        Seed of the random q/k/v values.
    kv_every : int
        Compare every sequence's stored K/V with the model after every ``kv_every``-th operation
        (1 = always). Integrity, lengths and free pages are checked after every operation, and a
        rejected call is always followed by a full K/V comparison when ``kv_every == 1``.
    """

    def __init__(self, cache, *, seed: int = 0, kv_every: int = 1):
        self.cache = cache
        self.cfg = cache.config
        self.driver = Replayer(cache, seed=seed)
        self.model = self.driver.model
        self.shadow = PageShadow(self.cfg.page_size, self.cfg.total_pages)
        self.kv_every = kv_every
        self.steps = 0
        self.rejected = 0
        self.stats: dict = {}

    # ---------------------------------------------------------------- model queries
    def ids(self) -> list:
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

    # ---------------------------------------------------------------- prediction
    def _forward_errors(self, ids, lengths, parents) -> set:
        """Exceptions begin_forward may raise for this batch (empty: it must succeed)."""
        cfg = self.cfg
        errs: set[type[Exception]] = set()
        known = [s for s in ids if _is_int(s) and s in self.model.seqs]
        if len(known) != len(ids):
            errs.add(KeyError)
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
            if need > self.shadow.free():
                errs.add(OutOfPagesError)
        return errs

    def expected_errors(self, op) -> set:
        """The exception classes ``op`` may raise; an empty set means it must succeed."""
        kind, seqs = op[0], self.model.seqs
        errs: set[type[Exception]] = set()
        if kind == "add":
            if not _is_int(op[1]):
                errs.add(TypeError)
            elif op[1] in seqs:
                errs.add(KeyError)
        elif kind == "remove":
            if op[1] not in seqs:
                errs.add(KeyError)
        elif kind == "fork":
            parent, child, pos = op[1:]
            if parent not in seqs or child in seqs:
                errs.add(KeyError)
            if parent in seqs:
                committed = self.committed(parent)
                pos = committed if pos == -1 else pos
                if pos < 0 or pos > committed or self.slid(parent):
                    errs.add(ValueError)
                elif not errs and pos % self.cfg.page_size and self.shadow.free() == 0:
                    errs.add(OutOfPagesError)
        elif kind == "pop":
            sid, n = op[1:]
            if sid not in seqs:
                errs.add(KeyError)
            elif n < 0 or self.tree_nodes(sid) or n > self.length(sid) or n > self.poppable(sid):
                errs.add(ValueError)
        elif kind == "window":
            sid, size, sink = op[1:]
            if sid not in seqs:
                errs.add(KeyError)
            if not self.cfg.support_sliding_window or size <= 0 or not 0 <= sink <= size:
                errs.add(ValueError)
            if sid in seqs and (self.tree_nodes(sid) or self.slid(sid)):
                errs.add(ValueError)
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
            if any(s not in seqs for s in ids):
                errs.add(KeyError)
            if len(set(ids)) != len(ids):
                errs.add(ValueError)
            if any(s in seqs and not -1 <= leaf < self.tree_nodes(s) for s, leaf in zip(ids, leaves, strict=False)):
                errs.add(ValueError)
        elif kind in ("end", "attn"):
            errs.add(ForwardStateError)
        else:
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
        elif kind == "midfwd":  # a plain forward with a forbidden call inside it
            ids, lengths = [x[0] for x in op[1]], [x[1] for x in op[1]]
            self.driver.forward(ids, lengths, None, None, after_begin=self._injector(op[2]))
        else:
            self.driver.apply(op)

    def _injector(self, what: str):
        """A forbidden call made while a forward is open; it must fail and change nothing."""
        calls = {
            "add": (ForwardStateError, lambda c: c.add_sequence(ID_POOL + 1)),
            "remove": (ForwardStateError, lambda c: c.remove_sequence(c.sequence_ids()[0])),
            "fork": (ForwardStateError, lambda c: c.fork_sequence(c.sequence_ids()[0], ID_POOL + 1, 0)),
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
        }
        exc, call = calls[what]

        def inject(cache):
            free = cache.num_available_pages()
            lengths = {s: cache.sequence_length(s) for s in cache.sequence_ids()}
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

        return inject

    def _update_shadow(self, op) -> None:
        kind, shadow = op[0], self.shadow
        if kind == "add":
            shadow.add(op[1])
        elif kind == "remove":
            shadow.remove(op[1])
        elif kind == "fork":
            shadow.fork(op[1], op[2], self.committed(op[2]))
        elif kind in ("pop", "commit"):
            for sid in [op[1]] if kind == "pop" else [x[0] for x in op[1]]:
                shadow.truncate(sid, self.slots(sid))
        elif kind == "window":
            s = self.model.seqs[op[1]]
            shadow.slide(op[1], s.appended, s.index)

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
        self.stats[op[0] + ("!" if errs else "")] = self.stats.get(op[0] + ("!" if errs else ""), 0) + 1
        free_before = self.cache.num_available_pages()
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
            key = f"{op[0]}!{type(err).__name__}"
            self.stats[key] = self.stats.get(key, 0) + 1
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
        self._check_state(op, free_before, force_kv=False, rejected=False)

    def _check_state(self, op, free_before: int, *, force_kv: bool, rejected: bool) -> None:
        cache = self.cache
        try:
            cache.check_integrity()
        except AssertionError as err:
            raise Mismatch(f"{op}: check_integrity failed: {err}") from err
        free = cache.num_available_pages()
        if rejected and free != free_before:
            raise Mismatch(f"{op}: rejected call changed free pages {free_before} -> {free}")
        if free != self.shadow.free():
            raise Mismatch(f"{op}: {free} free pages, the page shadow expects {self.shadow.free()}")
        if sorted(cache.sequence_ids()) != sorted(self.model.seqs):
            raise Mismatch(f"{op}: sequence ids {sorted(cache.sequence_ids())} != {sorted(self.model.seqs)}")
        for sid in self.model.seqs:
            if cache.sequence_length(sid) != self.length(sid):
                raise Mismatch(f"{op}: length of {sid} is {cache.sequence_length(sid)}, want {self.length(sid)}")
        if force_kv or self.steps % self.kv_every == 0:
            self.check_kv(op)

    def check_kv(self, op=None) -> None:
        """Compare every sequence's stored K/V with the model now; raises :class:`Mismatch` (naming ``op``)."""
        try:
            self.driver.check_kv()
        except AssertionError as err:
            raise Mismatch(f"{op}: stored K/V differ from the model: {err}") from err

    def run(self, ops) -> None:
        """Run ``ops``; a failure is re-raised as :class:`Mismatch` naming the step."""
        for i, op in enumerate(ops):
            try:
                self.step(op)
            except Mismatch as err:
                raise Mismatch(f"step {i}: {err}") from err

    def drain(self) -> int:
        """Remove every sequence; return how many pages did not come back (should be 0)."""
        for sid in list(self.model.seqs):
            self.step(["remove", sid])
        return self.cfg.total_pages - self.cache.num_available_pages()


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
    """

    def __init__(self, runner: StatefulRunner, seed: int, misuse: float = 0.15):
        self.r = runner
        self.rng = np.random.default_rng(seed)
        self.misuse = misuse
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
        free = [i for i in range(ID_POOL) if i not in self.r.model.seqs]
        return self._pick(free) if free else None

    def next(self) -> list:
        r, rng = self.r, self.rng
        ids = r.ids()
        if not ids:
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
        if len(ids) >= ID_POOL:
            weights["add"] = weights["fork"] = 0
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
        return ["window", self._pick(cands), size, self._int(0, min(size, r.cfg.page_size + 1))]

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

    # ---- misuse
    def _misuse(self):
        r, ids = self.r, self.r.ids()
        some = self._pick(ids) if ids else 0
        unknown = self._pick([i for i in range(ID_POOL + 2) if i not in r.model.seqs])
        kinds = [
            lambda: ["add", some] if ids else ["add", "x"],
            lambda: ["add", "x"],
            lambda: ["remove", unknown],
            lambda: ["fork", unknown, self._free_id() or ID_POOL, 0],
            lambda: ["fork", some, some, 0],
            lambda: ["fork", some, self._free_id() or ID_POOL, r.length(some) + self._int(1, 3)],
            lambda: ["fork", some, self._free_id() or ID_POOL, -self._int(2, 5)],
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
        return self._pick(kinds)()

    def _restricted(self) -> list:
        """Misuse aimed at the cache's documented restrictions, for sequences in the needed state."""
        r, out = self.r, []
        slid = [s for s in r.ids() if r.slid(s)]
        windowed = [s for s in r.ids() if r.window(s)]
        tree = [s for s in r.ids() if r.tree_nodes(s)]
        child = self._free_id() or ID_POOL
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


def run_random(cache, seed: int, num_ops: int, *, kv_every: int = 1, misuse: float = 0.15):
    """One episode: draw and run ``num_ops`` operations on a cleared ``cache``, compare every stored
    K/V with the model, remove every sequence and check that every page came back.

    Returns (the operations run, the final removes included; the runner). A failure raises
    :class:`Mismatch` with ``ops``, ``runner`` and ``leaked`` set.
    """
    cache.clear()
    runner = StatefulRunner(cache, seed=seed, kv_every=kv_every)
    gen = Generator(runner, seed, misuse)
    ops = []
    try:
        for _ in range(num_ops):
            op = gen.next()
            ops.append(op)
            runner.step(op)
        runner.check_kv("end of the episode")  # whatever kv_every skipped
        ops += [["remove", s] for s in runner.ids()]
        leaked = runner.drain()
        if leaked:
            err = Mismatch(f"{leaked} pages leaked after removing every sequence")
            err.leaked = leaked
            raise err
    except Mismatch as err:
        err.ops, err.runner = ops, runner
        raise
    return ops, runner


def replay_fails(cache, ops, seed: int = 0):
    """Replay ``ops`` on a cleared cache; return the Mismatch it raises (or None)."""
    cache.clear()
    runner = StatefulRunner(cache, seed=seed)
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
