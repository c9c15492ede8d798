"""`nstd` (N = 3) or `Nstd` (e.g. `2.5std`): mean -+ N standard deviations, clipped to the observed min/max.

    rmin = max(mean - N * std, min(x)),   rmax = min(mean + N * std, max(x))

std is the population standard deviation (ddof = 0), from the streaming Chan/Welford moments.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calibrators.registry import Calibrator, register_calibrator
from calibrators.statistics import Stat


@register_calibrator("std", param="n", usage="nstd (3std, 2.5std)", aliases=("nstd",))
@dataclass(frozen=True)
class NStd(Calibrator):
    """mean -+ n * std, clipped to the observed range."""

    n: float = 3.0
    needs = frozenset({Stat.MOMENTS})

    def __post_init__(self):
        if self.n is None or not np.isfinite(self.n) or self.n <= 0:
            raise ValueError(f"std: N must be a positive number (spelled like 3std), got {self.n}")

    def _compute(self, stats, bits, signed):
        moments = stats.moments
        half = self.n * moments.std
        rmin = np.maximum(moments.mean - half, stats.minmax.min)
        rmax = np.minimum(moments.mean + half, stats.minmax.max)
        return rmin, rmax
