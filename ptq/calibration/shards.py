"""Calibration statistics over shards of the image list (`ptq calibrate --workers N`, `--ray`).

Workers read the shard's files themselves (images or `--data` sample files, `ptq.data.samples`). Each shard's statistics are collected by `ptq.engine.float_run.collect_statistics` in a worker, exactly as the
one-process run collects those batches, and merged in shard order: min/max and the histograms merge
exactly in any order; per-batch extrema (`mean`) and moments (`Nstd`) keep one entry per batch and are
folded in batch order, so the table is byte-identical to the one-process table (`ptq.parallel.workers`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tqdm import tqdm

from calibrators import TensorStatistics
from ptq.core.bodies import calibrated_tensors
from ptq.core.graph import Graph
from ptq.engine.float_run import FloatRunner, collect_statistics
from ptq.data.images import ImageLog
from ptq.parallel.runners import make_runner
from ptq.parallel.workers import (
    Shard, ShardResult, ShippedModel, load_shipped_model, run_sharded, shard_batches_for, ship_model,
)
from ptq.data.samples import SampleFormat, SampleSource, UnreadableSample, stack


@dataclass(frozen=True)
class WorkerContext:
    graph: Graph
    reader: object  # the sample format's reader (ptq.data.samples)
    runner: FloatRunner


@dataclass(frozen=True)
class CalibrationJob:
    """Statistics of every activation of a model (a file path, or a serialized model) over sample shards."""

    model: ShippedModel
    input_shapes: Optional[dict]
    format: SampleFormat
    needs: frozenset

    def setup(self) -> WorkerContext:
        graph = load_shipped_model(self.model, self.input_shapes)
        return WorkerContext(graph, self.format.reader(graph),
                             FloatRunner.create(graph, calibrated_tensors(graph), intra_op_threads=1))

    def run(self, context: WorkerContext, shard: Shard) -> ShardResult:
        batches, skipped = [], []
        for files in shard.batches:
            batch = []
            for path in files:
                try:
                    batch.append((path, context.reader.read(path)))
                except UnreadableSample as exc:
                    skipped.append((path, str(exc)))
            batches.append(batch)
        if skipped:  # the layout changes: the driver plans again
            return ShardResult(skipped=skipped)
        stats = collect_statistics(context.graph, (stack(b) for b in batches), calibrated_tensors(context.graph),
                                   self.needs, runner=context.runner)
        return ShardResult(payload=stats)


def sharded_statistics(
    model, graph: Graph, source: SampleSource, needs: frozenset, *, num_images: Optional[int],
    batch_size: int, seed: int, input_shapes: Optional[dict], workers: int, ray: Optional[str] = None,
    progress: bool = False,
) -> tuple[dict[str, TensorStatistics], ImageLog]:
    """What `ptq.calibration.statistics.collect_image_statistics` returns, computed by `workers` processes (or on
    Ray)."""
    log = ImageLog()
    candidates = source.candidates(log, num_images, seed)
    source.format.reader(graph)  # errors (no image input, ...) before spawning
    job = CalibrationJob(ship_model(model), input_shapes, source.format, frozenset(needs))
    expected = len(candidates) if num_images is None else min(num_images, len(candidates))
    per_shard = shard_batches_for(expected, batch_size, workers)
    with make_runner(job, workers, ray) as runner, \
            tqdm(total=expected, unit="img", desc="calibrating", disable=None if progress else True,
                 leave=False) as bar:
        payloads = run_sharded(runner, candidates, log, limit=num_images, batch_size=batch_size,
                               shard_batches=per_shard, on_shard=bar.update)
    if not payloads:
        raise ValueError(f"no valid image in {source.location} ({len(log.skipped)} files skipped)")
    return merge_statistics(payloads), log


def merge_statistics(payloads: list[dict[str, TensorStatistics]]) -> dict[str, TensorStatistics]:
    """The shards' statistics (in shard order) as one: each tensor's collectors merged into the first's."""
    stats = payloads[0]
    for shard_stats in payloads[1:]:
        for name, collector in stats.items():
            collector.merge(shard_stats[name])
    return stats
