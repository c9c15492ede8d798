"""Pad (whitepaper 4.50), ONNX convention.

With s_y = s_x and zp_y = zp_x (the whitepaper's choice; the rule overrides the table's proposal):

    y_q = Pad(x_q)      modes constant / reflect / edge / wrap; negative pads crop

In constant mode the pad value is the constant quantized with the input qparams,
c_q = clamp(round_half_even(c / s_x) + zp_x, qmin, qmax), so a zero pad is exactly zp_x.
LSB bound vs the float op on the dequantized input: 0 on copied elements, 0.5 on padded ones (relative to
the constant clamped to the representable range).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ops.base import activation_qparams, int_list, normalize_axes, optional_input
from ops.conformance_case import X, Case, int64s
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node

_NUMPY_MODES = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}


def _mode(node: Node) -> str:
    mode = node.attr("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in _NUMPY_MODES:
        raise QuantizationError(f"unsupported mode {mode!r}")
    return mode


def _float_constant(node: Node, inputs) -> float:
    value = optional_input(inputs, 2)
    if value is not None:
        arr = np.asarray(value)
        if arr.size != 1:
            raise ValueError(f"constant_value must be a scalar, got shape {arr.shape}")
        return float(arr.ravel()[0])
    return float(node.attr("value", 0.0))


def pad_array(node: Node, x: np.ndarray, inputs, fill) -> np.ndarray:
    """ONNX Pad of `x` (float values or integer codes) with `fill` as the constant-mode value."""
    mode = _mode(node)
    pads = int_list(node, inputs, 1, "pads")
    if pads is None:
        raise ValueError("no pads")
    axes = int_list(node, inputs, 3, "axes")
    axes = list(range(x.ndim)) if axes is None else normalize_axes(axes, x.ndim)
    if len(pads) != 2 * len(axes):
        raise ValueError(f"{len(pads)} pads for {len(axes)} axes")
    crop = [slice(None)] * x.ndim
    width = [(0, 0)] * x.ndim
    for i, axis in enumerate(axes):
        begin, end = pads[i], pads[len(axes) + i]
        crop[axis] = slice(max(-begin, 0), x.shape[axis] - max(-end, 0))
        width[axis] = (max(begin, 0), max(end, 0))
    x = x[tuple(crop)]
    if mode == "constant":
        return np.pad(x, width, mode="constant", constant_values=fill)
    if any(w != (0, 0) and x.shape[a] == 0 for a, w in enumerate(width)):
        raise ValueError(f"mode {mode!r} cannot pad an empty axis")
    return np.pad(x, width, mode=_NUMPY_MODES[mode])


@dataclass
class QuantizedPad(QuantizedNode):
    fill_code: int  # the constant-mode value quantized with the input qparams


@register
class Pad(OpDef):
    """ONNX Pad. Integer formula and LSB bound: module docstring."""

    op_type = "Pad"
    lsb_bound = 0.5
    section = "4.50"
    keeps_input_qparams = True
    int_types = "any -> same as input"
    conformance = Case(inputs=(X, "pads"), constants={"pads": int64s(0, 0, 1, 2, 0, 0, 1, 0)})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        return [pad_array(node, x, inputs, _float_constant(node, inputs)).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedPad:
        x_qp = activation_qparams(ctx)
        _mode(ctx.node)
        node = ctx.node
        if len(node.inputs) > 2 and node.inputs[2] and 2 not in ctx.constants:
            raise QuantizationError("constant_value must be a constant input")
        raw = [ctx.constants.get(i) for i in range(len(ctx.node.inputs))]
        fill = int(x_qp.quantize(np.array([_float_constant(ctx.node, raw)]))[0])
        return QuantizedPad(ctx.node, list(ctx.in_qparams), [x_qp], fill)

    def forward_int(self, q: QuantizedPad, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        return [pad_array(q.node, x, inputs, q.fill_code)]
