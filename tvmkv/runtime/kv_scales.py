"""The fp8 page scales of a cache's layers (docs/layout.md, "fp8 pages"): given, set, or calibrated
from the first tokens appended.

Each layer has a ``kv_scale [2, H_kv]`` float32 tensor on the cache's device (row 0: K, row 1: V),
passed to every kernel that reads or writes its pages; a stored element is ``quantize(x / scale)``.
:class:`KvScales` owns those tensors and a host copy of them (reads never wait for the device), checks
scales a caller gives, and keeps the calibration state.

**Calibration** (``calibrate=N``): the scales are learned from the K/V of the first ``N`` tokens
appended (every forward that begins before ``N`` tokens were appended counts, whole). For each layer
and KV head the scale is ``HEADROOM * amax / largest``, ``amax`` the largest magnitude seen so far
(K as stored: rotated under rope_mode "normal") and ``largest`` the format's largest finite value (448
for e4m3fn, 57344 for e5m2); ``HEADROOM`` leaves room for later tokens a little larger than the
calibration tokens before they saturate. When a later calibration forward raises a scale, the codes
already stored under the smaller one are re-encoded under the new one (one more rounding of those
tokens; the cache runs ``requantize_pages``). After ``N`` tokens the scales are fixed; a head whose
calibration K or V were all zeros then gets the default scale 1.0. Codes imported into a calibrating
cache (checkpoints, transfers) are stored under its scales of the moment, which from then on only grow.
Non-finite K/V in a calibrating forward are refused (ValueError). This module decides; the cache
launches.
"""

from __future__ import annotations

import numpy as np

from ..config import CacheConfig

HEADROOM = 2.0  # calibrated scale = HEADROOM * amax / largest (one binade of room above the amax seen)
_LARGEST = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
FLOOR = float(2.0**-100)  # the scale of a head whose calibration tokens are all zero so far (a normal float32)


def adoptable(scales) -> np.ndarray:
    """``scales`` (float32, any shape) with a calibration's floor (a head that saw only zeros so far,
    whose codes are all zero) replaced by the default 1.0: what another cache taking them over (an
    import, a transfer) should set, never the floor itself."""
    scales = np.asarray(scales, np.float32)
    return np.where(scales == np.float32(FLOOR), np.float32(1.0), scales).astype(np.float32)


