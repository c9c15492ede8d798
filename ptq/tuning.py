"""`tune`: change a quant table step by step until the logits cosine on *validation* samples reaches a target.

The tuning samples are split (`ptq.tune_data`): what is estimated from data (activation statistics, bias
correction's mean input patches, the bottleneck ranking) comes from the fit part; every decision (keep a
step, stop, prune) is taken on the validation part, against the user's float model. The target is reached
when the validation mean minus `z` standard errors of it is at least `target + margin` (a table chosen on
some images scores lower on others). Candidates, in order of expected gain per cost, each kept only if it
raises the validation mean by at least `min_gain`:

1. per-channel weights (when the table is per-tensor): free at run time on most accelerators;
2. a better activation range: every activation recalibrated with each of `range_calibrators` on the fit
   samples (one statistics pass), then each activation's own choice by the per-tensor search
   (`ptq.range_search`, with `range_search`), the best kept. No percentile for the whole graph: a tail
   fitted to a few images clips others;
3. 16 bits, groups first (the outputs of all depthwise Convs, then the weights of all depthwise Convs, then
   every other weight), then single activations in the order of the report's bottleneck ranking, within
   `budget_int16` tensors (activations and weights count alike);
4. float, a layer at a time in the ranking's order, only with `allow_float` > 0 (the last resort); the tuned
   table marks the kept ones float (`"float": true`), so it runs them in float by itself;
5. once the target is reached, each kept 16-bit step but the last is undone, latest first, if the target
   stays reached without it; a group that cannot go (the last one included) is then tried tensor by tensor
   (`prune`).

A table calibrated with bias correction has biases corrected for its weight grids; a step that changes a
weight's grid (per-channel, 16 bits, and the undoing in `prune`) re-corrects that layer's bias for the new
grid (`ptq.bias_correction.recorrected_biases`), so the tuned graph is returned with the tuned table.

The passes over samples (the statistics, the ranking, each candidate's validation cosines) run in this
process, or with `workers` > 1 or `ray` on a pool (`ptq.tune_shards`) with the same result bit for bit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ptq.adjust import with_initializers
from ptq.core.graph import Graph, load_model
from ptq.executor import prepare
from ptq.quant_table import QuantTable
from ptq.range_search import DEFAULT_CANDIDATES as RANGE_SEARCH_CANDIDATES
from ptq.range_search import candidate_entries, search_ranges
from ptq.table_edit import with_float
from ptq.tune_defaults import DEFAULT_MARGIN, DEFAULT_VALIDATION_FRACTION, DEFAULT_Z
from ptq.tune_data import Samples, Score, Validation, split_samples
from ptq.weight_scale_floor import floor_weight_scales
from reports.build import build_report
from reports.evaluate import evaluate
from reports.layer_nodes import float_node_names
from reports.tables import with_bits

logger = logging.getLogger("ptq.tune")

DEFAULT_RANGE_CALIBRATORS = ("mse", "kld")
RANKING_IMAGES = 8  # images of the isolated per-layer pass that ranks the bottlenecks


@dataclass
class TuneStep:
    change: str  # what was tried, e.g. "per-channel weights", "int16: <tensor>"
    cosine: float  # the validation cosine measured with the change
    gain: float  # over the cosine before it
    kept: bool
    int16: list[str] = field(default_factory=list)  # tensors this step moved to 16 bits
    float_layers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TuneResult:
    table: QuantTable
    graph: Graph  # the graph the table runs with (biases re-corrected when weight grids changed)
    baseline: Score
    score: Score  # on the validation samples
    target: float
    margin: float
    z: float
    validation_samples: int
    steps: list[TuneStep]
    int16_tensors: list[str]
    float_nodes: list[str]
    table_path: Optional[Path] = None  # where `ptq.tune` wrote the tuned table and the record of the steps
    record_path: Optional[Path] = None

    @property
    def cosine(self) -> float:
        return self.score.mean

    @property
    def reached(self) -> bool:
        return self.score.bound(self.z) >= self.target + self.margin

    @property
    def int16_activations(self) -> list[str]:
        return [n for n in self.int16_tensors if self.table.tensors[n].kind == "activation"]

    def to_dict(self) -> dict:
        return {"target_cosine": self.target, "margin": self.margin, "z": self.z,
                "validation_samples": self.validation_samples, "baseline_cosine": self.baseline.mean,
                "cosine": self.cosine, "cosine_sem": self.score.sem, "reached": self.reached,
                "int16_tensors": self.int16_tensors, "float_nodes": self.float_nodes,
                "steps": [s.to_dict() for s in self.steps]}

    def summary(self) -> str:
        goal = f"mean - {self.z:g} sem {self.score.bound(self.z):.5f} vs target {self.target}"
        if self.margin:
            goal += f" + margin {self.margin}"
        lines = [f"validation cosine ({self.validation_samples} held-out samples) {self.baseline.mean:.5f} -> "
                 f"{self.cosine:.5f} +- {self.score.sem:.5f} ({goal}: {'reached' if self.reached else 'NOT reached'})"]
        for s in self.steps:
            lines.append(f"  {'kept   ' if s.kept else 'dropped'} {s.change}: {s.cosine:.5f} ({s.gain:+.5f})")
        acts = len(self.int16_activations)
        lines.append(f"{len(self.int16_tensors)} tensor(s) in 16 bits ({acts} activations, "
                     f"{len(self.int16_tensors) - acts} weights), {len(self.float_nodes)} node(s) in float")
        return "\n".join(lines)


def per_channel_weights(graph: Graph, table: QuantTable) -> QuantTable:
    """The table with every weight recalibrated per output channel (activations untouched)."""
    from ptq.pipeline import weight_entries

    options = dataclasses.replace(table.options, per_channel=True)
    tensors = dict(table.tensors)
    tensors.update(weight_entries(graph, options))
    floor_weight_scales(graph, tensors, options)
    return dataclasses.replace(table, options=options, tensors=tensors)


def recalibrated(graph: Graph, table: QuantTable, stats, calibrator: str) -> QuantTable:
    """The table with every activation's range from `calibrator` on `stats` (16-bit tensors stay 16-bit)."""
    from ptq.pipeline import activation_entries

    options = dataclasses.replace(table.options, calibrator=calibrator)
    entries = activation_entries(graph, stats, options)
    tensors = dict(table.tensors)
    wide = [n for n, e in table.tensors.items() if e.kind == "activation" and e.qparams.bits != options.bits]
    tensors.update(entries)
    result = with_bits(dataclasses.replace(table, tensors=tensors), wide, 16) if wide else \
        dataclasses.replace(table, tensors=tensors)
    return with_float(result, table.float_tensors())


