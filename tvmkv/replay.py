"""Replay operation sequences on a ``PagedAttentionKVCache`` and check them against ``CacheModel``.

A scenario is data: a list of operations, each a list whose first item names it.

    ["add", sid]                      add_sequence
    ["remove", sid]                   remove_sequence
    ["fork", parent, child, pos]      fork_sequence (pos -1 = full length)
    ["pop", sid, n]                   pop_n
    ["window", sid, size, sink]       enable_sliding_window_for_seq
    ["fwd", [[sid, n], ...]]          begin_forward / attention on every layer / end_forward
    ["tree", [[sid, [parent, ...]], ...]]   a token-tree forward (parents index uncommitted nodes)
    ["commit", [[sid, leaf], ...]]    commit_accepted_token_tree_nodes

The cache is :func:`tvmkv.testing.make_cache`'s (the replay shape unless options change it). After
every operation the cache's integrity is checked and every sequence's stored K/V is compared
with the model; every attention output of every layer is compared too.

``python -m tvmkv replay [--target llvm] [--dtype float32] [SCENARIO ...]`` prints a table per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

from .config import CacheConfig
from .reference.cache_model import CacheModel
from .runtime.sharding import ShardLayout
from .runtime.tensors import numpy_dtype
from .testing import cache_kwargs, make_cache, make_sharded_cache


def _tvm_operation_seq():
    """The operation sequence of TVM's own paged-KV-cache unit test (seed 003)."""
    seq = [[(0, 6)], [(1, 8)], [(2, 11)], [(3, 16)], [(4, 19), (5, 20)]]
    seq += [[(6, 21), (7, 24)], [(2, 5), (4, 7), (8, 24)]]
    seq += [[(6, 13)], [(8, 19)], [(0, 1)], [(1, 3), (3, 8), (5, 12), (7, 11)]]
    seq += [[(i, 1) for i in range(9)]] * 2
    seq += [[(0, 1), (2, 1), (4, 1), (6, 1), (8, 1)]]
    seq += [[(4, 1), (5, 1), (6, 1), (7, 1), (8, 1)]]
    ops, seen = [], set()
    for batch in seq:
        for sid, _ in batch:
            if sid not in seen:
                seen.add(sid)
                ops.append(["add", sid])
        ops.append(["fwd", [list(x) for x in batch]])
    ops += [["remove", s] for s in (4, 0, 8, 2, 7, 1, 3, 6, 5)]
    return ops


SCENARIOS = {
    "tvm_operation_seq": _tvm_operation_seq(),
    "fork": [
        ["add", 0],
        ["fwd", [[0, 13]]],
        ["fork", 0, 1, -1],
        ["fork", 0, 2, 5],
        ["fwd", [[0, 3], [1, 2], [2, 4]]],
        ["fork", 1, 3, 9],
        ["fork", 3, 4, -1],
        ["fwd", [[3, 1], [4, 5], [0, 1]]],
        ["fwd", [[i, 1] for i in range(5)]],
        ["fork", 2, 5, 0],
        ["fwd", [[5, 7], [2, 1]]],
        ["remove", 1],
        ["fwd", [[3, 1], [4, 1]]],
        ["remove", 0],
        ["remove", 4],
        ["remove", 2],
        ["remove", 3],
        ["remove", 5],
    ],
    "pop": [
        ["add", 0],
        ["fwd", [[0, 20]]],
        ["pop", 0, 3],
        ["fwd", [[0, 2]]],
        ["fork", 0, 1, -1],
        ["pop", 0, 5],
        ["fwd", [[0, 1], [1, 1]]],
        ["pop", 1, 16],
        ["fwd", [[1, 4], [0, 3]]],
        ["pop", 0, 0],
        ["pop", 1, 8],
        ["fwd", [[0, 1], [1, 1]]],
        ["remove", 0],
        ["remove", 1],
    ],
    "sliding": [
        ["add", 0],
        ["add", 1],
        ["add", 2],
        ["window", 0, 12, 3],
        ["window", 1, 9, 0],
        ["fwd", [[0, 20], [1, 6]]],
        ["fwd", [[0, 1], [1, 1]]],
        ["fwd", [[0, 5], [1, 7], [2, 4]]],
        ["fwd", [[0, 1], [1, 1], [2, 1]]],
        ["window", 2, 8, 2],
        ["fwd", [[0, 1], [1, 1], [2, 9]]],
        ["fwd", [[i, 1] for i in range(3)]],
        ["pop", 0, 2],
        ["fwd", [[0, 2], [2, 1]]],
        ["remove", 1],
        ["remove", 0],
        ["remove", 2],
    ],
    "tree": [
        ["add", 0],
        ["add", 1],
        ["add", 2],
        ["fwd", [[0, 9], [1, 4], [2, 1]]],
        ["tree", [[0, [-1, 0, 0, 1, -1]], [1, [-1, 0, 1, 2]], [2, [-1]]]],
        ["tree", [[1, [3, 4]], [0, [2, 5]]]],
        ["commit", [[1, 5], [0, 6], [2, -1]]],
        ["fwd", [[0, 1], [1, 1], [2, 2]]],
        ["tree", [[2, [-1, 0, 0, 2, -1]]]],
        ["commit", [[2, 3]]],
        ["tree", [[0, [-1, 0]], [1, [-1]]]],
        ["commit", [[0, -1], [1, 0]]],
        ["fwd", [[0, 1], [1, 1], [2, 1]]],
        ["remove", 2],
        ["remove", 0],
        ["remove", 1],
    ],
}
NEEDS_SLIDING = {"sliding"}


