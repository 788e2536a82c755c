"""The cases of the GPU attention benchmarks (bench/gpu_attention.py, gpu_decode_split.py,
gpu_tvm_baseline.py): one shape set, its data, a NumPy reference, torch SDPA and tvmkv's kernels.

fp16, H_qo 32, H_kv 8, D 128, page size 16. A case (:func:`make_case`) is a dict: pages with a
shuffled page table and the layout arrays of docs/layout.md, q, and the same K/V contiguous
``[B, H_kv, L, D]`` for torch. Every runner returns ``(run, get_output)``.
"""

from __future__ import annotations

import time

import numpy as np

H_QO, H_KV, D, P, DTYPE = 32, 8, 128, 16, "float16"


def api_cache(B: int, hist: int, n: int, target: str = "cuda", **options):
    """A one-layer ``PagedAttentionKVCache`` of this shape whose ``B`` sequences hold ``hist`` tokens each
    (reserved through ``begin_forward`` / ``end_forward``, no attention call) and a forward of ``n`` new
    tokens each open: what the benchmarks that go through the public API time. ``options``: more
    constructor arguments (``kv_dtype``, ...)."""
    from tvmkv import PagedAttentionKVCache

    cache = PagedAttentionKVCache(
        1,
        H_QO,
        H_KV,
        D,
        page_size=P,
        max_batch_size=max(B, 1),
        max_total_seq_len=B * (hist + n + 2 * P),
        prefill_chunk_size=max(B * n, hist, 16),
        dtype=DTYPE,
        target=target,
        **options,
    )
    for s in range(B):
        cache.add_sequence(s)
        if hist:
            cache.begin_forward([s], [hist])
            cache.end_forward()
    cache.begin_forward(list(range(B)), [n] * B)
    return cache