def fit_statistics(graph: Graph, samples: Samples, calibrators: Sequence[str]) -> dict:
    """Activation statistics of `graph` over the fit samples, for every calibrator listed."""
    from calibrators import required_stats
    from ptq.float_run import collect_statistics

    batches = (x for _, x, _ in samples.samples(graph))
    return collect_statistics(graph, batches, graph.activations, required_stats(calibrators))


class InProcess:
    """The passes over samples run here (`sample_passes`); `ptq.tune_shards.TunePool` is the pool's."""

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
    whose workers serve every pass (`ptq.tune_shards.TunePool`)."""
    if workers == 1 and ray is None:
        return contextlib.nullcontext(InProcess())
    from ptq.tune_shards import TunePool

    return TunePool(graph, fit, validation, table.options.input_shapes, workers=workers, ray=ray)


def searched_table(state: _State, stats: dict, fit: Samples) -> QuantTable:
    """The table with each 8-bit activation's range from the per-tensor search (`ptq.range_search`) on the fit
    samples."""
    candidates = candidate_entries(state.graph, stats, state.table.options)
    chosen, _ = search_ranges(state.graph, candidates, (x for _, x, _ in fit.samples(state.graph)))
    tensors = dict(state.table.tensors)
    tensors.update({n: e for n, e in chosen.items() if tensors[n].qparams.bits == state.table.options.bits})
    return dataclasses.replace(state.table, tensors=tensors)


def _depthwise(graph: Graph) -> list:
    return [n for n in graph.nodes if n.op_type == "Conv" and int(n.attr("group", 1)) > 1]


def depthwise_outputs(graph: Graph) -> list[str]:
    """The tensors the depthwise Convs write once fused: through a single-consumer Relu/Clip to its output."""
    consumers = graph.consumers()
    out = []
    for node in _depthwise(graph):
        name = node.outputs[0]
        users = consumers.get(name, [])
        if len(users) == 1 and users[0].op_type in ("Relu", "Clip") and name not in graph.outputs:
            name = users[0].outputs[0]
        out.append(name)
    return out


def depthwise_weights(graph: Graph) -> list[str]:
    return [n.inputs[1] for n in _depthwise(graph) if len(n.inputs) > 1 and n.inputs[1] in graph.initializers]


def with_weight_bits(graph: Graph, table: QuantTable, weights: Sequence[str], bits: int) -> QuantTable:
    """The table with the listed weights recalibrated at `bits` (same calibrator, granularity, symmetry)."""
    from ptq.pipeline import weight_entries

    options = dataclasses.replace(table.options, weight_bits=bits)
    entries = weight_entries(graph, options)
    tensors = dict(table.tensors)
    tensors.update({w: entries[w] for w in weights})
    floor_weight_scales(graph, tensors, table.options)
    return dataclasses.replace(table, tensors=tensors)


@dataclass
class _State:
    table: QuantTable
    graph: Graph
    score: Score
    int16: list[str] = field(default_factory=list)
    float_layers: list[str] = field(default_factory=list)


class _Tuner:
    """The search of the module docstring over one graph, table and split of the samples."""

    def __init__(self, graph: Graph, table: QuantTable, fit: Samples, validation: Validation, goal: float, z: float,
                 min_gain: float):
        self.fit, self.validation, self.goal, self.z, self.min_gain = fit, validation, goal, z, min_gain
        self.original = table
        self.steps: list[TuneStep] = []
        self._patches: Optional[dict] = None
        self.state = _State(table, graph, self.measure(graph, table))

    def measure(self, graph: Graph, table: QuantTable, float_layers: Sequence[str] = ()) -> Score:
        nodes = float_node_names(prepare(graph, table), list(float_layers)) if float_layers else []
        return self.validation.cosine(graph, table, nodes)

    def reaches(self, score: Score) -> bool:
        return score.bound(self.z) >= self.goal

    def done(self) -> bool:
        return self.reaches(self.state.score)

    def graph_for(self, table: QuantTable, weights: Sequence[str]) -> Graph:
        """The current graph, its biases re-corrected for `weights` moving to `table`'s grids."""
        if not weights or not self.original.options.bias_correction:
            return self.state.graph
        from ptq.bias_correction import mean_patches, recorrected_biases

        graph = self.state.graph
        if self._patches is None:  # the layers' mean input patches on the fit samples, once
            layers = [n for n in graph.nodes if n.op_type in ("Conv", "Gemm") and len(n.inputs) > 1
                      and n.inputs[1] in self.original.tensors]
            self._patches = mean_patches(graph, layers, (x for _, x, _ in self.fit.samples(graph)))
        biases = recorrected_biases(graph, self.state.table, table, weights, self._patches)
        return load_model(with_initializers(graph.model, biases), table.options.input_shapes) if biases else graph

    def attempt(self, change: str, table: QuantTable, int16: Sequence[str] = (), float_layers: Sequence[str] = (),
                weights: Sequence[str] = ()) -> bool:
        """Measure `table` (whose grids differ from the current one's for `weights`); keep it if it gains."""
        state = self.state
        graph = self.graph_for(table, weights)
        score = self.measure(graph, table, state.float_layers + list(float_layers))
        gain = score.mean - state.score.mean
        kept = gain >= self.min_gain
        self.steps.append(TuneStep(change, score.mean, gain, kept, list(int16), list(float_layers)))
        logger.info("%s: %.5f (%+.5f)%s", change, score.mean, gain, "" if kept else ", dropped")
        if kept:
            self.state = _State(table, graph, score, state.int16 + list(int16), state.float_layers + list(float_layers))
        return kept

    def narrowed(self, names: Sequence[str]) -> tuple[QuantTable, list[str]]:
        """The current table with `names` back at the original bit widths, and the weights among them."""
        acts = [n for n in names if self.original.tensors[n].kind == "activation"]
        weights = [n for n in names if self.original.tensors[n].kind == "weight"]
        table = self.state.table
        if acts:
            table = with_bits(table, acts, self.original.options.bits)
        if weights:
            table = with_weight_bits(self.state.graph, table, weights, self.original.options.weight_bits)
        return table, weights

    def undo(self, label: str, names: list[str]) -> bool:
        """Put `names` back to the original widths if the validation cosine stays at the goal."""
        table, weights = self.narrowed(names)
        graph = self.graph_for(table, weights)
        score = self.measure(graph, table, self.state.float_layers)
        kept = self.reaches(score)
        bits = f"{self.original.options.bits}/{self.original.options.weight_bits}"
        self.steps.append(TuneStep(f"back to {bits} bits: {label}", score.mean, score.mean - self.state.score.mean, kept))
        logger.info("%s: %.5f%s", self.steps[-1].change, score.mean, "" if kept else ", kept in 16 bits")
        if kept:
            self.state = _State(table, graph, score, [n for n in self.state.int16 if n not in names],
                                self.state.float_layers)
        return kept

    def prune(self) -> None:
        """Module docstring, item 5."""
        for k, step in enumerate([s for s in self.steps if s.kept and s.int16][::-1]):
            names = [n for n in step.int16 if n in self.state.int16]
            if k > 0 and names and self.undo(step.change, names):
                continue
            if len(names) > 1:
                for name in names:
                    self.undo(name, [name])


