"""Fake-quant debugging (whitepaper 6.2): run chosen layers in float inside the integer graph, and measure
how much of the model output's accuracy comes back.

A floated layer dequantizes its inputs, runs the float op and quantizes its outputs with their table qparams
(the executor's float fallback). A layer is named by its tensor (as in the report) or its node; floating a
Conv or Gemm also floats the BatchNormalization and the Relu/Clip/LeakyRelu the executor fused into it, so the
whole fused layer runs in float. A name a rewrite removed (a Conv's raw output before the Clip fused into it, or
the fused activation / folded BatchNormalization node) resolves to the node that absorbed it, with a note.

`auto_debug` takes the report's top K suspects and tries each alone in float and with its output tensor in
16 bits (qparams recomputed from the calibrated range), ranks them by the output cosine recovered, and
suggests a mixed-precision setting: 16 bits where that recovers at least half of what float recovers,
float where only float helps (gains under 5% of the lost cosine do not count).

What floating cannot fix: a floated layer still quantizes its outputs with their table qparams, so a tensor
whose *range* is wrong (values saturate) stays wrong, and 16 bits over the same range too. The report's
`clipped_fraction` shows such tensors; `auto_debug` names the suspects that saturate (recalibrate those).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from ptq.executor import IntegerGraph, prepare
from ptq.float_run import image_input
from ptq.core.graph import Graph
from ptq.quant_table import QuantTable
from reports.evaluate import INPUT_OP, Evaluation, FloatReference, LayerSpec, build_report, evaluate, layer_specs
from reports.layers import Report, qparams_summary
from reports.tables import with_bits

MIN_GAIN = 1e-4  # output cosine gains below this are noise, not recovery
MIN_RECOVERY = 0.05  # ... and so are gains below this fraction of the cosine the integer graph lost
SATURATION_HINT = 0.01  # suspects saturating this fraction of their values get a recalibration hint


@dataclass(frozen=True)
class OutputMetrics:
    cosine: float
    mse: float
    sqnr_db: float
    top1_agreement: Optional[float]
    top5_agreement: Optional[float]

    @classmethod
    def of(cls, ev: Evaluation) -> "OutputMetrics":
        sim = next(iter(ev.outputs.values())).result()
        c = ev.classification
        top1 = top5 = None
        if c is not None and c.samples:
            top1, top5 = c.top1_agree / c.samples, c.topk_agree / c.samples
        return cls(sim.cosine, sim.mse, sim.sqnr_db, top1, top5)

    def to_dict(self) -> dict:
        return {"cosine": self.cosine, "mse": self.mse, "sqnr_db": self.sqnr_db,
                "top1_agreement": self.top1_agreement, "top5_agreement": self.top5_agreement}

    def line(self) -> str:
        text = f"cosine {self.cosine:.6f}  sqnr {self.sqnr_db:.2f} dB"
        if self.top1_agreement is not None:
            text += f"  top-1 agreement {self.top1_agreement:.3f}  top-5 agreement {self.top5_agreement:.3f}"
        return text


@dataclass(frozen=True)
class ResolvedLayer:
    """A layer name resolved to the node of the integer graph that computes it."""

    node: str
    note: Optional[str] = None  # set when the name was removed by a rewrite: which node absorbed it


def absorbed_names(prepared: IntegerGraph) -> dict[str, str]:
    """Names the rewrites removed -> the node of the integer graph that absorbed them: a BatchNormalization
    folded into its Conv and a Relu/Clip/LeakyRelu fused into its Conv/Gemm, each by the removed node's name
    and by the tensor the host produced before (e.g. a Conv's raw output, now internal to Conv+Clip)."""
    rewrites = prepared.rewrites
    hosts = {}
    for fold in rewrites.batchnorm_folds:
        hosts[fold.batchnorm] = hosts[fold.removed_tensor] = fold.conv
    for fusion in rewrites.fusions:
        hosts[fusion.activation] = hosts[fusion.removed_tensor] = fusion.host
    return hosts


def resolve_layer(prepared: IntegerGraph, layer: str) -> ResolvedLayer:
    """The node computing `layer`: a node name, the producer of a tensor name, or, for a name a rewrite
    removed, the node that absorbed it (with a note saying so)."""
    steps = {step.node.name: step for step in prepared.steps}
    producer = {out: step.node.name for step in prepared.steps for out in step.node.outputs if out}
    if layer in steps:
        return ResolvedLayer(layer)
    if layer in producer:
        return ResolvedLayer(producer[layer])
    if layer in prepared.graph.inputs:
        raise ValueError(f"{layer!r} is a graph input: it has no layer to run in float")
    host = absorbed_names(prepared).get(layer)
    if host is None:
        raise ValueError(f"{layer!r} is neither a tensor nor a node of the integer graph")
    node = steps[host].node
    outputs = ", ".join(repr(o) for o in node.outputs if o)
    return ResolvedLayer(host, f"{layer!r} is not in the integer graph: a rewrite fused it into {node.op_type} node "
                               f"{host!r} (output {outputs}); that node runs in float")


def layer_nodes(prepared: IntegerGraph, layer: str) -> list[str]:
    """The original node names that make up a layer (tensor or node name of the integer graph, or a name a
    rewrite fused away): its producing node plus whatever the rewrites folded or fused into it."""
    node = resolve_layer(prepared, layer).node
    rewrites = prepared.rewrites
    extra = [f.activation for f in rewrites.fusions if f.host == node]
    extra += [f.batchnorm for f in rewrites.batchnorm_folds if f.conv == node]
    return [node] + extra


def float_node_names(prepared: IntegerGraph, layers: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(name for layer in layers for name in layer_nodes(prepared, layer)))


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
               progress: bool = False, backend=None) -> FakeQuantResult:
    """Output metrics and per-layer cumulative cosines with the chosen layers / op types in float, and without."""
    if not layers and not op_types:
        raise ValueError("choose layers (tensor or node names) or op types to run in float")
    base = prepare(graph, table, backend=backend)
    known_ops = {node.op_type for node in graph.nodes}
    unknown = [op for op in op_types if op not in known_ops]
    if unknown:
        raise ValueError(f"op types {unknown} do not occur in the model (it has {sorted(known_ops)})")
    notes = [note for note in (resolve_layer(base, layer).note for layer in layers) if note]
    specs = float_node_names(base, layers) + list(op_types)
    before = evaluate(graph, table, images, isolated=False, prepared=base, progress=progress, desc="integer")
    after = evaluate(graph, table, images, float_nodes=specs, isolated=False, progress=progress, desc="fake-quant",
                     backend=backend)
    floated = set(after.float_nodes)
    after_cum = {s.name: after.cumulative[s.name].result().cosine for s in after.layers}
    rows = [
        LayerRow(s.name, s.op_type, before.cumulative[s.name].result().cosine, after_cum[s.name], s.node in floated)
        for s in before.layers if s.name in after_cum
    ]
    return FakeQuantResult(after.float_nodes, OutputMetrics.of(before), OutputMetrics.of(after), rows, notes)


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


