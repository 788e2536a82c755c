"""Validation at the door (issue 14, items 4, 8 and 9): the scheduler, the command lines and
``interop.foreign_shape`` reject bad values with an error that names the value and the fix, and
leave everything as it was.

Oracles: the exception and its message, and the state read through public calls before and after
(``cache.sequence_ids()``, ``cache.num_available_pages()``, ``cache.check_integrity()``, the
scheduler's queues and counters); for the command lines, the exit status and stderr of a real
``python -m tvmkv`` process (the argument matrix runs in-process through each command's ``main``).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tvmkv import interop, testing
from tvmkv.errors import ForwardStateError
from tvmkv.runtime.scheduler import RUNNING, SWAPPED, WAITING, Part, Scheduler

ROOT = Path(__file__).resolve().parents[1]
NUM_PAGES, CHUNK, BATCH, PAGE = 8, 64, 4, 16


@pytest.fixture(scope="module")
def shared_cache():
    """One small llvm cache for the module (8 pages of 16, forwards of up to 64 tokens, 4 sequences)."""
    return testing.make_cache(
        "llvm", num_pages=NUM_PAGES, prefill_chunk_size=CHUNK, max_batch_size=BATCH, page_size=PAGE
    )


@pytest.fixture
def cache(shared_cache):
    """The module's cache, empty at the start of every test."""
    shared_cache.clear()
    assert shared_cache.num_available_pages() == NUM_PAGES
    return shared_cache


def run_forward(cache, seq_ids, lengths, seed=0) -> None:
    """One forward through every layer with random q/k/v."""
    cfg = cache.config
    rng = np.random.default_rng(seed)
    cache.begin_forward(seq_ids, lengths)
    for layer in range(cfg.num_layers):
        qkv = rng.uniform(-1, 1, (sum(lengths), cfg.qkv_heads, cfg.head_dim)).astype("float32")
        cache.attention_with_fused_qkv(layer, qkv)
    cache.end_forward()


def snapshot(cache, sched) -> dict:
    """What a rejected call must leave as it was: the cache's sequences and pages, the scheduler's
    queues, per-request counts and statistics."""
    cache.check_integrity()
    return {
        "ids": cache.sequence_ids(),
        "swapped": cache.swapped_sequence_ids(),
        "free": cache.num_available_pages(),
        "lengths": {sid: cache.sequence_length(sid) for sid in cache.sequence_ids()},
        "queues": {status: sched.queue_ids(status) for status in (WAITING, RUNNING, SWAPPED)},
        "requests": {sid: (st.num_tokens, st.num_computed) for sid, st in sched.seqs.items()},
        "stats": dataclasses.asdict(sched.stats),
    }


# ------------------------------------------------------------------------------- item 4: scheduler
@pytest.mark.parametrize(
    "option, error, words",
    [
        (dict(token_budget=1.5), TypeError, ["token_budget=1.5", f"prefill_chunk_size={CHUNK}"]),
        (dict(token_budget=True), TypeError, ["token_budget=True"]),
        (dict(token_budget=0), ValueError, ["token_budget=0", f"prefill_chunk_size={CHUNK}"]),
        (dict(token_budget=CHUNK + 1), ValueError, [f"token_budget={CHUNK + 1}", f"[1, {CHUNK}]"]),
        (dict(max_batch_size=2.5), TypeError, ["max_batch_size=2.5", f"max_batch_size={BATCH}"]),
        (dict(max_batch_size=0), ValueError, ["max_batch_size=0"]),
        (dict(max_batch_size=BATCH + 1), ValueError, [f"max_batch_size={BATCH + 1}", f"[1, {BATCH}]"]),
        (dict(watermark_pages=1000), ValueError, ["watermark_pages=1000", f"{NUM_PAGES} pages"]),
        (dict(watermark_pages=NUM_PAGES), ValueError, [f"watermark_pages={NUM_PAGES}", "nothing is admitted"]),
        (dict(watermark_pages=-1), ValueError, ["watermark_pages=-1"]),
        (dict(watermark_pages=0.5), TypeError, ["watermark_pages=0.5"]),
        (dict(preemption="drop"), ValueError, ["preemption='drop'", "recompute"]),
    ],
)
def test_scheduler_constructor_rejects_bad_options(cache, option, error, words):
    with pytest.raises(error) as info:
        Scheduler(cache, **option)
    for word in words:
        assert word in str(info.value)


def test_scheduler_constructor_takes_numpy_ints(cache):
    sched = Scheduler(cache, token_budget=np.int64(32), max_batch_size=np.int32(2), watermark_pages=np.int64(1))
    assert (type(sched.token_budget), type(sched.max_batch_size), type(sched.watermark_pages)) == (int, int, int)


