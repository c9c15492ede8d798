"""The Python API: one function per command, `ptq.calibrate`, `ptq.run`, `ptq.report`, `ptq.debug`,
`ptq.tune` and `ptq.export_table` (`ptq table export`), with the command's options as keyword arguments named
as the flags (`--crop-ratio` is `crop_ratio`, `--fake-quant` is `fake_quant`; `--qdq-target` is `qdq_target`,
`ptq.calibrate` keeps `target`) and results as objects. The `ptq` commands parse their flags
and call these functions; they only print.

Every function takes the shared options (`ptq.data_options.DataOptions`): `images` or `data`, the
preprocessing (`config`, `mean`, `std`, `resize`, `crop_ratio`, `bgr`, `layout`; default: what the quant
table records), `labels` (run, report, debug), `num_images`, `seed`, `batch_size`, `quiet`, `workers`, `ray`.
"""
from __future__ import annotations

# imports inside functions: `import ptq` and the command line stay cheap; a function imports what it runs
# (tests/test_cli_imports.py)

import dataclasses
import inspect
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

from ptq.engine.backends import DEFAULT_BACKEND_NAME, resolve_backend
from ptq.data_options import DataOptions, quiet_logging
from ptq.core.notes import Note
from ptq.output_paths import check_file, check_outputs, note_replaced
from ptq.parallel.workers import choose_workers, ship_model
from ptq.qdq.targets import DEFAULT_TARGET
from ptq.core.option_defaults import (
    DEFAULT_CALIBRATOR, DEFAULT_ISOLATED_IMAGES, DEFAULT_MATCH_IOU, DEFAULT_SCHEME, DEFAULT_SCORE_THRESHOLD,
    DEFAULT_WEIGHT_CALIBRATOR, INT4_DSP_SCHEME,
)
from ptq.tuning.defaults import DEFAULT_MARGIN, DEFAULT_VALIDATION_FRACTION, DEFAULT_VIEWS, DEFAULT_Z

if TYPE_CHECKING:
    from ptq.core.graph import Graph
    from ptq.tuning.lane_mix import Int4Grid
    from ptq.qdq.check import QDQCheck
    from ptq.engine.executor import FloatNode
    from ptq.calibration.pipeline import CalibrationResult
    from ptq.table.quant_table import QuantTable
    from ptq.data.samples import SampleSource
    from ptq.tuning.tuner import TuneResult
    from reports.auto_debug import AutoResult
    from reports.dsp_resources import DspReport
    from reports.fake_quant import FakeQuantResult
    from ptq.data.image_source import ImageSet
    from reports.layers import Bottleneck, LayerReport, OutputReport, Report


PathLike = Union[str, Path]


def _options(function: str, options: dict, *, labels: bool = True) -> DataOptions:
    """The shared options given to `ptq.<function>`; an unknown keyword is a TypeError that lists the function's
    own keywords too."""
    own = [p.name for p in inspect.signature(globals()[function]).parameters.values() if p.kind == p.KEYWORD_ONLY]
    opts = DataOptions.of(function, options, own)
    if not labels and opts.labels is not None:
        raise ValueError(f"labels: `ptq.{function}` uses no labels")
    return opts


def _table_stem(table_path: Path) -> str:
    """The name the files written beside a table start with: `x.quant.json` -> `x`."""
    name = table_path.name
    return name[: -len(".quant.json")] if name.endswith(".quant.json") else table_path.stem


def _input_shapes(input_shape) -> Optional[dict]:
    """`--input-shape NAME:D0,D1,...` (repeatable) or a dict {name: dims}."""
    from ptq.core.graph import parse_input_shapes

    if input_shape is None or isinstance(input_shape, dict):
        return input_shape
    return parse_input_shapes(list(input_shape))


def calibrate(
    model: PathLike,
    *,
    out: Optional[PathLike] = None,
    calibrator: str = DEFAULT_CALIBRATOR,
    weight_calibrator: str = DEFAULT_WEIGHT_CALIBRATOR,
    bits: int = 8,
    weight_bits: int = 8,
    symmetric: bool = False,
    weight_asymmetric: bool = False,
    narrow: bool = False,
    weight_full_range: bool = False,
    per_tensor: bool = False,
    pow2: bool = False,
    no_fold_clip: bool = False,
    equalize: bool = False,
    bias_correction: bool = False,
    adaround: bool = False,
    analytic_bias_correction: bool = False,
    range_search: bool = False,
    scheme: str = DEFAULT_SCHEME,
    target: str = DEFAULT_TARGET,
    no_check: bool = False,
    input_shape=None,
    **options,
) -> CalibrationResult:
    """`ptq calibrate`: the quant table (and, with `out`, `<stem>.quant.json` and `<stem>.qdq.onnx` there).

    Examples:
        >>> import tempfile, ptq
        >>> out = tempfile.mkdtemp()
        >>> result = ptq.calibrate("examples/efficientnet_lite0.onnx", images="examples/calib", out=out,
        ...                        num_images=2, mean=127.5, std=127.5, quiet=True)
        >>> result.images_used, result.table.options.preprocess["mean"], result.table_path.name
        (2, [127.5, 127.5, 127.5], 'efficientnet_lite0.quant.json')
    """
    from ptq.calibration.pipeline import calibrate as run_calibration

    opts = _options("calibrate", options, labels=False)
    if out is not None:
        from ptq.adjust.adjusted_model import adjusted_path
        from ptq.calibration.pipeline import output_paths

        table_path, qdq_path = output_paths(model, out)
        adjusts = equalize or bias_correction or adaround or analytic_bias_correction or scheme != DEFAULT_SCHEME
        check_outputs(out, [table_path.name, qdq_path.name] + ([adjusted_path(table_path).name] if adjusts else []),
                      note=not opts.quiet)
    with quiet_logging(opts.quiet):
        return run_calibration(
            model, images=opts.images, data=opts.data, out_dir=out,
            calibrator=calibrator, weight_calibrator=weight_calibrator, bits=bits, weight_bits=weight_bits,
            symmetric=symmetric, weight_symmetric=not weight_asymmetric, narrow=narrow,
            weight_narrow=not weight_full_range, per_channel=not per_tensor, pow2=pow2, fold_clip=not no_fold_clip,
            preprocess=opts.preprocess() if opts.images is not None else None,
            num_images=opts.num_images, batch_size=opts.batch_size, seed=opts.seed,
            input_shapes=_input_shapes(input_shape), progress=opts.progress, workers=opts.workers, ray=opts.ray,
            equalize=equalize, bias_correction=bias_correction, adaround=adaround,
            analytic_bias_correction=analytic_bias_correction, range_search=range_search, scheme=scheme,
            qdq_target=target, check_qdq=not (opts.quiet or no_check),
        )


