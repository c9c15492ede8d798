"""Stream images through the float model and the integer graph, and accumulate per-layer similarities.

Per image (one sample, batch 1):
- float reference: onnxruntime on the *original* model with every reported tensor as an extra output;
- cumulative: the integer graph end to end (`IntegerGraph.run`), each tensor dequantized,
  x_f = (x_q - zp) * scale, and compared with the float tensor of the same name;
- isolated: each step alone (`IntegerGraph.run_step`), fed with its float inputs quantized with the qparams
  the integer graph uses for them, x_q = clamp(round(x_f / scale) + zp); its outputs dequantized and compared.

Layers are the tensors that exist in both runs, by our own tensor names: graph inputs and the outputs of every
non-shape step of the rewritten graph (a Conv fused with its Clip produces the Clip's output tensor; the raw
Conv output has no integer counterpart and is not reported). Each image's tensors are folded into
`SimilarityAccumulator`s and dropped, so memory does not grow with the number of images.

Threads: the integer graph runs in the calling thread; one thread runs the float model on the next image, and a
worker thread folds every tensor into the metrics as soon as the integer graph produced it and runs the isolated
steps (onnxruntime and numpy release the GIL, so both overlap the integer run when a core is free). At most
`_Worker.LAG` + 2 images are in flight, each holding its float tensors (at most 53 MB for EfficientNet-Lite0).
The `ptq` command runs OpenBLAS on one thread (`ptq.cli.one_blas_thread`), which leaves the other core free.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from ptq.pipeline import input_spec
from ptq.executor import IntegerGraph, NodeKind, Step, prepare
from ptq.float_run import image_input, stats_model
from ptq.core.graph import Graph
from ptq.images import ImageLog, Preprocess, iter_images, select_files
from ptq.core.qparams import QParams
from ptq.quant_table import QuantTable
from reports.labels import LabelResolver
from reports.layers import LayerReport, OutputReport, Report, cosine_drops, rank_bottlenecks
from reports.metrics import ClipAccumulator, Reference, SimilarityAccumulator, TopKAgreement

INPUT_OP = "Input"


@dataclass(frozen=True)
class LayerSpec:
    """A reported tensor: produced by step `step` of the integer graph (None for a graph input)."""

    name: str
    node: str
    op_type: str
    step: Optional[int]
    inputs: tuple[str, ...]  # the quantized activation tensors the producing step reads
    float_fallback: bool


def layer_specs(prepared: IntegerGraph, float_tensors: Iterable[str]) -> list[LayerSpec]:
    """Every quantized tensor of the integer graph that the float model also has, in topological order."""
    available = set(float_tensors)
    specs = [
        LayerSpec(name, name, INPUT_OP, None, (), False)
        for name in prepared.graph.inputs
        if name in prepared.qparams and name in available
    ]
    constants = prepared.graph.initializers
    for index, step in enumerate(prepared.steps):
        if step.kind is NodeKind.SHAPE:
            continue
        node = step.node
        inputs = tuple(i for i in node.inputs if i and i not in constants and i in prepared.qparams)
        for name, qp in zip(node.outputs, step.out_qparams):
            if name and qp is not None and name in available:
                specs.append(LayerSpec(name, node.name, node.op_type, index, inputs, step.kind is NodeKind.FLOAT))
    return specs


class FloatReference:
    """onnxruntime on the original model with the listed tensors as extra outputs, for one sample at a time.

    One intra-op thread: onnxruntime's default pool keeps spinning after each run and takes the cores the
    integer graph runs on next (measured on 20 images of EfficientNet-Lite0, float and integer runs
    interleaved: 4.7 s with the default pool, 3.0 s with one thread; the float run alone takes 0.3-0.4 s).
    """

    def __init__(self, graph: Graph, tensors: Sequence[str]):
        import onnxruntime as ort  # imported lazily: it is slow to import

        self.input_name = image_input(graph)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(stats_model(graph, tensors).SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])
        self.wanted = [t for t in dict.fromkeys(tensors) if t != self.input_name]
        self.with_input = self.input_name in tensors

    def run(self, sample: np.ndarray) -> dict[str, np.ndarray]:
        """Float tensors by name for one sample (with its batch axis)."""
        out = dict(zip(self.wanted, self.session.run(self.wanted, {self.input_name: sample})))
        if self.with_input:
            out[self.input_name] = sample
        return out


@dataclass
class ImageSet:
    """The evaluation images: files, how they are preprocessed, and their labels."""

    files: list[Path]
    preprocess: Preprocess
    labels: LabelResolver = field(default_factory=LabelResolver)
    limit: Optional[int] = None

    @classmethod
    def from_folder(
        cls,
        images: Union[str, Path],
        preprocess: Preprocess,
        labels_file: Optional[Union[str, Path]] = None,
        limit: Optional[int] = None,
    ) -> "ImageSet":
        path = Path(images)
        files = [path] if path.is_file() else select_files(path, ImageLog())
        if not files:
            raise ValueError(f"no image files in {images}")
        if limit is not None and limit <= 0:
            raise ValueError(f"--num-images must be positive, got {limit}")
        return cls(files, preprocess, LabelResolver.from_option(labels_file), limit)

    @property
    def expected(self) -> int:
        return len(self.files) if self.limit is None else min(self.limit, len(self.files))

    def samples(self, graph: Graph) -> Iterator[tuple[Path, np.ndarray, Optional[int]]]:
        """(path, sample with a batch axis of 1, label) per decodable image; unreadable files are skipped."""
        log = ImageLog()
        spec = input_spec(graph, self.preprocess)
        dtype = graph.tensors[image_input(graph)].dtype
        for sample in iter_images(self.files, self.preprocess, spec, log, num_images=self.limit):
            path = log.used[-1]
            yield path, sample[None].astype(dtype, copy=False), self.labels(path)


@dataclass
class ArraySamples:
    """Already preprocessed samples (batch on axis 0) with optional labels: the in-memory `ImageSet`."""

    arrays: np.ndarray
    labels: Optional[Sequence[Optional[int]]] = None

    def __post_init__(self):
        if len(self.arrays) == 0:
            raise ValueError("no samples given")
        if self.labels is not None and len(self.labels) != len(self.arrays):
            raise ValueError(f"{len(self.labels)} labels for {len(self.arrays)} samples")

    @property
    def expected(self) -> int:
        return len(self.arrays)

    def samples(self, graph: Graph) -> Iterator[tuple[Path, np.ndarray, Optional[int]]]:
        dtype = graph.tensors[image_input(graph)].dtype
        for k, sample in enumerate(self.arrays):
            label = None if self.labels is None else self.labels[k]
            yield Path(f"<sample {k}>"), np.asarray(sample)[None].astype(dtype, copy=False), label


@dataclass
class Evaluation:
    """Accumulated similarities of one integer graph against the float model over a set of images."""

    layers: list[LayerSpec]
    qparams: dict[str, QParams]
    cumulative: dict[str, SimilarityAccumulator]
    isolated: dict[str, SimilarityAccumulator]
    outputs: dict[str, SimilarityAccumulator]
    classification: Optional[TopKAgreement]
    float_nodes: list[str]
    clipped: dict[str, ClipAccumulator] = field(default_factory=dict)  # float values beyond each grid
    overflows: dict[str, int] = field(default_factory=dict)
    images: int = 0


def dequantize32(qp: QParams, codes: np.ndarray) -> np.ndarray:
    """x = (x_q - zp) * scale as float32, equal to `QParams.dequantize` (codes - zp is exact in float32 and the
    scale is a float32 value, so the one rounding of the product is the same) with less memory traffic."""
    codes = np.asarray(codes)
    out = codes.astype(np.float32)  # a plain conversion loop: faster than a mixed-type subtract
    if np.any(qp.zero_point):
        out -= qp.broadcast(qp.zero_point.astype(np.float32), codes.ndim)
    out *= qp.broadcast(qp.scale.astype(np.float32), codes.ndim)
    return out


def grid_bounds(qp: QParams, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """The float interval a grid represents without saturating: [real_min - scale/2, real_max + scale/2],
    shaped to broadcast against a tensor of rank `ndim` (per channel along qp.axis)."""
    lo, hi = qp.real_range()
    return (qp.broadcast(np.asarray(lo - qp.scale / 2), ndim), qp.broadcast(np.asarray(hi + qp.scale / 2), ndim))


def _is_scores(graph: Graph, name: str) -> bool:
    """A classification output: a float tensor with one non-batch axis of more than one class."""
    info = graph.tensors.get(name)
    if info is None or not info.is_float or info.shape is None:
        return False
    dims = [d for d in info.shape[1:] if d != 1]
    return len(dims) == 1 and (dims[0] or 0) > 1


def _isolated_args(prepared: IntegerGraph, step: Step, floats: dict, ints: dict, quantized: dict) -> list:
    """The step's inputs with every quantized activation replaced by its quantized float value."""
    constants = prepared.graph.initializers
    args = []
    for name in step.node.inputs:
        if not name:
            args.append(None)
        elif name in constants:
            args.append(constants[name])
        elif name in prepared.qparams and name in floats:
            if name not in quantized:
                quantized[name] = prepared.qparams[name].quantize(floats[name])
            args.append(quantized[name])
        else:  # a run-time shape/index tensor: the same in both runs
            args.append(ints[name])
    return args


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
) -> Evaluation:
    """Run the float model and the integer graph on every image and accumulate the similarities.

    `layers=False` measures the graph outputs only (cheaper: debug passes); `isolated=False` skips the
    isolated runs; `isolated_images=N` runs them on the first N images only (they cost a second integer
    pass). `float_nodes` are node names, tensor names or op types run in float inside the integer graph.
    `backend` (a `DotBackend` or a `ptq.backends` name) computes the integer graph's dot products.
    """
    from tqdm import tqdm

    if isolated and not layers:
        raise ValueError("isolated metrics need layers=True")
    if isolated_images is not None and isolated_images <= 0:
        raise ValueError(f"isolated_images must be positive, got {isolated_images}")
    if prepared is not None and (float_nodes or backend is not None):
        raise ValueError("give float_nodes and backend to prepare(), not with an already prepared graph")
    prepared = prepared or prepare(graph, table, float_nodes=float_nodes, backend=backend)
    input_name = image_input(graph)
    outputs = [o for o in prepared.graph.outputs if o in prepared.qparams]
    if not outputs:
        raise ValueError(f"no graph output of the model is quantized ({prepared.graph.outputs})")
    specs = layer_specs(prepared, graph.activations) if layers else []
    wanted = list(dict.fromkeys([s.name for s in specs] + outputs))
    runner = FloatReference(graph, wanted)
    steps = sorted({s.step for s in specs if s.step is not None})
    ev = Evaluation(
        layers=specs,
        qparams=dict(prepared.qparams),
        cumulative={s.name: SimilarityAccumulator() for s in specs},
        isolated={s.name: SimilarityAccumulator() for s in specs} if isolated else {},
        outputs={o: SimilarityAccumulator() for o in outputs},
        classification=TopKAgreement() if _is_scores(graph, outputs[0]) else None,
        float_nodes=[f.name for f in prepared.float_nodes],
        clipped={s.name: ClipAccumulator() for s in specs},
    )
    bounds = {s.name: grid_bounds(ev.qparams[s.name], len(graph.tensors[s.name].shape or ())) for s in specs}
    image = _ImageRun(prepared, ev, specs, steps, bounds, input_name, outputs)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ptq-report") as pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ptq-float") as float_pool, \
            tqdm(total=images.expected, unit="img", desc=desc, disable=None if progress else True, leave=False) as bar:
        worker = _Worker(pool)
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


