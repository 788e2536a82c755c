"""``python -m tvmkv {build,replay,generate} ...``"""

from __future__ import annotations

import sys

COMMANDS = {  # command -> (module, one line of what it does)
    "build": ("tvmkv.build", "compile kernel sets into build/<target>/ with a manifest"),
    "replay": ("tvmkv.replay", "replay operation sequences and check them against the NumPy model"),
    "generate": ("tvmkv.generate", "greedy generation with the tiny Relax Llama on tvmkv's cache, checked"),
}
USAGE = "usage: python -m tvmkv {build,replay,generate} [options]  (COMMAND --help: its options)"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE + "\n\ncommands:")
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:<10} {what}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = "a command is required" if not argv else f"unknown command {argv[0]!r}"
        print(f"{USAGE}\ntvmkv: error: {problem}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    from .payload import bootstrap

    bootstrap()  # $TVMKV_PAYLOAD: a GPU host with a runtime-only TVM (scripts/gpu_suite.sh)
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
