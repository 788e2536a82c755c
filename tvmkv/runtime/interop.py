"""Interop: tvmkv's pages seen through other engines' KV interfaces and layouts.

Three kinds of operations over a :class:`~tvmkv.PagedAttentionKVCache` (layouts: docs/layout.md,
"Foreign layouts"):

- **Raw page-pool access by caller-managed indices** (no sequence bookkeeping involved):
  :func:`gather_kv` (Ascend's GatherPaKvCache: block tables + sequence lengths -> contiguous K/V) and
  :func:`store_kv` (nano-vllm's slot-mapping store: ``slot = page * page_size + offset``, negative
  skips). Helpers :func:`block_tables` and :func:`slot_mapping` read those indices off the cache's
  own sequences.
- **Export / import of a whole sequence** (every layer) to and from KsanaLLM's per-block layout,
  FlashInfer's paged NHD and HND layouts and a contiguous per-sequence layout: one kernel launch per
  layer (``tvmkv.tir.interop``). Imports allocate pages through the cache (ref counts, free list).
- **Zero-copy views** where the layouts agree: :func:`paged_view` hands out a layer's page pool as
  FlashInfer's HND paged KV cache (our layout per layer *is* HND), and :func:`ksana_atb_views` /
  :func:`atb_block_ids` give Ascend ATB's K and V caches over one KsanaLLM block pool (seed 000).

The copy kernels are not part of the cache's kernel set: they are compiled on first use (family
"interop", ``build/<target>/interop_<tag>.so``) and cached like the cache's own kernels.

Every function validates its arguments before touching anything and raises ``KeyError`` /
``ValueError`` / ``TypeError`` (or :class:`~tvmkv.OutOfPagesError`) naming the value and the fix;
a failed call leaves the cache unchanged. Only the cache's public API is used: ``sequence_info`` /
``sequence_pages`` to read sequences, ``cache.pool`` to allocate, hold and release pages and read
ref counts, ``add_sequence_with_pages`` to hand imported pages to a sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import OutOfPagesError
from ..tir import LAYOUTS
from ..tir import foreign_shape as _foreign_shape
from . import tensors
from .checkpoint import check_new_id, pending_imports
from .sequences import as_int, check_id

ARRAY_KINDS = ("numpy", "torch", "tvm")

__all__ = [
    "LAYOUTS",
    "AtbViews",
    "PageTable",
    "PagedView",
    "atb_block_ids",
    "block_tables",
    "export_sequence",
    "foreign_shape",
    "gather_kv",
    "import_sequence",
    "interop_kernels",
    "ksana_atb_views",
    "paged_view",
    "slot_mapping",
    "store_kv",
]


class PageTable(NamedTuple):
    """Padded block tables of some sequences (GatherPaKvCache / vLLM style)."""

    block_tables: np.ndarray  # [B, max_pages] int32, row b = pages of sequence b in token order, -1 padded
    seq_lens: np.ndarray  # [B] int32, slots used by sequence b (docs/layout.md, kv_len)


class PagedView(NamedTuple):
    """A FlashInfer paged KV cache over one layer of tvmkv's pool, without copying.

    ``data`` is the layer's page pool itself (``tvm.runtime.Tensor``; ``torch.from_dlpack(data)``
    shares it too), ``[num_pages, 2, H_kv, P, D]`` = FlashInfer's ``kv_layout="HND"`` single-tensor
    form; ``indptr [B + 1]``, ``indices [nnz]``, ``last_page_len [B]`` (int32) are the CSR page tables
    of docs/layout.md, which are FlashInfer's ``paged_kv_indptr`` / ``_indices`` / ``_last_page_len``.
    """

    data: object
    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray
    kv_layout: str = "HND"


class AtbViews(NamedTuple):
    """Ascend ATB's K and V caches over one KsanaLLM block pool (views, no copy)."""

    k_cache: object  # [NB * 2 * L, P, H_kv, D]
    v_cache: object  # [NB * 2 * L - L, P, H_kv, D], starts L blocks (one K half of a block) later


# ---------------------------------------------------------------------------------------------- helpers


_int = as_int  # ints, not bools, with the argument named in the error


