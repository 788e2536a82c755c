"""MLA decode kernels alone (no cache): schedules of ``mla_attention`` side by side vs torch bmm.

DeepSeek-V2's latent shape (D 576 = 512 + 64, fp16, page 16), decode ``B x L`` (one query row per
sequence over ``L`` latent rows on random, non-contiguous pages), H 128 and 16. Each schedule runs as
the cache would launch it: split into ``plan_split(B, L, blocks_per_seq, 32, num_sms)`` chunks
(``mla_attention_split`` + ``mla_merge_splits``) or whole (``mla_attention``), ``blocks_per_seq`` =
its thread blocks per query row. Contenders:

- ``old``: the tensor-core schedule and merge of git ``--old-rev``;
- ``new``: this checkout's defaults; ``new_*``: other ``tc_*`` keywords (see VARIANTS);
- ``<name>@2x`` / ``new@4x``: split as if the device had 2x / 4x its SMs (2 / 4 blocks per SM); the
  cache splits for ``tvmkv.tir.mla_layout.mla_blocks_per_sm`` blocks per SM (H200, fp16: 2 at H 16, 1 at
  H 128);
- ``torch``: bmm (q @ latents^T, fp32 softmax, P @ latents[:, :, :512]) on contiguous latents.

Errors: max abs difference of o from a float32 torch reference (and of the base-2 lse). Times:
CUDA-event medians, device time (each call queued behind a GPU spin; bench/_common.CudaTimer).

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
import subprocess
import sys
import tempfile
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
PLAN_SMS = (1, 2)  # each schedule split for 1 and 2 blocks per SM ("@2x"); "new@4x": the defaults for 4
# make_mla_attention keywords of each schedule tried ({} = the defaults)
VARIANTS = {
    128: {"new": {}, "new_t32": dict(tc_heads=32)},
    16: {"new": {}, "new_s3": dict(tc_stages=3)},
}


def _old_module(rev: str):
    """``tvmkv/tir/mla.py`` of git ``rev`` as a module of its own (relative imports made absolute)."""
    import importlib.util

    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:tvmkv/tir/mla.py"], capture_output=True, text=True, check=True
    ).stdout
    src = src.replace("from .", "from tvmkv.tir.")
    path = Path(tempfile.mkdtemp()) / "mla_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("mla_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prepare(out: Path, arch: str, old_rev: str) -> None:
    from tvmkv.build import compile_funcs, export_module
    from tvmkv.tir import mla, mla_layout
    from tvmkv.tir.spec import MlaSpec

    old = _old_module(old_rev)
    funcs, meta = {}, {"old_rev": old_rev, "arch": arch, "variants": {}}
    for H in sorted({c[0] for c in CASES}):
        spec = MlaSpec(H, LORA, ROPE, PAGE, "float16", "cuda", 192, 128)
        funcs[f"old_h{H}"] = old.make_mla_attention(spec)
        funcs[f"old_split_h{H}"] = old.make_mla_attention(spec, split=True)
        # heads per block of the old schedule: 16 before the layout module existed
        meta["variants"][f"old_h{H}"] = (
            H // mla_layout.mla_split_granule(spec)[0] if hasattr(old, "use_tensor_cores") else 16
        )
        for key, kw in VARIANTS[H].items():
            name = f"{key}_h{H}"
            funcs[name] = mla.make_mla_attention(spec, **kw)
            funcs[name.replace("new", "new_split", 1)] = mla.make_mla_attention(spec, split=True, **kw)
            meta["variants"][name] = kw.get("tc_heads") or H // mla_layout.mla_split_granule(spec)[0]
    funcs["merge"] = mla.make_mla_merge_splits(MlaSpec(16, LORA, ROPE, PAGE, "float16", "cuda"))
    funcs["old_merge"] = old.make_mla_merge_splits(MlaSpec(16, LORA, ROPE, PAGE, "float16", "cuda"))
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


def kernel_run(c, mod, name, heads_per_block, num_sms):
    import torch
    import tvm

    from tvmkv.runtime.decode_split import plan_split
    from tvmkv.runtime.tensors import to_device

    H, B, L = c["H"], c["B"], c["L"]
    dev = tvm.cuda(0)

    def tv(x):  # the same memory as a tvm tensor
        return to_device(x, "torch", dev)

    split = plan_split(B, L, blocks_per_seq=H // heads_per_block, tile_keys=32, num_sms=num_sms)
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
        f_split, f_merge = (
            mod[name.replace("old", "old_split", 1).replace("new", "new_split", 1)],
            mod["old_merge" if name.startswith("old") else "merge"],
        )

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
    print(f"{card}, {num_sms} SMs, old = git {meta['old_rev']}", flush=True)
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
        plans.append((f"new_h{H}", 4, meta["variants"][f"new_h{H}"], "@4x"))
        for name, mult, hpb, tag in plans:
            run, o, lse, split = kernel_run(c, mod, name, hpb, mult * num_sms)
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
            cells.append(f"{v['us']:.1f} ({r['MB'] * 1e6 / (v['us'] * 1e-6) / 1e9:.0f}) [{v.get('S', '')}]")
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
    ap.add_argument("--old-rev", default="4f17979", help="--prepare: git revision of the old schedule")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build" / "mla-kernels")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="the cases of at most 32 sequences")
    ap.add_argument("--check-only", action="store_true", help="run each kernel once and check it, no timing")
    ap.add_argument("--only", nargs="*", default=None, help="cases H,B,L to run (e.g. 128,1,1024)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(args.prepare, args.arch, args.old_rev)
        return 0
    return main_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
