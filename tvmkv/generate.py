"""``python -m tvmkv generate``: greedy generation with the tiny Relax Llama on tvmkv's cache, checked.

Several prompts of different lengths are prefilled in chunks of at most ``prefill_chunk_size``
tokens, mixed into the same forward as the decodes of sequences already running (continuous
batching: a sequence leaves the batch when it has its ``max_new_tokens`` and its pages are freed).
One sequence is forked right after its prefill for parallel sampling: the child starts from the
parent's second most likely token (the parent takes the first), then both decode greedily, sharing
the prompt's pages. Every step's logits are checked against :mod:`tvmkv.relax.torch_ref`, which
recomputes each whole sequence without a cache. Exit status 1 when any check fails.

``--model DIR --prompt TEXT`` serves a Hugging Face checkpoint instead (:mod:`tvmkv.hf_generate`).

Steps are planned by :class:`tvmkv.runtime.scheduler.Scheduler`. ``--num-pages N`` makes the pool
too small for the workload: the scheduler then preempts the newest sequences (``--preemption swap``:
K/V to host memory and back; ``recompute``: dropped and prefilled again) and resumes them in FIFO
order, and every step is still checked.

``--prefix-cache`` shares prompt prefixes through a :class:`tvmkv.RadixPrefixCache`: every prompt
starts with the same ``--system-prompt`` tokens (32 by default with it), admissions reuse the
cached K/V of that prefix (and a recompute-preempted sequence what is left of its own), only the rest
is prefilled, and the logits are checked as before; reuse statistics are printed at the end.

Drivers: ``--interface tvmkv`` (default) drives the cache through its Python methods and the model
calls ``tvmkv.attention_with_fused_qkv``; ``--interface tvm`` compiles the model against TVM's
``PagedKVCache`` and drives everything through the ``vm.builtin.*`` functions, as an MLC-style
engine would, with :class:`tvmkv.relax.TvmBuiltinOverride` installed.

``--tensor-parallel N`` shards the model over N Disco workers (:mod:`tvmkv.disco`: heads and MLP
columns split, two all-reduces per layer, one cache shard per worker) and runs the unsharded model on
its own cache beside it: every step's logits are checked against that single-device run as well as
against PyTorch. On the CPU the workers are processes whose all-reduces go through gloo. With
``--interface tvm`` each worker's model creates its shard through TVM's create function (tvmkv's
drop-in installed on every worker) and the sequence operations are TVM's ``vm.builtin.kv_state_*``
functions called on every worker through Disco, as MLC-LLM's engine calls them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tvmkv.build import BUILD_DIR_HELP, default_build_dir

TOLERANCE = {"float32": 1e-4, "float16": 2e-2}
MAX_NEW_TOKENS = 64  # --max-new-tokens (a Hugging Face checkpoint only)


@dataclass
class Request:
    """One prompt: ``max_new_tokens`` greedy tokens are generated for it."""

    seq_id: int
    prompt: list
    max_new_tokens: int


@dataclass
class _Seq:
    seq_id: int
    tokens: list  # prompt + generated tokens
    prompt_len: int
    max_new_tokens: int
    generated: int = 0


@dataclass
class StepRecord:
    """What one forward did (also printed as a table row)."""

    step: int
    parts: list  # (seq_id, first position, number of tokens)
    tokens: int
    seconds: float
    pages_used: int
    pages_free: int
    max_err: float | None
    events: list = field(default_factory=list)


@dataclass
class Report:
    steps: list
    outputs: dict  # seq_id -> generated tokens
    max_err: float | None
    tolerance: float
    failures: list  # (step, seq_id, error)
    stats: object = None  # tvmkv.runtime.scheduler.SchedulerStats

    @property
    def ok(self) -> bool:
        return not self.failures


class DirectOps:
    """Drives a :class:`tvmkv.PagedAttentionKVCache` through its own methods."""

    def __init__(self, cache):
        self.cache = cache

    def add_sequence(self, seq_id):
        self.cache.add_sequence(seq_id)

    def remove_sequence(self, seq_id):
        self.cache.remove_sequence(seq_id)

    def fork_sequence(self, parent, child, fork_pos=-1):
        self.cache.fork_sequence(parent, child, fork_pos)

    def begin_forward(self, seq_ids, lengths):
        self.cache.begin_forward(seq_ids, lengths)

    def end_forward(self):
        self.cache.end_forward()

    def num_available_pages(self) -> int:
        return self.cache.num_available_pages()


class _TwinCaches:
    """What the scheduler sees as the cache of :class:`TwinOps`: ``primary`` answers every query, and
    the swaps it makes itself (``swap_out`` / ``swap_in``) go to both caches."""

    def __init__(self, primary, twin):
        self._primary, self._twin = primary, twin

    def __getattr__(self, name):
        return getattr(self._primary, name)

    def swap_out(self, seq_ids, **options):
        self._primary.swap_out(seq_ids, **options)
        self._twin.swap_out(seq_ids, **options)

    def swap_in(self, seq_ids, **options):
        self._primary.swap_in(seq_ids, **options)
        self._twin.swap_in(seq_ids, **options)


class TwinOps:
    """Every sequence operation to ``ops`` and to ``twin`` (the single-device run beside a sharded one);
    ``cache`` (what the scheduler asks) is ``ops``'s, its swaps made on both."""

    def __init__(self, ops, twin):
        self.ops, self.twin = ops, twin
        self.cache = _TwinCaches(ops.cache, twin.cache)

    def add_sequence(self, seq_id):
        self.ops.add_sequence(seq_id)
        self.twin.add_sequence(seq_id)

    def remove_sequence(self, seq_id):
        self.ops.remove_sequence(seq_id)
        self.twin.remove_sequence(seq_id)

    def fork_sequence(self, parent, child, fork_pos=-1):
        self.ops.fork_sequence(parent, child, fork_pos)
        self.twin.fork_sequence(parent, child, fork_pos)

    def begin_forward(self, seq_ids, lengths):
        self.ops.begin_forward(seq_ids, lengths)
        self.twin.begin_forward(seq_ids, lengths)

    def end_forward(self):
        self.ops.end_forward()
        self.twin.end_forward()

    def num_available_pages(self) -> int:
        return self.ops.num_available_pages()


