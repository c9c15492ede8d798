"""`ptq run`'s per-sample step (`classify_image`) and, with `--workers N` / `--ray`, the samples classified in
shards and handed back in file order.

Each worker classifies its shard's samples (one at a time, as `ptq run` does) and returns one
`ImageOutcome` per file; the driver takes them in file order as soon as every earlier shard is in, as the
one-process loop does. An unreadable image is an outcome like any other here (there is
no batching and no image limit, so it shifts nothing).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from tqdm import tqdm

from ptq.core.graph import Graph
from ptq.engine.executor import ExecutorOptions, IntegerGraph, prepare
from ptq.engine.float_run import FloatRunner
from ptq.parallel.runners import make_runner
from ptq.parallel.workers import (
    Shard, ShardResult, ShippedModel, load_shipped_model, plan_shards, shard_batches_for,
)
from ptq.table.quant_table import QuantTable
from ptq.data.samples import SampleFormat, UnreadableSample
from reports.class_scores import class_count
from reports.float_reference import float_reference


@dataclass
class ImageOutcome:
    """One file: its top-k (class, probability) and the float model's top-1, or why it was skipped; the
    integer run's time and overflows."""

    path: Path
    ranked: Optional[list[tuple[int, float]]] = None
    skipped: Optional[str] = None
    seconds: float = 0.0
    overflows: dict[str, int] = field(default_factory=dict)
    float_class: Optional[int] = None
    # an output that is no class-score vector (ArgMax tags, TopK indices, a mask, a sequence of frames): how many
    # of its values equal the float model's (index/bool outputs exactly; float outputs by their argmax over
    # a last axis of 2 or more), and how many values were compared
    matched: Optional[tuple[int, int]] = None
    cosine: Optional[float] = None  # a float output without such an axis (a probability [1, 1]): its cosine


@dataclass(frozen=True)
class RunContext:
    graph: Graph
    prepared: IntegerGraph
    reader: object  # the sample format's reader (ptq.data.samples)
    floats: FloatRunner  # the float model's output, for the top-1 agreement


def run_context(graph: Graph, prepared: IntegerGraph, format: SampleFormat) -> RunContext:
    return RunContext(graph, prepared, format.reader(graph), float_reference(graph, graph.outputs[:1]))


@dataclass(frozen=True)
class ClassifyJob:
    model: ShippedModel
    table: QuantTable
    format: SampleFormat
    float_nodes: tuple
    backend: Optional[str]
    strict: bool
    top: int

    def setup(self) -> RunContext:
        graph = load_shipped_model(self.model, self.table.options.input_shapes)
        prepared = prepare(graph, self.table, float_nodes=list(self.float_nodes), backend=self.backend,
                           options=ExecutorOptions(strict=self.strict))
        return run_context(graph, prepared, self.format)

    def run(self, context: RunContext, shard: Shard) -> ShardResult:
        return ShardResult(payload=[classify_image(context, path, self.top)
                                    for batch in shard.batches for path in batch])


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities along the last axis (float64, max-subtracted)."""
    z = np.asarray(logits, dtype=np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def top_k(probs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most probable classes of a 1-D probability vector, most probable first (ties: lower index)."""
    order = np.argsort(-probs, kind="stable")[:k]
    return [(int(c), float(probs[c])) for c in order]


def classify_image(context: RunContext, path: Path, top: int) -> ImageOutcome:
    """One file through the integer graph: its top-k classes, or why it was skipped (`ptq run`'s per-image
    step, in one process or on a worker); and the float model's top-1 class."""
    try:
        sample = context.reader.read(path)
    except UnreadableSample as exc:
        return ImageOutcome(path, skipped=str(exc))
    start = time.perf_counter()
    result = context.prepared.run(sample, keep_all=False)
    seconds = time.perf_counter() - start
    output = context.graph.outputs[0]
    got, want = result.outputs[output], context.floats.run_dict(sample)[output]
    if class_count(context.graph, output) is None:
        if np.issubdtype(np.asarray(want).dtype, np.floating) and np.shape(want)[-1:] in ((), (1,)):
            return ImageOutcome(path, [], None, seconds, dict(result.overflows), cosine=cosine(want, got))
        return ImageOutcome(path, [], None, seconds, dict(result.overflows), matched=output_matches(want, got))
    ranked = top_k(softmax(got.reshape(-1)), top)
    float_class = int(np.argmax(want.reshape(-1)))
    return ImageOutcome(path, ranked, None, seconds, dict(result.overflows), float_class)


def cosine(want: np.ndarray, got: np.ndarray) -> float:
    """cos(float output, integer output), flattened; 1 when both are zero."""
    a, b = np.asarray(want, np.float64).ravel(), np.asarray(got, np.float64).ravel()
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / norm) if norm > 0 else float(np.array_equal(a, b))


def output_matches(want: np.ndarray, got: np.ndarray) -> tuple[int, int]:
    """(values of `got` equal to `want`, values compared): index and boolean outputs element by element, float
    outputs by their argmax over the last axis (one decision per frame or position)."""
    want, got = np.asarray(want), np.asarray(got)
    if np.issubdtype(want.dtype, np.floating) and want.ndim:
        want, got = np.argmax(want, axis=-1), np.argmax(got, axis=-1)
    return int(np.count_nonzero(want == got)), int(want.size)


def classify_sharded(job: ClassifyJob, files: list[Path], workers: int, ray: Optional[str],
                     on_outcome: Callable[[ImageOutcome], None], progress: bool = False) -> None:
    """Classify `files` on workers; `on_outcome(outcome)` is called in file order."""
    shards = plan_shards(files, 1, shard_batches_for(len(files), 1, workers))
    index = {shard: k for k, shard in enumerate(shards)}
    done: dict[int, list[ImageOutcome]] = {}
    following = 0
    with make_runner(job, workers, ray) as runner, \
            tqdm(total=len(files), unit="img", desc="run", disable=None if progress else True, leave=False) as bar:
        for shard, result in runner.map(shards):
            done[index[shard]] = result.payload
            bar.update(shard.images)
            while following in done:
                for outcome in done.pop(following):
                    on_outcome(outcome)
                following += 1
