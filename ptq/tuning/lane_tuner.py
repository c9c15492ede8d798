"""`tune_lanes` (`ptq tune --scheme int4-dsp`): the most DSP throughput whose validation cosine still reaches a
target, by moving layers from 8-bit to 4-bit DSP lanes (`ptq.tuning.lane_mix`), and to 16-bit lanes where that
buys accuracy cheaper than the 4-bit layers give it up, or where 8 bits do not reach the target at all.

1. *Sensitivities*: every layer alone on 4-bit lanes, the rest 8-bit: the drop of the mean logits cosine on the fit
   samples (no views: one pass per layer) from the all-8-bit one (at least `SENSITIVITY_FLOOR`), cross-fitted:
   the fit samples split in two halves, each half measured on the 4-bit layers fitted to the other
   (`cross_fitted_sensitivities`). Measured on the samples its grids and GPTQ rounding were fitted to, a layer
   fed few patches per weight (Lite0's 7x7 layers) looks up to 4x cheaper than on other photos. *16-bit gains*:
   every layer alone on 16-bit lanes, the rise of the mean cosine on the fit samples (`wide_gains`); the layers
   that gain, by gain per DSP operation the 16 bits add, most first.
2. Only when all-8-bit misses the target ("16 bits where nothing else holds"): the shortest head of the gain
   order on 16-bit lanes that reaches it on the validation samples (bisection, after all layers on 16-bit lanes:
   when even that misses, the tune stops there, not reached). The steps below start from it, its layers staying
   on 16-bit lanes (the sensitivities are measured with them in place).
3. The layers that 4-bit lanes speed up, sorted by DSP operations saved per sensitivity, (ops_8 - ops_4) /
   sensitivity, most first (one that saves nothing, e.g. a Gemm of a single row, stays 8-bit); the longest head
   of that order that reaches the target on the validation samples (mean - z sem >= target + margin, as `ptq
   tune` asks; `ptq.tuning.data`), by bisection on its length (log2(n) validation passes; the longest when
   reaching is monotone in the length, else one that reaches); then each of the `extra` layers after the first
   one the head missed (the bisection measured that one) tried alone on top of it, kept if the target still holds.
4. *Exchanges*: each of the first `exchanges` layers of the gain order not yet on 4- or 16-bit lanes is put on
   16-bit lanes, and step 3 goes on from the chosen 4-bit layers with it in place; kept when the throughput
   rises. On Lite0 the stem convolution reads the photo, finer than 8-bit data (`ptq.calibration.input_grid`): on
   16-bit lanes (2.7 % of the MACs at 1 MAC per DSP) it raises the validation cosine by 0.004 with 35.5 % of the
   MACs on 4-bit lanes, room for two more 4-bit layers, which leaves the throughput where it was (docs/dsp.md).

Every assignment measured is a trade-off point (`LanePoint`: throughput, 4-bit MAC share, validation cosine, the
16-bit layers); all-8-bit and all-4-bit are measured as the two ends (and all-16-bit when step 2 runs). The
result's graph reads through Requantize nodes only the 4-bit layers' inputs and the 8-bit layers' inputs that a
16-bit layer widened.
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
DEFAULT_EXCHANGES = 3  # layers tried on 16-bit lanes to make room for more 4-bit ones


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
    """What `tune_lanes` measured: per layer (in graph order) its MACs, DSP ops on each lane width, sensitivity
    (None for a layer on 16-bit lanes before step 3), 16-bit gain and chosen lanes; the points tried; the chosen
    point."""

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
               exchanges: int = DEFAULT_EXCHANGES, progress: bool = False) -> LaneTuneResult:
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

    def extend(four: list[str], rest: list[str], sixteen: list[str], start: LanePoint, label: str) -> LanePoint:
        """The point of `four` plus the longest head of `rest` on 4-bit lanes that reaches the target (bisection;
        `start`, the point of `four` alone, reaches), then each of the `extra` layers after the first one that head
        missed tried alone on top of it (a layer the cut passed over may fit)."""
        chosen = start
        lo, hi = 0, len(rest)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            point = measure(f"{label}{mid}", four + rest[:mid], sixteen)
            steps.append(TuneStep(f"4-bit lanes: {label}{mid}", point.cosine, point.cosine - chosen.cosine,
                                  point.reached))
            if point.reached:
                lo, chosen = mid, point
            else:
                hi = mid - 1
        for node in rest[lo + 1:lo + 1 + extra]:  # rest[lo] was measured by the bisection, and missed
            point = measure(f"+ {node}", chosen.four + [node], sixteen)
            steps.append(TuneStep(f"4-bit lanes: + {node}", point.cosine, point.cosine - chosen.cosine, point.reached))
            if point.reached:
                chosen = point
        return chosen

    every = [layer.node for layer in layers]
    eight = measure("all int8", [])
    measure("all int4", every)
    gains = wide_gains(mix, fit, reference, progress)
    for node, gain in gains.items():
        logger.info("16-bit gain %s: %.6f", node, gain)
    by_gain = [l.node for l in sorted((l for l in layers if gains[l.node] > 0),
                                      key=lambda l: -gains[l.node] / max(l.ops_at(16) - l.ops_at(8), 1))]
    base = eight if eight.reached else wide_layers(by_gain, every, eight.cosine, measure, steps)
    sixteen = base.sixteen
    sensitivity = cross_fitted_sensitivities(graph, table, fit, reference, grid, progress, sixteen)
    for node, value in sensitivity.items():
        logger.info("sensitivity %s: %.6f", node, value)
    # a layer 4-bit lanes do not speed up stays where it is, as does one on 16-bit lanes
    saving = [l for l in layers if l.ops_at(4) < l.ops_at(8) and l.node not in sixteen]
    order = sorted(saving, key=lambda l: -(l.ops_at(8) - l.ops_at(4)) / max(sensitivity[l.node], SENSITIVITY_FLOOR))
    order = [l.node for l in order]
    chosen = extend([], order, sixteen, base, "head ") if base.reached else base
    if chosen.reached:  # 16 bits traded for 4: a layer's 16-bit lanes may buy room for more 4-bit ones
        for node in [n for n in by_gain if n not in chosen.four and n not in chosen.sixteen][:exchanges]:
            if node in chosen.four:  # an exchange kept before put it on 4-bit lanes
                continue
            wider = chosen.sixteen + [node]
            start = measure(f"16-bit + {node}", chosen.four, wider)
            steps.append(TuneStep(f"16-bit lanes: + {node}", start.cosine, start.cosine - chosen.cosine,
                                  start.reached))
            if not start.reached:
                continue
            point = extend(chosen.four, [n for n in order if n not in chosen.four and n != node], wider, start,
                           f"16-bit + {node}, 4-bit + ")
            if point.throughput > chosen.throughput:
                chosen = point
    final_graph, final_table = mix.build(chosen.four, chosen.sixteen)
    score = Score(chosen.cosine, chosen.sem)
    record = LaneRecord(
        layers=[{"node": l.node, "output": l.output, "macs": l.macs, "ops_int8": l.ops_at(8), "ops_int4": l.ops_at(4),
                 "ops_int16": l.ops_at(16), "sensitivity": sensitivity.get(l.node),
                 "gain16": gains[l.node],
                 "lanes": lane_bits(l.node, chosen.four, chosen.sixteen)} for l in layers],
        points=points, chosen=chosen, grid=asdict(grid))
    wide = sorted({name for node in chosen.sixteen for name in mix.wide_sources(node)})
    return LaneTuneResult(table=final_table, graph=final_graph, baseline=Score(eight.cosine, eight.sem), score=score,
                          target=target, margin=margin, z=z, validation_samples=check.photos, steps=steps,
                          int16_tensors=wide, float_nodes=[], views=list(views) if check.groups is not None else [],
                          lanes=record, validation=check)


def wide_layers(order: list[str], every: list[str], before: float, measure, steps: list[TuneStep]) -> LanePoint:
    """The 16-bit step of the module docstring: the point of the shortest head of `order` (the layers that gain,
    by gain per DSP operation added) on 16-bit lanes that reaches the target, or all-16-bit (`every`) when none
    does. `before`: the all-8-bit cosine; `measure(label, four, sixteen)` measures and records an assignment on the
    validation samples."""
    widest = measure("all int16", [], every)
    steps.append(TuneStep("16-bit lanes: every layer", widest.cosine, widest.cosine - before, widest.reached))
    if not widest.reached:
        return widest
    chosen = widest
    lo, hi = 1, len(order)  # the shortest head that reaches is in [lo, hi] (head len(order) measured last)
    while lo < hi:
        mid = (lo + hi) // 2
        point = measure(f"16-bit head {mid}", [], order[:mid])
        steps.append(TuneStep(f"16-bit lanes: first {mid} of the order", point.cosine, point.cosine - before,
                              point.reached))
        if point.reached:
            hi, chosen = mid, point
        else:
            lo = mid + 1
    if order and chosen is widest:  # head len(order) not measured yet
        point = measure(f"16-bit head {lo}", [], order[:lo])
        steps.append(TuneStep(f"16-bit lanes: first {lo} of the order", point.cosine, point.cosine - before,
                              point.reached))
        if point.reached:
            chosen = point
    return chosen
