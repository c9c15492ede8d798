"""The data of a report: one `LayerReport` per quantized tensor, the graph outputs, the ranked suspects."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ptq.core.qparams import QParams
from reports.metrics import Similarity
from reports.output_breakdown import OutputBreakdown
from reports.value_histogram import ValueHistogram


def qparams_summary(qp: QParams) -> dict:
    """A short description of a tensor's qparams: per-tensor values, or min/max over the channels."""
    lo, hi = qp.real_range()
    summary = {
        "granularity": "per-channel" if qp.per_channel else "per-tensor",
        "signed": bool(qp.signed),
        "range": [float(np.min(lo)), float(np.max(hi))],
    }
    if qp.per_channel:
        summary.update(
            axis=qp.axis,
            channels=int(qp.scale.size),
            scale_min=float(qp.scale.min()),
            scale_max=float(qp.scale.max()),
            zero_point_min=int(qp.zero_point.min()),
            zero_point_max=int(qp.zero_point.max()),
        )
    else:
        summary.update(scale=float(qp.scale[0]), zero_point=int(qp.zero_point[0]))
    return summary


@dataclass
class LayerReport:
    """One quantized tensor: `name` is the tensor, `node`/`op_type` its producer ("Input" for a graph input).

    `inputs` are the quantized activation tensors the producer reads (the report's own layers).
    cosine_drop = min(cumulative cosine of the inputs) - cumulative cosine of this tensor (a graph input
    drops from 1: the float input is exact).
    """

    name: str
    node: str
    op_type: str
    qparams: QParams
    inputs: list[str]
    cumulative: Similarity
    isolated: Similarity
    cosine_drop: float
    float_fallback: bool = False
    clipped: float = 0.0  # fraction of the float values beyond the grid's range (they saturate)
    histogram: Optional[ValueHistogram] = None  # its float values over its grid (`reports.value_histogram`)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "node": self.node,
            "op_type": self.op_type,
            "bits": int(self.qparams.bits),
            "qparams": qparams_summary(self.qparams),
            "inputs": list(self.inputs),
            "float_fallback": self.float_fallback,
            "cumulative": self.cumulative.to_dict(),
            "isolated": self.isolated.to_dict(),
            "cosine_drop": self.cosine_drop,
            "clipped_fraction": self.clipped,
        }


def cosine_drops(names: list[str], inputs: dict[str, list[str]], cumulative_cosine: dict[str, float]) -> dict[str, float]:
    """cosine_drop per tensor: min over its inputs' cumulative cosine (1 without inputs) minus its own."""
    drops = {}
    for name in names:
        before = min((cumulative_cosine[i] for i in inputs.get(name, []) if i in cumulative_cosine), default=1.0)
        drops[name] = before - cumulative_cosine[name]
    return drops


@dataclass(frozen=True)
class Bottleneck:
    """A suspect: `added`, the cosine it loses alone beyond what its inputs' quantization costs (where error is
    made); `drop`, how far the cumulative cosine falls across it (where error shows, made here or amplified)."""

    name: str
    score: float
    reason: str
    added: float = 0.0
    drop: float = 0.0

    @property
    def amplifies(self) -> bool:
        """The fall of the cumulative cosine counts for more than what the layer adds alone: it carries (and
        amplifies) error made upstream, and floating it recovers little."""
        return self.added < DROP_WEIGHT * self.drop

    def to_dict(self) -> dict:
        return {"name": self.name, "score": self.score, "reason": self.reason, "added": self.added,
                "drop": self.drop, "kind": "amplifies" if self.amplifies else "makes"}


DROP_WEIGHT = 0.1  # weight of the cumulative drop in the score (see rank_bottlenecks)
CLIP_NOTE = 0.001  # a suspect that saturates at least this fraction of its values says so


def added_errors(layers: list[LayerReport]) -> dict[str, float]:
    """Per layer, the cosine it loses alone beyond what the quantization of its inputs already costs:
    max(0, (1 - isolated cosine) - max over the inputs of (1 - their isolated cosine))."""
    by_name = {layer.name: layer for layer in layers}
    added = {}
    for layer in layers:
        inherited = max((1.0 - by_name[i].isolated.cosine for i in layer.inputs if i in by_name), default=0.0)
        added[layer.name] = max(0.0, (1.0 - layer.isolated.cosine) - inherited)
    return added


def rank_bottlenecks(layers: list[LayerReport], top: Optional[int] = None, min_score: float = 1e-4) -> list[Bottleneck]:
    """The layers most likely to cost accuracy, worst first.

    Two signals, each a loss in cosine:
    - added = max(0, (1 - isolated cosine) - max over the inputs of (1 - their isolated cosine)): what this
      layer loses alone beyond what the quantization of its inputs already costs (fed with quantized inputs,
      a consumer of a badly quantized tensor inherits that tensor's loss; this charges it to the producer);
    - drop = max(0, cosine_drop): how far the end-to-end (cumulative) cosine falls across this layer.
    score = added + DROP_WEIGHT * drop. The drop counts a tenth: it also grows when a layer merely amplifies
    the error of its inputs (a linear projection after a damaged layer can take the cosine from 0.85 to 0.02
    while adding almost nothing itself), and floating such a layer cannot remove an error made upstream.
    Layers scoring below `min_score` are not suspects.
    """
    added_by_layer = added_errors(layers)
    suspects = []
    for layer in layers:
        added = added_by_layer[layer.name]
        drop = max(0.0, layer.cosine_drop)
        score = added + DROP_WEIGHT * drop
        if score < min_score:
            continue
        parts = []
        if added >= min_score:
            parts.append(f"isolated cosine {layer.isolated.cosine:.4f} (adds {added:.4f} alone)")
        if drop >= min_score:
            before = layer.cumulative.cosine + drop
            parts.append(f"cumulative cosine falls {drop:.4f} ({before:.4f} -> {layer.cumulative.cosine:.4f})")
        if layer.clipped >= CLIP_NOTE:
            parts.append(f"{100 * layer.clipped:.2f}% of its float values lie beyond its range (saturate)")
        if layer.float_fallback:
            parts.append("runs in float")
        suspects.append(Bottleneck(layer.name, score, "; ".join(parts), added, drop))
    suspects.sort(key=lambda b: (-b.score, b.name))
    return suspects if top is None else suspects[:top]


