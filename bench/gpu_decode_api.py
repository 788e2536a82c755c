"""Decode through the public API: one ``attention_with_fused_qkv`` call per step, as a model makes it.

fp16, H_qo 32, H_kv 8, D 128, page 16, rope mode "none" (bench/_attention_cases.py's shape), one layer,
decode ``B x L`` (one new token per sequence over ``L`` tokens of history). Per case: device µs of a call
(CUDA events, queued behind a GPU spin: the kernels alone, split + append + attention [+ merge]), µs
per call with its host work (no spin), and the host µs of a call (back-to-back calls, the GPU not
waited for), for torch CUDA tensors and for tvm tensors, beside torch SDPA on contiguous K/V
(attention alone, ``enable_gqa``). The launches per call are named: ``paged_decode_append`` (split,
rotate, append and attention [and the split's merge] in one kernel) where the kernel library has it,
else ``split_rope_append`` (split + append) and the attention kernel.

``--step-layers N`` (default 32) adds whole decode steps of an N-layer cache: ``begin_forward``, N
``attention_with_fused_qkv`` calls, ``end_forward`` and a synchronize (what a server's step costs once
it reads the logits), eager and through :class:`tvmkv.runtime.graphs.StepGraphs` (one CUDA graph per
``graph_key``, ``stable_decode_splits=True``), beside torch SDPA over N layers of contiguous K/V, eager
and in a CUDA graph (attention alone). Per row: µs per step (wall, median), and device µs of the
step's attention work (queued behind a spin; the graph replayed).

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

from _attention_cases import DTYPE, H_KV, H_QO, D, P, api_cache
from _common import CudaTimer

CASES = [(1, 1024), (32, 1024), (64, 4096), (128, 4096)]
STEP_CASES = [(1, 1024), (8, 1024), (32, 1024), (64, 2048)]


def host_time(fn, calls: int = 200, rounds: int = 15) -> float:
    """Host µs per call: ``calls`` back-to-back calls (few enough that the launch queue never fills, so
    the host does not wait for the GPU), synchronized after the timing; median over ``rounds``."""
    import time

    import numpy as np
    import torch

    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return float(np.median(times) * 1e6)


def decode_cache(B: int, L: int):
    """A one-layer cuda cache with ``B`` sequences of ``L`` tokens and a decode step of all of them open."""
    return api_cache(B, L, 1)


def sdpa(B: int, L: int):
    import torch
    import torch.nn.functional as F

    q = torch.rand(B, H_QO, 1, D, device="cuda", dtype=torch.float16)
    k = torch.rand(B, H_KV, L + 1, D, device="cuda", dtype=torch.float16)
    v = torch.rand_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def step_bench(B: int, L: int, layers: int, steps: int, timer) -> dict:
    """A whole decode step of a ``layers``-layer cache, eager and replayed from CUDA graphs, and the
    same step's attention in torch SDPA (each part frees its GPU memory before the next)."""
    import torch

    row = {"case": f"{layers} layers, decode {B}x{L}", **_tvmkv_step(B, L, layers, steps, timer)}
    torch.cuda.empty_cache()
    row.update(_sdpa_step(B, L + steps, layers, steps, timer))
    torch.cuda.empty_cache()
    return row


