"""Adversarial streams for the step planner (plan.Planner), checked on attention outputs.

A small llvm cache (rope "inline": a wrong position or window gap changes the output) runs against
the NumPy shadow model (tvmkv.reference.cache_model.CacheModel) through the public API: decode batches
of 62..67 sequences (the crossover between the Python-int and whole-batch NumPy decode paths) in
varying orders with repeated steps, sequences with sliding windows / attention sinks mixed with plain
ones, shared partial last pages (add_sequence_with_pages: copy-on-write), forks whose parent is then
removed, pop_n to a page boundary, swap out / in, ids reused after remove, and forwards refused for
lack of pages (OutOfPagesError must leave free pages and every sequence unchanged). After every
forward: outputs equal the model's, lengths agree, check_integrity() passes.
"""

from __future__ import annotations

import numpy as np
import pytest

from tvmkv import PagedAttentionKVCache
from tvmkv.errors import OutOfPagesError
from tvmkv.reference.cache_model import CacheModel

P, HQ, HKV, D = 4, 2, 1, 16


class _Pair:
    """The cache and its model, driven together."""

    def __init__(self, num_pages: int, seed: int, device_planning: bool = True):
        self.c = PagedAttentionKVCache(
            1,
            HQ,
            HKV,
            D,
            page_size=P,
            max_batch_size=80,
            max_total_seq_len=num_pages * P,
            prefill_chunk_size=256,
            dtype="float32",
            target="llvm",
            support_sliding_window=True,
            num_pages=num_pages,
            rope_mode="inline",
            device_planning=device_planning,
        )
        self.m = CacheModel.of(self.c.config)
        self.rng = np.random.default_rng(seed)
        self.ids: set = set()
        self.swapped: set = set()
        self.repeated = self.on_device = 0

    def resident(self) -> list:
        return sorted(self.ids - self.swapped)

    def add(self, sid: int, n: int) -> None:
        self.c.add_sequence(sid)
        self.m.add(sid)
        self.ids.add(sid)
        self.forward([sid], [n])

    def remove(self, sid: int) -> None:
        self.c.remove_sequence(sid)
        self.m.remove(sid)
        self.ids.discard(sid)
        self.swapped.discard(sid)

    def snapshot(self) -> tuple:
        return self.c.num_available_pages(), {s: self.c.sequence_info(s) for s in self.ids}

    def forward(self, batch: list, lens: list) -> bool:
        """One forward on both; False (nothing changed: checked) when the cache is out of pages."""
        c, m = self.c, self.m
        before = self.snapshot()
        try:
            c.begin_forward(batch, lens)
        except OutOfPagesError:
            assert self.snapshot() == before, "a refused forward changed the cache"
            c.check_integrity()
            return False
        info = c.debug_forward()
        self.repeated += bool(info.repeated)
        self.on_device += bool(info.planned_on_device)
        m.begin(batch, lens)
        qkv = self.rng.standard_normal((sum(lens), HQ + 2 * HKV, D)).astype(np.float32)
        out = np.asarray(c.attention_with_fused_qkv(0, qkv))
        want, _ = m.attention(0, qkv)
        c.end_forward()
        m.end()
        np.testing.assert_allclose(out, want, atol=2e-4, rtol=1e-3, err_msg=f"batch {batch} lengths {lens}")
        for s in batch:
            assert c.sequence_length(s) == m.length(s)
        c.check_integrity()
        return True

    def decode(self, batch: list, repeats: int = 1) -> None:
        for _ in range(repeats):
            self.forward(batch, [1] * len(batch))


def _populate(pair: _Pair, count: int) -> None:
    for sid in range(count):
        pair.add(sid, int(pair.rng.integers(1, 10)))


