"""calibrators: streaming, mergeable statistic collectors and the calibration algorithms built on them.

    from calibrators import TensorStatistics, get_calibrator
    calibrator = get_calibrator("kld")                      # or "auto" (the default), "extrema", "mean", "3std",
                                                            # "0.9mean", "99.99percentile", "mse"
    stats = TensorStatistics(calibrator.needs, axis=None)   # or required_stats([...]) for several
    for batch in batches:
        stats.update(batch)                                 # folded and dropped; NaN/Inf raise ValueError
    stats.merge(other_shard_stats)                          # sharding: equals one pass over all data
    rmin, rmax = calibrator.compute(stats, bits=8)          # float64 arrays, length 1 or C

    rmin, rmax = calibrate_array("extrema", weight, axis=0, bits=8)   # one shot, e.g. for weights
"""
from __future__ import annotations

from calibrators.collectors import (
    BatchExtremaCollector,
    ChannelRows,
    MinMaxCollector,
    MomentsCollector,
    as_channels,
)
from calibrators.histogram import DEFAULT_BINS, HistogramCollector
from calibrators.registry import (
    Calibrator,
    available_calibrators,
    calibrate_array,
    get_calibrator,
    register_calibrator,
    required_stats,
)
from calibrators.statistics import Stat, TensorStatistics
from calibrators import methods  # noqa: F401  (registers every calibrator)

__all__ = [
    "BatchExtremaCollector",
    "Calibrator",
    "ChannelRows",
    "DEFAULT_BINS",
    "HistogramCollector",
    "MinMaxCollector",
    "MomentsCollector",
    "Stat",
    "TensorStatistics",
    "as_channels",
    "available_calibrators",
    "calibrate_array",
    "get_calibrator",
    "register_calibrator",
    "required_stats",
]
