"""`evaluate` over shards of the images (`ptq report --workers N`, `--ray`), merged into the one-process
`Evaluation` bit for bit.

The similarity sums are floating point, so their totals depend on the order they are added in: each
worker records every sample's sums (a few floats per tensor and image, `RecordingAccumulator`) and the
driver adds them up in image order, as one process would. Counts (clipped values, accumulator overflows,
top-k agreement, value histograms) are integers and merge exactly. The isolated metrics go to the first N
images of the whole run (`Shard.isolated`). Shards and unreadable images: `ptq.parallel.workers`.

`ShardedEvaluator` keeps its pool for several calls (`ptq debug`, `ptq tune`): a worker loads the model once,
prepares the integer graph once per call and keeps its float reference session from shard to shard.
"""
from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import onnx
from tqdm import tqdm

from ptq.core.graph import Graph
from ptq.engine.executor import IntegerGraph, prepare
from ptq.engine.float_run import FloatRunner
from ptq.data.images import ImageLog
from ptq.parallel.runners import make_runner
from ptq.parallel.workers import (
    CallRunner, QuietLog, Shard, ShardResult, ShardRunner, ShippedModel, choose_workers, guided_shard_batches,
    load_shipped_model, run_sharded, ship_model, usable_cores,
)
from ptq.table.quant_table import QuantTable
from ptq.data.samples import SampleFormat
from reports.detections import DetectionAgreement, DetectionTask
from reports.evaluate import evaluate
from reports.evaluation import Evaluation
from reports.float_reference import float_reference
from ptq.data.image_source import ImageSet
from ptq.data.labels import LabelResolver
from reports.metrics import ClipAccumulator, SimilarityAccumulator, TopKAgreement, ValueAgreement
from reports.output_breakdown import GroupAccumulator
from reports.value_histogram import ValueHistogram


@dataclass
class RecordingAccumulator(SimilarityAccumulator):
    """A `SimilarityAccumulator` that also keeps each sample's sums, to be re-added in image order."""

    records: list = field(default_factory=list)

    def _add(self, **sample) -> None:
        self.records.append(sample)
        super()._add(**sample)


@dataclass
class ShardImages:
    """A shard's files as a report sample source (what `ImageSet.samples` yields), unreadable ones logged."""

    files: list[Path]
    format: SampleFormat
    labels: LabelResolver
    log: QuietLog = field(default_factory=QuietLog)

    @property
    def expected(self) -> int:
        return len(self.files)

    def samples(self, graph: Graph) -> Iterator[tuple[Path, dict, Optional[int]]]:
        return ImageSet(self.files, self.format, self.labels).samples(graph, self.log)


@dataclass(frozen=True)
class EvaluateCall:
    """One `evaluate` over shards: what may differ between the calls one pool serves (`ptq debug` and
    `ptq tune` evaluate many tables and float-node choices on the same model and images). `key` names the
    call: a worker prepares its integer graph once per call."""

    key: str
    table: QuantTable
    float_nodes: tuple = ()
    backend: Optional[str] = None
    layers: bool = True
    isolated: bool = True
    detection: Optional[DetectionTask] = None


@dataclass
class ReportContext:
    """A worker's model, and what it prepared for the call it is serving (the latest one only)."""

    graph: Graph
    goal: Optional[Graph] = None  # the user's model when `graph` holds adjusted weights (`evaluate`'s `goal`)
    call_key: Optional[str] = None
    prepared: Optional[IntegerGraph] = None
    runners: dict = field(default_factory=dict)  # (graph, tensors) -> float session, reused by the next shards

    def prepare(self, call: EvaluateCall) -> IntegerGraph:
        if call.key != self.call_key:
            self.prepared = prepare(self.graph, call.table, float_nodes=list(call.float_nodes), backend=call.backend)
            self.call_key = call.key
        return self.prepared

    def reference(self, graph: Graph, tensors: Sequence[str]) -> FloatRunner:
        """`reports.evaluate`'s float runner, one session per model for every shard that wants the same
        tensors."""
        key = (id(graph), tuple(dict.fromkeys(tensors)))
        if key not in self.runners:
            self.runners = {k: r for k, r in self.runners.items() if k[0] != key[0]}
            self.runners[key] = float_reference(graph, tensors)
        return self.runners[key]


