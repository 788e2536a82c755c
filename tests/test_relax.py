"""The tiny Relax Llama on tvmkv's cache against the cache-free PyTorch reference (tvmkv.relax).

Scenario of every model test: two prompts (21 tokens, chunked by prefill_chunk_size=16, and 6),
sequence 0 forked right after its prefill, then 16 decode steps of all three sequences in one batch,
each step's logits compared with TorchLlama (full recompute) and the cache's integrity checked.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tvm
from conftest import device_of

import tvmkv
from tvmkv.generate import TOLERANCE, BuiltinOps, DirectOps, Request, generate
from tvmkv.relax import UNSUPPORTED, TvmBuiltinOverride, register
from tvmkv.relax.llama import LlamaConfig, RelaxLlama, compile_llama, make_weights
from tvmkv.relax.torch_ref import TorchLlama

SIZES = dict(max_batch_size=4, max_total_seq_len=256, prefill_chunk_size=16, page_size=16)
DECODE_STEPS = 16
_compiled: dict = {}


def _compiled_model(cfg: LlamaConfig, interface: str, target: str):
    key = (cfg, interface, target)
    if key not in _compiled:
        if target == "cuda" and os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
            pytest.skip("this TVM is runtime-only: compiling the Relax model for cuda needs the full TVM")
        arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "") if target == "cuda" else None
        _compiled[key] = compile_llama(cfg, interface=interface, target=target, cuda_arch=arch)
    return _compiled[key]


def _requests(cfg: LlamaConfig):
    rng = np.random.default_rng(7)
    return [
        Request(0, rng.integers(0, cfg.vocab_size, 21).tolist(), DECODE_STEPS + 1),
        Request(1, rng.integers(0, cfg.vocab_size, 6).tolist(), DECODE_STEPS + 1),
    ]


def _run(model, ops, cfg, cache):
    report = generate(
        model,
        ops,
        _requests(cfg),
        prefill_chunk_size=SIZES["prefill_chunk_size"],
        max_batch_size=SIZES["max_batch_size"],
        total_pages=cache.config.total_pages,
        reference=TorchLlama(cfg, make_weights(cfg)),
        tolerance=TOLERANCE[cfg.dtype],
        fork=(0, 2, DECODE_STEPS + 1),
        check_integrity=cache.check_integrity,
        log=None,
    )
    assert report.ok, f"logits differ from the reference: {report.failures[:5]}"
    decode_steps = [s for s in report.steps if all(n == 1 for _, _, n in s.parts)]
    assert len(decode_steps) >= DECODE_STEPS
    assert max(len(s.parts) for s in decode_steps) == 3  # both prompts and the fork decode together
    assert any("fork 0->2" in e for s in report.steps for e in s.events)
    assert any(n == SIZES["prefill_chunk_size"] for s in report.steps for _, _, n in s.parts)  # chunked
    assert all(len(toks) == DECODE_STEPS + 1 for toks in report.outputs.values())
    assert report.outputs[0][1:] != report.outputs[2][1:] or report.outputs[0][0] != report.outputs[2][0]
    assert cache.num_available_pages() == cache.config.total_pages  # every sequence retired
    return report


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tvmkv_interface_matches_torch(target, dtype):
    """Own interface: TvmkvKVCache in the model, tvmkv.PagedAttentionKVCache driven from Python."""
    cfg = LlamaConfig(dtype=dtype)
    ex, names = _compiled_model(cfg, "tvmkv", target)
    model = RelaxLlama(ex, names, make_weights(cfg), cfg, device_of(target))
    cache = tvmkv.PagedAttentionKVCache(
        cfg.num_layers,
        cfg.num_qo_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        **SIZES,
        dtype=dtype,
        rope_mode="normal",
        rope_theta=cfg.rope_theta,
        target=target,
    )
    _run(model, DirectOps(cache), cfg, cache)


def test_tvm_interface_runs_on_tvmkv(target):
    """Drop-in: the model written against TVM's PagedKVCache (create_paged_kv_cache with TIR kernels,
    vm.builtin.* calls) runs unchanged on tvmkv's cache, driven through the vm.builtin.kv_state_* globals."""
    cfg = LlamaConfig()
    ex, names = _compiled_model(cfg, "tvm", target)
    with TvmBuiltinOverride() as override:
        model = RelaxLlama(ex, names, make_weights(cfg), cfg, device_of(target), interface="tvm")
        cache = model.create_paged_kv_cache(**SIZES)
        assert isinstance(cache, tvmkv.PagedAttentionKVCache) and override.created == [cache]
        assert cache.config.rope_mode == "normal" and cache.config.page_size == SIZES["page_size"]
        assert cache.config.target_kind == ("llvm" if target == "llvm" else "cuda")
        _run(model, BuiltinOps(cache), cfg, cache)
    # originals restored: TVM's own kv_state_add_sequence rejects a Python object
    with pytest.raises(Exception):  # noqa: B017 (TVM's type error)
        tvm.get_global_func("vm.builtin.kv_state_add_sequence")(cache, 9)