@dataclass
class OutputReport:
    """One graph output: similarity of the dequantized integer output to the float output."""

    name: str
    similarity: Similarity
    breakdown: OutputBreakdown = field(default_factory=OutputBreakdown)  # its parts and channels

    def to_dict(self) -> dict:
        d = self.similarity.to_dict()
        return {"name": self.name, "cosine": d["cosine"], "mse": d["mse"], "sqnr_db": d["sqnr_db"],
                "max_abs_err": d["max_abs_err"], **self.breakdown.to_dict()}


@dataclass
class Report:
    model: str
    quant: str
    images: int
    layers: list[LayerReport]
    outputs: list[OutputReport]
    classification: Optional[dict]  # TopKAgreement.to_dict() of the first output, when it is a score vector
    bottlenecks: list[Bottleneck]
    # per index/boolean graph output (ArgMax, TopK indices): ValueAgreement.to_dict() against the float model
    index_outputs: dict[str, dict] = field(default_factory=dict)
    float_nodes: list[str] = field(default_factory=list)
    float_reasons: dict[str, str] = field(default_factory=dict)  # node -> "OpType: why it runs in float"
    notes: list[str] = field(default_factory=list)
    isolated_images: int = 0  # images the isolated metrics were accumulated over (the first ones)
    inputs: dict = field(default_factory=dict)  # the samples used: --images or --data, preprocessing, labels, ...
    warnings: list[str] = field(default_factory=list)  # dead output parts or channels (`reports.output_breakdown`)
    detections: Optional[dict] = None  # `reports.detections.DetectionAgreement.to_dict()` with --task detect

    def to_dict(self) -> dict:
        outputs: dict = {"tensors": [o.to_dict() for o in self.outputs]}
        if self.index_outputs:
            outputs["index_outputs"] = [{"name": name, **value} for name, value in self.index_outputs.items()]
        if self.classification:
            outputs.update(self.classification)
        if self.detections:
            outputs["detections"] = dict(self.detections)
        return {
            "model": self.model,
            "quant": self.quant,
            "inputs": dict(self.inputs),
            "images": self.images,
            "isolated_images": self.isolated_images,
            "metric_definitions": METRIC_DEFINITIONS,
            "float_nodes": list(self.float_nodes),
            "float_reasons": dict(self.float_reasons),
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "outputs": outputs,
            "bottlenecks": [b.to_dict() for b in self.bottlenecks],
            "layers": [layer.to_dict() for layer in self.layers],
            "histograms": {layer.name: layer.histogram.to_dict() for layer in self.layers if layer.histogram},
        }


METRIC_DEFINITIONS = {
    "cosine": "mean over images of the cosine similarity of the flattened float and dequantized integer tensors",
    "mse": "mean squared error over all elements of all images",
    "sqnr_db": "10*log10(sum float^2 / sum (float - int)^2) over all images (null: infinite)",
    "max_abs_err": "largest |float - int| over all images",
    "cumulative": "the integer graph end to end",
    "isolated": "this layer alone, fed with its float inputs quantized",
    "cosine_drop": "min cumulative cosine of the layer's inputs minus its own cumulative cosine",
    "clipped_fraction": "fraction of the float values beyond [real_min - scale/2, real_max + scale/2] (saturated)",
    "folded": "a tensor consumed only by a clamp (Relu, Clip) whose range calibration folded to it is compared "
              "with its float values clamped to that range: its clipping is by design",
    "histograms": "per layer, its float values counted in fixed bins over its grid [low, high] = [real_min - "
                  "scale/2, real_max + scale/2]: counts[0] below low - margin_bins*w, then margin_bins bins of "
                  "width w = (high - low)/inner_bins below low, inner_bins bins across the grid, margin_bins bins "
                  "above high, and counts[-1] beyond; below/above: values outside [low, high] (saturated)",
    "top1_agreement": "fraction of images where the integer argmax equals the float argmax",
    "top5_agreement": "fraction of images where the float argmax is among the integer top 5 (10 classes or more)",
    "index_outputs": "per index or boolean graph output (ArgMax, TopK indices, a mask): the fraction of its values "
                     "equal to the float model's, over all images",
    "parts": "per output that is a join (a Concat, then only Reshape/Transpose-like ops), each joined input's "
             "elements: cosine pooled over all its elements of all images, mse, sqnr_db, max_abs_err, the distinct "
             "integer codes it takes (counted up to 5), its float range, codes_needed (the most distinct codes its "
             "float values take in one image on a 256-step grid of their own min..max); dead: 4 or fewer codes "
             "while the float values vary (more than 4 needed, spread above 1e-3 of their magnitude)",
    "channels": "per output of rank >= 3 with 2..256 channels on axis 1, the same per channel; channel_cosine: "
                "min / median / max of the channels' cosines and the worst channel",
    "detections": "with --task detect: the integer run's detections matched to float's (same class, IoU >= "
                  "match_iou, greedy by float score); recall = matched / float detections, precision = matched / "
                  "integer detections, over all images",
}