# stored K/V vs the model: K may be rotated in fp32 (cache) vs fp64 (model), one rounding apart
STORED_TOL = {
    "float32": dict(atol=1e-5, rtol=1e-5),
    "float16": dict(atol=2e-3, rtol=2e-3),
    "bfloat16": dict(atol=1.6e-2, rtol=1.6e-2),
}


@dataclass
class StepRow:
    step: int
    op: str
    batch: int
    tokens: int
    pages_used: int
    pages_free: int
    max_err: float


def _fmt_op(op) -> str:
    text = op[0] + (" " + " ".join(str(x) for x in op[1:]) if len(op) > 1 else "")
    return text if len(text) <= 48 else text[:45] + "..."


class Replayer:
    """Drives a cache and a model side by side and checks them after every operation."""

    def __init__(self, cache, *, seed=0, atol=None, rtol=None):
        cfg = cache.config
        self.cache = cache
        self.model = CacheModel.of(cfg)
        self.rng = np.random.default_rng(seed)
        tight = cfg.dtype == "float32"
        self.atol = atol if atol is not None else (1e-4 if tight else 1e-3 if cfg.dtype == "float16" else 2e-2)
        self.rtol = rtol if rtol is not None else (1e-4 if tight else 1e-3 if cfg.dtype == "float16" else 2e-2)
        self.initial_free = cache.num_available_pages()

    def run(self, ops, on_row=None) -> list:
        rows = []
        for step, op in enumerate(ops):
            err, batch, tokens = self.apply(op)
            self.cache.check_integrity()
            self.check_kv()
            total = self.cache.config.total_pages
            row = StepRow(
                step,
                _fmt_op(op),
                batch,
                tokens,
                total - self.cache.num_available_pages(),
                self.cache.num_available_pages(),
                err,
            )
            rows.append(row)
            if on_row:
                on_row(row)
        return rows

    def apply(self, op):
        cache, model, kind = self.cache, self.model, op[0]
        if kind == "add":
            cache.add_sequence(op[1])
            model.add(op[1])
        elif kind == "remove":
            cache.remove_sequence(op[1])
            model.remove(op[1])
        elif kind == "fork":
            cache.fork_sequence(op[1], op[2], op[3])
            model.fork(op[1], op[2], op[3])
        elif kind == "pop":
            cache.pop_n(op[1], op[2])
            model.pop(op[1], op[2])
        elif kind == "window":
            cache.enable_sliding_window_for_seq(op[1], op[2], op[3])
            model.enable_window(op[1], op[2], op[3])
        elif kind in ("fwd", "tree"):
            ids = [x[0] for x in op[1]]
            if kind == "fwd":
                lengths, parents, flat = [x[1] for x in op[1]], None, None
            else:
                parents = [list(x[1]) for x in op[1]]
                lengths = [len(p) for p in parents]
                flat = [p for ps in parents for p in ps]
            return self.forward(ids, lengths, parents, flat), len(ids), sum(lengths)
        elif kind == "commit":
            ids, leaves = [x[0] for x in op[1]], [x[1] for x in op[1]]
            cache.commit_accepted_token_tree_nodes(ids, leaves)
            model.commit(ids, leaves)
        else:
            raise ValueError(
                f"unknown replay operation {op[0]!r}; expected one of add/remove/fork/pop/window/fwd/tree/commit"
            )
        return 0.0, 0, 0

    def forward(self, ids, lengths, parents, flat, *, after_begin=None) -> float:
        """One forward of ``ids`` on the cache and the model; returns the largest output difference.

        ``after_begin(cache)``, when given, runs between ``begin_forward`` and the first layer (the
        stateful runner makes the calls an open forward forbids there).
        """
        cfg = self.cache.config
        n = sum(lengths)
        self.cache.begin_forward(ids, lengths, flat)
        self.model.begin(ids, lengths, parents)
        if after_begin is not None:
            after_begin(self.cache)
        worst = 0.0
        for layer in range(cfg.num_layers):
            qkv = self.rng.uniform(-1, 1, (n, cfg.qkv_heads, cfg.head_dim)).astype(numpy_dtype(cfg.dtype))
            o = self.cache.attention_with_fused_qkv(layer, qkv)
            ref, _ = self.model.attention(layer, qkv)
            o = np.asarray(o, np.float64)
            worst = max(worst, float(np.abs(o - ref).max()))
            np.testing.assert_allclose(
                o,
                ref,
                atol=self.atol,
                rtol=self.rtol,
                err_msg=f"attention output of layer {layer}, seqs {ids}, lengths {lengths}",
            )
        self.cache.end_forward()
        self.model.end()
        return worst

    def check_kv(self) -> None:
        for sid in self.cache.sequence_ids():
            assert self.cache.sequence_length(sid) == self.model.length(sid), f"length of sequence {sid}"
            pos, k_ref, v_ref = self.model.kept_kv(sid)
            if len(pos) == 0:
                continue
            # kept tokens form at most two contiguous runs (sink and window)
            breaks = np.nonzero(np.diff(pos) != 1)[0] + 1
            for run in np.split(np.arange(len(pos)), breaks):
                k, v = self.cache.debug_get_kv(sid, int(pos[run[0]]), int(pos[run[-1]]) + 1)
                tol = STORED_TOL[self.cache.config.dtype]
                np.testing.assert_allclose(
                    np.asarray(k, np.float64), k_ref[:, run], **tol, err_msg=f"stored K of sequence {sid}"
                )
                np.testing.assert_allclose(
                    np.asarray(v, np.float64), v_ref[:, run], **tol, err_msg=f"stored V of sequence {sid}"
                )

    def check_drained(self) -> None:
        """After every sequence is removed the free list is whole again."""
        if not self.cache.sequence_ids():
            free = self.cache.num_available_pages()
            assert free == self.initial_free, f"{self.initial_free - free} pages leaked"


