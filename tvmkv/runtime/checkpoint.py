"""Checkpoints of a sequence's KV pages in TVM's format, and the import reservations they share with
:mod:`tvmkv.runtime.transfer`.

TVM 0.27's ``PagedAttentionKVCache`` exports a sequence page group by page group and imports it in
three steps; this module is the same protocol for a :class:`~tvmkv.PagedAttentionKVCache` (the drop-in
registers it under TVM's six ``vm.builtin.attention_kv_cache_*`` names):

- :func:`checkpoint_metadata` (``get_checkpoint_metadata``): JSON naming the layout (page size, layers,
  heads, head dim, dtype, RoPE mode / scale / theta, attention kinds), :func:`layout_hash`, the
  sequence's length, its logical pages and one *page group* per layer.
- :func:`export_page_group` (``export_page_group``): layer ``group_id`` of the sequence into a tensor
  ``[1, m, 2, H_kv, P, D]`` (``m = ceil(length / P)`` logical pages in token order; each page is
  ``pages[l][page]`` of docs/layout.md, "Pages"). Slots past the length in a partial last page are
  written as **zeros**, so an export is a deterministic function of the tokens.
- :func:`prepare_import` checks the metadata against this cache and reserves ``m`` pages;
  :func:`import_page_group` copies each layer in (whole pages); :func:`finish_import` hands the pages
  to the sequence. :func:`abort_import` (or ``cache.clear()``) drops a pending import and frees its pages.

**Byte compatibility with TVM.** tvmkv's page of one layer, ``[2, H_kv, P, D]``, is TVM's page, and
K is stored as TVM stores it (rotated when rope_mode is "normal", raw otherwise), so the page
groups, the metadata fields and the layout hash (FNV-1a 64 of the same descriptor string,
:func:`layout_descriptor`) are TVM's for the same configuration: a checkpoint exported from TVM's C++
cache imports here and the reverse (tests/test_checkpoint.py does both). Where tvmkv differs:

- TVM checkpoints sequence 0 only, and ``prepare_import`` clears its whole cache; tvmkv exports and
  imports any sequence id, next to the other sequences, into a *new* id (KeyError for one in use).
  The metadata's ``seq_id`` records the exporter's id and is not required to match (TVM's import
  requires 0 in both: export sequence 0 for a TVM cache).
- TVM blocks every forward, ``get_sequence_length`` and export of the whole cache while an import is
  pending; tvmkv blocks only the importing id: until :func:`finish_import` it is not a sequence of
  the cache (``begin_forward`` / ``sequence_length`` on it raise KeyError), its pages are held by an
  :class:`ImportReservations` page holder (``check_integrity`` counts them, nothing evicts them).
- TVM refuses caches built with ``support_sliding_window`` or per-layer windows; the page layout
  does not depend on them, so tvmkv accepts those caches (the flags and ``mha_sliding`` attention
  kinds enter the descriptor, so the hash differs from a cache without them, exactly as TVM's formula
  gives it; TVM itself refuses such checkpoints). Sequences with a window are refused, as in TVM.
- Refused as in TVM: sequences with uncommitted token-tree nodes or a sliding window, MLA caches (a
  different page layout) and caches with RoPE extension factors (longrope).
- fp8 pages (``kv_dtype``; TVM has none): the metadata gains ``kv_dtype`` (also in the descriptor,
  so the hash differs from a 16-bit cache's), each group's ``dtype`` is the page dtype and its
  ``kv_scale`` ``[[K scales], [V scales]]`` the scales its codes were stored under; page groups hold
  the codes. :func:`import_page_group` re-encodes them to the cache's scales (``requantize_pages``:
  one more rounding, saturating; unchanged under equal scales). :func:`import_checkpoint` into a
  cache holding no token first gives it the checkpoint's scales (restored exactly, and a calibration
  ends); step by step, :func:`checkpoint_kv_scales` + ``set_kv_scales`` before ``prepare_import`` do
  the same.
- TVM's descriptor, so the hash, covers neither partial rotary nor llama3 / yarn RoPE scaling (both
  are baked into TVM's kernels, not known to its cache): with rope_mode "normal" the stored K is
  rotated under the exporting model's variant, so import it into a cache of the same model.

Every call validates everything first and leaves the cache unchanged on error (KeyError for ids,
ValueError / TypeError naming the field or tensor with both values, OutOfPagesError, ForwardStateError).
"""

from __future__ import annotations

import json
import weakref
from typing import NamedTuple

import numpy as np

from ..errors import OutOfPagesError
from . import tensors
from .kv_scales import adoptable
from .sequences import as_int, check_id, check_new_id_range

