"""Unary math ops through lookup tables: Exp, Log, Erf, Sin, Cos, Sqrt, Rsqrt, Elu, Selu, Softplus, Softsign,
BNLL (whitepaper 4.30, 4.40, 4.63, 4.16, 4.72, 4.60, 4.29, 4.61, 4.67, 4.68, 4.9; the LUT rule of 3.3.2.2).

Offline (float64, ONNX convention): T[x_q] = clamp(round_half_even(f((x_q - zp_x) * s_x) / s_y) + zp_y, qmin, qmax)
for every input code (inputs of at most 10 bits: a direct table, a half table mirrored for odd/even f when the
input is symmetric); 16-bit inputs get `ops.lut_ops.lut_within_budget`'s interpolated table. At run time
y_q = T[x_q], integer indexing only.

LSB bound vs the float op on the dequantized input: 0.5 for direct tables (the table is the correctly rounded
result; float32 evaluation of f may flip a tie); 0.5 + the table's `max_error_lsb` (measured over every input
code when the table is built; at most `WIDE_TABLE_BUDGET_LSB` = 2 for functions smooth over the input range,
more where f has a kink between two nodes: Selu's slope jumps from 1.76 to 1.05 at 0, 4 LSB measured with
1025 nodes on a 16-bit grid) for interpolated ones. Log, Sqrt and Rsqrt have an infinite slope or a pole at 0 that no interpolated table follows (thousands
of LSB off), so their input must have at most 10 bits. Their tables read input codes below zero as 0
(Log -> qmin of y, Sqrt -> 0, Rsqrt -> qmax of y), where the float op gives NaN.

Rsqrt (1 / sqrt(x)) and BNLL (log(1 + e^x), Caffe's) are whitepaper ops that ONNX lacks: domain "ai.ptq".
"""
from __future__ import annotations

import numpy as np

from lut.functions import FUNCTIONS, SELU_ALPHA, SELU_GAMMA, LutFunction
from lut.table import MAX_FULL_TABLE_BITS
from ops.base import require_per_tensor, require_qparams
from ops.conformance_case import Case
from ops.lut_ops import QuantizedLut, lut_within_budget
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, register


class _TableOp(OpDef):
    """y = f(x) elementwise through a table built from the input and output qparams (module docstring)."""

    int_types = "int8/uint8/int16 -> int8/uint8/int16"
    # f is singular at 0: tables need a direct (<= 10-bit) input and read codes below zero as 0
    singular_at_zero = False

    lut_name = ""  # the `lut.functions.FUNCTIONS` entry, for ops without attributes

    def function(self, node) -> LutFunction:
        return FUNCTIONS[self.lut_name]

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        return [self.function(node)(x).astype(np.float32)]

    def table_function(self, node) -> LutFunction:
        fn = self.function(node)
        if not self.singular_at_zero:
            return fn
        return LutFunction(f"{fn.name}_nonneg", lambda x: fn(np.maximum(x, 0.0)))

    def quantize(self, ctx: QuantizeContext) -> QuantizedLut:
        x_qp = require_qparams(ctx.in_qparams[0], "input")
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(x_qp, "input")
        require_per_tensor(y_qp, "output")
        if self.singular_at_zero and x_qp.bits > MAX_FULL_TABLE_BITS:
            raise QuantizationError(
                f"input has {x_qp.bits} bits: {self.op_type} needs a direct table of at most "
                f"{MAX_FULL_TABLE_BITS}-bit codes (no interpolated table follows it near 0)")
        table = lut_within_budget(self.table_function(ctx.node), x_qp, y_qp)
        return QuantizedLut(ctx.node, list(ctx.in_qparams), [y_qp], table)

    def forward_int(self, q: QuantizedLut, inputs, runtime: IntRuntime):
        return [q.table.lookup(np.asarray(inputs[0]))]


@register
class Exp(_TableOp):
    """ONNX Exp as a lookup table (module docstring)."""

    op_type = "Exp"
    lsb_bound = 0.5
    section = "4.30"
    lut_name = "exp"
    conformance = Case()


