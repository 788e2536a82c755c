"""``python -m tvmkv generate --model DIR --prompt TEXT``: a Hugging Face checkpoint served through tvmkv.

The checkpoint's config, weights and tokenizer are read by :mod:`tvmkv.relax.hf`; the Llama-family Relax
model is compiled for the target with those shapes and runs its attention on a
:class:`tvmkv.PagedAttentionKVCache` (RoPE, its scaling and sliding windows applied by the cache). The
prompt (in the checkpoint's chat template, unless ``--no-chat-template``) is prefilled in chunks, then
tokens are decoded (greedily, or sampled with ``--temperature`` / ``--top-k`` / ``--top-p``) and streamed to
the terminal as text, with tokens/s at the end.
``--check`` runs ``transformers``' own model of the checkpoint beside it (its forward with its cache, the
same tokens) and compares every step's logits: exit status 1 when they differ beyond the dtype's
tolerance or a greedy token differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

TOLERANCE = {"float32": 1e-3, "float16": 5e-2}  # max |logit difference| from transformers (fp32 reference)


@dataclass
class Generation:
    """What :func:`generate` produced: the new tokens, seconds of the prefill (time to first token) and
    of the decode steps, and (``keep_logits``) the logits of every position fed, prompt first."""

    tokens: list
    prefill_s: float
    decode_s: float
    logits: list = field(default_factory=list)


def generate(
    model,
    cache,
    prompt_ids,
    max_new_tokens,
    *,
    prefill_chunk,
    eos=(),
    on_token=None,
    keep_logits=False,
    sampler=None,
):
    """Generation of up to ``max_new_tokens`` after ``prompt_ids`` on ``model`` (a
    :class:`~tvmkv.relax.llama.RelaxLlama`) and ``cache`` (sequence 0, removed at the end, also when a step
    fails); stops after an ``eos`` token. Each token is ``sampler(logits)`` (default: the argmax, greedy);
    ``on_token(token)`` is called for each new token as it is chosen."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    if not len(prompt_ids):
        raise ValueError("prompt_ids is empty: a generation starts from at least one token")
    seq = 0
    cache.add_sequence(seq)
    kept: list = []
    try:
        t0 = time.perf_counter()
        last = np.zeros(0)
        for start in range(0, len(prompt_ids), prefill_chunk):
            chunk = prompt_ids[start : start + prefill_chunk]
            cache.begin_forward([seq], [len(chunk)])
            logits = model.forward(chunk, cache)
            cache.end_forward()
            if keep_logits:
                kept.append(logits)
            last = logits[-1]
        prefill_s = time.perf_counter() - t0
        tokens: list = []
        t0 = time.perf_counter()
        while True:
            token = int(np.argmax(last)) if sampler is None else int(sampler(last))
            tokens.append(token)
            if on_token is not None:
                on_token(token)
            if len(tokens) >= max_new_tokens or token in eos:
                break
            cache.begin_forward([seq], [1])
            logits = model.forward([token], cache)
            cache.end_forward()
            if keep_logits:
                kept.append(logits)
            last = logits[-1]
        decode_s = time.perf_counter() - t0
    except BaseException:
        # leave the cache as it was, the original error raised: close the forward a failure left open
        if cache.forward_open:
            cache.end_forward()
        cache.remove_sequence(seq)
        raise
    cache.remove_sequence(seq)
    return Generation(tokens, prefill_s, decode_s, kept)


class Sampler:
    """Sampling from the logits: ``temperature`` > 0 scales them, then only the ``top_k`` most likely tokens
    (0: all) and the smallest set of them whose probabilities reach ``top_p`` are kept; ``seed`` fixes the
    draws. ``temperature`` 0 is greedy (the argmax)."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
        if not (temperature >= 0 and np.isfinite(temperature)):
            raise ValueError(f"--temperature {temperature} must be a finite number >= 0 (0: greedy)")
        if top_k < 0:
            raise ValueError(f"--top-k {top_k} must be >= 0 (0: every token)")
        if not 0 < top_p <= 1:
            raise ValueError(f"--top-p {top_p} must be in (0, 1]")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        order = np.argsort(-z, kind="stable")
        if self.top_k:
            order = order[: self.top_k]
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        # the smallest prefix reaching top_p (all of them for 1.0, whatever the rounding of the sum)
        keep = len(p) if self.top_p >= 1 else min(len(p), int(np.searchsorted(np.cumsum(p), self.top_p) + 1))
        p = p[:keep] / p[:keep].sum()
        return int(order[self.rng.choice(keep, p=p)])


class TextStream:
    """New tokens as text, written as they come: each token's text is what decoding all of them adds to
    what was written. Text ending in an incomplete character (a byte-level token holding part of one,
    which decodes as U+FFFD) waits for the tokens that complete it; where decoding changes text already
    written, the rest is written from where they differ."""

    def __init__(self, decode, out):
        self.decode, self.out = decode, out
        self.tokens: list = []
        self.written = ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):
            return
        same = 0
        for a, b in zip(text, self.written):
            if a != b:
                break
            same += 1
        self.out.write(text[same:] if same < len(self.written) else text[len(self.written) :])
        self.out.flush()
        self.written = text


def reference_logits(directory: str | Path, prompt_ids: list, tokens: list) -> np.ndarray:
    """``transformers``' logits (float32, ``[len(prompt_ids) + len(tokens) - 1, V]``) of the checkpoint for
    the prompt and then each new token but the last, fed one at a time with its own KV cache, as
    :func:`generate` feeds them."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    hf.eval()
    # the cache's keyword: "cache" in transformers >= 5.2x, "past_key_values" before
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    rows = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt_ids]), use_cache=True)
        rows.append(out.logits[0].numpy())
        for token in tokens[:-1]:
            out = hf(torch.tensor([[token]]), use_cache=True, **{key: getattr(out, key)})
            rows.append(out.logits[0].numpy())
    return np.concatenate(rows)


