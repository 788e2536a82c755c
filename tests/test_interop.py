"""Interop (tvmkv.interop): gather_kv, store_kv, export/import of sequences in foreign layouts, views.

Every function is checked against NumPy (``tvmkv.reference.ops``) over a snapshot of the page pool
read straight from the cache's per-layer tensors, plus misuse cases that must leave the cache as it
was. One small configuration (P = 4 so sequences span several pages, H_kv = 2 so NHD differs from
HND), so the kernels compile once. Layouts: docs/layout.md ("Foreign layouts").
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import to_dev

import tvmkv
from tvmkv import build, interop
from tvmkv.reference import ops as ref
from tvmkv.testing import make_cache

L, H_QO, H_KV, D, P = 2, 4, 2, 64, 4
CFG = dict(
    page_size=P, max_batch_size=4, max_total_seq_len=48, prefill_chunk_size=64, dtype="float32", rope_mode="none"
)
LAYOUTS = ("ksana", "nhd", "hnd", "contiguous")
PAGED = ("ksana", "nhd", "hnd")


@pytest.fixture
def cache(target):
    return make_cache(target, num_layers=L, num_qo_heads=H_QO, num_kv_heads=H_KV, head_dim=D, **CFG)


def _fill(cache, rng, lengths: dict) -> dict:
    """Add sequences with ``lengths`` tokens through one forward; returns each one's K/V ``[L, n, H, D]``
    (rope_mode none: K is stored as given)."""
    for s in lengths:
        cache.add_sequence(s)
    cache.begin_forward(list(lengths), list(lengths.values()))
    n = sum(lengths.values())
    qkv = [rng.standard_normal((n, H_QO + 2 * H_KV, D)).astype(np.float32) for _ in range(L)]
    for layer in range(L):
        cache.attention_with_fused_qkv(layer, qkv[layer])
    cache.end_forward()
    out, at = {}, 0
    for s, m in lengths.items():
        k = np.stack([q[at : at + m, H_QO : H_QO + H_KV] for q in qkv])
        v = np.stack([q[at : at + m, H_QO + H_KV :] for q in qkv])
        out[s] = (k, v)
        at += m
    return out


def _pool(cache) -> np.ndarray:
    """Every layer's page pool, ``[L, num_pages, 2, H_kv, P, D]`` (read directly, no kernel)."""
    return np.stack([p.numpy() for p in cache.pages])


def _pages(cache, seq_id) -> list:
    return interop.block_tables(cache, [seq_id]).block_tables[0].tolist()


def _state(cache):
    """Everything a failed call must leave unchanged."""
    tables = interop.block_tables(cache, cache.sequence_ids())
    return _pool(cache), tables.block_tables.tolist(), tables.seq_lens.tolist(), cache.num_available_pages()


def _assert_unchanged(cache, before):
    after = _state(cache)
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1:] == before[1:]
    cache.check_integrity()


# ---------------------------------------------------------------------------------------------- gather_kv


def test_gather_kv_sequences(cache, rng):
    """Block tables of real sequences (padded with -1) give back exactly what the forward appended."""
    kv = _fill(cache, rng, {0: 9, 1: 4, 2: 13})
    table = interop.block_tables(cache, [2, 0, 1])
    assert table.block_tables.shape == (3, 4) and table.block_tables[2, 1] == -1  # padding
    assert table.seq_lens.tolist() == [13, 9, 4]
    for layer in range(L):
        k, v = interop.gather_kv(cache, layer, table.block_tables, table.seq_lens)
        np.testing.assert_array_equal(k, np.concatenate([kv[s][0][layer] for s in (2, 0, 1)]))
        np.testing.assert_array_equal(v, np.concatenate([kv[s][1][layer] for s in (2, 0, 1)]))


