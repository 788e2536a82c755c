"""A cache with fp8 pages (``kv_dtype``) through its public API, on every target.

The oracle is ``CacheModel`` storing each token's K/V quantized and back with ``ml_dtypes``
(``tvmkv.reference.fp8``) under the cache's scales: prefill (without and with history), decode,
fork, pop, swap; ``debug_get_kv`` returns exactly those dequantized values. Then the scales' API
(validation, nothing changed by a refused call), sizing at one byte per element, and the features
that refuse fp8 pages with a clear error.
"""

from __future__ import annotations

import numpy as np
import pytest

from tvmkv import PagedAttentionKVCache
from tvmkv.reference import fp8 as fp8_ref
from tvmkv.reference.cache_model import CacheModel
from tvmkv.tir.spec import FP8_DTYPES

L, HQ, HKV, D, P = 2, 4, 2, 64, 16


def _cache(target, fmt, **kw):
    opts = dict(page_size=P, dtype="float16", kv_dtype=fmt, max_batch_size=4, max_total_seq_len=512)
    opts.update(prefill_chunk_size=96, target=target, **kw)
    return PagedAttentionKVCache(L, HQ, HKV, D, **opts)


def _store(scales, fmt):
    """CacheModel's kv_store: K/V as fp8 pages under ``scales [L, 2, H_kv]`` hold them."""

    def store(layer, k, v):
        return tuple(
            fp8_ref.dequantize(fp8_ref.quantize(np.asarray(x, np.float32), scales[layer, kv], fmt), scales[layer, kv])
            for kv, x in ((0, k), (1, v))
        )

    return store