@dataclass
class Loaded:
    """What run, report, debug and tune start from: the graph (adjusted weights when the table names them),
    the table, and the samples."""

    graph: Graph
    table: QuantTable
    source: SampleSource
    samples: ImageSet
    inputs: dict  # what report.json / debug.json / tune.json record as the samples used


def load(model: PathLike, quant: PathLike, opts: DataOptions, strict: bool = False, labelled: bool = True) -> Loaded:
    """`labelled`: the command uses labels (run, report, debug); labels it cannot trust (`usable_labels`) are
    dropped with a note."""
    from ptq.adjust.adjusted_model import load_model_for_table
    from ptq.table.quant_table import load_quant_table
    from reports.class_scores import class_count
    from ptq.data.image_source import ImageSet
    from ptq.data.labels import usable_labels

    table = load_quant_table(quant)
    graph = load_model_for_table(model, table, quant)
    source = opts.source(table.options.preprocess)
    samples = ImageSet.from_source(source, opts.labels, opts.num_images, opts.seed)
    source.format.reader(graph)  # a model the samples cannot feed is an error before any work
    if labelled and (opts.labels is not None or opts.images is not None):  # --data samples: a labels file only
        samples.labels, why = usable_labels(samples.labels, samples.files, class_count(graph, graph.outputs[0]))
        if why is not None and not opts.quiet:
            warnings.warn(f"no labels: {why}", Note)
    if strict:  # the first node that would run in float is an error naming it and the reason
        from ptq.engine.executor import ExecutorOptions, prepare

        prepare(graph, table, options=ExecutorOptions(strict=True))
    inputs = {**source.to_dict(), "labels": None if opts.labels is None else str(opts.labels),
              "num_images": opts.num_images, "seed": opts.seed}
    return Loaded(graph, table, source, samples, inputs)


# ------------------------------------------------------------------------------------------------------- run

@dataclass
class SampleResult:
    """One sample of `ptq.run`: the integer run's top-k (class, probability), the float model's top-1 and the
    label (None: unlabelled), or why the file was skipped."""

    path: Path
    classes: Optional[list[tuple[int, float]]]
    float_class: Optional[int]
    label: Optional[int]
    skipped: Optional[str] = None
    seconds: float = 0.0
    # an output that is no class-score vector: (values equal to the float model's, values compared);
    # `classes` is then empty (`reports.run_shards.output_matches`)
    matched: Optional[tuple[int, int]] = None
    cosine: Optional[float] = None  # a float output that is neither class scores nor per-frame scores

    @property
    def agrees(self) -> Optional[bool]:
        """Integer top-1 == float top-1 (None when skipped or no class scores)."""
        return None if not self.classes else self.classes[0][0] == self.float_class

    @property
    def correct(self) -> Optional[bool]:
        """Integer top-1 == label (None when skipped, unlabelled or no class scores)."""
        return None if not self.classes or self.label is None else self.classes[0][0] == self.label