def tune(graph: Graph, table: QuantTable, images: Samples, target: float, *, budget_int16: int = 8,
         allow_float: int = 0, validation: Optional[Samples] = None, reference: Optional[Graph] = None,
         validation_fraction: float = DEFAULT_VALIDATION_FRACTION, margin: float = DEFAULT_MARGIN, z: float = DEFAULT_Z,
         range_calibrators: Sequence[str] = DEFAULT_RANGE_CALIBRATORS, range_search: bool = True,
         min_gain: float = 1e-5, progress: bool = False, workers: int = 1, ray: Optional[str] = None) -> TuneResult:
    """See the module docstring. `images`: the tuning samples, split into fit and validation parts unless
    `validation` is given (then all of `images` is fitted on). `reference`: the float model the cosine is
    measured against (default `graph`; pass the user's model when `graph` holds adjusted weights).
    `progress`: a progress bar per pass over the samples. `workers`, `ray`: where the passes over samples
    run (`sample_passes`)."""
    if validation is None:
        fit, validation = split_samples(images, validation_fraction)
    else:
        fit = images
    check = Validation.create(reference or graph, validation, progress=progress)
    with sample_passes(graph, table, fit, check, workers=workers, ray=ray) as passes:
        return _search(graph, table, fit, dataclasses.replace(check, scorer=passes.scorer), passes, target,
                       budget_int16=budget_int16, allow_float=allow_float, margin=margin, z=z,
                       range_calibrators=range_calibrators, range_search=range_search, min_gain=min_gain,
                       progress=progress)


