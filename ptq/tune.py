"""`tune`: change a quant table step by step until the logits cosine on the tuning images reaches a target.

Candidates, in order of expected gain per cost (each kept only if it raises the cosine by at least
`min_gain`; tuning stops as soon as the target is reached):

1. per-channel weights (when the table is per-tensor): free at run time on most accelerators;
2. a better activation range: every activation recalibrated with each of `range_calibrators` on the tuning
   images (one statistics pass), the best kept;
3. 16 bits, groups first (the outputs of all depthwise Convs, then the weights of all depthwise Convs: most
   of what per-channel int8 loses is weight rounding, then every other weight), then single activations in the order of the report's
   bottleneck ranking, within `budget_int16` tensors (activations and weights count alike);
4. float, a layer at a time in the ranking's order, only with `allow_float` > 0 (the last resort);
5. once the target is reached, each kept 16-bit step but the last is undone, latest first, if the cosine
   stays at the target without it (`prune`).

Every figure is the mean logits cosine over the tuning images (`reports.evaluate`, outputs only), so report
the result on held-out images: tuning fits the images it measures.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ptq.core.graph import Graph
from ptq.executor import prepare
from ptq.quant_table import QuantTable
from ptq.weight_scale_floor import floor_weight_scales
from reports.auto_debug import outputs_only
from reports.build import build_report
from reports.evaluate import evaluate
from reports.evaluation import Evaluation
from reports.layer_nodes import float_node_names
from reports.tables import with_bits

logger = logging.getLogger("ptq.tune")

DEFAULT_RANGE_CALIBRATORS = ("mse", "kld", "99.999percentile")


@dataclass
class TuneStep:
    change: str  # what was tried, e.g. "per-channel weights", "int16: <tensor>"
    cosine: float  # the cosine measured with the change
    gain: float  # over the cosine before it
    kept: bool
    int16: list[str] = field(default_factory=list)  # tensors this step moved to 16 bits
    float_layers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TuneResult:
    table: QuantTable
    baseline: float
    cosine: float
    target: float
    steps: list[TuneStep]
    int16_tensors: list[str]
    float_nodes: list[str]

    @property
    def reached(self) -> bool:
        return self.cosine >= self.target

    def to_dict(self) -> dict:
        return {"target_cosine": self.target, "baseline_cosine": self.baseline, "cosine": self.cosine,
                "reached": self.reached, "int16_tensors": self.int16_tensors, "float_nodes": self.float_nodes,
                "steps": [s.to_dict() for s in self.steps]}

    def summary(self) -> str:
        lines = [f"baseline cosine {self.baseline:.5f} -> {self.cosine:.5f} (target {self.target}: "
                 f"{'reached' if self.reached else 'NOT reached'})"]
        for s in self.steps:
            lines.append(f"  {'kept   ' if s.kept else 'dropped'} {s.change}: {s.cosine:.5f} ({s.gain:+.5f})")
        lines.append(f"{len(self.int16_tensors)} tensor(s) in 16 bits, {len(self.float_nodes)} node(s) in float")
        return "\n".join(lines)


def per_channel_weights(graph: Graph, table: QuantTable) -> QuantTable:
    """The table with every weight recalibrated per output channel (activations untouched)."""
    from ptq.pipeline import weight_entries

    options = dataclasses.replace(table.options, per_channel=True)
    tensors = dict(table.tensors)
    tensors.update(weight_entries(graph, options))
    floor_weight_scales(graph, tensors, options)
    return dataclasses.replace(table, options=options, tensors=tensors)


def recalibrated(graph: Graph, table: QuantTable, stats, calibrator: str) -> QuantTable:
    """The table with every activation's range from `calibrator` on `stats` (16-bit tensors stay 16-bit)."""
    from ptq.pipeline import activation_entries

    options = dataclasses.replace(table.options, calibrator=calibrator)
    entries = activation_entries(graph, stats, options)
    tensors = dict(table.tensors)
    wide = [n for n, e in table.tensors.items() if e.kind == "activation" and e.qparams.bits != options.bits]
    tensors.update(entries)
    return with_bits(dataclasses.replace(table, tensors=tensors), wide, 16) if wide else \
        dataclasses.replace(table, tensors=tensors)


def _depthwise(graph: Graph) -> list:
    return [n for n in graph.nodes if n.op_type == "Conv" and int(n.attr("group", 1)) > 1]


def depthwise_outputs(graph: Graph) -> list[str]:
    """The tensors the depthwise Convs write once fused: through a single-consumer Relu/Clip to its output."""
    consumers = graph.consumers()
    out = []
    for node in _depthwise(graph):
        name = node.outputs[0]
        users = consumers.get(name, [])
        if len(users) == 1 and users[0].op_type in ("Relu", "Clip") and name not in graph.outputs:
            name = users[0].outputs[0]
        out.append(name)
    return out


def depthwise_weights(graph: Graph) -> list[str]:
    return [n.inputs[1] for n in _depthwise(graph) if len(n.inputs) > 1 and n.inputs[1] in graph.initializers]


def with_weight_bits(graph: Graph, table: QuantTable, weights: Sequence[str], bits: int) -> QuantTable:
    """The table with the listed weights recalibrated at `bits` (same calibrator, granularity, symmetry)."""
    from ptq.pipeline import weight_entries

    options = dataclasses.replace(table.options, weight_bits=bits)
    entries = weight_entries(graph, options)
    tensors = dict(table.tensors)
    tensors.update({w: entries[w] for w in weights})
    floor_weight_scales(graph, tensors, table.options)
    return dataclasses.replace(table, tensors=tensors)


