"""MLA (DeepSeek-V2 latent attention) on CUDA: tvmkv's MLA cache vs TVM's own MLA kernels vs torch.

fp16, kv_lora_rank 512, qk_rope_head_dim 64 (stored row D = 576), self-attention dims (192, 128),
page size 16, H = 128 heads (DeepSeek-V2) and 16 (its share per GPU with 8-way tensor parallelism).
sm_scale = 192 ** -0.5 for both parts (the model's q/k head dim). One process, one data set per case:

- decode B x L: one new token per sequence, appended, then absorbed attention of q ``[B, H, 576]``
  over all ``L`` stored rows of the sequence (the new one included); output ``[B, H, 512]``.
- prefill 1x4096: causal self attention among the new tokens only (q/k 192, v 128): the cross
  attention of a new sequence has nothing to read, as in TVM's MLA test.
- prefill 4x1024 hist 2048: self attention among the new tokens + absorbed cross attention over the
  2048 history rows + merge. The merge needs both outputs in the v dim (128): the cross output is
  projected through a fixed W_UV ``[H, 512, 128]`` in torch once, outside the timed calls (the same
  projection for every contender); the timed call is self + cross + merge.

Contenders:

- tvmkv: the public API of ``PagedAttentionKVCache.mla`` (``append_mla_kv`` fills the cache;
  timed: ``cross_attention`` / ``self_attention`` / ``merge_attn_output_inplace``).
- TVM: TVM's kernels called directly (what its ``TIRPagedKVCache`` passes for MLA):
  ``batch_prefill_paged_kv_mla`` (``_attention_prefill_mla``, TVM's MLA cross attention, causal 0 as
  its cache calls it) on **the same page array** (tvmkv's pages of the layer) and the same page tables
  (read back with ``debug_forward``; history-only tables for the prefill's cross part),
  ``batch_prefill_ragged_kv`` (``_attention_prefill_ragged`` with H_kv = H, 192/128) for the self
  part and ``merge_state_inplace`` (``_merge_state_inplace``, v dim 128). Compiled by ``--prepare``.
- torch: absorbed attention on contiguous latents ``[B, L, 576]``, every head sharing the one kv
  "head"; several formulations are timed and the fastest correct one is reported (named in the
  table): ``bmm`` (cuBLAS q @ latent^T, fp32 softmax, P @ latent[:, :, :512]; with the logsumexp for
  merging), ``sdpa`` (``F.scaled_dot_product_attention``, the H heads as H query rows of one head
  for decode; causal self attention for prefill), ``effattn`` (the memory-efficient SDPA kernel
  with its logsumexp, ``aten._scaled_dot_product_efficient_attention``, for the merged prefill).

Every output is compared with a float32 torch reference of the same operation (max abs difference;
> 1e-2 is reported as FAILED). Times are CUDA-event medians (device time: each call queued behind a GPU
spin, as in bench/gpu_attention.py; per-call times with the host work included in the second
table). Bytes = the latents of the context read once (``B * L * D * 2``; the history for the
merged prefill); GB/s is compared with a device-to-device copy of the same size measured in the same
run. TFLOP/s counts 2 * H * (Dqk + Dv) per visible query-key pair.

Build machine (full TVM + nvcc)::

    .venv/bin/python bench/gpu_mla.py --prepare build/mla-bench     # tvmkv's + TVM's MLA kernels, sm_90
    .venv/bin/python bench/gpu_mla.py --selfcheck-cpu               # the same code paths on llvm, tiny

GPU machine (runtime-only TVM), carry ``.devpayload`` and ``build/mla-bench``::

    source .devpayload/setup.sh && TVMKV_PAYLOAD=$PWD/.devpayload TVM_USE_RUNTIME_LIB=1 \\
        python3 bench/gpu_mla.py --build-dir build/mla-bench --out $OUT

Results: the table on stdout, ``mla.json`` / ``mla.md`` in ``--out`` (default ``$OUT``; ``mla.json``
is rewritten after every case), ``--write`` replaces the MLA section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
from _common import ROOT, CudaTimer, default_out_dir, write_results
from gpu_tvm_baseline import bind_signature, gpu_schedule, kernel_signature, materialize, missing_device_kernels

MARK_BEGIN, MARK_END = "<!-- gpu-mla:begin -->", "<!-- gpu-mla:end -->"
TOL = 1e-2  # max abs difference from the fp32 reference above which an output is reported as FAILED
HEADS = (128, 16)
DECODE = [(1, 1024), (32, 1024), (64, 4096), (128, 2048)]  # (batch, context incl. the new token)
PREFILL = [(1, 4096, 0), (4, 1024, 2048)]  # (batch, new tokens, history)
FILL_TOKENS = 16384  # tokens per forward while the history is written


class Dims(NamedTuple):
    """The MLA shape of a run (DeepSeek-V2 on the GPU, tiny for the CPU self-check)."""

    lora: int  # kv_lora_rank: the latent, V of the absorbed attention
    rope: int  # qk_rope_head_dim
    dq: int  # q/k head dim of the self attention (qk_nope + qk_rope)
    dv: int  # v head dim of the self attention
    page: int
    dtype: str

    @property
    def d(self) -> int:
        return self.lora + self.rope

    @property
    def sm_scale(self) -> float:
        return self.dq**-0.5


GPU_DIMS = Dims(512, 64, 192, 128, 16, "float16")
CPU_DIMS = Dims(32, 16, 32, 16, 16, "float16")


# ------------------------------------------------------------------------------------------------
# Cases and the float32 reference
# ------------------------------------------------------------------------------------------------


def make_case(kind, H, B, n, hist, dims: Dims, dev, seed):
    """Inputs of one case as torch tensors on ``dev`` (token rows in begin_forward order: sequence 0's
    tokens, then sequence 1's ...). ``lat [B, L, D]`` is every stored row (history, then the new
    tokens); ``q [B * n, H, D]`` the absorbed queries; ``q_s, k_s [B * n, H, Dq]``, ``v_s [.., Dv]`` the
    self attention's inputs; ``w_uv [H, lora, Dv]`` (float32) the projection of the merged prefill."""
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    dt = getattr(torch, dims.dtype)

    def u(*shape):
        return (torch.rand(shape, generator=g, device=dev) * 2 - 1).to(dt)

    L, rows = hist + n, B * n
    c = dict(kind=kind, H=H, B=B, n=n, hist=hist, L=L, dims=dims, lat=u(B, L, dims.d))
    if kind == "decode" or hist:
        c["q"] = u(rows, H, dims.d)
    if kind == "prefill":
        c["q_s"], c["k_s"], c["v_s"] = u(rows, H, dims.dq), u(rows, H, dims.dq), u(rows, H, dims.dv)
        if hist:
            c["w_uv"] = torch.randn(H, dims.lora, dims.dv, generator=g, device=dev) / dims.lora**0.5
    return c


