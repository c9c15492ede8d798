"""Lower bounds on per-channel weight scales, applied once the activation ranges are known.

A calibrated weight scale can be so small that integer arithmetic suffers downstream:

- **int32 bias.** A Conv/Gemm bias is stored as `b_q = round(b / (s_x * s_w[c]))` in int32 (what a QDQ model
  holds and what an accelerator adds to its int32 accumulator). When `|b| / (s_x * s_w[c]) > 2^31 - 1` the bias
  saturates. The scale is raised to `|b[c]| / (s_x * (2^31 - 1))` (as onnxruntime's quantizer does).
- **Dead channels.** Trained networks have output channels whose weights are all ~1e-7: the channel's output is
  its bias. Their extrema scale makes the requant factor `r = s_x * s_w[c] / s_y` so small (< 2^-17) that a
  15-bit multiplier M / 2^N with N <= 31 loses its precision and the accumulator must be pre-rounded (a second
  pass over the whole output). A channel is dead when its weights cannot change its output code:
  either their whole swing is negligible, `K * max|x| * max|w[c]| <= DEAD_CHANNEL_LSB * s_y` (K terms per
  output), or the output is pinned at qmin (or qmax) whatever the input, `b[c] + K * max|x| * (max|w[c]| +
  s'/2)` still rounding below the lowest code (typically a negative bias before a ReLU6). Its scale is raised to
  `s' = MIN_REQUANT_FACTOR * s_y / s_x`: each weight then moves by at most max(|w|, s'/2), which changes the
  output by at most DEAD_CHANNEL_LSB in the first case and not at all in the second.

A raised scale is written to the table as a proportionally widened range, so `min`/`max` and `scale` stay
consistent and the QDQ export and the integer executor use the same grid. Weights the table never saw (a
Conv weight with a BatchNormalization folded into it by the executor) get the same floors from
`floor_folded_weight`, measured on the folded weight and bias: folding multiplies a dead channel's bias by
gamma / sqrt(var + eps), which is large exactly when the channel is dead (var ~ 0).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ptq.engine.bias_add_fold import bias_add_after
from ptq.core.graph import Graph, Node
from ptq.engine.weight_tensors import with_static_weights
from ptq.core.qparams import QParams, compute_qparams
from ptq.table.quant_table import CalibrationOptions, TensorEntry
from ptq.core.requant import INT32_MAX
from ops.registry import bias_role, weight_role

DEAD_CHANNEL_LSB = 1.0 / 64
MIN_REQUANT_FACTOR = 2.0 ** -16  # twice the smallest factor a 15-bit M with N <= 31 holds at full precision
_MARGIN = 1.0 + 2.0 ** -20  # keeps the float32-rounded scale at or above the floor


def _per_channel_max(w: np.ndarray, axis: Optional[int]) -> np.ndarray:
    if axis is None:
        return np.atleast_1d(np.abs(w).max())
    return np.abs(np.moveaxis(w, axis, 0)).reshape(w.shape[axis], -1).max(axis=1)


def _bias(node: Node, graph: Graph) -> np.ndarray:
    """The constant bias of a Conv/ConvTranspose/Gemm (flattened), or [0]."""
    role = bias_role(node)
    if role is None or node.inputs[role.input_index] not in graph.initializers:
        return np.zeros(1)
    return np.asarray(graph.initializers[node.inputs[role.input_index]], dtype=np.float64).ravel()


def _dead_channel_floor(w: np.ndarray, axis: Optional[int], bias: np.ndarray, x_entry: TensorEntry,
                        y_qp: QParams) -> np.ndarray:
    """MIN_REQUANT_FACTOR * s_y / s_x for the dead channels of a weight, 0 for the others."""
    s_x, s_y = float(x_entry.qparams.scale[0]), float(y_qp.scale[0])
    raised = MIN_REQUANT_FACTOR * s_y / s_x
    w_max = _per_channel_max(w, axis)
    terms = w.size / w_max.size  # an upper bound of the terms per output (exact for Conv and Gemm)
    x_max = max(abs(float(x_entry.min.min())), abs(float(x_entry.max.max())))
    negligible = terms * x_max * w_max <= DEAD_CHANNEL_LSB * s_y
    if bias.size not in (1, w_max.size) or w_max.size == 1:
        bias = np.zeros(1)
    # quantized with the raised scale, each weight is off by at most max(|w|, raised / 2)
    swing = terms * x_max * (w_max + raised / 2)
    zp = float(y_qp.zero_point[0])
    pinned = (bias + swing < (y_qp.qmin - zp - 0.5) * s_y) | (bias - swing > (y_qp.qmax - zp + 0.5) * s_y)
    return np.where(negligible | pinned, raised, 0.0)


def _node_floor(node: Node, graph: Graph, tensors: dict[str, TensorEntry], qp: QParams) -> Optional[np.ndarray]:
    """The scale floor one consumer of a weight asks for (per channel of `qp`), or None without an input range."""
    role = weight_role(node)
    x_entry = tensors.get(node.inputs[0])
    if x_entry is None or x_entry.qparams.per_channel:
        return None
    s_x = float(x_entry.qparams.scale[0])
    w = graph.initializers[node.inputs[role.input_index]]
    floor = np.zeros(qp.scale.size)
    # a constant added after the layer is its bias once folded (`ptq.engine.bias_add_fold`); it outputs the add's tensor
    bias_add = bias_add_after(graph, node, graph.consumers())
    signed_bias = _bias(node, graph) if bias_add is None else bias_add.folded_bias(graph)
    bias = np.abs(signed_bias)
    if floor.size == 1 or bias.size in (1, floor.size):
        floor = (bias.max() if floor.size == 1 else bias) / (s_x * INT32_MAX) + floor
    y_entry = tensors.get(node.outputs[0] if bias_add is None else bias_add.adder.outputs[0])
    if y_entry is not None and not y_entry.qparams.per_channel:
        floor = np.maximum(floor, _dead_channel_floor(w, qp.axis, signed_bias, x_entry, y_entry.qparams))
    return floor


def floor_folded_weight(node: Node, graph: Graph, tensors: dict[str, TensorEntry], qp: QParams) -> QParams:
    """`qp` (symmetric qparams of a weight the executor derived, e.g. BN-folded) with each channel's scale
    raised to the floors above, measured on `node` of the rewritten `graph`."""
    floor = _node_floor(node, graph, tensors, qp)
    if floor is None or not np.any(qp.scale < floor) or np.any(qp.zero_point):
        return qp
    scale = np.where(qp.scale < floor, floor * _MARGIN, qp.scale).astype(np.float32).astype(np.float64)
    return QParams(scale=scale, zero_point=qp.zero_point, bits=qp.bits, signed=qp.signed, axis=qp.axis,
                   narrow=qp.narrow)


def floor_weight_scales(graph: Graph, tensors: dict[str, TensorEntry], options: CalibrationOptions) -> list[str]:
    """Raise weight scales in `tensors` (in place) to the floors above; returns the names of the weights changed."""
    graph = with_static_weights(graph)  # a weight computed from initializers, as `weight_tensors` sees it
    floors: dict[str, np.ndarray] = {}
    for node in graph.nodes:
        role = weight_role(node)
        if role is None or len(node.inputs) <= role.input_index:
            continue
        name = node.inputs[role.input_index]
        entry = tensors.get(name)
        if entry is None or entry.kind != "weight":
            continue
        floor = _node_floor(node, graph, tensors, entry.qparams)
        if floor is not None:
            floors[name] = np.maximum(floors.get(name, 0.0), floor)
    changed = []
    for name, floor in floors.items():
        entry = tensors[name]
        qp = entry.qparams
        grow = np.where(qp.scale < floor, floor / qp.scale * _MARGIN, 1.0)
        if not np.any(grow > 1.0):
            continue
        rmin, rmax = np.minimum(entry.min, 0.0) * grow, np.maximum(entry.max, 0.0) * grow
        empty = rmin == rmax  # a zero channel (scale 1) is never below a floor; keep it as it is
        rmin, rmax = np.where(empty, entry.min, rmin), np.where(empty, entry.max, rmax)
        new_qp = compute_qparams(rmin, rmax, qp.bits, symmetric=options.weight_symmetric, signed=qp.signed,
                                 narrow=qp.narrow, pow2=options.pow2, axis=qp.axis)
        tensors[name] = TensorEntry(entry.kind, entry.calibrator, rmin, rmax, new_qp)
        changed.append(name)
    return changed