def _mha(cache) -> None:
    """The foreign layouts are MHA layouts of 16/32-bit values: refuse an MLA cache (docs/layout.md, "MLA
    pages") and fp8 pages ("fp8 pages": codes under per-head scales, not yet converted)."""
    if cache.config.is_mla:
        raise NotImplementedError(
            "the interop layouts (vLLM/FlashInfer/TVM/ATB K and V pages) are MHA layouts; this is an MLA cache"
        )
    if cache.config.fp8_pages:
        raise NotImplementedError(
            f"the interop layouts hold {cache.config.dtype} K/V; this cache's pages are {cache.config.page_dtype} "
            "codes under per-head scales: read them with debug_get_kv (dequantized) instead"
        )


def _layer(cache, layer) -> int:
    """The index into ``cache.pages`` of the model's layer id ``layer``: the per-layer calls take the
    ids the attention calls take (``config.layer_ids``: a pipeline stage's cache holds ``[first_layer,
    first_layer + num_layers)``)."""
    _mha(cache)
    return cache.config.layer_index(_int(layer, "layer"), "layer")


def _host_ints(x, name: str, ndim: int) -> np.ndarray:
    """An index array (list, NumPy, torch or tvm) as host int64, with its integer dtype checked."""
    if isinstance(x, (list, tuple)):
        arr = np.asarray(x)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    else:
        kind = tensors.array_kind(x)
        arr = x if kind == "numpy" else (x.numpy() if kind == "tvm" else x.detach().cpu().numpy())
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} has dtype {arr.dtype}; pass an integer (int32/int64) array")
    if arr.ndim != ndim:
        raise ValueError(f"{name} has shape {arr.shape}; expected a {ndim}-d array")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(arr > np.iinfo(np.int64).max))  # (int64 would wrap it negative: a skipped token)
        raise ValueError(f"{name}[{i}] = {int(arr.flat[i])} is out of range; entries must fit int64")
    return arr.astype(np.int64)


def _check_data(cache, x, name: str, shape=None, ndim=None) -> str:
    """Kind of a K/V data array after checking shape (or ndim), dtype, device and contiguity."""
    cfg = cache.config
    kind = tensors.array_kind(x)
    got_shape, got_dtype, got_dev = tensors.describe(x, kind)
    if shape is not None and got_shape != tuple(shape):
        raise ValueError(f"{name} has shape {got_shape}; expected {tuple(shape)}")
    if ndim is not None and len(got_shape) != ndim:
        raise ValueError(f"{name} has shape {got_shape}; expected a {ndim}-d array")
    if got_dtype != cfg.dtype:
        raise ValueError(f"{name} has dtype {got_dtype}; the cache holds {cfg.dtype}: cast it first")
    want_dev = tensors.device_name(cache.device)
    if kind != "numpy" and got_dev != want_dev:
        raise ValueError(f"{name} is on {got_dev} but the cache's pages are on {want_dev}; move it there")
    if not tensors.is_contiguous(x, kind):
        raise ValueError(f"{name} is not contiguous; pass a contiguous array (e.g. np.ascontiguousarray)")
    return kind


def _dev_ints(cache, arr: np.ndarray):
    import tvm

    return tvm.runtime.tensor(np.ascontiguousarray(arr, np.int32), cache.device)


def _empty(cache, shape):
    import tvm

    return tvm.runtime.empty(tuple(int(s) for s in shape), cache.config.dtype, cache.device)


def interop_kernels(cache):
    """The interop kernel family for ``cache``'s configuration (compiled on first use, then cached)."""
    from ..build import load_kernels

    _mha(cache)
    lib = cache.kernels
    key = lib.key
    build_dir = lib.path.parent.parent if getattr(lib, "path", None) is not None else None
    return load_kernels(key.spec, arch=key.arch, build_dir=build_dir, family="interop")


def _resident(cache, seq_id):
    """:meth:`~tvmkv.PagedAttentionKVCache.sequence_info` of a sequence on the device (KeyError for an
    unknown id, SequenceSwappedError for a swapped one)."""
    cache.sequence_pages(seq_id)
    return cache.sequence_info(seq_id)