@pytest.mark.parametrize("seq_id", ["a", 2.5, 2.0, None, True, False], ids=repr)
def test_add_request_rejects_ids_that_are_not_ints(cache, seq_id):
    sched = Scheduler(cache)
    with pytest.raises(TypeError, match="seq_id"):
        sched.add_request(seq_id, 5)
    assert not sched.has_unfinished() and not sched.seqs


@pytest.mark.parametrize(
    "count, error, match",
    [
        (2.5, TypeError, "num_prompt_tokens=2.5"),
        ("5", TypeError, "num_prompt_tokens='5'"),
        (True, TypeError, "num_prompt_tokens=True"),
        (0, ValueError, "num_prompt_tokens=0 .* must be positive"),
        (-3, ValueError, "num_prompt_tokens=-3 .* must be positive"),
        (NUM_PAGES * PAGE + 1, ValueError, f"needs {NUM_PAGES + 1} pages, more than the cache's {NUM_PAGES}"),
    ],
)
def test_add_request_rejects_bad_prompt_lengths(cache, count, error, match):
    sched = Scheduler(cache)
    with pytest.raises(error, match=match):
        sched.add_request(0, count)
    assert not sched.has_unfinished()


def test_add_request_rejects_ids_in_use(cache):
    """Ids of sequences outside the scheduler (on the device or swapped out) and of queued requests."""
    cache.add_sequence(3)
    cache.add_sequence(4)
    run_forward(cache, [4], [20])
    cache.swap_out([4])
    sched = Scheduler(cache)
    sched.add_request(0, 5)
    before = snapshot(cache, sched)
    for sid in (3, 4, np.int64(3)):
        with pytest.raises(KeyError, match=f"seq_id {sid} is used by a sequence in the cache"):
            sched.add_request(sid, 5)
    for sid in (0, np.int64(0)):
        with pytest.raises(KeyError, match="seq_id 0 is already scheduled"):
            sched.add_request(sid, 7)
    assert snapshot(cache, sched) == before
    # a fork's child follows the same rule
    plan = sched.schedule()
    run_forward(cache, plan.seq_ids, plan.lengths)
    sched.step_done(plan)
    before = snapshot(cache, sched)
    for child, error in ((3, KeyError), (0, KeyError), ("b", TypeError)):
        with pytest.raises(error, match="child_seq_id"):
            sched.fork(0, child)
    with pytest.raises(KeyError, match="parent_seq_id 9 is not a request"):
        sched.fork(9, 10)
    assert snapshot(cache, sched) == before


def test_schedule_admits_all_or_nothing(cache):
    """A waiting request whose id was taken in the cache after add_request: schedule() raises before
    admitting any request of the batch, and admits them all once the id is free again."""
    sched = Scheduler(cache)
    sched.add_request(0, 20)
    sched.add_request(1, 20)
    sched.add_request(2, 20)
    cache.add_sequence(1)  # behind the scheduler's back
    before = snapshot(cache, sched)
    for _ in range(2):
        with pytest.raises(KeyError, match=r"request 1 is waiting.*remove that sequence from the cache"):
            sched.schedule()
        assert snapshot(cache, sched) == before
    assert cache.sequence_ids() == [1]
    cache.remove_sequence(1)
    plan = sched.schedule()
    assert plan.admitted == [0, 1, 2] and sorted(cache.sequence_ids()) == [0, 1, 2]
    cache.check_integrity()