FORMAT_VERSION = 1
CACHE_TYPE = "relax.vm.PagedAttentionKVCache"  # TVM's runtime name, so that TVM's caches accept ours
PAGE_GROUP_LAYOUT = "1,num_logical_pages,2,num_kv_heads,page_size,qk_head_dim"

__all__ = [
    "CACHE_TYPE",
    "FORMAT_VERSION",
    "PAGE_GROUP_LAYOUT",
    "Checkpoint",
    "ImportReservations",
    "PendingImport",
    "abort_import",
    "check_new_id",
    "checkpoint_kv_scales",
    "checkpoint_metadata",
    "copy_pages",
    "export_checkpoint",
    "export_page_group",
    "finish_import",
    "import_checkpoint",
    "import_page_group",
    "layout_descriptor",
    "layout_hash",
    "page_group_shape",
    "pending",
    "pending_imports",
    "plain_sequence",
    "prepare_import",
]


class Checkpoint(NamedTuple):
    """A whole checkpoint in memory: the metadata JSON and one page group per layer."""

    metadata: str
    groups: list  # [num_layers] of [1, m, 2, H_kv, P, D] NumPy arrays of the cache dtype


# ---------------------------------------------------------------------------------------------- reservations


class PendingImport:
    """Pages reserved for ``seq_id`` (``length`` tokens) until the import finishes or is abandoned.

    ``imported[l]`` tells whether layer ``l``'s pages were written. A record is live while its
    :class:`ImportReservations` lists it; finishing or aborting takes it out. ``receive``: reserved by
    :func:`tvmkv.runtime.transfer.prepare_receive` (filled by ``send_sequence``, committed by
    ``Receive.commit``), not by :func:`prepare_import`; the checkpoint calls that fill and finish an
    import refuse it (its pages would be taken without the checkpoint's length and scales checked).
    """

    __slots__ = ("seq_id", "length", "pages", "imported", "scales", "receive")

    def __init__(self, seq_id: int, length: int, pages: list, num_layers: int, *, receive: bool = False):
        self.seq_id = seq_id
        self.length = length
        self.pages = pages
        self.imported = [False] * num_layers
        self.scales = None  # fp8 checkpoints: the [L, 2, H_kv] scales its codes were stored under
        self.receive = receive


