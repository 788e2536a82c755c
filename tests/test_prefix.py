"""RadixPrefixCache: prefix reuse against a no-sharing run of the NumPy CacheModel, page counts,
partial-page copies, LRU eviction under pressure, fork / pop_n interplay and misuse."""

from __future__ import annotations

import numpy as np
import pytest

import tvmkv
from tvmkv import testing
from tvmkv.reference.cache_model import CacheModel
from tvmkv.runtime.radix import RadixPrefixCache

ATOL = RTOL = 1e-4  # fp32 cache vs the fp64 model


def make_cache(target, *, page_size, num_pages, small=False):
    """Two configurations whose kernels the other tests build too: P=16 GQA 4 (``small=False``) and
    a tiny P=4 one with sliding-window kernels (``small=True``). RoPE "normal" (K stored rotated)."""
    shape = dict(num_qo_heads=2, num_kv_heads=1, head_dim=16, sliding=True) if small else dict(num_qo_heads=8)
    return testing.make_cache(
        target,
        **shape,
        page_size=page_size,
        num_pages=num_pages,
        max_total_seq_len=min(256, num_pages * page_size),
        prefill_chunk_size=1024,
        rope_mode="normal",
    )


class Driver:
    """Runs requests through a cache with a prefix cache and, side by side, through a CacheModel that
    shares nothing (each request prefills its whole prompt there). Token ``t`` at position ``p`` of
    layer ``l`` always gets the same fused qkv row, as a model's would when the prefix is the same."""

    def __init__(self, cache, *, vocab=2000, seed=0):
        cfg = cache.config
        self.cache, self.prefix = cache, RadixPrefixCache(cache)
        self.model = CacheModel.of(cfg)
        rng = np.random.default_rng(seed)
        shape = (cfg.num_layers, vocab, cfg.qkv_heads, cfg.head_dim)
        self.emb = rng.uniform(-1, 1, shape).astype(np.float32)
        self.pos = rng.uniform(-0.5, 0.5, (cfg.num_layers, 1024, cfg.qkv_heads, cfg.head_dim)).astype(np.float32)
        self.tokens: dict = {}
        self.max_err = 0.0

    def rows(self, layer, tokens, start):
        """Fused qkv ``[len(tokens), H_qo + 2 H_kv, D]`` of ``tokens`` at positions ``start, ...``."""
        return self.emb[layer, tokens] + self.pos[layer, start : start + len(tokens)]

    def request(self, sid, prompt, **kw) -> int:
        """Add ``sid`` from the prefix cache; the model prefills what the cache reused."""
        reused = self.prefix.add_sequence_with_prefix(sid, prompt, **kw)
        self.model.add(sid)
        self.tokens[sid] = list(prompt[:reused])
        if reused:
            self.model.begin([sid], [reused])
            for layer in range(self.cache.config.num_layers):
                self.model.attention(layer, self.rows(layer, prompt[:reused], 0))
            self.model.end()
        return reused

    def forward(self, new: dict) -> None:
        """Append ``new[sid]`` (token lists) to each sequence in one forward; compare every output."""
        ids = list(new)
        self.cache.begin_forward(ids, [len(new[s]) for s in ids])
        self.model.begin(ids, [len(new[s]) for s in ids])
        for layer in range(self.cache.config.num_layers):
            qkv = np.concatenate([self.rows(layer, new[s], len(self.tokens[s])) for s in ids])
            o = self.cache.attention_with_fused_qkv(layer, qkv)
            ref, _ = self.model.attention(layer, qkv)
            self.max_err = max(self.max_err, float(np.abs(o - ref).max()))
            np.testing.assert_allclose(o, ref, atol=ATOL, rtol=RTOL, err_msg=f"layer {layer}, seqs {ids}")
        self.cache.end_forward()
        self.model.end()
        for s in ids:
            self.tokens[s] += list(new[s])

    def finish(self, sid) -> int:
        added = self.prefix.finish_sequence(sid, self.tokens.pop(sid))
        self.model.remove(sid)
        return added

    def fork(self, parent, child, pos):
        self.cache.fork_sequence(parent, child, pos)
        self.model.fork(parent, child, pos)
        self.tokens[child] = self.tokens[parent][:pos]

    def pop(self, sid, n):
        self.cache.pop_n(sid, n)
        self.model.pop(sid, n)
        del self.tokens[sid][len(self.tokens[sid]) - n :]

    def check_kv(self, sid) -> None:
        """Stored K/V of ``sid`` equal the model's (which never shared a page)."""
        _, k_ref, v_ref = self.model.kept_kv(sid)
        k, v = self.cache.debug_get_kv(sid)
        np.testing.assert_allclose(k, k_ref, atol=1e-5, rtol=1e-5, err_msg=f"K of sequence {sid}")
        np.testing.assert_allclose(v, v_ref, atol=1e-5, rtol=1e-5, err_msg=f"V of sequence {sid}")

    def used_pages(self) -> int:
        cfg = self.cache.config
        return cfg.total_pages - self.cache.num_available_pages()


