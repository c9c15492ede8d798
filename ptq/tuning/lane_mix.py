"""Per-layer DSP lanes: which convolutions run on 4-bit lanes (WP521, four MACs per DSP48E2), which on 8-bit
lanes (WP486, two) and which on 16-bit ones (one product per slice), and the graph and table of such a mix
(`ptq tune --scheme int4-dsp`).

A *layer* is a node with a weight (Conv, ConvTranspose, Gemm, MatMul with a weight). Its lanes are the width of
its two multiplier operands: on 4-bit lanes its weight is int4 and its data input uint4; on 8-bit lanes both
are 8-bit, as the starting (default-scheme, 8-bit) table has them. The layer's output stays on the table's
8-bit grid either way (the accumulator is int32 and requantized to it), so only the edge into a 4-bit layer
changes: a `Requantize` node (ai.ptq, `ops.requantize`; identity in float) moves the 8-bit input to the
layer's own 4-bit copy of it, one copy per layer (a tensor read by two layers on different lanes keeps its
8-bit grid for the one and gets a 4-bit copy for the other).

The 4-bit grids (`Int4Grid`):

- weights: int4 per output channel, codes [-8, 7], s_c a power of two (WP521's grid, `pow2=True`) or any
  float (s_c = t_c / 7, `pow2=False`); t_c the channel's clipping threshold, `fit="mse"`: the candidate
  minimizing sum (Q(w) - w)^2 over the channel (powers of two 2^e for e around log2(max|w| / 7); else
  t = r max|w| for r in 0.30 .. 1.00), `fit="max"`: max|w| (rounded up to a power of two);
- activations (the copy): uint4 [0, 15] on [lo, hi] from the activation calibrator at 4 bits (`mse` fits the
  range to the histogram, `extrema` takes the extrema), within the 8-bit entry's range; `pow2=True`: WP521's
  scale 2^ceil(log2 max(|lo|, |hi|)) / 16 (unsigned) or / 8 with zero point 8 (offset binary, signed);
  `pow2=False`: the asymmetric grid s = (hi - lo) / 15, zp = round(-lo / s);
- the rounding of the 4-bit weights (`rounding`): GPTQ (`"gptq"`, the default; `ptq.adjust.gptq`: column by
  column, each rounding error spread over the columns not yet rounded by the inverse Hessian of the layer's output
  error, dampened by K / n when the fit samples give few patches per weight; only the layers 4-bit lanes speed
  up); AdaRound (`"adaround"`, `ptq.adjust.adaround` on the fit samples: each weight rounded up or down to
  minimize the layer's output error on the float inputs); or to nearest;
- output fit (`output_fit=True`, free grids only; `ptq.tuning.lane_fit`): then each speeding layer's weight
  thresholds and input range are refitted to the layer's output error on the fit samples (the tensor fits above
  are among the candidates);
- bias correction (`bias_correction=True`): the float bias of each 4-bit layer is lowered by the mean shift the
  4-bit rounding of its weight *and of its input* causes on the fit samples,
  b'_c = b_c - (sum W4[c] P4 - sum W[c] P) (`ptq.adjust.bias_correction`: P the mean input patch of the float
  input x, P4 that of its 4-bit rounding Q4(x) on the copy's grid, clipping included), less the 8-bit weight
  correction the bias already carries when the starting table was corrected.

16-bit layers, where 8 bits lose too much: the weight on the 16-bit grid of its 8-bit entry's range (per channel
as that one), and the data input 16-bit *where it is computed*: the tensor and, up through producers with one
activation input (Clip, Relu, Split, ...), each tensor it comes from, down to the output of the layer or the
Add that makes it (`LaneMix.wide_sources`): a Clip reading an 8-bit convolution output would give 8-bit values
on a 16-bit grid. Each other layer reading a widened tensor reads it through its copy, requantized to its own
8- or 4-bit grid, so the 16-bit layers change no other layer's operands. With a bias-corrected starting table
the 16-bit weight's bias drops the 8-bit rounding's correction, b_c + sum dW8[c] P.

Throughput (`lane_throughput`): total MACs over total packed DSP operations, each layer counted on its lanes
(`reports.dsp_resources.dsp_report`: padding of odd channel and pixel counts included), MACs per DSP per cycle.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from calibrators import TensorStatistics, get_calibrator
from ops.registry import weight_role
from ptq.adjust.adaround import adaround
from ptq.adjust.gptq import gptq
from ptq.adjust.bias_correction import (BiasCorrectionLog, bias_target, conv_geometry, layer_shift, mean_patch,
                                        rounding_delta, weighted_layers)
from ptq.calibration.adjustments import with_initializers
from ptq.calibration.int4_dsp import requantize_edges, tqt_qparams, tqt_scale
from ptq.core.graph import Graph, Node, load_model
from ptq.core.qparams import QParams
from ptq.engine.float_run import layer_inputs
from ptq.engine.weight_scale_floor import floor_weight_scales
from ptq.engine.weight_tensors import weight_tensors
from ptq.table.quant_table import QuantTable, TensorEntry
from ptq.tuning.defaults import INT4_ROUNDINGS
from ptq.tuning.lane_fit import fitted_grids, int4_weight_entry, uint4_qparams
from reports.dsp_resources import dsp_report

NARROW_BITS = 4
WIDE_BITS = 16
LANES = {4: "int4", 8: "int8", 16: "int16"}  # bits of a layer's operands -> the DSP packing it runs on
COPY_SUFFIX = "_lanes4"
POW2_EXPONENTS = range(-2, 3)  # around round(log2(max|w| / 7)): the weight grids `fit="mse"` tries
CLIP_RATIOS = np.linspace(0.30, 1.0, 36)


@dataclass(frozen=True)
class Int4Grid:
    """How the 4-bit layers are quantized (module docstring)."""

    pow2: bool = False  # measured on Lite0: free scales beat powers of two (module docstring of bench/int4_mix.py)
    weight_fit: str = "mse"  # "mse" or "max"
    activation_calibrator: str = "mse"
    bias_correction: bool = True
    rounding: str = "gptq"  # of the 4-bit weights: "nearest", "adaround" or "gptq" (module docstring; measured in
    # bench/int4_mix.py: GPTQ and AdaRound beat nearest, GPTQ is the faster)
    output_fit: bool = True  # free grids refitted to the layer's output error (`ptq.tuning.lane_fit`)

    def __post_init__(self):
        if self.weight_fit not in ("mse", "max"):
            raise ValueError(f"weight_fit must be mse or max, got {self.weight_fit!r}")
        if self.rounding not in INT4_ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(INT4_ROUNDINGS)}, got {self.rounding!r}")
        get_calibrator(self.activation_calibrator)  # an unknown name raises here, listing the known ones


@dataclass
class Layer:
    """A layer that can change lanes: its node, first output, data input (and its index), weight, MACs per
    sample and packed DSP operations per sample on each lane width."""

    node: str
    output: str
    data: str
    data_index: int
    weight: str
    macs: int
    ops: dict[str, int]

    def ops_at(self, bits: int) -> int:
        return self.ops[LANES[bits]]


def mac_nodes(graph: Graph) -> list[Node]:
    """The nodes with an initializer weight (the layers), in graph order."""
    out = []
    for node in graph.nodes:
        role = weight_role(node)
        if role is None or len(node.inputs) <= role.input_index:
            continue
        if node.inputs[role.input_index] in graph.initializers:
            out.append(node)
    return out


def layers_of(graph: Graph, table: QuantTable) -> list[Layer]:
    """The graph's layers with their MACs and DSP operations on both lane widths (one run of a zero input)."""
    costs = {layer.node: layer for layer in dsp_report(graph, table).layers}
    out = []
    for node in mac_nodes(graph):
        role = weight_role(node)
        data_index = next(i for i, name in enumerate(node.inputs) if i != role.input_index and name)
        cost = costs.get(node.name)
        if cost is None:  # run without a dot product (e.g. in float): it cannot change lanes
            continue
        out.append(Layer(node.name, node.outputs[0], node.inputs[data_index], data_index,
                         node.inputs[role.input_index], cost.macs, {s: cost.stats[s].ops for s in LANES.values()}))
    return out


