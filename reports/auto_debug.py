"""`auto_debug`: the report's top K suspects, each tried alone in float and with its output tensor in 16 bits
(qparams recomputed from the calibrated range), ranked by the output cosine recovered, and a mixed-precision
suggestion: 16 bits where that recovers at least half of what float recovers, float where only float helps
(gains under 5% of the lost cosine do not count).

A floated or 16-bit layer still writes its output on the same calibrated range, so a suspect whose values
saturate stays wrong: `auto_debug` names the suspects that saturate (recalibrate those).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ptq.core.graph import Graph
from ptq.engine.executor import prepare
from ptq.table.quant_table import QuantTable
from reports.build import build_report
from reports.evaluate import evaluate
from reports.evaluation import Evaluation
from reports.layer_nodes import float_node_names
from reports.layer_specs import INPUT_OP, LayerSpec
from reports.layers import Report
from reports.output_metrics import OutputMetrics
from reports.tables import with_bits

MIN_GAIN = 1e-4  # output cosine gains below this are noise, not recovery
MIN_RECOVERY = 0.05  # ... and so are gains below this fraction of the cosine the integer graph lost
SATURATION_HINT = 0.01  # suspects saturating this fraction of their values get a recalibration hint


@dataclass
class Trial:
    mode: str  # "float" | "int16"
    metrics: Optional[OutputMetrics]  # None: not applicable (a graph input cannot run in float)


@dataclass
class AutoRow:
    layer: str
    op_type: str
    reason: str
    float_trial: Trial
    int16_trial: Trial

    def best_cosine(self) -> float:
        return max(t.metrics.cosine for t in (self.float_trial, self.int16_trial) if t.metrics is not None)

    def to_dict(self) -> dict:
        def trial(t: Trial):
            return None if t.metrics is None else t.metrics.to_dict()
        return {"layer": self.layer, "op_type": self.op_type, "reason": self.reason,
                "float": trial(self.float_trial), "int16": trial(self.int16_trial)}


@dataclass
class Suggestion:
    int16_tensors: list[str] = field(default_factory=list)
    float_layers: list[str] = field(default_factory=list)
    float_nodes: list[str] = field(default_factory=list)  # the node names of float_layers (for --float-nodes)
    metrics: Optional[OutputMetrics] = None  # measured with the suggestion applied
    saturating: list[tuple[str, float]] = field(default_factory=list)  # suspects clipping >= SATURATION_HINT

    def to_dict(self) -> dict:
        return {"int16_tensors": self.int16_tensors, "float_layers": self.float_layers,
                "float_nodes": self.float_nodes, "metrics": None if self.metrics is None else self.metrics.to_dict(),
                "saturating": [{"tensor": name, "clipped_fraction": f} for name, f in self.saturating]}


@dataclass
class AutoResult:
    report: Report
    baseline: OutputMetrics
    rows: list[AutoRow]  # ranked: best recovered output cosine first
    suggestion: Suggestion
    mixed_table: Optional[QuantTable]  # the table with the suggested 16-bit tensors (None when there are none)

    def to_dict(self) -> dict:
        return {"baseline": self.baseline.to_dict(), "suspects": [r.to_dict() for r in self.rows],
                "suggestion": self.suggestion.to_dict()}


def outputs_only(graph: Graph, table: QuantTable, images, float_nodes: Sequence[str] = (), desc: str = "",
                  backend=None, progress: bool = False, evaluator: Callable[..., Evaluation] = evaluate) -> OutputMetrics:
    """The graph outputs' metrics only (`evaluator`: `evaluate` or a `ShardedEvaluator`)."""
    ev = evaluator(graph, table, images, float_nodes=float_nodes, layers=False, isolated=False, desc=desc,
                   backend=backend, progress=progress)
    return OutputMetrics.of(ev)


def suggest(baseline: OutputMetrics, rows: Sequence[AutoRow]) -> Suggestion:
    """A gain counts when it is at least MIN_GAIN and MIN_RECOVERY of the lost cosine (1 - baseline cosine).
    16 bits where that gain counts and is >= half of what float recovers; float where only float's gain counts."""
    threshold = max(MIN_GAIN, MIN_RECOVERY * (1.0 - baseline.cosine))
    result = Suggestion()
    for row in rows:
        gain_float = row.float_trial.metrics.cosine - baseline.cosine if row.float_trial.metrics else 0.0
        gain16 = row.int16_trial.metrics.cosine - baseline.cosine if row.int16_trial.metrics else 0.0
        if gain16 >= threshold and gain16 >= 0.5 * gain_float:
            result.int16_tensors.append(row.layer)
        elif gain_float >= threshold:
            result.float_layers.append(row.layer)
    return result


def auto_debug(graph: Graph, table: QuantTable, images, k: int, *, model: str = "", quant: str = "",
               isolated_images: Optional[int] = None, progress: bool = False, backend=None,
               evaluator: Callable[..., Evaluation] = evaluate) -> AutoResult:
    """Report, then try each of the top `k` suspects alone in float and in 16 bits (see the module docstring).
    `evaluator`: `reports.evaluate.evaluate`, or a `ShardedEvaluator` (workers; the same result)."""
    if k <= 0:
        raise ValueError(f"--auto needs a positive number of suspects, got {k}")
    base = prepare(graph, table, backend=backend)
    ev = evaluator(graph, table, images, isolated_images=isolated_images, progress=progress, backend=backend)
    report = build_report(ev, model, quant)
    baseline = OutputMetrics.of(ev)
    specs: dict[str, LayerSpec] = {s.name: s for s in ev.layers}
    rows = []
    for suspect in report.bottlenecks[:k]:
        spec = specs[suspect.name]
        float_trial = Trial("float", None)
        if spec.op_type != INPUT_OP:
            nodes = float_node_names(base, [suspect.name])
            float_trial = Trial("float", outputs_only(graph, table, images, nodes, desc=f"float {suspect.name}",
                                                       backend=backend, progress=progress, evaluator=evaluator))
        int16_trial = Trial("int16", None)
        if suspect.name in table.tensors and table.tensors[suspect.name].kind == "activation":
            wide = with_bits(table, [suspect.name], 16)
            int16_trial = Trial("int16", outputs_only(graph, wide, images, desc=f"int16 {suspect.name}",
                                                       backend=backend, progress=progress, evaluator=evaluator))
        rows.append(AutoRow(suspect.name, spec.op_type, suspect.reason, float_trial, int16_trial))
    rows.sort(key=lambda r: -r.best_cosine())
    suggestion = suggest(baseline, rows)
    suggestion.float_nodes = float_node_names(base, suggestion.float_layers)
    clipped = {layer.name: layer.clipped for layer in report.layers}
    suggestion.saturating = [(r.layer, clipped[r.layer]) for r in rows if clipped[r.layer] >= SATURATION_HINT]
    mixed = with_bits(table, suggestion.int16_tensors, 16) if suggestion.int16_tensors else None
    if suggestion.int16_tensors or suggestion.float_layers:
        suggestion.metrics = outputs_only(graph, mixed or table, images, suggestion.float_nodes, desc="suggested",
                                           backend=backend, progress=progress, evaluator=evaluator)
    return AutoResult(report, baseline, rows, suggestion, mixed)