class TwinModel:
    """``model`` on the sharded cache and ``twin`` on the single-device one (the same forward);
    returns ``model``'s logits and keeps the largest difference from ``twin``'s (``max_diff``)."""

    def __init__(self, model, twin, twin_cache):
        self.model, self.twin, self.twin_cache = model, twin, twin_cache
        self.max_diff = 0.0

    def forward(self, token_ids, cache):
        logits = self.model.forward(token_ids, cache)
        single = self.twin.forward(token_ids, self.twin_cache)
        diff = float(np.abs(logits - single).max())
        self.max_diff = max(self.max_diff, diff if np.isfinite(diff) else float("inf"))  # NaN fails the check
        return logits


# the vm.builtin.* functions (without the prefix) an MLC-style engine drives a cache with (BuiltinOps, DiscoBuiltinOps)
BUILTINS = (
    "kv_state_add_sequence",
    "kv_state_remove_sequence",
    "kv_state_fork_sequence",
    "kv_state_begin_forward",
    "kv_state_end_forward",
    "attention_kv_cache_get_num_available_pages",
)


class BuiltinOps:
    """Drives a cache through TVM's ``vm.builtin.*`` globals (as an MLC-style engine does).

    The functions are looked up here, once: construct it after installing the override.
    """

    def __init__(self, cache):
        import tvm

        self.cache = cache
        self._f = {name: tvm.get_global_func("vm.builtin." + name) for name in BUILTINS}

    def add_sequence(self, seq_id):
        self._f["kv_state_add_sequence"](self.cache, seq_id)

    def remove_sequence(self, seq_id):
        self._f["kv_state_remove_sequence"](self.cache, seq_id)

    def fork_sequence(self, parent, child, fork_pos=-1):
        self._f["kv_state_fork_sequence"](self.cache, parent, child, fork_pos)

    def begin_forward(self, seq_ids, lengths):
        import tvm_ffi

        self._f["kv_state_begin_forward"](self.cache, tvm_ffi.Shape(seq_ids), tvm_ffi.Shape(lengths))

    def end_forward(self):
        self._f["kv_state_end_forward"](self.cache)

    def num_available_pages(self) -> int:
        return int(self._f["attention_kv_cache_get_num_available_pages"](self.cache))


class DiscoBuiltinOps:
    """Drives the shards of a :class:`tvmkv.disco.DiscoKVCache` made through TVM's interface
    (:meth:`~tvmkv.disco.DiscoKVCache.from_handle`) with TVM's ``vm.builtin.*`` functions, called on every
    Disco worker (as MLC-LLM's engine drives a tensor-parallel model), then raises on this process what a
    call raised on a worker (:meth:`~tvmkv.disco.TvmkvSession.check_errors`). The scheduler's queries and
    swaps go to ``cache``, the DiscoKVCache."""

    def __init__(self, cache):
        self.cache, self.session = cache, cache.session
        self._f = {name: cache.session.session.get_global_func("vm.builtin." + name) for name in BUILTINS}
        self.session.holders.add(self)  # its functions hold the session: shutdown closes them

    def close(self) -> None:
        self._f = {}

    def _call(self, name, *args):
        self.session.check_workers()
        if not self._f:
            raise RuntimeError("the Disco session of these operations was shut down")
        result = self._f[name](self.cache.handle, *args)
        self.session.check_errors()  # a failed call is kept on the workers (a raise there would end them)
        return result

    def add_sequence(self, seq_id):
        self._call("kv_state_add_sequence", seq_id)

    def remove_sequence(self, seq_id):
        self._call("kv_state_remove_sequence", seq_id)

    def fork_sequence(self, parent, child, fork_pos=-1):
        self._call("kv_state_fork_sequence", parent, child, fork_pos)

    def begin_forward(self, seq_ids, lengths):
        import tvm_ffi

        self._call("kv_state_begin_forward", tvm_ffi.Shape(seq_ids), tvm_ffi.Shape(lengths))

    def end_forward(self):
        self._call("kv_state_end_forward")

    def num_available_pages(self) -> int:
        return int(self.session.fetch(self._call("attention_kv_cache_get_num_available_pages")))


