"""Check prebuilt tvmkv CUDA libraries on the GPU machine: they load and run with no CUDA compiler.

Usage (on the GPU machine, after ``source .devpayload/setup.sh``; ``scripts/gpu_suite.sh`` runs it)::

    TVMKV_PAYLOAD=$PWD/.devpayload python3 scripts/check_prebuilt_kernels.py build/cuda-sm_90 [--allow-source]

For every ``kvcache_*.so`` listed in the directory's ``manifest.json``: load it (timed), then run
``copy_page`` once and compare with NumPy. ``tvm_callback_cuda_compile`` is replaced by a function that
raises, so a library that still carried CUDA source (compiled at load) fails loudly, unless
``--allow-source``. Exit code 0 when every library passed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tvmkv without an install (the GPU machine)

import numpy as np  # noqa: E402

from tvmkv.payload import bootstrap  # noqa: E402


def main(argv) -> int:
    if not argv:
        print(__doc__)
        return 2
    bootstrap()  # $TVMKV_PAYLOAD: the runtime-only TVM's CUDA backend, before tvm is imported
    import tvm
    import tvm_ffi

    lib_dir = Path(argv[0])
    if "--allow-source" not in argv:

        @tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
        def _refuse(code, *_):
            raise RuntimeError("a library asked to compile CUDA source at load: it was not built as a fatbin")

    manifest = json.loads((lib_dir / "manifest.json").read_text())
    dev = tvm.cuda(0)
    print(f"device: {dev.device_name}, compute {dev.compute_version}; {len(manifest['artifacts'])} libraries")
    failed = 0
    for entry in manifest["artifacts"]:
        path = lib_dir / entry["library"]
        try:
            t0 = time.perf_counter()
            mod = tvm.runtime.load_module(str(path))
            t_load = time.perf_counter() - t0
            cfg = entry["config"]
            p, dtype = cfg["page_size"], cfg["dtype"]
            rng = np.random.default_rng(0)
            if entry.get("family") == "interop":
                print(f"ok   {entry['name']}: load {t_load * 1e3:.1f} ms (interop copies: loaded only)")
                continue
            if "latent_dim" in cfg:  # an MLA set (tvmkv.tir.MlaSpec): pages [num_pages, P, D]
                page_shape, copy = (p, cfg["latent_dim"] + cfg["rope_dim"]), "mla_copy_page"
            else:
                page_shape, copy = (2, cfg["num_kv_heads"], p, cfg["head_dim"]), "copy_page"
            host = rng.standard_normal((4, *page_shape)).astype("float32")
            if dtype == "bfloat16":
                import ml_dtypes

                host = host.astype(ml_dtypes.bfloat16)
            else:
                host = host.astype(dtype)
            pages = tvm.runtime.tensor(host, dev)
            t0 = time.perf_counter()
            mod[copy](pages, 1, 2, p)
            dev.sync()
            t_first = time.perf_counter() - t0
            got = pages.numpy()
            ok = np.array_equal(got[2].astype("float32"), host[1].astype("float32"))
            ok = ok and np.array_equal(got[[0, 1, 3]].astype("float32"), host[[0, 1, 3]].astype("float32"))
            print(
                f"{'ok  ' if ok else 'FAIL'} {entry['name']}: load {t_load * 1e3:.1f} ms, "
                f"first call {t_first * 1e3:.1f} ms, format {entry.get('device_format')}"
            )
            failed += not ok
        except Exception as err:  # noqa: BLE001 - one line per library, exit code at the end
            print(f"FAIL {entry['name']}: {type(err).__name__}: {str(err)[:400]}")
            failed += 1
    print(f"{len(manifest['artifacts']) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
