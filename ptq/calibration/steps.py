"""Calibration as a list of steps, each one object with one interface (as NNCF builds its PTQ pipeline as an
explicit list of algorithms and PPQ chains its passes).

`calibration_steps(options)` builds the list the options ask for, in this order:

    fold BatchNorm -> equalize -> [int4-dsp Requantize nodes] -> range statistics -> ranges (the table)
    -> range search -> input grid -> analytic bias correction -> AdaRound -> bias correction
    -> align with the integer graph

and `run_steps` runs it on a `CalibrationState`: each step's `apply` takes the state and returns the next one
(a new `CalibrationState`; the steps change only what their docstring names). BatchNorm folding runs whenever
a weight adjustment does, so that every adjustment sees the Conv the integer graph runs
(`ptq.adjust.batchnorm_stats`); equalization runs before the statistics (it changes the activations), the corrections after
the table (they correct for its weight grids). `ptq calibrate` (`ptq.calibration.pipeline.calibrate`) runs the
whole list; `ptq tune` (`ptq.tuning.tuner`) runs the range search step on its fit samples and builds its tables
with the same entries (`ptq.calibration.entries`).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterable, Optional, Protocol, Sequence, Union

import numpy as np
import onnx

from calibrators import TensorStatistics, required_stats
from ptq.adjust.batchnorm_stats import ChannelStats
from ptq.calibration import adjustments, int4_dsp
from ptq.calibration.entries import build_table
from ptq.calibration.input_grid import EIGHT_BIT_DATA, MAX_SAMPLES, widen_fine_inputs
from ptq.calibration.range_search import DEFAULT_CANDIDATES as RANGE_SEARCH_CANDIDATES
from ptq.calibration.range_search import candidate_entries, search_ranges
from ptq.calibration.shards import sharded_statistics
from ptq.calibration.statistics import collect_image_statistics, sample_batches
from ptq.core.graph import Graph
from ptq.data.images import ImageLog
from ptq.data.samples import SampleSource, iter_samples
from ptq.engine.clip_ranges import folded_ranges
from ptq.engine.executor import prepare
from ptq.engine.weight_scale_floor import floor_weight_scales
from ptq.data.input_warnings import warn_few_images
from ptq.parallel.workers import QuietLog, choose_workers
from ptq.table.quant_table import CalibrationOptions, QuantTable, TensorEntry

logger = logging.getLogger("ptq.calibration.steps")

ModelSource = Union[str, Path, onnx.ModelProto]


class SampleSupply(Protocol):
    """The calibration samples, read again in the same order by every step that needs them."""

    def batches(self, graph: Graph, batch_size: int) -> Iterable: ...


@dataclass(frozen=True)
class CalibrationSamples:
    """`ptq calibrate`'s samples: image or `--data` files (a `SampleSource`), or an array of samples."""

    source: Union[SampleSource, np.ndarray]
    num_images: Optional[int]
    seed: int

    def batches(self, graph: Graph, batch_size: int) -> Iterable:
        return sample_batches(graph, self.source, self.num_images, batch_size, self.seed)


@dataclass
class CalibrationState:
    """What the steps have made so far. `graph` is the model the table describes (adjusted by the steps);
    `model` the user's model as given, which statistics workers load while no step changed it."""

    graph: Graph
    options: CalibrationOptions
    samples: Optional[SampleSupply] = None
    model: Optional[ModelSource] = None
    input_shapes: Optional[dict] = None
    batchnorm: dict[str, ChannelStats] = field(default_factory=dict)  # BatchNorm statistics by output tensor
    statistics: Optional[dict[str, TensorStatistics]] = None  # of the activations, from the range statistics step
    image_log: Optional[ImageLog] = None  # the samples the statistics used and skipped
    table: Optional[QuantTable] = None
    rounded_weights: dict[str, np.ndarray] = field(default_factory=dict)  # AdaRound's, until bias correction writes them


class CalibrationStep(Protocol):
    name: ClassVar[str]

    def apply(self, state: CalibrationState) -> CalibrationState: ...