def pages_of(cache, sid) -> list:
    return cache.sequence_pages(sid)


# ------------------------------------------------------------------------------------------- sharing
def test_shared_system_prompt_16_requests(target):
    P, S = 16, 100  # the system prompt: 6 full pages + 4 tokens
    cache = make_cache(target, page_size=P, num_pages=256)
    d = Driver(cache)
    rng = np.random.default_rng(1)
    system = rng.integers(0, 1000, S).tolist()
    prompts = [system + [1000 + k] + rng.integers(0, 1000, 4 + 3 * k).tolist() for k in range(16)]

    assert d.request(0, prompts[0]) == 0  # empty tree: nothing to reuse
    d.forward({0: prompts[0]})
    assert d.prefix.insert(0, prompts[0]) == len(prompts[0])  # cache it while it keeps running
    d.prefix.check_integrity()
    for k in range(1, 16):
        assert d.prefix.match_prefix(prompts[k]) == S
        assert d.request(k, prompts[k]) == S
        d.prefix.check_integrity()
    for batch in (range(1, 6), range(6, 11), range(11, 16)):
        d.forward({k: prompts[k][S:] for k in batch})
        d.prefix.check_integrity()

    # the 6 full pages of the system prompt exist once, in every page table
    shared = pages_of(cache, 0)[: S // P]
    for k in range(16):
        assert pages_of(cache, k)[: S // P] == shared
    assert (cache.pool.ref_counts()[shared] == 16 + 1).all()  # 16 page tables + the tree
    # page 6 holds system tokens 96..99: each request got its own copy (copy-on-write), none lost
    assert len({pages_of(cache, k)[S // P] for k in range(16)}) == 16
    own = sum(-(-len(p) // P) - S // P for p in prompts)
    assert d.used_pages() == S // P + own
    no_sharing = sum(-(-len(p) // P) for p in prompts)
    assert no_sharing - d.used_pages() == 15 * (S // P)
    for k in (1, 15):
        d.check_kv(k)

    d.forward({k: [int(rng.integers(0, 1000))] for k in range(16)})  # one decode step of all 16
    d.prefix.check_integrity()
    for k in range(16):
        d.finish(k)
        d.prefix.check_integrity()
    assert not cache.sequence_ids()
    assert d.prefix.num_cached_pages() == d.used_pages()
    s = d.prefix.stats
    assert (s.requests, s.reused_tokens, s.partial_page_reuses) == (16, 15 * S, 15)
    assert all(d.prefix.match_prefix(p) == len(p) for p in prompts)


def test_partial_page_is_copied(target):
    P = 16
    cache = make_cache(target, page_size=P, num_pages=64)
    d = Driver(cache, seed=2)
    rng = np.random.default_rng(2)
    a = rng.integers(0, 1000, 40).tolist()  # pages: 16 + 16 + 8
    d.request(0, a)
    d.forward({0: a})
    tree_pages = pages_of(cache, 0)
    k_a, v_a = cache.debug_get_kv(0)
    d.finish(0)
    assert d.prefix.num_cached_pages() == 3 and d.used_pages() == 3

    b = a[:37] + rng.integers(1000, 2000, 13).tolist()
    assert d.prefix.match_prefix(b) == 37  # token-granular: a page-aligned cache would reuse 32
    assert d.request(1, b) == 37
    assert pages_of(cache, 1) == tree_pages  # shared until the first write into page 2
    d.forward({1: b[37:]})
    d.prefix.check_integrity()
    got = pages_of(cache, 1)
    assert got[:2] == tree_pages[:2] and got[2] not in tree_pages
    k_b, v_b = cache.debug_get_kv(1, 0, 37)
    np.testing.assert_array_equal(k_b, k_a[:, :37])  # the 5 slots of page 2 were copied bit-exact
    np.testing.assert_array_equal(v_b, v_a[:, :37])
    d.check_kv(1)
    d.finish(1)
    d.prefix.check_integrity()
    assert d.prefix.match_prefix(a) == 40 and d.prefix.match_prefix(b) == 50

    # a prompt that extends a cached leaf ending inside a page: the leaf's partial page is replaced
    c = a + rng.integers(0, 1000, 30).tolist()
    assert d.request(2, c) == 40
    d.forward({2: c[40:]})
    cached = d.prefix.num_cached_pages()
    assert d.prefix.insert(2, c) == 30
    assert d.prefix.num_cached_pages() == cached + 3 - 1  # pages 2..4 of c in, a's partial page 2 out
    d.prefix.check_integrity()
    d.check_kv(2)
    assert d.prefix.match_prefix(c) == 70 and d.prefix.match_prefix(a) == 40


# ------------------------------------------------------------------------------------------ eviction
def test_eviction_under_pressure(target):
    P = 4
    cache = make_cache(target, page_size=P, num_pages=24, small=True)
    d = Driver(cache, seed=3)
    rng = np.random.default_rng(3)
    families = [rng.integers(0, 1000, 18).tolist() for _ in range(4)]
    live = []
    for step in range(40):
        sid = 100 + step
        fam = families[int(rng.integers(0, 4))]
        prompt = fam[: int(rng.integers(6, 19))] + rng.integers(0, 1000, int(rng.integers(1, 6))).tolist()
        reused = d.request(sid, prompt)
        d.prefix.check_integrity()
        d.forward({sid: prompt[reused:]})
        d.prefix.check_integrity()
        live.append(sid)
        if len(live) == 2 or step % 5 == 0:
            d.forward({s: [int(rng.integers(0, 1000))] for s in live})
            d.prefix.check_integrity()
            for s in live:
                d.check_kv(s)
                d.finish(s)
                d.prefix.check_integrity()
            live = []
        assert cache.num_available_pages() + d.prefix.num_cached_pages() <= cache.config.total_pages
    s = d.prefix.stats
    assert s.evicted_pages > 0 and s.evicted_nodes > 0  # the pool (24 pages) ran out many times
    assert s.reused_tokens > 0


def test_lru_order_and_out_of_pages(target):
    P = 4
    cache = make_cache(target, page_size=P, num_pages=16, small=True)
    d = Driver(cache, seed=4)
    x, y, z = ([base + i for i in range(8)] for base in (100, 200, 300))  # 2 pages each
    for sid, p in enumerate((x, y, z)):
        d.request(sid, p)
        d.forward({sid: p})
        d.finish(sid)
    assert d.prefix.num_cached_pages() == 6 and cache.num_available_pages() == 10
    d.request(3, x + [1])  # touches x: y is now the least recently used
    d.forward({3: [1]})
    d.finish(3)
    assert d.prefix.num_evictable_pages() == 7  # x (2) + its leaf (1) + y (2) + z (2)

    d.request(4, [7] * 40)  # needs 10 pages, 9 are free: one leaf of the tree goes, the LRU one: y
    d.forward({4: [7] * 40})
    d.prefix.check_integrity()
    assert d.prefix.match_prefix(y) == 0
    assert d.prefix.match_prefix(x + [1]) == 9 and d.prefix.match_prefix(z) == 8
    assert d.prefix.stats.evicted_pages == 2

    # pages a sequence holds are never evicted: with z in use, the shortfall can't be covered
    prompt = z + list(range(2, 12))
    d.request(5, prompt, max_reuse=8)
    held, free, evictable = d.prefix.num_cached_pages(), cache.num_available_pages(), d.prefix.num_evictable_pages()
    assert (held, free, evictable) == (5, 1, 3)  # z's 2 pages are held by sequence 5
    with pytest.raises(tvmkv.OutOfPagesError) as info:
        cache.begin_forward([5, 4], [10, 16])  # 3 + 4 pages > 1 free + 3 evictable
    assert (info.value.needed, info.value.available) == (7, 1)
    assert (d.prefix.num_cached_pages(), cache.num_available_pages()) == (held, free)  # nothing evicted
    d.prefix.check_integrity()
    d.forward({5: prompt[8:]})  # 3 pages: fits after evicting x's subtree (3 pages); z stays
    d.prefix.check_integrity()
    assert d.prefix.match_prefix(x + [1]) == 0 and d.prefix.match_prefix(z) == 8
    assert d.prefix.stats.evicted_pages == 5
    d.check_kv(5)


# ---------------------------------------------------------------------------------- fork and pop_n
def test_fork_and_pop_n(target):
    P = 4
    cache = make_cache(target, page_size=P, num_pages=40, small=True)
    d = Driver(cache, seed=5)
    rng = np.random.default_rng(5)
    base = rng.integers(0, 1000, 14).tolist()
    d.request(0, base)
    d.forward({0: base})
    d.finish(0)
    tree_pages = d.prefix.num_cached_pages()

    assert d.request(1, base + [5, 6]) == 14
    d.fork(1, 2, 14)  # shares the tree's pages (3 full) + a copy of the partial page 3
    d.fork(1, 3, 9)
    d.prefix.check_integrity()
    assert d.prefix.num_evictable_pages() == 0  # every tree page is held by a sequence
    d.pop(2, 7)  # into the shared full pages: page 1 becomes partial for sequence 2
    d.prefix.check_integrity()
    d.forward({1: [5, 6], 2: [8, 9, 10], 3: [11]})  # copy-on-write of the shared partial pages
    d.prefix.check_integrity()
    for sid in (1, 2, 3):
        d.check_kv(sid)
    assert d.prefix.match_prefix(base) == 14  # the tree's K/V were not written
    d.request(4, base + [1])
    d.forward({4: [1]})
    d.check_kv(4)
    added = [d.finish(sid) for sid in (1, 2, 3, 4)]
    assert added == [2, 3, 1, 1]
    d.prefix.check_integrity()
    assert d.prefix.num_cached_pages() > tree_pages
    assert d.prefix.num_evictable_pages() == d.prefix.num_cached_pages()


# --------------------------------------------------------------------------------------------- misuse
def tree_state(d):
    nodes = sorted(d.prefix.edges())
    kept_from = {1: 6}  # sequence 1's window (8, sink 2) dropped positions [2, 6) of its 12
    seqs = {
        s: (d.cache.sequence_length(s), *d.cache.debug_get_kv(s, kept_from.get(s, 0))) for s in d.cache.sequence_ids()
    }
    return nodes, d.cache.num_available_pages(), cache_refs(d.cache), seqs


def cache_refs(cache):
    return cache.pool.ref_counts().tolist()


@pytest.fixture
def prepared(target):
    """A tree holding two prompts; sequence 0 (a prompt of the tree, 13 tokens), sequence 1 with a
    sliding window, sequence 2 with an uncommitted token tree."""
    cache = make_cache(target, page_size=4, num_pages=40, small=True)
    d = Driver(cache, seed=6)
    a, b = list(range(10, 23)), list(range(10, 16)) + list(range(50, 60))
    for sid, p in ((10, a), (11, b)):
        d.request(sid, p)
        d.forward({sid: p})
        d.finish(sid)
    d.request(0, a, max_reuse=13)
    cache.add_sequence(1)
    cache.enable_sliding_window_for_seq(1, 8, 2)
    d.tokens[1] = []
    d.model.add(1)
    d.model.enable_window(1, 8, 2)
    d.forward({1: list(range(12))})
    cache.add_sequence(2)
    d.tokens[2] = []
    cache.begin_forward([2], [3], [-1, 0, 0])
    for layer in range(2):
        cache.attention_with_fused_qkv(layer, d.rows(layer, [1, 2, 3], 0))
    cache.end_forward()
    d.prefix.check_integrity()
    return d


PREFIX_MISUSES = {
    "add existing id": (KeyError, lambda d: d.prefix.add_sequence_with_prefix(0, [1, 2])),
    "add bool id": (TypeError, lambda d: d.prefix.add_sequence_with_prefix(True, [1, 2])),
    "add 2-D tokens": (ValueError, lambda d: d.prefix.add_sequence_with_prefix(5, [[10, 11]])),
    "add float tokens": (TypeError, lambda d: d.prefix.add_sequence_with_prefix(5, [10.0, 11.0])),
    "add string tokens": (TypeError, lambda d: d.prefix.add_sequence_with_prefix(5, "abc")),
    "max_reuse too big": (ValueError, lambda d: d.prefix.add_sequence_with_prefix(5, [10, 11], max_reuse=3)),
    "max_reuse negative": (ValueError, lambda d: d.prefix.add_sequence_with_prefix(5, [10], max_reuse=-1)),
    "insert unknown": (KeyError, lambda d: d.prefix.insert(9, [1])),
    "insert too long": (ValueError, lambda d: d.prefix.insert(0, list(range(10, 24)))),
    "insert sliding window": (ValueError, lambda d: d.prefix.insert(1, list(range(12)))),
    "insert token tree": (ValueError, lambda d: d.prefix.insert(2, [1])),
    "insert wrong tokens": (ValueError, lambda d: d.prefix.insert(0, [10, 11, 12, 13, 99, 98, 97, 96, 95])),
    "finish unknown": (KeyError, lambda d: d.prefix.finish_sequence(9, [1])),
    "finish sliding window": (ValueError, lambda d: d.prefix.finish_sequence(1, [1])),
    "second prefix cache": (ValueError, lambda d: RadixPrefixCache(d.cache)),
    "pages not held": (ValueError, lambda d: d.cache.add_sequence_with_pages(5, [39], 3)),
    "pages too few": (ValueError, lambda d: d.cache.add_sequence_with_pages(5, [], 3)),
}


@pytest.mark.parametrize("name", list(PREFIX_MISUSES))
def test_misuse_leaves_state(prepared, name):
    exc, call = PREFIX_MISUSES[name]
    before = tree_state(prepared)
    with pytest.raises(exc) as info:
        call(prepared)
    assert str(info.value)
    after = tree_state(prepared)
    assert after[:3] == before[:3]
    assert after[3].keys() == before[3].keys()
    for sid, (length, k, v) in before[3].items():
        assert after[3][sid][0] == length
        np.testing.assert_array_equal(after[3][sid][1], k)
        np.testing.assert_array_equal(after[3][sid][2], v)
    prepared.prefix.check_integrity()


def test_misuse_during_forward(prepared):
    d = prepared
    d.cache.begin_forward([0], [1])
    before = sorted(d.prefix.edges())
    for call in (
        lambda: d.prefix.add_sequence_with_prefix(5, list(range(10, 20))),
        lambda: d.prefix.insert(0, list(range(10, 23))),
        lambda: d.prefix.finish_sequence(0, list(range(10, 23))),
        lambda: d.prefix.reset(),
    ):
        with pytest.raises(tvmkv.ForwardStateError):
            call()
        assert sorted(d.prefix.edges()) == before
    assert 5 not in d.cache.sequence_ids()
    for layer in range(2):
        d.cache.attention_with_fused_qkv(layer, d.rows(layer, [23], 13))
    d.cache.end_forward()
    d.prefix.check_integrity()


def test_reset_and_clear(prepared):
    d = prepared
    cache = d.cache
    held = d.prefix.num_cached_pages()
    assert held > 0
    free = cache.num_available_pages()
    in_use = d.prefix.num_cached_pages() - d.prefix.num_evictable_pages()
    d.prefix.reset()
    d.prefix.check_integrity()
    assert d.prefix.num_cached_pages() == 0 and d.prefix.match_prefix(list(range(10, 23))) == 0
    assert cache.num_available_pages() == free + held - in_use  # pages sequence 0 shares stay
    d.check_kv(0)
    cache.clear()
    d.prefix.check_integrity()
    assert cache.num_available_pages() == cache.config.total_pages


def test_insert_while_decoding(target):
    """A running sequence cached mid-decode keeps decoding: its shared partial page is copied on its
    next write (also when the decode steps before took the cache's steady-batch fast path)."""
    cache = make_cache(target, page_size=4, num_pages=40, small=True)
    d = Driver(cache, seed=7)
    prompt = list(range(30, 40))
    d.request(0, prompt)
    d.forward({0: prompt})
    for t in (41, 42, 43):  # decode steps of an unchanged batch
        d.forward({0: [t]})
    tokens = list(d.tokens[0])  # 13 tokens: the last page holds 1
    assert d.prefix.insert(0, tokens) == 13
    k_tree, v_tree = cache.debug_get_kv(0)
    for t in (44, 45, 46, 47, 48):
        d.forward({0: [t]})
        d.prefix.check_integrity()
    d.check_kv(0)
    assert d.request(1, tokens + [99]) == 13
    k, v = cache.debug_get_kv(1)
    np.testing.assert_array_equal(k, k_tree)  # the tree's pages were not written by sequence 0
    np.testing.assert_array_equal(v, v_tree)
    assert d.prefix.finish_sequence(0, d.tokens.pop(0)) == 5
    d.prefix.check_integrity()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_operations(target, seed):
    """Random requests (prefixes of 3 prompt families, small vocabulary: many partial matches),
    forwards, pop_n, forks, inserts, finishes and removals on a 20-page pool. Integrity after every
    operation, stored K/V against the model after every step; an OutOfPagesError only when the free
    plus evictable pages cannot cover the need, and it leaves the tree as it was."""
    rng = np.random.default_rng(seed)
    cache = make_cache(target, page_size=4, num_pages=20, small=True)
    d = Driver(cache, seed=seed)
    families = [rng.integers(0, 50, 20).tolist() for _ in range(3)]
    next_id, ooms = 0, 0

    def guarded(call, *args) -> None:
        nonlocal ooms
        cached, evictable, free = (
            d.prefix.num_cached_pages(),
            d.prefix.num_evictable_pages(),
            cache.num_available_pages(),
        )
        try:
            call(*args)
        except tvmkv.OutOfPagesError as err:
            assert err.needed > free + evictable
            assert (d.prefix.num_cached_pages(), cache.num_available_pages()) == (cached, free)
            ooms += 1

    for _ in range(150):
        live = cache.sequence_ids()
        op = int(rng.integers(0, 7)) if live else 0
        if op == 0:
            family = families[int(rng.integers(0, 3))]
            prompt = family[: int(rng.integers(1, 21))] + rng.integers(0, 50, int(rng.integers(0, 6))).tolist()
            max_reuse = None if rng.random() < 0.7 else int(rng.integers(0, len(prompt) + 1))
            sid, next_id = next_id, next_id + 1
            reused = d.request(sid, prompt, max_reuse=max_reuse)
            if reused < len(prompt):
                guarded(d.forward, {sid: prompt[reused:]})
        elif op == 1:
            ids = rng.choice(live, size=min(len(live), int(rng.integers(1, 4))), replace=False).tolist()
            guarded(d.forward, {s: rng.integers(0, 50, int(rng.integers(1, 4))).tolist() for s in ids})
        else:
            sid = int(rng.choice(live))
            length = len(d.tokens[sid])
            if op == 2:
                d.pop(sid, int(rng.integers(0, length + 1)))
            elif op == 3:
                next_id += 1
                guarded(d.fork, sid, next_id - 1, int(rng.integers(0, length + 1)))
            elif op == 4:
                d.finish(sid)
            elif op == 5:
                d.prefix.insert(sid, d.tokens[sid][: int(rng.integers(0, length + 1))])
            else:
                cache.remove_sequence(sid)
                d.model.remove(sid)
                del d.tokens[sid]
        d.prefix.check_integrity()
        for sid in cache.sequence_ids():
            d.check_kv(sid)
    s = d.prefix.stats
    assert s.reused_tokens > 0 and s.partial_page_reuses > 0 and s.evicted_pages > 0
