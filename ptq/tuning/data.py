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
with its standard error.

What it estimates. The target is a promise about the images the user will run, which are not the tuning
photos: a handful of validation photos says little about them (measured on the bundled model: 7 validation
photos 0.9984 +- 0.0002 for a tuned table, the 20 eval photos 0.9972, two of them at 0.984 and 0.987 and
nothing like them among the 7). Quantization loses most on images unlike the calibration photos, so with
image files each validation photo enters with its label-free views (`ptq.data.views`: mirrored, zoomed, at half
the model's resolution, at half contrast, darker, brighter): the estimand is the mean cosine over photos of
the kind given *and the variations of framing, resolution, contrast and exposure other photos of the same
scenes show*, a neighbourhood of the validation photos rather than the photos alone. It is harder than the
photos' mean and its left tail is the one that lowers held-out means (measured on the bundled model: the
untuned table 0.9974 on 7 validation photos, 0.9958 on them with their views; calibrated on all 23 photos,
0.9968 on 20 held-out photos; single views reach an error 1 - cosine of 0.02, like the hard held-out photos).

How it is bounded. The views of one photo are not independent samples: they share its content, and their
errors move together. The independent unit is the photo, so `Score` averages each photo's views first and
takes the mean and the standard error over the photos' averages (the cluster-robust standard error; the
standard error over all views as if independent would be too small by the design effect, sqrt(1 + (m - 1)
rho) for m views with intra-photo correlation rho). The tuner asks the mean minus z such standard errors to
reach the target: with z = 2 the mean over further photos of the kind (and their views) stays above it with
about 97.7 % probability by the central limit theorem over photos, and a photo whose views are hard, the
left tail, widens the standard error and so lowers the bound, which a mean alone does not.

`Validation.scorer` (`ptq tune --workers N`, `--ray`): an object whose `cosines(graph, table, float_nodes)`
computes the same per-sample cosines elsewhere (`ptq.tuning.shards`), in sample order, so that the mean is
the same float; without one they are computed here.

