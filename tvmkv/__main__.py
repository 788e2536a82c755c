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

    from .payload import bootstrap

    bootstrap()  # $TVMKV_PAYLOAD: a GPU host with a runtime-only TVM (scripts/gpu_suite.sh)
    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
