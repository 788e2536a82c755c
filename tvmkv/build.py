"""Compile kernel sets into ``build/<target>/`` and load them again without recompiling.

One artifact per cache configuration: ``build/<target-dir>/kvcache_<tag>[_rope-<mode>][_sw].so``
next to a ``manifest.json`` that records the configuration, target, TVM version, kernel names and a
hash of the kernel sources. The in-process cache and the file names derive from one key.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .tir.spec import KernelSpec

DEFAULT_BUILD_DIR = Path(os.environ.get("TVMKV_BUILD_DIR", Path(__file__).resolve().parent.parent / "build"))
DEFAULT_CUDA_ARCH = "sm_90"

_LOADED: dict = {}  # BuildKey -> KernelLibrary (this process)
STATS = {"compiles": 0, "disk_loads": 0, "memory_hits": 0}


@dataclass(frozen=True)
class BuildKey:
    """Everything that decides what a kernel set compiles to."""

    spec: KernelSpec
    rope_mode: str = "none"
    sliding: bool = False
    arch: str | None = None  # CUDA only, e.g. "sm_90"

    @property
    def target_dir(self) -> str:
        return "llvm" if self.spec.target_kind == "llvm" else f"cuda-{self.arch}"

    @property
    def name(self) -> str:
        parts = ["kvcache", self.spec.tag]
        if self.rope_mode != "none":
            parts.append(f"rope-{self.rope_mode}")
        if self.sliding:
            parts.append("sw")
        return "_".join(parts)


def make_target(target_kind: str, arch: str | None = None):
    """A ``tvm.target.Target`` for "llvm" or "cuda" (``arch`` like "sm_90", default sm_90)."""
    import tvm

    if target_kind == "llvm":
        return tvm.target.Target({"kind": "llvm"})
    if target_kind == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": arch or DEFAULT_CUDA_ARCH})
    raise ValueError(f"target kind {target_kind!r} is not supported; use 'llvm' or 'cuda'")


def sources_hash() -> str:
    """Hash of the kernel sources: a changed factory invalidates built artifacts."""
    h = hashlib.sha256()
    tir_dir = Path(__file__).resolve().parent / "tir"
    for path in sorted(tir_dir.glob("*.py")) + [Path(__file__).resolve()]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def compile_funcs(funcs: dict, target_kind: str, arch: str | None = None):
    """Compile ``{name: PrimFunc}`` into one runtime module (no disk I/O)."""
    import tvm

    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    STATS["compiles"] += 1
    return tvm.compile(mod, target=make_target(target_kind, arch), tir_pipeline="tirx")


class KernelLibrary:
    """The compiled kernels of one :class:`BuildKey`; ``lib["paged_decode"](...)`` calls one."""

    def __init__(self, key: BuildKey, module, path: Path | None):
        self.key = key
        self.module = module
        self.path = path
        self._funcs: dict = {}

    def __getitem__(self, name: str):
        f = self._funcs.get(name)
        if f is None:
            f = self._funcs[name] = self.module[name]
        return f

    def __contains__(self, name: str) -> bool:
        return self.module.implements_function(name)


def _manifest(key: BuildKey, names) -> dict:
    import tvm

    return {
        "name": key.name,
        "config": asdict(key.spec),
        "rope_mode": key.rope_mode,
        "sliding": key.sliding,
        "target": key.target_dir,
        "tvm_version": tvm.__version__,
        "sources_hash": sources_hash(),
        "kernels": sorted(names),
    }


def build_kernel_set(key: BuildKey, build_dir: Path | str | None = None, *, force: bool = False,
                     verbose: bool = False) -> Path:
    """Compile ``key``'s kernel set into ``build_dir`` unless an up-to-date artifact exists.

    Returns the library path. Writes ``<name>.so`` and ``<name>.json`` (its manifest entry).
    """
    from .tir import kernel_set

    out = Path(build_dir or DEFAULT_BUILD_DIR) / key.target_dir
    lib_path = out / f"{key.name}.so"
    man_path = out / f"{key.name}.json"
    if not force and _is_fresh(lib_path, man_path):
        return lib_path
    t0 = time.time()
    funcs = kernel_set(key.spec, rope_mode=key.rope_mode, sliding=key.sliding)
    if verbose:
        print(f"[tvmkv build] compiling {key.target_dir}/{key.name} ({len(funcs)} kernels)", file=sys.stderr)
    module = compile_funcs(funcs, key.spec.target_kind, key.arch)
    out.mkdir(parents=True, exist_ok=True)
    tmp = lib_path.with_suffix(f".tmp{os.getpid()}.so")
    module.export_library(str(tmp))
    os.replace(tmp, lib_path)
    manifest = _manifest(key, funcs)
    manifest["sha256"] = hashlib.sha256(lib_path.read_bytes()).hexdigest()
    man_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if verbose:
        print(f"[tvmkv build] wrote {lib_path} in {time.time() - t0:.1f}s", file=sys.stderr)
    return lib_path


def _is_fresh(lib_path: Path, man_path: Path) -> bool:
    if not (lib_path.exists() and man_path.exists()):
        return False
    try:
        manifest = json.loads(man_path.read_text())
    except ValueError:
        return False
    if _runtime_only():
        return True  # a runtime-only TVM cannot rebuild: trust what was carried here
    import tvm

    return manifest.get("sources_hash") == sources_hash() and manifest.get("tvm_version") == tvm.__version__


def _runtime_only() -> bool:
    return os.environ.get("TVM_USE_RUNTIME_LIB") == "1"


def load_kernels(spec: KernelSpec, *, rope_mode: str = "none", sliding: bool = False, arch: str | None = None,
                 build_dir: Path | str | None = None) -> KernelLibrary:
    """Kernels for one configuration: from this process's cache, else ``build/``, else compiled."""
    import tvm

    if spec.target_kind == "cuda" and arch is None:
        arch = os.environ.get("TVMKV_CUDA_ARCH", DEFAULT_CUDA_ARCH)
    key = BuildKey(spec, rope_mode, bool(sliding), arch if spec.target_kind == "cuda" else None)
    lib = _LOADED.get(key)
    if lib is not None:
        STATS["memory_hits"] += 1
        return lib
    path = build_kernel_set(key, build_dir)
    module = tvm.runtime.load_module(str(path))
    STATS["disk_loads"] += 1
    lib = _LOADED[key] = KernelLibrary(key, module, path)
    return lib