def label(c) -> str:
    if c["kind"] == "decode":
        return f"decode {c['B']}x{c['L']}"
    return f"prefill {c['B']}x{c['n']}" + (f" hist {c['hist']}" if c["hist"] else "")


def flops_and_bytes(c) -> tuple:
    """(FLOPs of QK^T and PV, bytes of latents read once) of a case."""
    H, B, n, hist, dims = c["H"], c["B"], c["n"], c["hist"], c["dims"]
    if c["kind"] == "decode":
        return 2 * H * (dims.d + dims.lora) * B * c["L"], B * c["L"] * dims.d * 2
    self_pairs = B * n * (n + 1) // 2
    fl = 2 * H * (dims.dq + dims.dv) * self_pairs + 2 * H * (dims.d + dims.lora) * B * n * hist
    return fl, B * hist * dims.d * 2


def _heads_chunk(H, n, L) -> int:
    """Heads per step of the fp32 reference: score blocks of at most 2^27 floats."""
    return max(1, min(H, (1 << 27) // max(n * L, 1)))


def ref_absorbed(q, lat, offset, scale, lora):
    """fp32 absorbed attention of one sequence: q ``[n, H, D]`` over rows ``lat [Lk, D]``, V = the first
    ``lora`` dims of each row; query ``i`` sees keys ``j <= offset + i`` (``offset`` None: all).
    Returns ``(o [n, H, lora], lse [n, H])``, natural log."""
    import torch

    n, H, _ = q.shape
    kf = lat.float()
    mask = None
    if offset is not None:
        keys, rows = torch.arange(kf.shape[0], device=q.device), torch.arange(n, device=q.device)
        mask = keys[None, :] <= (offset + rows)[:, None]
    o, lse = [], []
    step = _heads_chunk(H, n, kf.shape[0])
    for h0 in range(0, H, step):
        s = torch.einsum("nhd,ld->hnl", q[:, h0 : h0 + step].float(), kf) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        ls = torch.logsumexp(s, -1)
        o.append(torch.einsum("hnl,lc->nhc", torch.exp(s - ls[..., None]), kf[:, :lora]))
        lse.append(ls.T)
    return torch.cat(o, 1), torch.cat(lse, 1)


def ref_self(q, k, v, scale):
    """fp32 causal attention of one sequence (q/k ``[n, H, Dq]``, v ``[n, H, Dv]``): ``(o, lse)``."""
    import torch

    n, H, _ = q.shape
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    o, lse = [], []
    step = _heads_chunk(H, n, n)
    for h0 in range(0, H, step):
        sl = slice(h0, h0 + step)
        s = torch.einsum("nhd,mhd->hnm", q[:, sl].float(), k[:, sl].float()) * scale
        s = s.masked_fill(~mask, float("-inf"))
        ls = torch.logsumexp(s, -1)
        o.append(torch.einsum("hnm,mhd->nhd", torch.exp(s - ls[..., None]), v[:, sl].float()))
        lse.append(ls.T)
    return torch.cat(o, 1), torch.cat(lse, 1)


def merge_states(o1, l1, o2, l2):
    """The merged state of two attention outputs with natural-log lse (float32)."""
    import torch

    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2), m + torch.log(w1 + w2)[..., 0]


def project(c, o_lat):
    """The merged prefill's W_UV projection of an absorbed output ``[rows, H, lora]`` (float32)."""
    import torch

    return torch.einsum("nhc,hcd->nhd", o_lat.float(), c["w_uv"])


def reference(c):
    """float32 output of the case ``[rows, H, Dout]`` (decode: lora; prefill: Dv) under "o", and the
    merged prefill's parts ("self", "cross")."""
    import torch

    H, B, n, hist, L, dims = c["H"], c["B"], c["n"], c["hist"], c["L"], c["dims"]
    scale = dims.sm_scale
    if c["kind"] == "decode":
        q = c["q"].view(B, 1, H, dims.d)
        return {"o": torch.cat([ref_absorbed(q[b], c["lat"][b], L - 1, scale, dims.lora)[0] for b in range(B)])}
    self_parts = [ref_self(*(c[x].view(B, n, H, -1)[b] for x in ("q_s", "k_s", "v_s")), scale) for b in range(B)]
    o_s, l_s = torch.cat([o for o, _ in self_parts]), torch.cat([ls for _, ls in self_parts])
    if not hist:
        return {"o": o_s}
    q = c["q"].view(B, n, H, dims.d)
    cross = [ref_absorbed(q[b], c["lat"][b, :hist], None, scale, dims.lora) for b in range(B)]
    o_c, l_c = torch.cat([o for o, _ in cross]), torch.cat([ls for _, ls in cross])
    o, _ = merge_states(o_s, l_s, project(c, o_c), l_c)
    return {"o": o, "self": o_s, "cross": o_c, "cross_lse": l_c}


# ------------------------------------------------------------------------------------------------
# The layout: one tvmkv MLA cache holding the case (the pages TVM's kernels read too)
# ------------------------------------------------------------------------------------------------


def fill_cache(c, *, target, build_dir=None):
    """An MLA ``PagedAttentionKVCache`` (one layer) holding the case's history, written with
    ``append_mla_kv`` through the public API, with the forward of the new tokens open and their rows
    appended. Returns ``(cache, tables)``: tables = the forward's page tables (``debug_forward``) and
    the history-only tables of the merged prefill, as NumPy int32 ``(page_indptr, page_values,
    last_page_len)``."""
    from tvmkv import PagedAttentionKVCache

    H, B, n, hist, L, dims = c["H"], c["B"], c["n"], c["hist"], c["L"], c["dims"]
    P = dims.page
    cache = PagedAttentionKVCache.mla(
        1,
        H,
        dims.lora,
        dims.rope,
        mla_self_dims=(dims.dq, dims.dv),
        page_size=P,
        dtype=dims.dtype,
        target=target,
        max_batch_size=B,
        max_total_seq_len=B * (-(-L // P) + 1) * P,
        prefill_chunk_size=max(B * n, min(FILL_TOKENS, max(B * hist, 1))),
        build_dir=build_dir,
    )
    lat = c["lat"]
    for s in range(B):
        cache.add_sequence(s)
    group = max(1, FILL_TOKENS // max(hist, 1))
    for s0 in range(0, B if hist else 0, group):
        ids = list(range(s0, min(B, s0 + group)))
        cache.begin_forward(ids, [hist] * len(ids))
        cache.append_mla_kv(0, lat[ids[0] : ids[-1] + 1, :hist].reshape(-1, dims.d).contiguous())
        cache.end_forward()
    cache.begin_forward(list(range(B)), [n] * B)
    cache.append_mla_kv(0, lat[:, hist:].reshape(B * n, dims.d).contiguous())
    arr = cache.debug_forward().arrays
    pi, lpl = arr["page_indptr"].astype("int32"), arr["last_page_len"].astype("int32")
    px = arr["page_indices"][: pi[-1]].astype("int32")
    if not ((np.diff(pi) - 1) * P + lpl == L).all():
        raise RuntimeError(f"page tables of {label(c)} do not cover {L} tokens per sequence")
    tables = {"all": (pi, px, lpl)}
    if hist:
        npg = -(-hist // P)
        tables["history"] = (
            (np.arange(B + 1) * npg).astype("int32"),
            np.concatenate([px[pi[b] : pi[b] + npg] for b in range(B)]).astype("int32"),
            np.full(B, hist - (npg - 1) * P, "int32"),
        )
    return cache, tables


class Impl(NamedTuple):
    """A contender on a case: ``check()`` runs the whole operation once (the merged prefill's W_UV
    projection included) and returns the float32 output; ``run()`` is the timed call."""

    check: object
    run: object


def tvmkv_impl(c, cache) -> Impl:
    """tvmkv's public API on the open forward of ``fill_cache``'s cache."""
    import torch

    from tvmkv.runtime.tensors import to_device

    H, rows, dims, dev = c["H"], c["B"] * c["n"], c["dims"], c["lat"].device
    dt = getattr(torch, dims.dtype)
    tvm_dev = cache.device

    def tv(x):  # the same memory as a tvm tensor: no conversion inside the timed calls
        return to_device(x, "torch", tvm_dev)

    scale = dims.sm_scale
    if c["kind"] == "decode":
        o, lse = torch.empty(rows, H, dims.lora, dtype=dt, device=dev), torch.empty(rows, H, device=dev)
        q, ot, lt = tv(c["q"]), tv(o), tv(lse)

        def run():
            cache.cross_attention(0, q, out=ot, lse=lt, sm_scale=scale, include_new=True)

        return Impl(lambda: (run(), o.float())[1], run)
    o, lse = torch.empty(rows, H, dims.dv, dtype=dt, device=dev), torch.empty(rows, H, device=dev)
    qs, ks, vs, ot, lt = tv(c["q_s"]), tv(c["k_s"]), tv(c["v_s"]), tv(o), tv(lse)
    if not c["hist"]:

        def run_self():
            cache.self_attention(0, qs, ks, vs, out=ot, lse=lt, sm_scale=scale)

        return Impl(lambda: (run_self(), o.float())[1], run_self)
    oc, lc = torch.empty(rows, H, dims.lora, dtype=dt, device=dev), torch.empty(rows, H, device=dev)
    ocp = torch.empty(rows, H, dims.dv, dtype=dt, device=dev)  # W_UV of the cross output
    q, oct_, lct, ocpt = tv(c["q"]), tv(oc), tv(lc), tv(ocp)

    def parts():
        cache.self_attention(0, qs, ks, vs, out=ot, lse=lt, sm_scale=scale)
        cache.cross_attention(0, q, out=oct_, lse=lct, sm_scale=scale, include_new=False)

    def run():
        parts()
        cache.merge_attn_output_inplace(ot, lt, ocpt, lct)

    def check():
        parts()
        ocp.copy_(project(c, oc).to(dt))
        cache.merge_attn_output_inplace(ot, lt, ocpt, lct)
        return o.float()

    return Impl(check, run)


def tvm_impl(
    c, cache, tables, mod, sigs, *, suffix="", runnable=("mla", "ragged", "merge"), cross_stand_in=None
) -> Impl:
    """TVM's kernels called directly on the cache's page array and page tables. ``mod[name + suffix]``
    for name in ``tvm_mla_h<H>``, ``tvm_ragged_h<H>``, ``tvm_merge_h<H>``; the kernels not in
    ``runnable`` are bound to their arguments (signature checked) but raise NotImplementedError when
    run (the CPU self-check: TVM has no CPU MLA kernel). ``cross_stand_in(o, lse)``, CPU self-check
    only: writes the merged prefill's cross part (base-2 lse) in place of a non-runnable MLA kernel,
    so that TVM's ragged and merge kernels run on the same arguments."""
    import torch

    from tvmkv.runtime.tensors import to_device

    H, B, n, rows, dims = c["H"], c["B"], c["n"], c["B"] * c["n"], c["dims"]
    dev, tvm_dev, dt = c["lat"].device, cache.device, getattr(torch, dims.dtype)

    def tv(x):
        return to_device(x, "torch", tvm_dev)

    def bound(role, values):
        name = f"tvm_{role}_h{H}" + (suffix if role in runnable else "")  # bound only: the CUDA signature
        args, _ = materialize(bind_signature(sigs[name], values, name), tvm_dev)
        if role not in runnable:

            def refuse():
                raise NotImplementedError(f"{name} is not runnable here (bound and checked only)")

            return refuse
        f = mod[name]
        return lambda: f(*args)

    scale, qi = dims.sm_scale, (np.arange(B + 1) * n).astype("int32")

    def mla(q, o, lse, which):
        pi, px, lpl = tables[which]
        values = dict(
            q=tv(q),
            q_indptr=qi,
            pages=cache.pages[0],
            page_indptr=pi,
            page_values=px,
            length_info=lpl,
            output=tv(o),
            lse=tv(lse),
            causal=0,
            sm_scale=scale,
        )
        return bound("mla", values)

    if c["kind"] == "decode":
        o, lse = torch.empty(rows, H, dims.lora, dtype=dt, device=dev), torch.empty(rows, H, device=dev)
        f = mla(c["q"], o, lse, "all")
        return Impl(lambda: (f(), o.float())[1], f)
    o, lse = torch.empty(rows, H, dims.dv, dtype=dt, device=dev), torch.empty(rows, H, device=dev)
    values = dict(
        q=tv(c["q_s"]),
        q_indptr=qi,
        k=tv(c["k_s"]),
        v=tv(c["v_s"]),
        kv_indptr=qi,
        q_rope_position=np.tile(np.arange(c["hist"], c["hist"] + n, dtype="int32"), B),
        k_rope_pos_offset=np.zeros(B, "int32"),
        output=tv(o),
        lse=tv(lse),
        causal=1,
        rotary_mode=0,
        rope_scale=1.0,
        rope_theta=1e4,
        sm_scale=scale,
    )
    f_self = bound("ragged", values)
    if not c["hist"]:
        return Impl(lambda: (f_self(), o.float())[1], f_self)
    oc, lc = torch.empty(rows, H, dims.lora, dtype=dt, device=dev), torch.empty(rows, H, device=dev)
    ocp = torch.empty(rows, H, dims.dv, dtype=dt, device=dev)
    f_cross = mla(c["q"], oc, lc, "history")
    if cross_stand_in is not None and "mla" not in runnable:
        f_cross = lambda: cross_stand_in(oc, lc)  # noqa: E731
    f_merge = bound("merge", dict(v=tv(o), s=tv(lse), v_other=tv(ocp), s_other=tv(lc)))

    def run():
        f_self()
        f_cross()
        f_merge()

    def check():
        f_self()
        f_cross()
        ocp.copy_(project(c, oc).to(dt))
        f_merge()
        return o.float()

    return Impl(check, run)


# ------------------------------------------------------------------------------------------------
# torch: absorbed attention on contiguous latents, several formulations
# ------------------------------------------------------------------------------------------------


def _bmm_absorbed(q3, lat, scale, *, causal_offset=None, with_lse=False):
    """q3 ``[B, M, D]`` (M query rows per sequence, every head) over ``lat [B, Lk, D]``: cuBLAS scores,
    fp32 softmax, P @ lat[..., :lora]. ``causal_offset``: ``(n, H, hist)`` rows ordered token-major."""
    import torch

    s = torch.bmm(q3, lat.transpose(1, 2)).float().mul_(scale)
    if causal_offset is not None:
        n, H, off = causal_offset
        pos = off + torch.arange(n, device=q3.device).repeat_interleave(H)
        s.masked_fill_(torch.arange(lat.shape[1], device=q3.device)[None, :] > pos[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1) if with_lse else None
    p = (torch.exp(s - lse[..., None]) if with_lse else torch.softmax(s, -1)).to(q3.dtype)
    return p, lse


def torch_impls(c) -> dict:
    """``{variant: Impl}`` of torch formulations of the case (each may fail on a device: then skipped)."""
    import torch
    import torch.nn.functional as F

    H, B, n, hist, dims = c["H"], c["B"], c["n"], c["hist"], c["dims"]
    scale, lora, dt = dims.sm_scale, dims.lora, getattr(torch, dims.dtype)
    lat = c["lat"]
    out = {}
    if c["kind"] == "decode":
        q3 = c["q"].view(B, H, dims.d)

        def bmm():
            p, _ = _bmm_absorbed(q3, lat, scale)
            return torch.bmm(p, lat[:, :, :lora])

        qh = c["q"].view(B, 1, H, dims.d)

        def sdpa():
            return F.scaled_dot_product_attention(qh, lat[:, None], lat[:, None, :, :lora], scale=scale)[:, 0]

        for name, fn in (("bmm", bmm), ("sdpa", sdpa)):
            out[name] = Impl(lambda fn=fn: fn().reshape(B, H, lora).float(), fn)
        return out

    def self_sdpa():  # no lse: the prefill without history only
        q, k, v = (c[x].view(B, n, H, -1).transpose(1, 2) for x in ("q_s", "k_s", "v_s"))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)

    def self_bmm():
        q, k, v = (c[x].view(B, n, H, -1).transpose(1, 2).reshape(B * H, n, -1) for x in ("q_s", "k_s", "v_s"))
        s = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale)
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        o = torch.bmm(torch.exp(s - lse[..., None]).to(dt), v).view(B, H, n, -1)
        return o.transpose(1, 2).reshape(B * n, H, -1), lse.view(B, H, n).transpose(1, 2).reshape(-1, H)

    def self_eff():
        q, k, v = (c[x].view(B, n, H, -1).transpose(1, 2) for x in ("q_s", "k_s", "v_s"))
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True, scale=scale)[:2]
        return o.transpose(1, 2).reshape(B * n, H, -1), lse[:, :, :n].transpose(1, 2).reshape(-1, H)

    if not hist:
        out["sdpa"] = Impl(lambda: self_sdpa().reshape(B * n, H, -1).float(), self_sdpa)
        out["bmm"] = Impl(lambda: self_bmm()[0].float(), self_bmm)
        return out
    lh = lat[:, :hist]
    q3 = c["q"].view(B, n * H, dims.d)

    def cross_bmm():
        p, lse = _bmm_absorbed(q3, lh, scale, with_lse=True)
        return torch.bmm(p, lh[:, :, :lora]).view(B * n, H, lora), lse.view(B * n, H)

    def cross_eff():
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q3[:, None], lh[:, None], lh[:, None, :, :lora], None, True, 0.0, False, scale=scale
        )[:2]
        return o[:, 0].reshape(B * n, H, lora), lse[:, 0, : n * H].reshape(B * n, H)

    for name, f_self, f_cross in (("bmm", self_bmm, cross_bmm), ("effattn", self_eff, cross_eff)):
        state = {}

        def run(f_self=f_self, f_cross=f_cross, state=state):
            o_s, l_s = f_self()
            o_c, l_c = f_cross()
            if "ocp" not in state:  # the projection, once (outside the timed calls, as for the others)
                state["ocp"] = project(c, o_c).to(dt)
            return merge_states(o_s, l_s, state["ocp"], l_c)[0].to(dt)

        out[name] = Impl(lambda run=run: run().float(), run)
    return out


# ------------------------------------------------------------------------------------------------
# Timing, the run, the table
# ------------------------------------------------------------------------------------------------


class CpuTimer:
    """perf_counter medians (the CPU self-check exercises the same timing calls)."""

    def __init__(self, reps: int):
        self.reps = reps

    def time(self, fn, *, queued: bool = True) -> float:
        fn()
        ts = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts) * 1e6)


