"""The `int4-dsp` quantization scheme (`ptq calibrate --scheme int4-dsp`): Xilinx WP521's 4-bit quantization
(seeds 000/001), for the packed-DSP backend `dsp:int4` (four uint4 x int4 products per DSP48E2).

Scales are powers of two, set from the calibrated threshold t = max(|min|, |max|) as WP521's TQT quantizer
initializes them (equation 1; PTQ keeps the initial threshold, there is no training):

    signed:   s = 2^ceil(log2 t) / 2^(b-1),  codes [-2^(b-1), 2^(b-1) - 1]
    unsigned: s = 2^ceil(log2 t) / 2^b,      codes [0, 2^b - 1]              (t = 0: s = 1)

so every requantization factor s_x s_w / s_y is a power of two: a shift (the (M, N) pairs have M a power
of two; `ops.requantize` uses M = 1). Bit widths:

- weights: int4 (per output channel unless per_channel=False; WP521/TQT uses one threshold per tensor);
- the tensors of an Add (or Sub): inputs and output at 8 bits on one shared scale (WP521's ShareQuantize;
  chained residual Adds form one group, the scale covers the group's widest tensor), so the Add needs no
  multiplier; the graph outputs at 8 bits;
- every other activation at 4 bits, stored as uint4 for the DSP lanes' unsigned activation port: a
  non-negative tensor (a ReLU6 output) as plain uint4, a signed one on the symmetric int4 grid in offset
  binary, zero point 8 (the code is int4 + 8, the sign bit inverted; the convolution folds -8 * sum(w) into
  its bias, as it folds any input zero point);
- where an 8-bit tensor feeds a convolution (Conv, ConvTranspose, Gemm, MatMul with a weight), a
  `Requantize` node (ai.ptq, `ops.requantize`) moves it to 4 bits: WP521's "requantize" of the Add's 8-bit
  output for the next convolution. The Add's output itself stays 8-bit for the next Add of the residual chain.
- first and last layers: 4-bit like the others. The issue asked for 8 bits there, but WP521 says (section
  "Other") that the first and last layers are still INT4 and only the network output is 8-bit, and its result
  tables list first/last layer 4/4 and input/output 4/8; a 4-bit XDPU has no 8-bit lanes to run them on.
- biases: int32 at s_x * s_w as everywhere in ptq (WP521 quantizes biases to 8 bits; not modelled); a weight
  scale too small for its int32 bias, or of a dead channel, is raised (`ptq.engine.weight_scale_floor`) to the next
  power of two above the floor.

`with_requantize` inserts the Requantize nodes into the model (a model-local function whose body is ONNX
Identity, so onnxruntime runs it as the float identity); calibration writes that model beside the table as
its adjusted model, which `ptq run/report/debug` then load. `build_table` makes the table entries.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import onnx
from onnx import helper

from calibrators import TensorStatistics, calibrate_array, get_calibrator
from ops.registry import op_of, weight_role
from ptq.core.graph import Graph, Node, load_model
from ptq.core.qparams import QParams
from ptq.core.option_defaults import INT4_DSP_SCHEME
from ptq.engine.weight_tensors import weight_tensors
from ptq.table.quant_table import CalibrationOptions, QuantTable, TensorEntry
from ptq.engine.weight_scale_floor import floor_weight_scales

SCHEME = INT4_DSP_SCHEME
NARROW_BITS = 4  # weights and activations on the DSP lanes
WIDE_BITS = 8  # Add groups and graph outputs
OFFSET_BINARY_ZP = 1 << (NARROW_BITS - 1)  # a signed 4-bit tensor stored as uint4: code = int4 + 8
REQUANTIZE = "Requantize"
PTQ_DOMAIN = "ai.ptq"
REQUANTIZE_SUFFIX = "_uint4"

# The options a table of this scheme records (the rules above fix them).
SCHEME_OPTIONS = dict(bits=NARROW_BITS, weight_bits=NARROW_BITS, symmetric=True, weight_symmetric=True,
                      narrow=False, weight_narrow=False, pow2=True)


def tqt_scale(t: float, bits: int, signed: bool) -> float:
    """WP521 equation 1: 2^ceil(log2 t) / 2^(b-1) (signed) or / 2^b (unsigned); 1 for t = 0."""
    if not (t > 0 and math.isfinite(t)):
        return 1.0
    return math.ldexp(1.0, math.ceil(math.log2(t)) - (bits - 1 if signed else bits))


def tqt_qparams(rmin: float, rmax: float, bits: int, *, offset_binary: bool = False) -> QParams:
    """Power-of-two QParams of a tensor calibrated to [rmin, rmax] (signed when rmin < 0). `offset_binary`
    stores a signed grid as unsigned codes with zero point 2^(b-1) (the same real values)."""
    signed = rmin < 0
    scale = tqt_scale(max(abs(rmin), abs(rmax)), bits, signed)
    if signed and offset_binary:
        return QParams(scale=scale, zero_point=1 << (bits - 1), bits=bits, signed=False)
    return QParams(scale=scale, zero_point=0, bits=bits, signed=signed)


def _is_mac(node: Node) -> bool:
    """A node whose dot product runs on the DSP lanes: it has a weight input (Conv, ConvTranspose, Gemm, MatMul)."""
    return weight_role(node) is not None


def _sums_inputs(node: Node) -> bool:
    op = op_of(node)
    return op is not None and op.sums_inputs


def share_groups(graph: Graph) -> list[list[str]]:
    """WP521's ShareQuantize: the activations of every Add/Sub (inputs and output) joined into groups that
    share one scale (union-find; a residual chain of Adds is one group), in topological order."""
    activations = set(graph.activations)
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for node in graph.nodes:
        if not _sums_inputs(node):
            continue
        members = [t for t in list(node.inputs) + list(node.outputs) if t in activations]
        for t in members[1:]:
            parent[find(t)] = find(members[0])
    groups: dict[str, list[str]] = {}
    for t in graph.activations:
        if t in parent:
            groups.setdefault(find(t), []).append(t)
    return list(groups.values())


def wide_tensors(graph: Graph) -> set[str]:
    """The activations kept at 8 bits: the members of the share groups and the graph outputs."""
    wide = {t for group in share_groups(graph) for t in group}
    return wide | {t for t in graph.outputs if t in set(graph.activations)}


def requantize_function(opset: int) -> onnx.FunctionProto:
    """ai.ptq Requantize as a model-local function: Identity in float."""
    return helper.make_function(PTQ_DOMAIN, REQUANTIZE, ["x"], ["y"], [helper.make_node("Identity", ["x"], ["y"])],
                                [helper.make_opsetid("", opset)])


def _unique(name: str, taken: set[str]) -> str:
    candidate, k = name, 1
    while candidate in taken:
        candidate, k = f"{name}_{k}", k + 1
    taken.add(candidate)
    return candidate


def with_requantize(graph: Graph) -> tuple[Graph, dict[str, str]]:
    """`graph` with a Requantize node on every edge from an 8-bit tensor (`wide_tensors`) into a convolution's
    data input; returns the new graph (loaded from the edited model) and {8-bit tensor: its 4-bit copy}."""
    wide = wide_tensors(graph)
    mac_inputs: dict[str, list[tuple[str, int]]] = {}  # tensor -> (consumer's first output, input index)
    for node in graph.nodes:
        if not _is_mac(node):
            continue
        weight = weight_role(node).input_index
        for index, name in enumerate(node.inputs):
            if name in wide and index != weight:
                mac_inputs.setdefault(name, []).append((node.outputs[0], index))
    if not mac_inputs:
        return graph, {}
    taken = set(graph.tensors) | {n.name for n in graph.model.graph.node}
    copies = {t: _unique(t + REQUANTIZE_SUFFIX, taken) for t in mac_inputs}
    edges = {(out, index): copies[t] for t, uses in mac_inputs.items() for out, index in uses}
    return requantize_edges(graph, edges, taken), copies


def requantize_edges(graph: Graph, edges: dict[tuple[str, int], str], taken: set[str]) -> Graph:
    """`graph` with the input `index` of the node whose first output is `out` read through a Requantize node
    writing `edges[(out, index)]` (one node per copy name, before the first node that reads it; the model stays
    sorted); `taken`: the names in use (node names are added to it)."""
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    nodes, inserted = [], set()
    for proto in model.graph.node:
        for index, name in enumerate(proto.input):
            copy = edges.get((proto.output[0] if proto.output else "", index))
            if copy is None:
                continue
            if copy not in inserted:
                nodes.append(helper.make_node(REQUANTIZE, [name], [copy], name=_unique(f"requantize_{name}", taken),
                                              domain=PTQ_DOMAIN))
                inserted.add(copy)
            proto.input[index] = copy
        nodes.append(proto)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if not any(f.domain == PTQ_DOMAIN and f.name == REQUANTIZE for f in model.functions):
        model.functions.append(requantize_function(graph.opset))
    if not any(o.domain == PTQ_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(PTQ_DOMAIN, 1))
    return load_model(model)


def _activation_range(calibrator, stats: TensorStatistics, name: str, bits: int,
                      bounds: Optional[tuple[float, float]]) -> tuple[float, float]:
    try:
        rmin, rmax = calibrator.compute(stats, bits=bits)
    except ValueError as exc:
        raise ValueError(f"calibrating tensor {name!r}: {exc}") from exc
    rmin, rmax = float(np.min(rmin)), float(np.max(rmax))
    if bounds is not None:
        rmin, rmax = float(np.clip(rmin, *bounds)), float(np.clip(rmax, *bounds))
    return min(rmin, 0.0), max(rmax, 0.0)


def activation_entries(graph: Graph, stats: dict[str, TensorStatistics], options: CalibrationOptions,
                       bounds: dict[str, tuple[float, float]]) -> dict[str, TensorEntry]:
    """8-bit entries for the share groups (one scale per group) and the graph outputs, 4-bit (uint4) for the
    rest; `bounds` are the Relu/Clip folds (`ptq.engine.clip_ranges.folded_ranges`)."""
    calibrator = get_calibrator(options.calibrator).for_grid(True)
    groups = share_groups(graph)
    grouped = {t for group in groups for t in group}
    outputs = set(graph.outputs)
    ranges = {t: _activation_range(calibrator, stats[t], t, WIDE_BITS if t in grouped or t in outputs else NARROW_BITS,
                                   bounds.get(t)) for t in graph.activations}
    entries = {}
    for group in groups:
        lo = min(ranges[t][0] for t in group)
        hi = max(ranges[t][1] for t in group)
        qp = tqt_qparams(lo, hi, WIDE_BITS)
        for t in group:
            entries[t] = TensorEntry("activation", calibrator.spelling, ranges[t][0], ranges[t][1], qp)
    for t in graph.activations:
        if t in entries:
            continue
        lo, hi = ranges[t]
        qp = tqt_qparams(lo, hi, WIDE_BITS) if t in outputs else tqt_qparams(lo, hi, NARROW_BITS, offset_binary=True)
        entries[t] = TensorEntry("activation", calibrator.spelling, lo, hi, qp)
    return entries


def weight_entries(graph: Graph, options: CalibrationOptions) -> dict[str, TensorEntry]:
    """int4 weights with power-of-two scales, per output channel (or per tensor)."""
    calibrator = get_calibrator(options.weight_calibrator).for_grid(True)
    entries = {}
    for name, w, axis in weight_tensors(graph, options.per_channel):
        rmin, rmax = calibrate_array(calibrator, w, axis=axis, bits=NARROW_BITS)
        t = np.maximum(np.abs(np.atleast_1d(rmin)), np.abs(np.atleast_1d(rmax)))
        scale = np.array([tqt_scale(float(v), NARROW_BITS, True) for v in t])
        qp = QParams(scale=scale, zero_point=np.zeros(scale.size, dtype=np.int64), bits=NARROW_BITS, signed=True,
                     axis=axis)
        entries[name] = TensorEntry("weight", calibrator.spelling, rmin, rmax, qp)
    return entries


def build_table(graph: Graph, stats: dict[str, TensorStatistics], options: CalibrationOptions,
                bounds: dict[str, tuple[float, float]]) -> QuantTable:
    """The int4-dsp table of `graph` (which must already carry its Requantize nodes, `with_requantize`)."""
    tensors = activation_entries(graph, stats, options, bounds)
    tensors.update(weight_entries(graph, options))
    floor_weight_scales(graph, tensors, options)  # int32 biases and dead channels; raised scales stay pow2
    return QuantTable(options=options, tensors=tensors)