def test_crossover_batches_with_windows_cow_forks_and_swaps():
    """Batches of 62..67 sequences around the decode paths' crossover while the batch's make-up
    changes under them: windows, shared partial pages, forks of removed parents, pop_n, swaps."""
    pair = _Pair(num_pages=700, seed=11)
    rng, c, m = pair.rng, pair.c, pair.m
    _populate(pair, 72)
    for sid in range(0, 72, 5):  # windows with and without sinks, on some of the batch
        w, sink = int(rng.integers(5, 12)), int(rng.integers(0, 4))
        c.enable_sliding_window_for_seq(sid, w, sink)
        m.enable_window(sid, w, sink)
    next_id = 100
    for step in range(60):
        res = pair.resident()
        k = min(len(res), int(rng.choice([62, 63, 64, 65, 66, 67])))
        batch = [int(s) for s in rng.choice(res, k, replace=False)]
        pair.decode(batch, int(rng.integers(1, 4)))  # repeats: the in-place path
        kind = step % 6
        res = pair.resident()
        sid = int(rng.choice(res))
        info = c.sequence_info(sid)
        if kind == 0 and not info.slid and not info.window and info.length:
            # a new sequence over a prefix of sid's pages: a shared, usually partial, last page
            n = int(rng.integers(1, info.length + 1))
            c.add_sequence_with_pages(next_id, list(info.pages[: -(-n // P)]), n)
            m.fork(sid, next_id, n)
            pair.ids.add(next_id)
            next_id += 1
        elif kind == 1 and not info.slid:
            pos = int(rng.choice([(info.length // P) * P, info.length]))
            c.fork_sequence(sid, next_id, pos)
            m.fork(sid, next_id, pos)
            pair.ids.add(next_id)
            next_id += 1
            pair.remove(sid)  # the child keeps the shared pages
        elif kind == 2 and info.poppable:
            n = min(info.poppable, info.length % P or P)  # back to a page boundary
            c.pop_n(sid, n)
            m.pop(sid, n)
        elif kind == 3:
            c.swap_out([sid])
            pair.swapped.add(sid)
        elif kind == 4 and pair.swapped:
            back = sorted(pair.swapped)[0]
            if c.num_pages_needed(back, 0) <= c.num_available_pages():
                c.swap_in([back])
                pair.swapped.discard(back)
        elif kind == 5:
            pair.remove(sid)
            pair.add(sid, int(rng.integers(1, 6)))  # the id again, as a new sequence
            if rng.random() < 0.5:
                c.enable_sliding_window_for_seq(sid, 6, 2)
                m.enable_window(sid, 6, 2)
        for s in pair.resident():  # keep pages in check: long sequences start over (the id reused)
            if c.sequence_length(s) > 28:
                pair.remove(s)
                pair.add(s, int(rng.integers(1, 6)))


@pytest.mark.parametrize("device_planning", [True, False])
def test_shape_churn_then_repeat_decodes(device_planning):
    """Many distinct forward shapes (batch sizes x token counts, past the planner's 256 kept shapes)
    interleaved with repeated decodes of one batch and decodes of every size 1..70 (planned on the
    device, from its page table, or on the host)."""
    pair = _Pair(num_pages=900, seed=5, device_planning=device_planning)
    rng, c = pair.rng, pair.c
    _populate(pair, 70)
    fixed = [int(s) for s in rng.permutation(70)[:40]]
    for step in range(300):
        res = pair.resident()
        if step % 3 == 0:
            k = int(rng.integers(1, 9))
            batch = [int(s) for s in rng.choice(res, k, replace=False)]
            pair.forward(batch, [int(rng.integers(1, 20)) for _ in batch])  # prefill: a new shape
        elif step % 3 == 1:
            pair.decode(fixed, 3)
        else:
            k = 1 + step % 70
            pair.decode([int(s) for s in rng.choice(res, k, replace=False)])
        for s in res:
            if c.sequence_length(s) > 30:
                n = c.sequence_length(s) - int(rng.integers(1, 8))
                c.pop_n(s, n)
                pair.m.pop(s, n)
    assert pair.repeated > 0
    assert pair.on_device > 50 if device_planning else not pair.on_device, pair.on_device


@pytest.mark.parametrize("batch_size", [3, 66])
def test_refused_decode_changes_nothing(batch_size):
    """A decode that needs more pages than are free (new pages and copy-on-write copies) raises
    OutOfPagesError having changed nothing; the same decode succeeds once pages are freed."""
    pair = _Pair(num_pages=batch_size * 2 + 2, seed=batch_size)
    c, m = pair.c, pair.m
    for sid in range(batch_size):
        pair.add(sid, P)  # one full page each: the next token opens a page
    spare = c.num_available_pages()
    c.add_sequence(500)
    m.add(500)
    pair.ids.add(500)
    left = spare * P - 1  # fill the pool, leaving 500's last page partial
    while left:
        n = min(left, 200)
        pair.forward([500], [n])
        left -= n
    assert c.num_available_pages() == 0
    c.add_sequence_with_pages(501, c.sequence_info(500).pages, c.sequence_length(500))
    m.fork(500, 501, c.sequence_length(500))
    pair.ids.add(501)
    batch = [*range(batch_size), 500, 501] if batch_size + 2 <= 80 else list(range(batch_size))
    assert not pair.forward(batch, [1] * len(batch))
    pair.remove(500)  # 501 keeps the pages alone: no copy needed any more
    while not pair.forward(batch[:-2] + [501], [1] * (len(batch) - 1)):
        pair.remove(batch.pop(0))
    pair.decode(batch[:-2] + [501], 3)


@pytest.mark.parametrize("batch_size", [5, 66])
def test_empty_and_shared_sequences_swapped_together(batch_size):
    """Empty sequences (new, or popped to 0) decode beside ones whose partial last page is shared;
    the sharing pair is swapped out together and back in (sharing restored), then decoded: each gets
    a copy of the shared page, and the sequence that shared it keeps its tokens."""
    pair = _Pair(num_pages=400, seed=batch_size + 1)
    c, m, rng = pair.c, pair.m, pair.rng
    _populate(pair, batch_size)
    c.add_sequence(200)  # empty
    m.add(200)
    pair.ids.add(200)
    n = c.sequence_length(1)
    c.pop_n(1, n)  # popped to 0: no pages
    m.pop(1, n)
    pair.forward([0], [6 - c.sequence_length(0) % 4])  # 0's last page partial (2 slots)
    for sid in (300, 301):  # two more holders of 0's pages, partial last page included
        c.add_sequence_with_pages(sid, c.sequence_info(0).pages, c.sequence_length(0))
        m.fork(0, sid, c.sequence_length(0))
        pair.ids.add(sid)
    c.swap_out([300, 301])
    c.swap_in([301, 300])
    order = [int(s) for s in rng.permutation(sorted(pair.ids))]
    pair.decode(order, 3)
    pair.decode(order[::-1], 2)


def test_one_token_tree_forward_shares_the_decode_shape():
    """A token-tree forward of one sequence and one token has the planner shape of a one-sequence
    decode, (1, 1, 1): alternating them (tree arrays written, then the decode's template) must give
    each its own arrays."""
    pair = _Pair(num_pages=64, seed=3)
    c, m, rng = pair.c, pair.m, pair.rng
    _populate(pair, 2)
    for step in range(12):
        qkv = rng.standard_normal((1, HQ + 2 * HKV, D)).astype(np.float32)
        c.begin_forward([0], [1], token_tree_parent_ptr=[-1])
        m.begin([0], [1], parents=[[-1]])
        out = np.asarray(c.attention_with_fused_qkv(0, qkv))
        want, _ = m.attention(0, qkv)
        c.end_forward()
        m.end()
        np.testing.assert_allclose(out, want, atol=2e-4, rtol=1e-3, err_msg=f"tree step {step}")
        if step % 2:  # two root nodes now: drop both, or keep the first
            leaf = 0 if step % 4 == 3 else -1
            c.commit_accepted_token_tree_nodes([0], [leaf])
            m.commit([0], [leaf])
        pair.decode([1], 1 + step % 3)
        c.check_integrity()


@pytest.mark.parametrize(
    "seq_ids, lengths",
    [([0.0, 1.0], [1, 1]), ([0, 1], [1.0, 1.0]), ([0, 1], [True, True]), ([0, 1], np.ones(2))],
)
def test_repeated_decode_validates_like_a_new_one(seq_ids, lengths):
    """Floats or bools equal to the last decode step's ids / lengths are refused (TypeError) as they
    are after any other step, not taken by the repeated-decode path; NumPy ints are accepted by both."""
    pair = _Pair(num_pages=32, seed=0)
    c = pair.c
    _populate(pair, 2)
    for previous in ([1, 0], [0, 1]):  # another batch, then the same batch as the refused step
        pair.decode(previous)
        before = pair.snapshot()
        with pytest.raises(TypeError, match="must be an int"):
            c.begin_forward(seq_ids, lengths)
        assert pair.snapshot() == before and not c.forward_open
    pair.decode([0, 1], 2)
    c.begin_forward(np.array([0, 1]), np.ones(2, np.int64))  # NumPy ints: the repeated step
    assert c.debug_forward().repeated


@pytest.mark.parametrize("size", [4, 24])
@pytest.mark.parametrize("device_planning", [True, False])
def test_rows_replaced_in_a_kept_decode_batch(size, device_planning):
    """A decode batch whose rows are replaced one or two at a time (a fork of the row's sequence rolled
    back into its shared page, a new sequence over a prefix of another's pages, a fresh short one; the
    old one removed or kept, the same id reused), with kept rows popped or swapped now and then: the
    kept plan is patched (repeat_decode.RepeatDecode) or the step planned anew, and outputs must equal the
    model's every step (rope inline: a wrong position changes them). With device planning the
    steps whose rows moved are planned on the device instead."""
    pair = _Pair(num_pages=900, seed=5, device_planning=device_planning)
    rng, c, m = pair.rng, pair.c, pair.m
    _populate(pair, size)
    batch, next_id, patched = list(range(size)), 1000, 0
    for step in range(80):
        for r in rng.choice(size, int(rng.integers(1, 3)), replace=False).tolist():
            old, info = batch[r], c.sequence_info(batch[r])
            kind = int(rng.integers(3))
            if kind == 0 and info.length:  # fork at the last page boundary, rolled back into it
                pos = info.length // P * P or info.length
                c.fork_sequence(old, next_id, pos)
                m.fork(old, next_id, pos)
                pair.ids.add(next_id)
                if pos % P == 0:
                    c.pop_n(next_id, 1)
                    m.pop(next_id, 1)
            elif kind == 1 and info.length:  # over a prefix of old's pages: a shared partial last page
                n = int(rng.integers(1, info.length + 1))
                c.add_sequence_with_pages(next_id, list(info.pages[: -(-n // P)]), n)
                m.fork(old, next_id, n)
                pair.ids.add(next_id)
            else:
                pair.add(next_id, int(rng.integers(1, 6)))
            batch[r], next_id = next_id, next_id + 1
            if rng.random() < 0.5:
                pair.remove(old)
        if step % 7 == 3:  # a kept row changes too: the general path
            s = batch[int(rng.integers(size))]
            if c.sequence_info(s).poppable:
                c.pop_n(s, 1)
                m.pop(s, 1)
        if step % 3 == 1:  # rows move too (a permutation, perhaps with new rows)
            batch = [int(x) for x in rng.permutation(batch)]
        before = pair.repeated
        pair.decode(batch, int(rng.integers(1, 3)))
        patched += pair.repeated > before
        for s in list(batch):  # long sequences start over under a new id
            if c.sequence_length(s) > 40:
                r = batch.index(s)
                pair.remove(s)
                pair.add(next_id, 3)
                batch[r], next_id = next_id, next_id + 1
    assert patched > (5 if device_planning else 20), patched
    assert pair.on_device > 10 if device_planning else not pair.on_device, pair.on_device


@pytest.mark.parametrize("device_planning", [True, False])
def test_kept_row_sharing_a_copied_page_is_copied_too(device_planning):
    """A kept row's partial last page shared both with a row new to the batch (which gets its copy)
    and with a sequence outside the batch that owns a slot past the kept row's length (hostile round
    11): the kept row must not write its token into that page in place. Before the fix the patched
    plan (repeat_decode.RepeatDecode) copied the page for the new row only, and the kept row's token
    overwrote the outsider's K/V at that slot."""
    pair = _Pair(num_pages=200, seed=3, device_planning=device_planning)
    c, m = pair.c, pair.m
    for sid, n in enumerate([12, 6, 7, 9]):
        pair.add(sid, n)
    c.pop_n(0, 3)  # 9 tokens: slots 9..11 of its last page keep the rolled-back tokens
    m.pop(0, 3)
    batch = [0, 1, 2, 3]
    pair.decode(batch, 2)  # 11 tokens; the second step's plan is kept
    pages = list(c.sequence_info(0).pages)
    c.add_sequence_with_pages(30, pages, 12)  # owns slot 11 of 0's last page (outside the batch)
    k30, v30 = (np.array(x) for x in c.debug_get_kv(30))
    c.add_sequence_with_pages(31, pages, 11)  # the same prefix as 0, into row 3
    m.fork(0, 31, 11)
    pair.ids.add(31)
    pair.forward([0, 1, 2, 31], [1] * 4)  # outputs against the model
    k_after, v_after = c.debug_get_kv(30)
    np.testing.assert_array_equal(np.asarray(k_after), k30)
    np.testing.assert_array_equal(np.asarray(v_after), v30)
    assert len(set(c.sequence_info(s).pages[-1] for s in (0, 30, 31))) == 3  # three last pages now
    c.check_integrity()
