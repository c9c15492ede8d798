"""Bias quantization, shared by the integer ops and the QDQ export so both write the same int32 codes:

    s_b[c] = fl32(fl32(s_x) * fl32(s_w[c]))                 (the float32 scale a QDQ DequantizeLinear stores)
    b_q[c] = clamp(round_half_even(b_f[c] / s_b[c]), -2^(bits-1), 2^(bits-1) - 1)   (float64 division)

`bits` is 32 normally (what a QDQ export writes); the integer ops pass their accumulator width for 16-bit
operands, whose s_x * s_w can be so small that a real bias needs more than 32 bits.
"""
from __future__ import annotations

import numpy as np


def bias_scale(s_x, s_w) -> np.ndarray:
    """The float32 product `s_x * s_w` (one value per weight channel; `s_x` a scalar or a length-1 array),
    returned as float64 (exactly the float32 value; the QDQ export stores it as float32)."""
    return (np.asarray(s_x, dtype=np.float32) * np.asarray(s_w, dtype=np.float32)).astype(np.float64)


def quantize_bias(b_f: np.ndarray, scale: np.ndarray, bits: int = 32) -> np.ndarray:
    """int64 `clamp(round_half_even(b_f / scale))` to a signed `bits`-wide value (`scale` broadcast)."""
    q = np.rint(np.asarray(b_f, dtype=np.float64) / np.asarray(scale, dtype=np.float64))
    return np.clip(q, -(2.0 ** (bits - 1)), 2.0 ** (bits - 1) - 1).astype(np.int64)
