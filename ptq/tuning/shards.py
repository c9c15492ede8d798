"""`ptq tune --workers N` / `--ray`: the tuner's passes over samples on one pool of workers, with the
one-process result bit for bit (`ptq.parallel.workers`).

What goes out (the rest of the tuner runs in the driver):

- the statistics of the range candidates over the fit images (`ptq.tuning.data.fit_statistics`): shards of
  batches of one sample, collected as `ptq calibrate --workers` collects them
  (`ptq.calibration.shards.CalibrationJob`) and merged in shard order;
- the bottleneck ranking's `evaluate` over the fit images (`reports.evaluate_shards.evaluate_on`);
- each candidate's validation cosines (`ptq.tuning.data.Validation`): the validation samples and the reference
  outputs are part of the job, so they travel once per worker; an item is one sample's index, each worker
  prepares the candidate's integer graph once, and the cosines are put back in sample order, so their mean
  is the one-process float.

One pool (`TuneJob`) serves every pass, so the workers start and load the model once. The graph the tuner
measures changes between candidates only by re-corrected biases (`ptq.adjust.bias_correction`): an item names its
graph by the initializers that differ from the shipped model's and their digest (`GraphVersion`: a few KB,
not the model), and a worker rebuilds that graph once per version. Fit samples given as arrays
(`ArraySamples`, the Python API) are on no worker's disk: their statistics and ranking run in the driver.
"""
from __future__ import annotations

import dataclasses
import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
from tqdm import tqdm

from calibrators import required_stats
from ptq.calibration.adjustments import with_initializers
from ptq.calibration.shards import CalibrationJob, WorkerContext, merge_statistics
from ptq.core.graph import Graph, load_model
from ptq.engine.executor import IntegerGraph, prepare
from ptq.engine.float_run import FloatRunner
from ptq.data.images import ImageLog
from ptq.parallel.runners import make_runner
from ptq.parallel.workers import (
    CallRunner, ShardResult, ShippedModel, load_shipped_model, run_sharded, shard_batches_for,
    ship_model,
)
from ptq.table.quant_table import QuantTable
from ptq.data.samples import SampleFormat
from ptq.tuning.data import Samples, Validation, fit_statistics
from reports.evaluate import evaluate
from reports.evaluate_shards import EvaluateCall, ReportContext, ReportJob, evaluate_on
from reports.evaluation import Evaluation
from ptq.data.image_source import ImageSet
from ptq.data.labels import LabelResolver


@dataclass(frozen=True)
class GraphVersion:
    """A graph as the workers rebuild it: the shipped model with `initializers` ((name, value) pairs) replaced;
    `digest` names it (empty: the shipped model itself), and versions compare by it."""

    digest: str = ""
    initializers: tuple = field(default=(), compare=False)

    @classmethod
    def of(cls, graph: Graph, base: Graph) -> "GraphVersion":
        if graph is base:
            return cls()
        def structure(g: Graph) -> tuple:
            return [(n.op_type, n.inputs, n.outputs) for n in g.nodes], sorted(g.initializers)

        if structure(graph) != structure(base):
            raise ValueError("the workers hold the model they were started with: a graph may differ from it "
                             "only in initializer values")
        changed = tuple((name, value) for name, value in graph.initializers.items()
                        if not _same(value, base.initializers[name]))
        if not changed:
            return cls()
        digest = hashlib.sha256()
        for name, value in changed:
            digest.update(f"{name}\0{value.dtype.str}\0{value.shape}\0".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        return cls(digest.hexdigest(), changed)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())


@dataclass(frozen=True)
class StatisticsCall:
    """`fit_statistics` over shards of the fit images (items: (call, `Shard`))."""

    version: GraphVersion
    needs: frozenset


@dataclass(frozen=True)
class RankingCall:
    """One `evaluate` over shards of the fit images (items: (call, `Shard`))."""

    version: GraphVersion
    evaluate: EvaluateCall


@dataclass(frozen=True)
class ScoreCall:
    """One candidate's validation cosines (items: (call, sample index)); `key` names the candidate: a worker
    prepares its integer graph once."""

    version: GraphVersion
    key: str
    table: QuantTable
    float_nodes: tuple


KEPT_VERSIONS = 2  # a dropped candidate's graph is followed by the current one again: keep both


@dataclass
class TuneContext:
    """A worker's shipped model, the graphs of the latest versions it was asked for (by digest, the shipped
    model under ""), and what it set up for the one in use: a statistics session, a report context, the
    latest candidate's integer graph."""

    graphs: dict[str, Graph]
    digest: str = ""
    statistics: Optional[WorkerContext] = None
    report: Optional[ReportContext] = None
    scored: Optional[str] = None
    prepared: Optional[IntegerGraph] = None

    def use(self, version: GraphVersion, input_shapes: Optional[dict]) -> Graph:
        if version.digest in self.graphs:  # the most recently used last
            self.graphs[version.digest] = self.graphs.pop(version.digest)
        else:
            base = self.graphs[""]
            self.graphs[version.digest] = load_model(with_initializers(base.model, dict(version.initializers)),
                                                     input_shapes)
            while len(self.graphs) > KEPT_VERSIONS + 1:
                del self.graphs[next(d for d in self.graphs if d != "")]
        if version.digest != self.digest:
            self.digest = version.digest
            self.statistics, self.report, self.scored, self.prepared = None, None, None, None
        return self.graphs[version.digest]