class ImportReservations:
    """The pending imports of one cache: a page holder (:class:`tvmkv.runtime.pages.PageHolder`)
    attached to ``cache.pool``, holding one reference on each reserved page.

    It never evicts (a pending import's pages are not a cache to shrink); ``cache.clear()`` drops every
    pending import (``forget_pages``). Obtain it with :meth:`of`; its methods take the cache as an
    argument (holding it would make a reference cycle through ``cache.pool`` and delay freeing the pages).
    """

    def __init__(self):
        self.pending: dict = {}  # seq id -> PendingImport

    @classmethod
    def of(cls, cache, *, create: bool = True):
        """The reservations attached to ``cache`` (attached now when ``create``; else None if none)."""
        for holder in cache.pool.holders:
            if isinstance(holder, cls):
                return holder
        if not create:
            return None
        holder = cls()
        cache.attach_page_holder(holder)
        return holder

    # PageHolder protocol
    def held_pages(self) -> list:
        return [p for rec in self.pending.values() for p in rec.pages]

    def evict_pages(self, count: int) -> int:
        return 0

    def forget_pages(self) -> None:
        self.pending.clear()

    # reservations
    def reserve(self, cache, seq_id: int, length: int, *, receive: bool = False) -> PendingImport:
        """Reserve ``ceil(length / P)`` free pages for ``seq_id`` (checked by :func:`check_new_id`);
        ``receive``: for a transfer (:class:`PendingImport`)."""
        m = -(-length // cache.config.page_size)
        if not cache.pool.ensure_free(m):  # a prefix cache may evict pages only it holds
            raise OutOfPagesError(
                m, cache.num_available_pages(), f"an import of {length} tokens into sequence {seq_id}"
            )
        rec = PendingImport(seq_id, length, cache.pool.alloc(m), cache.config.num_layers, receive=receive)
        self.pending[seq_id] = rec
        cache_ref = weakref.ref(cache)  # no cycle cache -> table -> callback -> cache

        def abandon() -> None:  # cache.remove_sequence(seq_id) while pending
            c = cache_ref()
            if c is not None:
                self.abort(c, rec)

        what = (
            "a transfer into it is in progress (prepare_receive); commit or abort that Receive"
            if receive
            else f"an import into it is in progress; finish_import({seq_id}) or abort_import({seq_id}) it"
        )
        cache.reserve_sequence_id(seq_id, what, abandon)
        return rec

    def finish(self, cache, rec: PendingImport) -> None:
        """Hand ``rec``'s pages to a new sequence (every layer must be imported)."""
        missing = [g for g, done in enumerate(rec.imported) if not done]
        if missing:
            raise ValueError(
                f"the import of sequence {rec.seq_id} is missing page groups {missing}; import every layer "
                "(import_page_group) before finishing"
            )
        cache.require_no_forward("finishing an import")  # (the id itself is reserved while pending)
        cache.release_sequence_id(rec.seq_id)
        cache.add_sequence_with_pages(rec.seq_id, rec.pages, rec.length)  # one more reference each ...
        cache.pool.release(rec.pages)  # ... replaces the reservation's
        del self.pending[rec.seq_id]

    def abort(self, cache, rec: PendingImport) -> None:
        """Free ``rec``'s pages (nothing when it is no longer pending)."""
        if self.pending.get(rec.seq_id) is rec:
            del self.pending[rec.seq_id]
            cache.release_sequence_id(rec.seq_id)
            cache.pool.undo_alloc(rec.pages)  # the free list as the reservation found it


def check_new_id(cache, seq_id, what: str) -> int:
    """``seq_id`` as an int64 that neither the cache nor a pending import uses (KeyError otherwise)."""
    seq_id = check_new_id_range(seq_id)
    _, rec = _pending_record(cache, seq_id)
    if rec is not None and rec.receive:
        raise KeyError(
            f"sequence {seq_id} is already being imported by a transfer (prepare_receive); commit or abort that "
            "Receive first"
        )
    if rec is not None:
        raise KeyError(
            f"sequence {seq_id} is already being imported; finish_import({seq_id}) or abort_import({seq_id}) first"
        )
    if seq_id in cache.sequence_ids() or seq_id in cache.swapped_sequence_ids():
        raise KeyError(
            f"{what} into sequence {seq_id}, which is already in the cache; remove it first or pick a new id"
        )
    return seq_id


def _pending_record(cache, seq_id: int) -> tuple:
    # (reservations or None, the pending import of seq_id or None)
    res = ImportReservations.of(cache, create=False)
    return res, None if res is None else res.pending.get(seq_id)


def pending(cache, seq_id) -> tuple:
    """``(reservations, record)`` of the pending import of ``seq_id`` (KeyError when none is pending)."""
    seq_id = check_id(seq_id)
    res, rec = _pending_record(cache, seq_id)
    if rec is None:
        raise KeyError(f"no import of sequence {seq_id} is pending; prepare it first (prepare_import)")
    return res, rec


def pending_checkpoint(cache, seq_id, what: str) -> tuple:
    """:func:`pending` for the checkpoint calls that fill or finish an import (``what``): a reservation
    of :func:`tvmkv.runtime.transfer.prepare_receive` is refused (ValueError)."""
    res, rec = pending(cache, seq_id)
    if rec.receive:
        raise ValueError(
            f"{what}: sequence {rec.seq_id}'s pending import is a transfer receive (prepare_receive), not a "
            "checkpoint import; fill it with send_sequence and commit it with Receive.commit, or abort it and "
            "prepare_import the checkpoint"
        )
    return res, rec


def pending_imports(cache) -> list:
    """Ids of the sequences whose import is prepared but not finished, oldest first: checkpoint
    imports (:func:`prepare_import`) and transfer receives (``prepare_receive``, finished by
    ``Receive.commit``, which :func:`finish_import` refuses)."""
    res = ImportReservations.of(cache, create=False)
    return [] if res is None else list(res.pending)


# ---------------------------------------------------------------------------------------------- layout


def _attn_kinds(cache) -> list:
    windows = cache.config.layer_windows or (0,) * cache.config.num_layers
    return ["mha_sliding" if w else "mha" for w in windows]


def _check_layout(cache) -> None:
    """The cache stores MHA pages ``[num_pages, 2, H_kv, P, D]`` per layer (MLA caches do not) and has no
    RoPE extension factors (longrope; TVM refuses those caches too)."""
    cfg = cache.config
    if getattr(getattr(cfg, "rope_scaling", None), "long_factor", None) is not None:
        raise ValueError(
            "checkpoints do not support RoPE extension factors (rope_scaling longrope), as in TVM: "
            "move the sequence with tvmkv.runtime.transfer to a cache of the same configuration instead"
        )
    want = (2, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)
    got = tuple(cache.pages[0].shape[1:])
    if got != want:
        raise ValueError(
            f"checkpoints need the MHA page layout [num_pages, {', '.join(map(str, want))}] per layer; this cache's "
            f"pages are [num_pages, {', '.join(map(str, got))}] (MLA caches are not supported, as in TVM)"
        )


def _fp8(cache) -> bool:
    return bool(getattr(cache.config, "fp8_pages", False))


def _layout_fields(cache) -> dict:
    """TVM's layout fields of the metadata, in TVM's order."""
    cfg = cache.config
    return {
        "format_version": FORMAT_VERSION,
        "cache_type": CACHE_TYPE,
        "page_size": cfg.page_size,
        "num_layers": cfg.num_layers,
        "layer_begin": cfg.first_layer,
        "layer_end": cfg.first_layer + cfg.num_layers,
        "num_qo_heads": cfg.num_qo_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "qk_head_dim": cfg.head_dim,
        "v_head_dim": cfg.head_dim,
        "reserved_num_seqs": cfg.max_batch_size,
        "num_total_pages": cfg.total_pages,
        "prefill_chunk_size": cfg.prefill_chunk_size,
        "dtype": cfg.dtype,
        **({"kv_dtype": cfg.kv_dtype} if _fp8(cache) else {}),  # tvmkv's field (TVM has no fp8 pages)
        "attn_kinds": _attn_kinds(cache),
        "rope_mode": cfg.rope_mode,
        "rotary_scale": float(cfg.rope_scale),
        "rotary_theta": float(cfg.rope_theta),
        "has_rope_ext_factors": False,
        "support_sliding_window": bool(cfg.support_sliding_window),
        "support_layer_sliding_window": bool(cfg.layer_windows),
        "page_group_layout": PAGE_GROUP_LAYOUT,
    }


def layout_descriptor(cache) -> str:
    """The string :func:`layout_hash` hashes: ``key=value;`` pairs in TVM's order (doubles as C++'s
    ``%.17g``, bools as 0/1), ending with the attention kind of each layer."""
    _check_layout(cache)
    f = _layout_fields(cache)
    parts = []
    for key in (
        "format_version", "cache_type", "page_size", "num_layers", "layer_begin", "layer_end", "num_qo_heads",
        "num_kv_heads", "qk_head_dim", "v_head_dim", "dtype", "kv_dtype", "rope_mode", "rotary_scale",
        "rotary_theta", "has_rope_ext_factors", "support_sliding_window", "support_layer_sliding_window",
        "page_group_layout",
    ):  # fmt: skip
        if key not in f:  # kv_dtype: fp8 pages only, so other caches keep TVM's descriptor
            continue
        value = f[key]
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, float):
            value = format(value, ".17g")
        parts.append(f"{key}={value};")
    return "".join(parts) + "attn_kinds=" + ",".join(f["attn_kinds"])


