"""Stream images through the float model and the integer graph, and accumulate per-layer similarities.

Per image (one sample, batch 1): the float reference (`reports.float_reference`: onnxruntime on the *original*
model with every reported tensor as an extra output), then the integer graph compared with it cumulatively and
layer by layer in isolation (`reports.image_run`). Each image's tensors are folded into
`SimilarityAccumulator`s and dropped, so memory does not grow with the number of images.

Threads: the integer graph runs in the calling thread; one thread runs the float model on the next image, and a
worker thread (`reports.worker`) folds every tensor into the metrics as soon as the integer graph produced it and
runs the isolated steps (onnxruntime and numpy release the GIL, so both overlap the integer run when a core is
free). At most `MetricWorker.LAG` + 2 images are in flight, each holding its float tensors (at most 53 MB for
EfficientNet-Lite0). The `ptq` command runs OpenBLAS on one thread (`ptq.cli.one_blas_thread`), which leaves
the other core free.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional, Sequence, Union

from tqdm import tqdm

from ptq.core.graph import Graph
from ptq.engine.executor import IntegerGraph, prepare
from ptq.engine.float_run import FloatRunner
from ptq.engine.clip_ranges import folded_ranges
from ptq.table.quant_table import QuantTable
from reports.class_scores import class_count
from reports.detections import DetectionTask
from reports.evaluation import Evaluation
from reports.float_reference import GoalReference, float_reference
from reports.grid import grid_bounds
from reports.image_run import ImageRun
from ptq.data.image_source import ArraySamples, ImageSet
from reports.inline import background
from reports.layer_specs import layer_specs
from reports.metrics import ClipAccumulator, SimilarityAccumulator, TopKAgreement, ValueAgreement
from reports.output_breakdown import GroupAccumulator, output_groups
from reports.value_histogram import ValueHistogram
from reports.worker import MetricWorker


def index_outputs(graph: Graph, prepared: IntegerGraph) -> list[str]:
    """The graph outputs that are indices or booleans (not quantized, not float): compared by agreement."""
    return [o for o in prepared.graph.outputs if o not in prepared.qparams and graph.tensors.get(o) is not None
            and graph.tensors[o].dtype is not None and not graph.tensors[o].is_float]


def evaluate(
    graph: Graph,
    table: QuantTable,
    images: Union[ImageSet, ArraySamples],
    *,
    float_nodes: Sequence[str] = (),
    layers: bool = True,
    isolated: bool = True,
    isolated_images: Optional[int] = None,
    prepared: Optional[IntegerGraph] = None,
    progress: bool = False,
    desc: str = "report",
    backend=None,
    accumulator: type = SimilarityAccumulator,
    reference: Callable[[Graph, Sequence[str]], FloatRunner] = float_reference,
    threads: bool = True,
    goal: Optional[Graph] = None,
    detection: Optional[DetectionTask] = None,
) -> Evaluation:
    """Run the float model and the integer graph on every image and accumulate the similarities.

    `layers=False` measures the graph outputs only (cheaper: debug passes); `isolated=False` skips the
    isolated runs; `isolated_images=N` runs them on the first N images only (they cost a second integer
    pass; 0: on none of them). `float_nodes` are node names, tensor names or op types run in float inside the integer graph.
    `backend` (a `DotBackend` or a `ptq.engine.backends` name) computes the integer graph's dot products.
    `accumulator`: the `SimilarityAccumulator` class (a sharded run records each sample's sums).
    `reference(graph, tensors)`: the float runner (a worker reuses one session for all its shards).
    `goal`: the user's model when `graph` holds adjusted weights: the graph outputs are compared with its
    outputs, the layers with `graph`'s tensors (`reports.float_reference.GoalReference`).
    `threads=False`: no helper threads, every step in the calling thread (a sharded report's worker when the
    workers already take every core: `reports.evaluate_shards`).
    `detection`: the detections to compare (`reports.detections.detection_task`), counted in `ev.detections`.
    """
    if isolated and not layers:
        raise ValueError("isolated metrics need layers=True")
    if isolated_images is not None and isolated_images < 0:
        raise ValueError(f"isolated_images must not be negative, got {isolated_images}")
    if prepared is not None and (float_nodes or backend is not None):
        raise ValueError("give float_nodes and backend to prepare(), not with an already prepared graph")
    prepared = prepared or prepare(graph, table, float_nodes=float_nodes, backend=backend)
    outputs = [o for o in prepared.graph.outputs if o in prepared.qparams]
    indices = index_outputs(graph, prepared)
    if not outputs and not indices:
        raise ValueError(f"no graph output of the model is quantized or an index ({prepared.graph.outputs})")
    specs = layer_specs(prepared, graph.activations) if layers else []
    steps = sorted({s.step for s in specs if s.step is not None})
    # the isolated runs read every quantized input of those steps, no-op outputs included (they get no row)
    in_float_model = set(graph.activations)
    read = [i for k in steps for i in prepared.steps[k].node.all_inputs if i in prepared.qparams and i in in_float_model]
    detection_tensors = _detection_tensors(prepared, detection)
    wanted = list(dict.fromkeys([s.name for s in specs] + outputs + indices + read + detection_tensors))
    runner = reference(graph, wanted)
    if goal is not None:
        runner = GoalReference(runner, reference(goal, outputs))
    ev = Evaluation(
        layers=specs,
        qparams=dict(prepared.qparams),
        cumulative={s.name: accumulator() for s in specs},
        isolated={s.name: accumulator() for s in specs} if isolated else {},
        outputs={o: accumulator() for o in outputs},
        classification=_classification(graph, outputs),
        float_nodes=[f.name for f in prepared.float_nodes],
        float_reasons={f.name: f"{f.op_type}: {f.reason}" for f in prepared.float_nodes},
        clipped={s.name: ClipAccumulator() for s in specs},
        index_outputs={name: ValueAgreement() for name in indices},
        output_groups={o: [GroupAccumulator(g) for g in output_groups(graph, o)] for o in outputs},
        detections=None if detection is None else detection.agreement(),
    )
    ranks = {s.name: len(graph.tensors[s.name].shape or ()) for s in specs}
    bounds = {s.name: grid_bounds(ev.qparams[s.name], ranks[s.name]) for s in specs}
    # every layer gets its histogram: which ones the report shows (the top suspects) is known only after the
    # pass, and a second pass would cost another float run per image. Measured on EfficientNet-Lite0 (62
    # layers, 7.1 M values per image): 98 counts per layer, 48 KiB in all whatever the number of images; the
    # values are binned in the same pass that compares them (`reports.pair_sums`)
    ev.histograms = {s.name: ValueHistogram.for_grid(ev.qparams[s.name], ranks[s.name]) for s in specs}
    folded = folded_ranges(graph) if table.options.fold_clip else {}
    image = ImageRun(prepared, ev, specs, steps, bounds, outputs + indices,
                     {name: span for name, span in folded.items() if name in bounds}, detection)
    with background(threads, "ptq-report") as pool, background(threads, "ptq-float") as float_pool, \
            tqdm(total=images.expected, unit="img", desc=desc, disable=None if progress else True, leave=False) as bar:
        worker = MetricWorker(pool)
        samples = iter(images.samples(graph))
        upcoming = _start_float_run(float_pool, runner, samples)
        while upcoming is not None:
            sample, label, floats = upcoming
            # decode the next image and start its float run now: it overlaps this image's integer run
            upcoming = _start_float_run(float_pool, runner, samples)
            with_isolated = isolated and (isolated_images is None or ev.images < isolated_images)
            image.run(worker, sample, label, floats.result(), with_isolated=with_isolated)
            worker.settle()
            ev.images += 1
            bar.update(1)
        worker.settle(keep=0)
    if ev.images == 0:
        raise ValueError("no image could be decoded")
    return ev


def _classification(graph: Graph, outputs: list[str]) -> Optional[TopKAgreement]:
    """Top-k agreement of the first output when it is class scores: top-1, and top-5 (reported from 10 classes,
    `TopKAgreement.meaningful_topk`)."""
    if not outputs or class_count(graph, outputs[0]) is None:
        return None
    return TopKAgreement()


def _detection_tensors(prepared: IntegerGraph, detection: Optional[DetectionTask]) -> list[str]:
    """The run-time tensors the detections are decoded from; each must be a quantized tensor of the integer
    graph (a constant is read as it is)."""
    if detection is None:
        return []
    constants = prepared.graph.initializers
    missing = [t for t in detection.tensors if t not in constants and t not in prepared.qparams]
    if missing:
        raise ValueError(f"detections: {', '.join(missing)} is not a quantized tensor of the integer graph")
    return [t for t in detection.tensors if t not in constants]


def _start_float_run(pool: ThreadPoolExecutor, runner: FloatRunner, samples: Iterator):
    """(inputs, label, future float tensors) of the next readable sample, or None when there is none left.
    The float runs have a thread of their own: queued behind an isolated run, the next image's would stall
    the integer graph."""
    item = next(samples, None)
    if item is None:
        return None
    _path, sample, label = item
    return sample, label, pool.submit(runner.run_dict, sample)
