"""GPU attention benchmark (issue 4): tvmkv's kernels vs TVM's own paged KV cache vs torch SDPA.

fp16, H_qo 32, H_kv 8, D 128, page size 16. Decode at batch x context 1x1024, 32x1024, 64x4096,
128x4096, 256x2048; causal prefill 1x4096 and 8x512 on empty history, 4x1024 new tokens on 2048
tokens of history. Times are CUDA-event medians of many calls (µs); KV bandwidth is bytes of K/V read
over the time, as % of a device-to-device copy rate measured in the same run; TFLOP/s counts
QK^T and PV only (4 * H_qo * D per visible query-key pair).

- tvmkv: the KernelLibrary functions called directly on prepared index arrays (paged_decode,
  ragged_prefill_causal, paged_prefill_causal), plus one row through the full cache
  (``attention_with_fused_qkv``: split + append + attention) for reference. Outputs are checked
  against torch.
- TVM: ``vm.builtin.paged_attention_kv_cache_create`` with TVM's own CUDA kernels from
  ``tvm.relax.frontend.nn.llm.kv_cache`` (compiled on the build machine by ``--prepare``), timed
  through ``attention_kv_cache_attention_with_fused_qkv`` (which also splits q/k/v and appends K/V).
- torch: ``scaled_dot_product_attention`` on contiguous ``[B, H, L, D]`` K/V of the same data
  (``enable_gqa``; a bottom-right causal boolean mask when there is history).

Build machine (full TVM + nvcc)::

    python -m tvmkv build --target cuda --arch sm_90 --num-qo-heads 32 --num-kv-heads 8 \\
        --head-dim 128 --page-size 16 --dtype float16
    .venv/bin/python bench/gpu.py --prepare build/tvm-cuda-sm_90

GPU machine (runtime-only TVM), carry ``.devpayload``, ``build/cuda-sm_90``, ``build/tvm-cuda-sm_90``::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        python3 bench/gpu.py --tvm-lib build/tvm-cuda-sm_90 --out $OUT

Every section logs its traceback on failure and the rest continues; results go to
``$OUT/gpu.json`` and ``$OUT/gpu.md`` (``--write`` also replaces the GPU section of bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

H_QO, H_KV, D, P, DTYPE = 32, 8, 128, 16, "float16"
DECODE = [(1, 1024), (32, 1024), (64, 4096), (128, 4096), (256, 2048)]
PREFILL = [(1, 4096, 0), (8, 512, 0), (4, 1024, 2048)]  # (batch, new tokens, history), causal
FULL_CACHE_CASE = ("decode", 32, 1, 1024)
MARK_BEGIN, MARK_END = "<!-- gpu:begin -->", "<!-- gpu:end -->"


def prepare(out: Path) -> None:
    """Compile TVM's CUDA kernel PrimFuncs (what TIRPagedKVCache passes) into ``out/tvm_kv_cache.so``
    as a fatbin library (no CUDA compiler needed where it is loaded)."""
    import tvm
    from host import tvm_cache_funcs

    from tvmkv.build import export_module

    out.mkdir(parents=True, exist_ok=True)
    funcs = tvm_cache_funcs("cuda", num_layers=1, h_qo=H_QO, h_kv=H_KV, d=D, page_size=P, dtype=DTYPE)
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs})
    t0 = time.time()
    lib = tvm.compile(mod, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    fmt = export_module(lib, out / "tvm_kv_cache.so", "cuda", "sm_90")
    (out / "names.json").write_text(json.dumps([n for n, _ in funcs]))
    size = (out / "tvm_kv_cache.so").stat().st_size
    print(f"wrote {out / 'tvm_kv_cache.so'} ({size / 2**20:.1f} MiB, {fmt}) in {time.time() - t0:.0f}s")


class Bench:
    def __init__(self, reps: int):
        import torch

        self.torch, self.reps = torch, reps

    def time(self, fn) -> float:
        """Median µs of ``fn()`` over ``reps`` calls, each timed with CUDA events."""
        torch = self.torch
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends)]) * 1e3)

    def copy_rate(self) -> float:
        """Device-to-device copy rate in GB/s (bytes read + written)."""
        torch = self.torch
        a = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        us = self.time(lambda: b.copy_(a))
        return 2 * a.numel() / (us * 1e-6) / 1e9


def make_case(kind, B, n, hist, rng):
    """Pages with a shuffled page table, the layout arrays, q and contiguous K/V (numpy fp16)."""
    L = hist + n if kind == "prefill" else hist
    npg = -(-L // P)
    num_pages = B * npg + 1
    perm = rng.permutation(num_pages - 1).astype("int32")[: B * npg]
    k = rng.uniform(-1, 1, (B, H_KV, L, D)).astype(DTYPE)
    v = rng.uniform(-1, 1, (B, H_KV, L, D)).astype(DTYPE)
    pages = np.zeros((num_pages, 2, H_KV, P, D), DTYPE)
    kk = np.zeros((B, H_KV, npg * P, D), DTYPE)
    vv = np.zeros_like(kk)
    kk[:, :, :L], vv[:, :, :L] = k, v
    kk = kk.reshape(B, H_KV, npg, P, D).transpose(0, 2, 1, 3, 4).reshape(B * npg, H_KV, P, D)
    vv = vv.reshape(B, H_KV, npg, P, D).transpose(0, 2, 1, 3, 4).reshape(B * npg, H_KV, P, D)
    pages[perm, 0], pages[perm, 1] = kk, vv
    rows = B * (n if kind == "prefill" else 1)
    q = rng.uniform(-1, 1, (rows, H_QO, D)).astype(DTYPE)
    if kind == "decode":
        q_pos = np.full(B, L - 1, "int32")
    else:
        q_pos = np.tile(np.arange(hist, hist + n, dtype="int32"), B)
    return dict(
        kind=kind,
        B=B,
        n=n if kind == "prefill" else 1,
        hist=hist,
        L=L,
        pages=pages,
        k=k,
        v=v,
        q=q,
        q_pos=q_pos,
        q_indptr=(np.arange(B + 1) * (n if kind == "prefill" else 1)).astype("int32"),
        page_indptr=(np.arange(B + 1) * npg).astype("int32"),
        page_indices=perm,
        last_page_len=np.full(B, L - (npg - 1) * P, "int32"),
    )


def flops_and_bytes(c) -> tuple:
    if c["kind"] == "decode":
        pairs = c["B"] * c["L"]
    else:
        pairs = c["B"] * sum(c["hist"] + i + 1 for i in range(c["n"]))
    kv_bytes = c["B"] * c["L"] * H_KV * D * 2 * 2
    return 4 * H_QO * D * pairs, kv_bytes


def torch_run(c):
    import torch
    import torch.nn.functional as F

    B, n, L = c["B"], c["n"], c["L"]
    q = torch.from_numpy(c["q"]).cuda().reshape(B, n, H_QO, D).transpose(1, 2).contiguous()
    k = torch.from_numpy(c["k"]).cuda()
    v = torch.from_numpy(c["v"]).cuda()
    mask = None
    causal = c["kind"] == "prefill" and c["hist"] == 0
    if c["kind"] == "prefill" and c["hist"]:
        mask = torch.ones(n, L, dtype=torch.bool, device="cuda").tril(diagonal=c["hist"])
    out = {}

    def run():
        out["o"] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)

    def get():
        return out["o"].transpose(1, 2).reshape(B * n, H_QO, D).float().cpu().numpy()

    return run, get


def tvmkv_run(c, lib):
    import tvm

    dev = tvm.cuda(0)

    def t(a):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)

    B, rows = c["B"], c["q"].shape[0]
    q, pages = t(c["q"]), t(c["pages"])
    pi, px, lpl, q_pos = t(c["page_indptr"]), t(c["page_indices"]), t(c["last_page_len"]), t(c["q_pos"])
    kvw = t(np.zeros((B, 3), "int32"))
    o = tvm.runtime.empty((rows, H_QO, D), DTYPE, dev)
    lse = tvm.runtime.empty((rows, H_QO), "float32", dev)
    s = D**-0.5
    if c["kind"] == "decode":
        f = lib["paged_decode"]
        args = (q, q_pos, pages, pi, px, lpl, kvw, o, lse, s, 1.0, 1e4)
    elif c["hist"] == 0:
        f = lib["ragged_prefill_causal"]
        kr = t(c["k"].transpose(0, 2, 1, 3).reshape(B * c["n"], H_KV, D))
        vr = t(c["v"].transpose(0, 2, 1, 3).reshape(B * c["n"], H_KV, D))
        args = (q, kr, vr, t(c["q_indptr"]), q_pos, t(np.zeros((rows, 2), "int32")), o, lse, s, 1.0, 1e4)
    else:
        f = lib["paged_prefill_causal"]
        z = t(np.zeros((1, 2), "int32"))
        args = (
            q,
            t(c["q_indptr"]),
            q_pos,
            pages,
            pi,
            px,
            lpl,
            kvw,
            z,
            t(np.zeros(1, "int32")),
            t(np.zeros((1, 3), "int32")),
            t(np.zeros(1, "int32")),
            o,
            lse,
            s,
            1.0,
            1e4,
        )
    return (lambda: f(*args)), (lambda: o.numpy().astype("float32"))


def tvm_cache_run(c, tvm_dir: Path):
    """TVM's own cache, sequences reserved to the case's history, timed through its attention call."""
    import tvm
    import tvm_ffi
    from host import tvm_create_args

    dev = tvm.cuda(0)
    mod = tvm.runtime.load_module(str(tvm_dir / "tvm_kv_cache.so"))
    names = json.loads((tvm_dir / "names.json").read_text())
    B, n, hist = c["B"], c["n"], c["hist"] if c["kind"] == "prefill" else c["L"]
    chunk = max(B * n, hist, 16)
    args = tvm_create_args(
        mod,
        names,
        dev,
        max_batch=max(B, 1),
        max_total=B * (hist + n + 2 * P),
        chunk=chunk,
        num_layers=1,
        h_qo=H_QO,
        h_kv=H_KV,
        d=D,
        page_size=P,
        dtype=DTYPE,
    )
    cache = tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")(*args)
    g = {
        x: tvm.get_global_func("vm.builtin." + x)
        for x in (
            "kv_state_add_sequence",
            "kv_state_begin_forward",
            "kv_state_end_forward",
            "attention_kv_cache_attention_with_fused_qkv",
        )
    }
    for s in range(B):
        g["kv_state_add_sequence"](cache, s)
        if hist:
            g["kv_state_begin_forward"](cache, tvm_ffi.Shape([s]), tvm_ffi.Shape([hist]))
            g["kv_state_end_forward"](cache)
    rng = np.random.default_rng(1)
    qkv = tvm.runtime.tensor(rng.uniform(-1, 1, (B * n, H_QO + 2 * H_KV, D)).astype(DTYPE), dev)
    out = tvm.runtime.empty((B * n, H_QO, D), DTYPE, dev)
    g["kv_state_begin_forward"](cache, tvm_ffi.Shape(list(range(B))), tvm_ffi.Shape([n] * B))
    f = g["attention_kv_cache_attention_with_fused_qkv"]
    scale = D**-0.5
    return (lambda: f(cache, 0, scale, qkv, out)), cache


def tvmkv_full_cache_run(c):
    """tvmkv through ``PagedAttentionKVCache.attention_with_fused_qkv`` (split + append + attention)."""
    import tvm

    from tvmkv import PagedAttentionKVCache

    B, n, hist = c["B"], c["n"], c["hist"] if c["kind"] == "prefill" else c["L"]
    cache = PagedAttentionKVCache(
        1,
        H_QO,
        H_KV,
        D,
        page_size=P,
        max_batch_size=max(B, 1),
        max_total_seq_len=B * (hist + n + 2 * P),
        prefill_chunk_size=max(B * n, hist, 16),
        dtype=DTYPE,
        target="cuda",
    )
    for s in range(B):
        cache.add_sequence(s)
        if hist:
            cache.begin_forward([s], [hist])
            cache.end_forward()
    dev = tvm.cuda(0)
    rng = np.random.default_rng(1)
    qkv = tvm.runtime.tensor(rng.uniform(-1, 1, (B * n, H_QO + 2 * H_KV, D)).astype(DTYPE), dev)
    out = tvm.runtime.empty((B * n, H_QO, D), DTYPE, dev)
    cache.begin_forward(list(range(B)), [n] * B)
    return (lambda: cache.attention_with_fused_qkv(0, qkv, out=out)), cache


def label(c) -> str:
    if c["kind"] == "decode":
        return f"decode {c['B']}x{c['L']}"
    return f"prefill {c['B']}x{c['n']} hist {c['hist']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prepare", type=Path, help="build machine: compile TVM's CUDA kernels into this folder")
    ap.add_argument("--tvm-lib", type=Path, default=ROOT / "build" / "tvm-cuda-sm_90")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="first decode and first prefill case only")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench")
    ap.add_argument("--write", action="store_true", help="replace the GPU section of bench/RESULTS.md")
    ap.add_argument("--skip-tvm", action="store_true", help="leave out TVM's own cache (tvmkv and torch only)")
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    payload = os.environ.get("TVMKV_PAYLOAD")
    if payload:
        sys.path.insert(0, payload)
        import tvm_cuda_runtime  # noqa: F401  (TVM's CUDA runtime in runtime-only mode)
    import torch
    import tvm

    from tvmkv.build import load_kernels
    from tvmkv.tir.spec import KernelSpec

    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args.reps)
    meta = {
        "card": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "tvm": tvm.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "reps": args.reps,
    }
    errors = []

    def guard(what, fn, default=None):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - log and continue with the other sections
            traceback.print_exc()
            errors.append(f"{what}: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
            return default

    meta["copy_GBps"] = guard("copy rate", bench.copy_rate, float("nan"))
    lib = guard("load tvmkv kernels", lambda: load_kernels(KernelSpec(H_QO, H_KV, D, P, DTYPE, "cuda"), arch="sm_90"))
    print(f"{meta['card']}: D2D copy {meta['copy_GBps']:.0f} GB/s", flush=True)
    cases = [("decode", b, 1, ctx) for b, ctx in DECODE] + [("prefill", b, n, h) for b, n, h in PREFILL]
    if args.quick:
        cases = [cases[0], cases[len(DECODE)]]
    rng = np.random.default_rng(0)
    rows = []
    for kind, B, n, hist in cases:
        c = make_case(kind, B, n, hist, rng)
        row = {"case": label(c), "kind": kind, "batch": B, "new": c["n"], "history": hist, "kv_len": c["L"]}
        fl, kvb = flops_and_bytes(c)
        row.update(flops=fl, kv_bytes=kvb)
        ref = None
        print(f"[{row['case']}] torch", flush=True)
        tr = guard(f"{row['case']} torch", lambda: torch_run(c))
        if tr:
            tr[0]()
            ref = tr[1]()
            row["torch_us"] = guard(f"{row['case']} torch time", lambda: bench.time(tr[0]))
        if lib is not None:
            print(f"[{row['case']}] tvmkv", flush=True)
            kr = guard(f"{row['case']} tvmkv", lambda: tvmkv_run(c, lib))
            if kr:
                kr[0]()
                if ref is not None:
                    row["tvmkv_max_err"] = float(np.abs(kr[1]() - ref).max())
                row["tvmkv_us"] = guard(f"{row['case']} tvmkv time", lambda: bench.time(kr[0]))
        print(f"[{row['case']}] TVM cache", flush=True)
        tc = None if args.skip_tvm else guard(f"{row['case']} TVM cache", lambda: tvm_cache_run(c, args.tvm_lib))
        if tc:
            row["tvm_us"] = guard(f"{row['case']} TVM time", lambda: bench.time(tc[0]))
            del tc
        if (kind, B, n, c["L"] if kind == "decode" else hist) == FULL_CACHE_CASE and lib is not None:
            fc = guard(f"{row['case']} tvmkv full cache", lambda: tvmkv_full_cache_run(c))
            if fc:
                row["tvmkv_full_cache_us"] = guard("full cache time", lambda: bench.time(fc[0]))
                del fc
        for key in ("tvmkv", "tvm", "torch"):
            us = row.get(f"{key}_us")
            if us:
                row[f"{key}_tflops"] = fl / (us * 1e-6) / 1e12
                row[f"{key}_bw_pct"] = 100 * kvb / (us * 1e-6) / 1e9 / meta["copy_GBps"]
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("bytes")}), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    table = render(rows, meta, errors)
    print(table)
    (args.out / "gpu.json").write_text(json.dumps({"meta": meta, "rows": rows, "errors": errors}, indent=1))
    (args.out / "gpu.md").write_text(table)
    if args.write:
        from host import write_results

        write_results(table, MARK_BEGIN, MARK_END)
    return 1 if errors else 0


def render(rows, meta, errors) -> str:
    def f(x, spec):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    lines = [
        "## GPU",
        "",
        f"Measured {meta['date']} on **{meta['card']}** (torch {meta['torch']}, TVM {meta['tvm']}). "
        f"fp16, H_qo {H_QO}, H_kv {H_KV}, D {D}, page {P}. Median µs of {meta['reps']} calls (CUDA events). "
        f"KV bandwidth as % of the device-to-device copy rate measured in the same run "
        f"({f(meta.get('copy_GBps'), '.0f')} GB/s read+write). tvmkv = kernels called directly; TVM = its "
        "cache's attention call (also splits q/k/v and appends K/V); torch = SDPA on contiguous K/V. "
        "Ratio = baseline µs / tvmkv µs (> 1: tvmkv faster). `bench/gpu.py` regenerates this.",
        "",
        "| case | tvmkv µs | TVM µs | torch µs | vs TVM | vs torch | tvmkv KV bw % | tvmkv TFLOP/s "
        "| torch TFLOP/s | max err vs torch |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        ours = r.get("tvmkv_us")

        def ratio(key, r=r, ours=ours):
            return f(r[key] / ours, ".2f") + "x" if r.get(key) and ours else "n/a"

        lines.append(
            f"| {r['case']} | {f(ours, ',.1f')} | {f(r.get('tvm_us'), ',.1f')} | {f(r.get('torch_us'), ',.1f')} "
            f"| {ratio('tvm_us')} | {ratio('torch_us')} | {f(r.get('tvmkv_bw_pct'), '.0f')} "
            f"| {f(r.get('tvmkv_tflops'), '.1f')} | {f(r.get('torch_tflops'), '.1f')} "
            f"| {f(r.get('tvmkv_max_err'), '.1e')} |"
        )
    full = [r for r in rows if r.get("tvmkv_full_cache_us")]
    for r in full:
        lines.append(
            f"\nThrough the full tvmkv cache (split + append + attention), {r['case']}: "
            f"{r['tvmkv_full_cache_us']:,.1f} µs (TVM's cache: {f(r.get('tvm_us'), ',.1f')} µs)."
        )
    for e in errors:
        lines.append(f"\nFAILED {e}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
