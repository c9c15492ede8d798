"""`TensorStatistics`: the collectors one tensor needs, fed batch by batch and mergeable across shards.

    stats = TensorStatistics(required_stats(["kld", "3std"]), axis=None)
    for batch in batches:
        stats.update(batch)          # float ndarray; a per-channel `axis` indexes the batch's dimensions
    stats.merge(other_shard_stats)   # same needs, axis and bin count
    rmin, rmax = get_calibrator("kld").compute(stats, bits=8)

Min/max is always collected (cheap, and every calibrator needs the observed range or sign).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from calibrators.collectors import BatchExtremaCollector, MinMaxCollector, MomentsCollector, as_channels
from calibrators.histogram import DEFAULT_BINS, HistogramCollector


class Stat(enum.Enum):
    """A statistic a calibrator can ask for."""

    MINMAX = "minmax"
    MOMENTS = "moments"
    BATCH_EXTREMA = "batch_extrema"
    HISTOGRAM = "histogram"


@dataclass
class TensorStatistics:
    """Streaming statistics of one tensor, per-tensor (`axis=None`) or per channel along `axis`.

    Collectors that were not asked for stay None; asking a calibrator to use one raises ValueError.
    `channel_axis`: also the min/max of every channel along that axis (`channel_minmax`), beside the
    statistics above (calibration looks for outlier channels with it).
    """

    needs: frozenset = frozenset()
    axis: Optional[int] = None
    num_bins: int = DEFAULT_BINS
    channel_axis: Optional[int] = None
    minmax: MinMaxCollector = field(init=False)
    moments: Optional[MomentsCollector] = field(init=False, default=None)
    batch_extrema: Optional[BatchExtremaCollector] = field(init=False, default=None)
    histogram: Optional[HistogramCollector] = field(init=False, default=None)
    channel_minmax: Optional[MinMaxCollector] = field(init=False, default=None)

    def __post_init__(self):
        needs = frozenset(self.needs) | {Stat.MINMAX}
        unknown = [n for n in needs if not isinstance(n, Stat)]
        if unknown:
            raise ValueError(f"TensorStatistics: needs must be Stat members, got {unknown}")
        self.needs = needs
        self.minmax = MinMaxCollector()
        if Stat.MOMENTS in needs:
            self.moments = MomentsCollector()
        if Stat.BATCH_EXTREMA in needs:
            self.batch_extrema = BatchExtremaCollector()
        if Stat.HISTOGRAM in needs:
            self.histogram = HistogramCollector(self.num_bins)
        if self.channel_axis is not None:
            self.channel_minmax = MinMaxCollector()

    def _collectors(self) -> list:
        return [c for c in (self.minmax, self.moments, self.batch_extrema, self.histogram) if c is not None]

    @property
    def channels(self) -> Optional[int]:
        """Number of channels (1 per-tensor); None before the first batch."""
        return self.minmax.channels

    @property
    def empty(self) -> bool:
        return self.minmax.min is None

    @property
    def signed(self) -> bool:
        """Whether any value seen (in any channel) was negative."""
        return bool(np.min(self.require(Stat.MINMAX).min) < 0)

    def update(self, batch) -> "TensorStatistics":
        """Fold one batch (any real ndarray). Raises ValueError for NaN/Inf, an empty batch or a bad axis."""
        rows = as_channels(batch, self.axis)
        for collector in self._collectors():
            collector.update(rows)
        if self.channel_minmax is not None:
            self.channel_minmax.update(as_channels(batch, self.channel_axis))
        return self

    def merge(self, other: "TensorStatistics") -> "TensorStatistics":
        """Fold in statistics of another shard (same needs, axis and bin count); returns self."""
        if not isinstance(other, TensorStatistics):
            raise TypeError(f"can only merge TensorStatistics, got {type(other).__name__}")
        if (other.needs, other.axis, other.num_bins, other.channel_axis) != (
                self.needs, self.axis, self.num_bins, self.channel_axis):
            raise ValueError(
                "TensorStatistics.merge: incompatible statistics "
                f"(needs {sorted(n.value for n in self.needs)} vs {sorted(n.value for n in other.needs)}, "
                f"axis {self.axis} vs {other.axis}, bins {self.num_bins} vs {other.num_bins}, "
                f"channel axis {self.channel_axis} vs {other.channel_axis})"
            )
        for mine, theirs in zip(self._collectors(), other._collectors()):
            mine.merge(theirs)
        if self.channel_minmax is not None:
            self.channel_minmax.merge(other.channel_minmax)
        return self

    def require(self, stat: Stat):
        """The collector for `stat`, checking that it was collected and has seen data."""
        collector = {
            Stat.MINMAX: self.minmax,
            Stat.MOMENTS: self.moments,
            Stat.BATCH_EXTREMA: self.batch_extrema,
            Stat.HISTOGRAM: self.histogram,
        }[stat]
        if collector is None:
            raise ValueError(f"statistic '{stat.value}' was not collected (collected: "
                             f"{sorted(n.value for n in self.needs)})")
        if self.empty:
            raise ValueError("no data: the statistics have not seen any batch")
        return collector

