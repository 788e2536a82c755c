"""Stateful randomized differential testing of ``PagedAttentionKVCache`` against the NumPy ``CacheModel``.

A seeded generator (:func:`generate`) draws random interleavings of every public operation — add,
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

``bench/soak.py`` drives the same machinery for 100k+ operations.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import tvmkv
from tvmkv.errors import ForwardStateError, OutOfPagesError
from tvmkv.replay import Replayer
from tvmkv.runtime.tensors import numpy_dtype

ID_POOL = 8  # sequence ids are drawn from [0, ID_POOL) so collisions (misuse) happen often


class Mismatch(AssertionError):
    """The cache disagreed with the model or with the predicted outcome of an operation."""


# ------------------------------------------------------------------------------------------ page shadow
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


# ------------------------------------------------------------------------------------------ the runner
class _Driver(Replayer):
    """``Replayer`` whose forward can run one forbidden call between begin_forward and the layers."""

    inject = None  # callable(cache) run after begin_forward, before layer 0 (set per operation)

    def forward(self, ids, lengths, parents, flat) -> float:
        if self.inject is None:
            return super().forward(ids, lengths, parents, flat)
        cfg = self.cache.config
        n = sum(lengths)
        self.cache.begin_forward(ids, lengths, flat)
        self.model.begin(ids, lengths, parents)
        self.inject(self.cache)
        worst = 0.0
        for layer in range(cfg.num_layers):
            qkv = self.rng.uniform(-1, 1, (n, cfg.qkv_heads, cfg.head_dim)).astype(numpy_dtype(cfg.dtype))
            o = np.asarray(self.cache.attention_with_fused_qkv(layer, qkv), np.float64)
            ref, _ = self.model.attention(layer, qkv)
            worst = max(worst, float(np.abs(o - ref).max()))
            np.testing.assert_allclose(
                o,
                ref,
                atol=self.atol,
                rtol=self.rtol,
                err_msg=f"attention output of layer {layer}, seqs {ids}, lengths {lengths}",
            )
        self.cache.end_forward()
        self.model.end()
        return worst


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
        self.driver = _Driver(cache, seed=seed)
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

    def tree_nodes(self, sid) -> int:
        return len(self.model.seqs[sid].tparent)

    def window(self, sid) -> int:
        return self.model.seqs[sid].window

    def slid(self, sid) -> bool:
        s = self.model.seqs[sid]
        return s.length > len(s.pos)

    def poppable(self, sid) -> int:
        """Most tokens ``pop_n`` may drop (the window's kept tokens once a window slid)."""
        s = self.model.seqs[sid]
        return int((s.pos >= s.sink).sum()) if self.slid(sid) else s.length

    # ---------------------------------------------------------------- prediction
    def _forward_errors(self, ids, lengths, parents) -> set:
        """Exceptions begin_forward may raise for this batch (empty: it must succeed)."""
        cfg, errs = self.cfg, set()
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
            need = sum(self.shadow.needed(s, self.length(s), n) for s, n in zip(ids, lengths, strict=False))
            if need > self.shadow.free():
                errs.add(OutOfPagesError)
        return errs

    def expected_errors(self, op) -> set:
        """The exception classes ``op`` may raise; an empty set means it must succeed."""
        kind, seqs, errs = op[0], self.model.seqs, set()
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
        elif kind == "midfwd":
            self.driver.inject = self._injector(op[2])
            try:
                self.driver.apply(["fwd", op[1]])
            finally:
                self.driver.inject = None
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
                shadow.truncate(sid, self.length(sid))
        elif kind == "window":
            s = self.model.seqs[op[1]]
            shadow.slide(op[1], s.length, s.pos)

    def _pre_forward_shadow(self, op) -> list:
        """Lengths before a forward, so the shadow can append after the call."""
        if op[0] in ("fwd", "midfwd"):
            return [(x[0], self.length(x[0]), x[1]) for x in op[1]]
        if op[0] == "tree":
            return [(x[0], self.length(x[0]), len(x[1])) for x in op[1]]
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
                self.shadow.slide(sid, s.length, s.pos)
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
        return sum(r.shadow.needed(s, r.length(s), n if isinstance(n, int) else len(n)) for s, n in batch)

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


# ------------------------------------------------------------------------------------------ drivers
def make_cache(
    target="llvm",
    *,
    page_size=4,
    num_pages=16,
    num_layers=1,
    num_qo_heads=2,
    num_kv_heads=1,
    head_dim=16,
    rope_mode="normal",
    sliding=True,
    max_batch_size=4,
    prefill_chunk_size=32,
    dtype="float32",
    build_dir=None,
    decode_splits=None,
):
    """A small cache with few pages, so that out-of-pages happens; ``max_total_seq_len`` fills the pool."""
    return tvmkv.PagedAttentionKVCache(
        num_layers,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size=page_size,
        max_batch_size=max_batch_size,
        max_total_seq_len=num_pages * page_size,
        prefill_chunk_size=prefill_chunk_size,
        dtype=dtype,
        rope_mode=rope_mode,
        support_sliding_window=sliding,
        target=target,
        num_pages=num_pages,
        build_dir=build_dir,
        decode_splits=decode_splits,
    )


def run_random(cache, seed: int, num_ops: int, *, kv_every: int = 1, misuse: float = 0.15):
    """Draw and run ``num_ops`` operations on a cleared ``cache``; return (ops run, runner).

    On a failure the raised :class:`Mismatch` carries the operations drawn so far in ``.ops``.
    """
    cache.clear()
    runner = StatefulRunner(cache, seed=seed, kv_every=kv_every)
    gen = Generator(runner, seed, misuse)
    ops = []
    for _ in range(num_ops):
        op = gen.next()
        ops.append(op)
        try:
            runner.step(op)
        except Mismatch as err:
            err.ops = ops
            raise
    ops += [["remove", s] for s in runner.ids()]
    leaked = runner.drain()
    if leaked:
        err = Mismatch(f"{leaked} pages leaked after removing every sequence")
        err.ops = ops
        raise err
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


# ------------------------------------------------------------------------------------------ tests
# (page_size, num_pages, rope_mode, H_qo, H_kv, layers, sliding, max_batch, chunk, ops, seed)
CI_CONFIGS = [
    pytest.param(4, 16, "normal", 2, 1, 1, True, 4, 32, 700, 11, id="p4-normal-window"),
    pytest.param(1, 24, "inline", 4, 2, 2, True, 3, 16, 500, 12, id="p1-inline-window"),
    pytest.param(8, 10, "none", 2, 2, 1, False, 6, 48, 600, 13, id="p8-none-nowindow"),
]


def _run_or_shrink(cache, seed, num_ops):
    try:
        return run_random(cache, seed, num_ops)
    except Mismatch as err:
        small = shrink(cache, err.ops, seed)
        pytest.fail(f"{err}\n\nshrunk counterexample ({len(small)} ops):\n{small!r}")


@pytest.mark.parametrize("page_size,num_pages,rope,hq,hkv,layers,sliding,batch,chunk,num_ops,seed", CI_CONFIGS)
def test_random_operations(page_size, num_pages, rope, hq, hkv, layers, sliding, batch, chunk, num_ops, seed):
    cache = make_cache(
        page_size=page_size,
        num_pages=num_pages,
        rope_mode=rope,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        num_layers=layers,
        sliding=sliding,
        max_batch_size=batch,
        prefill_chunk_size=chunk,
    )
    ops, runner = _run_or_shrink(cache, seed, num_ops)
    # the draw must reach the interesting states, not only trivial ones
    for kind in (
        "fork",
        "pop",
        "fwd",
        "tree",
        "commit",
        "remove",
        "fwd!",
        "pop!",
        "fork!",
        "commit!",
        "midfwd",
    ):
        assert runner.stats.get(kind, 0) > 0, f"no {kind!r} operation was drawn: {runner.stats}"
    if sliding:
        assert runner.stats.get("window", 0) > 0
    assert cache.num_available_pages() == cache.config.total_pages


def test_shrink_finds_small_counterexample():
    """The shrinker cuts a failing list to the operations that matter (here: a planted bad prediction)."""
    cache = make_cache()
    ops = [
        ["add", 0],
        ["fwd", [[0, 5]]],
        ["add", 1],
        ["fwd", [[0, 1], [1, 3]]],
        ["add", 0],
        ["pop", 0, 2],
        ["fork", 0, 2, 3],
        ["fwd", [[2, 1]]],
        ["pop", 2, 9],
    ]
    planted = ops + [["remove", 7]]
    # a runner that wrongly predicts 'remove 7' succeeds fails at the last step; the shrinker keeps only it
    original = StatefulRunner.expected_errors
    try:
        StatefulRunner.expected_errors = lambda self, op: set() if op == ["remove", 7] else original(self, op)
        assert shrink(cache, planted) == [["remove", 7]]
    finally:
        StatefulRunner.expected_errors = original
    assert replay_fails(cache, ops) is None


# Each documented restriction, in the state it needs; the runner predicts the rejection ("!" ops) and
# checks that nothing changed, then that the cache keeps working.
RESTRICTIONS = [
    ["add", 0],
    ["window", 0, 6, 2],
    ["fwd", [[0, 5]]],
    ["fork", 0, 1, 3],  # a windowed sequence that has not slid: the child inherits its window
    ["tree", [[1, [-1]]]],  # ! token trees on a (inherited) window
    ["fwd", [[0, 3], [1, 5]]],  # both slide now
    ["fork", 0, 2, 1],  # ! fork of a slid sequence (tokens were dropped)
    ["fork", 1, 2, -1],  # ! same, for the forked child
    ["pop", 0, 5],  # ! into dropped tokens (only 4 window tokens are kept)
    ["pop", 0, 4],
    ["window", 0, 8, 1],  # ! window of a slid sequence cannot change
    ["fwd", [[0, 2]]],
    ["add", 3],
    ["fwd", [[3, 6]]],
    ["tree", [[3, [-1, 0, 0]]]],
    ["fwd", [[3, 1]]],  # ! plain forward with uncommitted tree nodes
    ["pop", 3, 0],  # ! pop_n with uncommitted tree nodes
    ["window", 3, 8, 0],  # ! window with uncommitted tree nodes
    ["fork", 3, 4, 7],  # ! inside the uncommitted tree
    ["fork", 3, 4, -1],
    ["tree", [[3, [2, -1]], [4, [-1]]]],
    ["commit", [[4, 0], [3, 3]]],
    ["fwd", [[3, 1], [4, 1], [0, 1], [1, 1]]],
]


def test_documented_restrictions():
    cache = make_cache(page_size=2, num_pages=40)
    runner = StatefulRunner(cache)
    runner.run(RESTRICTIONS)
    assert runner.rejected == 9, runner.stats
    assert runner.drain() == 0