class _Worker:
    """One background thread for the metric updates and the isolated runs, which overlap the
    integer graph running in the calling thread (onnxruntime and numpy release the GIL). Tasks run in submission
    order, so a metric update finds the `Reference` an earlier task of its image prepared. `settle()` closes an
    image; once more than LAG images are open it waits for the oldest one's tasks and re-raises their errors
    (each open image holds its float tensors)."""

    LAG = 3

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self.current: list[Future] = []
        self.open: deque[list[Future]] = deque()

    def submit(self, fn: Callable, *args) -> Future:
        future = self.pool.submit(fn, *args)
        self.current.append(future)
        return future

    def settle(self, keep: Optional[int] = None) -> None:
        """Close the current image; wait for the oldest open images until at most `keep` (default LAG) are open."""
        self.open.append(self.current)
        self.current = []
        while len(self.open) > (self.LAG if keep is None else keep):
            for future in self.open.popleft():
                future.result()


def _start_float_run(pool: ThreadPoolExecutor, runner: FloatReference, samples: Iterator):
    """(sample, label, future float tensors) of the next decodable image, or None when there is none left.
    The float runs have a thread of their own: queued behind an isolated run, the next image's would stall
    the integer graph."""
    item = next(samples, None)
    if item is None:
        return None
    _path, sample, label = item
    return sample, label, pool.submit(runner.run, sample)