def main(args: argparse.Namespace) -> int:
    """The ``--model`` path of ``python -m tvmkv generate`` (``args`` from its parser)."""
    from tvmkv.payload import bootstrap

    bootstrap()
    import tvm

    import tvmkv
    from tvmkv.relax import hf
    from tvmkv.relax.builtins import cuda_target
    from tvmkv.relax.llama import RelaxLlama, compile_llama
    from tvmkv.runtime.cache import available_bytes
    from tvmkv.target import default_cuda_arch

    def fail(message: str) -> int:
        print(f"tvmkv generate: error: {message}", file=sys.stderr)
        return 2

    try:
        ck = hf.read_config(args.model, args.dtype)
        tokenizer = hf.Tokenizer(args.model)
    except hf.CheckpointError as err:
        return fail(str(err))
    cfg = ck.cfg
    try:
        sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as err:
        return fail(str(err))
    if args.target == "cuda" and not tvm.cuda(0).exist and not args.export_lib:
        return fail("--target cuda but no CUDA device is present; use --target llvm")
    try:
        prompt_ids = tokenizer.encode(args.prompt, chat=not args.no_chat_template)
    except hf.CheckpointError as err:
        return fail(str(err))
    if not prompt_ids:
        return fail("the prompt encodes to no tokens; pass a non-empty --prompt")
    need = len(prompt_ids) + args.max_new_tokens
    if need > ck.max_position_embeddings:
        return fail(
            f"{len(prompt_ids)} prompt tokens + --max-new-tokens {args.max_new_tokens} = {need} exceed the model's "
            f"max_position_embeddings {ck.max_position_embeddings}; shorten the prompt or lower --max-new-tokens"
        )
    device = tvm.cpu(0) if args.target == "llvm" else tvm.cuda(0)
    arch = args.cuda_arch
    if args.target == "cuda" and arch is None:
        arch = "sm_" + device.compute_version.replace(".", "") if device.exist else default_cuda_arch()
    print(
        f"[tvmkv generate] {ck.architecture} from {ck.directory}: {cfg.num_layers} layers, {cfg.num_qo_heads} / "
        f"{cfg.num_kv_heads} heads of {cfg.head_dim}, vocabulary {cfg.vocab_size}, {cfg.dtype} on {args.target}",
        flush=True,
    )
    # everything that can be judged before compiling: the tensors (from the safetensors headers), whether the
    # weights and the cache fit the device
    try:
        weight_bytes = hf.check_weights(ck)
    except hf.CheckpointError as err:
        return fail(str(err))
    if not args.export_lib:
        free = available_bytes(device)
        if weight_bytes > free:
            return fail(
                f"the weights need {weight_bytes / 2**30:.2f} GiB in {cfg.dtype} but {device} has "
                f"{free / 2**30:.2f} GiB free; free the device, or run a smaller model"
            )
    options = dict(
        page_size=args.page_size,
        max_batch_size=1,
        max_total_seq_len=need,
        prefill_chunk_size=args.prefill_chunk_size,
        dtype=cfg.dtype,
        rope_mode="normal",
        rope_scale=cfg.rope_scale,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        layer_windows=list(cfg.layer_windows) or None,
        target=args.target if args.target == "llvm" else cuda_target(arch),
        build_dir=args.build_dir,
    )
    if args.memory_fraction is not None:
        options["memory_fraction"] = args.memory_fraction
    else:
        options["num_pages"] = args.num_pages
    shape = (cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim)
    if args.memory_fraction is not None and not args.export_lib:
        # the cache sizes itself from the memory free once the weights are on the device
        fits = _tokens_that_fit(shape, options, args.memory_fraction, device, reserved=weight_bytes)
        if fits < need:
            return fail(
                f"--memory-fraction {args.memory_fraction} of {device}'s free memory holds {fits} tokens of this "
                f"model's cache, but the prompt and --max-new-tokens need {need}: raise --memory-fraction, shorten "
                "the prompt or lower --max-new-tokens"
            )
    t0 = time.perf_counter()
    key = {"checkpoint_model": asdict(cfg), "target": args.target}
    if args.model_lib:  # compiled elsewhere (a runtime-only GPU host cannot compile)
        meta_path = Path(args.model_lib).with_suffix(".json")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as err:
            return fail(f"--model-lib {args.model_lib}: no readable {meta_path.name} beside it ({err})")
        if meta.get("model") != json.loads(json.dumps(key)):
            return fail(
                f"--model-lib {args.model_lib} was exported for another checkpoint, dtype or target; export it again "
                "with --model DIR --export-lib PATH (and this run's --dtype and --target)"
            )
        ex, names = tvm.runtime.load_module(args.model_lib), meta["param_names"]
    else:
        ex, names = compile_llama(cfg, target=args.target, cuda_arch=arch)
    if args.export_lib:
        ex.export_library(args.export_lib)
        Path(args.export_lib).with_suffix(".json").write_text(json.dumps({"param_names": names, "model": key}))
        print(f"  wrote {args.export_lib} (run it with --model-lib {args.export_lib})")
        return 0
    try:
        weights = hf.load_weights(ck, names)
    except hf.CheckpointError as err:
        return fail(str(err))
    model = RelaxLlama(ex, names, weights, cfg, device)  # on the device before the cache sizes itself
    del weights
    print(f"  compiled and loaded in {time.perf_counter() - t0:.1f}s ({weight_bytes / 2**30:.2f} GiB)", flush=True)
    try:
        cache = tvmkv.PagedAttentionKVCache(*shape, **options)
    except ValueError as err:
        return fail(f"{err} (the sequence needs {need} tokens)")
    stream = TextStream(tokenizer.decode, sys.stdout)

    gen = generate(
        model,
        cache,
        prompt_ids,
        args.max_new_tokens,
        prefill_chunk=args.prefill_chunk_size,
        eos=() if args.ignore_eos else ck.eos_token_ids,
        on_token=stream,
        keep_logits=args.check or bool(args.save_logits),
        sampler=sampler,
    )
    print()
    decoded = len(gen.tokens) - 1  # the first token comes from the prefill
    rate = f"{decoded / gen.decode_s:.1f} tokens/s" if decoded and gen.decode_s > 0 else "n/a"
    print(
        f"[tvmkv generate] {len(prompt_ids)} prompt tokens, time to first token {gen.prefill_s * 1e3:.1f} ms; "
        f"{len(gen.tokens)} new tokens, decode {rate}"
    )
    if args.save_logits:
        np.savez(
            args.save_logits,
            prompt_ids=np.asarray(prompt_ids),
            tokens=np.asarray(gen.tokens),
            logits=np.concatenate(gen.logits),
            dtype=cfg.dtype,
        )
        print(f"  wrote {args.save_logits}")
    if not args.check:
        return 0
    ok, report = check(
        ck.directory, prompt_ids, gen.tokens, np.concatenate(gen.logits), cfg.dtype, greedy=sampler.greedy
    )
    print(report)
    return 0 if ok else 1


