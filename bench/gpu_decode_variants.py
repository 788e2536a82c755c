"""Check and time the CUDA ``paged_decode`` kernel and its tuning variants against NumPy, torch SDPA
and copy bandwidth.

Two modes:

* ``--prepare`` (a machine with the full TVM + nvcc, no GPU needed): build the decode-only libraries
  into ``--variants`` (default ``decode-variants-<arch>/`` in tvmkv's build dir): the tuning variants
  (warps per block x keys per lane group, plus the generic schedule) of the bench configuration and
  the decode kernel of every correctness case.
* default (the GPU machine, runtime-only TVM; see the usage line below): correctness of decode
  (incl. sliding window + inline RoPE) against ``tvmkv.reference.attention`` and, at the bench
  shapes, against torch SDPA; then CUDA-event timings (median over repeats of back-to-back launches
  queued behind a ``torch.cuda._sleep`` so CPU launch overhead is hidden) vs torch SDPA on
  contiguous K/V (``enable_gqa``) and a device-to-device copy.

Usage on the GPU machine (carry ``.devpayload`` and the ``--variants`` folder)::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        python3 bench/gpu_decode_variants.py --variants build/decode-variants-sm_90
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from _common import ROOT

from tvmkv.build import default_build_dir
from tvmkv.payload import bootstrap
from tvmkv.target import default_cuda_arch
from tvmkv.tir.spec import KernelSpec

BENCH = KernelSpec(32, 8, 128, 16, "float16", "cuda")
SHAPES = [(1, 1024), (32, 1024), (64, 4096), (128, 4096), (256, 2048)]
# tuning variants of the bench configuration:
# name -> (warps per block, keys per lane group, double buffer, other make_paged_decode_cuda knobs);
# "stages": depth of the cp.async K/V ring in shared memory (1: loads into registers)
VARIANTS = {
    "regs_nw8_u4": (8, 4, False, {"stages": 1}),
    "regs_nw4_u4": (4, 4, False, {"stages": 1}),
    "db_nw4_u4": (4, 4, True, {}),
    "cp2_nw8_u4": (8, 4, False, {"stages": 2}),
    "cp3_nw8_u4": (8, 4, False, {"stages": 3}),
    "cp2_nw4_u4": (4, 4, False, {"stages": 2}),
    "cp2_nw4_u8": (4, 8, False, {"stages": 2}),
    "cp2_nw8_u2": (8, 2, False, {"stages": 2}),
    "cp2_nw16_u2": (16, 2, False, {"stages": 2}),
    "cp2_nw16_u4": (16, 4, False, {"stages": 2}),
    "cp3_nw4_u4": (4, 4, False, {"stages": 3}),
    "cp4_nw4_u4": (4, 4, False, {"stages": 4}),
    "cp6_nw4_u4": (4, 4, False, {"stages": 6}),
    "cp3_nw8_u2": (8, 2, False, {"stages": 3}),
    "cp6_nw8_u2": (8, 2, False, {"stages": 6}),
    "cp4_nw4_u8": (4, 8, False, {"stages": 4}),
    "cp3_nw2_u4": (2, 4, False, {"stages": 3}),
}
ROPE_SCALE, ROPE_THETA = 1.0, 10000.0
# the decode configurations of tests/test_attention_kernels.py, taken from it so the two cannot drift
sys.path.insert(0, str(ROOT / "tests"))
from test_attention_kernels import CORE, EXTRA  # noqa: E402
from test_attention_kernels import ROPE_CFGS as ROPE  # noqa: E402
from test_attention_kernels import SLIDING_CFGS as SLIDING  # noqa: E402


def _check_name(spec, sliding, rope) -> str:
    return f"{spec.tag}{'_sw' if sliding else ''}{'_rope' if rope else ''}"


def check_cases():
    """(spec, sliding, rope, kv_lens, windows) of the correctness checks: the decode cases of
    tests/test_attention_kernels.py (H_kv 2) plus the bench configuration and a group-16 one."""
    cases = []
    for dtype, D, P, group in CORE + EXTRA:
        spec = KernelSpec(2 * group, 2, D, P, dtype, "cuda")
        cases.append((spec, False, False, [1, P, 2 * P + 3, 37, 0, 100], None))
    for dtype, D, P, group in SLIDING:
        spec = KernelSpec(2 * group, 2, D, P, dtype, "cuda")
        win = [(4, 30, 17), (1, 2 * P, 5), (0, 0, 0), (0, 3, 9)]
        cases.append((spec, True, False, [70, 2 * P + 1, 45, 5], win))
    for dtype, D, P, group, sliding in ROPE:
        spec = KernelSpec(2 * group, 2, D, P, dtype, "cuda")
        win = [(0, 0, 0), (0, 0, 0), (2, 40, 11)] if sliding else None
        cases.append((spec, sliding, True, [1, 33, 70], win))
    big = [(4, 30, 17), (1, 32, 5), (0, 0, 0), (0, 3, 9), (16, 700, 3)]
    cases.append((BENCH, False, False, [1, 16, 1000, 37, 0, 513], None))
    cases.append((BENCH, True, True, [70, 33, 45, 5, 1000], big))
    cases.append((KernelSpec(32, 2, 128, 16, "float16", "cuda"), True, False, [70, 33, 45, 5, 1000], big))
    cases.append((KernelSpec(8, 2, 128, 32, "bfloat16", "cuda"), False, True, [1, 33, 700], None))
    return cases


def prepare(arch: str, out: Path) -> None:
    from tvmkv.build import compile_funcs, export_module
    from tvmkv.tir.attention_generic import build_attention
    from tvmkv.tir.decode import make_paged_decode
    from tvmkv.tir.decode_cuda import make_paged_decode_cuda

    out.mkdir(parents=True, exist_ok=True)
    funcs = {
        n: make_paged_decode_cuda(BENCH, num_warps=nw, unroll=u, double_buffer=db, **kw)
        for n, (nw, u, db, kw) in VARIANTS.items()
    }
    funcs["generic"] = build_attention(BENCH, source="decode", mask="none", sliding=False, inline_rope=False)
    for spec, sliding, rope, _, _ in check_cases():
        funcs[_check_name(spec, sliding, rope)] = make_paged_decode(spec, sliding=sliding, inline_rope=rope)
    for name, f in funcs.items():
        if (out / f"{name}.so").exists():
            continue
        export_module(compile_funcs({"paged_decode": f}, "cuda", arch), out / f"{name}.so", "cuda", arch)
        print("built", out / f"{name}.so", flush=True)


# ------------------------------------------------------------------------------------------ GPU side


def _np_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def check_reference(spec, vdir: Path, *, sliding, rope, kv_lens, windows, rng) -> str:
    """Run the prebuilt decode-only library (in ``vdir``) on random paged data and compare with NumPy."""
    import tvm

    from tvmkv.reference import attention as ref

    path = vdir / f"{_check_name(spec, sliding, rope)}.so"
    lib = tvm.runtime.load_module(str(path))
    P, B = spec.page_size, len(kv_lens)
    npages = [-(-L // P) for L in kv_lens]
    num_pages = sum(npages) + 4
    perm = rng.permutation(num_pages - 1).astype(np.int32)
    page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    page_indices = perm[: sum(npages)].copy() if sum(npages) else np.zeros(1, np.int32)
    last = np.array([L - (n - 1) * P if n else 0 for L, n in zip(kv_lens, npages, strict=True)], np.int32)
    dt = _np_dtype(spec.dtype)
    pages = rng.standard_normal((num_pages, 2, spec.num_kv_heads, P, spec.head_dim)).astype(np.float32).astype(dt)
    kv_window = np.array(windows if windows is not None else [(0, 0, 0)] * B, np.int32)
    q = rng.standard_normal((B, spec.num_qo_heads, spec.head_dim)).astype(np.float32).astype(dt)
    q_pos = np.array([max(L - 1, 0) + w[2] for L, w in zip(kv_lens, kv_window, strict=True)], np.int32)
    sm = 1.0 / math.sqrt(spec.head_dim)
    tables = [page_indptr, page_indices, last, kv_window]
    o_ref, lse_ref = ref.paged_decode(
        q, q_pos, pages, *tables, sm, ROPE_SCALE, ROPE_THETA, sliding=sliding, inline_rope=rope
    )
    dev = tvm.cuda(0)
    o = tvm.runtime.tensor(np.ones_like(q), dev)
    lse = tvm.runtime.tensor(np.zeros((B, spec.num_qo_heads), np.float32), dev)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in [q, q_pos, pages, *tables]]
    lib["paged_decode"](*args, o, lse, sm, ROPE_SCALE, ROPE_THETA)
    og, lg = o.numpy().astype(np.float64), lse.numpy().astype(np.float64)
    tol = 1e-3 if spec.dtype == "float32" else (2e-2 if spec.dtype == "float16" else 4e-2)
    ok = np.array_equal(np.isneginf(lg), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    err_o = float(np.max(np.abs(og - o_ref))) if og.size else 0.0
    err_l = float(np.max(np.abs(lg[fin] - lse_ref[fin]))) if fin.any() else 0.0
    ok = ok and np.allclose(og, o_ref, atol=tol, rtol=tol) and err_l <= tol * (1 + np.abs(lse_ref[fin]).max())
    tag = f"{spec.tag}{' sw' if sliding else ''}{' rope' if rope else ''} kv_lens={kv_lens}"
    return f"{'ok  ' if ok else 'FAIL'} {tag}: max|do|={err_o:.2e} max|dlse|={err_l:.2e}"


def gpu_time_ms(torch, fn, reps=20, inner=10) -> float:
    """Median over ``reps`` of (CUDA-event time of ``inner`` back-to-back calls) / inner, in ms."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU work: the launches below queue up behind it
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return float(np.median(times))