def _plain_sequence(cache, seq_id, what: str):
    """The sequence, checked to hold plain tokens ``[0, length)`` in slots ``[0, kv_len)``."""
    seq = _resident(cache, seq_id)
    if seq.num_tree_nodes:
        raise ValueError(
            f"sequence {seq_id} has {seq.num_tree_nodes} uncommitted token-tree nodes; "
            f"commit them (commit_accepted_token_tree_nodes) before {what}"
        )
    if seq.slid:
        raise ValueError(
            f"sequence {seq_id} has slid its sliding window (tokens were dropped, slots are no longer "
            f"positions); {what} supports sequences whose slots are their tokens [0, length) only"
        )
    return seq


def foreign_shape(cache, layout: str, num_blocks: int) -> tuple:
    """Shape of a foreign array for ``cache`` (all layers): ``num_blocks`` blocks of a paged
    ``layout``, or ``num_blocks`` tokens of the "contiguous" layout (docs/layout.md)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    num_blocks = _int(num_blocks, "num_blocks")
    if num_blocks < 0:
        unit = "tokens" if layout == "contiguous" else "blocks"
        raise ValueError(f"num_blocks={num_blocks} must be >= 0 (the number of {unit} of the foreign array)")
    return _foreign_shape(layout, num_blocks, cache.config.num_layers, cache.config.kernel_spec)


# ---------------------------------------------------------------------------------------------- page tables


def block_tables(cache, seq_ids) -> PageTable:
    """The page tables of ``seq_ids`` as padded block tables (the input of :func:`gather_kv`).

    Returns
    -------
    PageTable
        ``block_tables [B, max_pages]`` int32 (row ``b``: pages of ``seq_ids[b]`` in token order,
        padded with -1) and ``seq_lens [B]`` int32 (slots used, ``kv_len`` of docs/layout.md).
    """
    seqs = [_resident(cache, s) for s in seq_ids]
    width = max([len(s.pages) for s in seqs], default=0)
    table = np.full((len(seqs), width), -1, np.int32)
    for b, seq in enumerate(seqs):
        table[b, : len(seq.pages)] = seq.pages
    return PageTable(table, np.array([s.kv_len for s in seqs], np.int32))


def slot_mapping(cache, seq_id, start: int = 0, end: int | None = None) -> np.ndarray:
    """Slots (``page * page_size + offset``) of slot indices ``[start, end)`` of ``seq_id``, int32.

    For a sequence without a slid window or token tree, slot index ``j`` holds token ``j``.
    ``end`` defaults to the sequence's ``kv_len``; it may not go past its pages' capacity.
    """
    seq = _resident(cache, seq_id)
    P = cache.config.page_size
    cap = len(seq.pages) * P
    end = seq.kv_len if end is None else _int(end, "end")
    start = _int(start, "start")
    if not 0 <= start <= end <= cap:
        raise ValueError(
            f"slot range [{start}, {end}) is outside sequence {seq_id}'s pages, which hold slots [0, {cap}) "
            f"({seq.kv_len} used); pass 0 <= start <= end <= {cap}"
        )
    j = np.arange(start, end)
    pages = np.asarray(seq.pages, np.int64)
    return (pages[j // P] * P + j % P).astype(np.int32) if len(j) else np.zeros(0, np.int32)


# ---------------------------------------------------------------------------------------------- gather / store


def gather_kv(cache, layer, block_tables, seq_lens, *, seq_offset=None, is_seq_lens_cumsum=False, out=None):
    """Copy the K/V of ``B`` sequences given by block tables into contiguous arrays (GatherPaKvCache).

    Token ``j`` of row ``b`` sits at page ``block_tables[b, seq_offset[b] // P + j // P]``, offset
    ``j % P`` of layer ``layer``'s pool; rows are concatenated in order. Entries of ``block_tables``
    that no token reaches (padding) are not read and may hold anything.

    Parameters
    ----------
    cache : PagedAttentionKVCache
    layer : int
        The model's layer id, as the attention calls take it: in ``config.layer_ids`` (``[0,
        num_layers)`` unless the cache is a pipeline stage's, ``[first_layer, first_layer + num_layers)``).
    block_tables : [B, C] int32/int64 (list, NumPy, torch or tvm)
        Page ids; every entry a token reaches must be in ``[0, num_pages)``.
    seq_lens : [B] (or [B + 1] when ``is_seq_lens_cumsum``) int
        Tokens per row, or their running sum starting at 0.
    seq_offset : [B] int, optional
        Token offset of each row's first page: its block table is read from column
        ``seq_offset[b] // P`` on (the remainder is ignored, as in GatherPaKvCache).
    is_seq_lens_cumsum : bool
        ``seq_lens`` holds ``[0, l0, l0 + l1, ...]``.
    out : (k_out, v_out), optional
        ``[N, H_kv, D]`` arrays of the cache dtype, **written in place**; ``N = sum(lens)``.

    Returns
    -------
    (k, v) : ``[N, H_kv, D]`` each, the kind of ``block_tables`` (NumPy for a list), or ``out``.
    """
    cfg = cache.config
    layer = _layer(cache, layer)
    P, num_pages = cfg.page_size, cfg.total_pages
    table = _host_ints(block_tables, "block_tables", 2)
    raw = _host_ints(seq_lens, "seq_lens", 1)
    B, C = table.shape
    if is_seq_lens_cumsum:
        if raw.shape != (B + 1,):
            raise ValueError(
                f"seq_lens has shape {raw.shape}; with is_seq_lens_cumsum=True it holds B + 1 = {B + 1} running "
                "sums starting at 0"
            )
        if raw[0] != 0 or (np.diff(raw) < 0).any():
            raise ValueError(f"seq_lens {raw.tolist()} must start at 0 and not decrease (is_seq_lens_cumsum=True)")
        lens = np.diff(raw)
    else:
        if raw.shape != (B,):
            raise ValueError(f"seq_lens has shape {raw.shape}; expected ({B},), one length per block_tables row")
        if (raw < 0).any():
            b = int(np.flatnonzero(raw < 0)[0])
            raise ValueError(f"seq_lens[{b}] = {raw[b]} is negative; lengths must be >= 0")
        lens = raw
    if seq_offset is None:
        first = np.zeros(B, np.int64)
    else:
        off = _host_ints(seq_offset, "seq_offset", 1)
        if off.shape != (B,):
            raise ValueError(f"seq_offset has shape {off.shape}; expected ({B},), one offset per block_tables row")
        if (off < 0).any():
            b = int(np.flatnonzero(off < 0)[0])
            raise ValueError(f"seq_offset[{b}] = {off[b]} is negative; offsets must be >= 0")
        first = off // P
    N = int(lens.sum())
    rows = np.repeat(np.arange(B), lens)
    j = np.arange(N) - np.repeat(np.cumsum(lens) - lens, lens)
    cols = first[rows] + j // P
    if N and cols.max() >= C:
        e = int(np.argmax(cols >= C))
        b = int(rows[e])
        raise ValueError(
            f"row {b} of block_tables (seq_lens {int(lens[b])}, first column {int(first[b])}) needs column "
            f"{int(cols[rows == b].max())} but block_tables has {C} columns; pass a wider table or shorter seq_lens"
        )
    ids = table[rows, cols] if N else np.zeros(0, np.int64)
    bad = (ids < 0) | (ids >= num_pages)
    if bad.any():
        e = int(np.argmax(bad))
        raise ValueError(
            f"block_tables[{int(rows[e])}, {int(cols[e])}] = {int(ids[e])} is out of range: the pool has pages "
            f"[0, {num_pages}); fix the block table (padding is only allowed past each row's last page)"
        )
    shape = (N, cfg.num_kv_heads, cfg.head_dim)
    if out is not None:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError("out must be a pair (k_out, v_out)")
        kinds = {_check_data(cache, o, name, shape) for o, name in zip(out, ("out[0]", "out[1]"))}
        if len(kinds) != 1:
            raise TypeError(f"out holds arrays of different kinds {sorted(kinds)}; pass two of the same kind")
        kind = kinds.pop()
    else:
        kind = "numpy" if isinstance(block_tables, (list, tuple)) else tensors.array_kind(block_tables)
    # ---- validated
    k_dev, v_dev = _empty(cache, shape), _empty(cache, shape)
    if N:
        slots = (ids * P + j % P).astype(np.int32)
        cache.kernels["gather"](cache.pages[layer], _dev_ints(cache, slots), k_dev, v_dev)
    if out is None:
        return tensors.from_device(k_dev, kind), tensors.from_device(v_dev, kind)
    for o, dev in zip(out, (k_dev, v_dev)):
        _copy_back(o, kind, dev)
    return tuple(out)


def _copy_back(out, kind: str, dev) -> None:
    """Write device tensor ``dev`` into the caller's array ``out`` of ``kind``."""
    if kind == "numpy":
        out[...] = dev.numpy()
    elif kind == "torch":
        import torch

        out.copy_(torch.from_dlpack(dev))
    else:
        dev.copyto(out)


