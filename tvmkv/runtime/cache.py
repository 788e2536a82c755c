"""``PagedAttentionKVCache``: sequences, pages and the forward protocol over tvmkv's TIR kernels.

Bookkeeping is plain Python (page lists, a free list, a NumPy ref-count array); device arrays
appear only where kernels are launched. Layout of every array: docs/layout.md.

Forward protocol (plan/run): ``begin_forward`` validates the whole step, reserves pages and builds
every index array once; ``attention_with_fused_qkv`` only launches kernels (split/rotate, append,
attention, and the merge of a split decode's chunks) for one layer; ``end_forward`` commits (slides
windows). Every public operation validates first and mutates after, so a failed call leaves the
cache as it was.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from ..config import CacheConfig
from ..errors import ForwardStateError, IntegrityError, OutOfPagesError
from ..tir.decode_plan import split_granule
from . import tensors
from .decode_split import NO_SPLIT, DecodeSplit, plan_split
from .index_buffer import IndexBuffers, align
from .swap import HostSwap


@dataclass
class _Sequence:
    """One sequence's pages and window/tree state (slot indices are within the sequence)."""

    pages: list = field(default_factory=list)
    kv_len: int = 0  # slots used in `pages`
    sink_end: int = 0  # slots [0, sink_end) are the attention sink
    window_start: int = 0  # slots [sink_end, window_start) are slid out (invalid)
    pos_offset: int = 0  # logical position of slot j >= sink_end is j + pos_offset
    window: int = 0  # sliding window size (0 = none)
    sink: int = 0
    tree_parent: list = field(default_factory=list)  # uncommitted nodes: parent index or -1
    tree_depth: list = field(default_factory=list)
    mirror: _PageMirror = field(default=None, compare=False, repr=False)  # int32 copy of `pages`

    def __post_init__(self):
        if self.mirror is None:
            self.mirror = _PageMirror()

    @property
    def tree_start(self) -> int:
        """First slot of the uncommitted token-tree nodes."""
        return self.kv_len - len(self.tree_parent)

    @property
    def slid(self) -> bool:
        return self.window_start > self.sink_end or self.pos_offset > 0

    def position(self, slot: int) -> int:
        return slot if slot < self.sink_end else slot + self.pos_offset

    @property
    def committed_length(self) -> int:
        """Logical length of the committed tokens (slid-out tokens count)."""
        return self.position(self.tree_start)

    @property
    def length(self) -> int:
        return self.committed_length + len(self.tree_parent)


class _PageMirror:
    """An int32 NumPy copy of one sequence's page list, so ``begin_forward`` builds ``page_indices``
    with one ``np.concatenate`` instead of a Python loop over every page id.

    ``view`` is ``buf[:n]``; ``last`` its last page (-1 when empty); ``pos`` the sequence's
    ``pos_offset`` when last synced. ``begin_forward`` keeps it in step with the pages it appends or
    copies on write. Every other change of a page list is detected from what it does to the counts:
    a truncation (``pop_n``, token-tree commits) removes a suffix, so ``ceil(kv_len / P) < n`` and the
    prefix stays valid; a sliding window that frees pages raises ``pos_offset``; anything else
    (``ceil(kv_len / P) > n``, a fresh sequence with ``n == -1``) rebuilds from the list.
    """

    __slots__ = ("buf", "n", "view", "last", "pos")

    def __init__(self):
        self.buf = np.zeros(0, np.int32)
        self.n, self.view, self.last, self.pos = -1, self.buf, -1, 0

    def rebuild(self, pages: list, pos: int) -> None:
        self.buf = np.zeros(max(16, 2 * len(pages)), np.int32)
        self.buf[: len(pages)] = pages
        self.pos = pos
        self._set(len(pages))

    def _set(self, n: int) -> None:
        self.n, self.view = n, self.buf[:n]
        self.last = int(self.buf[n - 1]) if n else -1

    def truncate(self, n: int) -> None:
        self._set(n)

    def extend(self, pages: list) -> None:
        n = self.n + len(pages)
        if n > len(self.buf):
            buf = np.zeros(2 * n, np.int32)
            buf[: self.n] = self.view
            self.buf = buf
        self.buf[self.n : n] = pages
        self._set(n)

    def replace_last(self, page: int) -> None:
        self.buf[self.n - 1] = page
        self.last = page


_KV_LEN = attrgetter("kv_len")
_WINDOW = attrgetter("window")
_TREE = attrgetter("tree_parent")
_MIRROR_N = attrgetter("mirror.n")
_MIRROR_LAST = attrgetter("mirror.last")
_MIRROR_VIEW = attrgetter("mirror.view")

# Index arrays of a forward in the order they are packed into the upload buffer (docs/layout.md).
# page_indices comes last: its length changes from step to step, the others' offsets depend only on
# (B, n, tree nodes), so their device views are reused across steps of the same shape. q_pos, slots
# and last_page_len sit next to each other: a repeated decode step advances all three with one add.
_PACKED = (
    "q_indptr",
    "q_pos",
    "slots",
    "last_page_len",
    "page_indptr",
    "kv_window",
    "q_tree",
    "kv_tree_indptr",
    "kv_tree",
    "kv_tree_start",
)


def _layout(B: int, total: int, m: int) -> tuple:
    """``({name: (offset, shape)}, end)`` of the packed arrays before ``page_indices`` (at ``end``)."""
    n = total
    shapes = ((B + 1,), (n,), (n,), (B,), (B + 1,), (B, 3), (max(n, 1), 2), (B + 1,), (m, 3), (B,))
    out, at = {}, 0
    for name, shape in zip(_PACKED, shapes):
        out[name] = (at, shape)
        at += align(math.prod(shape))
    return out, at


@dataclass
class _Forward:
    """Everything ``begin_forward`` planned for one step: the device views of the packed index buffer
    (``dev``), the scratch views (``scratch``) and the kernel calls of one layer, bound once so that
    ``_run_layer`` does no work that grows with the batch."""

    seq_ids: list
    lengths: list
    total: int
    kernel: str  # paged_decode | paged_prefill_causal | paged_prefill_tree | ragged_prefill_causal
    slides: list  # sequences whose window slides at end_forward
    dev: dict  # name -> device tensor (a view of one slot of the packed index buffer)
    scratch: dict  # q, k, v, lse device buffers (views of buffers allocated once)
    split: tuple = ()  # split_rope's arguments after qkv
    append: tuple = ()  # append's arguments after pages
    attn_head: tuple = ()  # attention arguments before pages (all before o when not paged)
    attn_tail: tuple = ()  # attention arguments after pages, before o
    attn_end: tuple = ()  # lse (after o, before sm_scale); rope (after sm_scale)
    paged: bool = True
    kernels: tuple = ()  # (split_rope, append, attention) functions of the library
    decode_split: DecodeSplit = NO_SPLIT  # paged_decode only: how the step cuts its sequences
    merge: object = None  # merge_splits when decode_split splits, else None
    parts: tuple = ()  # (o_part, lse_part) views the split decode writes and merge_splits reads
    qkv_shape: tuple = ()  # [total, H_qo + 2 H_kv, D] expected of qkv
    o_shape: tuple = ()  # [total, H_qo, D] expected of out