def check(
    directory: str | Path, prompt_ids: list, tokens: list, logits: np.ndarray, dtype: str, *, greedy: bool = True
) -> tuple:
    """``(ok, report line)``: ``logits`` (every position fed, prompt first) against transformers' own model
    of the checkpoint fed the same tokens; ok when within the dtype's tolerance and (``greedy``) every token
    is transformers' argmax too."""
    ref = reference_logits(directory, list(prompt_ids), list(tokens))
    err = float(np.abs(logits - ref).max())
    P = len(prompt_ids)
    hf_tokens = [int(np.argmax(ref[P - 1 + i])) for i in range(len(tokens))]
    tol = TOLERANCE[dtype]
    same = hf_tokens == [int(t) for t in tokens]
    ok = err <= tol and (same or not greedy)
    tokens_text = f"greedy tokens {'identical' if same else 'DIFFER'}" if greedy else "tokens sampled (not compared)"
    return ok, (
        f"check against transformers: max |logit difference| {err:.2e} (tolerance {tol}) over {len(logits)} "
        f"positions; {tokens_text}: {'OK' if ok else 'FAILED'}"
    )


def _tokens_that_fit(shape: tuple, options: dict, fraction: float, device: object, reserved: int = 0) -> int:
    """Tokens of the cache ``options`` describe that ``fraction`` of ``device``'s free memory holds, once
    ``reserved`` more bytes (the weights) are taken."""
    from tvmkv.runtime.cache import available_bytes, make_config

    plain = {k: v for k, v in options.items() if k not in ("memory_fraction", "build_dir")}
    cfg = make_config(*shape, **{**plain, "num_pages": None})
    pages = int(max(0, available_bytes(device) - reserved) * fraction) // (cfg.page_bytes * cfg.num_layers)
    return pages * cfg.page_size
