"""`tune_lanes` (`ptq tune --scheme int4-dsp`): the most DSP throughput whose validation cosine still reaches a
target, by moving layers from 8-bit to 4-bit DSP lanes (`ptq.tuning.lane_mix`).

A greedy on measured sensitivities:

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
all-8-bit and all-4-bit are measured as the two ends. The result's graph reads only the 4-bit layers' inputs
through Requantize nodes.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ptq.core.graph import Graph
from ptq.table.quant_table import QuantTable
from ptq.tuning.data import Samples, Score, Validation, split_samples
from ptq.tuning.lane_mix import Int4Grid, LaneMix, four_bit_macs, lane_throughput
from ptq.tuning.tuner import TuneResult, TuneStep, fit_statistics

logger = logging.getLogger("ptq.tune")

SENSITIVITY_FLOOR = 1e-6  # a layer whose 4 bits cost nothing measurable still ranks by its savings
DEFAULT_EXTRA = 6


@dataclass
class LanePoint:
    """One lane assignment measured: its label, the layers on 4-bit lanes, its throughput (MACs per DSP per
    cycle), the share of MACs on 4-bit lanes and the validation cosine (mean, sem)."""

    label: str
    four: list[str]
    throughput: float
    four_bit_macs: float
    cosine: float
    sem: float
    reached: bool

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LaneRecord:
    """What `tune_lanes` measured: per layer (in graph order) its MACs, DSP ops on both lanes, sensitivity and
    chosen lanes; the points tried; the chosen assignment's point."""

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
        ends = {p.label: p for p in self.lanes.points if p.label in ("all int8", "all int4")}
        lines = [f"lanes: {len(c.four)} of {len(self.lanes.layers)} layers on 4-bit lanes, "
                 f"{c.four_bit_macs:.1%} of the MACs, {c.throughput:.3f} MACs/DSP/cycle; validation cosine "
                 f"{c.cosine:.5f} +- {c.sem:.5f} "
                 f"(target {self.target}: {'reached' if self.reached else 'NOT reached'})"]
        lines += [f"  {p.label}: {p.throughput:.3f} MACs/DSP/cycle, cosine {p.cosine:.5f}" for p in ends.values()]
        return "\n".join(lines + (self.verdict.lines() if self.verdict is not None else []))


def cross_fitted_sensitivities(graph: Graph, table: QuantTable, fit: Samples, reference: Graph, grid: Int4Grid,
                                progress: bool = False) -> dict[str, float]:
    """Layer node -> the mean cosine lost with the layer alone on 4-bit lanes (module docstring, step 1): on each
    half of the fit samples, by the 4-bit layers fitted to the other half, the drops weighed by the halves'
    sizes. Fewer than 4 fit samples: measured on the samples the layers were fitted to."""
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
        base = sensing.cosine(*mix.build([], every_edge=True)).mean
        for layer in mix.layers:
            drop = base - sensing.cosine(*mix.build([layer.node], every_edge=True)).mean
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

    def measure(label: str, four: Sequence[str]) -> LanePoint:
        g, t = mix.build(four, every_edge=True)
        score = check.cosine(g, t)
        point = LanePoint(label, list(four), lane_throughput(layers, four), four_bit_macs(layers, four),
                          score.mean, score.sem, reaches(score))
        points.append(point)
        logger.info("%s: %d layers on 4-bit lanes, %.3f MACs/DSP/cycle, cosine %.5f", label, len(four),
                    point.throughput, point.cosine)
        return point

    every = [layer.node for layer in layers]
    base = measure("all int8", [])
    measure("all int4", every)
    sensitivity = cross_fitted_sensitivities(graph, table, fit, reference, grid, progress)
    for layer in layers:
        logger.info("sensitivity %s: %.6f", layer.node, sensitivity[layer.node])
    saving = [l for l in layers if l.ops_at(4) < l.ops_at(8)]  # a layer 4-bit lanes do not speed up stays 8-bit
    order = sorted(saving, key=lambda l: -(l.ops_at(8) - l.ops_at(4)) / max(sensitivity[l.node], SENSITIVITY_FLOOR))
    order = [l.node for l in order]

    chosen = base
    lo, hi = 0, len(order)  # head lo reaches (0: all 8-bit, if anything); find the longest
    while lo < hi and base.reached:
        mid = (lo + hi + 1) // 2
        point = measure(f"head {mid}", order[:mid])
        steps.append(TuneStep(f"4-bit lanes: first {mid} of the order", point.cosine, point.cosine - chosen.cosine,
                              point.reached))
        if point.reached:
            lo, chosen = mid, point
        else:
            hi = mid - 1
    if base.reached:  # head lo + 1 was measured by the bisection (and missed) unless lo is the whole order
        for node in order[lo + 1:lo + 1 + extra]:
            point = measure(f"+ {node}", chosen.four + [node])
            steps.append(TuneStep(f"4-bit lanes: + {node}", point.cosine, point.cosine - chosen.cosine, point.reached))
            if point.reached:
                chosen = point
    final_graph, final_table = mix.build(chosen.four)
    score = Score(chosen.cosine, chosen.sem)
    record = LaneRecord(
        layers=[{"node": l.node, "output": l.output, "macs": l.macs, "ops_int8": l.ops_at(8), "ops_int4": l.ops_at(4),
                 "sensitivity": sensitivity[l.node], "lanes": 4 if l.node in chosen.four else 8} for l in layers],
        points=points, chosen=chosen, grid=asdict(grid))
    return LaneTuneResult(table=final_table, graph=final_graph, baseline=Score(base.cosine, base.sem), score=score,
                          target=target, margin=margin, z=z, validation_samples=check.photos, steps=steps,
                          int16_tensors=[], float_nodes=[], views=list(views) if check.groups is not None else [],
                          lanes=record, validation=check)