@dataclass
class _Steady:
    """The last decode step's plan, kept so that the next decode step of the same batch (same ids in
    the same order, one token each, nothing changed in between) updates it in place instead of planning
    from scratch (:meth:`PagedAttentionKVCache._decode_fast_path`). The arrays are views of the packed
    host index buffer, which still holds that step's index arrays."""

    seq_ids: list
    seqs: list
    ones: list  # [1] * B, compared with the next step's append_lengths
    version: int  # the cache's _version after the step; any other change bumps it
    npages: np.ndarray  # int64 [B] pages of each sequence
    host: np.ndarray  # the packed host buffer the views below point into
    slots: np.ndarray  # views of the packed host buffer (docs/layout.md)
    last_page_len: np.ndarray
    advance: np.ndarray  # one view from q_pos to the end of last_page_len (padding between included)
    page_indptr: np.ndarray
    layout: dict
    pi_off: int  # offset of page_indices in the packed buffer
    nnz: int  # page_indices entries
    max_keys: int  # the longest sequence's kv length after the step (plans the decode split)
    room: int  # steps before some sequence's last page is full (P - max(last_page_len))
    generation: int  # IndexBuffers.generation the cached forwards' views belong to
    forwards: dict  # device slot -> bound _Forward


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an int") from None


def _available_bytes(device) -> int:
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


def _dfs_intervals(parents: list) -> tuple[np.ndarray, np.ndarray]:
    """(enter, exit) preorder intervals of a forest given parent indices (parent < child)."""
    n = len(parents)
    children = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        (roots if p < 0 else children[p]).append(i)
    enter = np.zeros(n, np.int32)
    exit_ = np.zeros(n, np.int32)
    counter = 0
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            exit_[node] = counter - 1
            continue
        enter[node] = counter
        counter += 1
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children[node]))
    return enter, exit_