def generate(
    model,
    ops,
    requests,
    *,
    prefill_chunk_size,
    max_batch_size,
    total_pages,
    reference=None,
    tolerance=1e-4,
    fork=None,
    check_integrity=None,
    preemption="swap",
    prefix_cache=None,
    log=print,
) -> Report:
    """Run the requests to completion with continuous batching; check logits when ``reference`` is given.

    Steps are planned by :class:`tvmkv.runtime.scheduler.Scheduler` (decodes first, then prompt
    chunks up to the token budget; when pages run out the newest sequences are preempted and resumed
    later in FIFO order).

    Parameters
    ----------
    model : tvmkv.relax.llama.RelaxLlama
    ops : DirectOps or BuiltinOps
        The cache and how it is driven.
    requests : list of Request
    prefill_chunk_size, max_batch_size : int
        Limits of one forward (the cache's).
    total_pages : int
        Pages per layer (for the used/free column).
    reference : tvmkv.relax.torch_ref.TorchLlama, optional
    tolerance : float
        Largest allowed ``|logit - reference|``.
    fork : (parent_seq_id, child_seq_id, max_new_tokens), optional
        Fork the parent right after its prefill; the child starts from the parent's 2nd best token.
    check_integrity : callable, optional
        Called after every step (e.g. ``cache.check_integrity``).
    preemption : str
        "swap" (K/V to host and back) or "recompute" (drop and prefill again) when pages run out.
    prefix_cache : tvmkv.RadixPrefixCache, optional
        Over ``ops.cache``: admissions reuse cached prefixes, finished sequences stay cached.
    log : callable
        Receives each printed line (``None`` to stay silent).
    """
    from .runtime.scheduler import Scheduler

    log = log or (lambda *_: None)
    seqs = {r.seq_id: _Seq(r.seq_id, list(r.prompt), len(r.prompt), r.max_new_tokens) for r in requests}
    sched = Scheduler(
        ops.cache,
        token_budget=prefill_chunk_size,
        max_batch_size=max_batch_size,
        preemption=preemption,
        ops=ops,
        prefix_cache=prefix_cache,
    )
    for r in requests:
        sched.add_request(r.seq_id, tokens=r.prompt)
    steps, failures, worst = [], [], None
    log(f"{'step':>4}  {'batch (seq[start:end])':<44} {'tok':>4} {'ms':>7} {'pages used/free':>15}  max|dlogit|")
    step = 0
    while sched.has_unfinished():
        plan = sched.schedule()  # may preempt (swap out / drop), swap in or admit sequences
        parts = [(p.seq_id, p.start, p.num_tokens) for p in plan.parts]
        tokens = [t for sid, start, n in parts for t in seqs[sid].tokens[start : start + n]]
        # ---- forward
        t0 = time.perf_counter()
        ops.begin_forward(plan.seq_ids, plan.lengths)
        logits = model.forward(tokens, ops.cache)  # [n, V]
        ops.end_forward()
        seconds = time.perf_counter() - t0
        # ---- check against the cache-free reference
        step_err, row = None, 0
        for sid, start, n in parts:
            if reference is not None:
                want = reference.logits(seqs[sid].tokens[: start + n])[start:]
                err = float(np.abs(logits[row : row + n] - want).max())
                step_err = err if step_err is None else max(step_err, err)
                if not err <= tolerance:
                    failures.append((step, sid, err))
            row += n
        if step_err is not None:
            worst = step_err if worst is None else max(worst, step_err)
        # ---- sample (greedy), fork, retire
        events, row, finished = plan.events(), 0, []
        events += [f"seq {p.seq_id} reuses {p.start}" for p in plan.parts if p.seq_id in plan.admitted and p.start]
        forks, sampled = [], {}
        for part in plan.parts:
            sid, s, last = part.seq_id, seqs[part.seq_id], logits[row + part.num_tokens - 1]
            row += part.num_tokens
            if not part.samples:
                continue
            ranked = np.argsort(-last, kind="stable")
            s.tokens.append(int(ranked[0]))
            sampled[sid] = s.tokens[-1]
            s.generated += 1
            if fork is not None and sid == fork[0] and s.generated == 1:
                forks.append((sid, fork[1], s.tokens[:-1] + [int(ranked[1])], fork[2]))
            if s.generated >= s.max_new_tokens:
                finished.append(sid)
                events.append(f"seq {sid} done")
        sched.step_done(plan, sampled=sampled)
        for parent, child, tokens_, max_new in forks:  # after step_done: the parent's sample is counted
            shared = sched.fork(parent, child, tokens=tokens_)
            seqs[child] = _Seq(child, tokens_, seqs[parent].prompt_len, max_new, generated=1)
            where = f"at {sched.seqs[parent].num_computed}" if shared else "(no free page: recompute)"
            events.insert(0, f"fork {parent}->{child} {where}")
        for sid in finished:
            sched.finish(sid)  # removes it from the cache
        if check_integrity is not None:
            check_integrity()
        free = ops.num_available_pages()
        rec = StepRecord(step, parts, len(tokens), seconds, total_pages - free, free, step_err, events)
        steps.append(rec)
        batch = " ".join(f"{sid}[{start}:{start + n}]" for sid, start, n in parts)
        err_txt = "-" if step_err is None else f"{step_err:.1e}" + ("" if step_err <= tolerance else " FAIL")
        log(
            f"{step:>4}  {batch:<44} {len(tokens):>4} {seconds * 1e3:>7.1f} {rec.pages_used:>7}/{free:<7}  "
            f"{err_txt}  {'; '.join(events)}"
        )
        step += 1
    outputs = {sid: s.tokens[s.prompt_len :] for sid, s in seqs.items()}
    return Report(steps, outputs, worst, tolerance, failures, sched.stats)


