"""What one layer of a forward launches, bound once per step.

:class:`Launcher` owns the kernel library's per-step workspace (q/k/v/lse scratch sized for
``prefill_chunk_size`` rows, the split decode's partial states) and turns a planned step into a
:class:`Forward`: the device views of its uploaded index arrays and every kernel argument except the
layer's pages, qkv, the output and ``sm_scale``. :func:`run_layer` then launches a layer with O(1)
Python work: split/rotate, append, attention (and the merge of a split decode's chunks) — on cuda a
decode layer is one launch where the library has ``paged_decode_append`` (all of it in one kernel; fp8
kernel sets only on the tensor-core decode, the others split_rope_append + the decode kernel;
docs/layout.md "Fused qkv"), and a split decode merges its chunks in the same kernel (``paged_decode_split_merge``); a
causal prefill in rope mode "none" splits nothing: the attention's ``*_qkv`` kernel reads q (ragged: q,
k and v) from qkv in place, and ``append_qkv`` stores the new K/V from qkv (the ragged kernel stores
them itself: a prefill without history is one launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import CacheConfig
from ..target import default_cuda_arch
from ..tir import small_batch_granule, split_granule
from ..tir.decode_layout import MERGE_MAX_SPLITS
from ..tir.mla_layout import mla_blocks_per_sm, mla_split_granule
from .decode_split import BLOCKS_PER_SM, NO_SPLIT, DecodeSplit, plan_split
from .index_buffer import IndexBuffers
from .plan import PackedLayout

_MAX_SCRATCH_VIEWS = 256  # cached scratch views (one set per distinct token count) before clearing
# a decode layer is one launch where the library has paged_decode_append; False: split_rope_append + the
# decode kernel instead (what libraries without it run; benchmarks set it to compare the two)
ONE_LAUNCH_DECODE = True
# ... but not in rope mode "normal" over pages of the activation dtype (not fp8): that one-launch kernel
# rotates q and the new key itself (175 registers against 128, and a stack frame for cos / sin), and on an
# H200 (32 / 8 heads of 128, fp16) it took 224.9 µs a layer at 64 x 128 tokens and 223.4 at 32 x 1024 where
# the two launches take 32.0 and 53.6 (rope mode "none"'s one launch: 28.5 and 49.7; bench/gpu_decode_rope.py,
# bench/RESULTS.md "decode in rope mode normal")
ONE_LAUNCH_ROTATING_DECODE = False


@dataclass(slots=True)
class Forward:
    """One step's bound kernel calls (``run_layer``) and the device views they read."""

    seq_ids: list
    lengths: list
    total: int
    kernel: str  # paged_decode | paged_prefill_causal | paged_prefill_tree | ragged_prefill_causal
    slides: list  # Sequence records whose window slides at end_forward
    dev: dict  # name -> device tensor (a view of one slot of the packed index buffer)
    scratch: dict  # q, k, v, lse device buffers (views of buffers allocated once)
    split: tuple = ()  # split_rope's arguments after qkv (split_rope_append's before pages when fused)
    append: tuple = ()  # append's arguments after pages (split_rope_append's when fused)
    fused: bool = False  # kernels[0] is split_rope_append (split + rotate + append, one launch)
    direct: bool = False  # a prefill reading qkv in place: the attention's *_qkv kernel (paged: append_qkv first)
    attn_head: tuple = ()  # attention arguments before pages (all before o when not paged)
    attn_tail: tuple = ()  # attention arguments after pages, before o
    attn_end: tuple = ()  # lse (after o, before sm_scale); rope (after sm_scale)
    paged: bool = True
    kernels: tuple = ()  # (split_rope or split_rope_append, append, attention) functions of the library
    decode_split: DecodeSplit = NO_SPLIT  # paged_decode only: how the step cuts its sequences
    merge: Any = None  # merge_splits when decode_split splits with two launches, else None
    counter: Any = None  # paged_decode_split_merge's arrival counts when it splits in one launch
    single: tuple = ()  # decode in one launch: (paged_decode_append[_split], head, tail, trailing scalars)
    parts: tuple = ()  # (o_part, lse_part) views the split decode writes and merge_splits reads
    qkv_shape: tuple = ()  # [total, H_qo + 2 H_kv, D] expected of qkv
    o_shape: tuple = ()  # [total, H_qo, D] expected of out
    slot: int = 0  # device slot of the index buffer ring the views belong to
    local: Any = None  # the attention kernel's per-layer-window variant (same arguments + layer_window)
    shared: tuple = ()  # (kernel, local kernel, head, tail): paged attention over a given layer's pages
    key: tuple = ()  # graph_key's value, computed on first use