@register
class Log(_TableOp):
    """ONNX Log as a lookup table; input of at most 10 bits (module docstring)."""

    op_type = "Log"
    lsb_bound = 0.5
    section = "4.40"
    singular_at_zero = True
    int_types = "int8/uint8 -> int8/uint8/int16"
    lut_name = "log"
    conformance = Case(data="positive")


@register
class Erf(_TableOp):
    """ONNX Erf as a lookup table (odd: a half table for a symmetric input)."""

    op_type = "Erf"
    lsb_bound = 0.5
    section = "3.3.2.2 (LUT; no chapter 4 entry)"
    lut_name = "erf"
    conformance = Case()


@register
class Sin(_TableOp):
    """ONNX Sin as a lookup table (odd: a half table for a symmetric input)."""

    op_type = "Sin"
    lsb_bound = 0.5
    section = "4.63"
    lut_name = "sin"
    conformance = Case()


@register
class Cos(_TableOp):
    """ONNX Cos as a lookup table (even: a half table for a symmetric input)."""

    op_type = "Cos"
    lsb_bound = 0.5
    section = "4.16"
    lut_name = "cos"
    conformance = Case()


@register
class Sqrt(_TableOp):
    """ONNX Sqrt as a lookup table; input of at most 10 bits (module docstring)."""

    op_type = "Sqrt"
    lsb_bound = 0.5
    section = "4.72"
    singular_at_zero = True
    int_types = "int8/uint8 -> int8/uint8/int16"
    lut_name = "sqrt"
    conformance = Case(data="positive")


@register
class Rsqrt(_TableOp):
    """ai.ptq Rsqrt, y = 1 / sqrt(x), as a lookup table; input of at most 10 bits (module docstring)."""

    op_type = "Rsqrt"
    lsb_bound = 0.5
    domain = "ai.ptq"
    section = "4.60"
    singular_at_zero = True
    int_types = "int8/uint8 -> int8/uint8/int16"
    lut_name = "rsqrt"
    conformance = Case(path="direct", reference=lambda x: [1 / np.sqrt(x)], data="positive")


@register
class Softplus(_TableOp):
    """ONNX Softplus, log(1 + e^x), as a lookup table."""

    op_type = "Softplus"
    lsb_bound = 0.5
    section = "4.67"
    lut_name = "softplus"
    conformance = Case()


@register
class BNLL(_TableOp):
    """ai.ptq BNLL (Caffe): x + log(1 + e^-x) for x > 0, else log(1 + e^x); that is log(1 + e^x), as a table."""

    op_type = "BNLL"
    lsb_bound = 0.5
    domain = "ai.ptq"
    section = "4.9"
    lut_name = "bnll"
    conformance = Case(path="direct",
                       reference=lambda x: [np.where(x > 0, x + np.log1p(np.exp(-x)), np.log1p(np.exp(x)))])


@register
class Softsign(_TableOp):
    """ONNX Softsign, x / (1 + |x|), as a lookup table (odd: a half table for a symmetric input)."""

    op_type = "Softsign"
    lsb_bound = 0.5
    section = "4.68"
    lut_name = "softsign"
    conformance = Case()


@register
class Elu(_TableOp):
    """ONNX Elu, x for x > 0 else alpha * (e^x - 1) (alpha = 1 by default), as a lookup table."""

    op_type = "Elu"
    lsb_bound = 0.5
    section = "4.29"
    conformance = Case()

    def function(self, node) -> LutFunction:
        alpha = float(node.attr("alpha", 1.0))
        return LutFunction(f"elu_{alpha:g}", lambda x: np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0))))


@register
class Selu(_TableOp):
    """ONNX Selu, gamma * (x for x > 0 else alpha * (e^x - 1)), as a lookup table."""

    op_type = "Selu"
    lsb_bound = 0.5
    section = "4.61"
    conformance = Case()

    def function(self, node) -> LutFunction:
        alpha = float(node.attr("alpha", SELU_ALPHA))
        gamma = float(node.attr("gamma", SELU_GAMMA))
        return LutFunction(f"selu_{alpha:g}_{gamma:g}",
                           lambda x: gamma * np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0))))
