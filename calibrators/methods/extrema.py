"""`extrema`: the global minimum and maximum (whitepaper 2.2)."""
from __future__ import annotations

from dataclasses import dataclass

from calibrators.registry import Calibrator, register_calibrator
from calibrators.statistics import Stat


@register_calibrator("extrema")
@dataclass(frozen=True)
class Extrema(Calibrator):
    """rmin = min(x), rmax = max(x) over every batch (per channel)."""

    needs = frozenset({Stat.MINMAX})

    def _compute(self, stats, bits, signed):
        return stats.minmax.min.copy(), stats.minmax.max.copy()