def _outputs_only(graph: Graph, table: QuantTable, images, float_nodes: Sequence[str] = (), desc: str = "",
                  backend=None) -> OutputMetrics:
    ev = evaluate(graph, table, images, float_nodes=float_nodes, layers=False, isolated=False, desc=desc,
                  backend=backend)
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
               isolated_images: Optional[int] = None, progress: bool = False, backend=None) -> AutoResult:
    """Report, then try each of the top `k` suspects alone in float and in 16 bits (see the module docstring)."""
    if k <= 0:
        raise ValueError(f"--auto needs a positive number of suspects, got {k}")
    base = prepare(graph, table, backend=backend)
    ev = evaluate(graph, table, images, prepared=base, isolated_images=isolated_images, progress=progress)
    report = build_report(ev, model, quant)
    baseline = OutputMetrics.of(ev)
    specs: dict[str, LayerSpec] = {s.name: s for s in ev.layers}
    rows = []
    for suspect in report.bottlenecks[:k]:
        spec = specs[suspect.name]
        float_trial = Trial("float", None)
        if spec.op_type != INPUT_OP:
            nodes = float_node_names(base, [suspect.name])
            float_trial = Trial("float", _outputs_only(graph, table, images, nodes, desc=f"float {suspect.name}",
                                                       backend=backend))
        int16_trial = Trial("int16", None)
        if suspect.name in table.tensors and table.tensors[suspect.name].kind == "activation":
            wide = with_bits(table, [suspect.name], 16)
            int16_trial = Trial("int16", _outputs_only(graph, wide, images, desc=f"int16 {suspect.name}",
                                                       backend=backend))
        rows.append(AutoRow(suspect.name, spec.op_type, suspect.reason, float_trial, int16_trial))
    rows.sort(key=lambda r: -r.best_cosine())
    suggestion = suggest(baseline, rows)
    suggestion.float_nodes = float_node_names(base, suggestion.float_layers)
    clipped = {layer.name: layer.clipped for layer in report.layers}
    suggestion.saturating = [(r.layer, clipped[r.layer]) for r in rows if clipped[r.layer] >= SATURATION_HINT]
    mixed = with_bits(table, suggestion.int16_tensors, 16) if suggestion.int16_tensors else None
    if suggestion.int16_tensors or suggestion.float_layers:
        suggestion.metrics = _outputs_only(graph, mixed or table, images, suggestion.float_nodes, desc="suggested",
                                           backend=backend)
    return AutoResult(report, baseline, rows, suggestion, mixed)


