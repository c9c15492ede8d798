"""`evaluate` over shards of the images (`ptq report --workers N`, `--ray`), merged into the one-process
`Evaluation` bit for bit.

The similarity sums are floating point, so their totals depend on the order they are added in: each
worker records every sample's sums (a few floats per tensor and image, `RecordingAccumulator`) and the
driver adds them up in image order, as one process would. Counts (clipped values, accumulator overflows,
top-k agreement, value histograms) are integers and merge exactly. The isolated metrics go to the first N
images of the whole run (`Shard.isolated`). Shards and unreadable images: `ptq.parallel`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import onnx

from ptq.core.graph import Graph, load_model
from ptq.executor import IntegerGraph, prepare
from ptq.images import ImageLog
from ptq.parallel import Shard, ShardResult, make_runner, run_sharded, shard_batches_for
from ptq.samples import SampleFormat
from ptq.quant_table import QuantTable
from reports.evaluate import evaluate
from reports.evaluation import Evaluation
from reports.image_source import ImageSet
from reports.labels import LabelResolver
from reports.metrics import ClipAccumulator, SimilarityAccumulator, TopKAgreement
from reports.value_histogram import ValueHistogram


@dataclass
class RecordingAccumulator(SimilarityAccumulator):
    """A `SimilarityAccumulator` that also keeps each sample's sums, to be re-added in image order."""

    records: list = field(default_factory=list)

    def _add(self, **sample) -> None:
        self.records.append(sample)
        super()._add(**sample)


class QuietLog(ImageLog):
    """A worker's log: the driver warns about unreadable images, once, in candidate order."""

    def skip(self, path: Path, reason: str) -> None:
        self.skipped.append((path, reason))


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
class ReportContext:
    graph: Graph
    prepared: IntegerGraph


@dataclass(frozen=True)
class ReportJob:
    """`evaluate` of one integer graph over image shards (the model as a path or serialized bytes)."""

    model: Union[str, bytes]
    table: QuantTable
    format: SampleFormat
    labels: LabelResolver
    float_nodes: tuple = ()
    backend: Optional[str] = None
    layers: bool = True
    isolated: bool = True

    def setup(self) -> ReportContext:
        model = self.model if isinstance(self.model, str) else onnx.load_from_string(self.model)
        graph = load_model(model, self.table.options.input_shapes)
        return ReportContext(graph, prepare(graph, self.table, float_nodes=list(self.float_nodes),
                                            backend=self.backend))

    def run(self, context: ReportContext, shard: Shard) -> ShardResult:
        source = ShardImages([p for batch in shard.batches for p in batch], self.format, self.labels)
        try:
            ev = evaluate(context.graph, self.table, source, layers=self.layers, isolated=self.isolated,
                          isolated_images=shard.isolated, prepared=context.prepared,
                          accumulator=RecordingAccumulator)
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
        # integer counts and extremes: exact in any order
        histograms={name: reduce(ValueHistogram.merge, (part.histograms[name] for part in parts))
                    for name in first.histograms},
    )
    for part in parts:
        for merged, shard in ((ev.cumulative, part.cumulative), (ev.isolated, part.isolated),
                              (ev.outputs, part.outputs)):
            for name, accumulator in merged.items():
                for sample in shard[name].records:
                    accumulator._add(**sample)  # the same additions, in the same order, as one process
        ev.clipped = {name: acc.merge(part.clipped[name]) for name, acc in ev.clipped.items()}
        if ev.classification is not None:
            ev.classification = ev.classification.merge(part.classification)
        for name, count in part.overflows.items():
            ev.overflows[name] = ev.overflows.get(name, 0) + count
        ev.images += part.images
    return ev


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
) -> Evaluation:
    """What `evaluate(graph, table, images, ...)` returns, computed by `workers` processes (or on Ray)."""
    from tqdm import tqdm

    source = str(Path(model).resolve()) if isinstance(model, (str, Path)) else model.SerializeToString()
    job = ReportJob(source, table, images.format, images.labels, tuple(float_nodes), backend, layers, isolated)
    prefix = images.expected if isolated_images is None else isolated_images
    log = ImageLog()
    with make_runner(job, workers, ray) as runner, \
            tqdm(total=images.expected, unit="img", desc=desc, disable=None if progress else True,
                 leave=False) as bar:
        parts = run_sharded(runner, images.files, log, limit=images.limit, batch_size=1,
                            shard_batches=shard_batches_for(images.expected, 1, workers),
                            isolated=prefix if isolated else 0, on_shard=bar.update)
    if not parts:
        raise ValueError("no image could be decoded")
    return merge_evaluations(parts)