def layout_hash(cache) -> str:
    """FNV-1a 64 of :func:`layout_descriptor`, 16 lowercase hex digits (TVM's ``get_layout_hash``)."""
    h = 0xCBF29CE484222325
    for byte in layout_descriptor(cache).encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def page_group_shape(cache, num_pages: int) -> tuple:
    """``(1, num_pages, 2, H_kv, P, D)``: the tensor of one page group (one layer)."""
    cfg = cache.config
    return (1, int(num_pages), 2, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)


# ---------------------------------------------------------------------------------------------- copies


def _runs(src_ids: np.ndarray, dst_ids: np.ndarray):
    """``(src_first, dst_first, count)`` of the maximal runs where both id lists count up by one."""
    if not len(src_ids):
        return []
    breaks = np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(src_ids)]])
    return [(int(src_ids[s]), int(dst_ids[s]), int(e - s)) for s, e in zip(starts, ends)]


def _view(t, first: int, count: int, page_shape: tuple, page_bytes: int):
    """Pages ``[first, first + count)`` of a contiguous tensor whose memory is a run of pages."""
    return t._create_view((count, *page_shape), t.dtype, first * page_bytes)


def copy_pages(cache, src, src_ids, dst, dst_ids) -> None:
    """Copy whole pages ``src[src_ids[i]] -> dst[dst_ids[i]]`` of ``cache``'s page shape (``[2, H_kv, P, D]``;
    an MLA cache's ``[P, D]``, docs/layout.md "MLA pages").

    ``src`` / ``dst`` are contiguous tvm tensors whose memory is a sequence of such pages (a layer's
    pool ``[num_pages, 2, H_kv, P, D]`` or a page group ``[1, m, 2, H_kv, P, D]``), on any devices: each
    run of consecutive ids on both sides is one TVM copy (device to device, or through the host when
    the devices differ). Ids are not checked here.
    """
    cfg = cache.config
    page_shape = cfg.page_shape[1:]
    src_ids = np.asarray(src_ids, np.int64)
    dst_ids = np.asarray(dst_ids, np.int64)
    for s, d, n in _runs(src_ids, dst_ids):
        _view(src, s, n, page_shape, cfg.page_bytes).copyto(_view(dst, d, n, page_shape, cfg.page_bytes))


# ---------------------------------------------------------------------------------------------- checks


