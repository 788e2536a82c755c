# ruff: noqa: F821, F841
# (the signature binds the buffers its body macros read by name, which ruff cannot see)
"""Split the fused qkv projection and apply rotary position embedding (RoPE) to q and k.

Layouts and the RoPE convention (rotate-half over the whole head dim) are in docs/layout.md
("RoPE", "Fused qkv"). :func:`rope_pair` is the rotation of one pair, at the frequency of
:func:`tvmkv.tir._kernel_common.rope_inv_freq` (the formula the attention kernels with inline RoPE use).
:func:`make_rope_q` prepares q alone the same way (attention over another layer's K/V).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ._kernel_common import func_attrs, heads_per_block, macro, rope_inv_freq
from .spec import KernelSpec


def rope_pair(x_lo, x_hi, pos, i, head_dim: int, rope_scale, rope_theta):
    """TIR expressions ``(y[i], y[i + D/2])`` of rotate-half RoPE, computed in float32.

    ``x_lo = x[i]`` and ``x_hi = x[i + D/2]`` (any dtype, ``0 <= i < D/2``), ``pos`` the logical
    position (int or float expression). With ``a = pos * (rope_scale / rope_theta ** (2 i / D))``
    (in this order, as Hugging Face's ``inv_freq``):
    ``y[i] = x[i] cos a - x[i + D/2] sin a`` and ``y[i + D/2] = x[i + D/2] cos a + x[i] sin a``.
    Call it inside a ``@T.prim_func`` body (it is evaluated when the function is parsed).
    """
    lo = T.cast(x_lo, "float32")
    hi = T.cast(x_hi, "float32")
    angle = T.cast(pos, "float32") * rope_inv_freq(rope_scale, rope_theta, i, head_dim)
    c = T.cos(angle)
    s = T.sin(angle)
    return lo * c - hi * s, hi * c + lo * s


def split_rope_func(spec: KernelSpec, body):
    """The ``split_rope`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which reads
    the parameters of :func:`make_split_rope` by name (size ``n``, the tokens)."""
    H_qo, H_kv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    H = spec.qkv_heads
    attrs = func_attrs(spec)

    @T.prim_func
    def split_rope(
        var_qkv: T.handle,
        var_pos: T.handle,
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        rope_scale: T.float32,
        rope_theta: T.float32,
    ):
        T.func_attr(attrs)
        n = T.int32()
        qkv = T.match_buffer(var_qkv, (n, H, D), dtype)
        pos = T.match_buffer(var_pos, (n,), "int32")
        q = T.match_buffer(var_q, (n, H_qo, D), dtype)
        k = T.match_buffer(var_k, (n, H_kv, D), dtype)
        v = T.match_buffer(var_v, (n, H_kv, D), dtype)
        body()

    return split_rope


def make_split_rope(spec: KernelSpec, *, rotate: bool):
    """``split_rope(qkv, pos, q, k, v, rope_scale, rope_theta)``: split fused qkv, rotating q and k.

    Parameters
    ----------
    qkv : [n, H_qo + 2 H_kv, D], spec.dtype
        Fused projection: heads ``0..H_qo-1`` are q, the next ``H_kv`` k, the last ``H_kv`` v.
    pos : [n], int32
        Logical position of each token (the RoPE position).
    q : [n, H_qo, D], spec.dtype
        **Written**: q, rotated by ``pos`` when ``rotate``.
    k, v : [n, H_kv, D], spec.dtype
        **Written**: k (rotated by ``pos`` when ``rotate``) and v (copied as is).
    rope_scale, rope_theta : float32
        RoPE parameters (see :func:`rope_pair`); ignored when ``rotate`` is False.

    With ``rotate`` False (rope modes "none" and "inline") the kernel only splits.
    """
    H_qo, H_kv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    H = spec.qkv_heads
    D2 = D // 2
    HY = heads_per_block(H, D2)
    HB = (H + HY - 1) // HY

    @macro
    def cpu_body():
        for i in T.parallel(n):
            for h in T.serial(H_qo):
                for d in T.vectorized(D2):
                    if rotate:
                        y = T.meta_var(rope_pair(qkv[i, h, d], qkv[i, h, d + D2], pos[i], d, D, rope_scale, rope_theta))
                        q[i, h, d] = T.cast(y[0], dtype)
                        q[i, h, d + D2] = T.cast(y[1], dtype)
                    else:
                        q[i, h, d] = qkv[i, h, d]
                        q[i, h, d + D2] = qkv[i, h, d + D2]
            for h in T.serial(H_kv):
                for d in T.vectorized(D2):
                    if rotate:
                        y = T.meta_var(
                            rope_pair(
                                qkv[i, H_qo + h, d],
                                qkv[i, H_qo + h, d + D2],
                                pos[i],
                                d,
                                D,
                                rope_scale,
                                rope_theta,
                            )
                        )
                        k[i, h, d] = T.cast(y[0], dtype)
                        k[i, h, d + D2] = T.cast(y[1], dtype)
                    else:
                        k[i, h, d] = qkv[i, H_qo + h, d]
                        k[i, h, d + D2] = qkv[i, H_qo + h, d + D2]
                for d in T.vectorized(D):
                    v[i, h, d] = qkv[i, H_qo + H_kv + h, d]

    @macro
    def gpu_body():
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D2, thread="threadIdx.x"):
                        h = T.meta_var(hb * HY + hy)
                        if i < n and h < H:
                            if h < H_qo:
                                if rotate:
                                    y = T.meta_var(
                                        rope_pair(
                                            qkv[i, h, d],
                                            qkv[i, h, d + D2],
                                            pos[i],
                                            d,
                                            D,
                                            rope_scale,
                                            rope_theta,
                                        )
                                    )
                                    q[i, h, d] = T.cast(y[0], dtype)
                                    q[i, h, d + D2] = T.cast(y[1], dtype)
                                else:
                                    q[i, h, d] = qkv[i, h, d]
                                    q[i, h, d + D2] = qkv[i, h, d + D2]
                            elif h < H_qo + H_kv:
                                if rotate:
                                    y = T.meta_var(
                                        rope_pair(
                                            qkv[i, h, d],
                                            qkv[i, h, d + D2],
                                            pos[i],
                                            d,
                                            D,
                                            rope_scale,
                                            rope_theta,
                                        )
                                    )
                                    k[i, h - H_qo, d] = T.cast(y[0], dtype)
                                    k[i, h - H_qo, d + D2] = T.cast(y[1], dtype)
                                else:
                                    k[i, h - H_qo, d] = qkv[i, h, d]
                                    k[i, h - H_qo, d + D2] = qkv[i, h, d + D2]
                            else:
                                v[i, h - H_qo - H_kv, d] = qkv[i, h, d]
                                v[i, h - H_qo - H_kv, d + D2] = qkv[i, h, d + D2]

    return split_rope_func(spec, cpu_body if spec.is_cpu else gpu_body)


def rope_q_func(spec: KernelSpec, body):
    """The ``rope_q`` PrimFunc of ``spec`` around ``body``, a macro without arguments, which reads the
    parameters of :func:`make_rope_q` by name (size ``n``, the tokens)."""
    H_qo, D, dtype = spec.num_qo_heads, spec.head_dim, spec.dtype
    attrs = func_attrs(spec)

    @T.prim_func
    def rope_q(var_q: T.handle, var_q_pos: T.handle, var_q_out: T.handle, rope_scale: T.float32, rope_theta: T.float32):
        T.func_attr(attrs)
        n = T.int32()
        q = T.match_buffer(var_q, (n, H_qo, D), dtype)
        q_pos = T.match_buffer(var_q_pos, (n,), "int32")
        q_out = T.match_buffer(var_q_out, (n, H_qo, D), dtype)
        body()

    return rope_q


def make_rope_q(spec: KernelSpec, *, rotate: bool):
    """``rope_q(q, q_pos, q_out, rope_scale, rope_theta)``: q alone, prepared as :func:`make_split_rope`
    prepares it (for attention over another layer's K/V, which appends nothing).

    Parameters
    ----------
    q : [n, H_qo, D], spec.dtype
        Query rows (any layout of the caller's; not written).
    q_pos : [n], int32
        Logical position of each row (the RoPE position).
    q_out : [n, H_qo, D], spec.dtype
        **Written**: q rotated by ``q_pos`` when ``rotate``, else a copy of q. Must not overlap q (the
        cuda kernel is compiled with the no-alias promise).
    rope_scale, rope_theta : float32
        RoPE parameters (see :func:`rope_pair`); ignored when ``rotate`` is False.

    ``rotate``: rope mode "normal" (q rotated before attention); modes "none" and "inline" (the
    attention kernels rotate q themselves) only copy.
    """
    H_qo, D, dtype = spec.num_qo_heads, spec.head_dim, spec.dtype
    D2 = D // 2
    HY = heads_per_block(H_qo, D2)
    HB = (H_qo + HY - 1) // HY

    @macro
    def cpu_body():
        for i in T.parallel(n):
            for h in T.serial(H_qo):
                for d in T.vectorized(D2):
                    if rotate:
                        y = T.meta_var(rope_pair(q[i, h, d], q[i, h, d + D2], q_pos[i], d, D, rope_scale, rope_theta))
                        q_out[i, h, d] = T.cast(y[0], dtype)
                        q_out[i, h, d + D2] = T.cast(y[1], dtype)
                    else:
                        q_out[i, h, d] = q[i, h, d]
                        q_out[i, h, d + D2] = q[i, h, d + D2]

    @macro
    def gpu_body():
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D2, thread="threadIdx.x"):
                        h = T.meta_var(hb * HY + hy)
                        if i < n and h < H_qo:
                            if rotate:
                                y = T.meta_var(
                                    rope_pair(q[i, h, d], q[i, h, d + D2], q_pos[i], d, D, rope_scale, rope_theta)
                                )
                                q_out[i, h, d] = T.cast(y[0], dtype)
                                q_out[i, h, d + D2] = T.cast(y[1], dtype)
                            else:
                                q_out[i, h, d] = q[i, h, d]
                                q_out[i, h, d + D2] = q[i, h, d + D2]

    return rope_q_func(spec, cpu_body if spec.is_cpu else gpu_body)