@dataclass(frozen=True)
class ReportJob:
    """`evaluate` of one model over image shards (the model as a path or serialized bytes); each item is an
    (`EvaluateCall`, `Shard`) pair. `graph`: the model as the driver loaded it, which a forked worker inherits
    instead of loading the model again (it is not pickled: a spawned worker or a Ray task loads `model`).
    `threads`: `evaluate`'s helper threads in each worker (off when the workers take every core)."""

    model: ShippedModel
    input_shapes: Optional[dict]
    format: SampleFormat
    labels: LabelResolver
    threads: bool = True
    goal: Optional[ShippedModel] = None  # the user's model when `model` holds adjusted weights
    graph: Optional[Graph] = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "graph": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def setup(self) -> ReportContext:
        goal = None if self.goal is None else load_shipped_model(self.goal, self.input_shapes)
        return ReportContext(self.graph or load_shipped_model(self.model, self.input_shapes), goal)

    def run(self, context: ReportContext, item: tuple[EvaluateCall, Shard]) -> ShardResult:
        call, shard = item
        source = ShardImages([p for batch in shard.batches for p in batch], self.format, self.labels)
        try:
            ev = evaluate(context.graph, call.table, source, layers=call.layers, isolated=call.isolated,
                          isolated_images=shard.isolated, prepared=context.prepare(call),
                          accumulator=RecordingAccumulator, reference=context.reference, threads=self.threads,
                          goal=context.goal, detection=call.detection)
        except ValueError:
            if source.log.skipped and not source.log.used:  # "no image could be decoded"
                return ShardResult(skipped=source.log.skipped)
            raise
        if source.log.skipped:  # the layout changes: the driver plans again
            return ShardResult(skipped=source.log.skipped)
        return ShardResult(payload=ev)


def merge_evaluations(parts: Sequence[Evaluation]) -> Evaluation:
    """The shards' evaluations (in image order) as one: each sample's sums re-added in image order."""
    first = parts[0]
    ev = Evaluation(
        layers=first.layers, qparams=first.qparams,
        cumulative={name: SimilarityAccumulator() for name in first.cumulative},
        isolated={name: SimilarityAccumulator() for name in first.isolated},
        outputs={name: SimilarityAccumulator() for name in first.outputs},
        classification=None if first.classification is None else TopKAgreement(k=first.classification.k),
        float_nodes=first.float_nodes, float_reasons=first.float_reasons,
        clipped={name: ClipAccumulator() for name in first.clipped},
        index_outputs={name: reduce(ValueAgreement.merge, (part.index_outputs[name] for part in parts))
                       for name in first.index_outputs},
        # integer counts and extremes: exact in any order
        histograms={name: reduce(ValueHistogram.merge, (part.histograms[name] for part in parts))
                    for name in first.histograms},
        output_groups={name: [GroupAccumulator(acc.groups) for acc in groups]
                       for name, groups in first.output_groups.items()},
        detections=None if first.detections is None else DetectionAgreement(first.detections.score_threshold,
                                                                            first.detections.match_iou),
    )
    for part in parts:
        for merged, shard in ((ev.cumulative, part.cumulative), (ev.isolated, part.isolated),
                              (ev.outputs, part.outputs)):
            for name, accumulator in merged.items():
                for sample in shard[name].records:
                    accumulator._add(**sample)  # the same additions, in the same order, as one process
        ev.clipped = {name: acc.merge(part.clipped[name]) for name, acc in ev.clipped.items()}
        ev.output_groups = {name: [mine.merge(theirs) for mine, theirs in zip(groups, part.output_groups[name])]
                            for name, groups in ev.output_groups.items()}
        if ev.classification is not None:
            ev.classification = ev.classification.merge(part.classification)
        if ev.detections is not None:
            ev.detections = ev.detections.merge(part.detections)
        for name, count in part.overflows.items():
            ev.overflows[name] = ev.overflows.get(name, 0) + count
        ev.images += part.images
    return ev


class ShardedEvaluator:
    """`reports.evaluate.evaluate` with its arguments, computed by `workers` processes (or on Ray) that load
    the model and start once for every call (`ptq report` makes one call, `ptq debug` and `ptq tune` many).
    A context manager: the pool lives until the `with` block ends. Each call must pass the graph and the
    image set the evaluator was made for (the workers hold that model and those samples' format)."""

    def __init__(self, model: Union[str, Path, onnx.ModelProto], input_shapes: Optional[dict], images: ImageSet, *,
                 workers: int, ray: Optional[str] = None, graph: Optional[Graph] = None,
                 goal: Union[str, Path, onnx.ModelProto, None] = None):
        self.graph, self.images = graph, images
        job = ReportJob(ship_model(model), input_shapes, images.format, images.labels,
                        threads=worker_threads(workers, ray), goal=None if goal is None else ship_model(goal),
                        graph=graph)
        self.runner = make_runner(job, workers, ray)
        self.workers = workers

    @classmethod
    def for_graph(cls, graph: Graph, table: QuantTable, images: ImageSet, *, workers: int,
                  ray: Optional[str] = None) -> "ShardedEvaluator":
        """The workers get the model as loaded here (the adjusted one when the table records weight
        adjustments), with the table's input shapes."""
        return cls(graph.model, table.options.input_shapes, images, workers=workers, ray=ray, graph=graph)

    def __enter__(self) -> "ShardedEvaluator":
        self.runner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.runner.__exit__(*exc)

    def __call__(self, graph: Optional[Graph], table: QuantTable, images: ImageSet, *, float_nodes: Sequence[str] = (),
                 layers: bool = True, isolated: bool = True, isolated_images: Optional[int] = None,
                 progress: bool = False, desc: str = "report", backend=None,
                 detection: Optional[DetectionTask] = None) -> Evaluation:
        if graph is not self.graph or images is not self.images:
            raise ValueError("a ShardedEvaluator evaluates the graph and the images it was made for")
        return evaluate_on(self.runner, self.workers, table, images, float_nodes=float_nodes, layers=layers,
                           isolated=isolated, isolated_images=isolated_images, progress=progress, desc=desc,
                           backend=backend, detection=detection)


