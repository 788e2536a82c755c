"""Disco's NCCL backend for the GPU machine, built from the TVM wheel's own source.

The apache-tvm 0.27 wheel ships Disco without a collective backend: no ``runtime.disco.nccl.*``
function is compiled in, although the source of TVM's NCCL backend (``src/runtime/extra/disco/nccl``)
comes inside the wheel. :func:`build_plugin` compiles that source, as it is, into a small library
against the wheel's headers and libraries and NCCL's header (the ``nvidia-nccl-cu13`` wheel's, the
NCCL that torch uses on the GPU machine), with tvmkv's own stand-ins for the three support headers
the wheel lacks (``nccl_support/``). :func:`load` loads NCCL and that library into a process; the
controller and every worker must (``TVMKV_DISCO_NCCL`` names it for the workers), and then
``session.init_ccl("nccl", *device_ids)`` sets up the communicators as in a ``USE_NCCL=ON`` TVM
(:meth:`tvmkv.disco.TvmkvSession.init_nccl`).

``python -m tvmkv.disco.nccl OUT_DIR NCCL_ROOT`` builds ``OUT_DIR/libtvm_disco_nccl.so`` (g++, C++17,
the CUDA headers of ``$CUDA_HOME``, default ``/usr/local/cuda``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PLUGIN = "libtvm_disco_nccl.so"
ENV = "TVMKV_DISCO_NCCL"  # the plugin's path, for worker processes
_SUPPORT = Path(__file__).parent / "nccl_support"


def package_dir(name: str) -> Path:
    """The folder of the installed package ``name`` (ImportError when it is not installed)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed")
    return Path(spec.submodule_search_locations[0])


def build_plugin(out_dir, nccl_root, *, cuda_home=None) -> Path:
    """Compile TVM's Disco NCCL backend into ``out_dir/libtvm_disco_nccl.so``; returns its path.

    ``nccl_root`` holds ``include/nccl.h`` and ``lib/libnccl.so.2`` (``pip download --no-deps
    nvidia-nccl-cu13==2.28.9``, unzipped: its ``nvidia/nccl``)."""
    tvm_dir, ffi_dir = package_dir("tvm"), package_dir("tvm_ffi")
    src = tvm_dir / "src" / "runtime" / "extra" / "disco"
    nccl_root, cuda = Path(nccl_root), Path(cuda_home or os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    for need in (src / "nccl" / "nccl.cc", nccl_root / "include" / "nccl.h", cuda / "include" / "cuda_runtime.h"):
        if not need.exists():
            raise FileNotFoundError(f"{need} is missing: build_plugin needs the TVM wheel's sources, NCCL and CUDA")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # nccl.cc includes "../../../../support/process_id.h" and "../utils.h": the TVM tree's layout
        tree = Path(tmp) / "src"
        (tree / "runtime" / "extra" / "disco" / "nccl").mkdir(parents=True)
        (tree / "support").mkdir()
        for name in ("nccl.cc", "nccl_context.h"):
            shutil.copy(src / "nccl" / name, tree / "runtime" / "extra" / "disco" / "nccl" / name)
        shutil.copy(src / "utils.h", tree / "runtime" / "extra" / "disco" / "utils.h")
        shutil.copy(_SUPPORT / "process_id.h", tree / "support" / "process_id.h")
        cmd = [
            "g++",
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-o",
            str(out / PLUGIN),
            str(tree / "runtime" / "extra" / "disco" / "nccl" / "nccl.cc"),
            f"-I{tvm_dir / 'include'}",
            f"-I{ffi_dir / 'include'}",
            f"-I{_SUPPORT}",
            f"-I{nccl_root / 'include'}",
            f"-I{cuda / 'include'}",
            "-DTVM_NCCL_RCCL_SWITCH=0",
            f"-L{tvm_dir / 'lib'}",
            "-ltvm_runtime_extra",
            "-ltvm_runtime",
            f"-L{ffi_dir / 'lib'}",
            "-ltvm_ffi",
            f"-L{nccl_root / 'lib'}",
            "-l:libnccl.so.2",
            f"-L{cuda / 'lib64'}",
            "-lcudart",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building {PLUGIN} failed:\n{done.stderr[-4000:]}")
    return out / PLUGIN


def nccl_library() -> Path | None:
    """``libnccl.so.2`` of the ``nvidia-nccl`` package installed with torch, if any."""
    try:
        root = package_dir("nvidia")
    except ImportError:
        return None
    lib = root / "nccl" / "lib" / "libnccl.so.2"
    return lib if lib.exists() else None


def load(plugin=None) -> Path:
    """Load NCCL and the plugin into this process (``plugin`` default ``$TVMKV_DISCO_NCCL``); idempotent."""
    path = Path(plugin or os.environ.get(ENV, ""))
    if not path.is_file():
        raise FileNotFoundError(
            f"no Disco NCCL plugin at {str(path)!r}: build it with python -m tvmkv.disco.nccl OUT_DIR NCCL_ROOT "
            f"and pass its path (or set {ENV})"
        )
    lib = nccl_library()
    ctypes.CDLL(str(lib) if lib is not None else "libnccl.so.2", mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    os.environ[ENV] = str(path)  # the workers this process starts load it too
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m tvmkv.disco.nccl OUT_DIR NCCL_ROOT", file=sys.stderr)
        sys.exit(2)
    print(build_plugin(sys.argv[1], sys.argv[2]))
