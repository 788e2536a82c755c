"""Per-step host overhead of decode and prefill steps: tvmkv's Python manager vs TVM's C++ paged KV cache.

One step = ``begin_forward`` (plan + page-table upload) + one attention dispatch (layer 0) +
``end_forward``, for decode batches 1, 32 and 256 over 2k-token histories, at two pool capacities
(just enough pages, and 4x as many: the cost must follow the batch, not the pool). Both caches run
in this process with **stub kernels** (the real kernels' signatures, bodies emptied: the host-side
argument checks of every call remain, the device work is gone), so only host overhead is timed.
Rows with a *changed batch* take tvmkv's general planning path (a repeated batch takes its fast path);
the change between two steps (not timed: only begin / attention / end are) is one of :data:`CHURN`:

- ``flip``: the batch order is reversed every step;
- ``replace``: one sequence is removed and a new, empty one takes its row (a departure and an arrival);
- ``fork``: one row's sequence is forked at its last page boundary and rolled back one token
  (``pop_n``), the child takes the row (the parent is removed a step later), so the child's next
  token is written into a page it shares: copy-on-write in ``begin_forward``;
- ``chunk``: the same batch, but one row (a different one each step) appends a 16-token chunk while
  the others decode: a prefill chunk mixed with decodes (chunked prefill), a prefill step to the
  cache;
- ``prefill``: every row appends 16 tokens (a prefill step of the whole batch).

- tvmkv: ``PagedAttentionKVCache`` with its kernel library replaced by stubs of ``tvmkv.tir.kernel_set``.
- TVM: ``vm.builtin.paged_attention_kv_cache_create`` with stubs of the PrimFuncs
  ``tvm.relax.frontend.nn.llm.kv_cache.TIRPagedKVCache`` passes for the target (28 arguments, in
  TVM's order), driven by ``vm.builtin.kv_state_begin_forward``,
  ``attention_kv_cache_attention_with_fused_qkv`` and ``kv_state_end_forward``.

Usage::

    .venv/bin/python bench/host.py [--target llvm|cuda] [--steps 200] [--out DIR] [--write]
    .venv/bin/python bench/host.py --prepare DIR --target cuda   # stub libraries for a runtime-only TVM

``--write`` replaces the "Host path" section of bench/RESULTS.md. On the GPU machine (runtime-only
TVM) run with ``--stubs DIR`` pointing at what ``--prepare`` wrote here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _common import default_out_dir, machine_meta, tvm_cache_funcs, tvm_create_args, write_results

H_QO, H_KV, D, P, DTYPE = 8, 2, 64, 16, "float16"  # small: with stubs the shape only sizes the pool
BATCHES = (1, 32, 256)
CHURN = {
    "flip": "order flipped every step",
    "replace": "one replaced every step",
    "fork": "a fork every step",
    "chunk": "a 16-token chunk in one row",
    "prefill": "16 tokens in every row",
}
CHUNK = 16  # new tokens of a row that takes a chunk (churn kinds "chunk" and "prefill")
HISTORY = 2048
MARK_BEGIN, MARK_END = "<!-- host:begin -->", "<!-- host:end -->"


# ------------------------------------------------------------------------------------------------
# Stub kernels: the real signatures with empty bodies
# ------------------------------------------------------------------------------------------------


def stub(func):
    """``func`` with the same parameters and buffers and an empty body (host checks remain)."""
    import tvm

    return func.with_body(tvm.tirx.Evaluate(tvm.tirx.const(0, "int32")))


def compile_stubs(funcs: list, target_kind: str):
    import tvm

    from tvmkv.target import make_target

    mod = tvm.IRModule({n: stub(f).with_attr("global_symbol", n) for n, f in funcs})
    return tvm.compile(mod, target=make_target(target_kind), tir_pipeline="tirx")


def stub_libraries(target_kind: str, stub_dir: Path | None):
    """``(tvmkv stub module, [tvmkv names], TVM stub module, [TVM names])``: compiled here, or loaded
    from ``stub_dir`` (written by ``--prepare``) on a runtime-only TVM."""
    import tvm

    if stub_dir is not None and (stub_dir / "names.json").exists():
        names = json.loads((stub_dir / "names.json").read_text())
        return (
            tvm.runtime.load_module(str(stub_dir / "tvmkv_stubs.so")),
            names["tvmkv"],
            tvm.runtime.load_module(str(stub_dir / "tvm_stubs.so")),
            names["tvm"],
        )
    from tvmkv.tir import kernel_set
    from tvmkv.tir.spec import KernelSpec

    ours = list(kernel_set(KernelSpec(H_QO, H_KV, D, P, DTYPE, target_kind)).items())
    theirs = tvm_cache_funcs(target_kind, num_layers=1, h_qo=H_QO, h_kv=H_KV, d=D, page_size=P, dtype=DTYPE)
    return (
        compile_stubs(ours, target_kind),
        [n for n, _ in ours],
        compile_stubs(theirs, target_kind),
        [n for n, _ in theirs],
    )


def prepare(stub_dir: Path, target_kind: str) -> None:
    stub_dir.mkdir(parents=True, exist_ok=True)
    ours, ours_names, theirs, theirs_names = stub_libraries(target_kind, None)
    ours.export_library(str(stub_dir / "tvmkv_stubs.so"))
    theirs.export_library(str(stub_dir / "tvm_stubs.so"))
    (stub_dir / "names.json").write_text(json.dumps({"tvmkv": ours_names, "tvm": theirs_names}))
    print(f"wrote {stub_dir}: {sorted(p.name for p in stub_dir.iterdir())}")


# ------------------------------------------------------------------------------------------------
# The two caches behind one small interface
# ------------------------------------------------------------------------------------------------


class _StubLibrary:
    def __init__(self, module):
        self.module, self._f = module, {}

    def __getitem__(self, name):
        f = self._f.get(name)
        if f is None:
            f = self._f[name] = self.module[name]
        return f

    def __contains__(self, name):
        # tvm.compile's Executable (stubs compiled in this process) wraps the runtime module in .mod
        return getattr(self.module, "mod", self.module).implements_function(name)


def make_tvmkv(libs, target_kind, batch, num_pages, max_total, chunk, device_planning=True, layers=1):
    import tvmkv.build
    from tvmkv import PagedAttentionKVCache

    real = tvmkv.build.load_kernels
    tvmkv.build.load_kernels = lambda *a, **k: _StubLibrary(libs[0])  # no real kernels needed
    try:
        cache = PagedAttentionKVCache(
            layers,
            H_QO,
            H_KV,
            D,
            page_size=P,
            max_batch_size=batch,
            max_total_seq_len=max_total,
            prefill_chunk_size=chunk,
            dtype=DTYPE,
            target=target_kind,
            num_pages=num_pages,
            device_planning=device_planning,
        )
    finally:
        tvmkv.build.load_kernels = real

    class Ops:
        add = cache.add_sequence
        remove = cache.remove_sequence
        fork = cache.fork_sequence
        pop_n = cache.pop_n
        begin = cache.begin_forward
        end = cache.end_forward

        @staticmethod
        def attn(qkv, out):
            cache.attention_with_fused_qkv(0, qkv, out=out)

    return cache, Ops


def make_tvm(libs, device, batch, max_total, chunk, layers=1):
    import tvm
    import tvm_ffi

    args = tvm_create_args(
        libs[2],
        libs[3],
        device,
        max_batch=batch,
        max_total=max_total,
        chunk=chunk,
        num_layers=layers,
        h_qo=H_QO,
        h_kv=H_KV,
        d=D,
        page_size=P,
        dtype=DTYPE,
    )
    cache = tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")(*args)
    g = {
        n: tvm.get_global_func("vm.builtin." + n)
        for n in (
            "kv_state_add_sequence",
            "kv_state_remove_sequence",
            "kv_state_fork_sequence",
            "kv_state_popn",
            "kv_state_begin_forward",
            "kv_state_end_forward",
            "attention_kv_cache_attention_with_fused_qkv",
        )
    }
    scale = D**-0.5

    class Ops:
        @staticmethod
        def add(s):
            g["kv_state_add_sequence"](cache, s)

        @staticmethod
        def remove(s):
            g["kv_state_remove_sequence"](cache, s)

        @staticmethod
        def fork(parent, child, pos):
            g["kv_state_fork_sequence"](cache, parent, child, pos)

        @staticmethod
        def pop_n(s, n):
            g["kv_state_popn"](cache, s, n)

        @staticmethod
        def begin(ids, lens):
            g["kv_state_begin_forward"](cache, tvm_ffi.Shape(ids), tvm_ffi.Shape(lens))

        @staticmethod
        def end():
            g["kv_state_end_forward"](cache)

        @staticmethod
        def attn(qkv, out):
            g["attention_kv_cache_attention_with_fused_qkv"](cache, 0, scale, qkv, out)

    return cache, Ops


class Churn:
    """The batch of each step of one cache under churn ``kind`` (:data:`CHURN`; "" = none): the
    changes between steps go through ``ops`` and are not timed."""

    def __init__(self, ops, kind: str, batch: int):
        self.ops, self.kind = ops, kind
        self.ids = list(range(batch))
        self.lengths = dict.fromkeys(self.ids, HISTORY)
        self.next_id, self.row, self.retired = batch, 0, []
        self.lens = [1] * batch  # new tokens per row of the current step

    def batch(self, step: int) -> tuple:
        """(seq_ids, append_lengths) of step ``step``."""
        ids = self.ids
        self.lens = [1] * len(ids)
        if self.kind == "chunk":
            self.lens[step % len(ids)] = CHUNK
        elif self.kind == "prefill":
            self.lens = [CHUNK] * len(ids)
        return self.order(step), self.lens

    def order(self, step: int) -> list:
        ids, ops = self.ids, self.ops
        if self.kind == "flip":
            return ids[::-1] if step % 2 else ids
        if self.kind in ("replace", "fork"):
            r, new = self.row, self.next_id
            self.row, self.next_id = (r + 1) % len(ids), new + 1
            for s in self.retired:
                ops.remove(s)
            self.retired = [ids[r]]
            if self.kind == "replace":
                ops.add(new)
                self.lengths[new] = 0
            else:  # fork at the last page boundary (pages shared), roll back one token: a shared partial page
                at = self.lengths[ids[r]] // P * P
                ops.fork(ids[r], new, at)
                ops.pop_n(new, 1)
                self.lengths[new] = at - 1
            del self.lengths[ids[r]]
            ids[r] = new
        return ids

    def stepped(self) -> None:
        for s, n in zip(self.ids, self.lens):
            self.lengths[s] += n


def run_pair(libs, target_kind, batch, capacity_factor, steps, *, churn="", block=10, layers=1) -> list:
    """Median µs per decode step (and per phase) of TVM's cache and tvmkv for one batch and pool size.

    Both caches live in this process and run in alternating blocks of ``block`` steps, so load from
    other processes hits both alike. ``churn`` (a key of :data:`CHURN`): the batch changes every step
    (untimed), which forces tvmkv's general planning path instead of its same-batch decode fast path.
    """
    import tvm

    device = tvm.cpu(0) if target_kind == "llvm" else tvm.cuda(0)
    grow = {"chunk": 1 + CHUNK / batch, "prefill": CHUNK}.get(churn, 1)  # tokens a row gains per step, on average
    need_tokens = batch * (HISTORY + int((steps + 2 * block) * grow) + 2 * CHUNK + 2 * P)
    max_total = need_tokens * capacity_factor
    num_pages = -(-max_total // P) + batch
    chunk = max(HISTORY, batch * CHUNK)
    impls = {
        "tvm": make_tvm(libs, device, batch, max_total, chunk, layers),
        "tvmkv": make_tvmkv(libs, target_kind, batch, num_pages, max_total, chunk, layers=layers),
    }
    if churn:  # the same cache planning changed decode batches and prefill steps on the host
        impls["tvmkv_host"] = make_tvmkv(libs, target_kind, batch, num_pages, max_total, chunk, False, layers)
    ids = list(range(batch))
    tensors: dict = {}  # tokens of a step -> (qkv, out)

    def qkv_out(total: int) -> tuple:
        if total not in tensors:
            tensors[total] = (
                tvm.runtime.tensor(np.zeros((total, H_QO + 2 * H_KV, D), DTYPE), device),
                tvm.runtime.empty((total, H_QO, D), DTYPE, device),
            )
        return tensors[total]

    times = {impl: ([], [], [], []) for impl in impls}
    batches = {}
    for impl, (_, ops) in impls.items():
        for s in ids:
            ops.add(s)
            ops.begin([s], [HISTORY])  # 2k-token history; no attention call needed to reserve it
            ops.end()
        batches[impl] = Churn(ops, churn, batch)
    clock = time.perf_counter
    done = {impl: -5 for impl in impls}  # 5 warm-up steps each: view caches, first calls
    while min(done.values()) < steps:
        for impl, (_, ops) in impls.items():
            tb, ta, te, tt = times[impl]
            churner = batches[impl]
            for _ in range(block):
                order, lens = churner.batch(done[impl])
                qkv, out = qkv_out(sum(lens))
                t0 = clock()
                ops.begin(order, lens)
                t1 = clock()
                ops.attn(qkv, out)
                t2 = clock()
                ops.end()
                t3 = clock()
                churner.stepped()
                if done[impl] >= 0:
                    tb.append(t1 - t0), ta.append(t2 - t1), te.append(t3 - t2), tt.append(t3 - t0)
                done[impl] += 1
    device.sync()
    del impls
    gc.collect()
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    return [
        {
            "impl": impl,
            "batch": batch,
            "capacity_factor": capacity_factor,
            "churn": churn,
            "num_pages": num_pages,
            "begin_us": med(tb),
            "attn_us": med(ta),
            "end_us": med(te),
            "step_us": med(tt),
            "step_p90_us": float(np.percentile(tt, 90) * 1e6),
            "steps": len(tt),
        }
        for impl, (tb, ta, te, tt) in times.items()
    ]


def render(rows, meta) -> str:
    lines = [
        "## Host path",
        "",
        f"Measured {meta['date']} on `{meta['host']}` ({meta['cpu']}, {meta['ncpu']} CPUs, load average "
        f"{meta['load']:.1f}), target `{meta['target']}`{', ' + meta['device'] if meta.get('device') else ''}, "
        f"TVM {meta['tvm']}, {meta.get('layers', 1)} layer{'s' if meta.get('layers', 1) > 1 else ''}. One decode "
        f"step = begin_forward (plan + page-table upload) + one attention "
        f"call (layer 0) + end_forward; {HISTORY}-token histories; stub kernels (real signatures, empty "
        "bodies) in both caches, so this is host overhead only. Median µs over "
        f"{meta['steps']} steps; the caches run in alternating blocks of 10 steps in one process, so "
        "load from other processes hits both alike. tvmkv plans a decode step of the same batch as the "
        "step before by updating that plan in place (`repeat_decode.RepeatDecode`); rows with a changed batch "
        "take its general planning path: *order flipped* reverses the batch order each step, *one replaced* "
        "removes one sequence and adds a new, empty one in its row, *a fork* replaces one row's sequence "
        "by a fork of it at its last page boundary rolled back one token (`pop_n` 1; the parent is removed "
        "a step later), so that step writes into a shared page (copy-on-write); *a 16-token chunk in one "
        "row* keeps the batch but one row (a different one each step) appends 16 tokens while the others "
        "decode (chunked prefill beside decodes), *16 tokens in every row* is a prefill step of the whole "
        "batch: both are prefill steps to the caches. The changes themselves "
        "are not timed. "
        "`bench/host.py --write` regenerates this section.",
        "",
        "Acceptance: same batch every step, tvmkv step <= 0.5x TVM at batch 256, <= 1x at 32, <= 1.5x "
        "at 1; changed batch and prefill steps (issue 16's general path), tvmkv begin_forward <= 50 µs at "
        "batch <= 32, <= 0.5x TVM's begin_forward at batch 256.",
        "",
        "| batch | pool | pages | tvmkv step µs (begin / attn / end) | tvmkv begin µs, planned on the host "
        "| TVM C++ step µs (begin / attn / end) | tvmkv / TVM | target | ok |",
        "| ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | --- |",
    ]
    goal = {1: 1.5, 32: 1.0, 256: 0.5}
    by = {(r["impl"], r["batch"], r["capacity_factor"], r["churn"]): r for r in rows if "step_us" in r}
    order = ["", *CHURN]
    for (impl, b, cf, churn), r in sorted(by.items(), key=lambda kv: (order.index(kv[0][3]), kv[0][1], kv[0][2])):
        if impl != "tvmkv":
            continue
        t = by.get(("tvm", b, cf, churn))
        h = by.get(("tvmkv_host", b, cf, churn))
        hosted = f"{h['begin_us']:.1f}" if h else ""
        ours = f"{r['step_us']:.1f} ({r['begin_us']:.1f} / {r['attn_us']:.1f} / {r['end_us']:.1f})"
        theirs = (
            "n/a"
            if t is None
            else (f"{t['step_us']:.1f} ({t['begin_us']:.1f} / {t['attn_us']:.1f} / {t['end_us']:.1f})")
        )
        ratio = r["step_us"] / t["step_us"] if t else float("nan")
        if churn:  # the general path's goal is on begin_forward alone
            target = "begin <= 50 µs" if b <= 32 else "begin <= 0.5x"
            met = r["begin_us"] <= 50 if b <= 32 else t is not None and r["begin_us"] <= 0.5 * t["begin_us"]
        else:
            g = goal.get(b)
            target = f"<= {g}" if g else ""
            met = g is not None and t is not None and ratio <= g
        ok = "" if not target else ("yes" if met else "**no**")
        lines.append(
            f"| {b}{f' ({CHURN[churn]})' if churn else ''} | {cf}x | {r['num_pages']:,} | {ours} | {hosted} | {theirs} "
            f"| {ratio:.2f} | {target} | {ok} |"
        )
    for r in rows:
        if "error" in r:
            lines.append(f"\n{r['impl']} batch {r['batch']} pool {r['capacity_factor']}x failed: {r['error']}")
    lines += [
        "",
        "How tvmkv plans these steps: a batch that repeats the previous decode step's is advanced in place "
        "(`repeat_decode.RepeatDecode`: one add over the packed `q_pos` / `slots` / `last_page_len`, a page for each "
        "sequence whose new token opens one, one upload). A changed batch is planned on the device "
        '(`device_plan.DevicePlanner`, docs/layout.md "Device page table"): the pages are reserved on the '
        "host, then five ints per sequence (row, kv length, first page the device table lacks, where those "
        "pages sit, page_indptr) and the pages the table lacks are packed into one stage (`struct`), "
        "uploaded, and one `plan_decode` launch patches the table and writes the step's arrays into the "
        "index buffer; C-level passes over the batch only (`map`, `accumulate`, `compress`) besides one "
        "Python loop that advances each sequence's length. The column *planned on the host* is the same "
        "cache with `device_planning=False`, in the same process and alternation: there a batch of the "
        "same size with a few rows replaced "
        "(the *one replaced* and *a fork* rows) patches the kept plan: the kept rows advance in place, the "
        "new rows (and their copy-on-write) are written, page tables rewritten from the first changed row, "
        "provided every kept row's record is as the last step left it (`Sequence.stamp`). Any other "
        "changed decode batch (the *order flipped* rows) takes `plan.Planner`'s "
        "decode path: up to 64 sequences over Python ints written as one int32 run, "
        "above that about a dozen whole-batch NumPy calls; the layout, host views, device views, constant "
        "arrays and the bound forward (`launch.Forward`, rebound only to the new batch) of each batch size "
        'and slot are kept, `page_indices` is one `b"".join` of the sequences\' page arrays, copy-on-write '
        "is looked for only when some last page is in the pool's set of shared pages, and Python runs per "
        "sequence only for those that get a page (`struct` writes that run). Batch 1 "
        "with its order flipped is the same batch (the fast path). The fork rows' begin_forward includes "
        "the copy of the shared page (one `copy_page_layers` launch for every layer); TVM's cache copies in "
        "`fork_sequence`, which is not timed. A prefill or mixed step without token trees or windows (the two "
        "chunk rows) is planned on the device too (`plan.Planner._prefill_device`): Python ints per sequence "
        "(pages to reserve, handed out by one allocation; indptrs), seven ints per sequence and the new "
        "pages packed into the stage, and one `plan_prefill` launch that writes every array, the positions "
        "and slots of the new tokens included; the bound forward of its shape, slot and kernel is kept and "
        "rebound only to the new batch. Planned on the host, such a step of up to 64 sequences takes "
        "`plan.Planner._prefill_few` (Python ints per sequence, NumPy per new token), a larger one the "
        "general path (`plan.plan_step`, whole-batch NumPy), as token-tree steps and windows always do "
        "(not timed here).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--layers", type=int, default=1, help="layers of both caches (a fork's copy-on-write copies every layer)"
    )
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--capacity", type=int, nargs="+", default=[1, 4], help="pool size factors")
    ap.add_argument(
        "--churn", type=int, nargs="*", default=list(BATCHES), help="batches also timed with a changed batch every step"
    )
    ap.add_argument("--churn-kinds", nargs="*", choices=list(CHURN), default=list(CHURN), help="how the batch changes")
    ap.add_argument("--prepare", type=Path, help="only compile the stub libraries into this folder")
    ap.add_argument("--stubs", type=Path, help="load stub libraries from here (runtime-only TVM)")
    ap.add_argument("--out", type=Path, default=default_out_dir(), help="write JSON + table here (default $OUT)")
    ap.add_argument("--write", action="store_true", help="write the Host path section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    if args.prepare:
        prepare(args.prepare, args.target)
        return 0
    from tvmkv.payload import bootstrap

    bootstrap()  # $TVMKV_PAYLOAD: the GPU machine's runtime-only TVM, before tvm is imported
    libs = stub_libraries(args.target, args.stubs)
    rows = []
    cases = [(b, cf, "") for b in args.batches for cf in args.capacity]
    cases += [(b, 1, kind) for kind in args.churn_kinds for b in args.churn]
    for b, cf, churn in cases:
        try:
            pair = run_pair(libs, args.target, b, cf, args.steps, churn=churn, layers=args.layers)
        except Exception as err:  # noqa: BLE001 - report and go on
            import traceback

            traceback.print_exc()
            pair = [{"impl": "tvmkv", "batch": b, "capacity_factor": cf, "churn": churn, "error": repr(err)}]
        for r in pair:
            if "step_us" in r:
                print(
                    f"{r['impl']:6s} B={b:4d} pool {cf}x{' ' + churn if churn else ''}: step {r['step_us']:8.1f} us "
                    f"(begin {r['begin_us']:.1f}, attn {r['attn_us']:.1f}, end {r['end_us']:.1f})",
                    flush=True,
                )
        rows += pair
    meta = {**machine_meta(args.target), "steps": args.steps, "layers": args.layers}
    table = render(rows, meta)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"host_{args.target}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (args.out / f"host_{args.target}.md").write_text(table)
    if args.write:
        write_results(table, MARK_BEGIN, MARK_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
