"""Compiled quantization of a float input, the one float-to-code step of an integer run (its graph inputs).

    x_q = clamp(round_half_even(x / s) + zp, qmin, qmax)      x / s in float64, per-tensor s and zp

The same operations in the same order and precision as `ptq.core.qparams.QParams.quantize` (an IEEE float64
division, `rint` in the default round-to-nearest-even mode, the add, the clamp, then the exact integer stored),
so the same codes, in one pass instead of five over a float64 buffer of the input's size.
"""
from __future__ import annotations

from typing import Optional

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _quantize(x, scale, zero_point, qmin, qmax, out) -> None:
    for i in range(x.size):
        v = np.rint(np.float64(x[i]) / scale) + zero_point
        out[i] = min(max(v, qmin), qmax)


def quantize_per_tensor(qp, x: np.ndarray) -> Optional[np.ndarray]:
    """`qp.quantize(x)` for a per-tensor `QParams` and a C-contiguous float32/float64 x; None for any other
    case (per-channel, another dtype or layout), which `QParams.quantize` covers."""
    if qp.axis is not None or x.dtype not in (np.float32, np.float64) or not x.flags.c_contiguous:
        return None
    if qp.scale.dtype != np.float64:
        return None
    out = np.empty(x.shape, dtype=qp.dtype)
    _quantize(x.reshape(-1), float(qp.scale[0]), float(qp.zero_point[0]), float(qp.qmin), float(qp.qmax),
              out.reshape(-1))
    return out
