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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import onnx

from calibrators import TensorStatistics, calibrate_array, get_calibrator, required_stats
from ptq import adjust, int4_dsp
from ptq.range_search import DEFAULT_CANDIDATES as RANGE_SEARCH_CANDIDATES
from ptq.atomic import refuse_to_overwrite
from ptq.float_run import collect_statistics, image_input
from ptq.clip_ranges import folded_ranges
from ptq.core.graph import Graph, load_model
from ptq.images import ImageLog, InputSpec, Preprocess, iter_batches
from ptq.parallel import QuietLog, choose_workers
from ptq.samples import ArrayFormat, ImageFormat, SampleSource, iter_sample_batches, iter_samples
from ptq.qdq_check import CHECK_SAMPLES, QDQCheck
from ptq.qdq_export import DEFAULT_TARGET, get_target
from ptq.qdq_output import export_checked, summary_lines, write_model
from ptq.core.qparams import compute_qparams
from ptq.option_defaults import DEFAULT_CALIBRATOR, DEFAULT_SCHEME, DEFAULT_WEIGHT_CALIBRATOR, SCHEMES
from ptq.quant_table import CalibrationOptions, QuantTable, TensorEntry, save_quant_table
from ptq.weight_scale_floor import floor_weight_scales
from ptq.weight_tensors import weight_tensors

_FREE_DEFAULTS = dict(bits=8, weight_bits=8, symmetric=False, weight_symmetric=True, narrow=False,
                      weight_narrow=True, pow2=False)

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
    qdq_target: str = DEFAULT_TARGET
    qdq_check: Optional[QDQCheck] = None

    @property
    def images_skipped(self) -> int:
        return len(self.skipped)

    @property
    def tensors_calibrated(self) -> int:
        return sum(1 for e in self.table.tensors.values() if e.kind == "activation")

    @property
    def weights_quantized(self) -> int:
        return sum(1 for e in self.table.tensors.values() if e.kind == "weight")

    def _activation_bits(self) -> str:
        """'8-bit', or per width under a scheme that mixes them ('18 at 8 bits, 91 at 4 bits')."""
        widths = sorted({e.qparams.bits for e in self.table.tensors.values() if e.kind == "activation"}, reverse=True)
        if len(widths) <= 1:
            return f"{self.table.options.bits}-bit"
        counts = {b: sum(1 for e in self.table.tensors.values() if e.kind == "activation" and e.qparams.bits == b)
                  for b in widths}
        return ", ".join(f"{counts[b]} at {b} bits" for b in widths)

    def _activation_calibrators(self) -> str:
        """The calibrator, or for one that chooses per tensor how many tensors took each choice
        ('auto: mse 40, kld 12, extrema 3')."""
        chosen: dict[str, int] = {}
        for e in self.table.tensors.values():
            if e.kind == "activation" and e.calibrator.startswith(f"{self.table.options.calibrator}:"):
                choice = e.calibrator.split(":", 1)[1].split(" ", 1)[0]
                chosen[choice] = chosen.get(choice, 0) + 1
        if not chosen:
            return self.table.options.calibrator
        counts = ", ".join(f"{k} {v}" for k, v in sorted(chosen.items(), key=lambda kv: (-kv[1], kv[0])))
        return f"{self.table.options.calibrator}: {counts}"

    def summary(self) -> str:
        scheme = self.table.options.scheme
        lines = [
            f"images used: {self.images_used}, skipped: {self.images_skipped}",
            *([f"scheme: {scheme}"] if scheme != DEFAULT_SCHEME else []),
            f"tensors calibrated: {self.tensors_calibrated} activations "
            f"({self._activation_calibrators()}, {self._activation_bits()}), "
            f"{self.weights_quantized} weights ({self.table.options.weight_calibrator}, "
            f"{self.table.options.weight_bits}-bit, {'per-channel' if self.table.options.per_channel else 'per-tensor'})",
            f"time: {self.seconds:.1f} s",
        ]
        if self.table_path is not None:
            lines.append(f"quantization table: {self.table_path}")
        lines += summary_lines(self.qdq_path, self.qdq_target, self.qdq_check)
        return "\n".join(lines)


def _normalize_input_shapes(input_shapes: Optional[dict]) -> Optional[dict]:
    return {k: [int(d) for d in v] for k, v in input_shapes.items()} if input_shapes else None


