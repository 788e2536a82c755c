"""Tensor parallelism over attention heads: which query and KV heads each shard holds.

Plain Python, no tensors, no TVM: the in-process lockstep cache (:mod:`.sharded`), the Disco workers
and a model's weight sharding all read the same :class:`ShardLayout` (docs/layout.md, "Tensor
parallelism").

A model sharded ``S`` ways gives shard ``s`` the query heads ``[s H_qo / S, (s + 1) H_qo / S)`` and
the KV heads those query heads read (GQA: query head ``h`` reads KV head ``h // (H_qo / H_kv)``):

* ``H_kv >= S``: each shard holds ``H_kv / S`` KV heads of its own, nothing is stored twice;
* ``H_kv < S`` (e.g. 8 KV heads on 16 GPUs, or MQA): each KV head is *replicated* on the
  ``S / H_kv`` consecutive shards whose query heads read it, one KV head per shard. The pages of
  all shards then hold ``S / H_kv`` times the K/V of the unsharded cache (:attr:`kv_memory_factor`);
  vLLM does the same, MLC refuses the configuration.

Each shard's cache is an ordinary :class:`~tvmkv.runtime.cache.PagedAttentionKVCache` over
``qo_per_shard`` query heads and ``kv_per_shard`` KV heads. Sequence operations are issued to every
shard alike; page allocation depends only on those operations (the pool's free list is a stack, low
ids first at the start, the last page freed handed out next: :mod:`.pages`), so the shards' page
tables agree without any communication, and :meth:`PagedAttentionKVCache.table_digest` tells when
they do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


@dataclass(frozen=True)
class ShardLayout:
    """The heads of each of ``num_shards`` shards of a cache with ``num_qo_heads`` / ``num_kv_heads``.

    Raises ``ValueError`` (naming the counts and what would work) when the query heads do not split
    evenly, or the KV heads neither split evenly nor replicate evenly over the shards.
    """

    num_qo_heads: int
    num_kv_heads: int
    num_shards: int

    def __post_init__(self):
        hq = _positive("num_qo_heads", self.num_qo_heads)
        hkv = _positive("num_kv_heads", self.num_kv_heads)
        s = _positive("num_shards", self.num_shards)
        if hq % hkv:
            raise ValueError(f"num_qo_heads={hq} must be a multiple of num_kv_heads={hkv} (GQA)")
        if hq % s:
            fits = [d for d in range(1, hq + 1) if hq % d == 0 and (hkv % d == 0 or d % hkv == 0)]
            raise ValueError(
                f"num_shards={s} does not divide num_qo_heads={hq}: every shard takes the same number of query "
                f"heads; shard counts that work for {hq} query / {hkv} KV heads: {fits}"
            )
        if hkv >= s and hkv % s:
            raise ValueError(
                f"num_shards={s} does not divide num_kv_heads={hkv}: every shard must hold whole KV heads; "
                f"use a shard count that divides {hkv}, or a multiple of it (KV heads are then replicated)"
            )
        if hkv < s and s % hkv:
            raise ValueError(
                f"num_shards={s} is not a multiple of num_kv_heads={hkv}: with fewer KV heads than shards each KV "
                f"head is replicated on num_shards / num_kv_heads shards, which must be a whole number"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def qo_per_shard(self) -> int:
        """Query heads of each shard."""
        return self.num_qo_heads // self.num_shards

    @property
    def kv_per_shard(self) -> int:
        """KV heads of each shard (1 when KV heads are replicated)."""
        return max(1, self.num_kv_heads // self.num_shards)

    @property
    def replicas(self) -> int:
        """Shards holding each KV head: ``num_shards / num_kv_heads`` when that is > 1, else 1."""
        return max(1, self.num_shards // self.num_kv_heads)

    @property
    def kv_memory_factor(self) -> float:
        """K/V bytes of all shards together over those of the unsharded cache (``replicas``)."""
        return self.num_shards * self.kv_per_shard / self.num_kv_heads

    # ------------------------------------------------------------------ heads of a shard
    def _shard(self, shard) -> int:
        if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < self.num_shards:
            raise ValueError(f"shard={shard!r} must be an int in [0, {self.num_shards})")
        return shard

    def qo_heads(self, shard: int) -> range:
        """The query heads of ``shard`` (global indices)."""
        s = self._shard(shard)
        return range(s * self.qo_per_shard, (s + 1) * self.qo_per_shard)

    def kv_heads(self, shard: int) -> range:
        """The KV heads of ``shard`` (global indices; a replicated head appears in several shards)."""
        s = self._shard(shard)
        first = s // self.replicas * self.kv_per_shard
        return range(first, first + self.kv_per_shard)

    def qkv_rows(self, shard: int) -> np.ndarray:
        """Indices into the head axis of the unsharded fused ``qkv`` (``[n, H_qo + 2 H_kv, D]``,
        docs/layout.md "Fused qkv") that make up ``shard``'s fused ``qkv``: its q heads, then its k
        heads, then its v heads. int64 ``[qo_per_shard + 2 kv_per_shard]``. A sharded model's QKV
        projection keeps the same output rows of its weight (``head_dim`` rows per index)."""
        hq, hkv = self.num_qo_heads, self.num_kv_heads
        kv = np.asarray(self.kv_heads(shard), np.int64)
        return np.concatenate([np.asarray(self.qo_heads(shard), np.int64), hq + kv, hq + hkv + kv])

    def shard_of_kv_head(self, kv_head: int) -> int:
        """The first shard holding ``kv_head``."""
        if not isinstance(kv_head, int) or isinstance(kv_head, bool) or not 0 <= kv_head < self.num_kv_heads:
            raise ValueError(f"kv_head={kv_head!r} must be an int in [0, {self.num_kv_heads})")
        return kv_head // self.kv_per_shard * self.replicas

    def shard_kv_scales(self, scales, shard: int) -> np.ndarray:
        """``shard``'s part of fp8 scales given for the whole cache (``[..., num_kv_heads]``: the
        ``kv_scales`` / ``set_kv_scales`` arrays), the last axis cut to its KV heads."""
        a = np.asarray(scales)
        if a.ndim == 0 or a.shape[-1] != self.num_kv_heads:
            raise ValueError(
                f"kv scales of shape {a.shape} must end in num_kv_heads={self.num_kv_heads} (one per KV head of "
                "the whole model); the shards take their own heads from it"
            )
        return np.ascontiguousarray(a[..., list(self.kv_heads(shard))])
