"""fp8 pages against fp16 pages and torch SDPA, through the public API, in one process (issue 17).

fp16 activations, H_qo 32, H_kv 8, D 128, page 16, rope mode "none", one layer (bench/_attention_cases.py's
shape). Decode ``B x L`` (one new token per sequence over ``L`` tokens of history): device µs of one
``attention_with_fused_qkv(..., out=)`` call with torch CUDA tensors (CUDA events, queued behind a GPU
spin: the kernels alone) and µs with its host work, for a cache with fp16 pages and one with
``kv_dtype="float8_e4m3fn"``, beside torch SDPA (fp16, contiguous K/V, ``enable_gqa``). Per row also
the K/V bytes a call reads (``B x L x 2 x H_kv x D x`` bytes per element) and that rate as a fraction
of the measured device copy rate (bytes read and written per second by ``copy_``: what the memory
system moves). Prefill rows: one causal prefill of ``B x n`` new tokens each over ``L`` of history.

Run on the GPU machine with both kernel libraries in ``$TVMKV_BUILD_DIR`` (build here with
``python -m tvmkv build --target cuda --arch sm_90 --num-qo-heads 32 --num-kv-heads 8 --head-dim 128
--page-size 16 --dtype float16 [--kv-dtype float8_e4m3fn] --build-dir DIR``)::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        TVMKV_BUILD_DIR=DIR python3 bench/gpu_fp8.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _attention_cases import H_KV, H_QO, D, api_cache
from _common import CudaTimer

# issue 17's decode shapes, after the small batches (a step of at most one block per SM, where the
# tensor-core decode takes its small-batch layout: DecodeSplit.layout)
DECODE = [(1, 1024), (1, 16384), (16, 1024), (32, 1024), (64, 4096), (128, 4096), (256, 2048)]
# sequences, history, new tokens each
PREFILL = [(1, 0, 4096), (8, 0, 512), (4, 2048, 1024), (4, 8192, 64), (8, 2048, 128), (8, 2048, 16)]
PAGES = {"fp16": "", "fp8 e4m3": "float8_e4m3fn"}
# a decode of fp8 pages on the tensor cores is one launch (paged_decode_append); this row also times the
# two launches it replaced (split_rope_append + paged_decode), forced through launch.ONE_LAUNCH_DECODE
TWO_LAUNCHES = "fp8 e4m3, two launches"


def _sdpa(B: int, L: int, n: int):
    import torch
    import torch.nn.functional as F

    q = torch.rand(B, H_QO, n, D, device="cuda", dtype=torch.float16)
    k = torch.rand(B, H_KV, L + n, D, device="cuda", dtype=torch.float16)
    v = torch.rand_like(k)
    # causal only without history: SDPA's is_causal aligns the mask top-left, so over history it would
    # hide keys the prefill sees; there it runs unmasked (more work than the causal prefill)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=n > 1 and L == 0, enable_gqa=True)


def _row(timer, case: str, B: int, L: int, new: int, copy_gbs: float) -> dict:
    import torch

    from tvmkv.runtime import launch

    row: dict = {"case": case}
    pages = dict(PAGES)
    if new == 1:
        pages[TWO_LAUNCHES] = PAGES["fp8 e4m3"]
    for name, kv_dtype in pages.items():
        launch.ONE_LAUNCH_DECODE = name != TWO_LAUNCHES
        try:
            cache = api_cache(B, L, new, kv_dtype=kv_dtype)
        finally:
            launch.ONE_LAUNCH_DECODE = True
        qkv = torch.rand(B * new, H_QO + 2 * H_KV, D, device="cuda", dtype=torch.float16)
        out = torch.empty(B * new, H_QO, D, device="cuda", dtype=torch.float16)

        def call(cache=cache, qkv=qkv, out=out):
            cache.attention_with_fused_qkv(0, qkv, out=out)

        row[f"{name} device_us"] = timer.time(call)
        row[f"{name} call_us"] = timer.time(call, queued=False)
        row[f"{name} kernel"] = cache.debug_forward().kernel
        row[f"{name} layout"] = cache.debug_forward().decode_layout
        keys = B * (L + new)
        nbytes = keys * 2 * H_KV * D * (1 if kv_dtype else 2)
        row[f"{name} kv_MB"] = nbytes / 1e6
        row[f"{name} of_copy_rate"] = nbytes / (row[f"{name} device_us"] * 1e-6) / 1e9 / copy_gbs
        cache.end_forward()
        del cache
        torch.cuda.empty_cache()
    row["sdpa_us"] = timer.time(_sdpa(B, L, new))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from tvmkv.payload import bootstrap

    bootstrap()
    import torch

    timer = CudaTimer(args.reps)
    copy_gbs = timer.copy_rate()  # bytes moved (read + written) per second
    rows = [_row(timer, f"decode {B}x{L}", B, L, 1, copy_gbs) for B, L in DECODE]
    rows += [_row(timer, f"prefill {B}x{n} over {L}", B, L, n, copy_gbs) for B, L, n in PREFILL]
    for r in rows:
        print(json.dumps(r), flush=True)
    card = torch.cuda.get_device_name(0)
    lines = [
        f"{card}; device copy rate {copy_gbs:.0f} GB/s; µs per attention_with_fused_qkv "
        "call, device (kernels alone) / call (with host work)",
        "| case | fp16 pages | fp8 pages | fp8 / fp16 | SDPA | fp8 / SDPA | K/V MB fp16 / fp8 "
        "| of copy rate fp16 / fp8 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        a, b = r["fp16 device_us"], r["fp8 e4m3 device_us"]
        lines.append(
            f"| {r['case']} | {a:.1f} / {r['fp16 call_us']:.1f} | {b:.1f} / {r['fp8 e4m3 call_us']:.1f} | "
            f"{b / a:.2f} | {r['sdpa_us']:.1f} | {b / r['sdpa_us']:.2f} | {r['fp16 kv_MB']:.0f} / "
            f"{r['fp8 e4m3 kv_MB']:.0f} | {r['fp16 of_copy_rate']:.2f} / {r['fp8 e4m3 of_copy_rate']:.2f} |"
        )
    for r in rows:  # the decode forwards on the two launches the one-launch decode replaced
        if f"{TWO_LAUNCHES} device_us" in r:
            b = r[f"{TWO_LAUNCHES} device_us"]
            lines.append(
                f"| {r['case']}, fp8 pages, two launches (split_rope_append + paged_decode) | | "
                f"{b:.1f} / {r[f'{TWO_LAUNCHES} call_us']:.1f} | {b / r['fp16 device_us']:.2f} | | "
                f"{b / r['sdpa_us']:.2f} | | |"
            )
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"card": card, "copy_gbs": copy_gbs, "rows": rows}
        (args.out / "fp8.json").write_text(json.dumps(result, indent=1))
        (args.out / "fp8.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