@dataclass(frozen=True)
class TuneJob:
    """The tuner's passes on a worker: the model, the fit images' format and labels (None: fit samples are
    arrays, whose passes stay in the driver), and the validation samples with their reference outputs."""

    model: ShippedModel
    input_shapes: Optional[dict]
    format: Optional[SampleFormat]
    labels: Optional[LabelResolver]
    validation: Validation

    def setup(self) -> TuneContext:
        return TuneContext({"": load_shipped_model(self.model, self.input_shapes)})

    def run(self, context: TuneContext, item: tuple[Any, Any]) -> ShardResult:
        call, part = item
        graph = context.use(call.version, self.input_shapes)
        if isinstance(call, StatisticsCall):
            if context.statistics is None:
                context.statistics = WorkerContext(graph, self.format.reader(graph),
                                                   FloatRunner.create(graph, graph.activations, intra_op_threads=1))
            return CalibrationJob(self.model, self.input_shapes, self.format, call.needs).run(context.statistics, part)
        if isinstance(call, RankingCall):
            if context.report is None:
                context.report = ReportContext(graph)
            return ReportJob(self.model, self.input_shapes, self.format, self.labels).run(context.report,
                                                                                          (call.evaluate, part))
        if call.key != context.scored:
            context.prepared = prepare(graph, call.table, float_nodes=list(call.float_nodes),
                                       memo=self.validation.memo)
            context.scored = call.key
        return ShardResult(payload=self.validation.run(context.prepared, graph.outputs[0], [part]))


class TunePool:
    """The tuner's passes (`statistics`, `evaluate`, and as `Validation.scorer` the cosines) on `workers`
    processes or on Ray, for `graph` (and graphs differing from it in initializer values), the fit samples
    `fit` and the validation samples `validation`. A context manager: the pool lives until the block ends."""

    def __init__(self, graph: Graph, fit: Samples, validation: Validation, input_shapes: Optional[dict], *,
                 workers: int, ray: Optional[str] = None):
        self.base, self.fit, self.workers = graph, fit, workers
        self.samples, self.progress = len(validation), validation.progress
        files = isinstance(fit, ImageSet)
        job = TuneJob(ship_model(graph.model), input_shapes, fit.format if files else None,
                      fit.labels if files else None, dataclasses.replace(validation, progress=False, scorer=None))
        self.runner = make_runner(job, workers, ray)
        self._last: tuple[Graph, GraphVersion] = (graph, GraphVersion())
        self._candidate: Optional[tuple] = None  # (graph, table, float nodes, its ScoreCall) last scored

    def __enter__(self) -> "TunePool":
        self.runner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.runner.__exit__(*exc)

    @property
    def scorer(self) -> "TunePool":
        return self

    def version(self, graph: Graph) -> GraphVersion:
        if graph is not self._last[0]:
            self._last = (graph, GraphVersion.of(graph, self.base))
        return self._last[1]

    def _on_files(self, samples: Samples) -> bool:
        if samples is not self.fit:
            raise ValueError("a TunePool runs its passes over the fit samples it was made for")
        return isinstance(samples, ImageSet)

    def cosines(self, graph: Graph, table: QuantTable, float_nodes: Sequence[str] = (),
                samples: Optional[Sequence[int]] = None) -> list[float]:
        """`Validation.cosines` of `samples` (indices; None: all), one item per sample, in their order. Calls
        for the same graph, table and float nodes (the photos of one candidate, `Validation.cosine` with a
        rule) are one candidate: a worker prepares its integer graph once."""
        candidate = (graph, table, tuple(float_nodes))
        last = self._candidate
        if last is None or last[0] is not graph or last[1] is not table or last[2] != candidate[2]:
            self._candidate = (*candidate, ScoreCall(self.version(graph), uuid.uuid4().hex, table, candidate[2]))
        call = self._candidate[3]
        index = list(range(self.samples)) if samples is None else list(samples)
        values: dict[int, float] = {}
        with tqdm(total=len(index), unit="img", desc="tune", disable=None if self.progress else True,
                  leave=False) as bar:
            for (_, k), result in self.runner.map([(call, k) for k in index]):
                values[k] = result.payload[0]
                bar.update(1)
        return [values[k] for k in index]

    def statistics(self, graph: Graph, fit: Samples, calibrators: Sequence[str]) -> dict:
        """`ptq.tuning.data.fit_statistics`."""
        if not self._on_files(fit):
            return fit_statistics(graph, fit, calibrators)
        call = StatisticsCall(self.version(graph), frozenset(required_stats(calibrators)))
        payloads = run_sharded(CallRunner(self.runner, call), fit.files, ImageLog(), limit=fit.limit, batch_size=1,
                               shard_batches=shard_batches_for(fit.expected, 1, self.workers))
        if not payloads:
            raise ValueError("no fit sample could be read")
        return merge_statistics(payloads)

    def evaluate(self, graph: Graph, table: QuantTable, samples: Samples, **kwargs) -> Evaluation:
        """`reports.evaluate.evaluate` (with its keyword arguments)."""
        if not self._on_files(samples):
            return evaluate(graph, table, samples, **kwargs)
        version = self.version(graph)
        return evaluate_on(self.runner, self.workers, table, samples, wrap=lambda call: RankingCall(version, call),
                           **kwargs)
