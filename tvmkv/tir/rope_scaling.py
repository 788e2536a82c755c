"""The RoPE variant of a cache: TVM's ``rope_scaling`` dict and a partial ``rotary_dim``, validated.

:class:`RopeScaling` describes how ``split_rope`` and ``rope_q`` rotate (rope mode "normal") beyond the
default ``angle = pos * rope_scale / rope_theta ** (2 i / D)``: the rotated pairs (rotate-half or
gptj's interleaved pairs), how many leading dims of a head rotate (``rotary_dim``), the frequency of
each rotated dim and a magnitude factor, **as TVM's** ``relax/frontend/nn/llm/position_embedding.py``
**applies them** in ``llama_rope_with_position_map`` (the split kernel of TVM's ``PagedKVCache``).
The formulas, and where they differ from Hugging Face's ``modeling_rope_utils``, are in
docs/layout.md ("RoPE"). Plain Python and NumPy, no TVM import: the kernels
(:mod:`tvmkv.tir.rope`) read the fields, :meth:`RopeScaling.inv_freq` is the NumPy statement of the
frequencies, and the variant is part of the build key (:class:`tvmkv.build.BuildKey`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace

import numpy as np

ROPE_TYPES = ("default", "gptj", "llama3", "llama4", "longrope", "yarn")

# keys each rope_type needs in the dict (TVM reads them unconditionally); optional ones after
_REQUIRED = {
    "default": (),
    "gptj": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "llama4": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("max_position_embeddings", "original_max_position_embeddings"),
    "yarn": ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings"),
}
_OPTIONAL = {"longrope": ("long_factor", "short_factor"), "yarn": ("inv_theta_log_scale",)}
_INT_KEYS = ("original_max_position_embeddings", "max_position_embeddings")


class RopeScalingError(ValueError):
    """A ``rope_scaling`` dict or ``rotary_dim`` that tvmkv (and TVM) cannot apply."""


def _number(rope_type: str, key: str, value, *, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RopeScalingError(f"rope_scaling[{key!r}]={value!r} ({rope_type}) must be a number")
    if not (math.isfinite(value) and value > 0):
        raise RopeScalingError(f"rope_scaling[{key!r}]={value!r} ({rope_type}) must be a positive finite number")
    if integer:
        if int(value) != value:
            raise RopeScalingError(f"rope_scaling[{key!r}]={value!r} ({rope_type}) must be an integer")
        return int(value)
    return float(value)


def _factors(key: str, value) -> tuple:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or not np.all(arr > 0):
        raise RopeScalingError(
            f"rope_scaling[{key!r}] must be a non-empty list of positive finite floats, got {value!r}"
        )
    return tuple(float(np.float32(x)) for x in arr)  # the kernels hold them as float32, as TVM's tensor does


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE variant (frozen; compare and hash it like the build key it is part of).

    Build it with :meth:`from_dict` from TVM's / Hugging Face's ``rope_scaling`` dict, or
    :meth:`parse` (``None``, a dict or a ``RopeScaling``). Fields a ``rope_type`` does not use are None.

    Parameters
    ----------
    rope_type : str
        One of :data:`ROPE_TYPES`. "default": rotate-half at ``1 / theta ** (2 i / R)``; "gptj": the
        same frequencies on interleaved pairs ``(2 i, 2 i + 1)``; "llama3", "llama4", "longrope",
        "yarn": TVM's scaled frequencies (docs/layout.md, "RoPE").
    rotary_dim : int, optional
        ``R``: only dims ``0 .. R-1`` of each head rotate (the rest are copied); even, ``<= head_dim``.
        None: the whole head (resolved by :meth:`resolved`).
    factor, low_freq_factor, high_freq_factor : float, optional
        llama3 / llama4 (``factor`` also yarn's).
    original_max_position_embeddings, max_position_embeddings : int, optional
        llama3 / llama4 / yarn / longrope; ``max_position_embeddings`` longrope only.
    beta_fast, beta_slow, inv_theta_log_scale : float, optional
        yarn; ``inv_theta_log_scale`` None: ``1 / (2 ln rope_theta)`` of the cache's ``rope_theta``.
    long_factor, short_factor : tuple of float, optional
        longrope's extension factors, ``R / 2`` each (float32 values). They may come later than the
        dict (TVM passes them as a tensor at cache creation): :meth:`with_ext_factors`.
    """

    rope_type: str = "default"
    rotary_dim: int | None = None
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    inv_theta_log_scale: float | None = None
    long_factor: tuple | None = None
    short_factor: tuple | None = None

    def __post_init__(self):
        t = self.rope_type
        if t not in ROPE_TYPES:
            raise RopeScalingError(
                f"rope_type={t!r} is not supported; tvmkv (like TVM's PagedKVCache) applies {ROPE_TYPES}"
                + (" (for 'linear' pass rope_scale=1/factor instead)" if t == "linear" else "")
            )
        used = set(_REQUIRED[t]) | set(_OPTIONAL.get(t, ()))
        for key in _REQUIRED[t]:
            if getattr(self, key) is None:
                raise RopeScalingError(f"rope_type={t!r} needs rope_scaling[{key!r}]; it is missing")
        for key in _REQUIRED["llama3"] + _REQUIRED["longrope"] + _REQUIRED["yarn"] + _OPTIONAL["yarn"]:
            value = getattr(self, key)
            if value is None:
                continue
            if key not in used:
                raise RopeScalingError(f"{key}={value!r} does not apply to rope_type={t!r}")
            object.__setattr__(self, key, _number(t, key, value, integer=key in _INT_KEYS))
        for key in _OPTIONAL["longrope"]:
            value = getattr(self, key)
            if value is not None:
                if t != "longrope":
                    raise RopeScalingError(f"{key} does not apply to rope_type={t!r}")
                object.__setattr__(self, key, _factors(key, value))
        if (self.long_factor is None) != (self.short_factor is None):
            raise RopeScalingError("longrope needs both long_factor and short_factor (or neither, given later)")
        if t == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise RopeScalingError(
                f"llama3: high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
                f"{self.low_freq_factor} (TVM divides by their difference; equal factors: use rope_type 'llama4')"
            )
        if t == "llama4" and self.high_freq_factor < self.low_freq_factor:
            raise RopeScalingError(
                f"llama4: high_freq_factor={self.high_freq_factor} must be >= low_freq_factor={self.low_freq_factor}"
            )
        if self.rotary_dim is not None:
            r = self.rotary_dim
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r <= 0 or r % 2:
                raise RopeScalingError(f"rotary_dim={r!r} must be a positive even int (dims rotate in pairs)")
            object.__setattr__(self, "rotary_dim", int(r))
            half = r // 2
            for key in _OPTIONAL["longrope"]:
                value = getattr(self, key)
                if value is not None and len(value) != half:
                    raise RopeScalingError(
                        f"{key} has {len(value)} factors; rotary_dim={r} needs {half} (rotary_dim / 2)"
                    )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, rope_scaling: dict | None, *, rotary_dim: int | None = None) -> RopeScaling:
        """Parse TVM's / Hugging Face's ``rope_scaling`` dict (None or ``{}``: the default RoPE).

        ``rope_type`` missing or "default" is the default RoPE (as TVM); keys a type does not read are
        ignored (HF's dicts carry ``rope_theta``, ``attention_factor`` ...; TVM ignores them too, see
        docs/layout.md "RoPE"). Raises :class:`RopeScalingError` for an unknown ``rope_type`` and a
        missing or invalid key.
        """
        if rope_scaling is None:
            return cls(rotary_dim=rotary_dim)
        if not isinstance(rope_scaling, dict):
            raise RopeScalingError(
                f"rope_scaling must be a dict (TVM's rope_scaling) or None, not {type(rope_scaling).__name__}"
            )
        if "rope_type" not in rope_scaling and "type" in rope_scaling:
            raise RopeScalingError(
                f"rope_scaling has 'type'={rope_scaling['type']!r} but no 'rope_type'; TVM reads 'rope_type' only "
                "(and would silently apply the default RoPE): rename the key"
            )
        t = rope_scaling.get("rope_type", "default")
        if t not in ROPE_TYPES:
            cls(rope_type=t)  # raises the named error
        keys = _REQUIRED[t] + _OPTIONAL.get(t, ())
        return cls(rope_type=t, rotary_dim=rotary_dim, **{k: rope_scaling[k] for k in keys if k in rope_scaling})

    @classmethod
    def parse(cls, rope_scaling, *, rotary_dim: int | None = None) -> RopeScaling:
        """``rope_scaling`` (None, a dict or a RopeScaling) with ``rotary_dim`` (None: keep its own)."""
        if isinstance(rope_scaling, RopeScaling):
            if rotary_dim is None or rotary_dim == rope_scaling.rotary_dim:
                return rope_scaling
            if rope_scaling.rotary_dim is not None:
                raise RopeScalingError(
                    f"rotary_dim={rotary_dim!r} contradicts the RopeScaling's rotary_dim={rope_scaling.rotary_dim}"
                )
            return replace(rope_scaling, rotary_dim=rotary_dim)
        return cls.from_dict(rope_scaling, rotary_dim=rotary_dim)

    def resolved(self, head_dim: int) -> RopeScaling:
        """This variant with ``rotary_dim`` fixed for ``head_dim`` (None -> head_dim); checks it fits."""
        r = head_dim if self.rotary_dim is None else self.rotary_dim
        if r > head_dim:
            raise RopeScalingError(f"rotary_dim={r} exceeds head_dim={head_dim}; use rotary_dim <= head_dim")
        return self if r == self.rotary_dim else replace(self, rotary_dim=r)

    def with_ext_factors(self, ext_factors) -> RopeScaling:
        """longrope with TVM's ``rope_ext_factors`` tensor ``[rotary_dim]`` float32 (long factors, then
        short ones; any array-like). Raises if this is not longrope or the dict's factors differ."""
        if self.rope_type != "longrope":
            raise RopeScalingError(
                f"rope_ext_factors were given but rope_type={self.rope_type!r}; TVM applies them with "
                "rope_type 'longrope' only (pass that rope_scaling dict)"
            )
        ext = np.asarray(ext_factors, dtype=np.float32).reshape(-1)
        if ext.size % 2:
            raise RopeScalingError(f"rope_ext_factors has {ext.size} values; it holds long then short factors (even)")
        if self.rotary_dim is not None and ext.size != self.rotary_dim:
            raise RopeScalingError(
                f"rope_ext_factors has {ext.size} values; rotary_dim={self.rotary_dim} needs as many"
            )
        half = ext.size // 2
        new = replace(self, long_factor=tuple(ext[:half].tolist()), short_factor=tuple(ext[half:].tolist()))
        if self.long_factor is not None and (new.long_factor, new.short_factor) != (
            self.long_factor,
            self.short_factor,
        ):
            raise RopeScalingError("rope_ext_factors differ from the rope_scaling dict's long_factor/short_factor")
        return new

    # ------------------------------------------------------------------ properties
    @property
    def interleaved(self) -> bool:
        """gptj: pairs ``(2 i, 2 i + 1)``; else rotate-half pairs ``(i, i + R/2)``."""
        return self.rope_type == "gptj"

    @property
    def magnitude(self) -> float:
        """Factor on cos and sin (TVM applies one for longrope only; yarn's HF attention factor is not
        applied by TVM): longrope ``sqrt(1 + ln s / ln L)`` with ``s = max/original max position
        embeddings`` when ``s > 1``, else 1."""
        if self.rope_type != "longrope":
            return 1.0
        s = self.max_position_embeddings / self.original_max_position_embeddings
        return math.sqrt(1 + math.log(s) / math.log(self.original_max_position_embeddings)) if s > 1.0 else 1.0

    def is_default(self, head_dim: int) -> bool:
        """The plain RoPE over the whole head (what tvmkv's kernels applied before variants)."""
        return self.rope_type == "default" and self.rotary_dim in (None, head_dim)

    def to_dict(self) -> dict:
        """The fields that are set (``rope_type`` and ``rotary_dim`` always), JSON-ready."""
        out = {"rope_type": self.rope_type, "rotary_dim": self.rotary_dim}
        for key in _REQUIRED["llama3"] + _REQUIRED["longrope"] + _REQUIRED["yarn"] + _OPTIONAL["yarn"]:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.long_factor is not None:
            out["long_factor"], out["short_factor"] = list(self.long_factor), list(self.short_factor)
        return out

    @property
    def tag(self) -> str:
        """Short readable name for build artifacts: ``<type>[-r<R>][-<digest of the parameters>]``."""
        parts = [self.rope_type]
        if self.rotary_dim is not None:
            parts.append(f"r{self.rotary_dim}")
        params = {k: v for k, v in self.to_dict().items() if k not in ("rope_type", "rotary_dim")}
        if params:
            parts.append(hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:8])
        return "-".join(parts)

    # ------------------------------------------------------------------ the frequencies (NumPy)
    def inv_freq(self, rope_theta: float, *, head_dim: int | None = None, num_tokens: int = 1) -> np.ndarray:
        """Frequency of each rotated dim ``[R]`` (fp64): dim ``d`` rotates by ``pos * rope_scale * f[d]``.

        Element-wise, as TVM computes it: the two dims of a pair share one frequency except in TVM's
        llama4 (rotate-half pairs with the interleaved frequency index ``d // 2``) and yarn (the ramp
        at dim ``d``, not at the pair index, for ``d >= R/2``); docs/layout.md "RoPE". ``num_tokens``:
        longrope takes the long factors iff the call holds more tokens than
        ``original_max_position_embeddings`` (TVM's rule). ``head_dim`` resolves ``rotary_dim`` None.
        """
        r = self.rotary_dim if self.rotary_dim is not None else head_dim
        if r is None:
            raise RopeScalingError("rotary_dim is None: pass head_dim")
        d = np.arange(r, dtype=np.float64)
        t = self.rope_type
        pair = np.floor(d / 2) if t in ("gptj", "llama4") else np.mod(d, r // 2)
        base = float(rope_theta) ** (2.0 * pair / r)  # theta ** exponent
        if t in ("default", "gptj"):
            return 1.0 / base
        if t in ("llama3", "llama4"):
            orig = 1.0 / base
            if t == "llama4" and self.high_freq_factor == self.low_freq_factor:
                wavelen = 2 * math.pi / orig
                return np.where(
                    wavelen > self.original_max_position_embeddings / self.low_freq_factor, orig / self.factor, orig
                )
            inv_diff = 1.0 / (self.high_freq_factor - self.low_freq_factor)
            alpha = self.original_max_position_embeddings / (2 * math.pi) * inv_diff
            smooth = np.clip(alpha * orig - self.low_freq_factor * inv_diff, 0.0, 1.0)
            return (1.0 - smooth) * orig / self.factor + smooth * orig
        if t == "longrope":
            if self.long_factor is None:
                raise RopeScalingError("longrope without long_factor/short_factor: give them (with_ext_factors)")
            use_long = num_tokens > self.original_max_position_embeddings
            ext = np.asarray(self.long_factor if use_long else self.short_factor, np.float64)
            return 1.0 / (ext[np.mod(np.arange(r), r // 2)] * base)
        # yarn
        low, high = self.yarn_range(rope_theta, r)
        mask = 1.0 - np.clip((d - low) / (high - low), 0.0, 1.0)
        return (1.0 / (self.factor * base)) * (1.0 - mask) + (1.0 / base) * mask

    def yarn_range(self, rope_theta: float | None, rotary_dim: int) -> tuple:
        """yarn's correction range ``(low, high)`` as TVM computes it (no floor/ceil; ``high`` nudged
        by 0.001 when equal). ``rope_theta`` is read only when ``inv_theta_log_scale`` is None."""
        if self.inv_theta_log_scale is not None:
            s = self.inv_theta_log_scale
        elif rope_theta is None:
            raise RopeScalingError("yarn without inv_theta_log_scale needs rope_theta")
        else:
            s = 1.0 / (2 * math.log(rope_theta))
        L = self.original_max_position_embeddings
        low = max(rotary_dim * math.log(L / (self.beta_fast * 2 * math.pi)) * s, 0.0)
        high = min(rotary_dim * math.log(L / (self.beta_slow * 2 * math.pi)) * s, rotary_dim - 1.0)
        return low, high + 0.001 if low == high else high


def kernel_variant(rope_scaling, head_dim: int, rope_mode: str, rotary_dim: int | None = None) -> RopeScaling | None:
    """The variant ``split_rope``/``rope_q`` bake for a cache: ``rope_scaling`` (None, dict or
    RopeScaling) with ``rotary_dim`` resolved for ``head_dim``; None when the kernels are the default
    ones (default RoPE over the whole head, or rope mode "none", which rotates nothing).

    Raises :class:`RopeScalingError` for an invalid variant and NotImplementedError for a non-default
    one with rope mode "inline" (the attention kernels rotate with the default RoPE only).
    """
    rs = RopeScaling.parse(rope_scaling, rotary_dim=rotary_dim).resolved(head_dim)
    if rs.is_default(head_dim) or rope_mode == "none":
        return None
    if rope_mode == "inline":
        raise NotImplementedError(
            f"rope_scaling {rs.rope_type} with rotary_dim={rs.rotary_dim} (head_dim {head_dim}) and "
            "rope_mode='inline': tvmkv's attention kernels rotate with the default RoPE over the whole head "
            "only; use rope_mode='normal' (K stored rotated by split_rope, which applies the variant)"
        )
    if rs.rope_type == "longrope" and rs.long_factor is None:
        raise RopeScalingError(
            "rope_type 'longrope' needs its extension factors: long_factor and short_factor in the rope_scaling "
            "dict, or TVM's rope_ext_factors tensor (RopeScaling.with_ext_factors; the drop-in takes it from "
            "the create call)"
        )
    return rs
