"""Decode split sweep: tvmkv's decode at every split count (flash-decoding chunks per sequence) on
many shapes, beside the split ``begin_forward`` chooses; tunes tvmkv/runtime/decode_split.py.

fp16, H_qo 32, H_kv 8, D 128, page size 16 (bench/_attention_cases.py). Device µs per split count
(CUDA events, queued behind a GPU spin: see ``_common.CudaTimer``) and per-call µs; the output at the
automatic split is checked against NumPy. Writes ``split_sweep.md`` / ``split_sweep.json`` to
``--out``.

GPU machine (runtime-only TVM), carry ``.devpayload`` and ``build/cuda-sm_90``::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        python3 bench/gpu_decode_split.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import numpy as np
from _attention_cases import (
    H_KV,
    H_QO,
    D,
    P,
    decode_split_of,
    gpu_meta,
    load_tvmkv_kernels,
    make_case,
    numpy_attention,
    tvmkv_run,
)
from _common import ROOT, CudaTimer, default_out_dir

from tvmkv.payload import bootstrap

SWEEP_SHAPES = [(1, 1024), (1, 4096), (1, 16384), (4, 2048), (8, 1024), (16, 1024), (16, 4096), (32, 1024)]
SWEEP_SHAPES += [(32, 4096), (64, 1024), (64, 4096)]
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def split_sweep(lib, timer, meta, out: Path) -> int:
    """Decode µs of every split count (decode_splits forced) per shape, beside the automatic choice;
    outputs checked against NumPy at the automatic split."""
    from tvmkv.runtime.decode_split import NO_SPLIT

    rng = np.random.default_rng(0)
    rows = []
    for B, L in SWEEP_SHAPES:
        c = make_case("decode", B, 1, L, rng)
        auto = decode_split_of(c)
        row = {"case": f"decode {B}x{L}", "auto": list(auto), "us": {}, "call_us": {}}
        seen = set()
        for forced in SWEEP_SPLITS:
            split = decode_split_of(c, forced) if forced > 1 else NO_SPLIT
            if split.num_splits in seen:
                continue
            seen.add(split.num_splits)
            run, get = tvmkv_run(c, lib, split)
            run()
            if split == auto:
                row["max_err"] = float(np.abs(get() - numpy_attention(c)).max())
            row["us"][split.num_splits] = timer.time(run)
            row["call_us"][split.num_splits] = timer.time(run, queued=False)
        best = min(row["us"], key=row["us"].get)
        row["best"] = best
        row["auto_us"] = row["us"].get(auto.num_splits)
        print(json.dumps(row), flush=True)
        rows.append(row)
    lines = [
        f"Split sweep on **{meta['card']}** ({meta['date']}): decode device µs (queued, see CudaTimer.time) by splits "
        f"(fp16, H_qo {H_QO}, H_kv {H_KV}, D {D}, page {P}); auto = tvmkv/runtime/decode_split.py's choice.",
        "",
        "| case | auto splits | auto µs | best splits | best µs | " + " | ".join(f"S={k}" for k in SWEEP_SPLITS) + " |",
        "| --- " * (5 + len(SWEEP_SPLITS)) + "|",
    ]
    for r in rows:
        cells = [f"{r['us'][k]:.1f}" if k in r["us"] else "" for k in SWEEP_SPLITS]
        lines.append(
            f"| {r['case']} | {r['auto'][0]} | {r['auto_us']:.1f} | {r['best']} | {r['us'][r['best']]:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    table = "\n".join(lines)
    print(table)
    (out / "split_sweep.md").write_text(table)
    (out / "split_sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    bad = [r for r in rows if r.get("max_err", 1) > 1e-2]
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=default_out_dir() or ROOT / "bench", help="default $OUT, else bench/")
    args = ap.parse_args(argv)
    bootstrap()  # $TVMKV_PAYLOAD: the GPU machine's runtime-only TVM, before tvm is imported
    args.out.mkdir(parents=True, exist_ok=True)
    timer = CudaTimer(args.reps)
    meta = gpu_meta(args.reps)
    try:
        meta["copy_GBps"] = timer.copy_rate()
    except Exception:  # noqa: BLE001 - the sweep does not need it
        traceback.print_exc()
        meta["copy_GBps"] = float("nan")
    lib = load_tvmkv_kernels()
    print(f"{meta['card']}: D2D copy {meta['copy_GBps']:.0f} GB/s", flush=True)
    return split_sweep(lib, timer, meta, args.out)


if __name__ == "__main__":
    sys.exit(main())