def lane_bits(node: str, four: Iterable[str], sixteen: Iterable[str] = ()) -> int:
    """The lanes of layer `node` when the layers named in `four` run on 4-bit lanes and those in `sixteen` on
    16-bit ones (the rest 8-bit)."""
    return NARROW_BITS if node in four else WIDE_BITS if node in sixteen else 8


def lane_throughput(layers: Sequence[Layer], four: Iterable[str], sixteen: Iterable[str] = ()) -> float:
    """MACs per DSP per cycle of the whole network with the layers named in `four` on 4-bit lanes and those in
    `sixteen` on 16-bit ones."""
    four, sixteen = set(four), set(sixteen)
    ops = sum(layer.ops_at(lane_bits(layer.node, four, sixteen)) for layer in layers)
    return sum(layer.macs for layer in layers) / ops if ops else 0.0


def four_bit_macs(layers: Sequence[Layer], four: Iterable[str]) -> float:
    """The share of the MACs on 4-bit lanes."""
    four = set(four)
    total = sum(layer.macs for layer in layers)
    return sum(layer.macs for layer in layers if layer.node in four) / total if total else 0.0


def weight_scales(w: np.ndarray, axis: Optional[int], grid: Int4Grid) -> np.ndarray:
    """Per output channel int4 scales of `w` (codes [-8, 7]), as `Int4Grid` says (module docstring)."""
    axis = 0 if axis is None or w.ndim < 2 else axis
    rows = np.moveaxis(w.astype(np.float64), axis, 0).reshape(w.shape[axis], -1)
    peak = np.abs(rows).max(axis=1)
    scales = np.empty(rows.shape[0])
    for c, (row, top) in enumerate(zip(rows, peak)):
        if not top > 0:
            scales[c] = 1.0
            continue
        if grid.pow2:
            if grid.weight_fit == "max":
                scales[c] = tqt_scale(float(top), NARROW_BITS, True)
                continue
            base = round(math.log2(top / 7))
            candidates = [math.ldexp(1.0, base + e) for e in POW2_EXPONENTS]
        else:
            candidates = list(top * CLIP_RATIOS / 7) if grid.weight_fit == "mse" else [top / 7]
        errors = [np.sum((np.clip(np.round(row / s), -8, 7) * s - row) ** 2) for s in candidates]
        scales[c] = candidates[int(np.argmin(errors))]
    return scales


