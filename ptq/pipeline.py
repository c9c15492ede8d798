"""The calibration pipeline and its Python API (the CLI's `ptq calibrate` calls `calibrate`).

    images -> float run (streaming statistics) -> calibrator -> ranges -> QParams -> table (+ QDQ model)

Activations are calibrated per tensor from the images; weights per channel (or per tensor) from their
values. With `fold_clip`, a tensor whose every consumer is a Relu or a Clip with constant bounds gets its
range intersected with those bounds: values outside them are clipped away downstream anyway, so the
quantization grid is spent on the values that survive (what a fused Conv+ReLU6 does on hardware).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import onnx

from calibrators import TensorStatistics, calibrate_array, get_calibrator, required_stats
from ptq import adjust
from ptq.atomic import atomic_write_bytes
from ptq.float_run import collect_statistics, image_input
from ptq.core.graph import Graph, Node, load_model
from ptq.images import ImageLog, InputSpec, Preprocess, iter_batches, iter_images, select_files
from ptq.parallel import QuietLog, choose_workers
from ptq.qdq_export import export_qdq
from ptq.core.qparams import compute_qparams
from ptq.quant_table import CalibrationOptions, QuantTable, TensorEntry, save_quant_table
from ops.registry import op_of, weight_role
from ptq.weight_scale_floor import floor_weight_scales

DEFAULT_CALIBRATOR = "extrema"
DEFAULT_WEIGHT_CALIBRATOR = "extrema"

ModelSource = Union[str, Path, onnx.ModelProto]
ImageSource = Union[str, Path, Sequence[Union[str, Path]], np.ndarray]


@dataclass
class CalibrationResult:
    table: QuantTable
    graph: Graph
    images_used: int
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    seconds: float = 0.0
    table_path: Optional[Path] = None
    qdq_path: Optional[Path] = None

    @property
    def images_skipped(self) -> int:
        return len(self.skipped)

    @property
    def tensors_calibrated(self) -> int:
        return sum(1 for e in self.table.tensors.values() if e.kind == "activation")

    @property
    def weights_quantized(self) -> int:
        return sum(1 for e in self.table.tensors.values() if e.kind == "weight")

    def summary(self) -> str:
        lines = [
            f"images used: {self.images_used}, skipped: {self.images_skipped}",
            f"tensors calibrated: {self.tensors_calibrated} activations "
            f"({self.table.options.calibrator}, {self.table.options.bits}-bit), "
            f"{self.weights_quantized} weights ({self.table.options.weight_calibrator}, "
            f"{self.table.options.weight_bits}-bit, {'per-channel' if self.table.options.per_channel else 'per-tensor'})",
            f"time: {self.seconds:.1f} s",
        ]
        if self.table_path is not None:
            lines.append(f"quantization table: {self.table_path}")
        if self.qdq_path is not None:
            lines.append(f"QDQ model: {self.qdq_path}")
        return "\n".join(lines)


def _normalize_input_shapes(input_shapes: Optional[dict]) -> Optional[dict]:
    return {k: [int(d) for d in v] for k, v in input_shapes.items()} if input_shapes else None


def input_spec(graph: Graph, pre: Preprocess) -> InputSpec:
    return InputSpec.from_shape(graph.tensors[image_input(graph)].shape, pre.layout)


def collect_image_statistics(
    graph: Graph,
    images: ImageSource,
    needs: frozenset,
    *,
    preprocess: Preprocess,
    num_images: Optional[int] = None,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> tuple[dict[str, TensorStatistics], ImageLog]:
    """Statistics of every activation of `graph` over the images (a folder, a list of files, or an array of
    already preprocessed samples with the batch on axis 0)."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    log = ImageLog()
    if isinstance(images, np.ndarray):
        samples = list(images[:num_images] if num_images else images)
        if not samples:
            raise ValueError("no images given (empty array)")
        log.used = [Path(f"<array sample {k}>") for k in range(len(samples))]
        batches: Iterable[np.ndarray] = iter_batches(iter(samples), batch_size)
        total = len(samples)
    else:
        spec = input_spec(graph, preprocess)
        candidates = select_files(images, log, num_images=num_images, seed=seed)
        total = len(candidates) if num_images is None else min(num_images, len(candidates))
        batches = iter_batches(iter_images(candidates, preprocess, spec, log, num_images=num_images), batch_size)
    bar = tqdm(total=total, unit="img", desc="calibrating", disable=None if progress else True, leave=False)
    with bar, logging_redirect_tqdm():  # skip warnings are printed above the bar, not through it
        stats = collect_statistics(graph, batches, graph.activations, needs, on_batch=bar.update)
    if not log.used:
        raise ValueError(f"no valid image in {images} ({len(log.skipped)} files skipped)")
    return stats, log