def plain_sequence(cache, seq_id):
    """``sequence_info`` of a resident sequence whose slots are its tokens ``[0, length)``: no uncommitted
    token-tree nodes, no sliding window, not being imported (KeyError / ValueError otherwise)."""
    seq_id = check_id(seq_id)
    res = ImportReservations.of(cache, create=False)
    if res is not None and seq_id in res.pending:
        raise KeyError(f"sequence {seq_id} is being imported; finish_import({seq_id}) before exporting it")
    cache.sequence_pages(seq_id)  # KeyError (unknown) / SequenceSwappedError (swapped out)
    seq = cache.sequence_info(seq_id)
    if seq.num_tree_nodes:
        raise ValueError(
            f"sequence {seq_id} has {seq.num_tree_nodes} uncommitted token-tree nodes; commit them "
            "(commit_accepted_token_tree_nodes) first: checkpoints hold committed token chains only"
        )
    if seq.window:
        raise ValueError(
            f"sequence {seq_id} has a sliding window ({seq.window}, sink {seq.sink}); checkpoints and transfers "
            "do not support sequences with a sliding window (as in TVM)"
        )
    return seq


def _group(cache, group_id) -> int:
    group_id = as_int(group_id, "group_id")
    L = cache.config.num_layers
    if not 0 <= group_id < L:
        raise ValueError(f"group_id {group_id} is out of range [0, {L}); the cache has one page group per layer")
    return group_id


def _check_group(cache, x, name: str, num_pages: int, *, writable: bool) -> str:
    """The array kind of ``x`` after checking it is a page group of ``num_pages`` pages for ``cache``:
    shape, dtype, device, contiguity (ValueError naming ``name`` otherwise); copies nothing."""
    cfg = cache.config
    kind = tensors.array_kind(x)
    shape, dtype, dev = tensors.describe(x, kind)
    want = page_group_shape(cache, num_pages)
    if shape != want:
        raise ValueError(
            f"{name} has shape {shape}; a page group of this sequence is (1, num_logical_pages, 2, num_kv_heads, "
            f"page_size, head_dim) = {want}"
        )
    if dtype != cfg.page_dtype:
        raise ValueError(
            f"{name} has dtype {dtype}; the cache's pages hold {cfg.page_dtype}: pass a {cfg.page_dtype} tensor"
        )
    cache_dev = tensors.device_name(cache.device)
    if dev not in ("cpu", cache_dev):
        raise ValueError(f"{name} is on {dev}; pass it on the cache's device ({cache_dev}) or the CPU")
    if not tensors.is_contiguous(x, kind):
        raise ValueError(f"{name} is not contiguous; pass a contiguous tensor")
    if kind == "numpy" and writable and not x.flags.writeable:
        raise ValueError(f"{name} is a read-only NumPy array; pass a writeable one")
    return kind


def _group_tensor(cache, x, name: str, num_pages: int, *, writable: bool):
    """``(tvm tensor, kind)`` over ``x`` after :func:`_check_group`; NumPy and unaligned torch arrays
    and misaligned torch / tvm arrays get a host / device copy (written back by :func:`_write_back`)."""
    import tvm

    cfg = cache.config
    kind = _check_group(cache, x, name, num_pages, writable=writable)
    shape = page_group_shape(cache, num_pages)
    if kind == "tvm":  # (a misaligned one is copied: the kernels need 64-byte aligned data)
        return tensors.to_device(x, kind, cache.device), kind
    if kind == "numpy":  # a host copy (the destination of an export needs none of x's values)
        if writable:
            return tvm.runtime.empty(shape, cfg.page_dtype, tvm.cpu(0)), kind
        return tvm.runtime.tensor(x, tvm.cpu(0)), kind
    try:
        return tvm.runtime.from_dlpack(x), kind  # shares the torch tensor's memory
    except RuntimeError:  # unaligned: a copy (written back for exports)
        return tvm.runtime.from_dlpack(x.clone()), kind


def _write_back(x, kind: str, t) -> None:
    if kind == "numpy":
        x[...] = t.numpy()
    elif kind == "torch" and t.data_ptr() != x.data_ptr():
        import torch

        x.copy_(torch.from_dlpack(t))
    elif kind == "tvm" and t.data_ptr() != x.data_ptr():
        x.copyfrom(t)


# ---------------------------------------------------------------------------------------------- export