def adjusts_model(options: CalibrationOptions) -> bool:
    """The steps change the model (weight adjustments, the int4-dsp scheme's Requantize nodes): calibration then
    writes the adjusted model beside the table (`ptq.adjust.adjusted_model`)."""
    return (options.equalize or options.bias_correction or options.adaround or options.analytic_bias_correction
            or options.scheme == int4_dsp.SCHEME)


@dataclass(frozen=True)
class FoldBatchNorm:
    """BatchNormalizations folded into their Convs; their statistics kept (`state.batchnorm`)."""

    name: ClassVar[str] = "fold BatchNorm"

    def apply(self, state: CalibrationState) -> CalibrationState:
        graph, stats = adjustments.batchnorm_folded(state.graph, state.input_shapes)
        return dataclasses.replace(state, graph=graph, batchnorm=stats)


@dataclass(frozen=True)
class Equalize:
    """Cross-layer equalization (`ptq.adjust.equalize`), the BatchNorm statistics moved with the weights."""

    name: ClassVar[str] = "equalize"

    def apply(self, state: CalibrationState) -> CalibrationState:
        graph, stats = adjustments.equalized(state.graph, state.input_shapes, state.batchnorm)
        return dataclasses.replace(state, graph=graph, batchnorm=stats)


@dataclass(frozen=True)
class Int4DspRequantize:
    """The int4-dsp scheme's Requantize nodes inserted into the model (`ptq.calibration.int4_dsp`)."""

    name: ClassVar[str] = "int4-dsp Requantize nodes"

    def apply(self, state: CalibrationState) -> CalibrationState:
        graph, _copies = int4_dsp.with_requantize(state.graph)
        return dataclasses.replace(state, graph=graph)


@dataclass(frozen=True)
class RangeStatistics:
    """The float run over the samples: every activation's statistics, for the calibrator and, with range
    search, its candidates. `workers` > 1 processes or a Ray cluster (`ray`) collect them in shards with the same
    result (`ptq.calibration.shards`); None picks the number (`ptq.parallel.workers.choose_workers`)."""

    workers: Optional[int] = 1
    ray: Optional[str] = None
    progress: bool = False
    name: ClassVar[str] = "range statistics"

    def apply(self, state: CalibrationState) -> CalibrationState:
        options = state.options
        if not isinstance(state.samples, CalibrationSamples):
            raise TypeError("the range statistics step reads calibration samples (a CalibrationSamples)")
        source = state.samples.source
        needs = required_stats([options.calibrator] + (list(RANGE_SEARCH_CANDIDATES) if options.range_search else []))
        workers = self.workers
        if isinstance(source, SampleSource):  # the default, or a hint when more workers than samples warrant
            workers = choose_workers(workers, len(source.candidates(QuietLog(), options.num_images, options.seed)))
        if ((workers or 1) > 1 or self.ray is not None) and isinstance(source, SampleSource):
            # the workers load the model they are sent: the adjusted one when the steps changed it
            shipped = state.graph.model if adjusts_model(options) else state.model
            stats, log = sharded_statistics(shipped, state.graph, source, needs, num_images=options.num_images,
                                            batch_size=options.batch_size, seed=options.seed,
                                            input_shapes=state.input_shapes, workers=workers, ray=self.ray,
                                            progress=self.progress)
        else:
            stats, log = collect_image_statistics(state.graph, source, needs, num_images=options.num_images,
                                                  batch_size=options.batch_size, seed=options.seed,
                                                  progress=self.progress)
        warn_few_images(len(log.used), len(log.used) + len(log.skipped))
        return dataclasses.replace(state, statistics=stats, image_log=log)