@dataclass
class _ImageRun:
    """One image through the integer graph (calling thread), its metric updates handed to the worker.

    The integer codes handed over are not written to afterwards: integer kernels return new arrays."""

    prepared: IntegerGraph
    ev: Evaluation
    specs: list[LayerSpec]
    steps: list[int]
    bounds: dict[str, tuple[np.ndarray, np.ndarray]]
    input_name: str
    outputs: list[str]

    def run(self, worker: _Worker, sample: np.ndarray, label: Optional[int], floats: dict,
            with_isolated: bool) -> None:
        ev = self.ev
        refs: dict[str, Reference] = {}  # filled by the worker, read by later tasks of this image
        runtime_values: dict[str, np.ndarray] = {}  # run-time shape/index tensors (isolated runs read them)

        def fold(name: str, codes: np.ndarray) -> None:
            # each integer tensor is compared as soon as it exists; the executor may drop it meanwhile
            if name in self.bounds:
                worker.submit(self._fold_cumulative, name, floats[name], codes, refs)
            elif name not in ev.qparams:
                runtime_values[name] = codes

        result = self.prepared.run({self.input_name: sample}, keep_all=False, on_tensor=fold if self.specs else None)
        for name, count in result.overflows.items():
            ev.overflows[name] = ev.overflows.get(name, 0) + count
        if with_isolated:  # in the worker too (measured on 20 images, isolated on all: +85% there, +134% here)
            worker.submit(self._isolated, floats, runtime_values, refs)
        worker.submit(self._fold_outputs, floats, {name: result.tensors[name] for name in self.outputs}, label, refs)

    def _fold_cumulative(self, name: str, x: np.ndarray, codes: np.ndarray, refs: dict) -> None:
        ref = refs[name] = Reference.of(x)
        self.ev.cumulative[name].update(ref, dequantize32(self.ev.qparams[name], codes), overwrite_test=True)
        self.ev.clipped[name].update(x, *self.bounds[name])

    def _isolated(self, floats: dict, runtime_values: dict, refs: dict) -> None:
        """Each step alone on its quantized float inputs, its outputs compared with the float tensors."""
        quantized: dict[str, np.ndarray] = {}  # float tensors quantized once per image, shared by their consumers
        produced: dict[str, np.ndarray] = {}
        for index in self.steps:
            step = self.prepared.steps[index]
            args = _isolated_args(self.prepared, step, floats, runtime_values, quantized)
            results = self.prepared.run_step(step, args)
            produced.update((name, value) for name, value in zip(step.node.outputs, results) if name)
        for spec in self.specs:
            qp = self.ev.qparams[spec.name]
            if spec.step is None:  # a graph input: its quantization alone
                codes = quantized.get(spec.name)
                codes = qp.quantize(floats[spec.name]) if codes is None else codes
            else:
                codes = produced[spec.name]
            self.ev.isolated[spec.name].update(refs[spec.name], dequantize32(qp, codes), overwrite_test=True)

    def _fold_outputs(self, floats: dict, codes: dict, label: Optional[int], refs: dict) -> None:
        ev = self.ev
        dequantized = {name: dequantize32(ev.qparams[name], codes[name]) for name in self.outputs}
        for name in self.outputs:
            ev.outputs[name].update(refs.get(name, floats[name]), dequantized[name])
        if ev.classification is not None:
            ev.classification.update(floats[self.outputs[0]], dequantized[self.outputs[0]], label)


