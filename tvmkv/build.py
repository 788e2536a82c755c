"""Compile kernel sets into ``build/<target>/`` and load them again without recompiling.

One artifact per cache configuration:
``build/<target-dir>/kvcache_<tag>[_rope-<mode>][_<rope variant>][_sw][_local].so`` (the variant:
:attr:`tvmkv.tir.RopeScaling.tag`, e.g. ``yarn-r64-1a2b3c4d``; none for the default RoPE)
next to its own ``<name>.json`` (configuration, target, TVM version, kernel names, hashes). A
top-level ``build/<target-dir>/manifest.json`` lists every artifact of that directory; it is rewritten
from the per-artifact jsons (under a file lock) whenever an artifact is written, so several processes
may build into one directory; each artifact is compiled under a lock of its own
(``.<name>.lock``), so processes that want it at once compile it once. The in-process cache and the
file names derive from one key.

Kernel families: ``kvcache`` (``tvmkv.tir.kernel_set``, what every cache loads) and families that
are compiled lazily by the features that use them, into artifacts of their own named
``<family>_<tag>.so`` (``interop``: ``tvmkv.tir.interop``, the foreign-layout copies; ``mla``:
``tvmkv.tir.mla``, the MLA cache kernels, keyed by an ``MlaSpec`` and named by its tag alone, e.g.
``mla_h128_c512_r64_p16_float16.so``). A family's
modules listed in :data:`FAMILY_MODULES` are left out of the ``kvcache`` sources hash, so editing
them does not make cache kernel sets stale.

CUDA artifacts carry compiled device code: ``tvm.compile`` leaves the CUDA module as source (TVM 0.27
compiles it when the library is *loaded*, through ``tvm_callback_cuda_compile``), so the export step
compiles that source with nvcc into a fatbin here and packs the fatbin, with TVM's own function table,
into the library in place of the source. Loading such a library needs the CUDA runtime only.

Where: ``build_dir`` when a caller passes one (``--build-dir``), else :func:`default_build_dir`
(``$TVMKV_BUILD_DIR``; else ``build/`` of the source checkout tvmkv runs from; else the per-user
cache ``$XDG_CACHE_HOME/tvmkv``, default ``~/.cache/tvmkv``, so an installed tvmkv never writes
into site-packages).

Command line (``python -m tvmkv build --help``)::

    python -m tvmkv build --target cuda --arch sm_90 --num-qo-heads 32 --num-kv-heads 8 --head-dim 128
    python -m tvmkv build --target cuda --arch sm_90 --config scripts/gpu_configs.json -j 2
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .target import CUDA_ARCHS, default_cuda_arch, host_llvm_mcpu, make_target
from .tir.rope_scaling import RopeScaling, kernel_variant
from .tir.spec import KernelSpec, MlaSpec

BUILD_DIR_ENV = "TVMKV_BUILD_DIR"
BUILD_DIR_HELP = (
    "kernel library folder (default: $TVMKV_BUILD_DIR, else build/ of the source checkout tvmkv runs from, "
    "else $XDG_CACHE_HOME/tvmkv or ~/.cache/tvmkv)"
)
NVCC_DIAG_SUPPRESS = "177,550,1046"  # unused variable, set-but-unused, inexact float constant
MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = 1

# tir modules only that family builds
FAMILY_MODULES = {"kvcache": (), "interop": ("interop.py", "foreign_layouts.py"), "mla": ("mla.py", "mla_layout.py")}
_LOADED: dict = {}  # BuildKey -> KernelLibrary (this process)
STATS = {"compiles": 0, "disk_loads": 0, "memory_hits": 0, "nvcc_compiles": 0, "nvcc_cache_hits": 0}


@dataclass(frozen=True)
class BuildKey:
    """Everything that decides what a kernel set compiles to."""

    spec: KernelSpec | MlaSpec  # MlaSpec exactly for the mla family
    rope_mode: str = "none"
    sliding: bool = False
    arch: str | None = None  # CUDA only, e.g. "sm_90"
    family: str = "kvcache"  # one of FAMILY_MODULES; rope_mode/sliding/local only vary the kvcache family
    local: bool = False  # with the per-layer sliding window kernels (*_local)
    rope_scaling: RopeScaling | None = None  # the RoPE variant (rope_mode "normal"); None: default RoPE

    def __post_init__(self):
        if self.family not in FAMILY_MODULES:
            raise ValueError(f"family={self.family!r} is not one of {tuple(FAMILY_MODULES)}")
        if (self.family == "mla") != isinstance(self.spec, MlaSpec):
            raise ValueError(
                f"BuildKey family={self.family!r} with a {type(self.spec).__name__}: the mla family takes an "
                "MlaSpec and every other family a KernelSpec"
            )
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if not isinstance(rs, RopeScaling) or rs.rotary_dim is None or rs.is_default(self.spec.head_dim):
                raise ValueError(
                    f"BuildKey.rope_scaling={rs!r} must be a resolved, non-default RopeScaling "
                    "(tvmkv.tir.rope_scaling.kernel_variant gives one, or None)"
                )
            if self.family != "kvcache" or self.rope_mode != "normal":
                raise ValueError(
                    f"BuildKey.rope_scaling applies to the kvcache family with rope_mode 'normal', not "
                    f"{self.family}/{self.rope_mode}"
                )

    @property
    def target_dir(self) -> str:
        return "llvm" if self.spec.target_kind == "llvm" else f"cuda-{self.arch}"

    @property
    def name(self) -> str:
        parts = [self.family, self.spec.tag] if self.family != "mla" else [self.spec.tag]  # MlaSpec.tag: mla_...
        if self.rope_mode != "none":
            parts.append(f"rope-{self.rope_mode}")
        if self.rope_scaling is not None:
            parts.append(self.rope_scaling.tag)
        if self.sliding:
            parts.append("sw")
        if self.local:
            parts.append("local")
        return "_".join(parts)


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tvmkv``, else ``~/.cache/tvmkv``: tvmkv's per-user cache."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "tvmkv"


def _source_checkout(package_dir: Path) -> Path | None:
    """The checkout holding ``package_dir`` (its parent, with tvmkv's pyproject.toml), else None."""
    pyproject = package_dir.parent / "pyproject.toml"
    try:
        text = pyproject.read_text()
    except OSError:
        return None
    return package_dir.parent if 'name = "tvmkv"' in text else None


def default_build_dir(package_dir: Path | None = None) -> Path:
    """Where kernel libraries are built and loaded when no ``build_dir`` is given.

    In order: ``$TVMKV_BUILD_DIR`` when set; ``<checkout>/build`` when tvmkv runs from a source
    checkout (``package_dir``'s parent holds tvmkv's ``pyproject.toml``: a clone, or an editable
    install); otherwise :func:`user_cache_dir` (a wheel install: never ``site-packages/build``).

    Parameters
    ----------
    package_dir : Path, optional
        The ``tvmkv`` package folder to judge (default: this module's folder; tests pass others).
    """
    env = os.environ.get(BUILD_DIR_ENV)
    if env:
        return Path(env)
    checkout = _source_checkout(package_dir or Path(__file__).resolve().parent)
    return checkout / "build" if checkout is not None else user_cache_dir()


def sources_hash(family: str = "kvcache") -> str:
    """Hash of the kernel sources of ``family``: a changed factory invalidates built artifacts.

    ``kvcache`` hashes every ``tvmkv/tir`` module except those another family owns
    (:data:`FAMILY_MODULES`); other families hash every module (they may use shared helpers).
    """
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    tir_dir = here / "tir"
    skip = {m for mods in FAMILY_MODULES.values() for m in mods} if family == "kvcache" else set()
    files = [p for p in sorted(tir_dir.glob("*.py")) if p.name not in skip]
    files += [here / "build.py", here / "target.py"]  # how it is compiled, and for which Target
    for path in files:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def compile_funcs(funcs: dict, target_kind: str, arch: str | None = None):
    """Compile ``{name: PrimFunc}`` into one runtime module (no disk I/O).

    For "cuda" the device code of the returned module is still CUDA source; :func:`export_module`
    turns it into a fatbin when writing the library.
    """
    import tvm

    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    STATS["compiles"] += 1
    return tvm.compile(mod, target=make_target(target_kind, arch), tir_pipeline="tirx")


# ----------------------------------------------------------------------------------------------
# nvcc: CUDA source -> fatbin
# ----------------------------------------------------------------------------------------------


class NvccNotFoundError(RuntimeError):
    """Raised when a CUDA build needs nvcc and none is found."""


def find_nvcc() -> str:
    """Path of nvcc: ``$TVMKV_NVCC``, else ``nvcc`` on PATH, else ``/usr/local/cuda/bin/nvcc``."""
    for cand in (os.environ.get("TVMKV_NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    raise NvccNotFoundError(
        "nvcc was not found (checked $TVMKV_NVCC, PATH and /usr/local/cuda/bin/nvcc); a CUDA build compiles "
        "its kernels to a fatbin here. Install the CUDA toolkit or set TVMKV_NVCC=/path/to/nvcc, or set "
        "TVMKV_CUDA_SOURCE=1 to keep CUDA source in the library (then the GPU machine compiles it at load)."
    )


def gencode_flags(arch: str) -> list:
    """nvcc ``-gencode`` flags for ``arch``.

    sm_90 compiles for ``sm_90a`` (the ``a`` feature set is what wgmma needs; plain ``-arch=sm_90a``
    would also embed compute_90 PTX, which rejects wgmma). Other archs get SASS plus their PTX.
    """
    if arch not in CUDA_ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; use one of {CUDA_ARCHS}")
    num = arch.removeprefix("sm_")
    if arch == "sm_90":
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return [f"-gencode=arch=compute_{num},code=[sm_{num},compute_{num}]"]


def _nvcc_cache_dir() -> Path:
    return Path(os.environ.get("TVMKV_NVCC_CACHE") or user_cache_dir() / "nvcc")


def nvcc_fatbin(source: str, arch: str) -> bytes:
    """Compile CUDA ``source`` for ``arch`` into a fatbin (cached on disk by flags + source).

    The cache lives in ``$TVMKV_NVCC_CACHE`` (default ``nvcc/`` in :func:`user_cache_dir`).
    """
    nvcc = find_nvcc()
    flags = ["-O3", "--fatbin", *gencode_flags(arch), f"-diag-suppress={NVCC_DIAG_SUPPRESS}"]
    digest = hashlib.sha256((" ".join(flags) + "\0" + source).encode()).hexdigest()
    cache = _nvcc_cache_dir()
    hit = cache / f"{digest}.fatbin"
    if hit.exists():
        STATS["nvcc_cache_hits"] += 1
        return hit.read_bytes()
    with tempfile.TemporaryDirectory(prefix="tvmkv_nvcc_") as tmp:
        src, out = Path(tmp, "kernels.cu"), Path(tmp, "kernels.fatbin")
        src.write_text(source)
        proc = subprocess.run([nvcc, *flags, "-o", str(out), str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            keep = Path(tempfile.gettempdir(), f"tvmkv_failed_{digest[:12]}.cu")
            keep.write_text(source)
            raise RuntimeError(
                f"nvcc failed for {arch} (exit {proc.returncode}); source kept at {keep}\n"
                f"{' '.join([nvcc, *flags])}\n{proc.stderr[-4000:]}"
            )
        data = out.read_bytes()
    STATS["nvcc_compiles"] += 1
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp_hit = hit.with_suffix(f".tmp{os.getpid()}")
        tmp_hit.write_bytes(data)
        os.replace(tmp_hit, hit)
    except OSError:
        pass  # the cache is an optimisation only
    return data


# ----------------------------------------------------------------------------------------------
# The packed imports blob (``__tvm_ffi__library_bin``) of an exported library
# ----------------------------------------------------------------------------------------------
#
# Layout (little endian, as written by tvm-ffi's ModulePackImportsTo*): u64 nbytes of what follows;
# vector<u64> import-tree row pointers; vector<u64> child indices; then per module a string ``kind``
# and, unless kind == "_lib" (the host library itself), a string holding the module's SaveToBytes.
# A CUDA module's bytes are: string fmt ("cuda" = source, "fatbin", "cubin", "ptx"); its function table
# (FunctionInfo map); string data. Strings and vectors are a u64 length followed by the items.


def _read_u64(buf: bytes, pos: int) -> tuple:
    return struct.unpack_from("<Q", buf, pos)[0], pos + 8


def _read_str(buf: bytes, pos: int) -> tuple:
    n, pos = _read_u64(buf, pos)
    if pos + n > len(buf):
        raise ValueError(f"corrupt library blob: string of {n} bytes at offset {pos} overruns {len(buf)}")
    return buf[pos : pos + n], pos + n


def pack_str(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def parse_imports_blob(blob: bytes) -> tuple:
    """Split a packed imports blob into ``(tree_bytes, [(kind, module_bytes or None), ...])``."""
    nbytes, pos = _read_u64(blob, 0)
    if nbytes != len(blob) - 8:
        raise ValueError(f"corrupt library blob: header says {nbytes} bytes, {len(blob) - 8} follow")
    start = pos
    for _ in range(2):  # row pointers, child indices
        n, pos = _read_u64(blob, pos)
        pos += 8 * n
    tree = blob[start:pos]
    modules = []
    while pos < len(blob):
        kind, pos = _read_str(blob, pos)
        data = None
        if kind != b"_lib":
            data, pos = _read_str(blob, pos)
        modules.append((kind.decode(), data))
    return tree, modules


def pack_imports_blob(tree: bytes, modules: list) -> bytes:
    """Inverse of :func:`parse_imports_blob`."""
    body = tree + b"".join(pack_str(k.encode()) + (b"" if d is None else pack_str(d)) for k, d in modules)
    return struct.pack("<Q", len(body)) + body


def _skip_function_table(data: bytes, pos: int) -> int:
    """Offset just past a serialized ``{name: FunctionInfo}`` map starting at ``pos``.

    FunctionInfo = string name, vector<DLDataType> arg_types (4 bytes each), vector<string>
    launch_param_tags, vector<int32> arg_extra_tags.
    """
    count, pos = _read_u64(data, pos)
    for _ in range(count):
        _key, pos = _read_str(data, pos)
        _name, pos = _read_str(data, pos)
        n, pos = _read_u64(data, pos)
        pos += 4 * n
        n, pos = _read_u64(data, pos)
        for _ in range(n):
            _tag, pos = _read_str(data, pos)
        n, pos = _read_u64(data, pos)
        pos += 4 * n
    return pos


def split_cuda_module_bytes(data: bytes) -> tuple:
    """``(fmt, function_table_bytes, payload)`` of a serialized CUDA module."""
    fmt, pos = _read_str(data, 0)
    end = _skip_function_table(data, pos)
    payload, stop = _read_str(data, end)
    if stop != len(data):
        raise ValueError(
            f"unexpected CUDA module layout: {len(data) - stop} bytes after the payload; this TVM "
            f"({len(data)} bytes, fmt {fmt!r}) serializes CUDA modules differently than tvmkv.build expects"
        )
    return fmt.decode(), data[pos:end], payload


def _fatbin_blob(module, arch: str) -> bytes:
    """The packed imports of ``module`` with every CUDA-source import replaced by an nvcc fatbin."""
    import tvm_ffi

    blob = bytes(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(module).numpy())
    tree, modules = parse_imports_blob(blob)
    out = []
    for kind, data in modules:
        if kind == "cuda":
            fmt, table, payload = split_cuda_module_bytes(data)
            if fmt == "cuda":
                fatbin = nvcc_fatbin(payload.decode(), arch)
                data = pack_str(b"fatbin") + table + pack_str(fatbin)
        out.append((kind, data))
    return pack_imports_blob(tree, out)


def export_module(module, path: Path, target_kind: str, arch: str | None = None) -> str:
    """Write ``module`` (from :func:`compile_funcs`) as a shared library at ``path``.

    Returns the format of the device code inside: "host" (llvm), "fatbin" (cuda, the default) or "cuda"
    (CUDA source, only with ``TVMKV_CUDA_SOURCE=1``).
    """
    if target_kind == "llvm":
        module.export_library(str(path))
        return "host"
    if os.environ.get("TVMKV_CUDA_SOURCE") == "1":
        module.export_library(str(path))
        return "cuda"
    blob = _fatbin_blob(module.mod if hasattr(module, "mod") else module, arch or default_cuda_arch())

    def pack_fatbin(_mod, is_system_lib, prefix, workspace_dir):
        if is_system_lib:
            raise ValueError("system-lib export is not supported by tvmkv's fatbin packing")
        bin_path = Path(workspace_dir, f"{prefix}devc.bin")
        bin_path.write_bytes(blob)
        asm_path = Path(workspace_dir, f"{prefix}devc.S")
        sym = f"{prefix}__tvm_ffi__library_bin"
        asm_path.write_text(
            f'\t.section .rodata.{sym},"a"\n\t.globl {sym}\n\t.type {sym}, @object\n\t.balign 16\n'
            f'{sym}:\n\t.incbin "{bin_path}"\n\t.size {sym}, .-{sym}\n'
            '\t.section .note.GNU-stack,"",@progbits\n'
        )
        return str(asm_path)

    module.export_library(str(path), fpack_imports=pack_fatbin)
    return "fatbin"


def elf_symbol_bytes(path: Path, symbol: str) -> bytes:
    """Bytes of a data symbol in an ELF64 little-endian shared library (read from the file)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path} is not an ELF64 file")
    shoff, shentsize, shnum = struct.unpack_from("<Q", data, 0x28)[0], *struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for sec in secs:
        if sec[1] not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        strtab = secs[sec[6]]
        for off in range(sec[4], sec[4] + sec[5], 24):
            st_name, _info, _other, shndx, value, size = struct.unpack_from("<IBBHQQ", data, off)
            end = data.index(b"\0", strtab[4] + st_name)
            if data[strtab[4] + st_name : end].decode() == symbol and shndx not in (0, 0xFFF1):
                host = secs[shndx]
                start = host[4] + (value - host[3])
                return data[start : start + size]
    raise ValueError(f"symbol {symbol} not found in {path}")


def inspect_library(path: Path | str) -> list:
    """The imported device modules of an exported library, read from the file (no loading, no GPU).

    Returns
    -------
    list of dict
        One dict per module with ``kind`` ("_lib" is the host code itself), and for CUDA modules
        ``format`` ("fatbin"/"cubin"/"ptx" = compiled, "cuda" = source compiled at load) and ``nbytes``.
    """
    blob = elf_symbol_bytes(Path(path), "__tvm_ffi__library_bin")
    nbytes = struct.unpack_from("<Q", blob, 0)[0]
    _tree, modules = parse_imports_blob(blob[: nbytes + 8])
    out = []
    for kind, data in modules:
        info = {"kind": kind}
        if kind == "cuda":
            fmt, _table, payload = split_cuda_module_bytes(data)
            info.update(format=fmt, nbytes=len(payload))
        out.append(info)
    return out


def extract_fatbin(path: Path | str) -> bytes:
    """The compiled device code of a CUDA library (for ``cuobjdump``); raises if it holds source."""
    blob = elf_symbol_bytes(Path(path), "__tvm_ffi__library_bin")
    _tree, modules = parse_imports_blob(blob[: struct.unpack_from("<Q", blob, 0)[0] + 8])
    for kind, data in modules:
        if kind == "cuda":
            fmt, _table, payload = split_cuda_module_bytes(data)
            if fmt == "cuda":
                raise ValueError(f"{path} holds CUDA source, not compiled code; rebuild it with nvcc available")
            return payload
    raise ValueError(f"{path} has no CUDA module")


# ----------------------------------------------------------------------------------------------
# Artifacts and manifests
# ----------------------------------------------------------------------------------------------


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

    out = {
        "schema": MANIFEST_SCHEMA,
        "name": key.name,
        "library": f"{key.name}.so",
        "config": asdict(key.spec),
        "family": key.family,
        "rope_mode": key.rope_mode,
        "sliding": key.sliding,
        "local": key.local,
        "target": key.target_dir,
        "target_kind": key.spec.target_kind,
        "arch": key.arch,
        "llvm_mcpu": host_llvm_mcpu() if key.spec.target_kind == "llvm" else None,
        "tvm_version": tvm.__version__,
        "sources_hash": sources_hash(key.family),
        "kernels": sorted(names),
    }
    if key.rope_scaling is not None:
        out["rope_scaling"] = key.rope_scaling.to_dict()
    return out


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_dir_manifest(target_dir: Path | str) -> Path:
    """Rewrite ``<target_dir>/manifest.json`` from the per-artifact jsons there (under a file lock).

    The result lists every artifact whose library exists, sorted by name; it never depends on which
    process wrote last.
    """
    target_dir = Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(target_dir / ".manifest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        artifacts = []
        for jpath in sorted(target_dir.glob("*.json")):
            if jpath.name == MANIFEST_NAME:
                continue
            try:
                entry = json.loads(jpath.read_text())
            except ValueError:
                continue
            if isinstance(entry, dict) and (target_dir / entry.get("library", "")).is_file():
                artifacts.append(entry)
        import tvm

        manifest = {
            "schema": MANIFEST_SCHEMA,
            "target": target_dir.name,
            "tvm_version": tvm.__version__,
            "artifacts": sorted(artifacts, key=lambda e: e["name"]),
        }
        path = target_dir / MANIFEST_NAME
        _atomic_write(path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path


def family_kernels(key: BuildKey) -> dict:
    """``{name: PrimFunc}`` of ``key``'s kernel family."""
    from . import tir

    if key.family == "interop":
        from .tir import interop

        return interop.kernel_set(key.spec)
    if key.family == "mla":
        from .tir import mla

        return mla.kernel_set(key.spec, arch=key.arch)
    variant = {"rope_scaling": key.rope_scaling} if key.rope_scaling is not None else {}  # default: as before
    return tir.kernel_set(
        key.spec, rope_mode=key.rope_mode, sliding=key.sliding, local=key.local, arch=key.arch, **variant
    )


def _build(key: BuildKey, build_dir, *, force: bool, verbose: bool) -> tuple:
    """``(library path, cache_hit)``: compile ``key`` unless an up-to-date artifact exists.

    Processes that want the same artifact at once (test workers, servers started together) take
    turns on a per-artifact file lock: the first compiles, the others then find its library fresh."""
    out = Path(build_dir or default_build_dir()) / key.target_dir
    lib_path = out / f"{key.name}.so"
    man_path = out / f"{key.name}.json"
    if not force and _is_fresh(lib_path, man_path, key.family):
        return lib_path, True
    if _runtime_only():
        raise RuntimeError(
            f"{lib_path} is missing or unreadable and this TVM is runtime-only (TVM_USE_RUNTIME_LIB=1), "
            "so it cannot compile; prebuild it on the build machine (python -m tvmkv build ...) "
            "and carry build/"
        )
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f".{key.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not force and _is_fresh(lib_path, man_path, key.family):
            return lib_path, True  # another process built it while this one waited
        return _compile_artifact(key, out, lib_path, man_path, verbose=verbose)


def _compile_artifact(key: BuildKey, out: Path, lib_path: Path, man_path: Path, *, verbose: bool) -> tuple:
    # (under _build's lock, which made ``out``)
    t0 = time.time()
    funcs = family_kernels(key)
    if verbose:
        print(f"[tvmkv build] compiling {key.target_dir}/{key.name} ({len(funcs)} kernels)", file=sys.stderr)
    module = compile_funcs(funcs, key.spec.target_kind, key.arch)
    t_compile = time.time() - t0
    tmp = out / f".{key.name}.tmp{os.getpid()}.so"
    try:
        device_format = export_module(module, tmp, key.spec.target_kind, key.arch)
        os.replace(tmp, lib_path)
    finally:
        tmp.unlink(missing_ok=True)
    manifest = _manifest(key, funcs)
    manifest["device_format"] = device_format
    if key.spec.target_kind == "cuda" and device_format == "fatbin":
        manifest["nvcc_flags"] = gencode_flags(key.arch) + [f"-diag-suppress={NVCC_DIAG_SUPPRESS}"]
    manifest["sha256"] = hashlib.sha256(lib_path.read_bytes()).hexdigest()
    manifest["nbytes"] = lib_path.stat().st_size
    manifest["build_seconds"] = {"tvm_compile": round(t_compile, 2), "total": round(time.time() - t0, 2)}
    _atomic_write(man_path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    write_dir_manifest(out)
    if verbose:
        print(f"[tvmkv build] wrote {lib_path} in {time.time() - t0:.1f}s", file=sys.stderr)
    return lib_path, False


def build_kernel_set(
    key: BuildKey, build_dir: Path | str | None = None, *, force: bool = False, verbose: bool = False
) -> Path:
    """Compile ``key``'s kernel set into ``build_dir`` unless an up-to-date artifact exists.

    Returns the library path. Writes ``<name>.so``, ``<name>.json`` (its manifest entry) and refreshes
    the directory's ``manifest.json``.
    """
    return _build(key, build_dir, force=force, verbose=verbose)[0]


def _is_fresh(lib_path: Path, man_path: Path, family: str = "kvcache") -> bool:
    if not (lib_path.exists() and man_path.exists()):
        return False
    try:
        manifest = json.loads(man_path.read_text())
    except ValueError:
        return False
    if _runtime_only():
        return True  # a runtime-only TVM cannot rebuild: trust what was carried here
    import tvm

    if manifest.get("sources_hash") != sources_hash(family) or manifest.get("tvm_version") != tvm.__version__:
        return False
    if manifest.get("target_kind") == "llvm" and manifest.get("llvm_mcpu") != host_llvm_mcpu():
        return False  # built for another CPU: its instructions may not exist here
    if manifest.get("nbytes") is not None and manifest["nbytes"] != lib_path.stat().st_size:
        return False  # a library rewritten behind the manifest's back
    want = "cuda" if os.environ.get("TVMKV_CUDA_SOURCE") == "1" else "fatbin"
    return manifest.get("target_kind") != "cuda" or manifest.get("device_format") == want


def _runtime_only() -> bool:
    return os.environ.get("TVM_USE_RUNTIME_LIB") == "1"


def load_kernels(
    spec: KernelSpec | MlaSpec,
    *,
    rope_mode: str = "none",
    sliding: bool = False,
    arch: str | None = None,
    build_dir: Path | str | None = None,
    family: str = "kvcache",
    local: bool = False,
    rope_scaling=None,
    rotary_dim: int | None = None,
) -> KernelLibrary:
    """Kernels for one configuration: from this process's cache, else ``build/``, else compiled.

    ``family`` "kvcache" is a cache's kernel set; "mla" the MLA kernels of ``tvmkv.tir.mla`` (``spec``
    an :class:`~tvmkv.tir.spec.MlaSpec`; the options below do not apply); "interop" the foreign-layout
    copies of
    ``tvmkv.tir.interop`` (``rope_mode``, ``sliding``, ``local`` and the RoPE variant do not apply to
    it). ``local`` adds the per-layer sliding window kernels (``tvmkv.tir.kernel_set``), in a library
    of its own. ``rope_scaling`` (None, TVM's dict or a :class:`~tvmkv.tir.RopeScaling`) and
    ``rotary_dim``: the RoPE variant of ``split_rope``/``rope_q`` (rope mode "normal"; see
    :func:`tvmkv.tir.rope_scaling.kernel_variant`), in a library of its own unless it is the default.
    """
    import tvm

    if spec.target_kind == "cuda" and arch is None:
        arch = default_cuda_arch()
    if family != "kvcache":
        rope_mode, sliding, local, rope_scaling, rotary_dim = "none", False, False, None, None
    variant = kernel_variant(rope_scaling, spec.head_dim, rope_mode, rotary_dim)
    key = BuildKey(
        spec, rope_mode, bool(sliding), arch if spec.target_kind == "cuda" else None, family, bool(local), variant
    )
    lib = _LOADED.get(key)
    if lib is not None:
        STATS["memory_hits"] += 1
        return lib
    path = build_kernel_set(key, build_dir)
    module = tvm.runtime.load_module(str(path))
    STATS["disk_loads"] += 1
    lib = _LOADED[key] = KernelLibrary(key, module, path)
    return lib


def clear_loaded() -> None:
    """Forget this process's loaded libraries (the next :func:`load_kernels` reads ``build/`` again)."""
    _LOADED.clear()


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

_SPEC_KEYS = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype", "kv_dtype")
_CONFIG_KEYS = _SPEC_KEYS + ("rope_mode", "sliding", "local", "target", "arch", "family", "rope_scaling", "rotary_dim")
# family "mla" (tvmkv.tir.MlaSpec): num_qo_heads, page_size and dtype as above, plus these
_MLA_KEYS = ("kv_lora_rank", "qk_rope_head_dim", "self_qk_dim", "self_v_dim")


def expand_configs(entries, defaults: dict) -> list:
    """Configurations from a JSON config: a list of dicts (or one dict) over :data:`_CONFIG_KEYS`.

    Missing keys take ``defaults``; a list value expands into one configuration per item (the cross
    product over all list-valued keys). Returns a list of :class:`BuildKey`, duplicates removed, in order.
    """
    from .tir import ROPE_MODES

    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list):
        raise ValueError(f"a build config must be a list of dicts, got {type(entries).__name__}")
    keys: list = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"config entry {i} is {entry!r}; expected a dict with keys from {_CONFIG_KEYS}")
        unknown = sorted(set(entry) - set(_CONFIG_KEYS) - set(_MLA_KEYS) - {"comment"})
        if unknown:
            raise ValueError(f"config entry {i} has unknown keys {unknown}; allowed keys: {_CONFIG_KEYS}")
        merged = {**defaults, **{k: v for k, v in entry.items() if k != "comment"}}
        axes = {k: (v if isinstance(v, list) else [v]) for k, v in merged.items()}
        for combo in itertools.product(*axes.values()):
            c = dict(zip(axes, combo, strict=True))
            if c["rope_mode"] not in ROPE_MODES:
                raise ValueError(f"config entry {i}: rope_mode={c['rope_mode']!r} is not one of {ROPE_MODES}")
            arch = (c["arch"] or default_cuda_arch()) if c["target"] == "cuda" else None
            family = c.get("family", "kvcache")
            if family == "mla":
                if "kv_lora_rank" not in c or "qk_rope_head_dim" not in c:
                    raise ValueError(f"config entry {i}: family 'mla' needs kv_lora_rank and qk_rope_head_dim")
                mla = MlaSpec(
                    c["num_qo_heads"],
                    c["kv_lora_rank"],
                    c["qk_rope_head_dim"],
                    c["page_size"],
                    c["dtype"],
                    c["target"],
                    self_qk_dim=c.get("self_qk_dim", 0),
                    self_v_dim=c.get("self_v_dim", 0),
                )
                key = BuildKey(mla, "none", False, arch, "mla")
                if key not in keys:
                    keys.append(key)
                continue
            spec = KernelSpec(**{k: c[k] for k in _SPEC_KEYS if k in c}, target_kind=c["target"])  # (kv_dtype optional)
            if family == "kvcache":
                variant = kernel_variant(c.get("rope_scaling"), spec.head_dim, c["rope_mode"], c.get("rotary_dim"))
                key = BuildKey(
                    spec,
                    c["rope_mode"],
                    bool(c["sliding"]),
                    arch,
                    local=bool(c.get("local", False)),
                    rope_scaling=variant,
                )
            else:
                key = BuildKey(spec, "none", False, arch, family)
            if key not in keys:
                keys.append(key)
    return keys


def _build_one(args: tuple) -> tuple:
    key, build_dir, force = args
    t0 = time.time()
    path, hit = _build(key, build_dir, force=force, verbose=False)
    return key, path, hit, time.time() - t0


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tvmkv build",
        description="Compile tvmkv kernel sets into build/<target-dir>/ (cached; --force rebuilds).",
    )
    p.add_argument("--target", choices=("llvm", "cuda"), default="llvm", help="target kind (default llvm)")
    p.add_argument(
        "--arch",
        default=None,
        help=f"CUDA arch(s), comma-separated, of {CUDA_ARCHS}; default $TVMKV_CUDA_ARCH or sm_90 (as sm_90a)",
    )
    p.add_argument("--num-qo-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float16", help="float32, float16 or bfloat16 (default float16)")
    p.add_argument(
        "--kv-dtype",
        default="",
        help="page dtype when it differs: float8_e4m3fn or float8_e5m2 (fp8 pages; default: --dtype)",
    )
    p.add_argument("--rope-mode", default="none", help="none, normal or inline (default none)")
    p.add_argument(
        "--rope-scaling",
        type=json.loads,
        default=None,
        help='TVM\'s rope_scaling dict as JSON, e.g. \'{"rope_type": "gptj"}\' (rope mode normal; default none)',
    )
    p.add_argument("--rotary-dim", type=int, default=None, help="dims of a head that rotate (default: all)")
    p.add_argument("--sliding", action="store_true", help="the sliding-window/attention-sink variant")
    p.add_argument("--local", action="store_true", help="add the per-layer sliding window kernels (*_local)")
    p.add_argument(
        "--family",
        default="kvcache",
        choices=tuple(FAMILY_MODULES),
        help="kernel family: kvcache (a cache's kernel set, default) or interop (foreign-layout copies)",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="JSON file: a list of dicts with keys from " + ", ".join(_CONFIG_KEYS) + " (list values expand); "
        "keys left out take the command-line values",
    )
    p.add_argument("--build-dir", type=Path, default=None, help=f"{BUILD_DIR_HELP}; here: {default_build_dir()}")
    p.add_argument("--force", action="store_true", help="rebuild even when an up-to-date artifact exists")
    p.add_argument("-j", "--jobs", type=int, default=1, help="build this many kernel sets in parallel")
    return p


def main(argv=None) -> int:
    """``python -m tvmkv build ...``: build kernel sets, print one line per set, return the exit code."""
    args = arg_parser().parse_args(argv)
    if args.jobs < 1:
        print(f"tvmkv build: error: -j/--jobs {args.jobs} must be >= 1 (kernel sets built at once)", file=sys.stderr)
        return 2
    try:
        archs = [a.strip() for a in (args.arch or default_cuda_arch()).split(",") if a.strip()]
    except ValueError as err:  # a bad $TVMKV_CUDA_ARCH
        print(f"tvmkv build: error: {err}", file=sys.stderr)
        return 2
    defaults = {
        "num_qo_heads": args.num_qo_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "page_size": args.page_size,
        "dtype": args.dtype,
        "kv_dtype": args.kv_dtype,
        "rope_mode": args.rope_mode,
        "rope_scaling": args.rope_scaling,
        "rotary_dim": args.rotary_dim,
        "sliding": args.sliding,
        "local": args.local,
        "family": args.family,
        "target": args.target,
        "arch": archs if args.target == "cuda" else None,
    }
    try:
        if args.config is not None:
            entries = json.loads(args.config.read_text())
            if args.arch is not None:  # the command line's --arch wins over the file's
                entries = [{**e, "arch": archs} for e in (entries if isinstance(entries, list) else [entries])]
            keys = expand_configs(entries, defaults)
        else:
            keys = expand_configs([{}], defaults)
        for key in keys:
            if key.arch is not None:
                gencode_flags(key.arch)  # validate before spending minutes compiling
    except (ValueError, OSError, NotImplementedError) as err:
        print(f"tvmkv build: error: {err}", file=sys.stderr)
        return 2
    build_dir = args.build_dir or default_build_dir()
    print(f"[tvmkv build] {len(keys)} kernel set(s) -> {build_dir}", flush=True)
    jobs = [(key, build_dir, args.force) for key in keys]
    t0 = time.time()
    failures = 0
    if args.jobs > 1 and len(jobs) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_build_one, job): job[0] for job in jobs}
            for n, fut in enumerate(cf.as_completed(futures), 1):
                failures += _report(n, len(jobs), futures[fut], fut)
    else:
        import concurrent.futures as cf

        for n, job in enumerate(jobs, 1):
            fut = cf.Future()
            try:
                fut.set_result(_build_one(job))
            except Exception as err:  # noqa: BLE001 - reported per kernel set, then the exit code says it
                fut.set_exception(err)
            failures += _report(n, len(jobs), job[0], fut)
    for target_dir in sorted({build_dir / k.target_dir for k in keys}):
        if target_dir.is_dir():
            print(f"[tvmkv build] manifest {write_dir_manifest(target_dir)}")
    print(f"[tvmkv build] done in {time.time() - t0:.1f}s, {failures} failed", flush=True)
    return 1 if failures else 0


def _report(n: int, total: int, key: BuildKey, fut) -> int:
    err = fut.exception()
    if err is not None:
        print(f"[{n}/{total}] {key.target_dir}/{key.name} FAILED: {type(err).__name__}: {err}", flush=True)
        return 1
    _key, path, hit, seconds = fut.result()
    state = "cache hit" if hit else "built"
    print(f"[{n}/{total}] {key.target_dir}/{key.name} {state} in {seconds:.1f}s: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
