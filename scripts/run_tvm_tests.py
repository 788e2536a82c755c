"""Run Apache TVM's own unit tests for its paged KV cache through tvmkv's drop-in, on this machine's CPU.

    .venv/bin/python scripts/run_tvm_tests.py TVM_CHECKOUT [--files cpu tir mla_tir] [--work DIR] [-- PYTEST_ARGS]

``TVM_CHECKOUT`` is a checkout of apache/tvm (the files are read from its
``tests/python/relax/test_runtime_builtin_paged_attention_kv_cache_{cpu,tir,mla_tir}.py``; nothing of
TVM's is copied into this repository). Each file is written into ``--work`` (default: a fresh temporary
folder) beside a ``conftest.py`` that installs :class:`tvmkv.relax.TvmBuiltinOverride` before the tests
fetch TVM's global functions, so every ``vm.builtin.paged_attention_kv_cache_create`` call makes a tvmkv
cache; then pytest runs there with this interpreter.

* ``cpu``: run unchanged.
* ``tir`` and ``mla_tir`` are TVM's CUDA files. They are adapted to run on the CPU, and only in ways
  that leave what they check unchanged: the cache's device and torch's reference device become the
  CPU; TVM's own kernels, which the tests compile and hand to the create call (the drop-in does not
  run them), are compiled for an explicit ``cuda`` sm_90 target instead of the present GPU's; the
  "need cuda" skip markers go; and (``mla_tir``) the reference's fp16 matrix products run in fp32 and
  are rounded to fp16, as cuBLAS accumulates an fp16 GEMM on the GPU (torch's CPU fp16 GEMM takes
  minutes). Each replacement must be found in the file; an upstream change that breaks one
  stops the script with the text it could not find. ``tir``'s two tests of TVM's sliding-window kernel alone
  skip (no CUDA device).

Compiling TVM's CUDA kernels needs nvcc. Exit status: pytest's (the last file's non-zero one, if any).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

FILES = {
    name: f"tests/python/relax/test_runtime_builtin_paged_attention_kv_cache_{name}.py"
    for name in ("cpu", "tir", "mla_tir")
}

_TO_CPU = [
    ('device_torch = torch.device("cuda")', 'device_torch = torch.device("cpu")'),
    ("device = tvm.cuda()", "device = tvm.cpu()"),
    ("return tvm.target.Target.from_device(tvm.cuda())", 'return tvm.target.Target({"kind": "cuda", "arch": "sm_90"})'),
    ('@pytest.mark.skipif(not env.has_cuda(), reason="need cuda")\n', ""),
]
ADAPTATIONS = {
    "cpu": [],
    "tir": _TO_CPU,
    "mla_tir": _TO_CPU
    + [
        ("(latent @ w_kv)", "(latent.float() @ w_kv.float()).to(dtype_torch)"),
        ("(latent_seq @ w_kv)", "(latent_seq.float() @ w_kv.float()).to(dtype_torch)"),
        (
            "torch.bmm(queries_lora_np.permute(1, 0, 2), w_uk)",
            "torch.bmm(queries_lora_np.permute(1, 0, 2).float(), w_uk.float()).to(dtype_torch)",
        ),
        (
            "torch.from_numpy(outputs2.numpy()).to(device_torch).permute(1, 0, 2), w_uv\n                )",
            "torch.from_numpy(outputs2.numpy()).to(device_torch).permute(1, 0, 2).float(), w_uv.float()\n"
            "                ).to(dtype_torch)",
        ),
    ],
}

CONFTEST = '''"""Written by tvmkv's scripts/run_tvm_tests.py: TVM's cache builtins answered by tvmkv."""
import tvmkv.relax

_override = tvmkv.relax.TvmBuiltinOverride()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: TVM's marker of tests that need a GPU")
    _override.__enter__()


def pytest_unconfigure(config):
    _override.__exit__(None, None, None)
'''


def adapt(name: str, source: str) -> str:
    """``source`` of TVM's test file ``name`` with :data:`ADAPTATIONS` applied (ValueError: one not found)."""
    for old, new in ADAPTATIONS[name]:
        if old not in source:
            raise ValueError(f"{FILES[name]}: the text to adapt was not found (did the file change upstream?): {old!r}")
        source = source.replace(old, new)
    return source


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tvm_checkout", type=Path, help="a checkout of apache/tvm")
    ap.add_argument("--files", nargs="+", choices=list(FILES), default=list(FILES))
    ap.add_argument("--work", type=Path, help="folder for the adapted files (default: a new temporary one)")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="tvmkv_tvm_tests_"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "conftest.py").write_text(CONFTEST)
    status = 0
    for name in args.files:
        src = args.tvm_checkout / FILES[name]
        if not src.exists():
            ap.error(f"{src} does not exist; TVM_CHECKOUT must be a checkout of apache/tvm")
        dst = work / Path(FILES[name]).name
        dst.write_text(adapt(name, src.read_text()))
        print(f"[run_tvm_tests] {name}: {dst}", flush=True)
        rc = subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", dst.name, *args.pytest_args], cwd=work
        )
        status = rc or status
    return status


if __name__ == "__main__":
    sys.exit(main())
