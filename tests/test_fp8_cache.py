"""A cache with fp8 pages (``kv_dtype``) through its public API, on every target.

The oracle is ``CacheModel`` storing each token's K/V quantized and back with ``ml_dtypes``
(``tvmkv.reference.fp8``) under the cache's scales: prefill (without and with history), decode,
fork, pop, swap; ``debug_get_kv`` returns exactly those dequantized values. Then the scales' API
(validation, nothing changed by a refused call), sizing at one byte per element, and the features
that refuse fp8 pages with a clear error; checkpoints and transfers carrying the scales; calibration
(``calibrate=N``) against scales and re-encodings NumPy computes.
"""

from __future__ import annotations

import numpy as np
import pytest

from tvmkv import PagedAttentionKVCache
from tvmkv.reference import fp8 as fp8_ref
from tvmkv.reference.cache_model import CacheModel
from tvmkv.runtime.tensors import numpy_dtype
from tvmkv.target import default_cuda_arch
from tvmkv.tir.spec import FP8_DTYPES

L, HQ, HKV, D, P = 2, 4, 2, 64, 16


def _cache(target, fmt, *, layers=L, heads=(HQ, HKV, D), **kw):
    opts = dict(page_size=P, dtype="float16", kv_dtype=fmt, max_batch_size=4, max_total_seq_len=512)
    opts.update(prefill_chunk_size=96, target=target)
    opts.update(kw)
    return PagedAttentionKVCache(layers, *heads, **opts)


def _store(scales, fmt):
    """CacheModel's kv_store: K/V as fp8 pages under ``scales [L, 2, H_kv]`` hold them."""

    def store(layer, k, v):
        return tuple(
            fp8_ref.dequantize(fp8_ref.quantize(np.asarray(x, np.float32), scales[layer, kv], fmt), scales[layer, kv])
            for kv, x in ((0, k), (1, v))
        )

    return store


def _step(cache, model, rng, ids, lens, check_kv=(), split=False, layout=None):
    cfg = cache.config
    cache.begin_forward(ids, lens)
    if split:  # a decode cut into chunks (decode_splits)
        assert cache.debug_forward().num_splits > 1
    if layout is not None:  # the one-launch decode's layout (DecodeSplit.layout)
        assert cache.debug_forward().decode_layout == layout
    model.begin(ids, lens)
    raw = cache.debug_forward().kernel.startswith("ragged")  # a prefill without history reads no page
    n = sum(lens)
    for layer in range(cfg.num_layers):
        qkv = rng.standard_normal((n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim)) * 2
        qkv = qkv.astype(numpy_dtype(cfg.dtype))
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


@pytest.mark.parametrize("fmt, dtype", [*((f, "float16") for f in FP8_DTYPES), ("float8_e4m3fn", "bfloat16")])
def test_fp8_cache_matches_the_quantized_model(target, fmt, dtype, rng):
    scales = rng.uniform(0.004, 0.03, (L, 2, HKV)).astype(np.float32)
    cache = _cache(target, fmt, kv_scales=scales, dtype=dtype)
    assert np.array_equal(np.stack([cache.kv_scales(layer) for layer in range(L)]), scales)
    model = CacheModel(L, HQ, HKV, D, dtype=dtype, kv_store=_store(scales, fmt))
    for s in (0, 1, 2):
        cache.add_sequence(s)
        model.add(s)
    _step(cache, model, rng, [0, 1, 2], [40, 7, 17], check_kv=(0, 1))  # prefill, no history (raw K/V)
    _step(cache, model, rng, [0, 2], [9, 30], check_kv=(2,))  # chunked prefill over fp8 history
    _step(cache, model, rng, [1], [80], check_kv=(1,))  # ... a chunk of 80 (sm_90: two query blocks)
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


