"""The one cache factory of the tests, the replays and the soak: :func:`make_cache` (options resolved
by :func:`cache_kwargs`, which builds nothing)."""

from __future__ import annotations

import tvmkv


def make_cache(target="llvm", **options) -> tvmkv.PagedAttentionKVCache:
    """A :class:`tvmkv.PagedAttentionKVCache` for tests; ``options`` are :func:`cache_kwargs`'s keywords."""
    return tvmkv.PagedAttentionKVCache(**cache_kwargs(target, **options))


def make_sharded_cache(num_shards: int, target="llvm", **options) -> tvmkv.ShardedKVCache:
    """A :class:`tvmkv.ShardedKVCache` of ``num_shards`` shards over :func:`cache_kwargs`'s cache."""
    return tvmkv.ShardedKVCache(**cache_kwargs(target, **options), num_shards=num_shards)


def cache_kwargs(
    target="llvm",
    *,
    num_layers: int = 2,
    num_qo_heads: int | None = None,
    group: int | None = None,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    dtype: str = "float32",
    rope_mode: str = "none",
    sliding: bool = False,
    max_batch_size: int = 16,
    max_total_seq_len: int | None = None,
    prefill_chunk_size: int = 256,
    num_pages: int | None = None,
    **options,
) -> dict:
    """The :class:`tvmkv.PagedAttentionKVCache` keyword arguments of a test cache; every option is a keyword.

    The defaults are the replay shape (``python -m tvmkv replay``, tests/test_cache.py): 2 layers, 8 query
    heads over 2 KV heads, ``head_dim`` 64, pages of 16, float32, no RoPE, 16 sequences of up to 512
    tokens, forwards of up to 256 tokens.

    Parameters
    ----------
    target : str
        "llvm" or "cuda" (the cache's ``target``).
    num_qo_heads, group : int, optional
        Query heads, given directly or as the GQA group (``num_qo_heads = group * num_kv_heads``); not
        both. Neither: ``group`` 4.
    sliding : bool
        The cache's ``support_sliding_window``.
    max_total_seq_len : int, optional
        Default: the whole pool (``num_pages * page_size``) when ``num_pages`` is given, else 512.
    num_pages : int, optional
        Default: the cache's own sizing (``ceil(max_total_seq_len / page_size) + max_batch_size``).
    **options
        The cache's other keyword arguments (``decode_splits``, ``build_dir``, ``rope_scale``, ...).
    """
    if num_qo_heads is not None and group is not None:
        raise ValueError(
            f"num_qo_heads={num_qo_heads} and group={group} both given; pass one (num_qo_heads = group * num_kv_heads)"
        )
    if num_qo_heads is None:
        num_qo_heads = (4 if group is None else group) * num_kv_heads
    if max_total_seq_len is None:
        max_total_seq_len = 512 if num_pages is None else num_pages * page_size
    return dict(
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
        support_sliding_window=sliding,
        target=target,
        num_pages=num_pages,
        **options,
    )
