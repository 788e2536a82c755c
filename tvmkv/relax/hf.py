"""A Hugging Face checkpoint directory of the Llama family on tvmkv's Relax model (issue 19).

Three things, each read from the directory alone (nothing is downloaded):

- :func:`read_config`: ``config.json`` mapped onto :class:`~tvmkv.relax.llama_config.LlamaConfig`
  (Llama 2 / 3.x with its RoPE scaling, Mistral with its sliding window, Qwen2 with q/k/v biases and
  per-layer windows, Qwen3 with q/k norms); what the model cannot run is refused up front, by name.
- :func:`load_weights`: the ``*.safetensors`` files (one, or sharded with ``model.safetensors.index.json``),
  memory-mapped, each tensor converted to the model dtype and put into the model's fused parameters
  (q, k, v rows into ``qkv_proj``; gate and up into ``gate_up_proj``); missing, misshapen and unexpected
  tensors are all named in one error.
- :class:`Tokenizer`: ``tokenizer.json`` through ``tokenizers``, and the chat template of
  ``tokenizer_config.json`` (Jinja) where the checkpoint has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import errors
from .llama_config import LlamaConfig

# architecture (config.json "architectures") -> model_type; the four the Relax model runs
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3")  # Hugging Face rope_type values mapped onto the cache's RoPE
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry, which the model computes itself


class CheckpointError(errors.TvmkvError, ValueError):
    """A checkpoint directory the model cannot run: the message names what and what would work."""


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`read_config` learned: the model's config and the generation facts around it."""

    directory: Path
    architecture: str
    cfg: LlamaConfig
    eos_token_ids: tuple
    max_position_embeddings: int


def _json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: no {path.name} ({what})") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: a JSON object expected, got {type(data).__name__}")
    return data


def read_config(directory: str | Path, dtype: str = "float32") -> Checkpoint:
    """The checkpoint in ``directory`` as a :class:`Checkpoint` whose model runs in ``dtype``
    ("float32" or "float16"; the checkpoint's own dtype, bfloat16 included, is converted when loading)."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"--model {directory}: not a directory (a Hugging Face checkpoint directory expected)")
    c = _json(d / "config.json", "the model's Hugging Face config")
    arch = (c.get("architectures") or [None])[0]
    if arch is None:  # older configs: the model type alone
        arch = {v: k for k, v in ARCHITECTURES.items()}.get(str(c.get("model_type")))
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{d / 'config.json'}: architecture {arch or c.get('model_type')!r} is not supported; tvmkv runs "
            f"{', '.join(ARCHITECTURES)}"
        )
    kind = ARCHITECTURES[arch]
    if dtype not in ("float32", "float16"):
        raise CheckpointError(f"dtype {dtype!r}: the model runs in float32 or float16 (bfloat16 weights convert)")
    problems = []
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {c['hidden_act']!r} (only silu)")
    if c.get("mlp_bias"):
        problems.append("mlp_bias true (the MLP has no biases)")
    partial = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        problems.append(f"partial_rotary_factor {partial} (RoPE over whole heads only)")
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    layers = int(c["num_hidden_layers"])
    rope_scale, rope_scaling, theta = _rope(c, problems)
    windows = _windows(c, kind, layers, problems)
    if problems:
        raise CheckpointError(f"{d / 'config.json'} ({arch}): not supported: {'; '.join(problems)}")
    bias = bool(c.get("attention_bias", False))
    cfg = LlamaConfig(
        vocab_size=int(c["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        num_layers=layers,
        num_qo_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scale=rope_scale,
        dtype=dtype,
        qkv_bias=True if kind == "qwen2" else bias and kind != "mistral",
        o_bias=bias and kind in ("llama", "qwen3"),
        qk_norm=kind == "qwen3",
        layer_windows=windows,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )
    eos = c.get("eos_token_id")
    gen = d / "generation_config.json"
    if gen.is_file():
        eos = _json(gen, "generation defaults").get("eos_token_id", eos)
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
    return Checkpoint(d, arch, cfg, eos_ids, int(c.get("max_position_embeddings", 4096)))


def _rope(c: dict, problems: list) -> tuple:
    """``(rope_scale, rope_scaling dict or None, rope_theta)`` from ``rope_parameters`` (transformers >= 5)
    or ``rope_theta`` / ``rope_scaling`` (older configs)."""
    params = dict(c.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", c.get("rope_theta", 10000.0)))
    scaling = dict(c.get("rope_scaling") or params)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return 1.0, None, theta
    if kind == "linear":  # positions divided by the factor: the cache's rope_scale multiplies them
        return 1.0 / float(scaling["factor"]), None, theta
    if kind == "llama3":
        return 1.0, {**scaling, "rope_type": "llama3"}, theta
    problems.append(f"rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    return 1.0, None, theta


def _windows(c: dict, kind: str, layers: int, problems: list) -> tuple:
    """Per-layer sliding windows (() when no layer has one): Mistral's ``sliding_window`` on every layer,
    Qwen2/3's on the layers ``layer_types`` marks ``sliding_attention`` (when ``use_sliding_window``)."""
    window = c.get("sliding_window")
    if kind == "mistral":
        return (int(window),) * layers if window else ()
    if kind in ("qwen2", "qwen3") and c.get("use_sliding_window") and window:
        types = c.get("layer_types")
        if types is None:  # older configs: layers from max_window_layers on slide
            first = int(c.get("max_window_layers", 28))  # transformers' default
            types = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
        return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    if kind == "llama" and c.get("layer_types") and any(t != "full_attention" for t in c["layer_types"]):
        problems.append(f"layer_types {c['layer_types']} (Llama layers attend fully)")
    return ()


