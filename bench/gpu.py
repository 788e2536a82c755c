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
- TVM kernel: TVM's own TIR kernels from ``tvm.relax.frontend.nn.llm.kv_cache`` called directly on
  the case's layout (``batch_decode_paged_kv``; ``batch_prefill_ragged_kv`` on empty history,
  ``batch_prefill_paged_kv`` causal with history), arguments built from the signatures ``--prepare``
  saved; outputs checked against torch.
- TVM: ``vm.builtin.paged_attention_kv_cache_create`` with those kernels (compiled on the build machine
  by ``--prepare``, with the dlight GPU schedule TVM's relax pipeline gives the unscheduled ones), the
  case's history written through the cache, timed through ``attention_kv_cache_attention_with_fused_qkv``
  (which also splits q/k/v and appends K/V); output checked against torch.
- Both TVM paths run in worker processes (``--tvm-worker``): a crash or hang there is reported for that
  case (``--tvm-budget`` seconds in all) and the benchmark goes on.
- torch: ``scaled_dot_product_attention`` on contiguous ``[B, H, L, D]`` K/V of the same data
  (``enable_gqa``; a bottom-right causal boolean mask when there is history).

Build machine (full TVM + nvcc)::

    python -m tvmkv build --target cuda --arch sm_90 --num-qo-heads 32 --num-kv-heads 8 \\
        --head-dim 128 --page-size 16 --dtype float16
    .venv/bin/python bench/gpu.py --prepare build/tvm-cuda-sm_90
    .venv/bin/python bench/gpu.py --selfcheck-tvm-cpu   # TVM argument builders vs NumPy, on CPU

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
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    t0 = time.time()
    # Several of these PrimFuncs (transpose_append, split_rotary, debug_get_kv) carry no thread
    # binding; TVM's relax pipeline gives them a dlight GPU schedule. Without it tvm.compile makes them
    # host loops over device pointers, and the cache's first attention call segfaults in split_rotary.
    mod = gpu_schedule(tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs}), target)
    lib = tvm.compile(mod, target=target)
    fmt = export_module(lib, out / "tvm_kv_cache.so", "cuda", "sm_90")
    missing = missing_device_kernels(out / "tvm_kv_cache.so", [n for n, _ in funcs])
    if missing:
        raise RuntimeError(f"no CUDA kernel in {out / 'tvm_kv_cache.so'} for {missing} (host-only functions)")
    (out / "names.json").write_text(json.dumps([n for n, _ in funcs]))
    sigs = {n: kernel_signature(f) for n, f in funcs if n in TVM_KERNELS.values()}
    (out / "signatures.json").write_text(json.dumps(sigs, indent=1))
    (out / "prepare.json").write_text(json.dumps({"gpu_scheduled": True, "tvm": tvm.__version__}))
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 2**20:.2f} MiB, {fmt}, every function has a CUDA kernel) in {time.time() - t0:.0f}s")


# GPU clock cycles of the spin (torch.cuda._sleep) queued ahead of each timed call in device timing:
# ~0.2 ms, longer than any contender's host-side launch work, so the call's kernels are all queued
# when the start event fires and the events measure only the device
SLEEP_CYCLES = 400_000


class Bench:
    def __init__(self, reps: int):
        import torch

        self.torch, self.reps = torch, reps

    def time(self, fn, *, queued: bool = True) -> float:
        """Median µs of ``fn()`` over ``reps`` calls, each timed with CUDA events.

        ``queued`` (device time, the tables' main numbers): each call is queued behind a GPU spin, so
        the host-side cost of launching its kernels (Python, TVM's packed calls, torch's dispatch)
        overlaps the spin and only the device's work is timed, as under a CUDA graph or in a model
        whose layers keep the GPU busy. ``queued=False`` (call time): the GPU idles while the host
        launches, so that cost is included.
        """
        torch = self.torch
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends):
            if queued:
                torch.cuda._sleep(SLEEP_CYCLES)
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
        us = self.time(lambda: b.copy_(a), queued=False)
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


def decode_split_of(c, forced=None):
    """The split ``begin_forward`` would choose for this decode case (``forced``: decode_splits)."""
    import tvm

    from tvmkv.runtime.decode_split import plan_split
    from tvmkv.tir.decode_plan import split_granule
    from tvmkv.tir.spec import KernelSpec

    blocks, tile = split_granule(KernelSpec(H_QO, H_KV, D, P, DTYPE, "cuda"))
    sms = tvm.cuda(0).multi_processor_count
    return plan_split(c["B"], c["L"], blocks_per_seq=blocks, tile_keys=tile, num_sms=sms, max_splits=forced)