def default_requests(vocab_size: int, seed: int, system_prompt: int = 0) -> list:
    """Three prompts of lengths 45, 7 and 23 with 10, 16 and 12 new tokens (seq 0 is the one forked),
    each after the same ``system_prompt`` tokens (drawn from their own generator)."""
    rng = np.random.default_rng(seed + 1)
    spec = [(0, 45, 10), (1, 7, 16), (2, 23, 12)]
    system = np.random.default_rng(seed + 2).integers(0, vocab_size, system_prompt).tolist()
    return [Request(sid, system + rng.integers(0, vocab_size, n).tolist(), m) for sid, n, m in spec]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tvmkv generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=("llvm", "cuda"), default="llvm")
    p.add_argument(
        "--cuda-arch",
        default=None,
        help="sm_XX for --target cuda (default: the device's, else $TVMKV_CUDA_ARCH or sm_90)",
    )
    p.add_argument("--dtype", choices=tuple(TOLERANCE), default="float32")
    p.add_argument(
        "--interface",
        choices=("tvmkv", "tvm"),
        default="tvmkv",
        help="tvmkv's own nn.Object cache, or TVM's PagedKVCache run on tvmkv (drop-in)",
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--head-dim", type=int, choices=(64, 128), default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--prefill-chunk-size", type=int, default=None, help="most tokens of one forward (default 32; 512 with --model)"
    )
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-pages",
        type=int,
        default=None,
        metavar="N",
        help="pages per layer (default: room for every sequence); a few pages make memory scarce, so the "
        "scheduler preempts sequences and resumes them later (try 6)",
    )
    p.add_argument(
        "--preemption",
        choices=("swap", "recompute"),
        default="swap",
        help="when pages run out: swap the newest sequences' K/V to host memory, or drop and recompute them",
    )
    p.add_argument(
        "--prefix-cache",
        action="store_true",
        help="share prompt prefixes across requests through a RadixPrefixCache (prefill only what is not cached)",
    )
    p.add_argument(
        "--system-prompt",
        type=int,
        default=None,
        metavar="N",
        help="prepend the same N tokens to every prompt (default: 32 with --prefix-cache, else 0)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over N Disco workers (one cache shard each), checked against the single-device "
        "run and PyTorch",
    )
    p.add_argument(
        "--nccl-plugin",
        default=None,
        metavar="PATH",
        help="--tensor-parallel on cuda: Disco's NCCL backend (python -m tvmkv.disco.nccl builds it; default "
        "$TVMKV_DISCO_NCCL)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the PyTorch reference check")
    p.add_argument("--build-dir", default=None, help=f"tvmkv's {BUILD_DIR_HELP}; here: {default_build_dir()}")
    hf = p.add_argument_group("a Hugging Face checkpoint (instead of the tiny model)")
    hf.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a checkpoint directory (config.json, *.safetensors, tokenizer.json): Llama 2/3.x, Mistral, Qwen2, "
        "Qwen3; the generated text is streamed to stdout",
    )
    hf.add_argument("--prompt", default=None, help="the text to continue (in the chat template where there is one)")
    hf.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, metavar="N")
    hf.add_argument("--no-chat-template", action="store_true", help="encode the prompt as it is")
    hf.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy)")
    hf.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default 0: all)")
    hf.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set reaching this probability")
    hf.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens tokens, past end-of-text")
    hf.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        metavar="F",
        help="size the cache to this fraction of the device's free memory (default: the sequence's pages)",
    )
    hf.add_argument(
        "--check",
        action="store_true",
        help="compare every step's logits with transformers' own model of the checkpoint (needs transformers)",
    )
    hf.add_argument(
        "--save-logits",
        default=None,
        metavar="NPZ",
        help="write the prompt ids, new tokens and every step's logits (a runtime-only GPU host without "
        "transformers: check them elsewhere with scripts/check_hf_logits.py)",
    )
    p.add_argument(
        "--export-lib",
        default=None,
        metavar="PATH",
        help="compile the model, write it to PATH (.so) with its parameter names and what it was compiled for "
        "(.json), and exit",
    )
    p.add_argument(
        "--model-lib",
        default=None,
        metavar="PATH",
        help="run a model library written by --export-lib instead of compiling (runtime-only TVM); --layers, "
        "--head-dim, --dtype, --interface and --target must be the ones it was exported with",
    )
    return p


def _runtime_only() -> bool:
    """A runtime-only TVM (the GPU machine's payload) cannot compile (same flag as tvmkv.build)."""
    import os

    return os.environ.get("TVM_USE_RUNTIME_LIB") == "1"


