"""The per-step host path (packed index buffer, device ring, page mirrors) against the NumPy model.

Many forwards run back to back on device arrays with no host sync between them (q/k/v inputs are
uploaded up front, outputs stay on the device); only at the end are every output and the stored
K/V compared with ``tvmkv.reference.cache_model.CacheModel`` (through ``tvmkv.replay.Replayer``).
The scenario mixes what changes page lists behind ``begin_forward``'s back (fork + copy-on-write,
pop_n, sliding windows freeing pages, token-tree commits) so stale page mirrors would show.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import device_of

import tvmkv
from tvmkv import PagedAttentionKVCache
from tvmkv.replay import Replayer
from tvmkv.runtime.index_buffer import RING
from tvmkv.runtime.tensors import numpy_dtype

CONFIGS = [  # (H_qo, H_kv, D, P, dtype, sliding)
    (4, 2, 64, 16, "float32", False),
    (2, 2, 64, 4, "float32", True),
]


def _ops(sliding: bool, rng) -> list:
    ops = [("add", i) for i in range(6)]
    ops.append(("fwd", [(0, 37), (1, 5), (2, 16)]))  # ragged prefill, empty history
    ops.append(("fwd", [(3, 9), (0, 3)]))  # paged prefill over history
    ops += [("fwd", [(0, 1), (1, 1), (2, 1), (3, 1)])] * 6  # decode, pages fill up
    ops.append(("fork", 0, 10, 30))  # partial last page: copied; then copy-on-write below
    ops.append(("fork", 2, 11, -1))  # shares a full page
    ops += [("fwd", [(10, 1), (11, 2), (0, 1), (2, 1)])] * 4
    ops.append(("pop", 0, 13))  # drops pages: a suffix of the mirror
    ops += [("fwd", [(0, 2), (1, 1), (4, 20)])] * 2
    if sliding:
        ops.append(("window", 4, 12, 2))
        ops += [("fwd", [(4, 3), (0, 1), (3, 5)])] * 8  # window slides, frees pages
    else:
        ops.append(("tree", [(5, [-1, 0, 0, 1]), (1, [-1, 0])]))
        ops.append(("commit", [(5, 3), (1, 1)]))
        ops += [("fwd", [(5, 1), (1, 1)])] * 3
    ops.append(("remove", 11))
    ops += [("fwd", [(0, 1), (1, 1), (2, 1), (3, 1), (10, 1)])] * 6
    return ops


@pytest.mark.parametrize("splits", [None, 3], ids=["auto_split", "split3"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "q{}_kv{}_d{}_p{}_{}{}".format(*c[:5], "_sw" * c[5]))
def test_back_to_back_forwards_match_model(target, cfg, splits):
    """``splits=3`` forces flash-decoding (decode_splits): every decode step, fast path included,
    cuts its sequences into chunks and merges them; the outputs must not change."""
    H_qo, H_kv, D, P, dtype, sliding = cfg
    layers = 2
    cache = PagedAttentionKVCache(
        layers,
        H_qo,
        H_kv,
        D,
        page_size=P,
        max_batch_size=8,
        max_total_seq_len=512,
        prefill_chunk_size=64,
        dtype=dtype,
        support_sliding_window=sliding,
        target=target,
        num_pages=160,
        decode_splits=splits,
    )
    rep = Replayer(cache, seed=1)
    rng = np.random.default_rng(0)
    ops = _ops(sliding, rng)
    dev = device_of(target)
    # every input on the device before the first forward: no copy (and so no sync) in between
    inputs = []
    for op in ops:
        if op[0] in ("fwd", "tree"):
            n = sum(x[1] if op[0] == "fwd" else len(x[1]) for x in op[1])
            qkv = [rng.uniform(-1, 1, (n, H_qo + 2 * H_kv, D)).astype(numpy_dtype(dtype)) for _ in range(layers)]
            inputs.append([(q, tvm.runtime.tensor(q, dev)) for q in qkv])
    dev.sync()
    outputs, slots, chunks = [], [], []
    it = iter(inputs)
    for op in ops:
        if op[0] not in ("fwd", "tree"):
            rep.apply(op)
            continue
        ids = [x[0] for x in op[1]]
        if op[0] == "fwd":
            lengths, parents, flat = [x[1] for x in op[1]], None, None
        else:
            parents = [list(x[1]) for x in op[1]]
            lengths = [len(p) for p in parents]
            flat = [p for ps in parents for p in ps]
        cache.begin_forward(ids, lengths, flat)
        rep.model.begin(ids, lengths, parents)
        info = cache.debug_forward()
        slots.append(info.slot)
        if info.kernel == "paged_decode":
            chunks.append(info.num_splits)
        for layer, (q_host, q_dev) in enumerate(next(it)):
            o = cache.attention_with_fused_qkv(layer, q_dev)  # a device tensor, not read back yet
            ref, _ = rep.model.attention(layer, q_host)
            outputs.append((ids, lengths, layer, o, ref))
        cache.end_forward()
        rep.model.end()
    dev.sync()
    for ids, lengths, layer, o, ref in outputs:
        np.testing.assert_allclose(
            np.asarray(o.numpy(), np.float64),
            ref,
            atol=rep.atol,
            rtol=rep.rtol,
            err_msg=f"layer {layer}, seqs {ids}, lengths {lengths}",
        )
    rep.check_kv()
    cache.check_integrity()
    assert len(chunks) >= 12
    if target == "llvm":  # chunks of one key on the CPU: with splits=3 every decode step splits 3 ways
        assert set(chunks) == {3 if splits else 1}
    # consecutive forwards use different device index buffers (the ring; see runtime/index_buffer.py)
    assert all(a != b for a, b in zip(slots, slots[1:])) or RING == 1
    for sid in cache.sequence_ids():
        cache.remove_sequence(sid)
    rep.check_drained()


def test_page_indices_follow_page_lists_after_every_operation(rng):
    """White-box: the packed page_indices equal the Python page lists after random operations."""
    cache = PagedAttentionKVCache(
        1,
        2,
        2,
        64,
        page_size=4,
        max_batch_size=8,
        max_total_seq_len=256,
        prefill_chunk_size=64,
        dtype="float32",
        support_sliding_window=True,
        num_pages=200,
    )
    live = []
    for step in range(120):
        r = rng.random()
        if r < 0.15 or not live:
            sid = step + 100
            cache.add_sequence(sid)
            live.append(sid)
            if rng.random() < 0.3:
                cache.enable_sliding_window_for_seq(sid, int(rng.integers(6, 20)), int(rng.integers(0, 3)))
        elif r < 0.25 and cache.sequence_length(live[0]) > 2 and not cache.sequence_info(live[0]).slid:
            child = step + 1000
            cache.fork_sequence(live[0], child, int(rng.integers(1, cache.sequence_length(live[0]))))
            live.append(child)
        elif r < 0.35:
            sid = live[int(rng.integers(len(live)))]
            limit = cache.sequence_info(sid).poppable
            cache.pop_n(sid, int(rng.integers(0, limit + 1)))
        elif r < 0.42 and len(live) > 1:
            cache.remove_sequence(live.pop(int(rng.integers(len(live)))))
        else:
            batch = list(rng.choice(live, size=min(len(live), int(rng.integers(1, 5))), replace=False))
            lengths = [int(rng.integers(1, 6)) for _ in batch]
            cache.begin_forward(batch, lengths)
            d = cache.debug_forward().arrays
            indptr = d["page_indptr"]
            want = np.concatenate([np.asarray(cache.sequence_pages(s), np.int32) for s in batch] + [[]])
            got = d["page_indices"][: indptr[-1]]
            np.testing.assert_array_equal(got, want.astype(np.int32), err_msg=f"step {step}")
            cache.end_forward()
        cache.check_integrity()


def test_decode_fast_path_arrays_follow_page_lists(rng):
    """White-box: a decode step that repeats the previous step's batch is planned by updating that plan
    in place (``repeat_decode.RepeatDecode``). After every such step (and every other operation in between:
    forks with copy-on-write, pop_n, removals, a pool running out of pages) every index array must
    equal what the Python page lists and lengths say (docs/layout.md)."""
    P = 4
    cache = PagedAttentionKVCache(
        1, 2, 2, 16, page_size=P, max_batch_size=8, max_total_seq_len=160, prefill_chunk_size=64,
        dtype="float32", num_pages=40,
    )  # fmt: skip
    taken = []
    live, batch, next_id, out_of_pages = [], [], 0, 0
    for step in range(400):
        r = rng.random()
        if live and cache.num_available_pages() < 3 and r < 0.13:
            cache.remove_sequence(live.pop(0))  # room for adds and forks
        elif r < 0.06 or not live:
            cache.add_sequence(next_id)
            cache.begin_forward([next_id], [int(rng.integers(1, 9))])
            cache.end_forward()
            live.append(next_id)
            next_id += 1
        elif r < 0.09 and len(live) < 8:
            parent = live[int(rng.integers(len(live)))]
            cache.fork_sequence(parent, next_id, int(rng.integers(1, cache.sequence_length(parent) + 1)))
            live.append(next_id)
            next_id += 1
        elif r < 0.11:
            sid = live[int(rng.integers(len(live)))]
            cache.pop_n(sid, int(rng.integers(0, cache.sequence_length(sid))))
        elif r < 0.13 and len(live) > 1:
            cache.remove_sequence(live.pop(int(rng.integers(len(live)))))
        else:
            if not batch or not set(batch) <= set(live) or rng.random() < 0.1:
                batch = [int(s) for s in rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False)]
            before = {s: cache.sequence_pages(s) for s in live}
            free_before = cache.num_available_pages()
            try:
                cache.begin_forward(batch, [1] * len(batch))
            except tvmkv.OutOfPagesError:
                assert {s: cache.sequence_pages(s) for s in live} == before
                assert cache.num_available_pages() == free_before
                out_of_pages += 1
                cache.remove_sequence(live.pop(0))  # make room, as a scheduler would preempt
                continue
            seqs = [cache.sequence_info(s) for s in batch]
            kv = np.array([s.kv_len for s in seqs])
            npages = np.array([len(s.pages) for s in seqs])
            info = cache.debug_forward()
            taken.append(info.repeated)
            dev = info.arrays

            np.testing.assert_array_equal(dev["page_indptr"], np.concatenate([[0], np.cumsum(npages)]))
            pages = np.concatenate([s.pages for s in seqs])
            np.testing.assert_array_equal(dev["page_indices"][: len(pages)], pages, err_msg=f"step {step}")
            np.testing.assert_array_equal(dev["last_page_len"], kv - (npages - 1) * P)
            np.testing.assert_array_equal(dev["q_pos"], kv - 1)
            want_slots = [s.pages[(n - 1) // P] * P + (n - 1) % P for s, n in zip(seqs, kv)]
            np.testing.assert_array_equal(dev["slots"], want_slots, err_msg=f"step {step}")
            cache.end_forward()
        cache.check_integrity()
    assert sum(taken) > 100 and out_of_pages, f"fast path taken {sum(taken)} times, {out_of_pages} out of pages"


@pytest.mark.parametrize("blocks,tile,sms", [(8, 64, 132), (8, 1, 0), (32, 64, 80), (2, 16, 8)])
def test_split_plan_covers_keys_without_empty_chunks(blocks, tile, sms):
    """plan_split (flash-decoding, chosen in begin_forward): the chunks cover the longest sequence,
    none of them is empty for it, chunks are whole tiles, and automatic splitting stops where the
    batch alone fills the device."""
    from tvmkv.runtime.decode_split import BLOCKS_PER_SM, MIN_CHUNK_TILES, plan_split

    for batch in (1, 2, 7, 32, 64, 256):
        for max_keys in (1, 5, tile, 3 * tile + 1, 1000, 4096, 33000):
            for forced in (None, 1, 2, 5, 64):
                S, chunk, layout = plan_split(
                    batch, max_keys, blocks_per_seq=blocks, tile_keys=tile, num_sms=sms, max_splits=forced
                )
                assert layout == ""  # (the launcher picks a layout, plan_split never)
                what = f"batch {batch}, keys {max_keys}, forced {forced}: {S} x {chunk}"
                if S == 1:
                    continue
                assert chunk % tile == 0 and S * chunk >= max_keys > (S - 1) * chunk, what
                if forced is None:
                    assert sms and batch * blocks * S <= BLOCKS_PER_SM * sms, what
                    assert chunk >= MIN_CHUNK_TILES * tile, what
                else:
                    assert S <= forced, what
    # long context, batch 1, a big GPU: split wide; a full batch: no split; off: never
    assert plan_split(1, 4096, blocks_per_seq=8, tile_keys=64, num_sms=132) == (16, 256, "")
    assert plan_split(1, 1024, blocks_per_seq=8, tile_keys=64, num_sms=132) == (8, 128, "")
    assert plan_split(8, 1024, blocks_per_seq=8, tile_keys=64, num_sms=132) == (2, 512, "")
    assert plan_split(16, 1024, blocks_per_seq=8, tile_keys=64, num_sms=132).num_splits == 1
    assert plan_split(256, 4096, blocks_per_seq=8, tile_keys=64, num_sms=132).num_splits == 1
    assert plan_split(1, 4096, blocks_per_seq=8, tile_keys=64, num_sms=132, max_splits=1).num_splits == 1
    assert plan_split(1, 4096, blocks_per_seq=8, tile_keys=1, num_sms=0).num_splits == 1
    # a kernel that runs 2 blocks per SM (MLA at 16 heads): the grid may fill 2 x the SMs, no more
    for batch, keys in ((64, 4096), (128, 2048), (1, 1024), (32, 1024)):
        S1 = plan_split(batch, keys, blocks_per_seq=1, tile_keys=32, num_sms=132).num_splits
        S2 = plan_split(batch, keys, blocks_per_seq=1, tile_keys=32, num_sms=132, blocks_per_sm=2).num_splits
        assert S2 >= S1 and (S2 == 1 or batch * S2 <= 2 * 132), (batch, keys, S1, S2)
    assert plan_split(64, 4096, blocks_per_seq=1, tile_keys=32, num_sms=132, blocks_per_sm=2) == (4, 1024, "")
    assert plan_split(128, 2048, blocks_per_seq=1, tile_keys=32, num_sms=132, blocks_per_sm=2) == (2, 1024, "")


def test_decode_splits_option_is_validated():
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(ValueError, match="decode_splits"):
            PagedAttentionKVCache(1, 4, 2, 64, dtype="float32", decode_splits=bad)


def test_begin_forward_reads_a_one_shot_batch_once():
    """A batch given as iterators (read once), tuples or arrays is planned as the same lists are, also
    where the cache keeps a repeat-decode plan from the steps before (``repeat_decode.RepeatDecode``): that plan
    used to read the iterators itself and, declining the step, leave the general path an empty batch.
    Oracle: the sequences' lengths and the step's query positions, counted here."""
    cache = PagedAttentionKVCache(
        1, 2, 2, 16, page_size=4, max_batch_size=4, max_total_seq_len=128, prefill_chunk_size=32,
        dtype="float32", num_pages=32,
    )  # fmt: skip
    lengths = {0: 0, 1: 0}
    for s in lengths:
        cache.add_sequence(s)

    def step(ids, lens, want_ids, want_lens):
        cache.begin_forward(ids, lens)
        want_pos = np.concatenate([np.arange(lengths[s], lengths[s] + n) for s, n in zip(want_ids, want_lens)])
        np.testing.assert_array_equal(cache.debug_forward().arrays["q_pos"], want_pos)
        repeated = cache.debug_forward().repeated
        cache.end_forward()
        for s, n in zip(want_ids, want_lens):
            lengths[s] += n
            assert cache.sequence_length(s) == lengths[s]
        return repeated

    step(iter([0, 1]), iter([3, 4]), [0, 1], [3, 4])
    for _ in range(2):  # (the first decode after a prefill is planned anew; the next keeps its plan)
        step([0, 1], [1, 1], [0, 1], [1, 1])
    assert step([0, 1], [1, 1], [0, 1], [1, 1])  # a kept plan from here on
    step(iter([0, 1]), iter([5, 5]), [0, 1], [5, 5])  # declined by the kept plan: a prefill
    step((1, 0), np.array([1, 1]), [1, 0], [1, 1])
    assert step(iter([1, 0]), (n for n in (1, 1)), [1, 0], [1, 1])  # taken by the kept plan
    with pytest.raises(TypeError, match="takes a list of sequence ids"):  # named, with a plan kept too
        cache.begin_forward(1, [1])
    with pytest.raises(TypeError, match="append_lengths must be a list of ints"):
        cache.begin_forward([1, 0], 1)
    assert [cache.sequence_length(s) for s in (0, 1)] == [lengths[0], lengths[1]]
    assert step([1, 0], [1, 1], [1, 0], [1, 1])  # the kept plan survived the refusals
    cache.check_integrity()
