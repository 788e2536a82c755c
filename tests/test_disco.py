"""Tensor parallelism on a real Disco session with CPU workers (issue 18): the shards live in worker
processes, sequence operations go out from the controller, attention runs through the worker-side
Relax global, and everything is checked against the unsharded NumPy model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tvmkv
from tvmkv.replay import SCENARIOS, Replayer
from tvmkv.testing import cache_kwargs

disco = pytest.importorskip("tvmkv.disco")

SHAPE = cache_kwargs()  # the replay shape: 2 layers, 8 query / 2 KV heads, D 64, float32
ATTENTION = "tvmkv.attention_with_fused_qkv"  # tvmkv.relax.builtins.ATTENTION_FUNC, as a model calls it


@pytest.fixture(scope="module")
def session():
    with disco.TvmkvSession(2) as s:
        yield s


def _cache(session, **options):
    kw = {k: v for k, v in SHAPE.items() if k not in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim")}
    kw.update(options)
    return disco.DiscoKVCache(session, SHAPE["num_layers"], 8, 2, 64, **kw)


class _OnWorkers:
    """A DiscoKVCache as :class:`tvmkv.replay.Replayer` drives a cache: its own methods, plus
    ``attention_with_fused_qkv`` of the whole model run as a model runs it, on every worker through the
    Relax global with that worker's cache shard (qkv cut per shard, the outputs put side by side)."""

    def __init__(self, session, cache):
        self._session, self._cache = session, cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def attention_with_fused_qkv(self, layer, qkv):
        lay, sess, n = self._cache.layout, self._session.session, qkv.shape[0]
        part = sess.empty((n, lay.qo_per_shard + 2 * lay.kv_per_shard, qkv.shape[2]), "float32")
        out = sess.empty((n, lay.qo_per_shard, qkv.shape[2]), "float32")
        for w in range(self._session.num_workers):
            part.debug_copy_from(w, np.ascontiguousarray(qkv[:, lay.qkv_rows(w)]))
        sess.get_global_func(ATTENTION)(self._cache.handle, layer, qkv.shape[2] ** -0.5, part, out)
        return np.concatenate([out.debug_get_from_remote(w).numpy() for w in range(self._session.num_workers)], 1)


@pytest.mark.parametrize("scenario", ["tvm_operation_seq", "fork", "tree"])
def test_scenario_on_disco_workers(session, scenario):
    """The replay scenarios on the workers against the NumPy model: every layer's output and every
    sequence's stored K/V after every operation, the workers' page tables compared."""
    cache = _cache(session, rope_mode="normal")
    r = Replayer(_OnWorkers(session, cache))
    r.run(SCENARIOS[scenario])
    r.check_drained()
    assert cache.sequence_ids() == [] and cache.is_empty()  # every scenario ends removing its sequences
    d = cache.digests()
    assert len(d) == 2 and d[0] == d[1]


