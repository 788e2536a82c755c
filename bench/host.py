"""Per-step host overhead of a decode step: tvmkv's Python manager vs TVM's C++ paged KV cache.

One step = ``begin_forward`` (plan + page-table upload) + one attention dispatch (layer 0) +
``end_forward``, for decode batches 1, 32 and 256 over 2k-token histories, at two pool capacities
(just enough pages, and 4x as many: the cost must follow the batch, not the pool). Both caches run
in this process with **stub kernels** (the real kernels' signatures, bodies emptied: the host-side
argument checks of every call remain, the device work is gone), so only host overhead is timed:

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


def make_tvmkv(libs, target_kind, batch, num_pages, max_total, chunk):
    import tvmkv.build
    from tvmkv import PagedAttentionKVCache

    real = tvmkv.build.load_kernels
    tvmkv.build.load_kernels = lambda *a, **k: _StubLibrary(libs[0])  # no real kernels needed
    try:
        cache = PagedAttentionKVCache(
            1,
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
        )
    finally:
        tvmkv.build.load_kernels = real

    class Ops:
        add = cache.add_sequence
        begin = cache.begin_forward
        end = cache.end_forward

        @staticmethod
        def attn(qkv, out):
            cache.attention_with_fused_qkv(0, qkv, out=out)

    return cache, Ops


def make_tvm(libs, device, batch, max_total, chunk):
    import tvm
    import tvm_ffi

    args = tvm_create_args(
        libs[2],
        libs[3],
        device,
        max_batch=batch,
        max_total=max_total,
        chunk=chunk,
        num_layers=1,
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
        def begin(ids, lens):
            g["kv_state_begin_forward"](cache, tvm_ffi.Shape(ids), tvm_ffi.Shape(lens))

        @staticmethod
        def end():
            g["kv_state_end_forward"](cache)

        @staticmethod
        def attn(qkv, out):
            g["attention_kv_cache_attention_with_fused_qkv"](cache, 0, scale, qkv, out)

    return cache, Ops


def run_pair(libs, target_kind, batch, capacity_factor, steps, *, churn=False, block=10) -> list:
    """Median µs per decode step (and per phase) of TVM's cache and tvmkv for one batch and pool size.

    Both caches live in this process and run in alternating blocks of ``block`` steps, so load from
    other processes hits both alike. ``churn``: the batch order flips every step (a changed batch),
    which forces tvmkv's general planning path instead of its same-batch decode fast path.
    """
    import tvm

    device = tvm.cpu(0) if target_kind == "llvm" else tvm.cuda(0)
    need_tokens = batch * (HISTORY + steps + block + 2 * P)
    max_total = need_tokens * capacity_factor
    num_pages = -(-max_total // P) + batch
    chunk = HISTORY
    impls = {
        "tvm": make_tvm(libs, device, batch, max_total, chunk),
        "tvmkv": make_tvmkv(libs, target_kind, batch, num_pages, max_total, chunk),
    }
    ids = list(range(batch))
    orders = (ids, ids[::-1]) if churn else (ids,)
    qkv = tvm.runtime.tensor(np.zeros((batch, H_QO + 2 * H_KV, D), DTYPE), device)
    out = tvm.runtime.empty((batch, H_QO, D), DTYPE, device)
    ones = [1] * batch
    times = {impl: ([], [], [], []) for impl in impls}
    for _, ops in impls.values():
        for s in ids:
            ops.add(s)
            ops.begin([s], [HISTORY])  # 2k-token history; no attention call needed to reserve it
            ops.end()
    clock = time.perf_counter
    done = {impl: -5 for impl in impls}  # 5 warm-up steps each: view caches, first calls
    while min(done.values()) < steps:
        for impl, (_, ops) in impls.items():
            tb, ta, te, tt = times[impl]
            for _ in range(block):
                order = orders[done[impl] % len(orders)]
                t0 = clock()
                ops.begin(order, ones)
                t1 = clock()
                ops.attn(qkv, out)
                t2 = clock()
                ops.end()
                t3 = clock()
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
        f"TVM {meta['tvm']}. One decode step = begin_forward (plan + page-table upload) + one attention "
        f"call (layer 0) + end_forward; {HISTORY}-token histories; stub kernels (real signatures, empty "
        "bodies) in both caches, so this is host overhead only. Median µs over "
        f"{meta['steps']} steps; the two caches run in alternating blocks of 10 steps in one process, so "
        "load from other processes hits both alike. tvmkv plans a decode step of the same batch as the "
        "step before by updating that plan in place (`plan.RepeatDecode`); rows marked *changed every "
        "step* flip the batch order each step, which forces its general planning path. "
        "`bench/host.py --write` regenerates this section.",
        "",
        "Acceptance: tvmkv step <= 0.5x TVM at batch 256, <= 1x at 32, <= 1.5x at 1.",
        "",
        "| batch | pool | pages | tvmkv step µs (begin / attn / end) | TVM C++ step µs (begin / attn / end) "
        "| tvmkv / TVM | target | ok |",
        "| ---: | ---: | ---: | --- | --- | ---: | ---: | --- |",
    ]
    goal = {1: 1.5, 32: 1.0, 256: 0.5}
    by = {(r["impl"], r["batch"], r["capacity_factor"], r["churn"]): r for r in rows if "step_us" in r}
    for (impl, b, cf, churn), r in sorted(by.items(), key=lambda kv: (kv[0][3], kv[0][1], kv[0][2])):
        if impl != "tvmkv":
            continue
        t = by.get(("tvm", b, cf, churn))
        ours = f"{r['step_us']:.1f} ({r['begin_us']:.1f} / {r['attn_us']:.1f} / {r['end_us']:.1f})"
        theirs = (
            "n/a"
            if t is None
            else (f"{t['step_us']:.1f} ({t['begin_us']:.1f} / {t['attn_us']:.1f} / {t['end_us']:.1f})")
        )
        ratio = r["step_us"] / t["step_us"] if t else float("nan")
        g = None if churn else goal.get(b)
        ok = "" if g is None or t is None else ("yes" if ratio <= g else "**no**")
        lines.append(
            f"| {b}{' (changed every step)' if churn else ''} | {cf}x | {r['num_pages']:,} | {ours} | {theirs} "
            f"| {ratio:.2f} | "
            f"{'<= ' + str(g) if g else ''} | {ok} |"
        )
    for r in rows:
        if "error" in r:
            lines.append(f"\n{r['impl']} batch {r['batch']} pool {r['capacity_factor']}x failed: {r['error']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--capacity", type=int, nargs="+", default=[1, 4], help="pool size factors")
    ap.add_argument(
        "--churn", type=int, nargs="*", default=[32], help="batches also timed with a changed batch every step"
    )
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
    cases = [(b, cf, False) for b in args.batches for cf in args.capacity]
    cases += [(b, 1, True) for b in args.churn]
    for b, cf, churn in cases:
        try:
            pair = run_pair(libs, args.target, b, cf, args.steps, churn=churn)
        except Exception as err:  # noqa: BLE001 - report and go on
            import traceback

            traceback.print_exc()
            pair = [{"impl": "tvmkv", "batch": b, "capacity_factor": cf, "churn": churn, "error": repr(err)}]
        for r in pair:
            if "step_us" in r:
                print(
                    f"{r['impl']:6s} B={b:4d} pool {cf}x{' churn' if churn else ''}: step {r['step_us']:8.1f} us "
                    f"(begin {r['begin_us']:.1f}, attn {r['attn_us']:.1f}, end {r['end_us']:.1f})",
                    flush=True,
                )
        rows += pair
    meta = {**machine_meta(args.target), "steps": args.steps}
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
