"""`tune_lanes` (`ptq tune --scheme int4-dsp`): the most DSP throughput whose validation cosine still reaches a
target, by moving layers from 8-bit to 4-bit DSP lanes (`ptq.tuning.lane_mix`), and to 16-bit lanes where 8 bits
do not reach it.

First, only when all-8-bit misses the target ("16 bits where nothing else holds"): each layer alone on 16-bit lanes
gives its *gain*, the rise of the mean logits cosine on the fit samples; the layers that gain, sorted by gain per
DSP operation the 16 bits add, most first; the shortest head of that order that reaches the target on the
validation samples (bisection; all layers on 16-bit lanes measured first: when even that misses, the tune stops
there, not reached). Those layers stay on 16-bit lanes, and the greedy below starts from that assignment (its
sensitivities measured with them in place). Then a greedy on measured sensitivities:

1. every layer alone on 4-bit lanes, the rest 8-bit: its *sensitivity* is the drop of the mean logits cosine
   on the fit samples (no views: one pass per layer) from the all-8-bit one (at least `SENSITIVITY_FLOOR`),
   cross-fitted: the fit samples split in two halves, each half measured on the 4-bit layers fitted to the
   other (`cross_fitted_sensitivities`). Measured on the samples its grids and GPTQ rounding were fitted to, a
   layer fed few patches per weight (Lite0's 7x7 layers) looks up to 4x cheaper than on other photos;
2. the layers that 4-bit lanes speed up sorted by DSP operations saved per sensitivity, (ops_8 - ops_4) /
   sensitivity, most first (one that saves nothing, e.g. a Gemm of a single row, stays 8-bit);
3. the longest head of that order that reaches the target on the validation samples (mean - z sem >= target +
   margin, as `ptq tune` asks; `ptq.tuning.data`), by bisection on its length (log2(n) validation passes;
   the longest when reaching is monotone in the length, else one that reaches);
4. then each of the `extra` layers after the first one the head missed (the bisection measured that one) tried
   alone on top of the head, kept if the target still holds (a layer the cut passed over may fit).

Every assignment measured is a trade-off point (`LanePoint`: throughput, 4-bit MAC share, validation cosine);
all-8-bit and all-4-bit are measured as the two ends (and all-16-bit when the 16-bit step runs). The result's graph reads only the 4-bit layers' inputs
through Requantize nodes.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from ptq.core.graph import Graph
from ptq.table.quant_table import QuantTable
from ptq.tuning.data import Samples, Score, Validation, split_samples
from ptq.tuning.lane_mix import Int4Grid, LaneMix, four_bit_macs, lane_bits, lane_throughput
from ptq.tuning.tuner import TuneResult, TuneStep, fit_statistics

logger = logging.getLogger("ptq.tune")

SENSITIVITY_FLOOR = 1e-6  # a layer whose 4 bits cost nothing measurable still ranks by its savings
DEFAULT_EXTRA = 6


@dataclass
class LanePoint:
    """One lane assignment measured: its label, the layers on 4-bit lanes, its throughput (MACs per DSP per
    cycle), the share of MACs on 4-bit lanes, the validation cosine (mean, sem) and the layers on 16-bit lanes."""

    label: str
    four: list[str]
    throughput: float
    four_bit_macs: float
    cosine: float
    sem: float
    reached: bool
    sixteen: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LaneRecord:
    """What `tune_lanes` measured: per layer (in graph order) its MACs, DSP ops on each lane width, sensitivity,
    16-bit gain (None when the 16-bit step did not run) and chosen lanes; the points tried; the chosen point."""

    layers: list[dict]
    points: list[LanePoint]
    chosen: LanePoint
    grid: dict

    def to_dict(self) -> dict:
        return {"layers": self.layers, "points": [p.to_dict() for p in self.points], "chosen": self.chosen.to_dict(),
                "int4_grid": self.grid}


@dataclass
class LaneTuneResult(TuneResult):
    lanes: Optional[LaneRecord] = None

    def to_dict(self) -> dict:
        return {**super().to_dict(), "scheme": "int4-dsp", "lanes": self.lanes.to_dict() if self.lanes else None}

    def summary(self) -> str:
        c = self.lanes.chosen
        ends = {p.label: p for p in self.lanes.points if p.label in ("all int8", "all int4", "all int16")}
        wide = f" and {len(c.sixteen)} on 16-bit lanes" if c.sixteen else ""
        lines = [f"lanes: {len(c.four)} of {len(self.lanes.layers)} layers on 4-bit lanes{wide}, "
                 f"{c.four_bit_macs:.1%} of the MACs, {c.throughput:.3f} MACs/DSP/cycle; validation cosine "
                 f"{c.cosine:.5f} +- {c.sem:.5f} "
                 f"(target {self.target}: {'reached' if self.reached else 'NOT reached'})"]
        lines += [f"  {p.label}: {p.throughput:.3f} MACs/DSP/cycle, cosine {p.cosine:.5f}" for p in ends.values()]
        return "\n".join(lines + (self.verdict.lines() if self.verdict is not None else []))


def wide_gains(mix: LaneMix, fit: Samples, reference: Graph, progress: bool = False) -> dict[str, float]:
    """Layer node -> the mean cosine gained on the fit samples with the layer alone on 16-bit lanes, the rest on
    8-bit ones (module docstring, the 16-bit step)."""
    sensing = Validation.create(reference, fit, progress)
    base = sensing.cosine(*mix.build([], every_edge=True)).mean
    return {layer.node: sensing.cosine(*mix.build([], [layer.node], every_edge=True)).mean - base
            for layer in mix.layers}


def cross_fitted_sensitivities(graph: Graph, table: QuantTable, fit: Samples, reference: Graph, grid: Int4Grid,
                                progress: bool = False, sixteen: Sequence[str] = ()) -> dict[str, float]:
    """Layer node -> the mean cosine lost with the layer alone on 4-bit lanes (module docstring, step 1; the layers
    in `sixteen` on 16-bit lanes): on each half of the fit samples, by the 4-bit layers fitted to the other half,
    the drops weighed by the halves' sizes. Fewer than 4 fit samples: measured on the samples the layers were
    fitted to."""
    if fit.expected >= 4:
        one, other = split_samples(fit, 0.5)
        pairs = [(one, other), (other, one)]  # (fitted to, measured on)
    else:
        pairs = [(fit, fit)]
    sums: dict[str, float] = {}
    count = 0
    for fitted, measured in pairs:
        mix = LaneMix(graph, table, fit_statistics(graph, fitted, [grid.activation_calibrator]), grid,
                      (x for _, x, _ in fitted.samples(graph)))
        sensing = Validation.create(reference, measured, progress)
        base = sensing.cosine(*mix.build([], sixteen, every_edge=True)).mean
        for layer in mix.layers:
            if layer.node in sixteen:
                continue
            drop = base - sensing.cosine(*mix.build([layer.node], sixteen, every_edge=True)).mean
            sums[layer.node] = sums.get(layer.node, 0.0) + drop * len(sensing)
        count += len(sensing)
    return {node: total / count for node, total in sums.items()}


def tune_lanes(graph: Graph, table: QuantTable, samples: Samples, target: float, *, reference: Graph,
               validation: Optional[Samples] = None, validation_fraction: float = 0.25, margin: float = 0.0,
               z: float = 2.0, views: Sequence[str] = (), grid: Int4Grid = Int4Grid(), extra: int = DEFAULT_EXTRA,
               progress: bool = False) -> LaneTuneResult:
    """Tune the lanes of `graph`'s layers (module docstring) from the 8-bit `table`; `reference` is the user's
    float model (the goal); the fit samples give the 4-bit grids, bias correction and the sensitivities."""
    fit, held = (samples, validation) if validation is not None else split_samples(samples, validation_fraction)
    check = Validation.create(reference, held, progress, views)
    stats = fit_statistics(graph, fit, [grid.activation_calibrator])
    mix = LaneMix(graph, table, stats, grid, (x for _, x, _ in fit.samples(graph)))
    layers = mix.layers
    points: list[LanePoint] = []
    steps: list[TuneStep] = []

    def reaches(score: Score) -> bool:
        return score.bound(z) >= target + margin

    def measure(label: str, four: Sequence[str], sixteen: Sequence[str] = ()) -> LanePoint:
        g, t = mix.build(four, sixteen, every_edge=True)
        score = check.cosine(g, t)
        point = LanePoint(label, list(four), lane_throughput(layers, four, sixteen), four_bit_macs(layers, four),
                          score.mean, score.sem, reaches(score), list(sixteen))
        points.append(point)
        logger.info("%s: %d layers on 4-bit lanes, %d on 16-bit, %.3f MACs/DSP/cycle, cosine %.5f", label, len(four),
                    len(sixteen), point.throughput, point.cosine)
        return point

    every = [layer.node for layer in layers]
    eight = measure("all int8", [])
    measure("all int4", every)
    base, gains = eight, None
    if not eight.reached:
        base, gains = wide_layers(mix, fit, reference, measure, steps, progress)
    sixteen = base.sixteen
    sensitivity = cross_fitted_sensitivities(graph, table, fit, reference, grid, progress, sixteen)
    for node, value in sensitivity.items():
        logger.info("sensitivity %s: %.6f", node, value)
    # a layer 4-bit lanes do not speed up stays where it is, as does one on 16-bit lanes
    saving = [l for l in layers if l.ops_at(4) < l.ops_at(8) and l.node not in sixteen]
    order = sorted(saving, key=lambda l: -(l.ops_at(8) - l.ops_at(4)) / max(sensitivity[l.node], SENSITIVITY_FLOOR))
    order = [l.node for l in order]

    chosen = base
    lo, hi = 0, len(order)  # head lo reaches (0: the base, if anything); find the longest
    while lo < hi and base.reached:
        mid = (lo + hi + 1) // 2
        point = measure(f"head {mid}", order[:mid], sixteen)
        steps.append(TuneStep(f"4-bit lanes: first {mid} of the order", point.cosine, point.cosine - chosen.cosine,
                              point.reached))
        if point.reached:
            lo, chosen = mid, point
        else:
            hi = mid - 1
    if base.reached:  # head lo + 1 was measured by the bisection (and missed) unless lo is the whole order
        for node in order[lo + 1:lo + 1 + extra]:
            point = measure(f"+ {node}", chosen.four + [node], sixteen)
            steps.append(TuneStep(f"4-bit lanes: + {node}", point.cosine, point.cosine - chosen.cosine, point.reached))
            if point.reached:
                chosen = point
    final_graph, final_table = mix.build(chosen.four, chosen.sixteen)
    score = Score(chosen.cosine, chosen.sem)
    record = LaneRecord(
        layers=[{"node": l.node, "output": l.output, "macs": l.macs, "ops_int8": l.ops_at(8), "ops_int4": l.ops_at(4),
                 "ops_int16": l.ops_at(16), "sensitivity": sensitivity.get(l.node),
                 "gain16": None if gains is None else gains[l.node],
                 "lanes": lane_bits(l.node, chosen.four, chosen.sixteen)} for l in layers],
        points=points, chosen=chosen, grid=asdict(grid))
    wide = sorted({name for node in chosen.sixteen for name in mix.wide_sources(node)})
    return LaneTuneResult(table=final_table, graph=final_graph, baseline=Score(eight.cosine, eight.sem), score=score,
                          target=target, margin=margin, z=z, validation_samples=check.photos, steps=steps,
                          int16_tensors=wide, float_nodes=[], views=list(views) if check.groups is not None else [],
                          lanes=record, validation=check)


def wide_layers(mix: LaneMix, fit: Samples, reference: Graph, measure, steps: list[TuneStep],
                progress: bool = False) -> tuple[LanePoint, dict[str, float]]:
    """The 16-bit step of the module docstring: (the point of the fewest layers on 16-bit lanes that reaches the
    target, or all-16-bit when nothing does; each layer's 16-bit gain). `measure(label, four, sixteen)` measures
    and records an assignment on the validation samples."""
    gains = wide_gains(mix, fit, reference, progress)
    for node, gain in gains.items():
        logger.info("16-bit gain %s: %.6f", node, gain)
    every = [layer.node for layer in mix.layers]
    widest = measure("all int16", [], every)
    steps.append(TuneStep("16-bit lanes: every layer", widest.cosine, 0.0, widest.reached))
    if not widest.reached:
        return widest, gains
    gaining = [l for l in mix.layers if gains[l.node] > 0]
    order = [l.node for l in sorted(gaining, key=lambda l: -gains[l.node] / max(l.ops_at(16) - l.ops_at(8), 1))]
    chosen = widest
    lo, hi = 0, len(order)  # head hi reaches unless it is the whole order (then all layers do); find the shortest
    while lo < hi:
        mid = (lo + hi) // 2
        point = measure(f"16-bit head {mid}", [], order[:mid]) if mid else None
        if point is not None:
            steps.append(TuneStep(f"16-bit lanes: first {mid} of the order", point.cosine, 0.0, point.reached))
        if point is not None and point.reached:
            hi, chosen = mid, point
        else:
            lo = mid + 1
    if lo == len(order) and chosen is widest and order:  # head len(order) not measured yet
        point = measure(f"16-bit head {lo}", [], order)
        steps.append(TuneStep(f"16-bit lanes: first {lo} of the order", point.cosine, 0.0, point.reached))
        if point.reached:
            chosen = point
    return chosen, gains
