"""Decode through the public API: one ``attention_with_fused_qkv`` call per step, as a model makes it.

fp16, H_qo 32, H_kv 8, D 128, page 16, rope mode "none" (bench/_attention_cases.py's shape), one layer,
decode ``B x L`` (one new token per sequence over ``L`` tokens of history). Per case: device µs of a call
(CUDA events, queued behind a GPU spin: the kernels alone, split + append + attention [+ merge]) and µs
per call with its host work (no spin), for torch CUDA tensors and for tvm tensors, beside torch SDPA on
contiguous K/V (attention alone, ``enable_gqa``). The launches per call are named: ``split_rope_append``
(split + append fused) where the kernel library has it, else ``split_rope`` + ``append``.

Run on the GPU machine with the library to measure in ``$TVMKV_BUILD_DIR`` (build it here with
``python -m tvmkv build --target cuda --arch sm_90 --num-qo-heads 32 --num-kv-heads 8 --head-dim 128
--page-size 16 --dtype float16 --build-dir DIR``)::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        TVMKV_BUILD_DIR=DIR python3 bench/gpu_decode_api.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _attention_cases import DTYPE, H_KV, H_QO, D, P
from _common import CudaTimer

CASES = [(1, 1024), (32, 1024), (64, 4096), (128, 4096)]


def decode_cache(B: int, L: int):
    """A one-layer cuda cache with ``B`` sequences of ``L`` tokens and a decode step of all of them open."""
    from tvmkv import PagedAttentionKVCache

    cache = PagedAttentionKVCache(
        1,
        H_QO,
        H_KV,
        D,
        page_size=P,
        max_batch_size=B,
        max_total_seq_len=B * (L + 2 * P),
        prefill_chunk_size=max(B, L, 16),
        dtype=DTYPE,
        target="cuda",
    )
    for s in range(B):
        cache.add_sequence(s)
        cache.begin_forward([s], [L])
        cache.end_forward()
    cache.begin_forward(list(range(B)), [1] * B)
    return cache


def sdpa(B: int, L: int):
    import torch
    import torch.nn.functional as F

    q = torch.rand(B, H_QO, 1, D, device="cuda", dtype=torch.float16)
    k = torch.rand(B, H_KV, L + 1, D, device="cuda", dtype=torch.float16)
    v = torch.rand_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from tvmkv.payload import bootstrap

    bootstrap()
    import torch
    import tvm

    timer = CudaTimer(args.reps)
    rows = []
    for B, L in CASES:
        cache = decode_cache(B, L)
        launches = "split_rope_append" if "split_rope_append" in cache.kernels else "split_rope + append"
        qkv_t = torch.rand(B, H_QO + 2 * H_KV, D, device="cuda", dtype=torch.float16)
        out_t = torch.empty(B, H_QO, D, device="cuda", dtype=torch.float16)
        qkv_v = tvm.runtime.tensor(qkv_t.cpu().numpy(), tvm.cuda(0))
        out_v = tvm.runtime.empty((B, H_QO, D), DTYPE, tvm.cuda(0))
        row = {"case": f"decode {B}x{L}", "launches": launches, "splits": cache.debug_forward().num_splits}
        for kind, qkv, out in (("torch", qkv_t, out_t), ("tvm", qkv_v, out_v)):

            def call(cache=cache, qkv=qkv, out=out):
                cache.attention_with_fused_qkv(0, qkv, out=out)

            row[f"{kind}_device_us"] = timer.time(call)
            row[f"{kind}_call_us"] = timer.time(call, queued=False)
        row["sdpa_us"] = timer.time(sdpa(B, L))
        cache.end_forward()
        print(json.dumps(row), flush=True)
        rows.append(row)
        cache = None
        torch.cuda.empty_cache()
    card = torch.cuda.get_device_name(0)
    lines = [
        f"{card}; launches: {rows[0]['launches']}; µs (device = kernels alone; call = with host work)",
        "| case | splits | torch tensors: device / call | tvm tensors: device / call | SDPA device | device / SDPA |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['splits']} | {r['torch_device_us']:.1f} / {r['torch_call_us']:.1f} | "
            f"{r['tvm_device_us']:.1f} / {r['tvm_call_us']:.1f} | {r['sdpa_us']:.1f} | "
            f"{r['torch_device_us'] / r['sdpa_us']:.2f} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_api.json").write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
