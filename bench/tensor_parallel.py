"""Decode throughput of a Llama-shaped model sharded over 1, 2 and 4 GPUs (issue 18), through the Relax
model: the sharded model on Disco workers (``tvmkv.disco``, NCCL all-reduces), one tvmkv cache shard
per GPU; the 1-GPU row is the unsharded model on one ``PagedAttentionKVCache`` in this process.

Config (``WIDE``): 32 query / 8 KV heads, head_dim 128, hidden 4096, MLP 11008, 4 layers, vocabulary 32000,
fp16, random weights (``make_weights``). Per batch B in ``--batches``: B sequences prefilled with 32
tokens each in one forward, then ``--steps`` timed decode steps (``begin_forward`` + the model's
``forward`` + ``end_forward``, logits copied to the host every step as a sampler needs them) after 4
untimed ones; tokens/s = B * steps / wall time. Also per configuration: the host time of a step's cache
calls alone (``begin_forward`` + ``end_forward``; on Disco one call to every worker each, answered by
worker 0) and the KV capacity of one GPU's memory.

Two steps::

    python bench/tensor_parallel.py --prepare DIR          # here: model libraries for cuda sm_90, TP 1/2/4
    scripts: carry .devpayload, DIR and the kernel sets (TVMKV_BUILD_DIR), then on the GPU machine
    python3 bench/tensor_parallel.py --from DIR --nccl-plugin PLUGIN [--out $OUT]

The model's matmuls use TVM's DLight schedules without tensor cores (their tensorize rule crashes in
TVM 0.27, see tvmkv/relax/llama.py), so the per-GPU step time is the model's far more than the cache's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import ROOT  # noqa: F401  (puts the checkout on sys.path)

WIDE = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=4,
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim=128,
    dtype="float16",
)
# the same flow on CPU workers (--smoke): the config's head layout, a small model
SMOKE = dict(WIDE, vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2, dtype="float32")
PROMPT = 32


def prepare(out: Path, shape: dict, *, target: str = "cuda", shards=(1, 2, 4)) -> None:
    """Compile the model of ``shape`` for ``target`` (cuda: sm_90) as 1, 2 and 4 shards into ``out``."""
    from tvmkv.relax.llama import LlamaConfig, compile_llama

    cfg = LlamaConfig(**shape)
    out.mkdir(parents=True, exist_ok=True)
    for n in shards:
        t0 = time.perf_counter()
        arch = None if target == "llvm" else "sm_90"
        ex, names = compile_llama(cfg, target=target, cuda_arch=arch, tensor_parallel=n)
        ex.export_library(str(out / f"wide.tp{n}.so"))
        (out / f"wide.tp{n}.json").write_text(json.dumps({"param_names": names, "config": shape}))
        print(f"tp{n}: compiled in {time.perf_counter() - t0:.1f}s")


def _cache_options(batch: int, target: str, dtype: str) -> dict:
    tokens = batch * (PROMPT + 64)
    return dict(
        page_size=16,
        max_batch_size=batch,
        max_total_seq_len=tokens,
        prefill_chunk_size=batch * PROMPT,
        dtype=dtype,
        rope_mode="normal",
        target=target,
        num_pages=-(-tokens // 16) + batch,
    )


def _run(model, cache, batch: int, steps: int, rng, vocab: int) -> tuple:
    """(tokens/s of the timed decode steps, median host µs of a step's begin_forward + end_forward,
    median ms of a decode step)."""
    ids = list(range(batch))
    for sid in ids:
        cache.add_sequence(sid)
    cache.begin_forward(ids, [PROMPT] * batch)
    model.forward(rng.integers(0, vocab, batch * PROMPT), cache)
    cache.end_forward()
    times = []
    for step in range(4 + steps):
        t0 = time.perf_counter()
        cache.begin_forward(ids, [1] * batch)
        model.forward(rng.integers(0, vocab, batch), cache)
        cache.end_forward()
        if step >= 4:
            times.append(time.perf_counter() - t0)
    host = []
    for _ in range(20):  # the cache calls alone (no attention: nothing is read from what they append)
        t0 = time.perf_counter()
        cache.begin_forward(ids, [1] * batch)
        cache.end_forward()
        host.append((time.perf_counter() - t0) * 1e6)
    for sid in ids:
        cache.remove_sequence(sid)
    return batch * steps / sum(times), statistics.median(host), statistics.median(times) * 1e3


def run(src: Path, plugin: str | None, batches, steps: int, out: Path | None, shape: dict, *, smoke: bool = False):
    """The table for the model of ``shape``. ``smoke``: the same flow on CPU workers (llvm, gloo), to check
    the script."""
    from tvmkv.payload import bootstrap

    bootstrap()
    import tvm

    import tvmkv
    from tvmkv.disco import DiscoKVCache, TvmkvSession
    from tvmkv.disco.model import DiscoLlama
    from tvmkv.relax.llama import LlamaConfig, RelaxLlama, make_weights, param_dtype

    cfg = LlamaConfig(**shape)
    hq, hkv, d, layers = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    target, dev = ("llvm", tvm.cpu(0)) if smoke else ("cuda", tvm.cuda(0))
    ngpu = 4 if smoke else sum(tvm.cuda(i).exist for i in range(8))
    name = "CPU (smoke run)" if smoke else tvm.cuda(0).device_name
    t0 = time.perf_counter()
    weights = {k: v.astype(param_dtype(k, cfg)) for k, v in make_weights(cfg).items()}
    print(f"weights made in {time.perf_counter() - t0:.1f}s; {ngpu} x {name}", flush=True)
    rows = []
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "weights.npz"
        np.savez(npz, **weights)
        for n in (1, 2, 4):
            if n > ngpu:
                continue
            meta = json.loads((src / f"wide.tp{n}.json").read_text())
            lib = src / f"wide.tp{n}.so"
            if n == 1:
                model = RelaxLlama(tvm.runtime.load_module(str(lib)), meta["param_names"], weights, cfg, dev)
                for batch in batches:
                    cache = tvmkv.PagedAttentionKVCache(layers, hq, hkv, d, **_cache_options(batch, target, cfg.dtype))
                    rows.append((n, batch, *_run(model, cache, batch, steps, rng, cfg.vocab_size)))
                    del cache
                del model
            else:
                with TvmkvSession(n, nccl_plugin=None if smoke else plugin) as session:
                    session.init_gloo() if smoke else session.init_nccl()
                    model = DiscoLlama(session, lib, meta["param_names"], npz, cfg, target=target)
                    for batch in batches:
                        opts = _cache_options(batch, target, cfg.dtype)
                        cache = DiscoKVCache(session, layers, hq, hkv, d, **opts)
                        rows.append((n, batch, *_run(model, cache, batch, steps, rng, cfg.vocab_size)))
                        cache.close()
                        del cache
                    del model
            for r in rows[-len(batches) :]:
                print(f"TP {r[0]} batch {r[1]}: {r[4]:.1f} ms/step, {r[2]:.0f} tokens/s, cache calls {r[3]:.0f} us")
    base = {b: tps for n, b, tps, _, _ in rows if n == 1}
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"{name} x {ngpu}, TVM 0.27.0.post1 runtime, {stamp}; {json.dumps(shape)}",
        "",
        "| GPUs | batch | ms / decode step | tokens/s | speedup vs 1 GPU | scaling efficiency "
        "| host us of begin+end_forward | KV bytes / token / GPU | tokens in 40 GiB / GPU |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, b, tps, host, ms in rows:
        per_token = 2 * tvmkv.ShardLayout(hq, hkv, n).kv_per_shard * d * 2 * layers  # K and V, every layer
        sp = tps / base[b]
        lines.append(
            f"| {n} | {b} | {ms:.1f} | {tps:.0f} | {sp:.2f} | {sp / n:.0%} | {host:.0f} | {per_token} "
            f"| {40 * 2**30 // per_token:,} |"
        )
    text = "\n".join(lines)
    print(text)
    if out is not None:
        (out / "tensor_parallel.md").write_text(text + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare", type=Path, help="compile the model libraries into this folder and exit")
    ap.add_argument("--from", dest="src", type=Path, help="the folder --prepare wrote")
    ap.add_argument("--nccl-plugin", default=None, help="libtvm_disco_nccl.so (python -m tvmkv.disco.nccl)")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="a small model on CPU workers (gloo): checks the script")
    ap.add_argument(
        "--intermediate", type=int, default=None, help="the MLP's width instead of 11008 (give --prepare the same)"
    )
    args = ap.parse_args(argv)
    shape = SMOKE if args.smoke else WIDE
    if args.intermediate is not None:
        shape = dict(shape, intermediate_size=args.intermediate)
    if args.prepare:
        prepare(args.prepare, shape, target="llvm" if args.smoke else "cuda")
        return 0
    if not args.src or not (args.nccl_plugin or args.smoke):
        ap.error("pass --prepare DIR, or --from DIR --nccl-plugin PLUGIN (or --smoke)")
    run(args.src, args.nccl_plugin, args.batches, args.steps, args.out, shape, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
