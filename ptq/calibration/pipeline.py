"""The calibration pipeline and its Python API (the CLI's `ptq calibrate` calls `calibrate`).

    images -> float run (streaming statistics) -> calibrator -> ranges -> QParams -> table (+ QDQ model)

`calibrate` checks its arguments, loads the model, runs the steps the options ask for
(`ptq.calibration.steps`: BatchNorm folding, equalization, range statistics, ranges, range search, bias
correction, AdaRound, alignment with the integer graph) and writes what they made: the table, the adjusted
model when the steps changed it, and the QDQ model.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import onnx

from calibrators import get_calibrator
from ptq.calibration import adjustments, int4_dsp
from ptq.calibration.statistics import ImageSource, sample_source
from ptq.calibration.steps import (
    CalibrationSamples, CalibrationState, RangeStatistics, adjusts_model, calibration_steps,
    run_steps,
)
from ptq.core.atomic import refuse_to_overwrite
from ptq.core.graph import Graph, load_model
from ptq.core.option_defaults import DEFAULT_CALIBRATOR, DEFAULT_SCHEME, DEFAULT_WEIGHT_CALIBRATOR, SCHEMES
from ptq.data.images import InputSpec, Preprocess
from ptq.data.samples import ArrayFormat, SampleSource, data_input_shapes
from ptq.engine.compile_notice import first_run_note
from ptq.engine.float_run import image_input
from ptq.qdq.check import CHECK_SAMPLES, QDQCheck
from ptq.qdq.export import DEFAULT_TARGET, get_target
from ptq.qdq.output import export_checked, summary_lines, write_model
from ptq.table.quant_table import CalibrationOptions, QuantTable, save_quant_table

_FREE_DEFAULTS = dict(bits=8, weight_bits=8, symmetric=False, weight_symmetric=True, narrow=False,
                      weight_narrow=True, pow2=False)

ModelSource = Union[str, Path, onnx.ModelProto]


@dataclass
class CalibrationResult:
    """`ptq.calibrate`: the quant table, the graph it describes and what was written.

    Attributes:
        table: the quantization table (ranges, scales, zero points of every tensor, and the options used).
        graph: the model calibrated (the adjusted one when an option changed the weights).
        images_used: samples that went into the statistics.
        skipped: (path, reason) of each sample file that could not be read.
        seconds: calibration time.
        table_path: where `<stem>.quant.json` was written (None: nothing written, no `out`).
        qdq_path: where `<stem>.qdq.onnx` was written (None: nothing written).
        qdq_target: the runtime the QDQ model is stored for.
        qdq_check: the QDQ model's output cosine to float in onnxruntime, optimizations off and on (None: not run).
        first_run: what this first run of the installation compiled, said beside the time ("" on later runs).
        images_skipped: the number of skipped sample files.
        tensors_calibrated: activations in the table.
        weights_quantized: weights in the table.
    """

    table: QuantTable
    graph: Graph
    images_used: int
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    seconds: float = 0.0
    table_path: Optional[Path] = None
    qdq_path: Optional[Path] = None
    qdq_target: str = DEFAULT_TARGET
    qdq_check: Optional[QDQCheck] = None
    first_run: str = ""  # `ptq.engine.compile_notice.first_run_note`: said beside the time

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

    def _grid_lines(self) -> list[str]:
        """One line per reason ptq gave a grid of its own (`TensorEntry.why`), naming the tensors (up to 3)."""
        by_why: dict[str, list[str]] = {}
        for name, entry in self.table.tensors.items():
            if entry.why:
                by_why.setdefault(entry.why, []).append(name)
        lines = []
        for why, names in by_why.items():
            shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            lines.append(f"own grid for {shown}: {why}")
        return lines

    def summary(self) -> str:
        scheme = self.table.options.scheme
        lines = [
            f"images used: {self.images_used}, skipped: {self.images_skipped}",
            *([f"scheme: {scheme}"] if scheme != DEFAULT_SCHEME else []),
            f"tensors calibrated: {self.tensors_calibrated} activations "
            f"({self._activation_calibrators()}, {self._activation_bits()}), "
            f"{self.weights_quantized} weights ({self.table.options.weight_calibrator}, "
            f"{self.table.options.weight_bits}-bit, {'per-channel' if self.table.options.per_channel else 'per-tensor'})",
            *self._grid_lines(),
            f"time: {self.seconds:.1f} s{self.first_run}",
        ]
        if self.table_path is not None:
            lines.append(f"quantization table: {self.table_path}")
        lines += summary_lines(self.qdq_path, self.qdq_target, self.qdq_check)
        return "\n".join(lines)


def _normalize_input_shapes(input_shapes: Optional[dict]) -> Optional[dict]:
    return {k: [None if d is None else int(d) for d in v] for k, v in input_shapes.items()} if input_shapes else None


def input_spec(graph: Graph, pre: Preprocess) -> InputSpec:
    return InputSpec.from_shape(graph.tensors[image_input(graph)].shape, pre.layout)


def _check_feeds(graph: Graph, source: Union[SampleSource, np.ndarray], used: list[Path]) -> list[dict]:
    """The first CHECK_SAMPLES calibration samples (of an array, or the files that calibration `used`: read
    again, none skipped twice) as onnxruntime feeds, for the QDQ model's check (`ptq.qdq.output`)."""
    if isinstance(source, np.ndarray):
        name = image_input(graph)
        return [{name: sample[None]} for sample in source[:min(CHECK_SAMPLES, len(used))]]
    reader = source.format.reader(graph)
    return [reader.read(path) for path in used[:CHECK_SAMPLES]]


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
    (batch on axis 0); or instead `data`: a folder (or list) of .npy/.npz files of model inputs (`ptq.data.samples`). Activations use `calibrator` at `bits` (asymmetric unless `symmetric`), weights
    `weight_calibrator` at `weight_bits` (symmetric unless `weight_symmetric=False`), per channel unless
    `per_channel=False`. `narrow` selects the restricted signed range [-(2^(b-1)-1), 2^(b-1)-1]; `pow2`
    rounds scales up to powers of two. `align` writes the qparams the integer graph fixes by rule into the
    table (see `ptq.calibration.steps.align_with_integer_graph`). `equalize`, `bias_correction`, `adaround`, `analytic_bias_correction` adjust the weights
    (`ptq.calibration.adjustments`); the adjusted model is written beside the table and recorded in its options
    (`ptq.adjust.adjusted_model`). The input model is never modified; files are written atomically.
    `range_search` picks each activation's range among several calibrators' by its consumers' output error
    (`ptq.calibration.range_search`). `workers` > 1 processes (or a Ray cluster: `ray` 'auto', an address or 'local')
    collect the statistics
    of image files in shards, with the same result as one process (`ptq.calibration.shards`); None picks
    the number by `ptq.parallel.workers.choose_workers` (the usable cores, one per 50 images, from 3 on).
    `scheme="int4-dsp"` quantizes for the packed-DSP backend `dsp:int4` (`ptq.calibration.int4_dsp`: 4-bit, power-of-two
    scales, 8-bit Add groups and outputs, Requantize nodes written into the adjusted model); it fixes the bit
    widths, symmetry, ranges and pow2, so those arguments must keep their defaults.
    `qdq_target` names the runtime the QDQ model is stored for (`ptq.qdq.export.QDQ_TARGETS`; the table does
    not depend on it); `check_qdq` runs it in onnxruntime with optimizations off and on against the float model
    on a few calibration samples (`result.qdq_check`, `ptq.qdq.check`).
    """
    start = time.perf_counter()
    if (images is None) == (data is None):
        raise ValueError("give the samples as images or as data (one of them)")
    preprocess = preprocess or Preprocess()
    fixed = _scheme_options(scheme, bits=bits, weight_bits=weight_bits, symmetric=symmetric,
                            weight_symmetric=weight_symmetric, narrow=narrow, weight_narrow=weight_narrow, pow2=pow2)
    if data is not None:
        location = Path(data) if isinstance(data, (str, Path)) else tuple(Path(p) for p in data)
        source: Union[SampleSource, np.ndarray] = SampleSource(location, ArrayFormat())
    elif isinstance(images, np.ndarray):
        source = images
    else:
        source = sample_source(images, preprocess)
    if isinstance(source, SampleSource):  # --data: dynamic dimensions past axis 0 take the first sample's sizes
        input_shapes = {**data_input_shapes(model, source, num_images, seed), **(input_shapes or {})} or None
    target = get_target(qdq_target)
    options = CalibrationOptions(
        calibrator=get_calibrator(calibrator).spelling,
        weight_calibrator=get_calibrator(weight_calibrator).spelling,
        **fixed, per_channel=per_channel, fold_clip=fold_clip,
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
    steps = calibration_steps(options, align=align, statistics=RangeStatistics(workers, ray, progress))
    state = run_steps(steps, CalibrationState(graph, options, CalibrationSamples(source, num_images, seed), model,
                                              input_shapes))
    graph, table, log = state.graph, state.table, state.image_log
    qdq = export_checked(graph, table, target, reference=float_model,
                         feeds=_check_feeds(graph, source, log.used) if check_qdq else ()) if write_qdq else None
    result = CalibrationResult(table=table, graph=graph, images_used=len(log.used), skipped=list(log.skipped),
                               qdq_target=target.name, qdq_check=qdq.check if qdq is not None else None)
    if paths is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        if adjusts_model(options):
            relative, digest = adjustments.write_adjusted(graph, paths[0])
            table.options = dataclasses.replace(table.options, adjusted_model=relative, adjusted_sha256=digest)
        result.table_path = save_quant_table(table, paths[0])
        if qdq is not None:
            result.qdq_path = write_model(qdq.model, paths[1])
    result.seconds = time.perf_counter() - start
    result.first_run = first_run_note()
    return result
