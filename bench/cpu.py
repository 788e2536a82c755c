"""CPU micro-benchmark: tvmkv's paged decode/prefill vs TVM's own CPU kernels vs torch SDPA.

All three run on the same data: pages ``[num_pages, 2, H_kv, P, D]`` with a shuffled page table
(docs/layout.md) for tvmkv and TVM's ``batch_{decode,prefill}_paged_kv_cpu`` (from
``tvm.relax.frontend.nn.llm``), and the same K/V gathered into contiguous ``[B, H_kv, L, D]`` tensors
for ``torch.nn.functional.scaled_dot_product_attention`` (K/V heads repeated to H_qo beforehand).
Every output is checked against torch before timing. Times are medians over repetitions of one call (µs).

Usage::

    .venv/bin/python bench/cpu.py [--dtype float32 float16] [--threads 2] [--quick] [--write]

``--write`` replaces the CPU section of ``bench/RESULTS.md`` (between the ``cpu:begin``/``cpu:end``
markers) and leaves other sections alone.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
from _common import cpu_model, write_results

H_QO, H_KV, D, P = 32, 8, 128, 16
DECODE_CASES = [(1, 1024), (8, 1024), (16, 2048)]  # (batch, context)
PREFILL_CASES = [(1, 512, 0), (1, 256, 1024), (32, 4, 512)]  # (batch, new tokens, history), causal
MARK_BEGIN, MARK_END = "<!-- cpu:begin -->", "<!-- cpu:end -->"


@dataclass
class Case:
    """One benchmark shape with its page data and the arrays of docs/layout.md."""

    kind: str  # "decode" | "prefill"
    batch: int
    n_new: int  # new tokens per sequence (1 for decode)
    history: int  # tokens before this forward
    dtype: str

    @property
    def kv_len(self) -> int:
        return self.history + self.n_new if self.kind == "prefill" else self.history

    @property
    def label(self) -> str:
        if self.kind == "decode":
            return f"decode B={self.batch} ctx={self.kv_len}"
        return f"prefill B={self.batch} n={self.n_new} hist={self.history} causal"


def make_data(case: Case, rng) -> dict:
    """Pages, page tables, q and the contiguous K/V for one case (numpy, ``case.dtype``)."""
    B, L, n = case.batch, case.kv_len, case.n_new
    npages_seq = -(-L // P)
    num_pages = B * npages_seq + 1  # the last page is never handed out
    perm = rng.permutation(num_pages - 1).astype("int32")
    page_indices = perm[: B * npages_seq]
    page_indptr = (np.arange(B + 1) * npages_seq).astype("int32")
    last_page_len = np.full(B, L - (npages_seq - 1) * P, "int32")
    pages = np.zeros((num_pages, 2, H_KV, P, D), "float32")
    k = rng.uniform(-1, 1, (B, H_KV, L, D)).astype("float32")
    v = rng.uniform(-1, 1, (B, H_KV, L, D)).astype("float32")
    for b in range(B):
        for j in range(npages_seq):
            lo, hi = j * P, min(L, (j + 1) * P)
            pid = page_indices[b * npages_seq + j]
            pages[pid, 0, :, : hi - lo] = k[b, :, lo:hi]
            pages[pid, 1, :, : hi - lo] = v[b, :, lo:hi]
    rows = B * n
    q = rng.uniform(-1, 1, (rows, H_QO, D)).astype("float32")
    q_pos = np.concatenate([np.arange(case.history, case.history + n) for _ in range(B)]).astype("int32")
    if case.kind == "decode":
        q_pos = np.full(B, L - 1, "int32")
    cast = (lambda a: a.astype(case.dtype)) if case.dtype != "float32" else (lambda a: a)
    return dict(
        pages=cast(pages),
        k=cast(k),
        v=cast(v),
        q=cast(q),
        q_pos=q_pos,
        q_indptr=(np.arange(B + 1) * n).astype("int32"),
        page_indptr=page_indptr,
        page_indices=page_indices,
        last_page_len=last_page_len,
    )


def bench(fn, *, min_reps=5, max_reps=200, budget_s=1.5) -> float:
    """Median µs of ``fn()`` after one warm-up call; repeats until ``budget_s`` or ``max_reps``."""
    fn()
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


# ------------------------------------------------------------------------------------------------
# The three implementations: each returns (run, output_getter)
# ------------------------------------------------------------------------------------------------


def tvmkv_impl(case: Case, data: dict):
    import tvm

    from tvmkv.build import load_kernels
    from tvmkv.tir.spec import KernelSpec

    lib = load_kernels(KernelSpec(H_QO, H_KV, D, P, case.dtype, "llvm"))
    dev = tvm.cpu(0)

    def t(a):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)

    B, rows = case.batch, data["q"].shape[0]
    pages, q = t(data["pages"]), t(data["q"])
    pi, px, lpl = t(data["page_indptr"]), t(data["page_indices"]), t(data["last_page_len"])
    kv_window = t(np.zeros((B, 3), "int32"))
    o = tvm.runtime.empty((rows, H_QO, D), case.dtype, dev)
    lse = tvm.runtime.empty((rows, H_QO), "float32", dev)
    scale = 1.0 / math.sqrt(D)
    if case.kind == "decode":
        f = lib["paged_decode"]
        q_pos = t(data["q_pos"])

        def run():
            f(q, q_pos, pages, pi, px, lpl, kv_window, o, lse, scale, 1.0, 1e4)

    else:
        f = lib["paged_prefill_causal"]
        qi, q_pos = t(data["q_indptr"]), t(data["q_pos"])
        q_tree, kv_tree = t(np.zeros((1, 2), "int32")), t(np.zeros((1, 3), "int32"))
        one = t(np.zeros(1, "int32"))
        one_b = t(np.zeros(1, "int32"))

        def run():
            f(
                q,
                qi,
                q_pos,
                pages,
                pi,
                px,
                lpl,
                kv_window,
                q_tree,
                one,
                kv_tree,
                one_b,
                o,
                lse,
                scale,
                1.0,
                1e4,
            )

    return run, lambda: o.numpy()


def tvm_upstream_impl(case: Case, data: dict):
    """TVM's own CPU kernels (``tvm.relax.frontend.nn.llm``), compiled here for llvm."""
    import tvm
    from tvm.relax.frontend.nn.llm import kv_cache as kvc

    from tvmkv.target import make_target

    rope_scaling = {}  # no "rope_type": default frequencies (RoPE is off: rotary_mode 0)
    if case.kind == "decode":
        func = kvc._attention_decode_cpu(H_KV, H_QO, D, case.dtype, False, rope_scaling, page_size=P)
        name = "batch_decode_paged_kv_cpu"
    else:
        func = kvc._attention_prefill_cpu(H_KV, H_QO, D, case.dtype, False, rope_scaling, page_size=P)
        name = "batch_prefill_paged_kv_cpu"
    key = (case.kind, case.dtype)
    mod = _UPSTREAM.get(key)
    if mod is None:
        target = make_target("llvm")  # the same -mcpu as tvmkv's CPU libraries
        mod = _UPSTREAM[key] = tvm.compile(tvm.IRModule({name: func}), target=target)
    f = mod[name]
    dev = tvm.cpu(0)

    def t(a):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)

    B, rows = case.batch, data["q"].shape[0]
    pages, q = t(data["pages"]), t(data["q"])
    pi, px, lpl = t(data["page_indptr"]), t(data["page_indices"]), t(data["last_page_len"])
    k_rope_off = t(np.zeros(B, "int32"))
    o = tvm.runtime.empty((rows, H_QO, D), case.dtype, dev)
    lse = tvm.runtime.empty((rows, H_QO), "float32", dev)
    scale = 1.0 / math.sqrt(D)
    if case.kind == "decode":
        q_pos = t(data["q_pos"])

        def run():
            f(q, pages, pi, px, lpl, k_rope_off, q_pos, o, lse, 0, 1.0, 1e4, scale)

    else:
        qi, q_pos = t(data["q_indptr"]), t(data["q_pos"])

        def run():
            f(q, qi, pages, pi, px, lpl, k_rope_off, q_pos, o, lse, 1, 0, 1.0, 1e4, scale)

    return run, lambda: o.numpy()


