"""The images `ptq tune` fits on and the images it decides with, kept apart.

A tuner that keeps a step because it raised the cosine on the images it was fitted to overfits them (a
percentile range fitted to 23 images raised their cosine and lowered the held-out one). So the tuning images
are split: the *fit* part feeds what is estimated from data (activation statistics, the mean input patches
of bias correction, the bottleneck ranking), the *validation* part only scores candidates. `split_samples`
puts every k-th sample (k = round(1 / fraction)) into validation, in file order: deterministic, and spread
over the folder rather than one block of it.

`Validation.cosine` is the mean over the validation samples of the cosine between the first output of the
integer graph and that of the *reference* float model (the user's model, not the bias-corrected one the
integer graph is built from: bias correction changes the float function, the user's model is the goal),
with its standard error: a handful of validation images says little about the next image set (measured on
the bundled model: 7 validation images 0.9985 +- 0.0003, the 20 eval photos 0.9975, two hard photos among
them), so the tuner asks the mean minus z standard errors to reach the target.

`Validation.scorer` (`ptq tune --workers N`, `--ray`): an object whose `cosines(graph, table, float_nodes)`
computes the same per-sample cosines elsewhere (`ptq.tune_shards`), in sample order, so that the mean is
the same float; without one they are computed here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union

import numpy as np

from ptq.core.graph import Graph
from ptq.executor import IntegerGraph, prepare
from ptq.float_run import FloatRunner
from ptq.quant_table import QuantTable
from reports.image_source import ArraySamples, ImageSet

Samples = Union[ImageSet, ArraySamples]


def split_samples(samples: Samples, fraction: float) -> tuple[Samples, Samples]:
    """(fit, validation): every k-th sample, k = round(1 / fraction), starting with the (k-1)-th, validates."""
    if not 0 < fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction}")
    if isinstance(samples, ImageSet):
        items = samples.files[: samples.expected]
    else:
        items = list(range(len(samples.arrays)))
    k = max(2, round(1 / fraction))
    held = [i for i in range(len(items)) if i % k == k - 1]
    if len(items) < 2 or not held:
        raise ValueError(f"{len(items)} tuning samples cannot be split into fit and validation parts; "
                         f"give more images or a separate validation folder")
    kept = [i for i in range(len(items)) if i % k != k - 1]
    if isinstance(samples, ImageSet):
        return (ImageSet([items[i] for i in kept], samples.format, samples.labels),
                ImageSet([items[i] for i in held], samples.format, samples.labels))
    labels = samples.labels

    def part(index: list[int]) -> ArraySamples:
        return ArraySamples(samples.arrays[index], None if labels is None else [labels[i] for i in index])

    return part(kept), part(held)


class Scorer(Protocol):
    def cosines(self, graph: Graph, table: QuantTable, float_nodes: Sequence[str]) -> list[float]: ...


def sample_cosine(reference: np.ndarray, output: np.ndarray) -> float:
    """The cosine of one sample's output (float64, flattened) against the reference model's."""
    norm = np.linalg.norm(reference) * np.linalg.norm(output)
    return float(np.dot(reference, output) / norm) if norm > 0 else float(np.array_equal(reference, output))


@dataclass
class Validation:
    """Validation samples (inputs by name) and the reference model's first output on each (computed once);
    `progress`: a progress bar per pass over them; `scorer`: where the cosines are computed (None: here)."""

    inputs: list[dict]
    reference: list[np.ndarray]
    progress: bool = False
    scorer: Optional[Scorer] = None

    @classmethod
    def create(cls, reference_graph: Graph, samples: Samples, progress: bool = False) -> "Validation":
        runner = FloatRunner.create(reference_graph, [reference_graph.outputs[0]])
        inputs, outputs = [], []
        for _, x, _ in samples.samples(reference_graph):
            inputs.append(x)
            outputs.append(dict(runner.run(x))[reference_graph.outputs[0]].astype(np.float64).ravel())
        if not inputs:
            raise ValueError("no validation sample could be read")
        return cls(inputs, outputs, progress)

    def __len__(self) -> int:
        return len(self.inputs)

    def cosines(self, graph: Graph, table: QuantTable, float_nodes: Sequence[str] = ()) -> list[float]:
        """Per validation sample, in order: the cosine of the integer graph's first output."""
        if self.scorer is not None:
            return self.scorer.cosines(graph, table, float_nodes)
        return self.run(prepare(graph, table, float_nodes=float_nodes), graph.outputs[0], range(len(self)))

    def run(self, prepared: IntegerGraph, output: str, samples: Sequence[int]) -> list[float]:
        """The cosines of the listed samples (by index) through `prepared`, whose `output` is compared."""
        from tqdm import tqdm

        values = []
        for k in tqdm(samples, unit="img", desc="tune", disable=None if self.progress else True, leave=False):
            y = prepared.run(self.inputs[k], keep_all=False).outputs[output].astype(np.float64).ravel()
            values.append(sample_cosine(self.reference[k], y))
        return values

    def cosine(self, graph: Graph, table: QuantTable, float_nodes: Sequence[str] = ()) -> "Score":
        return Score.of(self.cosines(graph, table, float_nodes))


@dataclass(frozen=True)
class Score:
    """The mean per-sample cosine and its standard error (sample std / sqrt(n); 0 for one sample)."""

    mean: float
    sem: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Score":
        v = np.asarray(values, dtype=np.float64)
        return cls(float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0)

    def bound(self, z: float) -> float:
        """mean - z * sem: what the mean on other images of the same kind stays above, at z standard errors."""
        return self.mean - z * self.sem
