"""`percentile` (P = 99.99) or `Ppercentile` (e.g. `99.9percentile`): each side's percentile P, read off the signed histogram.

    rmin ~= np.percentile(x, 100 - P),   rmax ~= np.percentile(x, P)       (per channel)

Each side is handled separately (not P of |x|), so a skewed tensor keeps its own two tails. The
quantile is found on the cumulative histogram and interpolated linearly inside its bin (values taken as
uniform within a bin), so it agrees with np.percentile to about one bin width. The result is clipped to
the observed min/max.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calibrators.registry import Calibrator, register_calibrator
from calibrators.statistics import Stat


def histogram_quantile(signed_counts: np.ndarray, width: np.ndarray, q: float) -> np.ndarray:
    """Per channel, the value below which a fraction q of the values lie.

    `signed_counts` is (C, 2B) with bin k covering [(k - B) * w, (k - B + 1) * w) (see HistogramCollector).
    """
    half = signed_counts.shape[1] // 2
    cum = np.cumsum(signed_counts, axis=1, dtype=np.float64)
    target = q * cum[:, -1]
    k = np.argmax(cum >= target[:, None], axis=1)
    rows = np.arange(signed_counts.shape[0])
    in_bin = signed_counts[rows, k].astype(np.float64)
    before = cum[rows, k] - in_bin
    frac = np.divide(target - before, in_bin, out=np.zeros_like(target), where=in_bin > 0)
    return (k - half + frac) * width


@register_calibrator("percentile", param="percent", usage="percentile (99.99percentile, 99.9percentile)")
@dataclass(frozen=True)
class Percentile(Calibrator):
    """[percentile 100 - P, percentile P] of x per channel, from the histogram."""

    percent: float = 99.99
    needs = frozenset({Stat.HISTOGRAM})

    def __post_init__(self):
        if self.percent is None or not 50.0 < self.percent <= 100.0:
            raise ValueError(
                f"percentile: P must be in (50, 100] (spelled like 99.99percentile), got {self.percent}"
            )

    def _compute(self, stats, bits, signed):
        hist = stats.histogram
        counts, width = hist.signed_counts(), hist.width
        rmin = histogram_quantile(counts, width, 1.0 - self.percent / 100.0)
        rmax = histogram_quantile(counts, width, self.percent / 100.0)
        lo, hi = stats.minmax.min, stats.minmax.max
        return np.clip(rmin, lo, hi), np.clip(rmax, lo, hi)
