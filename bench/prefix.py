"""Prefix-sharing workload with and without the radix prefix cache: prefill time and page use.

Workload: ``--requests`` requests (default 16) share a ``--system``-token system prompt (default
500, so it ends inside a page) followed by a user turn of 32..96 tokens. Request 0 is prefilled
first; the others follow in forwards of at most ``--chunk`` new tokens, and all stay live until the
end (so the page count is the one of 16 concurrent requests). Both runs use the same packing rule:

- without the prefix cache every request prefills its whole prompt;
- with it, request 0 is inserted into the tree (``RadixPrefixCache.insert``) after its prefill and
  each later request starts from ``add_sequence_with_prefix`` and prefills only the rest.

Timed (fastest of ``--repeat`` runs): ``begin_forward`` + ``attention_with_fused_qkv`` of every
layer + ``end_forward`` (plus a device sync); the prefix run's ``add_sequence_with_prefix`` /
``insert`` calls are timed apart. Inputs are fused qkv rows that depend only on (token, position),
uploaded before timing. The last token's attention output of every request is compared between the
runs (they must agree).

Usage::

    .venv/bin/python bench/prefix.py [--target llvm|cuda] [--repeat 3] [--write]

``--write`` replaces the section between ``<!-- prefix:begin -->`` and ``<!-- prefix:end -->`` of
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _common import machine_meta, write_results

MARK_BEGIN, MARK_END = "<!-- prefix:begin -->", "<!-- prefix:end -->"


def workload(requests: int, system: int, seed: int = 0) -> list:
    """Prompts (token-id lists): one shared system prompt + a distinct user turn each."""
    rng = np.random.default_rng(seed)
    sys_prompt = rng.integers(0, 1000, system).tolist()
    turns = [[1000 + k] + rng.integers(0, 1000, int(rng.integers(31, 96))).tolist() for k in range(requests)]
    return [sys_prompt + turn for turn in turns]


def make_cache(args):
    import tvmkv

    return tvmkv.PagedAttentionKVCache(
        args.layers,
        args.qo_heads,
        args.kv_heads,
        args.head_dim,
        page_size=args.page_size,
        max_batch_size=args.requests,
        max_total_seq_len=args.system + 128,
        prefill_chunk_size=args.chunk,
        dtype=args.dtype,
        rope_mode="normal",
        target=args.target,
        num_pages=args.requests * (-(-(args.system + 128) // args.page_size) + 1),
    )


class Rows:
    """Fused qkv rows that depend only on (token, position, layer), as a model's would."""

    def __init__(self, cfg, vocab=1100, max_pos=4096, seed=1):
        rng = np.random.default_rng(seed)
        dt = np.float16 if cfg.dtype == "float16" else np.float32
        self.emb = rng.uniform(-1, 1, (vocab, cfg.qkv_heads, cfg.head_dim)).astype(dt)
        self.pos = rng.uniform(-0.5, 0.5, (max_pos, cfg.qkv_heads, cfg.head_dim)).astype(dt)

    def __call__(self, layer, tokens, start):
        return self.emb[tokens] + self.pos[start : start + len(tokens)] + np.asarray(0.01 * layer, self.emb.dtype)