def weight_entry(w: np.ndarray, axis: Optional[int], grid: Int4Grid) -> TensorEntry:
    scales = weight_scales(w, axis, grid)
    axis = axis if axis is not None and w.ndim >= 2 else None
    if axis is None:
        scales = scales[:1] if scales.size == 1 else np.array([scales.max()])
    qp = QParams(scale=scales, zero_point=np.zeros(scales.size, dtype=np.int64), bits=NARROW_BITS, signed=True,
                 axis=axis)
    entry = TensorEntry("weight", "", -7.5 * scales, 7.5 * scales, qp)
    return int4_weight_entry(entry, scales, f"int4-{grid.weight_fit}{'-pow2' if grid.pow2 else ''}")


def activation_entry(stats: TensorStatistics, wide: TensorEntry, grid: Int4Grid) -> TensorEntry:
    """The uint4 entry of a 4-bit layer's input copy, within the range of its 8-bit entry `wide`."""
    calibrator = get_calibrator(grid.activation_calibrator)
    rmin, rmax = calibrator.compute(stats, bits=NARROW_BITS)
    lo = max(float(np.min(rmin)), float(np.min(wide.min)))
    hi = min(float(np.max(rmax)), float(np.max(wide.max)))
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    qp = tqt_qparams(lo, hi, NARROW_BITS, offset_binary=True) if grid.pow2 else uint4_qparams(lo, hi)
    return TensorEntry("activation", calibrator.spelling, lo, hi, qp, why="4-bit lanes")