_UPSTREAM: dict = {}


def torch_impl(case: Case, data: dict):
    import torch
    import torch.nn.functional as F

    tdt = getattr(torch, case.dtype)
    B, n, L = case.batch, case.n_new, case.kv_len
    q = torch.from_numpy(data["q"].astype("float32")).to(tdt).reshape(B, n, H_QO, D).transpose(1, 2)
    q = q.contiguous()
    group = H_QO // H_KV  # K/V expanded to H_qo contiguous heads outside the timed call
    k = torch.from_numpy(data["k"].astype("float32")).to(tdt).repeat_interleave(group, dim=1).contiguous()
    v = torch.from_numpy(data["v"].astype("float32")).to(tdt).repeat_interleave(group, dim=1).contiguous()
    mask = None
    if case.kind == "prefill" and case.history:
        mask = torch.ones(n, L, dtype=torch.bool).tril(diagonal=case.history)  # bottom-right causal
    causal = case.kind == "prefill" and not case.history
    out = {}

    def run():
        with torch.no_grad():
            out["o"] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)

    def get():
        return out["o"].transpose(1, 2).reshape(B * n, H_QO, D).float().numpy()

    return run, get


IMPLS = {"tvmkv": tvmkv_impl, "tvm": tvm_upstream_impl, "torch": torch_impl}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "float16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--quick", action="store_true", help="first decode and first prefill case only")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds of repetitions per measurement")
    ap.add_argument("--write", action="store_true", help="write the CPU section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    cases = [Case("decode", b, 1, ctx, dt) for dt in args.dtype for b, ctx in DECODE_CASES]
    cases += [Case("prefill", b, n, h, dt) for dt in args.dtype for b, n, h in PREFILL_CASES]
    if args.quick:
        cases = [c for c in cases if (c.batch, c.n_new, c.history) in {(1, 1, 1024), (1, 256, 1024)}]
    rng = np.random.default_rng(0)
    rows = []
    for case in cases:
        data = make_data(case, rng)
        res = {}
        ref_run, ref_get = torch_impl(case, data)
        ref_run()
        ref = ref_get()
        for name in args.impl:
            try:
                run, get = IMPLS[name](case, data)
                run()
                err = float(np.abs(get().astype("float32") - ref).max())
                us = bench(run, budget_s=args.budget)
                res[name] = (us, err)
            except Exception as e:  # noqa: BLE001 - one failed implementation must not hide the others
                res[name] = (float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            us, err = res[name]
            err_s = f"{err:.1e}" if isinstance(err, float) else err
            print(
                f"{case.dtype:8s} {case.label:38s} {name:6s} {us:12.1f} us  max|err| vs torch {err_s}",
                flush=True,
            )
        rows.append((case, res))
    table = render(rows, args)
    print(table)
    if args.write:
        write_results(table, MARK_BEGIN, MARK_END)
    return 0


def render(rows, args) -> str:
    import torch
    import tvm

    from tvmkv.target import host_llvm_mcpu

    lines = [
        "## CPU",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} on `{platform.node()}`: {cpu_model()}, "
        f"{os.cpu_count()} logical CPUs; torch {torch.__version__} with {args.threads} threads, "
        f"TVM {tvm.__version__} (TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')}), both TVM libraries "
        f"compiled with -mcpu={host_llvm_mcpu()}. "
        f"H_qo={H_QO}, H_kv={H_KV}, D={D}, page size {P}. Median µs of one call "
        f"(≥5 repetitions, {args.budget:g} s budget each). `bench/cpu.py --write` regenerates this section.",
        "",
        f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (above the thread count "
        "means other processes shared the cores: absolute numbers are inflated, ratios less so).",
        "",
        "Ratios are baseline time / tvmkv time (> 1 means tvmkv is faster). "
        "Targets: ≥ 5x over TVM's CPU kernels, ≥ 1x torch on decode. max|err| is tvmkv's output vs torch.",
        "",
        "| dtype | case | tvmkv µs | TVM cpu µs | torch SDPA µs | vs TVM | vs torch | tvmkv max abs err |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def cell(res, name):
        us = res.get(name, (float("nan"), None))[0]
        return "n/a" if math.isnan(us) else f"{us:,.0f}"

    def ratio(res, name):
        a, b = res.get(name, (float("nan"),))[0], res.get("tvmkv", (float("nan"),))[0]
        return "n/a" if math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"

    for case, res in rows:
        err = res.get("tvmkv", (0, "n/a"))[1]
        err_s = f"{err:.1e}" if isinstance(err, float) else str(err)
        lines.append(
            f"| {case.dtype} | {case.label} | {cell(res, 'tvmkv')} | {cell(res, 'tvm')} "
            f"| {cell(res, 'torch')} | {ratio(res, 'tvm')} | {ratio(res, 'torch')} | {err_s} |"
        )
    failed = [(c, n, r[1]) for c, res in rows for n, r in res.items() if isinstance(r[1], str)]
    for c, n, msg in failed:
        lines.append(f"\n{n} failed on {c.dtype} {c.label}: {msg}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