class PagedAttentionKVCache(HostSwap):
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
        "float32", "float16" or "bfloat16".
    rope_mode : str
        "none", "normal" (K stored rotated) or "inline" (K stored raw, rotated in the kernels).
    rope_scale, rope_theta : float
        RoPE angle = position * rope_scale / rope_theta ** (2 i / head_dim).
    support_sliding_window : bool
        Build the sliding-window kernels (needed by ``enable_sliding_window_for_seq``).
    target : str or tvm.target.Target
        "llvm" (CPU) or "cuda" (an arch may be given as a Target); the device follows.
    num_pages : int, optional
        Pages per layer; default ``ceil(max_total_seq_len / page_size) + max_batch_size``.
    memory_fraction : float, optional
        Instead of ``num_pages``: size the pool to this fraction of the device's free memory
        (as vLLM's ``gpu_memory_utilization``), all layers together.
    decode_splits : int, optional
        Flash-decoding: a decode step may cut its sequences' keys into chunks that run in separate
        thread blocks and are merged after (docs/layout.md, "Split decode"). ``None`` (default) splits
        on cuda only as far as it fills the device (batches too small to occupy every SM); ``1`` never
        splits; an int > 1 forces up to that many chunks on any target (chunks of at least one tile).
    build_dir : path, optional
        Where compiled kernels are cached (default ``build/``).
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
        rope_mode="none",
        rope_scale=1.0,
        rope_theta=1e4,
        support_sliding_window=False,
        target="llvm",
        num_pages=None,
        memory_fraction=None,
        decode_splits=None,
        build_dir=None,
    ):
        import tvm

        from ..build import load_kernels

        kind, arch = _parse_target(target)
        device = tvm.cpu(0) if kind == "llvm" else tvm.cuda(0)
        if kind == "cuda" and not device.exist:
            raise RuntimeError("target='cuda' but no CUDA device is present; use target='llvm'")
        if memory_fraction is not None:
            if num_pages is not None:
                raise ValueError("pass num_pages or memory_fraction, not both")
            if not 0 < memory_fraction <= 1:
                raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1]")
            probe = CacheConfig(num_layers, num_qo_heads, num_kv_heads, head_dim, page_size=page_size, dtype=dtype)
            budget = int(_available_bytes(device) * memory_fraction)
            num_pages = budget // (probe.page_bytes * num_layers)
            need = -(-max_total_seq_len // page_size)
            if num_pages < need:
                raise ValueError(
                    f"memory_fraction={memory_fraction} of the device's free memory ({budget} bytes) gives "
                    f"{num_pages} pages, fewer than the {need} one sequence of max_total_seq_len="
                    f"{max_total_seq_len} needs; raise memory_fraction or lower max_total_seq_len"
                )
        self.config = CacheConfig(
            num_layers=num_layers,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            dtype=dtype,
            rope_mode=rope_mode,
            rope_scale=float(rope_scale),
            rope_theta=float(rope_theta),
            support_sliding_window=bool(support_sliding_window),
            target_kind=kind,
            cuda_arch=arch,
            num_pages=num_pages,
            decode_splits=decode_splits,
        )
        cfg = self.config
        self.device = device
        pool_bytes = cfg.total_pages * cfg.page_bytes * cfg.num_layers
        free_bytes = _available_bytes(device)
        if pool_bytes > free_bytes:
            raise ValueError(
                f"the page pool needs {pool_bytes / 2**30:.2f} GiB ({cfg.total_pages} pages x {cfg.num_layers} "
                f"layers) but the device has {free_bytes / 2**30:.2f} GiB free; lower num_pages / "
                "max_total_seq_len or use memory_fraction"
            )
        self._kernels = load_kernels(
            cfg.kernel_spec, rope_mode=cfg.rope_mode, sliding=cfg.support_sliding_window, arch=arch, build_dir=build_dir
        )
        self._split_granule = split_granule(cfg.kernel_spec) if "paged_decode_split" in self._kernels else None
        if self._split_granule is None and (cfg.decode_splits or 1) > 1:
            raise ValueError(
                f"decode_splits={cfg.decode_splits}: this configuration has no split decode kernel (head_dim "
                f"{cfg.head_dim} {cfg.dtype} is outside the fast cuda decode layout); pass decode_splits=None or 1"
            )
        self._num_sms = device.multi_processor_count if kind == "cuda" else 0
        shape = (cfg.total_pages, 2, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)
        zeros = np.zeros(shape, tensors.numpy_dtype(cfg.dtype))
        self.pages = [tvm.runtime.tensor(zeros, self.device) for _ in range(cfg.num_layers)]
        self._tvm_tensor, self._dl_device_type = tvm.runtime.Tensor, self.device.dlpack_device_type()
        self._default_sm_scale = cfg.head_dim**-0.5
        self._ref = np.zeros(cfg.total_pages, np.int32)
        self._free = list(range(cfg.total_pages - 1, -1, -1))  # pop() hands out low ids first
        self._seqs: dict = {}
        self._swapped: dict = {}  # swapped-out sequences (runtime/swap.py)
        self._staging_buf = None  # device staging buffer of swaps (allocated by the first swap)
        self._host_spare = None  # a released host buffer of swaps, kept for reuse
        self._holders: list = []  # page holders outside sequences (attach_page_holder)
        self._fwd: _Forward | None = None
        # Bumped by every change to a page table, length or window outside a decode fast-path step
        # (_alloc, _release, _truncate, _slide, fork, add/remove, window, clear): a _Steady plan is
        # reused only while it is unchanged (see _decode_fast_path).
        self._version = 0
        self._steady: _Steady | None = None
        self._init_host_path()

    # ------------------------------------------------------------------ queries
    def num_available_pages(self) -> int:
        """Pages on the free list (every one of them can be handed out)."""
        return len(self._free)

    def total_sequence_length(self) -> int:
        """Sum of ``sequence_length`` over all sequences."""
        return sum(s.length for s in self._seqs.values())

    def sequence_length(self, seq_id) -> int:
        """Logical length of ``seq_id``: every token appended and not popped (slid-out tokens count)."""
        if self._swapped_id(seq_id):
            return self._swapped[seq_id].seq.length
        return self._get(seq_id).length

    def sequence_ids(self) -> list:
        return list(self._seqs)

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id) -> None:
        """Add an empty sequence. KeyError if ``seq_id`` exists."""
        seq_id = self._check_new_id(seq_id, "seq_id")
        self._check_no_forward("add_sequence")
        self._seqs[seq_id] = _Sequence()
        self._version += 1

    def remove_sequence(self, seq_id) -> None:
        """Remove ``seq_id``; its pages return to the free list once nothing else holds them (a swapped-out
        sequence drops its host copy)."""
        if self._remove_swapped(seq_id):
            return
        seq = self._get(seq_id)
        self._check_no_forward("remove_sequence")
        self._release(seq.pages)
        del self._seqs[seq_id]
        self._version += 1

    def fork_sequence(self, parent_seq_id, child_seq_id, fork_pos=-1) -> None:
        """Create ``child_seq_id`` holding the first ``fork_pos`` tokens of ``parent_seq_id``.

        Full pages are shared (ref-counted, copy-on-write); a partially shared last page is copied.
        ``fork_pos=-1`` means the parent's whole (committed) length.
        """
        parent = self._get(parent_seq_id)
        child_id = self._check_new_id(child_seq_id, "child_seq_id")
        fork_pos = _as_int(fork_pos, "fork_pos")
        self._check_no_forward("fork_sequence")
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
        P = self.config.page_size
        full, partial = divmod(fork_pos, P)
        if partial and not self._make_room(1):
            raise OutOfPagesError(1, 0, f"fork of sequence {parent_seq_id} at {fork_pos}")
        child = _Sequence(
            window=parent.window, sink=parent.sink, sink_end=parent.sink_end, window_start=parent.sink_end
        )
        child.pages = parent.pages[:full]
        self._ref[child.pages] += 1
        if partial:
            page = self._alloc(1)[0]
            self._copy_page(parent.pages[full], page, partial)
            child.pages.append(page)
        child.kv_len = fork_pos
        self._seqs[child_id] = child
        self._version += 1

    def pop_n(self, seq_id, n) -> None:
        """Drop the last ``n`` tokens of ``seq_id`` (pages no longer used are released)."""
        seq = self._get(seq_id)
        n = _as_int(n, "n")
        self._check_no_forward("pop_n")
        if n < 0:
            raise ValueError(f"pop_n n={n} is negative; pass 0..{seq.length}")
        if seq.tree_parent:
            raise ValueError(
                f"sequence {seq_id} has {len(seq.tree_parent)} uncommitted token-tree nodes; "
                "commit or drop them (commit_accepted_token_tree_nodes) before pop_n"
            )
        limit = seq.kv_len - seq.window_start if seq.slid else seq.length
        if n > seq.length:
            raise ValueError(f"pop_n n={n} exceeds length {seq.length} of sequence {seq_id}")
        if n > limit:
            raise ValueError(
                f"pop_n n={n} reaches into tokens of sequence {seq_id} that its sliding window dropped; "
                f"at most {limit} can be popped"
            )
        self._truncate(seq, seq.kv_len - n)

    def enable_sliding_window_for_seq(self, seq_id, sliding_window_size, attn_sink_size=0) -> None:
        """Keep only the first ``attn_sink_size`` plus the last ``sliding_window_size - attn_sink_size``
        tokens of ``seq_id`` (applied now and after every forward; see docs/layout.md)."""
        seq = self._get(seq_id)
        window = _as_int(sliding_window_size, "sliding_window_size")
        sink = _as_int(attn_sink_size, "attn_sink_size")
        self._check_no_forward("enable_sliding_window_for_seq")
        if not self.config.support_sliding_window:
            raise ValueError(
                "this cache was built with support_sliding_window=False; "
                "construct it with support_sliding_window=True to use sliding windows"
            )
        if window <= 0:
            raise ValueError(f"sliding_window_size={window} must be positive")
        if not 0 <= sink <= window:
            raise ValueError(f"attn_sink_size={sink} must be in [0, sliding_window_size={window}]")
        if seq.tree_parent:
            raise ValueError(f"sequence {seq_id} has an uncommitted token tree; commit it first")
        if seq.slid:
            raise ValueError(f"sequence {seq_id} already slid its window; its window cannot be changed")
        seq.window, seq.sink, seq.sink_end, seq.window_start = window, sink, sink, sink
        self._version += 1
        self._slide(seq)

    def clear(self) -> None:
        """Remove every sequence and close any open forward."""
        self._fwd = None
        self._version += 1
        self._seqs.clear()
        self._swapped.clear()
        self._ref[:] = 0
        self._free = list(range(self.config.total_pages - 1, -1, -1))
        for holder in self._holders:
            holder.forget_pages()

    # ------------------------------------------------------------------ forward protocol
    def begin_forward(self, seq_ids, append_lengths, token_tree_parent_ptr=None) -> None:
        """Plan one forward: ``append_lengths[i]`` new tokens for ``seq_ids[i]``.

        ``token_tree_parent_ptr`` (optional, length ``sum(append_lengths)``): for each new token, the
        index of its parent among the sequence's uncommitted nodes (earlier rounds first, then this
        round's tokens in order), or -1 for a root that follows the committed tokens.
        Raises before changing anything: KeyError, ValueError, ForwardStateError, OutOfPagesError.
        """
        cfg = self.config
        if self._fwd is not None:
            raise ForwardStateError("begin_forward called while a forward is open; call end_forward first")
        fast = self._steady is not None and token_tree_parent_ptr is None
        if fast and self._decode_fast_path(seq_ids, append_lengths):
            return
        self._steady = None
        # Validation does O(1) Python-level passes over the batch (C-level map/set/min); the per-item
        # loops that build error messages run only once something is wrong.
        seq_ids = list(seq_ids)
        try:
            seqs = [self._seqs[s] for s in seq_ids]
        except (KeyError, TypeError):
            seq_ids = [self._known_id(s) for s in seq_ids]  # raises the KeyError that names the id
            raise
        lengths = list(append_lengths)
        if set(map(type, lengths)) - {int}:
            lengths = [_as_int(n, "append_lengths[i]") for n in lengths]
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
        parents = self._check_tree(seq_ids, seqs, lengths, token_tree_parent_ptr) if tree else None
        if not tree and any(map(_TREE, seqs)):
            for s, seq in zip(seq_ids, seqs):
                if seq.tree_parent:
                    raise ValueError(
                        f"sequence {s} has {len(seq.tree_parent)} uncommitted token-tree nodes; commit them "
                        "(commit_accepted_token_tree_nodes) or pass token_tree_parent_ptr"
                    )
        P = cfg.page_size
        B = len(seqs)
        history = np.fromiter(map(_KV_LEN, seqs), np.int64, B)
        lens = np.array(lengths, np.int64)
        have = -(-history // P)  # pages held now (== len(seq.pages), an invariant check_integrity checks)
        end = history + lens  # kv length of each sequence after the step
        want = -(-end // P)
        windowed = np.flatnonzero(np.fromiter(map(_WINDOW, seqs), np.int64, B))
        self._sync_mirrors(seqs, have, windowed)
        partial = np.flatnonzero(history % P)
        cow = partial[self._ref[np.fromiter(map(_MIRROR_LAST, seqs), np.int64, B)[partial]] > 1]
        grow = want - have
        needed = int(grow.sum()) + len(cow)
        if not self._make_room(needed):
            raise OutOfPagesError(needed, len(self._free))
        # ---- validated: from here on nothing raises for a reason the caller controls
        cow_set = set(cow.tolist())
        changed = sorted(cow_set.union(np.flatnonzero(grow).tolist()))  # batch order, as allocation always was
        for i, g in zip(changed, grow[changed].tolist()):
            seq = seqs[i]
            if i in cow_set:  # copy-on-write of a shared partial page
                page = self._alloc(1)[0]
                self._copy_page(seq.pages[-1], page, seq.kv_len % P)
                self._release([seq.pages[-1]])
                seq.pages[-1] = page
                seq.mirror.replace_last(page)
            if g:
                new = self._alloc(g)
                seq.pages.extend(new)
                seq.mirror.extend(new)
        plan = self._plan_arrays(seqs, lens, history, want, windowed, parents)
        for seq, n in zip(seqs, end.tolist()):
            seq.kv_len = n
        if tree:
            for seq, (p, d) in zip(seqs, parents):
                seq.tree_parent.extend(p)
                seq.tree_depth.extend(d)
        if tree:
            kernel = "paged_prefill_tree"
        elif total == B:
            kernel = "paged_decode"
        elif not history.any():
            kernel = "ragged_prefill_causal"
        else:
            kernel = "paged_prefill_causal"
        max_keys = int(end.max())
        self._fwd = self._bind(
            seq_ids,
            lengths,
            total,
            kernel,
            [seqs[i] for i in windowed.tolist()],
            dev=self._upload(plan),
            scratch=self._scratch(total),
            decode_split=self._decode_split(B, max_keys) if kernel == "paged_decode" else NO_SPLIT,
        )
        if kernel == "paged_decode" and not windowed.size:
            self._steady = self._make_steady(seqs, want, plan, max_keys)

    def attention_with_fused_qkv(self, layer_id, qkv, sm_scale=None, out=None):
        """Append this layer's new K/V and compute attention for the tokens of the open forward.

        Parameters
        ----------
        layer_id : int
            Layer in ``[0, num_layers)``.
        qkv : numpy.ndarray | torch.Tensor | tvm.runtime.Tensor
            ``[total_new_tokens, H_qo + 2 H_kv, D]`` of the cache dtype, tokens in ``begin_forward``
            order (docs/layout.md, "Fused qkv"), on the cache's device (NumPy is copied over).
        sm_scale : float, optional
            Softmax scale, default ``head_dim ** -0.5``.
        out : same kind as ``qkv``, optional
            ``[total_new_tokens, H_qo, D]``, written in place when given.

        Returns
        -------
        ``[total_new_tokens, H_qo, D]`` attention output, the same kind as ``qkv``.
        """
        cfg = self.config
        fwd = self._fwd
        if fwd is None:
            raise ForwardStateError("attention_with_fused_qkv called outside begin_forward/end_forward")
        layer = layer_id if type(layer_id) is int else _as_int(layer_id, "layer_id")
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"layer_id {layer} is out of range [0, {cfg.num_layers})")
        if sm_scale is None:
            sm_scale = self._default_sm_scale
        else:
            sm_scale = float(sm_scale)
            if not math.isfinite(sm_scale):
                raise ValueError(f"sm_scale={sm_scale} must be finite")
        if self._tvm_ok(qkv, fwd.qkv_shape) and (out is None or self._tvm_ok(out, fwd.o_shape)):
            o = self._output_buffer(None, "tvm", fwd.total) if out is None else out  # the Relax VM's case
            self._run_layer(layer, qkv, o, sm_scale)
            return o
        kind = self._check_array(qkv, "qkv", fwd.qkv_shape)
        if out is not None:
            if tensors.array_kind(out) != kind:
                raise TypeError(f"out is a {tensors.array_kind(out)} array but qkv is {kind}; pass the same kind")
            self._check_array(out, "out", fwd.o_shape)
        qkv_dev = tensors.to_device(qkv, kind, self.device)
        o_dev = self._output_buffer(out, kind, fwd.total)
        self._run_layer(layer, qkv_dev, o_dev, sm_scale)
        if out is None:
            return tensors.from_device(o_dev, kind)
        if kind == "numpy":
            out[...] = o_dev.numpy()
        elif kind == "torch" and o_dev.data_ptr() != out.data_ptr():
            import torch

            out.copy_(torch.from_dlpack(o_dev))
        return out

    def end_forward(self) -> None:
        """Close the open forward; sliding windows slide now."""
        if self._fwd is None:
            raise ForwardStateError("end_forward called with no forward open; call begin_forward first")
        for seq in self._fwd.slides:
            self._slide(seq)
        self._fwd = None

    def commit_accepted_token_tree_nodes(self, seq_ids, leaf_indices) -> None:
        """Keep, for each ``seq_ids[i]``, the root-to-leaf path ending at uncommitted node
        ``leaf_indices[i]`` (``-1`` drops the whole tree); every other uncommitted node is dropped."""
        self._check_no_forward("commit_accepted_token_tree_nodes")
        seq_ids = [self._known_id(s) for s in seq_ids]
        leaves = [_as_int(x, "leaf_indices[i]") for x in leaf_indices]
        if len(leaves) != len(seq_ids):
            raise ValueError(f"leaf_indices has {len(leaves)} entries for {len(seq_ids)} seq_ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a seq_id appears twice in commit_accepted_token_tree_nodes")
        for s, leaf in zip(seq_ids, leaves):
            count = len(self._seqs[s].tree_parent)
            if not -1 <= leaf < count:
                raise ValueError(
                    f"leaf index {leaf} of sequence {s} is out of range: it has {count} uncommitted nodes "
                    f"(valid: -1..{count - 1})"
                )
        P = self.config.page_size
        indptr, src, dst, plans = [0], [], [], []
        for s, leaf in zip(seq_ids, leaves):
            seq = self._seqs[s]
            path = []
            while leaf >= 0:
                path.append(leaf)
                leaf = seq.tree_parent[leaf]
            path.reverse()
            base = seq.tree_start
            for k, node in enumerate(path):
                if node != k:
                    a, b = base + node, base + k
                    src.append(seq.pages[a // P] * P + a % P)
                    dst.append(seq.pages[b // P] * P + b % P)
            indptr.append(len(src))
            plans.append((seq, base + len(path)))
        if src:
            import tvm

            arrays = [tvm.runtime.tensor(np.asarray(x, np.int32), self.device) for x in (indptr, src, dst)]
            for layer in range(self.config.num_layers):
                self._kernels["compact_copy"](self.pages[layer], *arrays)
        for seq, new_len in plans:
            seq.tree_parent.clear()
            seq.tree_depth.clear()
            self._truncate(seq, new_len)

    # ------------------------------------------------------------------ inspection
    def debug_get_kv(self, seq_id, start_pos=0, end_pos=None):
        """K and V of tokens ``[start_pos, end_pos)`` of ``seq_id`` as NumPy ``[num_layers, n, H_kv, D]``.

        Positions are logical (uncommitted tree nodes follow the committed tokens in append order);
        K is as stored (rotated when rope_mode is "normal"). Tokens a sliding window dropped are an error.
        """
        seq = self._get(seq_id)
        end_pos = seq.length if end_pos is None else _as_int(end_pos, "end_pos")
        start_pos = _as_int(start_pos, "start_pos")
        if not 0 <= start_pos <= end_pos <= seq.length:
            raise ValueError(f"range [{start_pos}, {end_pos}) is not inside sequence {seq_id} of length {seq.length}")
        P = self.config.page_size
        pos = np.arange(start_pos, end_pos)
        slot = np.where(pos < seq.sink_end, pos, pos - seq.pos_offset)
        bad = (slot >= seq.sink_end) & (slot < seq.window_start) | (slot < 0)
        if bad.any():
            raise ValueError(
                f"positions [{start_pos}, {end_pos}) of sequence {seq_id} include tokens its sliding window "
                f"dropped; kept: [0, {min(seq.sink_end, seq.length)}) and "
                f"[{seq.position(seq.window_start)}, {seq.length})"
            )
        import tvm

        pages = np.asarray(seq.pages, np.int64)
        flat = (pages[slot // P] * P + slot % P).astype(np.int32) if len(slot) else np.zeros(0, np.int32)
        cfg = self.config
        k = np.zeros((cfg.num_layers, len(slot), cfg.num_kv_heads, cfg.head_dim), tensors.numpy_dtype(cfg.dtype))
        v = np.zeros_like(k)
        if len(slot):
            slots_dev = tvm.runtime.tensor(flat, self.device)
            shape = (len(slot), cfg.num_kv_heads, cfg.head_dim)
            for layer in range(cfg.num_layers):
                kd = tvm.runtime.empty(shape, cfg.dtype, self.device)
                vd = tvm.runtime.empty(shape, cfg.dtype, self.device)
                self._kernels["gather"](self.pages[layer], slots_dev, kd, vd)
                k[layer], v[layer] = kd.numpy(), vd.numpy()
        return k, v

    def check_integrity(self) -> None:
        """Raise IntegrityError unless: free + used == total, each page's ref count equals the number of
        page lists holding it (plus the references of page holders such as the prefix cache), no page
        twice in one sequence, and every sequence's lengths agree."""
        cfg = self.config
        counts = np.zeros(cfg.total_pages, np.int64)
        problems = []
        for holder in self._holders:
            np.add.at(counts, np.asarray(holder.held_pages(), np.int64), 1)
        for sid, seq in self._seqs.items():
            if len(set(seq.pages)) != len(seq.pages):
                problems.append(f"sequence {sid} holds a page twice")
            counts[seq.pages] += 1
            if len(seq.pages) != -(-seq.kv_len // cfg.page_size):
                problems.append(f"sequence {sid}: {len(seq.pages)} pages for {seq.kv_len} slots")
            if not (seq.tree_start >= 0 and len(seq.tree_depth) == len(seq.tree_parent)):
                problems.append(f"sequence {sid}: inconsistent token tree")
            if seq.window and not (seq.sink_end <= seq.window_start <= max(seq.kv_len, seq.sink_end)):
                problems.append(f"sequence {sid}: window bounds {seq.sink_end}, {seq.window_start}, {seq.kv_len}")
        if not np.array_equal(counts, self._ref):
            bad = np.nonzero(counts != self._ref)[0][:5].tolist()
            problems.append(f"ref counts disagree with page tables at pages {bad}")
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("a page is on the free list twice")
        if any(self._ref[p] for p in free):
            problems.append("a page on the free list is referenced")
        used = int((self._ref > 0).sum())
        if used + len(self._free) != cfg.total_pages:
            problems.append(f"free {len(self._free)} + used {used} != total {cfg.total_pages}")
        problems += self._check_swapped()
        if problems:
            raise IntegrityError("; ".join(problems))

    # ------------------------------------------------------------------ page holders (prefix cache)
    def attach_page_holder(self, holder) -> None:
        """Register ``holder``, which holds page references outside any sequence (the radix prefix
        cache, :mod:`tvmkv.runtime.radix`). It provides ``held_pages()`` (each page it holds a reference
        on, once per reference: ``check_integrity`` counts them), ``evict_pages(count)`` (release at
        least ``count`` pages only it holds and return how many, or release nothing; asked before an
        ``OutOfPagesError`` is raised) and ``forget_pages()`` (``clear`` dropped every reference)."""
        if holder in self._holders:
            raise ValueError("this page holder is already attached")
        self._holders.append(holder)

    def add_sequence_with_pages(self, seq_id, pages, length) -> None:
        """Add ``seq_id`` holding ``length`` tokens that already sit in ``pages`` (page ``i`` holds
        positions ``[i P, (i + 1) P)``, docs/layout.md); each page must be held already (by a sequence
        or a page holder) and gains a reference. A partial last page is shared like any other and
        copied on the sequence's first write into it (copy-on-write in ``begin_forward``).
        Raises KeyError / TypeError, ValueError, ForwardStateError before changing anything."""
        seq_id = self._check_new_id(seq_id, "seq_id")
        self._check_no_forward("add_sequence_with_pages")
        length = _as_int(length, "length")
        pages = [_as_int(p, "pages[i]") for p in pages]
        P, total = self.config.page_size, self.config.total_pages
        if length < 0 or len(pages) != -(-length // P):
            raise ValueError(f"{len(pages)} pages cannot hold length {length}; pass ceil(length / {P}) pages")
        if len(set(pages)) != len(pages) or any(not 0 <= p < total or self._ref[p] < 1 for p in pages):
            raise ValueError(f"pages {pages[:8]} must be distinct page ids in [0, {total}) that are held already")
        self._hold(pages)
        seq = self._seqs[seq_id] = _Sequence()
        seq.pages, seq.kv_len = pages, length

    # ------------------------------------------------------------------ internals
    def _get(self, seq_id) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            self._raise_if_swapped(seq_id)
            raise KeyError(f"sequence {seq_id!r} is not in the cache; add it with add_sequence first") from None

    def _known_id(self, seq_id):
        self._get(seq_id)
        return seq_id

    def _check_new_id(self, seq_id, name: str):
        seq_id = _as_int(seq_id, name)
        if seq_id in self._seqs or seq_id in self._swapped:
            raise KeyError(f"{name} {seq_id} is already in the cache; remove it first or pick another id")
        return seq_id

    def _check_no_forward(self, what: str) -> None:
        if self._fwd is not None:
            raise ForwardStateError(f"{what} is not allowed while a forward is open; call end_forward first")

    def _alloc(self, count: int) -> list:
        assert count <= len(self._free), "caller checks free pages first"
        pages = [self._free.pop() for _ in range(count)]
        self._ref[pages] = 1
        self._version += 1
        return pages

    def _hold(self, pages) -> None:
        """One more reference on each of ``pages`` (distinct, already referenced)."""
        self._ref[pages] += 1
        self._version += 1

    def _make_room(self, needed: int) -> bool:
        """True when ``needed`` pages are free, after asking page holders to evict pages only they
        hold (a holder evicts nothing when it cannot cover the shortfall)."""
        for holder in self._holders:
            if needed <= len(self._free):
                break
            holder.evict_pages(needed - len(self._free))
        return needed <= len(self._free)

    def _release(self, pages) -> None:
        self._version += 1
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)

    def _truncate(self, seq: _Sequence, kv_len: int) -> None:
        keep = -(-kv_len // self.config.page_size)
        self._version += 1
        self._release(seq.pages[keep:])
        del seq.pages[keep:]
        seq.kv_len = kv_len
        if seq.window_start > max(kv_len, seq.sink_end):
            seq.window_start = max(kv_len, seq.sink_end)

    def _slide(self, seq: _Sequence) -> None:
        """Drop tokens beyond the window (keep sink + last window - sink) and free whole stale pages."""
        if not seq.window:
            return
        P = self.config.page_size
        kept = min(seq.kv_len, seq.sink_end) + max(0, seq.kv_len - seq.window_start)
        excess = kept - seq.window
        if excess <= 0:
            return
        seq.window_start += excess
        self._version += 1
        first, last = -(-seq.sink_end // P), seq.window_start // P
        if last > first:
            self._release(seq.pages[first:last])
            del seq.pages[first:last]
            drop = (last - first) * P
            seq.window_start -= drop
            seq.kv_len -= drop
            seq.pos_offset += drop

    def _copy_page(self, src: int, dst: int, num_slots: int) -> None:
        for layer in range(self.config.num_layers):
            self._kernels["copy_page"](self.pages[layer], src, dst, num_slots)

    def _check_tree(self, seq_ids, seqs, lengths, parent_ptr):
        """Validate parent pointers; return per sequence (new parents, new depths)."""
        parent_ptr = [_as_int(p, "token_tree_parent_ptr[i]") for p in parent_ptr]
        if len(parent_ptr) != sum(lengths):
            raise ValueError(
                f"token_tree_parent_ptr has {len(parent_ptr)} entries but the forward appends {sum(lengths)} tokens"
            )
        out, at = [], 0
        for s, seq, n in zip(seq_ids, seqs, lengths):
            if seq.window:
                raise ValueError(f"sequence {s} has a sliding window; token trees are not supported with windows")
            old = len(seq.tree_parent)
            parents, depths = [], []
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

    def _init_host_path(self) -> None:
        """Buffers of the per-step host path, allocated once: the packed index buffer (host + device
        ring, sized for a full batch over ``max_total_seq_len`` tokens; it grows when a step needs more)
        and the q/k/v/lse scratch for ``prefill_chunk_size`` rows."""
        import tvm

        cfg = self.config
        B, n = cfg.max_batch_size, cfg.prefill_chunk_size
        room = _layout(B, n, 1)[1] + -(-cfg.max_total_seq_len // cfg.page_size) + B
        self._index = IndexBuffers(self.device, room)
        empty = tvm.runtime.empty
        self._scratch_bufs = dict(
            q=empty((n, cfg.num_qo_heads, cfg.head_dim), cfg.dtype, self.device),
            k=empty((n, cfg.num_kv_heads, cfg.head_dim), cfg.dtype, self.device),
            v=empty((n, cfg.num_kv_heads, cfg.head_dim), cfg.dtype, self.device),
            lse=empty((n, cfg.num_qo_heads), "float32", self.device),
        )
        self._scratch_views: dict = {}
        self._part_bufs = None  # split decode's partial states (_split_parts)

    def _sync_mirrors(self, seqs, have, windowed) -> None:
        """Bring every ``seq.mirror`` in line with ``seq.pages`` (see :class:`_PageMirror`)."""
        stale = np.flatnonzero(np.fromiter(map(_MIRROR_N, seqs), np.int64, len(seqs)) != have).tolist()
        stale += [i for i in windowed.tolist() if seqs[i].mirror.pos != seqs[i].pos_offset]
        for i in stale:
            seq, m = seqs[i], seqs[i].mirror
            if m.pos == seq.pos_offset and 0 <= len(seq.pages) <= m.n:
                m.truncate(len(seq.pages))  # a suffix was dropped: the prefix is still right
            else:
                m.rebuild(seq.pages, seq.pos_offset)

    def _plan_arrays(self, seqs, lens, history, npages, windowed, parents) -> tuple:
        """Write the index arrays of one forward (docs/layout.md) into the packed host buffer.

        Called after pages were reserved and mirrored; ``lens``, ``history`` (slots before this
        forward) and ``npages`` (pages after it) are int64 ``[B]``. Vectorized over tokens and pages;
        Python loops only over windowed sequences and, in a tree forward, over its sequences.
        Returns ``(slot, layout, page_indices offset, nnz)`` for :meth:`_upload`.
        """
        P = self.config.page_size
        B, total = len(seqs), int(lens.sum())
        tree = parents is not None
        tree_rows = [len(seq.tree_parent) + len(p) for seq, (p, _) in zip(seqs, parents)] if tree else []
        m = max(sum(tree_rows), 1)
        layout, pi_off = _layout(B, total, m)
        nnz = int(npages.sum())
        slot = self._index.next_slot(pi_off + max(nnz, 1))
        host = self._index.host

        def arr(name):
            off, shape = layout[name]
            return host[off : off + math.prod(shape)].reshape(shape)

        q_indptr, page_indptr = arr("q_indptr"), arr("page_indptr")
        q_indptr[0] = page_indptr[0] = 0
        np.cumsum(lens, out=q_indptr[1:])
        np.cumsum(npages, out=page_indptr[1:])
        page_indices = host[pi_off : pi_off + max(nnz, 1)]
        if nnz:
            np.concatenate(list(map(_MIRROR_VIEW, seqs)), out=page_indices)
        else:
            page_indices[0] = 0
        end = history + lens
        arr("last_page_len")[:] = np.where(npages > 0, end - (npages - 1) * P, 0)
        kv_window = arr("kv_window")
        kv_window[:] = 0
        # token t of sequence b sits at slot history[b] + (t - q_indptr[b]) of that sequence
        if total == B:
            seq_of, pos = slice(None), history
        else:
            seq_of = np.repeat(np.arange(B), lens)
            pos = np.arange(total) - np.repeat(q_indptr[:-1] - history, lens)
        arr("slots")[:] = page_indices[page_indptr[:-1][seq_of] + pos // P] * P + pos % P
        q_pos = arr("q_pos")
        q_pos[:] = pos
        for b in windowed.tolist():
            seq = seqs[b]
            kv_window[b] = (seq.sink_end, seq.window_start, seq.pos_offset)
            lo, hi = q_indptr[b], q_indptr[b + 1]
            q_pos[lo:hi] = np.where(q_pos[lo:hi] < seq.sink_end, q_pos[lo:hi], q_pos[lo:hi] + seq.pos_offset)
        q_tree, kv_tree_indptr, kv_tree, kv_tree_start = (arr(n) for n in _PACKED[6:])
        q_tree[:] = 0
        kv_tree_indptr[:] = 0
        kv_tree[:] = 0
        kv_tree_start[:] = 0
        if tree:
            at = 0
            for b, (seq, (new_parents, new_depths)) in enumerate(zip(seqs, parents)):
                all_parents = seq.tree_parent + new_parents
                all_depths = np.asarray(seq.tree_depth + new_depths, np.int32)
                enter, exit_ = _dfs_intervals(all_parents)
                old = len(seq.tree_parent)
                committed = seq.committed_length
                lo, hi = q_indptr[b], q_indptr[b + 1]
                q_tree[lo:hi, 0], q_tree[lo:hi, 1] = enter[old:], exit_[old:]
                q_pos[lo:hi] = committed + all_depths[old:]
                rows = len(all_parents)
                kv_tree[at : at + rows] = np.stack([enter, exit_, committed + all_depths], axis=1)
                at += rows
                kv_tree_indptr[b + 1] = at
                kv_tree_start[b] = history[b] - old
        return slot, layout, pi_off, pi_off + max(nnz, 1)

    def _upload(self, plan) -> dict:
        """Copy the packed buffer to the device in one copy; device views of every array (views are
        cached per slot and shape, so a decode step of an unchanged batch size creates none)."""
        slot, layout, pi_off, used = plan
        self._index.upload(slot, used)
        return self._device_views(slot, layout, pi_off)

    def _device_views(self, slot: int, layout: dict, pi_off: int) -> dict:
        ib = self._index
        dev = {name: ib.view(slot, off, shape) for name, (off, shape) in layout.items()}
        dev["page_indices"] = ib.tail(slot, pi_off)  # longer than nnz: kernels index it via page_indptr
        return dev

    def _make_steady(self, seqs, npages, plan, max_keys: int) -> _Steady:
        """Remember a decode step's plan for :meth:`_decode_fast_path`."""
        slot, layout, pi_off, used = plan
        host = self._index.host

        def arr(name):
            off, shape = layout[name]
            return host[off : off + math.prod(shape)].reshape(shape)

        fwd = self._fwd
        return _Steady(
            seq_ids=fwd.seq_ids,
            seqs=seqs,
            ones=[1] * len(seqs),
            version=self._version,
            npages=npages.astype(np.int64),
            host=host,
            slots=arr("slots"),
            last_page_len=arr("last_page_len"),
            advance=host[layout["q_pos"][0] : layout["last_page_len"][0] + len(seqs)],
            page_indptr=arr("page_indptr"),
            layout=layout,
            pi_off=pi_off,
            nnz=used - pi_off,
            max_keys=max_keys,
            room=self.config.page_size - int(arr("last_page_len").max()),
            generation=self._index.generation,
            forwards={slot: fwd},
        )

    def _decode_fast_path(self, seq_ids, append_lengths) -> bool:
        """Plan a decode step of the previous decode step's batch by updating its arrays in place.

        Applies when the ids are the same in the same order, every append length is 1 and nothing
        changed the cache since (``_version``); sliding-window sequences never get here. Positions and
        slots advance by one; a sequence whose new token opens a page gets one, and only then is
        ``page_indices`` rebuilt. The same validation holds as in the general path: the batch was
        checked at the step this one repeats. Returns False, having changed nothing, when the step is
        not such a step or needs what the general path handles (too few free pages: it raises
        OutOfPagesError; a bigger index buffer).
        """
        S, ib = self._steady, self._index
        if self._version != S.version or S.host is not ib.host:
            return False
        if list(seq_ids) != S.seq_ids or list(append_lengths) != S.ones:
            return False
        seqs, P = S.seqs, self.config.page_size
        lpl = S.last_page_len  # the new token of a sequence whose last page is full opens a page
        opens = np.flatnonzero(lpl == P) if S.room == 0 else ()
        if len(opens):
            if len(opens) > len(self._free) or S.pi_off + S.nnz + len(opens) > ib.capacity:
                return False
            new = self._alloc(len(opens))
            for i, page in zip(opens.tolist(), new):
                seqs[i].pages.append(page)
                seqs[i].mirror.extend((page,))
            S.npages[opens] += 1
            S.nnz += len(opens)
            np.cumsum(S.npages, out=S.page_indptr[1:])
            np.concatenate(list(map(_MIRROR_VIEW, seqs)), out=S.host[S.pi_off : S.pi_off + S.nnz])
        # every token is one slot and one position further than its sequence's previous one, and
        # every last page one slot fuller: q_pos, slots, last_page_len (+ unread padding) += 1
        S.advance += 1
        if len(opens):
            lpl[opens] = 1
            S.slots[opens] = np.asarray(new, np.int32) * P
            S.room = P - int(lpl.max())
        else:
            S.room -= 1
        for seq in seqs:
            seq.kv_len += 1
        S.max_keys += 1
        split = self._decode_split(len(seqs), S.max_keys)
        used = S.pi_off + S.nnz
        slot = ib.next_slot(used)
        ib.upload(slot, used)
        if ib.generation != S.generation:  # the views cached forwards hold were dropped
            S.forwards.clear()
            S.generation = ib.generation
        fwd = S.forwards.get(slot)
        if fwd is None or fwd.decode_split != split:  # first use of the slot, or the split changed
            dev = self._device_views(slot, S.layout, S.pi_off)
            scratch = self._scratch(len(seqs))
            fwd = self._bind(
                S.seq_ids, S.ones, len(seqs), "paged_decode", [], dev=dev, scratch=scratch, decode_split=split
            )
            S.forwards[slot] = fwd
        self._fwd = fwd
        S.version = self._version
        return True

    def _scratch(self, total: int) -> dict:
        """Views ``[total, ...]`` of the q/k/v/lse scratch buffers allocated once for
        ``prefill_chunk_size`` rows (kernels on one stream run in order, so forwards may share them)."""
        views = self._scratch_views.get(total)
        if views is None:
            if len(self._scratch_views) > 256:
                self._scratch_views.clear()
            views = self._scratch_views[total] = {
                name: buf._create_view((total, *buf.shape[1:])) for name, buf in self._scratch_bufs.items()
            }
        return views

    def _decode_split(self, batch: int, max_keys: int) -> DecodeSplit:
        """How a decode step of ``batch`` sequences, the longest of ``max_keys`` keys, is cut."""
        if self._split_granule is None:
            return NO_SPLIT
        blocks, tile = self._split_granule
        return plan_split(
            batch,
            max_keys,
            blocks_per_seq=blocks,
            tile_keys=tile,
            num_sms=self._num_sms,
            max_splits=self.config.decode_splits,
        )

    def _split_parts(self, split: DecodeSplit, batch: int) -> tuple:
        """``(o_part [S, B, H_qo, D], lse_part [S, B, H_qo])`` float32 views of buffers allocated on
        first use and grown when a split needs more rows (forwards bound before keep their views)."""
        import tvm

        cfg = self.config
        rows = split.num_splits * batch
        if self._part_bufs is None or self._part_bufs[1].shape[0] < rows:
            rows_cap = max(rows, 2 * self._part_bufs[1].shape[0] if self._part_bufs else 0)
            self._part_bufs = (
                tvm.runtime.empty((rows_cap, cfg.num_qo_heads, cfg.head_dim), "float32", self.device),
                tvm.runtime.empty((rows_cap, cfg.num_qo_heads), "float32", self.device),
            )
        o_buf, lse_buf = self._part_bufs
        return (
            o_buf._create_view((split.num_splits, batch, cfg.num_qo_heads, cfg.head_dim)),
            lse_buf._create_view((split.num_splits, batch, cfg.num_qo_heads)),
        )

    def _bind(self, seq_ids, lengths, total, kernel, slides, *, dev, scratch, decode_split=NO_SPLIT) -> _Forward:
        """The :class:`_Forward` with each layer's kernel arguments bound (all but pages/qkv/o/sm_scale)."""
        cfg, d, s = self.config, dev, scratch
        rope = (cfg.rope_scale, cfg.rope_theta)
        fwd = _Forward(
            seq_ids=seq_ids,
            lengths=lengths,
            total=total,
            kernel=kernel,
            slides=slides,
            dev=dev,
            scratch=scratch,
            split=(d["q_pos"], s["q"], s["k"], s["v"], *rope),
            append=(s["k"], s["v"], d["slots"]),
            attn_end=(s["lse"], *rope),
            kernels=(self._kernels["split_rope"], self._kernels["append"], self._kernels[kernel]),
            qkv_shape=(total, cfg.qkv_heads, cfg.head_dim),
            o_shape=(total, cfg.num_qo_heads, cfg.head_dim),
        )
        if kernel == "paged_decode":
            fwd.attn_head = (s["q"], d["q_pos"])
            fwd.attn_tail = (d["page_indptr"], d["page_indices"], d["last_page_len"], d["kv_window"])
            if decode_split.num_splits > 1:
                fwd.decode_split = decode_split
                fwd.kernels = (*fwd.kernels[:2], self._kernels["paged_decode_split"])
                fwd.merge = self._kernels["merge_splits"]
                fwd.parts = self._split_parts(decode_split, total)
        elif kernel == "ragged_prefill_causal":
            fwd.paged = False
            fwd.attn_head = (s["q"], s["k"], s["v"], d["q_indptr"], d["q_pos"], d["q_tree"])
        else:
            fwd.attn_head = (s["q"], d["q_indptr"], d["q_pos"])
            fwd.attn_tail = (
                d["page_indptr"],
                d["page_indices"],
                d["last_page_len"],
                d["kv_window"],
                d["q_tree"],
                d["kv_tree_indptr"],
                d["kv_tree"],
                d["kv_tree_start"],
            )
        return fwd

    def _tvm_ok(self, x, shape: tuple) -> bool:
        """True when ``x`` is a contiguous tvm tensor of ``shape``, the cache's dtype and device, which
        the kernels take as is; everything else goes through :meth:`_check_array`, whose errors name
        what is wrong."""
        return (
            type(x) is self._tvm_tensor
            and x.is_contiguous()
            and x.shape == shape
            and x.device.dlpack_device_type() == self._dl_device_type
            and x.dtype == self.config.dtype
        )

    def _check_array(self, x, name: str, shape: tuple) -> str:
        kind = tensors.array_kind(x)
        got_shape, got_dtype, got_dev = tensors.describe(x, kind)
        if got_shape != shape:
            raise ValueError(f"{name} has shape {got_shape}; expected {shape} for this forward")
        if got_dtype != self.config.dtype:
            raise ValueError(f"{name} has dtype {got_dtype}; the cache holds {self.config.dtype}: cast it first")
        want_dev = "cpu" if self.config.target_kind == "llvm" else "cuda"
        if kind != "numpy" and got_dev != want_dev:
            raise ValueError(f"{name} is on {got_dev} but the cache's kernels run on {want_dev}; move it there")
        if not tensors.is_contiguous(x, kind):
            raise ValueError(f"{name} is not contiguous; pass a contiguous array (e.g. .contiguous())")
        return kind

    def _output_buffer(self, out, kind: str, total: int):
        import tvm

        cfg = self.config
        if out is not None and kind == "tvm":
            return out
        if out is not None and kind == "torch":
            try:
                return tvm.runtime.from_dlpack(out)
            except RuntimeError:
                pass  # unaligned: compute into a fresh buffer, copy back
        return tvm.runtime.empty((total, cfg.num_qo_heads, cfg.head_dim), cfg.dtype, self.device)

    def _run_layer(self, layer: int, qkv, o, sm_scale: float) -> None:
        """Launch one layer's kernels with the arguments :meth:`_bind` prepared (O(1) Python work)."""
        fwd = self._fwd
        split_rope, append, attention = fwd.kernels
        pages = self.pages[layer]
        split_rope(qkv, *fwd.split)
        append(pages, *fwd.append)
        lse, rope_scale, rope_theta = fwd.attn_end
        if fwd.merge is not None:  # split decode: a partial state per chunk, then their merge
            o_part, lse_part = fwd.parts
            attention(
                *fwd.attn_head,
                pages,
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
            attention(*fwd.attn_head, pages, *fwd.attn_tail, o, lse, sm_scale, rope_scale, rope_theta)
        else:
            attention(*fwd.attn_head, o, lse, sm_scale, rope_scale, rope_theta)


def _parse_target(target):
    """("llvm", None) or ("cuda", arch or None) from a string or a tvm.target.Target."""
    if isinstance(target, str):
        if target in ("llvm", "cpu"):
            return "llvm", None
        if target == "cuda":
            return "cuda", None
        raise ValueError(f"target={target!r} is not supported; use 'llvm', 'cuda' or a tvm.target.Target")
    kind = getattr(getattr(target, "kind", None), "name", None)
    if kind == "llvm":
        return "llvm", None
    if kind == "cuda":
        arch = target.attrs.get("arch") if hasattr(target, "attrs") else None
        return "cuda", str(arch) if arch else None
    raise ValueError(f"target={target!r} is not supported; use 'llvm', 'cuda' or a tvm.target.Target")