def test_schedule_with_an_open_forward_changes_nothing(cache):
    sched = Scheduler(cache)
    sched.add_request(0, 5)
    plan = sched.schedule()
    run_forward(cache, plan.seq_ids, plan.lengths)
    sched.step_done(plan)
    sched.add_request(1, 20)
    sched.add_request(2, 20)
    cache.begin_forward([0], [1])
    try:
        before = snapshot(cache, sched)
        with pytest.raises(ForwardStateError, match="Scheduler.schedule"):
            sched.schedule()
        assert snapshot(cache, sched) == before
    finally:
        cache.end_forward()


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_schedule_that_could_only_preempt_in_vain_changes_nothing(cache, preemption):
    """Pages held outside the scheduler leave its one running sequence no page to grow into: preempting
    that sequence (swapping it out, or dropping its K/V to recompute) would free only the pages it needs
    back, so schedule() raises before preempting anything, and the sequence runs once pages are free.
    A second request waiting behind it changes nothing (in recompute mode it is younger, so second in
    line; in swap mode nothing is admitted while a sequence is swapped out)."""
    outside = 100
    cache.add_sequence(outside)
    run_forward(cache, [outside], [4 * PAGE])  # 4 of the 8 pages, not the scheduler's
    sched = Scheduler(cache, preemption=preemption)
    sched.add_request(0, 4 * PAGE)  # the other 4: its next token needs a fifth
    plan = sched.schedule()
    run_forward(cache, plan.seq_ids, plan.lengths)
    sched.step_done(plan)
    sched.add_request(1, 2)
    before = snapshot(cache, sched)
    assert before["free"] == 0 and before["queues"][RUNNING] == [0]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="nothing can be scheduled.*not manage"):
            sched.schedule()
        assert snapshot(cache, sched) == before  # not swapped out, K/V not dropped
    cache.remove_sequence(outside)
    plan = sched.schedule()
    assert plan.seq_ids == [0, 1] and plan.lengths == [1, 2] and not plan.preempted
    assert cache.sequence_length(0) == 4 * PAGE


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda c: c.commit_accepted_token_tree_nodes([0], 1), "leaf_indices must be a list of ints, not int"),
        (lambda c: c.commit_accepted_token_tree_nodes(0, [1]), "commit_accepted_token_tree_nodes takes a list"),
        (lambda c: c.begin_forward([0], [1], -1), "token_tree_parent_ptr must be a list of ints, not int"),
        (lambda c: c.begin_forward(0, [1]), "begin_forward takes a list of sequence ids, not int"),
        (lambda c: c.add_sequence_with_pages(9, 3, 4), "pages must be a list of ints, not int"),
    ],
)
def test_a_number_where_a_list_belongs_is_named(cache, call, words):
    """One int where the API takes a list: a TypeError naming the argument and showing the list form
    (not Python's bare "'int' object is not iterable"), and the cache as it was."""
    cache.add_sequence(0)
    run_forward(cache, [0], [3])
    before = (cache.sequence_ids(), cache.sequence_length(0), cache.num_available_pages(), cache.forward_open)
    with pytest.raises(TypeError, match=words):
        call(cache)
    assert (cache.sequence_ids(), cache.sequence_length(0), cache.num_available_pages(), cache.forward_open) == before
    cache.check_integrity()


def test_a_plan_is_completed_once(cache):
    """step_done twice for one plan raises and counts nothing (the cache holds 5 tokens, the
    scheduler too); so does a plan superseded by a later schedule()."""
    sched = Scheduler(cache)
    sched.add_request(0, 5)
    plan = sched.schedule()
    run_forward(cache, plan.seq_ids, plan.lengths)
    sched.step_done(plan)
    before = snapshot(cache, sched)
    with pytest.raises(ValueError, match="already completed.*completed once"):
        sched.step_done(plan)
    assert snapshot(cache, sched) == before
    assert sched.seqs[0].num_computed == cache.sequence_length(0) == 5
    stale = sched.schedule()
    latest = sched.schedule()  # plans the same decode again (e.g. after a failed forward)
    assert stale.parts == latest.parts == [Part(0, 5, 1, True)]
    before = snapshot(cache, sched)
    with pytest.raises(ValueError, match="not the one the last schedule"):
        sched.step_done(stale)
    assert snapshot(cache, sched) == before
    run_forward(cache, latest.seq_ids, latest.lengths)
    sched.step_done(latest)
    assert sched.seqs[0].num_computed == cache.sequence_length(0) == 6


@pytest.mark.parametrize(
    "finished, error, match",
    [
        ([99], KeyError, "finished\\[i\\] 99 is not a request"),
        ([0, 0], ValueError, "names a sequence twice"),
        (["x"], TypeError, "finished\\[i\\]"),
    ],
)
def test_step_done_rejects_bad_finished_before_counting(cache, finished, error, match):
    sched = Scheduler(cache)
    sched.add_request(0, 5)
    plan = sched.schedule()
    run_forward(cache, plan.seq_ids, plan.lengths)
    before = snapshot(cache, sched)
    with pytest.raises(error, match=match):
        sched.step_done(plan, finished)
    assert snapshot(cache, sched) == before
    sched.step_done(plan, [0])  # the plan is still open
    assert not sched.has_unfinished() and cache.sequence_ids() == []
    assert cache.num_available_pages() == NUM_PAGES