def test_override_delegates_to_tvms_own_cache():
    """Under the override, a TVM cache (made before installing it) still goes to TVM's functions."""
    cfg = LlamaConfig()
    ex, names = _compiled_model(cfg, "tvm", "llvm")
    weights = make_weights(cfg)
    outside = RelaxLlama(ex, names, weights, cfg, tvm.cpu(), interface="tvm")
    tvm_cache = outside.create_paged_kv_cache(**SIZES)
    assert not isinstance(tvm_cache, tvmkv.PagedAttentionKVCache)
    with TvmBuiltinOverride():
        inside = RelaxLlama(ex, names, weights, cfg, tvm.cpu(), interface="tvm")  # resolves the overrides
        ops = BuiltinOps(tvm_cache)
        rng = np.random.default_rng(3)
        prompt = rng.integers(0, cfg.vocab_size, 9).tolist()
        ops.add_sequence(0)
        ops.begin_forward([0], [len(prompt)])
        logits = inside.forward(prompt, tvm_cache)
        ops.end_forward()
    want = TorchLlama(cfg, weights).logits(prompt)
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)


def test_unsupported_builtins_name_themselves():
    cfg = LlamaConfig()
    cache = tvmkv.PagedAttentionKVCache(
        cfg.num_layers,
        cfg.num_qo_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        **SIZES,
        dtype="float32",
        rope_mode="normal",
        target="llvm",
    )
    with TvmBuiltinOverride():
        for name in UNSUPPORTED:
            # NotImplementedError in Python; the FFI boundary turns it into a RuntimeError
            with pytest.raises((NotImplementedError, RuntimeError), match=name.replace(".", r"\.")):
                tvm.get_global_func(name)(cache, 0, 1.0)
        nav = tvm.get_global_func("vm.builtin.attention_kv_cache_get_num_available_pages")
        assert nav(cache) == cache.config.total_pages


def _create_args(**change):
    """Arguments of vm.builtin.paged_attention_kv_cache_create as TVM 0.27's TIRPagedKVCache passes them."""
    args = dict(
        sizes=[4, 256, 16, 16, 0, 1024],
        partition=[0, 2],
        hq=4,
        hkv=2,
        qk=64,
        v=64,
        kinds=[0, 0],
        disagg=False,
        rope=1,
        scale=1.0,
        theta=1e4,
        ext=0,
        ref=tvm.runtime.tensor(np.zeros((), "float32"), tvm.cpu()),
    )
    args.update(change)
    return [*args.values()] + [None] * 15


