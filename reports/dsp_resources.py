"""Packed-DSP resource report: what each layer of a quantized model costs on an array of DSP48E2 slices.

One integer run (of a zero input: only the shapes and code types matter) records every dot product of
Conv, ConvTranspose, Gemm and MatMul, depthwise included, with its operands' signedness; `dsp.plan.plan_dot`
maps it onto slices for both schemes side by side:

- int8 (WP486, two MACs per slice) with the operands' own 8-bit code types;
- int4 (WP521, four MACs per slice) with the same shapes and signedness at 4 bits (what the layer would
  cost if quantized to 4 bits).
- int16 (one MAC per slice, recorded for the lanes a mixed-precision table gives a layer whose operands are wider
  than 8 bits; `ptq tune --scheme int4-dsp`'s 16-bit layers).

Per layer and scheme: MACs, packed DSP operations (slice cycles), lanes lost to padding (odd channel or pixel
counts) and to chaining (dot products rounded up to whole MACC chains of K slices), and cycles on an
array of `dsps` slices, `cycles = ceil(chain_ops / dsps)`: every slice busy every cycle, no memory stalls
(a lower bound of a real accelerator's time). Time = cycles / clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dsp.backend import DspStats
from dsp.packing import CodeRange
from dsp.plan import plan_dot
from ops.backend import NumpyBackend
from ptq.core.graph import Graph
from ptq.engine.executor import prepare
from ptq.core.option_defaults import DEFAULT_CLOCK_MHZ, DEFAULT_DSPS
from ptq.table.quant_table import QuantTable

SCHEMES = ("int8", "int4")  # the model totals printed side by side
LANE_BITS = {"int8": 8, "int4": 4, "int16": 16}  # every lane width a layer is costed on


@dataclass(frozen=True)
class DspArray:
    dsps: int = DEFAULT_DSPS
    clock_mhz: float = DEFAULT_CLOCK_MHZ

    def __post_init__(self):
        if self.dsps <= 0 or not self.clock_mhz > 0:
            raise ValueError(f"a DSP array needs a positive slice count and clock, got {self.dsps}, {self.clock_mhz}")

    def cycles(self, stats: DspStats) -> int:
        return -(-stats.chain_ops // self.dsps)

    def milliseconds(self, cycles: int) -> float:
        return cycles / (self.clock_mhz * 1e3)


@dataclass
class LayerCost:
    name: str  # the node's first output tensor (the name the accuracy report uses)
    node: str
    op_type: str
    stats: dict[str, DspStats] = field(default_factory=lambda: {s: DspStats() for s in LANE_BITS})
    lanes: str = "int8"  # the lanes the table puts it on (`_lanes`)

    @property
    def macs(self) -> int:
        return self.stats[SCHEMES[0]].macs


@dataclass
class DspReport:
    array: DspArray
    layers: list[LayerCost]

    def total(self, scheme: str) -> DspStats:
        total = DspStats()
        for layer in self.layers:
            stats = layer.stats[scheme]
            total.macs += stats.macs
            total.ops += stats.ops
            total.chain_ops += stats.chain_ops
            total.lane_slots += stats.lane_slots
        return total

    def cycles(self, scheme: str) -> int:
        """Model cycles: each layer on the whole array in turn."""
        return sum(self.array.cycles(layer.stats[scheme]) for layer in self.layers)

    def table_stats(self) -> DspStats:
        """The model's totals with each layer on the lanes its table gives it (a mixed 4/8-bit model)."""
        total = DspStats()
        for layer in self.layers:
            stats = layer.stats[layer.lanes]
            total.macs += stats.macs
            total.ops += stats.ops
            total.chain_ops += stats.chain_ops
            total.lane_slots += stats.lane_slots
        return total

    def ranked(self, scheme: str = "int8") -> list[LayerCost]:
        """Layers by cycles, most first (the speed bottlenecks)."""
        return sorted(self.layers, key=lambda layer: -self.array.cycles(layer.stats[scheme]))

    def to_dict(self) -> dict:
        def scheme_dict(stats: DspStats) -> dict:
            cycles = self.array.cycles(stats)
            return {"macs": stats.macs, "dsp_ops": stats.ops, "chain_ops": stats.chain_ops,
                    "macs_per_dsp_cycle": stats.macs / stats.ops if stats.ops else 0.0,
                    "padding_loss": stats.padding_loss, "chain_loss": stats.chain_loss, "cycles": cycles,
                    "ms": self.array.milliseconds(cycles)}

        totals = {}
        for scheme in SCHEMES:
            cycles = self.cycles(scheme)
            totals[scheme] = {**scheme_dict(self.total(scheme)), "cycles": cycles,
                              "ms": self.array.milliseconds(cycles)}
        totals["table"] = scheme_dict(self.table_stats())
        return {"dsps": self.array.dsps, "clock_mhz": self.array.clock_mhz, "totals": totals,
                "layers": [{"name": layer.name, "node": layer.node, "op_type": layer.op_type, "lanes": layer.lanes,
                            **{s: scheme_dict(layer.stats[s]) for s in SCHEMES}}
                           for layer in self.ranked()]}


