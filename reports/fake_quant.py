"""Fake-quant debugging (whitepaper 6.2): run chosen layers in float inside the integer graph, and measure
how much of the model output's accuracy comes back.

A floated layer dequantizes its inputs, runs the float op and quantizes its outputs with their table qparams
(the executor's float fallback). Layers are named as in `reports.layer_nodes`.

What floating cannot fix: a floated layer still quantizes its outputs with their table qparams, so a tensor
whose *range* is wrong (values saturate) stays wrong. The report's `clipped_fraction` shows such tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ptq.core.graph import Graph
from ptq.engine.executor import prepare
from ptq.table.quant_table import QuantTable
from reports.evaluate import evaluate
from reports.evaluation import Evaluation
from reports.layer_nodes import float_node_names, resolve_layer
from reports.output_metrics import OutputMetrics


@dataclass
class LayerRow:
    """One layer of a fake-quant comparison: its cumulative cosine before and after."""

    name: str
    op_type: str
    cosine_before: float
    cosine_after: float
    floated: bool

    def to_dict(self) -> dict:
        return {"name": self.name, "op_type": self.op_type, "cumulative_cosine_before": self.cosine_before,
                "cumulative_cosine_after": self.cosine_after, "float": self.floated}


@dataclass
class FakeQuantResult:
    float_nodes: list[str]
    before: OutputMetrics
    after: OutputMetrics
    layers: list[LayerRow]
    notes: list[str] = field(default_factory=list)  # layer names resolved to the node a rewrite fused them into

    def to_dict(self) -> dict:
        return {"float_nodes": self.float_nodes, "before": self.before.to_dict(), "after": self.after.to_dict(),
                "layers": [row.to_dict() for row in self.layers], "notes": self.notes}


def fake_quant(graph: Graph, table: QuantTable, images, *, layers: Sequence[str] = (), op_types: Sequence[str] = (),
               progress: bool = False, backend=None,
               evaluator: Callable[..., Evaluation] = evaluate) -> FakeQuantResult:
    """Output metrics and per-layer cumulative cosines with the chosen layers / op types in float, and without.
    `evaluator`: `reports.evaluate.evaluate`, or a `ShardedEvaluator` (workers; the same result)."""
    if not layers and not op_types:
        raise ValueError("choose layers (tensor or node names) or op types to run in float")
    base = prepare(graph, table, backend=backend)
    known_ops = {node.op_type for node in graph.nodes}
    unknown = [op for op in op_types if op not in known_ops]
    if unknown:
        raise ValueError(f"op types {unknown} do not occur in the model (it has {sorted(known_ops)})")
    notes = [note for note in (resolve_layer(base, layer).note for layer in layers) if note]
    specs = float_node_names(base, layers) + list(op_types)
    before = evaluator(graph, table, images, isolated=False, progress=progress, desc="integer", backend=backend)
    after = evaluator(graph, table, images, float_nodes=specs, isolated=False, progress=progress, desc="fake-quant",
                      backend=backend)
    floated = set(after.float_nodes)
    after_cum = {s.name: after.cumulative[s.name].result().cosine for s in after.layers}
    rows = [
        LayerRow(s.name, s.op_type, before.cumulative[s.name].result().cosine, after_cum[s.name], s.node in floated)
        for s in before.layers if s.name in after_cum
    ]
    return FakeQuantResult(after.float_nodes, OutputMetrics.of(before), OutputMetrics.of(after), rows, notes)