def evaluate_on(runner: ShardRunner, workers: int, table: QuantTable, images: ImageSet, *,
                float_nodes: Sequence[str] = (), layers: bool = True, isolated: bool = True,
                isolated_images: Optional[int] = None, progress: bool = False, desc: str = "report", backend=None,
                wrap: Callable[[EvaluateCall], Any] = lambda call: call,
                detection: Optional[DetectionTask] = None) -> Evaluation:
    """One `evaluate` on `runner`, a pool of `workers` whose job runs (`wrap(call)`, `Shard`) items as
    `ReportJob.run` does (`ptq tune`'s pool wraps the call with the graph it is for)."""
    if backend is not None and not isinstance(backend, str):
        raise ValueError("workers take the backend by name (ptq.engine.backends)")
    if isolated and not layers:
        raise ValueError("isolated metrics need layers=True")
    call = wrap(EvaluateCall(uuid.uuid4().hex, table, tuple(float_nodes), backend, layers, isolated, detection))
    prefix = images.expected if isolated_images is None else isolated_images
    log = ImageLog()
    with tqdm(total=images.expected, unit="img", desc=desc, disable=None if progress else True,
              leave=False) as bar:
        parts = run_sharded(CallRunner(runner, call), images.files, log, limit=images.limit, batch_size=1,
                            shard_batches=guided_shard_batches(images.expected, 1, workers),
                            isolated=prefix if isolated else 0, on_shard=bar.update)
    if not parts:
        raise ValueError("no image could be decoded")
    return merge_evaluations(parts)


def worker_threads(workers: int, ray: Optional[str]) -> bool:
    """Whether each worker runs `evaluate` with its helper threads: only when the workers leave cores free
    (a Ray task has one CPU)."""
    return ray is None and workers < usable_cores()


def choose_evaluator(graph: Graph, table: QuantTable, images: ImageSet, *, workers: Optional[int],
                     ray: Optional[str] = None):
    """A context manager giving `reports.evaluate.evaluate` when `ptq.parallel.workers.choose_workers` picks one
    process (and no Ray), else a `ShardedEvaluator` whose workers serve every call (`ptq debug`, `ptq tune`)."""
    workers = choose_workers(workers, images.expected)
    if workers == 1 and ray is None:
        return contextlib.nullcontext(evaluate)
    return ShardedEvaluator.for_graph(graph, table, images, workers=workers, ray=ray)


def sharded_evaluate(
    model: Union[str, Path, onnx.ModelProto],
    table: QuantTable,
    images: ImageSet,
    *,
    workers: int,
    ray: Optional[str] = None,
    float_nodes: Sequence[str] = (),
    layers: bool = True,
    isolated: bool = True,
    isolated_images: Optional[int] = None,
    backend: Optional[str] = None,
    progress: bool = False,
    desc: str = "report",
    graph: Optional[Graph] = None,
    goal: Union[str, Path, onnx.ModelProto, None] = None,
    detection: Optional[DetectionTask] = None,
) -> Evaluation:
    """What `evaluate(graph, table, images, ...)` returns, computed by `workers` processes (or on Ray).
    `graph`: `model` as already loaded here (forked workers inherit it instead of loading the model).
    `goal`: the user's model when `model` holds adjusted weights (`evaluate`'s `goal`)."""
    with ShardedEvaluator(model, table.options.input_shapes, images, workers=workers, ray=ray,
                          graph=graph, goal=goal) as evaluator:
        return evaluator(graph, table, images, float_nodes=float_nodes, layers=layers, isolated=isolated,
                         isolated_images=isolated_images, progress=progress, desc=desc, backend=backend,
                         detection=detection)