@dataclass(frozen=True)
class ForwardInfo:
    """What the open forward runs (``PagedAttentionKVCache.debug_forward``), for tests and tools."""

    kernel: str  # the attention kernel (names of tvmkv.tir.kernel_set)
    num_splits: int  # chunks of a split decode (1: not split)
    repeated: bool  # planned by advancing the previous decode step's plan in place
    slot: int  # device slot of the index buffer ring
    arrays: dict  # name -> NumPy copy of the uploaded index array (docs/layout.md)
    planned_on_device: bool = False  # its arrays written by plan_decode / plan_prefill from the device page table
    decode_layout: str = ""  # the layout of the decode's bound one-launch kernel (DecodeSplit.layout; "_small_batch")


def device_views(ib: IndexBuffers, slot: int, layout: PackedLayout) -> dict:
    """Device views of every packed array in ``slot`` (cached per slot and shape by ``ib``)."""
    dev = {name: ib.view(slot, off, shape) for name, (off, shape) in layout.arrays.items()}
    dev["page_indices"] = ib.tail(slot, layout.page_indices_at)  # longer than nnz: read via page_indptr
    return dev


class Launcher:
    """Binds planned steps to the kernels of one cache configuration (see the module docstring)."""

    def __init__(self, config: CacheConfig, device, kernels, num_sms: int):
        import tvm

        self.config, self.device, self.kernels, self.num_sms = config, device, kernels, num_sms
        self.blocks_per_sm = BLOCKS_PER_SM
        if config.is_mla:  # the blocks per query row and keys per latent tile of tvmkv.tir.mla's split kernel
            arch = (config.cuda_arch or default_cuda_arch()) if config.target_kind == "cuda" else None
            self.granule = mla_split_granule(config.mla_spec, arch) if "mla_attention_split" in kernels else None
            if num_sms > 0:
                self.blocks_per_sm = mla_blocks_per_sm(config.mla_spec, device.compute_version, arch)
        else:
            variant = dict(sliding=config.support_sliding_window, inline_rope=config.rope_mode == "inline")
            self.granule = split_granule(config.kernel_spec, **variant) if "paged_decode_split" in kernels else None
        if self.granule is None and (config.decode_splits or 1) > 1:
            raise ValueError(
                f"decode_splits={config.decode_splits}: this configuration has no split decode kernel (head_dim "
                f"{config.head_dim} {config.dtype} is outside the fast cuda decode layout); pass decode_splits=None "
                "or 1"
            )
        rotating = config.rope_mode == "normal" and not config.is_mla and not config.kernel_spec.fp8_pages
        self._one_launch = ONE_LAUNCH_ROTATING_DECODE or not rotating  # (see ONE_LAUNCH_ROTATING_DECODE)
        # the tensor-core decode's layout for steps whose blocks fill the SMs at most once, where the
        # library has it (its one-launch kernels, split and not) and decode steps launch once
        small = ("paged_decode_append_small_batch", "paged_decode_append_split_small_batch")
        has_small = self.granule is not None and not config.is_mla and self._one_launch
        has_small = has_small and all(name in kernels for name in small)
        self.small_granule = small_batch_granule(config.kernel_spec) if has_small else None
        cfg, n, empty = config, config.prefill_chunk_size, tvm.runtime.empty
        self._scratch_views: dict = {}
        self._part_bufs: tuple | None = None
        self._counter = None  # paged_decode_split_merge's arrival counts (all zero between launches)
        if not config.is_mla and "paged_decode_split_merge" in kernels and self.granule is not None:
            import numpy as np

            # the split's blocks per sequence (of either decode layout: both have the group's)
            rows = config.max_batch_size * max(self.granule[0], (self.small_granule or (0,))[0])
            self._counter = tvm.runtime.tensor(np.zeros(rows, np.int32), device)
        if config.is_mla:  # MLA layers launch from the cache's own calls (append_mla_kv, cross_attention)
            self._scratch_bufs: dict = {}
            return
        self._scratch_bufs = dict(
            q=empty((n, cfg.num_qo_heads, cfg.head_dim), cfg.dtype, device),
            k=empty((n, cfg.num_kv_heads, cfg.head_dim), cfg.dtype, device),
            v=empty((n, cfg.num_kv_heads, cfg.head_dim), cfg.dtype, device),
            lse=empty((n, cfg.num_qo_heads), "float32", device),
        )

    def decode_split(self, batch: int, max_keys: int) -> DecodeSplit:
        """How a decode step of ``batch`` sequences, the longest of ``max_keys`` keys, is cut, and for
        which one-launch layout: the small-batch one (``small_granule``) where the step's blocks, its
        split's chunks included, fill the SMs at most once and it launches once, else the default. The
        split is the default layout's either way (what was measured; the kernels take any chunk)."""
        if self.granule is None:
            return NO_SPLIT
        blocks, tile = self.granule
        split = plan_split(
            batch,
            max_keys,
            blocks_per_seq=blocks,
            tile_keys=tile,
            num_sms=self.num_sms,
            max_splits=self.config.decode_splits,
            blocks_per_sm=self.blocks_per_sm,
            stable=self.config.stable_decode_splits,
        )
        small = self.small_granule
        if (
            small is not None
            and ONE_LAUNCH_DECODE
            and batch * small[0] * split.num_splits <= self.num_sms  # (a forced split may pass it)
            and split.num_splits <= MERGE_MAX_SPLITS  # (more: split + merge_splits, two launches)
        ):
            return split._replace(layout="_small_batch")
        return split

    def scratch(self, total: int) -> dict:
        """Views ``[total, ...]`` of the q/k/v/lse scratch buffers allocated once for
        ``prefill_chunk_size`` rows (kernels on one stream run in order, so forwards may share them)."""
        views = self._scratch_views.get(total)
        if views is None:
            if len(self._scratch_views) > _MAX_SCRATCH_VIEWS:
                self._scratch_views.clear()  # _create_view views own a reference to their buffer
            views = self._scratch_views[total] = {
                name: buf._create_view((total, *buf.shape[1:])) for name, buf in self._scratch_bufs.items()
            }
        return views

    def _split_parts(self, split: DecodeSplit, batch: int) -> tuple:
        """``(o_part [S, B, H_qo, D], lse_part [S, B, H_qo])`` float32 views of buffers allocated on
        first use and grown when a split needs more rows (forwards bound before keep their views)."""
        import tvm

        cfg = self.config
        dim = cfg.kv_lora_rank if cfg.is_mla else cfg.head_dim  # the output's head dim
        rows = split.num_splits * batch
        if self._part_bufs is None or self._part_bufs[1].shape[0] < rows:
            rows_cap = max(rows, 2 * self._part_bufs[1].shape[0] if self._part_bufs else 0)
            self._part_bufs = (
                tvm.runtime.empty((rows_cap, cfg.num_qo_heads, dim), "float32", self.device),
                tvm.runtime.empty((rows_cap, cfg.num_qo_heads), "float32", self.device),
            )
        o_buf, lse_buf = self._part_bufs
        return (
            o_buf._create_view((split.num_splits, batch, cfg.num_qo_heads, dim)),
            lse_buf._create_view((split.num_splits, batch, cfg.num_qo_heads)),
        )

    def paged(self, fwd: Forward, history: tuple | None = None) -> tuple:
        """``(kernel, local kernel, head, tail)``: paged attention of ``fwd``'s queries over one layer's
        pages, called as ``kernel(q, *head, pages, *tail, o, lse, sm_scale, rope_scale, rope_theta)``
        (the local kernel takes a trailing ``layer_window``; None without per-layer windows).

        ``history`` None: every key the pages hold for the forward's sequences, this forward's tokens
        included (causal; the decode kernel for a decode step). Otherwise the device page tables
        ``(page_indptr, page_indices, last_page_len)`` of the keys held before the forward
        (:func:`tvmkv.runtime.plan.history_tables`): the causal prefill kernel over them sees every
        key, since each lies before the queries.
        """
        lib, d = self.kernels, fwd.dev
        head: tuple
        if history is not None:
            name, head = "paged_prefill_causal", (d["q_indptr"], d["q_pos"])
            tail = (*history, *_paged_tail(d)[3:])
        elif fwd.kernel == "paged_decode":
            name, head, tail = "paged_decode", (d["q_pos"],), _paged_tail(d)[:4]
        else:  # the new tokens are in the pages: a prefill reads them there too
            name = "paged_prefill_tree" if fwd.kernel == "paged_prefill_tree" else "paged_prefill_causal"
            head, tail = (d["q_indptr"], d["q_pos"]), _paged_tail(d)
        local = lib[name + "_local"] if self.config.has_local_layers and name != "paged_prefill_tree" else None
        return lib[name], local, head, tail

    def shared(self, fwd: Forward) -> tuple:
        """:meth:`paged` over every key, bound on first use and kept on the forward
        (``attention_with_shared_kv``, which runs once per sharing layer)."""
        if not fwd.shared:
            fwd.shared = self.paged(fwd)
        return fwd.shared

    def _single_launch(self, fwd: Forward) -> tuple:
        """A decode layer as one launch (split + rotate + append + attention [+ merge]) where the library
        has it: ``(kernel, head, tail, trailing scalars)`` for
        ``kernel(qkv, *head, pages, *tail, o, lse, sm_scale, rope_scale, rope_theta, *trailing)``; ``()``
        otherwise (then ``split_rope_append`` and the attention kernels launch). A split needs the
        in-kernel merge (``fwd.counter``, bound by :meth:`bind`)."""
        lib, d, layout = self.kernels, fwd.dev, fwd.decode_split.layout
        tail = (*_paged_tail(d)[:4], d["slots"])
        if fwd.decode_split.num_splits == 1:
            name = "paged_decode_append" + layout
            return (lib[name], (d["q_pos"],), tail, ()) if name in lib else ()
        name = "paged_decode_append_split" + layout
        if fwd.counter is None or name not in lib:
            return ()
        tail += (*fwd.parts, fwd.counter)
        return lib[name], (d["q_pos"],), tail, (fwd.decode_split.kv_chunk,)

    def bind(self, seq_ids, lengths, total, kernel, slides, dev, slot: int, decode_split=NO_SPLIT) -> Forward:
        """The :class:`Forward` with each layer's kernel arguments bound (all but pages/qkv/o/sm_scale)."""
        cfg, d, lib = self.config, dev, self.kernels
        rope = (cfg.rope_scale, cfg.rope_theta)
        if cfg.is_mla:  # only the index arrays (and a split decode's buffers): MLA's calls launch themselves
            fwd = Forward(
                seq_ids=seq_ids,
                lengths=lengths,
                total=total,
                kernel=kernel,
                slides=slides,
                dev=dev,
                scratch={},
                attn_end=(None, *rope),
                slot=slot,
            )
            if decode_split.num_splits > 1:
                fwd.decode_split = decode_split
                fwd.parts = self._split_parts(decode_split, total)
            return fwd
        s = self.scratch(total)
        fwd = Forward(
            seq_ids=seq_ids,
            lengths=lengths,
            total=total,
            kernel=kernel,
            slides=slides,
            dev=dev,
            scratch=s,
            split=(d["q_pos"], s["q"], s["k"], s["v"], *rope),
            append=(s["k"], s["v"], d["slots"]),
            attn_end=(s["lse"], *rope),
            kernels=(lib["split_rope"], lib["append"], lib[kernel]),
            qkv_shape=(total, cfg.qkv_heads, cfg.head_dim),
            o_shape=(total, cfg.num_qo_heads, cfg.head_dim),
            slot=slot,
        )
        if kernel != "ragged_prefill_causal" and "split_rope_append" in lib:  # attention reads K/V from the pages
            fwd.fused = True
            fwd.split = (d["q_pos"], s["q"])
            fwd.append = (d["slots"], *rope)
            fwd.kernels = (lib["split_rope_append"], *fwd.kernels[1:])
        if cfg.has_local_layers and kernel != "paged_prefill_tree":
            fwd.local = lib[kernel + "_local"]
        paged_tail = _paged_tail(d)
        if kernel == "paged_decode":
            fwd.attn_head = (s["q"], d["q_pos"])
            fwd.attn_tail = paged_tail[:4]
            fwd.decode_split = decode_split  # (unsplit too: its layout picks the one-launch kernel)
            if decode_split.num_splits > 1:
                fwd.parts = self._split_parts(decode_split, total)
                if self._counter is not None and decode_split.num_splits <= MERGE_MAX_SPLITS:
                    # the last block of each group merges the chunks: one launch
                    fwd.kernels = (*fwd.kernels[:2], lib["paged_decode_split_merge"])
                    fwd.counter = self._counter
                else:
                    fwd.kernels = (*fwd.kernels[:2], lib["paged_decode_split"])
                    fwd.merge = lib["merge_splits"]
            fwd.single = self._single_launch(fwd) if ONE_LAUNCH_DECODE and self._one_launch else ()
        elif kernel == "ragged_prefill_causal":
            fwd.paged = False
            fwd.attn_head = (s["q"], s["k"], s["v"], d["q_indptr"], d["q_pos"], d["q_tree"])
        else:
            fwd.attn_head = (s["q"], d["q_indptr"], d["q_pos"])
            fwd.attn_tail = paged_tail
        if kernel + "_qkv" in lib and not cfg.has_local_layers:
            # rope mode "none": nothing to rotate, so the prefill reads qkv where it is (docs/layout.md,
            # "Fused qkv"); the attention takes qkv as its first argument
            fwd.direct, fwd.fused, fwd.split = True, False, ()
            if kernel == "ragged_prefill_causal":  # stores the new K/V at their slots itself
                fwd.kernels = (None, None, lib[kernel + "_qkv"])
                fwd.attn_head, fwd.attn_tail = fwd.attn_head[-3:], (d["slots"],)
            else:  # append_qkv stores them first
                fwd.kernels = (None, lib["append_qkv"], lib[kernel + "_qkv"])
                fwd.append, fwd.attn_head = (d["slots"],), fwd.attn_head[1:]
        return fwd