def test_scheduler_counters_are_python_ints(cache):
    """NumPy ids and lengths in, plain Python ints out: plan lengths, parts and statistics."""
    sched = Scheduler(cache, preemption="recompute", token_budget=np.int64(CHUNK))
    sched.add_request(np.int64(0), np.int64(40))
    sched.add_request(np.int32(1), np.int64(40))
    sched.add_request(np.int64(2), tokens=np.arange(30, dtype=np.int64))
    seen = []
    for _ in range(12):
        plan = sched.schedule()
        seen += [*plan.seq_ids, *plan.lengths, plan.num_tokens, *plan.admitted, *plan.swapped_in]
        seen += [p.start for p in plan.parts] + [sid for sid, _ in plan.preempted]
        run_forward(cache, plan.seq_ids, plan.lengths)
        tokens = {p.seq_id: 7 for p in plan.parts if p.samples}
        sched.step_done(plan, sampled=tokens)
        cache.check_integrity()
    assert sched.stats.preempted_recompute > 0  # the three outgrow 8 pages of 16
    seen += dataclasses.astuple(sched.stats)
    seen += [n for st in sched.seqs.values() for n in (st.seq_id, st.num_tokens, st.num_computed)]
    assert {type(x) for x in seen} == {int}


# ------------------------------------------------------------------------ item 9: interop shapes
@pytest.mark.parametrize("layout", interop.LAYOUTS)
def test_foreign_shape_rejects_negative_counts(cache, layout):
    with pytest.raises(ValueError, match="num_blocks=-3 must be >= 0"):
        interop.foreign_shape(cache, layout, -3)
    with pytest.raises(TypeError, match="num_blocks"):
        interop.foreign_shape(cache, layout, 1.5)
    assert all(type(n) is int and n >= 0 for n in interop.foreign_shape(cache, layout, 0))
    assert 3 in interop.foreign_shape(cache, layout, 3)


