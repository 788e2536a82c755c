"""Decode through ``attention_with_fused_qkv`` in rope mode "normal" (every real model's) against "none"
(what the speed tables measure), one launch against two, on a GPU: fp16, 32 query / 8 KV heads of 128, page
16, sequences prefilled one at a time, then decode layers timed (device synchronized, median µs per layer).

``ONE_LAUNCH_ROTATING_DECODE`` (tvmkv/runtime/launch.py) chooses, in rope mode "normal" over 16-bit pages,
between the one-launch ``paged_decode_append`` that rotates q and the new key itself and the two launches
``split_rope_append`` + ``paged_decode``; both rows are measured here in one process.

    python3 bench/gpu_decode_rope.py [--out DIR]     (TVMKV_BUILD_DIR: the q32/kv8/d128 p16 fp16 kernel sets,
                                                     RoPE none and normal, for the GPU's arch)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from _common import ROOT  # noqa: F401  (puts the checkout on sys.path)

CASES = [(64, 128), (32, 1024), (128, 512), (1, 1024)]  # (batch, tokens per sequence before the decode)


def measure(batch: int, prompt: int, rope_mode: str, layers: int = 4) -> float:
    import numpy as np
    import tvm

    import tvmkv

    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)

    def t(shape):
        return tvm.runtime.tensor((rng.standard_normal(shape) * 0.5).astype("float16"), dev)

    cache = tvmkv.PagedAttentionKVCache(
        layers, 32, 8, 128, page_size=16, max_batch_size=batch, max_total_seq_len=batch * (prompt + 32),
        prefill_chunk_size=max(prompt, 512), dtype="float16", rope_mode=rope_mode, rope_theta=5e5, target="cuda",
    )  # fmt: skip
    qkv_p, o_p = t((prompt, 48, 128)), t((prompt, 32, 128))
    for s in range(batch):
        cache.add_sequence(s)
        cache.begin_forward([s], [prompt])
        for layer in range(layers):
            cache.attention_with_fused_qkv(layer, qkv_p, out=o_p)
        cache.end_forward()
    qkv, o = t((batch, 48, 128)), t((batch, 32, 128))
    seqs, times = list(range(batch)), []
    for _ in range(13):
        cache.begin_forward(seqs, [1] * batch)
        dev.sync()
        t0 = time.perf_counter()
        for layer in range(layers):
            cache.attention_with_fused_qkv(layer, qkv, out=o)
        dev.sync()
        times.append((time.perf_counter() - t0) / layers)
        cache.end_forward()
    return statistics.median(times[3:]) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from tvmkv.payload import bootstrap

    bootstrap()
    import tvm

    import tvmkv.runtime.launch as launch

    rows = []
    for batch, prompt in CASES:
        row = [f"{batch}x{prompt}"]
        for rope, one in (("none", True), ("normal", True), ("normal", False)):
            launch.ONE_LAUNCH_ROTATING_DECODE = one  # read when a cache is created
            row.append(measure(batch, prompt, rope))
        launch.ONE_LAUNCH_ROTATING_DECODE = False
        rows.append(row)
        print(row, flush=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"{tvm.cuda(0).device_name}, {stamp}; µs per decode layer (median, device synchronized)",
        "",
        "| batch x tokens | rope none, one launch | rope normal, one launch (rotating) | rope normal, two launches "
        "| rotating one launch / two launches |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1f} | {r[2] / r[3]:.2f}x |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        (args.out / "gpu_decode_rope.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
