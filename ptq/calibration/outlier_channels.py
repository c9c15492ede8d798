"""Outlier channels: an activation that a layer sums over against a constant weight (MatMul's A, Gemm's A:
`OpDef.summed_input_axis`) gets 16 bits when a few of its channels along that axis span a far wider range
than the others.

Transformers carry outlier features: a LayerNorm whose gain is large on a few channels makes those channels
span +-270 where the others span +-4. One 8-bit grid over the whole range has a step of 2.1, so every
ordinary channel lands on 3-4 codes, and the MatMul that sums them against its weight loses them (measured on
bench/models/gelu_classifier.onnx: top-1 agreement 198/200, the MatMul's isolated cosine 0.990, while the
LayerNorm output's own cosine reads 0.9995, dominated by the outliers). At 16 bits (whitepaper 5.1.3) an
ordinary channel keeps the resolution an 8-bit grid of its own would give it: 200/200.

The test, from the per-channel min/max calibration collects for these tensors: the widest channel's range is
more than RANGE_RATIO times the median channel's. Scores (the output of an op that `gives_scores`: a Softmax's
probabilities) are left alone: their channels are classes of one distribution, most of them near 0 on every
sample, not features an 8-bit grid crushes. Measured ratios: 51 on the gelu classifier's outlier
LayerNorm; 1.5-3.2 on every other MatMul input of the bench's transformer, sequence models. The entry keeps
its calibrated range; its `why` says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calibrators import TensorStatistics
from ops.registry import op_of
from ptq.core.graph import Graph
from ptq.table.quant_table import CalibrationOptions, TensorEntry

RANGE_RATIO = 16.0  # widest channel range / median channel range above this: outlier channels
WIDE_BITS = 16


@dataclass(frozen=True)
class OutlierChannels:
    """A tensor given 16 bits for its outlier channels."""

    tensor: str
    ratio: float
    outliers: int  # channels wider than RANGE_RATIO x the median
    why: str


def channel_ratio(stats: TensorStatistics) -> tuple[float, int]:
    """(widest channel range / median channel range, channels wider than RANGE_RATIO x the median); (0, 0)
    without per-channel statistics or with a median range of 0."""
    collector = stats.channel_minmax
    if collector is None or collector.min is None or collector.min.size < 2:
        return 0.0, 0
    widths = collector.max - collector.min
    median = float(np.median(widths))
    if median <= 0:
        return 0.0, 0
    return float(widths.max()) / median, int(np.count_nonzero(widths > RANGE_RATIO * median))


def widen_outlier_channels(graph: Graph, stats: dict[str, TensorStatistics], entries: dict[str, TensorEntry],
                           options: CalibrationOptions) -> list[OutlierChannels]:
    """Give the activations with outlier channels 16 bits, in place on `entries`; returns what changed."""
    producers = graph.producer()
    changed = []
    for name, tensor_stats in stats.items():
        entry = entries.get(name)
        if entry is None or entry.qparams.bits >= WIDE_BITS or entry.qparams.per_channel:
            continue
        op = op_of(producers[name]) if name in producers else None
        if op is not None and op.gives_scores:
            continue
        ratio, outliers = channel_ratio(tensor_stats)
        if ratio <= RANGE_RATIO:
            continue
        why = (f"{outliers} of its {tensor_stats.channel_minmax.min.size} channels along axis "
               f"{tensor_stats.channel_axis} (summed against a weight) span up to {ratio:.0f}x the median "
               f"channel's range (> {RANGE_RATIO:g}x): at {WIDE_BITS} bits so the others keep their resolution")
        qp = options.derive_qparams("activation", entry.min, entry.max, WIDE_BITS)
        entries[name] = TensorEntry("activation", entry.calibrator, entry.min, entry.max, qp, entry.run_in_float,
                                    why)
        changed.append(OutlierChannels(name, ratio, outliers, why))
    return changed