def test_gather_kv_matches_gather_pa_kv_cache(cache, rng):
    """Raw block tables (any pages, seq_offset, cumsum lengths) against the GatherPaKvCache reference."""
    _fill(cache, rng, {0: 20, 1: 7})
    pool = _pool(cache)
    tables = np.array([[5, 3, 0, 1, 6], [2, 6, 4, -7, 99], [1, 1, 0, 0, 3]], np.int32)  # unreached ids: anything
    lens = np.array([11, 6, 0], np.int32)
    offset = np.array([5, 2, 19], np.int32)  # row 0 starts at column 1, row 1 at column 0
    cumsum = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    for layer in range(L):
        key_cache = pool[layer, :, 0].transpose(0, 2, 1, 3)  # GatherPaKvCache "Norm": [num_blocks, P, H, D]
        value_cache = pool[layer, :, 1].transpose(0, 2, 1, 3)
        want = ref.gather_pa_kv_ref(key_cache, value_cache, tables, lens, seq_offset=offset)
        got = interop.gather_kv(cache, layer, tables, lens, seq_offset=offset)
        got_cumsum = interop.gather_kv(cache, layer, tables, cumsum, seq_offset=offset, is_seq_lens_cumsum=True)
        for g, gc, w in zip(got, got_cumsum, want):
            assert g.shape == (17, H_KV, D)
            np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(gc, w)


def test_gather_kv_array_kinds_and_out(cache, rng):
    torch = pytest.importorskip("torch")
    kv = _fill(cache, rng, {0: 6})
    table = interop.block_tables(cache, [0])
    dev = "cpu" if cache.config.target_kind == "llvm" else "cuda"
    k, v = interop.gather_kv(cache, 1, torch.from_numpy(table.block_tables).to(dev), table.seq_lens.tolist())
    assert isinstance(k, torch.Tensor) and k.device.type == dev
    np.testing.assert_array_equal(k.cpu().numpy(), kv[0][0][1])
    out = (np.zeros((6, H_KV, D), np.float32), np.zeros((6, H_KV, D), np.float32))
    res = interop.gather_kv(cache, 0, table.block_tables.tolist(), [6], out=out)
    assert res[0] is out[0]
    np.testing.assert_array_equal(out[1], kv[0][1][0])
    empty = interop.gather_kv(cache, 0, np.zeros((2, 0), np.int32), np.zeros(2, np.int32))
    assert empty[0].shape == (0, H_KV, D)