def make_case(kind, B, n, hist, rng):
    """Pages with a shuffled page table, the layout arrays, q and contiguous K/V (numpy fp16)."""
    L = hist + n if kind == "prefill" else hist
    npg = -(-L // P)
    num_pages = B * npg + 1
    perm = rng.permutation(num_pages - 1).astype("int32")[: B * npg]
    k = rng.uniform(-1, 1, (B, H_KV, L, D)).astype(DTYPE)
    v = rng.uniform(-1, 1, (B, H_KV, L, D)).astype(DTYPE)
    pages = np.zeros((num_pages, 2, H_KV, P, D), DTYPE)
    kk = np.zeros((B, H_KV, npg * P, D), DTYPE)
    vv = np.zeros_like(kk)
    kk[:, :, :L], vv[:, :, :L] = k, v
    kk = kk.reshape(B, H_KV, npg, P, D).transpose(0, 2, 1, 3, 4).reshape(B * npg, H_KV, P, D)
    vv = vv.reshape(B, H_KV, npg, P, D).transpose(0, 2, 1, 3, 4).reshape(B * npg, H_KV, P, D)
    pages[perm, 0], pages[perm, 1] = kk, vv
    rows = B * (n if kind == "prefill" else 1)
    q = rng.uniform(-1, 1, (rows, H_QO, D)).astype(DTYPE)
    if kind == "decode":
        q_pos = np.full(B, L - 1, "int32")
    else:
        q_pos = np.tile(np.arange(hist, hist + n, dtype="int32"), B)
    return dict(
        kind=kind,
        B=B,
        n=n if kind == "prefill" else 1,
        hist=hist,
        L=L,
        pages=pages,
        k=k,
        v=v,
        q=q,
        q_pos=q_pos,
        q_indptr=(np.arange(B + 1) * (n if kind == "prefill" else 1)).astype("int32"),
        page_indptr=(np.arange(B + 1) * npg).astype("int32"),
        page_indices=perm,
        last_page_len=np.full(B, L - (npg - 1) * P, "int32"),
    )


def flops_and_bytes(c) -> tuple:
    if c["kind"] == "decode":
        pairs = c["B"] * c["L"]
    else:
        pairs = c["B"] * sum(c["hist"] + i + 1 for i in range(c["n"]))
    kv_bytes = c["B"] * c["L"] * H_KV * D * 2 * 2
    return 4 * H_QO * D * pairs, kv_bytes


def label(c) -> str:
    if c["kind"] == "decode":
        return f"decode {c['B']}x{c['L']}"
    return f"prefill {c['B']}x{c['n']} hist {c['hist']}"


def numpy_attention(c) -> np.ndarray:
    """fp64 reference [rows, H_qo, D]: query i of a sequence sees keys 0..L - n + i."""
    B, n, L = c["B"], c["n"], c["L"]
    g = H_QO // H_KV
    q = c["q"].astype("float64").reshape(B, n, H_QO, D)
    out = np.empty((B, n, H_QO, D))
    visible = np.arange(L)[None, :] <= (L - n + np.arange(n))[:, None]
    for b in range(B):
        k = np.repeat(c["k"][b].astype("float64"), g, axis=0)
        v = np.repeat(c["v"][b].astype("float64"), g, axis=0)
        s = np.einsum("nhd,hld->hnl", q[b], k) * D**-0.5
        s = np.where(visible[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = np.einsum("hnl,hld->nhd", p / p.sum(-1, keepdims=True), v)
    return out.reshape(B * n, H_QO, D)


def case_seed(spec) -> int:
    """The RNG seed of a case ``(kind, B, n, hist)``: the same data in every process."""
    kind, B, n, hist = spec
    return (1 if kind == "decode" else 2) * 10**7 + B * 10**5 + n * 7 + hist


def torch_run(c):
    import torch
    import torch.nn.functional as F

    B, n, L = c["B"], c["n"], c["L"]
    q = torch.from_numpy(c["q"]).cuda().reshape(B, n, H_QO, D).transpose(1, 2).contiguous()
    k = torch.from_numpy(c["k"]).cuda()
    v = torch.from_numpy(c["v"]).cuda()
    mask = None
    causal = c["kind"] == "prefill" and c["hist"] == 0
    if c["kind"] == "prefill" and c["hist"]:
        mask = torch.ones(n, L, dtype=torch.bool, device="cuda").tril(diagonal=c["hist"])
    out = {}

    def run():
        out["o"] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)

    def get():
        return out["o"].transpose(1, 2).reshape(B * n, H_QO, D).float().cpu().numpy()

    return run, get


def decode_split_of(c, forced=None):
    """The split ``begin_forward`` would choose for this decode case (``forced``: decode_splits)."""
    import tvm

    from tvmkv.runtime.decode_split import plan_split
    from tvmkv.tir import split_granule
    from tvmkv.tir.spec import KernelSpec

    blocks, tile = split_granule(KernelSpec(H_QO, H_KV, D, P, DTYPE, "cuda"))
    sms = tvm.cuda(0).multi_processor_count
    return plan_split(c["B"], c["L"], blocks_per_seq=blocks, tile_keys=tile, num_sms=sms, max_splits=forced)


def tvmkv_run(c, lib, split=None):
    """tvmkv's kernels on case ``c``; decode runs with ``split`` (default: the cache's own choice),
    i.e. ``paged_decode`` or ``paged_decode_split`` + ``merge_splits``."""
    import tvm

    dev = tvm.cuda(0)

    def t(a):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)

    B, rows = c["B"], c["q"].shape[0]
    q, pages = t(c["q"]), t(c["pages"])
    pi, px, lpl, q_pos = t(c["page_indptr"]), t(c["page_indices"]), t(c["last_page_len"]), t(c["q_pos"])
    kvw = t(np.zeros((B, 3), "int32"))
    o = tvm.runtime.empty((rows, H_QO, D), DTYPE, dev)
    lse = tvm.runtime.empty((rows, H_QO), "float32", dev)
    s = D**-0.5
    if c["kind"] == "decode":
        split = decode_split_of(c) if split is None else split
        c["split"] = tuple(split)
        if split.num_splits > 1:
            o_part = tvm.runtime.empty((split.num_splits, B, H_QO, D), "float32", dev)
            lse_part = tvm.runtime.empty((split.num_splits, B, H_QO), "float32", dev)
            f_split, f_merge = lib["paged_decode_split"], lib["merge_splits"]
            args = (q, q_pos, pages, pi, px, lpl, kvw, o_part, lse_part, s, 1.0, 1e4, split.kv_chunk)

            def run():
                f_split(*args)
                f_merge(o_part, lse_part, o, lse)

            return run, (lambda: o.numpy().astype("float32"))
        f = lib["paged_decode"]
        args = (q, q_pos, pages, pi, px, lpl, kvw, o, lse, s, 1.0, 1e4)
    elif c["hist"] == 0:
        f = lib["ragged_prefill_causal"]
        kr = t(c["k"].transpose(0, 2, 1, 3).reshape(B * c["n"], H_KV, D))
        vr = t(c["v"].transpose(0, 2, 1, 3).reshape(B * c["n"], H_KV, D))
        args = (q, kr, vr, t(c["q_indptr"]), q_pos, t(np.zeros((rows, 2), "int32")), o, lse, s, 1.0, 1e4)
    else:
        f = lib["paged_prefill_causal"]
        z = t(np.zeros((1, 2), "int32"))
        args = (
            q,
            t(c["q_indptr"]),
            q_pos,
            pages,
            pi,
            px,
            lpl,
            kvw,
            z,
            t(np.zeros(1, "int32")),
            t(np.zeros((1, 3), "int32")),
            t(np.zeros(1, "int32")),
            o,
            lse,
            s,
            1.0,
            1e4,
        )
    return (lambda: f(*args)), (lambda: o.numpy().astype("float32"))


def load_tvmkv_kernels():
    """tvmkv's kernel library of the benchmark configuration for CUDA (default arch, default build dir)."""
    from tvmkv.build import load_kernels
    from tvmkv.tir.spec import KernelSpec

    return load_kernels(KernelSpec(H_QO, H_KV, D, P, DTYPE, "cuda"))


def gpu_meta(reps: int) -> dict:
    """The header of a GPU table: card, torch, TVM, date and repetitions (the caller adds the device
    copy rate, ``copy_GBps``)."""
    import torch
    import tvm

    return {
        "card": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "tvm": tvm.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "reps": reps,
    }