def prune(graph: Graph, original: QuantTable, state: dict, steps: list, measure, target: float,
          current: float) -> float:
    """Once the target is reached: undo each kept 16-bit step, latest first but the last, while the cosine
    stays at the target (fewer 16-bit tensors for the same target). Returns the final cosine."""
    for step in [s for s in steps if s.kept and s.int16][-2::-1]:
        names = [n for n in step.int16 if n in state["int16"]]
        acts = [n for n in names if original.tensors[n].kind == "activation"]
        weights = [n for n in names if original.tensors[n].kind == "weight"]
        candidate = state["table"]
        if acts:
            candidate = with_bits(candidate, acts, original.options.bits)
        if weights:
            candidate = with_weight_bits(graph, candidate, weights, original.options.weight_bits)
        cosine = measure(candidate, state["float"])
        kept = cosine >= target
        steps.append(TuneStep(f"back to {original.options.bits}/{original.options.weight_bits} bits: {step.change}",
                              cosine, cosine - current, kept))
        logger.info("%s: %.5f%s", steps[-1].change, cosine, "" if kept else ", kept in 16 bits")
        if kept:
            state["table"] = candidate
            state["int16"] = [n for n in state["int16"] if n not in names]
            current = cosine
    return current


def tune(graph: Graph, table: QuantTable, images, target: float, *, budget_int16: int = 8, allow_float: int = 0,
         stats_for: Optional[Callable[[Sequence[str]], dict]] = None,
         range_calibrators: Sequence[str] = DEFAULT_RANGE_CALIBRATORS, min_gain: float = 1e-5,
         evaluator: Callable[..., Evaluation] = evaluate) -> TuneResult:
    """See the module docstring. `stats_for(calibrators)`: activation statistics on the tuning images for the
    range step (None skips it). `evaluator`: `reports.evaluate.evaluate`, or a `ShardedEvaluator` (workers;
    the same result)."""
    state = {"table": table, "float": [], "int16": []}

    def measure(candidate: QuantTable, float_layers=()) -> float:
        nodes = float_node_names(prepare(graph, candidate), list(float_layers)) if float_layers else []
        return outputs_only(graph, candidate, images, nodes, evaluator=evaluator).cosine

    baseline = current = measure(table)
    steps: list[TuneStep] = []

    def attempt(change: str, candidate: QuantTable, int16=(), float_layers=()) -> bool:
        nonlocal current
        cosine = measure(candidate, state["float"] + list(float_layers))
        gain = cosine - current
        kept = gain >= min_gain
        steps.append(TuneStep(change, cosine, gain, kept, list(int16), list(float_layers)))
        logger.info("%s: %.5f (%+.5f)%s", change, cosine, gain, "" if kept else ", dropped")
        if kept:
            state["table"], current = candidate, cosine
            state["int16"] += list(int16)
            state["float"] += list(float_layers)
        return kept

    def done() -> bool:
        return current >= target

    if not done() and not table.options.per_channel:
        attempt("per-channel weights", per_channel_weights(graph, state["table"]))
    if not done() and stats_for is not None and range_calibrators:
        stats = stats_for(list(range_calibrators))
        for name in range_calibrators:
            if done():
                break
            attempt(f"activation ranges: {name}", recalibrated(graph, state["table"], stats, name))
    activations = {n for n, e in table.tensors.items() if e.kind == "activation"}
    if not done() and budget_int16 > 0:
        for label, tensors in (("all depthwise outputs", [t for t in depthwise_outputs(graph) if t in activations]),):
            fresh = [t for t in tensors if t not in state["int16"]]
            if fresh and len(state["int16"]) + len(fresh) <= budget_int16 and not done():
                attempt(f"int16: {label} ({len(fresh)})", with_bits(state["table"], fresh, 16), int16=fresh)
        weights = [w for w in depthwise_weights(graph) if w in table.tensors and w not in state["int16"]]
        if weights and len(state["int16"]) + len(weights) <= budget_int16 and not done():
            attempt(f"int16 weights: all depthwise Convs ({len(weights)})",
                    with_weight_bits(graph, state["table"], weights, 16), int16=weights)
        rest = [n for n, e in table.tensors.items() if e.kind == "weight" and n not in state["int16"]]
        if rest and len(state["int16"]) + len(rest) <= budget_int16 and not done():
            attempt(f"int16 weights: every other weight ({len(rest)})",
                    with_weight_bits(graph, state["table"], rest, 16), int16=rest)
    ranking = []
    if not done() and (budget_int16 > len(state["int16"]) or allow_float > 0):
        ev = evaluator(graph, state["table"], images, isolated=True)
        ranking = [b.name for b in build_report(ev, "", "").bottlenecks]
    if not done() and budget_int16 > 0:
        for name in ranking:
            if done() or len(state["int16"]) >= budget_int16:
                break
            if name in activations and name not in state["int16"]:
                attempt(f"int16: {name}", with_bits(state["table"], [name], 16), int16=[name])
    if not done() and allow_float > 0:
        for name in ranking:
            if done() or len(state["float"]) >= allow_float:
                break
            if name not in state["float"] and name not in graph.inputs:
                attempt(f"float: {name}", state["table"], float_layers=[name])
    if done():
        current = prune(graph, table, state, steps, measure, target, current)
    nodes = float_node_names(prepare(graph, state["table"]), state["float"]) if state["float"] else []
    return TuneResult(state["table"], baseline, current, target, steps, list(state["int16"]), nodes)