def bench(torch, vdir: Path) -> None:
    import tvm

    spec = BENCH
    H_qo, H_kv, D, P = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size
    kernels = {"tvmkv": tvm.runtime.load_module(str(vdir / f"{_check_name(spec, False, False)}.so"))["paged_decode"]}
    for name in [*VARIANTS, "generic"]:
        if (vdir / f"{name}.so").exists():
            kernels[name] = tvm.runtime.load_module(str(vdir / f"{name}.so"))["paged_decode"]
    dl = tvm.runtime.from_dlpack
    # copy bandwidth (read + write)
    n = 1 << 29
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = gpu_time_ms(torch, lambda s=src, d=dst: d.copy_(s), reps=10, inner=5)
    copy_bw = 2 * n / t / 1e6
    print(f"device-to-device copy: {copy_bw:.0f} GB/s (read + write of {n >> 20} MiB)")
    src = dst = None
    sm = 1.0 / math.sqrt(D)
    cols = ["B x L", "KV MB", "torch us", "tvmkv us", "ratio", "tvmkv GB/s", "% copy", "max|do|"]
    extra = [k for k in kernels if k != "tvmkv"]
    print(" | ".join(cols + [f"{k} us" for k in extra]))
    for B, L in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        npg = L // P
        num_pages = B * npg + 1
        pages = torch.randn((num_pages, 2, H_kv, P, D), device="cuda", dtype=torch.float16, generator=g)
        ids = torch.randperm(num_pages - 1, device="cuda", generator=g)[: B * npg].to(torch.int32)
        page_indptr = torch.arange(0, B * npg + 1, npg, device="cuda", dtype=torch.int32)
        last = torch.full((B,), P, device="cuda", dtype=torch.int32)
        kv_window = torch.zeros((B, 3), device="cuda", dtype=torch.int32)
        q = torch.randn((B, H_qo, D), device="cuda", dtype=torch.float16, generator=g)
        q_pos = torch.full((B,), L - 1, device="cuda", dtype=torch.int32)
        sel = pages[ids.long().view(B, npg)]  # [B, npg, 2, H_kv, P, D]
        k = sel[:, :, 0].permute(0, 2, 1, 3, 4).reshape(B, H_kv, L, D).contiguous()
        v = sel[:, :, 1].permute(0, 2, 1, 3, 4).reshape(B, H_kv, L, D).contiguous()
        del sel
        qt = q.view(B, H_qo, 1, D)
        o = torch.empty_like(q)
        lse = torch.empty((B, H_qo), device="cuda", dtype=torch.float32)
        args = [dl(x) for x in (q, q_pos, pages, page_indptr, ids, last, kv_window, o, lse)]

        def sdpa(qt=qt, k=k, v=v):
            return torch.nn.functional.scaled_dot_product_attention(qt, k, v, scale=sm, enable_gqa=True)

        ref_o = sdpa().view(B, H_qo, D).float()
        times = {}
        for name, fn in kernels.items():
            o.zero_()
            try:
                fn(*args, sm, ROPE_SCALE, ROPE_THETA)
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - a variant the card cannot launch: report it, time the rest
                if name == "tvmkv":
                    raise
                print(f"  {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                times[name] = float("nan")
                continue
            err = float((o.float() - ref_o).abs().max())
            if name == "tvmkv":
                err_main = err
            elif err > 2e-2:
                print(f"  {name}: max|do|={err:.2e} (WRONG)")
            times[name] = gpu_time_ms(torch, lambda fn=fn, a=args: fn(*a, sm, ROPE_SCALE, ROPE_THETA))
        t_torch = gpu_time_ms(torch, sdpa)
        mb = B * L * H_kv * D * 2 * 2 / 1e6
        bw = mb / times["tvmkv"] if times["tvmkv"] > 0 else 0.0  # MB / ms = GB/s
        row = [
            f"{B}x{L}",
            f"{mb:.0f}",
            f"{t_torch * 1e3:.1f}",
            f"{times['tvmkv'] * 1e3:.1f}",
            f"{times['tvmkv'] / t_torch:.2f}",
            f"{bw:.0f}",
            f"{100 * bw / copy_bw:.0f}",
            f"{err_main:.1e}",
        ] + [f"{times[k] * 1e3:.1f}" for k in extra]
        print(" | ".join(row), flush=True)
        del pages, k, v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", action="store_true", help="build the decode-only libraries (full TVM + nvcc)")
    p.add_argument("--arch", default=None, help="CUDA arch of --prepare (default $TVMKV_CUDA_ARCH or sm_90)")
    p.add_argument(
        "--variants",
        type=Path,
        default=None,
        help="folder of the decode-only libraries (default: decode-variants-<arch> in tvmkv's build dir, "
        "see python -m tvmkv build --help)",
    )
    p.add_argument("--skip-bench", action="store_true", help="correctness checks only")
    args = p.parse_args(argv)
    arch = args.arch or default_cuda_arch()
    vdir = args.variants or default_build_dir() / f"decode-variants-{arch}"
    if args.prepare:
        prepare(arch, vdir)
        return 0
    bootstrap()  # $TVMKV_PAYLOAD: the GPU machine's runtime-only TVM, before tvm is imported
    import torch
    import tvm

    dev = tvm.cuda(0)
    print(f"device: {torch.cuda.get_device_name()} (compute {dev.compute_version}); torch {torch.__version__}")
    rng = np.random.default_rng(0)
    checks = check_cases()
    failed = 0
    for spec, sliding, rope, kv_lens, windows in checks:
        try:
            line = check_reference(spec, vdir, sliding=sliding, rope=rope, kv_lens=kv_lens, windows=windows, rng=rng)
        except Exception as err:  # noqa: BLE001 - report and go on to the timings
            line = f"FAIL {spec.tag}: {type(err).__name__}: {str(err)[:300]}"
        failed += line.startswith("FAIL")
        print(line, flush=True)
    if not args.skip_bench:
        bench(torch, vdir)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
