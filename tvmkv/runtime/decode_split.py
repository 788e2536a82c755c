"""Flash-decoding plan: how a decode step cuts its sequences' keys across thread blocks.

The split (docs/layout.md, "Split decode"): the keys a decode query visits (the sink, then the
window, in slot order) are cut into ``num_splits`` chunks of ``kv_chunk`` keys; ``paged_decode_split``
computes one partial state per (chunk, sequence, query head) and ``merge_splits`` combines them.
Splitting pays where the batch alone launches too few thread blocks to keep every SM streaming
(batch 1-32 at H_kv 8); it costs a second launch and a float32 round trip of the partial states.
Pure arithmetic, chosen once per step in ``begin_forward``, never per layer.
"""

from __future__ import annotations

from typing import NamedTuple

# Heuristic, from ``bench/gpu_decode_split.py`` on an H100 (fp16, H_kv 8, D 128; bench/RESULTS.md):
# split a power-of-two number of ways (3- and 6-way splits measured 10-25% slower than 2/4/8) until
# the grid has BLOCKS_PER_SM blocks per SM, into chunks of at least MIN_CHUNK_TILES tiles, at most
# MAX_SPLITS ways. The batch alone filling the SMs once is enough: at 16 x 1024 (128 blocks on 132
# SMs) a 2-way split already costs 20%, while batch 1 x 4096 runs 4.4x faster cut 16 ways.
BLOCKS_PER_SM = 1
MIN_CHUNK_TILES = 2
MAX_SPLITS = 64


class DecodeSplit(NamedTuple):
    """How one decode step cuts its sequences: ``num_splits`` chunks of ``kv_chunk`` visited keys
    (``num_splits == 1``: no split, the plain ``paged_decode`` runs), and the suffix of the one-launch
    kernel's layout the split was planned for (``""``; ``"_small_batch"``: the tensor-core decode's
    layout for steps of few blocks, ``tvmkv.tir.small_batch_granule``)."""

    num_splits: int
    kv_chunk: int
    layout: str = ""


NO_SPLIT = DecodeSplit(1, 0)


def plan_split(
    batch: int,
    max_keys: int,
    *,
    blocks_per_seq: int,
    tile_keys: int,
    num_sms: int,
    max_splits: int | None = None,
    blocks_per_sm: int = BLOCKS_PER_SM,
    stable: bool = False,
) -> DecodeSplit:
    """The split of one decode step (pure arithmetic, called by ``begin_forward``).

    Parameters
    ----------
    batch : int
        Sequences in the step.
    max_keys : int
        Keys the longest sequence visits (an upper bound is fine: its kv length).
    blocks_per_seq, tile_keys : int
        From :func:`tvmkv.tir.split_granule`.
    num_sms : int
        Streaming multiprocessors of the device (0: no split, e.g. on the CPU).
    max_splits : int, optional
        ``None``: split a power-of-two number of ways only as far as the grid stays within
        ``blocks_per_sm`` blocks per SM, at most ``MAX_SPLITS`` ways, into chunks of at least
        ``MIN_CHUNK_TILES`` tiles. An int forces up to that many splits whatever the device (chunks of
        at least one tile); 1 turns splitting off.
    blocks_per_sm : int
        Blocks of the split kernel one SM runs at once that are worth filling (``BLOCKS_PER_SM`` for
        MHA decode; :func:`tvmkv.tir.mla_layout.mla_blocks_per_sm` for MLA).
    stable : bool
        Plan for CUDA-graph replay (``CacheConfig.stable_decode_splits``): a captured graph keeps the
        split's launch parameters, so the split should change rarely as sequences grow. The chunk is
        ``tile_keys`` times a power of two and the count stays the power of two the batch allows
        (trailing chunks may be empty): both change only when ``max_keys`` crosses a power of two.

    Returns
    -------
    DecodeSplit ``(num_splits, kv_chunk)`` with ``num_splits * kv_chunk >= max_keys``; ``kv_chunk`` is
    a multiple of ``tile_keys``, and, unless ``stable``, ``(num_splits - 1) * kv_chunk < max_keys`` (no
    empty chunk for the longest sequence).
    """
    if max_splits is None:
        if num_sms <= 0:
            return NO_SPLIT
        cap = min(
            blocks_per_sm * num_sms // (batch * blocks_per_seq),
            MAX_SPLITS,
            max_keys // (MIN_CHUNK_TILES * tile_keys),
        )
        splits = 1 << (cap.bit_length() - 1) if cap > 1 else 1  # the largest power of two <= cap
    else:
        splits = min(max_splits, -(-max_keys // tile_keys))
    if splits <= 1:
        return NO_SPLIT
    if stable:
        tiles = -(-max_keys // (splits * tile_keys))  # tiles per chunk, rounded up to a power of two
        return DecodeSplit(splits, tile_keys << (tiles - 1).bit_length())
    chunk = -(-max_keys // splits)
    chunk = -(-chunk // tile_keys) * tile_keys
    splits = -(-max_keys // chunk)
    if splits <= 1:
        return NO_SPLIT
    return DecodeSplit(splits, chunk)