def graph_key(fwd: Forward) -> tuple:
    """What a CUDA graph captured over ``fwd``'s launches depends on, besides each layer's pages, qkv,
    output and scalars (docs/cuda_graphs.md): the kernels and their scalar launch parameters (the
    token count, the decode split), and the device address and shape of every index array and
    workspace buffer the launches read or write. Equal keys: a graph captured in one forward replays
    correctly in the other, whose index arrays were uploaded to the same memory."""
    if not fwd.key:
        bufs = (*fwd.dev.values(), *fwd.scratch.values(), *fwd.parts)
        if fwd.counter is not None:
            bufs += (fwd.counter,)
        where = tuple((b.data_ptr(), tuple(b.shape)) for b in bufs)
        launches = (fwd.fused, fwd.direct, fwd.merge is not None, fwd.counter is not None, len(fwd.single))
        fwd.key = (fwd.kernel, fwd.total, launches, fwd.decode_split, where)
    return fwd.key


def run_layer(fwd: Forward, pages: tuple, qkv, o, sm_scale: float, window: int = 0) -> None:
    """Launch one layer's kernels with the arguments :meth:`Launcher.bind` prepared (O(1) Python).
    ``pages``: the layer's page arguments, ``(pages,)`` or with fp8 pages ``(pages, kv_scale)``
    (docs/layout.md, "fp8 pages"). ``window`` > 0: the layer attends within a sliding window of its
    own (``fwd.local``)."""
    if fwd.single and not window:  # the whole decode layer in one launch
        kernel, head, tail, trailing = fwd.single
        lse, rope_scale, rope_theta = fwd.attn_end
        kernel(qkv, *head, *pages, *tail, o, lse, sm_scale, rope_scale, rope_theta, *trailing)
        return
    split_rope, append, attention = fwd.kernels
    lse, rope_scale, rope_theta = fwd.attn_end
    if fwd.direct:  # no split: the kernels read q (and ragged k, v) from qkv; never a local layer
        if append is not None:  # (the ragged kernel stores K/V itself)
            append(*pages, qkv, *fwd.append)
        attention(qkv, *fwd.attn_head, *pages, *fwd.attn_tail, o, lse, sm_scale, rope_scale, rope_theta)
        return
    if fwd.fused:  # split + rotate + append in one kernel
        split_rope(qkv, *fwd.split, *pages, *fwd.append)
    else:
        split_rope(qkv, *fwd.split)
        append(*pages, *fwd.append)
    if window:  # a local layer: the window's kernel variant, never split
        if fwd.paged:
            fwd.local(*fwd.attn_head, *pages, *fwd.attn_tail, o, lse, sm_scale, rope_scale, rope_theta, window)
        else:
            fwd.local(*fwd.attn_head, o, lse, sm_scale, rope_scale, rope_theta, window)
    elif fwd.counter is not None:  # split decode, merged by the last block of each group
        o_part, lse_part = fwd.parts
        attention(
            *fwd.attn_head,
            *pages,
            *fwd.attn_tail,
            o_part,
            lse_part,
            fwd.counter,
            o,
            lse,
            sm_scale,
            rope_scale,
            rope_theta,
            fwd.decode_split.kv_chunk,
        )
    elif fwd.merge is not None:  # split decode: a partial state per chunk, then their merge
        o_part, lse_part = fwd.parts
        attention(
            *fwd.attn_head,
            *pages,
            *fwd.attn_tail,
            o_part,
            lse_part,
            sm_scale,
            rope_scale,
            rope_theta,
            fwd.decode_split.kv_chunk,
        )
        fwd.merge(o_part, lse_part, o, lse)
    elif fwd.paged:
        attention(*fwd.attn_head, *pages, *fwd.attn_tail, o, lse, sm_scale, rope_scale, rope_theta)
    else:
        attention(*fwd.attn_head, o, lse, sm_scale, rope_scale, rope_theta)