def test_create_maps_tvm_arguments_and_rejects_what_tvmkv_lacks():
    override = TvmBuiltinOverride(num_pages=40)
    kw = override.cache_kwargs(*_create_args(rope=2, theta=5e5, sizes=[4, 256, 16, 32, 1, 1024]))
    assert kw["num_layers"] == 2 and kw["page_size"] == 32 and kw["rope_mode"] == "inline"
    assert kw["rope_theta"] == 5e5 and kw["support_sliding_window"] and kw["num_pages"] == 40
    assert kw["dtype"] == "float32" and kw["target"] == "llvm"
    assert override.cache_kwargs(*_create_args(ext=None))["rope_mode"] == "normal"  # None: no factors (TVM)
    # TVM's cache rotates K inline whenever it supports sliding windows (paged_kv_cache.cc, the rope_mode_
    # initializer; MLC's Mistral creates such a cache with rope_mode 1): it ran in "normal" mode here, and
    # once a window slid its outputs and debug_get_kv differed from TVM's
    slide = [4, 256, 16, 16, 1, 1024]
    assert override.cache_kwargs(*_create_args(rope=1, sizes=slide))["rope_mode"] == "inline"
    assert override.cache_kwargs(*_create_args(rope=0, sizes=slide))["rope_mode"] == "none"
    scaled = TvmBuiltinOverride(rope_scaling={"rope_type": "gptj"})
    with pytest.raises(NotImplementedError, match="rotates K inline"):  # tvmkv's inline RoPE has no variants
        scaled.cache_kwargs(*_create_args(rope=1, sizes=slide))
    # AttnKind.MHA_SLIDING layers take the config's 6th entry (layer_sliding_window_size) as their window
    assert override.cache_kwargs(*_create_args(kinds=[3, 0], sizes=[4, 256, 16, 16, 0, 5]))["layer_windows"] == [5, 0]
    with pytest.raises(ValueError, match="layer_sliding_window_size"):
        override.cache_kwargs(*_create_args(kinds=[3, 0], sizes=[4, 256, 16, 16, 0]))
    for change, match in [
        (dict(kinds=[0, 1]), "MLA"),
        (dict(v=32), "v_head_dim"),
        (dict(disagg=True), "disagg"),
    ]:
        with pytest.raises(NotImplementedError, match=match):
            override.cache_kwargs(*_create_args(**change))
    # two pipeline stages outside a Disco session of two worker groups (TVM checks the same)
    for partition in ([0, 1, 2], [1, 2], [0, 2, 2], [0, 3]):
        with pytest.raises(ValueError, match="layer_partition"):
            override.cache_kwargs(*_create_args(partition=partition))
    with pytest.raises(ValueError, match="longrope"):  # extension factors without TvmBuiltinOverride(rope_scaling=)
        override.cache_kwargs(*_create_args(ext=tvm.runtime.tensor(np.ones(32, "float32"), tvm.cpu())))


def test_attention_global_rejects_a_foreign_cache():
    register()
    f = tvm.get_global_func("tvmkv.attention_with_fused_qkv")
    with pytest.raises(TypeError, match="tvmkv.PagedAttentionKVCache"):
        f(object(), 0, 0.125, None, None)


def test_overrides_uninstalled_in_any_order_restore_tvms_functions():
    """Two overrides, the first uninstalled first: the second had recorded the first's functions as its
    originals and put them back, so TVM's create stayed replaced after both were uninstalled."""
    import tvm_ffi

    from tvmkv.relax import builtins

    names = (builtins.CREATE, "vm.builtin.kv_state_add_sequence")
    tvms = [tvm_ffi.get_global_func(n) for n in names]
    live = lambda: [tvm_ffi.get_global_func(n) for n in names]  # noqa: E731
    first, second = TvmBuiltinOverride(), TvmBuiltinOverride()
    first.install()
    mine = live()
    second.install()
    theirs = live()
    assert not any(a.same_as(b) for a, b in zip(mine, theirs))
    first.uninstall()  # the second stays live
    assert all(a.same_as(b) for a, b in zip(live(), theirs))
    second.uninstall()
    assert all(a.same_as(b) for a, b in zip(live(), tvms))
    first.install()
    mine = live()
    second.install()
    second.uninstall()  # in reverse order of install, as before
    assert all(a.same_as(b) for a, b in zip(live(), mine))
    first.uninstall()
    assert all(a.same_as(b) for a, b in zip(live(), tvms))
