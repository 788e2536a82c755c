"""Regression tests of bugs found by using tvmkv adversarially (issue 14), each failing before its fix.

Oracles: attention written out in NumPy here (float64 softmax over the K/V the test put in), the K/V
the test wrote, and a fresh process under CPython's debug allocator for the memory-safety case.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tvmkv
from tvmkv import interop

H_QO, H_KV, D, P = 4, 2, 16, 4


def _cache(**kw):
    opts = dict(page_size=P, max_batch_size=4, max_total_seq_len=64, prefill_chunk_size=32, dtype="float32")
    opts.update(kw)
    return tvmkv.PagedAttentionKVCache(1, H_QO, H_KV, D, **opts)


def _attention(q, k, v):
    """q [H_qo, D] against k/v [L, H_kv, D] (float64), GQA, no mask: [H_qo, D]."""
    group = H_QO // H_KV
    out = np.zeros((H_QO, D))
    for h in range(H_QO):
        s = k[:, h // group] @ q[h] * D**-0.5
        p = np.exp(s - s.max())
        out[h] = p @ v[:, h // group] / p.sum()
    return out


def _prefill(cache, sid, n, rng):
    qkv = rng.standard_normal((n, H_QO + 2 * H_KV, D)).astype(np.float32)
    cache.begin_forward([sid], [n])
    cache.attention_with_fused_qkv(0, qkv)
    cache.end_forward()
    return qkv


def test_import_into_an_emptied_sequence_uses_its_new_pages():
    """An id popped to length 0 and imported into must read and write its new pages, not the pages it
    held before the pop (which by then belong to another sequence)."""
    rng = np.random.default_rng(0)
    cache = _cache()
    cache.add_sequence(0)
    _prefill(cache, 0, 2 * P, rng)  # sequence 0 holds pages [0, 1]
    cache.pop_n(0, 2 * P)  # empty again: pages 0 and 1 are free
    cache.add_sequence(1)
    qkv1 = _prefill(cache, 1, 2 * P, rng)  # sequence 1 now holds pages [0, 1]
    data = rng.standard_normal((1, 2, 2 * P - 1, H_KV, D)).astype(np.float32)  # [L, 2, n, H, D]
    interop.import_sequence(cache, 0, data, "contiguous")
    assert set(cache.sequence_pages(0)).isdisjoint(cache.sequence_pages(1))
    cache.check_integrity()
    q = rng.standard_normal((1, H_QO + 2 * H_KV, D)).astype(np.float32)
    cache.begin_forward([0], [1])
    o = cache.attention_with_fused_qkv(0, q)
    cache.end_forward()
    k = np.concatenate([data[0, 0], q[:, H_QO : H_QO + H_KV]]).astype(np.float64)
    v = np.concatenate([data[0, 1], q[:, H_QO + H_KV :]]).astype(np.float64)
    np.testing.assert_allclose(o[0], _attention(q[0, :H_QO].astype(np.float64), k, v), atol=1e-5)
    k1, v1 = cache.debug_get_kv(1)  # sequence 1's K/V untouched
    np.testing.assert_array_equal(k1[0], qkv1[:, H_QO : H_QO + H_KV])
    np.testing.assert_array_equal(v1[0], qkv1[:, H_QO + H_KV :])
    cache.check_integrity()


def test_import_evicts_prefix_cache_pages_before_running_out():
    """import_sequence, like begin_forward and swap_in, asks the prefix cache to evict pages only it
    holds before it raises OutOfPagesError."""
    rng = np.random.default_rng(1)
    cache = _cache(num_pages=16, max_total_seq_len=32)
    prefix = tvmkv.RadixPrefixCache(cache)
    for sid in range(3):  # three cached prompts of 4 pages each, held only by the tree
        cache.add_sequence(sid)
        _prefill(cache, sid, 4 * P, rng)
        prefix.finish_sequence(sid, list(range(100 * sid, 100 * sid + 4 * P)))
    assert cache.num_available_pages() == 4 and prefix.num_evictable_pages() == 12
    data = rng.standard_normal((1, 2, 8 * P, H_KV, D)).astype(np.float32)
    interop.import_sequence(cache, 7, data, "contiguous")  # 8 pages: 4 free + 4 evicted
    k, v = cache.debug_get_kv(7)
    np.testing.assert_array_equal(k[0], data[0, 0])
    np.testing.assert_array_equal(v[0], data[0, 1])
    prefix.check_integrity()


@pytest.mark.parametrize("bad", [2.0, True, "2", None])
def test_one_id_rule_for_every_method(bad):
    """Float, bool, str and None ids are rejected by every method (a float 2.0 or True used to act
    on sequence 2 or 1), and the cache is unchanged."""
    cache = _cache()
    for sid in (1, 2):
        cache.add_sequence(sid)
    calls = [
        lambda: cache.remove_sequence(bad),
        lambda: cache.fork_sequence(bad, 3),
        lambda: cache.pop_n(bad, 0),
        lambda: cache.begin_forward([bad], [1]),
        lambda: cache.sequence_length(bad),
        lambda: cache.debug_get_kv(bad),
        lambda: cache.num_pages_needed(bad, 1),
        lambda: cache.swap_out([bad]),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="must be an int"):
            call()
    assert cache.sequence_ids() == [1, 2] and not cache.forward_open
    cache.check_integrity()


def test_page_queries_validate_their_arguments():
    cache = _cache()
    cache.add_sequence(0)
    with pytest.raises(ValueError, match="num_tokens=-100 must be >= 0"):
        cache.num_pages_needed(0, -100)
    with pytest.raises(TypeError, match="num_tokens=1.5 must be an int"):
        cache.num_pages_needed(0, 1.5)
    assert type(cache.num_pages_needed(0, 5)) is int and cache.num_pages_needed(0, 5) == 2
    with pytest.raises(ValueError, match="twice"):
        cache.num_pages_released_by([0, 0])


_VIEW_LIFETIME = textwrap.dedent(
    """
    import numpy as np, tvm
    from tvmkv.runtime.index_buffer import IndexBuffers, RING

    ib = IndexBuffers(tvm.cpu(0), 1 << 14)
    ib.host[:] = np.arange(ib.capacity, dtype=np.int32)
    ib.upload(0, ib.capacity)
    ib.upload(1, ib.capacity)
    kept = []
    for i in range(3000):  # > 512 distinct views per slot: the view cache is dropped several times
        slot = ib.next_slot(16)
        off, n = 16 * (i % 300), 1 + i % 37
        view = ib.view(slot, off, (n,))
        if i % 7 == 0:
            kept.append((view, off, n))  # a caller (e.g. a bound forward) still holds it
    assert ib.generation >= 4, ib.generation
    for view, off, n in kept:  # every kept view still has its shape and reads its memory
        assert tuple(view.shape) == (n,), (view.shape, n)
        np.testing.assert_array_equal(view.numpy(), np.arange(off, off + n, dtype=np.int32))
    del kept
    print("ok")
    """
)


def test_index_views_outlive_the_view_cache_under_the_debug_allocator():
    """Views handed out by IndexBuffers stay valid after its view cache is dropped (they used to point
    into freed DLPack structs); run under PYTHONMALLOC=debug, which poisons freed memory."""
    env = {"PYTHONMALLOC": "debug", "PATH": "/usr/bin:/bin"}
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", _VIEW_LIFETIME], capture_output=True, text=True, timeout=300, env=env, cwd=root
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


def test_scalar_where_a_list_belongs_and_bad_sm_scale_name_the_fix():
    cache = _cache()
    cache.add_sequence(0)
    with pytest.raises(TypeError, match=r"begin_forward takes a list of sequence ids, not int; e.g. \[0\]"):
        cache.begin_forward(0, 1)
    with pytest.raises(TypeError, match="append_lengths must be a list of ints"):
        cache.begin_forward([0], 1)
    with pytest.raises(TypeError, match=r"swap_out takes a list of sequence ids, not int; e.g. \[0\]"):
        cache.swap_out(0)
    assert not cache.forward_open and cache.sequence_length(0) == 0
    cache.begin_forward([0], [1])
    qkv = np.zeros((1, H_QO + 2 * H_KV, D), np.float32)
    with pytest.raises(TypeError, match="sm_scale='x' must be a float"):
        cache.attention_with_fused_qkv(0, qkv, sm_scale="x")
    cache.end_forward()
    cache.check_integrity()


@pytest.mark.parametrize(
    "option, fix",
    [
        (dict(prefill_chunk_size=10**9), "lower prefill_chunk_size"),
        (dict(max_batch_size=10**9), "lower max_total_seq_len / max_batch_size"),
        (dict(max_total_seq_len=10**12, num_pages=None), "max_total_seq_len"),
    ],
)
def test_oversized_buffers_name_the_parameter_before_allocating(option, fix):
    """Every buffer the cache allocates up front is sized first: an oversized parameter is a
    ValueError naming it (it used to end in std::bad_alloc)."""
    with pytest.raises(ValueError, match=fix):
        _cache(**option)


def test_read_only_out_is_rejected_before_anything_runs():
    rng = np.random.default_rng(3)
    cache = _cache()
    cache.add_sequence(0)
    _prefill(cache, 0, 3, rng)
    k_before, v_before = cache.debug_get_kv(0)
    cache.begin_forward([0], [1])
    qkv = rng.standard_normal((1, H_QO + 2 * H_KV, D)).astype(np.float32)
    out = np.zeros((1, H_QO, D), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        cache.attention_with_fused_qkv(0, qkv, out=out)
    cache.end_forward()
    k_after, _ = cache.debug_get_kv(0, 0, 3)
    np.testing.assert_array_equal(k_after, k_before)  # nothing was appended for the rejected call
    assert not out.any()


def _state(cache):
    """What a refused call must leave as it was: sequences, free pages and the page tables' digest."""
    return cache.sequence_ids(), cache.num_available_pages(), cache.table_digest()


