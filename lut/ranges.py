"""Tighter input ranges for table functions with flat tails (whitepaper chapter 4 notes on Sigmoid, Tanh,
Exp, Elu, Selu, Softplus/BNLL: a calibrated min/max deep in a flat tail wastes codes on inputs whose output
code no longer changes; "truncate near 6.0" for sigmoid).

Rule: with the output quantized to `out_bits` over f's range on [rmin, rmax] (LSB = range / (2^b - 1)),
move each end inwards as long as f on the part cut off stays within `tol_lsb` output LSB of f at the new
end. Clamping an input to the tuned range then changes the output by at most `tol_lsb` LSB (before
rounding). A cut narrower than `MIN_TAIL_FRACTION` of the range is not made: it is the end of a sloped
function, not a flat tail, and would buy almost nothing. With the default half LSB this reproduces the
whitepaper's rules of thumb: sigmoid +-6.2, tanh +-3.1 (8-bit outputs), and cuts exp at
max - ln(2 * 255) = max - 6.2.
"""
from __future__ import annotations

import numpy as np

from lut.functions import get_function

DEFAULT_SAMPLES = 8193
MIN_TAIL_FRACTION = 1.0 / 32


def _flat_prefix_end(y: np.ndarray, tol: float) -> int:
    """Largest t such that every y[:t+1] is within tol of y[t] (non-finite values never are)."""
    finite = np.isfinite(y)
    if not finite[0]:
        return 0
    bad = ~np.logical_and.accumulate(finite)
    yf = np.where(finite, y, 0.0)
    spread = np.maximum(np.maximum.accumulate(yf) - yf, yf - np.minimum.accumulate(yf))
    ok = (spread <= tol) & ~bad
    return int(np.argmin(ok)) - 1 if not ok.all() else y.size - 1


def tune_input_range(fn, rmin: float, rmax: float, *, out_bits: int = 8, tol_lsb: float = 0.5,
                     samples: int = DEFAULT_SAMPLES) -> tuple[float, float]:
    """(lo, hi) within [rmin, rmax]: the calibrated input range with f's flat tails cut off (see module doc).

    `fn` is a registry name, `LutFunction` or callable. A function without a flat tail keeps its range.
    """
    fn = get_function(fn)
    rmin, rmax = float(rmin), float(rmax)
    if not (np.isfinite(rmin) and np.isfinite(rmax)) or rmin > rmax:
        raise ValueError(f"tune_input_range: need finite rmin <= rmax, got [{rmin}, {rmax}]")
    if not 2 <= out_bits <= 32 or tol_lsb < 0 or samples < 3:
        raise ValueError("tune_input_range: out_bits in [2, 32], tol_lsb >= 0 and samples >= 3 required")
    if rmin == rmax:
        return rmin, rmax
    x = np.linspace(rmin, rmax, samples)
    y = fn(x)
    finite = y[np.isfinite(y)]
    if finite.size == 0:
        return rmin, rmax
    lo_y, hi_y = min(float(finite.min()), 0.0), max(float(finite.max()), 0.0)  # outputs include zero too
    lsb = (hi_y - lo_y) / ((1 << out_bits) - 1)
    if lsb == 0:
        return rmin, rmax
    tol = tol_lsb * lsb
    lo = x[_flat_prefix_end(y, tol)]
    hi = x[samples - 1 - _flat_prefix_end(y[::-1], tol)]
    if lo >= hi:  # f is flat (within tol) over the whole range
        return rmin, rmax
    min_cut = MIN_TAIL_FRACTION * (rmax - rmin)
    lo = lo if lo - rmin >= min_cut else rmin
    hi = hi if rmax - hi >= min_cut else rmax
    return float(lo), float(hi)
