"""``PagedAttentionKVCache``: the facade over the page pool, the sequence table, the planner and the kernels.

Reading order of ``tvmkv/runtime``: :mod:`.pages` (free list, ref counts) -> :mod:`.sequences` (page
lists, windows, token trees) -> :mod:`.plan` (one step's index arrays) -> this module (validation,
uploads, launches) -> :mod:`.launch` (what one layer launches); :mod:`.swap`, :mod:`.radix`,
:mod:`.interop` and :mod:`.scheduler` build on the public API here. Layout of every array:
docs/layout.md.

Forward protocol (plan/run): ``begin_forward`` validates the whole step, reserves pages and builds
every index array once; ``attention_with_fused_qkv`` only launches kernels for one layer;
``end_forward`` commits (slides windows). Every public operation validates everything first and then
mutates through component methods that cannot fail for reasons the caller controls, so a failed call
leaves the cache as it was.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from ..config import FLOAT32_MAX, LOG2E, CacheConfig
from ..errors import ForwardStateError, IntegrityError, OutOfPagesError
from ..target import parse_target
from . import tensors
from .decode_split import NO_SPLIT
from .device_plan import DevicePlanner
from .index_buffer import RING, IndexBuffers
from .kv_scales import KvScales
from .launch import Forward, ForwardInfo, Launcher, device_views, graph_key, run_layer, run_paged, run_ragged
from .pages import PageHolder, PagePool
from .plan import PackedLayout, Planner, history_tables
from .repeat_decode import RepeatDecode
from .sequences import SequenceInfo, SequenceTable, as_int, check_id
from .swap import DEFAULT_STAGING_BYTES, HostSwap

_TREE = attrgetter("tree_parent")


def available_bytes(device) -> int:
    """Free memory of ``device`` in bytes (MemAvailable for the CPU)."""
    free = device.available_global_memory if device.dlpack_device_type() != 1 else None
    if free is None:
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            free = int(info["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            import os

            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free)


_HISTORY_UPLOAD = (
    "an attention over the history alone (cross_attention with include_new=False, or MLA's / a sliding-window "
    "cache's cross attention) uploads this forward's history page tables from Python, which a replay would "
    "not do again; capture steps without it, or run them eagerly"
)


class PagedAttentionKVCache:
    """A paged KV cache for ``num_layers`` attention layers (layout: docs/layout.md).

    Parameters
    ----------
    num_layers, num_qo_heads, num_kv_heads, head_dim : int
        Model shape; ``num_qo_heads`` is a multiple of ``num_kv_heads`` (GQA).
    page_size : int
        Tokens per page, a power of two in [1, 256].
    max_batch_size : int
        Most sequences in one forward.
    max_total_seq_len : int
        Token capacity the page pool is sized for (see ``num_pages``).
    prefill_chunk_size : int
        Most new tokens in one forward.
    dtype : str
        "float32", "float16" or "bfloat16": q/k/v, outputs (and the pages, unless ``kv_dtype``).
    kv_dtype : str, optional
        "float8_e4m3fn" or "float8_e5m2" (with ``dtype`` float16 or bfloat16): fp8 pages, one byte per
        element, so the same memory holds twice the tokens (``memory_fraction`` counts them at one
        byte). Each stored K / V is ``x / scale`` rounded (saturating) with a scale per layer, K or V
        and KV head (docs/layout.md, "fp8 pages"); attention reads them back dequantized and
        accumulates in fp32. Default "": pages of ``dtype``.
    kv_scales : array, optional
        fp8 pages only: the scales, ``[num_layers, 2, num_kv_heads]`` (axis 1: 0 = K, 1 = V) or
        ``[2, num_kv_heads]`` for every layer; positive and finite. Default 1.0 everywhere (vLLM's
        default); :meth:`set_kv_scales` sets a layer's before any token is stored.
    calibrate : int, optional
        fp8 pages only, instead of ``kv_scales``: learn every layer's scales from the K/V of the first
        ``calibrate`` tokens appended, ``HEADROOM * max|x| / largest`` per layer, K or V and KV head
        (:mod:`tvmkv.runtime.kv_scales`); codes stored while a scale grows are re-encoded. Calibrating
        forwards copy their new K/V to the host (a device sync per layer), refuse non-finite K/V
        (ValueError, nothing stored) and cannot be captured in a CUDA graph; after ``calibrate``
        tokens the scales are fixed. Default 0: no calibration.
    rope_mode : str
        "none", "normal" (K stored rotated) or "inline" (K stored raw, rotated in the kernels).
    rope_scale, rope_theta : float
        RoPE angle = position * rope_scale / rope_theta ** (2 i / head_dim).
    rope_scaling : dict or tvmkv.tir.RopeScaling, optional
        TVM's (Hugging Face's) ``rope_scaling`` dict: ``rope_type`` "gptj", "llama3", "llama4",
        "longrope" (with ``long_factor``/``short_factor``) or "yarn", applied as TVM applies it
        (docs/layout.md, "RoPE"); rope mode "normal" only. Default: the plain RoPE.
    rotary_dim : int, optional
        Only the first ``rotary_dim`` dims of each head rotate (even, <= head_dim); default all.
    support_sliding_window : bool
        Build the sliding-window kernels (needed by ``enable_sliding_window_for_seq``).
    target : str or tvm.target.Target
        "llvm" (CPU) or "cuda" (an arch may be given as a Target); the device follows.
    device_id : int
        The GPU (``cuda:device_id``) that holds the pages and runs the kernels; 0 on the CPU. Each
        tensor-parallel worker passes its own (docs/layout.md, "Tensor parallelism"). Default 0.
    first_layer : int
        A pipeline stage's cache: it holds the model's layers ``[first_layer, first_layer + num_layers)``
        and every call names a layer by its id in the whole model (TVM's ``layer_indptr``;
        docs/layout.md, "Pipeline stages"). Default 0.
    num_pages : int, optional
        Pages per layer; default ``ceil(max_total_seq_len / page_size) + max_batch_size``.
    memory_fraction : float, optional
        Instead of ``num_pages``: size the pool to this fraction of the device's free memory
        (as vLLM's ``gpu_memory_utilization``), all layers together.
    layer_windows : sequence of int, optional
        Per-layer sliding window (TVM's ``MHA_SLIDING`` layers, e.g. Gemma's local layers): layer ``l``
        with ``layer_windows[l] = W > 0`` lets a query at position ``p`` see keys at positions
        ``(p - W, p]`` only; 0 means full attention. The cache keeps every token (other layers need
        them); only the mask changes. Default: every layer full.
    decode_splits : int, optional
        Flash-decoding: a decode step may cut its sequences' keys into chunks that run in separate
        thread blocks and are merged after (docs/layout.md, "Split decode"). ``None`` (default) splits
        on cuda only as far as it fills the device (batches too small to occupy every SM); ``1`` never
        splits; an int > 1 forces up to that many chunks on any target (chunks of at least one tile).
    stable_decode_splits : bool
        Plan those chunks for CUDA-graph replay (docs/cuda_graphs.md): chunk sizes at powers of two,
        so a captured decode step stays valid until the longest sequence doubles. Default False.
    device_planning : bool
        Plan a decode step whose batch changed since the last step (arrivals, departures, forks,
        preemption, a new order), and a prefill or mixed step without token trees or windows, on the
        device: every sequence's page list is kept in a device table patched only where it changed, and
        one small kernel writes the step's index arrays from five (seven) integers per sequence
        (docs/layout.md, "Device page table"). False plans those steps on the host. Default True (where
        the kernel library has ``plan_decode`` / ``plan_prefill``: every non-MLA one).
    build_dir : path, optional
        Where compiled kernels are cached (default: see ``python -m tvmkv build --help``).

    ``PagedAttentionKVCache.from_config(CacheConfig(...))`` builds the same cache from one config.
    """

    def __init__(
        self,
        num_layers,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        *,
        page_size=16,
        max_batch_size=32,
        max_total_seq_len=2048,
        prefill_chunk_size=512,
        dtype="float16",
        kv_dtype="",
        kv_scales=None,
        calibrate=0,
        rope_mode="none",
        rope_scale=1.0,
        rope_theta=1e4,
        rope_scaling=None,
        rotary_dim=None,
        support_sliding_window=False,
        target="llvm",
        device_id=0,
        first_layer=0,
        num_pages=None,
        memory_fraction=None,
        decode_splits=None,
        stable_decode_splits=False,
        device_planning=True,
        layer_windows=None,
        build_dir=None,
        kv_lora_rank=0,
        qk_rope_head_dim=0,
        mla_self_dims=None,
    ):
        config = make_config(
            num_layers,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size=page_size,
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            dtype=dtype,
            kv_dtype=kv_dtype,
            rope_mode=rope_mode,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rotary_dim=rotary_dim,
            support_sliding_window=support_sliding_window,
            target=target,
            device_id=device_id,
            first_layer=first_layer,
            num_pages=num_pages,
            memory_fraction=memory_fraction,
            decode_splits=decode_splits,
            stable_decode_splits=stable_decode_splits,
            device_planning=device_planning,
            layer_windows=layer_windows,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            mla_self_dims=mla_self_dims,
        )
        self._setup(config, build_dir)
        if kv_scales is not None:
            kv = self._require_fp8("kv_scales")
            table = kv.table(kv_scales, "kv_scales")
            for layer in range(config.num_layers):
                kv.set(layer, table[layer])
        if not (calibrate is None or (type(calibrate) is int and calibrate == 0)):  # the rest is validated there
            self._start_calibration(calibrate, kv_scales)

    @classmethod
    def mla(cls, num_layers, num_heads, kv_lora_rank, qk_rope_head_dim, *, mla_self_dims=None, **options):
        """An MLA cache (DeepSeek-V2 multi-head latent attention; docs/layout.md, "MLA pages"): each token
        stores one vector per layer, its compressed latent (``kv_lora_rank``) followed by its rotated key
        part (``qk_rope_head_dim``), appended with :meth:`append_mla_kv` and attended by
        :meth:`cross_attention` (absorbed weights: q ``[n, num_heads, kv_lora_rank + qk_rope_head_dim]``,
        output ``[n, num_heads, kv_lora_rank]``); :meth:`self_attention` runs the prefill's
        non-absorbed attention among the new tokens (q/k ``[n, num_heads, Dq]``, v ``[n, num_heads, Dv]``,
        ``mla_self_dims=(Dq, Dv)``, inferred from its first call when not given), and
        :meth:`merge_attn_output_inplace` merges the two.

        ``options`` are the keyword arguments of the constructor (page_size, dtype, target, capacity ...);
        rope_mode "inline", sliding windows and per-layer windows do not apply to MLA (as in TVM).
        """
        return cls(
            num_layers,
            num_heads,
            1,
            kv_lora_rank + qk_rope_head_dim,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            mla_self_dims=mla_self_dims,
            **options,
        )

    @classmethod
    def from_config(cls, config: CacheConfig, *, build_dir=None) -> PagedAttentionKVCache:
        """A cache of ``config`` (``config.num_pages`` fixes the pool; None sizes it from capacity)."""
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a tvmkv.CacheConfig, not {type(config).__name__}")
        self = cls.__new__(cls)
        self._setup(config, build_dir)
        return self

    def _setup(self, config: CacheConfig, build_dir) -> None:
        import tvm

        from ..build import load_kernels

        cfg = self.config = config
        device = self.device = _device(cfg.target_kind, cfg.device_id)
        if cfg.target_kind == "cuda" and not device.exist:
            if cfg.device_id:
                raise RuntimeError(f"device_id={cfg.device_id}: there is no cuda:{cfg.device_id} on this machine")
            raise RuntimeError("target='cuda' but no CUDA device is present; use target='llvm'")
        _check_memory(cfg, device)
        self._mla = cfg.is_mla
        self._build_dir = build_dir
        self._mla_self: tuple | None = None  # MLA: ((Dq, Dv), kernels) when inferred from a first self_attention
        if self._mla:
            self.kernels = load_kernels(cfg.mla_spec, family="mla", arch=cfg.cuda_arch, build_dir=build_dir)
        else:
            self.kernels = load_kernels(
                cfg.kernel_spec,
                rope_mode=cfg.rope_mode,
                sliding=cfg.support_sliding_window,
                arch=cfg.cuda_arch,
                build_dir=build_dir,
                rope_scaling=cfg.rope_scaling,
                **_local_option(cfg),
            )
        num_sms = device.multi_processor_count if cfg.target_kind == "cuda" else 0
        self._launcher = Launcher(cfg, device, self.kernels, num_sms)
        zeros = np.zeros(cfg.page_shape, tensors.numpy_dtype(cfg.page_dtype))
        self.pages = [tvm.runtime.tensor(zeros, device) for _ in range(cfg.num_layers)]
        # where each layer's page array starts on the device: copy_page_layers copies a page in every
        # layer in one launch (libraries built before it have only the per-layer copy)
        self._layer_pages = (
            tvm.runtime.tensor(np.array([p.data_ptr() for p in self.pages], np.uint64), device)
            if "copy_page_layers" in self.kernels
            else None
        )
        # fp8 pages: each layer's kv_scale [2, H_kv] (docs/layout.md, "fp8 pages"), passed after its pages
        self._kv = KvScales(cfg, device) if cfg.fp8_pages else None
        self._calibrating = False  # a copy of KvScales.calibrating, kept current (read on every attention call)
        self._swapped_scales: dict = {}  # swapped-out seq id -> scales its host codes were stored under
        scales = self._kv.tensors if self._kv is not None else []
        # what every page-reading or -writing launch of a layer takes where the layout says "pages"
        self._page_args = [(p, *scales[layer : layer + 1]) for layer, p in enumerate(self.pages)]
        self.pool = PagePool(cfg.total_pages)
        self._table = SequenceTable(self.pool, cfg.page_size)
        self._swap = HostSwap(cfg, device, self.pool, self._table, self.kernels, self.pages)
        # the packed index buffer: a full batch of prefill_chunk_size tokens over max_total_seq_len tokens
        B = cfg.max_batch_size
        arrays = PackedLayout.of(B, cfg.prefill_chunk_size, 1).page_indices_at
        self._index = IndexBuffers(device, arrays + -(-cfg.max_total_seq_len // cfg.page_size) + B)
        self._planner = Planner(self._index, cfg.page_size)
        if cfg.device_planning and "plan_decode" in self.kernels:
            self._planner.device = DevicePlanner(
                device,
                self.kernels["plan_decode"],
                self._table,
                self.kernels["plan_prefill"] if "plan_prefill" in self.kernels else None,
            )
        self._tvm_tensor, self._dl_device_type = tvm.runtime.Tensor, device.dlpack_device_type()
        self._dev_index, self._device_name = device.index, tensors.device_name(device)
        self._torch_fast: tuple | None = None  # (torch.Tensor, the cache's torch dtype, torch device), on first use
        # MLA: the scale of the non-absorbed q.k (qk_nope + rope dims), known once mla_self_dims are
        self._default_sm_scale = cfg.mla_self_dims[0] ** -0.5 if cfg.mla_self_dims else cfg.head_dim**-0.5
        self._windows = cfg.layer_windows or (0,) * cfg.num_layers
        self._fwd: Forward | None = None
        self._step = 0  # forwards begun so far
        self._ran = [-1] * cfg.num_layers  # per layer: the last forward (self._step) its attention ran in
        self._uncapturable: tuple = (-1, "")  # (forward, why): a call of it uploaded what a replay would not
        self._repeat: RepeatDecode | None = None
        self._repeated = False  # whether the open forward was planned by RepeatDecode
        self._planned_on_device = False  # whether it was planned by the DevicePlanner
        self._history: tuple | None = None  # (step, device page tables of the keys before it): cross_attention

    # ------------------------------------------------------------------ queries
    def is_empty(self) -> bool:
        """No sequence (on the device or swapped out) and every page free (TVM's ``Empty``)."""
        return not self._table.resident and not self._table.swapped and self.pool.num_free == self.pool.num_pages

    def num_available_pages(self) -> int:
        """Pages on the free list (every one of them can be handed out)."""
        return self.pool.num_free

    def total_sequence_length(self) -> int:
        """Sum of ``sequence_length`` over the sequences on the device."""
        return sum(s.length for s in self._table.resident.values())

    def sequence_length(self, seq_id) -> int:
        """Tokens ``seq_id`` holds: appended and not popped, minus those its sliding window dropped
        (TVM's rule; uncommitted token-tree nodes count)."""
        return self._table.info(seq_id).length

    def sequence_ids(self) -> list:
        """Ids of the sequences on the device (``swapped_sequence_ids()`` lists the others)."""
        return list(self._table.resident)

    def sequence_info(self, seq_id) -> SequenceInfo:
        """A read-only snapshot of ``seq_id`` (on the device or swapped out): lengths, pages, window,
        uncommitted token-tree nodes."""
        return self._table.info(seq_id)

    def sequence_pages(self, seq_id) -> list:
        """Page ids of ``seq_id`` in slot order (a copy; docs/layout.md, "Pages")."""
        return self._table.get(seq_id).pages.tolist()

    @property
    def forward_open(self) -> bool:
        """Whether a forward is open (between ``begin_forward`` and ``end_forward``)."""
        return self._fwd is not None

    @property
    def forward_tokens(self) -> int:
        """New tokens of the open forward (``sum(append_lengths)``; 0 when none is open): the rows of
        ``qkv`` the attention calls read."""
        return 0 if self._fwd is None else self._fwd.total

    def require_no_forward(self, what: str) -> None:
        """ForwardStateError naming ``what`` when a forward is open (for components built on the cache)."""
        if self._fwd is not None:
            raise ForwardStateError(f"{what} is not allowed while a forward is open; call end_forward first")

    def query_positions(self):
        """Logical positions int32 ``[total_new_tokens]`` of the open forward's tokens (a device tensor
        valid until the forward ends; docs/layout.md, "Ragged queries")."""
        if self._fwd is None:
            raise ForwardStateError("query_positions called outside begin_forward/end_forward")
        return self._fwd.dev["q_pos"]

    def num_pages_needed(self, seq_id, num_tokens) -> int:
        """Free pages a forward appending ``num_tokens`` to ``seq_id`` takes (new pages plus the
        copy-on-write of a shared partial last page); for a swapped sequence, its ``swap_in`` plus that."""
        P = self.config.page_size
        num_tokens = as_int(num_tokens, "num_tokens")
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        seq_id = check_id(seq_id)
        if seq_id in self._table.swapped:
            return -(-(self._table.swapped[seq_id].kv_len + num_tokens) // P)
        seq = self._table.get(seq_id)
        grow = -(-(seq.kv_len + num_tokens) // P) - seq.num_pages
        cow = bool(seq.kv_len % P) and num_tokens > 0 and self.pool.ref_count(seq.last_page) > 1
        return int(grow + cow)

    def num_pages_released_by(self, seq_ids) -> int:
        """Pages that would return to the free list if every sequence of ``seq_ids`` (distinct, on the
        device) left it (``remove_sequence`` or ``swap_out``): pages no other holder keeps."""
        seq_ids = [check_id(s, "seq_ids[i]") for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids {seq_ids} name a sequence twice; pass each sequence once")
        held: dict = {}
        for s in seq_ids:
            for p in self._table.get(s).pages.tolist():
                held[p] = held.get(p, 0) + 1
        return sum(1 for p, n in held.items() if self.pool.ref_count(p) == n)

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id) -> None:
        """Add an empty sequence. KeyError if ``seq_id`` exists."""
        seq_id = self._table.check_new(seq_id)
        self.require_no_forward("add_sequence")
        self._table.add(seq_id)

    def add_sequence_with_pages(self, seq_id, pages, length) -> None:
        """Add ``seq_id`` holding ``length`` tokens that already sit in ``pages`` (page ``i`` holds
        positions ``[i P, (i + 1) P)``, docs/layout.md); each page must be held already (by a sequence
        or a page holder) and gains a reference. A partial last page is shared like any other and
        copied on the sequence's first write into it (copy-on-write in ``begin_forward``). Pages that hold
        another sequence's uncommitted token-tree nodes are refused (its commit rewrites them in place).
        Raises KeyError / TypeError, ValueError, ForwardStateError before changing anything."""
        seq_id = self._table.check_new(seq_id)
        self.require_no_forward("add_sequence_with_pages")
        length = as_int(length, "length")
        pages = [as_int(p, "pages[i]") for p in _int_list(pages, "pages")]
        P, total = self.config.page_size, self.config.total_pages
        if length < 0 or len(pages) != -(-length // P):
            raise ValueError(f"{len(pages)} pages cannot hold length {length}; pass ceil(length / {P}) pages")
        if len(set(pages)) != len(pages) or any(not 0 <= p < total or self.pool.ref_count(p) < 1 for p in pages):
            raise ValueError(f"pages {pages[:8]} must be distinct page ids in [0, {total}) that are held already")
        tree = self._table.tree_pages()
        hit = next((p for p in pages if p in tree), None)
        if hit is not None:
            raise ValueError(
                f"page {hit} holds uncommitted token-tree nodes of sequence {tree[hit]}, which its commit "
                "rewrites in place; commit (or pop_n) that tree first"
            )
        self.pool.hold(pages)
        self._table.add(seq_id, pages, length)

    def remove_sequence(self, seq_id) -> None:
        """Remove ``seq_id``; its pages return to the free list once nothing else holds them (a swapped-out
        sequence drops its host copy)."""
        seq_id = check_id(seq_id)
        if seq_id in self._table.reserved:  # an import in progress: removing it abandons the import
            self.require_no_forward("remove_sequence")
            self._table.reserved[seq_id][1]()
            return
        if seq_id not in self._table.swapped:
            self._table.get(seq_id)
        self.require_no_forward("remove_sequence")
        if seq_id in self._table.swapped:
            self._swap.drop(seq_id)
            self._swapped_scales.pop(seq_id, None)
        self._table.remove(seq_id)

    def fork_sequence(self, parent_seq_id, child_seq_id, fork_pos=-1) -> None:
        """Create ``child_seq_id`` holding the first ``fork_pos`` tokens of ``parent_seq_id``.

        Full pages are shared (ref-counted, copy-on-write); a partially shared last page is copied.
        ``fork_pos=-1`` means the parent's whole (committed) length.
        """
        parent = self._table.get(parent_seq_id)
        child_id = self._table.check_new(child_seq_id, "child_seq_id")
        fork_pos = as_int(fork_pos, "fork_pos")
        self.require_no_forward("fork_sequence")
        committed = parent.committed_length
        if fork_pos == -1:
            fork_pos = committed
        if fork_pos < 0:
            raise ValueError(f"fork_pos {fork_pos} is negative; use -1 for the parent's full length or 0..{committed}")
        if fork_pos > parent.length:
            raise ValueError(f"fork_pos {fork_pos} exceeds length {parent.length} of sequence {parent_seq_id}")
        if fork_pos > committed:
            raise ValueError(
                f"fork_pos {fork_pos} is inside the uncommitted token tree of sequence {parent_seq_id} "
                f"(committed length {committed}); commit the tree first or fork at <= {committed}"
            )
        if parent.slid:
            raise ValueError(
                f"sequence {parent_seq_id} has slid its window (tokens were dropped); forking it is not supported"
            )
        if fork_pos % self.config.page_size and not self.pool.ensure_free(1):
            raise OutOfPagesError(1, 0, f"fork of sequence {parent_seq_id} at {fork_pos}")
        self._table.fork(parent, child_id, fork_pos, self._copy_page)

    def pop_n(self, seq_id, n) -> None:
        """Drop the last ``n`` tokens of ``seq_id`` (pages no longer used are released)."""
        seq = self._table.get(seq_id)
        n = as_int(n, "n")
        self.require_no_forward("pop_n")
        if n < 0:
            raise ValueError(f"pop_n n={n} is negative; pass 0..{seq.length}")
        if seq.tree_parent:
            raise ValueError(
                f"sequence {seq_id} has {len(seq.tree_parent)} uncommitted token-tree nodes; "
                "commit or drop them (commit_accepted_token_tree_nodes) before pop_n"
            )
        limit = seq.poppable
        if n > seq.length:
            raise ValueError(f"pop_n n={n} exceeds length {seq.length} of sequence {seq_id}")
        if n > limit:
            raise ValueError(
                f"pop_n n={n} reaches into tokens of sequence {seq_id} that its sliding window dropped; "
                f"at most {limit} can be popped"
            )
        self._table.truncate(seq, seq.kv_len - n)

    def enable_sliding_window_for_seq(self, seq_id, sliding_window_size, attn_sink_size=0) -> None:
        """Keep only the first ``attn_sink_size`` plus the last ``sliding_window_size - attn_sink_size``
        tokens of ``seq_id``, from the end of its next forward on (see docs/layout.md). As in TVM's cache,
        nothing is dropped now: the length stays, ``pop_n`` may still roll back, and that next forward
        attends to every token the sequence holds; and the whole pages a fork shares between parent and
        child (``SequenceInfo.fork_prefix``) stay as attention sinks of either's window."""
        seq = self._table.get(seq_id)
        window = as_int(sliding_window_size, "sliding_window_size")
        sink = as_int(attn_sink_size, "attn_sink_size")
        self.require_no_forward("enable_sliding_window_for_seq")
        if not self.config.support_sliding_window:
            raise ValueError(
                "this cache was built with support_sliding_window=False; "
                "construct it with support_sliding_window=True to use sliding windows"
            )
        if window <= 0:
            raise ValueError(f"sliding_window_size={window} must be positive")
        if not 0 <= sink < window:
            raise ValueError(
                f"attn_sink_size={sink} must be in [0, sliding_window_size={window}) (TVM's rule: a window of sink "
                "tokens only would keep no new token)"
            )
        if seq.tree_parent:
            raise ValueError(f"sequence {seq_id} has an uncommitted token tree; commit it first")
        if seq.slid:
            raise ValueError(f"sequence {seq_id} already slid its window; its window cannot be changed")
        prefix = seq.shared_prefix  # TVM: blocks that forks share never slide, natural sinks
        if prefix >= window:
            raise ValueError(
                f"sequence {seq_id} shares its first {prefix} tokens with a fork (it was forked, or forked from, "
                f"there); they are attention sinks (TVM's rule), so sliding_window_size={window} must exceed {prefix}"
            )
        self._table.set_window(seq, window, sink)

    def clear(self) -> None:
        """Remove every sequence (swapped ones too) and close any open forward."""
        self._fwd = None
        self._repeat = None
        self._table.clear()
        self._swap.clear()
        self._swapped_scales.clear()
        self.pool.reset()

    # ------------------------------------------------------------------ forward protocol
    def begin_forward(self, seq_ids, append_lengths, token_tree_parent_ptr=None) -> None:
        """Plan one forward: ``append_lengths[i]`` new tokens for ``seq_ids[i]``.

        ``token_tree_parent_ptr`` (optional, length ``sum(append_lengths)``): for each new token, the
        index of its parent among the sequence's uncommitted nodes (earlier rounds first, then this
        round's tokens in order), or -1 for a root that follows the committed tokens.
        Raises before changing anything: KeyError, TypeError, ValueError, ForwardStateError,
        OutOfPagesError.
        """
        if self._fwd is not None:
            raise ForwardStateError("begin_forward called while a forward is open; call end_forward first")
        if type(seq_ids) is not list:  # read once, here: a one-shot iterator serves both paths below
            seq_ids = _id_list(seq_ids, "begin_forward")
        if type(append_lengths) is not list:
            append_lengths = _int_list(append_lengths, "append_lengths")
        R, ib = self._repeat, self._index
        if R is not None and token_tree_parent_ptr is None and R.advance(seq_ids, append_lengths):
            # the decode fast path: the last decode step's plan, advanced in place (repeat_decode.RepeatDecode),
            # uploaded, and the forward bound for this slot reused (kept flat: this runs every step)
            L = self._launcher
            split = NO_SPLIT if L.granule is None else L.decode_split(len(R.seqs), R.max_keys)
            used = R.pi + R.nnz
            slot = ib.next_slot(used)
            ib.upload(slot, used)
            if ib.generation != R.generation:  # the view cache was dropped: rebind (views stay valid)
                R.forwards.clear()
                R.generation = ib.generation
            fwd = R.forwards.get(slot)
            if fwd is None or fwd.decode_split != split:  # first use of the slot, or the split changed
                dev = device_views(ib, slot, R.layout)
                fwd = L.bind(R.seq_ids, R.ones, len(R.seqs), "paged_decode", [], dev, slot, split)
                R.forwards[slot] = fwd
            fwd.seq_ids = R.seq_ids  # (a step that replaced rows has new ids)
            self._fwd = fwd
            self._step += 1
            self._repeated = True
            self._planned_on_device = False
            return
        self._repeat = None
        self._repeated = False
        cfg, table, pool = self.config, self._table, self.pool
        # Validation does O(1) Python-level passes over the batch (C-level map/set/min); the per-item
        # loops that build error messages run only once something is wrong.
        seq_ids = _id_list(seq_ids, "begin_forward")
        if set(map(type, seq_ids)) - {int}:
            seq_ids = [check_id(s, "seq_ids[i]") for s in seq_ids]
        resident = table.resident
        try:  # ints only by now: plain lookups, and the table's own errors for an unknown or swapped id
            seqs = list(map(resident.__getitem__, seq_ids))
        except KeyError:
            seqs = list(map(table.get, seq_ids))
        lengths = _int_list(append_lengths, "append_lengths")
        if set(map(type, lengths)) - {int}:
            lengths = [as_int(n, "append_lengths[i]") for n in lengths]
        if not seq_ids:
            raise ValueError("begin_forward needs at least one sequence")
        if len(lengths) != len(seq_ids):
            raise ValueError(f"append_lengths has {len(lengths)} entries for {len(seq_ids)} seq_ids")
        if len(set(seq_ids)) != len(seq_ids):
            dup = next(s for s in seq_ids if seq_ids.count(s) > 1)
            raise ValueError(f"seq_id {dup} appears twice in one forward; merge its tokens into one entry")
        if min(lengths) <= 0:
            for s, n in zip(seq_ids, lengths):
                if n <= 0:
                    raise ValueError(f"append length {n} of sequence {s} must be positive")
        if len(seq_ids) > cfg.max_batch_size:
            raise ValueError(f"batch of {len(seq_ids)} sequences exceeds max_batch_size={cfg.max_batch_size}")
        total = sum(lengths)
        if total > cfg.prefill_chunk_size:
            raise ValueError(
                f"{total} new tokens exceed prefill_chunk_size={cfg.prefill_chunk_size}; split the forward into chunks"
            )
        tree = token_tree_parent_ptr is not None
        if tree and cfg.has_local_layers:
            raise ValueError(
                f"token trees are not supported with per-layer sliding windows (layer_windows={cfg.layer_windows})"
            )
        parents = self._check_tree(seq_ids, seqs, lengths, token_tree_parent_ptr) if tree else None
        if not tree and any(map(_TREE, seqs)):
            for s, seq in zip(seq_ids, seqs):
                if seq.tree_parent:
                    raise ValueError(
                        f"sequence {s} has {len(seq.tree_parent)} uncommitted token-tree nodes; commit them "
                        "(commit_accepted_token_tree_nodes) or pass token_tree_parent_ptr"
                    )
        # pages reserved (OutOfPagesError before any change), arrays written, sequences grown (plan.Planner)
        planner, L = self._planner, self._launcher
        plan = planner.plan(seq_ids, seqs, lengths, parents, pool, table, self._copy_page)
        self._planned_on_device = plan.on_device
        if not plan.on_device:
            ib.upload(plan.slot, plan.used)
        self._step += 1
        # a forward binds only device views of its shape and slot, scratch views of its token count and
        # a decode's split: the one bound last over them is kept (Planner.keep_forward) and reused with
        # this step's batch
        decode = plan.kernel == "paged_decode"
        split = NO_SPLIT if not decode or L.granule is None else L.decode_split(len(seqs), plan.max_keys)
        fwd = planner.kept_forward(plan)
        if fwd is None or fwd.decode_split != split:
            dev = planner.device_views(plan)
            fwd = L.bind(plan.seq_ids, plan.lengths, plan.total, plan.kernel, plan.slides, dev, plan.slot, split)
            planner.keep_forward(plan, fwd)
        else:
            fwd.seq_ids, fwd.lengths, fwd.slides = plan.seq_ids, plan.lengths, plan.slides
        self._fwd = fwd
        if decode and not plan.slides and not plan.on_device:
            # where decode steps are planned on the device (device_plan), the kept plan patches only rows
            # replaced in place; a batch whose rows moved is planned there
            moves = planner.device is None
            self._repeat = RepeatDecode.after(plan, seqs, plan.npages, ib, pool, table, fwd, self._copy_page, moves)

    def attention_with_fused_qkv(self, layer_id, qkv, sm_scale=None, out=None):
        """Append this layer's new K/V and compute attention for the tokens of the open forward.

        Parameters
        ----------
        layer_id : int
            The model's layer id: in ``[first_layer, first_layer + num_layers)``, which is
            ``[0, num_layers)`` but for a pipeline stage.
        qkv : numpy.ndarray | torch.Tensor | tvm.runtime.Tensor
            ``[total_new_tokens, H_qo + 2 H_kv, D]`` of the cache dtype, tokens in ``begin_forward``
            order (docs/layout.md, "Fused qkv"), on the cache's device (NumPy is copied over). More rows
            are allowed, as TVM's cache allows them (a buffer sized for the largest batch): only the
            first ``total_new_tokens`` are read.
        sm_scale : float, optional
            Softmax scale, default ``head_dim ** -0.5``.
        out : same kind as ``qkv``, optional
            ``[total_new_tokens, H_qo, D]`` (or more rows, the rest left as they are), written in place
            when given.

        Returns
        -------
        ``[total_new_tokens, H_qo, D]`` attention output, the same kind as ``qkv`` (``out`` when given).
        """
        cfg = self.config
        fwd = self._fwd
        if fwd is None:
            raise ForwardStateError("attention_with_fused_qkv called outside begin_forward/end_forward")
        if self._mla:
            raise TypeError(
                "attention_with_fused_qkv on an MLA cache: append the latent with append_mla_kv and attend with "
                "cross_attention (+ self_attention / merge_attn_output_inplace in a prefill)"
            )
        layer = cfg.layer_index(layer_id if type(layer_id) is int else as_int(layer_id, "layer_id"))
        sm_scale = self._default_sm_scale if sm_scale is None else self._sm_scale(sm_scale)
        window = self._windows[layer]
        if self._tvm_ok(qkv, fwd.qkv_shape) and (out is None or self._tvm_ok(out, fwd.o_shape)):
            if out is not None:
                self._check_apart(qkv, out, fwd)
            if self._calibrating:
                self._calibrate(layer, fwd, qkv)
            o = self._output_buffer(None, "tvm", fwd.total) if out is None else out  # the Relax VM's case
            run_layer(fwd, self._page_args[layer], qkv, o, sm_scale, window)
            self._ran[layer] = self._step
            return o
        if out is not None and self._torch_ok(qkv, fwd.qkv_shape) and self._torch_ok(out, fwd.o_shape):
            kind = "torch"  # a model's torch tensors, of a kind an earlier call checked in full
        else:
            more_qkv = _more_rows(qkv, fwd.qkv_shape)
            more_out = out is not None and _more_rows(out, fwd.o_shape)
            if more_qkv or more_out:  # rows to spare (TVM's cache takes them): their first rows, as views
                whole = out  # (a buffer with too few rows is passed on as it is, for the checks to name)
                qkv = _first_rows(qkv, fwd.total) if more_qkv else qkv
                out = _first_rows(out, fwd.total) if more_out else out
                result = self.attention_with_fused_qkv(layer_id, qkv, sm_scale, out)
                return result if whole is None else whole
            kind = self._check_array(qkv, "qkv", fwd.qkv_shape)
            if out is not None:
                self._check_out(out, kind, "qkv", fwd.o_shape)
        if out is not None and kind != "numpy":
            self._check_apart(qkv, out, fwd)
        qkv_dev = tensors.to_device(qkv, kind, self.device)
        if self._calibrating:
            self._calibrate(layer, fwd, qkv_dev)
        o_dev = self._output_buffer(out, kind, fwd.total)
        run_layer(fwd, self._page_args[layer], qkv_dev, o_dev, sm_scale, window)
        self._ran[layer] = self._step
        if kind == "torch" and self._torch_fast is None:
            self._torch_fast = (type(qkv), getattr(tensors.torch_module(), self.config.dtype), qkv.device)
        return self._deliver(o_dev, out, kind)

    def attention_with_shared_kv(self, layer_id, q, k, v, out=None, sm_scale=None, *, rotate_q=False):
        """Attention of ``q`` over the K/V of layer ``layer_id`` (cross-layer KV sharing, e.g. Gemma-style
        models), appending nothing: ``layer_id``'s attention must already have run in this forward, so
        its pages hold this forward's tokens too. Its per-layer window (``layer_windows``) applies.

        Parameters
        ----------
        layer_id : int
            The source layer, whose ``attention_with_fused_qkv`` ran in the open forward.
        q : array
            ``[total_new_tokens, H_qo, D]`` queries, used as given (TVM's rule: the model rotates them
            with "normal" RoPE; "inline" RoPE rotates them inside the kernel).
        k, v : array
            ``[total_new_tokens, H_kv, D]``: the current tokens' K/V as TVM's builtin passes them;
            checked for shape and dtype only (the source layer's pages already hold them).
        out, sm_scale
            As for :meth:`attention_with_fused_qkv`.
        rotate_q : bool
            Rotate raw ``q`` here as ``split_rope`` rotates the fused path's q (kernel ``rope_q``; only
            with rope_mode "normal" does it change anything), for models that leave RoPE to the cache.
        """
        cfg, fwd = self.config, self._open_forward("attention_with_shared_kv")
        if self._mla:
            raise TypeError("attention_with_shared_kv reads MHA pages; this is an MLA cache (as in TVM, MHA only)")
        layer = self._layer(layer_id)
        if self._ran[layer] != self._step:
            raise ForwardStateError(
                f"attention_with_shared_kv reads layer {layer}'s pages, but that layer's attention has not run in "
                "this forward; call attention_with_fused_qkv for it first"
            )
        sm_scale = self._sm_scale(sm_scale)
        n = fwd.total
        kind = self._check_array(q, "q", (n, cfg.num_qo_heads, cfg.head_dim))
        for x, name in ((k, "k"), (v, "v")):
            self._check_kind(x, name, kind, "q")
            self._check_array(x, name, (n, cfg.num_kv_heads, cfg.head_dim))
        if out is not None:
            self._check_out(out, kind, "q", fwd.o_shape)
        if not isinstance(rotate_q, bool):
            raise TypeError(f"rotate_q={rotate_q!r} must be True or False")
        if rotate_q and "rope_q" not in self.kernels:
            raise RuntimeError(
                f"the kernel library {getattr(self.kernels, 'path', '')} has no rope_q (built before shared-KV "
                "support); rebuild it (python -m tvmkv build ...)"
            )
        q_dev = tensors.to_device(q, kind, self.device)
        o_dev = self._output_buffer(out, kind, n)
        lse, rope_scale, rope_theta = fwd.attn_end
        if rotate_q:
            q_rot = fwd.scratch["q"]
            self.kernels["rope_q"](q_dev, fwd.dev["q_pos"], q_rot, rope_scale, rope_theta)
            q_dev = q_rot
        bound = self._launcher.shared(fwd)
        run_paged(
            bound, self._page_args[layer], q_dev, o_dev, lse, sm_scale, rope_scale, rope_theta, self._windows[layer]
        )
        return self._deliver(o_dev, out, kind)

    # ------------------------------------------------------------------ fine-grained attention (TVM's)
    def self_attention(self, layer_id, q, k, v, out=None, lse=None, sm_scale=None):
        """Attention among the open forward's new tokens alone, over the ``k`` / ``v`` given here: causal
        within each sequence (a token-tree forward: each token sees its ancestors among the new
        tokens); reads and writes no pages (TVM's ``self_attention``; docs/layout.md, "Fine-grained
        attention"). A layer with a per-layer window (``layer_windows``) attends within it. With
        ``rope_mode="inline"`` q and k are rotated at their positions inside the kernel; otherwise they
        are used as given.

        Parameters
        ----------
        layer_id : int
            The model's layer id, in ``[first_layer, first_layer + num_layers)`` (selects its per-layer
            window).
        q : array
            ``[total_new_tokens, H_qo, D]`` of the cache dtype, tokens in ``begin_forward`` order.
        k, v : array
            ``[total_new_tokens, H_kv, D]``, the same kind as ``q``.
        out : array, optional
            ``[total_new_tokens, H_qo, D]``, written in place when given.
        lse : array, optional
            ``[total_new_tokens, H_qo]`` float32, written in place when given: the base-2 log-sum-exp
            of each row's scores (docs/layout.md), to merge with :meth:`merge_attn_output_inplace`.
        sm_scale : float, optional
            Softmax scale, default ``head_dim ** -0.5``.

        On an MLA cache (:meth:`mla`) this is the prefill's non-absorbed attention: q and k
        ``[total_new_tokens, H, Dq]``, v and out ``[total_new_tokens, H, Dv]`` (``mla_self_dims``).

        Returns
        -------
        ``(o, lse)`` in the kind of ``q``.
        """
        cfg = self.config
        fwd = self._open_forward("self_attention")
        layer = self._layer(layer_id)
        sm_scale = self._sm_scale(sm_scale)
        if self._mla:
            return self._mla_self_attention(fwd, q, k, v, out, lse, sm_scale)
        n, D = fwd.total, cfg.head_dim
        kind = self._check_array(q, "q", (n, cfg.num_qo_heads, D))
        for x, name in ((k, "k"), (v, "v")):
            self._check_kind(x, name, kind, "q")
            self._check_array(x, name, (n, cfg.num_kv_heads, D))
        o_dev, lse_dev = self._outputs(out, lse, kind, (n, cfg.num_qo_heads, D))
        q_dev, k_dev, v_dev = (tensors.to_device(x, kind, self.device) for x in (q, k, v))
        run_ragged(fwd, self.kernels, q_dev, k_dev, v_dev, o_dev, lse_dev, sm_scale, self._windows[layer])
        return self._deliver(o_dev, out, kind), self._deliver(lse_dev, lse, kind)

    def cross_attention(self, layer_id, q, out=None, lse=None, sm_scale=None, *, include_new=None):
        """Attention of the open forward's queries over the K/V that layer ``layer_id``'s pages hold,
        appending nothing (TVM's ``cross_attention``; docs/layout.md, "Fine-grained attention").

        Parameters
        ----------
        layer_id : int
            The layer whose pages are read (its per-layer window applies).
        q : array
            ``[total_new_tokens, H_qo, D]``, tokens in ``begin_forward`` order (rotated inside the
            kernel only with ``rope_mode="inline"``).
        out, lse, sm_scale
            As for :meth:`self_attention`.
        include_new : bool, optional
            False: only the keys held before this forward (the history; a sequence without one gets
            ``o = 0``, ``lse = -inf``). True: the history and this forward's tokens (causal), which
            this layer's attention must already have appended. None (default): TVM's rule — True for
            a decode step (one token per sequence) of a cache without ``support_sliding_window``,
            else False; that is what pairs with :meth:`self_attention` and
            :meth:`merge_attn_output_inplace` in a prefill.

        On an MLA cache (:meth:`mla`) this is absorbed attention over the latent rows: q
        ``[total_new_tokens, H, kv_lora_rank + qk_rope_head_dim]``, out ``[total_new_tokens, H,
        kv_lora_rank]``.

        Returns
        -------
        ``(o, lse)`` in the kind of ``q``.
        """
        cfg = self.config
        fwd = self._open_forward("cross_attention")
        layer = self._layer(layer_id)
        sm_scale = self._sm_scale(sm_scale)
        if fwd.kernel == "paged_prefill_tree":
            raise NotImplementedError(
                "cross_attention in a token-tree forward is not supported (as in TVM); use attention_with_fused_qkv"
            )
        if include_new is None:
            include_new = fwd.kernel == "paged_decode" and not cfg.support_sliding_window
        elif not isinstance(include_new, bool):
            raise TypeError(f"include_new={include_new!r} must be True, False or None (TVM's rule)")
        if include_new and self._ran[layer] != self._step:
            raise ForwardStateError(
                f"cross_attention(include_new=True) reads this forward's tokens from layer {layer}'s pages, but "
                f"nothing appended them in this forward; call "
                f"{'append_mla_kv' if self._mla else 'attention_with_fused_qkv'} for that layer first, or pass "
                "include_new=False"
            )
        n = fwd.total
        shape = (n, cfg.num_qo_heads, cfg.head_dim)
        kind = self._check_array(q, "q", shape)
        if self._mla:  # absorbed MLA: V is the latent part of each stored row
            o_dev, lse_dev = self._outputs(out, lse, kind, (n, cfg.num_qo_heads, cfg.kv_lora_rank))
            q_dev = tensors.to_device(q, kind, self.device)
            self._mla_cross_attention(fwd, layer, q_dev, o_dev, lse_dev, sm_scale, include_new)
            return self._deliver(o_dev, out, kind), self._deliver(lse_dev, lse, kind)
        o_dev, lse_dev = self._outputs(out, lse, kind, shape)
        q_dev = tensors.to_device(q, kind, self.device)
        bound = self._launcher.paged(fwd, None if include_new else self._history_tables(fwd))
        _, rope_scale, rope_theta = fwd.attn_end
        run_paged(
            bound, self._page_args[layer], q_dev, o_dev, lse_dev, sm_scale, rope_scale, rope_theta, self._windows[layer]
        )
        return self._deliver(o_dev, out, kind), self._deliver(lse_dev, lse, kind)

    def merge_attn_output_inplace(self, o, lse, o_other, lse_other):
        """Merge the partial attention state ``(o_other, lse_other)`` into ``(o, lse)``, **in place**:
        the result of attending over both key sets (docs/layout.md, "Outputs and the log-sum-exp";
        rows with ``lse = -inf`` contribute nothing). TVM's ``merge_attn_output_inplace``; needs no
        open forward.

        Parameters
        ----------
        o, o_other : array
            ``[n, H_qo, D]`` of the cache dtype; ``o`` is overwritten.
        lse, lse_other : array
            ``[n, H_qo]`` float32 base-2 log-sum-exps; ``lse`` is overwritten.

        Returns
        -------
        ``(o, lse)``, the arrays passed in.
        """
        cfg = self.config
        kind = tensors.array_kind(o)
        shape = tensors.describe(o, kind)[0]
        any_dim = "merge_any" in self.kernels  # MLA kernel sets merge any head dim
        if len(shape) != 3 or shape[1] != cfg.num_qo_heads or not (any_dim or shape[2] == cfg.head_dim):
            raise ValueError(
                f"o has shape {shape}; expected [n, {cfg.num_qo_heads}, {'D' if any_dim else cfg.head_dim}]"
            )
        n = shape[0]
        self._check_array(o, "o", shape)
        for x, name, want, dtype in (
            (lse, "lse", (n, cfg.num_qo_heads), "float32"),
            (o_other, "o_other", shape, None),
            (lse_other, "lse_other", (n, cfg.num_qo_heads), "float32"),
        ):
            self._check_kind(x, name, kind, "o")
            self._check_array(x, name, want, dtype)
        for x, name in ((o, "o"), (lse, "lse")):
            if kind == "numpy" and not x.flags.writeable:
                raise ValueError(f"{name} is a read-only NumPy array; merge_attn_output_inplace writes it")
        o_dev, lse_dev, ob_dev, lb_dev = (tensors.to_device(x, kind, self.device) for x in (o, lse, o_other, lse_other))
        self.kernels["merge_any" if any_dim else "merge_state"](o_dev, lse_dev, ob_dev, lb_dev)
        self._deliver(o_dev, o, kind)
        self._deliver(lse_dev, lse, kind)
        return o, lse

    def append_mla_kv(self, layer_id, kv):
        """Write the open forward's MLA rows into layer ``layer_id``'s pages (TVM's ``append_mla_kv``).

        Parameters
        ----------
        layer_id : int
            The model's layer id: in ``[first_layer, first_layer + num_layers)``, which is
            ``[0, num_layers)`` but for a pipeline stage.
        kv : array
            ``[total_new_tokens, kv_lora_rank + qk_rope_head_dim]`` of the cache dtype, tokens in
            ``begin_forward`` order: each token's compressed latent, then its rotated key part.

        Returns
        -------
        The cache (TVM's builtin returns it).
        """
        fwd = self._open_forward("append_mla_kv")
        if not self._mla:
            raise TypeError("append_mla_kv on an MHA cache: use attention_with_fused_qkv (MLA caches: .mla(...))")
        layer = self._layer(layer_id)
        kind = self._check_array(kv, "kv", (fwd.total, self.config.head_dim))
        self.kernels["mla_append"](self.pages[layer], tensors.to_device(kv, kind, self.device), fwd.dev["slots"])
        self._ran[layer] = self._step
        return self

    def _mla_cross_attention(self, fwd: Forward, layer: int, q, o, lse, sm_scale: float, include_new: bool) -> None:
        """Absorbed MLA attention of device ``q`` over layer ``layer``'s latent rows into ``o`` / ``lse``:
        the forward's own page tables (split when the decode step is) or the history's."""
        d = fwd.dev
        if include_new:
            tables = (d["page_indptr"], d["page_indices"], d["last_page_len"])
        else:
            tables = self._history_tables(fwd)
        head = (q, d["q_indptr"], d["q_pos"], self.pages[layer], *tables, d["kv_window"])
        split = fwd.decode_split
        if include_new and split.num_splits > 1:  # flash-decoding: a partial state per key chunk, merged
            o_part, lse_part = fwd.parts
            self.kernels["mla_attention_split"](*head, o_part, lse_part, sm_scale, 1, split.kv_chunk)
            self.kernels["mla_merge_splits"](o_part, lse_part, o, lse)
        else:
            self.kernels["mla_attention"](*head, o, lse, sm_scale, 1)

    def _mla_self_attention(self, fwd: Forward, q, k, v, out, lse, sm_scale: float):
        """MLA's non-absorbed self attention of a prefill (see :meth:`mla`)."""
        import dataclasses

        from ..build import load_kernels

        cfg, n, H = self.config, fwd.total, self.config.num_qo_heads
        if fwd.kernel == "paged_prefill_tree":
            raise NotImplementedError("MLA self_attention in a token-tree forward is not supported (as in TVM)")
        kind = tensors.array_kind(q)
        qs, vs = tensors.describe(q, kind)[0], tensors.describe(v, tensors.array_kind(v))[0]
        if len(qs) != 3 or len(vs) != 3:
            raise ValueError(f"q {qs} and v {vs} must be [total_new_tokens, {H}, head dim]")
        dims = cfg.mla_self_dims or (self._mla_self[0] if self._mla_self else (qs[2], vs[2]))
        self._check_array(q, "q", (n, H, dims[0]))
        for x, name, shape in ((k, "k", (n, H, dims[0])), (v, "v", (n, H, dims[1]))):
            self._check_kind(x, name, kind, "q")
            self._check_array(x, name, shape)
        if cfg.mla_self_dims:
            lib = self.kernels
        else:  # inferred from the first call: its kernels are loaded (or built) once
            if self._mla_self is None:
                if min(dims) <= 0:  # (0, 0) would name the kernel set without self attention
                    raise ValueError(
                        f"q/k have head dim {dims[0]} and v {dims[1]}; MLA self attention needs both > 0 (pass "
                        "[total_new_tokens, num_heads, qk_dim] q and k and [..., v_dim] v)"
                    )
                spec = dataclasses.replace(cfg.mla_spec, self_qk_dim=int(dims[0]), self_v_dim=int(dims[1]))
                try:
                    lib = load_kernels(spec, family="mla", arch=cfg.cuda_arch, build_dir=self._build_dir)
                except ValueError as err:
                    raise ValueError(f"MLA self attention with q/k dim {dims[0]}, v dim {dims[1]}: {err}") from None
                self._mla_self = (dims, lib)
            lib = self._mla_self[1]
        o_dev, lse_dev = self._outputs(out, lse, kind, (n, H, dims[1]))
        q_dev, k_dev, v_dev = (tensors.to_device(x, kind, self.device) for x in (q, k, v))
        lib["ragged_attention_dv"](q_dev, k_dev, v_dev, fwd.dev["q_indptr"], o_dev, lse_dev, sm_scale)
        return self._deliver(o_dev, out, kind), self._deliver(lse_dev, lse, kind)

    def _open_forward(self, what: str) -> Forward:
        if self._fwd is None:
            raise ForwardStateError(f"{what} called outside begin_forward/end_forward")
        return self._fwd

    def _layer(self, layer_id) -> int:
        """The index into this cache's layers of the model's layer ``layer_id`` (checked)."""
        return self.config.layer_index(layer_id if type(layer_id) is int else as_int(layer_id, "layer_id"))

    def _check_kind(self, x, name: str, kind: str, source: str) -> None:
        if tensors.array_kind(x) != kind:
            raise TypeError(f"{name} is a {tensors.array_kind(x)} array but {source} is {kind}; pass the same kind")

    def _outputs(self, out, lse, kind: str, o_shape: tuple) -> tuple:
        """Device ``(o, lse)`` buffers: the caller's ``out`` / ``lse`` (checked) or fresh ones."""
        lse_shape = o_shape[:2]
        if out is not None:
            self._check_out(out, kind, "q", o_shape)
        if lse is not None:
            self._check_out(lse, kind, "q", lse_shape, "lse", "float32")
        n = o_shape[0]
        return self._output_buffer(out, kind, n, o_shape), self._output_buffer(lse, kind, n, lse_shape, "float32")

    def _history_tables(self, fwd: Forward) -> tuple:
        """Device page tables of the keys held before the open forward (built once per forward)."""
        if self._history is None or self._history[0] != self._step:
            import tvm

            seqs = [self._table.get(s) for s in fwd.seq_ids]
            tables = history_tables(seqs, fwd.lengths, self.config.page_size)
            self._history = (self._step, tuple(tvm.runtime.tensor(a, self.device) for a in tables))
        self._uncapturable = (self._step, _HISTORY_UPLOAD)  # a replay would not upload them again
        return self._history[1]

    def _deliver(self, o_dev, out, kind: str):
        """The output in the caller's kind: ``out`` written in place, or a new array."""
        if out is None:
            return tensors.from_device(o_dev, kind)
        if kind == "numpy":
            out[...] = o_dev.numpy()
        elif kind == "torch" and o_dev.data_ptr() != out.data_ptr():
            import torch

            out.copy_(torch.from_dlpack(o_dev))
        elif kind == "tvm" and o_dev.data_ptr() != out.data_ptr():
            out.copyfrom(o_dev)
        return out

    def _sm_scale(self, sm_scale) -> float:
        if sm_scale is None:
            if self._mla and not self.config.mla_self_dims:
                raise ValueError(
                    "sm_scale=None on an MLA cache without mla_self_dims: pass sm_scale (DeepSeek-V2: "
                    "(qk_nope_head_dim + qk_rope_head_dim) ** -0.5)"
                )
            return self._default_sm_scale
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"sm_scale={sm_scale!r} must be a float (e.g. head_dim ** -0.5) or None")
        sm_scale = float(sm_scale)
        if not abs(sm_scale) <= FLOAT32_MAX / LOG2E:  # (NaN and inf fail too) the kernels scale by it in base 2
            raise ValueError(
                f"sm_scale={sm_scale} must be finite in float32 once the kernels multiply it by log2(e) "
                f"(|sm_scale| <= {FLOAT32_MAX / LOG2E:.4g})"
            )
        return sm_scale

    def end_forward(self) -> None:
        """Close the open forward; sliding windows slide now.

        The forward's new tokens count as appended whether or not every layer's attention ran: a
        layer whose ``attention_with_fused_qkv`` was not called in this forward holds undefined K/V
        in those tokens' slots (as in TVM's cache). Call it once per layer per forward.
        """
        if self._fwd is None:
            raise ForwardStateError("end_forward called with no forward open; call begin_forward first")
        for seq in self._fwd.slides:
            self._table.slide(seq)
        if self._calibrating:
            kv = self._require_fp8("end_forward")
            if self._step in self._ran:  # a forward that appended: its tokens count
                for layer, old in kv.count(self._fwd.total):  # heads of zeros given the default scale
                    self._requantize(layer, np.flatnonzero(self.pool.ref_counts() > 0), old)
            self._calibrating = kv.calibrating
        self._fwd = None

    def commit_accepted_token_tree_nodes(self, seq_ids, leaf_indices, *, scope="tree") -> None:
        """Keep, for each ``seq_ids[i]``, the root-to-leaf path ending at uncommitted node
        ``leaf_indices[i]`` (``-1`` keeps none of it).

        ``scope="tree"`` (default): the tree may have grown over several forwards; the path is kept
        and every other uncommitted node is dropped. ``scope="last_forward"`` is TVM's rule (what the
        drop-in for TVM's builtin does): nodes appended by earlier forwards are kept as they are, and of
        the last forward's nodes the first ``depth(leaf) + 1`` are kept, node ``path[k]`` (indices over
        the whole tree) copied into the ``k``-th of them; every path node must then be one of the last
        forward's first nodes (ValueError otherwise, instead of TVM's out-of-range read).
        """
        if scope not in ("tree", "last_forward"):
            raise ValueError(f"scope={scope!r} must be 'tree' or 'last_forward'")
        self.require_no_forward("commit_accepted_token_tree_nodes")
        seq_ids = [check_id(s, "seq_ids[i]") for s in _id_list(seq_ids, "commit_accepted_token_tree_nodes")]
        seqs = [self._table.get(s) for s in seq_ids]
        leaves = [as_int(x, "leaf_indices[i]") for x in _int_list(leaf_indices, "leaf_indices")]
        if len(leaves) != len(seq_ids):
            raise ValueError(f"leaf_indices has {len(leaves)} entries for {len(seq_ids)} seq_ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a seq_id appears twice in commit_accepted_token_tree_nodes")
        for s, seq, leaf in zip(seq_ids, seqs, leaves):
            count = len(seq.tree_parent)
            if not -1 <= leaf < count:
                raise ValueError(
                    f"leaf index {leaf} of sequence {s} is out of range: it has {count} uncommitted nodes "
                    f"(valid: -1..{count - 1})"
                )
        paths = []
        for s, seq, leaf in zip(seq_ids, seqs, leaves):
            path = []
            while leaf >= 0:
                path.append(leaf)
                leaf = seq.tree_parent[leaf]
            path.reverse()
            if scope == "last_forward" and any(node >= seq.tree_last for node in path):
                raise ValueError(
                    f"the accepted path {path} of sequence {s} reaches nodes of an earlier forward; with "
                    f"scope='last_forward' its nodes must be among the last forward's {seq.tree_last}"
                )
            paths.append(path)
        P = self.config.page_size
        indptr, src, dst, plans = [0], [], [], []
        for seq, path in zip(seqs, paths):
            base = seq.tree_start if scope == "tree" else seq.kv_len - seq.tree_last
            pages = seq.pages
            for k, node in enumerate(path):
                if node != k:
                    a, b = base + node, base + k
                    src.append(int(pages[a // P]) * P + a % P)
                    dst.append(int(pages[b // P]) * P + b % P)
            indptr.append(len(src))
            plans.append((seq, base + len(path)))
        if src:
            import tvm

            arrays = [tvm.runtime.tensor(np.asarray(x, np.int32), self.device) for x in (indptr, src, dst)]
            for layer in range(self.config.num_layers):
                self.kernels["compact_copy"](self.pages[layer], *arrays)
        for seq, new_len in plans:
            seq.tree_parent.clear()
            seq.tree_depth.clear()
            seq.tree_last = 0
            self._table.truncate(seq, new_len)

    # ------------------------------------------------------------------ swap to host (runtime/swap.py)
    def swap_out(self, seq_ids, *, max_staging_bytes=DEFAULT_STAGING_BYTES) -> None:
        """Move the K/V of ``seq_ids`` to host memory and free their device pages.

        Parameters
        ----------
        seq_ids : list of int
            Sequences on the device (distinct). An empty list does nothing.
        max_staging_bytes : int
            Largest device staging buffer; a larger batch is copied in several chunks.

        Raises before changing anything: KeyError (unknown id), SequenceSwappedError (already
        swapped out), ValueError (duplicate id), ForwardStateError (a forward is open).
        """
        self.require_no_forward("swap_out")
        self._no_mla("swap_out")
        ids = [check_id(s, "seq_ids[i]") for s in _id_list(seq_ids, "swap_out")]
        self._swap.swap_out(ids, as_int(max_staging_bytes, "max_staging_bytes"))
        if self._calibrating:  # the host codes keep these scales; swap_in converts if they grow meanwhile
            snapshot = self._require_fp8("swap_out").snapshot()
            self._swapped_scales.update((seq_id, snapshot) for seq_id in ids)

    def swap_in(self, seq_ids, *, max_staging_bytes=DEFAULT_STAGING_BYTES) -> None:
        """Bring swapped-out ``seq_ids`` back into free device pages with identical K/V.

        Pages shared by several of these sequences when they were swapped out together are shared
        again. Raises before changing anything: KeyError (unknown id), ValueError (a sequence that is
        not swapped out, duplicate id), ForwardStateError (a forward is open), OutOfPagesError
        (``needed`` / ``available`` pages).
        """
        self.require_no_forward("swap_in")
        self._no_mla("swap_in")
        ids = [check_id(s, "seq_ids[i]") for s in _id_list(seq_ids, "swap_in")]
        self._swap.swap_in(ids, as_int(max_staging_bytes, "max_staging_bytes"))
        if self._swapped_scales:  # codes swapped out during calibration, under scales that may have grown
            pages: dict = {}  # distinct pages per snapshot (sequences swapped out together share pages)
            for seq_id in ids:
                snapshot = self._swapped_scales.pop(seq_id, None)
                if snapshot is not None:
                    pages.setdefault(id(snapshot), (snapshot, set()))[1].update(self.sequence_pages(seq_id))
            for snapshot, held in pages.values():
                for layer in range(self.config.num_layers):
                    self._requantize(layer, np.array(sorted(held), np.int64), snapshot[layer])

    def is_swapped(self, seq_id) -> bool:
        """Whether ``seq_id`` is swapped out (KeyError if the cache does not know it)."""
        return self._table.is_swapped(seq_id)

    def swapped_sequence_ids(self) -> list:
        """Ids of the swapped-out sequences, oldest swap first (``sequence_ids()`` lists the others)."""
        return list(self._table.swapped)

    def num_swapped_pages(self, seq_ids=None) -> int:
        """Device pages ``swap_in(seq_ids)`` would allocate (default: every swapped sequence)."""
        return self._swap.num_pages(None if seq_ids is None else _id_list(seq_ids, "num_swapped_pages"))

    def swapped_host_bytes(self) -> int:
        """Bytes of host memory held for swapped-out sequences (whole buffers of ``swap_out`` calls)."""
        return self._swap.host_bytes()

    def spare_host_bytes(self) -> int:
        """Bytes of the released host buffer kept as a spare for the next ``swap_out`` (0 when none)."""
        return self._swap.spare_bytes()

    def release_host_memory(self) -> None:
        """Free the spare host buffer kept for reuse (buffers of swapped sequences stay)."""
        self._swap.release_spare()

    # ------------------------------------------------------------------ inspection
    def debug_get_kv(self, seq_id, start_pos=0, end_pos=None):
        """K and V of tokens ``[start_pos, end_pos)`` of ``seq_id`` as NumPy ``[num_layers, n, H_kv, D]``.

        Positions index the tokens the cache holds (uncommitted tree nodes follow the committed tokens in
        append order; after a sliding window dropped tokens, position ``i`` is the ``i``-th kept token, as
        in TVM); K is as stored (rotated when rope_mode is "normal"). With fp8 pages (``kv_dtype``) the
        values are dequantized, ``code * scale`` (docs/layout.md, "fp8 pages"), as float32.
        """
        if self._mla:
            raise TypeError("debug_get_kv on an MLA cache: use debug_get_kv_mla (one latent row per token)")
        import tvm

        flat = self._debug_slots(seq_id, start_pos, end_pos)
        cfg = self.config
        out_dtype = np.float32 if cfg.fp8_pages else tensors.numpy_dtype(cfg.dtype)
        k = np.zeros((cfg.num_layers, len(flat), cfg.num_kv_heads, cfg.head_dim), out_dtype)
        v = np.zeros_like(k)
        if len(flat):
            slots_dev = tvm.runtime.tensor(flat, self.device)
            shape = (len(flat), cfg.num_kv_heads, cfg.head_dim)
            for layer in range(cfg.num_layers):
                kd = tvm.runtime.empty(shape, cfg.page_dtype, self.device)
                vd = tvm.runtime.empty(shape, cfg.page_dtype, self.device)
                self.kernels["gather"](self.pages[layer], slots_dev, kd, vd)
                k[layer], v[layer] = kd.numpy(), vd.numpy()
                if cfg.fp8_pages:
                    scale = self._require_fp8("debug_get_kv").get(layer)
                    k[layer] *= scale[0][:, None]
                    v[layer] *= scale[1][:, None]
        return k, v

    def debug_get_kv_mla(self, seq_id, start_pos=0, end_pos=None):
        """The stored MLA rows (latent, then rotated key part) of tokens ``[start_pos, end_pos)`` of
        ``seq_id`` as NumPy ``[num_layers, n, kv_lora_rank + qk_rope_head_dim]`` (TVM's
        ``debug_get_kv_mla``)."""
        if not self._mla:
            raise TypeError("debug_get_kv_mla on an MHA cache: use debug_get_kv")
        import tvm

        flat = self._debug_slots(seq_id, start_pos, end_pos)
        cfg = self.config
        kv = np.zeros((cfg.num_layers, len(flat), cfg.head_dim), tensors.numpy_dtype(cfg.dtype))
        if len(flat):
            slots_dev = tvm.runtime.tensor(flat, self.device)
            for layer in range(cfg.num_layers):
                out = tvm.runtime.empty((len(flat), cfg.head_dim), cfg.dtype, self.device)
                self.kernels["mla_gather"](self.pages[layer], slots_dev, out)
                kv[layer] = out.numpy()
        return kv

    def _debug_slots(self, seq_id, start_pos, end_pos) -> np.ndarray:
        """Flat int32 slots (page * P + offset) of kept tokens ``[start_pos, end_pos)`` of ``seq_id``."""
        seq = self._table.get(seq_id)
        end_pos = seq.length if end_pos is None else as_int(end_pos, "end_pos")
        start_pos = as_int(start_pos, "start_pos")
        if not 0 <= start_pos <= end_pos <= seq.length:
            raise ValueError(f"range [{start_pos}, {end_pos}) is not inside sequence {seq_id} of length {seq.length}")
        P = self.config.page_size
        pos = np.arange(start_pos, end_pos)
        slot = np.where(pos < seq.sink_end, pos, pos + seq.gap)
        pages = seq.pages.astype(np.int64)
        return (pages[slot // P] * P + slot % P).astype(np.int32) if len(slot) else np.zeros(0, np.int32)

    def _no_mla(self, what: str) -> None:
        if self._mla:
            raise NotImplementedError(f"{what} is not supported for MLA caches yet")

    def debug_forward(self) -> ForwardInfo:
        """The open forward as planned: attention kernel, decode split, whether it advanced the previous
        decode step's plan in place, its index-buffer slot, whether it was planned on the device
        (``device_planning``), the decode's one-launch layout, and every index array read back from the
        device (NumPy copies; ``page_indices`` is longer than used: read it through ``page_indptr``)."""
        fwd = self._fwd
        if fwd is None:
            raise ForwardStateError("debug_forward called outside begin_forward/end_forward")
        arrays = {name: t.numpy() for name, t in fwd.dev.items()}
        on_device = self._planned_on_device
        return ForwardInfo(
            fwd.kernel,
            fwd.decode_split.num_splits,
            self._repeated,
            fwd.slot,
            arrays,
            on_device,
            fwd.decode_split.layout if fwd.single else "",  # (the layout of the one launch bound)
        )

    def graph_key(self) -> tuple:
        """A hashable key of the open forward for CUDA-graph capture (docs/cuda_graphs.md): a graph of
        this forward's attention calls, captured in one forward, replays correctly in any later forward
        with an equal key (same kernels and launch parameters, index arrays uploaded to the same device
        memory), whatever its sequences, lengths and page tables. :class:`tvmkv.runtime.graphs.StepGraphs`
        keeps one graph per key. ValueError once a call of the forward has used device memory a replay would
        not refresh (the history page tables of ``cross_attention(include_new=False)``), and while the fp8
        scales calibrate (``calibrate``: those forwards read K/V back to the host)."""
        fwd = self._fwd
        if fwd is None:
            raise ForwardStateError("graph_key called outside begin_forward/end_forward")
        step, why = self._uncapturable
        if step == self._step:
            raise ValueError(f"this forward cannot be captured in a CUDA graph: {why}")
        if self._calibrating:
            raise ValueError(
                "this forward cannot be captured in a CUDA graph: it calibrates the fp8 scales (calibrate=N), "
                "which reads K/V back to the host; capture after calibration (cache.calibrating is False)"
            )
        return graph_key(fwd)

    def attended_layers(self) -> tuple:
        """The layers whose ``attention_with_fused_qkv`` (or ``append_mla_kv``) ran in the open forward:
        their pages hold this forward's tokens, which ``attention_with_shared_kv`` and
        ``cross_attention(include_new=True)`` require. The model's layer ids (``config.layer_ids``), as
        the attention calls and :meth:`mark_attended` take them."""
        self._open_forward("attended_layers")
        return tuple(layer for layer, step in zip(self.config.layer_ids, self._ran) if step == self._step)

    def mark_attended(self, layers) -> None:
        """Record that ``layers``' K/V were appended in the open forward by launches the cache did not
        make from Python: a replayed CUDA graph of this forward's attention calls
        (:class:`tvmkv.runtime.graphs.StepGraphs` calls it after each replay)."""
        self._open_forward("mark_attended")
        checked = [self._layer(layer) for layer in layers]  # every id validated before any is marked
        for layer in checked:
            self._ran[layer] = self._step

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every part agrees: each page's ref count equals the page lists
        and page holders holding it, free + used == total, every sequence's pages match its length,
        swapped sequences hold no pages, and the kept repeat-decode plan and the device page table
        (``device_plan``) match the page lists."""
        problems = self._table.check()
        problems += self.pool.check(seq.pages for seq in self._table.resident.values())
        problems += self._swap.check()
        if self._repeat is not None:
            problems += self._repeat.check()
        if self._planner.device is not None:
            problems += self._planner.device.check()
        if problems:
            raise IntegrityError("; ".join(problems))

    def table_digest(self) -> str:
        """A hex digest of the bookkeeping that decides every later page: each sequence's page list,
        slots, window and token tree (resident and swapped), the free list in hand-out order and the
        ref counts. Caches driven by the same operations (the shards of a tensor-parallel model,
        docs/layout.md "Tensor parallelism") digest alike; no tensor is read."""
        import hashlib

        h = hashlib.blake2b(digest_size=16)
        self._table.digest(h)
        self.pool.digest(h)
        return h.hexdigest()

    # ------------------------------------------------------------------ reserved ids (imports)
    def reserve_sequence_id(self, seq_id, what: str, abandon) -> None:
        """Claim the unused ``seq_id`` for something in progress (an import, :mod:`.checkpoint` /
        :mod:`.transfer`): until :meth:`release_sequence_id`, adding it, forking into it or a forward on
        it raise an error that says ``what``, and ``remove_sequence(seq_id)`` calls ``abandon()`` (which
        must release the claim). ``clear()`` drops every claim."""
        seq_id = self._table.check_new(seq_id)
        self._table.reserved[seq_id] = (str(what), abandon)

    def reserved_sequence_ids(self) -> list:
        """Ids claimed by :meth:`reserve_sequence_id` (imports in progress): not sequences of the cache
        yet, and not free for a new sequence either."""
        return list(self._table.reserved)

    def release_sequence_id(self, seq_id) -> None:
        """Drop the claim of :meth:`reserve_sequence_id` on ``seq_id`` (no-op without one)."""
        self._table.reserved.pop(check_id(seq_id), None)

    # ------------------------------------------------------------------ page holders (prefix cache)
    def attach_page_holder(self, holder: PageHolder) -> None:
        """Register ``holder``, which holds page references outside any sequence (the radix prefix
        cache, :mod:`tvmkv.runtime.radix`; protocol: :class:`tvmkv.runtime.pages.PageHolder`). It takes
        and drops its references through ``cache.pool`` (``hold`` / ``release``); the cache asks it to
        evict before an ``OutOfPagesError`` and ``check_integrity`` counts its references."""
        self.pool.attach_holder(holder)

    # ------------------------------------------------------------------ fp8 page scales
    def kv_scales(self, layer_id) -> np.ndarray:
        """Layer ``layer_id``'s fp8 page scales as NumPy ``[2, num_kv_heads]`` float32 (index 0: K, 1: V;
        docs/layout.md, "fp8 pages")."""
        return self._require_fp8("kv_scales").get(self._layer(layer_id))

    def set_kv_scales(self, layer_id, k_scale, v_scale) -> None:
        """Set layer ``layer_id``'s fp8 page scales: ``k_scale`` and ``v_scale``, each one positive finite
        float or ``[num_kv_heads]`` of them. A stored K is ``k / k_scale`` rounded to fp8, so a scale of
        about ``max |k| / 448`` (e4m3fn; 57344 for e5m2) uses the format's range. Only while the cache
        holds no token (the stored codes would change meaning): set scales before the first forward.
        A layer given scales is no longer calibrated (``calibrate``)."""
        kv = self._require_fp8("set_kv_scales")
        layer = self._layer(layer_id)
        scales = np.stack([kv.row(k_scale, "k_scale"), kv.row(v_scale, "v_scale")])
        self._require_empty_pages("set_kv_scales")
        kv.set(layer, scales)
        self._calibrating = kv.calibrating

    @property
    def calibrating(self) -> bool:
        """Whether forwards still calibrate the fp8 scales (``calibrate``; False once fixed)."""
        return self._kv is not None and self._kv.calibrating

    def requantize_pages(self, layer_id, page_ids, from_scales) -> None:
        """Re-encode the fp8 codes of pages ``page_ids`` of layer ``layer_id``, stored under the scales
        ``from_scales`` (``[2, num_kv_heads]``), to the layer's current scales (kernel
        ``requantize_pages``: one more rounding, saturating). For code that writes pages itself (an
        import of pages stored under other scales, :mod:`tvmkv.runtime.checkpoint`); the pages must be
        held (by a sequence, a page holder or an import). They then hold codes under the current scales,
        which a calibration (``calibrate``) that raises the scales later re-encodes with the rest."""
        kv = self._require_fp8("requantize_pages")
        layer = self._layer(layer_id)
        try:
            rows = [from_scales[0], from_scales[1]] if len(from_scales) == 2 else None
        except (TypeError, KeyError, IndexError):
            rows = None
        if rows is None:
            raise ValueError(
                f"from_scales={from_scales!r} must be [2, num_kv_heads] = (2, {self.config.num_kv_heads}): the K and "
                "V scales the pages' codes were stored under"
            )
        src = np.stack([kv.row(rows[0], "from_scales[0] (K)"), kv.row(rows[1], "from_scales[1] (V)")])
        if isinstance(page_ids, (str, bytes)) or not hasattr(page_ids, "__iter__"):
            raise TypeError(f"page_ids must be a list of page ids, not {type(page_ids).__name__}")
        ids = np.asarray([as_int(p, "page_ids[i]") for p in page_ids], np.int64)
        total = self.config.total_pages
        if len(set(ids.tolist())) != len(ids) or any(not 0 <= p < total or self.pool.ref_count(p) < 1 for p in ids):
            raise ValueError(f"page_ids {ids[:8].tolist()} must be distinct page ids in [0, {total}) that are held")
        old = kv.unfloor(layer)  # a head whose calibration saw only zeros: not a scale for these codes
        if old is not None:  # (the listed pages hold codes under from_scales, converted next)
            self._requantize(layer, np.setdiff1d(np.flatnonzero(self.pool.ref_counts() > 0), ids), old)
        self._requantize(layer, ids, src)
        kv.stored_elsewhere()

    def _requantize(self, layer: int, ids: np.ndarray, from_scales: np.ndarray) -> None:
        """Launch ``requantize_pages`` over ``ids`` of ``layer`` (nothing when no page or equal scales)."""
        import tvm

        if not len(ids) or np.array_equal(from_scales, self._require_fp8("requantize_pages").get(layer)):
            return
        self.kernels["requantize_pages"](
            *self._page_args[layer],
            tvm.runtime.tensor(ids.astype(np.int32), self.device),
            tvm.runtime.tensor(np.ascontiguousarray(from_scales, np.float32), self.device),
        )

    def _start_calibration(self, calibrate, kv_scales) -> None:
        """The constructor's ``calibrate``: learn the scales from the first ``calibrate`` tokens."""
        kv = self._require_fp8("calibrate")
        if kv_scales is not None:
            raise ValueError("pass kv_scales or calibrate, not both: calibrate learns the scales kv_scales gives")
        tokens = as_int(calibrate, "calibrate")
        if tokens < 0:
            raise ValueError(f"calibrate={tokens} must be a number of tokens >= 0 (0: no calibration)")
        kv.start_calibration(tokens)
        self._calibrating = kv.calibrating

    def _calibrate(self, layer: int, fwd, qkv) -> None:
        """Calibration of layer ``layer``'s scales on the open forward's new K/V (``calibrate``): their
        largest magnitudes as stored (``split_rope`` writes them to the scratch buffers, rotated as the
        pages hold them) raise the layer's scales; codes already stored under smaller scales are
        re-encoded before this forward's tokens are appended. Non-finite K/V: ValueError, nothing
        changed."""
        kv = self._require_fp8("calibrate")
        if not kv.calibrates(layer) or fwd.total == 0:
            return
        s = fwd.scratch
        _, rope_scale, rope_theta = fwd.attn_end
        self.kernels["split_rope"](qkv, fwd.dev["q_pos"], s["q"], s["k"], s["v"], rope_scale, rope_theta)
        amax = np.stack([np.abs(s[name].numpy().astype(np.float32)).max(axis=(0, 2)) for name in ("k", "v")])
        if not np.isfinite(amax).all():
            kv_i, head = map(int, np.argwhere(~np.isfinite(amax))[0])
            raise ValueError(
                f"layer {layer}'s new {'KV'[kv_i]} of KV head {head} holds non-finite values ({amax[kv_i, head]}); "
                "fp8 scales cannot be calibrated on them (check the model's activations)"
            )
        old = kv.observe(layer, amax)
        if old is not None:  # every held page: sequences', a prefix cache's, pending imports'
            self._requantize(layer, np.flatnonzero(self.pool.ref_counts() > 0), old)

    def _require_fp8(self, what: str) -> KvScales:
        """The fp8 scales, or ValueError naming ``what`` when the pages are not fp8."""
        if self._kv is None:
            raise ValueError(
                f"{what}: this cache's pages are {self.config.page_dtype}; scales belong to fp8 pages "
                "(construct it with kv_dtype='float8_e4m3fn' or 'float8_e5m2')"
            )
        return self._kv

    def holds_no_token(self) -> bool:
        """Whether the cache holds no token at all: no page in use (by sequences, a prefix cache or
        pending imports), nothing swapped out, no forward open. Then ``set_kv_scales`` may change
        the fp8 scales (no stored code would change meaning)."""
        return self._fwd is None and self.pool.num_free == self.pool.num_pages and not self._table.swapped

    def _require_empty_pages(self, what: str) -> None:
        if self._fwd is not None:
            raise ForwardStateError(f"{what} called inside begin_forward/end_forward")
        if not self.holds_no_token():
            raise ValueError(
                f"{what}: the cache holds tokens ({self.pool.num_pages - self.pool.num_free} pages in use"
                f"{', sequences swapped out' if self._table.swapped else ''}) whose stored codes would change "
                "meaning; set scales before the first forward (or remove every sequence first)"
            )

    # ------------------------------------------------------------------ internals
    def _copy_page(self, src: int, dst: int, num_slots: int) -> None:
        if self._layer_pages is not None:
            self.kernels["copy_page_layers"](self._layer_pages, src, dst, num_slots)
            return
        for layer in range(self.config.num_layers):
            self.kernels["mla_copy_page" if self._mla else "copy_page"](self.pages[layer], src, dst, num_slots)

    def _check_tree(self, seq_ids, seqs, lengths, parent_ptr):
        """Validate parent pointers; return per sequence (new parents, new depths)."""
        parent_ptr = [as_int(p, "token_tree_parent_ptr[i]") for p in _int_list(parent_ptr, "token_tree_parent_ptr")]
        if len(parent_ptr) != sum(lengths):
            raise ValueError(
                f"token_tree_parent_ptr has {len(parent_ptr)} entries but the forward appends {sum(lengths)} tokens"
            )
        out, at = [], 0
        for s, seq, n in zip(seq_ids, seqs, lengths):
            if seq.window:
                raise ValueError(f"sequence {s} has a sliding window; token trees are not supported with windows")
            old = len(seq.tree_parent)
            parents: list = []
            depths: list = []
            for i in range(n):
                p = parent_ptr[at + i]
                if not -1 <= p < old + i:
                    raise ValueError(
                        f"token_tree_parent_ptr entry {at + i} (= {p}, token {i} of sequence {s}) must be -1 or "
                        f"an earlier uncommitted node index in [0, {old + i})"
                    )
                parents.append(p)
                depths.append(0 if p < 0 else (seq.tree_depth[p] if p < old else depths[p - old]) + 1)
            out.append((parents, depths))
            at += n
        return out

    def _tvm_ok(self, x, shape: tuple) -> bool:
        """True when ``x`` is a contiguous, 64-byte aligned tvm tensor of ``shape``, the cache's dtype and
        device, which the kernels take as is; everything else goes through :meth:`_check_array`, whose
        errors name what is wrong (and a misaligned tensor is copied: the kernels' vector loads need the
        alignment, and TVM's own cache takes such a tensor)."""
        return (
            type(x) is self._tvm_tensor
            and x.is_contiguous()
            and x.shape == shape
            and x.data_ptr() % tensors.ALIGN == 0
            and (d := x.device).dlpack_device_type() == self._dl_device_type
            and d.index == self._dev_index
            and x.dtype == self.config.dtype
        )

    def _torch_ok(self, x, shape: tuple) -> bool:
        """True when ``x`` is a contiguous torch tensor of ``shape``, the cache's dtype and device, of
        the class an earlier call already checked through :meth:`_check_array` (a fast path for
        models that pass torch tensors every layer)."""
        fast = self._torch_fast
        return (
            fast is not None
            and type(x) is fast[0]
            and x.dtype is fast[1]
            and x.shape == shape
            and x.device == fast[2]
            and x.is_contiguous()
        )

    def _check_array(self, x, name: str, shape: tuple, dtype: str | None = None) -> str:
        kind = tensors.array_kind(x)
        got_shape, got_dtype, got_dev = tensors.describe(x, kind)
        if got_shape != shape:
            raise ValueError(f"{name} has shape {got_shape}; expected {shape} for this forward")
        if dtype is not None and got_dtype != dtype:
            raise ValueError(f"{name} has dtype {got_dtype}; expected {dtype}")
        if dtype is None and got_dtype != self.config.dtype:
            raise ValueError(f"{name} has dtype {got_dtype}; the cache holds {self.config.dtype}: cast it first")
        want_dev = self._device_name
        if kind != "numpy" and got_dev != want_dev:
            raise ValueError(f"{name} is on {got_dev} but the cache's kernels run on {want_dev}; move it there")
        if not tensors.is_contiguous(x, kind):
            fix = "np.ascontiguousarray(x)" if kind == "numpy" else "x.contiguous()"
            raise ValueError(f"{name} is not contiguous; pass a contiguous array (e.g. {fix})")
        return kind

    def _check_apart(self, qkv, out, fwd) -> None:
        """``out`` must not share memory with ``qkv``: the kernels read q, k and v from qkv while they
        write the output (a decode, or a prefill in rope mode "none", reads qkv in place)."""
        row = self.config.head_dim * self.config.itemsize * fwd.total
        if tensors.overlaps(qkv, out, row * self.config.qkv_heads, row * self.config.num_qo_heads):
            raise ValueError(
                "out shares memory with qkv; the attention kernels read qkv while they write out, so the "
                "result would be corrupted: pass an output buffer of its own (or out=None)"
            )

    def _check_out(
        self, out, kind: str, source: str, shape: tuple, name: str = "out", dtype: str | None = None
    ) -> None:
        """Output ``name`` must be the same kind as the input ``source``, of ``shape`` (and ``dtype``, default
        the cache's), and writeable."""
        self._check_kind(out, name, kind, source)
        self._check_array(out, name, shape, dtype)
        if kind == "numpy" and not out.flags.writeable:
            raise ValueError(f"{name} is a read-only NumPy array; pass a writeable one (or {name}=None)")

    def _output_buffer(self, out, kind: str, total: int, shape: tuple | None = None, dtype: str | None = None):
        """The device tensor a kernel writes: ``out`` itself (tvm; torch when DLPack takes it) or a fresh
        ``shape`` (default ``[total, H_qo, D]``) buffer of ``dtype`` (default the cache's)."""
        import tvm

        cfg = self.config
        if out is not None and kind == "tvm" and out.data_ptr() % tensors.ALIGN == 0:
            return out  # (a misaligned one gets a fresh buffer, copied into it after the launch)
        if out is not None and kind == "torch":
            try:
                return tvm.runtime.from_dlpack(out)
            except RuntimeError:
                pass  # unaligned: compute into a fresh buffer, copy back
        shape = shape or (total, cfg.num_qo_heads, cfg.head_dim)
        return tvm.runtime.empty(shape, dtype or cfg.dtype, self.device)


def _more_rows(x, shape: tuple) -> bool:
    """Whether ``x`` (any array kind) has ``shape`` but for more leading rows."""
    got = getattr(x, "shape", None)
    return got is not None and len(got) == len(shape) and got[0] > shape[0] and tuple(got[1:]) == shape[1:]


def _first_rows(x, n: int):
    """The first ``n`` rows of ``x`` as a view of the same kind (a tvm tensor's view keeps its data
    pointer: no byte offset)."""
    if tensors.array_kind(x) != "tvm":
        return x[:n]
    if not x.is_contiguous():
        raise ValueError(f"a tvm tensor of shape {tuple(x.shape)} is not contiguous; pass a contiguous one")
    return x._create_view((n, *x.shape[1:]))


def memory_needs(cfg: CacheConfig) -> list:
    """``[(what, bytes, on_device, fix)]``: every buffer a cache of ``cfg`` allocates up front (the page
    pool, a host staging copy of one layer's pool, the q/k/v/lse scratch, the packed index buffers),
    computed without allocating anything."""
    itemsize = cfg.itemsize
    chunk, B = cfg.prefill_chunk_size, cfg.max_batch_size
    layer_bytes = cfg.total_pages * cfg.page_bytes
    index = PackedLayout.of(B, chunk, 1).page_indices_at + -(-cfg.max_total_seq_len // cfg.page_size) + B
    index = -(-index // 1024) * 1024 * 4  # int32 elements rounded up to IndexBuffers' bucket
    scratch = 0 if cfg.is_mla else chunk * (cfg.qkv_heads * cfg.head_dim * itemsize + cfg.num_qo_heads * 4)
    pool_fix = "lower num_pages / max_total_seq_len or use memory_fraction"
    if cfg.num_pages is None:
        pool_fix = (
            f"num_pages defaults to ceil(max_total_seq_len / page_size) + max_batch_size = {cfg.total_pages}: "
            "lower max_total_seq_len / max_batch_size, or pass num_pages or memory_fraction"
        )
    return [
        (
            f"the page pool ({cfg.total_pages} pages x {cfg.num_layers} layers)",
            layer_bytes * cfg.num_layers,
            True,
            pool_fix,
        ),
        ("the host copy that initializes one layer's pool", layer_bytes, False, "lower num_pages / max_total_seq_len"),
        (
            f"the q/k/v/lse scratch of prefill_chunk_size={chunk} rows",
            scratch,
            True,
            "lower prefill_chunk_size",
        ),
        (
            f"the packed index buffers (max_batch_size={B}, prefill_chunk_size={chunk}, "
            f"max_total_seq_len={cfg.max_total_seq_len})",
            index * RING,
            True,
            "lower max_batch_size / prefill_chunk_size / max_total_seq_len",
        ),
        ("the packed host index buffer", index, False, "lower max_batch_size / prefill_chunk_size / max_total_seq_len"),
    ]


def _check_memory(cfg: CacheConfig, device) -> None:
    """ValueError naming the parameter to lower when the buffers of ``cfg`` do not fit (checked before
    anything is allocated: an oversized parameter used to end in ``std::bad_alloc``)."""
    needs = memory_needs(cfg)
    host = device.dlpack_device_type() == 1
    pools = [("the device", [n for n in needs if n[2] or host], device)]
    if not host:
        import tvm

        pools.append(("host memory", [n for n in needs if not n[2]], tvm.cpu(0)))
    for where, items, dev in pools:
        total, free = sum(n[1] for n in items), available_bytes(dev)
        if total > free:
            what, size, _, fix = max(items, key=lambda n: n[1])
            raise ValueError(
                f"{what} needs {size / 2**30:.2f} GiB ({total / 2**30:.2f} GiB with the cache's other buffers) "
                f"but {where} has {free / 2**30:.2f} GiB free; {fix}"
            )


def _local_option(cfg: CacheConfig) -> dict:
    """``load_kernels``'s option for the per-layer-window kernels (only when a layer has a window)."""
    return {"local": True} if cfg.has_local_layers else {}


def make_config(
    num_layers,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    *,
    page_size=16,
    max_batch_size=32,
    max_total_seq_len=2048,
    prefill_chunk_size=512,
    dtype="float16",
    kv_dtype="",
    rope_mode="none",
    rope_scale=1.0,
    rope_theta=1e4,
    rope_scaling=None,
    rotary_dim=None,
    support_sliding_window=False,
    target="llvm",
    device_id=0,
    first_layer=0,
    num_pages=None,
    memory_fraction=None,
    decode_splits=None,
    stable_decode_splits=False,
    device_planning=True,
    layer_windows=None,
    kv_lora_rank=0,
    qk_rope_head_dim=0,
    mla_self_dims=None,
) -> CacheConfig:
    """The :class:`~tvmkv.CacheConfig` that ``PagedAttentionKVCache(num_layers, ..., **options)`` builds from
    its keyword options (all but ``kv_scales``, ``calibrate`` and ``build_dir``, which are not
    configuration); nothing is allocated and no kernel is loaded. ``memory_fraction`` reads the
    device's free memory to size the pool."""
    kind, arch = parse_target(target)
    if memory_fraction is not None:
        if num_pages is not None:
            raise ValueError("pass num_pages or memory_fraction, not both")
        if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)):
            raise TypeError(f"memory_fraction={memory_fraction!r} must be a float in (0, 1]")
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1]")
        probe = CacheConfig(
            num_layers,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size=page_size,
            dtype=dtype,
            kv_dtype=kv_dtype,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
        )
        budget = int(available_bytes(_device(kind, device_id)) * memory_fraction)
        num_pages = budget // (probe.page_bytes * num_layers)
        need = -(-max_total_seq_len // page_size)
        if num_pages < need:
            raise ValueError(
                f"memory_fraction={memory_fraction} of the device's free memory ({budget} bytes) gives "
                f"{num_pages} pages, fewer than the {need} one sequence of max_total_seq_len="
                f"{max_total_seq_len} needs; raise memory_fraction or lower max_total_seq_len"
            )
    config = CacheConfig(
        num_layers=num_layers,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_batch_size=max_batch_size,
        max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        rope_mode=rope_mode,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rotary_dim=rotary_dim,
        support_sliding_window=bool(support_sliding_window),
        target_kind=kind,
        cuda_arch=arch,
        device_id=device_id,
        first_layer=first_layer,
        num_pages=num_pages,
        decode_splits=decode_splits,
        stable_decode_splits=stable_decode_splits,
        device_planning=device_planning,
        layer_windows=_windows(layer_windows, num_layers),
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        mla_self_dims=tuple(mla_self_dims or ()),
    )
    return config


def _windows(layer_windows, num_layers) -> tuple:
    """``layer_windows`` as the config's tuple (() when no layer has a window of its own)."""
    if layer_windows is None:
        return ()
    if isinstance(layer_windows, (str, bytes)) or not hasattr(layer_windows, "__iter__"):
        raise TypeError(f"layer_windows={layer_windows!r} must be a list of {num_layers} window sizes")
    ws = tuple(as_int(w, "layer_windows[i]") for w in layer_windows)
    return ws if any(ws) else ()


def _id_list(seq_ids, what: str) -> list:
    if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
        raise TypeError(f"{what} takes a list of sequence ids, not {type(seq_ids).__name__}; e.g. [{seq_ids!r}]")
    return list(seq_ids)


def _int_list(values, name: str) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, not {type(values).__name__}; e.g. [{values!r}]")
    return list(values)


def _device(kind: str, index: int = 0):
    import tvm

    return tvm.cpu(0) if kind == "llvm" else tvm.cuda(index)
