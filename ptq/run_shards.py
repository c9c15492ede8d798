"""`ptq run --workers N` / `--ray`: the images classified in shards, printed in file order.

Each worker classifies its shard's images (one at a time, as `ptq run` does) and returns one
`ImageOutcome` per file; the driver prints them in file order as soon as every earlier shard is in, and
tallies them as the one-process loop does. An unreadable image is an outcome like any other here (there is
no batching and no image limit, so it shifts nothing).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import onnx

from ptq.core.graph import Graph, load_model
from ptq.executor import ExecutorOptions, IntegerGraph, prepare
from ptq.float_run import image_input
from ptq.images import InputSpec, Preprocess, load_image
from ptq.parallel import Shard, ShardResult, make_runner, plan_shards, shard_batches_for
from ptq.pipeline import input_spec
from ptq.quant_table import QuantTable


@dataclass
class ImageOutcome:
    """One file: its top-k (class, probability) or why it was skipped, the integer run's time and overflows."""

    path: Path
    ranked: Optional[list[tuple[int, float]]] = None
    skipped: Optional[str] = None
    seconds: float = 0.0
    overflows: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RunContext:
    graph: Graph
    prepared: IntegerGraph
    spec: InputSpec


@dataclass(frozen=True)
class ClassifyJob:
    model: Union[str, bytes]
    table: QuantTable
    preprocess: Preprocess
    float_nodes: tuple
    backend: Optional[str]
    strict: bool
    top: int

    def setup(self) -> RunContext:
        model = self.model if isinstance(self.model, str) else onnx.load_from_string(self.model)
        graph = load_model(model, self.table.options.input_shapes)
        prepared = prepare(graph, self.table, float_nodes=list(self.float_nodes), backend=self.backend,
                           options=ExecutorOptions(strict=self.strict))
        return RunContext(graph, prepared, input_spec(graph, self.preprocess))

    def run(self, context: RunContext, shard: Shard) -> ShardResult:
        return ShardResult(payload=[classify_image(context, path, self.preprocess, self.top)
                                    for batch in shard.batches for path in batch])


def classify_image(context: RunContext, path: Path, preprocess: Preprocess, top: int) -> ImageOutcome:
    """One file through the integer graph: its top-k classes, or why it was skipped (`ptq run`'s per-image
    step, in one process or on a worker)."""
    from ptq.commands.run import softmax, top_k

    try:
        sample = load_image(path, preprocess, context.spec)[None]
    except ValueError as exc:
        return ImageOutcome(path, skipped=str(exc))
    start = time.perf_counter()
    result = context.prepared.run({image_input(context.graph): sample}, keep_all=False)
    seconds = time.perf_counter() - start
    ranked = top_k(softmax(result.outputs[context.graph.outputs[0]].reshape(-1)), top)
    return ImageOutcome(path, ranked, None, seconds, dict(result.overflows))


def classify_sharded(job: ClassifyJob, files: list[Path], workers: int, ray: Optional[str], tally,
                     print_outcome, labels: Callable[[Path], Optional[int]]) -> None:
    """Classify `files` on workers; `print_outcome(outcome)` is called in file order, `tally` filled with
    the top-1 against `labels(path)`."""
    shards = plan_shards(files, 1, shard_batches_for(len(files), 1, workers))
    index = {shard: k for k, shard in enumerate(shards)}
    done: dict[int, list[ImageOutcome]] = {}
    following = 0
    with make_runner(job, workers, ray) as runner:
        for shard, result in runner.map(shards):
            done[index[shard]] = result.payload
            while following in done:
                for outcome in done.pop(following):
                    tally_outcome(tally, outcome, labels(outcome.path))
                    print_outcome(outcome)
                following += 1


def tally_outcome(tally, outcome: ImageOutcome, label: Optional[int]) -> None:
    """Add one file's outcome to `ptq run`'s tally (images, skipped, time, overflows, top-1 against `label`)."""
    if outcome.skipped is not None:
        tally.skipped += 1
        return
    tally.images += 1
    tally.seconds += outcome.seconds
    for node, count in outcome.overflows.items():
        tally.overflows[node] = tally.overflows.get(node, 0) + count
    if label is not None:
        tally.labelled += 1
        tally.correct += int(outcome.ranked[0][0] == label)


def print_outcome(outcome: ImageOutcome) -> None:
    """The line `ptq run` prints for one file."""
    if outcome.skipped is not None:
        print(f"{outcome.path.name}: skipped ({outcome.skipped})")
    else:
        print(f"{outcome.path.name}: " + "  ".join(f"{c}:{p:.4f}" for c, p in outcome.ranked))


def classify_on_workers(args, graph: Graph, table: QuantTable, preprocess: Preprocess, files: list[Path],
                        tally, labels: Callable[[Path], Optional[int]], workers: int) -> None:
    """`ptq run` on `workers` > 1 processes or --ray: the lines and the tally of the one-process loop. The
    workers get the model as loaded here (the adjusted one when the table records weight adjustments)."""
    job = ClassifyJob(graph.model.SerializeToString(), table, preprocess, tuple(args.float_nodes), args.backend,
                      args.strict, args.top)
    classify_sharded(job, files, workers, args.ray, tally, print_outcome, labels)