def _search(graph: Graph, table: QuantTable, fit: Samples, check: Validation, passes, target: float, *,
            budget_int16: int, allow_float: int, margin: float, z: float, range_calibrators: Sequence[str],
            range_search: bool, min_gain: float, progress: bool) -> TuneResult:
    """`tune` once the samples are split and the passes over them placed."""
    tuner = _Tuner(graph, table, fit, check, target + margin, z, min_gain)
    baseline = tuner.state.score
    logger.info("validation cosine on %d samples: %.5f +- %.5f (goal: mean - %g sem >= %.5f)", len(check),
                baseline.mean, baseline.sem, z, tuner.goal)
    if not tuner.done() and not table.options.per_channel:
        weights = [n for n, e in table.tensors.items() if e.kind == "weight"]
        tuner.attempt("per-channel weights", per_channel_weights(graph, tuner.state.table), weights=weights)
    if not tuner.done() and (range_calibrators or range_search):
        searched = list(RANGE_SEARCH_CANDIDATES) if range_search else []
        stats = passes.statistics(tuner.state.graph, fit, list(range_calibrators) + searched)
        for name in range_calibrators:
            if tuner.done():
                break
            tuner.attempt(f"activation ranges: {name}", recalibrated(tuner.state.graph, tuner.state.table, stats, name))
        if range_search and not tuner.done():
            tuner.attempt("activation ranges: per-tensor search", searched_table(tuner.state, stats, fit))
    activations = {n for n, e in table.tensors.items() if e.kind == "activation"}

    def room(names: Sequence[str]) -> bool:
        return bool(names) and len(tuner.state.int16) + len(names) <= budget_int16 and not tuner.done()

    fresh = [t for t in depthwise_outputs(graph) if t in activations]
    if room(fresh):
        tuner.attempt(f"int16: all depthwise outputs ({len(fresh)})", with_bits(tuner.state.table, fresh, 16),
                      int16=fresh)
    for label, names in (("all depthwise Convs", depthwise_weights(graph)),
                         ("every other weight", [n for n, e in table.tensors.items() if e.kind == "weight"])):
        names = [w for w in names if w in table.tensors and w not in tuner.state.int16]
        if room(names):
            tuner.attempt(f"int16 weights: {label} ({len(names)})",
                          with_weight_bits(tuner.state.graph, tuner.state.table, names, 16), int16=names, weights=names)
    ranking = []
    if not tuner.done() and (budget_int16 > len(tuner.state.int16) or allow_float > 0):
        ev = passes.evaluate(tuner.state.graph, tuner.state.table, fit, isolated=True,
                             isolated_images=RANKING_IMAGES, desc="ranking", progress=progress)
        ranking = [b.name for b in build_report(ev, "", "").bottlenecks]
    for name in ranking:
        if tuner.done() or len(tuner.state.int16) >= budget_int16:
            break
        if name in activations and name not in tuner.state.int16:
            tuner.attempt(f"int16: {name}", with_bits(tuner.state.table, [name], 16), int16=[name])
    for name in ranking:
        if tuner.done() or len(tuner.state.float_layers) >= allow_float:
            break
        if name not in tuner.state.float_layers and name not in graph.inputs:
            tuner.attempt(f"float: {name}", tuner.state.table, float_layers=[name])
    if tuner.done():
        tuner.prune()
    state = tuner.state
    nodes = float_node_names(prepare(state.graph, state.table), state.float_layers) if state.float_layers else []
    tuned = with_float(state.table, state.float_layers)  # the table runs its float layers by itself
    return TuneResult(tuned, state.graph, baseline, state.score, target, margin, z, len(check), tuner.steps,
                      list(state.int16), nodes)