@dataclass(frozen=True)
class Ranges:
    """The quant table from the statistics and the weights (`ptq.calibration.entries`, or the int4-dsp scheme's
    `ptq.calibration.int4_dsp.build_table`)."""

    name: ClassVar[str] = "ranges"

    def apply(self, state: CalibrationState) -> CalibrationState:
        options = state.options
        if options.scheme == int4_dsp.SCHEME:
            table = int4_dsp.build_table(state.graph, state.statistics, options,
                                         folded_ranges(state.graph) if options.fold_clip else {})
        else:
            table = build_table(state.graph, state.statistics, options)
        return dataclasses.replace(state, table=table)


def with_activation_entries(state: CalibrationState, tensors: dict) -> CalibrationState:
    """`state` with its table's entries `tensors` after a step changed activation grids: the weight scale floors
    (dead channels, int32 biases; `ptq.engine.weight_scale_floor`) raised for the scales they now hold (a finer
    input or a clipped range lowers s_x). Raising only: where the floors held, nothing changes."""
    floor_weight_scales(state.graph, tensors, state.options)
    return dataclasses.replace(state, table=dataclasses.replace(state.table, tensors=tensors))


@dataclass(frozen=True)
class RangeSearch:
    """Each activation's range chosen among the candidates' by its consumers' output error on the samples
    (`ptq.calibration.range_search`); a tensor at another width than the table's activations (16 bits after
    tuning, the int4-dsp scheme's 8-bit tensors) keeps its entry."""

    candidates: Sequence[str] = RANGE_SEARCH_CANDIDATES
    name: ClassVar[str] = "range search"

    def apply(self, state: CalibrationState) -> CalibrationState:
        table = state.table
        candidates = candidate_entries(state.graph, state.statistics, table.options, self.candidates)
        chosen, log = search_ranges(state.graph, candidates, state.samples.batches(state.graph, 1))
        logger.info("%s", log.summary())
        tensors = dict(table.tensors)
        tensors.update({n: e for n, e in chosen.items() if tensors[n].qparams.bits == table.options.bits})
        return with_activation_entries(state, tensors)


@dataclass(frozen=True)
class InputGrid:
    """Graph inputs whose calibration samples are finer than 8-bit data at 16 bits
    (`ptq.calibration.input_grid`)."""

    name: ClassVar[str] = "input grid"

    def apply(self, state: CalibrationState) -> CalibrationState:
        if state.samples is None:
            return state
        tensors = dict(state.table.tensors)
        widened = widen_fine_inputs(state.graph, tensors, self.first_samples(state), state.options)
        for wide in widened:
            logger.info("%s: %s", wide.tensor, wide.why)
        return with_activation_entries(state, tensors)

    @staticmethod
    def first_samples(state: CalibrationState) -> Iterable:
        """The first samples the statistics used: of image or `--data` files only those read then, so a file
        skipped there is not read (nor reported) again."""
        samples = state.samples
        if isinstance(samples, CalibrationSamples) and isinstance(samples.source, SampleSource) \
                and state.image_log is not None:
            reader = samples.source.format.reader(state.graph)
            return (feeds for _, feeds in iter_samples(state.image_log.used[:MAX_SAMPLES], reader, ImageLog()))
        return samples.batches(state.graph, state.options.batch_size)


@dataclass(frozen=True)
class AnalyticBiasCorrection:
    """Biases corrected for the table's weight rounding from the BatchNorm statistics
    (`ptq.adjust.analytic_bias_correction`)."""

    name: ClassVar[str] = "analytic bias correction"

    def apply(self, state: CalibrationState) -> CalibrationState:
        graph = adjustments.analytic_corrected(state.graph, state.table, state.batchnorm, state.input_shapes)
        return dataclasses.replace(state, graph=graph)


@dataclass(frozen=True)
class AdaRound:
    """Each weight's rounding onto the table's grid learned (`ptq.adjust.adaround`). With `defer_write` the
    learned weights wait in `state.rounded_weights` for the bias correction step, which corrects for them
    against the float weights and writes both; without, they are written into the graph here."""

    defer_write: bool = False
    name: ClassVar[str] = "AdaRound"

    def apply(self, state: CalibrationState) -> CalibrationState:
        learned = adjustments.adarounded(state.graph, state.table,
                                         state.samples.batches(state.graph, state.options.batch_size))
        if self.defer_write:
            return dataclasses.replace(state, rounded_weights=learned)
        graph = adjustments.with_rounded_weights(state.graph, learned, state.input_shapes)
        return dataclasses.replace(state, graph=graph)