def make_timer(fn, cuda: bool, reps: int, budget_s: float):
    """A timer for ``fn`` with at most ``reps`` repetitions, fewer when one call is long (about
    ``budget_s`` seconds per timing): at least 10, or 3 for calls over 50 ms (TVM's slowest)."""
    import torch

    if not cuda:
        return CpuTimer(min(reps, 3))
    fn()  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = time.perf_counter() - t0
    if est < 0.05:
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        est = (time.perf_counter() - t0) / 3
    floor = 10 if est < 0.05 else 3
    return CudaTimer(int(max(floor, min(reps, budget_s / max(est, 1e-6)))))


def copy_rate(nbytes: int, cuda: bool, reps: int) -> float:
    """GB/s (bytes read + written) of a device-to-device copy of ``nbytes`` (at least 1 MiB)."""
    import torch

    nbytes = max(int(nbytes), 1 << 20)
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    b = torch.empty_like(a)
    us = (CudaTimer(reps) if cuda else CpuTimer(3)).time(lambda: b.copy_(a), queued=False)
    return 2 * nbytes / (us * 1e-6) / 1e9


def run_case(c, *, cache_fn, tvm_fn, cuda, reps, budget_s, errors, guard) -> dict:
    """Every contender on case ``c``: max err vs the fp32 reference, device and call µs, GB/s, TFLOP/s."""
    import torch

    name = label(c)
    fl, nbytes = flops_and_bytes(c)
    row = {"case": name, "H": c["H"], "kind": c["kind"], "batch": c["B"], "new": c["n"], "history": c["hist"]}
    row.update(kv_len=c["L"], flops=fl, bytes=nbytes)
    ref = guard(f"H{c['H']} {name} reference", lambda: reference(c)["o"])
    row["copy_GBps"] = float("nan")
    if nbytes:
        row["copy_GBps"] = guard(f"H{c['H']} {name} copy", lambda: copy_rate(nbytes, cuda, 20), float("nan"))
    impls = {}
    built = guard(f"H{c['H']} {name} tvmkv cache", cache_fn)
    if built:
        cache, tables = built
        impls["tvmkv"] = guard(f"H{c['H']} {name} tvmkv", lambda: tvmkv_impl(c, cache))
        if tvm_fn is not None:
            impls["tvm"] = guard(f"H{c['H']} {name} TVM", lambda: tvm_fn(c, cache, tables))
    torch_variants = guard(f"H{c['H']} {name} torch", lambda: torch_impls(c), {})
    outputs = {}

    def measure(key, impl):
        out = impl.check()
        if cuda:
            torch.cuda.synchronize()
        outputs[key] = out
        if ref is not None:
            row[f"{key}_max_err"] = float((out - ref).abs().max())
        timer = make_timer(impl.run, cuda, reps, budget_s)
        row[f"{key}_reps"] = timer.reps
        row[f"{key}_us"] = timer.time(impl.run)
        row[f"{key}_call_us"] = timer.time(impl.run, queued=False)

    for key, impl in impls.items():
        if impl is not None:
            print(f"[H{c['H']} {name}] {key}", flush=True)
            try:
                measure(key, impl)
            except NotImplementedError as err:
                row[f"{key}_note"] = str(err)
                print(f"  {key}: {err}", flush=True)
            except Exception as err:  # noqa: BLE001 - log, report, go on with the others
                traceback.print_exc()
                errors.append(f"H{c['H']} {name} {key}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    variants = {}
    for var, impl in torch_variants.items():
        print(f"[H{c['H']} {name}] torch {var}", flush=True)
        try:
            out = impl.check()
            err = float((out - ref).abs().max()) if ref is not None else float("nan")
            timer = make_timer(impl.run, cuda, reps, budget_s)
            variants[var] = {"max_err": err, "us": timer.time(impl.run), "call_us": timer.time(impl.run, queued=False)}
            variants[var]["reps"] = timer.reps
            if not err <= TOL:
                variants[var]["rejected"] = f"max err {err:.2e}"
            else:
                outputs.setdefault("torch_" + var, out)
        except Exception as err:  # noqa: BLE001 - a formulation the device does not support is skipped
            variants[var] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"}
            print(f"  torch {var}: {variants[var]['error']}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    row["torch_variants"] = variants
    ok = {v: r for v, r in variants.items() if "us" in r and "rejected" not in r}
    if ok:
        best = min(ok, key=lambda v: ok[v]["us"])
        row.update(torch_variant=best, torch_us=ok[best]["us"], torch_call_us=ok[best]["call_us"])
        row.update(torch_max_err=ok[best]["max_err"], torch_reps=ok[best]["reps"])
        if "tvm" in outputs:
            row["tvm_vs_torch_max_diff"] = float((outputs["tvm"] - outputs["torch_" + best]).abs().max())
    elif variants:
        errors.append(f"H{c['H']} {name} torch: no formulation ran correctly: {variants}")
    for key in ("tvmkv", "tvm", "torch"):
        us = row.get(f"{key}_us")
        if us:
            row[f"{key}_GBps"] = nbytes / (us * 1e-6) / 1e9 if nbytes else None
            row[f"{key}_tflops"] = fl / (us * 1e-6) / 1e12
        err = row.get(f"{key}_max_err")
        if err is not None and not err <= TOL:
            errors.append(f"H{c['H']} {name} {key}: max err {err:.2e} vs the fp32 reference (> {TOL})")
    if row.get("tvm_vs_torch_max_diff", 0) > TOL:
        errors.append(f"H{c['H']} {name}: TVM and torch disagree (max diff {row['tvm_vs_torch_max_diff']:.2e})")
    return row


def case_specs(heads, quick: bool) -> list:
    specs = []
    for H in heads:
        cases = [("decode", H, B, 1, L - 1) for B, L in DECODE] + [("prefill", H, B, n, h) for B, n, h in PREFILL]
        specs += [cases[0], cases[len(DECODE)]] if quick else cases
    return specs


def gpu_meta(reps: int) -> dict:
    import torch
    import tvm

    try:
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            )
            .stdout.split("\n")[0]
            .strip()
        )
    except OSError:
        driver = "unknown"
    return {
        "card": torch.cuda.get_device_name(0),
        "host": platform.node(),
        "driver": driver or "unknown",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "tvm": tvm.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "reps": reps,
    }


