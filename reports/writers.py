"""report.json and report.csv writers, and the short stdout summary."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Union

from ptq.core.atomic import atomic_write_text
from reports.detections import detection_line
from reports.diagnosis import loss_spread, next_step_lines
from reports.layers import CLIP_NOTE, Bottleneck, Report
from reports.output_breakdown import OutputBreakdown


def breakdown_lines(breakdown: OutputBreakdown) -> list[str]:
    """An output's parts, one line each, and the spread of its channel cosines."""
    lines = []
    for part in breakdown.parts or ():
        codes = str(part.codes) if part.dead or part.codes <= 4 else ">4"
        lines.append(f"part {part.name} ({part.span}): cosine {part.cosine:.6f}  sqnr {part.sqnr_db:.2f} dB  "
                     f"float {part.float_min:.4g}..{part.float_max:.4g}  codes {codes}"
                     + ("  DEAD" if part.dead else ""))
    spread = breakdown.spread()
    if spread is not None:
        lines.append(f"{len(breakdown.channels)} channels on axis 1: cosine min {spread['min']:.6f} (channel "
                     f"{spread['worst_channel']})  median {spread['median']:.6f}  max {spread['max']:.6f}")
    return lines

CSV_COLUMNS = (
    "index", "name", "node", "op_type", "bits", "granularity", "scale", "zero_point", "range_min", "range_max",
    "cumulative_cosine", "cumulative_mse", "cumulative_sqnr_db", "cumulative_max_abs_err",
    "isolated_cosine", "isolated_mse", "isolated_sqnr_db", "isolated_max_abs_err",
    "cosine_drop", "clipped_fraction", "float_fallback", "suspect_rank",
)


def finite_or_none(value):
    """JSON has no Infinity/NaN: non-finite floats become null (the metric definitions say so)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def report_json(report: Report) -> str:
    data = report.to_dict()
    spread = loss_spread(report)
    data["loss_spread"] = None if spread is None else spread.to_dict()
    return json.dumps(finite_or_none(data), indent=1, allow_nan=False)


def write_json(report: Report, path: Union[str, Path]) -> Path:
    return atomic_write_text(path, report_json(report) + "\n")


def report_csv(report: Report) -> str:
    """One row per layer, in topological order; per-channel qparams give their scale range as `min..max`."""
    ranks = {b.name: k for k, b in enumerate(report.bottlenecks, 1)}
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for index, layer in enumerate(report.layers):
        qp = layer.to_dict()["qparams"]
        if qp["granularity"] == "per-channel":
            scale = f"{qp['scale_min']:.6g}..{qp['scale_max']:.6g}"
            zero_point = f"{qp['zero_point_min']}..{qp['zero_point_max']}"
        else:
            scale, zero_point = f"{qp['scale']:.6g}", qp["zero_point"]
        cum, iso = layer.cumulative, layer.isolated
        writer.writerow([
            index, layer.name, layer.node, layer.op_type, layer.qparams.bits, qp["granularity"], scale, zero_point,
            f"{qp['range'][0]:.6g}", f"{qp['range'][1]:.6g}",
            f"{cum.cosine:.6f}", f"{cum.mse:.6g}", f"{cum.sqnr_db:.3f}", f"{cum.max_abs_err:.6g}",
            f"{iso.cosine:.6f}", f"{iso.mse:.6g}", f"{iso.sqnr_db:.3f}", f"{iso.max_abs_err:.6g}",
            f"{layer.cosine_drop:.6f}", f"{layer.clipped:.6g}", int(layer.float_fallback), ranks.get(layer.name, ""),
        ])
    return buf.getvalue()


def write_csv(report: Report, path: Union[str, Path]) -> Path:
    return atomic_write_text(path, report_csv(report))


def summary_text(report: Report, top: int = 5) -> str:
    """Output metrics and the top suspects, for stdout."""
    lines = list(report.warnings)
    lines.append(f"{report.images} images, {len(report.layers)} quantized tensors")
    for out in report.outputs:
        s = out.similarity
        lines.append(f"output {out.name}: cosine {s.cosine:.6f}  mse {s.mse:.4g}  sqnr {s.sqnr_db:.2f} dB")
        lines.extend(f"  {line}" for line in breakdown_lines(out.breakdown))
    if report.detections:
        lines.append(detection_line(report.detections))
    for name, agreement in report.index_outputs.items():
        lines.append(f"output {name}: agreement with float {agreement['agreement']:.4f} "
                     f"({agreement['equal']}/{agreement['values']} values)")
    c = report.classification
    if c:
        line = f"top-1 agreement {c['top1_agreement']:.3f}"
        if "top5_agreement" in c:  # only with 10 classes or more
            line += f"  top-5 agreement {c['top5_agreement']:.3f}"
        if "labelled" in c:
            line += f"  accuracy float {c['float_accuracy']:.3f} int {c['int_accuracy']:.3f} ({c['labelled']} labelled)"
        else:
            line += "  (no labels: agreement with float only)"
        lines.append(line)
    if report.float_nodes:
        lines.append(f"float nodes: {', '.join(report.float_nodes)}")
    lines.extend(report.notes)
    if report.bottlenecks:
        lines.append(f"top {min(top, len(report.bottlenecks))} suspects (isolated: the layer alone on quantized "
                     "float inputs, the error it makes; cumulative: end to end, the error that reaches it):")
        lines.extend(f"  {k}. {suspect_line(report, b)}" for k, b in enumerate(report.bottlenecks[:top], 1))
        if any(b.amplifies for b in report.bottlenecks[:top]):
            lines.append("an amplifier adds almost nothing alone: it carries error made upstream further, and "
                         "floating it recovers little")
    else:
        lines.append("no suspects: every layer keeps its cosine")
    lines.extend(next_step_lines(report))
    return "\n".join(lines)


def suspect_line(report: Report, suspect: Bottleneck) -> str:
    """A suspect with its isolated and cumulative metrics side by side, and whether it makes or amplifies error."""
    layer = next(layer for layer in report.layers if layer.name == suspect.name)
    kind = "amplifies its inputs' error" if suspect.amplifies else "makes error"
    parts = [f"{suspect.name}: {kind} ({layer.op_type}): isolated cosine {layer.isolated.cosine:.5f}, adds "
             f"{suspect.added:.4f} alone; cumulative cosine {layer.cumulative.cosine:.5f}, falls {suspect.drop:.4f}"]
    if layer.clipped >= CLIP_NOTE:
        parts.append(f"{100 * layer.clipped:.2f}% of its float values saturate")
    if layer.float_fallback:
        parts.append("runs in float")
    return "; ".join(parts)
