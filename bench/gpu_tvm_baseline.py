"""TVM's own paged KV cache and its attention kernels, the baseline of bench/gpu_attention.py.

- TVM kernel: TVM's own TIR kernels from ``tvm.relax.frontend.nn.llm.kv_cache`` called directly on
  the case's layout (``batch_decode_paged_kv``; ``batch_prefill_ragged_kv`` on empty history,
  ``batch_prefill_paged_kv`` causal with history), arguments built from the signatures ``--prepare``
  saved; outputs checked against torch.
- TVM: ``vm.builtin.paged_attention_kv_cache_create`` with those kernels (compiled on the build machine
  by ``--prepare``, with the dlight GPU schedule TVM's relax pipeline gives the unscheduled ones), the
  case's history written through the cache, timed through ``attention_kv_cache_attention_with_fused_qkv``
  (which also splits q/k/v and appends K/V); output checked against torch.
- Both run in worker processes (``--worker``, started by :func:`run_tvm_isolated`): a crash or hang
  there (segfault, CUDA fault) is reported for that case and the benchmark goes on.

Build machine (full TVM + nvcc)::

    .venv/bin/python bench/gpu_tvm_baseline.py --prepare build/tvm-cuda-sm_90
    .venv/bin/python bench/gpu_tvm_baseline.py --selfcheck-cpu   # the argument builders vs NumPy, on CPU

The GPU machine runs it through ``bench/gpu_attention.py --tvm-lib build/tvm-cuda-sm_90``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from _attention_cases import DTYPE, H_KV, H_QO, D, P, case_seed, label, make_case, numpy_attention, torch_run
from _common import CudaTimer, tvm_cache_funcs, tvm_create_args

# The TVM kernel called directly for each case ("ragged" for prefill on empty history: same role as
# tvmkv's ragged_prefill_causal; "prefill" = paged, causal, pages holding history + new tokens).
TVM_KERNELS = {
    "decode": "tir_attention_decode",
    "prefill": "tir_attention_prefill",
    "ragged": "tir_attention_prefill_ragged",
}
_ROLE_ALIASES = {"page_table_indptr": "page_indptr", "page_table_values": "page_values"}


def prepare(out: Path, arch: str) -> None:
    """Compile TVM's CUDA kernel PrimFuncs (what TIRPagedKVCache passes) into ``out/tvm_kv_cache.so``
    as a fatbin library for ``arch`` (no CUDA compiler needed where it is loaded)."""
    import tvm

    from tvmkv.build import export_module
    from tvmkv.target import make_target

    out.mkdir(parents=True, exist_ok=True)
    funcs = tvm_cache_funcs("cuda", num_layers=1, h_qo=H_QO, h_kv=H_KV, d=D, page_size=P, dtype=DTYPE)
    target = make_target("cuda", arch)
    t0 = time.time()
    # Several of these PrimFuncs (transpose_append, split_rotary, debug_get_kv) carry no thread
    # binding; TVM's relax pipeline gives them a dlight GPU schedule. Without it tvm.compile makes them
    # host loops over device pointers, and the cache's first attention call segfaults in split_rotary.
    mod = gpu_schedule(tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs}), target)
    lib = tvm.compile(mod, target=target)
    fmt = export_module(lib, out / "tvm_kv_cache.so", "cuda", arch)
    missing = missing_device_kernels(out / "tvm_kv_cache.so", [n for n, _ in funcs])
    if missing:
        raise RuntimeError(f"no CUDA kernel in {out / 'tvm_kv_cache.so'} for {missing} (host-only functions)")
    (out / "names.json").write_text(json.dumps([n for n, _ in funcs]))
    sigs = {n: kernel_signature(f) for n, f in funcs if n in TVM_KERNELS.values()}
    (out / "signatures.json").write_text(json.dumps(sigs, indent=1))
    (out / "prepare.json").write_text(json.dumps({"gpu_scheduled": True, "tvm": tvm.__version__}))
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 2**20:.2f} MiB, {fmt}, every function has a CUDA kernel) in {time.time() - t0:.0f}s")


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

    from tvmkv.build import elf_symbol_bytes, parse_imports_blob, split_cuda_module_bytes

    blob = elf_symbol_bytes(Path(lib_path), "__tvm_ffi__library_bin")
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


def tvm_worker(mode: str, specs: list, tvm_dir: Path, reps: int) -> int:
    """Worker process: TVM's kernels (``mode`` "kernel") or cache ("cache") on each case; prints
    ``TVMKV_START <spec>`` before and ``TVMKV_RESULT <json>`` after each case."""
    import torch
    import tvm

    prep = tvm_dir / "prepare.json"
    if not prep.exists() or not json.loads(prep.read_text()).get("gpu_scheduled"):
        raise RuntimeError(f"{tvm_dir} was prepared before the dlight fix (host-only kernels): rerun --prepare")
    dev = tvm.cuda(0)
    mod = tvm.runtime.load_module(str(tvm_dir / "tvm_kv_cache.so"))
    names = json.loads((tvm_dir / "names.json").read_text())
    sigs = json.loads((tvm_dir / "signatures.json").read_text())
    timer = CudaTimer(reps)
    for spec in specs:
        print("TVMKV_START", json.dumps(spec), flush=True)
        res = {}
        try:
            c = make_case(*spec, np.random.default_rng(case_seed(spec)))
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
            res["us"] = timer.time(run)
            res["call_us"] = timer.time(run, queued=False)
        except Exception as err:  # noqa: BLE001 - reported to the parent, next case goes on
            traceback.print_exc()
            res["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        print("TVMKV_RESULT", json.dumps({"spec": spec, **res}), flush=True)
        if "cuda" in res.get("error", "").lower():
            return 3  # a CUDA fault poisons this context: the parent starts a new worker for the rest
        c = run = get = tr = _cache = None
        torch.cuda.empty_cache()
    return 0


def _pump(stream, lines) -> None:
    """Copy ``stream``'s lines into the queue ``lines``, then None (the worker's end)."""
    for line in stream:
        lines.put(line)
    lines.put(None)


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
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--cases"]
        cmd += [json.dumps(remaining), "--tvm-lib", str(tvm_dir), "--reps", str(reps)]
        current, how, lines = None, None, queue.Queue()
        with tempfile.TemporaryFile("w+") as err_file:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True, bufsize=1)
            reader = threading.Thread(target=_pump, args=(proc.stdout, lines))
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
    from tvm.relax.frontend.nn.llm import kv_cache as kvc

    from tvmkv.target import make_target

    failures = []
    specs = [
        ("decode", 3, 1, 37),
        ("decode", 2, 1, 16),
        ("prefill", 2, 5, 19),
        ("prefill", 2, 7, 0),
        ("prefill", 1, 33, 0),
    ]
    cases = [make_case(*s, np.random.default_rng(case_seed(s))) for s in specs]
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
    target = make_target("cuda")
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prepare", type=Path, metavar="DIR", help="build machine: compile TVM's CUDA kernels into DIR")
    mode.add_argument("--selfcheck-cpu", action="store_true", help="build machine: check the TVM paths on CPU")
    mode.add_argument(
        "--worker",
        choices=("kernel", "cache"),
        help="GPU machine: time TVM's kernels or cache on --cases (what run_tvm_isolated starts)",
    )
    ap.add_argument("--arch", default=None, help="--prepare: CUDA arch (default $TVMKV_CUDA_ARCH or sm_90)")
    ap.add_argument("--cases", default="[]", help="--worker: JSON list of [kind, batch, new, history]")
    ap.add_argument("--tvm-lib", type=Path, help="--worker: the folder --prepare wrote")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args(argv)
    if args.prepare:
        from tvmkv.target import default_cuda_arch

        prepare(args.prepare, args.arch or default_cuda_arch())
        return 0
    if args.selfcheck_cpu:
        return selfcheck_tvm_cpu()
    if args.tvm_lib is None:
        ap.error("--worker needs --tvm-lib")
    from tvmkv.payload import bootstrap

    bootstrap()  # $TVMKV_PAYLOAD: the GPU machine's runtime-only TVM, before tvm is imported
    return tvm_worker(args.worker, json.loads(args.cases), args.tvm_lib, args.reps)


if __name__ == "__main__":
    sys.exit(main())
