"""Linear quantization parameters in the ONNX convention.

    x_f = (x_q - zero_point) * scale
    x_q = clamp(round_half_even(x_f / scale) + zero_point, qmin, qmax)

Scales are kept as float32-representable float64 values, so that a QDQ model (whose scales are float32)
describes exactly the same grid as the integer executor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

MIN_BITS, MAX_BITS = 2, 16


def storage_dtype(bits: int, signed: bool) -> np.dtype:
    """The smallest numpy integer dtype that holds every code of a `bits`-wide (un)signed tensor."""
    if bits <= 8:
        return np.dtype(np.int8 if signed else np.uint8)
    if bits <= 16:
        return np.dtype(np.int16 if signed else np.uint16)
    return np.dtype(np.int32 if signed else np.uint32)


def integer_range(bits: int, signed: bool, narrow: bool = False) -> tuple[int, int]:
    """(qmin, qmax) of a `bits`-wide integer; `narrow` drops the most negative code (restricted range)."""
    if signed:
        qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        return (qmin + 1 if narrow else qmin), qmax
    return 0, (1 << bits) - 1


def _as_f32_grid(scale: np.ndarray) -> np.ndarray:
    return np.asarray(scale, dtype=np.float32).astype(np.float64)


@dataclass(frozen=True, eq=False)
class QParams:
    """Quantization parameters of one tensor: per-tensor (`axis=None`, arrays of length 1) or per-channel
    along `axis` (arrays of length C). `narrow` marks the restricted symmetric range [-(2^(b-1)-1), 2^(b-1)-1].
    """

    scale: np.ndarray
    zero_point: np.ndarray
    bits: int = 8
    signed: bool = True
    axis: Optional[int] = None
    narrow: bool = False

    def __post_init__(self):
        scale = _as_f32_grid(np.atleast_1d(np.asarray(self.scale, dtype=np.float64)).ravel())
        zp = np.atleast_1d(np.asarray(self.zero_point)).ravel()
        if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
            raise ValueError(f"QParams: scale must be finite and positive, got {scale}")
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"QParams: bits must be in [{MIN_BITS}, {MAX_BITS}], got {self.bits}")
        if np.any(zp != np.round(zp)):
            raise ValueError(f"QParams: zero point must be an integer, got {zp}")
        zp = zp.astype(np.int64)
        if zp.size not in (1, scale.size) or (scale.size > 1 and zp.size != scale.size):
            raise ValueError(f"QParams: scale has {scale.size} values, zero point {zp.size}")
        if zp.size == 1 and scale.size > 1:
            zp = np.full(scale.size, zp[0], dtype=np.int64)
        if self.axis is None and scale.size != 1:
            raise ValueError("QParams: a per-tensor QParams (axis=None) needs one scale")
        qmin, qmax = integer_range(self.bits, self.signed, self.narrow)
        if np.any(zp < qmin) or np.any(zp > qmax):
            raise ValueError(f"QParams: zero point {zp} outside [{qmin}, {qmax}]")
        for arr in (scale, zp):
            arr.setflags(write=False)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "zero_point", zp)

    @property
    def qmin(self) -> int:
        return integer_range(self.bits, self.signed, self.narrow)[0]

    @property
    def qmax(self) -> int:
        return integer_range(self.bits, self.signed, self.narrow)[1]

    @property
    def dtype(self) -> np.dtype:
        return storage_dtype(self.bits, self.signed)

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    @property
    def symmetric(self) -> bool:
        return bool(np.all(self.zero_point == 0))

    def broadcast(self, arr: np.ndarray, ndim: int) -> np.ndarray:
        """`arr` (one value per channel) shaped to broadcast against a tensor of rank `ndim`."""
        if self.axis is None:
            return arr.reshape(())
        shape = [1] * ndim
        shape[self.axis % ndim] = arr.size
        return arr.reshape(shape)

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """Float array -> integer codes clamp(round_half_even(x / scale) + zp, qmin, qmax) in `self.dtype`, x / scale
        in float64 (computed in one buffer: large activations make temporaries the main cost)."""
        x = np.asarray(x)
        scale = self.broadcast(self.scale, x.ndim)
        q = np.empty(np.broadcast_shapes(x.shape, scale.shape), dtype=np.float64)
        np.divide(x, scale, out=q)
        np.rint(q, out=q)
        q += self.broadcast(self.zero_point, x.ndim)
        np.clip(q, self.qmin, self.qmax, out=q)
        return q.astype(self.dtype)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        """Integer codes -> float32 values."""
        q = np.asarray(q)
        centered = q.astype(np.int64) - self.broadcast(self.zero_point, q.ndim)
        return (centered * self.broadcast(self.scale, q.ndim)).astype(np.float32)

    def real_range(self) -> tuple[np.ndarray, np.ndarray]:
        """The float values of qmin and qmax, per channel."""
        return ((self.qmin - self.zero_point) * self.scale, (self.qmax - self.zero_point) * self.scale)

    def to_dict(self) -> dict:
        return {
            "scale": [float(s) for s in self.scale],
            "zero_point": [int(z) for z in self.zero_point],
            "bits": int(self.bits),
            "signed": bool(self.signed),
            "axis": self.axis,
            "narrow": bool(self.narrow),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "QParams":
        return cls(
            scale=np.asarray(d["scale"], dtype=np.float64),
            zero_point=np.asarray(d["zero_point"], dtype=np.int64),
            bits=int(d["bits"]),
            signed=bool(d["signed"]),
            axis=d.get("axis"),
            narrow=bool(d.get("narrow", False)),
        )

    def __eq__(self, other) -> bool:
        if not isinstance(other, QParams):
            return NotImplemented
        return (
            self.bits == other.bits
            and self.signed == other.signed
            and self.axis == other.axis
            and self.narrow == other.narrow
            and np.array_equal(self.scale, other.scale)
            and np.array_equal(self.zero_point, other.zero_point)
        )

    __hash__ = None


def compute_qparams(
    rmin,
    rmax,
    bits: int = 8,
    *,
    symmetric: bool = True,
    signed: Optional[bool] = None,
    narrow: bool = False,
    pow2: bool = False,
    axis: Optional[int] = None,
) -> QParams:
    """QParams covering [rmin, rmax] (scalars, or arrays per channel along `axis`), whitepaper 2.2.

    - The range is first widened to include 0, so that zero is exactly representable.
    - `signed=None` picks unsigned for a non-negative range (e.g. ReLU outputs), signed otherwise.
    - Symmetric: zero point 0 (signed: `scale = max|x| / ((2^b - 1) / 2)` for the full range,
      `max|x| / (2^(b-1) - 1)` for the restricted one; unsigned: `scale = max / (2^b - 1)`).
    - Asymmetric: `scale = (max - min) / (qmax - qmin)`, `zero_point = round(qmin - min / scale)`.
    - A channel whose range is empty (min == max) gets scale 1.
    - `pow2` rounds each scale up to a power of two (the TQT form), which keeps the range covered.
    """
    rmin = np.minimum(np.atleast_1d(np.asarray(rmin, dtype=np.float64)), 0.0)
    rmax = np.maximum(np.atleast_1d(np.asarray(rmax, dtype=np.float64)), 0.0)
    if not (np.all(np.isfinite(rmin)) and np.all(np.isfinite(rmax))):
        raise ValueError(f"cannot quantize a range with NaN or Inf: min={rmin}, max={rmax}")
    if signed is None:
        signed = bool(np.any(rmin < 0))
    if not signed:
        rmin = np.zeros_like(rmin)  # an unsigned tensor clamps negatives to 0
    if symmetric and not signed:
        narrow = False
    qmin, qmax = integer_range(bits, signed, narrow)
    if symmetric:
        amax = np.maximum(np.abs(rmin), np.abs(rmax))
        levels = (qmax - qmin) / 2.0 if signed else float(qmax)
        scale = amax / levels
        zp = np.zeros_like(scale, dtype=np.int64)
    else:
        scale = (rmax - rmin) / float(qmax - qmin)
        zp = None
    scale = np.where(scale > 0, scale, 1.0)
    if pow2:
        scale = np.exp2(np.ceil(np.log2(scale)))
    scale = _as_f32_grid(scale)
    if zp is None:
        zp = np.clip(np.rint(qmin - rmin / scale), qmin, qmax).astype(np.int64)
    if axis is None and scale.size != 1:
        raise ValueError("compute_qparams: per-channel ranges need an axis")
    return QParams(scale=scale, zero_point=zp, bits=bits, signed=signed, axis=axis, narrow=narrow)
