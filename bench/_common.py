"""What tvmkv's benchmarks share: machine metadata, bench/RESULTS.md sections, CUDA-event timing, and
the construction of TVM's own paged KV cache (the baseline of bench/host.py and the GPU benchmarks).

Benchmarks are scripts run from the checkout (``python bench/NAME.py``; their folder is then on
``sys.path``, so ``from _common import ...`` works). Importing this module puts the checkout on
``sys.path`` too (``tvmkv`` imports without an install, as on the GPU machine) and imports nothing
heavy: a benchmark calls :func:`tvmkv.payload.bootstrap` before its first ``import tvm``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "RESULTS.md"


# ------------------------------------------------------------------------------------------------
# Where and when, and where the results go
# ------------------------------------------------------------------------------------------------


def default_out_dir() -> Path | None:
    """``$OUT`` (the GPU machine's result folder) as a Path, else None."""
    out = os.environ.get("OUT")
    return Path(out) if out else None


def cpu_model() -> str:
    """The CPU's model name (``lscpu``), else what :mod:`platform` knows."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_meta(target: str) -> dict:
    """Where and when a benchmark ran (date, host, CPU model and count, load, TVM, GPU name): the
    header every bench/RESULTS.md section states."""
    import tvm

    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "host": platform.node(),
        "cpu": cpu_model(),
        "ncpu": os.cpu_count(),
        "load": os.getloadavg()[0],
        "target": target,
        "tvm": tvm.__version__,
        "device": tvm.cuda(0).device_name if target == "cuda" else None,
    }


def write_results(table: str, begin: str, end: str) -> None:
    """Replace the section of bench/RESULTS.md between the markers ``begin`` and ``end`` with
    ``table`` (append it if absent); other sections are left alone."""
    text = RESULTS.read_text() if RESULTS.exists() else "# tvmkv benchmark results\n\n"
    block = f"{begin}\n{table}{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")


# ------------------------------------------------------------------------------------------------
# CUDA-event timing
# ------------------------------------------------------------------------------------------------

# GPU clock cycles of the spin (torch.cuda._sleep) queued ahead of each timed call in device timing:
# ~0.2 ms, longer than any contender's host-side launch work, so the call's kernels are all queued
# when the start event fires and the events measure only the device
SLEEP_CYCLES = 400_000


class CudaTimer:
    """Median µs of a callable on the GPU, timed with CUDA events (needs torch with CUDA)."""

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


# ------------------------------------------------------------------------------------------------
# TVM's own cache: the PrimFuncs TIRPagedKVCache hands to paged_attention_kv_cache_create
# ------------------------------------------------------------------------------------------------


def tvm_cache_funcs(target_kind: str, *, num_layers, h_qo, h_kv, d, page_size, dtype) -> list:
    """``[(name, PrimFunc)]`` in the order of create's arguments 13.. (TVM 0.27 TIRPagedKVCache).

    Tuple arguments are rebuilt by :func:`tvm_create_args` from the names. For CUDA, four of them
    (transpose_append[_mla], split_rotary, debug_get_kv) have no thread binding: a real build must give
    them a GPU schedule first (``bench/gpu_tvm_baseline.py``'s ``gpu_schedule``, as TVM's relax
    pipeline does) or they compile to host loops over device memory (bench/host.py's stubs have empty
    bodies, so they don't care).
    """
    from tvm.relax.frontend.nn.llm import kv_cache as kvc

    from tvmkv.target import make_target

    rs = {}  # rope_scaling: default frequencies
    common = [
        ("kv_cache_transpose_append", kvc._kv_cache_transpose_append(h_kv, d, dtype)),
        ("kv_cache_transpose_append_mla", kvc._kv_cache_transpose_append_mla(d, dtype)),
    ]
    if target_kind == "llvm":
        return common + [
            (
                "tir_attention_prefill_ragged_cpu",
                kvc._attention_prefill_ragged_cpu(h_kv, h_qo, d, d, dtype, rs),
            ),
            ("tir_attention_prefill_cpu", kvc._attention_prefill_cpu(h_kv, h_qo, d, dtype, False, rs)),
            ("tir_attention_decode_cpu", kvc._attention_decode_cpu(h_kv, h_qo, d, dtype, False, rs)),
            (
                "tir_attention_prefill_cpu_sliding_window",
                kvc._attention_prefill_cpu(h_kv, h_qo, d, dtype, True, rs, sliding_window_size=1024),
            ),
            (
                "tir_attention_decode_cpu_sliding_window",
                kvc._attention_decode_cpu(h_kv, h_qo, d, dtype, True, rs),
            ),
            ("tir_attention_prefill_with_tree_mask_cpu", kvc.tree_attn_cpu(h_kv, h_qo, d, dtype, rs)),
            (
                "tir_attention_prefill_with_tree_mask_with_paged_kv_cache_cpu",
                kvc.tree_attn_with_paged_kv_cache_cpu(h_kv, h_qo, d, dtype, rs),
            ),
            ("tir_attention_merge_state_cpu", kvc._merge_state_inplace_cpu(dtype)),
            ("tir_split_rotary", kvc.llama_rope_with_position_map(1e4, 1.0, d, h_qo, h_kv, dtype, rs, d)),
            ("kv_cache_copy_single_page_cpu", kvc._copy_single_page_cpu(h_kv, page_size, d, dtype)),
            ("kv_cache_debug_get_kv", kvc._kv_cache_debug_get_kv(num_layers, h_kv, d, dtype)),
            ("kv_cache_compact_kv_copy_cpu", kvc._compact_kv_copy_cpu(h_kv, d, dtype)),
        ]
    target = make_target("cuda")
    return common + [
        ("tir_attention_prefill_ragged", kvc._attention_prefill_ragged(h_kv, h_qo, d, d, dtype, rs, target)),
        ("tir_attention_prefill", kvc._attention_prefill(h_kv, h_qo, d, dtype, False, rs, target)),
        ("tir_attention_decode", kvc._attention_decode(h_kv, h_qo, d, dtype, False, rs, target)),
        (
            "tir_attention_prefill_sliding_window",
            kvc._attention_prefill(h_kv, h_qo, d, dtype, True, rs, target, sliding_window_size=1024),
        ),
        (
            "tir_attention_decode_sliding_window",
            kvc._attention_decode(h_kv, h_qo, d, dtype, True, rs, target),
        ),
        (
            "tir_attention_prefill_with_tree_mask_with_paged_kv_cache",
            kvc.tree_attn_with_paged_kv_cache(h_kv, h_qo, d, dtype, rs, target),
        ),
        ("tir_attention_prefill_with_tree_mask", kvc.tree_attn(h_kv, h_qo, d, dtype, rs, target)),
        (
            "tir_attention_merge_state",
            kvc._merge_state_inplace(h_qo, d, dtype, target, "tir_attention_merge_state"),
        ),
        ("tir_split_rotary", kvc.llama_rope_with_position_map(1e4, 1.0, d, h_qo, h_kv, dtype, rs, d)),
        ("kv_cache_copy_single_page", kvc._copy_single_page(h_kv, page_size, d, dtype, target)),
        ("kv_cache_debug_get_kv", kvc._kv_cache_debug_get_kv(num_layers, h_kv, d, dtype)),
        ("kv_cache_compact_kv_copy", kvc._compact_kv_copy(h_kv, d, dtype, target)),
    ]


def tvm_create_args(
    module, names: list, device, *, max_batch, max_total, chunk, num_layers, h_qo, h_kv, d, page_size, dtype
) -> list:
    """The 28 arguments of ``vm.builtin.paged_attention_kv_cache_create`` (TIRPagedKVCache's order)."""
    import tvm
    import tvm_ffi

    f = {n: module[n] for n in names}
    cpu = "tir_attention_decode_cpu" in f
    sfx = "_cpu" if cpu else ""
    head = [
        tvm_ffi.Shape([max_batch, max_total, chunk, page_size, 0, 1024]),
        tvm_ffi.Shape([0, num_layers]),
        h_qo,
        h_kv,
        d,
        d,
        tvm_ffi.Shape([0] * num_layers),  # AttnKind.MHA
        False,
        0,
        1.0,
        1e4,
        0,  # disaggregation, rope_mode none, scale, theta, no ext factors
        tvm.runtime.tensor(np.zeros((), dtype), device),
        f["kv_cache_transpose_append"],
        f["kv_cache_transpose_append_mla"],
    ]
    if cpu:
        attn = [
            "tir_attention_prefill_ragged_cpu",
            "tir_attention_prefill_cpu",
            "tir_attention_decode_cpu",
            "tir_attention_prefill_cpu_sliding_window",
            "tir_attention_decode_cpu_sliding_window",
            "tir_attention_prefill_with_tree_mask_cpu",
            "tir_attention_prefill_with_tree_mask_with_paged_kv_cache_cpu",
        ]
        merge = [f["tir_attention_merge_state_cpu"]]
    else:
        attn = [
            "tir_attention_prefill_ragged",
            "tir_attention_prefill",
            "tir_attention_decode",
            "tir_attention_prefill_sliding_window",
            "tir_attention_decode_sliding_window",
            "tir_attention_prefill_with_tree_mask_with_paged_kv_cache",
            "tir_attention_prefill_with_tree_mask",
        ]
        merge = [f["tir_attention_merge_state"]]
    return (
        head
        + [["tirx", f[n]] for n in attn]
        + [
            [],  # MLA prefill
            merge,
            f["tir_split_rotary"],
            f[f"kv_cache_copy_single_page{sfx}"],
            f["kv_cache_debug_get_kv"],
            f[f"kv_cache_compact_kv_copy{sfx}"],
        ]
    )