def test_stored_kv_gathered_from_workers(session):
    cache = _cache(session)
    r = Replayer(_OnWorkers(session, cache), seed=1)
    r.run([["add", 3], ["add", 4], ["fwd", [[3, 17], [4, 5]]], ["fork", 3, 5, 9], ["fwd", [[5, 2], [4, 1]]]])
    for sid in (3, 4, 5):
        _, k_ref, v_ref = r.model.kept_kv(sid)
        k, v = cache.debug_get_kv(sid)
        np.testing.assert_allclose(k, k_ref, atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(v, v_ref, atol=1e-6, rtol=1e-6)
    cache.calls([("remove_sequence", (5,)), ("remove_sequence", (3,)), ("remove_sequence", (4,))])
    cache.check_integrity()


def test_worker_errors_are_raised_on_the_controller(session):
    cache = _cache(session, num_pages=6, max_total_seq_len=64)
    cache.add_sequence(0)
    with pytest.raises(KeyError, match="seq_id 0 is already in the cache"):
        cache.add_sequence(0)
    with pytest.raises(KeyError, match="sequence 9"):
        cache.begin_forward([9], [1])
    with pytest.raises(tvmkv.OutOfPagesError) as err:
        cache.begin_forward([0], [7 * 16])
    assert (err.value.needed, err.value.available) == (7, 6)
    with pytest.raises(TypeError, match="must be an int"):
        cache.pop_n(0, 1.5)
    with pytest.raises(ValueError, match="'check_integrity' is not a sequence operation"):
        cache.calls([("check_integrity", ())])
    # a batch of calls stops at the first refused one; those before it ran on every worker
    with pytest.raises(KeyError, match="sequence 8"):
        cache.calls([("add_sequence", (1,)), ("remove_sequence", (8,)), ("add_sequence", (2,))])
    cache.check_integrity()
    r = Replayer(_OnWorkers(session, cache), seed=2)
    for sid in (0, 1):  # added above, still empty
        r.model.add(sid)
    r.forward([0, 1], [3, 4], None, None)
    with pytest.raises(ValueError, match="page_size=3"):
        _cache(session, page_size=3)
    with pytest.raises(ValueError, match="does not divide num_kv_heads=3"):
        disco.DiscoKVCache(session, 2, 6, 3, 64)


def test_diverged_digests_name_the_worker(session, monkeypatch):
    cache = _cache(session)
    cache.check_integrity()
    monkeypatch.setattr(cache, "digests", lambda: ["a" * 32, "b" * 32])
    with pytest.raises(tvmkv.ShardDivergenceError, match="shard 1 diverged") as err:
        cache.check_integrity()
    assert err.value.shard == 1


def test_a_dead_worker_is_an_error_not_an_abort():
    s = disco.TvmkvSession(2)
    cache = disco.DiscoKVCache(s, 2, 8, 2, 64, dtype="float32")
    cache.add_sequence(0)
    s.pool.procs[1].kill()
    s.pool.procs[1].wait()
    with pytest.raises(disco.WorkerDiedError, match="worker 1 exited"):
        cache.add_sequence(1)
    s.shutdown()  # closes the cache too: no DRef of it keeps the session
    assert cache.handle is None
    with pytest.raises(RuntimeError, match="shut down"):
        cache.add_sequence(2)


@pytest.mark.parametrize(
    "argv",
    [
        ["--tensor-parallel", "2"],
        # 4 shards over 2 KV heads (each replicated twice), scarce pages: swap preemption and a fork
        ["--tensor-parallel", "4", "--num-pages", "6"],
        ["--tensor-parallel", "2", "--num-pages", "6", "--preemption", "recompute", "--dtype", "float16"],
        # the model compiled against TVM's PagedKVCache: each worker creates its shard through TVM's create
        # function (the drop-in on every worker), sequence operations are vm.builtin.kv_state_* through Disco
        ["--tensor-parallel", "2", "--interface", "tvm", "--num-pages", "6"],
    ],
)
def test_generate_on_sharded_model(argv, capsys):
    """The tiny Llama sharded over CPU Disco workers (gloo all-reduces): every step's logits against the
    single-device model run beside it and against PyTorch (main exits 1 when either differs)."""
    from tvmkv.generate import main

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "max |logit difference| from the single-device run" in out and "check: OK" in out
    if "--num-pages" in argv:
        assert "preempt" in out


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--tensor-parallel", "3"], "num_shards=3 does not divide num_qo_heads=4"),
        (["--tensor-parallel", "2", "--prefix-cache"], "does not combine with --prefix-cache"),
        (["--tensor-parallel", "0"], "must be a positive int"),
    ],
)
def test_generate_refuses_what_it_cannot_shard(argv, words, capsys):
    from tvmkv.generate import main

    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_nccl_plugin_support_headers_stand_in_for_the_missing_ones(tmp_path):
    """The wheel's runtime headers include tvm/support/io.h and serializer.h, which it does not ship:
    tvmkv's stand-ins (tvmkv/disco/nccl_support) must make them compile, as the plugin build needs."""
    import shutil
    import subprocess

    from tvmkv.disco import nccl

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    tvm_inc = nccl.package_dir("tvm") / "include"
    ffi_inc = nccl.package_dir("tvm_ffi") / "include"
    src = tmp_path / "t.cc"
    src.write_text(
        "#include <tvm/runtime/disco/builtin.h>\n#include <tvm/runtime/disco/session.h>\n"
        "#include <tvm/runtime/tensor.h>\nint main() { return 0; }\n"
    )
    base = ["g++", "-std=c++17", "-fsyntax-only", f"-I{tvm_inc}", f"-I{ffi_inc}", str(src)]
    without = subprocess.run(base, capture_output=True, text=True)
    assert without.returncode != 0 and "tvm/support/io.h" in without.stderr  # what the stand-ins are for
    support = Path(nccl.__file__).parent / "nccl_support"
    done = subprocess.run([*base, f"-I{support}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_nccl_plugin_builds_where_nccl_is_given(tmp_path):
    """The whole plugin (TVM's own nccl.cc from the wheel) builds and registers runtime.disco.nccl.*, where
    $TVMKV_NCCL_ROOT names NCCL (nvidia-nccl-cu13's nvidia/nccl) and CUDA's headers are installed."""
    import os
    import subprocess
    import sys

    root = os.environ.get("TVMKV_NCCL_ROOT")
    if not root:
        pytest.skip("TVMKV_NCCL_ROOT is not set")
    from tvmkv.disco import nccl

    lib = nccl.build_plugin(tmp_path, root)
    probe = (
        "import ctypes, sys, tvm_ffi\nfrom tvmkv.disco.runtime import load\nload()\n"
        f"ctypes.CDLL({str(Path(root) / 'lib' / 'libnccl.so.2')!r}, mode=ctypes.RTLD_GLOBAL)\n"
        f"ctypes.CDLL({str(lib)!r}, mode=ctypes.RTLD_GLOBAL)\n"
        "names = [n for n in tvm_ffi.registry.list_global_func_names() if n.startswith('runtime.disco.nccl.')]\n"
        "print(sorted(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "runtime.disco.nccl.allreduce" in out.stdout and "runtime.disco.nccl.init_ccl" in out.stdout


def test_nccl_setup_errors_name_the_fix(tmp_path, capsys):
    from tvmkv.disco import nccl
    from tvmkv.generate import main

    with pytest.raises(FileNotFoundError, match="python -m tvmkv.disco.nccl OUT_DIR NCCL_ROOT"):
        nccl.load(tmp_path / "missing.so")
    with disco.TvmkvSession(1) as s:
        with pytest.raises(RuntimeError, match="nccl_plugin="):
            s.init_nccl()
    assert main(["--tensor-parallel", "2", "--target", "cuda", "--nccl-plugin", str(tmp_path / "x.so")]) == 2
    assert "needs Disco's NCCL backend" in capsys.readouterr().err


def test_a_shard_refused_by_one_worker_fails_the_cache(session):
    """Worker 1's KV head has a bad fp8 scale: worker 0's shard is fine, the cache still refuses (every
    worker's creation is checked)."""
    kw = dict(dtype="float16", kv_dtype="float8_e4m3fn", kv_scales=[[1.0, -1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="positive"):
        _cache(session, **kw)
    with pytest.raises(ValueError, match=r"device_ids=\[0, -1\] must name one GPU per worker"):
        _cache(session, device_ids=[0, -1])


def test_disco_arguments_and_reads_match_the_local_cache(session):
    import tvmkv.testing

    cache, local = _cache(session, num_pages=8, max_total_seq_len=128), tvmkv.testing.make_cache(num_pages=8)
    for c in (cache, local):
        c.add_sequence(np.int64(0))  # NumPy and 0-d ids are ids
        c.add_sequence(np.array(1))
        c.begin_forward(np.array([0, 1]), (n for n in [5, 3]))
        c.end_forward()
    assert cache.sequence_ids() == local.sequence_ids() == [0, 1]
    for bad in (True, 1.5, "0"):
        with pytest.raises(TypeError):
            cache.pop_n(bad, 1)
        with pytest.raises(TypeError):
            local.pop_n(bad, 1)
    k, v = cache.debug_get_kv(0, 2, 2)  # an empty range, as the cache gives it
    assert k.shape == v.shape == (2, 0, 2, 64)
    with pytest.raises(ValueError, match=r"range \[0, 9\) is outside sequence 0 of length 5"):
        cache.debug_get_kv(0, 0, 9)
    with pytest.raises(ValueError, match="outside"):
        cache.debug_get_kv(0, 0, -1)
    cache.begin_forward([1], [cache.num_available_pages() * 16 + 13])  # every free page taken
    cache.end_forward()
    with pytest.raises(tvmkv.OutOfPagesError, match="fork of sequence 0 at 3") as err:
        cache.fork_sequence(0, 2, 3)  # inside a page: its copy needs one more
    assert (err.value.needed, err.value.available) == (1, 0) and err.value.what.startswith("fork")
    with pytest.raises(TypeError, match="is not a \\(method, args\\)"):
        cache.calls([("add_sequence",)])
    with pytest.raises(TypeError, match="must be a list of"):
        cache.calls("clear")
    cache.check_integrity()


def _create_args(session, partition, heads=(8, 2), num_layers=4):
    """vm.builtin.paged_attention_kv_cache_create's arguments as TVM's TIRPagedKVCache passes them (a shard's
    query / KV ``heads``, D 64, float32; the 15 kernel arguments, which tvmkv ignores, as None), ``partition``
    its layer_indptr; the 0-d tensor on every worker."""
    from tvm_ffi import Shape

    ref = session.session.empty((), "float32")
    sizes, kinds = Shape([4, 64, 16, 16, 0]), Shape([0] * num_layers)
    head = [sizes, Shape(partition), *heads, 64, 64, kinds, False, 1, 1.0, 1e4, 0]
    return [*head, ref] + [None] * 15


def test_dropin_on_every_worker_and_its_errors():
    """TVM's interface on Disco workers: the create call makes a tvmkv shard on each worker, the controller
    drives it with vm.builtin.kv_state_* through Disco (as MLC-LLM's engine does); a call that fails on the
    workers leaves them alive, the cache unchanged, and raises on the controller at the next check."""
    with disco.TvmkvSession(2) as s:
        s.install_tvm_override(num_pages=20)
        # each worker's model (compiled for 2 shards) asks for its shard's 4 query / 1 KV heads
        handle = s.call("vm.builtin.paged_attention_kv_cache_create", *_create_args(s, [0, 4], (4, 1)))
        cache = disco.DiscoKVCache.from_handle(s, handle, 8, 2)
        assert cache.layout.kv_per_shard == 1 and cache.config.num_layers == 4 and cache.config.total_pages == 20
        add = s.session.get_global_func("vm.builtin.kv_state_add_sequence")
        add(handle, 5)
        s.check_errors()
        assert cache.sequence_ids() == [5]
        add(handle, 5)  # already there: TVM's cache would end the worker (and worker 0's, this process)
        with pytest.raises(KeyError, match="vm.builtin.kv_state_add_sequence on worker 0: .*seq_id 5 is already"):
            s.check_errors()
        s.check_errors()  # taken: nothing left
        cache.add_sequence(6)
        cache.check_integrity()
        with pytest.raises(ValueError, match="worker 0 holds 4 query / 1 KV heads"):
            disco.DiscoKVCache.from_handle(s, handle, 16, 2)  # not the model's heads
        # a create the workers refuse: the model gets None, the controller the error
        bad = s.call("vm.builtin.paged_attention_kv_cache_create", *_create_args(s, [0, 2, 4], (4, 1)))
        with pytest.raises(ValueError, match="layer_partition \\[0, 2, 4\\] gives 2 pipeline stages"):
            disco.DiscoKVCache.from_handle(s, bad, 8, 2)
        s.check_workers()
        del bad, handle, add


def test_pipeline_groups_hold_their_stage_layers():
    """A session of two worker groups (pipeline stages): each group's shard holds the layers TVM's
    layer_indptr gives it, created by tvmkv (layer_partition) or through TVM's create call."""
    with disco.TvmkvSession(2, num_groups=2) as s:
        kw = dict(dtype="float32", num_pages=20, max_total_seq_len=64)
        with pytest.raises(ValueError, match="2 worker groups .* pass layer_partition"):
            disco.DiscoKVCache(s, 4, 8, 2, 64, **kw)
        with pytest.raises(ValueError, match="layer_partition=\\[0, 4, 4\\] must be 3 increasing"):
            disco.DiscoKVCache(s, 4, 8, 2, 64, layer_partition=[0, 4, 4], **kw)
        cache = disco.DiscoKVCache(s, 4, 8, 2, 64, layer_partition=[0, 1, 4], **kw)
        seen = disco.DiscoKVCache.from_handle(s, cache.handle, 8, 2)  # each worker's own configuration
        assert seen.layer_partition == [0, 1, 4] and seen.config.num_layers == 4
        cache.calls([("add_sequence", (1,)), ("begin_forward", ([1], [20])), ("end_forward", ())])
        cache.check_integrity()  # both stages' page tables alike
        k, v = cache.debug_get_kv(1, 3, 3)
        assert k.shape == v.shape == (4, 0, 2, 64)
        s.install_tvm_override(num_pages=20)
        handle = s.call("vm.builtin.paged_attention_kv_cache_create", *_create_args(s, [0, 3, 4]))
        dropin = disco.DiscoKVCache.from_handle(s, handle, 8, 2)
        assert dropin.layer_partition == [0, 3, 4] and dropin.layout.qo_per_shard == 8
        bad = s.call("vm.builtin.paged_attention_kv_cache_create", *_create_args(s, [0, 4]))
        with pytest.raises(ValueError, match="1 pipeline stages but the cache is created in a Disco session of 2"):
            disco.DiscoKVCache.from_handle(s, bad, 8, 2)
        del bad, handle


def test_sessions_in_one_process_keep_their_own_errors_and_override():
    """Worker 0 of every session is a thread of this process: an error one session's worker 0 kept is not
    another's, and one session's shutdown leaves the other's drop-in in place."""
    with disco.TvmkvSession(2) as a:
        a.install_tvm_override(num_pages=20)
        with disco.TvmkvSession(2) as b:
            b.install_tvm_override(num_pages=24)
            ha = a.call("vm.builtin.paged_attention_kv_cache_create", *_create_args(a, [0, 4], (4, 1)))
            hb = b.call("vm.builtin.paged_attention_kv_cache_create", *_create_args(b, [0, 4], (4, 1)))
            ca, cb = (disco.DiscoKVCache.from_handle(x, h, 8, 2) for x, h in ((a, ha), (b, hb)))
            assert (ca.config.total_pages, cb.config.total_pages) == (20, 24)  # each session's own options
            add = a.session.get_global_func("vm.builtin.kv_state_add_sequence")
            add(ha, 1)
            add(ha, 1)  # fails on a's workers only
            b.check_errors()  # nothing of a's
            cb.add_sequence(1)
            cb.check_integrity()
            with pytest.raises(KeyError, match="seq_id 1 is already"):
                a.check_errors()
            del add, hb, cb
        # b is shut down: a's drop-in still creates tvmkv shards
        h2 = a.call("vm.builtin.paged_attention_kv_cache_create", *_create_args(a, [0, 4], (4, 1)))
        assert disco.DiscoKVCache.from_handle(a, h2, 8, 2).config.total_pages == 20
        del ha, ca, h2


def _run_script(path, text: str, timeout: int, hang: str) -> str:
    """Write ``text`` to ``path`` and run it in a fresh interpreter from the checkout (a hang there is a
    timeout here, reported as ``hang``); its stdout, after asserting that it exited 0."""
    import subprocess
    import sys

    path.write_text(text)
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run([sys.executable, str(path)], cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(hang)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def test_a_session_left_to_the_collector_does_not_hang_another(tmp_path):
    """A session dropped without shutdown() inside a reference cycle (as a traceback's frames leave one),
    with a cache on its workers, while another session's worker 0 (a thread of this process) runs the
    collection: Disco's destructor would join the first session's worker 0 while holding the GIL that
    worker needs to free the cache shard, and both would wait forever. Open sessions are held until
    shutdown or exit, so the collection frees the cycle and nothing hangs; the dropped session is shut
    down at exit (the process exits 0). In a subprocess, so that a hang is a timeout here."""
    out = _run_script(
        tmp_path / "collect.py",
        "import gc\n"
        "from tvm_ffi import register_global_func\n"
        "from tvmkv import disco\n"
        "from tvmkv.testing import cache_kwargs\n"
        "shape = cache_kwargs()\n"
        "kw = {k: v for k, v in shape.items() if k not in ('num_layers', 'num_qo_heads', 'num_kv_heads', 'head_dim')}\n"
        "gc.disable()\n"
        "a = disco.TvmkvSession(1)\n"
        "cache = disco.DiscoKVCache(a, shape['num_layers'], 8, 2, 64, **kw)\n"
        "cache.add_sequence(0)\n"
        "cycle = [a, cache]\n"
        "cycle.append(cycle)\n"
        "del a, cache, cycle\n"
        "b = disco.TvmkvSession(1)\n"
        "register_global_func('tvmkv_test.collect', lambda: gc.collect(), override=True)\n"
        "print('collected', b.fetch(b.call('tvmkv_test.collect')) > 0, flush=True)\n"
        "b.shutdown()\n",
        240,
        "the collection on worker 0 hung (a session finalized by the garbage collector)",
    )
    assert "collected True" in out, out


def test_a_cache_collected_on_worker_0_does_not_hang_the_next_call(tmp_path):
    """A DiscoKVCache left in a reference cycle (as a traceback's frames leave one) and collected on worker
    0's thread (a thread of this process) while that worker runs a function and the controller sends its
    next call. Releasing the cache's DRef there sent Disco's free-register message from that thread while
    the controller wrote its own, Disco's channels take one writer at a time, and the controller then
    waited forever for a reply (the hang pytest-xdist runs met in test_diverged_digests_name_the_worker:
    before the fix this loop hung within 40-480 rounds, 3 runs of 3). Now finalizers hand the DRef to the
    session, whose next call releases it. Worker 0 collects at the start of every create (its global
    function wrapped here; worker 1 runs its own); in a subprocess, so that a hang is a timeout here."""
    out = _run_script(
        tmp_path / "collect_on_worker0.py",
        "import gc, threading, weakref\n"
        "from tvm_ffi import get_global_func, register_global_func\n"
        "from tvmkv import disco\n"
        "from tvmkv.disco import worker\n"
        "from tvmkv.testing import cache_kwargs\n"
        "shape = cache_kwargs()\n"
        "kw = {k: v for k, v in shape.items() if k not in ('num_layers', 'num_qo_heads', 'num_kv_heads', 'head_dim')}\n"
        "s = disco.TvmkvSession(2)\n"
        "create = get_global_func(worker.CREATE)\n"
        "register_global_func(worker.CREATE, lambda spec: (gc.collect(0), create(spec))[1], override=True)\n"
        "main, elsewhere = threading.get_ident(), []\n"
        "gc.disable()\n"
        "for i in range(600):\n"
        "    a = disco.DiscoKVCache(s, shape['num_layers'], 8, 2, 64, **kw)\n"
        "    a.add_sequence(1)\n"
        "    weakref.finalize(a, lambda: elsewhere.append(threading.get_ident() != main))\n"
        "    cycle = [a]\n"
        "    cycle.append(cycle)\n"
        "    del a, cycle\n"
        "    b = disco.DiscoKVCache(s, shape['num_layers'], 8, 2, 64, **kw)\n"
        "    b.add_sequence(2)\n"
        "    b.check_integrity()\n"
        "    del b\n"
        "gc.enable()\n"
        "print('finalized on worker 0:', sum(elsewhere), 'of', len(elsewhere), flush=True)\n"
        "s.shutdown()\n",
        150,
        "a call hung after a cache was collected on worker 0's thread",
    )
    assert "finalized on worker 0: 600 of 600" in out, out


def test_a_refused_create_does_not_keep_the_session_alive():
    """from_handle raising inside ``with``: no DRef in the traceback keeps the workers running."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "Disco workers still run after shutdown"
        with pytest.raises(ValueError, match="layer_partition"):
            with disco.TvmkvSession(2) as s:
                s.install_tvm_override()
                create = "vm.builtin.paged_attention_kv_cache_create"
                disco.DiscoKVCache.from_handle(s, s.call(create, *_create_args(s, [0, 2, 4], (4, 1))), 8, 2)
    assert all(p.poll() is not None for p in s.pool.procs.values())