def input_spec(graph: Graph, pre: Preprocess) -> InputSpec:
    return InputSpec.from_shape(graph.tensors[image_input(graph)].shape, pre.layout)


def sample_source(images: ImageSource, preprocess: Optional[Preprocess]) -> "SampleSource":
    """Image files (a folder, one file or a list of files) as a `SampleSource`."""
    location = Path(images) if isinstance(images, (str, Path)) else tuple(Path(p) for p in images)
    return SampleSource(location, ImageFormat(preprocess or Preprocess()))


def collect_image_statistics(
    graph: Graph,
    images: Union[ImageSource, SampleSource],
    needs: frozenset,
    *,
    preprocess: Optional[Preprocess] = None,
    num_images: Optional[int] = None,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> tuple[dict[str, TensorStatistics], ImageLog]:
    """Statistics of every activation of `graph` over the samples: a `SampleSource` (image or `--data`
    files), image files (a folder or a list, preprocessed with `preprocess`), or an array of already
    preprocessed samples with the batch on axis 0."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    log = ImageLog()
    if isinstance(images, np.ndarray):
        samples = list(images[:num_images] if num_images else images)
        if not samples:
            raise ValueError("no images given (empty array)")
        log.used = [Path(f"<array sample {k}>") for k in range(len(samples))]
        batches: Iterable = iter_batches(iter(samples), batch_size)
        total = len(samples)
    else:
        source = images if isinstance(images, SampleSource) else sample_source(images, preprocess)
        reader = source.format.reader(graph)
        candidates = source.candidates(log, num_images, seed)
        total = len(candidates) if num_images is None else min(num_images, len(candidates))
        batches = iter_sample_batches(iter_samples(candidates, reader, log, num_images=num_images), batch_size)
    bar = tqdm(total=total, unit="img", desc="calibrating", disable=None if progress else True, leave=False)
    with bar, logging_redirect_tqdm():  # skip warnings are printed above the bar, not through it
        stats = collect_statistics(graph, batches, graph.activations, needs, on_batch=bar.update)
    if not log.used:
        where = images.location if isinstance(images, SampleSource) else images
        raise ValueError(f"no valid image in {where} ({len(log.skipped)} files skipped)")
    return stats, log


def activation_entries(
    graph: Graph, stats: dict[str, TensorStatistics], options: CalibrationOptions
) -> dict[str, TensorEntry]:
    """Table entries of the activations from their statistics."""
    calibrator = get_calibrator(options.calibrator).for_grid(options.symmetric)
    bounds = folded_ranges(graph) if options.fold_clip else {}
    entries = {}
    for name in graph.activations:
        try:
            rmin, rmax, label = calibrator.compute_explained(stats[name], bits=options.bits)
        except ValueError as exc:
            raise ValueError(f"calibrating tensor {name!r}: {exc}") from exc
        if name in bounds:
            lo, hi = bounds[name]
            rmin, rmax = np.clip(rmin, lo, hi), np.clip(rmax, lo, hi)
        qp = compute_qparams(rmin, rmax, options.bits, symmetric=options.symmetric, narrow=options.narrow,
                             pow2=options.pow2)
        entries[name] = TensorEntry("activation", label, rmin, rmax, qp)
    return entries


def weight_entries(graph: Graph, options: CalibrationOptions) -> dict[str, TensorEntry]:
    """Table entries of the weights (initializers in a weight role, see ptq.core.roles)."""
    calibrator = get_calibrator(options.weight_calibrator).for_grid(options.weight_symmetric)
    entries = {}
    for name, w, axis in weight_tensors(graph, options.per_channel):
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


def _check_feeds(graph: Graph, source: Union[SampleSource, np.ndarray], used: list[Path]) -> list[dict]:
    """The first CHECK_SAMPLES calibration samples (of an array, or the files that calibration `used`: read
    again, none skipped twice) as onnxruntime feeds, for the QDQ model's check (`ptq.qdq_output`)."""
    if isinstance(source, np.ndarray):
        name = image_input(graph)
        return [{name: sample[None]} for sample in source[:min(CHECK_SAMPLES, len(used))]]
    reader = source.format.reader(graph)
    return [{k: v[None] for k, v in reader.read(path).items()} for path in used[:CHECK_SAMPLES]]


def output_paths(model: ModelSource, out_dir: Union[str, Path]) -> tuple[Path, Path]:
    stem = Path(model).stem if isinstance(model, (str, Path)) else (model.graph.name or "model")
    out_dir = Path(out_dir)
    return out_dir / f"{stem}.quant.json", out_dir / f"{stem}.qdq.onnx"


def _scheme_options(scheme: str, **given) -> dict:
    """The grid options under `scheme`: as given for the default scheme; fixed by int4-dsp, which refuses
    any that differs from its default (the user asked for something the scheme overrides)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == DEFAULT_SCHEME:
        return given
    changed = sorted(k for k, v in given.items() if v != _FREE_DEFAULTS[k])
    if changed:
        raise ValueError(f"scheme {scheme} fixes {', '.join(changed)}; leave them at their defaults")
    return dict(int4_dsp.SCHEME_OPTIONS)


def calibrate(
    model: ModelSource,
    images: Optional[ImageSource] = None,
    out_dir: Optional[Union[str, Path]] = None,
    *,
    data: Optional[Union[str, Path, Sequence[Union[str, Path]]]] = None,
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
    scheme: str = DEFAULT_SCHEME,
    qdq_target: str = DEFAULT_TARGET,
    check_qdq: bool = False,
    analytic_bias_correction: bool = False,
    range_search: bool = False,
) -> CalibrationResult:
    """Calibrate `model` on `images` and, with `out_dir`, write `<stem>.quant.json` and `<stem>.qdq.onnx`.

    `images`: a folder (searched recursively), a list of image files, or an ndarray of preprocessed samples
    (batch on axis 0); or instead `data`: a folder (or list) of .npy/.npz files of model inputs (`ptq.samples`). Activations use `calibrator` at `bits` (asymmetric unless `symmetric`), weights
    `weight_calibrator` at `weight_bits` (symmetric unless `weight_symmetric=False`), per channel unless
    `per_channel=False`. `narrow` selects the restricted signed range [-(2^(b-1)-1), 2^(b-1)-1]; `pow2`
    rounds scales up to powers of two. `align` writes the qparams the integer graph fixes by rule into the
    table (see `align_with_integer_graph`). `equalize`, `bias_correction`, `adaround`, `analytic_bias_correction` adjust the weights
    (`ptq.adjust`); the adjusted model is written beside the table and recorded in its options
    (`ptq.adjusted_model`). The input model is never modified; files are written atomically.
    `range_search` picks each activation's range among several calibrators' by its consumers' output error
    (`ptq.range_search`). `workers` > 1 processes (or a Ray cluster: `ray` 'auto', an address or 'local')
    collect the statistics
    of image files in shards, with the same result as one process (`ptq.calibration_shards`); None picks
    the number by `ptq.parallel.choose_workers` (the usable cores, one per 50 images).
    `scheme="int4-dsp"` quantizes for the packed-DSP backend `dsp:int4` (`ptq.int4_dsp`: 4-bit, power-of-two
    scales, 8-bit Add groups and outputs, Requantize nodes written into the adjusted model); it fixes the bit
    widths, symmetry, ranges and pow2, so those arguments must keep their defaults.
    `qdq_target` names the runtime the QDQ model is stored for (`ptq.qdq_export.QDQ_TARGETS`; the table does
    not depend on it); `check_qdq` runs it in onnxruntime with optimizations off and on against the float model
    on a few calibration samples (`result.qdq_check`, `ptq.qdq_check`).
    """
    start = time.perf_counter()
    if (images is None) == (data is None):
        raise ValueError("give the samples as images or as data (one of them)")
    preprocess = preprocess or Preprocess()
    fixed = _scheme_options(scheme, bits=bits, weight_bits=weight_bits, symmetric=symmetric,
                            weight_symmetric=weight_symmetric, narrow=narrow, weight_narrow=weight_narrow, pow2=pow2)
    bits, weight_bits, symmetric = fixed["bits"], fixed["weight_bits"], fixed["symmetric"]
    weight_symmetric, narrow, weight_narrow, pow2 = (fixed["weight_symmetric"], fixed["narrow"],
                                                     fixed["weight_narrow"], fixed["pow2"])
    if data is not None:
        location = Path(data) if isinstance(data, (str, Path)) else tuple(Path(p) for p in data)
        source: Union[SampleSource, np.ndarray] = SampleSource(location, ArrayFormat())
    elif isinstance(images, np.ndarray):
        source = images
    else:
        source = sample_source(images, preprocess)
    target = get_target(qdq_target)
    options = CalibrationOptions(
        calibrator=get_calibrator(calibrator).spelling,
        weight_calibrator=get_calibrator(weight_calibrator).spelling,
        bits=bits, weight_bits=weight_bits, symmetric=symmetric, weight_symmetric=weight_symmetric,
        narrow=narrow, weight_narrow=weight_narrow, per_channel=per_channel, pow2=pow2, fold_clip=fold_clip,
        num_images=num_images, batch_size=batch_size, seed=seed,
        preprocess=None if data is not None else preprocess.to_dict(),
        input_shapes=_normalize_input_shapes(input_shapes),
        equalize=equalize, bias_correction=bias_correction, adaround=adaround, scheme=scheme,
        analytic_bias_correction=analytic_bias_correction, range_search=range_search,
    )
    paths = output_paths(model, out_dir) if out_dir is not None else None
    if paths is not None:
        refuse_to_overwrite({"model": model}, paths)
    graph = load_model(model, input_shapes)
    float_model = graph.model
    if bias_correction and analytic_bias_correction:
        raise ValueError("choose one bias correction: empirical (on the images) or analytic (BatchNorm statistics)")
    adjusted = equalize or bias_correction or adaround or analytic_bias_correction
    bn_stats: dict = {}
    if adjusted:
        graph, bn_stats = adjust.batchnorm_folded(graph, input_shapes)
    if equalize:
        graph, bn_stats = adjust.equalized(graph, input_shapes, bn_stats)
    rewritten = scheme == int4_dsp.SCHEME
    if rewritten:
        graph, _copies = int4_dsp.with_requantize(graph)
    needs = required_stats([options.calibrator] + (list(RANGE_SEARCH_CANDIDATES) if range_search else []))
    if isinstance(source, SampleSource) and workers is None:
        workers = choose_workers(None, len(source.candidates(QuietLog(), num_images, seed)))
    if ((workers or 1) > 1 or ray is not None) and isinstance(source, SampleSource):
        from ptq.calibration_shards import sharded_statistics

        # the workers load the model they are sent: the adjusted one when the adjustments changed it
        shipped = graph.model if adjusted or rewritten else model
        stats, log = sharded_statistics(shipped, graph, source, needs, num_images=num_images, batch_size=batch_size,
                                        seed=seed, input_shapes=input_shapes, workers=workers, ray=ray,
                                        progress=progress)
    else:
        stats, log = collect_image_statistics(graph, source, needs, num_images=num_images, batch_size=batch_size,
                                              seed=seed, progress=progress)
    if rewritten:
        table = int4_dsp.build_table(graph, stats, options, folded_ranges(graph) if fold_clip else {})
    else:
        table = build_table(graph, stats, options)
    if range_search:
        table.tensors.update(adjust.searched_ranges(
            graph, stats, options, lambda: adjust.sample_batches(graph, source, num_images, 1, seed)))
    if analytic_bias_correction:
        graph = adjust.analytic_corrected(graph, table, bn_stats, input_shapes)
    if bias_correction or adaround:
        graph = adjust.after_table(
            graph, table, lambda: adjust.sample_batches(graph, source, num_images, batch_size, seed),
            bias_correction=bias_correction, adaround=adaround, input_shapes=input_shapes)
    if align:
        align_with_integer_graph(graph, table)
    qdq = export_checked(graph, table, target, reference=float_model,
                         feeds=_check_feeds(graph, source, log.used) if check_qdq else ()) if write_qdq else None
    result = CalibrationResult(table=table, graph=graph, images_used=len(log.used), skipped=list(log.skipped),
                               qdq_target=target.name, qdq_check=qdq.check if qdq is not None else None)
    if paths is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        if adjusted or rewritten:
            relative, digest = adjust.write_adjusted(graph, paths[0])
            table.options = dataclasses.replace(table.options, adjusted_model=relative, adjusted_sha256=digest)
        result.table_path = save_quant_table(table, paths[0])
        if qdq is not None:
            result.qdq_path = write_model(qdq.model, paths[1])
    result.seconds = time.perf_counter() - start
    return result

