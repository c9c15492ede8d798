"""`tune`: change a quant table step by step until the logits cosine on *validation* samples reaches a target.

The tuning samples are split (`ptq.tuning.data`): what is estimated from data (activation statistics, bias
correction's mean input patches, the bottleneck ranking) comes from the fit part; every decision (keep a
step, stop, prune) is taken on the validation part, against the user's float model, each validation photo
with its label-free views (`ptq.data.views`). The target is reached when the validation mean minus `z` standard
errors over the photos is at least `target + margin` (`ptq.tuning.data`: what that bound estimates and why
over photos). Candidates, in order of expected gain per cost, each kept only if it raises the validation
mean by at least `min_gain`:

1. per-channel weights (when the table is per-tensor): free at run time on most accelerators;
2. a better activation range: every activation recalibrated with each of `range_calibrators` on the fit
   samples (one statistics pass), then each activation's own choice by the per-tensor search
   (`ptq.calibration.range_search`, with `range_search`), the best kept. No percentile for the whole graph: a tail
   fitted to a few images clips others;
3. 16 bits, within `budget_int16` tensors (activations and weights count alike; None: no limit, as the
   fewest that keep the target are searched once it is reached, item 5), groups first: the outputs
   of all depthwise Convs, then every activation, then the weights of all depthwise Convs, then every other
   weight (measured on the bundled model, 7 validation photos with their views: every activation in 16
   bits 0.9958 -> 0.9984, every weight 0.9965 -> 0.9983, both 0.99996; `minimize` then keeps the fewest of
   them, by tensors or by whole layers, so the order decides little but the first feasible set); then, when
   a group does not fit the budget, single activations in the order of the report's bottleneck ranking. A
   16-bit activation takes its extrema range on the fit samples (`wide_activations`), not the range step's
   clipped one;
4. float, a layer at a time in the ranking's order, only with `allow_float` > 0 (the last resort); the tuned
   table marks the kept ones float (`"float": true`), so it runs them in float by itself;
5. once the target is reached, the fewest 16-bit tensors that keep it (`minimize`), by two routes, the one
   with fewer 16-bit tensors kept: (a) the tensors the steps moved, ordered by the bottleneck ranking of the
   8-bit layers (isolated errors on the fit samples: the layers that lose most first), the shortest head of
   that order that still reaches the goal, the others back at their 8-bit entries; (b) the shortest head of
   the layers (each its output and its weight) in the ranking's order, searched only among the heads that
   keep fewer 16-bit tensors than (a) did: from the longest of them in 16 bits (`layer_head`; when it does not
   reach, no shorter one does, and (b) costs that one pass). A head is
   found by bisection on its length: log2(n) validation passes rather than n, and the shortest one when
   reaching the goal is monotone in the length (more 16-bit tensors, less error; otherwise a head that
   reaches, not always the shortest). The unit that ends a head is needed (the head without it did not
   reach) whatever its rank, so the bisection is run again with it moved first (`shortest_head`, up to
   `REFINE_ROUNDS` times): a ranking that misplaces one needed layer costs a few passes, not every layer
   ranked before it. Route (b) helps when the error left is the weights' rounding (16-bit weights on the
   layers that lose most may do with fewer tensors than every activation). With enough validation photos
   the bisections decide each head on the hardest photos, the others predicted (`ptq.tuning.screen`), and
   the head they end with is verified on every photo, a full bisection from the start when it falls short
   (`shortest_head`): the goal is always checked on all the validation samples.

A table calibrated with bias correction has biases corrected for its weight grids; a step that changes a
weight's grid (per-channel, 16 bits, and the undoing in `minimize`) re-corrects that layer's bias for the new
grid (`ptq.adjust.bias_correction.recorrected_biases`), so the tuned graph is returned with the tuned table.

The passes over samples (the statistics, the ranking, each candidate's validation cosines) run in this
process, or with `workers` > 1 or `ray` on a pool (`ptq.tuning.shards`) with the same result bit for bit.
A candidate's validation pass scores the photos hardest first (by the first, full pass) and stops as soon as
no cosines of the photos left could make it pass its rule (keep: the mean gains `min_gain`; undo: the goal is
still reached), the same decision as the full pass (`ptq.tuning.early_stop`); a pass that is not stopped is
the full pass bit for bit. Each sample's integer run resumes after the steps the candidate shares with a
pass kept before (`ptq.tuning.prefix_cache`), with the same outputs bit for bit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from onnx import numpy_helper

from ops.registry import channel_groups, layer_kind
from ptq.adjust.bias_correction import CORRECTED_LAYERS, mean_patches, recorrected_biases
from ptq.calibration.adjustments import with_initializers
from ptq.core.graph import Graph
from ptq.core.roles import LayerKind
from ptq.engine.fused_layers import fused_output
from ptq.engine.executor import prepare
from ptq.engine.threads import usable_cores
from ptq.qdq.check import QDQCheck
from ptq.qdq.output import summary_lines
from ptq.table.quant_table import QuantTable
from ptq.calibration.entries import activation_entries, weight_entries
from ptq.calibration.range_search import DEFAULT_CANDIDATES as RANGE_SEARCH_CANDIDATES
from ptq.calibration.steps import CalibrationState, RangeSearch
from ptq.table.edit import with_float
from ptq.tuning.defaults import DEFAULT_MARGIN, DEFAULT_VALIDATION_FRACTION, DEFAULT_VIEWS, DEFAULT_Z
from ptq.tuning.data import FitSamples, Samples, Score, Validation, fit_statistics, split_samples
from ptq.tuning.early_stop import PassRule, hardest_first
from ptq.tuning.export_alignment import aligned_for_export
from ptq.tuning.goal import Goal
from ptq.tuning.metric import MetricTarget
from ptq.tuning.screen import Screen
from ptq.tuning.shards import TunePool
from ptq.engine.weight_scale_floor import floor_weight_scales
from reports.build import build_report
from reports.evaluate import evaluate
from reports.layer_nodes import float_node_names
from reports.tables import with_bits

if TYPE_CHECKING:
    from ptq.tuning.verdict import Verdict

logger = logging.getLogger("ptq.tune")

DEFAULT_RANGE_CALIBRATORS = ("mse", "kld")
RANKING_IMAGES = 8  # images of the isolated per-layer pass that ranks the bottlenecks
REFINE_ROUNDS = 2  # bisections again with a needed unit moved first (`_Tuner.shortest_head`)


@dataclass
class TuneStep:
    change: str  # what was tried, e.g. "per-channel weights", "int16: <tensor>"
    cosine: float  # the validation cosine measured with the change
    gain: float  # over the cosine before it
    kept: bool
    int16: list[str] = field(default_factory=list)  # tensors this step moved to 16 bits
    float_layers: list[str] = field(default_factory=list)
    scored: Optional[int] = None  # photos scored when the pass stopped, the step out of reach (None: all)
    screened: bool = False  # decided on the `scored` hardest photos (`ptq.tuning.screen`), verified later

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TuneResult:
    """`ptq.tune`: the tuned table, the validation score before and after, and every step tried.

    Attributes:
        table: the tuned quantization table.
        baseline: the starting table's validation score (mean cosine and its standard error).
        score: the tuned table's validation score.
        target: the target cosine (`target_cosine`; None: none), reached when `score`'s mean minus `z` standard
            errors is at least target + margin.
        metric_target: the target on the user's metric (`ptq.tuning.metric`; None: none).
        steps: every step tried, kept or dropped, with its validation cosine and gain.
        int16_tensors: the tensors the tuned table holds in 16 bits.
        float_nodes: the nodes it runs in float.
        table_path: where the tuned table was written.
        record_path: where `<stem>.tune.json` (the steps) was written.
        qdq_path: where the tuned table's QDQ model was written.
        qdq_check: its two onnxruntime figures, the verdict's mean validation cosines (None: not run).
        verdict: the QDQ model written and the integer graph judged on the validation samples
            (`ptq.tuning.verdict`; None: the QDQ model was not judged).
        cosine: the tuned validation cosine (`score`'s mean).
        reached: whether the goal was reached on the validation samples by the integer graph and, once judged,
            by the QDQ model written, optimizations off and on (`verdict`).
    """

    table: QuantTable
    graph: Graph  # the graph the table runs with (biases re-corrected when weight grids changed)
    baseline: Score
    score: Score  # on the validation samples
    target: Optional[float]
    margin: float
    z: float
    validation_samples: int  # photos (or samples), each with `views` views
    steps: list[TuneStep]
    int16_tensors: list[str]
    float_nodes: list[str]
    table_path: Optional[Path] = None  # where `ptq.tune` wrote the tuned table and the record of the steps
    record_path: Optional[Path] = None
    qdq_path: Optional[Path] = None  # the QDQ model `ptq.tune` exported from the tuned table and graph
    qdq_target: Optional[str] = None
    qdq_check: Optional[QDQCheck] = None  # its onnxruntime check (None: not run)
    views: list[str] = field(default_factory=list)  # of each validation photo (`ptq.data.views`); none: samples as read
    metric_target: Optional[MetricTarget] = None
    verdict: Optional["Verdict"] = None
    validation: Optional[Validation] = field(default=None, repr=False)  # the samples decided on, for the verdict
    # entries aligned with the integer run for the QDQ model (`ptq.tuning.export_alignment`)
    export_aligned: list[str] = field(default_factory=list)
    # the tables `minimize` passed through, each reaching the goal on every validation photo with more 16-bit
    # tensors, fewest first, built when asked: what `ptq.tune` delivers instead when the QDQ model of this one
    # falls short (`fell_back`)
    fallbacks: Callable[[], Iterator["TuneResult"]] = field(default=lambda: iter(()), repr=False)
    fell_back: str = ""  # why this table was delivered instead of the one with fewer 16-bit tensors ("": it was not)

    @property
    def cosine(self) -> float:
        return self.score.mean

    @property
    def goal(self) -> Goal:
        return Goal(self.target, self.margin, self.z, self.metric_target)

    @property
    def reached(self) -> bool:
        return self.verdict.reached if self.verdict is not None else self.goal.reaches(self.score)

    @property
    def int16_activations(self) -> list[str]:
        return [n for n in self.int16_tensors if self.table.tensors[n].kind == "activation"]

    def to_dict(self) -> dict:
        metric = self.score.metric
        return {"target_cosine": self.target, "margin": self.margin, "z": self.z,
                "max_metric_drop": self.metric_target.max_drop if self.metric_target is not None else None,
                "validation_samples": self.validation_samples, "views": self.views,
                "baseline_cosine": self.baseline.mean,
                "cosine": self.cosine, "cosine_sem": self.score.sem, "reached": self.reached,
                "baseline_metric": self.baseline.metric.to_dict() if self.baseline.metric is not None else None,
                "metric": metric.to_dict() if metric is not None else None,
                "verdict": self.verdict.to_dict() if self.verdict is not None else None,
                "int16_tensors": self.int16_tensors, "export_aligned": self.export_aligned, "fell_back": self.fell_back,
                "float_nodes": self.float_nodes, "steps": [s.to_dict() for s in self.steps]}

    def summary(self) -> str:
        held = (f"{self.validation_samples} held-out photos x {len(self.views)} views" if self.views
                else f"{self.validation_samples} held-out samples")
        integer = "the integer graph reaches it" if self.goal.reaches(self.score) else "the integer graph falls short"
        lines = [f"validation cosine ({held}) {self.baseline.mean:.5f} -> "
                 f"{self.cosine:.5f} +- {self.score.sem:.5f} ({self.goal.describe(self.score)}: {integer})"]
        if self.baseline.metric is not None:
            start, end = self.baseline.metric, self.score.metric
            unit = "photo" if start.samples != start.photos else "sample"
            lines.append(f"validation {start.name} {start.over()} (coarse: one {unit} is {1 / start.photos:.3f}): "
                         f"{start.value:.4f} -> {end.value:.4f}, float model {end.reference:.4f}")
        for s in self.steps:
            lines.append(f"  {'kept   ' if s.kept else 'dropped'} {s.change}: {s.cosine:.5f} ({s.gain:+.5f})"
                         + stopped_note(s.scored, self.validation_samples, s.screened))
        acts = len(self.int16_activations)
        lines.append(f"{len(self.int16_tensors)} tensor(s) in 16 bits ({acts} activations, "
                     f"{len(self.int16_tensors) - acts} weights), {len(self.float_nodes)} node(s) in float")
        if self.export_aligned:
            lines.append(f"{len(self.export_aligned)} entr{'y' if len(self.export_aligned) == 1 else 'ies'} the "
                         f"integer run fixes by rule or fuses away aligned with it for the QDQ model: "
                         f"{', '.join(self.export_aligned)}")
        if self.fell_back:
            lines.append(self.fell_back)
        lines += summary_lines(self.qdq_path, self.qdq_target, None)
        if self.verdict is not None:
            lines += self.verdict.lines()
        else:
            missed = self.goal.shortfalls(self.score)
            unchecked = " (the QDQ model written was not checked)" if self.qdq_path is not None else ""
            lines.append(f"target NOT reached: the integer graph: {'; '.join(missed)}" if missed else
                         f"target reached by the integer graph{unchecked}")
        return "\n".join(lines)


def with_biases(graph: Graph, biases: dict) -> Graph:
    """`graph` with the named initializers (re-corrected biases) replaced, in its model and as the values a
    reload of that model reads; its nodes, shapes and everything else unchanged, not reloaded."""
    model = with_initializers(graph.model, biases)
    stored = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer if init.name in biases}
    return dataclasses.replace(graph, model=model, initializers={**graph.initializers, **stored})


def stopped_note(scored: Optional[int], photos: int, screened: bool = False) -> str:
    """`, stopped after k of n photos: out of reach` for a pass stopped early (`ptq.tuning.early_stop`), `, screened
    on the k hardest of n photos` for a screened one (`ptq.tuning.screen`)."""
    if scored is None:
        return ""
    return (f", screened on the {scored} hardest of {photos} photos" if screened else
            f", stopped after {scored} of {photos} photos: out of reach")


def per_channel_weights(graph: Graph, table: QuantTable) -> QuantTable:
    """The table with every weight recalibrated per output channel (activations untouched)."""
    options = dataclasses.replace(table.options, per_channel=True)
    tensors = dict(table.tensors)
    tensors.update(weight_entries(graph, options))
    floor_weight_scales(graph, tensors, options)
    return dataclasses.replace(table, options=options, tensors=tensors)


def recalibrated(graph: Graph, table: QuantTable, stats, calibrator: str) -> QuantTable:
    """The table with every activation's range from `calibrator` on `stats` (16-bit tensors stay 16-bit)."""
    options = dataclasses.replace(table.options, calibrator=calibrator)
    entries = activation_entries(graph, stats, options)
    tensors = dict(table.tensors)
    wide = [n for n, e in table.tensors.items() if e.kind == "activation" and e.qparams.bits != options.bits]
    tensors.update(entries)
    result = with_bits(dataclasses.replace(table, tensors=tensors), wide, 16) if wide else \
        dataclasses.replace(table, tensors=tensors)
    return with_float(result, table.float_tensors())


class InProcess:
    """The passes over samples run here (`sample_passes`); `ptq.tuning.shards.TunePool` is the pool's."""

    scorer = None  # the validation cosines: `Validation.cosines` itself

    @staticmethod
    def statistics(graph: Graph, fit: Samples, calibrators: Sequence[str]) -> dict:
        return fit_statistics(graph, fit, calibrators)

    @staticmethod
    def evaluate(graph: Graph, table: QuantTable, samples: Samples, **kwargs):
        return evaluate(graph, table, samples, **kwargs)


def sample_passes(graph: Graph, table: QuantTable, fit: Samples, validation: Validation, *, workers: int = 1,
                  ray: Optional[str] = None):
    """A context manager giving the passes over samples: `InProcess`, or with `workers` > 1 or `ray` a pool
    whose workers serve every pass (`ptq.tuning.shards.TunePool`)."""
    if workers == 1 and ray is None:
        return contextlib.nullcontext(InProcess())
    return TunePool(graph, fit, validation, table.options.input_shapes, workers=workers, ray=ray)


def searched_table(state: _State, stats: dict, fit: Samples) -> QuantTable:
    """The table with each 8-bit activation's range from calibration's range search step
    (`ptq.calibration.steps.RangeSearch`) on the fit samples."""
    searched = RangeSearch().apply(CalibrationState(state.graph, state.table.options, FitSamples(fit),
                                                    table=state.table, statistics=stats))
    return searched.table


def _depthwise(graph: Graph) -> list:
    """The grouped convolutions (group > 1: depthwise on the models ptq meets)."""
    return [n for n in graph.nodes if layer_kind(n) is LayerKind.CONVOLUTION and channel_groups(n) > 1]


def depthwise_outputs(graph: Graph) -> list[str]:
    """The tensors the depthwise Convs write once fused (`ptq.engine.fused_layers.fused_output`)."""
    consumers = graph.consumers()
    return [fused_output(graph, node, consumers) for node in _depthwise(graph)]


def depthwise_weights(graph: Graph) -> list[str]:
    return [n.inputs[1] for n in _depthwise(graph) if len(n.inputs) > 1 and n.inputs[1] in graph.initializers]


def with_weight_bits(graph: Graph, table: QuantTable, weights: Sequence[str], bits: int) -> QuantTable:
    """The table with the listed weights recalibrated at `bits` (same calibrator, granularity, symmetry)."""
    options = dataclasses.replace(table.options, weight_bits=bits)
    entries = weight_entries(graph, options)
    tensors = dict(table.tensors)
    tensors.update({w: entries[w] for w in weights})
    floor_weight_scales(graph, tensors, table.options)
    return dataclasses.replace(table, tensors=tensors)


def wide_activations(graph: Graph, table: QuantTable, stats: dict, names: Sequence[str], bits: int = 16) -> QuantTable:
    """The table with the listed activations at `bits` on their extrema range over `stats`: a range fitted to
    clip for 8 bits (mse, kld, the search) would keep its clipping error at 16 bits, where rounding costs
    256 times less and clipping values no fit image reached is the only error left."""
    options = dataclasses.replace(table.options, calibrator="extrema")
    entries = activation_entries(graph, stats, options)
    tensors = dict(table.tensors)
    tensors.update({n: entries[n] for n in names})
    return with_bits(dataclasses.replace(table, tensors=tensors), names, bits)


def layer_outputs(graph: Graph) -> dict[str, str]:
    """Weight -> the tensor its layer writes once fused (`ptq.engine.fused_layers.fused_output`), the name the
    bottleneck ranking gives the layer."""
    consumers = graph.consumers()
    out = {}
    for node in graph.nodes:
        for w in node.inputs[1:2]:
            if w in graph.initializers:
                out[w] = fused_output(graph, node, consumers)
    return out


def by_ranking(names: Sequence[str], ranking: Sequence[str], graph: Graph) -> list[str]:
    """`names` most useful in 16 bits first: by the ranking's position of the tensor (a weight: of its layer's
    output), activations before weights at equal position, the unranked last in their given order."""
    position = {n: k for k, n in enumerate(ranking)}
    layer = layer_outputs(graph)

    def key(item):
        k, name = item
        return (position.get(layer.get(name, name), len(position)), name in layer, k)

    return [n for _, n in sorted(enumerate(names), key=key)]


def layer_units(graph: Graph, table: QuantTable, ranking: Sequence[str]) -> list[list[str]]:
    """The layers as 16-bit units, the ranking's order (the unranked last, in graph order): each the tensor
    the layer writes (its name in the ranking) with the weight of the layer, those of them in `table`."""
    weight_of = {out: w for w, out in layer_outputs(graph).items()
                 if w in table.tensors and table.tensors[w].kind == "weight"}
    names = list(dict.fromkeys(list(ranking) + [n for n, e in table.tensors.items() if e.kind == "activation"]))
    units = []
    for name in names:
        unit = [n for n in (name, weight_of.get(name)) if n is not None and n in table.tensors]
        if unit:
            units.append(unit)
    return units


@dataclass
class _State:
    table: QuantTable
    graph: Graph
    score: Score
    int16: list[str] = field(default_factory=list)
    float_layers: list[str] = field(default_factory=list)


class _Tuner:
    """The search of the module docstring over one graph, table and split of the samples."""

    def __init__(self, graph: Graph, table: QuantTable, fit: Samples, validation: Validation, goal: Optional[float],
                 z: float, min_gain: float, passes=None, metric: Optional[MetricTarget] = None):
        """`goal`: the bound the validation cosine must reach (target + margin; None: no cosine target);
        `metric`: the target on the user's metric (None: none)."""
        self.fit, self.validation, self.min_gain = fit, validation, min_gain
        self.aim = Goal(goal, 0.0, z, metric)  # the margin is in `goal` already
        self.passes = passes or InProcess()  # where the passes over the fit samples run (`sample_passes`)
        self.original = table
        self.steps: list[TuneStep] = []
        self._patches: Optional[dict] = None
        self._shifts: dict = {}  # the layers' bias shifts between grids, as computed (`recorrected_biases`)
        self.stats: Optional[dict] = None  # activation statistics of the fit samples, once collected
        self.saved: dict = {}  # the entry each 16-bit tensor had before it was widened
        self.state = _State(table, graph, self.measure(graph, table))
        # states that reach the goal on every photo, as `minimize` passes through them (`TuneResult.fallbacks`)
        self.reached_states: list[_State] = []
        self.order = hardest_first(self.state.score.photo_means)  # the photos every later pass scores first

    def measure(self, graph: Graph, table: QuantTable, float_layers: Sequence[str] = (),
                rule: Optional[PassRule] = None) -> Score:
        """The validation score; with `rule`, stopped once out of its reach (`ptq.tuning.early_stop`)."""
        prepared = prepare(graph, table, memo=self.validation.memo) if float_layers else None
        nodes = float_node_names(prepared, list(float_layers)) if float_layers else []
        if rule is None or not rule.order:  # no photo means from the first pass: no order to stop early in
            return self.validation.cosine(graph, table, nodes)
        return self.validation.cosine(graph, table, nodes, rule=rule)

    def gain_rule(self) -> PassRule:
        """A step is kept when it raises the mean by `min_gain`."""
        return PassRule(self.state.score.mean + self.min_gain, 0.0, self.order)

    def goal_rule(self) -> Optional[PassRule]:
        """The cosine goal is reached when mean - z sem is at least it (None: no cosine target to stop on)."""
        return None if self.aim.bound is None else PassRule(self.aim.bound, self.aim.z, self.order)

    def reaches(self, score: Score) -> bool:
        return self.aim.reaches(score)

    def done(self) -> bool:
        return self.reaches(self.state.score)

    def graph_for(self, table: QuantTable, weights: Sequence[str]) -> Graph:
        """The current graph, its biases re-corrected for `weights` moving to `table`'s grids."""
        if not weights or not self.original.options.bias_correction:
            return self.state.graph
        graph = self.state.graph
        if self._patches is None:  # the layers' mean input patches on the fit samples, once
            layers = [n for n in graph.nodes if layer_kind(n) in CORRECTED_LAYERS and len(n.inputs) > 1
                      and n.inputs[1] in self.original.tensors]
            self._patches = mean_patches(graph, layers, (x for _, x, _ in self.fit.samples(graph)))
        biases = recorrected_biases(graph, self.state.table, table, weights, self._patches, self._shifts)
        return with_biases(graph, biases) if biases else graph

    def attempt(self, change: str, table: QuantTable, int16: Sequence[str] = (), float_layers: Sequence[str] = (),
                weights: Sequence[str] = ()) -> bool:
        """Measure `table` (whose grids differ from the current one's for `weights`); keep it if it gains."""
        state = self.state
        graph = self.graph_for(table, weights)
        score = self.measure(graph, table, state.float_layers + list(float_layers), self.gain_rule())
        gain = score.mean - state.score.mean
        kept = gain >= self.min_gain and score.scored is None
        self.steps.append(TuneStep(change, score.mean, gain, kept, list(int16), list(float_layers), score.scored))
        logger.info("%s: %.5f (%+.5f)%s%s", change, score.mean, gain, "" if kept else ", dropped",
                    stopped_note(score.scored, len(self.order)))
        if kept:
            self.state = _State(table, graph, score, state.int16 + list(int16), state.float_layers + list(float_layers))
        return kept

    def widened(self, names: Sequence[str]) -> tuple[QuantTable, list[str]]:
        """The current table with `names` in 16 bits (activations on their extrema range, see
        `wide_activations`), and the weights among them."""
        acts = [n for n in names if self.original.tensors[n].kind == "activation"]
        weights = [n for n in names if self.original.tensors[n].kind == "weight"]
        table = self.state.table
        for n in names:
            self.saved.setdefault(n, table.tensors[n])
        if acts:
            if self.stats is None:
                self.stats = self.passes.statistics(self.state.graph, self.fit, ["extrema"])
            table = wide_activations(self.state.graph, table, self.stats, acts)
        if weights:
            table = with_weight_bits(self.state.graph, table, weights, 16)
        return table, weights

    def narrowed(self, names: Sequence[str]) -> tuple[QuantTable, list[str]]:
        """The current table with `names` back at the entries they had before they were widened, and the
        weights among them."""
        tensors = dict(self.state.table.tensors)
        tensors.update({n: self.saved[n] for n in names})
        weights = [n for n in names if self.original.tensors[n].kind == "weight"]
        return dataclasses.replace(self.state.table, tensors=tensors), weights

    def undo(self, label: str, names: list[str], screen: Optional[Screen] = None) -> bool:
        """Put `names` back to the original widths if the validation cosine stays at the goal; with `screen`, as
        far as the photos it scores predict (`ptq.tuning.screen`)."""
        table, weights = self.narrowed(names)
        graph = self.graph_for(table, weights)
        rule = self.goal_rule()
        if screen is not None and rule is not None:
            rule = dataclasses.replace(rule, order=screen.order[:screen.photos])
        score = self.measure(graph, table, self.state.float_layers, rule)
        if score.screened:
            kept = self.reaches(screen.predicted(score))
        else:
            kept = self.reaches(score) and score.scored is None
        bits = f"{self.original.options.bits}/{self.original.options.weight_bits}"
        self.steps.append(TuneStep(f"back to {bits} bits: {label}", score.mean, score.mean - self.state.score.mean, kept,
                                   scored=score.scored, screened=score.screened))
        logger.info("%s: %.5f%s%s", self.steps[-1].change, score.mean, "" if kept else ", kept in 16 bits",
                    stopped_note(score.scored, len(self.order), score.screened))
        if kept:
            self.state = _State(table, graph, score, [n for n in self.state.int16 if n not in names],
                                self.state.float_layers)
        return kept

    def bisect(self, units: Sequence[Sequence[str]], label: str, screen: Optional[Screen] = None,
               low: Optional[int] = None) -> int:
        """The shortest head of `units` (groups of 16-bit tensors, most useful first) that keeps the goal, the
        rest back at their entries before widening, by bisection on its length (`high` units reach it, `low`
        do not: try the middle); returns its length. The current state has every unit in 16 bits; without
        float layers, no unit did not reach (`low`: a head known not to reach). `screen`: each head decided
        on its photos (`ptq.tuning.screen`)."""
        if low is None:
            low = -1 if self.state.float_layers else 0
        high = len(units)
        while high - low > 1:
            mid = (low + high) // 2
            names = [n for unit in units[mid:high] for n in unit]
            if self.undo(f"all but the {mid} most useful of {len(units)} {label}", names, screen):
                high = mid
            else:
                low = mid
        return high

    def shortest_head(self, units: Sequence[Sequence[str]], label: str) -> None:
        """`refined_head` with each head screened on the hardest photos (`ptq.tuning.screen`), then the head it
        ends with measured on every photo: when that does not reach, the bisection again from the state it
        started from with full passes, between that head and all units, in the order it ended with."""
        start = self.state
        screen = Screen.of(start.score.photo_means, self.order) if self.goal_rule() is not None else None
        order, high = self.refined_head(units, label, screen)
        order += [unit for unit in units if unit not in order]  # the units a first bisection put back: the tail
        if self.state is start or screen is None:
            return
        score = self.measure(self.state.graph, self.state.table, self.state.float_layers, self.goal_rule())
        reached = self.reaches(score) and score.scored is None
        bits = f"{self.original.options.bits}/{self.original.options.weight_bits}"
        self.steps.append(TuneStep(f"back to {bits} bits, verified on every photo: all but the {high} most useful of "
                                   f"{len(order)} {label}", score.mean, score.mean - start.score.mean, reached,
                                   scored=score.scored))
        logger.info("%s: %.5f%s%s", self.steps[-1].change, score.mean, "" if reached else ", short of the goal",
                    stopped_note(score.scored, len(self.order)))
        if reached:
            self.state = dataclasses.replace(self.state, score=score)
            return
        self.state = start
        self.bisect(order, f"{label}, on every photo", low=high)

    def refined_head(self, units: Sequence[Sequence[str]], label: str,
                     screen: Optional[Screen] = None) -> tuple[list, int]:
        """`bisect`, then up to `REFINE_ROUNDS` times again with the head's last unit moved to the front (after
        those moved before): with the head one shorter the goal was not reached, so that unit is needed
        more than its rank says, and a head led by it may be shorter. Each round keeps the state it ends in,
        which reaches the goal; the rounds stop when the head does not shrink. Returns the units in the order
        of the last round kept and the length of the head kept."""
        units = list(units)
        high = self.bisect(units, label, screen)
        for pinned in range(REFINE_ROUNDS):
            if high - pinned < 2:
                break
            order = units[:pinned] + [units[high - 1]] + units[pinned:high - 1]
            shorter = self.bisect(order, f"{label}, {pinned + 1} moved first", screen)
            if shorter >= high:
                break
            units, high = order, shorter
        return units, high

    def minimize(self, ranking: Sequence[str]) -> None:
        """Module docstring, item 5: the tensors the steps moved, and the layers, each bisected in the
        ranking's order; the fewer 16-bit tensors kept. The layers are tried only as far as they can keep
        fewer: from the longest head of them with fewer 16-bit tensors than the first route kept (the
        others 8-bit), not from every layer (`layer_head`)."""
        graph = self.state.graph
        self.reached_states.append(self.state)
        self.shortest_head([[n] for n in by_ranking(self.state.int16, ranking, graph)], "16-bit tensors")
        self.reached_states.append(self.state)
        units = layer_units(graph, self.original, ranking)
        head = layer_head(units, self.state.int16)
        if len(units) >= 2 and head and self.head_reaches(units, head):
            self.reached_states.append(self.state)
            self.shortest_head(units[:head], "16-bit layers")

    def head_reaches(self, units: Sequence[Sequence[str]], head: int) -> bool:
        """Measure the first `head` layer units in 16 bits, the other units' 16-bit tensors back at their entries
        before widening (16-bit tensors outside every unit stay); move there if that reaches the goal."""
        kept = self.state
        covered = {n for unit in units for n in unit}
        wide = [n for unit in units[:head] for n in unit]
        narrow = [n for n in kept.int16 if n in covered and n not in wide]
        table, weights = self.widened([n for n in wide if n not in kept.int16])
        table = dataclasses.replace(table, tensors={**table.tensors, **{n: self.saved[n] for n in narrow}})
        weights += [n for n in narrow if self.original.tensors[n].kind == "weight"]
        graph16 = self.graph_for(table, weights)
        score = self.measure(graph16, table, kept.float_layers, self.goal_rule())
        reached = self.reaches(score) and score.scored is None
        self.steps.append(TuneStep(f"int16: the {head} most useful of {len(units)} layers, to remove layer by layer",
                                   score.mean, score.mean - kept.score.mean, reached, list(wide), scored=score.scored))
        logger.info("%s: %.5f%s", self.steps[-1].change, score.mean, stopped_note(score.scored, len(self.order)))
        if reached:
            self.state = _State(table, graph16, score, [n for n in kept.int16 if n not in narrow] +
                                [n for n in wide if n not in kept.int16], kept.float_layers)
        return reached


def layer_head(units: Sequence[Sequence[str]], int16: Sequence[str]) -> int:
    """The most layer units, from the head of `units`, that keep fewer 16-bit tensors than `int16` (with those
    of `int16` outside every unit, which the layers' route leaves in 16 bits): the layers' route keeps a
    head of them only if it is shorter, and when reaching the goal is monotone in the head's length a
    head at most this long reaches only if this one does."""
    covered = {n for unit in units for n in unit}
    count = len([n for n in int16 if n not in covered])
    head = 0
    for unit in units:
        count += len(unit)
        if count >= len(int16):
            break
        head += 1
    return head


def tune(graph: Graph, table: QuantTable, images: Samples, target: Optional[float], *,
         budget_int16: Optional[int] = None,
         allow_float: int = 0, validation: Optional[Samples] = None, reference: Optional[Graph] = None,
         validation_fraction: float = DEFAULT_VALIDATION_FRACTION, margin: float = DEFAULT_MARGIN, z: float = DEFAULT_Z,
         range_calibrators: Sequence[str] = DEFAULT_RANGE_CALIBRATORS, range_search: bool = True,
         min_gain: float = 1e-5, views: Sequence[str] = DEFAULT_VIEWS, progress: bool = False, workers: int = 1,
         ray: Optional[str] = None, metric: Optional[MetricTarget] = None) -> TuneResult:
    """See the module docstring. `images`: the tuning samples, split into fit and validation parts unless
    `validation` is given (then all of `images` is fitted on). `target`: the target cosine (None: none, with
    `metric`). `reference`: the float model the cosine is
    measured against (default `graph`; pass the user's model when `graph` holds adjusted weights). `views`: the
    views (`ptq.data.views`) each validation image enters with (`ptq.tuning.data`: image files only). `progress`: a
    progress bar per pass over the samples. `workers`, `ray`: where the passes over samples run
    (`sample_passes`; the validation passes run here with a metric). `metric`: a target on the user's metric
    (`ptq.tuning.metric`, `ptq.tuning.goal`), with or instead of the cosine."""
    Goal(target, margin, z, metric)  # a goal at all, before any pass
    if validation is None:
        fit, validation = split_samples(images, validation_fraction)
    else:
        fit = images
    check = Validation.create(reference or graph, validation, progress=progress, views=views, metric=metric)
    with sample_passes(graph, table, fit, check, workers=workers, ray=ray) as passes:
        # passes scored here run their samples on the usable cores (`Validation.run`); the pool's workers one at a time
        here = dataclasses.replace(check, scorer=passes.scorer, threads=usable_cores())
        return _search(graph, table, fit, here, passes, target,
                       budget_int16=len(table.tensors) if budget_int16 is None else budget_int16,
                       allow_float=allow_float, margin=margin, z=z,
                       range_calibrators=range_calibrators, range_search=range_search, min_gain=min_gain,
                       views=views, progress=progress, metric=metric)


def _search(graph: Graph, table: QuantTable, fit: Samples, check: Validation, passes, target: Optional[float], *,
            budget_int16: int, allow_float: int, margin: float, z: float, range_calibrators: Sequence[str],
            range_search: bool, min_gain: float, views: Sequence[str], progress: bool,
            metric: Optional[MetricTarget]) -> TuneResult:
    """`tune` once the samples are split and the passes over them placed."""
    tuner = _Tuner(graph, table, fit, check, None if target is None else target + margin, z, min_gain, passes,
                   metric)
    baseline = tuner.state.score
    logger.info("validation cosine on %d samples (%d photos): %.5f +- %.5f (%s)", len(check), check.photos,
                baseline.mean, baseline.sem, tuner.aim.describe(baseline))
    if not tuner.done() and not table.options.per_channel:
        weights = [n for n, e in table.tensors.items() if e.kind == "weight"]
        tuner.attempt("per-channel weights", per_channel_weights(graph, tuner.state.table), weights=weights)
    if not tuner.done() and (range_calibrators or range_search):
        searched = list(RANGE_SEARCH_CANDIDATES) if range_search else []
        stats = passes.statistics(tuner.state.graph, fit, list(range_calibrators) + searched + ["extrema"])
        tuner.stats = stats  # also the extrema ranges of 16-bit activations
        for name in range_calibrators:
            if tuner.done():
                break
            tuner.attempt(f"activation ranges: {name}", recalibrated(tuner.state.graph, tuner.state.table, stats, name))
        if range_search and not tuner.done():
            tuner.attempt("activation ranges: per-tensor search", searched_table(tuner.state, stats, fit))
    activations = [n for n, e in table.tensors.items() if e.kind == "activation"]
    weights = [n for n, e in table.tensors.items() if e.kind == "weight"]
    ranking = []
    if not tuner.done() and (budget_int16 > 0 or allow_float > 0):  # of the 8-bit layers, on the fit samples
        ev = passes.evaluate(tuner.state.graph, tuner.state.table, fit, isolated=True,
                             isolated_images=RANKING_IMAGES, desc="ranking", progress=progress)
        ranking = [b.name for b in build_report(ev, "", "").bottlenecks]

    def room(names: Sequence[str]) -> bool:
        return bool(names) and len(tuner.state.int16) + len(names) <= budget_int16 and not tuner.done()

    def widen(label: str, names: Sequence[str]) -> None:
        table16, moved = tuner.widened(names)
        tuner.attempt(label, table16, int16=names, weights=moved)

    depthwise = set(depthwise_weights(graph))
    for label, group in (("all depthwise outputs", [t for t in depthwise_outputs(graph) if t in activations]),
                         ("every activation", activations),
                         ("weights of all depthwise Convs", [w for w in weights if w in depthwise]),
                         ("every other weight", weights)):
        names = [n for n in group if n not in tuner.state.int16]
        if room(names):
            widen(f"int16: {label} ({len(names)})", names)
    for name in ranking:
        if tuner.done() or len(tuner.state.int16) >= budget_int16:
            break
        if name in activations and name not in tuner.state.int16:
            widen(f"int16: {name}", [name])
    for name in ranking:
        if tuner.done() or len(tuner.state.float_layers) >= allow_float:
            break
        if name not in tuner.state.float_layers and name not in graph.inputs:
            tuner.attempt(f"float: {name}", tuner.state.table, float_layers=[name])
    if tuner.done() and tuner.state.int16:
        tuner.minimize(ranking)
    result = tuned_result(tuner.state, tuner, baseline, target, margin, z, check, views, metric)
    if result.export_aligned:
        logger.info("aligned with the integer run for the QDQ model: %s", ", ".join(result.export_aligned))
    wider = {id(st): st for st in tuner.reached_states if len(st.int16) > len(tuner.state.int16)}
    result.fallbacks = lambda: (tuned_result(st, tuner, baseline, target, margin, z, check, views, metric)
                                for st in sorted(wider.values(), key=lambda st: len(st.int16)))
    return result


def tuned_result(state: _State, tuner: _Tuner, baseline: Score, target: Optional[float], margin: float, z: float,
                 check: Validation, views, metric: Optional[MetricTarget]) -> TuneResult:
    """The `TuneResult` of `state`: its table with the float layers marked and aligned for the QDQ export."""
    nodes = float_node_names(prepare(state.graph, state.table), state.float_layers) if state.float_layers else []
    tuned = with_float(state.table, state.float_layers)  # the table runs its float layers by itself
    tuned, aligned = aligned_for_export(state.graph, tuned)  # as the integer run reads them: the QDQ model reads all
    wide = [n for n in aligned if tuned.tensors[n].qparams.bits == 16 and n not in state.int16]
    return TuneResult(tuned, state.graph, baseline, state.score, target, margin, z, check.photos, tuner.steps,
                      list(state.int16) + wide, nodes, views=list(views) if check.groups is not None else [],
                      metric_target=metric, validation=dataclasses.replace(check, scorer=None),  # the pool is gone
                      export_aligned=aligned)