def test_import_sequence_into_an_id_a_pending_import_reserved_changes_nothing():
    """import_sequence into an id that prepare_import reserved raised KeyError only after allocating and
    writing its pages, which then leaked (2 of 24 pages lost, check_integrity failing)."""
    from tvmkv.runtime import checkpoint

    rng = np.random.default_rng(2)
    cache = _cache(num_pages=24)
    cache.add_sequence(0)
    _prefill(cache, 0, 6, rng)
    saved = checkpoint.export_checkpoint(cache, 0)
    data = rng.standard_normal((1, 2, 6, H_KV, D)).astype(np.float32)
    checkpoint.prepare_import(cache, 5, saved.metadata)
    before = _state(cache)
    with pytest.raises(KeyError, match="sequence 5 is already being imported"):
        interop.import_sequence(cache, 5, data, "contiguous")
    assert _state(cache) == before
    cache.check_integrity()
    checkpoint.abort_import(cache, 5)
    cache.remove_sequence(0)
    assert cache.num_available_pages() == 24


def test_an_aborted_import_leaves_the_free_list_as_it_was():
    """import_checkpoint with a forward open reserved and copied every group, then failed in
    finish_import; the abort gave the pages back in another order, so the next allocations (and the
    digest the tensor-parallel shards compare) differed. It now raises first, and an abort restores the
    free list's order."""
    from tvmkv.runtime import checkpoint

    rng = np.random.default_rng(3)
    cache = _cache(num_pages=24)
    cache.add_sequence(0)
    _prefill(cache, 0, 6, rng)
    saved = checkpoint.export_checkpoint(cache, 0)
    cache.begin_forward([0], [1])
    before = _state(cache)
    with pytest.raises(tvmkv.ForwardStateError, match="import_checkpoint"):
        checkpoint.import_checkpoint(cache, 4, saved)
    assert _state(cache) == before
    cache.end_forward()
    before = _state(cache)
    checkpoint.prepare_import(cache, 4, saved.metadata)  # reserves 2 pages
    checkpoint.abort_import(cache, 4)
    assert _state(cache) == before


