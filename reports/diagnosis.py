"""Where a report's loss comes from, and what to do next.

- **Spread**: each layer's isolated loss (1 - isolated cosine: the layer alone on quantized float inputs)
  summed over the graph is the error the layers make. When the layer that loses most makes less than
  SPREAD_TOP_SHARE of it and SPREAD_HALF_LAYERS layers or more are needed to make half of it, no single layer
  is the cause (the ranking's "added" error, beyond the inputs' isolated loss, cannot tell this: in a chain of
  alike layers each one's isolated loss equals its input's, and all of it is charged to the first): floating or widening one (`ptq debug --auto`) recovers little, and `ptq tune`, which changes
  many tensors step by step, is the tool. (Measured on a Paddle classifier, logits cosine 0.932: dozens of
  layers between 0.87 and 0.95 cumulative, floating any of the top three suspects gained nothing.)
- **Next step**: the `ptq tune` command line for the report's model, table and samples.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Optional

from reports.layers import Report

SPREAD_TOP_SHARE = 0.25  # the top layer makes less than this share of the summed isolated loss ...
SPREAD_HALF_LAYERS = 5  # ... and this many layers or more make half of it
MIN_LOSS = 1e-3  # an output cosine loss below this needs no diagnosis
TUNE_TARGETS = (0.99, 0.999)  # the target suggested: the first one above the output cosine


@dataclass(frozen=True)
class LossSpread:
    """How the layers' isolated losses are distributed: `layers` layers lose some; the `half` largest make half of
    the sum; the largest, `top_layer`, makes `top_share` of it."""

    layers: int
    half: int
    top_layer: str
    top_share: float

    @property
    def spread(self) -> bool:
        return self.top_share < SPREAD_TOP_SHARE and self.half >= SPREAD_HALF_LAYERS

    def sentence(self) -> str:
        if self.spread:
            return (f"the loss is spread over many layers: {self.layers} layers lose cosine alone, {self.half} of "
                    f"them make half of it, the largest ({self.top_layer}) {100 * self.top_share:.0f}%; floating "
                    f"or widening one layer recovers little")
        return (f"the loss is concentrated: {self.top_layer} makes {100 * self.top_share:.0f}% of the error the "
                f"layers make alone ({self.half} layer(s) make half of it)")

    def to_dict(self) -> dict:
        return {"layers_adding_error": self.layers, "layers_making_half": self.half, "top_layer": self.top_layer,
                "top_share": self.top_share, "spread": self.spread}


def output_cosine(report: Report) -> Optional[float]:
    return min(out.similarity.cosine for out in report.outputs) if report.outputs else None


def loss_spread(report: Report, min_loss: float = 1e-4) -> Optional[LossSpread]:
    """The spread of the isolated losses, or None when the output loses less than MIN_LOSS or no layer loses
    `min_loss` alone."""
    cosine = output_cosine(report)
    if cosine is None or 1.0 - cosine < MIN_LOSS:
        return None
    losses = sorted(((1.0 - layer.isolated.cosine, layer.name) for layer in report.layers
                     if 1.0 - layer.isolated.cosine >= min_loss), reverse=True)
    total = sum(v for v, _ in losses)
    if total <= 0.0:
        return None
    running, half = 0.0, 0
    for value, _ in losses:
        running += value
        half += 1
        if running >= total / 2:
            break
    return LossSpread(len(losses), half, losses[0][1], losses[0][0] / total)


def suggested_target(cosine: float) -> Optional[float]:
    """The first of TUNE_TARGETS above `cosine` (None: the output is already above them all)."""
    return next((t for t in TUNE_TARGETS if cosine < t), None)


def tune_command(report: Report, target: Optional[float] = None) -> Optional[str]:
    """`ptq tune MODEL --quant TABLE --images DIR --target-cosine T` for the report's model, table and samples
    (None when the report does not say where its samples came from, or the output is above every target)."""
    cosine = output_cosine(report)
    target = target if target is not None else (suggested_target(cosine) if cosine is not None else None)
    samples = [(flag, report.inputs[flag]) for flag in ("images", "data") if isinstance(report.inputs.get(flag), str)]
    if target is None or not samples or not report.model or not report.quant:
        return None
    flag, where = samples[0]
    return shlex.join(["ptq", "tune", report.model, "--quant", report.quant, f"--{flag}", where,
                       "--target-cosine", f"{target:g}"])


def next_step_lines(report: Report) -> list[str]:
    """The spread sentence and, when the loss is spread, the tune command (for the console and the page)."""
    spread = loss_spread(report)
    if spread is None:
        return []
    lines = [spread.sentence()]
    command = tune_command(report) if spread.spread else None
    if command:
        lines.append(f"ptq tune changes many tensors step by step until the output reaches a target: {command}")
    return lines
