"""The float run the reports compare against: `ptq.engine.float_run.FloatRunner` on the original model, with every
reported tensor as an extra output, one intra-op thread.

One thread: onnxruntime's default pool keeps spinning after each run and takes the cores the integer graph runs
on next (measured on 20 images of EfficientNet-Lite0, float and integer runs interleaved: 4.7 s with the default
pool, 3.0 s with one thread; the float run alone takes 0.3-0.4 s).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ptq.core.graph import Graph
from ptq.engine.float_run import FloatRunner

REPORT_FLOAT_THREADS = 1


def float_reference(graph: Graph, tensors: Sequence[str]) -> FloatRunner:
    """The float runner of a report: `run_dict(sample)` gives the float tensors `tensors` of one sample."""
    return FloatRunner.create(graph, tensors, intra_op_threads=REPORT_FLOAT_THREADS)


@dataclass
class GoalReference:
    """The float reference of a graph with adjusted weights (`ptq.adjust.adjusted_model`): the layers' tensors from
    the adjusted model, whose tensors the table's grids were fitted on (equalization rescales channels), and
    the graph outputs from the user's own model, which the integer outputs are meant to match: bias
    correction moves the adjusted model's outputs away from it on purpose (bundled model, per-channel with bias
    correction, 20 eval photos: the integer logits score 0.9968 against the user's model, 0.9918 against the
    bias-corrected one)."""

    adjusted: FloatRunner
    goal: FloatRunner

    @property
    def tensors(self) -> list[str]:
        return self.adjusted.tensors

    def run_dict(self, sample) -> dict:
        floats = self.adjusted.run_dict(sample)
        floats.update(self.goal.run_dict(sample))
        return floats
