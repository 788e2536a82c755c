"""Checkpoints in TVM's page-group format (tvmkv.runtime.checkpoint) and moving a sequence between
caches (tvmkv.runtime.transfer), on the CPU.

Oracles: the K/V rows written into the cache (NumPy), a NumPy attention of the next token, and TVM's
own C++ cache built in this process with TVM's CPU kernels (as TVM's CPU test file builds it): its
metadata, layout hash and page groups must equal tvmkv's byte for byte, and checkpoints move both ways.
"""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import HAS_GPU

import tvmkv
from tvmkv.relax import TvmBuiltinOverride
from tvmkv.runtime import checkpoint, transfer

H_QO, H_KV, D, L = 4, 2, 16, 2
SM_SCALE = D**-0.5
G = "vm.builtin.attention_kv_cache_"  # TVM's checkpoint globals: G + "get_checkpoint_metadata", ...


def _cache(page_size=4, **kw):
    opts = dict(page_size=page_size, max_batch_size=4, max_total_seq_len=64, prefill_chunk_size=32, dtype="float32")
    opts.update(kw)
    return tvmkv.PagedAttentionKVCache(L, H_QO, H_KV, D, **opts)


def _rows(n, seed):
    """Fused qkv rows of ``n`` tokens for every layer: ``[L, n, H_QO + 2 H_KV, D]``."""
    return np.random.default_rng(seed).standard_normal((L, n, H_QO + 2 * H_KV, D)).astype(np.float32)


def _fill(cache, seq_id, rows):
    cache.add_sequence(seq_id)
    cache.begin_forward([seq_id], [rows.shape[1]])
    for layer in range(L):
        cache.attention_with_fused_qkv(layer, rows[layer])
    cache.end_forward()


def _k(rows):
    return rows[..., H_QO : H_QO + H_KV, :]


def _v(rows):
    return rows[..., H_QO + H_KV :, :]


