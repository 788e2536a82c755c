"""Load TVM's distributed runtime, Disco, in any TVM 0.27 install (the full wheel or the GPU machine's
runtime-only payload), in the controller and in every worker process.

Disco lives in ``libtvm_runtime_extra.so``, which ``import tvm`` loads only beside the compiler
library: in runtime-only mode ``tvm.runtime.disco`` imports with an empty ``_ffi_api`` and its object
types unregistered, and even with the full wheel ``tvm.runtime`` imports ``disco`` before that library
is loaded (``tvm.runtime.disco`` is then ``None``). :func:`load` loads the library, fills the module's
API and registers the session types once; it is idempotent.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

_SESSION_TYPES = ("DRef", "Session", "ThreadedSession", "ProcessSession", "SocketSession")
_LIBS = ("libtvm_runtime.so", "libtvm_runtime_extra.so")


def _lib_dir() -> Path:
    """``tvm/lib`` of the TVM this process imports (the wheel's, or the payload's)."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("no TVM is installed (pip install apache-tvm==0.27.0.post1)")
    return Path(spec.submodule_search_locations[0]) / "lib"


def load():
    """``tvm.runtime.disco``, usable: ``ProcessSession``, ``DRef`` and the worker functions registered.

    Call it before anything touches Disco (in a worker, before its loop starts). On the GPU machine
    run :func:`tvmkv.payload.bootstrap` first, as for any tvmkv program.
    """
    if "tvm" not in sys.modules:  # preload both libraries so that `import tvm` registers Disco itself
        import tvm_ffi  # noqa: F401  (libtvm_ffi.so, which the TVM libraries link against)

        lib_dir = _lib_dir()
        if all((lib_dir / n).exists() for n in _LIBS):
            for name in _LIBS:
                ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
    import tvm
    import tvm_ffi

    extra = _lib_dir() / "libtvm_runtime_extra.so"
    if not extra.exists():
        raise ImportError(
            f"this TVM has no {extra.name} beside {extra.parent}: Disco (tvmkv's tensor parallelism) needs it; "
            "install apache-tvm==0.27.0.post1 (or carry the payload that scripts/make_gpu_payload.sh builds)"
        )
    ctypes.CDLL(str(extra), mode=ctypes.RTLD_GLOBAL)
    import tvm.runtime.disco as disco
    from tvm.runtime.disco import _ffi_api, session

    if not hasattr(_ffi_api, "SessionProcess"):  # the module was imported before the library was loaded
        tvm_ffi.init_ffi_api("runtime.disco", _ffi_api.__name__)
        for name in _SESSION_TYPES:
            tvm_ffi.register_object(f"runtime.disco.{name}")(getattr(session, name))
    tvm.runtime.disco = disco
    return disco