def render(rows, meta, errors, d: Dims = GPU_DIMS) -> str:
    def f(x, spec):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    def ratio(r, key, ours="tvmkv_us"):
        return f(r[key] / r[ours], ".2f") + "x" if r.get(key) and r.get(ours) else "n/a"

    def bw(r, key):
        gbps = r.get(f"{key}_GBps")
        if not gbps:
            return "-"
        cp = r.get("copy_GBps")
        return f"{gbps:,.0f} ({100 * gbps / cp:.0f}%)" if cp and not math.isnan(cp) else f"{gbps:,.0f}"

    lines = [
        "## GPU: MLA (DeepSeek-V2 latent attention)",
        "",
        f"Measured {meta['date']} on **{meta['card']}** (host `{meta['host']}`, driver {meta['driver']}, CUDA "
        f"{meta['cuda']}, torch {meta['torch']}, TVM {meta['tvm']}). {d.dtype}, kv_lora_rank {d.lora}, "
        f"qk_rope_head_dim {d.rope} (D {d.d}), self attention dims ({d.dq}, {d.dv}), page {d.page}, one layer; "
        f"H = {' and '.join(str(h) for h in dict.fromkeys(r['H'] for r in rows))} heads (DeepSeek-V2: 128; 16 = "
        f"its share per GPU with 8-way tensor parallelism). Median µs of up to {meta['reps']} calls "
        "(CUDA events; at least 10, fewer than the maximum where a call is long: `mla.json` has each count), "
        "device time (each call queued behind a GPU spin; per-call times with host work: second table). "
        "decode = append, then absorbed attention over the whole context incl. the new token; prefill = causal "
        f"self attention among the new tokens ({d.dq}/{d.dv} dims) + with history: absorbed cross attention over the "
        "history and merge (the cross output's W_UV projection is done once outside the timed calls). "
        "tvmkv = `PagedAttentionKVCache.mla` public API (`cross_attention`, `self_attention`, "
        "`merge_attn_output_inplace`); TVM = its kernels called directly on tvmkv's page array and page tables "
        "(`batch_prefill_paged_kv_mla` with causal 0 as TVM's cache calls it, `batch_prefill_ragged_kv`, "
        "`merge_state_inplace`); torch = fastest correct formulation on contiguous latents (named: bmm = cuBLAS "
        "scores + fp32 softmax + cuBLAS PV; sdpa = F.scaled_dot_product_attention; effattn = the memory-efficient "
        "SDPA kernel with its logsumexp). GB/s = latents of the context read once (B x L x D x 2 bytes; the "
        "history for the merged prefill) / time, in parentheses % of a device-to-device copy of the same size "
        f"in the same run (read+write; 512 MiB copy: {f(meta.get('copy_GBps'), '.0f')} GB/s). TFLOP/s: "
        "2 H (Dqk + Dv) per visible query-key pair. Errors: max abs difference from a float32 torch reference. "
        "Ratio = baseline µs / tvmkv µs (> 1: tvmkv faster). `bench/gpu_mla.py` regenerates this.",
        "",
        "| H | case | tvmkv µs | TVM µs | torch µs | torch variant | vs TVM | vs torch | latents MB | copy GB/s "
        "| tvmkv GB/s | TVM GB/s | torch GB/s | tvmkv TFLOP/s | TVM TFLOP/s | torch TFLOP/s "
        "| max err (tvmkv / TVM / torch) |",
        "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['H']} | {r['case']} | {f(r.get('tvmkv_us'), ',.1f')} | {f(r.get('tvm_us'), ',.1f')} "
            f"| {f(r.get('torch_us'), ',.1f')} | {r.get('torch_variant', 'n/a')} | {ratio(r, 'tvm_us')} "
            f"| {ratio(r, 'torch_us')} | {r['bytes'] / 1e6:,.1f} | {f(r.get('copy_GBps'), ',.0f')} "
            f"| {bw(r, 'tvmkv')} | {bw(r, 'tvm')} | {bw(r, 'torch')} | {f(r.get('tvmkv_tflops'), '.1f')} "
            f"| {f(r.get('tvm_tflops'), '.1f')} | {f(r.get('torch_tflops'), '.1f')} "
            f"| {f(r.get('tvmkv_max_err'), '.1e')} / {f(r.get('tvm_max_err'), '.1e')} / "
            f"{f(r.get('torch_max_err'), '.1e')} |"
        )
    lines += [
        "",
        "Per call, host-side launch work included (no spin ahead):",
        "",
        "| H | case | tvmkv µs | TVM µs | torch µs | vs TVM | vs torch |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['H']} | {r['case']} | {f(r.get('tvmkv_call_us'), ',.1f')} | {f(r.get('tvm_call_us'), ',.1f')} "
            f"| {f(r.get('torch_call_us'), ',.1f')} | {ratio(r, 'tvm_call_us', 'tvmkv_call_us')} "
            f"| {ratio(r, 'torch_call_us', 'tvmkv_call_us')} |"
        )
    lines += ["", "torch formulations (device µs / max err; the table takes the fastest correct one):", ""]
    for r in rows:
        parts = []
        for var, v in r.get("torch_variants", {}).items():
            if "error" in v:
                parts.append(f"{var}: unsupported ({v['error'][:80]})")
            else:
                parts.append(
                    f"{var} {v['us']:,.1f} µs / {v['max_err']:.1e}" + (" (rejected)" if "rejected" in v else "")
                )
        lines.append(f"- H {r['H']} {r['case']}: " + ("; ".join(parts) or "none ran"))
    diffs = [f"H {r['H']} {r['case']} {r['tvm_vs_torch_max_diff']:.1e}" for r in rows if "tvm_vs_torch_max_diff" in r]
    if diffs:
        lines += ["", "TVM vs torch (max abs difference of the outputs): " + ", ".join(diffs) + "."]
    for e in errors:
        lines.append(f"\nFAILED {e}")
    return "\n".join(lines) + "\n"


