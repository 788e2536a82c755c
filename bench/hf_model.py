"""A Llama-3-8B-shaped model served through tvmkv and through TVM's own cache, in the same compiled model
(issue 19): the cache's share of a real step.

The model (``LLAMA3_8B``: 32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary
128256, RoPE theta 500000, fp16; random weights made on the GPU, about 16 GB) is compiled once against TVM's
``PagedKVCache`` (``interface="tvm"``: its ``create_paged_kv_cache`` builds TVM's C++ cache with TVM's own
TIR attention kernels compiled into the library). It runs twice from that one library: on TVM's cache, and
on tvmkv's through the drop-in (:class:`tvmkv.relax.TvmBuiltinOverride`: the same create call returns a
tvmkv cache). Per cache:

- time to first token of a ``--prompt``-token prompt (one sequence, the prompt in one forward, until its
  logits are on the host);
- decode tokens/s at each batch of ``--batches``: B sequences prefilled with 128 tokens each, then
  ``--steps`` timed decode steps after 3 untimed ones (``begin_forward`` + the model's ``forward`` +
  ``end_forward``, the device synchronized; the logits stay on the device as a device-side sampler's
  would);
- the attention alone: one decode step's 32 ``attention_with_fused_qkv`` calls (append + attention, every
  layer) on that cache at that batch, timed the same way, which is the cache's share of the step.

Two steps::

    python bench/hf_model.py --prepare DIR            # here: the model for cuda sm_90 (a few minutes)
    python3 bench/hf_model.py --from DIR [--out OUT]  # on the GPU machine (TVMKV_BUILD_DIR: tvmkv's kernels
                                                      # for 32 / 8 heads of 128, fp16, RoPE normal, sm_90)

The model's matmuls use TVM's DLight schedules without tensor cores (tvmkv/relax/llama.py says why), so
the rest of the step is theirs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import ROOT  # noqa: F401  (puts the checkout on sys.path)

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_qo_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    dtype="float16",
)
SMOKE = dict(LLAMA3_8B, vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2, dtype="float32")
PREFILL = 128  # tokens per sequence before the timed decode steps


def prepare(out: Path, shape: dict, target: str) -> None:
    from tvmkv.relax.llama import LlamaConfig, compile_llama

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ex, names = compile_llama(
        LlamaConfig(**shape), interface="tvm", target=target, cuda_arch=None if target == "llvm" else "sm_90"
    )
    ex.export_library(str(out / "model.so"))
    (out / "model.json").write_text(json.dumps({"param_names": names, "config": shape}))
    print(f"compiled in {time.perf_counter() - t0:.1f}s into {out}")


def _weights(cfg, names, device, smoke: bool) -> list:
    """Random weights in the model's parameter order, made on the device (linear weights N(0, 1/in), norms 1)."""
    import torch
    import tvm

    from tvmkv.relax.llama import make_weights, param_dtype

    if smoke:
        w = make_weights(cfg)
        return [tvm.runtime.tensor(w[n].astype(param_dtype(n, cfg)), device) for n in names]
    H, D, V, I = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size  # noqa: E741
    shape_of = {
        "embed_tokens.weight": (V, H),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.qkv_proj.weight": (cfg.qkv_heads * D, H),
        "self_attn.o_proj.weight": (H, cfg.num_qo_heads * D),
        "mlp.gate_up_proj.weight": (2 * I, H),
        "mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (V, H),
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for n in names:
        shape = next(s for suffix, s in shape_of.items() if n.endswith(suffix))
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.float16, device="cuda")
        else:
            t = torch.randn(shape, dtype=torch.float16, device="cuda", generator=gen) * shape[-1] ** -0.5
        out.append(tvm.runtime.from_dlpack(t))
    return out


class _Builtins:
    """TVM's vm.builtin.* functions of a cache (either kind: under the override they dispatch on it)."""

    def __init__(self):
        import tvm

        def f(name):
            return tvm.get_global_func("vm.builtin." + name)

        self.add, self.remove = f("kv_state_add_sequence"), f("kv_state_remove_sequence")
        self.begin, self.end = f("kv_state_begin_forward"), f("kv_state_end_forward")
        self.attention = f("attention_kv_cache_attention_with_fused_qkv")