def build_report(ev: Evaluation, model: str, quant: str, top: Optional[int] = None) -> Report:
    """The `Report` of an evaluation with isolated metrics: layers, outputs, ranked bottlenecks."""
    if not ev.isolated:
        raise ValueError("a report needs isolated metrics (evaluate with isolated=True)")
    cum = {s.name: ev.cumulative[s.name].result() for s in ev.layers}
    iso = {s.name: ev.isolated[s.name].result() for s in ev.layers}
    drops = cosine_drops([s.name for s in ev.layers], {s.name: list(s.inputs) for s in ev.layers},
                         {name: sim.cosine for name, sim in cum.items()})
    layer_reports = [
        LayerReport(
            name=s.name, node=s.node, op_type=s.op_type, qparams=ev.qparams[s.name], inputs=list(s.inputs),
            cumulative=cum[s.name], isolated=iso[s.name], cosine_drop=drops[s.name], float_fallback=s.float_fallback,
            clipped=ev.clipped[s.name].fraction,
        )
        for s in ev.layers
    ]
    notes = []
    isolated_images = next(iter(iso.values())).samples if iso else 0
    if isolated_images < ev.images:
        notes.append(f"isolated metrics over the first {isolated_images} of {ev.images} images")
    if ev.overflows:
        notes.append("int32 accumulator saturated in: "
                     + ", ".join(f"{n} ({c} values)" for n, c in sorted(ev.overflows.items())))
    return Report(
        model=model,
        quant=quant,
        images=ev.images,
        layers=layer_reports,
        outputs=[OutputReport(name, acc.result()) for name, acc in ev.outputs.items()],
        classification=ev.classification.to_dict() if ev.classification is not None else None,
        bottlenecks=rank_bottlenecks(layer_reports, top=top),
        float_nodes=list(ev.float_nodes),
        notes=notes,
        isolated_images=isolated_images,
    )