def _signed(x: np.ndarray) -> bool:
    return not np.issubdtype(x.dtype, np.unsignedinteger) and x.size > 0 and int(x.min()) < 0


class _Recorder(NumpyBackend):
    """The default dot product, recording each call's shapes and operand signedness (depthwise included)."""

    name = "numpy (recording)"
    direct_depthwise = False

    def __init__(self):
        self.pending: list[tuple[tuple, tuple, bool, bool]] = []

    def matmul(self, a, b):
        a_signed = np.issubdtype(a.dtype, np.signedinteger) if a.dtype.itemsize == 1 else _signed(a)
        b_signed = np.issubdtype(b.dtype, np.signedinteger) if b.dtype.itemsize == 1 else _signed(b)
        self.pending.append((a.shape, b.shape, a_signed, b_signed))
        return super().matmul(a, b)


def _lanes(node, table: QuantTable) -> str:
    """int4 when every quantized input of `node` (its weight and data input) is on a grid of at most 4 bits, int16
    when one is wider than 8 bits, else int8."""
    entries = [table.tensors[name] for name in node.inputs if name in table.tensors]
    bits = [e.qparams.bits for e in entries if e.kind in ("activation", "weight")]
    if bits and max(bits) <= 4:
        return "int4"
    return "int16" if bits and max(bits) > 8 else "int8"


def dsp_report(graph: Graph, table: QuantTable, array: DspArray = DspArray()) -> DspReport:
    """Prepare `graph` with `table`, run it once on a zero input with a recording backend and cost every dot
    product."""
    recorder = _Recorder()
    prepared = prepare(graph, table, backend=recorder)
    producer = {out: step.node for step in prepared.steps for out in step.node.outputs[:1] if out}
    layers: dict[str, LayerCost] = {}

    def on_tensor(name: str, _value) -> None:
        if not recorder.pending or name not in producer:
            return
        node = producer[name]
        layer = layers.setdefault(node.name, LayerCost(name, node.name, node.op_type, lanes=_lanes(node, table)))
        for a_shape, b_shape, a_signed, b_signed in recorder.pending:
            for scheme, bits in LANE_BITS.items():
                plan = plan_dot(scheme, a_shape, b_shape, CodeRange(bits, a_signed), CodeRange(bits, b_signed))
                layer.stats[scheme].add(plan)
        recorder.pending.clear()

    inputs = {}
    for name in graph.inputs:
        info = graph.tensors[name]
        if info.shape is None or any(not d for d in info.shape):
            raise ValueError(f"input {name!r} has no fixed shape {info.shape}; calibrate with `ptq calibrate --input-shape`")
        inputs[name] = np.zeros(info.shape, dtype=info.dtype or np.float32)
    prepared.run(inputs, keep_all=False, on_tensor=on_tensor)
    return DspReport(array, list(layers.values()))


