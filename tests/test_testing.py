"""tvmkv.testing: the cache factory's options and the kernel sets the shared tables need on the GPU machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tvmkv.build import expand_configs
from tvmkv.testing import cache_kwargs
from tvmkv.testing.configs import kernel_configs

GPU_CONFIGS = Path(__file__).resolve().parent.parent / "scripts" / "gpu_configs.json"


def test_cache_kwargs_defaults_and_sizing():
    kw = cache_kwargs()
    assert (kw["num_layers"], kw["num_qo_heads"], kw["num_kv_heads"], kw["head_dim"], kw["page_size"]) == (
        2,
        8,
        2,
        64,
        16,
    )
    assert (kw["max_total_seq_len"], kw["num_pages"], kw["target"]) == (512, None, "llvm")
    assert cache_kwargs(group=1, num_kv_heads=4)["num_qo_heads"] == 4
    assert cache_kwargs(page_size=4, num_pages=10)["max_total_seq_len"] == 40  # the pool, filled
    assert cache_kwargs(num_pages=10, max_total_seq_len=64)["max_total_seq_len"] == 64
    assert cache_kwargs(sliding=True, decode_splits=2)["support_sliding_window"] is True
    with pytest.raises(ValueError, match="num_qo_heads=8 and group=2"):
        cache_kwargs(num_qo_heads=8, group=2)


def test_gpu_configs_cover_the_shared_tables():
    """scripts/gpu_configs.json prebuilds every kernel set the shared tables make on cuda."""
    defaults = dict(rope_mode="none", sliding=False, target="cuda", arch=None)
    have = set(expand_configs(json.loads(GPU_CONFIGS.read_text()), defaults))
    missing = [key.name for key in expand_configs(kernel_configs(), defaults) if key not in have]
    assert not missing, f"add these kernel sets to {GPU_CONFIGS.name}: {missing}"