def _fail(problem: str) -> int:
    """Print ``problem`` as the one-line error of a bad option; the exit status of a usage error."""
    print(f"tvmkv generate: error: {problem}", file=sys.stderr)
    return 2


# what an exported model library was compiled for, compared with the run's options on --model-lib
# (LlamaConfig's fields but the seed, which only draws the weights at run time): key -> its option
_MODEL_FLAGS = {
    "num_layers": "--layers",
    "head_dim": "--head-dim",
    "dtype": "--dtype",
    "interface": "--interface",
    "target": "--target",
}


def _model_key(cfg, interface: str, target: str) -> dict:
    """What a compiled model library depends on: the model's shape, its cache interface, the target (as
    its ``.json`` holds it: tuples as lists)."""
    key = {k: v for k, v in asdict(cfg).items() if k != "seed"}
    return json.loads(json.dumps({**key, "interface": interface, "target": target}))


def _check_options(args) -> str | None:
    """The first bad option as one line (None when all are good), found before anything is compiled."""
    from tvmkv.config import CacheConfig
    from tvmkv.relax.llama_config import LlamaConfig

    model_only = {
        "--prompt": args.prompt is not None,
        "--check": args.check,
        "--save-logits": args.save_logits is not None,
        "--memory-fraction": args.memory_fraction is not None,
        "--no-chat-template": args.no_chat_template,
        "--ignore-eos": args.ignore_eos,
        "--max-new-tokens": args.max_new_tokens != MAX_NEW_TOKENS,
        "--temperature / --top-k / --top-p": (args.temperature, args.top_k, args.top_p) != (0.0, 0, 1.0),
    }
    named = [flag for flag, on in model_only.items() if on]
    if named:
        return f"{', '.join(named)} apply to --model DIR (a Hugging Face checkpoint) only"
    positive = {
        "--layers": args.layers,
        "--page-size": args.page_size,
        "--prefill-chunk-size": args.prefill_chunk_size,
        "--max-batch-size": args.max_batch_size,
        "--num-pages": args.num_pages,
    }
    for flag, value in positive.items():
        if value is not None and value <= 0:
            return f"{flag} {value} must be a positive int"
    for flag, value in {"--seed": args.seed, "--system-prompt": args.system_prompt}.items():
        if value is not None and value < 0:
            return f"{flag} {value} must be >= 0"
    if args.export_lib and args.model_lib:
        return "pass --export-lib (compile and write the model) or --model-lib (run a written one), not both"
    cfg = LlamaConfig(num_layers=args.layers, head_dim=args.head_dim, dtype=args.dtype, seed=args.seed)
    if args.tensor_parallel != 1:
        problem = _check_tensor_parallel(args, cfg)
        if problem is not None:
            return problem
    elif args.nccl_plugin:
        return "--nccl-plugin applies to --tensor-parallel N (N > 1) only"
    requests = default_requests(cfg.vocab_size, args.seed, _system_prompt(args))
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    need = -(-longest // args.page_size)
    if args.num_pages is not None and args.num_pages < need:
        return (
            f"--num-pages {args.num_pages} cannot hold the longest sequence ({longest} tokens: {need} pages of "
            f"{args.page_size}); pass at least {need}"
        )
    try:  # the cache's own checks (a power-of-two page size ...)
        CacheConfig(
            cfg.num_layers,
            cfg.num_qo_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            **_sizes(args, requests),
            dtype=cfg.dtype,
            rope_mode="normal",
            target_kind=args.target,
            num_pages=args.num_pages,
        )
    except ValueError as err:
        return f"{err} (options --page-size, --prefill-chunk-size, --max-batch-size, --num-pages)"
    if args.model_lib:
        return _check_model_lib(Path(args.model_lib), _model_key(cfg, args.interface, args.target))
    return None


def _check_model_options(args) -> str | None:
    """What ``--model`` does not combine with, and its own values."""
    if args.prompt is None:
        return "--model needs --prompt TEXT (the text to continue)"
    others = {
        "--tensor-parallel": args.tensor_parallel != 1,
        "--interface tvm": args.interface == "tvm",
        "--prefix-cache": args.prefix_cache,
        "--system-prompt": args.system_prompt is not None,
    }
    named = [flag for flag, on in others.items() if on]
    if named:
        return f"--model serves one prompt through tvmkv's own interface; not with {', '.join(named)}"
    for flag, value in {
        "--max-new-tokens": args.max_new_tokens,
        "--page-size": args.page_size,
        "--prefill-chunk-size": args.prefill_chunk_size,
    }.items():
        if value <= 0:
            return f"{flag} {value} must be a positive int"
    if args.num_pages is not None and args.memory_fraction is not None:
        return "pass --num-pages or --memory-fraction, not both"
    if args.export_lib and args.model_lib:
        return "pass --export-lib (compile and write the model) or --model-lib (run a written one), not both"
    return None


def _check_tensor_parallel(args, cfg) -> str | None:
    from tvmkv.runtime.sharding import ShardLayout

    n = args.tensor_parallel
    if n < 1:
        return f"--tensor-parallel {n} must be a positive int"
    try:
        ShardLayout(cfg.num_qo_heads, cfg.num_kv_heads, n)
    except ValueError as err:
        return f"--tensor-parallel {n}: {err}"
    if cfg.intermediate_size % n:
        return f"--tensor-parallel {n} does not divide the MLP's {cfg.intermediate_size} columns"
    if args.prefix_cache:
        return f"--tensor-parallel {n} does not combine with --prefix-cache (the prefix cache holds one cache's pages)"
    if args.target == "cuda" and not args.export_lib:
        plugin = _nccl_plugin(args)
        if not plugin or not Path(plugin).is_file():
            return (
                f"--tensor-parallel {n} --target cuda needs Disco's NCCL backend: build it with python -m "
                "tvmkv.disco.nccl OUT_DIR NCCL_ROOT and pass --nccl-plugin OUT_DIR/libtvm_disco_nccl.so"
            )
    if args.model_lib:
        lib = _shard_lib(args.model_lib, n)
        if not lib.is_file():
            return (
                f"--model-lib {args.model_lib}: no {lib.name} beside it; export both with --export-lib "
                f"{args.model_lib} --tensor-parallel {n}"
            )
        problem = _check_model_lib(lib, {**_model_key(cfg, args.interface, args.target), "tensor_parallel": n})
        if problem is not None:
            return problem
    return None


def _nccl_plugin(args) -> str | None:
    import os

    return args.nccl_plugin or os.environ.get("TVMKV_DISCO_NCCL")


def _shard_lib(path, n: int) -> Path:
    """Where ``--export-lib PATH --tensor-parallel n`` writes the model shard: ``PATH``'s stem + ``.tp<n>.so``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.tp{n}.so")


def _check_model_lib(path: Path, want: dict) -> str | None:
    """Whether the library ``path`` written by ``--export-lib`` exists and was compiled for ``want``."""
    meta = path.with_suffix(".json")
    if not path.is_file() or not meta.is_file():
        return f"--model-lib {path}: no such library, or no {meta.name} beside it (both written by --export-lib)"
    try:
        have = json.loads(meta.read_text()).get("model")
    except (ValueError, OSError, AttributeError) as err:
        return f"--model-lib {path}: {meta} is not the JSON object --export-lib writes ({err})"
    if have is None:
        print(f"  note: {meta} does not say what the model was compiled for (an older --export-lib); not checked")
        return None
    diffs = [
        f"{key}={have.get(key)!r} where this run has {value!r}"
        + (f" ({_MODEL_FLAGS[key]})" if key in _MODEL_FLAGS else " (not an option: export it with this tvmkv)")
        for key, value in want.items()
        if have.get(key) != value
    ]
    if diffs:
        return (
            f"--model-lib {path} was exported for another model: {'; '.join(diffs)}; run with the options it was "
            "exported with, or export it again with --export-lib"
        )
    return None


def _system_prompt(args) -> int:
    return args.system_prompt if args.system_prompt is not None else 32 * args.prefix_cache


def _sizes(args, requests) -> dict:
    """The cache's sizes: room for 4 times the workload, or the pool of ``--num-pages``."""
    max_total = 4 * sum(len(r.prompt) + r.max_new_tokens for r in requests)
    if args.num_pages is not None:  # scarce memory: the pool, not the longest sequence, limits
        max_total = min(max_total, args.num_pages * args.page_size)
    return dict(
        max_batch_size=args.max_batch_size,
        max_total_seq_len=max_total,
        prefill_chunk_size=args.prefill_chunk_size,
        page_size=args.page_size,
    )


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.prefill_chunk_size is None:
        args.prefill_chunk_size = 512 if args.model else 32
    if args.model is not None:
        problem = _check_model_options(args)
        if problem is not None:
            return _fail(problem)
        from tvmkv.hf_generate import main as generate_model

        return generate_model(args)
    problem = _check_options(args)
    if problem is not None:
        return _fail(problem)
    from tvmkv.payload import bootstrap

    bootstrap()  # before tvm: $TVMKV_PAYLOAD's runtime-only TVM on a GPU host
    import tvm

    import tvmkv
    from tvmkv.relax import TvmBuiltinOverride
    from tvmkv.relax.llama import LlamaConfig, RelaxLlama, compile_llama, make_weights
    from tvmkv.target import default_cuda_arch

    if args.target == "cuda" and args.export_lib is None and args.model_lib is None and _runtime_only():
        return _fail("this TVM is runtime-only: compile with --export-lib on a build machine, pass --model-lib")
    if args.target == "cuda" and not tvm.cuda(0).exist and not args.export_lib:
        return _fail("--target cuda but no CUDA device is present; use --target llvm")
    cfg = LlamaConfig(num_layers=args.layers, head_dim=args.head_dim, dtype=args.dtype, seed=args.seed)
    weights = make_weights(cfg)
    device = tvm.cpu(0) if args.target == "llvm" else tvm.cuda(0)
    arch = args.cuda_arch
    if args.target == "cuda" and arch is None:
        arch = "sm_" + device.compute_version.replace(".", "") if device.exist else default_cuda_arch()
    system_prompt = _system_prompt(args)
    requests = default_requests(cfg.vocab_size, args.seed, system_prompt)
    fork = (0, 3, 8)
    sizes = _sizes(args, requests)
    print(
        f"[tvmkv generate] {cfg}\n  target={args.target}{' ' + arch if arch else ''} interface={args.interface} {sizes}"
    )
    t0 = time.perf_counter()
    if args.model_lib:
        ex = tvm.runtime.load_module(args.model_lib)
        names = json.loads(Path(args.model_lib).with_suffix(".json").read_text())["param_names"]
        print(f"  model loaded from {args.model_lib} in {time.perf_counter() - t0:.1f}s")
    else:
        ex, names = compile_llama(cfg, interface=args.interface, target=args.target, cuda_arch=arch)
        print(f"  model compiled in {time.perf_counter() - t0:.1f}s")
    if args.export_lib:
        ex.export_library(args.export_lib)
        meta = {"param_names": names, "model": _model_key(cfg, args.interface, args.target)}
        Path(args.export_lib).with_suffix(".json").write_text(json.dumps(meta))
        print(f"  wrote {args.export_lib}")
        if args.tensor_parallel > 1:
            n, shard_lib = args.tensor_parallel, _shard_lib(args.export_lib, args.tensor_parallel)
            tp_ex, tp_names = compile_llama(
                cfg, interface=args.interface, target=args.target, cuda_arch=arch, tensor_parallel=n
            )
            tp_ex.export_library(str(shard_lib))
            key = {**_model_key(cfg, args.interface, args.target), "tensor_parallel": n}
            meta = {"param_names": tp_names, "model": key}
            shard_lib.with_suffix(".json").write_text(json.dumps(meta))
            print(f"  wrote {shard_lib} (one of {n} shards)")
        return 0
    if args.tensor_parallel > 1:
        return _main_tensor_parallel(args, cfg, weights, ex, names, requests, fork, sizes, arch)
    override = TvmBuiltinOverride(build_dir=args.build_dir, cuda_arch=arch, num_pages=args.num_pages)
    t0 = time.perf_counter()
    with override:  # only needed for interface "tvm"; harmless otherwise
        model = RelaxLlama(ex, names, weights, cfg, device, interface=args.interface)
        if args.interface == "tvm":
            cache = model.create_paged_kv_cache(**sizes)
            ops = BuiltinOps(cache)
        else:
            opts = _cache_options(args, cfg, sizes, arch)
            cache = tvmkv.PagedAttentionKVCache(
                cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, **opts
            )
            ops = DirectOps(cache)
        print(
            f"  cache ready in {time.perf_counter() - t0:.1f}s: "
            f"{type(cache).__module__}.{type(cache).__name__}, "
            f"{cache.config.total_pages} pages of {cache.config.page_size}"
        )
        prefix = tvmkv.RadixPrefixCache(cache) if args.prefix_cache else None
        reference = None
        if not args.no_check:
            from tvmkv.relax.torch_ref import TorchLlama

            reference = TorchLlama(cfg, weights)
        report = generate(
            model,
            ops,
            requests,
            prefill_chunk_size=args.prefill_chunk_size,
            max_batch_size=args.max_batch_size,
            total_pages=cache.config.total_pages,
            reference=reference,
            tolerance=TOLERANCE[cfg.dtype],
            fork=fork,
            check_integrity=cache.check_integrity if prefix is None else prefix.check_integrity,
            preemption=args.preemption,
            prefix_cache=prefix,
        )
    return _summary(args, report, reference, prefix, system_prompt)


def _cache_options(args, cfg, sizes: dict, arch) -> dict:
    """The cache's keyword options of this run (of the single cache, and of every shard's)."""
    from tvmkv.relax.builtins import cuda_target

    return dict(
        sizes,
        dtype=cfg.dtype,
        rope_mode="normal",
        rope_scale=cfg.rope_scale,
        rope_theta=cfg.rope_theta,
        target=args.target if args.target == "llvm" else cuda_target(arch),
        num_pages=args.num_pages,
        build_dir=args.build_dir,
    )


def _main_tensor_parallel(args, cfg, weights, ex, names, requests, fork, sizes, arch) -> int:
    """``generate --tensor-parallel N``: the sharded model on N Disco workers beside the single-device one
    (CPU workers all-reduce through gloo, GPU workers through Disco's NCCL backend)."""
    import tempfile

    import tvm

    import tvmkv
    from tvmkv.disco import DiscoKVCache, TvmkvSession
    from tvmkv.disco.model import DiscoLlama
    from tvmkv.relax.llama import RelaxLlama, compile_llama

    n, cuda = args.tensor_parallel, args.target == "cuda"
    t0 = time.perf_counter()
    opts = _cache_options(args, cfg, sizes, arch)
    plugin = _nccl_plugin(args) if cuda else None
    with tempfile.TemporaryDirectory() as tmp, TvmkvSession(n, nccl_plugin=plugin) as session:
        npz = Path(tmp) / "weights.npz"
        np.savez(npz, **weights)
        if args.model_lib:
            lib = _shard_lib(args.model_lib, n)
            tp_names = json.loads(lib.with_suffix(".json").read_text())["param_names"]
        else:
            tp_ex, tp_names = compile_llama(
                cfg, interface=args.interface, target=args.target, cuda_arch=arch, tensor_parallel=n
            )
            lib = Path(tmp) / "model_shard.so"
            tp_ex.export_library(str(lib))
            print(f"  model shard (1 of {n}) compiled in {time.perf_counter() - t0:.1f}s")
        t0 = time.perf_counter()
        if cuda:
            session.init_nccl()
        else:
            session.init_gloo()
        device = tvm.cuda(0) if cuda else tvm.cpu(0)
        if args.interface == "tvm":  # each worker's model creates its shard through TVM's create function
            session.install_tvm_override(build_dir=args.build_dir, cuda_arch=arch, num_pages=args.num_pages)
            model = DiscoLlama(session, lib, tp_names, npz, cfg, target=args.target)
            cache = DiscoKVCache.from_handle(
                session, model.create_paged_kv_cache(**sizes), cfg.num_qo_heads, cfg.num_kv_heads
            )
            ops = DiscoBuiltinOps(cache)
            # the single-device model beside it: this process's functions are tvmkv's too (worker 0 is here)
            single = RelaxLlama(ex, names, weights, cfg, device, interface="tvm")
            single_cache = single.create_paged_kv_cache(**sizes)
            single_ops = BuiltinOps(single_cache)
        else:
            cache = DiscoKVCache(session, cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, **opts)
            model = DiscoLlama(session, lib, tp_names, npz, cfg, target=args.target)
            ops = DirectOps(cache)
            single_cache = tvmkv.PagedAttentionKVCache(
                cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, **opts
            )
            single = RelaxLlama(ex, names, weights, cfg, device)
            single_ops = DirectOps(single_cache)
        lay = cache.layout
        print(
            f"  {n} Disco workers ready in {time.perf_counter() - t0:.1f}s: each {lay.qo_per_shard} query / "
            f"{lay.kv_per_shard} KV heads (KV memory {lay.kv_memory_factor:g}x the unsharded cache's), "
            f"{cache.config.total_pages} pages of {cache.config.page_size}"
        )
        reference = None
        if not args.no_check:
            from tvmkv.relax.torch_ref import TorchLlama

            reference = TorchLlama(cfg, weights)
        twin = TwinModel(model, single, single_cache)

        def check_integrity():
            cache.check_integrity()
            single_cache.check_integrity()

        report = generate(
            twin,
            TwinOps(ops, single_ops),
            requests,
            prefill_chunk_size=args.prefill_chunk_size,
            max_batch_size=args.max_batch_size,
            total_pages=cache.config.total_pages,
            reference=reference,
            tolerance=TOLERANCE[cfg.dtype],
            fork=fork,
            check_integrity=check_integrity,
            preemption=args.preemption,
        )
    tol = TOLERANCE[cfg.dtype]
    print(f"tensor parallel: {n} workers, max |logit difference| from the single-device run {twin.max_diff:.2e}")
    status = _summary(args, report, reference, None, 0)
    if not twin.max_diff <= tol:
        print(f"check FAILED: the sharded model's logits differ from the single-device run by {twin.max_diff:.3e}")
        return 1
    return status


def _summary(args, report, reference, prefix, system_prompt) -> int:
    """Print what ``generate`` did; the exit status (1 when a check failed)."""
    total_tokens = sum(s.tokens for s in report.steps)
    st = report.stats
    print(
        f"scheduler ({args.preemption}): {st.preempted_swap + st.preempted_recompute} preemptions, "
        f"{st.swapped_in} swap-ins, {st.recomputed_tokens} tokens recomputed, {st.forks_recomputed} forks recomputed"
    )
    if prefix is not None:
        ps = prefix.stats
        print(
            f"prefix cache (system prompt of {system_prompt} tokens): {ps.requests} admissions reused "
            f"{ps.reused_tokens} of their {ps.requested_tokens} tokens ({ps.hit_rate:.0%}; "
            f"{ps.partial_page_reuses} ending inside a page, copied); tree holds {prefix.num_cached_pages()} pages "
            f"({prefix.num_evictable_pages()} evictable), {ps.evicted_pages} evicted"
        )
    total_s = sum(s.seconds for s in report.steps)
    dec = [s for s in report.steps if all(n == 1 for _, _, n in s.parts)]
    print("generated (greedy):")
    for sid, toks in sorted(report.outputs.items()):
        print(f"  seq {sid}: {toks}")
    print(
        f"throughput: {total_tokens / total_s:.0f} tokens/s over {len(report.steps)} forwards "
        f"({total_tokens} tokens, {total_s:.2f}s)",
        end="",
    )
    if dec:
        print(f"; decode-only steps {sum(s.tokens for s in dec) / sum(s.seconds for s in dec):.0f} tokens/s")
    else:
        print()
    if reference is None:
        print("check: skipped (--no-check)")
        return 0
    if report.ok:
        print(
            f"check: OK, every step's logits match the PyTorch reference (max |diff| {report.max_err:.2e} "
            f"<= {report.tolerance})"
        )
        return 0
    for step, sid, err in report.failures[:10]:
        print(f"check FAILED: step {step} seq {sid}: max |diff| {err:.3e} > {report.tolerance}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
