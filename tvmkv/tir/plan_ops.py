# ruff: noqa: F821, F841
# (the body macros read the signature's buffers by name, which ruff cannot see)
"""Planning a step on the device: the index arrays derived from a device-resident page table.

A decode or prefill step's index arrays (docs/layout.md, "Page tables", "Ragged queries") follow from
a few integers per sequence and its page list. The runtime keeps every resident sequence's page list in a device table
``table[row, k]`` (docs/layout.md, "Device page table"), patched only where a list changed, so a
decode step uploads five integers per sequence plus the pages that are new to the table, and
:func:`make_plan_decode` writes the step's arrays into the packed index buffer the attention kernels
read; a prefill or mixed step (no token tree, no window) uploads seven and :func:`make_plan_prefill`
writes its arrays, the per-token ones (positions, slots) included. The host then does O(1)
Python-level passes over the batch, however long the sequences are.

CUDA mapping: one block per sequence, whose threads stride over its pages (and new tokens). llvm: one
serial loop (``plan_prefill`` runs the CUDA kernel's per-thread code with one thread per sequence).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._kernel_common import func_attrs, macro
from .decode_layout import PREFILL_STAGE_COLS, STAGE_COLS
from .spec import KernelSpec

LANES = 32  # threads per sequence (cuda, plan_decode)
PREFILL_LANES = 128  # threads per sequence (cuda, plan_prefill: a sequence may bring thousands of tokens)


@macro
def zero_share(b, lane, lanes):
    """Thread ``lane`` of sequence ``b``'s ``lanes`` zeroes its share of ``out[zero_at:zero_end]`` (the
    whole range over every thread of the launch), in a plan kernel's body."""
    for it in T.serial((zero_end - zero_at + batch * lanes - 1) // (batch * lanes)):
        z = zero_at + (it * batch + b) * lanes + lane
        if z < zero_end:
            out[z] = 0


def plan_func(spec: KernelSpec, body):
    """The PrimFunc of ``plan_decode`` or ``plan_prefill`` (one signature) of ``spec`` around ``body``, a
    macro without arguments, which reads the parameters of :func:`make_plan_decode` by name."""
    attrs = func_attrs(spec)

    @T.prim_func
    def plan(
        var_stage: T.handle,
        var_table: T.handle,
        var_out: T.handle,
        batch: T.int32,
        q_indptr_at: T.int32,
        q_pos_at: T.int32,
        slots_at: T.int32,
        last_page_len_at: T.int32,
        page_indptr_at: T.int32,
        zero_at: T.int32,
        zero_end: T.int32,
        page_indices_at: T.int32,
    ):
        T.func_attr(attrs)
        n_stage, rows, width, n_out = T.int32(), T.int32(), T.int32(), T.int32()
        stage = T.match_buffer(var_stage, (n_stage,), "int32")
        table = T.match_buffer(var_table, (rows, width), "int32")
        out = T.match_buffer(var_out, (n_out,), "int32")
        body()

    return plan


def make_plan_decode(spec: KernelSpec):
    """``plan_decode(stage, table, out, batch, <8 offsets>)``: the index arrays of a decode step.

    Parameters
    ----------
    stage : [STAGE_COLS * batch + deltas], int32
        Column-major per sequence ``b``: ``row[b]`` (its row of ``table``), ``hist[b]`` (its kv length
        before the step: the new token's slot), ``first[b]`` (its first page index that is new to the
        table), ``delta[b]`` (where its new pages start, counted from ``STAGE_COLS * batch``),
        ``start[b]`` (page_indptr[b]); then the new pages of every sequence. The sequence's pages
        after the step are ``n = hist // P + 1``; pages ``k >= first`` come from the stage and are
        written into ``table[row, k]``, the others are read from it.
    table : [rows, width], int32
        Device page table, **written in place** (its new pages).
    batch : int32
        Sequences of the step (``B``).
    out : int32
        The packed index buffer (docs/layout.md, "Page tables"), **written**: ``q_indptr = 0..batch``,
        ``q_pos = hist``, ``slots = page * P + hist % P`` (the last page's), ``last_page_len = hist % P
        + 1``, ``page_indptr = start`` (and ``start[-1] + n[-1]`` last), ``page_indices`` each
        sequence's ``n`` pages; ``out[zero_at:zero_end]`` (kv_window and the token-tree arrays) 0.
        The 8 offsets (int32, elements of ``out``) say where: ``q_indptr_at``, ``q_pos_at``,
        ``slots_at``, ``last_page_len_at``, ``page_indptr_at``, ``zero_at``, ``zero_end``,
        ``page_indices_at``; the rest of ``out`` (padding, other arrays) is not written.
    """
    P = spec.page_size
    S = STAGE_COLS

    @macro
    def cpu_body():
        for i in T.serial(zero_end - zero_at):
            out[zero_at + i] = 0
        for b in T.serial(batch):
            row = stage[b]
            hist = stage[batch + b]
            first = stage[2 * batch + b]
            delta = S * batch + stage[3 * batch + b]
            start = stage[4 * batch + b]
            n = hist // P + 1
            for k in T.serial(n):
                if k >= first:
                    table[row, k] = stage[delta + k - first]
                out[page_indices_at + start + k] = table[row, k]
            out[q_indptr_at + b] = b
            out[q_pos_at + b] = hist
            out[slots_at + b] = table[row, n - 1] * P + hist % P
            out[last_page_len_at + b] = hist % P + 1
            out[page_indptr_at + b] = start
            if b == batch - 1:
                out[q_indptr_at + batch] = batch
                out[page_indptr_at + batch] = start + n

    @macro
    def gpu_body():
        for b in T.thread_binding(batch, thread="blockIdx.x"):
            for lane in T.thread_binding(LANES, thread="threadIdx.x"):
                row = stage[b]
                hist = stage[batch + b]
                first = stage[2 * batch + b]
                delta = S * batch + stage[3 * batch + b]
                start = stage[4 * batch + b]
                n = hist // P + 1
                zero_share(b, lane, LANES)
                for it in T.serial((n + LANES - 1) // LANES):
                    k = it * LANES + lane
                    if k < n:
                        if k >= first:
                            table[row, k] = stage[delta + k - first]
                            out[page_indices_at + start + k] = stage[delta + k - first]
                        else:
                            out[page_indices_at + start + k] = table[row, k]
                        if k == n - 1:
                            if k >= first:
                                out[slots_at + b] = stage[delta + k - first] * P + hist % P
                            else:
                                out[slots_at + b] = table[row, k] * P + hist % P
                if lane == 0:
                    out[q_indptr_at + b] = b
                    out[q_pos_at + b] = hist
                    out[last_page_len_at + b] = hist % P + 1
                    out[page_indptr_at + b] = start
                    if b == batch - 1:
                        out[q_indptr_at + batch] = batch
                        out[page_indptr_at + batch] = start + n

    return plan_func(spec, cpu_body if spec.is_cpu else gpu_body)


def make_plan_prefill(spec: KernelSpec):
    """``plan_prefill(stage, table, out, batch, <8 offsets>)``: the index arrays of a prefill or mixed
    step (any new tokens per sequence; no token tree, no sliding window), from the device page table.

    The signature, ``table`` and the offsets are :func:`make_plan_decode`'s. ``stage`` is
    ``[PREFILL_STAGE_COLS * batch + deltas]``: plan_decode's five columns (``delta`` counted from
    ``PREFILL_STAGE_COLS * batch``), then ``qs[b]`` (``q_indptr[b]``) and ``m[b]`` (its new tokens,
    > 0), then the new pages. With ``end = hist + m`` and ``n = ceil(end / P)`` pages after the step,
    it writes ``q_indptr[b] = qs``, ``q_pos[qs + t] = hist + t`` and ``slots[qs + t] = page(hist + t)
    * P + (hist + t) % P`` for ``t < m``, ``last_page_len = end - (n - 1) P``, ``page_indptr[b] =
    start``, the last entries of both indptrs, the ``n`` pages at ``page_indices[start:]``, and the
    zeros; ``table[row, k] = page k`` for ``k >= first``.

    One macro, :func:`sequence`, is each thread's work on both targets: ``lanes`` threads of a block
    per sequence on CUDA, one on llvm, each striding over the sequence's pages and tokens (a token's
    page is read from the stage where the launch writes it into the table, so no thread reads what
    another writes).
    """
    P = spec.page_size
    S = PREFILL_STAGE_COLS

    @macro
    def sequence(b, lane, lanes):
        row = stage[b]
        hist = stage[batch + b]
        first = stage[2 * batch + b]
        delta = S * batch + stage[3 * batch + b]
        start = stage[4 * batch + b]
        qs = stage[5 * batch + b]
        m = stage[6 * batch + b]
        n = (hist + m + P - 1) // P
        zero_share(b, lane, lanes)
        for it in T.serial((n + lanes - 1) // lanes):
            k = it * lanes + lane
            if k < n:
                if k >= first:
                    table[row, k] = stage[delta + k - first]
                    out[page_indices_at + start + k] = stage[delta + k - first]
                else:
                    out[page_indices_at + start + k] = table[row, k]
        for it in T.serial((m + lanes - 1) // lanes):
            t = it * lanes + lane
            if t < m:
                out[q_pos_at + qs + t] = hist + t
                if (hist + t) // P >= first:
                    out[slots_at + qs + t] = stage[delta + (hist + t) // P - first] * P + (hist + t) % P
                else:
                    out[slots_at + qs + t] = table[row, (hist + t) // P] * P + (hist + t) % P
        if lane == 0:
            out[q_indptr_at + b] = qs
            out[last_page_len_at + b] = hist + m - (n - 1) * P
            out[page_indptr_at + b] = start
            if b == batch - 1:
                out[q_indptr_at + batch] = qs + m
                out[page_indptr_at + batch] = start + n

    @macro
    def cpu_body():
        for b in T.serial(batch):
            sequence(b, 0, 1)

    @macro
    def gpu_body():
        for b in T.thread_binding(batch, thread="blockIdx.x"):
            for lane in T.thread_binding(PREFILL_LANES, thread="threadIdx.x"):
                sequence(b, lane, PREFILL_LANES)

    return plan_func(spec, cpu_body if spec.is_cpu else gpu_body)