def test_store_kv_refuses_pages_only_the_prefix_cache_holds():
    """A page the prefix cache alone holds has ref count 1, as a sequence's own page has; store_kv wrote
    into it, and the next request reusing that prefix read the overwritten K (NumPy: what was prefilled)."""
    rng = np.random.default_rng(4)
    cache = _cache(num_pages=16)
    prefix = tvmkv.RadixPrefixCache(cache)
    prompt = list(range(1, 10))
    cache.add_sequence(0)
    qkv = _prefill(cache, 0, len(prompt), rng)
    page = cache.sequence_pages(0)[0]
    prefix.finish_sequence(0, prompt)  # the tree now holds the pages; no sequence does
    zeros = np.zeros((1, H_KV, D), np.float32)
    with pytest.raises(ValueError, match=f"page {page}, which no sequence holds"):
        interop.store_kv(cache, 0, zeros, zeros, [page * P])
    reused = prefix.add_sequence_with_prefix(1, prompt + [10])
    k, _ = cache.debug_get_kv(1)
    np.testing.assert_array_equal(k[0, :reused], qkv[:reused, H_QO : H_QO + H_KV])
    # a sequence's own unshared page is still writable
    cache.add_sequence(2)
    _prefill(cache, 2, 2, rng)
    own = cache.sequence_pages(2)[0]
    interop.store_kv(cache, 0, zeros + 1, zeros + 1, [own * P + 1])
    assert (cache.debug_get_kv(2)[0][0, 1] == 1).all()