def tvmkv_run(c, lib, split=None):
    """tvmkv's kernels on case ``c``; decode runs with ``split`` (default: the cache's own choice),
    i.e. ``paged_decode`` or ``paged_decode_split`` + ``merge_splits``."""
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
        split = decode_split_of(c) if split is None else split
        c["split"] = tuple(split)
        if split.num_splits > 1:
            o_part = tvm.runtime.empty((split.num_splits, B, H_QO, D), "float32", dev)
            lse_part = tvm.runtime.empty((split.num_splits, B, H_QO), "float32", dev)
            f_split, f_merge = lib["paged_decode_split"], lib["merge_splits"]
            args = (q, q_pos, pages, pi, px, lpl, kvw, o_part, lse_part, s, 1.0, 1e4, split.kv_chunk)

            def run():
                f_split(*args)
                f_merge(o_part, lse_part, o, lse)

            return run, (lambda: o.numpy().astype("float32"))
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


# ------------------------------------------------------------------------------------------------
# TVM's own paged KV cache and its kernels (issue 4). On the GPU machine both run in worker processes
# (``--tvm-worker``): a crash there (segfault, CUDA fault) is reported for that case, not fatal here.
# ------------------------------------------------------------------------------------------------

# The TVM kernel called directly for each case ("ragged" for prefill on empty history: same role as
# tvmkv's ragged_prefill_causal; "prefill" = paged, causal, pages holding history + new tokens).
TVM_KERNELS = {
    "decode": "tir_attention_decode",
    "prefill": "tir_attention_prefill",
    "ragged": "tir_attention_prefill_ragged",
}
_ROLE_ALIASES = {"page_table_indptr": "page_indptr", "page_table_values": "page_values"}


def gpu_schedule(mod, target):
    """What TVM's CUDA relax pipeline does to its PrimFuncs (``legalize_passes``): dlight default GPU
    schedules for every function not already marked ``tirx.is_scheduled``."""
    from tvm.s_tir import dlight as dl

    with target:
        return dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()
        )(mod)


def missing_device_kernels(lib_path: Path, names) -> list:
    """Names without a ``<name>_kernel*`` entry in the CUDA function table of an exported library."""
    import struct

    from tvmkv.build import _elf_symbol_bytes, parse_imports_blob, split_cuda_module_bytes

    blob = _elf_symbol_bytes(Path(lib_path), "__tvm_ffi__library_bin")
    _tree, modules = parse_imports_blob(blob[: struct.unpack_from("<Q", blob, 0)[0] + 8])
    table = b"".join(split_cuda_module_bytes(data)[1] for kind, data in modules if kind == "cuda")
    return [n for n in names if f"{n}_kernel".encode() not in table]


def kernel_signature(func) -> list:
    """``[{name, dtype[, shape]}]`` of a PrimFunc's parameters (shape entries: int, or the name /
    expression of a symbolic size); written by ``--prepare`` since the GPU machine cannot parse TIR."""
    import tvm
    from tvm.tirx.buffer import is_buffer_var

    sig = []
    for p in func.params:
        if is_buffer_var(p):
            shape = [int(s) if isinstance(s, tvm.tirx.IntImm) else str(s) for s in p.shape]
            sig.append({"name": p.name, "dtype": str(p.dtype), "shape": shape})
        else:
            sig.append({"name": p.name, "dtype": str(p.ty.dtype)})
    return sig


def tvm_kernel_for(c) -> str:
    if c["kind"] == "decode":
        return "decode"
    return "ragged" if c["hist"] == 0 else "prefill"


def tvm_kernel_inputs(c, which: str) -> dict:
    """Every argument of TVM's decode / paged prefill / ragged prefill kernel, by role, for a case of
    :func:`make_case` (NumPy arrays; ``("empty", shape, dtype)`` for outputs). Semantics (TVM 0.27
    ``_decode_kernels`` / ``_prefill_kernels``): pages [num_pages, 2, H_kv, P, D]; page_indptr /
    page_values = CSR page table; length_info = last_page_len [B] (no sliding window); kv length =
    (num_pages_of_seq - 1) * P + last_page_len; causal mask: key j visible to row i if
    j < kv_len - qo_len + i + 1; k_rope_pos_offset / q_rope_position only matter for rotary_mode 1;
    sm_scale is the plain 1/sqrt(D) (the kernels fold log2(e) in); lse is base 2."""
    B, rows = c["B"], c["q"].shape[0]
    v = {
        "q": c["q"],
        "q_rope_position": c["q_pos"],
        "k_rope_pos_offset": np.zeros(B, "int32"),
        "output": ("empty", (rows, H_QO, D), DTYPE),
        "lse": ("empty", (rows, H_QO), "float32"),
        "rotary_mode": 0,
        "rope_scale": 1.0,
        "rope_theta": 1e4,
        "sm_scale": D**-0.5,
    }
    if which == "ragged":
        if c["kind"] != "prefill" or c["hist"]:
            raise ValueError("the ragged kernel sees only the new tokens: prefill cases without history")
        n = c["n"]
        v.update(
            k=np.ascontiguousarray(c["k"].transpose(0, 2, 1, 3).reshape(B * n, H_KV, D)),
            v=np.ascontiguousarray(c["v"].transpose(0, 2, 1, 3).reshape(B * n, H_KV, D)),
            q_indptr=c["q_indptr"],
            kv_indptr=c["q_indptr"],
            causal=1,
        )
        return v
    v.update(
        pages=c["pages"],
        page_indptr=c["page_indptr"],
        page_values=c["page_indices"],
        length_info=c["last_page_len"],
    )
    if which == "prefill":
        v.update(q_indptr=c["q_indptr"], causal=1)
    lens = (np.diff(c["page_indptr"]) - 1) * P + c["last_page_len"]
    if not (lens == c["L"]).all() or c["page_indices"].max() >= c["pages"].shape[0]:
        raise ValueError("inconsistent page table")
    return v