def replay(name, *, target="llvm", on_row=None, seed=0, tensor_parallel=1, **options) -> list:
    """Replay scenario ``name`` on a fresh cache; raises AssertionError on any mismatch.

    The cache is :func:`tvmkv.testing.make_cache` with ``options`` (by default the replay shape; the
    sliding-window kernels when the scenario needs them). ``decode_splits`` is the cache's option (an
    int > 1 forces flash-decoding on every decode step). ``tensor_parallel`` > 1 replays on that many
    shards in lockstep (:class:`tvmkv.ShardedKVCache`, KV heads replicated when fewer than shards),
    checked against the same unsharded model, and the shards' page tables against each other after
    every operation. Returns one :class:`StepRow` per operation.
    """
    sliding = name in NEEDS_SLIDING
    if tensor_parallel > 1:
        cache = make_sharded_cache(tensor_parallel, target, sliding=sliding, **options)
    else:
        cache = make_cache(target, sliding=sliding, **options)
    r = Replayer(cache, seed=seed)
    rows = r.run(SCENARIOS[name], on_row=on_row)
    r.check_drained()
    return rows


_FLAGS = {  # cache parameter -> the option that sets it
    "head_dim": "--head-dim",
    "num_qo_heads": "--num-qo-heads",
    "num_kv_heads": "--num-kv-heads",
    "page_size": "--page-size",
    "decode_splits": "--decode-splits",
    "tensor_parallel": "--tensor-parallel",
}