# ----------------------------------------------------------------------------- item 8: the CLIs
def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmkv", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def one_line_error(stderr: str) -> str:
    """The single line of a usage error (no traceback)."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_cli_help_lists_the_commands():
    done = run_cli("--help")
    assert done.returncode == 0, done.stderr
    for command in ("build", "replay", "generate"):
        assert f"\n  {command} " in done.stdout
    assert run_cli("-h").returncode == 0
    for args, problem in (((), "a command is required"), (("serve",), "unknown command 'serve'")):
        done = run_cli(*args)
        assert done.returncode == 2 and problem in done.stderr and "usage:" in done.stderr


@pytest.mark.parametrize(
    "command, args, words",
    [
        ("generate", ["--num-pages", "0", "--build-dir", "{tmp}"], ["--num-pages 0"]),
        ("replay", ["--head-dim", "20"], ["head_dim=20", "--head-dim"]),
        ("build", ["-j", "0", "--build-dir", "{tmp}"], ["--jobs 0", ">= 1"]),
    ],
)
def test_cli_bad_value_is_a_one_line_error(command, args, words, tmp_path):
    done = run_cli(command, *(a.format(tmp=tmp_path) for a in args))
    assert done.returncode == 2, (done.stdout, done.stderr)
    line = one_line_error(done.stderr)
    assert line.startswith(f"tvmkv {command}: error: ")
    for word in words:
        assert word in line
    assert "max_total_seq_len" not in line
    assert list(tmp_path.iterdir()) == []  # nothing compiled


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--num-pages", "0"], ["--num-pages 0 must be a positive int"]),
        (["--num-pages", "2"], ["--num-pages 2 cannot hold the longest sequence", "pass at least 4"]),
        (["--page-size", "0"], ["--page-size 0"]),
        (["--page-size", "3"], ["page_size=3", "--page-size"]),
        (["--layers", "0"], ["--layers 0"]),
        (["--prefill-chunk-size", "0"], ["--prefill-chunk-size 0"]),
        (["--max-batch-size", "-1"], ["--max-batch-size -1"]),
        (["--seed", "-1"], ["--seed -1 must be >= 0"]),
        (["--system-prompt", "-2"], ["--system-prompt -2 must be >= 0"]),
        (["--model-lib", "no/such/model.so"], ["--model-lib no/such/model.so", "--export-lib"]),
        (["--model-lib", "m.so", "--export-lib", "n.so"], ["not both"]),
    ],
)
def test_generate_rejects_bad_values(argv, words, capsys):
    from tvmkv.generate import main

    assert main(argv) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("tvmkv generate: error: ")
    for word in words:
        assert word in line
    assert "max_total_seq_len" not in line


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--head-dim", "0"], ["--head-dim 0 must be a positive int"]),
        (["--head-dim", "20"], ["head_dim=20", "multiple of 16", "--head-dim"]),
        (["--page-size", "3"], ["page_size=3", "power of two", "--page-size"]),
        (["--num-qo-heads", "3"], ["num_qo_heads=3", "num_kv_heads=2", "--num-qo-heads"]),
        (["--num-kv-heads", "0"], ["--num-kv-heads 0"]),
        (["--decode-splits", "0"], ["--decode-splits 0"]),
        (["nosuch"], ["unknown scenario(s) ['nosuch']"]),
    ],
)
def test_replay_rejects_bad_values(argv, words, capsys):
    from tvmkv.replay import main

    assert main(argv) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("tvmkv replay: error: ")
    for word in words:
        assert word in line


def test_build_rejects_zero_jobs(tmp_path, capsys):
    from tvmkv.build import main

    for jobs in ("0", "-2"):
        assert main(["-j", jobs, "--build-dir", str(tmp_path)]) == 2
        assert f"--jobs {jobs} must be >= 1" in one_line_error(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_generate_model_lib_names_a_config_mismatch(tmp_path):
    """--export-lib stores what the model was compiled for beside it; --model-lib with other options
    names each difference and its option before loading anything."""
    from tvmkv.generate import main
    from tvmkv.relax.llama_config import LlamaConfig

    lib = tmp_path / "model.so"
    done = run_cli("generate", "--export-lib", str(lib))
    assert done.returncode == 0, done.stderr
    meta = json.loads(lib.with_suffix(".json").read_text())
    want = {k: v for k, v in dataclasses.asdict(LlamaConfig()).items() if k != "seed"}
    assert meta["model"] == json.loads(json.dumps({**want, "interface": "tvmkv", "target": "llvm"}))
    assert len(meta["param_names"]) == 15  # embedding, 6 per layer, norm, head
    done = run_cli("generate", "--model-lib", str(lib))  # the options it was exported with: it runs
    assert done.returncode == 0, done.stderr
    done = run_cli("generate", "--model-lib", str(lib), "--head-dim", "128", "--layers", "3")
    assert done.returncode == 2
    line = one_line_error(done.stderr)
    assert f"--model-lib {lib} was exported for another model" in line
    assert "num_layers=2 where this run has 3 (--layers)" in line
    assert "head_dim=64 where this run has 128 (--head-dim)" in line
    assert "max_total_seq_len" not in line
    # the interface too (in-process: the same check)
    assert main(["--model-lib", str(lib), "--interface", "tvm", "--dtype", "float16"]) == 2


def test_generate_model_lib_mismatch_is_found_before_loading(tmp_path, capsys):
    """The check reads only model.json: a library file that is not one is never loaded."""
    from tvmkv.generate import main

    lib = tmp_path / "model.so"
    lib.write_bytes(b"not a library")
    model = {"num_layers": 2, "head_dim": 128, "dtype": "float32", "interface": "tvm", "target": "llvm"}
    lib.with_suffix(".json").write_text(json.dumps({"param_names": [], "model": model}))
    assert main(["--model-lib", str(lib)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "head_dim=128 where this run has 64 (--head-dim)" in line
    assert "interface='tvm' where this run has 'tvmkv' (--interface)" in line
    assert "vocab_size=None where this run has 256 (not an option" in line


def test_out_sharing_memory_with_qkv_is_refused(cache):
    """An ``out`` that overlaps ``qkv`` would be written while the kernels still read q, k and v from
    qkv (a decode, and a prefill in rope mode "none", read qkv in place): refused with the fix named,
    nothing appended; the same call with an output of its own then matches the NumPy reference."""
    import tvm

    from tvmkv.reference.cache_model import CacheModel

    cfg = cache.config
    rng = np.random.default_rng(3)
    n = 20
    qkv_np = rng.uniform(-1, 1, (n, cfg.qkv_heads, cfg.head_dim)).astype("float32")
    qkv = tvm.runtime.tensor(qkv_np, tvm.cpu())
    cache.add_sequence(0)
    cache.begin_forward([0], [n])
    with pytest.raises(ValueError, match="shares memory with qkv"):  # a view starting where qkv starts
        cache.attention_with_fused_qkv(0, qkv, out=qkv._create_view((n, cfg.num_qo_heads, cfg.head_dim)))
    assert np.array_equal(qkv.numpy(), qkv_np)  # nothing written
    out = tvm.runtime.empty((n, cfg.num_qo_heads, cfg.head_dim), "float32", tvm.cpu())
    cache.attention_with_fused_qkv(0, qkv, out=out)
    for layer in range(1, cfg.num_layers):
        cache.attention_with_fused_qkv(layer, qkv)
    cache.end_forward()
    model = CacheModel(cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim)
    model.add(0)
    model.begin([0], [n])
    want, _ = model.attention(0, qkv_np.astype(np.float64))
    np.testing.assert_allclose(out.numpy(), want, atol=2e-4, rtol=2e-4)