# ---------------------------------------------------------------------------------------------- weights
def _sources(ck: Checkpoint) -> dict:
    """Hugging Face tensor name -> the safetensors file holding it."""
    d = ck.directory
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map object")
        missing = sorted({f for f in weight_map.values() if not (d / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} names shards that are not in {d}: {', '.join(missing)}")
        return {name: d / f for name, f in weight_map.items()}
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{d}: no *.safetensors files (pytorch_model.bin checkpoints are not read: save the model with "
            "transformers' save_pretrained(..., safe_serialization=True))"
        )
    from safetensors import safe_open

    sources = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            sources.update({name: f for name in sf.keys()})
    return sources


def param_sources(cfg: LlamaConfig) -> dict:
    """The model's parameter name -> (the Hugging Face tensors concatenated into it, its shape)."""
    H, D, V, I = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size  # noqa: E741
    hq, hkv = cfg.num_qo_heads, cfg.num_kv_heads
    plan: dict = {"embed_tokens.weight": (["model.embed_tokens.weight"], (V, H))}
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        a, m = hf + "self_attn.", hf + "mlp."
        plan[ours + "input_layernorm.weight"] = ([hf + "input_layernorm.weight"], (H,))
        plan[ours + "self_attn.qkv_proj.weight"] = (
            [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
            ((hq + 2 * hkv) * D, H),
        )
        if cfg.qkv_bias:
            plan[ours + "self_attn.qkv_proj.bias"] = (
                [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
                ((hq + 2 * hkv) * D,),
            )
        plan[ours + "self_attn.o_proj.weight"] = ([a + "o_proj.weight"], (H, hq * D))
        if cfg.o_bias:
            plan[ours + "self_attn.o_proj.bias"] = ([a + "o_proj.bias"], (H,))
        if cfg.qk_norm:
            plan[ours + "self_attn.q_norm.weight"] = ([a + "q_norm.weight"], (D,))
            plan[ours + "self_attn.k_norm.weight"] = ([a + "k_norm.weight"], (D,))
        plan[ours + "post_attention_layernorm.weight"] = ([hf + "post_attention_layernorm.weight"], (H,))
        plan[ours + "mlp.gate_up_proj.weight"] = ([m + "gate_proj.weight", m + "up_proj.weight"], (2 * I, H))
        plan[ours + "mlp.down_proj.weight"] = ([m + "down_proj.weight"], (H, I))
    plan["norm.weight"] = (["model.norm.weight"], (H,))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    plan["lm_head.weight"] = ([head], (V, H))
    return plan


def check_weights(ck: Checkpoint) -> int:
    """Check, from the safetensors headers alone (nothing is read), that the checkpoint holds every tensor
    the model needs with its shape and nothing else (but the ``rotary_emb.inv_freq`` buffers some
    checkpoints keep); one :class:`CheckpointError` lists every problem. Returns the bytes the weights take
    in the model's dtypes."""
    from safetensors import safe_open

    from .llama import param_dtype

    cfg = ck.cfg
    plan = param_sources(cfg)
    sources = _sources(ck)
    wanted = {hf for hfs, _ in plan.values() for hf in hfs}
    shapes: dict = {}
    for f in sorted(set(sources.values())):
        with safe_open(str(f), framework="pt") as sf:
            names = set(sf.keys())
            for name in [n for n, src in sources.items() if src == f and n in wanted and n in names]:
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    missing = sorted(w for w in wanted if w not in shapes)
    extra = sorted(
        n
        for n in sources
        if n not in wanted
        and not n.endswith(_IGNORED)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")  # a tied head saved anyway
    )
    wrong = []
    for hfs, shape in plan.values():
        if any(h in missing for h in hfs):
            continue
        got = (sum(shapes[h][0] for h in hfs), *shapes[hfs[0]][1:])  # concatenated along the first axis
        if got != shape or any(shapes[h][1:] != shapes[hfs[0]][1:] for h in hfs):
            wrong.append(f"{' + '.join(hfs)}: {' + '.join(str(shapes[h]) for h in hfs)} where the config gives {shape}")
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if extra:
        parts.append(f"unexpected {len(extra)}: {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    if wrong:
        parts.append(f"of the wrong shape: {'; '.join(wrong[:8])}")
    if parts:
        raise CheckpointError(f"{ck.directory} does not match its config.json ({ck.architecture}): {'; '.join(parts)}")
    itemsize = {"float32": 4, "float16": 2}
    return sum(itemsize[param_dtype(n, cfg)] * int(np.prod(shape)) for n, (_, shape) in plan.items())


def load_weights(ck: Checkpoint, param_names: list) -> dict:
    """The model's parameters ``param_names`` (from :func:`~tvmkv.relax.llama.compile_llama`) as NumPy
    arrays of the dtypes the model takes them in (:func:`~tvmkv.relax.llama.param_dtype`), read from the
    checkpoint's safetensors files (memory-mapped, one tensor at a time). Every tensor the model needs must
    be there with its shape, and every tensor there must be used (but the ``rotary_emb.inv_freq`` buffers
    some checkpoints keep): otherwise one :class:`CheckpointError` lists them all."""
    import torch
    from safetensors import safe_open

    cfg = ck.cfg
    plan = param_sources(cfg)
    unknown = [n for n in param_names if n not in plan]
    if unknown:
        raise CheckpointError(f"the compiled model has parameters no checkpoint tensor maps to: {unknown[:5]}")
    check_weights(ck)
    sources = _sources(ck)
    from .llama import param_dtype

    dtypes = {"float32": torch.float32, "float16": torch.float16}
    handles: dict = {}
    out, wrong = {}, []
    try:
        for name in param_names:
            hf_names, shape = plan[name]
            tensors = []
            for hf in hf_names:
                f = sources[hf]
                if f not in handles:
                    handles[f] = safe_open(str(f), framework="pt")
                tensors.append(handles[f].get_tensor(hf).to(dtypes[param_dtype(name, cfg)]))
            t = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            if tuple(t.shape) != shape:
                wrong.append(f"{' + '.join(hf_names)}: {tuple(t.shape)} where the config gives {shape}")
                continue
            out[name] = t.numpy()
    finally:
        handles.clear()
    if wrong:
        raise CheckpointError(f"{ck.directory}: tensors of the wrong shape: {'; '.join(wrong[:8])}")
    return out


# ---------------------------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """``tokenizer.json`` (``tokenizers``) and the chat template of ``tokenizer_config.json``.

    :meth:`encode` renders the template around a user message when ``chat`` (and the checkpoint has one),
    else encodes the text with the tokenizer's own special tokens; :meth:`decode` drops special tokens.
    """

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer as Fast

        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(
                f"{d}: no tokenizer.json (the fast tokenizer's file; for a checkpoint with only tokenizer.model, "
                "save its tokenizer with transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
            )
        self.fast = Fast.from_file(str(path))
        conf = (
            _json(d / "tokenizer_config.json", "tokenizer settings") if (d / "tokenizer_config.json").exists() else {}
        )
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        self.chat_template = template
        self.special = {k: _token_text(conf.get(k)) for k in ("bos_token", "eos_token")}

    def encode(self, text: str, *, chat: bool = True) -> list:
        if chat and self.chat_template:
            return self.fast.encode(self.render(text), add_special_tokens=False).ids
        return self.fast.encode(text).ids

    def render(self, text: str) -> str:
        """The chat template around one user message ``text``, with the generation prompt. The template is
        the checkpoint's, so it runs in Jinja's sandbox (no access to Python's internals), with the helpers
        transformers gives templates (``raise_exception``, ``strftime_now``)."""
        from datetime import datetime

        from jinja2.exceptions import SecurityError, TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            return env.from_string(str(self.chat_template)).render(
                messages=[{"role": "user", "content": text}], add_generation_prompt=True, **self.special
            )
        except SecurityError as err:
            raise CheckpointError(f"the checkpoint's chat template tried what its sandbox forbids: {err}") from None
        except TemplateError as err:
            raise CheckpointError(f"the checkpoint's chat template failed: {err}; pass --no-chat-template") from None

    def decode(self, ids: list) -> str:
        return self.fast.decode([int(i) for i in ids], skip_special_tokens=True)


def _token_text(token: object) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with its ``content``."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return "" if token is None else str(token)


__all__ = [
    "ARCHITECTURES",
    "Checkpoint",
    "CheckpointError",
    "Tokenizer",
    "load_weights",
    "param_sources",
    "read_config",
]
