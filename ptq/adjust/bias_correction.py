"""Empirical bias correction (Nagel et al. 2019, "Data-Free Quantization", section 4.2), on calibration images.

Quantizing a weight W to W_q = dequantize(quantize(W)) shifts each output channel's expected value by
E[(W_q - W) x]. For a Conv that expectation is linear in the mean input patch, so per output channel c

    shift_c = sum_{k, i, j} (W_q - W)[c, k, i, j] * P[g(c) * K + k, i, j],
    P[k', i, j] = mean over images and output positions of the zero-padded input x[k', y*s + i*d, x*s + j*d]

(K input channels per group, g(c) the group of channel c); exact, padding and strides included. For a Gemm
(alpha = beta = 1) the patch is the mean input row. The corrected bias is b'_c = b_c - shift_c, so
E[W_q x + b'] = E[W x + b] on the images the statistics come from. A layer without a bias of its own whose
bias is a per-channel constant added after it (`Conv -> Add(c)`, folded into the layer at prepare:
`ptq.engine.bias_add_fold`) has that constant corrected instead: c'_c = c_c - sign * shift_c. Inputs are the float model's activations.
Only the mean patch of each layer is kept (C*kh*kw numbers), so memory does not grow with the images.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ptq.engine.bias_add_fold import bias_add_after
from ops.registry import bias_role, channel_groups, layer_kind
from ptq.core.graph import Graph, Node
from ptq.core.roles import LayerKind
from ptq.engine.float_run import layer_inputs
from ptq.table.quant_table import QuantTable

# the layers whose output mean shift the correction computes: convolutions (2-D, explicit pads) and Gemms
CORRECTED_LAYERS = (LayerKind.CONVOLUTION, LayerKind.FULLY_CONNECTED)


@dataclass
class BiasCorrectionLog:
    corrected: dict[str, float] = field(default_factory=dict)  # node name -> max |shift_c|
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        worst = max(self.corrected.values(), default=0.0)
        return f"bias correction: {len(self.corrected)} layers (largest shift {worst:.3g})"


def conv_geometry(node: Node, w: np.ndarray) -> Optional[tuple]:
    if w.ndim != 4 or node.attr("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        return None
    pads = list(node.attr("pads", [0, 0, 0, 0]))
    strides = list(node.attr("strides", [1, 1]))
    dilations = list(node.attr("dilations", [1, 1]))
    return pads, strides, dilations


def mean_patch(x: np.ndarray, kernel: tuple[int, int], pads, strides, dilations) -> np.ndarray:
    """Sum over samples and output positions of the zero-padded input patch, [C, kh, kw] (float64), and the
    number of positions summed (module docstring)."""
    kh, kw = kernel
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    ho = (xp.shape[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    wo = (xp.shape[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    out = np.empty((x.shape[1], kh, kw))
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dilations[0], j * dilations[1]
            window = xp[:, :, r0: r0 + strides[0] * (ho - 1) + 1: strides[0], c0: c0 + strides[1] * (wo - 1) + 1: strides[1]]
            out[:, i, j] = window.sum(axis=(0, 2, 3))
    return out, x.shape[0] * ho * wo


def conv_shift(delta: np.ndarray, patch: np.ndarray, group: int) -> np.ndarray:
    """shift_c = sum (W_q - W)[c] * P[group of c] (module docstring); delta [Cout, K, kh, kw], patch [C, kh, kw]."""
    cout, k = delta.shape[:2]
    d = delta.reshape(group, cout // group, k, -1)
    p = patch.reshape(group, k, -1)
    return np.einsum("gokx,gkx->go", d, p).reshape(cout)


def weighted_layers(graph: Graph, table: QuantTable, log: BiasCorrectionLog) -> list[Node]:
    chosen = []
    for node in graph.nodes:
        kind = layer_kind(node)
        if kind not in CORRECTED_LAYERS or len(node.inputs) < 2:
            continue
        entry = table.tensors.get(node.inputs[1])
        if entry is None or entry.kind != "weight":
            continue
        w = graph.initializers[node.inputs[1]]
        if kind is LayerKind.CONVOLUTION and conv_geometry(node, w) is None:
            log.skipped.append((node.name, "not a 2-D Conv with explicit pads"))
            continue
        if kind is LayerKind.FULLY_CONNECTED and (node.attr("alpha", 1.0) != 1.0 or node.attr("beta", 1.0) != 1.0
                                                  or node.attr("transA", 0) or w.ndim != 2):
            log.skipped.append((node.name, "Gemm with alpha/beta != 1 or transA"))
            continue
        chosen.append(node)
    return chosen


def mean_patches(graph: Graph, layers: list[Node], batches: Iterable[np.ndarray]) -> dict[str, np.ndarray]:
    """Node name -> the mean input patch P of the module docstring ([C, kh, kw] for a Conv, the mean input row
    for a Gemm), from the float graph's activations over `batches` (each folded in and dropped)."""
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for node, x in layer_inputs(graph, layers, batches):
        w = graph.initializers[node.inputs[1]]
        if layer_kind(node) is LayerKind.CONVOLUTION:
            pads, strides, dilations = conv_geometry(node, w)
            s, n = mean_patch(x, w.shape[2:], pads, strides, dilations)
        else:
            rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
            s, n = rows.sum(axis=0), rows.shape[0]
        sums[node.name] = sums.get(node.name, 0) + s
        counts[node.name] = counts.get(node.name, 0) + n
    return {name: sums[name] / counts[name] for name in sums}