def _attend(q, k, v):
    """One query ``q [H_QO, D]`` over ``k, v [n, H_KV, D]`` (float64, GQA, every key visible)."""
    g = H_QO // H_KV
    out = np.zeros((H_QO, D))
    for h in range(H_QO):
        s = k[:, h // g].astype(np.float64) @ q[h] * SM_SCALE
        p = np.exp(s - s.max())
        out[h] = p @ v[:, h // g] / p.sum()
    return out


def _decode_matches_numpy(step, history, new):
    """``step(layer, row)`` runs layer ``layer``'s decode of ``new [L, 1, ., D]`` over ``history``."""
    for layer in range(L):
        o = step(layer, new[layer])
        keys = np.concatenate([history[layer], new[layer]])
        np.testing.assert_allclose(o[0], _attend(new[layer, 0, :H_QO], _k(keys), _v(keys)), atol=2e-5)


def _group_of(rows, layer, page_size):
    """The page group TVM defines for ``rows``' tokens of ``layer``: ``[1, m, 2, H_KV, P, D]``, zeros past n."""
    n = rows.shape[1]
    m = -(-n // page_size)
    g = np.zeros((1, m * page_size, 2, H_KV, D), np.float32)
    g[0, :n, 0], g[0, :n, 1] = _k(rows[layer]), _v(rows[layer])
    return g.reshape(1, m, page_size, 2, H_KV, D).transpose(0, 1, 3, 4, 2, 5)


def _state(cache):
    """What an error must leave unchanged: sequences, lengths, free pages, pending imports."""
    return (
        {s: cache.sequence_length(s) for s in cache.sequence_ids()},
        cache.num_available_pages(),
        checkpoint.pending_imports(cache),
    )


def _decode(cache, seq_id, history, new):
    cache.begin_forward([seq_id], [1])
    _decode_matches_numpy(lambda layer, row: cache.attention_with_fused_qkv(layer, row), history, new)
    cache.end_forward()


# ---------------------------------------------------------------------------------------------- tvmkv -> tvmkv


@pytest.mark.parametrize("n", [10, 8, 1])
def test_round_trip_between_tvmkv_caches(n):
    """Sequence 3 of one cache -> sequence 0 of a fresh cache: the page groups are the rows' tokens page
    by page (zeros past n), debug_get_kv agrees, and a decode step after the import matches NumPy."""
    rows, new = _rows(n, n), _rows(1, 100 + n)
    src, dst = _cache(), _cache()
    src.add_sequence(0)  # sequence 3 does not start at page 0
    _fill(src, 3, rows)
    ckpt = checkpoint.export_checkpoint(src, 3)
    meta = json.loads(ckpt.metadata)
    assert meta["seq_id"] == 3 and meta["seq_length"] == n and meta["layout_hash"] == checkpoint.layout_hash(src)
    assert [p["length"] for p in meta["logical_pages"]] == [min(4, n - i) for i in range(0, n, 4)]
    for layer in range(L):
        np.testing.assert_array_equal(ckpt.groups[layer], _group_of(rows, layer, 4))
    checkpoint.import_checkpoint(dst, 0, ckpt)
    k, v = dst.debug_get_kv(0)
    np.testing.assert_array_equal(k, _k(rows))
    np.testing.assert_array_equal(v, _v(rows))
    assert dst.sequence_length(0) == n and checkpoint.pending_imports(dst) == []
    dst.check_integrity()
    _decode(dst, 0, rows, new)
    _decode(src, 3, rows, new)
    dst.check_integrity()


def test_page_group_step_by_step_with_tvm_and_torch_tensors():
    """The six calls one by one, groups out of order, destinations of every kind; the import's pages
    are held (not free) while pending and handed to the sequence at finish."""
    import torch

    rows = _rows(7, 1)
    src, dst = _cache(), _cache()
    _fill(src, 0, rows)
    meta = checkpoint.checkpoint_metadata(src, 0)
    shape = checkpoint.page_group_shape(src, 2)
    outs = [tvm.runtime.empty(shape, "float32", tvm.cpu()), torch.full(shape, 7.0)]
    checkpoint.export_page_group(src, 0, 1, outs[0])
    checkpoint.export_page_group(src, 0, 0, outs[1])
    free = dst.num_available_pages()
    checkpoint.prepare_import(dst, 5, meta)
    assert dst.num_available_pages() == free - 2 and checkpoint.pending_imports(dst) == [5]
    assert 5 not in dst.sequence_ids()
    dst.check_integrity()  # the reserved pages are counted (held by the import reservations)
    checkpoint.import_page_group(dst, 5, 1, outs[0])
    checkpoint.import_page_group(dst, 5, 0, outs[1])
    checkpoint.finish_import(dst, 5)
    assert dst.num_available_pages() == free - 2
    k, _ = dst.debug_get_kv(5)
    np.testing.assert_array_equal(k, _k(rows))
    dst.check_integrity()
    dst.remove_sequence(5)
    assert dst.num_available_pages() == free
    dst.check_integrity()


# ---------------------------------------------------------------------------------------------- TVM's cache


def _tvm_kernels(page_size):
    """TVM's CPU kernels of the test shape, built once (TVM's CPU test file's set)."""
    from tvm.relax.frontend.nn.llm.kv_cache import (  # TVM's CPU test file imports the same factories
        _attention_decode_cpu,
        _attention_prefill_cpu,
        _attention_prefill_ragged_cpu,
        _compact_kv_copy_cpu,
        _copy_single_page_cpu,
        _kv_cache_debug_get_kv,
        _kv_cache_transpose_append,
        _merge_state_inplace_cpu,
        llama_rope_with_position_map,
        tree_attn_cpu,
        tree_attn_with_paged_kv_cache_cpu,
    )

    key = ("tvm_kernels", page_size)
    if key not in _BUILT:
        rs: dict = {}
        f32 = "float32"
        funcs = {
            "append": _kv_cache_transpose_append(H_KV, D, f32),
            "debug": _kv_cache_debug_get_kv(L, H_KV, D, f32),
            "prefill": _attention_prefill_cpu(H_KV, H_QO, D, f32, False, rs),
            "decode": _attention_decode_cpu(H_KV, H_QO, D, f32, False, rs),
            "prefill_sw": _attention_prefill_cpu(H_KV, H_QO, D, f32, True, rs, sliding_window_size=1024),
            "decode_sw": _attention_decode_cpu(H_KV, H_QO, D, f32, True, rs),
            "ragged": _attention_prefill_ragged_cpu(H_KV, H_QO, D, D, f32, rs),
            "tree": tree_attn_cpu(H_KV, H_QO, D, f32, rs),
            "tree_paged": tree_attn_with_paged_kv_cache_cpu(H_KV, H_QO, D, f32, rs),
            "merge": _merge_state_inplace_cpu(f32),
            "rope": llama_rope_with_position_map(1e4, 1.0, D, H_QO, H_KV, f32, rs),
            "copy_page": _copy_single_page_cpu(H_KV, page_size, D, f32),
            "compact": _compact_kv_copy_cpu(H_KV, D, f32),
        }
        mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
        lib = tvm.tirx.build(mod, target="llvm")
        _BUILT[key] = {name: lib[name] for name in funcs}
    return _BUILT[key]


_BUILT: dict = {}
# TVM's create, fetched before any test installs the drop-in (which makes the name build tvmkv caches)
_TVM_CREATE = tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")


def _tvm_cache(page_size=16, *, rope_mode=0, rope_scale=1.0, rope_theta=1e4):
    """TVM's own ``PagedAttentionKVCache`` (C++), created as TVM's CPU test file creates it:
    4 sequences, 64 tokens (ceil(64 / P) + 1 pages), chunks of 32, float32, TVM's CPU kernels."""
    f = _tvm_kernels(16)  # TVM's append kernel is written for pages of 16
    return _TVM_CREATE(
        tvm_ffi.Shape([4, 64, 32, page_size, 0]),
        tvm_ffi.Shape([0, L]),
        H_QO,
        H_KV,
        D,
        D,
        tvm_ffi.Shape([0] * L),  # AttnKind.MHA
        False,
        rope_mode,
        rope_scale,
        rope_theta,
        None,
        tvm.runtime.empty((), "float32", tvm.cpu()),
        f["append"],
        None,
        ["tirx", f["ragged"]],
        ["tirx", f["prefill"]],
        ["tirx", f["decode"]],
        ["tirx", f["prefill_sw"]],
        ["tirx", f["decode_sw"]],
        ["tirx", f["tree_paged"]],
        ["tirx", f["tree"]],
        [],
        [f["merge"]],
        f["rope"],
        f["copy_page"],
        f["debug"],
        f["compact"],
    )


def _g(name):
    return tvm.get_global_func("vm.builtin." + name)


def _tvm_fill(cache, rows):
    _g("kv_state_add_sequence")(cache, 0)
    _tvm_forward(cache, rows)


def _tvm_forward(cache, rows):
    n = rows.shape[1]
    _g("kv_state_begin_forward")(cache, tvm_ffi.Shape([0]), tvm_ffi.Shape([n]))
    outs = []
    for layer in range(L):
        o = tvm.runtime.empty((n, H_QO, D), "float32", tvm.cpu())
        _g("attention_kv_cache_attention_with_fused_qkv")(cache, layer, SM_SCALE, tvm.runtime.tensor(rows[layer]), o)
        outs.append(o.numpy())
    _g("kv_state_end_forward")(cache)
    return outs


def _tvm_kv(cache, n):
    k = tvm.runtime.empty((L, n, H_KV, D), "float32", tvm.cpu())
    v = tvm.runtime.empty((L, n, H_KV, D), "float32", tvm.cpu())
    _g("attention_kv_cache_debug_get_kv")(cache, 0, 0, n, k, v)
    return k.numpy(), v.numpy()


def _export_with_globals(cache, n, page_size=16):
    """(metadata, groups) through TVM's global names (TVM's implementation or the drop-in's)."""
    meta = tvm.get_global_func(G + "get_checkpoint_metadata")(cache, 0)
    m = -(-n // page_size)
    groups = []
    for layer in range(L):
        t = tvm.runtime.empty((1, m, 2, H_KV, page_size, D), "float32", tvm.cpu())
        tvm.get_global_func(G + "export_page_group")(cache, 0, layer, t)
        groups.append(t)
    return str(meta), groups


def _import_with_globals(cache, meta, groups):
    tvm.get_global_func(G + "prepare_import")(cache, 0, meta)
    for layer, t in enumerate(groups):
        tvm.get_global_func(G + "import_page_group")(cache, 0, layer, t)
    tvm.get_global_func(G + "finish_import")(cache, 0)


@pytest.fixture
def override():
    with TvmBuiltinOverride() as o:
        yield o


def test_tvm_and_tvmkv_write_the_same_checkpoint(override):
    """The same 20 tokens (a full page of 16 and a partial one) in TVM's cache and in tvmkv's: equal
    metadata JSON (byte for byte), layout hash and page groups, each through TVM's global names (the
    drop-in dispatches the tvmkv cache to tvmkv, TVM's cache to TVM)."""
    rows = _rows(20, 2)
    theirs, ours = _tvm_cache(), _cache(16, num_pages=5)
    assert not isinstance(theirs, tvmkv.PagedAttentionKVCache)
    _tvm_fill(theirs, rows)
    _fill(ours, 0, rows)
    meta_t, groups_t = _export_with_globals(theirs, 20)
    meta_o, groups_o = _export_with_globals(ours, 20)
    assert meta_o == meta_t
    hash_of = tvm.get_global_func(G + "get_layout_hash")
    assert hash_of(ours) == hash_of(theirs) == json.loads(meta_t)["layout_hash"]
    for layer in range(L):
        np.testing.assert_array_equal(groups_o[layer].numpy(), groups_t[layer].numpy())
        np.testing.assert_array_equal(groups_o[layer].numpy(), _group_of(rows, layer, 16))


def test_checkpoint_from_tvm_imports_into_tvmkv_and_back(override):
    """TVM -> tvmkv: the imported K/V are TVM's and tvmkv's next decode step matches NumPy.
    tvmkv -> TVM: TVM's debug_get_kv reads the rows back and TVM's next decode step matches NumPy."""
    rows, new = _rows(20, 3), _rows(1, 4)
    theirs = _tvm_cache()
    _tvm_fill(theirs, rows)
    meta, groups = _export_with_globals(theirs, 20)
    ours = _cache(16, num_pages=5)
    _import_with_globals(ours, meta, groups)
    k, v = ours.debug_get_kv(0)
    np.testing.assert_array_equal(k, _k(rows))
    np.testing.assert_array_equal(v, _v(rows))
    ours.check_integrity()
    _decode(ours, 0, rows, new)

    rows2, new2 = _rows(21, 5), _rows(1, 6)
    ours2 = _cache(16, num_pages=5)
    _fill(ours2, 0, rows2)
    meta2, groups2 = _export_with_globals(ours2, 21)
    back = _tvm_cache()
    _import_with_globals(back, meta2, groups2)
    k, v = _tvm_kv(back, 21)
    np.testing.assert_array_equal(k, _k(rows2))
    np.testing.assert_array_equal(v, _v(rows2))
    outs = _tvm_forward(back, new2)
    _decode_matches_numpy(lambda layer, row: outs[layer], rows2, new2)


@pytest.mark.parametrize("rope", [("none", 0, 1.0, 1e4), ("inline", 2, 0.1, 5e5)])
def test_layout_hash_and_metadata_equal_tvms(rope, override):
    """For pages of 4 and a RoPE mode / scale / theta (0.1 prints as 0.10000000000000001 in the
    descriptor), TVM's and tvmkv's layout hashes and the metadata of an empty sequence agree."""
    name, mode, scale, theta = rope
    theirs = _tvm_cache(4, rope_mode=mode, rope_scale=scale, rope_theta=theta)
    ours = _cache(4, rope_mode=name, rope_scale=scale, rope_theta=theta, num_pages=17)
    assert "rotary_scale=" + ("1;" if scale == 1.0 else "0.10000000000000001;") in checkpoint.layout_descriptor(ours)
    assert tvm.get_global_func(G + "get_layout_hash")(theirs) == checkpoint.layout_hash(ours)
    _g("kv_state_add_sequence")(theirs, 0)
    ours.add_sequence(0)
    meta = str(tvm.get_global_func(G + "get_checkpoint_metadata")(theirs, 0))
    assert checkpoint.checkpoint_metadata(ours, 0) == meta
    empty = np.zeros(checkpoint.page_group_shape(ours, 0), np.float32)  # TVM's empty sequence imports too
    checkpoint.import_checkpoint(ours, 1, checkpoint.Checkpoint(meta, [empty] * L))
    assert ours.sequence_length(1) == 0 and ours.sequence_info(1).pages == ()
    ours.check_integrity()


def test_tvm_refuses_a_checkpoint_of_another_layout(override):
    """TVM's own import refuses tvmkv's checkpoint of pages of 4 (its cache has 16), as tvmkv refuses
    TVM's; the tvmkv cache stays as it was."""
    rows = _rows(5, 7)
    ours = _cache(4)
    _fill(ours, 0, rows)
    meta, _ = _export_with_globals(ours, 5, page_size=4)
    with pytest.raises(Exception, match="page_size"):  # noqa: B017 (TVM's InternalError)
        tvm.get_global_func(G + "prepare_import")(_tvm_cache(), 0, meta)
    theirs = _tvm_cache()
    _tvm_fill(theirs, _rows(5, 8))
    meta_t, _ = _export_with_globals(theirs, 5)
    before = _state(ours)
    with pytest.raises(ValueError, match="'page_size' is 16 but this cache has 4"):
        checkpoint.prepare_import(ours, 1, meta_t)
    assert _state(ours) == before


# ---------------------------------------------------------------------------------------------- errors


def test_import_errors_leave_the_cache_unchanged():
    rows = _rows(6, 9)
    src, dst = _cache(), _cache()
    _fill(src, 0, rows)
    dst.add_sequence(4)
    ckpt = checkpoint.export_checkpoint(src, 0)
    meta = json.loads(ckpt.metadata)
    before = _state(dst)

    def bad(**change):
        return json.dumps({**meta, **change})

    for text, err, match in [
        (bad(layout_hash="0123456789abcdef"), ValueError, "layout hash 0123456789abcdef does not match"),
        (bad(num_kv_heads=4), ValueError, "'num_kv_heads' is 4 but this cache has 2"),
        (bad(dtype="float16"), ValueError, "'dtype' is 'float16' but this cache has 'float32'"),
        (bad(rope_mode="normal"), ValueError, "'rope_mode' is 'normal'"),
        (bad(seq_length=9), ValueError, "needs 3 logical pages but the metadata lists 2"),
        (bad(format_version=True), ValueError, "not a JSON int"),
        ("{not json", ValueError, "not valid JSON"),
        ("[1, 2]", ValueError, "must be a JSON object"),
    ]:
        with pytest.raises(err, match=match):
            checkpoint.prepare_import(dst, 1, text)
        assert _state(dst) == before
    with pytest.raises(KeyError, match="already in the cache"):
        checkpoint.prepare_import(dst, 4, ckpt.metadata)
    with pytest.raises(KeyError, match="no import of sequence 1 is pending"):
        checkpoint.import_page_group(dst, 1, 0, ckpt.groups[0])
    assert _state(dst) == before
    dst.check_integrity()

    checkpoint.prepare_import(dst, 1, ckpt.metadata)
    pending = _state(dst)
    for src_array, match in [
        (ckpt.groups[0].astype(np.float64), "dtype float64"),
        (ckpt.groups[0][:, :1].copy(), r"shape \(1, 1, 2, 2, 4, 16\)"),
        (np.asfortranarray(ckpt.groups[0]), "not contiguous"),
    ]:
        with pytest.raises(ValueError, match=match):
            checkpoint.import_page_group(dst, 1, 0, src_array)
    with pytest.raises(ValueError, match="group_id 2 is out of range"):
        checkpoint.import_page_group(dst, 1, 2, ckpt.groups[0])
    with pytest.raises(KeyError, match="already being imported"):
        checkpoint.prepare_import(dst, 1, ckpt.metadata)
    with pytest.raises(ValueError, match=r"missing page groups \[0, 1\]"):
        checkpoint.finish_import(dst, 1)
    checkpoint.import_page_group(dst, 1, 0, ckpt.groups[0])
    with pytest.raises(ValueError, match="already imported"):
        checkpoint.import_page_group(dst, 1, 0, ckpt.groups[0])
    assert _state(dst) == pending
    # an unfinished import is no sequence of the cache: no forward, no length, no export
    with pytest.raises(KeyError):
        dst.begin_forward([1], [1])
    assert not dst.forward_open
    with pytest.raises(KeyError):
        dst.sequence_length(1)
    with pytest.raises(KeyError, match="being imported"):
        checkpoint.checkpoint_metadata(dst, 1)
    dst.check_integrity()
    checkpoint.abort_import(dst, 1)
    assert _state(dst) == before
    dst.check_integrity()
    with pytest.raises(KeyError, match="no import of sequence 1 is pending"):
        checkpoint.finish_import(dst, 1)


def test_abandoned_imports_free_their_pages():
    """abort_import, cache.clear(), an id taken while pending (finish refuses, abort frees), a
    shortage (OutOfPagesError, nothing reserved)."""
    rows = _rows(9, 10)
    src = _cache()
    _fill(src, 0, rows)
    ckpt = checkpoint.export_checkpoint(src, 0)
    dst = _cache(num_pages=5, max_total_seq_len=20)
    checkpoint.prepare_import(dst, 0, ckpt.metadata)
    assert dst.num_available_pages() == 2
    with pytest.raises(tvmkv.OutOfPagesError, match="needs 3 free pages but only 2"):
        checkpoint.prepare_import(dst, 1, ckpt.metadata)
    assert checkpoint.pending_imports(dst) == [0]
    dst.clear()
    assert checkpoint.pending_imports(dst) == [] and dst.num_available_pages() == 5 and dst.is_empty()
    dst.check_integrity()

    checkpoint.prepare_import(dst, 2, ckpt.metadata)
    for g in range(L):
        checkpoint.import_page_group(dst, 2, g, ckpt.groups[g])
    with pytest.raises(KeyError, match="an import into it is in progress"):
        dst.add_sequence(2)  # the id is reserved while its import is pending
    checkpoint.abort_import(dst, 2)
    assert dst.num_available_pages() == 5 and dst.sequence_ids() == []
    dst.add_sequence(2)  # free again
    dst.check_integrity()


def test_export_errors_and_refused_sequences():
    rows = _rows(6, 11)
    cache = _cache(support_sliding_window=True)
    _fill(cache, 0, rows)
    shape = checkpoint.page_group_shape(cache, 2)
    dst = np.full(shape, 3.0, np.float32)
    for args, err, match in [
        ((9, 0, dst), KeyError, "sequence 9 is not in the cache"),
        ((0, 2, dst), ValueError, "group_id 2 is out of range"),
        ((0, 0, np.zeros(checkpoint.page_group_shape(cache, 3), np.float32)), ValueError, "expected|shape"),
        ((0, 0, dst.astype(np.float16)), ValueError, "dtype float16"),
        ((0, 0, "dst"), TypeError, "numpy.ndarray"),
    ]:
        with pytest.raises(err, match=match):
            checkpoint.export_page_group(cache, *args)
    assert (dst == 3.0).all()
    # a sequence with a sliding window, one with an uncommitted token tree
    cache.add_sequence(1)
    cache.enable_sliding_window_for_seq(1, 8, 0)
    with pytest.raises(ValueError, match="sliding window"):
        checkpoint.checkpoint_metadata(cache, 1)
    cache.begin_forward([0], [2], [-1, 0])
    with pytest.raises(tvmkv.ForwardStateError):
        checkpoint.export_page_group(cache, 0, 0, dst)
    for layer in range(L):
        cache.attention_with_fused_qkv(layer, _rows(2, 12)[layer])
    cache.end_forward()
    with pytest.raises(ValueError, match="uncommitted token-tree nodes"):
        checkpoint.checkpoint_metadata(cache, 0)
    cache.swap_out([1])
    with pytest.raises(tvmkv.SequenceSwappedError):
        checkpoint.checkpoint_metadata(cache, 1)
    assert (dst == 3.0).all()
    cache.check_integrity()


def test_checkpoints_of_sliding_window_caches_stay_between_them():
    """A cache built with support_sliding_window holds the same pages; its descriptor says so, so its
    hash differs and a cache without it refuses the checkpoint (TVM refuses such caches altogether)."""
    rows = _rows(5, 13)
    sw, plain = _cache(support_sliding_window=True), _cache()
    _fill(sw, 0, rows)
    assert "support_sliding_window=1;" in checkpoint.layout_descriptor(sw)
    assert checkpoint.layout_hash(sw) != checkpoint.layout_hash(plain)
    ckpt = checkpoint.export_checkpoint(sw, 0)
    with pytest.raises(ValueError, match="'support_sliding_window' is True but this cache has False"):
        checkpoint.import_checkpoint(plain, 0, ckpt)
    assert plain.is_empty()
    other = _cache(support_sliding_window=True)
    checkpoint.import_checkpoint(other, 0, ckpt)
    np.testing.assert_array_equal(other.debug_get_kv(0)[0], _k(rows))


def test_drop_in_globals_refuse_like_the_native_calls(override):
    rows = _rows(5, 14)
    cache = _cache()
    _fill(cache, 0, rows)
    with pytest.raises(KeyError, match="sequence 3 is not in the cache"):
        tvm.get_global_func(G + "get_checkpoint_metadata")(cache, 3)
    meta = tvm.get_global_func(G + "get_checkpoint_metadata")(cache, 0)
    with pytest.raises(KeyError, match="already in the cache"):
        tvm.get_global_func(G + "prepare_import")(cache, 0, meta)
    tvm.get_global_func(G + "prepare_import")(cache, 1, meta)
    with pytest.raises(ValueError, match="missing page groups"):
        tvm.get_global_func(G + "finish_import")(cache, 1)
    checkpoint.abort_import(cache, 1)
    assert cache.sequence_ids() == [0] and cache.num_available_pages() == cache.config.total_pages - 2
    cache.check_integrity()


# ---------------------------------------------------------------------------------------------- transfer


def test_send_a_sequence_to_a_peer_cache():
    rows, new = _rows(11, 15), _rows(1, 16)
    sender, receiver = _cache(), _cache(max_batch_size=2, num_pages=12, max_total_seq_len=48)  # capacity may differ
    sender.add_sequence(7)
    _fill(sender, 3, rows)
    receiver.add_sequence(0)
    recv = transfer.prepare_receive(receiver, 5, 11)
    assert recv.pending and recv.num_pages == 3 and receiver.num_available_pages() == 9
    receiver.check_integrity()
    with pytest.raises(ValueError, match="nothing was sent"):
        recv.commit()
    transfer.send_sequence(sender, 3, recv)
    recv.commit()
    assert not recv.pending and receiver.sequence_length(5) == 11
    k, v = receiver.debug_get_kv(5)
    np.testing.assert_array_equal(k, _k(rows))
    np.testing.assert_array_equal(v, _v(rows))
    receiver.check_integrity()
    _decode(receiver, 5, rows, new)
    _decode(sender, 3, rows, new)
    recv.abort()  # a committed receive: nothing to free
    assert receiver.sequence_ids() == [0, 5]
    receiver.check_integrity()
    # move_sequence: prepare, send, commit in one call, then drop the sender's copy
    assert transfer.move_sequence(sender, 3, receiver, 6, remove=True) == 6
    assert sender.sequence_ids() == [7]
    np.testing.assert_array_equal(receiver.debug_get_kv(6)[1], _v(np.concatenate([rows, new], axis=1)))
    sender.check_integrity()
    receiver.check_integrity()


def test_abandoned_receives_free_their_pages():
    rows = _rows(6, 17)
    sender, receiver = _cache(), _cache(num_pages=6, max_total_seq_len=24)
    _fill(sender, 0, rows)
    total = receiver.num_available_pages()
    recv = transfer.prepare_receive(receiver, 1, 6)
    transfer.send_sequence(sender, 0, recv)
    recv.abort()
    assert receiver.num_available_pages() == total and not recv.pending and receiver.sequence_ids() == []
    with pytest.raises(ValueError, match="no longer pending"):
        recv.commit()
    with pytest.raises(ValueError, match="no longer pending"):
        transfer.send_sequence(sender, 0, recv)
    with transfer.prepare_receive(receiver, 1, 6):  # leaving the block without commit aborts
        assert receiver.num_available_pages() == total - 2
    assert receiver.num_available_pages() == total
    recv = transfer.prepare_receive(receiver, 1, 6)
    del recv  # the last reference: aborted
    gc.collect()
    assert receiver.num_available_pages() == total
    recv = transfer.prepare_receive(receiver, 1, 6)
    receiver.clear()
    assert not recv.pending and receiver.num_available_pages() == total
    with pytest.raises(tvmkv.OutOfPagesError, match="needs 7 free pages but only 6"):
        transfer.prepare_receive(receiver, 1, 25)
    assert receiver.num_available_pages() == total and checkpoint.pending_imports(receiver) == []
    receiver.check_integrity()


def test_transfer_refuses_mismatched_caches_and_lengths():
    rows = _rows(6, 18)
    sender = _cache()
    _fill(sender, 0, rows)
    other = _cache(16)
    recv = transfer.prepare_receive(other, 0, 6)
    with pytest.raises(ValueError, match="page_size is 4 on the sender but 16 on the receiver"):
        transfer.send_sequence(sender, 0, recv)
    same = _cache()
    recv2 = transfer.prepare_receive(same, 0, 5)
    with pytest.raises(ValueError, match="holds 6 tokens but the receive of sequence 0 reserved 5"):
        transfer.send_sequence(sender, 0, recv2)
    with pytest.raises(KeyError, match="already being imported"):
        transfer.prepare_receive(same, 0, 6)
    with pytest.raises(ValueError, match="length=-1"):
        transfer.prepare_receive(same, 1, -1)
    with pytest.raises(TypeError, match="Receive"):
        transfer.send_sequence(sender, 0, "recv")
    assert not recv.sent and not recv2.sent
    recv.abort()
    recv2.abort()
    assert other.is_empty() and same.is_empty()
    sender.check_integrity()


def test_checkpoint_calls_refuse_a_transfer_receive():
    """A receive (prepare_receive) is a pending import, but not a checkpoint's: filling it with
    import_page_group and finishing it with finish_import took the pages without the checkpoint's
    length or fp8 scales checked (an 18-token checkpoint became a 20-token sequence; fp8 codes came
    back scaled by the receiver's scale over the sender's). Both refuse it now and change nothing; the
    receive still takes send_sequence and commit, and abort_import still frees it."""
    rows = _rows(6, 21)
    sender, receiver = _cache(), _cache()
    _fill(sender, 0, rows)
    cp = checkpoint.export_checkpoint(sender, 0)
    recv = transfer.prepare_receive(receiver, 1, 8)  # (the same 2 pages as the 6-token checkpoint)
    before = _state(receiver)
    with pytest.raises(ValueError, match="import_page_group: sequence 1's pending import is a transfer receive"):
        checkpoint.import_page_group(receiver, 1, 0, cp.groups[0])
    with pytest.raises(ValueError, match="finish_import: .* fill it with send_sequence"):
        checkpoint.finish_import(receiver, 1)
    with pytest.raises(KeyError, match="being imported by a transfer .*commit or abort that Receive"):
        checkpoint.prepare_import(receiver, 1, cp.metadata)
    assert _state(receiver) == before and recv.pending and not recv.sent
    checkpoint.abort_import(receiver, 1)
    assert not recv.pending and receiver.is_empty()
    recv = transfer.prepare_receive(receiver, 1, 6)
    transfer.send_sequence(sender, 0, recv)
    recv.commit()
    np.testing.assert_array_equal(receiver.debug_get_kv(1)[0], _k(rows))
    checkpoint.import_checkpoint(receiver, 2, cp)  # a checkpoint import is unaffected
    assert receiver.sequence_length(2) == 6
    np.testing.assert_array_equal(receiver.debug_get_kv(2)[1], _v(rows))
    receiver.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")
def test_move_and_checkpoint_between_gpu_and_cpu_caches():
    """A sequence of a CUDA cache moves to a CPU cache and back (TVM copies across the devices); a
    checkpoint of the CUDA cache goes through host NumPy groups and device tensors."""
    rows, new = _rows(11, 19), _rows(1, 20)
    gpu, cpu = _cache(target="cuda"), _cache()
    _fill(gpu, 0, rows)
    assert transfer.move_sequence(gpu, 0, cpu, 1) == 1
    np.testing.assert_array_equal(cpu.debug_get_kv(1)[0], _k(rows))
    _decode(cpu, 1, rows, new)
    both = np.concatenate([rows, new], axis=1)
    transfer.move_sequence(cpu, 1, gpu, 2)
    k, v = gpu.debug_get_kv(2)
    np.testing.assert_array_equal(k, _k(both))
    np.testing.assert_array_equal(v, _v(both))
    ckpt = checkpoint.export_checkpoint(gpu, 2)
    checkpoint.import_checkpoint(cpu, 3, ckpt)
    np.testing.assert_array_equal(cpu.debug_get_kv(3)[1], _v(both))
    shape = checkpoint.page_group_shape(gpu, 3)
    on_device = [tvm.runtime.empty(shape, "float32", tvm.cuda(0)) for _ in range(L)]
    for layer in range(L):
        checkpoint.export_page_group(gpu, 2, layer, on_device[layer])
        np.testing.assert_array_equal(on_device[layer].numpy(), _group_of(both, layer, 4))
    checkpoint.import_checkpoint(gpu, 4, checkpoint.Checkpoint(ckpt.metadata, on_device))
    np.testing.assert_array_equal(gpu.debug_get_kv(4)[0], _k(both))
    gpu.check_integrity()
    cpu.check_integrity()


def test_transfer_moves_an_mla_sequence():
    """MLA caches move their latent pages the same way; the moved rows equal the appended ones, and a
    cache of another kv_lora_rank is refused by name."""
    import tvmkv
    from tvmkv.runtime import transfer

    def mk(rank=32):
        return tvmkv.PagedAttentionKVCache.mla(
            2, 4, rank, 16, page_size=4, max_batch_size=4, max_total_seq_len=64, prefill_chunk_size=32,
            dtype="float32", mla_self_dims=(32, 16),
        )  # fmt: skip

    a, b = mk(), mk()
    a.add_sequence(0)
    a.begin_forward([0], [6])
    kv = np.random.default_rng(0).standard_normal((6, 48)).astype(np.float32)
    for layer in (0, 1):
        a.append_mla_kv(layer, kv)
    a.end_forward()
    with pytest.raises(ValueError, match="head_dim is 48 on the sender but 64"):
        transfer.move_sequence(a, 0, mk(48))
    transfer.move_sequence(a, 0, b)
    np.testing.assert_array_equal(b.debug_get_kv_mla(0)[1], kv)
    a.check_integrity()
    b.check_integrity()


def test_pending_import_id_is_reserved_and_remove_abandons_it():
    """While an import is pending its id cannot be added, forked into or forwarded (each error says an
    import is in progress), and ``remove_sequence`` on it abandons the import and frees its pages."""
    from tvmkv.runtime import checkpoint

    src, dst = _cache(), _cache()
    _fill(src, 0, _rows(9, 0))
    free = dst.num_available_pages()
    checkpoint.prepare_import(dst, 4, checkpoint.checkpoint_metadata(src, 0))
    dst.add_sequence(1)
    for call in (lambda: dst.add_sequence(4), lambda: dst.fork_sequence(1, 4), lambda: dst.begin_forward([4], [1])):
        with pytest.raises(KeyError, match="import"):
            call()
    dst.remove_sequence(4)
    assert dst.num_available_pages() == free and checkpoint.pending_imports(dst) == []
    dst.add_sequence(4)  # the id is free again
    dst.check_integrity()