def _measure(vm, params, cache, b: _Builtins, cfg, device, batches, steps: int, prompt: int) -> dict:
    import numpy as np
    import tvm
    from tvm_ffi import Shape

    rng = np.random.default_rng(0)

    def ids(n):
        return tvm.runtime.tensor(rng.integers(0, cfg.vocab_size, (1, n)).astype("int32"), device)

    forward = vm["forward"]
    res: dict = {}
    b.add(cache, 0)  # time to first token: the prompt in one forward, its logits on the host
    b.begin(cache, Shape([0]), Shape([prompt]))
    forward(ids(prompt), cache, params)  # warm-up of this shape
    b.end(cache)
    b.remove(cache, 0)
    ttft = []
    for _ in range(3):
        b.add(cache, 0)
        device.sync()
        t0 = time.perf_counter()
        b.begin(cache, Shape([0]), Shape([prompt]))
        logits = forward(ids(prompt), cache, params)
        b.end(cache)
        logits.numpy()
        ttft.append(time.perf_counter() - t0)
        b.remove(cache, 0)
    res["ttft_ms"] = statistics.median(ttft) * 1e3
    D, hq = cfg.head_dim, cfg.num_qo_heads
    for batch in batches:
        seqs = list(range(batch))
        for s in seqs:
            b.add(cache, s)
            b.begin(cache, Shape([s]), Shape([PREFILL]))
            forward(ids(PREFILL), cache, params)
            b.end(cache)
        times = []
        for step in range(3 + steps):
            device.sync()
            t0 = time.perf_counter()
            b.begin(cache, Shape(seqs), Shape([1] * batch))
            forward(ids(batch), cache, params)
            b.end(cache)
            device.sync()
            if step >= 3:
                times.append(time.perf_counter() - t0)
        qkv = tvm.runtime.tensor((rng.standard_normal((batch, cfg.qkv_heads, D)) * 0.5).astype(cfg.dtype), device)
        o = tvm.runtime.empty((batch, hq, D), cfg.dtype, device)
        attn = []
        for rep in range(3 + steps):  # one step's attention calls alone, every layer
            b.begin(cache, Shape(seqs), Shape([1] * batch))
            device.sync()
            t0 = time.perf_counter()
            for layer in range(cfg.num_layers):
                b.attention(cache, layer, cfg.sm_scale, qkv, o)
            device.sync()
            if rep >= 3:
                attn.append(time.perf_counter() - t0)
            b.end(cache)
        for s in seqs:
            b.remove(cache, s)
        step_ms = statistics.median(times) * 1e3
        res[batch] = (step_ms, batch / (step_ms / 1e3), statistics.median(attn) * 1e3)
    return res


def run(src: Path, batches, steps: int, prompt: int, out: Path | None, smoke: bool) -> None:
    from tvmkv.payload import bootstrap

    bootstrap()
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from tvmkv.relax import TvmBuiltinOverride
    from tvmkv.relax.llama import LlamaConfig, tvm_shape_int

    meta = json.loads((src / "model.json").read_text())
    cfg = LlamaConfig(**meta["config"])
    device = tvm.cpu(0) if smoke else tvm.cuda(0)
    name = "CPU (smoke run)" if smoke else device.device_name
    ex = tvm.runtime.load_module(str(src / "model.so"))
    t0 = time.perf_counter()
    params = _weights(cfg, meta["param_names"], device, smoke)
    print(f"{name}: weights made in {time.perf_counter() - t0:.1f}s", flush=True)
    most = max(batches)
    sizes = (most, most * (PREFILL + 2 * steps + 8) + prompt, max(prompt, PREFILL, most), 16, 0)
    results = {}
    for which in ("TVM", "tvmkv"):
        override = TvmBuiltinOverride(cuda_arch=None if smoke else "sm_90") if which == "tvmkv" else None
        if override is not None:
            override.install()
        try:
            vm = VirtualMachine(ex, device)  # resolves the vm.builtin.* names now: tvmkv's under the override
            cache = vm["create_paged_kv_cache"](*(tvm_shape_int(x) for x in sizes))
            kind = type(cache).__module__ + "." + type(cache).__name__
            print(f"{which}: cache {kind}", flush=True)
            results[which] = _measure(vm, params, cache, _Builtins(), cfg, device, batches, steps, prompt)
            print(f"{which}: {results[which]}", flush=True)
            del cache, vm
        finally:
            if override is not None:
                override.uninstall()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"{name}, TVM 0.27.0.post1 runtime, {stamp}; {json.dumps(meta['config'])}; the same compiled model on "
        "each cache; ms are medians",
        "",
        f"time to first token, {prompt}-token prompt: TVM's cache {results['TVM']['ttft_ms']:.1f} ms, "
        f"tvmkv {results['tvmkv']['ttft_ms']:.1f} ms",
        "",
        f"| batch | cache | ms / decode step | tokens/s | attention of a step ({cfg.num_layers} layers) ms "
        "| attention share | rest of the step ms | tvmkv / TVM tokens/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for batch in batches:
        for which in ("TVM", "tvmkv"):
            step, tps, attn = results[which][batch]
            ratio = f"{tps / results['TVM'][batch][1]:.2f}" if which == "tvmkv" else ""
            lines.append(
                f"| {batch} | {which} | {step:.2f} | {tps:.0f} | {attn:.2f} | {attn / step:.0%} | {step - attn:.2f} "
                f"| {ratio} |"
            )
    text = "\n".join(lines)
    print(text)
    if out is not None:
        (out / "hf_model.md").write_text(text + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare", type=Path, help="compile the model into this folder and exit")
    ap.add_argument("--from", dest="src", type=Path, help="the folder --prepare wrote")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=2048, help="tokens of the time-to-first-token prompt")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="a small model on the CPU: checks the script")
    args = ap.parse_args(argv)
    shape = SMOKE if args.smoke else LLAMA3_8B
    if args.prepare:
        prepare(args.prepare, shape, "llvm" if args.smoke else "cuda")
        return 0
    if not args.src:
        ap.error("pass --prepare DIR (here) or --from DIR (on the GPU machine)")
    run(args.src, args.batches, args.steps, args.prompt, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
