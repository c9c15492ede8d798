"""A tuning target on the user's own metric (`ptq tune --max-accuracy-drop`, `ptq.tune(metric=..., max_drop=...)`),
as NNCF's accuracy control offers (`nncf.quantize_with_accuracy_control(model, calibration_dataset,
validation_dataset, validation_fn, max_drop=0.01)`, an absolute drop by default).

    metric(outputs, sample) -> float

is called once per validation sample with the model's outputs (graph output name -> array, in the model's
output order) and the sample (`ValidationSample`: its inputs, file, label, view, photo); higher is better. The
model's figure is the mean over photos of each photo's mean over its views (as the logits cosine,
`ptq.tuning.data`), the float model's is taken on the same samples, and the target is reached when

    float figure - quantized figure <= max_drop

(the measured drop, no standard error: a 0/1 metric such as top-1 accuracy over a few photos has no useful
one, nothing changes on most photos). `top1_accuracy` is the built-in metric of `--max-accuracy-drop`: 1 when
the argmax of the first output is the sample's label.

How coarse it is: over n photos top-1 accuracy moves in steps of 1/n (the 20 eval photos: 0.05, so any
`max_drop` below 0.05 there asks that no photo's top-1 changes), and it says nothing of the photos whose
top-1 is far from a tie. Every figure printed names the number of photos it is over; the logits cosine stays the
guide of the search (`ptq.tuning.goal`: a step is kept when it raises the cosine).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import numpy as np

TOP1_ACCURACY = "top-1 accuracy"


@dataclass(frozen=True)
class ValidationSample:
    """What a metric is given besides the outputs: the sample's inputs (input name -> array, as fed to the model),
    its file (a `<sample k>` path for arrays), its label (None: unlabelled), its view (`ptq.data.views`; "" when
    the samples enter as read) and the index of the photo it is a view of."""

    inputs: dict
    path: Path
    label: Optional[int]
    view: str
    photo: int


Metric = Callable[[Mapping[str, np.ndarray], ValidationSample], float]


def top1_accuracy(outputs: Mapping[str, np.ndarray], sample: ValidationSample) -> float:
    """1.0 when the argmax of the first output (flattened: one class-score vector per sample) is the label."""
    if sample.label is None:
        raise ValueError(f"{sample.path}: no label for top-1 accuracy")
    scores = np.asarray(next(iter(outputs.values()))).reshape(-1)
    return float(int(np.argmax(scores)) == sample.label)


@dataclass(frozen=True)
class MetricTarget:
    """The metric (`name`: what the summary calls it) and the most it may drop below the float model's."""

    metric: Metric
    max_drop: float
    name: str = "metric"

    def __post_init__(self):
        if not callable(self.metric):
            raise TypeError(f"metric must be a callable metric(outputs, sample) -> float, got {self.metric!r}")
        if not (np.isfinite(self.max_drop) and self.max_drop >= 0):
            raise ValueError(f"the maximal metric drop must be a number >= 0, got {self.max_drop}")

    def of(self, outputs: Mapping[str, np.ndarray], sample: ValidationSample) -> float:
        """The metric of one sample given a model's outputs on it."""
        value = float(self.metric(outputs, sample))
        if not np.isfinite(value):
            raise ValueError(f"the {self.name} gave {value} on {sample.path}")
        return value


def accuracy_target(max_drop: float) -> MetricTarget:
    """`--max-accuracy-drop`: top-1 accuracy on the labelled validation samples."""
    return MetricTarget(top1_accuracy, max_drop, TOP1_ACCURACY)


@dataclass(frozen=True)
class MetricScore:
    """A model's metric over the validation samples (mean over photos of each photo's mean over its views) beside
    the float model's on the same samples."""

    name: str
    value: float
    reference: float
    samples: int
    photos: int

    @property
    def drop(self) -> float:
        return self.reference - self.value

    def over(self) -> str:
        """How many samples the figure is over (module docstring: how coarse it is)."""
        if self.samples != self.photos:
            return f"over {self.photos} photo{'s' if self.photos != 1 else ''}, {self.samples} samples with their views"
        return f"over {self.samples} sample{'s' if self.samples != 1 else ''}"

    def to_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "float": self.reference, "drop": self.drop,
                "samples": self.samples, "photos": self.photos}


@dataclass(frozen=True)
class MetricReference:
    """The target, the validation samples as the metric sees them, and the float model's metric on each."""

    target: MetricTarget
    samples: list[ValidationSample]
    reference: list[float]

    def value(self, k: int, outputs: Mapping[str, np.ndarray]) -> float:
        """The metric of sample `k` given a model's outputs on it."""
        return self.target.of(outputs, self.samples[k])
