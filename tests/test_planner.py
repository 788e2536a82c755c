"""The step planner's index arrays against an independent NumPy construction of docs/layout.md.

Random streams of add / remove / fork / pop_n / sliding-window / decode (new batches, reordered
batches, repeated batches: the fast path) / prefill / token-tree / commit operations drive a small
cache (llvm; cuda too where a GPU is) through its public API, decode steps of a changed batch and
prefill steps planned on the device (``device_planning``, its page table kept there) or on the host;
after every
``begin_forward`` each array ``debug_forward()`` reads
back from the device must equal what the layout document defines, built here from the sequences'
public state before the step (``sequence_info``, ``pool.ref_count``) and the tree parents this test
issued. Pages are checked too: a sequence keeps its pages, a shared partial last page is replaced by
a copy (copy-on-write), new pages come last, and a forward the pool cannot serve changes nothing.
No attention runs (the kernels are the real ones: copy-on-write copies pages, plan_decode and
plan_prefill plan).
"""

from __future__ import annotations

import numpy as np
import pytest

from tvmkv import PagedAttentionKVCache
from tvmkv.errors import OutOfPagesError

P = 4
FEW = 64  # plan.Planner plans decode and prefill batches up to this size over Python ints, larger ones with NumPy


def _make_cache(
    num_pages: int, max_batch: int, device_planning: bool = True, target: str = "llvm"
) -> PagedAttentionKVCache:
    return PagedAttentionKVCache(
        1,
        4,
        2,
        64,
        page_size=P,
        max_batch_size=max_batch,
        max_total_seq_len=num_pages * P,
        prefill_chunk_size=128,
        dtype="float32",
        target=target,
        support_sliding_window=True,
        num_pages=num_pages,
        device_planning=device_planning,
    )


def _dfs(parents: list) -> tuple:
    """(enter, exit) preorder numbers of a forest (children in index order); exit = the largest
    enter number in the node's subtree."""
    children: list = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    enter, exit_ = [0] * len(parents), [0] * len(parents)
    counter = 0

    def visit(node: int) -> None:
        nonlocal counter
        enter[node] = counter
        counter += 1
        for c in children[node]:
            visit(c)
        exit_[node] = counter - 1

    for i, p in enumerate(parents):
        if p < 0:
            visit(i)
    return enter, exit_


