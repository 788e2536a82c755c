"""Helpers every kernel family shares, so each family module holds only its own kernels.

* :func:`func_attrs`: the function attributes every kernel signature sets.
* :func:`macro`: the TVMScript macro kernel bodies are written as. A signature is declared once per
  kernel role (e.g. ``append_func`` in :mod:`tvmkv.tir.append`, the attention signatures in
  :mod:`tvmkv.tir.attention`) and the llvm and cuda bodies are macros passed to it.
* :func:`slots`: names for the elements of a small local state buffer.
* :func:`heads_per_block`: the CUDA block shape of the data-movement kernels.
* :func:`rope_inv_freq`: the one RoPE frequency formula (docs/layout.md, "RoPE").
* :func:`qkv_view`: a view of some heads of the fused qkv, for the kernels that read it directly.
"""

from __future__ import annotations

import math
from collections import namedtuple

from tvm.script import tirx as T
from tvm.script.parser._core import scan_macro, utils
from tvm.tirx.script.parser.entry import TIRMacro

from .decode_layout import WARP  # noqa: F401 (lanes per warp; defined in that TVM-free module)
from .spec import KernelSpec, dtype_bytes

NOALIAS = "tirx.noalias"  # the key TVM 0.27 reads; the older "tir.noalias" is ignored silently
LOG2E = math.log2(math.e)  # the kernels work in base 2: exp(x) = 2^(x log2(e))
MAX_THREADS = 256  # threads per CUDA block of the data-movement kernels


class _OpenMacro(TIRMacro):
    """A non-hygienic ``T.macro`` (sees the caller's buffers and variables) that also sees the
    Python values of its own closure (the factory's static sizes and flags); plain non-hygienic
    macros see only the caller's scope."""

    def __call__(self, *args, **kwargs):
        parser = self._find_parser_def()
        with parser.var_table.with_frame():
            for name, value in self.closure_vars.items():
                parser.var_table.add(name, value)
            return super().__call__(*args, **kwargs)


def macro(func):
    """Decorator: ``func`` as a TVMScript macro, expanded where it is called inside a PrimFunc.

    The macro sees its arguments, the Python values of its closure (static sizes, flags, helper
    functions) and, by name, the parameters of the signature it is expanded in (a body passed to a
    ``*_func(spec, body)`` signature reads the buffers that signature documents). Kernel state (local
    buffers) is passed to helper macros as arguments, never picked up from the caller.
    """
    source, closure_vars = scan_macro(func, utils.inspect_function_capture(func))
    obj = _OpenMacro(source, closure_vars, func, hygienic=False)

    def wrapper(*args, **kwargs):
        return obj(*args, **kwargs)

    return wrapper


def slots(*names: str):
    """Names of the elements of a small local state buffer: ``R = slots("kv_len", "end")`` gives
    ``R.kv_len == 0``, ``R.end == 1`` and ``len(R) == 2``. A kernel allocates
    ``T.alloc_buffer((len(R),), ...)`` and writes ``rng[R.kv_len]``: one buffer in the generated
    code, a name in the source."""
    return namedtuple("Slots", names)(*range(len(names)))


def func_attrs(spec: KernelSpec) -> dict:
    """``T.func_attr`` of every kernel of ``spec``: whether its buffers are promised not to overlap.

    cuda: yes (``{NOALIAS: True}``; TVM 0.27 generates the same CUDA source either way). llvm: no,
    explicitly: with the promise LLVM compiles the tuned CPU attention schedule 1.1-1.5x slower
    (bench/RESULTS.md, "CPU: the no-alias attribute"), and TVM 0.27 applies the attribute of one
    function of a module to all of them, so the llvm data-movement kernels (no measurable gain from
    it) go without too. A kernel with the promise must not be called with overlapping buffers one of
    which it writes.
    """
    return {NOALIAS: not spec.is_cpu}


def heads_per_block(num_heads: int, threads_x: int) -> int:
    """Heads one CUDA block handles (``threadIdx.y`` extent) when ``threads_x`` threads cover one head.

    The data-movement kernels (``append``, ``split_rope``, ``merge_*``, the page ops and the interop
    copies) share one CUDA mapping: ``threadIdx.x`` over the head dimension (or half of it; ``append``
    and ``split_rope`` move :func:`copy_vector` elements a thread), ``threadIdx.y`` over a few heads,
    ``blockIdx`` over tokens (slots, pages) and head chunks.
    """
    return max(1, min(num_heads, MAX_THREADS // threads_x))


def copy_vector(dtype: str, extent: int) -> int:
    """Elements per thread of the data-movement kernels' innermost loop on cuda: 8 bytes' worth (4 x
    16-bit, 2 x fp32) where ``extent`` divides evenly, else 1. One vector load / store per thread
    instead of several 2- or 4-byte ones, and ``heads_per_block`` packs more heads into a block."""
    v = 8 // dtype_bytes(dtype)
    return v if extent % v == 0 else 1


def rope_inv_freq(rope_scale, rope_theta, i, head_dim: int):
    """TIR expression of the RoPE frequency of rotate-half pair ``i`` (``0 <= i < D/2``), in float32:
    ``rope_scale / rope_theta ** (2 i / D)`` (in this order, as Hugging Face's ``inv_freq``)."""
    return rope_scale / T.pow(rope_theta, T.Cast("float32", 2 * i) / T.float32(head_dim))


def qkv_view(spec: KernelSpec, first: int) -> dict:
    """``T.decl_buffer`` keyword arguments that view the fused ``qkv [n, H_qo + 2 H_kv, D]`` from its
    head ``first`` on (docs/layout.md, "Fused qkv"): the view keeps qkv's shape and starts
    ``first`` heads in, so ``view[t, h, d]`` is head ``first + h`` of token ``t`` and the kernels that
    read q, k or v straight from qkv (``*_qkv``) index the views as they index separate arrays. (A
    view declared with its own head count and qkv's strides would read wrong rows: TVM 0.27's tirx
    lowering flattens a declared buffer as if it were compact, keeping only its offset.)"""
    return {"elem_offset": first * spec.head_dim}