def bind_signature(sig: list, values: dict, what: str = "kernel") -> list:
    """``values`` (by role) in the order of ``sig``, each checked against the parameter's dtype and
    shape (constant sizes equal, one value per symbolic size, expressions such as ``B + 1`` hold)."""
    env, pending, ordered = {}, [], []
    for p in sig:
        role = p["name"].lower().removeprefix("var_").removesuffix("_handle")
        role = _ROLE_ALIASES.get(role, role)
        if role not in values:
            raise KeyError(f"{what}: no value for parameter {p['name']!r}")
        val = values[role]
        if "shape" not in p:
            if isinstance(val, (tuple, np.ndarray)):
                raise TypeError(f"{what}: parameter {p['name']!r} is a scalar")
            ordered.append(int(val) if p["dtype"].startswith("int") else float(val))
            continue
        shape, dtype = (tuple(val[1]), val[2]) if isinstance(val, tuple) else (val.shape, str(val.dtype))
        if dtype != p["dtype"] or len(shape) != len(p["shape"]):
            raise TypeError(f"{what}: {p['name']!r} wants {p['dtype']}{p['shape']}, got {dtype}{list(shape)}")
        for want, got in zip(p["shape"], shape):
            if isinstance(want, int):
                if want != got:
                    raise ValueError(f"{what}: {p['name']!r} wants {p['shape']}, got {list(shape)}")
            elif want.isidentifier():
                if env.setdefault(want, got) != got:
                    raise ValueError(f"{what}: {p['name']!r}: size {want} is {env[want]} elsewhere, {got} here")
            else:
                pending.append((p["name"], want, got))
        ordered.append(val)
    for name, expr, got in pending:
        if eval(expr, {"__builtins__": {}}, dict(env)) != got:  # noqa: S307 - our own signature strings
            raise ValueError(f"{what}: {name!r}: {expr} = {eval(expr, {'__builtins__': {}}, dict(env))}, got {got}")
    return ordered


def materialize(ordered: list, dev):
    """Device tensors for :func:`bind_signature`'s list; returns ``(args, output tensor)``."""
    import tvm

    args, out = [], None
    for val in ordered:
        if isinstance(val, tuple):
            val = tvm.runtime.empty(val[1], val[2], dev)
            out = val if out is None else out  # the first output is "output", then "lse"
        elif isinstance(val, np.ndarray):
            val = tvm.runtime.tensor(np.ascontiguousarray(val), dev)
        args.append(val)
    return args, out


def tvm_kernel_run(c, mod, sigs: dict, dev, suffix: str = ""):
    """TVM's own attention kernel for the case, called directly: ``(run, get_output)``."""
    which = tvm_kernel_for(c)
    name = TVM_KERNELS[which] + suffix
    args, out = materialize(bind_signature(sigs[name], tvm_kernel_inputs(c, which), name), dev)
    f = mod[name]
    return (lambda: f(*args)), (lambda: out.numpy().astype("float32"))


def _fused_qkv(q, k, v):
    """[tokens, H_qo + 2 H_kv, D] from q [tokens, H_qo, D] and k, v [H_kv, tokens, D]."""
    return np.ascontiguousarray(np.concatenate([q, k.transpose(1, 0, 2), v.transpose(1, 0, 2)], axis=1))


