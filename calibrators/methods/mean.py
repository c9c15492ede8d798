"""`mean`: a weighted mean of the per-batch minima and maxima (whitepaper 2.2), weights summing to 1.

    rmin = sum_t w_t * min_t,   rmax = sum_t w_t * max_t      (t = 0 .. T-1, in the order folded)

`mean` (momentum None): w_t = 1 / T, the plain average.
`<m>mean`, e.g. `0.9mean`: the exponential moving average r <- m * r + (1 - m) * x_t started at r = x_0,
i.e. w_0 = m^(T-1) and w_t = (1 - m) * m^(T-1-t) for t >= 1 (these sum to 1). It depends on batch order,
and merged shards count in the order merged (this shard's batches, then the other's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from calibrators.registry import Calibrator, register_calibrator
from calibrators.statistics import Stat


def batch_weights(batches: int, momentum: Optional[float]) -> np.ndarray:
    """The weight of each batch (see the module docstring); they sum to 1."""
    if momentum is None:
        return np.full(batches, 1.0 / batches)
    t = np.arange(batches)
    w = (1.0 - momentum) * momentum ** (batches - 1 - t)
    w[0] = momentum ** (batches - 1)
    return w


@register_calibrator("mean", param="momentum", usage="mean (0.9mean: moving average)")
@dataclass(frozen=True)
class Mean(Calibrator):
    """Weighted mean of per-batch min/max; `momentum` None = plain average, m in (0, 1) = EMA."""

    momentum: Optional[float] = None
    needs = frozenset({Stat.BATCH_EXTREMA})

    def __post_init__(self):
        if self.momentum is not None and not 0.0 < self.momentum < 1.0:
            raise ValueError(f"mean: momentum must be in (0, 1), got {self.momentum}")

    def _compute(self, stats, bits, signed):
        mins, maxs = stats.batch_extrema.as_arrays()
        w = batch_weights(mins.shape[0], self.momentum)
        return w @ mins, w @ maxs