Accuracy = dict[str, tuple[int, Optional[float]]]  # tensor -> (bottleneck rank, 0 if none; isolated cosine)


def accuracy_ranks(report: dict) -> Accuracy:
    """Each layer's bottleneck rank (0: not a suspect) and isolated cosine, from a `ptq report` report.json
    (or `Report.to_dict()`)."""
    ranks = {b["name"]: k for k, b in enumerate(report["bottlenecks"], 1)}
    return {layer["name"]: (ranks.get(layer["name"], 0), layer["isolated"].get("cosine"))
            for layer in report["layers"]}


def report_text(report: DspReport, top: int = 10, accuracy: Optional[Accuracy] = None) -> str:
    """The model totals for both schemes and the `top` layers ranked by int8 cycles; with `accuracy`
    (tensor -> (bottleneck rank, 0 if none; isolated cosine)) each layer's accuracy standing beside them."""
    arr = report.array
    lines = [f"DSP48E2 array: {arr.dsps} slices at {arr.clock_mhz:g} MHz; cycles = ceil(chain slots / slices) per "
             "layer (every slice busy, no memory stalls)",
             f"{'scheme':<6} {'MACs':>13} {'DSP ops':>13} {'MACs/DSP/cyc':>12} {'padding lost':>12} "
             f"{'chain lost':>10} {'cycles':>11} {'ms/image':>9}"]
    for scheme in SCHEMES:
        t, cycles = report.total(scheme), report.cycles(scheme)
        lines.append(f"{scheme:<6} {t.macs:>13,} {t.ops:>13,} {t.macs / max(t.ops, 1):>12.3f} "
                     f"{t.padding_loss:>12.1%} {t.chain_loss:>10.1%} {cycles:>11,} {arr.milliseconds(cycles):>9.3f}")
    four = [layer for layer in report.layers if layer.lanes == "int4"]
    wide = [layer for layer in report.layers if layer.lanes == "int16"]
    if (four and len(four) < len(report.layers)) or wide:
        t = report.table_stats()
        sixteen = f", {len(wide)} on int16 ({sum(l.macs for l in wide) / max(t.macs, 1):.1%})" if wide else ""
        lines.append(f"{'table':<6} {t.macs:>13,} {t.ops:>13,} {t.macs / max(t.ops, 1):>12.3f} {t.padding_loss:>12.1%} "
                     f"{t.chain_loss:>10.1%}   (each layer on its table's lanes: {len(four)} of {len(report.layers)} "
                     f"on int4, {sum(l.macs for l in four) / max(t.macs, 1):.1%} of the MACs{sixteen})")
    ranked = report.ranked()[:top]
    width = max([len(layer.name) for layer in ranked] + [5])
    lines += ["", f"layers ranked by int8 cycles (top {len(ranked)} of {len(report.layers)}):",
              f"{'rank':<4} {'layer':<{width}} {'op':<8} {'MACs':>11} "
              f"{'int8 cyc':>9} {'pad':>6} {'chain':>6} {'int4 cyc':>9} {'pad':>6} {'chain':>6}"
              + (f" {'acc rank':>8} {'iso cos':>8}" if accuracy is not None else "")]
    for k, layer in enumerate(ranked, 1):
        cells = []
        for scheme in SCHEMES:
            s = layer.stats[scheme]
            cells.append(f"{arr.cycles(s):>9,} {s.padding_loss:>6.1%} {s.chain_loss:>6.1%}")
        if accuracy is not None:
            rank, cosine = accuracy.get(layer.name, (0, None))
            cells.append(f"{rank or '-':>8} {'-' if cosine is None else format(cosine, '.5f'):>8}")
        lines.append(f"{k:<4} {layer.name:<{width}} {layer.op_type:<8} {layer.macs:>11,} {' '.join(cells)}")
    return "\n".join(lines)
