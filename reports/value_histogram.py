"""A tensor's float values binned over its quantization grid: streaming, bounded memory, merged exactly.

The bins are fixed before any value arrives, from the tensor's qparams: the grid covers
[low, high] = [real_min - scale/2, real_max + scale/2] (`reports.grid.grid_bounds`; a value outside saturates
to qmin/qmax when quantized), split into `inner` bins of width w = (high - low) / inner, which is a whole number
of quantization steps whenever `inner` divides the number of codes (64 bins of 4 steps for 8 bits). `margin`
bins of the same width continue on each side, and one underflow and one overflow bin count what lies further
out. Counts layout (length inner + 2 * margin + 2):

    [0]                                   x < low - margin * w                    (underflow)
    [1 + k],   k = 0 .. margin - 1        low - (margin - k) * w <= x < low - (margin - k - 1) * w
    [1 + margin + j], j = 0 .. inner - 1  low + j * w <= x < low + (j + 1) * w    (the last one closed at high)
    [1 + margin + inner + k]              high + k * w <= x < high + (k + 1) * w, x > high
    [-1]                                  x >= high + margin * w, x > high        (overflow)

Inside and beyond the grid, a bin edge is where floor((x - low) / w), resp. floor((x - high) / w), computed in
float64, changes: exact up to the rounding of that quotient. Whether a value lies below `low` or above `high`
is decided exactly (x in float64 against the float64 bound), so the counts outside [low, high] are the clipped
counts of `ClipAccumulator` for a per-tensor grid. A per-channel grid is binned over the union of its
channels' intervals (the outside bins then hold what lies beyond every channel). The extremes seen are kept too.
Each value's bin depends on the value alone, so the counts do not depend on image order or sharding, and
`merge` (integer sums, min of mins, max of maxes) is exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numba
import numpy as np

from ptq.core.qparams import QParams
from reports.grid import grid_bounds

MAX_INNER = 64  # bins across the grid: enough to see a distribution's shape in a 500-pixel plot
MARGIN = 16  # bins beyond each end of the grid (a quarter of the grid's width at 64 bins)


def inner_bins(codes: int, limit: int = MAX_INNER) -> int:
    """Bins across a grid of `codes` codes: the largest divisor of `codes` up to `limit` (each bin then holds a
    whole number of codes), or `limit` when that divisor is below limit / 2 (an odd count such as 127)."""
    best = max(d for d in range(1, min(codes, limit) + 1) if codes % d == 0)
    return best if best >= min(codes, limit) / 2 else limit


@numba.njit(cache=True, nogil=True)
def bin_index(v, low, high, inv, inner, margin):
    """The bin of a float64 value v (the layout of the module docstring; NaN: bin 0, callers refuse NaN):
    floor((v - high) * inv) past `high`, floor((v - low) * inv) otherwise, clamped to the margins. Written as
    selects, so that a loop over values vectorizes."""
    outside = np.floor((v - high) * inv)
    outside = outside if outside < margin else np.float64(margin)
    inside = np.floor((v - low) * inv)  # v - low < 0 exactly when v < low: the sign of a rounded difference is exact
    inside = inside if inside < inner - 1 else np.float64(inner - 1)
    inside = inside if inside > -margin - 1 else np.float64(-margin - 1)
    j = outside + (1 + margin + inner) if v > high else inside + (1 + margin)
    return np.int32(j) if v == v else np.int32(0)


@numba.njit(cache=True, nogil=True)
def _fold(x, low, high, inv, inner, margin, counts):
    """counts[bin(v)] += 1 for every v of x (`bin_index`), in one pass, each v compared and offset in float64;
    returns (min, max, NaN count). One pass instead of numpy's nine (convert, scale, floor, clip, cast, bincount,
    min, max, the mask above high): 17-19 ms CPU per EfficientNet-Lite0 image (7.1 M values;
    `bench/report_histograms.py`), where those numpy passes took 41 ms."""
    smallest, largest, nan = np.inf, -np.inf, 0
    for k in range(x.size):
        v = np.float64(x[k])
        if v != v:
            nan += 1
            continue
        smallest = min(smallest, v)
        largest = max(largest, v)
        counts[bin_index(v, low, high, inv, inner, margin)] += 1
    return smallest, largest, nan


@dataclass
class ValueHistogram:
    """Counts of a tensor's float values over its grid (layout: the module docstring)."""

    low: float
    high: float
    inner: int
    steps_per_bin: float  # codes / inner: quantization steps per bin (of a per-tensor grid)
    margin: int = MARGIN
    counts: np.ndarray = field(default=None)  # int64, inner + 2 * margin + 2
    min: float = math.inf  # extremes of the values seen
    max: float = -math.inf

    def __post_init__(self):
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"histogram: need finite low < high, got [{self.low}, {self.high}]")
        if self.inner < 1 or self.margin < 0:
            raise ValueError(f"histogram: need at least one inner bin and a non-negative margin, got "
                             f"{self.inner} and {self.margin}")
        if self.counts is None:
            self.counts = np.zeros(self.inner + 2 * self.margin + 2, dtype=np.int64)

    @classmethod
    def for_grid(cls, qp: QParams, ndim: int = 0) -> "ValueHistogram":
        """The empty histogram of a tensor quantized with `qp` (rank `ndim`, for per-channel grids)."""
        lo, hi = grid_bounds(qp, ndim)
        codes = qp.qmax - qp.qmin + 1
        inner = inner_bins(codes)
        return cls(low=float(np.min(lo)), high=float(np.max(hi)), inner=inner,
                   steps_per_bin=codes / inner)

    @property
    def width(self) -> float:
        return (self.high - self.low) / self.inner

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @property
    def below(self) -> int:
        """Values below `low` (they saturate to qmin)."""
        return int(self.counts[: 1 + self.margin].sum())

    @property
    def above(self) -> int:
        """Values above `high` (they saturate to qmax)."""
        return int(self.counts[1 + self.margin + self.inner:].sum())

    def edges(self) -> np.ndarray:
        """The inner + 2 * margin + 1 edges of the finite bins, from low - margin * w to high + margin * w
        (the underflow and overflow bins lie beyond the first and the last)."""
        w = self.width
        lower = self.low + w * np.arange(-self.margin, self.inner)
        upper = self.high + w * np.arange(0, self.margin + 1)
        return np.concatenate([lower, upper])

    def update(self, values: np.ndarray) -> None:
        """Fold in values (any shape, finite; float32 and float64 are read as they are)."""
        x = np.ravel(values)
        if x.dtype not in (np.float32, np.float64):
            x = x.astype(np.float64)
        if x.size == 0:
            return
        low, high, nan = _fold(x, self.low, self.high, 1.0 / self.width, self.inner, self.margin, self.counts)
        if nan:
            raise ValueError(f"histogram: {nan} NaN values")
        self.min = min(self.min, low)
        self.max = max(self.max, high)

    def add(self, counts: np.ndarray, smallest: float, largest: float) -> None:
        """Fold in counts binned elsewhere with these bins (`reports.pair_sums.compare`) and their extremes."""
        self.counts += counts
        self.min = min(self.min, smallest)
        self.max = max(self.max, largest)

    def merge(self, other: "ValueHistogram") -> "ValueHistogram":
        """The histogram of both value sets (same bins; neither input is modified)."""
        layout = (self.low, self.high, self.inner, self.margin)
        if layout != (other.low, other.high, other.inner, other.margin):
            raise ValueError(f"histogram: cannot merge bins {layout} with "
                             f"{(other.low, other.high, other.inner, other.margin)}")
        return ValueHistogram(self.low, self.high, self.inner, self.steps_per_bin, self.margin,
                              self.counts + other.counts, min(self.min, other.min), max(self.max, other.max))

    def to_dict(self) -> dict:
        return {
            "low": self.low,
            "high": self.high,
            "inner_bins": self.inner,
            "margin_bins": self.margin,
            "steps_per_bin": self.steps_per_bin,
            "counts": [int(c) for c in self.counts],
            "below": self.below,
            "above": self.above,
            "min": self.min if self.total else None,
            "max": self.max if self.total else None,
        }
