"""A graph input whose samples are finer than 8-bit data takes 16 bits (issue 24).

The integer graph starts by quantizing the model's input. Images are 8-bit data: each colour channel takes at
most 256 values (pixels scaled and offset by the preprocessing), and an 8-bit grid over the input's range has
about their resolution. Continuous arrays (features, spectra, rendered or resampled samples) are not: the 8-bit
grid rounds them once more before the first layer, and that rounding reaches every later layer as the
network's own error does. On models read by an argmax or a threshold it decides near ties: on the bench's CRNN
recognizer (continuous glyph lines, `bench/detectors.py`) the greedy CTC decode of the 74 eval lines that have a
frame within 0.25 in logit of a tie differs from float's on 13 with an 8-bit input, on 10 with a 16-bit one, as
many as with every activation at 16 bits.

So, by default (8-bit tables), each graph input whose calibration samples take more than 256 distinct values in
some channel (axis 1, or the whole tensor below rank 2) takes 16 bits over the same calibrated range (whitepaper
5.1.3 allows int16 activations). The input is where the model's data enter; its first consumer usually has few
input channels (3 colours, a few features), so the wider products cost little. The check reads the first
MAX_SAMPLES samples again (no model run). The entry's `why` says so.

This is a calibration step of its own (`ptq.calibration.steps.InputGrid`), after the ranges (and range search),
so it composes with any calibrator choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from ptq.core.graph import Graph
from ptq.engine.float_run import sample_input
from ptq.table.quant_table import CalibrationOptions, TensorEntry

WIDE_BITS = 16
EIGHT_BIT_DATA = 8  # the tables the rule applies to (a lower width is the user's deliberate choice)
MAX_SAMPLES = 8  # samples read for the check


@dataclass(frozen=True)
class FineInput:
    """A graph input given 16 bits because its samples are finer than 8-bit data."""

    tensor: str
    distinct: int  # the most distinct values one channel took (counting stops past 256)
    why: str


class DistinctValues:
    """The distinct values each channel (axis 1) of a tensor takes over batches, kept until a channel passes
    `limit` (then only that is known)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.values: list[np.ndarray] = []
        self.exceeded = False

    def update(self, batch: np.ndarray) -> None:
        if self.exceeded:
            return
        batch = np.asarray(batch)
        channels = np.moveaxis(batch, 1, 0).reshape(batch.shape[1], -1) if batch.ndim > 1 else batch.reshape(1, -1)
        if not self.values:
            self.values = [np.zeros(0, batch.dtype)] * len(channels)
        for c, row in enumerate(channels[: len(self.values)]):
            self.values[c] = np.union1d(self.values[c], row)
            if self.values[c].size > self.limit:
                self.exceeded = True
                return

    @property
    def most(self) -> int:
        return max((v.size for v in self.values), default=0)


def _feeds(graph: Graph, batch) -> Mapping[str, np.ndarray]:
    return batch if isinstance(batch, Mapping) else {sample_input(graph): batch}


def widen_fine_inputs(graph: Graph, entries: dict[str, TensorEntry], batches: Iterable,
                      options: CalibrationOptions, max_samples: int = MAX_SAMPLES) -> list[FineInput]:
    """Give each graph input whose samples are finer than its grid 16 bits (module docstring), in place on
    `entries`; `batches`: the calibration samples as the statistics read them. Returns what changed."""
    checked = {name: DistinctValues(2 ** EIGHT_BIT_DATA) for name in graph.inputs
               if name in entries and entries[name].kind == "activation"
               and entries[name].qparams.bits == EIGHT_BIT_DATA
               and not entries[name].qparams.per_channel and not entries[name].run_in_float}
    seen = 0
    for batch in batches if checked else ():
        feeds = _feeds(graph, batch)
        for name, distinct in checked.items():
            if name in feeds and np.issubdtype(np.asarray(feeds[name]).dtype, np.floating):
                distinct.update(feeds[name])
        seen += max((len(v) if np.ndim(v) else 1 for v in feeds.values()), default=1)
        if seen >= max_samples or all(d.exceeded for d in checked.values()):
            break
    changed = []
    for name, distinct in checked.items():
        if not distinct.exceeded:
            continue
        entry = entries[name]
        why = (f"graph input: a channel of its calibration samples takes more than {distinct.limit} distinct values "
               f"(finer than {entry.qparams.bits}-bit data): at {WIDE_BITS} bits so its first layer sees them")
        qp = options.derive_qparams("activation", entry.min, entry.max, WIDE_BITS)
        entries[name] = TensorEntry("activation", entry.calibrator, entry.min, entry.max, qp, entry.run_in_float, why)
        changed.append(FineInput(name, distinct.most, why))
    return changed