@dataclass
class RunResult:
    """`ptq.run`: every sample in order, the nodes that ran in float, the int32 accumulator overflows."""

    samples: list[SampleResult]
    float_nodes: list[FloatNode]  # name, op_type, reason
    overflows: dict[str, int]
    inputs: dict
    output: str = ""  # the graph output the figures are of
    backend: str = DEFAULT_BACKEND_NAME  # the integer kernels that ran (`backend="auto"` chose them)

    @property
    def class_scores(self) -> bool:
        """Whether the output is class scores (top-k per sample, top-1 agreement), not indices or frames."""
        return not any(s.matched is not None or s.cosine is not None for s in self.classified)

    @property
    def output_agreement(self) -> Optional[float]:
        """For an output that is no class-score vector: the fraction of its values (index/bool outputs) or
        last-axis argmax decisions (float outputs) equal to the float model's, over every sample; else None."""
        pairs = [s.matched for s in self.classified if s.matched is not None]
        return sum(m for m, _ in pairs) / max(1, sum(n for _, n in pairs)) if pairs else None

    @property
    def output_cosine(self) -> Optional[float]:
        """For a float output with neither classes nor a last axis to take the argmax of: the mean cosine."""
        values = [s.cosine for s in self.classified if s.cosine is not None]
        return sum(values) / len(values) if values else None

    @property
    def classified(self) -> list[SampleResult]:
        return [s for s in self.samples if s.classes is not None]

    @property
    def images(self) -> int:
        return len(self.classified)

    @property
    def skipped(self) -> int:
        return len(self.samples) - self.images

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.classified)

    @property
    def agreement(self) -> float:
        """Fraction of the samples whose integer top-1 is the float top-1; for an output that is no class-score
        vector, `output_agreement`."""
        if not self.class_scores:
            return self.output_agreement if self.output_agreement is not None else self.output_cosine
        return sum(bool(s.agrees) for s in self.classified) / max(1, self.images)

    @property
    def labelled(self) -> int:
        return sum(s.label is not None for s in self.classified)

    @property
    def correct(self) -> int:
        return sum(bool(s.correct) for s in self.classified)

    @property
    def accuracy(self) -> Optional[float]:
        """Top-1 accuracy over the labelled samples (None: no labels)."""
        return self.correct / self.labelled if self.labelled else None


def run(
    model: PathLike,
    *,
    quant: PathLike,
    top: int = 5,
    float_nodes: Sequence[str] = (),
    strict: bool = False,
    backend: str = DEFAULT_BACKEND_NAME,
    **options,
) -> RunResult:
    """`ptq run`: classify each sample with the integer graph (and the float model, for the agreement).
    With `num_images`, that many files drawn with `seed`. `backend="auto"` (the command line's default): numpy
    kernels on a few samples, compiled ones on more (`ptq.engine.backends.resolve_backend`); `result.backend`
    names those that ran.

    Examples:
        >>> import tempfile, ptq
        >>> cal = ptq.calibrate("examples/efficientnet_lite0.onnx", images="examples/calib", out=tempfile.mkdtemp(),
        ...                     num_images=2, quiet=True)
        >>> result = ptq.run("examples/efficientnet_lite0.onnx", quant=cal.table_path, images="examples/calib",
        ...                  num_images=2, top=3, quiet=True)
        >>> result.images, len(result.samples[0].classes), result.agreement, result.accuracy is None
        (2, 3, 1.0, True)
    """
    from tqdm import tqdm

    from ptq.engine.executor import ExecutorOptions, prepare
    from reports.run_shards import ClassifyJob, classify_image, classify_sharded, run_context

    opts = _options("run", options)
    if top <= 0:
        raise ValueError(f"--top must be positive, got {top}")
    with quiet_logging(opts.quiet):
        loaded = load(model, quant, opts)
        graph, table, samples = loaded.graph, loaded.table, loaded.samples
        files = samples.files[:samples.limit] if samples.limit else samples.files
        backend = resolve_backend(backend, len(files))
        prepared = prepare(graph, table, float_nodes=list(float_nodes), backend=backend,
                           options=ExecutorOptions(strict=strict))
        outcomes = []
        if opts.sharded(len(files)):  # the workers get the model as loaded here (the adjusted one with adjusted weights)
            job = ClassifyJob(ship_model(graph.model), table, samples.format, tuple(float_nodes), backend,
                              strict, top)
            classify_sharded(job, files, choose_workers(opts.workers, len(files)), opts.ray, outcomes.append,
                             progress=opts.progress)
        else:
            context = run_context(graph, prepared, samples.format)
            for path in tqdm(files, unit="img", desc="run", disable=None if opts.progress else True, leave=False):
                outcomes.append(classify_image(context, path, top))
    result = RunResult(
        [SampleResult(o.path, o.ranked, o.float_class, samples.labels(o.path), o.skipped, o.seconds, o.matched,
                      o.cosine)
         for o in outcomes],
        list(prepared.float_nodes), {}, loaded.inputs, graph.outputs[0], backend)
    for outcome in outcomes:
        for node, count in outcome.overflows.items():
            result.overflows[node] = result.overflows.get(node, 0) + count
    if not result.images:
        raise ValueError(f"no sample of {loaded.inputs.get('images') or loaded.inputs.get('data')} could be read")
    return result


# ---------------------------------------------------------------------------------------------------- report

@dataclass
class ReportResult:
    """`ptq.report`: the report (layers, outputs, ranked bottlenecks), the files written, and with a DSP
    backend the resource report."""

    report: Report
    paths: list[Path] = field(default_factory=list)
    dsp: Optional[DspReport] = None

    @property
    def outputs(self) -> list[OutputReport]:
        """Per graph output: cosine, MSE, SQNR, max error of the integer graph against the float model."""
        return self.report.outputs

    @property
    def classification(self) -> Optional[dict]:
        """Top-1/top-5 agreement (and accuracy when labelled) of the first output, if it is class scores."""
        return self.report.classification

    @property
    def bottlenecks(self) -> list[Bottleneck]:
        """The suspect layers, most damaging first."""
        return self.report.bottlenecks

    @property
    def layers(self) -> list[LayerReport]:
        return self.report.layers


REPORT_FILES = ("report.json", "report.csv", "report.html")