def checkpoint_metadata(cache, seq_id) -> str:
    """TVM's checkpoint metadata JSON of ``seq_id`` (``get_checkpoint_metadata``).

    Fields: the layout (:func:`layout_descriptor`'s fields, plus ``reserved_num_seqs`` =
    ``max_batch_size``, ``num_total_pages``, ``prefill_chunk_size``), ``layout_hash``, ``seq_id``,
    ``seq_length``, ``logical_pages`` (``logical_page_index``, ``start_pos``, ``length`` of each page)
    and ``groups`` (per layer: ``group_index``, ``layer_begin``, ``layer_end``, ``num_logical_pages``,
    ``dtype`` (of the pages), ``shape`` = :func:`page_group_shape`, ``nbytes``, and with fp8 pages
    ``kv_scale``).
    """
    seq = plain_sequence(cache, seq_id)
    h = layout_hash(cache)  # checks the layout
    cfg = cache.config
    P, n, m = cfg.page_size, seq.length, len(seq.pages)
    meta = _layout_fields(cache)
    meta.update(
        layout_hash=h,
        seq_id=check_id(seq_id),
        seq_length=n,
        logical_pages=[{"logical_page_index": i, "start_pos": i * P, "length": min(P, n - i * P)} for i in range(m)],
        groups=[
            {
                "group_index": g,
                "layer_begin": g,
                "layer_end": g + 1,
                "num_logical_pages": m,
                "dtype": cfg.page_dtype,
                "shape": list(page_group_shape(cache, m)),
                "nbytes": m * cfg.page_bytes,
                **({"kv_scale": [[float(x) for x in row] for row in cache.kv_scales(layer)]} if _fp8(cache) else {}),
            }
            for g, layer in enumerate(cfg.layer_ids)
        ],
    )
    return _json(meta)