def tvm_cache_setup(c, mod, names, dev):
    """TVM's own cache (``vm.builtin.paged_attention_kv_cache_create``, RoPE none) holding the case's
    history, written through its own attention calls (one prefill per sequence); then a forward of the
    case's new tokens (decode: the last token). ``(run, get_output, cache)``; run = one
    ``attention_with_fused_qkv`` (split + append + attention; re-running it rewrites the same slots)."""
    import tvm
    import tvm_ffi
    from host import tvm_create_args

    B, n, L = c["B"], c["n"], c["L"]
    hist = L - n
    args = tvm_create_args(
        mod,
        names,
        dev,
        max_batch=max(B, 1),
        max_total=B * (L + 2 * P),
        chunk=max(B * n, hist, 16),
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
    attn, scale = g["attention_kv_cache_attention_with_fused_qkv"], D**-0.5
    for s in range(B):
        g["kv_state_add_sequence"](cache, s)
        if hist:
            qkv = _fused_qkv(np.zeros((hist, H_QO, D), DTYPE), c["k"][s, :, :hist], c["v"][s, :, :hist])
            g["kv_state_begin_forward"](cache, tvm_ffi.Shape([s]), tvm_ffi.Shape([hist]))
            attn(cache, 0, scale, tvm.runtime.tensor(qkv, dev), tvm.runtime.empty((hist, H_QO, D), DTYPE, dev))
            g["kv_state_end_forward"](cache)
    q = c["q"].reshape(B, n, H_QO, D)
    qkv = np.concatenate([_fused_qkv(q[s], c["k"][s, :, hist:], c["v"][s, :, hist:]) for s in range(B)])
    qkv = tvm.runtime.tensor(qkv, dev)
    out = tvm.runtime.empty((B * n, H_QO, D), DTYPE, dev)
    g["kv_state_begin_forward"](cache, tvm_ffi.Shape(list(range(B))), tvm_ffi.Shape([n] * B))
    return (lambda: attn(cache, 0, scale, qkv, out)), (lambda: out.numpy().astype("float32")), cache


def numpy_attention(c) -> np.ndarray:
    """fp64 reference [rows, H_qo, D]: query i of a sequence sees keys 0..L - n + i."""
    B, n, L = c["B"], c["n"], c["L"]
    g = H_QO // H_KV
    q = c["q"].astype("float64").reshape(B, n, H_QO, D)
    out = np.empty((B, n, H_QO, D))
    visible = np.arange(L)[None, :] <= (L - n + np.arange(n))[:, None]
    for b in range(B):
        k = np.repeat(c["k"][b].astype("float64"), g, axis=0)
        v = np.repeat(c["v"][b].astype("float64"), g, axis=0)
        s = np.einsum("nhd,hld->hnl", q[b], k) * D**-0.5
        s = np.where(visible[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = np.einsum("hnl,hld->nhd", p / p.sum(-1, keepdims=True), v)
    return out.reshape(B * n, H_QO, D)


def _case_seed(spec) -> int:
    kind, B, n, hist = spec
    return (1 if kind == "decode" else 2) * 10**7 + B * 10**5 + n * 7 + hist


def tvm_worker(mode: str, specs: list, tvm_dir: Path, reps: int) -> int:
    """Worker process: TVM's kernels (``mode`` "kernel") or cache ("cache") on each case; prints
    ``TVMKV_START <spec>`` before and ``TVMKV_RESULT <json>`` after each case."""
    payload = os.environ.get("TVMKV_PAYLOAD")
    if payload:
        sys.path.insert(0, payload)
        import tvm_cuda_runtime  # noqa: F401
    import torch
    import tvm

    prep = tvm_dir / "prepare.json"
    if not prep.exists() or not json.loads(prep.read_text()).get("gpu_scheduled"):
        raise RuntimeError(f"{tvm_dir} was prepared before the dlight fix (host-only kernels): rerun --prepare")
    dev = tvm.cuda(0)
    mod = tvm.runtime.load_module(str(tvm_dir / "tvm_kv_cache.so"))
    names = json.loads((tvm_dir / "names.json").read_text())
    sigs = json.loads((tvm_dir / "signatures.json").read_text())
    bench = Bench(reps)
    for spec in specs:
        print("TVMKV_START", json.dumps(spec), flush=True)
        res = {}
        try:
            c = make_case(*spec, np.random.default_rng(_case_seed(spec)))
            if mode == "kernel":
                res["kernel"] = TVM_KERNELS[tvm_kernel_for(c)]
                run, get = tvm_kernel_run(c, mod, sigs, dev)
            else:
                run, get, _cache = tvm_cache_setup(c, mod, names, dev)
            run()
            torch.cuda.synchronize()
            tr = torch_run(c)
            tr[0]()
            res["max_err"] = float(np.abs(get() - tr[1]()).max())
            res["us"] = bench.time(run)
            res["call_us"] = bench.time(run, queued=False)
        except Exception as err:  # noqa: BLE001 - reported to the parent, next case goes on
            traceback.print_exc()
            res["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        print("TVMKV_RESULT", json.dumps({"spec": spec, **res}), flush=True)
        if "cuda" in res.get("error", "").lower():
            return 3  # a CUDA fault poisons this context: the parent starts a new worker for the rest
        c = run = get = tr = _cache = None
        torch.cuda.empty_cache()
    return 0


def run_tvm_isolated(mode: str, specs: list, tvm_dir: Path, reps: int, *, case_timeout=120.0, deadline=None) -> dict:
    """:func:`tvm_worker` in a child process, its output streamed; a case that kills the worker (signal,
    CUDA fault) or runs past ``case_timeout`` s is recorded as an error and a new worker goes on with
    the cases after it. Past ``deadline`` (``time.monotonic()``) the rest is skipped.
    Returns ``{tuple(spec): {"us", "max_err", ...} or {"error"}}``."""
    import queue
    import signal
    import subprocess
    import tempfile
    import threading

    results, remaining = {}, [list(s) for s in specs]
    while remaining:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--tvm-worker", mode, "--worker-cases"]
        cmd += [json.dumps(remaining), "--tvm-lib", str(tvm_dir), "--reps", str(reps)]
        current, how, lines = None, None, queue.Queue()
        with tempfile.TemporaryFile("w+") as err_file:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True, bufsize=1)
            reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)])
            reader.start()
            until = time.monotonic() + case_timeout
            while True:
                limit = min(until, deadline) if deadline else until
                try:
                    line = lines.get(timeout=max(limit - time.monotonic(), 0.01))
                except queue.Empty:
                    how = "timed out" if time.monotonic() < (deadline or float("inf")) else "stopped (TVM time budget)"
                    proc.kill()  # the worker started here, by its own handle
                    reader.join()
                    break
                if line is None:
                    break
                line = line.rstrip("\n")
                if line.startswith("TVMKV_START "):
                    current, until = tuple(json.loads(line.split(" ", 1)[1])), time.monotonic() + case_timeout
                elif line.startswith("TVMKV_RESULT "):
                    r = json.loads(line.split(" ", 1)[1])
                    results[tuple(r.pop("spec"))] = r
                    print(f"  [TVM {mode}] {r}", flush=True)
                    current = None
                else:
                    print(f"  [TVM {mode} worker] {line}", flush=True)
            rc = proc.wait()
            err_file.seek(0)
            stderr = err_file.read()
        if stderr.strip():
            print(f"  [TVM {mode} worker stderr, last lines]\n" + "\n".join(stderr.splitlines()[-25:]), flush=True)
        if how is None and rc != 0:
            how = f"exit status {rc}" + (f" ({signal.Signals(-rc).name})" if rc < 0 else "")
        tail = (stderr.strip().splitlines() or [""])[-1][:200]
        if current is not None:
            results[current] = {"error": f"worker {how} during this case; last stderr line: {tail}"}
        left = [s for s in remaining if tuple(s) not in results]
        if len(left) == len(remaining) or (deadline and time.monotonic() >= deadline):
            for s in left:  # no progress (the worker failed before any case), or out of time
                results[tuple(s)] = {"error": f"worker {how or 'ended'} before this case; last stderr line: {tail}"}
            break
        remaining = left
    return results


