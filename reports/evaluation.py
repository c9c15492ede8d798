"""`Evaluation`: what `reports.evaluate.evaluate` accumulates over the images, per layer and per output."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ptq.core.qparams import QParams
from reports.detections import DetectionAgreement
from reports.layer_specs import LayerSpec
from reports.metrics import ClipAccumulator, SimilarityAccumulator, TopKAgreement, ValueAgreement
from reports.output_breakdown import GroupAccumulator
from reports.value_histogram import ValueHistogram


@dataclass
class Evaluation:
    """Accumulated similarities of one integer graph against the float model over a set of images."""

    layers: list[LayerSpec]
    qparams: dict[str, QParams]
    cumulative: dict[str, SimilarityAccumulator]
    isolated: dict[str, SimilarityAccumulator]
    outputs: dict[str, SimilarityAccumulator]
    classification: Optional[TopKAgreement]
    float_nodes: list[str]
    float_reasons: dict[str, str]  # float node name -> why it runs in float ("not registered", ...)
    clipped: dict[str, ClipAccumulator] = field(default_factory=dict)  # float values beyond each grid
    histograms: dict[str, ValueHistogram] = field(default_factory=dict)  # each layer's float values
    overflows: dict[str, int] = field(default_factory=dict)
    # index and boolean graph outputs (ArgMax, TopK indices, masks): exact agreement with the float model's
    index_outputs: dict[str, ValueAgreement] = field(default_factory=dict)
    # per output, its parts (a join) and channels (`reports.output_breakdown`)
    output_groups: dict[str, list[GroupAccumulator]] = field(default_factory=dict)
    detections: Optional[DetectionAgreement] = None  # with a detection task (`reports.detections`)
    images: int = 0