def folded_ranges(graph: Graph) -> dict[str, tuple[float, float]]:
    """Tensors whose every consumer clamps them to a constant interval (an op with a `clip_range`: Relu,
    Clip with constant bounds) -> the union of those intervals."""
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    bounds = {}
    for name in graph.activations:
        users = consumers.get(name, [])
        if not users or name in outputs:
            continue
        spans = [_clip_span(graph, node) if node.inputs[0] == name else None for node in users]
        if all(s is not None for s in spans):
            bounds[name] = (min(s[0] for s in spans), max(s[1] for s in spans))
    return bounds


def _clip_span(graph: Graph, node: Node) -> Optional[tuple[float, float]]:
    op = op_of(node)
    return op.clip_range(node, graph.constant_lookup(node)) if op is not None else None


def activation_entries(
    graph: Graph, stats: dict[str, TensorStatistics], options: CalibrationOptions
) -> dict[str, TensorEntry]:
    """Table entries of the activations from their statistics."""
    calibrator = get_calibrator(options.calibrator).for_grid(options.symmetric)
    bounds = folded_ranges(graph) if options.fold_clip else {}
    entries = {}
    for name in graph.activations:
        try:
            rmin, rmax = calibrator.compute(stats[name], bits=options.bits)
        except ValueError as exc:
            raise ValueError(f"calibrating tensor {name!r}: {exc}") from exc
        if name in bounds:
            lo, hi = bounds[name]
            rmin, rmax = np.clip(rmin, lo, hi), np.clip(rmax, lo, hi)
        qp = compute_qparams(rmin, rmax, options.bits, symmetric=options.symmetric, narrow=options.narrow,
                             pow2=options.pow2)
        entries[name] = TensorEntry("activation", calibrator.spelling, rmin, rmax, qp)
    return entries


def weight_entries(graph: Graph, options: CalibrationOptions) -> dict[str, TensorEntry]:
    """Table entries of the weights (initializers in a weight role, see ptq.core.roles)."""
    calibrator = get_calibrator(options.weight_calibrator).for_grid(options.weight_symmetric)
    entries = {}
    for node in graph.nodes:
        role = weight_role(node)
        if role is None or len(node.inputs) <= role.input_index:
            continue
        name = node.inputs[role.input_index]
        if name in entries or name not in graph.initializers:
            continue
        w = graph.initializers[name]
        if not np.issubdtype(w.dtype, np.floating):
            continue
        axis = None
        if options.per_channel and role.channel_axis is not None and w.ndim >= 2:
            axis = role.channel_axis % w.ndim
        rmin, rmax = calibrate_array(calibrator, w, axis=axis, bits=options.weight_bits)
        qp = compute_qparams(rmin, rmax, options.weight_bits, symmetric=options.weight_symmetric,
                             narrow=options.weight_narrow, pow2=options.pow2, axis=axis)
        entries[name] = TensorEntry("weight", calibrator.spelling, rmin, rmax, qp)
    return entries


def build_table(graph: Graph, stats: dict[str, TensorStatistics], options: CalibrationOptions) -> QuantTable:
    tensors = activation_entries(graph, stats, options)
    tensors.update(weight_entries(graph, options))
    floor_weight_scales(graph, tensors, options)
    return QuantTable(options=options, tensors=tensors)


def align_with_integer_graph(graph: Graph, table: QuantTable) -> list[str]:
    """Give activations the qparams the integer graph fixes by rule, in place; returns the tensors changed.

    Some op rules override the calibrated proposal for their output (layout ops, MaxPool and nearest Resize
    move codes and keep their input's qparams). Writing those final qparams into the table makes the QDQ model
    describe the grid the integer executor computes on. A graph the executor cannot prepare keeps the
    calibrated qparams, with a warning.
    """
    from ptq.executor import prepare

    try:
        final = prepare(graph, table).qparams
    except ValueError as exc:  # QuantizationError, ExecutorError
        logging.getLogger("ptq.pipeline").warning(
            "the integer graph could not be prepared (%s); the table keeps the calibrated qparams", exc)
        return []
    changed = []
    for name, entry in table.tensors.items():
        qp = final.get(name)
        if entry.kind == "activation" and qp is not None and qp != entry.qparams:
            lo, hi = qp.real_range()
            table.tensors[name] = TensorEntry("activation", entry.calibrator, lo, hi, qp)
            changed.append(name)
    return changed


def output_paths(model: ModelSource, out_dir: Union[str, Path]) -> tuple[Path, Path]:
    stem = Path(model).stem if isinstance(model, (str, Path)) else (model.graph.name or "model")
    out_dir = Path(out_dir)
    return out_dir / f"{stem}.quant.json", out_dir / f"{stem}.qdq.onnx"


def _check_not_input(model: ModelSource, paths: Iterable[Path]) -> None:
    if not isinstance(model, (str, Path)):
        return
    for path in paths:
        if path.exists() and os.path.samefile(path, model):
            raise ValueError(f"refusing to overwrite the input model {model} with {path}")