def auto_table(result: AutoResult) -> str:
    """The ranked --auto table for stdout."""
    def cell(t: Trial) -> str:
        if t.metrics is None:
            return f"{'n/a':>9} {'':>6}"
        top1 = "" if t.metrics.top1_agreement is None else f"{t.metrics.top1_agreement:.3f}"
        return f"{t.metrics.cosine:9.6f} {top1:>6}"

    b = result.baseline
    width = max([len(r.layer) for r in result.rows] + [5])
    top1 = "" if b.top1_agreement is None else f", top-1 agreement {b.top1_agreement:.3f}"
    lines = [f"integer baseline: output cosine {b.cosine:.6f}{top1}",
             f"{'rank':<4} {'layer':<{width}} {'op':<10} {'float cos':>9} {'top-1':>6} {'int16 cos':>9} {'top-1':>6}"]
    for k, row in enumerate(result.rows, 1):
        lines.append(f"{k:<4} {row.layer:<{width}} {row.op_type:<10} {cell(row.float_trial)} {cell(row.int16_trial)}")
    s = result.suggestion
    if not (s.int16_tensors or s.float_layers):
        lines.append("suggestion: none of these layers recovers the output (keep the table as it is)")
    else:
        if s.int16_tensors:
            lines.append(f"suggestion: 16 bits for {', '.join(s.int16_tensors)}")
        if s.float_layers:
            lines.append(f"suggestion: float for {', '.join(s.float_layers)} "
                         f"(ptq run/report --float-nodes {' '.join(s.float_nodes)})")
        if s.metrics is not None:
            lines.append(f"with the suggestion: output {s.metrics.line()}")
    for name, fraction in s.saturating:
        lines.append(f"note: {name} saturates {100 * fraction:.1f}% of its float values; a floated or 16-bit layer "
                     "still writes that tensor on the same range, so recalibrate it (its range is too small)")
    return "\n".join(lines)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def dump_tensors(graph: Graph, table: QuantTable, images, out_dir: Union[str, Path], *, layers: Sequence[str] = (),
                 float_nodes: Sequence[str] = (), max_images: int = 1, backend=None) -> Path:
    """Save the float and integer tensors of `layers` (all reported tensors when empty) for the first
    `max_images` images as .npy files, with `index.json` describing them (tensor, op, shape, qparams, files).

    Integer tensors are saved as their codes; dequantize with x_f = (x_q - zero_point) * scale from the index.
    """
    if max_images <= 0:
        raise ValueError(f"--dump-images must be positive, got {max_images}")
    prepared = prepare(graph, table, float_nodes=float_nodes, backend=backend)
    specs = layer_specs(prepared, graph.activations)
    if layers:
        known = {s.name for s in specs}
        by_node = {s.node: s.name for s in specs}
        wanted = []
        for layer in layers:
            if layer not in known and layer not in by_node:
                raise ValueError(f"--dump: {layer!r} is not a reported tensor or node of the integer graph")
            wanted.append(layer if layer in known else by_node[layer])
        specs = [s for s in specs if s.name in set(wanted)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runner = FloatReference(graph, [s.name for s in specs])
    input_name = image_input(graph)
    index = {"float_nodes": [f.name for f in prepared.float_nodes], "images": [], "tensors": []}
    for spec in specs:
        qp = prepared.qparams[spec.name]
        index["tensors"].append({"name": spec.name, "node": spec.node, "op_type": spec.op_type, "bits": qp.bits,
                                 "qparams": qparams_summary(qp), "scale": [float(v) for v in qp.scale],
                                 "zero_point": [int(v) for v in qp.zero_point], "axis": qp.axis})
    for k, (path, sample, _label) in enumerate(images.samples(graph)):
        if k >= max_images:
            break
        floats = runner.run(sample)
        ints = prepared.run({input_name: sample}).tensors
        files = {}
        for spec in specs:
            stem = f"img{k:03d}_{_safe(spec.name)}"
            np.save(out / f"{stem}.float.npy", np.asarray(floats[spec.name]))
            np.save(out / f"{stem}.int.npy", ints[spec.name])
            files[spec.name] = {"float": f"{stem}.float.npy", "int": f"{stem}.int.npy"}
        index["images"].append({"image": str(path), "files": files})
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    return out / "index.json"