def store_kv(cache, layer, k, v, slot_mapping) -> None:
    """Write new K and V of layer ``layer`` at caller-managed slots (nano-vllm's ``store_kvcache``).

    Token ``i`` goes to slot ``s = slot_mapping[i]`` = page ``s // P``, offset ``s % P``; a negative
    slot skips the token. Only page contents change (no sequence length or page table does): use it
    for slots the caller's own bookkeeping owns, e.g. from :func:`slot_mapping`.

    Parameters
    ----------
    cache : PagedAttentionKVCache
        Its layer's page pool is **written in place**.
    layer : int
        The model's layer id, as for :func:`gather_kv`.
    k, v : [n, H_kv, D], the cache dtype (NumPy, torch or tvm on the cache's device)
    slot_mapping : [n] int
        Slots in ``[0, num_pages * P)`` or negative. Each non-negative slot at most once, in a page
        of a resident sequence's page table that nothing else holds (ref count 1, so a shared page is
        never changed behind a fork's back, nor a prefix the prefix cache alone keeps, nor the pages a
        pending import reserved).
    """
    cfg = cache.config
    layer = _layer(cache, layer)
    P, num_pages = cfg.page_size, cfg.total_pages
    slots = _host_ints(slot_mapping, "slot_mapping", 1)
    n = len(slots)
    shape = (n, cfg.num_kv_heads, cfg.head_dim)
    kind_k = _check_data(cache, k, "k", shape)
    kind_v = _check_data(cache, v, "v", shape)
    live = slots[slots >= 0]
    if (live >= num_pages * P).any():
        i = int(np.argmax(slots >= num_pages * P))
        raise ValueError(
            f"slot_mapping[{i}] = {int(slots[i])} is out of range: the pool has slots [0, {num_pages * P}) "
            f"({num_pages} pages of {P}); use page * {P} + offset, or -1 to skip the token"
        )
    uniq, counts = np.unique(live, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"slot {int(uniq[np.argmax(counts > 1)])} appears {int(counts.max())} times in slot_mapping; "
            "each slot may be written once per call"
        )
    ref = cache.pool.ref_counts()
    refs = ref[live // P] if len(live) else np.zeros(0, np.int32)
    if (refs != 1).any():
        s = int(live[np.argmax(refs != 1)])
        r = int(ref[s // P])
        why = (
            "no sequence holds it (a free page); allocate pages through the cache (begin_forward, import_sequence)"
            if r == 0
            else f"{r} page tables share it (fork / prefix sharing); writing would change all of them"
        )
        raise ValueError(f"slot {s} is in page {s // P}, but {why}")
    # ref count 1 is not enough where the prefix cache or a pending import may be that one holder
    if len(live) and (cache.pool.holders or pending_imports(cache)):
        touched = np.unique(live // P)
        held = [cache.sequence_pages(sid) for sid in cache.sequence_ids()]
        outside = touched[~np.isin(touched, np.concatenate(held))] if held else touched
        if len(outside):
            page = int(outside[0])
            s = int(live[np.argmax(live // P == page)])
            raise ValueError(
                f"slot {s} is in page {page}, which no sequence holds (the prefix cache or a pending import "
                "does); write only into pages of your sequences (slot_mapping, begin_forward)"
            )
    # ---- validated
    if not len(live):
        return
    k_dev = tensors.to_device(k, kind_k, cache.device)
    v_dev = tensors.to_device(v, kind_v, cache.device)
    cache.kernels["append"](cache.pages[layer], k_dev, v_dev, _dev_ints(cache, slots))


# ---------------------------------------------------------------------------------------------- export / import


def _block_ids(block_ids, m: int, num_blocks: int, *, distinct: bool) -> np.ndarray:
    if block_ids is None:
        if m > num_blocks:
            raise ValueError(
                f"the sequence needs {m} blocks but the foreign array holds {num_blocks}; pass a larger array"
            )
        return np.arange(m, dtype=np.int64)
    ids = _host_ints(block_ids, "block_ids", 1)
    if ids.shape != (m,):
        raise ValueError(f"block_ids has {len(ids)} entries; the sequence has {m} pages, pass one block id per page")
    bad = (ids < 0) | (ids >= num_blocks)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"block_ids[{i}] = {int(ids[i])} is out of range [0, {num_blocks}) of the foreign array")
    if distinct and len(np.unique(ids)) != m:
        raise ValueError(f"block_ids {ids.tolist()} repeat a block; each page needs its own foreign block")
    return ids


def _num_blocks(cache, x, layout: str, name: str) -> int:
    """The block (or token) count of a foreign array of ``layout``, after checking the other dims."""
    _check_data(cache, x, name)
    shape = tensors.describe(x, tensors.array_kind(x))[0]
    cfg = cache.config
    probe = _foreign_shape(layout, -1, -2, cfg.kernel_spec)  # -1 marks the block axis, -2 the layer axis
    nb = shape[probe.index(-1)] if len(shape) == len(probe) else -1
    want = tuple(nb if p == -1 else cfg.num_layers if p == -2 else p for p in probe)
    if shape != want:
        want = tuple("num_blocks" if w == -1 else w for w in want)
        raise ValueError(
            f"{name} has shape {shape}; the {layout!r} layout of this cache is {_describe_layout(layout)} = {want}"
        )
    return nb


def _describe_layout(layout: str) -> str:
    return {
        "ksana": "[num_blocks, 2, num_layers, P, H_kv, D]",
        "nhd": "[num_layers, num_blocks, 2, P, H_kv, D]",
        "hnd": "[num_layers, num_blocks, 2, H_kv, P, D]",
        "contiguous": "[num_layers, 2, num_tokens, H_kv, D]",
    }[layout]


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")


def export_sequence(cache, seq_id, layout: str, *, out=None, block_ids=None, kind: str = "numpy"):
    """Copy every layer of ``seq_id``'s K/V into a foreign ``layout`` (one kernel launch per layer).

    Parameters
    ----------
    cache : PagedAttentionKVCache
        No forward may be open.
    seq_id : int
        A sequence without a slid window or uncommitted token tree; its ``n`` tokens fill ``m =
        ceil(n / P)`` pages.
    layout : str
        "ksana" ``[NB, 2, L, P, H_kv, D]``, "nhd" ``[L, NB, 2, P, H_kv, D]``, "hnd"
        ``[L, NB, 2, H_kv, P, D]`` (whole pages; slots past ``n`` in the last one are whatever the
        page holds) or "contiguous" ``[L, 2, n, H_kv, D]`` (docs/layout.md, "Foreign layouts").
    out : array, optional
        Destination (NumPy, torch or tvm, the cache dtype), **written in place**: for a paged layout
        only the blocks ``block_ids`` (so a KsanaLLM / FlashInfer pool of ``NB`` blocks can receive a
        sequence among others); for "contiguous" exactly ``[L, 2, n, H_kv, D]``.
    block_ids : [m] int, optional
        Destination block of each page (distinct, in ``[0, NB)``); default ``0..m-1``. Paged
        layouts only.
    kind : str
        Kind of the new array when ``out`` is None: "numpy", "torch" or "tvm" (on the cache's device).

    Returns
    -------
    ``out``, or a new array of ``m`` blocks (``n`` tokens for "contiguous").
    """
    cfg = cache.config
    _check_layout(layout)
    seq = _plain_sequence(cache, seq_id, "export_sequence")
    cache.require_no_forward("export_sequence")
    m, n = len(seq.pages), seq.kv_len
    if out is None:
        if kind not in ARRAY_KINDS:
            raise ValueError(f"kind={kind!r} is not one of {ARRAY_KINDS}")
        if block_ids is not None and layout != "contiguous":
            raise ValueError("block_ids needs out (the foreign array they index); pass out= or drop block_ids")
        nb = n if layout == "contiguous" else m
        out_kind = kind
    else:
        out_kind = tensors.array_kind(out)
        nb = _num_blocks(cache, out, layout, "out")
    if layout == "contiguous":
        if block_ids is not None:
            raise ValueError("block_ids applies to paged layouts only; the contiguous layout is indexed by token")
        if nb != n:
            raise ValueError(
                f"out holds {nb} tokens but sequence {seq_id} has {n}; pass out of shape [L, 2, {n}, H, D]"
            )
    else:
        blocks = _block_ids(block_ids, m, nb, distinct=True)
    # ---- validated
    shape = foreign_shape(cache, layout, nb)
    if out is None or out_kind == "numpy":
        dst = _empty(cache, shape) if out is None else tensors.to_device(out, "numpy", cache.device)
    else:
        dst = tensors.to_device(out, out_kind, cache.device)
    if m:
        kern = interop_kernels(cache)[f"export_{layout}"]
        page_ids = _dev_ints(cache, np.asarray(seq.pages))
        extra = () if layout == "contiguous" else (_dev_ints(cache, blocks),)
        for layer in range(cfg.num_layers):
            kern(cache.pages[layer], page_ids, dst, *extra, layer)
    if out is None:
        return tensors.from_device(dst, out_kind)
    if out_kind == "numpy":
        out[...] = dst.numpy()
    elif dst.data_ptr() != out.data_ptr():  # a torch / tvm out the kernels could not write in place (misaligned)
        _copy_back(out, out_kind, dst)
    return out


def import_sequence(cache, seq_id, data, layout: str, *, num_tokens=None, block_ids=None) -> None:
    """Create ``seq_id`` holding the K/V of ``data`` (a foreign ``layout``, every layer).

    Pages are allocated through the cache (free list, ref count 1 each), so the imported sequence
    behaves like any other: forks share its pages, ``remove_sequence`` frees them,
    ``check_integrity`` passes. K is stored as given (rotate it first when rope_mode is "normal").

    Parameters
    ----------
    cache : PagedAttentionKVCache
        No forward may be open.
    seq_id : int
        A new id, or an existing sequence that is still empty (no tokens, no window).
    data : array
        NumPy, torch or tvm of the cache dtype in ``layout`` (see :func:`export_sequence`).
    layout : str
        "ksana", "nhd", "hnd" or "contiguous".
    num_tokens : int
        Tokens to import; required for paged layouts (the fill of the last block), for "contiguous"
        it must be None or ``data.shape[2]``.
    block_ids : [ceil(num_tokens / P)] int, optional
        The sequence's blocks in ``data`` in token order (paged layouts); default ``0..m-1``.

    Raises
    ------
    OutOfPagesError
        Fewer free pages than ``ceil(num_tokens / P)``; nothing was allocated.
    """
    cfg = cache.config
    _check_layout(layout)
    cache.require_no_forward("import_sequence")
    seq_id = check_id(seq_id)
    new = seq_id not in cache.sequence_ids()
    if new:  # not swapped out, not reserved by a pending import (prepare_import / prepare_receive) either
        check_new_id(cache, seq_id, "import_sequence")
    else:
        seq = cache.sequence_info(seq_id)
        if seq.kv_len or seq.pages or seq.window or seq.num_tree_nodes:
            raise ValueError(
                f"sequence {seq_id} already holds {seq.length} tokens (or has a window); import into a new id or "
                "an empty sequence (remove_sequence it first)"
            )
    kind = tensors.array_kind(data)
    nb = _num_blocks(cache, data, layout, "data")
    if layout == "contiguous":
        if block_ids is not None:
            raise ValueError("block_ids applies to paged layouts only; the contiguous layout is indexed by token")
        if num_tokens is not None and _int(num_tokens, "num_tokens") != nb:
            raise ValueError(
                f"num_tokens={num_tokens} but data holds {nb} tokens; the contiguous layout imports all of them "
                "(slice data first)"
            )
        n = nb
    else:
        if num_tokens is None:
            raise ValueError(
                f"num_tokens is required for the paged layout {layout!r} (its last block may be partly filled)"
            )
        n = _int(num_tokens, "num_tokens")
        if n < 0:
            raise ValueError(f"num_tokens={n} must be >= 0")
    P = cfg.page_size
    m = -(-n // P)
    if layout != "contiguous":
        blocks = _block_ids(block_ids, m, nb, distinct=False)
    if not cache.pool.ensure_free(m):  # the prefix cache may evict pages only it holds
        raise OutOfPagesError(m, cache.num_available_pages(), f"import of {n} tokens into sequence {seq_id}")
    kern = interop_kernels(cache)[f"import_{layout}"] if m else None  # compile before allocating anything
    # ---- validated: copy into fresh pages, then hand them to the sequence
    pages = cache.pool.alloc(m)
    done = False
    try:
        if m:
            src = tensors.to_device(data, kind, cache.device)
            page_ids = _dev_ints(cache, np.asarray(pages))
            extra = () if layout == "contiguous" else (_dev_ints(cache, blocks),)
            for layer in range(cfg.num_layers):
                kern(cache.pages[layer], page_ids, src, *extra, layer)  # type: ignore[misc]  # set when m
        if not new:
            cache.remove_sequence(seq_id)  # empty, no window, no tree: re-added below over the pages
        cache.add_sequence_with_pages(seq_id, pages, n)  # one more reference each ...
        done = True
    finally:
        if done:
            cache.pool.release(pages)  # ... replaces the allocation's
        else:
            cache.pool.undo_alloc(pages)  # the free list as it was


# ---------------------------------------------------------------------------------------------- zero-copy views


def paged_view(cache, layer, seq_ids) -> PagedView:
    """Layer ``layer`` of the cache as a FlashInfer paged KV cache in HND layout, without copying.

    Our per-layer pool ``[num_pages, 2, H_kv, P, D]`` is FlashInfer's single-tensor HND form, so the
    view is the pool itself plus the CSR page tables of ``seq_ids`` (docs/layout.md). Writes through
    ``data`` change the cache. NHD and KsanaLLM layouts differ from ours: use :func:`export_sequence`.
    """
    layer = _layer(cache, layer)
    seqs = [_resident(cache, s) for s in seq_ids]
    P = cache.config.page_size
    npages = np.array([len(s.pages) for s in seqs], np.int64)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    indices = np.array([p for s in seqs for p in s.pages], np.int32)
    last = np.array([s.kv_len - (len(s.pages) - 1) * P if s.pages else 0 for s in seqs], np.int32)
    return PagedView(cache.pages[layer], indptr, indices, last)


def atb_block_ids(block_ids, num_layers: int, layer: int) -> np.ndarray:
    """KsanaLLM block ids -> Ascend ATB block ids of one layer (seed 000): ``b * 2 * num_layers + layer``.

    Index both :class:`AtbViews` caches with the result: ``k_cache[atb[i]]`` is block ``b``'s K of
    ``layer``, ``v_cache[atb[i]]`` its V. Returns int64 ``[len(block_ids)]``.
    """
    L = _int(num_layers, "num_layers")
    layer = _int(layer, "layer")
    if L <= 0:
        raise ValueError(f"num_layers={L} must be positive")
    if not 0 <= layer < L:
        raise ValueError(f"layer {layer} is out of range [0, {L})")
    ids = _host_ints(block_ids, "block_ids", 1)
    if (ids < 0).any():
        i = int(np.argmax(ids < 0))
        raise ValueError(f"block_ids[{i}] = {int(ids[i])} is negative; KsanaLLM block ids are >= 0")
    return ids * (2 * L) + layer


def ksana_atb_views(pool) -> AtbViews:
    """Ascend ATB's K and V caches over a KsanaLLM block pool, without copying (seed 000).

    ``pool [NB, 2, L, P, H_kv, D]`` (NumPy or torch, contiguous) is one allocation of ``NB`` blocks;
    ATB sees it as ``NB * 2 * L`` blocks of ``[P, H_kv, D]``. Its K cache starts at the pool's base and
    its V cache ``L`` such blocks later (the size of one block's K half), so that both are indexed by
    :func:`atb_block_ids`. Writes through either view change ``pool``.
    """
    kind = tensors.array_kind(pool)
    if kind == "tvm":
        raise TypeError("ksana_atb_views takes a NumPy array or torch tensor; wrap a tvm tensor with torch.from_dlpack")
    shape = tuple(pool.shape)
    if len(shape) != 6 or shape[1] != 2:
        raise ValueError(f"pool has shape {shape}; a KsanaLLM block pool is [num_blocks, 2, num_layers, P, H_kv, D]")
    if not tensors.is_contiguous(pool, kind):
        raise ValueError("pool is not contiguous; KsanaLLM's block pool is one contiguous allocation")
    NB, _, L, P, H, D = shape
    k_cache = pool.reshape(NB * 2 * L, P, H, D)
    return AtbViews(k_cache, k_cache[L:])
