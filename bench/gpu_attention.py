"""GPU attention benchmark: tvmkv's kernels vs TVM's own paged KV cache and kernels vs torch SDPA.

fp16, H_qo 32, H_kv 8, D 128, page size 16. Decode at batch x context 1x1024, 32x1024, 64x4096,
128x4096, 256x2048; causal prefill 1x4096 and 8x512 on empty history, 4x1024 new tokens on 2048
tokens of history. Times are CUDA-event medians of many calls (µs); KV bandwidth is bytes of K/V read
over the time, as % of a device-to-device copy rate measured in the same run; TFLOP/s counts
QK^T and PV only (4 * H_qo * D per visible query-key pair).

- tvmkv: the KernelLibrary functions called directly on prepared index arrays (paged_decode,
  ragged_prefill_causal, paged_prefill_causal), plus one row through the full cache
  (``attention_with_fused_qkv``: split + append + attention) for reference. Outputs are checked
  against torch.
- TVM kernel, TVM: TVM's own kernels and cache (bench/gpu_tvm_baseline.py), each in worker
  processes: a crash or hang there is reported for that case (``--tvm-budget`` seconds in all) and
  the benchmark goes on.
- torch: ``scaled_dot_product_attention`` on contiguous ``[B, H, L, D]`` K/V of the same data
  (``enable_gqa``; a bottom-right causal boolean mask when there is history).

Build machine (full TVM + nvcc)::

    python -m tvmkv build --target cuda --arch sm_90 --num-qo-heads 32 --num-kv-heads 8 \\
        --head-dim 128 --page-size 16 --dtype float16
    .venv/bin/python bench/gpu_tvm_baseline.py --prepare build/tvm-cuda-sm_90

GPU machine (runtime-only TVM), carry ``.devpayload``, ``build/cuda-sm_90``, ``build/tvm-cuda-sm_90``::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        python3 bench/gpu_attention.py --tvm-lib build/tvm-cuda-sm_90 --out $OUT

Every section logs its traceback on failure and the rest continues; results go to
``$OUT/gpu.json`` and ``$OUT/gpu.md`` (``--write`` also replaces the GPU section of bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from _attention_cases import (
    DTYPE,
    H_KV,
    H_QO,
    D,
    P,
    api_cache,
    flops_and_bytes,
    gpu_meta,
    label,
    load_tvmkv_kernels,
    make_case,
    torch_run,
    tvmkv_run,
)
from _common import ROOT, CudaTimer, default_out_dir, write_results
from gpu_tvm_baseline import run_tvm_isolated

from tvmkv.build import default_build_dir
from tvmkv.payload import bootstrap
from tvmkv.target import default_cuda_arch

DECODE = [(1, 1024), (32, 1024), (64, 4096), (128, 4096), (256, 2048)]
PREFILL = [(1, 4096, 0), (8, 512, 0), (4, 1024, 2048)]  # (batch, new tokens, history), causal
FULL_CACHE_CASE = ("decode", 32, 1, 1024)
MARK_BEGIN, MARK_END = "<!-- gpu:begin -->", "<!-- gpu:end -->"


def tvmkv_full_cache_run(c):
    """tvmkv through ``PagedAttentionKVCache.attention_with_fused_qkv`` (split + append + attention)."""
    import tvm

    B, n, hist = c["B"], c["n"], c["hist"] if c["kind"] == "prefill" else c["L"]
    cache = api_cache(B, hist, n)
    dev = tvm.cuda(0)
    rng = np.random.default_rng(1)
    qkv = tvm.runtime.tensor(rng.uniform(-1, 1, (B * n, H_QO + 2 * H_KV, D)).astype(DTYPE), dev)
    out = tvm.runtime.empty((B * n, H_QO, D), DTYPE, dev)
    return (lambda: cache.attention_with_fused_qkv(0, qkv, out=out)), cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--tvm-lib",
        type=Path,
        default=default_build_dir() / f"tvm-cuda-{default_cuda_arch()}",
        help="what bench/gpu_tvm_baseline.py --prepare wrote (default: tvm-cuda-<arch> in tvmkv's build dir, "
        "see python -m tvmkv build --help)",
    )
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="first decode and first prefill case only")
    ap.add_argument("--out", type=Path, default=default_out_dir() or ROOT / "bench", help="default $OUT, else bench/")
    ap.add_argument("--write", action="store_true", help="replace the GPU section of bench/RESULTS.md")
    ap.add_argument("--skip-tvm", action="store_true", help="leave out TVM (its kernels and its cache)")
    ap.add_argument("--skip-tvm-cache", action="store_true", help="leave out TVM's cache (keep its kernels)")
    ap.add_argument("--tvm-budget", type=float, default=300, help="seconds for all TVM workers together")
    args = ap.parse_args(argv)
    bootstrap()  # $TVMKV_PAYLOAD: the GPU machine's runtime-only TVM, before tvm is imported
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    timer = CudaTimer(args.reps)
    meta = gpu_meta(args.reps)
    errors = []

    def guard(what, fn, default=None):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - log and continue with the other sections
            traceback.print_exc()
            errors.append(f"{what}: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
            return default

    meta["copy_GBps"] = guard("copy rate", timer.copy_rate, float("nan"))
    lib = guard("load tvmkv kernels", load_tvmkv_kernels)
    print(f"{meta['card']}: D2D copy {meta['copy_GBps']:.0f} GB/s", flush=True)
    cases = [("decode", b, 1, ctx) for b, ctx in DECODE] + [("prefill", b, n, h) for b, n, h in PREFILL]
    if args.quick:
        cases = [cases[0], cases[len(DECODE)]]
    tvm_results = {}  # TVM's kernels and cache, each in worker processes (see run_tvm_isolated)
    tvm_deadline = time.monotonic() + args.tvm_budget
    for mode in () if args.skip_tvm else ("kernel",) if args.skip_tvm_cache else ("kernel", "cache"):
        print(f"TVM {mode}: worker process", flush=True)
        tvm_results[mode] = guard(
            f"TVM {mode}",
            lambda: run_tvm_isolated(mode, cases, args.tvm_lib, args.reps, deadline=tvm_deadline),
            {},
        )
    rng = np.random.default_rng(0)
    rows = []
    for kind, B, n, hist in cases:
        c = make_case(kind, B, n, hist, rng)
        row = {"case": label(c), "kind": kind, "batch": B, "new": c["n"], "history": hist, "kv_len": c["L"]}
        fl, kvb = flops_and_bytes(c)
        row.update(flops=fl, kv_bytes=kvb)
        ref = None
        print(f"[{row['case']}] torch", flush=True)
        tr = guard(f"{row['case']} torch", lambda: torch_run(c))
        if tr:
            tr[0]()
            ref = tr[1]()
            row["torch_us"] = guard(f"{row['case']} torch time", lambda: timer.time(tr[0]))
            row["torch_call_us"] = guard(f"{row['case']} torch time", lambda: timer.time(tr[0], queued=False))
        if lib is not None:
            print(f"[{row['case']}] tvmkv", flush=True)
            kr = guard(f"{row['case']} tvmkv", lambda: tvmkv_run(c, lib))
            if kr:
                kr[0]()
                if ref is not None:
                    row["tvmkv_max_err"] = float(np.abs(kr[1]() - ref).max())
                row["tvmkv_us"] = guard(f"{row['case']} tvmkv time", lambda: timer.time(kr[0]))
                row["tvmkv_call_us"] = guard(f"{row['case']} tvmkv time", lambda: timer.time(kr[0], queued=False))
                if "split" in c:
                    row["tvmkv_split"] = list(c["split"])
        for mode, key in (("kernel", "tvm_kernel"), ("cache", "tvm")):
            res = tvm_results.get(mode, {}).get((kind, B, n, hist))
            if res is None:
                continue
            row.update({f"{key}_{k}": v for k, v in res.items() if k in ("us", "call_us", "max_err", "kernel")})
            if "error" in res:
                errors.append(f"{row['case']} TVM {mode}: {res['error']}")
            elif res.get("max_err", 0) > 1e-2:
                errors.append(f"{row['case']} TVM {mode}: output differs from torch (max err {res['max_err']:.2e})")
        if (kind, B, n, c["L"] if kind == "decode" else hist) == FULL_CACHE_CASE and lib is not None:
            fc = guard(f"{row['case']} tvmkv full cache", lambda: tvmkv_full_cache_run(c))
            if fc:
                row["tvmkv_full_cache_us"] = guard("full cache time", lambda: timer.time(fc[0]))
                row["tvmkv_full_cache_call_us"] = guard("full cache time", lambda: timer.time(fc[0], queued=False))
                del fc
        for key in ("tvmkv", "tvm_kernel", "tvm", "torch"):
            us = row.get(f"{key}_us")
            if us:
                row[f"{key}_tflops"] = fl / (us * 1e-6) / 1e12
                row[f"{key}_bw_pct"] = 100 * kvb / (us * 1e-6) / 1e9 / meta["copy_GBps"]
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("bytes")}), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    table = render(rows, meta, errors)
    print(table)
    (args.out / "gpu.json").write_text(json.dumps({"meta": meta, "rows": rows, "errors": errors}, indent=1))
    (args.out / "gpu.md").write_text(table)
    if args.write:
        write_results(table, MARK_BEGIN, MARK_END)
    return 1 if errors else 0


def render(rows, meta, errors) -> str:
    def f(x, spec):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    lines = [
        "## GPU",
        "",
        f"Measured {meta['date']} on **{meta['card']}** (torch {meta['torch']}, TVM {meta['tvm']}). "
        f"fp16, H_qo {H_QO}, H_kv {H_KV}, D {D}, page {P}. Median µs of {meta['reps']} calls (CUDA events), "
        "device time: each call is queued behind a GPU spin so that host-side launch work (Python, packed "
        "calls, torch dispatch) is hidden for every contender alike (per-call times with it included: second "
        "table). "
        f"KV bandwidth as % of the device-to-device copy rate measured in the same run "
        f"({f(meta.get('copy_GBps'), '.0f')} GB/s read+write). tvmkv = kernels called directly; TVM kernel = "
        "TVM's own TIR kernel of the same role called directly on the same layout (decode: batch_decode_paged_kv; "
        "prefill without history: batch_prefill_ragged_kv; with history: batch_prefill_paged_kv); TVM = its "
        "cache's attention call (also splits q/k/v and appends K/V; with history: paged + ragged + merge); "
        "torch = SDPA on contiguous K/V. Splits = chunks per sequence of tvmkv's decode (flash-decoding, "
        "chosen as begin_forward does; 1 = paged_decode, else paged_decode_split + merge_splits). "
        "Ratio = baseline µs / tvmkv µs (> 1: tvmkv faster). `bench/gpu_attention.py` regenerates this.",
        "",
        "| case | tvmkv µs | splits | TVM kernel µs | TVM µs | torch µs | vs TVM kernel | vs TVM | vs torch "
        "| tvmkv KV bw % | tvmkv TFLOP/s | torch TFLOP/s | max err vs torch (tvmkv / TVM kernel / TVM) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        ours = r.get("tvmkv_us")

        def ratio(key, r=r, ours=ours):
            return f(r[key] / ours, ".2f") + "x" if r.get(key) and ours else "n/a"

        splits = r["tvmkv_split"][0] if r.get("tvmkv_split") else "-"
        lines.append(
            f"| {r['case']} | {f(ours, ',.1f')} | {splits} | {f(r.get('tvm_kernel_us'), ',.1f')} "
            f"| {f(r.get('tvm_us'), ',.1f')} "
            f"| {f(r.get('torch_us'), ',.1f')} | {ratio('tvm_kernel_us')} | {ratio('tvm_us')} | {ratio('torch_us')} "
            f"| {f(r.get('tvmkv_bw_pct'), '.0f')} | {f(r.get('tvmkv_tflops'), '.1f')} "
            f"| {f(r.get('torch_tflops'), '.1f')} "
            f"| {f(r.get('tvmkv_max_err'), '.1e')} / {f(r.get('tvm_kernel_max_err'), '.1e')} "
            f"/ {f(r.get('tvm_max_err'), '.1e')} |"
        )
    lines += [
        "",
        "Per call, host-side launch work included (no spin ahead; what one eager call costs):",
        "",
        "| case | tvmkv µs | TVM kernel µs | TVM µs | torch µs | vs TVM kernel | vs TVM | vs torch |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ours = r.get("tvmkv_call_us")

        def ratio(key, r=r, ours=ours):
            return f(r[key] / ours, ".2f") + "x" if r.get(key) and ours else "n/a"

        lines.append(
            f"| {r['case']} | {f(ours, ',.1f')} | {f(r.get('tvm_kernel_call_us'), ',.1f')} "
            f"| {f(r.get('tvm_call_us'), ',.1f')} | {f(r.get('torch_call_us'), ',.1f')} "
            f"| {ratio('tvm_kernel_call_us')} | {ratio('tvm_call_us')} | {ratio('torch_call_us')} |"
        )
    full = [r for r in rows if r.get("tvmkv_full_cache_us")]
    for r in full:
        lines.append(
            f"\nThrough the full tvmkv cache (split + append + attention), {r['case']}: "
            f"{r['tvmkv_full_cache_us']:,.1f} µs device / {f(r.get('tvmkv_full_cache_call_us'), ',.1f')} µs per call "
            f"(TVM's cache: {f(r.get('tvm_us'), ',.1f')} / {f(r.get('tvm_call_us'), ',.1f')} µs)."
        )
    for e in errors:
        lines.append(f"\nFAILED {e}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
