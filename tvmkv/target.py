"""Targets: what a user may pass as ``target``, and the ``tvm.target.Target`` tvmkv compiles for.

A target is a *kind* ("llvm" for the host CPU, "cuda") and, for CUDA, an *arch* ("sm_90"). Every
place that accepts a target from a user goes through :func:`parse_target`; every place that compiles
goes through :func:`make_target`. The CUDA arch used when none is given is :func:`default_cuda_arch`.

Nothing here imports tvm at module level: a runtime-only TVM (the GPU machine's payload, see
:mod:`tvmkv.payload`) has no ``Target`` constructor, and :func:`parse_target` must work there.
"""

from __future__ import annotations

import functools
import os
from typing import Any

CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
"""CUDA archs tvmkv compiles for (``tvmkv.build.gencode_flags``)."""

BUILTIN_CUDA_ARCH = "sm_90"
"""The CUDA arch when neither the caller nor ``$TVMKV_CUDA_ARCH`` names one."""

CUDA_ARCH_ENV = "TVMKV_CUDA_ARCH"
LLVM_MCPU_ENV = "TVMKV_LLVM_MCPU"

_UNSUPPORTED = "target={!r} is not supported; use 'llvm', 'cuda' or a tvm.target.Target"


@functools.cache
def default_cuda_arch() -> str:
    """The CUDA arch used when none is given: ``$TVMKV_CUDA_ARCH``, else ``sm_90``.

    Read once per process (the first call), so that every library a process builds or loads
    agrees on it; ``default_cuda_arch.cache_clear()`` reads the variable again.

    Raises
    ------
    ValueError
        When ``$TVMKV_CUDA_ARCH`` is not one of :data:`CUDA_ARCHS`.
    """
    arch = os.environ.get(CUDA_ARCH_ENV) or BUILTIN_CUDA_ARCH
    if arch not in CUDA_ARCHS:
        raise ValueError(f"{CUDA_ARCH_ENV}={arch!r} is not supported; set it to one of {CUDA_ARCHS} or unset it")
    return arch


def parse_target(target: Any) -> tuple[str, str | None]:
    """``(kind, arch)`` of a user's target.

    Parameters
    ----------
    target : str, tvm.target.Target or dict
        ``"llvm"`` or ``"cpu"`` (the host CPU), ``"cuda"``; a ``tvm.target.Target`` of kind llvm or
        cuda (its ``arch`` attribute, if any, is kept); or a dict like ``{"kind": "cuda", "arch":
        "sm_90"}`` (``"arch"`` optional; other keys, e.g. ``"mcpu"``, are ignored).

    Returns
    -------
    tuple of (str, str or None)
        ``("llvm", None)`` or ``("cuda", arch)`` where ``arch`` is None when the target does not
        name one (the caller then uses :func:`default_cuda_arch`). The arch is not validated here.

    Raises
    ------
    ValueError
        For any other kind, naming the value and the accepted forms.
    """
    if isinstance(target, str):
        if target in ("llvm", "cpu"):
            return "llvm", None
        if target == "cuda":
            return "cuda", None
        raise ValueError(_UNSUPPORTED.format(target))
    if isinstance(target, dict):
        return _parse_target_dict(target)
    kind = getattr(getattr(target, "kind", None), "name", None)
    if kind == "llvm":
        return "llvm", None
    if kind == "cuda":
        arch = target.attrs.get("arch") if hasattr(target, "attrs") else None
        return "cuda", str(arch) if arch else None
    raise ValueError(_UNSUPPORTED.format(target))


def _parse_target_dict(target: dict) -> tuple[str, str | None]:
    kind = target.get("kind")
    if kind in ("llvm", "cpu"):
        return "llvm", None
    if kind != "cuda":
        raise ValueError(
            f"target={target!r} is not supported; a dict target needs 'kind' 'llvm' or 'cuda', "
            "e.g. {'kind': 'cuda', 'arch': 'sm_90'}"
        )
    arch = target.get("arch")
    if arch is not None and not isinstance(arch, str):
        raise ValueError(f"target={target!r}: 'arch' must be a string like 'sm_90', got {type(arch).__name__}")
    return "cuda", arch or None


def host_llvm_mcpu() -> str:
    """The ``-mcpu`` of CPU builds: ``$TVMKV_LLVM_MCPU``, else this machine's CPU as LLVM names it.

    Without it LLVM targets generic x86-64 (SSE2, no FMA, no F16C: every fp16 load becomes a libcall),
    which made the CPU decode kernel 7x (fp32) to 20x (fp16) slower on an AVX2 EPYC. Set
    ``TVMKV_LLVM_MCPU=generic`` for libraries that must run on any x86-64.
    """
    env = os.environ.get(LLVM_MCPU_ENV)
    if env:
        return env
    import tvm

    try:
        return str(tvm.target.codegen.llvm_get_system_cpu())
    except Exception:  # noqa: BLE001 - an LLVM without host detection: stay portable
        return "generic"


def make_target(kind: str, arch: str | None = None) -> Any:
    """The ``tvm.target.Target`` tvmkv compiles for.

    Parameters
    ----------
    kind : str
        "llvm" (the host CPU, ``-mcpu`` from :func:`host_llvm_mcpu`) or "cuda".
    arch : str, optional
        CUDA only, e.g. "sm_90"; default :func:`default_cuda_arch`. Ignored for "llvm".

    Raises
    ------
    ValueError
        For any other kind.
    """
    import tvm

    if kind == "llvm":
        mcpu = host_llvm_mcpu()
        return tvm.target.Target({"kind": "llvm"} if mcpu == "generic" else {"kind": "llvm", "mcpu": mcpu})
    if kind == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": arch or default_cuda_arch()})
    raise ValueError(f"target kind {kind!r} is not supported; use 'llvm' or 'cuda'")
