"""The verdict `ptq tune` gives: whether what it writes reaches the goal on the validation samples it decided on.

The integer graph was judged on the validation samples (each photo with its views); the QDQ model it writes
is what most users deploy, so it is judged on the same samples, against the same float references, by the same
rule (`ptq.tuning.goal`), in onnxruntime twice:

- graph optimizations off: the QDQ graph's own arithmetic, op by op;
- onnxruntime's default (ORT_ENABLE_ALL): QDQ groups fused into integer kernels, what a deployed model runs.

"reached" is said only when the integer graph and both QDQ runs reach the goal; otherwise the verdict names
each run that fell short and by how much. The integer graph's score is the tuner's last measurement (the same
graph and table, the float layers run by the table's marks as by the node list the tuner measured with).

The QDQ model should compute what the integer run computes: each QDQ run's mean validation cosine within
`TOLERANCE` (0.002) of the integer graph's. When one is not, the verdict warns and says why:
- with optimizations off too, the QDQ graph itself computes otherwise: the first tensor of the table, in the
  integer run's order, whose values differ between the two runs by more than TOLERANCE in centred cosine
  (the correlation: a Relu's output, all positive, has a plain cosine near 1 whatever its error), on the
  `DEPARTURE_SAMPLES` validation samples the QDQ model scores worst on, is named with the node writing it, and
  with the tensors the QDQ model rounds on the way that the integer run fuses away (`ptq.qdq.departure`; e.g. a
  Gemm's output kept at 4 bits before a Relu whose output was moved to 16 bits: the integer Gemm+Relu writes
  the 16-bit output directly, the QDQ model rounds to 4 bits first; `ptq.tuning.export_alignment` removes the
  causes the tuning itself leaves);
- with optimizations on only, onnxruntime's fused kernels do not compute the QDQ arithmetic exactly on this
  machine (`ptq.qdq.check`, with its advice for the target).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx
from tqdm import tqdm

from ptq.core.graph import Graph
from ptq.qdq.check import TOLERANCE, QDQCheck, QDQCheckError, qdq_session, run_session
from ptq.qdq.departure import first_departure
from ptq.table.quant_table import QuantTable
from ptq.tuning.data import Score, Validation
from ptq.tuning.goal import Goal

DEPARTURE_SAMPLES = 8  # the validation samples `first_departure` compares the two runs' tensors on
INTEGER, UNOPTIMIZED, OPTIMIZED = ("the integer graph", "the QDQ model with optimizations off",
                                   "the QDQ model with optimizations on")


@dataclass(frozen=True)
class Verdict:
    """The three runs' scores over the validation samples (a QDQ score None: onnxruntime could not run the model,
    `failure` says why), the QDQ target, and where the QDQ graph first departs from the integer run (when its
    unoptimized figure disagrees with the integer graph's)."""

    goal: Goal
    integer: Score
    qdq_unoptimized: Optional[Score]
    qdq_optimized: Optional[Score]
    samples: int
    photos: int
    target: str
    failure: Optional[str] = None
    departure: Optional[str] = None

    def runs(self) -> list[tuple[str, Optional[Score]]]:
        return [(INTEGER, self.integer), (UNOPTIMIZED, self.qdq_unoptimized), (OPTIMIZED, self.qdq_optimized)]

    def shortfalls(self) -> list[str]:
        """Each run that misses the goal: which, what, by how much."""
        missed = []
        for label, score in self.runs():
            if score is None:
                missed.append(f"{label}: onnxruntime could not run it ({self.failure})")
            else:
                missed += [f"{label}: {miss}" for miss in self.goal.shortfalls(score)]
        return missed

    @property
    def reached(self) -> bool:
        return not self.shortfalls()

    @property
    def check(self) -> Optional[QDQCheck]:
        """The two QDQ figures as `ptq calibrate`'s onnxruntime check reports them (mean validation cosine)."""
        if self.qdq_unoptimized is None or self.qdq_optimized is None:
            return None
        return QDQCheck(self.target, self.samples, self.qdq_unoptimized.mean, self.qdq_optimized.mean, "validation")

    def warnings(self) -> list[str]:
        """The module docstring's disagreements with the integer run, each with why."""
        if self.qdq_unoptimized is None or self.qdq_optimized is None:
            return [f"the QDQ model written could not be run in onnxruntime ({self.failure}): nothing says it "
                    f"computes what the integer run computes"]
        found = []
        off, on, ours = self.qdq_unoptimized.mean, self.qdq_optimized.mean, self.integer.mean
        if abs(off - ours) > TOLERANCE:
            why = self.departure or ("no tensor of the table differs by that much: the difference accumulates over "
                                     "the graph")
            found.append(f"the QDQ model written does not compute what the integer run computes: validation cosine "
                         f"{off:.4f} in onnxruntime with optimizations off against {ours:.4f} for the integer graph "
                         f"(gap {abs(off - ours):.4f} > {TOLERANCE}); {why}")
        if abs(on - ours) > TOLERANCE and abs(off - ours) <= TOLERANCE:
            fused = QDQCheck(self.target, self.samples, off, on, "validation").warning()
            found.append(f"the QDQ model written, run with onnxruntime's default optimizations, does not compute what "
                         f"the integer run computes: validation cosine {on:.4f} against {ours:.4f} for the integer "
                         f"graph (gap {abs(on - ours):.4f} > {TOLERANCE}); "
                         + (fused or "its fused kernels compute otherwise than the QDQ graph on this machine"))
        return found

    def lines(self) -> list[str]:
        """What the summary prints: each QDQ run's figures, then the verdict and its warnings."""
        held = (f"the same {self.samples} validation samples ({self.photos} photos with their views)"
                if self.samples != self.photos else f"the same {self.samples} validation samples")
        lines = []
        if self.qdq_unoptimized is not None and self.qdq_optimized is not None:
            lines.append(f"QDQ model in onnxruntime (target {self.target}) on {held}: "
                         f"optimizations off {self._figures(self.qdq_unoptimized)}, "
                         f"on {self._figures(self.qdq_optimized)}")
        missed = self.shortfalls()
        if missed:
            lines.append("target NOT reached: " + "; ".join(missed))
        else:
            lines.append("target reached by the integer graph and the QDQ model written (onnxruntime, optimizations "
                         "off and on)")
        return lines + [f"warning: {w}" for w in self.warnings()]

    @staticmethod
    def _figures(score: Score) -> str:
        text = f"cosine {score.mean:.5f} +- {score.sem:.5f}"
        return text + (f", {score.metric.name} {score.metric.value:.4f}" if score.metric is not None else "")

    def to_dict(self) -> dict:
        def score(s: Optional[Score]) -> Optional[dict]:
            if s is None:
                return None
            return {"cosine": s.mean, "cosine_sem": s.sem,
                    "metric": s.metric.to_dict() if s.metric is not None else None}

        return {"reached": self.reached, "samples": self.samples, "photos": self.photos, "target": self.target,
                "integer": score(self.integer), "qdq_unoptimized": score(self.qdq_unoptimized),
                "qdq_optimized": score(self.qdq_optimized), "shortfalls": self.shortfalls(),
                "warnings": self.warnings()}


def judge(graph: Graph, table: QuantTable, qdq_model: onnx.ModelProto, validation: Validation, goal: Goal,
          integer: Score, target: str) -> Verdict:
    """The verdict (module docstring) on the QDQ model `qdq_model` exported from `graph` with `table`, whose integer
    run scored `integer` on `validation`."""
    first = graph.outputs[0]
    measured: list[list] = [[], []]
    try:
        sessions = [qdq_session(qdq_model, optimize=False), qdq_session(qdq_model, optimize=True)]
        for k in tqdm(range(len(validation)), unit="img", desc="QDQ check", leave=False,
                      disable=None if validation.progress else True):
            for session, values in zip(sessions, measured):
                values.append(validation.measure(k, run_session(session, validation.inputs[k]), first))
    except QDQCheckError as exc:
        return Verdict(goal, integer, None, None, len(validation), validation.photos, target, failure=str(exc))
    off, on = validation.score(measured[0]), validation.score(measured[1])
    departure = None
    if abs(off.mean - integer.mean) > TOLERANCE:
        worst = np.argsort([cosine for cosine, _ in measured[0]])[:DEPARTURE_SAMPLES]
        departure = first_departure(graph, table, qdq_model, [validation.inputs[k] for k in worst],
                                    f"the {len(worst)} validation samples the QDQ model scores worst on")
    return Verdict(goal, integer, off, on, len(validation), validation.photos, target, departure=departure)