def lane_operands(table: QuantTable, layers: Sequence[Layer]) -> QuantTable:
    """`table` with each layer's activation operand wider than 8 bits on the 8-bit grid of its range: DSP lanes
    multiply 8- or 4-bit operands, and the default calibration gives a few activations 16 bits for accuracy (a
    graph input finer than 8-bit data, outlier channels: `ptq.calibration`)."""
    tensors = dict(table.tensors)
    for layer in layers:
        entry = tensors[layer.data]
        if entry.kind == "activation" and entry.qparams.bits > 8:
            qp = table.options.derive_qparams("activation", entry.min, entry.max, 8, entry.qparams.axis)
            tensors[layer.data] = TensorEntry("activation", entry.calibrator, entry.min, entry.max, qp,
                                              entry.run_in_float, f"8 bits for the DSP lanes (calibrated at "
                                                                  f"{entry.qparams.bits}: {entry.why})")
    return dataclasses.replace(table, tensors=tensors)


class LaneMix:
    """Builds the graph and table of any lane assignment of `graph`'s layers from the 8-bit `table`.

    `stats`: activation statistics of the layers' data inputs on the fit samples (for the 4-bit grids);
    `fit_batches`: the fit samples' input batches (for bias correction's mean patches; None: no correction)."""

    def __init__(self, graph: Graph, table: QuantTable, stats: dict[str, TensorStatistics], grid: Int4Grid,
                 fit_batches: Optional[Iterable] = None):
        table = lane_operands(table, layers_of(graph, table))
        self.graph, self.table, self.grid = graph, table, grid
        self.layers = layers_of(graph, table)
        for layer in self.layers:
            for name in (layer.data, layer.weight):
                if table.tensors[name].qparams.bits != 8:
                    raise ValueError(f"--scheme int4-dsp tunes from an 8-bit table (`ptq calibrate` with its default "
                                     f"scheme and bits): layer {layer.node} reads {name!r} at "
                                     f"{table.tensors[name].qparams.bits} bits")
        self.by_node = {layer.node: layer for layer in self.layers}
        self._weighted = {node.name for node in mac_nodes(graph)}
        self._producers = {out: node for node in graph.nodes for out in node.outputs if out}
        taken = set(graph.tensors) | {n.name for n in graph.nodes}
        self.copies: dict[str, str] = {}  # layer node -> its 4-bit input copy
        for layer in self.layers:
            name, k = layer.data + COPY_SUFFIX, 1
            while name in taken:
                name, k = f"{layer.data}{COPY_SUFFIX}_{k}", k + 1
            taken.add(name)
            self.copies[layer.node] = name
        self._taken = taken
        axes = {name: axis for name, _, axis in weight_tensors(graph, True)}
        self.weights4 = {layer.node: weight_entry(graph.initializers[layer.weight], axes.get(layer.weight), grid)
                         for layer in self.layers}
        self.inputs4 = {layer.node: activation_entry(stats[layer.data], table.tensors[layer.data], grid)
                        for layer in self.layers}
        batches = list(fit_batches) if fit_batches is not None else []
        speeding = {layer.node for layer in self.layers if layer.ops_at(4) < layer.ops_at(8)}
        adjusted = [n for n in weighted_layers(graph, table, BiasCorrectionLog()) if n.name in speeding]
        if grid.output_fit and not grid.pow2 and batches:
            weights, copies = fitted_grids(graph, adjusted, self.weights4, self.inputs4,
                                           {n.name: table.tensors[self.by_node[n.name].data] for n in adjusted},
                                           batches)
            self.weights4.update(weights)
            self.inputs4.update(copies)
        self.rounded4: dict[str, np.ndarray] = {}  # weight -> its AdaRound or GPTQ value (on the 4-bit grid)
        if grid.rounding == "adaround" and batches:
            four = dataclasses.replace(table, tensors={**table.tensors, **{
                layer.weight: self.weights4[layer.node] for layer in self.layers}})
            self.rounded4, _ = adaround(graph, four, batches)
        elif grid.rounding == "gptq" and batches:
            self.rounded4, _ = gptq(graph, adjusted, {layer.weight: self.weights4[layer.node].qparams
                                                      for layer in self.layers}, batches)
        self.biases4: dict[str, tuple[str, np.ndarray]] = {}
        self.biases16: dict[str, tuple[str, np.ndarray]] = {}
        if batches and (grid.bias_correction or table.options.bias_correction):
            self.biases4, self.biases16 = self._corrected_biases(batches)
            if not grid.bias_correction:
                self.biases4 = {}
        self.weights16 = {layer.node: self._wide_weight(layer) for layer in self.layers}
        self._full: Optional[Graph] = None

    def _wide_weight(self, layer: Layer) -> TensorEntry:
        entry = self.table.tensors[layer.weight]
        qp = self.table.options.derive_qparams("weight", entry.min, entry.max, WIDE_BITS, entry.qparams.axis)
        return dataclasses.replace(entry, qparams=qp, why="16-bit lanes")

    def wide_sources(self, layer: str) -> list[str]:
        """The tensors 16-bit lanes for `layer` widen: its data input and, up through producers with one activation
        input, each tensor it is computed from, ending at the output of a layer, of an op with several activation
        inputs, or at a graph input (module docstring)."""
        name, chain = self.by_node[layer].data, []
        while self.table.tensors.get(name) is not None and self.table.tensors[name].kind == "activation":
            chain.append(name)
            node = self._producers.get(name)
            if node is None or node.name in self._weighted:
                break
            sources = [i for i in node.inputs if i and i not in self.graph.initializers]
            if len(sources) != 1:
                break
            name = sources[0]
        return chain

    def _corrected_biases(self, batches) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, tuple[str, np.ndarray]]]:
        """(layer node -> (its bias initializer, the bias corrected for the 4-bit weight rounding), the same for
        16-bit lanes: the bias without the 8-bit weight rounding's correction the starting table's bias carries,
        if any)."""
        nodes = {n.name: n for n in self.graph.nodes}
        consumers = self.graph.consumers()
        shared = {name for name, users in consumers.items() if len(users) > 1}
        four = set(self.by_node)
        patched = [n for n in weighted_layers(self.graph, self.table, BiasCorrectionLog()) if n.name in four]
        patches, rounded = self._mean_patches(patched, batches)
        out, wide = {}, {}
        for layer in self.layers:
            node = nodes[layer.node]
            bias_name, sign = bias_target(self.graph, node, shared, consumers)
            if not bias_name or node.name not in patches:
                continue
            bias = self.graph.initializers[bias_name]
            w = self.graph.initializers[layer.weight].astype(np.float64)
            shift8 = None  # the 8-bit weight rounding's mean shift, which a bias-corrected table's bias corrects
            if self.table.options.bias_correction:
                shift8 = layer_shift(node, rounding_delta(w, self.table.tensors[layer.weight].qparams),
                                     patches[node.name])
                restored = bias.astype(np.float64) + sign * shift8.reshape(bias.shape)
                wide[layer.node] = (bias_name, restored.astype(bias.dtype))
            if layer.weight in self.rounded4:
                w4 = self.rounded4[layer.weight].astype(np.float64)
            else:
                w4 = w + rounding_delta(w, self.weights4[layer.node].qparams)
            # E[W4 Q4(x)] - E[W x]: the mean shift of the weight's and the input's 4-bit rounding together
            shift = layer_shift(node, w4, rounded[node.name]) - layer_shift(node, w, patches[node.name])
            if shift8 is not None:  # the graph's bias already corrects the 8-bit weight rounding
                shift -= shift8
            value = bias.astype(np.float64) - sign * shift.reshape(bias.shape)
            out[layer.node] = (bias_name, value.astype(bias.dtype))
        return out, wide

    def _mean_patches(self, nodes: Sequence[Node], batches) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Node name -> the mean input patch (`ptq.adjust.bias_correction`) of the float input x and of its
        4-bit rounding Q4(x) on the layer's copy grid, over `batches`."""
        sums: dict[str, list] = {}
        counts: dict[str, int] = {}
        for node, x in layer_inputs(self.graph, nodes, batches):
            qp = self.inputs4[node.name].qparams
            both = []
            w = self.graph.initializers[node.inputs[1]]
            for value in (x, qp.dequantize(qp.quantize(x))):
                if w.ndim == 4:  # a Conv (`weighted_layers` keeps 2-D Convs and Gemms)
                    pads, strides, dilations = conv_geometry(node, w)
                    total, n = mean_patch(value, w.shape[2:], pads, strides, dilations)
                else:
                    rows = value.reshape(-1, value.shape[-1]).astype(np.float64)
                    total, n = rows.sum(axis=0), rows.shape[0]
                both.append(total)
            previous = sums.get(node.name, [0, 0])
            sums[node.name] = [previous[0] + both[0], previous[1] + both[1]]
            counts[node.name] = counts.get(node.name, 0) + n
        return ({name: v[0] / counts[name] for name, v in sums.items()},
                {name: v[1] / counts[name] for name, v in sums.items()})

    def _graph(self, nodes: Sequence[str]) -> Graph:
        edges = {(self.by_node[n].output, self.by_node[n].data_index): self.copies[n] for n in nodes}
        return requantize_edges(self.graph, edges, set(self._taken)) if edges else self.graph

    def build(self, four: Iterable[str], sixteen: Iterable[str] = (), *,
              every_edge: bool = False) -> tuple[Graph, QuantTable]:
        """(graph, table) with the layers named in `four` on 4-bit lanes, those in `sixteen` on 16-bit lanes, the
        others on the table's 8 bits. `every_edge`: every layer reads its input through a Requantize (an 8-bit
        layer's is the identity, exact), so that all assignments share one graph (only the biases differ); else
        the 4-bit layers do, and the 8-bit ones reading a tensor a 16-bit layer widened."""
        four, sixteen = set(four), set(sixteen) - set(four)
        four = [layer.node for layer in self.layers if layer.node in four]
        sixteen = [layer.node for layer in self.layers if layer.node in sixteen]
        widened = {name for node in sixteen for name in self.wide_sources(node)}
        if every_edge:
            if self._full is None:
                self._full = self._graph([layer.node for layer in self.layers])
            graph = self._full
        else:
            graph = self._graph(four + [layer.node for layer in self.layers
                                        if layer.node not in four and layer.node not in sixteen
                                        and layer.data in widened])
        tensors = dict(self.table.tensors)
        for name in widened:
            entry = tensors[name]
            qp = self.table.options.derive_qparams("activation", entry.min, entry.max, WIDE_BITS, entry.qparams.axis)
            tensors[name] = dataclasses.replace(entry, qparams=qp, why="16-bit lanes")
        for layer in self.layers:
            copy = self.copies[layer.node]
            if layer.node in four:
                tensors[copy] = self.inputs4[layer.node]
                tensors[layer.weight] = self.weights4[layer.node]
            elif copy in graph.tensors:
                tensors[copy] = tensors[layer.data] if layer.node in sixteen else self.table.tensors[layer.data]
            if layer.node in sixteen:
                tensors[layer.weight] = self.weights16[layer.node]
        values = dict(self.biases4[n] for n in four if n in self.biases4)
        values.update(self.biases16[n] for n in sixteen if n in self.biases16)
        values.update({self.by_node[n].weight: self.rounded4[self.by_node[n].weight] for n in four
                       if self.by_node[n].weight in self.rounded4})
        if values:
            graph = load_model(with_initializers(graph.model, values), self.table.options.input_shapes)
        floor_weight_scales(graph, tensors, self.table.options)
        return graph, dataclasses.replace(self.table, tensors=tensors)
