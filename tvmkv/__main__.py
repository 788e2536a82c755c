"""``python -m tvmkv {build,replay,generate} ...``"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"build": "tvmkv.build", "replay": "tvmkv.replay", "generate": "tvmkv.generate"}
    if not argv or argv[0] not in commands:
        print("usage: python -m tvmkv {build,replay,generate} [options]  (COMMAND --help: its options)")
        return 2
    import importlib
    import os

    payload = os.environ.get("TVMKV_PAYLOAD")  # GPU host with a runtime-only TVM (scripts/gpu_suite.sh)
    if payload:
        sys.path.insert(0, payload)
        import tvm_cuda_runtime  # noqa: F401  (loads TVM's CUDA runtime before anything touches CUDA)

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
