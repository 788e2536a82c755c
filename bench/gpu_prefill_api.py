"""Prefill through the public API: one ``attention_with_fused_qkv`` call on a forward of new tokens.

fp16, H_qo 32, H_kv 8, D 128, page 16, rope mode "none" (bench/_attention_cases.py's shape), one layer,
causal. Cases (batch x new tokens, history): 1x4096 and 8x512 on empty sequences (the cache runs the
ragged kernel over the new tokens), 4x1024 onto 2048 tokens of history (the new tokens are appended
and the paged kernel reads history and new tokens together). The history is written by an earlier
forward through the same call, so every key and value is known.

Per case: device µs of a call (CUDA events, queued behind a GPU spin: the kernels alone, split + append
+ attention), µs per call with its host work (no spin), torch SDPA on contiguous K/V of the same data
(attention alone, ``enable_gqa``; a bottom-right causal mask with history), TFLOP/s of both (QK^T and
PV: 4 H_qo D per visible query-key pair), and the largest difference of the call's output from SDPA in
float32 on the same q, k, v.

Run on the GPU machine with the library to measure in ``$TVMKV_BUILD_DIR`` (build it here with
``python -m tvmkv build --target cuda --arch sm_90 --num-qo-heads 32 --num-kv-heads 8 --head-dim 128
--page-size 16 --dtype float16 --build-dir DIR``); ``--label`` names the run in the output, so two
libraries can be compared on one machine::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        TVMKV_BUILD_DIR=DIR python3 bench/gpu_prefill_api.py --label new --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _attention_cases import DTYPE, H_KV, H_QO, D, P
from _common import CudaTimer

CASES = [(1, 4096, 0), (8, 512, 0), (4, 1024, 2048)]  # (batch, new tokens, history)


def prefill_case(B: int, n: int, hist: int, seed: int = 0):
    """A one-layer cuda cache whose ``B`` sequences hold ``hist`` tokens written through the public
    API, a forward of ``n`` new tokens each open, and the torch tensors of everything it will see:
    ``(cache, qkv, out, q, k, v)`` with q ``[B, H_qo, n, D]`` and k, v ``[B, H_kv, hist + n, D]``."""
    import torch

    from tvmkv import PagedAttentionKVCache

    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = PagedAttentionKVCache(
        1,
        H_QO,
        H_KV,
        D,
        page_size=P,
        max_batch_size=B,
        max_total_seq_len=B * (hist + n + 2 * P),
        prefill_chunk_size=B * max(n, hist),
        dtype=DTYPE,
        target="cuda",
    )

    def rand_qkv(tokens):
        return torch.rand(B * tokens, H_QO + 2 * H_KV, D, device="cuda", dtype=torch.float16, generator=gen) * 2 - 1

    seqs = list(range(B))
    for s in seqs:
        cache.add_sequence(s)
    parts = []
    if hist:
        qkv_h = rand_qkv(hist)
        cache.begin_forward(seqs, [hist] * B)
        cache.attention_with_fused_qkv(0, qkv_h, out=torch.empty(B * hist, H_QO, D, device="cuda", dtype=torch.float16))
        cache.end_forward()
        parts.append(qkv_h.reshape(B, hist, H_QO + 2 * H_KV, D))
    qkv = rand_qkv(n)
    parts.append(qkv.reshape(B, n, H_QO + 2 * H_KV, D))
    whole = torch.cat(parts, dim=1)  # [B, hist + n, heads, D]
    q = qkv.reshape(B, n, H_QO + 2 * H_KV, D)[:, :, :H_QO].transpose(1, 2).contiguous()
    k = whole[:, :, H_QO : H_QO + H_KV].transpose(1, 2).contiguous()
    v = whole[:, :, H_QO + H_KV :].transpose(1, 2).contiguous()
    cache.begin_forward(seqs, [n] * B)
    out = torch.empty(B * n, H_QO, D, device="cuda", dtype=torch.float16)
    return cache, qkv, out, q, k, v


def sdpa(q, k, v, hist: int):
    import torch
    import torch.nn.functional as F

    n, L = q.shape[2], k.shape[2]
    mask = torch.ones(n, L, dtype=torch.bool, device="cuda").tril(diagonal=hist) if hist else None
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not hist, enable_gqa=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--label", default="tvmkv", help="name of this library in the output")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from tvmkv.payload import bootstrap

    bootstrap()
    import torch

    timer = CudaTimer(args.reps)
    rows = []
    for B, n, hist in CASES:
        cache, qkv, out, q, k, v = prefill_case(B, n, hist)

        def call(cache=cache, qkv=qkv, out=out):
            cache.attention_with_fused_qkv(0, qkv, out=out)

        call()
        ref = sdpa(q.float(), k.float(), v.float(), hist)()  # [B, H, n, D]
        err = (out.float().reshape(B, n, H_QO, D).transpose(1, 2) - ref).abs().max().item()
        pairs = B * sum(hist + i + 1 for i in range(n))
        flops = 4 * H_QO * D * pairs
        row = {
            "case": f"prefill {B}x{n} hist {hist}",
            "label": args.label,
            "device_us": timer.time(call),
            "call_us": timer.time(call, queued=False),
            "sdpa_us": timer.time(sdpa(q, k, v, hist)),
            "max_err_vs_sdpa_fp32": err,
        }
        row["tflops"] = flops / row["device_us"] / 1e6
        row["sdpa_tflops"] = flops / row["sdpa_us"] / 1e6
        cache.end_forward()
        print(json.dumps(row), flush=True)
        rows.append(row)
        cache = None
        torch.cuda.empty_cache()
    card = torch.cuda.get_device_name(0)
    lines = [
        f"{card}; library {args.label}; µs (device = kernels alone; call = with host work)",
        "| case | device | call | TFLOP/s | SDPA device | SDPA TFLOP/s | device / SDPA | max err vs SDPA fp32 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['device_us']:.1f} | {r['call_us']:.1f} | {r['tflops']:.0f} | {r['sdpa_us']:.1f} | "
            f"{r['sdpa_tflops']:.0f} | {r['device_us'] / r['sdpa_us']:.2f} | {r['max_err_vs_sdpa_fp32']:.1e} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"prefill_api_{args.label}.json").write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