def _paged_tail(d: dict) -> tuple:
    """The page-table arguments of the paged attention kernels, after the pages (docs/layout.md)."""
    return (
        d["page_indptr"],
        d["page_indices"],
        d["last_page_len"],
        d["kv_window"],
        d["q_tree"],
        d["kv_tree_indptr"],
        d["kv_tree"],
        d["kv_tree_start"],
    )


def run_paged(
    bound: tuple, pages: tuple, q, o, lse, sm_scale: float, rope_scale: float, rope_theta: float, window: int
):
    """Launch :meth:`Launcher.paged`'s ``bound`` attention of ``q`` over ``pages`` (a layer's page
    arguments, as :func:`run_layer` takes them) into ``o`` / ``lse``."""
    kernel, local, head, tail = bound
    if window:
        local(q, *head, *pages, *tail, o, lse, sm_scale, rope_scale, rope_theta, window)
    else:
        kernel(q, *head, *pages, *tail, o, lse, sm_scale, rope_scale, rope_theta)


def run_ragged(fwd: Forward, kernels, q, k, v, o, lse, sm_scale: float, window: int) -> None:
    """Causal (or token-tree) attention among the forward's new tokens alone, over the given ``k`` /
    ``v`` (``self_attention``): the ragged prefill kernel, its local variant for a windowed layer."""
    d = fwd.dev
    _, rope_scale, rope_theta = fwd.attn_end
    args = (q, k, v, d["q_indptr"], d["q_pos"], d["q_tree"], o, lse, sm_scale, rope_scale, rope_theta)
    if fwd.kernel == "paged_prefill_tree":
        kernels["ragged_prefill_tree"](*args)
    elif window:
        kernels["ragged_prefill_causal_local"](*args, window)
    else:
        kernels["ragged_prefill_causal"](*args)