def selfcheck_tvm_cpu() -> int:
    """CPU check of the TVM argument builders: TVM's CPU kernel variants and its cache with real llvm
    kernels against NumPy, the CUDA signatures bound (not run) on the same cases, and the GPU
    schedule (every CUDA function of the cache gets a device kernel)."""
    import tvm
    from host import tvm_cache_funcs
    from tvm.relax.frontend.nn.llm import kv_cache as kvc

    failures = []
    specs = [
        ("decode", 3, 1, 37),
        ("decode", 2, 1, 16),
        ("prefill", 2, 5, 19),
        ("prefill", 2, 7, 0),
        ("prefill", 1, 33, 0),
    ]
    cases = [make_case(*s, np.random.default_rng(_case_seed(s))) for s in specs]
    rs, dev = {}, tvm.cpu(0)
    cpu = {
        "tir_attention_decode_cpu": kvc._attention_decode_cpu(H_KV, H_QO, D, DTYPE, False, rs),
        "tir_attention_prefill_cpu": kvc._attention_prefill_cpu(H_KV, H_QO, D, DTYPE, False, rs),
        "tir_attention_prefill_ragged_cpu": kvc._attention_prefill_ragged_cpu(H_KV, H_QO, D, D, DTYPE, rs),
    }
    sigs = {n: kernel_signature(f) for n, f in cpu.items()}
    cuda = dict(tvm_cache_funcs("cuda", num_layers=1, h_qo=H_QO, h_kv=H_KV, d=D, page_size=P, dtype=DTYPE))
    sigs.update({n: kernel_signature(cuda[n]) for n in TVM_KERNELS.values()})
    t0 = time.time()
    lib = tvm.compile(tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in cpu.items()}), target="llvm")
    print(f"compiled TVM's CPU attention kernels in {time.time() - t0:.0f}s")

    def report(what, err, tol=2e-3):
        ok = err is not None and err < tol
        print(f"  {'ok  ' if ok else 'FAIL'} {what}: max err vs NumPy {err:.2e}")
        if not ok:
            failures.append(what)

    # Paged prefill (tir_attention_prefill) also on empty history: TVM's cache uses it that way too.
    extra = [(c, "prefill") for c in cases if c["kind"] == "prefill" and c["hist"] == 0]
    for c, which in [(c, tvm_kernel_for(c)) for c in cases] + extra:
        ref = numpy_attention(c)
        name = TVM_KERNELS[which]
        try:
            bind_signature(sigs[name], tvm_kernel_inputs(c, which), name)  # CUDA kernel: bind only
            inputs = tvm_kernel_inputs(c, which)
            args, out = materialize(bind_signature(sigs[name + "_cpu"], inputs, name + "_cpu"), dev)
            lib[name + "_cpu"](*args)
            report(f"{name}_cpu on {label(c)} (CUDA signature binds)", float(np.abs(out.numpy() - ref).max()))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failures.append(f"{name} on {label(c)}")
    # A wrong argument must show: swap K and V pages / drop the causal flag.
    c = cases[2]
    bad = dict(tvm_kernel_inputs(c, "prefill"), causal=0)
    args, out = materialize(bind_signature(sigs["tir_attention_prefill_cpu"], bad), dev)
    lib["tir_attention_prefill_cpu"](*args)
    err = float(np.abs(out.numpy() - numpy_attention(c)).max())
    print(f"  {'ok  ' if err > 1e-2 else 'FAIL'} causal=0 is caught: max err {err:.2e}")
    if err <= 1e-2:
        failures.append("negative control")

    # TVM's cache with real llvm kernels (the create arguments of bench/host.py, this history fill).
    funcs = tvm_cache_funcs("llvm", num_layers=1, h_qo=H_QO, h_kv=H_KV, d=D, page_size=P, dtype=DTYPE)
    t0 = time.time()
    clib = tvm.compile(tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs}), target="llvm")
    print(f"compiled TVM's CPU cache kernels in {time.time() - t0:.0f}s")
    for c in cases:
        try:
            run, get, _cache = tvm_cache_setup(c, clib, [n for n, _ in funcs], dev)
            run()
            run()
            report(f"TVM cache (llvm) on {label(c)}", float(np.abs(get() - numpy_attention(c)).max()))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failures.append(f"cache {label(c)}")

    # The GPU schedule: every function of the CUDA cache gets a device kernel (source only, no nvcc).
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    for scheduled in (False, True):
        mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in cuda.items()})
        src = tvm.compile(gpu_schedule(mod, target) if scheduled else mod, target=target).mod.imports[0]
        src = src.inspect_source()
        host_only = [n for n in cuda if f" {n}_kernel(" not in src]
        print(f"  CUDA build {'with' if scheduled else 'without'} the dlight schedule: host-only {host_only}")
        if scheduled and host_only:
            failures.append("gpu schedule")
    print("selfcheck:", "FAILED " + ", ".join(failures) if failures else "all ok")
    return 1 if failures else 0


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
    ap.add_argument("--skip-tvm", action="store_true", help="leave out TVM (its kernels and its cache)")
    ap.add_argument("--skip-tvm-cache", action="store_true", help="leave out TVM's cache (keep its kernels)")
    ap.add_argument("--tvm-budget", type=float, default=300, help="seconds for all TVM workers together")
    ap.add_argument("--selfcheck-tvm-cpu", action="store_true", help="build machine: check the TVM paths on CPU")
    ap.add_argument(
        "--split-sweep",
        action="store_true",
        help="time tvmkv's decode at every split count on more shapes (tunes tvmkv/runtime/decode_split.py)",
    )
    ap.add_argument("--tvm-worker", choices=("kernel", "cache"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-cases", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    if args.selfcheck_tvm_cpu:
        return selfcheck_tvm_cpu()
    if args.tvm_worker:
        return tvm_worker(args.tvm_worker, json.loads(args.worker_cases), args.tvm_lib, args.reps)
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
    if args.split_sweep:
        return split_sweep(lib, bench, meta, args.out)
    cases = [("decode", b, 1, ctx) for b, ctx in DECODE] + [("prefill", b, n, h) for b, n, h in PREFILL]
    if args.quick:
        cases = [cases[0], cases[len(DECODE)]]
    tvm_results = {}  # TVM's kernels and cache, each in worker processes (see run_tvm_isolated)
    tvm_deadline = time.monotonic() + args.tvm_budget
    for mode in () if args.skip_tvm else ("kernel",) if args.skip_tvm_cache else ("kernel", "cache"):
        print(f"TVM {mode}: worker process", flush=True)
        tvm_results[mode] = guard(
            f"TVM {mode}",
            lambda: run_tvm_isolated(mode, cases, args.tvm_lib, args.reps, deadline=tvm_deadline),
            {},
        )
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
            row["torch_call_us"] = guard(f"{row['case']} torch time", lambda: bench.time(tr[0], queued=False))
        if lib is not None:
            print(f"[{row['case']}] tvmkv", flush=True)
            kr = guard(f"{row['case']} tvmkv", lambda: tvmkv_run(c, lib))
            if kr:
                kr[0]()
                if ref is not None:
                    row["tvmkv_max_err"] = float(np.abs(kr[1]() - ref).max())
                row["tvmkv_us"] = guard(f"{row['case']} tvmkv time", lambda: bench.time(kr[0]))
                row["tvmkv_call_us"] = guard(f"{row['case']} tvmkv time", lambda: bench.time(kr[0], queued=False))
                if "split" in c:
                    row["tvmkv_split"] = list(c["split"])
        for mode, key in (("kernel", "tvm_kernel"), ("cache", "tvm")):
            res = tvm_results.get(mode, {}).get((kind, B, n, hist))
            if res is None:
                continue
            row.update({f"{key}_{k}": v for k, v in res.items() if k in ("us", "call_us", "max_err", "kernel")})
            if "error" in res:
                errors.append(f"{row['case']} TVM {mode}: {res['error']}")
            elif res.get("max_err", 0) > 1e-2:
                errors.append(f"{row['case']} TVM {mode}: output differs from torch (max err {res['max_err']:.2e})")
        if (kind, B, n, c["L"] if kind == "decode" else hist) == FULL_CACHE_CASE and lib is not None:
            fc = guard(f"{row['case']} tvmkv full cache", lambda: tvmkv_full_cache_run(c))
            if fc:
                row["tvmkv_full_cache_us"] = guard("full cache time", lambda: bench.time(fc[0]))
                row["tvmkv_full_cache_call_us"] = guard("full cache time", lambda: bench.time(fc[0], queued=False))
                del fc
        for key in ("tvmkv", "tvm_kernel", "tvm", "torch"):
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


SWEEP_SHAPES = [(1, 1024), (1, 4096), (1, 16384), (4, 2048), (8, 1024), (16, 1024), (16, 4096), (32, 1024)]
SWEEP_SHAPES += [(32, 4096), (64, 1024), (64, 4096)]
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def split_sweep(lib, bench, meta, out: Path) -> int:
    """Decode µs of every split count (decode_splits forced) per shape, beside the automatic choice;
    outputs checked against NumPy at the automatic split."""
    from tvmkv.runtime.decode_split import NO_SPLIT

    rng = np.random.default_rng(0)
    rows = []
    for B, L in SWEEP_SHAPES:
        c = make_case("decode", B, 1, L, rng)
        auto = decode_split_of(c)
        row = {"case": f"decode {B}x{L}", "auto": list(auto), "us": {}, "call_us": {}}
        seen = set()
        for forced in SWEEP_SPLITS:
            split = decode_split_of(c, forced) if forced > 1 else NO_SPLIT
            if split.num_splits in seen:
                continue
            seen.add(split.num_splits)
            run, get = tvmkv_run(c, lib, split)
            run()
            if split == auto:
                row["max_err"] = float(np.abs(get() - numpy_attention(c)).max())
            row["us"][split.num_splits] = bench.time(run)
            row["call_us"][split.num_splits] = bench.time(run, queued=False)
        best = min(row["us"], key=row["us"].get)
        row["best"] = best
        row["auto_us"] = row["us"].get(auto.num_splits)
        print(json.dumps(row), flush=True)
        rows.append(row)
    lines = [
        f"Split sweep on **{meta['card']}** ({meta['date']}): decode device µs (queued, see Bench.time) by splits "
        f"(fp16, H_qo {H_QO}, H_kv {H_KV}, D {D}, page {P}); auto = tvmkv/runtime/decode_split.py's choice.",
        "",
        "| case | auto splits | auto µs | best splits | best µs | " + " | ".join(f"S={k}" for k in SWEEP_SPLITS) + " |",
        "| --- " * (5 + len(SWEEP_SPLITS)) + "|",
    ]
    for r in rows:
        cells = [f"{r['us'][k]:.1f}" if k in r["us"] else "" for k in SWEEP_SPLITS]
        lines.append(
            f"| {r['case']} | {r['auto'][0]} | {r['auto_us']:.1f} | {r['best']} | {r['us'][r['best']]:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    table = "\n".join(lines)
    print(table)
    (out / "split_sweep.md").write_text(table)
    (out / "split_sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    bad = [r for r in rows if r.get("max_err", 1) > 1e-2]
    return 1 if bad else 0


def render(rows, meta, errors) -> str:
    def f(x, spec):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    lines = [
        "## GPU",
        "",
        f"Measured {meta['date']} on **{meta['card']}** (torch {meta['torch']}, TVM {meta['tvm']}). "
        f"fp16, H_qo {H_QO}, H_kv {H_KV}, D {D}, page {P}. Median µs of {meta['reps']} calls (CUDA events), "
        "device time: each call is queued behind a GPU spin so that host-side launch work (Python, packed "
        "calls, torch dispatch) is hidden for every contender alike (per-call times with it included: second "
        "table). "
        f"KV bandwidth as % of the device-to-device copy rate measured in the same run "
        f"({f(meta.get('copy_GBps'), '.0f')} GB/s read+write). tvmkv = kernels called directly; TVM kernel = "
        "TVM's own TIR kernel of the same role called directly on the same layout (decode: batch_decode_paged_kv; "
        "prefill without history: batch_prefill_ragged_kv; with history: batch_prefill_paged_kv); TVM = its "
        "cache's attention call (also splits q/k/v and appends K/V; with history: paged + ragged + merge); "
        "torch = SDPA on contiguous K/V. Splits = chunks per sequence of tvmkv's decode (flash-decoding, "
        "chosen as begin_forward does; 1 = paged_decode, else paged_decode_split + merge_splits). "
        "Ratio = baseline µs / tvmkv µs (> 1: tvmkv faster). `bench/gpu.py` regenerates this.",
        "",
        "| case | tvmkv µs | splits | TVM kernel µs | TVM µs | torch µs | vs TVM kernel | vs TVM | vs torch "
        "| tvmkv KV bw % | tvmkv TFLOP/s | torch TFLOP/s | max err vs torch (tvmkv / TVM kernel / TVM) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        ours = r.get("tvmkv_us")

        def ratio(key, r=r, ours=ours):
            return f(r[key] / ours, ".2f") + "x" if r.get(key) and ours else "n/a"

        splits = r["tvmkv_split"][0] if r.get("tvmkv_split") else "-"
        lines.append(
            f"| {r['case']} | {f(ours, ',.1f')} | {splits} | {f(r.get('tvm_kernel_us'), ',.1f')} "
            f"| {f(r.get('tvm_us'), ',.1f')} "
            f"| {f(r.get('torch_us'), ',.1f')} | {ratio('tvm_kernel_us')} | {ratio('tvm_us')} | {ratio('torch_us')} "
            f"| {f(r.get('tvmkv_bw_pct'), '.0f')} | {f(r.get('tvmkv_tflops'), '.1f')} "
            f"| {f(r.get('torch_tflops'), '.1f')} "
            f"| {f(r.get('tvmkv_max_err'), '.1e')} / {f(r.get('tvm_kernel_max_err'), '.1e')} "
            f"/ {f(r.get('tvm_max_err'), '.1e')} |"
        )
    lines += [
        "",
        "Per call, host-side launch work included (no spin ahead; what one eager call costs):",
        "",
        "| case | tvmkv µs | TVM kernel µs | TVM µs | torch µs | vs TVM kernel | vs TVM | vs torch |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ours = r.get("tvmkv_call_us")

        def ratio(key, r=r, ours=ours):
            return f(r[key] / ours, ".2f") + "x" if r.get(key) and ours else "n/a"

        lines.append(
            f"| {r['case']} | {f(ours, ',.1f')} | {f(r.get('tvm_kernel_call_us'), ',.1f')} "
            f"| {f(r.get('tvm_call_us'), ',.1f')} | {f(r.get('torch_call_us'), ',.1f')} "
            f"| {ratio('tvm_kernel_call_us')} | {ratio('tvm_call_us')} | {ratio('torch_call_us')} |"
        )
    full = [r for r in rows if r.get("tvmkv_full_cache_us")]
    for r in full:
        lines.append(
            f"\nThrough the full tvmkv cache (split + append + attention), {r['case']}: "
            f"{r['tvmkv_full_cache_us']:,.1f} µs device / {f(r.get('tvmkv_full_cache_call_us'), ',.1f')} µs per call "
            f"(TVM's cache: {f(r.get('tvm_us'), ',.1f')} / {f(r.get('tvm_call_us'), ',.1f')} µs)."
        )
    for e in errors:
        lines.append(f"\nFAILED {e}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