def main_gpu(args) -> int:
    from tvmkv.payload import bootstrap

    bootstrap()  # $TVMKV_PAYLOAD: the GPU machine's runtime-only TVM, before tvm is imported
    import torch
    import tvm

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in full fp32
    errors: list = []

    def guard(what, fn, default=None):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - log and continue with the other sections
            traceback.print_exc()
            errors.append(f"{what}: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
            return default

    meta = gpu_meta(args.reps)
    meta["copy_GBps"] = guard("copy rate", lambda: CudaTimer(args.reps).copy_rate(), float("nan"))
    print(f"{meta['card']} (driver {meta['driver']}): D2D copy {meta['copy_GBps']:.0f} GB/s", flush=True)
    tvm_fn = None
    if not args.skip_tvm:
        tvm_dir = args.build_dir / "tvm"
        loaded = guard(
            "load TVM's MLA kernels",
            lambda: (
                tvm.runtime.load_module(str(tvm_dir / "tvm_mla.so")),
                json.loads((tvm_dir / "signatures.json").read_text()),
            ),
        )
        if loaded:
            tvm_fn = lambda c, cache, tables: tvm_impl(c, cache, tables, *loaded)  # noqa: E731
    heads = [int(h) for h in args.heads.split(",")]
    rows = []
    out = args.out
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for kind, H, B, n, hist in case_specs(heads, args.quick):
        c = make_case(kind, H, B, n, hist, GPU_DIMS, "cuda", seed=zlib.crc32(repr((kind, H, B, n, hist)).encode()))
        row = run_case(
            c,
            cache_fn=lambda c=c: fill_cache(c, target="cuda", build_dir=args.build_dir),
            tvm_fn=tvm_fn,
            cuda=True,
            reps=args.reps,
            budget_s=args.budget,
            errors=errors,
            guard=guard,
        )
        print(json.dumps({k: v for k, v in row.items() if k != "torch_variants"}), flush=True)
        rows.append(row)
        if out:  # partial results survive a crash in a later case
            (out / "mla.json").write_text(json.dumps({"meta": meta, "rows": rows, "errors": errors}, indent=1))
        c = None
        gc.collect()  # the case's cache (its page array) before the next one is built
        torch.cuda.empty_cache()
    table = render(rows, meta, errors)
    print(table)
    if out:
        (out / "mla.json").write_text(json.dumps({"meta": meta, "rows": rows, "errors": errors}, indent=1))
        (out / "mla.md").write_text(table)
        print(f"wrote {out / 'mla.md'}, {out / 'mla.json'}")
    if args.write:
        write_results(table, MARK_BEGIN, MARK_END)
    return 1 if errors else 0


# ------------------------------------------------------------------------------------------------
# Build machine: --prepare and --selfcheck-cpu
# ------------------------------------------------------------------------------------------------


def tvm_funcs(heads, dims: Dims, target, *, cpu: bool = False) -> dict:
    """TVM's PrimFuncs of the MLA path by our global names: ``tvm_mla_h<H>`` (CUDA only: TVM has no CPU
    MLA kernel), ``tvm_ragged_h<H>``, ``tvm_merge_h<H>`` (``_cpu`` suffix on CPU)."""
    from tvm.relax.frontend.nn.llm import kv_cache as kvc

    funcs = {}
    for H in heads:
        if cpu:
            funcs[f"tvm_ragged_h{H}_cpu"] = kvc._attention_prefill_ragged_cpu(H, H, dims.dq, dims.dv, dims.dtype, {})
            funcs[f"tvm_merge_h{H}_cpu"] = kvc._merge_state_inplace_cpu(dims.dtype)
            continue
        funcs[f"tvm_mla_h{H}"] = kvc._attention_prefill_mla(
            H, dims.lora, dims.rope, dims.dtype, False, target, page_size=dims.page
        )
        funcs[f"tvm_ragged_h{H}"] = kvc._attention_prefill_ragged(H, H, dims.dq, dims.dv, dims.dtype, {}, target)
        funcs[f"tvm_merge_h{H}"] = kvc._merge_state_inplace(H, dims.dv, dims.dtype, target, f"tvm_merge_h{H}")
    return funcs


def mla_specs(heads, dims: Dims, target_kind: str) -> list:
    from tvmkv.tir.spec import MlaSpec

    return [MlaSpec(H, dims.lora, dims.rope, dims.page, dims.dtype, target_kind, dims.dq, dims.dv) for H in heads]


def prepare(out: Path, arch: str, heads) -> None:
    """tvmkv's MLA kernel sets (``out/cuda-<arch>/``, where the cache's ``build_dir=out`` finds them)
    and TVM's MLA-path kernels (``out/tvm/tvm_mla.so`` + ``signatures.json``) as fatbin libraries."""
    import tvm

    from tvmkv.build import BuildKey, build_kernel_set, export_module
    from tvmkv.target import make_target

    t0 = time.time()
    for spec in mla_specs(heads, GPU_DIMS, "cuda"):
        path = build_kernel_set(BuildKey(spec, arch=arch, family="mla"), out, verbose=True)
        print(f"tvmkv {spec.tag}: {path} ({path.stat().st_size / 2**20:.2f} MiB, {time.time() - t0:.0f}s)", flush=True)
    target = make_target("cuda", arch)
    funcs = tvm_funcs(heads, GPU_DIMS, target)
    tdir = out / "tvm"
    tdir.mkdir(parents=True, exist_ok=True)
    mod = gpu_schedule(tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()}), target)
    lib = tvm.compile(mod, target=target)
    fmt = export_module(lib, tdir / "tvm_mla.so", "cuda", arch)
    missing = missing_device_kernels(tdir / "tvm_mla.so", list(funcs))
    if missing:
        raise RuntimeError(f"no CUDA kernel in {tdir / 'tvm_mla.so'} for {missing} (host-only functions)")
    (tdir / "signatures.json").write_text(json.dumps({n: kernel_signature(f) for n, f in funcs.items()}, indent=1))
    (tdir / "prepare.json").write_text(json.dumps({"tvm": tvm.__version__, "arch": arch, "heads": list(heads)}))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 2**20:.2f} MiB in all; TVM's kernels {fmt}) in {time.time() - t0:.0f}s")


