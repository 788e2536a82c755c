"""``ShardedKVCache``: the shards of a tensor-parallel cache in one process, driven in lockstep.

Each shard is a :class:`~tvmkv.runtime.cache.PagedAttentionKVCache` over its share of the heads
(:class:`~tvmkv.runtime.sharding.ShardLayout`); every sequence operation goes to every shard, and an
attention call cuts the unsharded fused ``qkv`` into the shards' and puts their outputs back side by
side. This is what the workers of a Disco session do one per GPU, here one process for all: it runs
the sharding logic without GPUs (the tests and ``python -m tvmkv replay --tensor-parallel N`` check it
against the unsharded NumPy model) and serves a model that runs its shards in one process.

The interface is the cache's own, for the whole model: ``config`` is the unsharded configuration,
``attention_with_fused_qkv`` takes ``[n, H_qo + 2 H_kv, D]`` and returns ``[n, H_qo, D]``,
``debug_get_kv`` returns every KV head. A call the first shard refuses (bad input, out of pages)
changes nothing anywhere; a later shard refusing what the first accepted would mean the shards
drifted apart, and raises :class:`~tvmkv.errors.ShardDivergenceError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import NoReturn

import numpy as np

from ..errors import IntegrityError, ShardDivergenceError
from . import tensors
from .cache import PagedAttentionKVCache, make_config
from .sharding import ShardLayout


def _reusable(x):
    """``x``, or a list of it when it is a one-shot iterator (each shard must see the same items)."""
    if isinstance(x, Iterator):
        return list(x)
    if isinstance(x, (list, tuple)):
        return [_reusable(v) for v in x]
    return x


class ShardedKVCache:
    """``num_shards`` caches over the heads of one model, driven in lockstep.

    Parameters
    ----------
    num_layers, num_qo_heads, num_kv_heads, head_dim : int
        The whole model's shape; :class:`ShardLayout` decides each shard's heads (KV heads are
        replicated when there are fewer than shards).
    num_shards : int
        Shards (tensor-parallel degree).
    **options
        :class:`PagedAttentionKVCache`'s keyword options, given to every shard. ``kv_scales`` (fp8
        pages) is given for the whole model (``[..., num_kv_heads]``); each shard takes its heads.
    """

    def __init__(self, num_layers, num_qo_heads, num_kv_heads, head_dim, *, num_shards, **options):
        self.layout = ShardLayout(num_qo_heads, num_kv_heads, num_shards)
        scales = options.pop("kv_scales", None)
        if options.get("memory_fraction") is not None:  # sized once: each shard would see what the others took
            own = {k: v for k, v in options.items() if k not in ("calibrate", "build_dir")}
            sized = make_config(num_layers, self.layout.qo_per_shard, self.layout.kv_per_shard, head_dim, **own)
            options = {**options, "memory_fraction": None, "num_pages": sized.num_pages}
        shards = []
        for s in range(num_shards):
            own = {} if scales is None else {"kv_scales": self.layout.shard_kv_scales(scales, s)}
            shards.append(
                PagedAttentionKVCache(
                    num_layers,
                    self.layout.qo_per_shard,
                    self.layout.kv_per_shard,
                    head_dim,
                    **options,
                    **own,
                )
            )
        self.shards = tuple(shards)
        first = self.shards[0].config
        # the unsharded configuration (no kernels are built for it; the shards hold theirs)
        self.config = replace(first, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads)
        self._rows = [self.layout.qkv_rows(s) for s in range(num_shards)]
        self._torch_rows: dict = {}

    @property
    def num_shards(self) -> int:
        return self.layout.num_shards

    def __getattr__(self, name: str) -> NoReturn:
        # only for names the class lacks: the subsystems that take one cache (checkpoints, transfers,
        # interop, RadixPrefixCache) reach for a PagedAttentionKVCache's own parts (pool, pages, device)
        if name.startswith("__") or name in ("layout", "shards", "config"):
            raise AttributeError(name)
        from .cache import PagedAttentionKVCache

        if not name.startswith("_") and hasattr(PagedAttentionKVCache, name):
            raise AttributeError(
                f"ShardedKVCache has no {name!r} (PagedAttentionKVCache.{name} is not offered across shards: "
                "MLA calls, fine-grained per-layer calls, host-side views); call it on each shard "
                "(sharded.shards[i], its heads: sharded.layout) where that makes sense"
            )
        raise AttributeError(
            f"ShardedKVCache has no {name!r}: checkpoints, transfers, interop and RadixPrefixCache take one "
            "PagedAttentionKVCache; pass each shard (sharded.shards[i], its heads: sharded.layout) instead"
        )

    # ------------------------------------------------------------------ lockstep
    def _each(self, name: str, *args, **kwargs):
        """Call method ``name`` on every shard; the first shard's result is returned."""
        args = tuple(_reusable(a) for a in args)
        kwargs = {k: _reusable(v) for k, v in kwargs.items()}
        result = getattr(self.shards[0], name)(*args, **kwargs)  # may refuse: nothing changed anywhere
        for s, shard in enumerate(self.shards[1:], 1):
            try:
                getattr(shard, name)(*args, **kwargs)
            except Exception as err:
                raise ShardDivergenceError(s, f"{name} failed there after shard 0 accepted it: {err!r}") from err
        return result

    def add_sequence(self, seq_id) -> None:
        self._each("add_sequence", seq_id)

    def remove_sequence(self, seq_id) -> None:
        self._each("remove_sequence", seq_id)

    def fork_sequence(self, parent_seq_id, child_seq_id, fork_pos=-1) -> None:
        self._each("fork_sequence", parent_seq_id, child_seq_id, fork_pos)

    def pop_n(self, seq_id, n) -> None:
        self._each("pop_n", seq_id, n)

    def enable_sliding_window_for_seq(self, seq_id, sliding_window_size, attn_sink_size=0) -> None:
        self._each("enable_sliding_window_for_seq", seq_id, sliding_window_size, attn_sink_size)

    def clear(self) -> None:
        self._each("clear")

    def begin_forward(self, seq_ids, append_lengths, token_tree_parent_ptr=None) -> None:
        self._each("begin_forward", seq_ids, append_lengths, token_tree_parent_ptr)

    def end_forward(self) -> None:
        self._each("end_forward")

    def commit_accepted_token_tree_nodes(self, seq_ids, leaf_indices, *, scope="tree") -> None:
        self._each("commit_accepted_token_tree_nodes", seq_ids, leaf_indices, scope=scope)

    def swap_out(self, seq_ids, **options) -> None:
        self._each("swap_out", seq_ids, **options)

    def swap_in(self, seq_ids, **options) -> None:
        self._each("swap_in", seq_ids, **options)

    def set_kv_scales(self, layer_id, k_scale, v_scale) -> None:
        """fp8 pages: ``k_scale`` / ``v_scale`` as for the whole model (one float, or ``[num_kv_heads]``),
        checked whole before any shard takes its part."""
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            a = np.asarray(x, np.float64) if np.ndim(x) else np.asarray([x], np.float64)
            if a.ndim != 1 or (np.ndim(x) and a.shape[0] != self.layout.num_kv_heads):
                raise ValueError(
                    f"{name} of shape {np.shape(x)} must be one float or [{self.layout.num_kv_heads}] (one per KV head)"
                )
            bad = np.flatnonzero(~(np.isfinite(a) & (a > 0)))
            if bad.size:
                raise ValueError(f"{name}[{int(bad[0])}]={float(a[bad[0]])!r} must be a positive finite float")
        cuts = []
        for s in range(self.num_shards):
            k = k_scale if np.ndim(k_scale) == 0 else self.layout.shard_kv_scales(k_scale, s)
            v = v_scale if np.ndim(v_scale) == 0 else self.layout.shard_kv_scales(v_scale, s)
            cuts.append((k, v))
        self.shards[0].set_kv_scales(layer_id, *cuts[0])
        for s, shard in enumerate(self.shards[1:], 1):
            try:
                shard.set_kv_scales(layer_id, *cuts[s])
            except Exception as err:
                raise ShardDivergenceError(s, f"set_kv_scales failed there after shard 0 accepted it: {err!r}") from err

    def kv_scales(self, layer_id) -> np.ndarray:
        """fp8 pages: layer ``layer_id``'s scales ``[2, num_kv_heads]`` of the whole model."""
        out = np.zeros((2, self.layout.num_kv_heads), np.float32)
        for s, shard in enumerate(self.shards):
            out[:, list(self.layout.kv_heads(s))] = shard.kv_scales(layer_id)
        return out

    # ------------------------------------------------------------------ queries (shard 0 answers)
    def is_empty(self) -> bool:
        return self.shards[0].is_empty()

    def num_available_pages(self) -> int:
        return self.shards[0].num_available_pages()

    def total_sequence_length(self) -> int:
        return self.shards[0].total_sequence_length()

    def sequence_length(self, seq_id) -> int:
        return self.shards[0].sequence_length(seq_id)

    def sequence_ids(self) -> list:
        return self.shards[0].sequence_ids()

    def sequence_info(self, seq_id):
        return self.shards[0].sequence_info(seq_id)

    def sequence_pages(self, seq_id) -> list:
        return self.shards[0].sequence_pages(seq_id)

    @property
    def forward_open(self) -> bool:
        return self.shards[0].forward_open

    def num_pages_needed(self, seq_id, num_tokens) -> int:
        return self.shards[0].num_pages_needed(seq_id, num_tokens)

    def query_positions(self):
        return self.shards[0].query_positions()

    def is_swapped(self, seq_id) -> bool:
        return self.shards[0].is_swapped(seq_id)

    def swapped_sequence_ids(self) -> list:
        return self.shards[0].swapped_sequence_ids()

    def reserved_sequence_ids(self) -> list:
        """Ids an import into any shard holds (adding one raises in that shard)."""
        return list(dict.fromkeys(sid for shard in self.shards for sid in shard.reserved_sequence_ids()))

    def num_pages_released_by(self, seq_ids) -> int:
        return self.shards[0].num_pages_released_by(seq_ids)

    def require_no_forward(self, what: str) -> None:
        self.shards[0].require_no_forward(what)

    @property
    def calibrating(self) -> bool:
        return any(shard.calibrating for shard in self.shards)

    # ------------------------------------------------------------------ attention
    def attention_with_fused_qkv(self, layer_id, qkv, sm_scale=None, out=None):
        """Attention of layer ``layer_id`` for the whole model: each shard appends and attends over its
        own heads of ``qkv`` (``[n, H_qo + 2 H_kv, D]``, NumPy, torch or tvm), and the outputs are
        put side by side in ``[n, H_qo, D]`` (``out`` written in place when given), the kind of ``qkv``."""
        kind = tensors.array_kind(qkv)
        if kind == "tvm":  # cut on the host (a tvm tensor has no gather); handed back as a tvm tensor
            import tvm

            if out is not None:
                want = (qkv.shape[0], self.layout.num_qo_heads, qkv.shape[2])
                rows = min(want[0], self.shards[0].forward_tokens) or want[0]  # (out may have rows to spare)
                got = tuple(out.shape) if tensors.array_kind(out) == "tvm" else ()
                if not got or got[0] < rows or got[1:] != want[1:] or out.dtype != qkv.dtype:
                    raise ValueError(
                        f"out ({type(out).__name__} {tuple(getattr(out, 'shape', ()))}) must be a tvm tensor of "
                        f"shape [{rows} or more, {want[1]}, {want[2]}] and dtype {qkv.dtype}, like qkv"
                    )
            o = self.attention_with_fused_qkv(layer_id, qkv.numpy(), sm_scale)
            if out is None:
                return tvm.runtime.tensor(o, qkv.device)
            if out.shape[0] > o.shape[0]:  # rows to spare: the first ones written, the rest kept
                o = np.concatenate([o, out.numpy()[o.shape[0] :]])
            out.copyfrom(o)
            return out
        if getattr(qkv, "ndim", 0) != 3 or qkv.shape[1] != self.config.qkv_heads:
            raise ValueError(
                f"qkv of shape {tuple(getattr(qkv, 'shape', ()))} must be [num_tokens, {self.config.qkv_heads}, "
                f"{self.config.head_dim}] (H_qo + 2 H_kv heads of the whole model; each shard takes its own)"
            )
        total = self.shards[0].forward_tokens  # rows to spare (as the cache takes them): the first ones
        if qkv.shape[0] > total > 0:
            qkv = qkv[:total]
        if out is not None and qkv.shape[0] == total and getattr(out, "ndim", 0) == 3 and out.shape[0] > total:
            self.attention_with_fused_qkv(layer_id, qkv, sm_scale, out[:total])
            return out
        n, hq = qkv.shape[0], self.layout.qo_per_shard
        if out is None:
            if kind == "numpy":
                out = np.empty((n, self.layout.num_qo_heads, qkv.shape[2]), qkv.dtype)
            else:
                out = qkv.new_empty((n, self.layout.num_qo_heads, qkv.shape[2]))
        else:
            self._check_out(qkv, out, kind, (n, self.layout.num_qo_heads, qkv.shape[2]))
        if any(shard.calibrating for shard in self.shards) and not _all_finite(qkv, kind):
            raise ValueError(
                "qkv holds non-finite values while the fp8 scales are being calibrated; nothing was stored"
            )
        parts = []
        for s, shard in enumerate(self.shards):
            if kind == "numpy":
                part = np.ascontiguousarray(qkv[:, self._rows[s]])
            else:
                part = qkv.index_select(1, self._torch_index(s, qkv.device))
            parts.append(shard.attention_with_fused_qkv(layer_id, part, sm_scale))
        for s, o in enumerate(parts):  # written only once every shard has appended its K/V
            out[:, s * hq : (s + 1) * hq] = o
        return out

    def attention_with_shared_kv(self, layer_id, q, k, v, out=None, sm_scale=None, *, rotate_q=False):
        """:meth:`PagedAttentionKVCache.attention_with_shared_kv` for the whole model: each shard attends
        with its own query heads of ``q`` (``[n, H_qo, D]``) over its pages of layer ``layer_id``; ``k``
        and ``v`` (``[n, H_kv, D]``, checked only) are cut the same way. NumPy or torch; the outputs are
        put side by side in ``[n, H_qo, D]`` (``out`` written in place when given)."""
        kind = tensors.array_kind(q)
        if kind == "tvm":
            raise TypeError("ShardedKVCache.attention_with_shared_kv takes NumPy or torch arrays; pass q.numpy()")
        total = self.shards[0].forward_tokens
        for x, name, heads in ((q, "q", self.layout.num_qo_heads), (k, "k", None), (v, "v", None)):
            want = (total, heads or self.layout.num_kv_heads, self.config.head_dim)
            if tuple(getattr(x, "shape", ())) != want and total:
                raise ValueError(
                    f"{name} of shape {tuple(getattr(x, 'shape', ()))} must be {list(want)} (the forward's tokens, "
                    "the heads of the whole model: each shard takes its own)"
                )
        n, hq = q.shape[0], self.layout.qo_per_shard
        if out is None:
            out = np.empty(q.shape, q.dtype) if kind == "numpy" else q.new_empty(q.shape)
        else:
            self._check_out(q, out, kind, tuple(q.shape))
        parts = []
        for s, shard in enumerate(self.shards):
            qo, kv = self.layout.qo_heads(s), self.layout.kv_heads(s)
            cut = [x[:, r.start : r.stop] for x, r in ((q, qo), (k, kv), (v, kv))]
            if kind == "numpy":
                cut = [np.ascontiguousarray(x) for x in cut]
            else:
                cut = [x.contiguous() for x in cut]
            qs, ks, vs = cut
            parts.append(shard.attention_with_shared_kv(layer_id, qs, ks, vs, sm_scale=sm_scale, rotate_q=rotate_q))
        for s, o in enumerate(parts):
            out[:n, s * hq : (s + 1) * hq] = o
        return out

    @staticmethod
    def _check_out(qkv, out, kind: str, shape: tuple) -> None:
        # each shard's output is copied into out after the next shard has read qkv: they must not overlap
        if tensors.array_kind(out) != kind or out.dtype != qkv.dtype or tuple(out.shape) != shape:
            raise ValueError(
                f"out ({type(out).__name__} {tuple(out.shape)} {out.dtype}) must be a {kind} array of shape "
                f"{list(shape)} and dtype {qkv.dtype}, like qkv"
            )
        if kind == "numpy" and not out.flags.writeable:
            raise ValueError("out is a read-only NumPy array; pass a writeable one (or out=None)")
        if kind == "torch" and out.requires_grad:
            raise ValueError("out requires grad; pass a tensor that does not (or out=None)")
        if kind == "numpy":
            apart = not np.may_share_memory(qkv, out)
        else:
            if out.device != qkv.device:
                raise ValueError(f"out is on {out.device} and qkv on {qkv.device}; pass both on one device")
            size = qkv.element_size()
            apart = not tensors.overlaps(qkv, out, qkv.numel() * size, out.numel() * size)
        if not apart:
            raise ValueError("out overlaps qkv; pass an output buffer of its own")

    def _torch_index(self, s: int, device):
        key = (s, str(device))
        if key not in self._torch_rows:
            torch = tensors.torch_module()
            self._torch_rows[key] = torch.as_tensor(self._rows[s], device=device)
        return self._torch_rows[key]

    def debug_get_kv(self, seq_id, start_pos=0, end_pos=None):
        """K and V of tokens ``[start_pos, end_pos)`` of ``seq_id``, every KV head of the model, as NumPy
        ``[num_layers, n, H_kv, D]`` (a replicated head read from the first shard holding it)."""
        parts = [shard.debug_get_kv(seq_id, start_pos, end_pos) for shard in self.shards]
        k0 = parts[0][0]
        shape = (k0.shape[0], k0.shape[1], self.layout.num_kv_heads, k0.shape[3])
        k, v = np.zeros(shape, k0.dtype), np.zeros(shape, k0.dtype)
        for h in range(self.layout.num_kv_heads):
            s = self.layout.shard_of_kv_head(h)
            i = h - self.layout.kv_heads(s).start
            k[:, :, h], v[:, :, h] = parts[s][0][:, :, i], parts[s][1][:, :, i]
        return k, v

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Each shard's own :meth:`~PagedAttentionKVCache.check_integrity`, then that every shard's
        bookkeeping digests as shard 0's (:meth:`~PagedAttentionKVCache.table_digest`); a shard that
        differs raises :class:`ShardDivergenceError` naming it and the first sequence that differs."""
        for s, shard in enumerate(self.shards):
            try:
                shard.check_integrity()
            except IntegrityError as err:
                raise IntegrityError(f"shard {s}: {err}") from err
        self.table_digest()

    def table_digest(self) -> str:
        """The shards' common :meth:`~PagedAttentionKVCache.table_digest` (they keep the same bookkeeping);
        :class:`ShardDivergenceError` naming the first shard that differs from shard 0."""
        ref = self.shards[0].table_digest()
        for s, shard in enumerate(self.shards[1:], 1):
            if shard.table_digest() != ref:
                raise ShardDivergenceError(s, first_difference(self.shards[0], shard))
        return ref


def _all_finite(x, kind: str) -> bool:
    if kind == "numpy":
        return bool(np.isfinite(x).all())
    return bool(tensors.torch_module().isfinite(x).all())


def first_difference(a: PagedAttentionKVCache, b: PagedAttentionKVCache) -> str:
    """A line naming the first difference between the bookkeeping of caches ``a`` and ``b``."""
    ids_a = set(a.sequence_ids()) | set(a.swapped_sequence_ids())
    ids_b = set(b.sequence_ids()) | set(b.swapped_sequence_ids())
    if ids_a != ids_b:
        return f"sequence ids differ: {sorted(ids_a ^ ids_b)} held by one shard only"
    for sid in sorted(ids_a):
        ia, ib = a.sequence_info(sid), b.sequence_info(sid)
        if ia != ib:
            return f"sequence {sid} differs: {ia} against {ib}"
    if a.num_available_pages() != b.num_available_pages():
        return f"free pages differ: {a.num_available_pages()} against {b.num_available_pages()}"
    return "the free lists or page reference counts differ (same sequences)"