@pytest.mark.parametrize(
    "sliding, splits", [(False, 4), (False, 1), (True, 4)], ids=["tensor-cores", "tensor-cores-unsplit", "sliding"]
)
def test_fp8_decode_of_a_group_of_eight_through_the_cache(target, sliding, splits, rng):
    """fp8 decode at head_dim 128 with 8 query heads per KV head, split (up to 4 ways; cuda: merged in
    the kernel), against the quantized model. On cuda the plain kernel set decodes on the tensor cores
    (one block per KV head), the sliding one on the CUDA cores (two blocks per KV head: the runtime
    sizes the merge's arrival counters for it); llvm has one schedule for both. On sm_90 the tensor-core
    steps, 6 blocks a chunk, launch the small-batch layout (``paged_decode_append[_split]_small_batch``),
    split and (``decode_splits=1``) not."""
    fmt, hq, hkv, d = "float8_e4m3fn", 16, 2, 128
    scales = rng.uniform(0.004, 0.03, (1, 2, hkv)).astype(np.float32)
    cache = _cache(
        target,
        fmt,
        layers=1,
        heads=(hq, hkv, d),
        kv_scales=scales,
        max_total_seq_len=2048,
        prefill_chunk_size=512,
        support_sliding_window=sliding,
        decode_splits=splits,
    )
    model = CacheModel(1, hq, hkv, d, dtype="float16", kv_store=_store(scales, fmt))
    for s in (0, 1, 2):
        cache.add_sequence(s)
        model.add(s)
    _step(cache, model, rng, [0, 1, 2], [300, 17, 1])
    small = "paged_decode_append_small_batch" in cache.kernels  # (sm_90 tensor-core sets)
    arch = cache.config.cuda_arch or default_cuda_arch()
    assert small == (target == "cuda" and not sliding and arch == "sm_90")
    for _ in range(3):
        _step(cache, model, rng, [0, 1, 2], [1, 1, 1], split=splits > 1, layout="_small_batch" if small else "")
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
        ((0, 1e39, 1.0), ValueError, "float32's largest"),
        ((0, "big", 1.0), TypeError, "k_scale"),
        ((0, "0.5", 1.0), TypeError, "k_scale='0.5'"),  # a numeric string is not parsed
        ((0, None, 1.0), TypeError, "k_scale=None"),  # not turned into a NaN the caller never passed
        ((0, 1.0, [1.0, None]), TypeError, "v_scale"),
        ((0, True, 1.0), TypeError, "k_scale=True"),
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
    with pytest.raises(TypeError, match="kv_scales=.* is not an array of floats"):  # not a table with a NaN
        _cache("llvm", "float8_e4m3fn", kv_scales=[[[1.0, None], [1.0, 1.0]]])
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


def _prefill(cache, rng, seq_id, n, amp=1.0, layers=range(L)):
    """Append ``n`` tokens of N(0, amp^2) q/k/v to ``seq_id`` (every layer); the qkv of each layer."""
    cache.begin_forward([seq_id], [n])
    qkvs = [(rng.standard_normal((n, HQ + 2 * HKV, D)) * amp).astype(np.float16) for _ in layers]
    for layer, qkv in zip(layers, qkvs):
        cache.attention_with_fused_qkv(layer, qkv)
    cache.end_forward()
    return qkvs


def _requantized(values, to_scales, fmt):
    """``values`` (float32 K or V ``[n, H_kv, D]``, already fp8 values times a scale) stored again under
    ``to_scales [H_kv]``: the reference of a re-encoding."""
    return fp8_ref.dequantize(fp8_ref.quantize(values, to_scales, fmt), to_scales)


def test_fp8_refusals_name_what_to_use(rng):
    """Foreign layouts hold 16-bit K/V: refused, naming what to use; caches of another page dtype refuse
    each other's sequences."""
    from tvmkv.runtime import interop, transfer

    cache = _cache("llvm", "float8_e4m3fn")
    cache.add_sequence(0)
    _prefill(cache, rng, 0, 5)
    with pytest.raises(NotImplementedError, match="debug_get_kv"):
        interop.export_sequence(cache, 0, "nhd")
    with pytest.raises(ValueError, match="kv_dtype"):
        transfer.check_compatible(cache, _cache("llvm", "float8_e5m2"))


