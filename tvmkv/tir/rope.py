# ruff: noqa: F821, F841
# (the signature binds the buffers its body macros read by name, which ruff cannot see)
"""Split the fused qkv projection and apply rotary position embedding (RoPE) to q and k.

Layouts and the RoPE convention (rotate-half over the whole head dim) are in docs/layout.md
("RoPE", "Fused qkv"). :func:`rope_pair` is the rotation of one pair, at the frequency of
:func:`tvmkv.tir._kernel_common.rope_inv_freq` (the formula the attention kernels with inline RoPE use).
:func:`make_rope_q` prepares q alone the same way (attention over another layer's K/V).

Both factories take a static ``rope_scaling`` (:class:`tvmkv.tir.rope_scaling.RopeScaling`, resolved:
``rotary_dim`` set): a RoPE variant baked into the kernel as TVM bakes it into its split kernel
(:func:`variant_angle`, :func:`rope_pair_variant`); ``None`` is the default RoPE over the whole head,
whose kernels are the ones above, unchanged. longrope's extension factors are baked too (a constant
lookup), so every variant keeps one signature.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from ._kernel_common import copy_vector, func_attrs, heads_per_block, macro, rope_inv_freq
from .fp8 import kv_scale_buffer, page_code, store_lanes, with_kv_scale
from .rope_scaling import RopeScaling
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


def _table(values: tuple, j, lo: int = 0, hi: int | None = None):
    """TIR float32 expression of ``values[j]`` for an int expression ``0 <= j < len(values)``: a
    balanced tree of selects over baked constants (longrope's extension factors)."""
    hi = len(values) if hi is None else hi
    if hi - lo == 1:
        return T.float32(values[lo])
    mid = (lo + hi) // 2
    return T.Select(j < mid, _table(values, j, lo, mid), _table(values, j, mid, hi))


def variant_angle(rs: RopeScaling, e, pos, n, rope_scale, rope_theta):
    """TIR float32 angle of rotated dim ``e`` (int expression, ``0 <= e < R``) at position ``pos``,
    as TVM's split kernel computes it for ``rs`` (docs/layout.md, "RoPE"; NumPy: ``rs.inv_freq``).

    ``s = pos * rope_scale``; ``n`` is the number of tokens of the call (longrope's long/short choice).
    """
    R = rs.rotary_dim
    t = rs.rope_type
    s = T.cast(pos, "float32") * rope_scale
    if t in ("gptj", "llama4"):
        expo = T.Cast("float32", 2 * (e // 2)) / T.float32(R)
    else:
        expo = T.Cast("float32", (2 * e) % R) / T.float32(R)
    p = T.pow(rope_theta, expo)  # theta ** exponent
    if t in ("default", "gptj"):
        return s / p
    if t == "longrope":
        j = e % (R // 2)
        L = rs.original_max_position_embeddings
        ext = T.Select(n > L, _table(rs.long_factor, j), _table(rs.short_factor, j))
        return s / (ext * p)
    if t in ("llama3", "llama4"):
        orig = T.float32(1) / p
        lf, hf, L = rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings
        if t == "llama4" and hf == lf:
            wavelen = T.float32(2 * math.pi) / orig
            return s * T.Select(wavelen > T.float32(L / lf), orig / T.float32(rs.factor), orig)
        inv_diff = 1.0 / (hf - lf)
        alpha, beta = L / (2 * math.pi) * inv_diff, lf * inv_diff
        smooth = T.max(T.float32(0), T.min(T.float32(1), T.float32(alpha) * orig - T.float32(beta)))
        return s * ((T.float32(1) - smooth) * orig * T.float32(1.0 / rs.factor) + smooth * orig)
    # yarn: the ramp runs over the dim index e (TVM), between the correction range (low, high)
    L = rs.original_max_position_embeddings
    c_low = R * math.log(L / (rs.beta_fast * 2 * math.pi))
    c_high = R * math.log(L / (rs.beta_slow * 2 * math.pi))
    if rs.inv_theta_log_scale is not None:
        low_f, high_f = rs.yarn_range(None, R)
        low, high = T.float32(low_f), T.float32(high_f)
    else:
        ilts = T.float32(1) / (T.float32(2) * T.log(rope_theta))
        low = T.max(T.float32(c_low) * ilts, T.float32(0))
        high = T.min(T.float32(c_high) * ilts, T.float32(R - 1))
        high = T.Select(low == high, high + T.float32(0.001), high)
    mask = T.float32(1) - T.max(T.min((T.Cast("float32", e) - low) / (high - low), T.float32(1)), T.float32(0))
    inv = T.float32(1) / (T.float32(rs.factor) * p) * (T.float32(1) - mask) + T.float32(1) / p * mask
    return s * inv


def rope_pair_variant(rs: RopeScaling, x_lo, x_hi, lo, hi, pos, n, rope_scale, rope_theta):
    """TIR expressions ``(y[lo], y[hi])`` of the pair ``(lo, hi)`` of variant ``rs``, in float32.

    Pairs are ``(j, j + R/2)`` (rotate-half) or ``(2 j, 2 j + 1)`` (gptj): ``y[lo] = m (x[lo] cos a_lo -
    x[hi] sin a_lo)``, ``y[hi] = m (x[hi] cos a_hi + x[lo] sin a_hi)`` with ``a = variant_angle`` and
    ``m = rs.magnitude``; ``a_hi = a_lo`` except for TVM's llama4 and yarn (docs/layout.md, "RoPE").
    """
    a_lo = variant_angle(rs, lo, pos, n, rope_scale, rope_theta)
    a_hi = a_lo if rs.rope_type not in ("llama4", "yarn") else variant_angle(rs, hi, pos, n, rope_scale, rope_theta)
    xl = T.cast(x_lo, "float32")
    xh = T.cast(x_hi, "float32")
    y_lo = xl * T.cos(a_lo) - xh * T.sin(a_lo)
    y_hi = xh * T.cos(a_hi) + xl * T.sin(a_hi)
    m = rs.magnitude
    if m != 1.0:
        y_lo, y_hi = y_lo * T.float32(m), y_hi * T.float32(m)
    return y_lo, y_hi


def _pair_index(rs: RopeScaling, j):
    """Dims ``(lo, hi)`` of rotated pair ``j`` (``0 <= j < R/2``)."""
    if rs.interleaved:
        return 2 * j, 2 * j + 1
    return j, j + rs.rotary_dim // 2


def _check_variant(spec: KernelSpec, rs: RopeScaling) -> None:
    if rs.rotary_dim is None or rs.rotary_dim > spec.head_dim:
        raise ValueError(f"rope_scaling must be resolved for head_dim={spec.head_dim} (rotary_dim={rs.rotary_dim})")
    if rs.rope_type == "longrope" and rs.long_factor is None:
        raise ValueError("longrope kernels need long_factor/short_factor (RopeScaling.with_ext_factors)")


def _variant_cpu_rows(rs: RopeScaling, D: int, dtype: str):
    """Macro ``rows(src, src_h, dst, dst_h, i, pos_i, n)``: one head of token ``i``, rotated by variant
    ``rs`` (dims ``< R``) and copied (the rest), on one CPU thread."""
    R = rs.rotary_dim
    R2 = R // 2
    C = D - R

    @macro
    def rows(src, src_h, dst, dst_h, i, pos_i, n_tok):
        for j in T.serial(R2):
            ix = T.meta_var(_pair_index(rs, j))
            y = T.meta_var(
                rope_pair_variant(
                    rs, src[i, src_h, ix[0]], src[i, src_h, ix[1]], ix[0], ix[1], pos_i, n_tok, rope_scale, rope_theta
                )
            )
            dst[i, dst_h, ix[0]] = T.cast(y[0], dtype)
            dst[i, dst_h, ix[1]] = T.cast(y[1], dtype)
        if C > 0:
            for c in T.serial(C):
                dst[i, dst_h, R + c] = src[i, src_h, R + c]

    return rows


def _variant_gpu_lane(rs: RopeScaling, D: int, dtype: str):
    """Macro ``lane(src, src_h, dst, dst_h, i, pos_i, n, d)``: lane ``d < D/2`` of one head of token
    ``i``: rotated pair ``d`` when ``d < R/2``, and the copied dims ``R + d`` and ``R + D/2 + d``."""
    R = rs.rotary_dim
    R2 = R // 2
    D2 = D // 2
    C = D - R

    @macro
    def lane(src, src_h, dst, dst_h, i, pos_i, n_tok, d):
        if d < R2:
            ix = T.meta_var(_pair_index(rs, d))
            y = T.meta_var(
                rope_pair_variant(
                    rs, src[i, src_h, ix[0]], src[i, src_h, ix[1]], ix[0], ix[1], pos_i, n_tok, rope_scale, rope_theta
                )
            )
            dst[i, dst_h, ix[0]] = T.cast(y[0], dtype)
            dst[i, dst_h, ix[1]] = T.cast(y[1], dtype)
        if C > 0:
            if d < C:
                dst[i, dst_h, R + d] = src[i, src_h, R + d]
        if C > D2:
            if d + D2 < C:
                dst[i, dst_h, R + D2 + d] = src[i, src_h, R + D2 + d]

    return lane


def _split_rope_variant(spec: KernelSpec, rs: RopeScaling):
    """``split_rope`` rotating with variant ``rs`` (same signature as :func:`make_split_rope`)."""
    _check_variant(spec, rs)
    H_qo, H_kv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    H = spec.qkv_heads
    D2 = D // 2
    HY = heads_per_block(H, D2)
    HB = (H + HY - 1) // HY
    rows = _variant_cpu_rows(rs, D, dtype)
    lane = _variant_gpu_lane(rs, D, dtype)

    @macro
    def cpu_body():
        for i in T.parallel(n):
            for h in T.serial(H_qo):
                rows(qkv, h, q, h, i, pos[i], n)
            for h in T.serial(H_kv):
                rows(qkv, H_qo + h, k, h, i, pos[i], n)
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
                                lane(qkv, h, q, h, i, pos[i], n, d)
                            elif h < H_qo + H_kv:
                                lane(qkv, h, k, h - H_qo, i, pos[i], n, d)
                            else:
                                v[i, h - H_qo - H_kv, d] = qkv[i, h, d]
                                v[i, h - H_qo - H_kv, d + D2] = qkv[i, h, d + D2]

    return split_rope_func(spec, cpu_body if spec.is_cpu else gpu_body)


def _rope_q_variant(spec: KernelSpec, rs: RopeScaling):
    """``rope_q`` rotating with variant ``rs`` (same signature as :func:`make_rope_q`)."""
    _check_variant(spec, rs)
    H_qo, D, dtype = spec.num_qo_heads, spec.head_dim, spec.dtype
    D2 = D // 2
    HY = heads_per_block(H_qo, D2)
    HB = (H_qo + HY - 1) // HY
    rows = _variant_cpu_rows(rs, D, dtype)
    lane = _variant_gpu_lane(rs, D, dtype)

    @macro
    def cpu_body():
        for i in T.parallel(n):
            for h in T.serial(H_qo):
                rows(q, h, q_out, h, i, q_pos[i], n)

    @macro
    def gpu_body():
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for d in T.thread_binding(D2, thread="threadIdx.x"):
                        h = T.meta_var(hb * HY + hy)
                        if i < n and h < H_qo:
                            lane(q, h, q_out, h, i, q_pos[i], n, d)

    return rope_q_func(spec, cpu_body if spec.is_cpu else gpu_body)


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


def split_rope_append_func(spec: KernelSpec, body, scale=None):
    """The ``split_rope_append`` PrimFunc of ``spec`` around ``body`` (the parameters of
    :func:`make_split_rope` with ``into_pages``, read by name; size ``n``). ``scale``: fp8 pages'
    ``kv_scale`` buffer ``body`` reads (:mod:`tvmkv.tir.fp8`), added after ``pages``."""
    H_qo, H_kv, D, P, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype
    H = spec.qkv_heads
    attrs = func_attrs(spec)

    @T.prim_func(check_well_formed=False)  # checked by with_kv_scale
    def split_rope_append(
        var_qkv: T.handle,
        var_pos: T.handle,
        var_q: T.handle,
        var_pages: T.handle,
        var_slot: T.handle,
        rope_scale: T.float32,
        rope_theta: T.float32,
    ):
        T.func_attr(attrs)
        n = T.int32()
        num_pages = T.int32()
        qkv = T.match_buffer(var_qkv, (n, H, D), dtype)
        pos = T.match_buffer(var_pos, (n,), "int32")
        q = T.match_buffer(var_q, (n, H_qo, D), dtype)
        pages = T.match_buffer(var_pages, (num_pages, 2, H_kv, P, D), spec.page_dtype)
        slot = T.match_buffer(var_slot, (n,), "int32")
        body()

    return with_kv_scale(split_rope_append, scale, 3)


def make_split_rope(
    spec: KernelSpec, *, rotate: bool, rope_scaling: RopeScaling | None = None, into_pages: bool = False
):
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

    With ``rotate`` False (rope modes "none" and "inline") the kernel only splits. ``rope_scaling``
    (resolved, see the module docstring): rotate with that variant instead of the default RoPE.

    ``into_pages`` gives ``split_rope_append(qkv, pos, q, pages, slot, rope_scale, rope_theta)``, split,
    rotate and :func:`tvmkv.tir.append.make_append` in one kernel: q as above, and token ``i``'s
    (rotated) k and its v written straight into ``pages`` ``[num_pages, 2, H_kv, P, D]`` at ``slot[i]``
    (skipped where ``slot[i] < 0``), for the forwards whose attention reads K/V from the pages (one
    launch less per layer). Default RoPE only. With fp8 pages ``kv_scale [2, H_kv]`` follows ``pages``
    and k / v are stored quantized as ``append`` stores them.
    """
    if into_pages and rope_scaling is not None:
        raise ValueError("into_pages with a rope_scaling variant: use split_rope + append for RoPE variants")
    if rotate and rope_scaling is not None:
        return _split_rope_variant(spec, rope_scaling)
    P = spec.page_size
    H_qo, H_kv, D, dtype = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.dtype
    H = spec.qkv_heads
    D2 = D // 2
    V = copy_vector(spec.dtype, D2)  # elements of each half a cuda thread moves (one vector access)
    HY = heads_per_block(H, D2 // V)
    HB = (H + HY - 1) // HY

    scale = kv_scale_buffer(spec) if into_pages else None  # fp8 pages: stored quantized
    lanes = store_lanes(spec, quantizes=into_pages)

    @macro
    def put_kv(kv, i, hk, d, value):
        # element d of kv head hk of token i (kv: 0 = k, 1 = v, a Python int): into the scratch k / v,
        # or (into_pages) at the token's slot, skipped where the slot is negative
        if into_pages:
            if slot[i] >= 0:
                pages[slot[i] // P, kv, hk, slot[i] % P, d] = page_code(spec, value, scale, kv, hk)
        elif kv == 0:
            k[i, hk, d] = value
        else:
            v[i, hk, d] = value

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
                        put_kv(0, i, h, d, T.cast(y[0], dtype))
                        put_kv(0, i, h, d + D2, T.cast(y[1], dtype))
                    else:
                        put_kv(0, i, h, d, qkv[i, H_qo + h, d])
                        put_kv(0, i, h, d + D2, qkv[i, H_qo + h, d + D2])
                for d in T.vectorized(D):
                    put_kv(1, i, h, d, qkv[i, H_qo + H_kv + h, d])

    @macro
    def gpu_body():
        for i in T.thread_binding(T.max(n, 1), thread="blockIdx.x"):  # max: no empty grid when n == 0
            for hb in T.thread_binding(HB, thread="blockIdx.y"):
                for hy in T.thread_binding(HY, thread="threadIdx.y"):
                    for c in T.thread_binding(D2 // V, thread="threadIdx.x"):
                        for e in lanes(V):
                            d = T.meta_var(c * V + e)
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
                                        put_kv(0, i, h - H_qo, d, T.cast(y[0], dtype))
                                        put_kv(0, i, h - H_qo, d + D2, T.cast(y[1], dtype))
                                    else:
                                        put_kv(0, i, h - H_qo, d, qkv[i, h, d])
                                        put_kv(0, i, h - H_qo, d + D2, qkv[i, h, d + D2])
                                else:
                                    put_kv(1, i, h - H_qo - H_kv, d, qkv[i, h, d])
                                    put_kv(1, i, h - H_qo - H_kv, d + D2, qkv[i, h, d + D2])

    if into_pages:
        return split_rope_append_func(spec, cpu_body if spec.is_cpu else gpu_body, scale)
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


def make_rope_q(spec: KernelSpec, *, rotate: bool, rope_scaling: RopeScaling | None = None):
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
    attention kernels rotate q themselves) only copy. ``rope_scaling``: as :func:`make_split_rope`.
    """
    if rotate and rope_scaling is not None:
        return _rope_q_variant(spec, rope_scaling)
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
