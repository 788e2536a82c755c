"""Long randomized soak of ``PagedAttentionKVCache`` against the NumPy model (tvmkv.testing.stateful).

Runs ``--ops`` random operations (valid ones and deliberate misuse, on caches with few pages) with
tiny shapes, in episodes of ``--reset-every`` operations that take the configurations of
tests/test_stateful.py (``tvmkv.testing.configs.STATEFUL_CONFIGS``, or those ``--configs`` names) in
turn, each with its own cache, operation families (import/export into reused ids, swap, prefix
reuse, varied batch shapes past 512 cached index views) and id pool; episode ``i`` uses seed
``--seed + i``. Every operation's outcome (success, or which exception) is predicted and checked, with
``check_integrity()``, page sharing, lengths and free pages checked after every operation; attention
outputs on every forward; exported K/V on every export; stored K/V every ``--kv-every`` operations,
after every import, prefix hit and swap-in, and at the end of each episode. At the end of an episode
all sequences are removed (and the prefix tree dropped) and the free list must be whole again (a
leak check).

    .venv/bin/python bench/soak.py --ops 100000 --seed 0 --target llvm

Prints one progress line per episode and a final summary (operations run, mismatches, leaked pages,
wall time, rate, per configuration: operations and the most index views one slot cached); ``--json
PATH`` also writes the summary as JSON. On cuda every configuration's kernel set (and its "interop"
family) must be built; ``--configs p4-normal-window,p4-interop-swap,p4-prefix,p4-views-all`` keeps
to the kernel set of ``STATEFUL_CACHE``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tvmkv without an install (the GPU machine)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=100_000, help="operations to run (default 100000)")
    ap.add_argument("--seed", type=int, default=0, help="first episode seed (episode i uses seed + i)")
    ap.add_argument("--target", default="llvm", choices=["llvm", "cuda"])
    ap.add_argument(
        "--configs", default="all", help="comma-separated STATEFUL_CONFIGS names, taken in turn (default: all)"
    )
    cache_args = ap.add_argument_group(
        "cache", "left out: as in the stateful tests (each configuration's tvmkv.testing.configs entry)"
    )
    cache_args.add_argument("--page-size", type=int)
    cache_args.add_argument("--num-pages", type=int, help="pages in the pool (few, so it runs out)")
    cache_args.add_argument("--rope-mode", choices=["none", "normal", "inline"])
    cache_args.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    ap.add_argument(
        "--decode-splits", type=int, default=None, help="the cache's decode_splits (N > 1 forces flash-decoding)"
    )
    ap.add_argument("--kv-every", type=int, default=50, help="compare stored K/V every N operations")
    ap.add_argument("--reset-every", type=int, default=2000, help="operations per episode (leak check after)")
    ap.add_argument("--misuse", type=float, default=0.15, help="probability of a deliberate misuse")
    ap.add_argument("--max-mismatches", type=int, default=5, help="stop after this many failing episodes")
    ap.add_argument("--shrink", action="store_true", help="shrink each counterexample (slow)")
    ap.add_argument("--time-limit", type=float, default=0, help="stop after this many seconds (0 = none)")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args(argv)
    from tvmkv.payload import bootstrap

    bootstrap()  # $TVMKV_PAYLOAD: the GPU machine's runtime-only TVM, before tvm is imported

    from tvmkv.testing import make_cache
    from tvmkv.testing.configs import STATEFUL_CONFIGS
    from tvmkv.testing.stateful import Mismatch, run_random, shrink

    by_name = {c.name: c for c in STATEFUL_CONFIGS}
    names = list(by_name) if args.configs == "all" else args.configs.split(",")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        ap.error(f"unknown --configs {unknown}; choose from {list(by_name)}")
    given = dict(page_size=args.page_size, num_pages=args.num_pages, rope_mode=args.rope_mode, dtype=args.dtype)
    given = {k: v for k, v in given.items() if v is not None}
    t_build = time.time()
    caches = {
        n: make_cache(args.target, **{**by_name[n].cache, **given}, decode_splits=args.decode_splits) for n in names
    }
    build_s = time.time() - t_build
    ops_run = rejected = leaked = episodes = 0
    mismatches, stats = [], {}
    per_config = {n: {"operations": 0, "episodes": 0, "max_views_per_slot": 0} for n in names}
    t0 = time.time()
    seed = args.seed
    while ops_run < args.ops and len(mismatches) < args.max_mismatches:
        if args.time_limit and time.time() - t0 > args.time_limit:
            break
        name = names[episodes % len(names)]
        config, cache = by_name[name], caches[name]
        n = min(args.reset_every, args.ops - ops_run)
        try:
            _, runner = run_random(
                cache,
                seed,
                n,
                kv_every=args.kv_every,
                misuse=args.misuse,
                extras=config.extras,
                id_pool=config.id_pool,
            )
        except Mismatch as err:
            runner, step = err.runner, err.runner.steps - 1
            leaked += err.leaked
            entry = {"config": name, "seed": seed, "step": step, "error": str(err)[:2000]}
            if args.shrink:
                entry["shrunk"] = shrink(cache, err.ops, seed)
            mismatches.append(entry)
            print(f"MISMATCH {name} seed {seed} step {step}: {str(err)[:500]}", flush=True)
        ops_run += runner.steps
        rejected += runner.rejected
        for k, v in runner.stats.items():
            stats[k] = stats.get(k, 0) + v
        mine = per_config[name]
        mine["operations"] += runner.steps
        mine["episodes"] += 1
        mine["max_views_per_slot"] = max(mine["max_views_per_slot"], runner.max_views())
        episodes += 1
        seed += 1
        elapsed = time.time() - t0
        print(
            f"{ops_run:>8} ops  {elapsed:8.1f}s  {ops_run / elapsed:7.0f} ops/s  "
            f"mismatches {len(mismatches)}  "
            f"leaked pages {leaked}  ({name} seed {seed - 1}: {runner.steps} ops, "
            f"max views/slot {runner.max_views()})",
            flush=True,
        )
    wall = time.time() - t0
    summary = {
        "operations": ops_run,
        "episodes": episodes,
        "rejected_calls": rejected,
        "mismatches": len(mismatches),
        "leaked_pages": leaked,
        "wall_s": round(wall, 1),
        "ops_per_s": round(ops_run / max(wall, 1e-9), 1),
        "build_s": round(build_s, 1),
        "target": args.target,
        "seed": args.seed,
        "configs": {
            n: {**per_config[n], "cache": {**by_name[n].cache, **given}, "extras": list(by_name[n].extras)}
            for n in names
        },
        "decode_splits": args.decode_splits,
        "kv_every": args.kv_every,
        "reset_every": args.reset_every,
        "op_counts": dict(sorted(stats.items())),
        "failures": mismatches,
    }
    print(
        f"\nsoak: {ops_run} operations ({rejected} rejected as misuse) in {wall:.1f}s "
        f"({summary['ops_per_s']} ops/s, {episodes} episodes, target {args.target}); "
        f"mismatches: {len(mismatches)}; leaked pages: {leaked}"
    )
    for n in names:
        c = per_config[n]
        print(f"  {n}: {c['operations']} ops in {c['episodes']} episodes, max views/slot {c['max_views_per_slot']}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if mismatches or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
