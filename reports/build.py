"""Turning an `Evaluation` into a `Report`: per-layer metrics, cosine drops, notes, ranked bottlenecks."""
from __future__ import annotations

from typing import Optional

from reports.evaluation import Evaluation
from reports.layers import LayerReport, OutputReport, Report, cosine_drops, rank_bottlenecks
from reports.output_breakdown import OutputBreakdown, dead_warnings


def build_report(ev: Evaluation, model: str, quant: str, top: Optional[int] = None) -> Report:
    """The `Report` of an evaluation with isolated metrics: layers, outputs, ranked bottlenecks."""
    if not ev.isolated:
        raise ValueError("a report needs isolated metrics (evaluate with isolated=True)")
    cum = {s.name: ev.cumulative[s.name].result() for s in ev.layers}
    iso = {s.name: ev.isolated[s.name].result() for s in ev.layers}
    drops = cosine_drops([s.name for s in ev.layers], {s.name: list(s.inputs) for s in ev.layers},
                         {name: sim.cosine for name, sim in cum.items()})
    layer_reports = [
        LayerReport(
            name=s.name, node=s.node, op_type=s.op_type, qparams=ev.qparams[s.name], inputs=list(s.inputs),
            cumulative=cum[s.name], isolated=iso[s.name], cosine_drop=drops[s.name], float_fallback=s.float_fallback,
            clipped=ev.clipped[s.name].fraction, histogram=ev.histograms.get(s.name),
        )
        for s in ev.layers
    ]
    notes = []
    isolated_images = next(iter(iso.values())).samples if iso else 0
    if isolated_images < ev.images:
        notes.append(f"isolated metrics over the first {isolated_images} of {ev.images} images")
    if ev.overflows:
        notes.append("int32 accumulator saturated in: "
                     + ", ".join(f"{n} ({c} values)" for n, c in sorted(ev.overflows.items())))
    outputs = [OutputReport(name, acc.result(), OutputBreakdown.of(ev.output_groups.get(name, [])))
               for name, acc in ev.outputs.items()]
    return Report(
        model=model,
        quant=quant,
        images=ev.images,
        layers=layer_reports,
        outputs=outputs,
        classification=ev.classification.to_dict() if ev.classification is not None else None,
        index_outputs={name: acc.to_dict() for name, acc in ev.index_outputs.items()},
        bottlenecks=rank_bottlenecks(layer_reports, top=top),
        float_nodes=list(ev.float_nodes),
        float_reasons=dict(ev.float_reasons),
        notes=notes,
        isolated_images=isolated_images,
        warnings=[line for out in outputs for line in dead_warnings(out.name, out.breakdown)],
        detections=ev.detections.to_dict() if ev.detections is not None and ev.detections.samples else None,
    )