def _check_options(args) -> str | None:
    """The first bad option as one line (None when all are good), found before any cache is built."""
    for name, flag in _FLAGS.items():
        value = getattr(args, name)
        if value is not None and value <= 0:
            return f"{flag} {value} must be a positive int"
    kw = cache_kwargs(
        args.target,
        dtype=args.dtype,
        head_dim=args.head_dim,
        num_qo_heads=args.num_qo_heads,
        num_kv_heads=args.num_kv_heads,
        page_size=args.page_size,
        rope_mode=args.rope_mode,
        decode_splits=args.decode_splits,
    )
    kw["target_kind"] = kw.pop("target")
    try:
        CacheConfig(**kw)  # the cache's own checks (head_dim a multiple of 16, GQA group, page size ...)
    except ValueError as err:
        flag = next((f for name, f in _FLAGS.items() if str(err).startswith(name + "=")), None)
        return f"{err}" + (f" (option {flag})" if flag else "")
    try:
        ShardLayout(kw["num_qo_heads"], kw["num_kv_heads"], args.tensor_parallel)
    except ValueError as err:
        return f"{err} (option --tensor-parallel)"
    if args.target == "cuda":
        import tvm

        if not tvm.cuda(0).exist:
            return "--target cuda but no CUDA device is present; use --target llvm"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tvmkv replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios", nargs="*", help=f"scenario names (default: all): {', '.join(SCENARIOS)}")
    ap.add_argument("--target", default="llvm", choices=["llvm", "cuda"])
    shape = cache_kwargs()  # the replay shape: tvmkv.testing.make_cache's defaults
    ap.add_argument("--dtype", default=shape["dtype"], choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--head-dim", type=int, default=shape["head_dim"])
    ap.add_argument("--num-qo-heads", type=int, default=shape["num_qo_heads"])
    ap.add_argument("--num-kv-heads", type=int, default=shape["num_kv_heads"])
    ap.add_argument("--page-size", type=int, default=shape["page_size"])
    ap.add_argument("--rope-mode", default="normal", choices=["none", "normal", "inline"])
    ap.add_argument(
        "--decode-splits",
        type=int,
        default=None,
        help="the cache's decode_splits: default automatic, 1 never split, N > 1 force up to N chunks",
    )
    ap.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="replay on N shards of the heads in lockstep (tvmkv.ShardedKVCache) against the unsharded model",
    )
    args = ap.parse_args(argv)
    names = args.scenarios or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    problem = f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}" if unknown else _check_options(args)
    if problem is not None:
        print(f"tvmkv replay: error: {problem}", file=sys.stderr)
        return 2
    failures = 0
    for name in names:
        print(
            f"\n== {name} ({args.target}, {args.dtype}, D={args.head_dim}, H_qo={args.num_qo_heads}, "
            f"H_kv={args.num_kv_heads}, page={args.page_size}, rope={args.rope_mode}, "
            f"decode_splits={args.decode_splits or 'auto'}, tensor_parallel={args.tensor_parallel})"
        )
        header = ("step", "operation", "batch", "tokens", "used", "free", "max err")
        print("{:>4}  {:<48} {:>5} {:>6} {:>5} {:>5} {:>9}".format(*header))
        t0 = time.time()

        def show(row):
            print(
                f"{row.step:>4}  {row.op:<48} {row.batch:>5} {row.tokens:>6} {row.pages_used:>5} "
                f"{row.pages_free:>5} {row.max_err:>9.2e}",
                flush=True,
            )

        try:
            replay(
                name,
                target=args.target,
                dtype=args.dtype,
                head_dim=args.head_dim,
                num_qo_heads=args.num_qo_heads,
                num_kv_heads=args.num_kv_heads,
                page_size=args.page_size,
                rope_mode=args.rope_mode,
                on_row=show,
                decode_splits=args.decode_splits,
                tensor_parallel=args.tensor_parallel,
            )
            print(f"-- {name}: OK ({time.time() - t0:.1f}s)")
        except AssertionError as err:
            failures += 1
            print(f"-- {name}: FAILED\n{err}")
    print(f"\n{len(names) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