def _wall(run, steps: int) -> float:
    """Median wall µs of ``run()`` followed by a synchronize."""
    import time

    import numpy as np
    import torch

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def _tvmkv_step(B: int, L: int, layers: int, steps: int, timer) -> dict:
    import numpy as np
    import torch

    from tvmkv import PagedAttentionKVCache
    from tvmkv.runtime.graphs import StepGraphs

    grow = 2 * steps + 64  # tokens each sequence gains over the timed steps (and the warm-up)
    cache = PagedAttentionKVCache(
        layers,
        H_QO,
        H_KV,
        D,
        page_size=P,
        max_batch_size=B,
        max_total_seq_len=B * (L + grow + 2 * P),
        prefill_chunk_size=max(B, L, 16),
        dtype=DTYPE,
        target="cuda",
        stable_decode_splits=True,
    )
    for s in range(B):
        cache.add_sequence(s)
        cache.begin_forward([s], [L])
        cache.end_forward()
    ids, ones = list(range(B)), [1] * B
    qkv = torch.rand(layers, B, H_QO + 2 * H_KV, D, device="cuda", dtype=torch.float16)
    out = torch.empty(layers, B, H_QO, D, device="cuda", dtype=torch.float16)

    def attention():
        for layer in range(layers):
            cache.attention_with_fused_qkv(layer, qkv[layer], out=out[layer])

    graphs = StepGraphs(cache, attention)

    def step(run):
        def one():
            cache.begin_forward(ids, ones)
            run()
            cache.end_forward()

        return one

    _wall(step(attention), 3)  # warm-up
    _wall(step(graphs), 4)  # captures for both index-buffer slots
    captures = graphs.captures
    # eager and graph steps alternate (pairs, so each sees both slots), so both meet the same lengths
    eager, graph = [], []
    for _ in range(steps // 2):
        eager.append(_wall(step(attention), 2))
        graph.append(_wall(step(graphs), 2))
    row = {"eager_step_us": float(np.median(eager)), "graph_step_us": float(np.median(graph))}
    row["recaptures"] = graphs.captures - captures  # new keys met during the timed graph steps
    cache.begin_forward(ids, ones)  # device time: the same forward's work again (idempotent)
    row["eager_device_us"] = timer.time(attention)
    graphs()
    row["graph_device_us"] = timer.time(graphs)
    row["splits"] = cache.debug_forward().num_splits
    cache.end_forward()
    return row


def _sdpa_step(B: int, n: int, layers: int, steps: int, timer) -> dict:
    import torch
    import torch.nn.functional as F

    q = torch.rand(B, H_QO, 1, D, device="cuda", dtype=torch.float16)
    ks = [torch.rand(B, H_KV, n, D, device="cuda", dtype=torch.float16) for _ in range(layers)]
    vs = [torch.rand_like(k) for k in ks]
    o = torch.empty(B, H_QO, 1, D, device="cuda", dtype=torch.float16)

    def sdpa():
        for k, v in zip(ks, vs):
            o.copy_(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))

    sdpa()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sdpa()

    return {
        "sdpa_eager_step_us": _wall(sdpa, steps),
        "sdpa_graph_step_us": _wall(g.replay, steps),
        "sdpa_device_us": timer.time(g.replay),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--step-layers", type=int, default=32, help="layers of the whole-step rows (0: none)")
    ap.add_argument("--step-reps", type=int, default=100, help="timed steps per whole-step row")
    ap.add_argument("--skip-calls", action="store_true", help="only the whole-step rows")
    args = ap.parse_args(argv)
    from tvmkv.payload import bootstrap

    bootstrap()
    import torch
    import tvm

    timer = CudaTimer(args.reps)
    rows = []
    for B, L in [] if args.skip_calls else CASES:
        cache = decode_cache(B, L)
        lib = cache.kernels
        if "paged_decode_append" in lib:
            launches = "paged_decode_append[_split] (one launch)"
        elif "split_rope_append" in lib:
            launches = "split_rope_append + attention"
        else:
            launches = "split_rope + append + attention"
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
            row[f"{kind}_host_us"] = host_time(call)
        row["sdpa_us"] = timer.time(sdpa(B, L))
        cache.end_forward()
        print(json.dumps(row), flush=True)
        rows.append(row)
        cache = None
        torch.cuda.empty_cache()
    steps = []
    for B, L in STEP_CASES if args.step_layers > 0 else []:
        steps.append(step_bench(B, L, args.step_layers, args.step_reps, timer))
        print(json.dumps(steps[-1]), flush=True)
    card = torch.cuda.get_device_name(0)
    launches = rows[0]["launches"] if rows else ""
    lines = [
        f"{card}; launches: {launches}; µs (device = kernels alone; call = with host work)",
        "| case | splits | torch tensors: device / call / host | tvm tensors: device / call / host | SDPA device "
        "| device / SDPA |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['splits']} | {r['torch_device_us']:.1f} / {r['torch_call_us']:.1f} / "
            f"{r['torch_host_us']:.1f} | {r['tvm_device_us']:.1f} / {r['tvm_call_us']:.1f} / {r['tvm_host_us']:.1f} | "
            f"{r['sdpa_us']:.1f} | {r['torch_device_us'] / r['sdpa_us']:.2f} |"
        )
    if steps:
        lines += [
            "",
            f"Whole decode steps ({args.step_layers} layers; µs per step, wall incl. synchronize / device):",
            "| case | splits | tvmkv eager | tvmkv CUDA graph | graph re-captures | SDPA eager | SDPA CUDA graph |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in steps:
            lines.append(
                f"| {r['case']} | {r['splits']} | {r['eager_step_us']:.0f} / {r['eager_device_us']:.0f} | "
                f"{r['graph_step_us']:.0f} / {r['graph_device_us']:.0f} | {r['recaptures']} | "
                f"{r['sdpa_eager_step_us']:.0f} | {r['sdpa_graph_step_us']:.0f} / {r['sdpa_device_us']:.0f} |"
            )
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_api.json").write_text(json.dumps({"card": card, "rows": rows, "steps": steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