def write_report(report: Report, out_dir: Path, lanes: Optional[dict] = None) -> list[Path]:
    """report.json, .csv and .html in `out_dir`; `lanes`: a tune record whose lane trade-off report.html shows."""
    from reports.html import write_html
    from reports.writers import write_csv, write_json

    out_dir.mkdir(parents=True, exist_ok=True)
    json_name, csv_name, html_name = REPORT_FILES
    return [write_json(report, out_dir / json_name), write_csv(report, out_dir / csv_name),
            write_html(report, out_dir / html_name, lanes=lanes)]


def report(
    model: PathLike,
    *,
    quant: PathLike,
    out: Optional[PathLike] = None,
    isolated_images: Optional[int] = DEFAULT_ISOLATED_IMAGES,
    float_nodes: Sequence[str] = (),
    strict: bool = False,
    backend: str = DEFAULT_BACKEND_NAME,
    task: Optional[str] = None,
    score_threshold: float = DEFAULT_SCORE_THRESHOLD,
    match_iou: float = DEFAULT_MATCH_IOU,
    tune: Optional[PathLike] = None,
    **options,
) -> ReportResult:
    """`ptq report`: the integer graph against the float model, layer by layer; with `out`, report.json, .csv
    and .html there. `isolated_images=None` computes the isolated metrics on every sample.
    `task="detect"`: the integer run's detections matched to float's (score >= `score_threshold`, IoU >=
    `match_iou`, same class; `reports.detections`): recall and precision in `result.report.detections`; None
    or "auto" does so when the graph has one NonMaxSuppression node; "classify" never. `tune`: the
    `<stem>.tune.json` of `ptq tune --scheme int4-dsp`, whose accuracy-throughput trade-off (the Pareto figure,
    the assignments and each layer's lanes) report.html then shows.

    Examples:
        >>> import tempfile, ptq
        >>> cal = ptq.calibrate("examples/efficientnet_lite0.onnx", images="examples/calib", out=tempfile.mkdtemp(),
        ...                     num_images=2, quiet=True)
        >>> result = ptq.report("examples/efficientnet_lite0.onnx", quant=cal.table_path, images="examples/calib",
        ...                     num_images=2, out=tempfile.mkdtemp(), quiet=True)
        >>> result.report.images, [p.name for p in result.paths], result.outputs[0].similarity.cosine > 0.9
        (2, ['report.json', 'report.csv', 'report.html'], True)
        >>> result.report.inputs["preprocess"]["crop_ratio"], len(result.bottlenecks) > 0
        (0.875, True)
    """
    from reports.build import build_report
    from reports.detections import detection_task
    from reports.evaluate import evaluate

    opts = _options("report", options)
    lanes = None
    if tune is not None:
        from reports.lane_pareto import lanes_record

        lanes = lanes_record(tune)
    if out is not None:
        check_outputs(out, REPORT_FILES + (("dsp_report.json",) if backend.startswith("dsp:") else ()),
                      note=not opts.quiet)
    with quiet_logging(opts.quiet):
        loaded = load(model, quant, opts, strict)
        graph, table, samples = loaded.graph, loaded.table, loaded.samples
        detection = detection_task(graph, task, score_threshold, match_iou)
        # with adjusted weights the graph outputs are compared with the user's model (reports.float_reference)
        adjusted = table.options.adjusted_model is not None
        if opts.sharded(samples.expected):
            from reports.evaluate_shards import sharded_evaluate

            # the loaded model (the adjusted one when the table records weight adjustments) goes to the workers
            ev = sharded_evaluate(graph.model, table, samples, workers=choose_workers(opts.workers, samples.expected),
                                  ray=opts.ray,
                                  float_nodes=float_nodes, isolated_images=isolated_images, progress=opts.progress,
                                  backend=backend, graph=graph, goal=model if adjusted else None,
                                  detection=detection)
        else:
            from ptq.core.graph import load_model

            goal = load_model(model, table.options.input_shapes) if adjusted else None
            ev = evaluate(graph, table, samples, float_nodes=float_nodes, isolated_images=isolated_images,
                          progress=opts.progress, backend=backend, goal=goal, detection=detection)
    built = build_report(ev, str(model), str(quant))
    built.inputs = loaded.inputs
    if detection is not None:
        built.notes.append(f"detections decoded from {detection.describe()}")
    result = ReportResult(built, write_report(built, Path(out), lanes) if out is not None else [])
    if backend.startswith("dsp:"):
        from reports.dsp_resources import dsp_report

        result.dsp = dsp_report(graph, table)
        if out is not None:
            path = Path(out) / "dsp_report.json"
            path.write_text(json.dumps(result.dsp.to_dict(), indent=1) + "\n", encoding="utf-8")
            result.paths.append(path)
    return result


# ----------------------------------------------------------------------------------------------------- debug

@dataclass
class DebugResult:
    """`ptq.debug`: the fake-quant comparison or the `auto` trials (with their report), the dump, the files."""

    inputs: dict
    fake_quant: Optional[FakeQuantResult] = None
    auto: Optional[AutoResult] = None
    report_paths: list[Path] = field(default_factory=list)
    written_quant: Optional[Path] = None
    dump_index: Optional[Path] = None
    json_path: Optional[Path] = None

    def to_dict(self, model: str, quant: str) -> dict:
        data: dict = {"model": model, "quant": quant, "inputs": self.inputs}
        if self.auto is not None:
            data.update({"mode": "auto", **self.auto.to_dict()})
        elif self.fake_quant is not None:
            data.update({"mode": "fake_quant", **self.fake_quant.to_dict()})
        if self.written_quant is not None:
            data["written_quant"] = str(self.written_quant)
        if self.dump_index is not None:
            data["dump_index"] = str(self.dump_index)
        return data