def selfcheck_cpu() -> int:
    """The GPU run's code paths on llvm with tiny shapes: tvmkv's llvm MLA kernels through the public
    API, TVM's CPU ragged + merge kernels (its MLA kernel, CUDA only, bound to the same arguments with
    its CUDA signature), torch's formulations, against the fp32 reference; then the table."""
    import torch
    import tvm

    from tvmkv.target import make_target

    torch.manual_seed(0)
    heads, dims = (4,), CPU_DIMS
    errors: list = []

    def guard(what, fn, default=None):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            errors.append(f"{what}: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
            return default

    t0 = time.time()
    cpu_funcs = tvm_funcs(heads, dims, None, cpu=True)
    cuda_funcs = tvm_funcs(heads, dims, make_target("cuda", "sm_90"))
    lib = tvm.compile(tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in cpu_funcs.items()}), target="llvm")
    sigs = {n: kernel_signature(f) for n, f in {**cpu_funcs, **cuda_funcs}.items()}
    print(f"compiled TVM's CPU ragged/merge kernels in {time.time() - t0:.0f}s", flush=True)

    def tvm_cpu(c, cache, tables):
        """TVM's CPU ragged (+ merge) kernels; its MLA kernel (CUDA only) is bound, not run: a decode
        has no TVM row, the merged prefill's cross part comes from the fp32 reference."""
        tvm_impl(c, cache, tables, lib, sigs, runnable=())  # the CUDA signatures bind to the same arguments
        print(f"  TVM: CUDA signatures bound; MLA kernel not run on CPU ({c['kind']})", flush=True)
        if c["kind"] == "decode":
            return None
        ref = reference(c) if c["hist"] else {}

        def stand_in(o, lse):
            o.copy_(ref["cross"].to(o.dtype))
            lse.copy_(ref["cross_lse"] * math.log2(math.e))

        return tvm_impl(
            c, cache, tables, lib, sigs, suffix="_cpu", runnable=("ragged", "merge"), cross_stand_in=stand_in
        )

    specs = [
        ("decode", 4, 3, 1, 36),
        ("decode", 4, 2, 1, 15),
        ("prefill", 4, 1, 33, 0),
        ("prefill", 4, 2, 7, 0),
        ("prefill", 4, 2, 5, 19),
        ("prefill", 4, 2, 16, 32),
    ]
    rows = []
    for i, spec in enumerate(specs):
        c = make_case(*spec, dims, "cpu", seed=i)
        row = run_case(
            c,
            cache_fn=lambda c=c: fill_cache(c, target="llvm"),
            tvm_fn=tvm_cpu,
            cuda=False,
            reps=3,
            budget_s=1.0,
            errors=errors,
            guard=guard,
        )
        print(json.dumps({k: row.get(k) for k in ("case", "tvmkv_max_err", "tvm_max_err", "torch_max_err")}))
        if row.get("tvmkv_max_err") is None:
            errors.append(f"{row['case']}: tvmkv did not run")
        if c["kind"] == "prefill" and row.get("tvm_max_err") is None:
            errors.append(f"{row['case']}: TVM's CPU ragged (+ merge) kernels did not run")
        rows.append(row)
    # Negative controls: a wrong scale / the history-only tables on a decode must show in the error.
    c = make_case("decode", 4, 2, 1, 20, dims, "cpu", seed=99)
    ref = reference(c)["o"]
    cache, _ = fill_cache(c, target="llvm")
    for what, kw in (("sm_scale x2", dict(sm_scale=2 * dims.sm_scale, include_new=True)), ("include_new=False", {})):
        o, _ = cache.cross_attention(0, c["q"], **{"sm_scale": dims.sm_scale, "include_new": False, **kw})
        err = float((o.float() - ref).abs().max())
        print(f"  {'ok  ' if err > TOL else 'FAIL'} negative control ({what}) is caught: max err {err:.2e}")
        if err <= TOL:
            errors.append(f"negative control {what}")
    meta = {"card": "CPU self-check (llvm)", "host": platform.node(), "driver": "-", "cuda": "-"}
    meta.update(torch=torch.__version__, tvm=tvm.__version__, date=time.strftime("%Y-%m-%d %H:%M %Z"), reps=3)
    meta["copy_GBps"] = float("nan")
    print(render(rows, meta, errors, dims))
    print("selfcheck:", "FAILED " + "; ".join(errors) if errors else "all ok")
    return 1 if errors else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--prepare", type=Path, metavar="DIR", help="build machine: compile the kernels into DIR")
    mode.add_argument("--selfcheck-cpu", action="store_true", help="build machine: the code paths on llvm, tiny")
    ap.add_argument("--arch", default=None, help="--prepare: CUDA arch (default $TVMKV_CUDA_ARCH or sm_90)")
    ap.add_argument(
        "--build-dir", type=Path, default=ROOT / "build" / "mla-bench", help="what --prepare wrote (GPU run)"
    )
    ap.add_argument("--heads", default=",".join(map(str, HEADS)), help="comma-separated head counts (128,16)")
    ap.add_argument("--reps", type=int, default=100, help="most calls timed per contender and case")
    ap.add_argument("--budget", type=float, default=2.0, help="about this many seconds per timing (fewer reps)")
    ap.add_argument("--quick", action="store_true", help="first decode and first prefill case per head count")
    ap.add_argument("--skip-tvm", action="store_true", help="leave out TVM's kernels")
    ap.add_argument("--out", type=Path, default=default_out_dir(), help="folder for mla.json / mla.md (default $OUT)")
    ap.add_argument("--write", action="store_true", help="replace the MLA section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    if args.prepare:
        from tvmkv.target import default_cuda_arch

        prepare(args.prepare, args.arch or default_cuda_arch(), [int(h) for h in args.heads.split(",")])
        return 0
    if args.selfcheck_cpu:
        return selfcheck_cpu()
    return main_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
