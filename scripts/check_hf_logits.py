"""Check logits written by ``python -m tvmkv generate --model DIR --save-logits NPZ`` (e.g. on a runtime-only
GPU host without transformers) against transformers' own model of the checkpoint, here.

    python scripts/check_hf_logits.py DIR NPZ [NPZ ...]      exit 1 when any differs
"""

from __future__ import annotations

import sys

import numpy as np

from tvmkv.hf_generate import check


def main(argv) -> int:
    directory, files = argv[0], argv[1:]
    status = 0
    for f in files:
        with np.load(f) as z:
            ok, report = check(directory, z["prompt_ids"], z["tokens"], z["logits"], str(z["dtype"]))
        print(f"{f}: {report}")
        status |= not ok
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
