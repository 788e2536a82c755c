"""A randomized stateful episode under CPython's debug allocator (issue 14).

``PYTHONMALLOC=debug`` fills freed memory with a pattern and checks buffer ends, so a view whose
DLPack struct was freed (issue 14's use-after-free in the index buffer's view cache) crashes or reads
garbage instead of passing silently. The episode (``p4-views-all`` of
:data:`tvmkv.testing.configs.STATEFUL_CONFIGS`, longer and with another seed) mixes every operation
family: imports and exports into reused ids, swap, prefix reuse, repeated decode steps among forwards
of varied shapes, so that one index-buffer slot caches more than 512 views and the view cache is
dropped while forwards still hold views from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tvmkv.runtime import interop
from tvmkv.testing import make_cache
from tvmkv.testing.configs import STATEFUL_CONFIGS

CONFIG = next(c for c in STATEFUL_CONFIGS if c.name == "p4-views-all")
SEED, NUM_OPS, KV_EVERY = 16, 2000, 20

_EPISODE = textwrap.dedent(
    f"""
    import json
    from tvmkv.testing import make_cache
    from tvmkv.testing.configs import STATEFUL_CONFIGS
    from tvmkv.testing.stateful import Mismatch, run_random

    config = next(c for c in STATEFUL_CONFIGS if c.name == {CONFIG.name!r})
    cache = make_cache(**config.cache)
    try:
        _, runner = run_random(
            cache, {SEED}, {NUM_OPS}, kv_every={KV_EVERY}, extras=config.extras, id_pool=config.id_pool
        )
        out = dict(mismatches=0, ops=runner.steps, max_views=runner.max_views(), stats=runner.stats)
    except Mismatch as err:
        out = dict(mismatches=1, error=str(err)[-3000:], leaked=err.leaked)
    print(json.dumps(out))
    """
)


def test_random_episode_under_the_debug_allocator():
    cache = make_cache(**CONFIG.cache)  # build (or load) the kernels here, not under the slow allocator
    interop.interop_kernels(cache)
    env = {**os.environ, "PYTHONMALLOC": "debug"}
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", _EPISODE], capture_output=True, text=True, timeout=240, env=env, cwd=root
    )
    assert run.returncode == 0, f"exit status {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["mismatches"] == 0, out["error"]
    stats = out["stats"]
    assert out["ops"] >= NUM_OPS and out["max_views"] > 512, out
    for kind in ("import@reused", "export", "swap_in", "prefix_add@hit", "fwd@repeated"):
        assert stats.get(kind, 0) > 0, f"no {kind!r} in the episode: {stats}"
