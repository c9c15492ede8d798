"""An integer tensor's grid seen from float: its dequantized values and the interval it covers."""
from __future__ import annotations

import numpy as np

from ptq.core.qparams import QParams


def dequantize32(qp: QParams, codes: np.ndarray) -> np.ndarray:
    """x = (x_q - zp) * scale as float32, equal to `QParams.dequantize` (codes - zp is exact in float32 and the
    scale is a float32 value, so the one rounding of the product is the same) with less memory traffic."""
    codes = np.asarray(codes)
    # a plain conversion loop (faster than a mixed-type subtract), into C order: the compiled convolutions
    # return views of channels-last codes, and the metrics flatten their operands in C order
    out = codes.astype(np.float32, order="C")
    if np.any(qp.zero_point):
        out -= qp.broadcast(qp.zero_point.astype(np.float32), codes.ndim)
    out *= qp.broadcast(qp.scale.astype(np.float32), codes.ndim)
    return out


def grid_bounds(qp: QParams, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """The float interval a grid represents without saturating: [real_min - scale/2, real_max + scale/2],
    shaped to broadcast against a tensor of rank `ndim` (per channel along qp.axis)."""
    lo, hi = qp.real_range()
    return (qp.broadcast(np.asarray(lo - qp.scale / 2), ndim), qp.broadcast(np.asarray(hi + qp.scale / 2), ndim))
