"""Unary ops with exact integer rules: Abs (4.1), Neg (4.47 Negative), Sign (4.64), CRelu (4.17), Square (4.73).

ONNX convention, x_c = x_q - zp_x. The output qparams are set by rule (the quant table's proposal is not used),
chosen so that every input code maps to an output code exactly:

    Abs:   y_q = |x_c|                                  s_y = s_x, zp_y = 0, unsigned, same bits
    Neg:   y_q = qmin + qmax - x_q                      s_y = s_x, zp_y = qmin + qmax - zp_x, same type
    Sign:  y_q = sign(x_c)                              s_y = 1, zp_y = 0, int8
    CRelu: y_q = concat(max(x_c, 0), max(-x_c, 0))      s_y = s_x, zp_y = 0, unsigned, same bits
           (ai.ptq: Concat(Relu(x), Relu(-x)) along `axis`, default 1, the channel axis)

|x_c| <= 2^bits - 1 for any zero point, so the unsigned grid of the input's width holds every value; Neg
mirrors the input grid (qmin + qmax - x_q stays in [qmin, qmax]). LSB bound vs the float op on the dequantized
input: 0 (exact).

Square (ai.ptq; ONNX writes x * x or Pow(x, 2)) takes the output proposal and ElementwiseMul's rule:

    y_q = clamp(((x_c * x_c * M + 2^(N-1)) >> N) + zp_y, qmin, qmax),     M / 2^N ~= s_x^2 / s_y
    LSB bound: 0.5 + x_c^2 * |M / 2^N - s_x^2 / s_y|  (<= 0.5 + |y_q - zp_y| * 2^-(mbits-1) for factors >= 2^-17)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ops.base import activation_qparams, centered, multiplier, require_per_tensor, require_qparams
from ops.conformance_case import Case
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register
from ptq.core.qparams import QParams
from ptq.core.requant import requantize


def _magnitude_qparams(x_qp: QParams) -> QParams:
    """The unsigned grid of the input's scale and width: holds |x_c| for every input code."""
    return QParams(scale=x_qp.scale, zero_point=0, bits=x_qp.bits, signed=False)


def _same_type_float(x: np.ndarray) -> np.ndarray:
    """Float inputs as float32; integer inputs (shape subgraphs) keep their dtype, as ONNX's ops do."""
    x = np.asarray(x)
    return x if np.issubdtype(x.dtype, np.integer) else x.astype(np.float32)


@register
class Abs(OpDef):
    """ONNX Abs: y_q = |x_q - zp_x| on the unsigned grid of the input's scale (module docstring)."""

    op_type = "Abs"
    lsb_bound = 0.0
    section = "4.1"
    int_types = "int8/uint8/int16 -> uint8/uint8/uint16"
    conformance = Case()

    def forward_float(self, node, inputs):
        return [np.abs(_same_type_float(inputs[0]))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        x_qp = activation_qparams(ctx)
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [_magnitude_qparams(x_qp)])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        return [np.abs(centered(inputs[0], q.in_qparams[0])).astype(q.out_qparams[0].dtype)]


@register
class Neg(OpDef):
    """ONNX Neg: y_q = qmin + qmax - x_q on the mirrored input grid (module docstring)."""

    op_type = "Neg"
    lsb_bound = 0.0
    section = "4.47"
    int_types = "int8/uint8/int16 -> same as input"
    conformance = Case()

    def forward_float(self, node, inputs):
        return [np.negative(_same_type_float(inputs[0]))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        x_qp = activation_qparams(ctx)
        zp = x_qp.qmin + x_qp.qmax - int(x_qp.zero_point[0])
        y_qp = QParams(scale=x_qp.scale, zero_point=zp, bits=x_qp.bits, signed=x_qp.signed, narrow=x_qp.narrow)
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [y_qp])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        y_qp = q.out_qparams[0]
        return [(y_qp.qmin + y_qp.qmax - np.asarray(inputs[0]).astype(np.int64)).astype(y_qp.dtype)]


@register
class Sign(OpDef):
    """ONNX Sign: y_q = sign(x_q - zp_x) with s_y = 1, zp_y = 0 (module docstring)."""

    op_type = "Sign"
    lsb_bound = 0.0
    section = "4.64"
    int_types = "int8/uint8/int16 -> int8"
    conformance = Case(data="grid")

    def forward_float(self, node, inputs):
        return [np.sign(_same_type_float(inputs[0]))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        activation_qparams(ctx)
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [QParams(scale=1.0, zero_point=0, bits=8, signed=True)])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        return [np.sign(centered(inputs[0], q.in_qparams[0])).astype(np.int8)]


@register
class CRelu(OpDef):
    """ai.ptq CRelu: Concat(Relu(x), Relu(-x)) along `axis` (default 1); exact on |x_c|'s grid (module docstring)."""

    op_type = "CRelu"
    lsb_bound = 0.0
    domain = "ai.ptq"
    section = "4.17"
    int_types = "int8/uint8/int16 -> uint8/uint8/uint16"
    conformance = Case(path="direct",
                       reference=lambda x: [np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], axis=1)])

    @staticmethod
    def _axis(node, ndim: int) -> int:
        axis = int(node.attr("axis", 1))
        if not -ndim <= axis < ndim:
            raise ValueError(f"attribute axis={axis} out of range for an input of rank {ndim}")
        return axis % ndim

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        zero = np.float32(0)
        return [np.concatenate([np.maximum(x, zero), np.maximum(-x, zero)], axis=self._axis(node, x.ndim))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        x_qp = activation_qparams(ctx)
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [_magnitude_qparams(x_qp)])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        x_c = centered(inputs[0], q.in_qparams[0])
        halves = [np.maximum(x_c, 0), np.maximum(-x_c, 0)]
        return [np.concatenate(halves, axis=self._axis(q.node, x_c.ndim)).astype(q.out_qparams[0].dtype)]


@dataclass
class QuantizedSquare(QuantizedNode):
    m: np.ndarray  # M / 2^N ~= s_x^2 / s_y
    n: np.ndarray


@register
class Square(OpDef):
    """ai.ptq Square, y = x^2: x_c^2 requantized by M / 2^N ~= s_x^2 / s_y (module docstring)."""

    op_type = "Square"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    domain = "ai.ptq"
    section = "4.73"
    int_types = "int8/uint8/int16 -> int8/uint8/int16"
    conformance = Case(path="direct", reference=lambda x: [x * x])

    def forward_float(self, node, inputs):
        x = _same_type_float(inputs[0])
        return [x * x]

    def quantize(self, ctx: QuantizeContext) -> QuantizedSquare:
        x_qp = activation_qparams(ctx)
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(y_qp, "output")
        r = float(x_qp.scale[0]) ** 2 / float(y_qp.scale[0])
        m, n = multiplier(r, ctx.options.mbits, "s_x^2 / s_y")
        return QuantizedSquare(ctx.node, list(ctx.in_qparams), [y_qp], m, n)

    def forward_int(self, q: QuantizedSquare, inputs, runtime: IntRuntime):
        x_c = centered(inputs[0], q.in_qparams[0])
        y_qp = q.out_qparams[0]
        return [requantize(x_c * x_c, q.m, q.n, y_qp.zero_point[0], y_qp.qmin, y_qp.qmax, dtype=y_qp.dtype)]