def layer_shift(node: Node, delta: np.ndarray, patch: np.ndarray) -> np.ndarray:
    """shift_c = E[(delta x)_c] for the layer's weight change `delta` (module docstring)."""
    if layer_kind(node) is LayerKind.CONVOLUTION:
        return conv_shift(delta, patch, channel_groups(node))
    return (delta if node.attr("transB", 0) else delta.T) @ patch


def rounding_delta(w: np.ndarray, qparams) -> np.ndarray:
    """W_q - W on the grid of `qparams` (round to nearest), float64."""
    w = w.astype(np.float64)
    return qparams.dequantize(qparams.quantize(w)).astype(np.float64) - w


def own_bias(graph: Graph, node: Node, shared: set) -> str:
    """The node's bias initializer (its op's `bias_role`) when no other node uses it, else ''."""
    role = bias_role(node)
    name = node.inputs[role.input_index] if role is not None and len(node.inputs) > role.input_index else ""
    return name if name and name in graph.initializers and name not in shared else ""


def bias_target(graph: Graph, node: Node, shared: set, consumers: dict) -> tuple[str, int]:
    """(the initializer holding the layer's bias, the sign it enters with): its own bias, else a per-channel
    constant added after it that no other node uses (one value per channel); ('', 0) when there is none."""
    name = own_bias(graph, node, shared)
    if name:
        return name, 1
    match = bias_add_after(graph, node, consumers)
    if match is None or match.constant in shared or graph.initializers[match.constant].size != match.channels:
        return "", 0
    return match.constant, match.sign


def corrected_bias(graph: Graph, bias_name: str, shift: np.ndarray, sign: int = 1) -> np.ndarray:
    """b' = b - sign * shift_c for the initializer `bias_name` holding the layer's bias (module docstring), in the
    bias's dtype; `sign` -1 for a constant subtracted after the layer (`bias_target`)."""
    bias = graph.initializers[bias_name]
    return (bias.astype(np.float64) - sign * np.reshape(shift, bias.shape)).astype(bias.dtype)


def correct_biases(graph: Graph, table: QuantTable, batches: Iterable[np.ndarray],
                   quantized: Optional[dict[str, np.ndarray]] = None) -> tuple[onnx.ModelProto, BiasCorrectionLog]:
    """A copy of `graph.model` whose Conv/Gemm biases are corrected for the table's weight quantization.
    `quantized`: weight name -> the dequantized weight the integer graph will use (AdaRound's), instead of
    round-to-nearest on the table's grid; the copy holds those weights."""
    log = BiasCorrectionLog()
    layers = weighted_layers(graph, table, log)
    patches = mean_patches(graph, layers, batches)
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    inits = {init.name: init for init in model.graph.initializer}
    consumers = graph.consumers()
    shared = {name for name, users in consumers.items() if len(users) > 1}
    for node in layers:
        if node.name not in patches:
            continue
        w = graph.initializers[node.inputs[1]]
        w_q = (quantized or {}).get(node.inputs[1])
        delta = rounding_delta(w, table.tensors[node.inputs[1]].qparams) if w_q is None else \
            w_q.astype(np.float64) - w.astype(np.float64)
        shift = layer_shift(node, delta, patches[node.name])
        bias_name, sign = bias_target(graph, node, shared, consumers)
        if not bias_name:
            log.skipped.append((node.name, "no bias of its own to correct"))
            continue
        inits[bias_name].CopyFrom(numpy_helper.from_array(corrected_bias(graph, bias_name, shift, sign), bias_name))
        log.corrected[node.name] = float(np.max(np.abs(shift)))
    for name, value in (quantized or {}).items():
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
    return model, log


def recorrected_biases(graph: Graph, old: QuantTable, new: QuantTable, weights: Iterable[str],
                       patches: dict[str, np.ndarray], shifts: Optional[dict] = None) -> dict[str, np.ndarray]:
    """Bias name -> its value once the listed weights move from `old`'s grid to `new`'s (e.g. 8 -> 16 bits) in a
    graph whose biases were corrected for `old`: b'' = b' - shift(delta_new - delta_old), the correction for
    the old rounding replaced by the one for the new (linear in delta, so no float weights need be kept).
    `patches`: `mean_patches` of the layers (a layer without one keeps its bias). `shifts`: the shifts computed
    by earlier calls, kept by the caller (`ptq tune` moves the same weights between the same grids again and
    again): by the ids of the node, weight, grids and patch, each entry holding them (so no id is reused)."""
    wanted = set(weights)
    consumers = graph.consumers()
    shared = {name for name, users in consumers.items() if len(users) > 1}
    out = {}
    for node in graph.nodes:
        if layer_kind(node) not in CORRECTED_LAYERS or len(node.inputs) < 2 or node.inputs[1] not in wanted:
            continue
        bias_name, sign = bias_target(graph, node, shared, consumers)
        if not bias_name or node.name not in patches:
            continue
        w, patch = graph.initializers[node.inputs[1]], patches[node.name]
        grids = new.tensors[node.inputs[1]].qparams, old.tensors[node.inputs[1]].qparams
        key = (id(node), id(w), id(grids[0]), id(grids[1]), id(patch))
        known = shifts.get(key) if shifts is not None else None
        if known is None:
            change = rounding_delta(w, grids[0]) - rounding_delta(w, grids[1])
            known = (node, w, grids, patch, layer_shift(node, change, patch))
            if shifts is not None:
                shifts[key] = known
        out[bias_name] = corrected_bias(graph, bias_name, known[-1], sign)
    return out