def _json(value) -> str:
    """Compact JSON as tvm-ffi writes it: integral doubles as ``%.1f`` (``1.0``), others ``%.17g``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "%.1f" % value if value.is_integer() and abs(value) < 2**53 else "%.17g" % value
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ",".join(map(_json, value)) + "]"
    return "{" + ",".join(f"{json.dumps(k)}:{_json(v)}" for k, v in value.items()) + "}"


def export_page_group(cache, seq_id, group_id, dst) -> None:
    """Copy layer ``group_id`` of ``seq_id`` into ``dst`` (written in place; ``export_page_group``).

    Parameters
    ----------
    dst : tvm.runtime.Tensor | numpy.ndarray | torch.Tensor
        ``[1, m, 2, H_kv, P, D]`` (:func:`page_group_shape`, ``m = ceil(length / P)``) of the cache dtype,
        contiguous, on the cache's device or the CPU. Logical page ``i`` holds tokens ``[i P, (i+1) P)``;
        slots past the sequence's length in its last page are set to zero.
    """
    cache.require_no_forward("export_page_group")
    seq = plain_sequence(cache, seq_id)
    _check_layout(cache)
    group = _group(cache, group_id)
    m = len(seq.pages)
    t, kind = _group_tensor(cache, dst, "dst", m, writable=True)
    # ---- validated
    P = cache.config.page_size
    full, partial = divmod(seq.length, P)
    copy_pages(cache, cache.pages[group], seq.pages[:full], t, np.arange(full))
    if partial:  # the last page through the host, its unused slots zeroed (TVM's bytes)
        cfg = cache.config
        page_shape = (2, cfg.num_kv_heads, P, cfg.head_dim)
        page = _view(cache.pages[group], seq.pages[full], 1, page_shape, cfg.page_bytes).numpy()
        page[:, :, :, partial:] = 0
        _view(t, full, 1, page_shape, cfg.page_bytes).copyfrom(page)
    _write_back(dst, kind, t)


def export_checkpoint(cache, seq_id) -> Checkpoint:
    """The metadata and every page group of ``seq_id`` as host NumPy arrays."""
    meta = checkpoint_metadata(cache, seq_id)
    m = len(json.loads(meta)["logical_pages"])
    groups = []
    for g in range(cache.config.num_layers):
        out = np.empty(page_group_shape(cache, m), tensors.numpy_dtype(cache.config.page_dtype))
        export_page_group(cache, seq_id, g, out)
        groups.append(out)
    return Checkpoint(meta, groups)


# ---------------------------------------------------------------------------------------------- import

_CONTEXT = "checkpoint metadata"


def _field(obj: dict, key: str, kind, where: str = _CONTEXT):
    if key not in obj:
        raise ValueError(
            f"{where} has no field {key!r}; pass the JSON of get_checkpoint_metadata / checkpoint_metadata"
        )
    value = obj[key]
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "list": isinstance(value, list),
        "object": isinstance(value, dict),
    }[kind]
    if not ok:
        raise ValueError(f"{where} field {key!r} = {value!r} is not a JSON {kind}")
    return value


def _expect(obj: dict, key: str, want, kind: str, where: str = _CONTEXT) -> None:
    got = _field(obj, key, kind, where)
    if got != want:
        raise ValueError(
            f"{where} field {key!r} is {got!r} but this cache has {want!r}: the checkpoint comes from a cache of "
            "another configuration"
        )


def _check_metadata(cache, metadata_json) -> int:
    """The sequence length of a checkpoint after checking its metadata against this cache (TVM's checks)."""
    if not isinstance(metadata_json, str):
        raise TypeError(f"metadata_json must be the JSON string of the checkpoint, not {type(metadata_json).__name__}")
    try:
        meta = json.loads(metadata_json)
    except json.JSONDecodeError as err:
        raise ValueError(f"checkpoint metadata is not valid JSON: {err}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"checkpoint metadata must be a JSON object, not {type(meta).__name__}")
    mine = _layout_fields(cache)
    if ("kv_dtype" in mine) != ("kv_dtype" in meta):
        theirs = meta.get("kv_dtype") or f"{meta.get('dtype')!r} pages"
        ours = mine.get("kv_dtype") or f"{cache.config.dtype!r} pages"
        raise ValueError(
            f"the checkpoint holds {theirs} (kv_dtype {meta.get('kv_dtype', 'absent')}) but this cache stores {ours}: "
            "import it into a cache with the same kv_dtype"
        )
    kinds = {bool: "bool", int: "int", float: "number", str: "str", list: "list"}
    for key, want in mine.items():
        if key in ("reserved_num_seqs", "num_total_pages", "prefill_chunk_size"):
            if _field(meta, key, "int") <= 0:
                raise ValueError(f"{_CONTEXT} field {key!r} = {meta[key]} must be positive")
        elif key == "attn_kinds":
            got = _field(meta, key, "list")
            if got != want:
                raise ValueError(f"{_CONTEXT} field 'attn_kinds' is {got} but this cache's layers are {want}")
        else:
            _expect(meta, key, want, kinds[type(want)])
    got_hash, want_hash = _field(meta, "layout_hash", "str"), layout_hash(cache)
    if got_hash != want_hash:
        raise ValueError(
            f"checkpoint layout hash {got_hash} does not match this cache's {want_hash}; the checkpoint was "
            "written for another layout (compare layout_descriptor(cache))"
        )
    _field(meta, "seq_id", "int")
    n = _field(meta, "seq_length", "int")
    if not 0 <= n <= 2**31 - 1:
        raise ValueError(f"{_CONTEXT} field 'seq_length' = {n} must be in [0, 2**31)")
    P, total = cache.config.page_size, cache.config.total_pages
    m = -(-n // P)
    if m > meta["num_total_pages"]:
        raise ValueError(
            f"the checkpoint's {n} tokens need {m} pages but it reports a source cache of only "
            f"{meta['num_total_pages']} pages; the metadata is inconsistent"
        )
    if m > total:
        raise ValueError(f"the checkpoint's {n} tokens need {m} pages but this cache has only {total} pages")
    pages = _field(meta, "logical_pages", "list")
    if len(pages) != m:
        raise ValueError(f"seq_length {n} needs {m} logical pages but the metadata lists {len(pages)}")
    for i, page in enumerate(pages):
        where = f"{_CONTEXT} logical_pages[{i}]"
        if not isinstance(page, dict):
            raise ValueError(f"{where} is not a JSON object")
        _expect(page, "logical_page_index", i, "int", where)
        _expect(page, "start_pos", i * P, "int", where)
        _expect(page, "length", min(P, n - i * P), "int", where)
    groups = _field(meta, "groups", "list")
    L = cache.config.num_layers
    if len(groups) != L:
        raise ValueError(f"{_CONTEXT} lists {len(groups)} page groups but this cache has {L} layers")
    for g, group in enumerate(groups):
        where = f"{_CONTEXT} groups[{g}]"
        if not isinstance(group, dict):
            raise ValueError(f"{where} is not a JSON object")
        for key, want in (("group_index", g), ("layer_begin", g), ("layer_end", g + 1), ("num_logical_pages", m)):
            _expect(group, key, want, "int", where)
        _expect(group, "dtype", cache.config.page_dtype, "str", where)
        _expect(group, "shape", list(page_group_shape(cache, m)), "list", where)
        _expect(group, "nbytes", m * cache.config.page_bytes, "int", where)
    return n


def checkpoint_kv_scales(cache, metadata_json: str):
    """fp8 pages: the ``[L, 2, H_kv]`` float32 scales a checkpoint's page groups were stored under
    (``kv_scale`` of each group, checked against ``cache``: shape, JSON numbers, positive, finite,
    normal float32); None for caches without fp8 pages. A cache given these scales
    (``set_kv_scales``) before ``prepare_import`` imports the codes unchanged."""
    if not _fp8(cache):
        return None
    _check_metadata(cache, metadata_json)
    H = cache.config.num_kv_heads
    f32 = np.finfo(np.float32)
    out = []
    for g, group in enumerate(json.loads(metadata_json)["groups"]):
        where = f"{_CONTEXT} groups[{g}]"
        value = _field(group, "kv_scale", "list", where)
        rows_ok = len(value) == 2 and all(isinstance(row, list) and len(row) == H for row in value)
        numbers = rows_ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) for row in value for x in row)
        arr = np.asarray(value, np.float64) if numbers else np.zeros(0)
        if arr.shape != (2, H) or not (np.isfinite(arr) & (arr >= f32.tiny) & (arr <= f32.max)).all():
            raise ValueError(
                f"{where} field 'kv_scale' = {value!r} must be [[K scales], [V scales]] of {H} positive finite "
                "floats each (the fp8 scales the group's codes were stored under)"
            )
        out.append(arr.astype(np.float32))
    return np.stack(out)


def prepare_import(cache, seq_id, metadata_json) -> None:
    """Check a checkpoint's metadata against this cache and reserve its pages for ``seq_id``.

    ``seq_id`` must be new (not in the cache, not pending). Until :func:`finish_import` the id is not a
    sequence of the cache; :func:`abort_import` (or ``cache.clear()``) frees the reserved pages.
    Raises ValueError naming the first field that differs (then a layout-hash mismatch), KeyError,
    OutOfPagesError; nothing is reserved then. It and :func:`import_page_group` may run while a forward
    is open (the reserved pages are none of the forward's), :func:`finish_import` may not.
    """
    _check_layout(cache)
    seq_id = check_new_id(cache, seq_id, "prepare_import")
    n = _check_metadata(cache, metadata_json)
    scales = checkpoint_kv_scales(cache, metadata_json)
    rec = ImportReservations.of(cache).reserve(cache, seq_id, n)
    rec.scales = scales


def import_page_group(cache, seq_id, group_id, src) -> None:
    """Copy page group ``group_id`` (layer) of a prepared import from ``src`` into its reserved pages.

    ``src``: ``[1, m, 2, H_kv, P, D]`` of the cache dtype (tvm tensor on the cache's device or the CPU,
    NumPy, or torch), whole pages. Each group once (ValueError for a repeat).
    """
    _, rec = pending_checkpoint(cache, seq_id, "import_page_group")
    group = _group(cache, group_id)
    if rec.imported[group]:
        raise ValueError(f"page group {group} of sequence {rec.seq_id}'s import was already imported")
    m = len(rec.pages)
    t, _ = _group_tensor(cache, src, "src", m, writable=False)
    # ---- validated
    copy_pages(cache, t, np.arange(m), cache.pages[group], rec.pages)
    if rec.scales is not None:  # codes stored under the checkpoint's scales, now under the cache's
        cache.requantize_pages(cache.config.layer_ids[group], rec.pages, rec.scales[group])
    rec.imported[group] = True


def finish_import(cache, seq_id) -> None:
    """Make the imported ``seq_id`` a sequence of the cache (every page group must be imported)."""
    res, rec = pending_checkpoint(cache, seq_id, "finish_import")
    res.finish(cache, rec)


def abort_import(cache, seq_id) -> None:
    """Drop the pending import of ``seq_id`` and free the pages it reserved (KeyError if none is pending)."""
    res, rec = pending(cache, seq_id)
    res.abort(cache, rec)


def import_checkpoint(cache, seq_id, checkpoint: Checkpoint) -> None:
    """Import a whole :class:`Checkpoint` into the new ``seq_id`` (aborted again if a group fails).

    fp8 pages: a cache holding no token takes the checkpoint's scales first (``set_kv_scales``: the
    codes are restored exactly, and a calibration ends), once every part of the checkpoint has been
    checked; a cache holding tokens keeps its scales and re-encodes the codes. No forward may be open
    (raised before anything is reserved or copied)."""
    cache.require_no_forward("import_checkpoint")
    check_new_id(cache, seq_id, "import_checkpoint")
    n = _check_metadata(cache, checkpoint.metadata)
    if len(checkpoint.groups) != cache.config.num_layers:
        raise ValueError(
            f"the checkpoint has {len(checkpoint.groups)} page groups; this cache has {cache.config.num_layers} layers"
        )
    for g, group in enumerate(checkpoint.groups):
        _check_group(cache, group, f"checkpoint.groups[{g}]", -(-n // cache.config.page_size), writable=False)
    scales = checkpoint_kv_scales(cache, checkpoint.metadata)
    if scales is not None and cache.holds_no_token():  # everything checked: restore exactly
        for layer, (k, v) in zip(cache.config.layer_ids, adoptable(scales)):
            cache.set_kv_scales(layer, k, v)
    prepare_import(cache, seq_id, checkpoint.metadata)
    try:
        for g, group in enumerate(checkpoint.groups):
            import_page_group(cache, seq_id, g, group)
        finish_import(cache, seq_id)
    except BaseException:
        if seq_id in pending_imports(cache):
            abort_import(cache, seq_id)
        raise
