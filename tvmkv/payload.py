"""The GPU machine's runtime-only TVM: the one bootstrap every entry point runs before ``import tvm``.

On a GPU host without a TVM compiler, ``scripts/make_gpu_payload.sh`` carries a runtime-only TVM and
``tvm_cuda_runtime.py`` (which loads TVM's CUDA backend) in ``.devpayload/``. ``TVMKV_PAYLOAD``
names that folder; :func:`bootstrap` puts it on ``sys.path`` and imports ``tvm_cuda_runtime``, which
must happen before anything touches CUDA. Without ``TVMKV_PAYLOAD`` it does nothing.

This module imports nothing from tvm, and neither does ``import tvmkv`` (a test checks both), so
``from tvmkv.payload import bootstrap; bootstrap()`` may be the first thing a program does.
"""

from __future__ import annotations

import importlib
import os
import sys

PAYLOAD_ENV = "TVMKV_PAYLOAD"
RUNTIME_MODULE = "tvm_cuda_runtime"


def bootstrap() -> str | None:
    """Load the runtime-only TVM's CUDA backend when ``$TVMKV_PAYLOAD`` is set; idempotent.

    Returns
    -------
    str or None
        The payload folder, or None when ``TVMKV_PAYLOAD`` is unset or empty (nothing done).

    Raises
    ------
    ImportError
        When the folder has no ``tvm_cuda_runtime.py``: it was not built by
        ``scripts/make_gpu_payload.sh`` (or not carried), and CUDA would fail later with a less
        helpful error.
    """
    payload = os.environ.get(PAYLOAD_ENV)
    if not payload:
        return None
    if payload not in sys.path:
        sys.path.insert(0, payload)
    try:
        importlib.import_module(RUNTIME_MODULE)
    except ModuleNotFoundError as err:
        if err.name != RUNTIME_MODULE:
            raise
        raise ImportError(
            f"{PAYLOAD_ENV}={payload!r} has no {RUNTIME_MODULE}.py; point it at the .devpayload/ folder "
            "that scripts/make_gpu_payload.sh wrote (and source its setup.sh), or unset it to use an "
            "installed TVM"
        ) from err
    return payload
