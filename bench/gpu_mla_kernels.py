"""MLA decode kernels alone (no cache): schedules of ``mla_attention`` side by side vs torch bmm.

DeepSeek-V2's latent shape (D 576 = 512 + 64, fp16, page 16), decode ``B x L`` (one query row per
sequence over ``L`` latent rows on random, non-contiguous pages), H 128 and 16. Each schedule runs as
the cache would launch it: split into ``plan_split(B, L, blocks_per_seq, tile_keys, num_sms,
blocks_per_sm=...)`` chunks (``mla_attention_split`` + ``mla_merge_splits``) or whole
(``mla_attention``), with the schedule's heads per block, keys per tile and blocks per SM
(``tvmkv.tir.mla_layout``). Contenders (this checkout, see VARIANTS):

- ``mma``: the ``mma.sync`` schedule (what sm_80 / sm_89 build; sm_90 before the warpgroup-MMA one);
- ``wg32`` / ``wg16``: the sm_90 warpgroup-MMA schedule (``tvmkv.tir.mla_hopper``), 32 / 16 heads a
  block, its copying warpgroup issuing bulk tensor copies (TMA); ``_cpasync``: 16-byte ``cp.async``
  instead; ``_1wg_k64s2``: one warpgroup copying and computing, 64-key tiles in 2 stages;
- ``<name>@2x``: split as if each SM held twice the blocks it does;
- ``torch``: bmm (q @ latents^T, fp32 softmax, P @ latents[:, :, :512]) on contiguous latents.

Errors: max abs difference of o from a float32 torch reference (and of the base-2 lse). Times:
CUDA-event medians, device time (each call queued behind a GPU spin; bench/_common.CudaTimer); a
device-to-device copy of the same bytes is timed in the same run (GB/s of the latents read once, and
the copy's read + write rate beside it), and so is a read of them alone (``read``: torch's sum).

Build machine::

    .venv/bin/python bench/gpu_mla_kernels.py --prepare build/mla-kernels

GPU machine (carry ``.devpayload`` and ``build/mla-kernels``)::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        python3 bench/gpu_mla_kernels.py --build-dir build/mla-kernels
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from _common import ROOT, CudaTimer

LORA, ROPE, PAGE = 512, 64, 16
D = LORA + ROPE
SCALE = 192**-0.5
CASES = [
    (128, 1, 1024),
    (128, 32, 1024),
    (128, 64, 4096),
    (128, 128, 2048),
    (16, 1, 1024),
    (16, 32, 1024),
    (16, 64, 4096),
    (16, 128, 2048),
]
PLAN_SMS = (1, 2)  # each schedule split for its blocks per SM and twice as many ("@2x")
# make_mla_attention keywords of each schedule tried
VARIANTS = {
    128: {
        "mma": {},
        "wg32": dict(arch="sm_90"),
        "wg32_cpasync": dict(arch="sm_90", wg_tma=False),
        "wg16": dict(arch="sm_90", wg_heads=16),
    },
    16: {
        "mma": {},
        "wg16": dict(arch="sm_90"),
        "wg16_cpasync": dict(arch="sm_90", wg_tma=False),
        "wg16_1wg_k64s2": dict(arch="sm_90", wg_keys=64, wg_stages=2, wg_producer=False),
    },
}


def prepare(out: Path, arch: str) -> None:
    from tvmkv.build import compile_funcs, export_module
    from tvmkv.tir import mla, mla_layout
    from tvmkv.tir.spec import MlaSpec

    funcs, meta = {}, {"arch": arch, "variants": {}}
    for H in sorted({c[0] for c in CASES}):
        spec = MlaSpec(H, LORA, ROPE, PAGE, "float16", "cuda", 192, 128)
        for key, kw in VARIANTS[H].items():
            name = f"{key}_h{H}"
            funcs[name] = mla.make_mla_attention(spec, **kw)
            funcs[f"{key}_split_h{H}"] = mla.make_mla_attention(spec, split=True, **kw)
            tile = dict(keys=kw.get("wg_keys", mla_layout.WG_KEYS), stages=kw.get("wg_stages", mla_layout.WG_STAGES))
            hb = mla_layout.wgmma_heads(spec, kw.get("arch"), kw.get("wg_heads"), **tile)
            if hb:  # the occupancy rule of mla_layout.mla_blocks_per_sm, for this variant's tiles
                smem = mla_layout.wg_shared_bytes(spec, hb, **tile) + 4 * (2 * (tile["stages"] + 1) * 64 + 8 * hb)
                bps = mla_layout.SHARED_PER_SM["9.0"] * 1024 // (smem + mla_layout.SHARED_RESERVED)
                meta["variants"][name] = dict(blocks_per_seq=H // hb, tile_keys=tile["keys"], blocks_per_sm=bps)
            else:
                blocks_per_seq, tile_keys = mla_layout.mla_split_granule(spec)
                bps = mla_layout.mla_blocks_per_sm(spec, "9.0")
                meta["variants"][name] = dict(blocks_per_seq=blocks_per_seq, tile_keys=tile_keys, blocks_per_sm=bps)
    funcs["merge"] = mla.make_mla_merge_splits(MlaSpec(16, LORA, ROPE, PAGE, "float16", "cuda"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    fmt = export_module(compile_funcs(funcs, "cuda", arch), out / "kernels.so", "cuda", arch)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {out / 'kernels.so'} ({fmt}, {len(funcs)} functions) in {time.time() - t0:.0f}s")


def make_case(H, B, L, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    npg = -(-L // PAGE)
    num_pages = B * npg + 3
    pages = (torch.rand(num_pages, PAGE, D, generator=g, device="cuda") * 2 - 1).half()
    perm = torch.randperm(num_pages, generator=g, device="cuda")[: B * npg].int()
    c = dict(H=H, B=B, L=L, pages=pages, page_indices=perm)
    c["page_indptr"] = (torch.arange(B + 1, device="cuda") * npg).int()
    c["last_page_len"] = torch.full((B,), L - (npg - 1) * PAGE, dtype=torch.int32, device="cuda")
    c["kv_window"] = torch.zeros(B, 3, dtype=torch.int32, device="cuda")
    c["q_indptr"] = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    c["q_pos"] = torch.full((B,), L - 1, dtype=torch.int32, device="cuda")
    c["q"] = (torch.rand(B, H, D, generator=g, device="cuda") * 2 - 1).half()
    c["lat"] = pages[perm.long()].view(B, npg * PAGE, D)[:, :L].contiguous()
    return c


def reference(c):
    import torch

    s = torch.einsum("bhd,bld->bhl", c["q"].float(), c["lat"].float()) * SCALE
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhl,blc->bhc", torch.exp(s - lse[..., None]), c["lat"][:, :, :LORA].float()), lse


def torch_bmm(c):
    import torch

    q, lat = c["q"], c["lat"]

    def run():
        s = torch.bmm(q, lat.transpose(1, 2)).float().mul_(SCALE)
        p = torch.softmax(s, -1).half()
        return torch.bmm(p, lat[:, :, :LORA])

    return run


def _copier(src):
    import torch

    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def kernel_run(c, mod, name, v, mult, num_sms):
    import torch
    import tvm

    from tvmkv.runtime.decode_split import plan_split
    from tvmkv.runtime.tensors import to_device

    H, B, L = c["H"], c["B"], c["L"]
    dev = tvm.cuda(0)

    def tv(x):  # the same memory as a tvm tensor
        return to_device(x, "torch", dev)

    split = plan_split(
        B,
        L,
        blocks_per_seq=v["blocks_per_seq"],
        tile_keys=v["tile_keys"],
        num_sms=num_sms,
        blocks_per_sm=mult * v["blocks_per_sm"],
    )
    o = torch.empty(B, H, LORA, dtype=torch.float16, device="cuda")
    lse = torch.empty(B, H, device="cuda")
    args = [tv(c[k]) for k in ("q", "q_indptr", "q_pos", "pages", "page_indptr", "page_indices", "last_page_len")]
    args.append(tv(c["kv_window"]))
    ot, lt = tv(o), tv(lse)
    if split.num_splits > 1:
        S = split.num_splits
        op = torch.empty(S, B, H, LORA, device="cuda")
        lp = torch.empty(S, B, H, device="cuda")
        opt, lpt = tv(op), tv(lp)
        key, h = name.rsplit("_", 1)
        f_split, f_merge = mod[f"{key}_split_{h}"], mod["merge"]

        def run():
            f_split(*args, opt, lpt, np.float32(SCALE), np.int32(1), np.int32(split.kv_chunk))
            f_merge(opt, lpt, ot, lt)

    else:
        f = mod[name]

        def run():
            f(*args, ot, lt, np.float32(SCALE), np.int32(1))

    return run, o, lse, split


def main_gpu(args) -> int:
    from tvmkv.payload import bootstrap

    bootstrap()
    import torch
    import tvm

    torch.backends.cuda.matmul.allow_tf32 = False
    mod = tvm.runtime.load_module(str(args.build_dir / "kernels.so"))
    meta = json.loads((args.build_dir / "meta.json").read_text())
    card = torch.cuda.get_device_name(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{card}, {num_sms} SMs", flush=True)
    timer = CudaTimer(args.reps)
    rows, bad = [], 0
    for H, B, L in CASES:
        if (args.quick and B > 32) or (args.only and f"{H},{B},{L}" not in args.only):
            continue
        c = make_case(H, B, L, seed=H * 7919 + B * 31 + L)
        o_ref, lse_ref = reference(c)
        row = {"case": f"H{H} decode {B}x{L}", "MB": B * L * D * 2 / 1e6}
        names = [n for n in meta["variants"] if n.endswith(f"_h{H}")]
        plans = [(n, m, meta["variants"][n], "" if m == 1 else f"@{m}x") for n in names for m in PLAN_SMS]
        for name, mult, v, tag in plans:
            run, o, lse, split = kernel_run(c, mod, name, v, mult, num_sms)
            run()
            torch.cuda.synchronize()
            err = float((o.float() - o_ref).abs().max())
            lerr = float((lse - lse_ref * math.log2(math.e)).abs().max())
            key = name[: -len(f"_h{H}")] + tag
            row[key] = dict(us=None if args.check_only else timer.time(run), err=err, lse_err=lerr, S=split.num_splits)
            if not (err < 1e-2 and lerr < 1e-3):
                bad += 1
                print(f"  FAILED {row['case']} {key}: max err o {err:.2e} lse {lerr:.2e}", flush=True)
        tb = torch_bmm(c)
        err = float((tb().float() - o_ref).abs().max())
        row["torch"] = dict(us=None if args.check_only else timer.time(tb), err=err)
        if not args.check_only:  # a device-to-device copy of the latents (its rate counts read + write)
            us = timer.time(_copier(c["lat"]))
            row["copy"] = dict(us=us, err=0.0, rw_gbs=2 * row["MB"] * 1e6 / (us * 1e-6) / 1e9)
            lat = c["lat"]
            row["read"] = dict(us=timer.time(lambda: lat.sum(dtype=torch.float32)), err=0.0)  # noqa: B023
        print(json.dumps(row), flush=True)
        rows.append(row)
        c = None
        torch.cuda.empty_cache()
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("case", "MB")))
    lines = [f"{card}: µs (GB/s of the latents read once) [splits]", "| case | " + " | ".join(keys) + " |"]
    lines.append("| --- |" + " ---: |" * len(keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            if not v or v.get("us") is None:
                cells.append("-" if not v else f"err {v['err']:.1e}")
                continue
            gbs = r["MB"] * 1e6 / (v["us"] * 1e-6) / 1e9
            if k == "copy":
                cells.append(f"{v['us']:.1f} ({gbs:.0f}; read + write {v['rw_gbs']:.0f})")
            else:
                cells.append(f"{v['us']:.1f} ({gbs:.0f}) [{v.get('S', '')}]")
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mla_kernels.json").write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prepare", type=Path, metavar="DIR", help="build machine: compile the kernels into DIR")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build" / "mla-kernels")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="the cases of at most 32 sequences")
    ap.add_argument("--check-only", action="store_true", help="run each kernel once and check it, no timing")
    ap.add_argument("--only", nargs="*", default=None, help="cases H,B,L to run (e.g. 128,1,1024)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(args.prepare, args.arch)
        return 0
    return main_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
