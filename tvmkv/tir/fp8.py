"""fp8 pages: how kernels write and read pages of ``float8_e4m3fn`` / ``float8_e5m2`` (docs/layout.md,
"fp8 pages").

A page element holds ``quantize(x / s)`` for the token's value ``x`` (computed in fp32) and the scale
``s = kv_scale[kv, hk]`` of its layer, K or V (``kv`` 0 or 1) and KV head; reading it gives
``dequantize(code) * s``. Quantization rounds to nearest (ties to even) and saturates at the format's
largest finite value (448 for e4m3fn, 57344 for e5m2): a value beyond it (infinity too) is stored as
that value, never as infinity; NaN is stored as NaN (code 0x7F), as with 16-bit pages.

Attention kernels never multiply a key or a value by its scale: ``q . (s_k k) = (s_k q) . k``, so
the K scale joins ``sm_scale`` where q is loaded, and ``sum_j p_j (s_v v_j) = s_v sum_j p_j v_j``, so
the V scale multiplies the output once (both exact up to fp32 rounding; the log-sum-exp is unchanged).

Targets: cuda converts with the hardware instructions (``cvt`` of sm_89 / sm_90, through TVM's cast).
llvm converts with integer arithmetic on the fp32 bits (below): TVM 0.27's software cast maps 0 and
subnormals to wrong codes, while this one agrees bit for bit with ``ml_dtypes`` over the whole range.

The kernels take the scales as one more argument, ``kv_scale [2, H_kv] float32`` right after
``pages``: a factory declares the buffer with :func:`kv_scale_buffer`, its body reads it through the
helpers here, and :func:`with_kv_scale` adds it to the finished PrimFunc's parameters.
"""

from __future__ import annotations

import struct

from tvm import tirx
from tvm.script import tirx as T

from ._kernel_common import macro
from .spec import KernelSpec

# format -> (mantissa bits, exponent bias, largest finite value)
FORMATS = {"float8_e4m3fn": (3, 7, 448.0), "float8_e5m2": (2, 15, 57344.0)}
# cuda (sm_89 / sm_90): the instruction converting two codes (a uint16, low byte first) into two fp16
# (a uint32, low half first), exact: the kernels that read many codes convert them in pairs
PAIR_TO_HALF2 = {"float8_e4m3fn": "cvt.rn.f16x2.e4m3x2", "float8_e5m2": "cvt.rn.f16x2.e5m2x2"}
# ... and two fp32 into two codes (upper byte from the first operand): round to nearest even,
# saturating, NaN kept, as :func:`quantize` (the kernels that store many codes quantize in pairs)
FLOAT2_TO_PAIR = {"float8_e4m3fn": "cvt.rn.satfinite.e4m3x2.f32", "float8_e5m2": "cvt.rn.satfinite.e5m2x2.f32"}


