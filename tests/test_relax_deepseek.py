"""The tiny Relax DeepSeek-V2-shaped model (MLA attention) against its PyTorch reference.

Scenario of every model test: three prompts (21, 6 and 11 tokens). Forward 0 prefills the first 12
tokens of prompt 0 with the whole of prompts 1 and 2, no history: ``prefill`` (non-absorbed self
attention only, as MLC-LLM does) or ``extend`` (the same merged with an absorbed cross attention over
the empty history); forward 1 (``extend``) takes the other 9 tokens of prompt 0 (history: absorbed
cross attention over 12 cached tokens, merged) together with the first generated token of sequences 1
and 2 (one-token queries with history through the same path). Sequence 0 is then forked into
sequence 3 (a partial page: copied on write), which continues from the parent's second most likely
token. Then 8 ``decode`` forwards (absorbed cross attention alone) of all sequences in one batch;
sequence 1 retires after 4. Every token's logits are compared with TorchDeepseek (plain causal
attention over all tokens, no cache, no absorption) in float32, and the rows the cache holds
(``debug_get_kv_mla``) with the reference's latents and rotated ``k_pe``.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import tvm
from conftest import device_of

import tvmkv
from tvmkv.generate import TOLERANCE, BuiltinOps, DirectOps
from tvmkv.relax import TvmBuiltinOverride, register
from tvmkv.relax.deepseek import DeepseekConfig, RelaxDeepseek, cache_kwargs, compile_deepseek, make_weights
from tvmkv.relax.deepseek_torch_ref import TorchDeepseek

SIZES = dict(max_batch_size=4, max_total_seq_len=128, prefill_chunk_size=32, page_size=16)
PROMPT_LENGTHS = (21, 6, 11)
FIRST_CHUNK = 12  # of prompt 0 in forward 0; the rest in forward 1
DECODE_STEPS = 8
RETIRE = (1, 4)  # sequence 1 leaves the batch after this many decode steps
FORK = (0, 3)  # parent, child (after forward 1)
CFG = DeepseekConfig()  # q_lora_rank=48 (DeepSeek-V2's q compression)
CFG_NO_Q_LORA = dataclasses.replace(CFG, q_lora_rank=None)  # DeepSeek-V2-Lite's direct q_proj


@pytest.fixture(scope="module")
def compiled():
    """``compiled(cfg, interface, target) -> (executable, param_names)``, each compiled once per module."""
    done: dict = {}

    def get(cfg: DeepseekConfig, interface: str, target: str):
        if (cfg, interface, target) not in done:
            if target == "cuda" and os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
                pytest.skip("this TVM is runtime-only: compiling the Relax model for cuda needs the full TVM")
            arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "") if target == "cuda" else None
            done[cfg, interface, target] = compile_deepseek(cfg, interface=interface, target=target, cuda_arch=arch)
        return done[cfg, interface, target]

    return get


def _prompts(cfg: DeepseekConfig) -> dict:
    rng = np.random.default_rng(7)
    return {sid: rng.integers(0, cfg.vocab_size, n).tolist() for sid, n in enumerate(PROMPT_LENGTHS)}


def _run(model: RelaxDeepseek, ops, cfg: DeepseekConfig, get_rows, check_integrity=None, first="prefill") -> list:
    """Drive the scenario; returns ``(step, seq_id, position, max |logit - reference|)`` for every token
    whose logits were computed. ``get_rows(seq_id) -> [layers, L, D]`` reads the cache's rows (None:
    not checked)."""
    reference = TorchDeepseek(cfg, make_weights(cfg))
    prompts = _prompts(cfg)
    seqs = {sid: [] for sid in prompts}  # tokens in the cache or about to be
    errors = []

    def forward(step: int, parts: dict, mode: str):  # parts: seq_id -> new tokens
        for sid, toks in parts.items():
            seqs[sid].extend(toks)
        ops.begin_forward(list(parts), [len(t) for t in parts.values()])
        logits = getattr(model, mode)([t for toks in parts.values() for t in toks], ops.cache)
        ops.end_forward()
        if check_integrity is not None:
            check_integrity()
        row = 0
        nxt = {}
        for sid, toks in parts.items():
            want = reference.logits(seqs[sid])[-len(toks) :]
            for j in range(len(toks)):
                pos = len(seqs[sid]) - len(toks) + j
                errors.append((step, sid, pos, float(np.abs(logits[row + j] - want[j]).max())))
            row += len(toks)
            nxt[sid] = want[-1]
        return nxt  # seq_id -> reference logits of its next token

    for sid in prompts:
        ops.add_sequence(sid)
    p0 = prompts[0]
    nxt = forward(0, {0: p0[:FIRST_CHUNK], 1: prompts[1], 2: prompts[2]}, first)
    pending = {sid: int(np.argmax(nxt[sid])) for sid in (1, 2)}
    nxt = forward(1, {0: p0[FIRST_CHUNK:], 1: [pending[1]], 2: [pending[2]]}, "extend")
    parent, child = FORK
    ops.fork_sequence(parent, child)
    seqs[child] = list(seqs[parent])
    pending = {sid: int(np.argmax(x)) for sid, x in nxt.items()}
    pending[child] = int(np.argsort(nxt[parent])[-2])  # the parent's second choice
    for step in range(2, DECODE_STEPS + 2):
        if step == RETIRE[1] + 2:
            ops.remove_sequence(RETIRE[0])
            del pending[RETIRE[0]]
        nxt = forward(step, {sid: [tok] for sid, tok in pending.items()}, "decode")
        pending = {sid: int(np.argmax(x)) for sid, x in nxt.items()}
    for sid in pending:
        if get_rows is not None:
            want, got = reference.mla_rows(seqs[sid]), get_rows(sid)
            assert got.shape == want.shape, (sid, got.shape, want.shape)
            assert np.abs(got - want).max() < TOLERANCE[cfg.dtype], f"cached MLA rows of sequence {sid}"
        ops.remove_sequence(sid)
    return errors


def _assert_close(errors: list, tol: float):
    bad = [e for e in errors if not e[3] <= tol]
    assert not bad, (
        f"{len(bad)} of {len(errors)} tokens differ from the reference by > {tol}; (step, seq, pos, err): {bad[:8]}"
    )
    decoded = 4 * RETIRE[1] + 3 * (DECODE_STEPS - RETIRE[1])  # 4 sequences, then 3
    assert len(errors) == sum(PROMPT_LENGTHS) + 2 + decoded
    assert max(pos for _, _, pos, _ in errors) == PROMPT_LENGTHS[0] + DECODE_STEPS - 1


@pytest.mark.parametrize(("cfg", "first"), [(CFG, "extend"), (CFG_NO_Q_LORA, "prefill")], ids=["q_lora", "no_q_lora"])
def test_tvmkv_interface_matches_torch(target, compiled, cfg, first):
    """Own interface: TvmkvKVCache's append_mla_kv / self_attention / cross_attention /
    merge_attn_output_inplace on a tvmkv.PagedAttentionKVCache.mla(...) driven from Python."""
    ex, names = compiled(cfg, "tvmkv", target)
    model = RelaxDeepseek(ex, names, make_weights(cfg), cfg, device_of(target))
    cache = tvmkv.PagedAttentionKVCache.mla(**cache_kwargs(cfg), **SIZES, target=target)
    assert cache.config.is_mla and cache.config.mla_self_dims == (32, 16)
    errors = _run(model, DirectOps(cache), cfg, cache.debug_get_kv_mla, cache.check_integrity, first)
    _assert_close(errors, TOLERANCE[cfg.dtype])
    assert cache.num_available_pages() == cache.config.total_pages


@pytest.mark.parametrize("first", ["prefill", "extend"])
def test_tvm_interface_on_tvmkv_matches_torch(target, compiled, first):
    """Drop-in: the model written against TVM's PagedKVCache (AttnKind.MLA create call, append_mla_kv,
    self/cross attention, merge_attn_output_inplace, get_query_positions) runs unchanged on tvmkv's
    MLA cache, driven through the vm.builtin.* globals. (TVM's own cache gets "extend" wrong on the
    first forward, where no sequence has history: its cross attention leaves o/lse unwritten; seen
    on CUDA, apache-tvm 0.27. MLC-LLM calls "prefill" there.)"""
    ex, names = compiled(CFG, "tvm", target)
    with TvmBuiltinOverride(mla_self_dims=CFG.mla_self_dims) as override:
        model = RelaxDeepseek(ex, names, make_weights(CFG), CFG, device_of(target), interface="tvm")
        cache = model.create_paged_kv_cache(**SIZES)
        assert isinstance(cache, tvmkv.PagedAttentionKVCache) and override.created == [cache]
        assert cache.config.is_mla and cache.config.kv_lora_rank == CFG.kv_lora_rank
        assert cache.config.rope_mode == "none" and cache.config.mla_self_dims == CFG.mla_self_dims
        get_kv = tvm.get_global_func("vm.builtin.attention_kv_cache_debug_get_kv_mla")

        def rows(sid: int) -> np.ndarray:
            n = cache.sequence_length(sid)
            out = tvm.runtime.empty((CFG.num_layers, n, CFG.latent_dim), CFG.dtype, device_of(target))
            get_kv(cache, sid, 0, n, out)
            return out.numpy()

        errors = _run(model, BuiltinOps(cache), CFG, rows, cache.check_integrity, first)
    _assert_close(errors, TOLERANCE[CFG.dtype])
    assert cache.num_available_pages() == cache.config.total_pages


def test_tvm_interface_on_llvm_needs_the_override(compiled):
    """TVM 0.27 has no MLA kernels for llvm: its TIRPagedKVCache refuses, and the create call the model
    emits instead (empty kernel slots) is for tvmkv's override only. If this fails, TVM changed:
    run the scenario on TVM's own cache too."""
    from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

    bb = tvm.relax.BlockBuilder()
    with pytest.raises(ValueError, match="MLA is not supported in TIR kernels"), bb.function("create", []):
        TIRPagedKVCache(
            attn_kind="mla",
            max_batch_size=4,
            max_total_seq_len=128,
            prefill_chunk_size=32,
            page_size=16,
            support_sliding_window=0,
            layer_partition=tvm.relax.ShapeExpr([0, CFG.num_layers]),
            num_hidden_layers=CFG.num_layers,
            num_attention_heads=CFG.num_heads,
            num_key_value_heads=1,
            qk_head_dim=CFG.latent_dim,
            v_head_dim=CFG.kv_lora_rank,
            mla_original_qk_head_dim=CFG.q_head_dim,
            mla_original_v_head_dim=CFG.v_head_dim,
            rope_mode=RopeMode.NONE,
            rope_scale=1,
            rope_theta=CFG.rope_theta,
            rope_scaling={},
            rope_ext_factors=tvm.relax.prim_value(0),
            rotary_dim=CFG.qk_rope_head_dim,
            enable_disaggregation=False,
            dtype=CFG.dtype,
            target=tvm.target.Target("llvm"),
        )
    ex, names = compiled(CFG, "tvm", "llvm")
    model = RelaxDeepseek(ex, names, make_weights(CFG), CFG, tvm.cpu(), interface="tvm")
    with pytest.raises(TypeError, match="to `ffi.Function`"):  # TVM's own create: a tuple, not a kernel
        model.create_paged_kv_cache(**SIZES)