class KvScales:
    """Per-layer fp8 scales of one cache: device tensors (``tensors[layer]``), a host copy, and the
    calibration of ``calibrate`` tokens (0: none)."""

    def __init__(self, config: CacheConfig, device, calibrate: int = 0):
        import tvm

        self.config = config
        ones = np.ones((2, config.num_kv_heads), np.float32)
        self.tensors = [tvm.runtime.tensor(ones, device) for _ in range(config.num_layers)]
        self._host = [ones.copy() for _ in range(config.num_layers)]
        self.calibrate = calibrate
        self.seen = 0  # tokens appended while calibrating
        self._fixed = [calibrate == 0] * config.num_layers  # layers whose scales calibration leaves alone
        self._stored = [False] * config.num_layers  # calibrating layers holding codes under their scales

    # ---------------------------------------------------------------- reading and setting
    def get(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s scales, a float32 ``[2, H_kv]`` copy."""
        return self._host[layer].copy()

    def snapshot(self) -> list:
        """Every layer's scales (copies), to convert codes stored now if the scales change later."""
        return [h.copy() for h in self._host]

    def set(self, layer: int, scales: np.ndarray, *, fixed: bool = True) -> None:
        """Make ``scales`` (float32 ``[2, H_kv]``, checked) layer ``layer``'s; ``fixed``: calibration
        no longer changes them."""
        self.tensors[layer].copyfrom(scales)
        self._host[layer] = scales.copy()
        self._fixed[layer] = self._fixed[layer] or fixed

    def row(self, value, name: str) -> np.ndarray:
        """``value`` (a float or ``[H_kv]`` of them) as float32 ``[H_kv]``: positive, finite, normal."""
        H = self.config.num_kv_heads
        row = _float64(value, f"{name}={value!r} is not a float or an array of {H} floats")
        if row.ndim == 0:
            row = np.full(H, float(row))
        if row.shape != (H,):
            raise ValueError(f"{name} has shape {row.shape}; pass one float or {H} (num_kv_heads) of them")
        bad = ~(np.isfinite(row) & (row > 0))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{name}[{i}]={row[i]!r}: every scale must be positive and finite")
        small = row < np.finfo(np.float32).tiny
        if small.any():
            i = int(np.flatnonzero(small)[0])
            raise ValueError(f"{name}[{i}]={row[i]!r} is below float32's smallest normal: use a larger scale")
        big = row > np.finfo(np.float32).max
        if big.any():
            i = int(np.flatnonzero(big)[0])
            raise ValueError(f"{name}[{i}]={row[i]!r} is above float32's largest value: use a smaller scale")
        return row.astype(np.float32)

    def table(self, value, name: str) -> np.ndarray:
        """``value``, ``[num_layers, 2, H_kv]`` or one ``[2, H_kv]`` for every layer, as float32
        ``[num_layers, 2, H_kv]`` (each row checked by :meth:`row`)."""
        cfg = self.config
        arr = _float64(value, f"{name}={value!r} is not an array of floats")
        want = ((cfg.num_layers, 2, cfg.num_kv_heads), (2, cfg.num_kv_heads))
        if arr.shape not in want:
            raise ValueError(
                f"{name} has shape {arr.shape}; pass [num_layers, 2, num_kv_heads] = {want[0]} or one "
                f"[2, num_kv_heads] = {want[1]} for every layer"
            )
        per_layer = np.broadcast_to(arr, want[0])
        return np.stack(
            [
                np.stack([self.row(per_layer[layer, kv], f"{name}[{layer}, {kv}]") for kv in (0, 1)])
                for layer in range(cfg.num_layers)
            ]
        )

    # ---------------------------------------------------------------- calibration
    def start_calibration(self, tokens: int) -> None:
        """Calibrate every layer's scales from the first ``tokens`` tokens appended (the cache starts it
        at construction, before any token is stored)."""
        self.calibrate, self.seen = tokens, 0
        self._fixed = [False] * len(self._fixed)
        self._stored = [False] * len(self._stored)

    @property
    def calibrating(self) -> bool:
        """Whether forwards still calibrate (fewer than ``calibrate`` tokens appended so far)."""
        return self.seen < self.calibrate and not all(self._fixed)

    def calibrates(self, layer: int) -> bool:
        """Whether layer ``layer``'s attention call of the open forward calibrates its scales."""
        return self.calibrating and not self._fixed[layer]

    def observe(self, layer: int, amax: np.ndarray):
        """Take the largest magnitudes ``amax`` (float32 ``[2, H_kv]``, finite) of layer ``layer``'s
        new K/V (as stored) into its scales. Returns the scales the layer's stored codes were written
        under when they must be re-encoded (a scale grew over stored codes), else None."""
        cur = self._host[layer]
        stored = self._stored[layer]
        want = np.maximum(amax.astype(np.float64) * HEADROOM / _LARGEST[self.config.page_dtype], FLOOR)
        if stored:  # scales only grow once codes are stored under them
            want = np.maximum(want, cur)
        new = want.astype(np.float32)
        self._stored[layer] = True
        if np.array_equal(new, cur):
            return None
        self.set(layer, new, fixed=False)
        return cur if stored else None  # (before its first observation a layer holds no codes)

    def count(self, tokens: int) -> list:
        """Count ``tokens`` appended by a forward that calibrated. When that ends the calibration, a
        head whose calibration K or V was all zeros (its scale still the floor) gets the default scale
        1.0. Returns ``[(layer, old scales)]`` of the layers changed so: codes stored under the old
        scales (zeros, or an import's) must be re-encoded."""
        self.seen += tokens
        if self.calibrating:
            return []
        changed = [(layer, self.unfloor(layer)) for layer in range(len(self._host))]
        return [(layer, old) for layer, old in changed if old is not None]

    def unfloor(self, layer: int):
        """Give layer ``layer``'s heads still at the floor scale (all their calibration K or V zeros)
        the default scale 1.0, before calibration ends or codes of other values are imported under
        them. Returns the old scales when any changed (codes stored under them must be re-encoded:
        zeros, which stay zeros), else None."""
        cur = self._host[layer]
        unseen = cur == np.float32(FLOOR)
        if not unseen.any() or self._fixed[layer]:
            return None
        self.set(layer, np.where(unseen, np.float32(1.0), cur).astype(np.float32), fixed=False)
        return cur

    def stored_elsewhere(self) -> None:
        """Codes were stored under the current scales outside calibration (an import): calibrating
        layers must re-encode them when their scales grow, so from now on their scales only grow (an
        import into a fresh calibrating cache keeps its scales at 1.0 or above)."""
        self._stored = [True] * len(self._stored)


def _float64(value, message: str) -> np.ndarray:
    """``value`` as a float64 array; TypeError(``message``) for what is not numbers: None (which
    ``np.asarray(..., float64)`` would turn into NaN), strings (which it would parse), bools, objects."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as err:
        raise TypeError(message) from err
    if arr.dtype.kind in "OUSb":
        raise TypeError(message)
    try:
        return arr.astype(np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(message) from err
