"""Everything issue 16 measures on one GPU, in one run on one card, the baselines beside each number.

Four parts, run one after the other on the same machine (each a benchmark of its own, in a process
of its own, so one that fails is reported and the others go on):

1. ``gpu_attention.py``: **kernels alone** (tvmkv's attention kernels called directly), beside TVM's
   own kernels of the same role, TVM's cache and torch SDPA; decode 1x1024 .. 256x2048, causal prefill
   1x4096, 8x512 and 4x1024 onto 2048.
2. ``gpu_decode_api.py``: decode **through the public API** (``attention_with_fused_qkv``: device time,
   time with host work, host time per call with torch and with tvm tensors) beside SDPA, and whole
   32-layer decode steps (``begin_forward`` .. ``end_forward``) eager and replayed from CUDA graphs.
3. ``gpu_prefill_api.py``: prefill through the public API beside SDPA.
4. ``host.py --target cuda``: the host side of a decode step with stub kernels beside TVM's C++ cache,
   the same batch every step and the general planning path after a change in the batch.

fp16, H_qo 32, H_kv 8, D 128, page 16, rope mode "none" throughout (bench/_attention_cases.py).

Build machine (full TVM + nvcc), once::

    .venv/bin/python bench/gpu.py --prepare DIR

GPU machine (runtime-only TVM; carry ``.devpayload`` and ``DIR``)::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        python3 bench/gpu.py --from DIR --out $OUT

Writes ``$OUT/gpu_all.md`` (the card, then each part's tables) and each part's own files into
``$OUT/<part>/``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCH_LIB = [
    "--num-qo-heads", "32", "--num-kv-heads", "8", "--head-dim", "128", "--page-size", "16",
    "--dtype", "float16", "--rope-mode", "none",
]  # fmt: skip


def prepare(out: Path, arch: str) -> int:
    """Compile what the GPU machine cannot: the bench configuration's kernel library (``lib``), TVM's
    kernels for its cache (``tvm``) and the host benchmark's stub libraries (``stubs``)."""
    steps = [
        [sys.executable, "-m", "tvmkv", "build", "--target", "cuda", "--arch", arch, *BENCH_LIB,
         "--build-dir", str(out / "lib")],
        [sys.executable, str(HERE / "gpu_tvm_baseline.py"), "--prepare", str(out / "tvm")],
        [sys.executable, str(HERE / "host.py"), "--prepare", str(out / "stubs"), "--target", "cuda"],
    ]  # fmt: skip
    for cmd in steps:
        print("+", " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode:
            return 1
    return 0


def parts(src: Path, out: Path, tvm_budget: float) -> list:
    """``(name, command, timeout s)`` of the four parts (each writes into ``out/<name>``)."""
    py = sys.executable
    return [
        ("kernels", [py, str(HERE / "gpu_attention.py"), "--tvm-lib", str(src / "tvm"), "--out", str(out / "kernels"),
                     "--tvm-budget", str(tvm_budget)], 300 + tvm_budget),
        ("decode_api", [py, str(HERE / "gpu_decode_api.py"), "--out", str(out / "decode_api")], 300),
        ("prefill_api", [py, str(HERE / "gpu_prefill_api.py"), "--out", str(out / "prefill_api")], 200),
        ("host", [py, str(HERE / "host.py"), "--target", "cuda", "--stubs", str(src / "stubs"), "--out",
                  str(out / "host")], 300),
    ]  # fmt: skip


def tables(text: str) -> str:
    """The markdown of a part's output: its header lines and tables, not its JSON or progress lines
    (a blank line before each table's header row, so adjacent tables stay apart)."""
    lines = [line for line in text.splitlines() if line.startswith(("|", "#", "NVIDIA", "Measured", "- "))]
    keep: list = []
    for i, line in enumerate(lines):
        if keep and i + 1 < len(lines) and lines[i + 1].startswith("| ---"):
            keep.append("")
        keep.append(line)
    return "\n".join(keep)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prepare", type=Path, help="build machine: compile the libraries into this folder")
    ap.add_argument("--arch", default=os.environ.get("TVMKV_CUDA_ARCH", "sm_90"))
    ap.add_argument("--from", dest="src", type=Path, help="GPU machine: what --prepare wrote")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench")))
    ap.add_argument("--only", nargs="*", default=None, help="run only these parts (kernels, decode_api, ...)")
    ap.add_argument("--tvm-budget", type=float, default=120, help="seconds for TVM's kernels and cache in part 1")
    args = ap.parse_args(argv)
    if args.prepare:
        return prepare(args.prepare.resolve(), args.arch)
    if args.src is None:
        ap.error("pass --prepare DIR (build machine) or --from DIR (GPU machine)")
    src, out = args.src.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TVMKV_BUILD_DIR=str(src / "lib"))
    card = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    report = [f"# bench/gpu.py on {card or 'an unnamed card'}, {time.strftime('%Y-%m-%d %H:%M %Z')}", ""]
    failed = 0
    for name, cmd, limit in parts(src, out, args.tvm_budget):
        if args.only is not None and name not in args.only:
            continue
        (out / name).mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            rc, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as err:
            rc, text = "timeout", (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        (out / name / "log.txt").write_text(text)
        failed += rc != 0
        report += [f"## {name} ({' '.join(Path(c).name for c in cmd[1:2])}; exit {rc}, {time.time() - t0:.0f} s)", ""]
        report += [tables(text) or text[-3000:], ""]
        print(f"[gpu.py] {name}: exit {rc} in {time.time() - t0:.0f} s", flush=True)
    (out / "gpu_all.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
