"""Softmax (whitepaper 4.66), LogSoftmax and Hardmax through lut's integer kernels, in both ONNX semantics:

- opset >= 13: along one `axis` (default -1);
- opset < 13: the input coerced to 2-D at `axis` (default 1), (prod(shape[:axis]), prod(shape[axis:])), the
  function taken over each row, the result reshaped back. The two agree only when axis is the last axis.

Softmax, per row of n terms (`lut.softmax`):

    d_i = max_j x_q[j] - x_q[i];  e_i = exp_table[d_i] = round(2^E * exp(-d_i * s_x));  S = sum_j e_j
    y_q[i] = floor(e_i * Q / S) + (2 * (e_i * Q mod S) >= S),   Q = 2^B - 1
    E = 20 (the whitepaper's table, int32 sum up to 2047 terms, int64 to 4096); E = ceil(log2 n) + 8 with an
    int64 sum for longer rows, up to 2^24 terms (an OCR head's 18,710 classes: E = 23)

The row length comes from the input's static shape at prepare; a row longer than 2^24 terms is refused there
(the node runs in float, reported with the reason), and a kernel for an unknown row length carries the 2^20
table and a 2^32 one for rows past 4096. The output qparams are fixed by the rule, whatever the quant table
proposed: unsigned B bits (B = the proposal's bits, 8 without one), scale 1 / (2^B - 1), zero point 0.
LSB bound vs the float softmax of the dequantized input (proven in `lut.softmax`): 0.5 LSB (final rounding)
+ Q * (n + 1) / 2^(E+1) (table rounding, <= Q * 2^-9 since n <= 2^(E-8)) -- under 1 LSB for 8-bit outputs
at any row length.

LogSoftmax (`lut.log_softmax`): y = -(d_i * s_x) - log(S / 2^E), with log2(S) from its leading one and a
Q16 table of log2(1 + m); output qparams calibrated (values <= 0). LSB bound: 1 LSB.

Hardmax: y = 1 at the first maximum of each row, else 0. Integer: the first maximum of the codes (the codes are
monotonic in x, so it is the first maximum of the dequantized input), written as the codes of 1.0 and 0.0 in
the output qparams (exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

from lut.log_softmax import LogSoftmaxKernel, build_log_softmax
from lut.softmax import SoftmaxKernel, build_softmax
from ops.base import require_per_tensor, require_qparams
from ops.conformance_case import Case
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node

COERCED_BEFORE = 13  # the opset that changed the Softmax family from "coerce to 2-D" to "one axis"


def along_axis(node: Node, x: np.ndarray, fn: Callable[[np.ndarray, int], np.ndarray]) -> np.ndarray:
    """fn(x, axis) under the node's opset semantics (module docstring): one axis from opset 13, else the
    input coerced to 2-D at `axis` and `fn` applied over its rows (axis 1)."""
    if node.opset >= COERCED_BEFORE:
        return fn(x, int(node.attr("axis", -1)))
    axis = int(node.attr("axis", 1))
    if not -x.ndim <= axis < max(x.ndim, 1):
        raise ValueError(f"axis {axis} out of range for rank {x.ndim}")
    axis %= max(x.ndim, 1)
    rows = x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)
    return fn(rows, 1).reshape(x.shape)


def _kernel_axis(node: Node) -> int:
    """The axis the integer kernel reduces over (the rows' axis under the coerced semantics)."""
    return int(node.attr("axis", -1)) if node.opset >= COERCED_BEFORE else -1


def row_length(node: Node, shape: Optional[tuple]) -> Optional[int]:
    """The number of terms per row under the node's opset semantics, from the input's static shape (None when
    a dimension it needs is unknown): shape[axis] from opset 13, prod(shape[axis:]) before."""
    if shape is None or not shape:
        return None
    if node.opset >= COERCED_BEFORE:
        axis = int(node.attr("axis", -1))
        dims = (shape[axis % len(shape)],) if -len(shape) <= axis < len(shape) else (None,)
    else:
        axis = int(node.attr("axis", 1))
        dims = tuple(shape[axis % len(shape):]) if -len(shape) <= axis < len(shape) else (None,)
    if any(d is None or int(d) <= 0 for d in dims):
        return None
    return int(np.prod(dims, dtype=np.int64))


@dataclass
class QuantizedSoftmax(QuantizedNode):
    kernel: Union[SoftmaxKernel, LogSoftmaxKernel]


def _run_kernel(q: QuantizedSoftmax, x: np.ndarray) -> np.ndarray:
    return along_axis(q.node, np.asarray(x), lambda rows, _axis: q.kernel.forward(rows))


def _float_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _float_log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def _hardmax(x: np.ndarray, axis: int) -> np.ndarray:
    """A boolean mask of the first maximum along `axis`."""
    first = np.expand_dims(np.argmax(x, axis=axis), axis)
    mask = np.zeros(x.shape, dtype=bool)
    np.put_along_axis(mask, first, True, axis=axis)
    return mask


@register
class Softmax(OpDef):
    """ONNX Softmax (both opset semantics) in integers. Formula and LSB bound: module docstring."""

    op_type = "Softmax"
    gives_scores = True
    ranks_input = True
    lsb_bound = 1.0
    section = "4.66"
    int_types = "int8/uint8/int16 -> uint8/uint16"
    conformance = Case(attrs={"axis": -1})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        return [along_axis(node, x, _float_softmax).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedSoftmax:
        x_qp = require_qparams(ctx.in_qparams[0], "input")
        require_per_tensor(x_qp, "input")
        proposal = ctx.out_qparams[0] if ctx.out_qparams else None
        bits = proposal.bits if proposal is not None else 8
        kernel = build_softmax(x_qp, bits, _kernel_axis(ctx.node), row_length(ctx.node, ctx.in_shape(0)))
        return QuantizedSoftmax(ctx.node, list(ctx.in_qparams), [kernel.out_qparams], kernel)

    def forward_int(self, q: QuantizedSoftmax, inputs, runtime: IntRuntime):
        return [_run_kernel(q, inputs[0])]


@register
class LogSoftmax(OpDef):
    """ONNX LogSoftmax (both opset semantics) in integers. Formula and LSB bound: module docstring."""

    op_type = "LogSoftmax"
    gives_scores = True
    ranks_input = True
    lsb_bound = 1.0
    section = "4.66"
    int_types = "int8/uint8/int16 -> int8/uint8/int16"
    conformance = Case(attrs={"axis": -1})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        return [along_axis(node, x, _float_log_softmax).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedSoftmax:
        x_qp = require_qparams(ctx.in_qparams[0], "input")
        require_per_tensor(x_qp, "input")
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(y_qp, "output")
        kernel = build_log_softmax(x_qp, y_qp, _kernel_axis(ctx.node), row_length(ctx.node, ctx.in_shape(0)))
        return QuantizedSoftmax(ctx.node, list(ctx.in_qparams), [y_qp], kernel)

    def forward_int(self, q: QuantizedSoftmax, inputs, runtime: IntRuntime):
        return [_run_kernel(q, inputs[0])]


@register
class Hardmax(OpDef):
    """ONNX Hardmax (both opset semantics): the first maximum of the codes. Exact (module docstring)."""

    op_type = "Hardmax"
    ranks_input = True
    lsb_bound = 0.0
    int_types = "any -> int8/uint8/int16 (codes of 0 and 1)"
    conformance = Case(attrs={"axis": -1})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        return [along_axis(node, x, _hardmax).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        require_per_tensor(require_qparams(ctx.in_qparams[0], "input"), "input")  # codes order as values do
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(y_qp, "output")
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [y_qp])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        y_qp = q.out_qparams[0]
        zero, one = (int(c) for c in y_qp.quantize(np.array([0.0, 1.0])))
        mask = along_axis(q.node, np.asarray(inputs[0]), _hardmax)
        return [np.where(mask, one, zero).astype(y_qp.dtype)]