@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_fp8_checkpoints_and_transfers_carry_the_scales(fmt, rng):
    """A checkpoint of fp8 pages holds the codes and the scales they were stored under: a cache holding no
    token takes those scales and the codes as they are (restored exactly); one holding tokens keeps its
    scales and re-encodes the codes (one more rounding, as the reference computes it); a transfer between
    caches of other scales re-encodes the same way. A 16-bit checkpoint does not import into fp8 pages."""
    from tvmkv.runtime import checkpoint, transfer

    s_a = rng.uniform(0.004, 0.03, (L, 2, HKV)).astype(np.float32)
    a = _cache("llvm", fmt, kv_scales=s_a)
    a.add_sequence(0)
    _prefill(a, rng, 0, 37)
    ka, va = a.debug_get_kv(0)
    ckpt = checkpoint.export_checkpoint(a, 0)
    meta = __import__("json").loads(ckpt.metadata)
    assert meta["kv_dtype"] == fmt and all(g["dtype"] == fmt for g in meta["groups"])
    assert np.array_equal(np.array([g["kv_scale"] for g in meta["groups"]], np.float32), s_a)
    assert ckpt.groups[0].dtype == fp8_ref.np_dtype(fmt) and ckpt.groups[0].shape == (1, 3, 2, HKV, P, D)
    assert checkpoint.layout_hash(a) != checkpoint.layout_hash(_cache("llvm", ""))

    fresh = _cache("llvm", fmt)  # holds no token: takes the checkpoint's scales, codes unchanged
    checkpoint.import_checkpoint(fresh, 5, ckpt)
    assert np.array_equal(np.stack([fresh.kv_scales(layer) for layer in range(L)]), s_a)
    k, v = fresh.debug_get_kv(5)
    assert np.array_equal(k, ka) and np.array_equal(v, va)

    s_b = rng.uniform(0.004, 0.03, (L, 2, HKV)).astype(np.float32)
    for receive in ("checkpoint", "transfer"):
        b = _cache("llvm", fmt, kv_scales=s_b)
        b.add_sequence(9)
        _prefill(b, rng, 9, 3)  # holds tokens: keeps its scales
        if receive == "checkpoint":
            checkpoint.import_checkpoint(b, 5, ckpt)
        else:
            transfer.move_sequence(a, 0, b, 5)
        assert np.array_equal(np.stack([b.kv_scales(layer) for layer in range(L)]), s_b)
        k, v = b.debug_get_kv(5)
        for layer in range(L):
            np.testing.assert_allclose(k[layer], _requantized(ka[layer], s_b[layer, 0], fmt), rtol=1e-6, atol=0)
            np.testing.assert_allclose(v[layer], _requantized(va[layer], s_b[layer, 1], fmt), rtol=1e-6, atol=0)
        b.check_integrity()

    for wrong in (
        [[0.0] * HKV, [1.0] * HKV],
        [["0.1"] * HKV, [1.0] * HKV],
        [[True] * HKV, [1.0] * HKV],
        [[1e39] * HKV, [1.0] * HKV],
        [[1.0] * HKV],
    ):
        bad = dict(meta, groups=[dict(g, kv_scale=wrong) for g in meta["groups"]])
        target_cache = _cache("llvm", fmt)
        with pytest.raises(ValueError, match="kv_scale"):
            checkpoint.prepare_import(target_cache, 1, __import__("json").dumps(bad))
        with pytest.raises(ValueError, match="kv_scale"):
            checkpoint.import_checkpoint(
                target_cache, 1, checkpoint.Checkpoint(__import__("json").dumps(bad), ckpt.groups)
            )
        assert np.array_equal(target_cache.kv_scales(0), np.ones((2, HKV), np.float32))
        assert target_cache.num_available_pages() == target_cache.config.total_pages
    # a failed import leaves an empty calibrating cache as it was: its scales, its calibration
    calibrating = _cache("llvm", fmt, calibrate=8)
    wrong_shape = checkpoint.Checkpoint(ckpt.metadata, [ckpt.groups[0], ckpt.groups[1][:, :2]])
    with pytest.raises(ValueError, match="shape"):
        checkpoint.import_checkpoint(calibrating, 1, wrong_shape)
    checkpoint.prepare_import(calibrating, 1, ckpt.metadata)  # step by step: re-encoded, never adopted
    checkpoint.abort_import(calibrating, 1)
    assert calibrating.calibrating and np.array_equal(calibrating.kv_scales(1), np.ones((2, HKV), np.float32))
    calibrating.check_integrity()
    # a move refused by the sender (a forward open) leaves an empty receiver's scales and calibration
    receiver = _cache("llvm", fmt, calibrate=8)
    fresh.add_sequence(7)
    fresh.begin_forward([7], [1])
    with pytest.raises(Exception, match="forward"):
        transfer.move_sequence(fresh, 5, receiver, 2)
    fresh.end_forward()
    fresh.remove_sequence(7)
    assert receiver.calibrating and np.array_equal(receiver.kv_scales(1), np.ones((2, HKV), np.float32))
    # a move into a cache holding no token gives it the sender's scales: the codes move unchanged
    receiver = _cache("llvm", fmt, calibrate=8)
    transfer.move_sequence(fresh, 5, receiver, 2)
    assert not receiver.calibrating and np.array_equal(receiver.kv_scales(1), s_a[1])
    k, v = receiver.debug_get_kv(2)
    assert np.array_equal(k, ka) and np.array_equal(v, va)
    plain = _cache("llvm", "")
    plain.add_sequence(0)
    _prefill(plain, rng, 0, 4)
    with pytest.raises(ValueError, match="kv_dtype"):
        checkpoint.import_checkpoint(_cache("llvm", fmt), 1, checkpoint.export_checkpoint(plain, 0))