def _names(value) -> list[str]:
    """Names as a list, from a list or a comma-separated string."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [n.strip() for n in items if n.strip()]


def debug(
    model: PathLike,
    *,
    quant: PathLike,
    out: Optional[PathLike] = None,
    fake_quant=None,
    fake_quant_ops=None,
    auto: Optional[int] = None,
    write_quant: Optional[PathLike] = None,
    isolated_images: Optional[int] = DEFAULT_ISOLATED_IMAGES,
    dump: Optional[PathLike] = None,
    dump_images: int = 1,
    strict: bool = False,
    backend: str = DEFAULT_BACKEND_NAME,
    **options,
) -> DebugResult:
    """`ptq debug`: run the `fake_quant` layers (or `fake_quant_ops` op types) in float inside the integer
    graph; or with `auto=K` try the report's top K suspects in float and in 16 bits (`write_quant`: the
    suggested mixed-precision table); `dump`: the float and integer tensors as .npy. With `out`, debug.json.

    Examples:
        >>> import tempfile, ptq
        >>> cal = ptq.calibrate("examples/efficientnet_lite0.onnx", images="examples/calib", out=tempfile.mkdtemp(),
        ...                     num_images=2, quiet=True)
        >>> result = ptq.debug("examples/efficientnet_lite0.onnx", quant=cal.table_path, images="examples/calib",
        ...                    num_images=2, fake_quant_ops=["Conv"], quiet=True)
        >>> result.fake_quant.after.cosine > result.fake_quant.before.cosine
        True
    """
    from ptq.table.quant_table import save_quant_table
    from reports.auto_debug import auto_debug
    from reports.dump import dump_tensors
    from reports.evaluate_shards import choose_evaluator
    from reports.fake_quant import fake_quant as run_fake_quant
    from reports.layer_nodes import float_node_names
    from reports.writers import finite_or_none

    opts = _options("debug", options)
    layers, op_types = _names(fake_quant), _names(fake_quant_ops)
    if layers and op_types:
        raise ValueError("choose --fake-quant or --fake-quant-ops, not both")
    if auto is None and not (layers or op_types or dump):
        raise ValueError("choose --fake-quant LAYERS, --fake-quant-ops OPS, --auto K or --dump DIR")
    if auto is not None and (layers or op_types):
        raise ValueError("--auto tries its own layers: not with --fake-quant or --fake-quant-ops")
    if write_quant and auto is None:
        raise ValueError("--write-quant needs --auto")
    existing = []
    if out is not None:
        existing += check_outputs(out, ("debug.json",) + (REPORT_FILES if auto is not None else ()), note=False)
    if write_quant:
        existing += [Path(write_quant)] if check_file(write_quant, "--write-quant") else []
    if dump:
        existing += check_outputs(dump, ("index.json",), "--dump", note=False)
    if not opts.quiet:
        note_replaced(existing)
    with quiet_logging(opts.quiet):
        loaded = load(model, quant, opts, strict)
        graph, table, samples = loaded.graph, loaded.table, loaded.samples
        result = DebugResult(loaded.inputs)
        # one pool of workers (or plain `evaluate`) serves every evaluation of the command
        with choose_evaluator(graph, table, samples, workers=opts.workers, ray=opts.ray) as evaluator:
            if auto is not None:
                result.auto = auto_debug(graph, table, samples, auto, model=str(model), quant=str(quant),
                                         isolated_images=isolated_images, progress=opts.progress, backend=backend,
                                         evaluator=evaluator)
            elif layers or op_types:
                result.fake_quant = run_fake_quant(graph, table, samples, layers=layers, op_types=op_types,
                                                   progress=opts.progress, backend=backend, evaluator=evaluator)
        if result.auto is not None:
            result.auto.report.inputs = loaded.inputs
            if out is not None:
                result.report_paths = write_report(result.auto.report, Path(out))
            if write_quant:
                result.written_quant = save_quant_table(result.auto.mixed_table or table, write_quant)
        if dump:
            from ptq.engine.executor import prepare

            nodes = float_node_names(prepare(graph, table), layers) + op_types
            result.dump_index = dump_tensors(graph, table, samples, dump, layers=layers, float_nodes=nodes,
                                             max_images=dump_images, backend=backend)
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        result.json_path = Path(out) / "debug.json"
        result.json_path.write_text(json.dumps(finite_or_none(result.to_dict(str(model), str(quant))), indent=1,
                                               allow_nan=False) + "\n", encoding="utf-8")
    return result


# ------------------------------------------------------------------------------------------------------ tune

def tune(
    model: PathLike,
    *,
    quant: PathLike,
    target_cosine: Optional[float] = None,
    max_accuracy_drop: Optional[float] = None,
    metric: Optional[Callable] = None,
    max_drop: Optional[float] = None,
    budget_int16: Optional[int] = None,
    allow_float: int = 0,
    validation: Optional[PathLike] = None,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    margin: float = DEFAULT_MARGIN,
    z: float = DEFAULT_Z,
    views: Sequence[str] = DEFAULT_VIEWS,
    out: Optional[PathLike] = None,
    qdq_target: str = DEFAULT_TARGET,
    no_check: bool = False,
    scheme: str = DEFAULT_SCHEME,
    int4_grid: Optional["Int4Grid"] = None,
    **options,
) -> TuneResult:
    """`ptq tune`: change the table step by step until the logits cosine on validation samples reaches
    `target_cosine` (a part of the samples held out, or the `validation` folder, in the samples' format; each
    image with the `views` of `ptq.data.views`), and/or until a metric is within a drop of the float model's on
    them: `max_accuracy_drop` (top-1 accuracy against the samples' labels: `labels`, or file names ending in
    _LABEL), or `metric(outputs, sample) -> float` with `max_drop` (`ptq.tuning.metric`: outputs by name, the
    sample a `ValidationSample`; as NNCF's `quantize_with_accuracy_control(validation_fn, max_drop)`);
    a metric over a few photos is coarse (20 photos: steps of 0.05), the summary says over how many.
    Write `<stem>.tuned.quant.json`, `<stem>.tuned.qdq.onnx` (the QDQ model of the tuned table, from the
    tuned weights when the table records adjusted ones, stored for `qdq_target`) and `<stem>.tune.json` to `out`
    (default: the table's folder). `reached` is said only when the integer graph and the QDQ model written, in
    onnxruntime with optimizations off and on, reach the goal on the validation samples (`result.verdict`,
    `ptq.tuning.verdict`: otherwise which fell short by how much; `no_check`: the QDQ model is not run, and
    `reached` is the integer graph's alone). Judge the result on other held-out samples still. `workers`/`ray`: the
    passes over the samples (statistics, ranking, each step's validation cosines) on a pool, with the same
    result (`ptq.tuning.shards`). `scheme="int4-dsp"`: from an 8-bit table, move layers to 4-bit DSP lanes
    (4 MACs per DSP48E2) while the target holds, maximizing MACs per DSP per cycle, and to 16-bit lanes (1 MAC) where
    all-8-bit misses it (`ptq.tuning.lane_tuner`;
    `int4_grid`: how the 4-bit layers are quantized, `ptq.tuning.lane_mix.Int4Grid`); the result's `lanes`
    records each layer's lanes and sensitivity and every assignment tried.

    Examples:
        >>> import tempfile, ptq
        >>> cal = ptq.calibrate("examples/efficientnet_lite0.onnx", images="examples/calib", out=tempfile.mkdtemp(),
        ...                     num_images=3, quiet=True)
        >>> result = ptq.tune("examples/efficientnet_lite0.onnx", quant=cal.table_path, images="examples/calib",
        ...                   num_images=3, target_cosine=0.9, quiet=True)
        >>> result.reached, result.steps, result.validation_samples, result.table_path.name
        (True, [], 1, 'efficientnet_lite0.tuned.quant.json')
        >>> result.qdq_path.name, result.qdq_target
        ('efficientnet_lite0.tuned.qdq.onnx', 'ort-cpu')
    """
    from ptq.adjust.adjusted_model import adjusted_path, save_adjusted
    from ptq.core.atomic import refuse_to_overwrite
    from ptq.core.graph import load_model
    from ptq.qdq.output import export_checked, write_model
    from ptq.table.quant_table import save_quant_table
    from ptq.tuning.tuner import tune as run_tuning
    from ptq.tuning.verdict import judge
    from ptq.tuning.lane_mix import Int4Grid
    from ptq.tuning.lane_tuner import tune_lanes
    from ptq.data.views import VIEWS
    from ptq.data.image_source import ImageSet

    opts = _options("tune", options)
    metric_target = _metric_target(max_accuracy_drop, metric, max_drop)
    if target_cosine is None and metric_target is None:
        raise ValueError("tune needs a target: --target-cosine, --max-accuracy-drop (or metric= with max_drop=)")
    if scheme not in (DEFAULT_SCHEME, INT4_DSP_SCHEME):
        raise ValueError(f"unknown tuning scheme {scheme!r}; choose {DEFAULT_SCHEME} or {INT4_DSP_SCHEME}")
    if scheme == INT4_DSP_SCHEME and (budget_int16 is not None or allow_float):
        raise ValueError("--budget-int16 and --allow-float do not apply to --scheme int4-dsp (it chooses each "
                         "layer's DSP lanes, 4, 8 or 16 bits, itself)")
    if scheme == INT4_DSP_SCHEME and (metric_target is not None or target_cosine is None):
        raise ValueError("--scheme int4-dsp tunes to --target-cosine only (no metric target)")
    if target_cosine is not None and not 0 < target_cosine <= 1:
        raise ValueError(f"--target-cosine must be in (0, 1], got {target_cosine}")
    if (budget_int16 is not None and budget_int16 < 0) or allow_float < 0:
        raise ValueError("--budget-int16 and --allow-float must be >= 0")
    unknown = [v for v in views if v not in VIEWS]
    if unknown:
        raise ValueError(f"unknown --views {', '.join(unknown)}; known: {', '.join(VIEWS)}, or none")
    table_path = Path(quant)
    out_dir = Path(out) if out is not None else table_path.parent
    stem = _table_stem(table_path)
    tuned_path, qdq_path = out_dir / f"{stem}.tuned.quant.json", out_dir / f"{stem}.tuned.qdq.onnx"
    refuse_to_overwrite({"model": model, "quant table": quant}, [tuned_path, qdq_path])
    # the adjusted weights written with a table that records them: checked whether or not it does
    written = [tuned_path, qdq_path, out_dir / f"{stem}.tune.json", adjusted_path(tuned_path)]
    existing = check_outputs(out_dir, [p.name for p in written], note=False)
    with quiet_logging(opts.quiet):
        loaded = load(model, quant, opts, labelled=False)
        graph, table, samples = loaded.graph, loaded.table, loaded.samples
        if max_accuracy_drop is not None and validation is None:  # the validation part is drawn from these
            samples.labels = _trusted_labels(samples, graph)
        if not opts.quiet:
            note_replaced([p for p in existing if table.options.adjusted_model is not None or p != written[-1]])
        held = None
        if validation is not None:  # the same format (and preprocessing) as the tuning samples
            held = ImageSet.from_source(dataclasses.replace(loaded.source, location=Path(validation)), opts.labels)
            if max_accuracy_drop is not None:
                held.labels = _trusted_labels(held, graph)
        reference = load_model(model, table.options.input_shapes)  # the user's model: the goal
        if scheme == INT4_DSP_SCHEME:  # layers moved to 4-bit DSP lanes while the target holds
            result = tune_lanes(graph, table, samples, target_cosine, reference=reference, validation=held,
                                validation_fraction=validation_fraction, margin=margin, z=z, views=views,
                                grid=int4_grid or Int4Grid(), progress=opts.progress)
        else:
            result = run_tuning(
                graph, table, samples, target_cosine, budget_int16=budget_int16, allow_float=allow_float,
                validation=held, reference=reference, validation_fraction=validation_fraction, margin=margin, z=z,
                views=views, progress=opts.progress, workers=choose_workers(opts.workers, samples.expected),
                ray=opts.ray, metric=metric_target)
        # exported (and judged on the validation samples) before anything is written: a failure leaves no file
        qdq = export_checked(result.graph, result.table, qdq_target)
        if not no_check:
            # the tuner's last score is of this graph and table (the lanes' of a graph with more Requantize nodes)
            integer = (result.score if scheme == DEFAULT_SCHEME
                       else result.validation.cosine(result.graph, result.table))
            result.verdict = judge(result.graph, result.table, qdq.model, result.validation, result.goal, integer,
                                   qdq.target)
            if not result.verdict.reached and result.goal.reaches(integer):  # the QDQ model alone fell short
                result, qdq = _delivered(result, qdq, qdq_target)
            qdq.check = result.verdict.check  # its warnings end the summary
    out_dir.mkdir(parents=True, exist_ok=True)
    tuned = result.table
    if tuned.options.adjusted_model is not None or scheme == INT4_DSP_SCHEME:  # the weights (biases
        # re-corrected) and the Requantize nodes of the 4-bit lanes move with the table
        _, relative, digest = save_adjusted(result.graph.model, tuned_path)
        tuned.options = dataclasses.replace(tuned.options, adjusted_model=relative, adjusted_sha256=digest)
    result.table_path = save_quant_table(tuned, tuned_path)
    result.qdq_path, result.qdq_target, result.qdq_check = write_model(qdq.model, qdq_path), qdq.target, qdq.check
    result.record_path = out_dir / f"{stem}.tune.json"
    result.record_path.write_text(json.dumps({"model": str(model), "quant": str(table_path), "tuned": str(tuned_path),
                                              "qdq": str(result.qdq_path), "qdq_target": result.qdq_target,
                                              "inputs": loaded.inputs, **result.to_dict()}, indent=1) + "\n",
                                  encoding="utf-8")
    return result


def _delivered(result, qdq, qdq_target: str):
    """`result` and its QDQ export, or the first of its `fallbacks` (more 16-bit tensors, each reaching the goal
    on every validation photo in the integer graph) whose QDQ model reaches the goal too, saying why."""
    from ptq.qdq.output import export_checked  # reason: as in `tune`
    from ptq.tuning.verdict import judge  # reason: as in `tune`

    for fallback in result.fallbacks():
        exported = export_checked(fallback.graph, fallback.table, qdq_target)
        verdict = judge(fallback.graph, fallback.table, exported.model, fallback.validation, fallback.goal,
                        fallback.score, exported.target)
        if verdict.reached:
            fallback.verdict = verdict
            fallback.fell_back = (f"delivered the table with {len(fallback.int16_tensors)} 16-bit tensors: the QDQ "
                                  f"model of the one with {len(result.int16_tensors)} fell short ("
                                  f"{'; '.join(result.verdict.shortfalls())})")
            return fallback, exported
    return result, qdq


def _metric_target(max_accuracy_drop: Optional[float], metric: Optional[Callable], max_drop: Optional[float]):
    """The metric target of `ptq.tune` (None: none): top-1 accuracy, or the user's metric."""
    from ptq.tuning.metric import MetricTarget, accuracy_target

    if metric is None and max_drop is not None:
        raise ValueError("max_drop is the most metric= may drop: give metric= too (or --max-accuracy-drop)")
    if metric is not None and max_accuracy_drop is not None:
        raise ValueError("give either --max-accuracy-drop or metric= (with max_drop=), not both")
    if metric is not None:
        if max_drop is None:
            raise ValueError("metric= needs max_drop=: the most the metric may drop below the float model's")
        name = getattr(metric, "__name__", "")
        return MetricTarget(metric, max_drop, name if name and not name.startswith("<") else "metric")
    return None if max_accuracy_drop is None else accuracy_target(max_accuracy_drop)


def _trusted_labels(samples: ImageSet, graph: Graph):
    """The labels of `samples` for top-1 accuracy: an error when they cannot be trusted (`usable_labels`)."""
    from ptq.data.labels import usable_labels
    from reports.evaluate import class_count

    labels, why = usable_labels(samples.labels, samples.files, class_count(graph, graph.outputs[0]))
    files = samples.files[: samples.expected]
    missing = sum(labels(f) is None for f in files)
    if why is None and missing:
        why = f"{missing} of the {len(files)} samples have no label"
    if why is not None:
        raise ValueError(f"--max-accuracy-drop needs labelled validation samples ({why}): give --labels FILE, or "
                         f"image file names ending in _LABEL (imagenet_00_243.jpg -> 243)")
    return labels


# -------------------------------------------------------------------------------------------- table export

@dataclass
class ExportResult:
    """`ptq.export_table`: the QDQ model written, the target it is stored for, its onnxruntime check (None: not
    run), and what of the table it carries besides 8-bit integers: the nodes kept in float (node -> the tensor
    the table marks float) and the tensors wider than 8 bits."""

    path: Path
    target: str
    check: Optional[QDQCheck]
    float_nodes: dict[str, str]
    wide_tensors: list[str]

    def summary(self) -> str:
        from ptq.qdq.output import summary_lines

        lines = summary_lines(self.path, self.target, self.check)
        if self.float_nodes:
            lines.append(f"{len(self.float_nodes)} node(s) in float (weights and biases kept float): " + ", ".join(
                f"{node} ({tensor!r})" for node, tensor in self.float_nodes.items()))
        if self.wide_tensors:
            lines.append(f"{len(self.wide_tensors)} tensor(s) wider than 8 bits: {', '.join(self.wide_tensors)}")
        return "\n".join(lines)


def export_table(
    model: PathLike,
    *,
    quant: PathLike,
    out: Optional[PathLike] = None,
    qdq_target: str = DEFAULT_TARGET,
    no_check: bool = False,
    **options,
) -> ExportResult:
    """`ptq table export`: the QDQ model of `model` with any quant table `quant` (calibrated, tuned, edited by
    hand or with `ptq table set`), from the adjusted weights when the table records them, stored for
    `qdq_target`, written atomically to `out` (default: beside the table, `<stem>.qdq.onnx`; never over the
    model, the table or its adjusted weights). With samples (`images` or `data`, preprocessed as the table
    records), checked in onnxruntime against the float model as `ptq.calibrate` does, unless `quiet` or
    `no_check`. A table that does not match the model is a one-line error.

    Examples:
        >>> import tempfile, ptq
        >>> cal = ptq.calibrate("examples/efficientnet_lite0.onnx", images="examples/calib", out=tempfile.mkdtemp(),
        ...                     num_images=2, quiet=True)
        >>> result = ptq.export_table("examples/efficientnet_lite0.onnx", quant=cal.table_path,
        ...                           out=cal.table_path.with_name("again.qdq.onnx"), images="examples/calib",
        ...                           num_images=2)
        >>> result.path.name, result.target, result.check.samples, result.float_nodes
        ('again.qdq.onnx', 'ort-cpu', 2, {})
    """
    from ptq.adjust.adjusted_model import load_model_for_table, resolve_adjusted
    from ptq.core.atomic import refuse_to_overwrite
    from ptq.core.graph import load_model
    from ptq.engine.executor import table_float_nodes
    from ptq.qdq.export import check_table_matches
    from ptq.qdq.output import export_checked, sample_feeds, write_model
    from ptq.table.quant_table import load_quant_table
    from ptq.data.image_source import ImageSet

    quiet = bool(options.get("quiet", False))
    opts = _options("export_table", options, labels=False) if set(options) - {"quiet"} else None
    path = Path(out) if out is not None else Path(quant).with_name(f"{_table_stem(Path(quant))}.qdq.onnx")
    with quiet_logging(quiet):
        table = load_quant_table(quant)
        refuse_to_overwrite({"model": model, "quant table": quant, "adjusted model": resolve_adjusted(table, quant)},
                            [path])
        if check_file(path, "--out") and not quiet:
            note_replaced([path])
        graph = load_model_for_table(model, table, quant, note=not quiet)
        check_table_matches(graph, table)
        feeds: list = []
        if opts is not None and not (quiet or no_check):
            samples = ImageSet.from_source(opts.source(table.options.preprocess), None, opts.num_images, opts.seed)
            feeds = sample_feeds(samples, graph)
        reference = load_model(model, table.options.input_shapes).model if feeds else None
        qdq = export_checked(graph, table, qdq_target, reference=reference, feeds=feeds, source="")
    path.parent.mkdir(parents=True, exist_ok=True)
    wide = [name for name, entry in table.tensors.items() if entry.qparams.bits > 8]
    return ExportResult(write_model(qdq.model, path), qdq.target, qdq.check, table_float_nodes(graph, table), wide)