def run(args, prompts, *, prefix: bool) -> dict:
    """One pass of the workload; returns times, token and page counts, and last-token outputs."""
    import tvm

    from tvmkv.runtime.radix import RadixPrefixCache

    cache = make_cache(args)
    cfg, dev = cache.config, cache.device
    rows = Rows(cfg)
    tree = RadixPrefixCache(cache) if prefix else None
    t_prefix = t_fwd = 0.0
    done = {}  # request -> tokens already in the cache
    last_out = {}
    reused = []  # tokens each request started with
    prefilled = 0

    def forward(batch):
        nonlocal t_fwd, prefilled
        ids = list(batch)
        lens = [len(prompts[k]) - done[k] for k in ids]
        qkv = [
            tvm.runtime.tensor(
                np.ascontiguousarray(np.concatenate([rows(layer, prompts[k][done[k] :], done[k]) for k in ids])), dev
            )
            for layer in range(cfg.num_layers)
        ]
        dev.sync()
        t0 = time.perf_counter()
        cache.begin_forward(ids, lens)
        outs = [cache.attention_with_fused_qkv(layer, qkv[layer]) for layer in range(cfg.num_layers)]
        cache.end_forward()
        dev.sync()
        t_fwd += time.perf_counter() - t0
        ends = np.cumsum(lens) - 1
        for k, e in zip(ids, ends.tolist()):
            last_out[k] = np.stack([o.numpy()[e] for o in outs]).astype(np.float64)
            done[k] = len(prompts[k])
        prefilled += sum(lens)

    def add(k):
        nonlocal t_prefix
        t0 = time.perf_counter()
        if tree is None:
            cache.add_sequence(k)
            done[k] = 0
        else:
            done[k] = tree.add_sequence_with_prefix(k, prompts[k])
        t_prefix += time.perf_counter() - t0
        reused.append(done[k])

    add(0)
    forward([0])
    if tree is not None:
        t0 = time.perf_counter()
        tree.insert(0, prompts[0])
        t_prefix += time.perf_counter() - t0
    batch, budget = [], 0
    for k in range(1, len(prompts)):
        add(k)
        need = len(prompts[k]) - done[k]
        if batch and budget + need > args.chunk:
            forward(batch)
            batch, budget = [], 0
        batch.append(k)
        budget += need
    if batch:
        forward(batch)
    if tree is not None:
        tree.check_integrity()
    else:
        cache.check_integrity()
    P = cfg.page_size
    return {
        "prefill_s": t_fwd,
        "prefix_ops_s": t_prefix,
        "prefilled": prefilled,
        "pages": cfg.total_pages - cache.num_available_pages(),
        "stats": tree.stats if tree is not None else None,
        "page_aligned_reuse": sum(r // P * P for r in reused),  # what whole-page matching would reuse
        "out": last_out,
    }


def render(meta, base, pref, err) -> str:
    s = pref["stats"]
    tokens = sum(len(p) for p in meta["prompts"])
    aligned = meta["page_aligned_reuse"]
    lines = [
        "## Prefix cache",
        "",
        f"Measured {meta['date']} on `{meta['host']}` ({meta['cpu']}, {meta['ncpu']} CPUs, load average "
        f"{meta['load']:.1f}), target `{meta['target']}`{', ' + meta['device'] if meta.get('device') else ''}, "
        f"TVM {meta['tvm']}. {meta['requests']} requests share a {meta['system']}-token system prompt, then a "
        f"32..96-token user turn each ({tokens:,} prompt tokens); {meta['layers']} layers, H_qo={meta['qo']}, "
        f"H_kv={meta['kv']}, D={meta['d']}, page size {meta['P']}, {meta['dtype']}, RoPE normal; forwards of at "
        f"most {meta['chunk']} new tokens; all requests live at the end. Prefill = begin_forward + attention "
        f"of every layer + end_forward (+ device sync), fastest of {meta['repeat']} runs (other processes "
        "share the machine: see the load average); the prefix run's match/insert calls are timed apart. "
        "`bench/prefix.py --write` regenerates this section.",
        "",
        "| run | prefilled tokens | prefill ms | prefix-cache ops ms | pages in use | reused tokens |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| no prefix cache | {base['prefilled']:,} | {base['prefill_ms']:,.1f} | – | {base['pages']:,} | 0 |",
        f"| radix prefix cache | {pref['prefilled']:,} | {pref['prefill_ms']:,.1f} | {pref['prefix_ops_ms']:.2f} "
        f"| {pref['pages']:,} | {s.reused_tokens:,} ({s.hit_rate:.0%}) |",
        "",
        f"Prefill speedup {base['prefill_ms'] / pref['prefill_ms']:.2f}x, pages {base['pages'] / pref['pages']:.2f}x "
        f"fewer. Matching is token-granular: the {meta['requests'] - 1} later requests reuse "
        f"{s.reused_tokens:,} tokens, {s.reused_tokens - aligned:,} more than whole pages alone would give "
        f"({aligned:,}); the page each match ends inside is copied ({s.partial_page_reuses} copies). "
        f"Last-token outputs of the two runs differ by at most {err:.1e}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system", type=int, default=500, help="system prompt tokens")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--qo-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunk", type=int, default=1024, help="most new tokens per forward")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="write the Prefix cache section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    from tvmkv.payload import bootstrap

    bootstrap()  # $TVMKV_PAYLOAD: the GPU machine's runtime-only TVM, before tvm is imported

    prompts = workload(args.requests, args.system)
    results = {}
    for prefix in (False, True):
        runs = [run(args, prompts, prefix=prefix) for _ in range(args.repeat)]
        r = runs[-1]
        r["prefill_ms"] = min(x["prefill_s"] for x in runs) * 1e3
        r["prefix_ops_ms"] = min(x["prefix_ops_s"] for x in runs) * 1e3
        r["prefill_ms_all"] = [round(x["prefill_s"] * 1e3, 1) for x in runs]
        results[prefix] = r
        print(
            f"prefix={prefix}: prefilled {r['prefilled']} tokens in {r['prefill_ms']:.1f} ms "
            f"(prefix ops {r['prefix_ops_ms']:.2f} ms), {r['pages']} pages in use; all runs {r['prefill_ms_all']} ms",
            flush=True,
        )
    base, pref = results[False], results[True]
    err = max(float(np.abs(base["out"][k] - pref["out"][k]).max()) for k in base["out"])
    meta = {
        **machine_meta(args.target),
        "requests": args.requests,
        "system": args.system,
        "prompts": prompts,
        "layers": args.layers,
        "qo": args.qo_heads,
        "kv": args.kv_heads,
        "d": args.head_dim,
        "P": args.page_size,
        "dtype": args.dtype,
        "chunk": args.chunk,
        "repeat": args.repeat,
        "page_aligned_reuse": pref["page_aligned_reuse"],
    }
    table = render(meta, base, pref, err)
    print(table)
    tol = 1e-3 if args.dtype == "float32" else 2e-2
    if err > tol:
        print(f"outputs of the two runs differ by {err:.2e} > {tol}", file=sys.stderr)
        return 1
    if args.write:
        write_results(table, MARK_BEGIN, MARK_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