@pytest.mark.skipif(os.environ.get("TVM_USE_RUNTIME_LIB") == "1", reason="compiling needs the full TVM")
def test_compiles_for_cuda():
    """Both interfaces compile for cuda (sm_90; no GPU needed) and call the expected cache globals."""
    want = {
        "tvmkv": {f"tvmkv.{n}" for n in ("append_mla_kv", "self_attention", "cross_attention", "merge_attn_output")},
        "tvm": {
            f"vm.builtin.{n}"
            for n in (
                "paged_attention_kv_cache_create",
                "attention_kv_cache_append_mla_kv",
                "attention_kv_cache_self_attention",
                "attention_kv_cache_cross_attention",
                "attention_kv_cache_merge_attn_output_inplace",
            )
        },
    }
    for interface, names in want.items():
        ex, _ = compile_deepseek(CFG, interface=interface, target="cuda", cuda_arch="sm_90")
        text = tvm.relax.VMExecutable(ex).as_text()
        assert all(f"@{n} packed_func" in text for n in names), (interface, names)


def test_the_oracle_has_teeth():
    """The reference is sensitive to what the scenario checks: the rotation of q_pe / k_pe (another RoPE
    base), the latent's RMSNorm and the absorbed key rows (W_UK) move the logits of a 30-token sequence
    far beyond the tolerance."""
    weights = make_weights(CFG)
    tokens = _prompts(CFG)[0] + list(range(9))
    want = TorchDeepseek(CFG, weights).logits(tokens)
    nope = CFG.qk_nope_head_dim

    def changed(name_end: str, f) -> dict:
        return {k: (f(v) if k.endswith(name_end) else v) for k, v in weights.items()}

    def scale_k_nope(w):  # the key rows of every head's kv_b_proj block (what W_UK absorbs)
        w = w.reshape(CFG.num_heads, nope + CFG.v_head_dim, -1).copy()
        w[:, :nope] *= 1.5
        return w.reshape(-1, w.shape[-1])

    others = [
        TorchDeepseek(dataclasses.replace(CFG, rope_theta=100.0), weights),
        TorchDeepseek(CFG, changed("kv_a_layernorm.weight", np.ones_like)),
        TorchDeepseek(CFG, changed("kv_b_proj.weight", scale_k_nope)),
    ]
    assert np.abs(others[0].logits(tokens[:1]) - want[:1]).max() < 1e-9  # position 0: no rotation
    for other in others:
        assert np.abs(other.logits(tokens) - want).max() > 100 * TOLERANCE["float32"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(kv_lora_rank=31), "kv_lora_rank=31"),
        (dict(qk_rope_head_dim=0), "qk_rope_head_dim=0"),
        (dict(q_lora_rank=0), "q_lora_rank=0"),
        (dict(dtype="bfloat16"), "dtype='bfloat16'"),
    ],
)
def test_config_rejects_bad_shapes(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **change)


def test_config_derives_the_cache_shapes():
    assert (CFG.q_head_dim, CFG.latent_dim, CFG.mla_self_dims) == (32, 48, (32, 16))
    assert CFG.sm_scale == pytest.approx(32.0**-0.5)
    kw = cache_kwargs(CFG)
    assert (kw["kv_lora_rank"], kw["qk_rope_head_dim"], kw["rope_mode"]) == (32, 16, "none")


def test_own_mla_globals_reject_a_foreign_cache():
    register()
    for name, nargs in [
        ("tvmkv.append_mla_kv", 2),
        ("tvmkv.self_attention", 7),
        ("tvmkv.cross_attention", 5),
        ("tvmkv.merge_attn_output", 6),
    ]:
        with pytest.raises(TypeError, match="tvmkv.PagedAttentionKVCache"):
            tvm.get_global_func(name)(object(), *([None] * nargs))