def test_store_kv_refuses_uint64_slots_beyond_int64():
    """A uint64 slot >= 2**63 wrapped negative on the way to int64, which means 'skip this token': the
    write silently did nothing."""
    cache = _cache()
    zeros = np.zeros((1, H_KV, D), np.float32)
    for slot in (2**63, 2**64 - 1):
        with pytest.raises(ValueError, match=r"slot_mapping\[0\] = \d+ is out of range"):
            interop.store_kv(cache, 0, zeros, zeros, np.array([slot], np.uint64))


def test_misaligned_tvm_tensors_are_copied_not_read_in_place():
    """A NumPy array handed to a TVM global function reaches the cache as a tvm tensor over the same
    memory, which need not be 64-byte aligned; the kernels' vector loads assumed alignment and the
    process died (SIGSEGV) where TVM's own cache computes the call. qkv, out and merge's in-place o
    4 bytes off a 64-byte boundary, against NumPy; in a subprocess, so a crash is a failure here."""
    script = textwrap.dedent(
        """
        import numpy as np, tvmkv
        from tvm_ffi import get_global_func, register_global_func
        H_QO, H_KV, D, P = 4, 2, 16, 4
        got = []
        register_global_func("tvmkv_test.keep", lambda x: got.append(x) or 0, override=True)
        def as_tvm(a):  # what a TVM global function receives for a NumPy array: a tvm tensor, zero-copy
            get_global_func("tvmkv_test.keep")(a)
            return got.pop()
        def misaligned(shape, rng):
            n = int(np.prod(shape)) * 4
            raw = np.zeros(n + 128, np.uint8)
            s = (-raw.ctypes.data) % 64 + 4
            a = raw[s : s + n].view(np.float32).reshape(shape)
            a[...] = rng.standard_normal(shape)
            return a
        rng = np.random.default_rng(0)
        cache = tvmkv.PagedAttentionKVCache(1, H_QO, H_KV, D, page_size=P, max_batch_size=2, max_total_seq_len=32,
                                            prefill_chunk_size=16, dtype="float32")
        cache.add_sequence(0)
        first = rng.standard_normal((5, H_QO + 2 * H_KV, D)).astype(np.float32)
        cache.begin_forward([0], [5]); cache.attention_with_fused_qkv(0, first); cache.end_forward()
        qkv = misaligned((1, H_QO + 2 * H_KV, D), rng)
        out = misaligned((1, H_QO, D), rng)
        t_qkv, t_out = as_tvm(qkv), as_tvm(out)
        assert t_qkv.data_ptr() % 64 == 4 and t_out.data_ptr() % 64 == 4
        cache.begin_forward([0], [1]); cache.attention_with_fused_qkv(0, t_qkv, out=t_out); cache.end_forward()
        k = np.concatenate([first[:, H_QO : H_QO + H_KV], qkv[:, H_QO : H_QO + H_KV]]).astype(np.float64)
        v = np.concatenate([first[:, H_QO + H_KV :], qkv[:, H_QO + H_KV :]]).astype(np.float64)
        for h in range(H_QO):
            s = k[:, h // 2] @ qkv[0, h].astype(np.float64) * D**-0.5
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[0, h], p @ v[:, h // 2] / p.sum(), atol=1e-5)
        o, lse = misaligned((3, H_QO, D), rng), misaligned((3, H_QO), rng)
        ob, lb = rng.standard_normal((3, H_QO, D)).astype(np.float32), rng.standard_normal((3, H_QO)).astype(np.float32)
        m = np.maximum(lse, lb)
        wa, wb = np.exp2(lse - m), np.exp2(lb - m)
        want = (o * wa[..., None] + ob * wb[..., None]) / (wa + wb)[..., None]
        cache.merge_attn_output_inplace(as_tvm(o), as_tvm(lse), as_tvm(ob), as_tvm(lb))
        np.testing.assert_allclose(o, want, atol=1e-5)
        from tvmkv import interop  # an export into a misaligned out wrote a copy and left out as it was
        dst = misaligned((1, 2, 6, H_KV, D), rng)
        interop.export_sequence(cache, 0, "contiguous", out=as_tvm(dst))
        k_all, v_all = cache.debug_get_kv(0)
        np.testing.assert_array_equal(dst[:, 0], k_all)
        np.testing.assert_array_equal(dst[:, 1], v_all)
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-3000:])


@pytest.mark.parametrize("kind", ["numpy", "tvm"])
def test_qkv_and_out_with_rows_to_spare_use_their_first_rows(kind):
    """TVM's cache takes qkv / out with more rows than the forward's tokens (a buffer sized for the
    largest batch) and uses the first rows; tvmkv refused them ("qkv has shape (5, 8, 16); expected
    (3, 8, 16)"). Outputs against NumPy; the spare rows of out are left as they were."""
    import tvm

    rng = np.random.default_rng(5)
    cache = _cache()
    for sid in (0, 1):
        cache.add_sequence(sid)
    first = _prefill(cache, 0, 6, rng)
    qkv = rng.standard_normal((5, H_QO + 2 * H_KV, D)).astype(np.float32)  # 1 + 1 tokens used, 3 spare
    out = np.full((5, H_QO, D), 7.0, np.float32)
    wrap = (lambda a: tvm.runtime.tensor(a)) if kind == "tvm" else (lambda a: a)
    q_in, o_in = wrap(qkv), wrap(out)
    cache.begin_forward([0, 1], [1, 1])
    got = cache.attention_with_fused_qkv(0, q_in, out=o_in)
    cache.end_forward()
    assert got is o_in
    o = o_in.numpy() if kind == "tvm" else o_in
    k0 = np.concatenate([first[:, H_QO : H_QO + H_KV], qkv[:1, H_QO : H_QO + H_KV]]).astype(np.float64)
    v0 = np.concatenate([first[:, H_QO + H_KV :], qkv[:1, H_QO + H_KV :]]).astype(np.float64)
    np.testing.assert_allclose(o[0], _attention(qkv[0, :H_QO].astype(np.float64), k0, v0), atol=1e-5)
    k1, v1 = qkv[1:2, H_QO : H_QO + H_KV].astype(np.float64), qkv[1:2, H_QO + H_KV :].astype(np.float64)
    np.testing.assert_allclose(o[1], _attention(qkv[1, :H_QO].astype(np.float64), k1, v1), atol=1e-5)
    assert (o[2:] == 7.0).all()
    assert cache.sequence_length(0) == 7 and cache.sequence_length(1) == 1  # the spare rows appended nothing
    cache.begin_forward([0, 1], [1, 1])
    with pytest.raises(ValueError, match=r"out has shape \(1, 4, 16\); expected \(2, 4, 16\)"):
        cache.attention_with_fused_qkv(0, q_in, out=wrap(out[:1].copy()))  # spare qkv rows, too few out rows
    cache.end_forward()


def test_pages_holding_uncommitted_tree_nodes_cannot_be_shared():
    """A token-tree commit compacts the accepted nodes in place. add_sequence_with_pages took the page
    holding another sequence's uncommitted nodes, and that sequence's commit then rewrote the new
    sequence's tokens. Such pages are refused now (nothing changes); once committed they can be shared,
    and the sharer keeps exactly the K/V it was given."""
    rng = np.random.default_rng(6)
    cache = _cache(page_size=8)
    cache.add_sequence(0)
    _prefill(cache, 0, 3, rng)
    cache.begin_forward([0], [3], [-1, -1, 1])  # nodes in slots 3..5 of page 0
    cache.attention_with_fused_qkv(0, rng.standard_normal((3, H_QO + 2 * H_KV, D)).astype(np.float32))
    cache.end_forward()
    pages, free = cache.sequence_pages(0), cache.num_available_pages()
    with pytest.raises(ValueError, match=r"page \d+ holds uncommitted token-tree nodes of sequence 0"):
        cache.add_sequence_with_pages(1, pages, 6)
    assert cache.sequence_ids() == [0] and cache.num_available_pages() == free
    cache.commit_accepted_token_tree_nodes([0], [2])  # path [1, 2]: slots 3, 4
    k0, v0 = cache.debug_get_kv(0)
    cache.add_sequence_with_pages(1, cache.sequence_pages(0), 5)
    k1, v1 = cache.debug_get_kv(1)
    np.testing.assert_array_equal(k1, k0)
    np.testing.assert_array_equal(v1, v0)
    cache.check_integrity()


def test_sequence_ids_outside_int64_are_refused_where_they_are_created():
    """``add_sequence(2**63)`` was accepted and broke ``table_digest`` (and so ShardedKVCache's and
    Disco's integrity checks) later with an OverflowError naming nothing. TVM's ids are int64."""
    cache = _cache()
    for bad in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match=rf"seq_id {bad} is outside int64"):
            cache.add_sequence(bad)
    cache.add_sequence(2**63 - 1)
    cache.add_sequence(-(2**63))
    with pytest.raises(ValueError, match=r"child_seq_id 18446744073709551616 is outside int64"):
        cache.fork_sequence(2**63 - 1, 2**64)
    assert sorted(cache.sequence_ids()) == [-(2**63), 2**63 - 1]
    assert isinstance(cache.table_digest(), str)
    cache.check_integrity()


def test_pipeline_stage_with_fp8_pages_checkpoints_and_moves():
    """A cache holding layers 2..3 of a model (``first_layer=2``) with fp8 pages: checkpoints and
    transfers named its layers 0..1 where the fp8 scale calls take the model's ids (every call raised
    "layer_id 0 is out of range [2, 4)"), and a move into a cache of another stage went through,
    putting layers 0..1's K/V in layers 2..3. Round trips now restore the codes exactly; another stage
    is refused by name."""
    from tvmkv.runtime import checkpoint, transfer

    scales = np.full((2, H_KV), 0.05, np.float32)

    def stage(first):
        return tvmkv.PagedAttentionKVCache(
            2, H_QO, H_KV, D, page_size=P, max_batch_size=4, max_total_seq_len=64, prefill_chunk_size=32,
            dtype="float16", kv_dtype="float8_e4m3fn", first_layer=first, kv_scales=scales,
        )  # fmt: skip

    rng = np.random.default_rng(9)
    a = stage(2)
    a.add_sequence(0)
    a.begin_forward([0], [6])
    for layer in (2, 3):
        a.attention_with_fused_qkv(layer, rng.standard_normal((6, H_QO + 2 * H_KV, D)).astype(np.float16))
    a.end_forward()
    k, v = a.debug_get_kv(0)
    b = stage(2)
    checkpoint.import_checkpoint(b, 4, checkpoint.export_checkpoint(a, 0))
    assert transfer.move_sequence(a, 0, b, 5) == 5
    for sid in (4, 5):
        kb, vb = b.debug_get_kv(sid)
        np.testing.assert_array_equal(kb, k)
        np.testing.assert_array_equal(vb, v)
    other, free = stage(0), None
    free = other.num_available_pages()
    with pytest.raises(ValueError, match="first_layer is 2 on the sender but 0 on the receiver"):
        transfer.move_sequence(a, 0, other, 5)
    assert other.sequence_ids() == [] and other.num_available_pages() == free
    b.check_integrity()


def test_nan_inputs_propagate_as_softmax_propagates_them():
    """A NaN key makes NaN the outputs of the query heads that see it, and a NaN query its own head's
    output, as softmax attention (NumPy, torch SDPA) does; every other output is exact. (The CPU
    kernels' exp2 clamp and running max dropped NaN: the key was skipped, the query row gave 0.)"""
    rng = np.random.default_rng(0)
    cache = _cache()
    qkv = rng.standard_normal((5, H_QO + 2 * H_KV, D)).astype(np.float32)
    qkv[2, H_QO, 0] = np.nan  # the K of token 2, kv head 0 (query heads 0 and 1)
    qkv[4, 3, 0] = np.nan  # the query of token 4, head 3
    cache.add_sequence(0)
    for n, rows in ((5, qkv), (1, rng.standard_normal((1, H_QO + 2 * H_KV, D)).astype(np.float32))):
        cache.begin_forward([0], [n])  # a prefill, then a decode step that sees the NaN key
        o = cache.attention_with_fused_qkv(0, rows)
        cache.end_forward()
        qkv = rows if n == 5 else np.concatenate([qkv, rows])
        k, v = qkv[:, H_QO : H_QO + H_KV].astype(np.float64), qkv[:, H_QO + H_KV :].astype(np.float64)
        for i in range(n):
            t = len(qkv) - n + i
            with np.errstate(invalid="ignore"):
                want = _attention(qkv[t, :H_QO].astype(np.float64), k[: t + 1], v[: t + 1])
            nan = np.isnan(want).any(-1)
            np.testing.assert_array_equal(np.isnan(o[i]).all(-1), nan)
            np.testing.assert_allclose(o[i][~nan], want[~nan], atol=1e-5, rtol=1e-5)
    assert np.isnan(o[0, :2]).all() and np.isfinite(o[0, 2:]).all()  # the decode: heads 0, 1 see the NaN


@pytest.mark.parametrize(
    ("option", "error", "words"),
    [
        (dict(num_layers=2, layer_windows=[2**32 + 3, 0]), ValueError, r"int in \[0, 2\*\*31 - 1\]"),
        (dict(rope_scale=1e39), ValueError, r"rope_scale=1e\+39 must be .* float32's normal range"),
        (dict(rope_scale=1e38), ValueError, r"rope_scale=1e\+38 with rope_theta=10000.0: the RoPE angle .* overflows"),
        (dict(rope_theta=1e-300), ValueError, r"rope_theta=1e-300 must be .* float32's normal range"),
        (dict(rope_theta="1e4"), TypeError, r"rope_theta='1e4' must be a positive finite float"),
        (dict(rope_theta=float("nan")), ValueError, r"rope_theta=nan must be"),
    ],
    ids=[
        "window-past-int32",
        "rope-scale-past-float32",
        "rope-angle-past-float32",
        "rope-theta-under-float32",
        "str",
        "nan",
    ],
)
def test_options_the_kernels_take_as_int32_or_float32_are_range_checked(option, error, words):
    """Values the kernels take as int32 / float32 are refused where they would wrap or overflow there
    (a window of 2**32 + 3 acted as a window of 3; a huge rope_scale stored NaN keys)."""
    opts = dict(page_size=P, max_batch_size=4, max_total_seq_len=64, prefill_chunk_size=32, dtype="float32")
    num_layers = option.pop("num_layers", 1)
    with pytest.raises(error, match=words):
        tvmkv.PagedAttentionKVCache(num_layers, H_QO, H_KV, D, **opts, **option)


def test_sm_scale_past_float32_is_refused():
    cache = _cache()
    cache.add_sequence(0)
    cache.begin_forward([0], [2])
    qkv = np.ones((2, H_QO + 2 * H_KV, D), np.float32)
    for bad in (1e39, -1e39, float("inf"), 3e38):  # 3e38 * log2(e) is past float32 in the kernels
        with pytest.raises(ValueError, match=r"must be finite in float32 once the kernels multiply it by log2"):
            cache.attention_with_fused_qkv(0, qkv, sm_scale=bad)
    o = cache.attention_with_fused_qkv(0, np.zeros_like(qkv), sm_scale=2e38)  # (scores 0: nothing overflows)
    cache.end_forward()
    assert np.isfinite(o).all()
