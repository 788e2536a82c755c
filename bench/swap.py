"""Swap bandwidth: ``swap_out`` / ``swap_in`` of many sequences vs a plain host<->device copy.

A cache (H_qo=32, H_kv=8, D=128, page size 16, float16, ``--layers`` layers) holds ``--seqs``
sequences of ``--tokens`` tokens. One measurement swaps them all out in one ``swap_out`` call and back
in with one ``swap_in`` (pages scattered to whatever is free), repeated ``--reps`` times; bandwidth
= bytes of K/V moved (pages x layers x page bytes) / median time. The baseline is TVM's own copy of
the same byte count between one device tensor and one host tensor (``Tensor.copyto``, the call the
swap path uses, pageable host memory), in the same run: the swap's rate is reported as a fraction
of it. With torch present, torch's pageable and pinned copies of the same bytes are listed too.
The round trip is checked bit-exact (``debug_get_kv`` of two sequences before and after).

Usage::

    .venv/bin/python bench/swap.py [--target llvm|cuda] [--layers 8] [--seqs 8] [--tokens 512] [--write]

On the GPU machine (runtime-only TVM) set ``TVMKV_PAYLOAD`` (``tvmkv.payload.bootstrap``)
and carry the prebuilt ``build/cuda-sm_90``: the cache's kernel set (q32 kv8 d128 p16 float16, the
"cache defaults" entry of scripts/gpu_configs.json) must include ``gather_pages`` / ``scatter_pages``.
``--write`` replaces the ``<!-- swap:begin -->`` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _common import RESULTS, default_out_dir, machine_meta, write_results

H_QO, H_KV, D, P, DTYPE = 32, 8, 128, 16, "float16"
MARK_BEGIN, MARK_END = "<!-- swap:begin -->", "<!-- swap:end -->"


def _sync(dev) -> None:
    if dev.dlpack_device_type() != 1:
        dev.sync()


def _median_seconds(fn, reps: int, dev) -> float:
    fn()  # warm-up (allocates the staging buffer, loads kernels)
    _sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_cache(target: str, layers: int, seqs: int, tokens: int):
    import tvm

    import tvmkv

    pages_per_seq = -(-tokens // P)
    cache = tvmkv.PagedAttentionKVCache(
        layers,
        H_QO,
        H_KV,
        D,
        page_size=P,
        max_batch_size=seqs,
        max_total_seq_len=seqs * pages_per_seq * P,
        prefill_chunk_size=seqs * 64,
        dtype=DTYPE,
        target=target,
        num_pages=seqs * pages_per_seq + 1,
    )
    # K/V content: random values written straight into the pool; sequences take pages through an
    # empty forward (begin/end without attention), which is all swapping looks at
    rng = np.random.default_rng(0)
    shape = tuple(cache.pages[0].shape)
    block = rng.standard_normal((min(shape[0], 64), *shape[1:])).astype(np.float16)
    host = np.resize(block, shape)
    for layer in range(layers):
        host[..., 0] = layer  # layers differ
        cache.pages[layer].copyfrom(host)
    del host
    ids = list(range(seqs))
    for s in ids:
        cache.add_sequence(s)
    done = 0
    while done < tokens:  # fill in chunks of the forward limit
        n = min(tokens - done, cache.config.prefill_chunk_size // seqs)
        cache.begin_forward(ids, [n] * seqs)
        cache.end_forward()
        done += n
    _sync(tvm.cpu(0) if target == "llvm" else cache.device)
    return cache, ids


def copy_rates(nbytes: int, dev, reps: int) -> dict:
    """GB/s of TVM's (and torch's, when present) host<->device copies of ``nbytes``."""
    import tvm

    n = nbytes // 2
    host = tvm.runtime.empty((n,), DTYPE, tvm.cpu(0))
    devt = tvm.runtime.empty((n,), DTYPE, dev)
    out = {
        "tvm_d2h": nbytes / _median_seconds(lambda: devt.copyto(host), reps, dev) / 1e9,
        "tvm_h2d": nbytes / _median_seconds(lambda: host.copyto(devt), reps, dev) / 1e9,
    }
    try:
        import torch
    except ImportError:
        return out
    if dev.dlpack_device_type() == 1:
        return out
    if not torch.cuda.is_available():
        return out
    d = torch.empty(n, dtype=torch.float16, device="cuda")
    for kind, h in (
        ("pageable", torch.empty(n, dtype=torch.float16)),
        ("pinned", torch.empty(n, dtype=torch.float16).pin_memory()),
    ):

        def d2h(h=h):
            h.copy_(d)
            torch.cuda.synchronize()

        def h2d(h=h):
            d.copy_(h)
            torch.cuda.synchronize()

        out[f"torch_{kind}_d2h"] = nbytes / _median_seconds(d2h, reps, dev) / 1e9
        out[f"torch_{kind}_h2d"] = nbytes / _median_seconds(h2d, reps, dev) / 1e9
    return out


def run(target: str, layers: int, seqs: int, tokens: int, reps: int) -> dict:
    cache, ids = make_cache(target, layers, seqs, tokens)
    dev = cache.device
    pages = cache.config.total_pages - cache.num_available_pages()
    nbytes = pages * layers * cache.config.page_bytes
    check = ids[:1] + ids[-1:]
    before = {s: cache.debug_get_kv(s) for s in check}
    # time each direction separately; each call leaves the cache ready for the other
    t_out, t_in = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        cache.swap_out(ids)
        _sync(dev)
        t_out.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache.swap_in(ids)
        _sync(dev)
        t_in.append(time.perf_counter() - t0)
    t_out, t_in = statistics.median(t_out[1:]), statistics.median(t_in[1:])  # first: warm-up
    exact = all(
        np.array_equal(before[s][0], cache.debug_get_kv(s)[0])
        and np.array_equal(before[s][1], cache.debug_get_kv(s)[1])
        for s in check
    )
    cache.check_integrity()
    rates = copy_rates(nbytes, dev, reps)
    return {
        "target": target,
        "layers": layers,
        "seqs": seqs,
        "tokens": tokens,
        "pages": pages,
        "bytes": nbytes,
        "swap_out_s": t_out,
        "swap_in_s": t_in,
        "swap_out_GBps": nbytes / t_out / 1e9,
        "swap_in_GBps": nbytes / t_in / 1e9,
        "bit_exact": exact,
        **rates,
    }


def render(r: dict, meta: dict) -> str:
    from tvmkv.runtime.swap import DEFAULT_STAGING_BYTES

    where = meta["device"] or f"{meta['cpu']}, {meta['ncpu']} CPUs"
    lines = [
        f"### {'GPU (' + meta['device'] + ')' if meta['device'] else 'CPU'}",
        "",
        f"Measured {meta['date']} on `{meta['host']}` ({where}; load average {meta['load']:.1f}), TVM {meta['tvm']}. "
        f"{r['seqs']} sequences x {r['tokens']} tokens, {r['layers']} layers, H_kv={H_KV}, D={D}, page size {P}, "
        f"{DTYPE}: {r['pages']} pages, {r['bytes'] / 2**20:.0f} MiB of K/V per direction, swapped in one "
        f"`swap_out` / `swap_in` call each (per layer one gather/scatter kernel into a device staging buffer, "
        f"one copy per {DEFAULT_STAGING_BYTES >> 20} MiB chunk). Baseline: TVM `Tensor.copyto` of the same "
        "bytes between one device and one host tensor (pageable host memory, as the swap uses), measured in "
        "the same run. Median of "
        f"{meta['reps']} round trips. Round trip bit-exact: {'yes' if r['bit_exact'] else '**NO**'}. "
        "`bench/swap.py --write` regenerates this section.",
        "",
        "| direction | swap GB/s | copy GB/s (TVM) | swap / copy | swap ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, key in (("device -> host (swap_out)", "d2h"), ("host -> device (swap_in)", "h2d")):
        swap = r["swap_out_GBps" if key == "d2h" else "swap_in_GBps"]
        copy = r[f"tvm_{key}"]
        ms = 1e3 * r["swap_out_s" if key == "d2h" else "swap_in_s"]
        lines.append(f"| {name} | {swap:.2f} | {copy:.2f} | {swap / copy:.2f} | {ms:.1f} |")
    torch_keys = [k for k in r if k.startswith("torch_")]
    if torch_keys:
        lines += ["", "torch copies of the same bytes (GB/s): " + ", ".join(f"{k[6:]} {r[k]:.1f}" for k in torch_keys)]
    if r["target"] == "llvm":
        lines += [
            "",
            'On the CPU target the "device" is host memory: the gather/scatter kernels write/read the host '
            "buffer directly (no staging copy), so the baseline is a plain memcpy.",
        ]
    return "\n".join(lines) + "\n"


def section(target: str, table: str) -> str:
    """The whole swap section of bench/RESULTS.md: this target's table, the other target's as it is."""
    text = RESULTS.read_text() if RESULTS.exists() else ""
    parts = {}
    for t in ("llvm", "cuda"):
        begin, end = f"<!-- swap-{t}:begin -->", f"<!-- swap-{t}:end -->"
        if t == target:
            parts[t] = f"{begin}\n{table}{end}\n"
        elif begin in text and end in text:
            parts[t] = begin + text.split(begin, 1)[1].split(end, 1)[0] + end + "\n"
    return "## Swap to host\n\n" + "\n".join(parts[t] for t in ("cuda", "llvm") if t in parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    ap.add_argument("--layers", type=int, default=None, help="default 8 (llvm) / 32 (cuda)")
    ap.add_argument("--seqs", type=int, default=None, help="default 8 (llvm) / 32 (cuda)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per sequence, default 512 (llvm) / 1024 (cuda)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=default_out_dir(), help="write JSON + table here (default $OUT)")
    ap.add_argument("--write", action="store_true", help="replace the swap section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    from tvmkv.payload import bootstrap

    bootstrap()  # $TVMKV_PAYLOAD: the GPU machine's runtime-only TVM, before tvm is imported

    gpu = args.target == "cuda"
    layers = args.layers or (32 if gpu else 8)
    seqs = args.seqs or (32 if gpu else 8)
    tokens = args.tokens or (1024 if gpu else 512)
    r = run(args.target, layers, seqs, tokens, args.reps)
    meta = {**machine_meta(args.target), "reps": args.reps}
    table = render(r, meta)
    print(json.dumps(r, indent=1))
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"swap_{args.target}.json").write_text(json.dumps({"meta": meta, "result": r}, indent=1))
        (args.out / f"swap_{args.target}.md").write_text(table)
    if args.write:
        write_results(section(args.target, table), MARK_BEGIN, MARK_END)
    return 0 if r["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