`Validation.metric` (`ptq.tuning.metric`: `--max-accuracy-drop`, a user's `metric(outputs, sample)`): each
sample's metric beside its cosine, averaged over photos the same way, with the float model's on the same
samples; the `Score` then carries it (`Score.metric`). Those passes run here, in this process (the metric is the
user's callable and reads every output), whatever the scorer.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional, Protocol, Sequence, Union

import numpy as np
from tqdm import tqdm

from calibrators import required_stats
from ptq.core.bodies import calibrated_tensors
from ptq.core.graph import Graph
from ptq.engine.executor import IntegerGraph, prepare
from ptq.engine.quantize_memo import QuantizeMemo
from ptq.engine.float_run import FloatRunner, collect_statistics
from ptq.table.quant_table import QuantTable
from ptq.data.images import decode_image, preprocess_array
from ptq.data.samples import ImageFormat
from ptq.data.views import views as photo_views
from ptq.data.image_source import ArraySamples, ImageSet
from ptq.tuning.early_stop import PassRule
from ptq.tuning.metric import MetricReference, MetricScore, MetricTarget, ValidationSample
from ptq.tuning.prefix_cache import PrefixCache

Samples = Union[ImageSet, ArraySamples]


@dataclass(frozen=True)
class FitSamples:
    """The fit samples as calibration steps read them (`ptq.calibration.steps.SampleSupply`), one at a time."""

    samples: Samples

    def batches(self, graph: Graph, batch_size: int) -> Iterator[dict]:
        return (x for _, x, _ in self.samples.samples(graph))


def fit_statistics(graph: Graph, samples: Samples, calibrators: Sequence[str]) -> dict:
    """Activation statistics of `graph` over the fit samples, for every calibrator listed (what the range
    statistics step of calibration collects, over the fit samples one at a time)."""
    return collect_statistics(graph, FitSamples(samples).batches(graph, 1), calibrated_tensors(graph),
                              required_stats(calibrators))


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
    def cosines(self, graph: Graph, table: QuantTable, float_nodes: Sequence[str],
                samples: Optional[Sequence[int]] = None) -> list[float]: ...


def sample_cosine(reference: np.ndarray, output: np.ndarray) -> float:
    """The cosine of one sample's output (float64, flattened) against the reference model's."""
    norm = np.linalg.norm(reference) * np.linalg.norm(output)
    return float(np.dot(reference, output) / norm) if norm > 0 else float(np.array_equal(reference, output))


_THREADS: dict[int, ThreadPoolExecutor] = {}


def sample_threads(count: int) -> ThreadPoolExecutor:
    """The threads validation passes run their samples in, `count` of them, started once per process: a thread
    keeps its kernels' scratch buffers (`ops.compiled.scratch`) from pass to pass."""
    if count not in _THREADS:
        _THREADS[count] = ThreadPoolExecutor(count, thread_name_prefix="ptq-tune")
    return _THREADS[count]


@dataclass
class Validation:
    """Validation samples (inputs by name) and the reference model's first output on each (computed once);
    `groups`: the photo each sample is a view of (None: every sample its own photo); `progress`: a progress
    bar per pass over them; `scorer`: where the cosines are computed (None: here); `metric`: the user's metric
    and the reference model's on each sample (None: the cosine alone); `prefix`: the passes kept to resume later
    ones from (`ptq.tuning.prefix_cache`; None: every pass from the input); `memo`: the quantized nodes of the
    candidates prepared before, reused where a node's quantize context is unchanged (`ptq.engine.quantize_memo`;
    None: every node quantized for each candidate); `threads`: the samples of a pass run here this many at a time
    (`run`)."""

    inputs: list[dict]
    reference: list[np.ndarray]
    progress: bool = False
    groups: Optional[list[int]] = None
    scorer: Optional[Scorer] = None
    metric: Optional[MetricReference] = None
    prefix: Optional[PrefixCache] = field(default_factory=PrefixCache)
    memo: Optional[QuantizeMemo] = field(default_factory=QuantizeMemo)
    threads: int = 1

    @classmethod
    def create(cls, reference_graph: Graph, samples: Samples, progress: bool = False,
               views: Sequence[str] = (), metric: Optional[MetricTarget] = None) -> "Validation":
        """The samples, with image files each as the listed views of it (`ptq.data.views`; none: the samples as
        read). Samples that are not image files (`--data`, arrays) enter as they are. `metric`: also the
        reference model's metric on each sample (from all its outputs)."""
        first = reference_graph.outputs[0]
        runner = FloatRunner.create(reference_graph, list(reference_graph.outputs) if metric else [first])
        viewed = bool(views) and isinstance(samples, ImageSet) and isinstance(samples.format, ImageFormat)
        reader = samples.format.reader(reference_graph) if viewed else None
        inputs, outputs, groups, seen, metric_values = [], [], [], [], []
        for photo, (path, x, label) in enumerate(samples.samples(reference_graph)):
            if viewed:
                size = (reader.spec.height, reader.spec.width)
                x_views = [(name, {reader.name: preprocess_array(v, reader.preprocess, reader.spec)[None].astype(
                    reader.dtype, copy=False)}) for name, v in photo_views(decode_image(path), size, views)]
            else:
                x_views = [("", x)]
            for view, xv in x_views:
                inputs.append(xv)
                groups.append(photo)
                got = dict(runner.run(xv))
                outputs.append(got[first].astype(np.float64).ravel())
                if metric is not None:
                    seen.append(ValidationSample(xv, path, label, view, photo))
                    metric_values.append(metric.of({name: got[name] for name in reference_graph.outputs}, seen[-1]))
        if not inputs:
            raise ValueError("no validation sample could be read")
        return cls(inputs, outputs, progress, groups if viewed else None,
                   metric=MetricReference(metric, seen, metric_values) if metric is not None else None)

    @property
    def photos(self) -> int:
        """The independent samples: photos (each with its views) or samples."""
        return len(set(self.groups)) if self.groups is not None else len(self.inputs)

    def __len__(self) -> int:
        return len(self.inputs)

    def photo_samples(self) -> list[list[int]]:
        """The sample indices of each photo, photos in `Score`'s order (ascending group label)."""
        if self.groups is None:
            return [[k] for k in range(len(self))]
        by_photo: dict[int, list[int]] = {}
        for k, photo in enumerate(self.groups):
            by_photo.setdefault(photo, []).append(k)
        return [by_photo[p] for p in sorted(by_photo)]

    def sample_runner(self, graph: Graph, table: QuantTable,
                      float_nodes: Sequence[str] = ()) -> Callable[[Sequence[int]], list[float]]:
        """A function of sample indices giving their cosines through the integer graph of `graph` and `table`
        (prepared once, here or by the scorer)."""
        if self.scorer is not None:
            return lambda samples: self.scorer.cosines(graph, table, float_nodes, samples)
        prepared = prepare(graph, table, float_nodes=float_nodes, memo=self.memo)
        return lambda samples: self.run(prepared, graph.outputs[0], samples)

    def cosines(self, graph: Graph, table: QuantTable, float_nodes: Sequence[str] = ()) -> list[float]:
        """Per validation sample, in order: the cosine of the integer graph's first output."""
        return self.sample_runner(graph, table, float_nodes)(range(len(self)))

    def run(self, prepared: IntegerGraph, output: str, samples: Sequence[int]) -> list[float]:
        """The cosines of the listed samples (by index) through `prepared`, whose `output` is compared; with a
        `prefix` cache, each sample resumed after the steps an earlier pass shares (the same values). With
        `threads` > 1, that many samples at a time in threads (the compiled kernels release the GIL; each
        sample's run is its own, so the cosines are those of one thread, in the order listed)."""
        runner = self.prefix.runner(prepared) if self.prefix is not None else None

        def cosine(k: int) -> float:
            outputs = runner.outputs(k, self.inputs[k]) if runner is not None else \
                prepared.run(self.inputs[k], keep_all=False).outputs
            return sample_cosine(self.reference[k], outputs[output].astype(np.float64).ravel())

        bar = dict(total=len(samples), unit="img", desc="tune", disable=None if self.progress else True, leave=False)
        if self.threads < 2 or len(samples) < 2:
            return [cosine(k) for k in tqdm(samples, **bar)]
        return list(tqdm(sample_threads(self.threads).map(cosine, samples), **bar))

    def cosine(self, graph: Graph, table: QuantTable, float_nodes: Sequence[str] = (),
               rule: Optional[PassRule] = None) -> "Score":
        """The score of the integer graph; with `rule`, photo by photo in its order, stopped as soon as the
        candidate cannot pass it (`ptq.tuning.early_stop`: the score then covers the photos scored, `scored` of
        them), or after the photos of an order shorter than the photos (`screened`). A pass not stopped that
        scores every photo is the full pass, bit for bit. With a metric: one full pass here, scored on both
        (a stop rule bounds the cosine alone)."""
        if self.metric is not None:
            return self._metric_pass(graph, table, float_nodes)
        if rule is None or not rule.order:
            return Score.of(self.cosines(graph, table, float_nodes), self.groups)
        run = self.sample_runner(graph, table, float_nodes)
        photos = self.photo_samples()
        values: dict[int, float] = {}
        known: list[float] = []

        def partial(done: int, screened: bool) -> Score:
            scored = sorted(k for p in rule.order[:done] for k in photos[p])
            score = Score.of([values[k] for k in scored],
                             None if self.groups is None else [self.groups[k] for k in scored])
            return dataclasses.replace(score, scored=done, screened=screened)

        for done, photo in enumerate(rule.order, 1):
            index = photos[photo]
            values.update(zip(index, run(index)))
            known.append(float(np.mean([values[k] for k in index])))
            if done < len(photos) and rule.out_of_reach(known, len(photos)):
                return partial(done, screened=False)
        if len(rule.order) < len(photos):  # a screening order (`ptq.tuning.screen`): its photos, none out of reach
            return partial(len(rule.order), screened=True)
        return Score.of([values[k] for k in range(len(self))], self.groups)

    def _metric_pass(self, graph: Graph, table: QuantTable, float_nodes: Sequence[str]) -> "Score":
        """One full pass here, each sample scored on the cosine and the metric (`measure`)."""
        prepared = prepare(graph, table, float_nodes=float_nodes, memo=self.memo)
        measured = []
        for k in tqdm(range(len(self)), unit="img", desc="tune", disable=None if self.progress else True,
                      leave=False):
            measured.append(self.measure(k, prepared.run(self.inputs[k], keep_all=False).outputs, graph.outputs[0]))
        return self.score(measured)

    def measure(self, k: int, outputs: Mapping[str, np.ndarray], first: str) -> tuple[float, Optional[float]]:
        """Sample `k`'s cosine (of output `first`) and metric (None: no metric), given a model's outputs on it
        (graph output name -> array, in the graph's order)."""
        cosine = sample_cosine(self.reference[k], np.asarray(outputs[first], dtype=np.float64).ravel())
        return cosine, None if self.metric is None else self.metric.value(k, outputs)

    def score(self, measured: Sequence[tuple[float, Optional[float]]]) -> "Score":
        """The `Score` of per-sample (cosine, metric) pairs (`measure`), in sample order."""
        score = Score.of([c for c, _ in measured], self.groups)
        if self.metric is None:
            return score
        metric = MetricScore(self.metric.target.name, Score.of([m for _, m in measured], self.groups).mean,
                             Score.of(self.metric.reference, self.groups).mean, len(self), self.photos)
        return dataclasses.replace(score, metric=metric)


@dataclass(frozen=True)
class Score:
    """The mean per-photo cosine and its standard error over photos (sample std / sqrt(n); 0 for one photo):
    a photo's cosine is the mean over its views (module docstring, "How it is bounded"). `photo_means`: each
    photo's cosine, in photo order; `scored`: the photos scored when the pass stopped early, out of reach of
    its rule (`Validation.cosine`; then mean and sem are those of the photos scored), None for a full pass;
    `metric`: the user's metric over the same samples, when the validation has one; `screened`: the pass scored
    only the photos of a screening order (`ptq.tuning.screen`), `scored` of them, none out of reach."""

    mean: float
    sem: float
    photo_means: tuple = field(default=(), compare=False)
    scored: Optional[int] = None
    metric: Optional[MetricScore] = None
    screened: bool = False

    @classmethod
    def of(cls, values: Sequence[float], groups: Optional[Sequence[int]] = None) -> "Score":
        """`values` per sample; `groups`: the photo of each (None: each sample its own)."""
        v = np.asarray(values, dtype=np.float64)
        if groups is not None:
            if len(groups) != len(v):
                raise ValueError(f"{len(v)} values but {len(groups)} group labels")
            _, index = np.unique(np.asarray(groups), return_inverse=True)
            v = np.bincount(index, weights=v) / np.bincount(index)
        return cls(float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0,
                   tuple(float(x) for x in v))

    def bound(self, z: float) -> float:
        """mean - z * sem: what the mean on other photos of the same kind stays above, at z standard errors."""
        return self.mean - z * self.sem
