"""A streaming, mergeable, signed fixed-width histogram whose counts do not depend on batch order or chunking.

Layout, per channel c (vectorized: one (C, 2, B) count array, B = `num_bins`, a power of two):

    width w_c = 2^e_c                       (a power of two, so x / w_c is exact in float64)
    counts[c, 0, j] = #{x >= 0 : floor( x / w_c) == j}      bin [j*w, (j+1)*w) of the positive side
    counts[c, 1, j] = #{x <  0 : floor(-x / w_c) == j}      bin (-(j+1)*w, -j*w] of the negative side

The two sides are mirror images about 0, so the histogram of |x| is exactly `counts.sum(axis=1)` (what
KLD needs), while percentile and MSE can still see each side. Exact zeros are also counted separately
(`zeros`), because after a ReLU they are a large spike that quantizes with no error.

Bin width: e_c is the smallest exponent with max|x| < B * 2^e_c, so the occupied bins number between
B/2 + 1 and B (the first batch fixes it; a channel that has seen only zeros has no width yet). When a later
batch (or a merged shard) exceeds B * w, the width doubles as often as needed and adjacent bins are summed
in pairs: floor(floor(|x|/w) / 2^k) == floor(|x| / (2^k w)), so this is exact. The final width therefore
depends only on the global max|x| and every count equals what one pass over all the data would give,
whatever the batch order, chunking or sharding. An outlier in the first batch keeps its bin: bins are
only ever merged, never dropped, and the array never grows past B bins per side.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from calibrators.collectors import ChannelRows, check_channels

DEFAULT_BINS = 4096  # >= 2049 occupied bins: at least TensorRT's 2048-bin resolution for KLD
EMPTY_EXPONENT = -1100  # below every float64 exponent: a channel that has only seen zeros
_MAX_SHIFT = 62  # j < 2^62, so shifting further gives 0 just the same (and stays defined for int64)


def width_exponent(amax: np.ndarray, num_bins: int) -> np.ndarray:
    """The smallest e (per channel) with floor(amax / 2^e) < num_bins; EMPTY_EXPONENT where amax == 0."""
    _, p = np.frexp(amax)  # amax = f * 2^p with f in [0.5, 1)  ->  amax / 2^(p - log2 B) = f * B < B
    e = p.astype(np.int64) - (int(num_bins).bit_length() - 1)
    return np.where(amax > 0, e, EMPTY_EXPONENT)


def flat_bin_index(values: np.ndarray, exponent: np.ndarray, num_bins: int) -> np.ndarray:
    """Every value's index into `counts.ravel()` (layout (C, 2, B)):
    (c * 2 + [x < 0]) * B + floor(|x| / 2^e_c), for rows whose max|x| < B * 2^e_c.

    Multiplying by the power of two 2^-e is exact (in float32 too, when 2^-e is a normal float32), so
    truncating the product is the exact floor; rows with EMPTY_EXPONENT hold only zeros and get scale 0.
    The arithmetic stays in floating point until one final cast: the integers involved are exact there
    (float32 is used only while C * 2B <= 2^24), and it is several times faster than int64 temporaries.
    """
    c = values.shape[0]
    empty = exponent <= EMPTY_EXPONENT
    e = np.where(empty, 0, exponent)
    if np.all((e >= -1023) & (e <= 1022)):
        narrow = values.dtype == np.float32 and np.all((e >= -127) & (e <= 126)) and 2 * c * num_bins <= 1 << 24
        dtype = np.float32 if narrow else np.float64
        scale = np.where(empty, 0.0, np.ldexp(1.0, -e)).astype(dtype)
        scaled = values * scale[:, None]
        np.abs(scaled, out=scaled)
    else:  # 2^-e is not a normal float64 (max|x| below ~1e-300): let ldexp scale each value exactly
        dtype = np.float64
        scaled = np.ldexp(np.abs(values.astype(np.float64)), -e[:, None])
    np.trunc(scaled, out=scaled)
    scaled += (values < 0) * dtype(num_bins)
    if c > 1:
        scaled += (np.arange(c) * (2 * num_bins)).astype(dtype)[:, None]
    return scaled.astype(np.int64).ravel()


def _normal_scale(exponent: np.ndarray) -> Optional[np.ndarray]:
    """2^-e_c per channel (float64; 0 for a channel with EMPTY_EXPONENT), None when one is not a normal float64
    (then `flat_bin_index` scales each value by `np.ldexp`)."""
    empty = exponent <= EMPTY_EXPONENT
    e = np.where(empty, 0, exponent)
    if not np.all((e >= -1022) & (e <= 1022)):
        return None
    return np.where(empty, 0.0, np.ldexp(1.0, -e))


def _coarsened(counts: np.ndarray, exponent: np.ndarray, new_exponent: np.ndarray) -> np.ndarray:
    """`counts` (C, 2, B) at widths 2^exponent re-binned to widths 2^new_exponent (new >= old, exact)."""
    shift = np.minimum(new_exponent - exponent, _MAX_SHIFT)
    if not shift.any():
        return counts
    c, sides, b = counts.shape
    target = np.arange(b, dtype=np.int64)[None, :] >> shift[:, None]  # (C, B)
    flat = (np.arange(c * sides, dtype=np.int64).reshape(c, sides, 1) * b + target[:, None, :]).ravel()
    # float64 weights are exact for counts below 2^53
    merged = np.bincount(flat, weights=counts.ravel(), minlength=counts.size)
    return np.rint(merged).astype(np.int64).reshape(counts.shape)


@dataclass
class HistogramCollector:
    """Signed power-of-two-width histogram per channel (see the module docstring for the exact layout)."""

    num_bins: int = DEFAULT_BINS
    counts: Optional[np.ndarray] = None  # (C, 2, num_bins) int64
    exponent: Optional[np.ndarray] = None  # (C,) int64: bin width 2^exponent
    zeros: Optional[np.ndarray] = None  # (C,) int64: exact zeros (also counted in counts[:, 0, 0])

    def __post_init__(self):
        b = int(self.num_bins)
        if b < 2 or b & (b - 1):
            raise ValueError(f"HistogramCollector: num_bins must be a power of two >= 2, got {self.num_bins}")

    @property
    def channels(self) -> Optional[int]:
        return None if self.counts is None else self.counts.shape[0]

    @property
    def width(self) -> np.ndarray:
        """(C,) bin widths; 0 for a channel that has only seen zeros."""
        return np.where(self.exponent > EMPTY_EXPONENT, np.ldexp(1.0, self.exponent), 0.0)

    @property
    def total(self) -> np.ndarray:
        """(C,) number of values folded."""
        return self.counts.sum(axis=(1, 2))

    def abs_counts(self) -> np.ndarray:
        """(C, B) histogram of |x|: bin j covers [j*w, (j+1)*w)."""
        return self.counts.sum(axis=1)

    def signed_counts(self) -> np.ndarray:
        """(C, 2B) histogram of x in ascending order: bin k covers [(k - B)*w, (k - B + 1)*w)
        (up to which end is open; the negative side's bins are (a, b] instead of [a, b))."""
        return np.concatenate([self.counts[:, 1, ::-1], self.counts[:, 0]], axis=1)

    def occupied_bins(self) -> np.ndarray:
        """(C,) index of the last non-empty |x| bin plus one (0 for a channel with no values)."""
        nonzero = self.abs_counts() > 0
        last = self.num_bins - 1 - np.argmax(nonzero[:, ::-1], axis=1)
        return np.where(nonzero.any(axis=1), last + 1, 0)

    def update(self, rows: ChannelRows) -> None:
        c = check_channels(self.channels, rows.channels, "HistogramCollector")
        need = width_exponent(np.maximum(-rows.min, rows.max), self.num_bins)
        if self.counts is None:
            self.counts = np.zeros((c, 2, self.num_bins), dtype=np.int64)
            self.exponent = need
            self.zeros = np.zeros(c, dtype=np.int64)
        else:
            new_exponent = np.maximum(self.exponent, need)
            self.counts = _coarsened(self.counts, self.exponent, new_exponent)
            self.exponent = new_exponent
        scale = _normal_scale(self.exponent)
        if scale is not None:
            # reason: numba is loaded only where a histogram is filled (a calibrator such as extrema fills none)
            from calibrators.histogram_counts import add_counts

            if add_counts(rows.values, scale, self.counts, self.zeros):
                raise ValueError("HistogramCollector: a value lies past the histogram's widest bin")
            return
        flat = flat_bin_index(rows.values, self.exponent, self.num_bins)
        self.counts += np.bincount(flat, minlength=self.counts.size).reshape(self.counts.shape)
        zero = rows.values == 0
        self.zeros += np.count_nonzero(zero, axis=1) if c > 1 else np.count_nonzero(zero)

    def merge(self, other: "HistogramCollector") -> None:
        if other.counts is None:
            return
        if other.num_bins != self.num_bins:
            raise ValueError(f"HistogramCollector.merge: {self.num_bins} bins vs {other.num_bins}")
        if self.counts is None:
            self.counts, self.exponent, self.zeros = other.counts.copy(), other.exponent.copy(), other.zeros.copy()
            return
        check_channels(self.channels, other.channels, "HistogramCollector.merge")
        new_exponent = np.maximum(self.exponent, other.exponent)
        self.counts = _coarsened(self.counts, self.exponent, new_exponent) + _coarsened(
            other.counts, other.exponent, new_exponent
        )
        self.exponent = new_exponent
        self.zeros = self.zeros + other.zeros
