"""Softmax (whitepaper 4.66) through lut's integer softmax kernel (opset >= 13 semantics: one axis, default -1).

    d_i = max_j x_q[j] - x_q[i];  e_i = exp_table[d_i] = round(2^20 * exp(-d_i * s_x));  S = sum_j e_j
    y_q[i] = floor(e_i * Q / S) + (2 * (e_i * Q mod S) >= S),   Q = 2^B - 1

The output qparams are fixed by the rule, whatever the quant table proposed: unsigned B bits (B = the
proposal's bits, 8 without one), scale 1 / (2^B - 1), zero point 0. Rows are limited to 4096 terms.

LSB bound vs the float softmax of the dequantized input: 0.5 LSB (final rounding) + Q * (relative error of
the table entries around the row's mass, <= 2^-21 for entries near 2^20; entries rounded to small integers
carry at most 0.5 / e_i) -- under 1 LSB for 8-bit outputs; `tests/test_ops_activation.py` checks <= 1 LSB.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lut.softmax import SoftmaxKernel, build_softmax
from ops.base import require_per_tensor, require_qparams
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register


@dataclass
class QuantizedSoftmax(QuantizedNode):
    kernel: SoftmaxKernel


@register
class Softmax(OpDef):
    """ONNX Softmax (opset 13+: along `axis`, default -1) in integers. Formula and LSB bound: module docstring."""

    op_type = "Softmax"
    section = "4.66"
    int_types = "int8/uint8/int16 -> uint8/uint16"

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        axis = int(node.attr("axis", -1))
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return [(e / e.sum(axis=axis, keepdims=True)).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedSoftmax:
        node = ctx.node
        x_qp = require_qparams(ctx.in_qparams[0], "input")
        require_per_tensor(x_qp, "input")
        proposal = ctx.out_qparams[0] if ctx.out_qparams else None
        bits = proposal.bits if proposal is not None else 8
        kernel = build_softmax(x_qp, bits, int(node.attr("axis", -1)))
        return QuantizedSoftmax(node, list(ctx.in_qparams), [kernel.out_qparams], kernel)

    def forward_int(self, q: QuantizedSoftmax, inputs, runtime: IntRuntime):
        return [q.kernel.forward(np.asarray(inputs[0]))]
