"""The logical family (whitepaper 4.41) and Where (4.79), with numpy broadcasting, ONNX convention.

Comparisons (Equal, Greater, GreaterOrEqual, Less, LessOrEqual) compare the two inputs on one common integer
grid, without rounding (the whitepaper's L((a_q - zp_a) * 2^N, (b_q - zp_b) * M)). With s_a >= s_b (else the
roles swap), M / 2^N ~= s_b / s_a and the common unit s_a / 2^N:

    y = L((a_q - zp_a) * 2^N, (b_q - zp_b) * M)                                   bool, no qparams

A constant operand c is put on the grid of the other input x at `CONSTANT_FRACTION_BITS` = K fraction bits:
c' = round_half_even(c * 2^K / s_x) (clipped beyond x's codes), compared with (x_q - zp_x) * 2^K.
Bound: y equals the float comparison of the dequantized inputs whenever |a_f - b_f| > d, with
d = |b_q - zp_b| * s_a * |M / 2^N - s_b / s_a| for two activations (0 when the scales are equal or differ by a
power of two: then Equal is exact) and d = s_x * 2^-(K+1) against a constant.

And, Or, Xor, Not: bool in, bool out, the same operation as in float (no quantization).

Where: the condition is bool; each branch is requantized to the output grid (a constant branch is quantized
straight onto it), then selected:

    z_q = where(c, clamp(((x_c * M_x + 2^(N_x-1)) >> N_x) + zp_z), clamp(((y_c * M_y + 2^(N_y-1)) >> N_y) + zp_z))
    M_i / 2^N_i ~= s_i / s_z.   LSB bound: 0.5 + |x_c| * |M / 2^N - s_i / s_z| (0 for a branch on the output grid).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import numpy as np

from ops.base import centered, multiplier, require_per_tensor, require_qparams
from ops.conformance_case import X, Case, seeded_rng, uniform_constant
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.requant import requantize

CONSTANT_FRACTION_BITS = 16


def _float_operands(inputs) -> list[np.ndarray]:
    """The operands as float32, or as they are when all are integer/bool (shape subgraphs)."""
    arrays = [np.asarray(v) for v in inputs]
    if all(np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_ for a in arrays):
        return arrays
    return [a.astype(np.float32) for a in arrays]


@dataclass
class QuantizedCompare(QuantizedNode):
    factors: tuple[int, int]  # integer multipliers of a_c and b_c onto the common grid (1 for a constant)
    constant_codes: tuple[Optional[np.ndarray], Optional[np.ndarray]]  # a constant on the common grid (int64)


class _Compare(OpDef):
    int_types = "int8/uint8/int16 x int8/uint8/int16 -> bool"
    section = "4.41"
    compare: ClassVar[Callable[[np.ndarray, np.ndarray], np.ndarray]]

    def index_outputs(self, node):
        return frozenset({0})

    def forward_float(self, node, inputs):
        a, b = _float_operands(inputs[:2])
        return [type(self).compare(a, b)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedCompare:
        if len(ctx.node.inputs) != 2:
            raise QuantizationError(f"expected 2 inputs, got {len(ctx.node.inputs)}")
        if 0 in ctx.constants and 1 in ctx.constants:
            raise QuantizationError("both inputs are constants (the graph should have folded this node)")
        qps = [None, None]
        for i in (0, 1):
            if i not in ctx.constants:
                qps[i] = require_qparams(ctx.in_qparams[i], f"input {i}")
                require_per_tensor(qps[i], f"input {i}")
        if 0 in ctx.constants or 1 in ctx.constants:
            return self._with_constant(ctx, qps)
        big = 0 if qps[0].scale[0] >= qps[1].scale[0] else 1
        m, n = multiplier(float(qps[1 - big].scale[0]) / float(qps[big].scale[0]), ctx.options.mbits,
                          "the smaller input scale / the larger")
        factors = [0, 0]
        factors[big], factors[1 - big] = 1 << int(n[0]), int(m[0])
        return QuantizedCompare(ctx.node, qps, [None], (factors[0], factors[1]), (None, None))

    @staticmethod
    def _with_constant(ctx: QuantizeContext, qps) -> QuantizedCompare:
        c_index = 0 if 0 in ctx.constants else 1
        x_qp = qps[1 - c_index]
        c = np.asarray(ctx.constants[c_index], dtype=np.float64)
        if np.any(np.isnan(c)):
            raise QuantizationError(f"constant input {c_index} holds NaN")
        unit = float(x_qp.scale[0]) / (1 << CONSTANT_FRACTION_BITS)
        limit = float((1 << (x_qp.bits + 1)) << CONSTANT_FRACTION_BITS)  # beyond every |x_c| * 2^K
        codes = np.clip(np.rint(c / unit), -limit, limit).astype(np.int64)
        factors = [1, 1]
        factors[1 - c_index] = 1 << CONSTANT_FRACTION_BITS
        constant_codes = (codes, None) if c_index == 0 else (None, codes)
        return QuantizedCompare(ctx.node, qps, [None], (factors[0], factors[1]), constant_codes)

    def forward_int(self, q: QuantizedCompare, inputs, runtime: IntRuntime):
        operands = []
        for i in (0, 1):
            if q.constant_codes[i] is not None:
                operands.append(q.constant_codes[i])
            else:
                operands.append(centered(inputs[i], q.in_qparams[i]) * q.factors[i])
        return [type(self).compare(operands[0], operands[1])]


@register
class Equal(_Compare):
    """ONNX Equal on the common integer grid (module docstring)."""

    op_type = "Equal"
    lsb_bound = 0.0
    compare = staticmethod(np.equal)
    conformance = Case(inputs=(X, "c"), constants={"c": (np.arange(20, dtype=np.float32).reshape(4, 5) % 9 - 4) / 4},
                       data="grid", note="grid data: ties occur")


@register
class Greater(_Compare):
    """ONNX Greater on the common integer grid (module docstring)."""

    op_type = "Greater"
    lsb_bound = 0.0
    compare = staticmethod(np.greater)
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("gt", (4, 5))})


@register
class GreaterOrEqual(_Compare):
    """ONNX GreaterOrEqual on the common integer grid (module docstring)."""

    op_type = "GreaterOrEqual"
    lsb_bound = 0.0
    compare = staticmethod(np.greater_equal)
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("ge", (4, 5))})


@register
class Less(_Compare):
    """ONNX Less on the common integer grid (module docstring)."""

    op_type = "Less"
    lsb_bound = 0.0
    compare = staticmethod(np.less)
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("lt", (4, 5))})


@register
class LessOrEqual(_Compare):
    """ONNX LessOrEqual on the common integer grid (module docstring)."""

    op_type = "LessOrEqual"
    lsb_bound = 0.0
    compare = staticmethod(np.less_equal)
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("le", (4, 5))})


class _BoolOp(OpDef):
    """Bool in, bool out: the integer forward is the float one (no quantization)."""

    int_types = "bool -> bool"
    section = "4.41"
    lsb_bound = 0.0  # exact: no quantization
    apply: ClassVar[Callable[..., np.ndarray]]

    def index_outputs(self, node):
        return frozenset({0})

    def _run(self, inputs) -> list[np.ndarray]:
        arrays = [np.asarray(v) for v in inputs]
        for i, a in enumerate(arrays):
            if a.dtype != np.bool_:
                raise ValueError(f"input {i} must be bool, got {a.dtype}")
        return [type(self).apply(*arrays)]

    def forward_float(self, node, inputs):
        return self._run(inputs)

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [None])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        return self._run(inputs)


@register
class And(_BoolOp):
    """ONNX And (bool, broadcasting)."""

    op_type = "And"
    apply = staticmethod(np.logical_and)
    conformance = Case(shape=(1, 3, 4), inputs=(X, "c"),
                       constants={"c": seeded_rng("and").integers(0, 2, (3, 4)).astype(bool)},
                       x_dtype=np.bool_, path="direct", note="bool inputs: a graph runs it as a shape node")


@register
class Or(_BoolOp):
    """ONNX Or (bool, broadcasting)."""

    op_type = "Or"
    apply = staticmethod(np.logical_or)
    conformance = Case(shape=(1, 3, 4), inputs=(X, "c"),
                       constants={"c": seeded_rng("or").integers(0, 2, (3, 4)).astype(bool)},
                       x_dtype=np.bool_, path="direct", note="bool inputs: a graph runs it as a shape node")


@register
class Xor(_BoolOp):
    """ONNX Xor (bool, broadcasting)."""

    op_type = "Xor"
    apply = staticmethod(np.logical_xor)
    conformance = Case(shape=(1, 3, 4), inputs=(X, "c"),
                       constants={"c": seeded_rng("xor").integers(0, 2, (3, 4)).astype(bool)},
                       x_dtype=np.bool_, path="direct", note="bool inputs: a graph runs it as a shape node")


@register
class Not(_BoolOp):
    """ONNX Not (bool)."""

    op_type = "Not"
    apply = staticmethod(np.logical_not)
    conformance = Case(shape=(1, 3, 4), x_dtype=np.bool_, path="direct",
                       note="bool input: a graph runs it as a shape node")


@dataclass
class QuantizedWhere(QuantizedNode):
    branch_codes: tuple[Optional[np.ndarray], Optional[np.ndarray]]  # constant branches on the output grid
    m: np.ndarray  # per branch: M_i / 2^N_i ~= s_i / s_z (1 for a constant branch, unused)
    n: np.ndarray


@register
class Where(OpDef):
    """ONNX Where: bool condition, both branches requantized to the output grid (module docstring)."""

    op_type = "Where"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.79"
    int_types = "bool, int8/uint8/int16, int8/uint8/int16 -> int8/uint8/int16"
    conformance = Case(inputs=("cond", X, "c"),
                       constants={"cond": seeded_rng("where").integers(0, 2, (4, 5)).astype(bool),
                                  "c": uniform_constant("where", (4, 5))})

    def forward_float(self, node, inputs):
        x, y = _float_operands(inputs[1:3])
        return [np.where(np.asarray(inputs[0], dtype=bool), x, y)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedWhere:
        if len(ctx.node.inputs) != 3:
            raise QuantizationError(f"expected 3 inputs (condition, x, y), got {len(ctx.node.inputs)}")
        z_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(z_qp, "output")
        in_qp, codes, ratios = [None], [], []
        for i in (1, 2):
            if i in ctx.constants:
                codes.append(z_qp.quantize(np.asarray(ctx.constants[i], dtype=np.float64)))
                in_qp.append(None)
                ratios.append(1.0)
            else:
                qp = require_qparams(ctx.in_qparams[i], f"input {i}")
                require_per_tensor(qp, f"input {i}")
                codes.append(None)
                in_qp.append(qp)
                ratios.append(float(qp.scale[0]) / float(z_qp.scale[0]))
        m, n = multiplier(np.array(ratios), ctx.options.mbits, "s_branch / s_z")
        return QuantizedWhere(ctx.node, in_qp, [z_qp], (codes[0], codes[1]), m, n)

    def forward_int(self, q: QuantizedWhere, inputs, runtime: IntRuntime):
        cond = np.asarray(inputs[0])
        if cond.dtype != np.bool_:
            raise ValueError(f"input 0 (the condition) must be bool, got {cond.dtype}")
        z_qp = q.out_qparams[0]
        branches = []
        for k, i in enumerate((1, 2)):
            if q.branch_codes[k] is not None:
                branches.append(q.branch_codes[k])
            else:
                branches.append(requantize(centered(inputs[i], q.in_qparams[i]), q.m[k], q.n[k],
                                           z_qp.zero_point[0], z_qp.qmin, z_qp.qmax))
        return [np.where(cond, branches[0], branches[1]).astype(z_qp.dtype)]