def test_pipeline_stage_takes_the_model_layer_ids(target, rng):
    """A stage holding the model's layers 2 and 3 (``first_layer=2``): gather_kv, store_kv and paged_view
    name a layer as its attention calls do, and refuse the ids of other stages' layers."""
    cache = make_cache(target, num_layers=L, num_qo_heads=H_QO, num_kv_heads=H_KV, head_dim=D, first_layer=2, **CFG)
    cache.add_sequence(0)
    cache.begin_forward([0], [6])
    qkv = [rng.standard_normal((6, H_QO + 2 * H_KV, D)).astype(np.float32) for _ in range(L)]
    for i in range(L):
        cache.attention_with_fused_qkv(2 + i, qkv[i])
    cache.end_forward()
    table = interop.block_tables(cache, [0])
    for i in range(L):
        k, v = interop.gather_kv(cache, 2 + i, table.block_tables, table.seq_lens)
        np.testing.assert_array_equal(k, qkv[i][:, H_QO : H_QO + H_KV])
        np.testing.assert_array_equal(v, qkv[i][:, H_QO + H_KV :])
        assert interop.paged_view(cache, 2 + i, [0]).data.same_as(cache.pages[i])
    new = rng.standard_normal((1, H_KV, D)).astype(np.float32)
    slot = int(table.block_tables[0, 1]) * P + 1  # token 5's slot, overwritten in layer 3 only
    interop.store_kv(cache, 3, new, -new, [slot])
    pool = _pool(cache)
    np.testing.assert_array_equal(pool[1, slot // P, 0, :, slot % P], new[0])
    np.testing.assert_array_equal(pool[1, slot // P, 1, :, slot % P], -new[0])
    np.testing.assert_array_equal(pool[0, slot // P, 0, :, slot % P], qkv[0][5, H_QO : H_QO + H_KV])
    before = _state(cache)
    for layer in (0, 1, 4):
        with pytest.raises(ValueError, match=rf"layer {layer} is out of range \[2, 4\) \(this cache is the pipeline"):
            interop.gather_kv(cache, layer, table.block_tables, table.seq_lens)
        with pytest.raises(ValueError, match=rf"layer {layer} is out of range \[2, 4\)"):
            interop.store_kv(cache, layer, new, new, [slot])
    _assert_unchanged(cache, before)


# ---------------------------------------------------------------------------------------------- store_kv


def test_store_kv_slot_mapping(cache, rng):
    """nano-vllm style: the caller's slots (negative skips) -> exactly append_ref on that layer's pool."""
    kv = _fill(cache, rng, {0: 10, 1: 3})
    slots = interop.slot_mapping(cache, 0)
    pages = _pages(cache, 0)
    np.testing.assert_array_equal(slots, [pages[j // P] * P + j % P for j in range(10)])
    slots = np.concatenate([slots[2:7], [-1], interop.slot_mapping(cache, 1, 1, 4)]).astype(np.int32)
    k = rng.standard_normal((len(slots), H_KV, D)).astype(np.float32)
    v = rng.standard_normal((len(slots), H_KV, D)).astype(np.float32)
    before = _pool(cache)
    interop.store_kv(cache, 1, k, v, slots)
    after = _pool(cache)
    np.testing.assert_array_equal(after[0], before[0])  # other layers untouched
    np.testing.assert_array_equal(after[1], ref.append_ref(before[1], k, v, slots))
    got_k, _ = cache.debug_get_kv(0)
    np.testing.assert_array_equal(got_k[1, 2:7], k[:5])
    np.testing.assert_array_equal(got_k[1, :2], kv[0][0][1, :2])
    cache.check_integrity()


# ---------------------------------------------------------------------------------------------- export / import


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_import_roundtrip(cache, rng, layout):
    kv = _fill(cache, rng, {0: 10, 1: 5})
    pages = _pages(cache, 0)
    before = _pool(cache)
    out = interop.export_sequence(cache, 0, layout)
    assert out.shape == interop.foreign_shape(cache, layout, 10 if layout == "contiguous" else 3)
    np.testing.assert_array_equal(out, ref.export_pages_ref(before, pages, layout, num_tokens=10))
    if layout == "contiguous":
        np.testing.assert_array_equal(out[:, 0], kv[0][0])
        np.testing.assert_array_equal(out[:, 1], kv[0][1])
    free = cache.num_available_pages()
    interop.import_sequence(cache, 7, out, layout, num_tokens=10)
    cache.check_integrity()
    assert cache.num_available_pages() == free - 3 and cache.sequence_length(7) == 10
    new_pages = _pages(cache, 7)
    assert not set(new_pages) & set(pages)
    np.testing.assert_array_equal(_pool(cache), ref.import_pages_ref(before, new_pages, out, layout))
    k7, v7 = cache.debug_get_kv(7)
    np.testing.assert_array_equal(k7, kv[0][0])
    np.testing.assert_array_equal(v7, kv[0][1])


@pytest.mark.parametrize("layout", PAGED)
def test_export_import_into_foreign_pool(cache, rng, layout):
    """A sequence goes into chosen blocks of a foreign pool holding other data (kept), and comes back."""
    torch = pytest.importorskip("torch")
    kv = _fill(cache, rng, {0: 7, 1: 9})
    pages = _pages(cache, 1)
    blocks = [4, 0, 2]
    pool = rng.standard_normal(interop.foreign_shape(cache, layout, 6)).astype(np.float32)
    want = ref.export_pages_ref(_pool(cache), pages, layout, out=pool, block_ids=blocks)
    res = interop.export_sequence(cache, 1, layout, out=pool, block_ids=blocks)
    assert res is pool
    np.testing.assert_array_equal(pool, want)
    dev = "cpu" if cache.config.target_kind == "llvm" else "cuda"
    pool_t = torch.from_numpy(pool).to(dev)
    interop.import_sequence(cache, 3, pool_t, layout, num_tokens=9, block_ids=blocks)
    k3, v3 = cache.debug_get_kv(3)
    np.testing.assert_array_equal(k3, kv[1][0])
    np.testing.assert_array_equal(v3, kv[1][1])
    out_t = torch.zeros(interop.foreign_shape(cache, layout, 3), device=dev)
    interop.export_sequence(cache, 3, layout, out=out_t)
    np.testing.assert_array_equal(out_t.cpu().numpy(), ref.export_pages_ref(_pool(cache), _pages(cache, 3), layout))
    cache.check_integrity()


def test_imported_sequence_is_an_ordinary_sequence(cache, rng):
    """Page accounting after import: fork shares its pages, attention continues it, removal frees them."""
    kv = _fill(cache, rng, {0: 6})
    data = interop.export_sequence(cache, 0, "contiguous")
    cache.add_sequence(5)
    interop.import_sequence(cache, 5, data, "contiguous")  # an existing, empty sequence
    cache.fork_sequence(5, 6, fork_pos=4)  # one full page shared
    shared = _pages(cache, 5)[0]
    assert _pages(cache, 6) == [shared]
    cache.check_integrity()
    cache.begin_forward([5], [3])
    qkv = rng.standard_normal((3, H_QO + 2 * H_KV, D)).astype(np.float32)
    for layer in range(L):
        cache.attention_with_fused_qkv(layer, qkv)
    cache.end_forward()
    k5, _ = cache.debug_get_kv(5)
    np.testing.assert_array_equal(k5[0, :6], kv[0][0][0])
    np.testing.assert_array_equal(k5[0, 6:], qkv[:, H_QO : H_QO + H_KV])
    free = cache.num_available_pages()
    cache.remove_sequence(5)
    cache.remove_sequence(6)
    cache.check_integrity()
    assert cache.num_available_pages() == free + 3
    interop.import_sequence(cache, 8, data[:, :, :0], "contiguous")  # zero tokens: an empty sequence
    assert cache.sequence_length(8) == 0
    cache.check_integrity()


# ---------------------------------------------------------------------------------------------- zero-copy views


def test_paged_view_is_the_pool(cache, rng):
    """FlashInfer HND: the view's data is the layer's pool; its CSR tables read back each sequence."""
    torch = pytest.importorskip("torch")
    kv = _fill(cache, rng, {0: 9, 1: 4})
    view = interop.paged_view(cache, 1, [1, 0])
    assert view.data is cache.pages[1] and view.kv_layout == "HND"
    assert torch.from_dlpack(view.data).data_ptr() == cache.pages[1].data_ptr()  # shared, not copied
    data = view.data.numpy()  # [num_pages, 2, H, P, D]
    for b, s in enumerate([1, 0]):
        idx = view.indices[view.indptr[b] : view.indptr[b + 1]]
        n = (len(idx) - 1) * P + view.last_page_len[b]
        k = np.concatenate([data[p, 0].transpose(1, 0, 2) for p in idx])[:n]
        np.testing.assert_array_equal(k, kv[s][0][1])


def test_ksana_atb_block_ids(cache, rng):
    """Seed 000: ATB K/V caches over one KsanaLLM pool; ids b * 2L + layer address a block's K and V."""
    kv = _fill(cache, rng, {0: 11})
    blocks = [3, 1, 4]
    pool = np.zeros(interop.foreign_shape(cache, "ksana", 5), np.float32)
    interop.export_sequence(cache, 0, "ksana", out=pool, block_ids=blocks)
    atb = interop.ksana_atb_views(pool)
    assert np.shares_memory(atb.k_cache, pool) and np.shares_memory(atb.v_cache, pool)
    assert atb.k_cache.shape == (5 * 2 * L, P, H_KV, D)
    for layer in range(L):
        ids = interop.atb_block_ids(blocks, L, layer)
        assert ids.tolist() == [b * 2 * L + layer for b in blocks]
        k = atb.k_cache[ids].reshape(-1, H_KV, D)[:11]  # [blocks, P, H, D] -> tokens
        v = atb.v_cache[ids].reshape(-1, H_KV, D)[:11]
        np.testing.assert_array_equal(k, kv[0][0][layer])
        np.testing.assert_array_equal(v, kv[0][1][layer])


# ---------------------------------------------------------------------------------------------- misuse


def test_misuse_leaves_cache_unchanged(cache, rng):
    _fill(cache, rng, {0: 10, 1: 3})
    cache.fork_sequence(0, 2, fork_pos=4)  # page _pages(0)[0] is shared
    before = _state(cache)
    bt = interop.block_tables(cache, [0]).block_tables
    k = np.zeros((2, H_KV, D), np.float32)
    num_slots = cache.config.total_pages * P
    free_page = next(p for p in range(cache.config.total_pages) if p not in sum(before[1], []))
    cases = [
        # gather_kv
        (ValueError, "layer 2 is out of range", lambda: interop.gather_kv(cache, 2, bt, [10])),
        (ValueError, "needs column 3", lambda: interop.gather_kv(cache, 0, bt, [13])),
        (
            ValueError,
            r"block_tables\[0, 1\] = 999 is out of range",
            lambda: interop.gather_kv(cache, 0, [[0, 999]], [5]),
        ),
        (ValueError, "must start at 0", lambda: interop.gather_kv(cache, 0, bt, [1, 4], is_seq_lens_cumsum=True)),
        (ValueError, r"seq_lens\[0\] = -1 is negative", lambda: interop.gather_kv(cache, 0, bt, [-1])),
        (
            ValueError,
            "one offset per block_tables row",
            lambda: interop.gather_kv(cache, 0, bt, [2], seq_offset=[0, 1]),
        ),
        (TypeError, "integer", lambda: interop.gather_kv(cache, 0, bt.astype(np.float32), [2])),
        (ValueError, "dtype float16", lambda: interop.gather_kv(cache, 0, bt, [2], out=(k.astype(np.float16), k))),
        # store_kv
        (ValueError, f"= {num_slots} is out of range", lambda: interop.store_kv(cache, 0, k, k, [num_slots, -1])),
        (ValueError, "appears 2 times", lambda: interop.store_kv(cache, 0, k, k, [9, 9])),
        (ValueError, "free page", lambda: interop.store_kv(cache, 0, k, k, [free_page * P, -1])),
        (ValueError, "2 page tables share it", lambda: interop.store_kv(cache, 0, k, k, [_pages(cache, 0)[0] * P, -1])),
        (ValueError, "expected \\(2, 2, 64\\)", lambda: interop.store_kv(cache, 0, k[:1], k, [-1, -1])),
        (ValueError, "dtype float16", lambda: interop.store_kv(cache, 0, k, k.astype(np.float16), [-1, -1])),
        # export
        (KeyError, "sequence 42 is not in the cache", lambda: interop.export_sequence(cache, 42, "nhd")),
        (ValueError, "layout='vllm' is not one of", lambda: interop.export_sequence(cache, 0, "vllm")),
        (ValueError, "the 'hnd' layout of this cache", lambda: interop.export_sequence(cache, 0, "hnd", out=k)),
        (ValueError, "block_ids needs out", lambda: interop.export_sequence(cache, 0, "nhd", block_ids=[0, 1, 2])),
        (
            ValueError,
            "repeat a block",
            lambda: interop.export_sequence(
                cache, 0, "nhd", out=np.zeros(interop.foreign_shape(cache, "nhd", 4), np.float32), block_ids=[0, 1, 0]
            ),
        ),
        (
            ValueError,
            r"block_ids\[2\] = 4 is out of range \[0, 4\)",
            lambda: interop.export_sequence(
                cache,
                0,
                "ksana",
                out=np.zeros(interop.foreign_shape(cache, "ksana", 4), np.float32),
                block_ids=[0, 1, 4],
            ),
        ),
        # import
        (ValueError, "already holds 10 tokens", lambda: interop.import_sequence(cache, 0, _contig(4), "contiguous")),
        (ValueError, "num_tokens is required", lambda: interop.import_sequence(cache, 9, _paged(2), "nhd")),
        (
            ValueError,
            "needs 3 blocks but the foreign array holds 2",
            lambda: interop.import_sequence(cache, 9, _paged(2), "nhd", num_tokens=9),
        ),
        (
            ValueError,
            "num_tokens=3 but data holds 4",
            lambda: interop.import_sequence(cache, 9, _contig(4), "contiguous", num_tokens=3),
        ),
        (ValueError, "dtype float16", lambda: interop.import_sequence(cache, 9, _contig(4, np.float16), "contiguous")),
        (
            tvmkv.OutOfPagesError,
            "needs 20 free pages",
            lambda: interop.import_sequence(cache, 9, _contig(80), "contiguous"),
        ),
        # page tables and views
        (ValueError, "outside sequence 0's pages", lambda: interop.slot_mapping(cache, 0, 0, 13)),
        (KeyError, "sequence 42 is not in the cache", lambda: interop.block_tables(cache, [0, 42])),
        (KeyError, "sequence 42 is not in the cache", lambda: interop.paged_view(cache, 0, [42])),
        # ATB helpers
        (ValueError, "layer 2 is out of range", lambda: interop.atb_block_ids([0], L, 2)),
        (ValueError, "a KsanaLLM block pool is", lambda: interop.ksana_atb_views(np.zeros((2, 3, 1, 1, 1, 1)))),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
        _assert_unchanged(cache, before)
    assert 9 not in cache.sequence_ids()
    cache.begin_forward([1], [1])
    with pytest.raises(tvmkv.ForwardStateError, match="end_forward"):
        interop.export_sequence(cache, 0, "hnd")
    with pytest.raises(tvmkv.ForwardStateError, match="end_forward"):
        interop.import_sequence(cache, 9, _contig(4), "contiguous")
    cache.end_forward()


def _contig(n, dtype=np.float32):
    return np.zeros((L, 2, n, H_KV, D), dtype)


def _paged(nb):
    return np.zeros((L, nb, 2, P, H_KV, D), np.float32)


# ---------------------------------------------------------------------------------------------- kernels alone


def test_layout_kernels_bf16_single_head(target, rng):
    """The tvmkv.tir.interop kernels without a cache, in another dtype and shape (bf16, H_kv = 1, P = 8):
    export then import of every layout against the NumPy references, bit for bit."""
    spec = tvmkv.KernelSpec(2, 1, 16, 8, "bfloat16", target)
    lib = build.load_kernels(spec, family="interop")
    bf16 = ml_dtypes.bfloat16
    layers, num_pages, n = 3, 7, 13
    pools = rng.standard_normal((layers, num_pages, 2, 1, 8, 16)).astype(bf16)
    page_ids = np.array([5, 0], np.int32)
    for layout in LAYOUTS:
        paged = layout != "contiguous"
        blocks = np.array([2, 0], np.int32) if paged else None  # into a foreign pool of 3 blocks
        size = 3 if paged else n
        empty = np.zeros(_shape(layout, layers, size), bf16)
        want = ref.export_pages_ref(
            pools, page_ids, layout, num_tokens=n, out=empty if paged else None, block_ids=blocks
        )
        out = to_dev(empty, target)
        extra = (to_dev(blocks, target),) if paged else ()
        for layer in range(layers):
            lib[f"export_{layout}"](to_dev(pools[layer], target), to_dev(page_ids, target), out, *extra, layer)
        np.testing.assert_array_equal(out.numpy().view(np.uint16), want.view(np.uint16))
        dst_ids = np.array([1, 6], np.int32)
        back = [to_dev(np.zeros_like(pools[0]), target) for _ in range(layers)]
        for layer in range(layers):
            lib[f"import_{layout}"](back[layer], to_dev(dst_ids, target), out, *extra, layer)
        got = np.stack([b.numpy() for b in back])
        expect = ref.import_pages_ref(np.zeros_like(pools), dst_ids, want, layout, block_ids=blocks)
        np.testing.assert_array_equal(got.view(np.uint16), expect.view(np.uint16))


def _shape(layout, layers, size):
    H, P, D = 1, 8, 16
    return {
        "ksana": (size, 2, layers, P, H, D),
        "nhd": (layers, size, 2, P, H, D),
        "hnd": (layers, size, 2, H, P, D),
        "contiguous": (layers, 2, size, H, D),
    }[layout]


# ---------------------------------------------------------------------------------------------- build family


def test_interop_kernels_are_a_separate_family(cache):
    """The copies are not in the cache's kernel set; they build lazily into interop_<tag>.so, and the
    cache's sources hash ignores tvmkv/tir/interop.py."""
    assert "export_nhd" not in cache.kernels and "gather" in cache.kernels
    cache.add_sequence(0)
    interop.export_sequence(cache, 0, "nhd")  # an empty sequence: validates, loads nothing
    lib = interop.interop_kernels(cache)
    assert lib.key.family == "interop" and lib.path.name == f"interop_{cache.config.kernel_spec.tag}.so"
    assert lib.path.parent == cache.kernels.path.parent
    assert all(f"{d}_{layout}" in lib for d in ("export", "import") for layout in LAYOUTS)
    assert build.sources_hash("kvcache") != build.sources_hash("interop")
    with pytest.raises(ValueError, match="family='nope'"):
        build.BuildKey(cache.config.kernel_spec, family="nope")