def code_pair_at(spec: KernelSpec, page, kv: int, h, pos, pair):
    """Index of code pair ``pair`` (elements ``2 pair``, ``2 pair + 1``) of K (``kv`` 0) or V (1) of KV
    head ``h`` at slot ``pos`` of page ``page``, in the page pool seen as a flat ``uint16`` buffer (how
    the kernels that quantize in pairs store them: ``T.decl_buffer((1,), "uint16", data=pages.data)``)."""
    H, P, D = spec.num_kv_heads, spec.page_size, spec.head_dim
    return (((page * 2 + kv) * H + h) * P + pos) * (D // 2) + pair


def widen_pair(page_dtype: str, dtype: str):
    """A macro ``(dst, codes, f2)``: ``dst`` (uint32) = the two fp8 codes ``codes`` (uint16, low byte
    first) as a pair of ``dtype`` (float16 / bfloat16; low half first), exact (every fp8 value is a
    value of both); ``f2`` is a float32 [2] scratch buffer (bf16 goes through fp16 and fp32). cuda
    sm_89 / sm_90."""

    @macro
    def widen(dst, codes, f2):
        T.ptx[PAIR_TO_HALF2[page_dtype]](dst, codes)
        if dtype == "bfloat16":  # fp16 pair -> bf16 pair
            f2[0] = T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", dst >> T.uint32(16))))
            f2[1] = T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", dst & T.uint32(0xFFFF))))
            T.ptx["cvt.rn.bf16x2.f32"](dst, f2[0], f2[1])  # hi, lo

    return widen


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def quantize(x, fmt: str, cpu: bool):
    """fp8 code (dtype ``fmt``) of the fp32 expression ``x``: round to nearest even, saturating; NaN
    stays NaN (code 0x7F)."""
    mant, bias, largest = FORMATS[fmt]
    nan = T.isnan(x)
    x = T.if_then_else(nan, x, T.max(T.min(x, T.float32(largest)), T.float32(-largest)))
    if not cpu:
        return T.Cast(fmt, x)
    drop = 23 - mant  # fp32 mantissa bits the code does not keep
    bits = T.reinterpret("uint32", x)
    mag = bits & T.uint32(0x7FFFFFFF)
    sign = (bits >> T.uint32(24)) & T.uint32(0x80)
    # normal range: round the fp32 bits to ``mant`` mantissa bits (ties to even), rebias the exponent
    rounded = (mag + T.uint32((1 << (drop - 1)) - 1) + ((mag >> T.uint32(drop)) & T.uint32(1))) >> T.uint32(drop)
    normal = rounded - T.uint32((127 - bias) << mant)
    # subnormal range: adding C, whose fp32 spacing is the code's subnormal step 2^(1 - bias - mant),
    # rounds |x| to that step (ties to even); the bits above C's count the steps, which is the code
    # (a count of 2^mant steps is the smallest normal, whose code is the same number)
    c = 2.0 ** (1 - bias - mant + 23)
    sub = T.reinterpret("uint32", T.reinterpret("float32", mag) + T.float32(c)) - T.uint32(_f32_bits(c))
    code = T.if_then_else(mag < T.uint32(_f32_bits(2.0 ** (1 - bias))), sub, normal)
    code = T.if_then_else(nan, T.uint32(0x7F), code)
    return T.reinterpret(fmt, T.Cast("uint8", code | sign))


def dequantize(code, fmt: str, cpu: bool):
    """fp32 value of the fp8 ``code`` (exact: every fp8 value is an fp32 value; NaN codes give NaN,
    e5m2's infinities infinity)."""
    if not cpu:
        return T.Cast("float32", code)
    mant, bias, _ = FORMATS[fmt]
    u = T.Cast("uint32", T.reinterpret("uint8", code))
    # the code's exponent and mantissa bits moved to fp32's places: a number 2^(127 - bias) too small
    # (a subnormal code becomes an fp32 subnormal with the same ratio), then scaled back
    mag = T.reinterpret("float32", (u & T.uint32(0x7F)) << T.uint32(23 - mant)) * T.float32(2.0 ** (127 - bias))
    if fmt == "float8_e4m3fn":  # one NaN (all bits but the sign set), no infinity
        mag = T.if_then_else((u & T.uint32(0x7F)) == T.uint32(0x7F), T.float32(float("nan")), mag)
    else:  # e5m2: exponent all ones is infinity (mantissa 0) or NaN
        mag = T.if_then_else((u & T.uint32(0x7F)) >= T.uint32(0x7C), T.float32(float("inf")), mag)
        mag = T.if_then_else((u & T.uint32(0x7F)) > T.uint32(0x7C), T.float32(float("nan")), mag)
    return T.if_then_else(u >= T.uint32(0x80), -mag, mag)


def store_lanes(spec: KernelSpec, quantizes: bool = True):
    """The loop kind of a data-movement kernel's innermost loop that stores into the pages:
    ``T.vectorized``, but ``T.serial`` where it quantizes on cuda (TVM has no vector conversions to
    fp8 there; each element is converted on its own)."""
    return T.serial if quantizes and spec.fp8_pages and not spec.is_cpu else T.vectorized


def kv_scale_buffer(spec: KernelSpec):
    """The ``kv_scale [2, H_kv] float32`` buffer a kernel of ``spec`` reads (None without fp8 pages)."""
    if not spec.fp8_pages:
        return None
    return tirx.decl_buffer((2, spec.num_kv_heads), "float32", name="kv_scale")


def with_kv_scale(func, scale, after: int, *, check: bool = True):
    """``func`` with the buffer ``scale`` inserted as a parameter after parameter ``after`` (the pages),
    checked well formed (its body, parsed with the buffer from a closure and
    ``check_well_formed=False``, is well formed once the buffer is a parameter; ``check=False``: the
    caller checks, having added parameters of its own). ``scale`` None: ``func`` as it is, checked."""
    if scale is not None:
        params = list(func.params)
        func = tirx.PrimFunc(params[: after + 1] + [scale] + params[after + 1 :], func.body, func.ret_type, func.attrs)
    if check:
        tirx.analysis.verify_well_formed(func)
    return func


def page_value(spec: KernelSpec, element):
    """fp32 value of a page ``element`` before its scale: the element itself, or its fp8 decoding."""
    if spec.fp8_pages:
        return dequantize(element, spec.page_dtype, spec.is_cpu)
    return T.Cast("float32", element)


def page_code(spec: KernelSpec, x, scale, kv: int, hk):
    """What a page stores for the value ``x`` (any float dtype) of K (``kv`` 0) or V (1) of KV head
    ``hk``: ``x`` itself, or its fp8 code under ``scale[kv, hk]`` (``scale``: :func:`kv_scale_buffer`)."""
    return page_code_under(spec, x, scale[kv, hk] if spec.fp8_pages else None)


def page_code_under(spec: KernelSpec, x, scale_value):
    """:func:`page_code` with the scale given as a value (e.g. loaded into a register ahead of its use)."""
    if spec.fp8_pages:
        return quantize(T.Cast("float32", x) / scale_value, spec.page_dtype, spec.is_cpu)
    return x


def zero(dtype: str):
    """The constant 0 of ``dtype``; for fp8 the all-zero code (TVM 0.27's llvm cast of 0 to fp8 is not 0)."""
    if dtype in FORMATS:
        return T.reinterpret(dtype, T.uint8(0))
    return T.cast(0, dtype)


def times_key_scale(x, scale, hk):
    """``x`` (a query's scale factor) times KV head ``hk``'s K scale; ``x`` itself when ``scale`` is
    None (no fp8 pages, or keys that were never quantized)."""
    return x if scale is None else x * scale[0, hk]


def times_value_scale(x, scale, hk):
    """``x`` (an output value) times KV head ``hk``'s V scale; ``x`` itself when ``scale`` is None."""
    return x if scale is None else x * scale[1, hk]