def _step(cache, model, rng, ids, lens, check_kv=()):
    cache.begin_forward(ids, lens)
    model.begin(ids, lens)
    raw = cache.debug_forward().kernel.startswith("ragged")  # a prefill without history reads no page
    n = sum(lens)
    for layer in range(L):
        qkv = (rng.standard_normal((n, HQ + 2 * HKV, D)) * 2).astype(np.float16)
        o = cache.attention_with_fused_qkv(layer, qkv)
        want, _ = model.attention(layer, qkv, new_raw=raw)
        np.testing.assert_allclose(np.asarray(o, np.float64), want, atol=2e-2, rtol=2e-2)
    cache.end_forward()
    model.end()
    for s in check_kv:
        k, v = cache.debug_get_kv(s)
        _, mk, mv = model.kept_kv(s)
        assert k.dtype == np.float32
        np.testing.assert_allclose(k, mk, rtol=1e-6, atol=0)
        np.testing.assert_allclose(v, mv, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_fp8_cache_matches_the_quantized_model(target, fmt, rng):
    scales = rng.uniform(0.004, 0.03, (L, 2, HKV)).astype(np.float32)
    cache = _cache(target, fmt, kv_scales=scales)
    assert np.array_equal(np.stack([cache.kv_scales(layer) for layer in range(L)]), scales)
    model = CacheModel(L, HQ, HKV, D, dtype="float16", kv_store=_store(scales, fmt))
    for s in (0, 1, 2):
        cache.add_sequence(s)
        model.add(s)
    _step(cache, model, rng, [0, 1, 2], [40, 7, 17], check_kv=(0, 1))  # prefill, no history (raw K/V)
    _step(cache, model, rng, [0, 2], [9, 30], check_kv=(2,))  # chunked prefill over fp8 history
    for _ in range(3):
        _step(cache, model, rng, [0, 1, 2], [1, 1, 1])
    cache.fork_sequence(1, 3, 5)  # inside a page: the shared partial page is copied (codes)
    model.fork(1, 3, 5)
    cache.pop_n(0, 4)
    model.pop(0, 4)
    _step(cache, model, rng, [3, 0, 1], [1, 2, 1], check_kv=(3, 0))
    before = cache.debug_get_kv(2)
    cache.swap_out([2])
    cache.swap_in([2])
    after = cache.debug_get_kv(2)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    _step(cache, model, rng, [2, 3], [1, 1], check_kv=(2,))
    cache.check_integrity()


def test_fp8_scales_are_validated_and_refusals_change_nothing(rng):
    cache = _cache("llvm", "float8_e4m3fn")
    ones = np.ones((2, HKV), np.float32)
    assert all(np.array_equal(cache.kv_scales(layer), ones) for layer in range(L))  # vLLM's default
    cache.set_kv_scales(1, 0.5, [0.25, 2.0])
    assert np.array_equal(cache.kv_scales(1), [[0.5, 0.5], [0.25, 2.0]])
    bad = [
        ((0, [1.0, 2.0, 3.0], 1.0), ValueError, "shape"),
        ((0, 1.0, 0.0), ValueError, "positive and finite"),
        ((0, -1.0, 1.0), ValueError, "positive and finite"),
        ((0, float("nan"), 1.0), ValueError, "positive and finite"),
        ((0, 1.0, [1.0, float("inf")]), ValueError, r"v_scale\[1\]"),
        ((0, 1e-45, 1.0), ValueError, "smallest normal"),
        ((0, "big", 1.0), TypeError, "k_scale"),
        ((2, 1.0, 1.0), ValueError, "out of range"),
    ]
    for args, err, match in bad:
        with pytest.raises(err, match=match):
            cache.set_kv_scales(*args)
    assert np.array_equal(cache.kv_scales(0), ones) and np.array_equal(cache.kv_scales(1), [[0.5, 0.5], [0.25, 2.0]])
    # once tokens are stored their codes would change meaning: refused until the cache is empty again
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    with pytest.raises(Exception, match="inside begin_forward"):
        cache.set_kv_scales(0, 2.0, 2.0)
    for layer in range(L):
        cache.attention_with_fused_qkv(layer, rng.standard_normal((3, HQ + 2 * HKV, D)).astype(np.float16))
    cache.end_forward()
    with pytest.raises(ValueError, match="holds tokens"):
        cache.set_kv_scales(0, 2.0, 2.0)
    cache.remove_sequence(0)
    cache.set_kv_scales(0, 2.0, 2.0)
    assert np.array_equal(cache.kv_scales(0), 2 * ones)
    # constructor
    with pytest.raises(ValueError, match=r"kv_scales has shape \(3, 2\)"):
        _cache("llvm", "float8_e4m3fn", kv_scales=np.ones((3, 2)))
    with pytest.raises(ValueError, match=r"kv_scales\[1, 0\]"):
        _cache("llvm", "float8_e4m3fn", kv_scales=np.r_[np.ones((1, 2, HKV)), [[[0.0, 1.0], [1.0, 1.0]]]])
    with pytest.raises(ValueError, match="kv_dtype='int8' is not supported"):
        _cache("llvm", "int8")
    with pytest.raises(ValueError, match="16-bit activations"):
        PagedAttentionKVCache(L, HQ, HKV, D, dtype="float32", kv_dtype="float8_e5m2")
    plain = _cache("llvm", "")
    for call in (lambda: plain.kv_scales(0), lambda: plain.set_kv_scales(0, 1.0, 1.0)):
        with pytest.raises(ValueError, match="scales belong to fp8 pages"):
            call()
    with pytest.raises(ValueError, match="scales belong to fp8 pages"):
        _cache("llvm", "", kv_scales=ones)
    with pytest.raises(ValueError, match="MLA cache"):
        PagedAttentionKVCache.mla(1, 4, 64, 16, kv_dtype="float8_e4m3fn")


def test_fp8_pages_take_one_byte_per_element():
    """The same pool at half the bytes, and ``memory_fraction`` (all layers' pages at one byte per
    element) gives about twice the pages of fp16."""
    from tvmkv.runtime.cache import memory_needs

    fp16, fp8 = _cache("llvm", ""), _cache("llvm", "float8_e5m2")
    assert fp8.config.page_bytes * 2 == fp16.config.page_bytes == 2 * HKV * P * D * 2
    pool = [memory_needs(c.config)[0][1] for c in (fp16, fp8)]
    assert pool[0] == 2 * pool[1]
    assert fp8.pages[0].dtype == "float8_e5m2" and fp8.pages[0].shape == fp16.pages[0].shape
    sized = [_cache("llvm", kv, memory_fraction=0.01).num_available_pages() for kv in ("", "float8_e4m3fn")]
    assert 1.9 < sized[1] / sized[0] < 2.1


def test_fp8_features_without_fp8_support_refuse_clearly(rng):
    """Foreign layouts and TVM's checkpoint format hold 16-bit K/V: refused, naming what to use; a
    transfer between fp8 caches needs equal scales."""
    from tvmkv.runtime import checkpoint, interop, transfer

    cache = _cache("llvm", "float8_e4m3fn")
    cache.add_sequence(0)
    cache.begin_forward([0], [5])
    for layer in range(L):
        cache.attention_with_fused_qkv(layer, rng.standard_normal((5, HQ + 2 * HKV, D)).astype(np.float16))
    cache.end_forward()
    with pytest.raises(NotImplementedError, match="debug_get_kv"):
        interop.export_sequence(cache, 0, "nhd")
    with pytest.raises(NotImplementedError, match="checkpoints of fp8 pages"):
        checkpoint.export_checkpoint(cache, 0)
    other = _cache("llvm", "float8_e4m3fn")
    other.set_kv_scales(1, 0.5, 0.5)
    with pytest.raises(ValueError, match="scales differ at layer 1"):
        transfer.check_compatible(cache, other)
    with pytest.raises(ValueError, match="kv_dtype"):
        transfer.check_compatible(cache, _cache("llvm", "float8_e5m2"))
    transfer.check_compatible(cache, _cache("llvm", "float8_e4m3fn"))  # same scales: allowed