@dataclass(frozen=True)
class BiasCorrection:
    """Biases corrected for the mean shift the weight rounding (the table's, or AdaRound's
    `state.rounded_weights`) causes on the samples (`ptq.adjust.bias_correction`)."""

    name: ClassVar[str] = "bias correction"

    def apply(self, state: CalibrationState) -> CalibrationState:
        graph = adjustments.bias_corrected(state.graph, state.table,
                                           state.samples.batches(state.graph, state.options.batch_size),
                                           state.rounded_weights, state.input_shapes)
        return dataclasses.replace(state, graph=graph, rounded_weights={})


def align_with_integer_graph(graph: Graph, table: QuantTable) -> list[str]:
    """Give activations the qparams the integer graph fixes by rule, in place; returns the tensors changed.

    Some op rules override the calibrated proposal for their output (layout ops, MaxPool and nearest Resize
    move codes and keep their input's qparams). Writing those final qparams into the table makes the QDQ model
    describe the grid the integer executor computes on. A graph the executor cannot prepare keeps the
    calibrated qparams, with a warning.
    """
    try:
        final = prepare(graph, table).qparams
    except ValueError as exc:  # QuantizationError, ExecutorError
        logging.getLogger("ptq.calibration.pipeline").warning(
            "the integer graph could not be prepared (%s); the table keeps the calibrated qparams", exc)
        return []
    changed = []
    for name, entry in table.tensors.items():
        qp = final.get(name)
        if entry.kind == "activation" and qp is not None and qp != entry.qparams:
            lo, hi = qp.real_range()
            table.tensors[name] = TensorEntry("activation", entry.calibrator, lo, hi, qp, why=entry.why)
            changed.append(name)
    return changed


@dataclass(frozen=True)
class AlignWithIntegerGraph:
    """The qparams the integer graph fixes by rule written into the table (`align_with_integer_graph`)."""

    name: ClassVar[str] = "align with the integer graph"

    def apply(self, state: CalibrationState) -> CalibrationState:
        table = dataclasses.replace(state.table, tensors=dict(state.table.tensors))
        align_with_integer_graph(state.graph, table)
        return dataclasses.replace(state, table=table)


def calibration_steps(options: CalibrationOptions, *, align: bool = True,
                      statistics: RangeStatistics = RangeStatistics()) -> list[CalibrationStep]:
    """The steps `options` ask for, in the order of the module docstring. `align`: end with
    `AlignWithIntegerGraph`; `statistics`: where the float run over the samples happens."""
    if options.bias_correction and options.analytic_bias_correction:
        raise ValueError("choose one bias correction: empirical (on the images) or analytic (BatchNorm statistics)")
    steps: list[CalibrationStep] = []
    if options.equalize or options.bias_correction or options.adaround or options.analytic_bias_correction:
        steps.append(FoldBatchNorm())
    if options.equalize:
        steps.append(Equalize())
    if options.scheme == int4_dsp.SCHEME:
        steps.append(Int4DspRequantize())
    steps += [statistics, Ranges()]
    if options.range_search:
        steps.append(RangeSearch())
    if options.scheme != int4_dsp.SCHEME and options.bits == EIGHT_BIT_DATA:
        steps.append(InputGrid())
    if options.analytic_bias_correction:
        steps.append(AnalyticBiasCorrection())
    if options.adaround:
        steps.append(AdaRound(defer_write=options.bias_correction))
    if options.bias_correction:
        steps.append(BiasCorrection())
    if align:
        steps.append(AlignWithIntegerGraph())
    return steps


def run_steps(steps: Sequence[CalibrationStep], state: CalibrationState) -> CalibrationState:
    for step in steps:
        logger.debug("calibration step: %s", step.name)
        state = step.apply(state)
    return state