def calibrate(
    model: ModelSource,
    images: ImageSource,
    out_dir: Optional[Union[str, Path]] = None,
    *,
    calibrator: str = DEFAULT_CALIBRATOR,
    weight_calibrator: str = DEFAULT_WEIGHT_CALIBRATOR,
    bits: int = 8,
    weight_bits: int = 8,
    symmetric: bool = False,
    weight_symmetric: bool = True,
    narrow: bool = False,
    weight_narrow: bool = True,
    per_channel: bool = True,
    pow2: bool = False,
    fold_clip: bool = True,
    preprocess: Optional[Preprocess] = None,
    num_images: Optional[int] = None,
    batch_size: int = 8,
    seed: int = 0,
    input_shapes: Optional[dict] = None,
    progress: bool = False,
    write_qdq: bool = True,
    align: bool = True,
    workers: Optional[int] = 1,
    ray: Optional[str] = None,
    equalize: bool = False,
    bias_correction: bool = False,
    adaround: bool = False,
) -> CalibrationResult:
    """Calibrate `model` on `images` and, with `out_dir`, write `<stem>.quant.json` and `<stem>.qdq.onnx`.

    `images`: a folder (searched recursively), a list of image files, or an ndarray of preprocessed samples
    (batch on axis 0). Activations use `calibrator` at `bits` (asymmetric unless `symmetric`), weights
    `weight_calibrator` at `weight_bits` (symmetric unless `weight_symmetric=False`), per channel unless
    `per_channel=False`. `narrow` selects the restricted signed range [-(2^(b-1)-1), 2^(b-1)-1]; `pow2`
    rounds scales up to powers of two. `align` writes the qparams the integer graph fixes by rule into the
    table (see `align_with_integer_graph`). `equalize`, `bias_correction`, `adaround` adjust the weights
    (`ptq.adjust`); the adjusted model is written beside the table and recorded in its options
    (`ptq.adjusted_model`). The input model is never modified; files are written atomically.
    `workers` > 1 processes (or a Ray cluster: `ray` 'auto', an address or 'local') collect the statistics
    of image files in shards, with the same result as one process (`ptq.calibration_shards`); None picks
    the number by `ptq.parallel.choose_workers` (the usable cores, one per 50 images).
    """
    start = time.perf_counter()
    preprocess = preprocess or Preprocess()
    options = CalibrationOptions(
        calibrator=get_calibrator(calibrator).spelling,
        weight_calibrator=get_calibrator(weight_calibrator).spelling,
        bits=bits, weight_bits=weight_bits, symmetric=symmetric, weight_symmetric=weight_symmetric,
        narrow=narrow, weight_narrow=weight_narrow, per_channel=per_channel, pow2=pow2, fold_clip=fold_clip,
        num_images=num_images, batch_size=batch_size, seed=seed,
        preprocess=preprocess.to_dict(), input_shapes=_normalize_input_shapes(input_shapes),
        equalize=equalize, bias_correction=bias_correction, adaround=adaround,
    )
    paths = output_paths(model, out_dir) if out_dir is not None else None
    if paths is not None:
        _check_not_input(model, paths)
    graph = load_model(model, input_shapes)
    if equalize:
        graph = adjust.equalized(graph, input_shapes)
    needs = required_stats([options.calibrator])
    if not isinstance(images, np.ndarray) and workers is None:
        candidates = len(select_files(images, QuietLog(), num_images=num_images, seed=seed))
        workers = choose_workers(None, candidates if num_images is None else min(num_images, candidates))
    if ((workers or 1) > 1 or ray is not None) and not isinstance(images, np.ndarray):
        from ptq.calibration_shards import sharded_statistics

        # the workers load the model they are sent: the equalized one when equalization changed it
        source = graph.model if equalize else model
        stats, log = sharded_statistics(source, graph, images, needs, preprocess=preprocess, num_images=num_images,
                                        batch_size=batch_size, seed=seed, input_shapes=input_shapes,
                                        workers=workers, ray=ray, progress=progress)
    else:
        stats, log = collect_image_statistics(graph, images, needs, preprocess=preprocess, num_images=num_images,
                                              batch_size=batch_size, seed=seed, progress=progress)
    table = build_table(graph, stats, options)
    if bias_correction or adaround:
        graph = adjust.after_table(
            graph, table, lambda: adjust.sample_batches(graph, images, preprocess, num_images, batch_size, seed),
            bias_correction=bias_correction, adaround=adaround, input_shapes=input_shapes)
    if align:
        align_with_integer_graph(graph, table)
    qdq = export_qdq(graph, table) if write_qdq else None
    result = CalibrationResult(table=table, graph=graph, images_used=len(log.used), skipped=list(log.skipped))
    if paths is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        if equalize or bias_correction or adaround:
            relative, digest = adjust.write_adjusted(graph, paths[0])
            table.options = dataclasses.replace(table.options, adjusted_model=relative, adjusted_sha256=digest)
        result.table_path = save_quant_table(table, paths[0])
        if qdq is not None:
            result.qdq_path = atomic_write_bytes(paths[1], qdq.SerializeToString())
    result.seconds = time.perf_counter() - start
    return result