@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_fp8_calibration_learns_the_scales_from_the_first_tokens(target, fmt, rng):
    """``calibrate=N``: each layer's scales become ``2 max|x| / largest`` over the first N tokens'
    K/V per head (NumPy computes the expected value); a forward that raises them re-encodes the codes
    stored before (a swapped-out sequence's too, when it comes back); after N tokens they stay fixed and
    larger values saturate; attention reads the re-encoded values (NumPy attention over them)."""
    cache = _cache(target, fmt, calibrate=60)
    assert cache.calibrating
    largest = fp8_ref.largest(fmt)

    def amax(qkvs, kv):  # [L, H_kv] of K (kv 0) or V (1) of each layer's qkv
        lo = HQ + kv * HKV
        return np.stack([np.abs(q[:, lo : lo + HKV].astype(np.float32)).max(axis=(0, 2)) for q in qkvs])

    def scales():
        return np.stack([cache.kv_scales(layer) for layer in range(L)])

    for s in (0, 1):
        cache.add_sequence(s)
    x1 = _prefill(cache, rng, 0, 20, amp=1.0)
    s1 = np.stack([amax(x1, 0), amax(x1, 1)], axis=1) * 2 / largest  # [L, 2, H_kv]
    np.testing.assert_allclose(scales(), s1, rtol=1e-6)
    s1 = scales()
    cache.swap_out([np.int64(0)])  # ids of any integer type name the same sequence
    cache.begin_forward([1], [30])
    with pytest.raises(ValueError, match="calibrates the fp8 scales"):
        cache.graph_key()
    x2 = [(rng.standard_normal((30, HQ + 2 * HKV, D)) * 3).astype(np.float16) for _ in range(L)]
    for layer in range(L):
        cache.attention_with_fused_qkv(layer, x2[layer])
    cache.end_forward()
    s2 = np.maximum(s1, np.stack([amax(x2, 0), amax(x2, 1)], axis=1) * 2 / largest)
    np.testing.assert_allclose(scales(), s2, rtol=1e-6)
    s2 = scales()
    assert (s2 > s1).any() and cache.calibrating  # 50 of 60 tokens
    cache.swap_in([np.array(0)])
    k, v = cache.debug_get_kv(0)
    for layer in range(L):  # stored under s1, re-encoded under s2
        for kv, got in ((0, k), (1, v)):
            lo = HQ + kv * HKV
            first = fp8_ref.dequantize(fp8_ref.quantize(x1[layer][:, lo : lo + HKV], s1[layer, kv], fmt), s1[layer, kv])
            want = _requantized(first.astype(np.float32), s2[layer, kv], fmt)
            np.testing.assert_allclose(got[layer], want, rtol=1e-6, atol=0)
    before = [cache.debug_get_kv(s) for s in (0, 1)]  # under s2, both sequences on the device
    x3 = _prefill(cache, rng, 1, 11, amp=5.0)  # 61 tokens: calibration ends with this forward, raising s2
    assert not cache.calibrating
    s3 = np.maximum(s2, np.stack([amax(x3, 0), amax(x3, 1)], axis=1) * 2 / largest)
    np.testing.assert_allclose(scales(), s3, rtol=1e-6)
    s3 = scales()
    assert (s3 > s2).any()
    for s, (k_old, v_old) in zip((0, 1), before):  # resident codes re-encoded from s2 to s3
        k, v = cache.debug_get_kv(s, 0, k_old.shape[1])
        for layer in range(L):
            for kv, got, old in ((0, k, k_old), (1, v, v_old)):
                want = _requantized(old[layer], s3[layer, kv], fmt)
                np.testing.assert_allclose(got[layer], want, rtol=1e-6, atol=0)
    s2 = s3
    cache.begin_forward([0], [1])
    qkv = (rng.standard_normal((1, HQ + 2 * HKV, D)) * 1e3).astype(np.float16)  # beyond the range: saturates
    o = np.asarray(cache.attention_with_fused_qkv(0, qkv), np.float64)
    cache.end_forward()
    assert np.array_equal(scales(), s2)
    k, v = cache.debug_get_kv(0)
    last = np.abs(k[0, -1]) / s2[0, 0][:, None]
    assert np.allclose(last.max(axis=1), largest, rtol=1e-6)  # each head's largest |code| saturated
    # the forward's attention over the stored (re-encoded, saturated) K/V, in NumPy
    q = qkv[0, :HQ].astype(np.float64)
    g = HQ // HKV
    for h in range(HQ):
        scores = k[0, :, h // g].astype(np.float64) @ q[h] / np.sqrt(D)
        p = np.exp(scores - scores.max())
        want = (p / p.sum()) @ v[0, :, h // g].astype(np.float64)
        np.testing.assert_allclose(o[0, h], want, atol=2e-2 * np.abs(want).max() + 1e-3, rtol=2e-2)
    cache.check_integrity()


def test_fp8_calibration_is_validated_and_refusals_change_nothing(rng):
    for kw, err, match in (
        (dict(calibrate=8, kv_scales=np.ones((2, HKV))), ValueError, "not both"),
        (dict(calibrate=-1), ValueError, "calibrate=-1"),
        (dict(calibrate="many"), TypeError, "calibrate"),
    ):
        with pytest.raises(err, match=match):
            _cache("llvm", "float8_e4m3fn", **kw)
    with pytest.raises(ValueError, match="scales belong to fp8 pages"):
        _cache("llvm", "", calibrate=8)
    cache = _cache("llvm", "float8_e4m3fn", calibrate=16)
    cache.set_kv_scales(1, 0.25, 0.5)  # a layer given scales is not calibrated
    cache.add_sequence(0)
    cache.begin_forward([0], [4])
    qkv = rng.standard_normal((4, HQ + 2 * HKV, D)).astype(np.float16)
    bad = qkv.copy()
    bad[2, HQ + HKV + 1, 7] = np.inf  # V of KV head 1
    with pytest.raises(ValueError, match="V of KV head 1 holds non-finite"):
        cache.attention_with_fused_qkv(0, bad)
    assert np.array_equal(cache.kv_scales(0), np.ones((2, HKV), np.float32))  # unchanged
    for layer in range(L):
        cache.attention_with_fused_qkv(layer, qkv)
    cache.end_forward()
    assert np.array_equal(cache.kv_scales(1), [[0.25, 0.25], [0.5, 0.5]])
    want = np.abs(qkv[:, HQ:].astype(np.float32)).reshape(4, 2, HKV, D).max(axis=(0, 3)) * 2 / 448
    np.testing.assert_allclose(cache.kv_scales(0), want, rtol=1e-6)
    assert cache.calibrating


def test_fp8_nan_stays_nan_and_all_zero_heads_get_the_default_scale(rng):
    """NaN K/V are stored as NaN (as 16-bit pages hold them), infinities saturate at the format's largest
    value; a head whose calibration K or V were all zeros ends the calibration with the default scale
    1.0, which later values fit, not the floor its zeros gave."""
    cache = _cache("llvm", "float8_e4m3fn", kv_scales=np.full((2, HKV), 0.01))
    cache.add_sequence(0)
    qkv = rng.standard_normal((3, HQ + 2 * HKV, D)).astype(np.float16)
    qkv[1, HQ, 5] = np.nan  # K of KV head 0
    qkv[2, HQ + HKV + 1, 9] = np.inf  # V of KV head 1
    cache.begin_forward([0], [3])
    for layer in range(L):
        cache.attention_with_fused_qkv(layer, qkv)
    cache.end_forward()
    k, v = cache.debug_get_kv(0)
    assert np.isnan(k[:, 1, 0, 5]).all() and np.isnan(k).sum() == L and not np.isnan(v).any()
    assert (v[:, 2, 1, 9] == np.float32(448) * np.float32(0.01)).all()

    cal = _cache("llvm", "float8_e4m3fn", calibrate=4)
    cal.add_sequence(0)
    x = rng.standard_normal((4, HQ + 2 * HKV, D)).astype(np.float16)
    x[:, HQ + HKV] = 0  # V of KV head 0: all zeros during the calibration
    cal.begin_forward([0], [4])
    for layer in range(L):
        cal.attention_with_fused_qkv(layer, x)
    cal.end_forward()
    assert not cal.calibrating
    want = np.abs(x[:, HQ + HKV + 1].astype(np.float32)).max() * 2 / 448
    np.testing.assert_allclose(cal.kv_scales(0)[1], [1.0, want], rtol=1e-6)
    later = rng.standard_normal((1, HQ + 2 * HKV, D)).astype(np.float16)
    cal.begin_forward([0], [1])
    for layer in range(L):
        cal.attention_with_fused_qkv(layer, later)
    cal.end_forward()
    _, v = cal.debug_get_kv(0)
    assert (v[:, :4, 0] == 0).all()
    stored, exact = v[0, 4, 0], later[0, HQ + HKV].astype(np.float32)
    np.testing.assert_allclose(stored, exact, rtol=2**-4, atol=2**-9)  # e4m3 rounding under scale 1.0


def test_fp8_imports_into_a_calibrating_cache(rng):
    """Codes moved into a cache while it calibrates are stored under its scales of the moment (a head
    whose calibration saw only zeros first gets the default 1.0, so the moved values fit) and re-encoded
    with the rest when a later calibrating forward raises the scales (NumPy references); the public
    ``requantize_pages`` refuses bad arguments and changes nothing then."""
    from tvmkv.runtime import transfer

    fmt = "float8_e4m3fn"
    cal = _cache("llvm", fmt, calibrate=64)
    cal.add_sequence(0)
    x = rng.standard_normal((4, HQ + 2 * HKV, D)).astype(np.float16)
    x[:, HQ + HKV] = 0  # V of KV head 0: zeros so far
    cal.begin_forward([0], [4])
    for layer in range(L):
        cal.attention_with_fused_qkv(layer, x)
    cal.end_forward()
    src = _cache("llvm", fmt, kv_scales=np.full((2, HKV), 0.02))
    src.add_sequence(3)
    _prefill(src, rng, 3, 5, amp=2.0)
    k_src, v_src = src.debug_get_kv(3)
    transfer.move_sequence(src, 3, cal, 9)  # cal holds tokens: the codes are re-encoded to its scales
    assert cal.calibrating
    moved = np.stack([cal.kv_scales(layer) for layer in range(L)])
    assert (moved[:, 1, 0] == 1.0).all()
    k, v = cal.debug_get_kv(9)
    for layer in range(L):
        np.testing.assert_allclose(k[layer], _requantized(k_src[layer], moved[layer, 0], fmt), rtol=1e-6, atol=0)
        np.testing.assert_allclose(v[layer], _requantized(v_src[layer], moved[layer, 1], fmt), rtol=1e-6, atol=0)
    k_mid, v_mid = k, v
    _prefill(cal, rng, 0, 2, amp=300.0)  # still calibrating: the scales grow over the moved codes
    grown = np.stack([cal.kv_scales(layer) for layer in range(L)])
    assert (grown > moved).all()
    k, v = cal.debug_get_kv(9)
    for layer in range(L):
        np.testing.assert_allclose(k[layer], _requantized(k_mid[layer], grown[layer, 0], fmt), rtol=1e-6, atol=0)
        np.testing.assert_allclose(v[layer], _requantized(v_mid[layer], grown[layer, 1], fmt), rtol=1e-6, atol=0)
    pages = cal.sequence_pages(9)
    free = next(p for p in range(cal.config.total_pages) if cal.pool.ref_count(p) == 0)
    for args, err, match in (
        ((0, pages, [[1.0] * HKV]), ValueError, "from_scales"),
        ((0, pages, [[1.0] * HKV, [1.0, 2.0, 3.0]]), ValueError, "from_scales"),
        ((0, pages, [[1.0] * HKV, [-1.0] * HKV]), ValueError, r"from_scales\[1\] \(V\)"),
        ((0, [free], np.ones((2, HKV))), ValueError, "held"),
        ((0, pages[:1] * 2, np.ones((2, HKV))), ValueError, "distinct"),
        ((0, None, np.ones((2, HKV))), TypeError, "page_ids"),
        ((L, pages, np.ones((2, HKV))), ValueError, "out of range"),
    ):
        with pytest.raises(err, match=match):
            cal.requantize_pages(*args)
    assert np.array_equal(np.stack(cal.debug_get_kv(9)), np.stack([k, v]))
    cal.check_integrity()
    # a sender still calibrating, a head of zeros so far: an empty receiver takes 1.0 for that head, never
    # the calibration's floor (under which every later value would vanish), by a move or a checkpoint
    from tvmkv.runtime import checkpoint

    zeros = _cache("llvm", fmt, calibrate=64)
    zeros.add_sequence(0)
    zeros.begin_forward([0], [4])
    for layer in range(L):
        zeros.attention_with_fused_qkv(layer, x)  # V of KV head 0 all zeros
    zeros.end_forward()
    ckpt = checkpoint.export_checkpoint(zeros, 0)
    for receive in ("move", "checkpoint"):
        empty = _cache("llvm", fmt)
        if receive == "move":
            transfer.move_sequence(zeros, 0, empty, 1)
        else:
            checkpoint.import_checkpoint(empty, 1, ckpt)
        assert (np.stack([empty.kv_scales(layer) for layer in range(L)])[:, 1, 0] == 1.0).all()
        ones = np.ones((1, HQ + 2 * HKV, D), np.float16)
        empty.begin_forward([1], [1])
        for layer in range(L):
            empty.attention_with_fused_qkv(layer, ones)
        empty.end_forward()
        _, v = empty.debug_get_kv(1)
        assert (v[:, :4, 0] == 0).all() and (v[:, 4, 0] == 1.0).all()


@pytest.mark.parametrize("rope", ["none", "normal"])
def test_fp8_prefills_over_history_in_a_random_stream(target, rope, rng):
    """Chunked prefills over fp8 history of mixed sizes between forks inside and at page boundaries,
    rollbacks, removals and decode steps: every output against the quantized model, every stored value
    exact, the pool's accounting intact. Rope mode "none" reads q from qkv in place
    (``paged_prefill_causal_qkv``), "normal" rotates it first."""
    fmt = "float8_e4m3fn"
    scales = rng.uniform(0.004, 0.03, (L, 2, HKV)).astype(np.float32)
    cache = _cache(
        target, fmt, kv_scales=scales, max_batch_size=4, max_total_seq_len=2048, prefill_chunk_size=256, rope_mode=rope
    )
    model = CacheModel(L, HQ, HKV, D, dtype="float16", kv_store=_store(scales, fmt), rope_mode=rope)
    live, next_id = [], 0
    for _ in range(24):
        if len(live) < 3 or rng.random() < 0.2:  # a new sequence, or a fork of a live one
            if live and rng.random() < 0.5:
                parent = live[rng.integers(len(live))]
                n = cache.sequence_length(parent)
                at = int(rng.choice([n, n // P * P, max(n - 5, 1)]))
                cache.fork_sequence(parent, next_id, at)
                model.fork(parent, next_id, at)
            else:
                cache.add_sequence(next_id)
                model.add(next_id)
            live.append(next_id)
            next_id += 1
        if len(live) > 3:  # a departure
            gone = live.pop(int(rng.integers(len(live))))
            cache.remove_sequence(gone)
            model.remove(gone)
        ids = [int(s) for s in rng.permutation(live)[: int(rng.integers(1, len(live) + 1))]]
        if rng.random() < 0.3:  # decode
            lens = [1] * len(ids)
        else:  # a chunk of a prefill: from one token to two query blocks of the sm_90 schedule
            lens = [int(x) for x in rng.choice([1, 9, 40, 64, 90, 200], len(ids))]
            while sum(lens) > 256:
                lens[int(np.argmax(lens))] //= 2
        grows = [cache.sequence_length(s) + n for s, n in zip(ids, lens)]
        if max(grows) > 700:  # keep the pool from filling: roll the longest back
            s = ids[int(np.argmax(grows))]
            k = cache.sequence_length(s) // 2
            cache.pop_n(s, k)
            model.pop(s, k)
        # (stored values compared exactly in rope mode "none" only: a rotated key one fp16 ulp off the
        # fp64 model's, from fp32 cos / sin, may round to the neighbouring fp8 code)
        _step(cache, model, rng, ids, lens, check_kv=ids[:1] if rope == "none" else ())
        cache.check_integrity()


def test_fp8_prefill_over_a_shared_prefix(target, rng):
    """Forks sharing a long prefix, then a prefill of 64 tokens each over it: the forward's page table
    lists more pages than the pool holds (the shared ones once per sequence), and every output matches
    the quantized model."""
    fmt = "float8_e4m3fn"
    scales = rng.uniform(0.004, 0.03, (L, 2, HKV)).astype(np.float32)
    cache = _cache(target, fmt, kv_scales=scales, max_batch_size=4, num_pages=56, prefill_chunk_size=256)
    model = CacheModel(L, HQ, HKV, D, dtype="float16", kv_store=_store(scales, fmt))
    cache.add_sequence(0)
    model.add(0)
    for n in (200, 200, 200, 40):  # a 40-page prefix
        _step(cache, model, rng, [0], [n])
    for child in (1, 2, 3):
        cache.fork_sequence(0, child, 640)
        model.fork(0, child, 640)
    assert cache.num_available_pages() == 16
    # 3 x 44 page-table entries > 56 pages: 52 distinct (the 40 shared once, 4 of each sequence's own)
    _step(cache, model, rng, [1, 2, 3], [64, 64, 64], check_kv=(2, 3))
    _step(cache, model, rng, [0, 1, 2, 3], [1, 1, 1, 1])
    cache.check_integrity()