def _expected(before: dict, after: dict, batch: list, lengths: list, trees: dict, new_parents) -> dict:
    """docs/layout.md's arrays of a forward of ``batch`` / ``lengths``: ``before`` / ``after`` map ids to
    ``sequence_info`` before and after ``begin_forward``; ``trees`` the uncommitted tree parents before
    the step, ``new_parents`` the step's per-sequence parent lists (tree forward) or None."""
    B, n = len(batch), sum(lengths)
    q_indptr = np.concatenate([[0], np.cumsum(lengths)])
    npages = [len(after[s].pages) for s in batch]
    page_indptr = np.concatenate([[0], np.cumsum(npages)])
    page_indices = np.array([p for s in batch for p in after[s].pages], np.int64)
    last_page_len, q_pos, slots, kv_window = [], [], [], []
    q_tree, kv_tree, kv_tree_indptr, kv_tree_start = [], [], [0], []
    for b, (s, k) in enumerate(zip(batch, lengths)):
        info, pages = before[s], after[s].pages
        kv_after = info.kv_len + k
        assert after[s].kv_len == kv_after, "the forward's tokens are appended"
        last_page_len.append(kv_after - (len(pages) - 1) * P if pages else 0)
        gap = info.kv_len - info.length if info.window else 0  # slots slid out (no tree with a window)
        sink_end = info.sink if info.window else 0
        kv_window.append((sink_end, sink_end + gap, -gap))
        for j in range(info.kv_len, kv_after):
            slots.append(pages[j // P] * P + j % P)
            q_pos.append(j if j < sink_end else j - gap)
        if new_parents is not None:
            parents = trees.get(s, []) + new_parents[b]
            depth: list = []
            for p in parents:
                depth.append(0 if p < 0 else depth[p] + 1)
            enter, exit_ = _dfs(parents)
            old, committed = len(trees.get(s, [])), info.length - info.num_tree_nodes
            q_tree += list(zip(enter[old:], exit_[old:]))
            q_pos[len(q_pos) - k :] = [committed + d for d in depth[old:]]
            kv_tree += [(e, x, committed + d) for e, x, d in zip(enter, exit_, depth)]
            kv_tree_indptr.append(len(kv_tree))
            kv_tree_start.append(info.kv_len - old)
    if new_parents is None:
        q_tree, kv_tree, kv_tree_indptr, kv_tree_start = [(0, 0)] * n, [(0, 0, 0)], [0] * (B + 1), [0] * B
    arrays = dict(
        q_indptr=q_indptr,
        q_pos=q_pos,
        slots=slots,
        last_page_len=last_page_len,
        page_indptr=page_indptr,
        kv_window=kv_window,
        q_tree=q_tree or [(0, 0)],
        kv_tree_indptr=kv_tree_indptr,
        kv_tree=kv_tree or [(0, 0, 0)],
        kv_tree_start=kv_tree_start,
        page_indices=page_indices,
    )
    return {name: np.asarray(a, np.int64) for name, a in arrays.items()}


def _kernel(batch_lengths: list, tree: bool, before: dict, batch: list) -> str:
    if tree:
        return "paged_prefill_tree"
    if sum(batch_lengths) == len(batch_lengths):
        return "paged_decode"
    return "paged_prefill_causal" if any(before[s].kv_len for s in batch) else "ragged_prefill_causal"


class Driver:
    """Draws valid operations and checks every forward (see the module docstring)."""

    def __init__(self, seed: int, num_pages: int, sequences: int, device_planning: bool = True, target: str = "llvm"):
        """``sequences`` > 0: that many sequences first, and batches of up to ``sequences + 8``, most
        above :data:`FEW` (the NumPy decode path); else batches of up to 8 (the Python-int path)."""
        self.rng = np.random.default_rng(seed)
        self.max_batch = sequences + 8 if sequences else 8
        self.least = FEW + 1 if sequences else 1
        self.cache = _make_cache(num_pages, self.max_batch, device_planning, target)
        self.roomy = num_pages > 200
        self.trees: dict = {}  # seq id -> uncommitted tree parents (this test's record)
        for s in range(sequences):
            self.cache.add_sequence(s)
        self.next_id = sequences
        self.last_decode: tuple | None = None
        self.forwards = self.repeats = self.out_of_pages = self.cows = self.large = self.on_device = 0
        self.prefills_on_device = 0  # prefill / mixed steps planned on the device (plan_prefill)
        self.wide_prefills = 0  # prefill / mixed steps above FEW sequences (device or plan_step)

    def ids(self) -> list:
        return self.cache.sequence_ids()

    def step(self) -> None:
        rng, c, ids = self.rng, self.cache, self.ids()
        op = rng.choice(["add", "remove", "fork", "pop", "window", "decode", "repeat", "prefill", "tree", "commit"])
        if op == "add" or not ids:
            c.add_sequence(self.next_id)
            self.next_id += 1
        elif op == "remove" and len(ids) > max(2, self.least):
            s = int(rng.choice(ids))
            c.remove_sequence(s)
            self.trees.pop(s, None)
        elif op == "fork":
            s = int(rng.choice(ids))
            info = c.sequence_info(s)
            if info.slid:
                return
            committed = info.length - info.num_tree_nodes
            pos = int(rng.choice([-1, committed // P * P, int(rng.integers(0, committed + 1))]))
            try:
                c.fork_sequence(s, self.next_id, pos)
            except OutOfPagesError:
                return
            child, self.next_id = self.next_id, self.next_id + 1
            if rng.random() < 0.5 and c.sequence_length(child) % P == 0 and c.sequence_length(child):
                c.pop_n(child, 1)  # its last page is shared and partial now: copy-on-write at its next token
        elif op == "pop":
            s = int(rng.choice(ids))
            info = c.sequence_info(s)
            if info.num_tree_nodes == 0 and info.poppable:
                c.pop_n(s, int(rng.integers(0, min(info.poppable, 2 * P) + 1)))
        elif op == "window":
            s = int(rng.choice(ids))
            info = c.sequence_info(s)
            if info.num_tree_nodes == 0 and not info.slid and rng.random() < 0.5:
                window = int(rng.integers(max(2, info.fork_prefix + 1), 4 * P + info.fork_prefix + 1))
                c.enable_sliding_window_for_seq(s, window, int(rng.integers(0, window)))
        elif op == "commit":
            pending = [s for s in ids if self.trees.get(s)]
            if pending:
                leaves = [int(rng.integers(-1, len(self.trees[s]))) for s in pending]
                c.commit_accepted_token_tree_nodes(pending, leaves)
                for s in pending:
                    del self.trees[s]
        elif op == "repeat":  # a decode batch again (the first time perhaps planned anew), then repeated
            usable = self.last_decode is not None and set(self.last_decode[0]) <= set(ids)
            if not usable or any(self.trees.get(s) for s in self.last_decode[0]):
                self.last_decode = None
                self.draw_forward("repeat", ids)
            for _ in range(int(rng.integers(1, 4))):
                if self.last_decode is not None:
                    self.forward(*self.last_decode)
        else:
            self.draw_forward(op, ids)

    def draw_forward(self, op: str, ids: list) -> None:
        rng = self.rng
        if op == "tree":
            pool = [s for s in ids if not self.cache.sequence_info(s).window]
        elif op == "repeat":  # a batch the fast path can repeat: no trees, no windows
            pool = [s for s in ids if not self.trees.get(s) and not self.cache.sequence_info(s).window]
            op = "decode"
        else:
            pool = [s for s in ids if not self.trees.get(s)]
        if not pool:
            return
        most = min(len(pool), self.max_batch)
        # a mixed step of many sequences (where pages are many: they grow every sequence)
        wide = op == "prefill" and self.least and self.roomy and rng.random() < 0.4
        size = int(rng.integers(min(self.least, most), most + 1)) if op == "decode" or wide else int(rng.integers(1, 9))
        batch = [int(s) for s in rng.permutation(pool)[: min(size, most)]]
        if op == "decode":
            self.forward(batch, [1] * len(batch), None)
            return
        if wide:  # decodes and a few 2-token rows (the chunk holds 128 tokens)
            lengths = [1 + int(x < 0.1) for x in rng.random(len(batch))]
            lengths[0] = 2
        else:
            lengths = [int(rng.integers(1, 9)) for _ in batch]
        parents = None
        if op == "tree":
            parents = []
            for s, k in zip(batch, lengths):
                old = len(self.trees.get(s, []))
                parents.append([int(rng.integers(-1, old + i)) for i in range(k)])
        self.forward(batch, lengths, parents)

    def forward(self, batch: list, lengths: list, parents) -> None:
        c = self.cache
        before = {s: c.sequence_info(s) for s in c.sequence_ids()}
        free = c.num_available_pages()
        shared_last = {s: bool(i.pages) and c.pool.ref_count(i.pages[-1]) > 1 for s, i in before.items()}
        ptr = None if parents is None else [p for ps in parents for p in ps]
        try:
            c.begin_forward(batch, lengths, ptr)
        except OutOfPagesError:
            assert {s: c.sequence_info(s) for s in c.sequence_ids()} == before, "a refused forward changed nothing"
            assert c.num_available_pages() == free
            c.check_integrity()
            self.out_of_pages += 1
            return
        info = c.debug_forward()
        after = {s: c.sequence_info(s) for s in batch}
        want = _expected(before, after, batch, lengths, self.trees, parents)
        got = dict(info.arrays)
        got["page_indices"] = got["page_indices"][: len(want["page_indices"])]
        for name, expected in want.items():
            np.testing.assert_array_equal(got[name].reshape(expected.shape), expected, err_msg=name)
            assert got[name].shape == expected.shape or name == "page_indices", name
        assert info.kernel == _kernel(lengths, parents is not None, before, batch)
        for s, k in zip(batch, lengths):  # pages: kept, copy-on-write of a shared partial last page, new ones
            old, new = before[s].pages, after[s].pages
            assert len(new) == -(-(before[s].kv_len + k) // P)
            cow = before[s].kv_len % P != 0 and shared_last[s]
            kept = max(len(old) - 1, 0)
            assert new[:kept] == old[:kept] and (not old or (new[kept] != old[-1]) == cow)
            self.cows += cow
        c.check_integrity()
        c.end_forward()
        if parents is not None:
            for s, ps in zip(batch, parents):
                self.trees[s] = self.trees.get(s, []) + ps
        self.forwards += 1
        self.large += len(batch) > FEW and sum(lengths) == len(batch) and not info.repeated
        self.wide_prefills += len(batch) > FEW and sum(lengths) > len(batch) and parents is None
        self.repeats += info.repeated
        self.on_device += info.planned_on_device
        decode = parents is None and sum(lengths) == len(lengths)
        self.prefills_on_device += info.planned_on_device and not decode
        self.last_decode = (batch, lengths, None) if decode else self.last_decode


@pytest.mark.parametrize("device_planning", [True, False])
@pytest.mark.parametrize(
    "seed,num_pages,sequences",
    [(0, 400, 0), (1, 400, 0), (2, 40, 0), (3, 24, 0), (4, 1200, FEW), (7, 1200, FEW), (6, 150, FEW)],
)
def test_random_operations_plan_the_layout(seed, num_pages, sequences, device_planning, target):
    """Many pages (no shortage) and few (OutOfPagesError, forks that cannot copy); small batches and,
    with ``sequences``, decode batches above FEW: the planner's decode paths (on the device from its
    page table; on the host over Python ints or NumPy) and its general path must all write the
    layout's arrays."""
    d = Driver(seed, num_pages, sequences, device_planning, target)
    for _ in range(400):
        d.step()
    d.cache.check_integrity()
    assert d.forwards > 50, d.forwards
    assert d.repeats >= 3, d.repeats  # the repeat-decode fast path ran among the others
    if num_pages > 200:
        assert d.cows > 0, "copy-on-write was exercised"
    else:
        assert d.out_of_pages > 0
    if sequences:  # decode steps above FEW planned anew (few of them once pages run short), and mixed ones
        assert d.large > (20 if num_pages > 200 else 0), d.large
        assert (d.wide_prefills > 3) if num_pages > 200 else not d.wide_prefills, d.wide_prefills
    assert (d.on_device > (5 if num_pages > 200 else 0)) if device_planning else not d.on_device, d.on_device
    assert (d.prefills_on_device > 3) if device_planning else not d.prefills_on_device, d.prefills_on_device


def test_page_pool_shared_set_follows_the_references():
    """``PagePool.shared`` (the pages the decode planner tests last pages against for copy-on-write)
    equals the pages this test holds more than one reference on, after every alloc / hold / release;
    alloc hands pages out in the free list's order (lowest ids first, then the most recently freed),
    for any count, 0 included."""
    from tvmkv.runtime.pages import PagePool

    rng = np.random.default_rng(0)
    pool, refs = PagePool(12), {}
    free = list(range(12))  # this test's free list, next out first
    for _ in range(400):
        held = [p for p, n in refs.items() if n]
        op = rng.integers(3)
        if op == 0:
            n = int(rng.integers(0, pool.num_free + 1))
            version = pool.version
            got = pool.alloc(n)
            assert got == free[:n] and (pool.version == version) == (n == 0)
            del free[:n]
            for p in got:
                refs[p] = 1
        elif op == 1 and held:
            pages = [int(p) for p in rng.choice(held, int(rng.integers(1, 4)))]  # repeats add up
            pool.hold(pages)
            for p in pages:
                refs[p] += 1
        elif held:
            p = int(rng.choice(held))
            pool.release([p])
            refs[p] -= 1
            if not refs[p]:
                free.insert(0, p)
        assert pool.shared == {p for p, n in refs.items() if n > 1}
        assert pool.num_shared == len(pool.shared)
        assert pool.num_free == sum(1 for p in range(12) if not refs.get(p))
    assert not pool.check([[p] * n for p, n in refs.items()])


@pytest.mark.parametrize("size", [3, FEW + 2])
def test_changed_batches_of_one_size_rebind_their_sequences(size):
    """Decode batches of one size but different members, orders and windows, each planned anew: the
    planner keeps the forward bound over that shape and slot and rebinds only its batch; every array
    must still be the layout's, and end_forward must slide the windows of this step's sequences (not
    of the step the forward was first bound for)."""
    d = Driver(7, 1200, size)  # sequences 0 .. size - 1, batches up to size + 8
    c = d.cache
    for s in range(2 * size + 1):
        if s >= size:
            c.add_sequence(s)
        d.forward([s], [int(d.rng.integers(1, 3 * P))], None)
    first, second = list(range(size)), list(range(size, 2 * size))
    for s in (second[0], 2 * size):  # in batches that reuse one slot's forward in turn
        c.enable_sliding_window_for_seq(s, 2 * P, 1)
    for k in range(12):
        batch = [first, second, first[::-1], [2 * size, *second[1:]]][k % 4]
        before = {s: c.sequence_info(s) for s in batch}
        d.forward(batch, [1] * size, None)
        for s in batch:
            info, was = c.sequence_info(s), before[s]
            assert info.length == (min(was.length + 1, was.window) if was.window else was.length + 1), s
    c.check_integrity()


@pytest.mark.parametrize("device_planning", [True, False])
@pytest.mark.parametrize("size,num_pages", [(3, 400), (24, 4000), (24, 70)])
def test_rows_replaced_between_decode_steps(size, num_pages, device_planning, target):
    """A decode batch whose rows change between steps, a few at a time: a new empty sequence, a fork
    of the row's sequence (rolled back into a shared page: copy-on-write), a sequence holding another's
    pages (its partial last page shared) or a windowed one takes a row; meanwhile another, kept row's
    sequence may be popped, swapped out and in, get its last page shared, or run another forward.
    Every step's arrays and pages must be the layout's whether the kept plan is patched
    (repeat_decode.RepeatDecode, without device planning), the step planned on the device from its page table
    (which must follow every one of those changes) or on the host; with few pages some steps are
    refused."""
    d = Driver(11, num_pages, size, device_planning, target)  # sequences 0 .. size - 1
    c, rng = d.cache, d.rng
    for s in range(size):
        d.forward([s], [int(rng.integers(1, 4 * P))], None)
    batch = list(range(size))
    patched, windowed, last = 0, None, []
    for _ in range(200):
        r = int(rng.integers(size)) if windowed is None else batch.index(windowed)
        op = "new" if windowed is not None else rng.choice(["new", "fork", "pages", "window", "none"])
        old, windowed = batch[r], None
        if op == "new":
            c.add_sequence(d.next_id)
        elif op == "fork":
            info = c.sequence_info(old)
            try:
                c.fork_sequence(old, d.next_id, info.length // P * P or info.length)
            except (OutOfPagesError, ValueError):
                continue
            if c.sequence_length(d.next_id) % P == 0 and c.sequence_length(d.next_id):
                c.pop_n(d.next_id, 1)
        elif op == "pages":
            info = c.sequence_info(old)
            c.add_sequence_with_pages(d.next_id, list(info.pages), info.kv_len)
        elif op == "window":  # a new sequence with a window takes the row (the general path plans it)
            c.add_sequence(d.next_id)
            c.enable_sliding_window_for_seq(d.next_id, 3 * P, 1)
            windowed = d.next_id
        if op != "none":
            batch[r] = d.next_id
            d.next_id += 1
            if rng.random() < 0.5:
                c.remove_sequence(old)
        kept = batch[(r + 1 + int(rng.integers(size - 1))) % size] if size > 1 else None
        change = rng.choice(["none", "none", "pop", "swap", "share", "other"])
        if kept is not None and kept != batch[r]:
            info = c.sequence_info(kept)
            if change == "pop" and info.poppable:
                c.pop_n(kept, 1)
            elif change == "swap" and c.num_available_pages() >= len(info.pages):
                c.swap_out([kept])
                c.swap_in([kept])
            elif change == "share" and info.pages:  # its (maybe partial) last page gets a second holder
                c.add_sequence_with_pages(d.next_id, list(info.pages), info.kv_len)
                d.next_id += 1
            elif change == "other":
                d.forward([kept], [2], None)
        if rng.random() < 0.3:  # rows move too (a permutation, perhaps with new rows)
            batch = [int(x) for x in rng.permutation(batch)]
        before = d.repeats
        d.forward(list(batch), [1] * size, None)
        patched += batch != last and d.repeats > before  # a changed batch, patched
        last = list(batch)
    c.check_integrity()
    if num_pages > 100:  # (the seed fixes the stream)
        if device_planning:  # rows replaced in place are patched, moved rows planned on the device
            assert d.on_device > 30 and patched > 10, (d.on_device, patched)
        else:
            assert patched > (4 if size < 8 else 10) and not d.on_device, patched
    else:
        assert d.out_of_pages > 0


def test_device_page_table_grows_and_follows_every_change(target):
    """The device page table (runtime.device_plan) grows past its first size in rows (more than 64
    sequences) and in width (a sequence of more than 64 pages), and follows swap out / in, removal
    and reuse of rows, pop_n into an earlier page, clear() and ids reused after it: every decode step
    it plans must write the layout's arrays, and check_integrity (which reads the table back) must
    find each row equal to its sequence's page list."""
    d = Driver(12, 4000, 70, target=target)  # sequences 0 .. 69, batches up to 78
    c, rng = d.cache, d.rng
    for s in range(70):
        d.forward([s], [int(rng.integers(1, 3 * P))], None)
    d.forward(list(range(70)), [1] * 70, None)  # 70 rows
    for _ in range(3):  # one sequence past 64 pages, in chunks
        d.forward([5], [100], None)
    for step in range(40):
        ids = c.sequence_ids()
        batch = [int(s) for s in rng.permutation(ids)[: int(rng.integers(1, min(len(ids), 78) + 1))]]
        d.forward(batch, [1] * len(batch), None)
        s = int(rng.choice(ids))
        op = step % 4
        if op == 0:
            c.swap_out([s])
            c.swap_in([s])
        elif op == 1 and c.sequence_info(s).poppable > P:
            c.pop_n(s, P + 1)  # back into an earlier page
        elif op == 2:
            c.remove_sequence(s)
            c.add_sequence(d.next_id)  # takes the freed row
            d.forward([d.next_id], [int(rng.integers(1, 2 * P))], None)
            d.next_id += 1
    assert d.on_device > 30, d.on_device
    c.clear()
    for s in range(3):  # ids and rows reused after clear()
        c.add_sequence(s)
        d.forward([s], [P + 1], None)
    d.forward([2, 0, 1], [1] * 3, None)
    d.forward([1, 2], [1] * 2, None)
    c.check_integrity()
