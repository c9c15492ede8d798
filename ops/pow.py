"""Pow, z = x^y with numpy broadcasting (whitepaper 4.51), ONNX convention.

A constant exponent alpha (one value; LayerNorm's Pow(x, 2), x^0.5, x^3) goes through a lookup table on x:

    z_q = T[x_q],   T[x_q] = clamp(round_half_even(((x_q - zp_x) * s_x)^alpha / s_z) + zp_z, qmin, qmax)

(`ops.unary_lut`'s table rule: 0.5 LSB for inputs of at most 10 bits, 0.5 + the table's measured error for
interpolated 16-bit ones). alpha = 2 instead takes Square's exact integer rule, good for 16-bit inputs too:

    z_q = clamp(((x_c * x_c * M + 2^(N-1)) >> N) + zp_z, qmin, qmax),   M / 2^N ~= s_x^2 / s_z
    LSB bound: 0.5 + x_c^2 * |M / 2^N - s_x^2 / s_z|

A fractional alpha reads input codes below zero as 0 (float: NaN); for 0 < alpha < 1 or alpha < 0 (infinite
slope or a pole at 0) the input must have at most 10 bits.

A run-time exponent y takes `lut.arith.build_pow`: z = sign(x)^y * exp(y * log|x|) through a 16-bit log|x|
table, an integer product requantized to a 16-bit v, and an interpolated exp table; x of at most 10 bits.
An integer exponent tensor (ONNX allows int32/int64 y) is read with s_y = 1, zp_y = 0 (its parity gives the
sign of a negative base); a constant exponent with several values is quantized the same way when it holds
integers, else on its own range with 8 bits. LSB bound: 1 (measured, `lut.arith`: the log and exp codes'
roundings plus the final one, when |z| is within the output range). A constant positive scalar base b
(2^y, e^y) is a table on y: T[y_q] = quantize(b^((y_q - zp_y) s_y)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from lut.arith import PowKernel, build_pow
from lut.functions import LutFunction, power
from lut.table import MAX_FULL_TABLE_BITS, LookupTable
from ops.base import centered, multiplier, require_per_tensor, require_qparams
from ops.conformance_case import X, Case
from ops.lut_ops import lut_within_budget
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.qparams import QParams, compute_qparams
from ptq.core.requant import requantize

INTEGER_EXPONENT_BITS = 16  # an integer exponent tensor's codes are its values
CONSTANT_EXPONENT_BITS = 8


@dataclass
class QuantizedPowSquare(QuantizedNode):
    m: np.ndarray  # M / 2^N ~= s_x^2 / s_z
    n: np.ndarray


@dataclass
class QuantizedPowTable(QuantizedNode):
    table: LookupTable
    table_input: int  # 0: a table on x (constant exponent); 1: a table on y (constant base)


@dataclass
class QuantizedPowKernel(QuantizedNode):
    kernel: PowKernel
    exponent_codes: Optional[np.ndarray]  # a constant exponent with several values, quantized


def _singular_at_zero(alpha: float) -> bool:
    return alpha < 1 and alpha != 0


def _exponent_table(alpha: float) -> LutFunction:
    fn = power(alpha)
    if alpha == round(alpha):
        return fn
    return LutFunction(f"{fn.name}_nonneg", lambda x: fn(np.maximum(x, 0.0)))


@register
class Pow(OpDef):
    """ONNX Pow (broadcasting). Integer formulas and LSB bounds: module docstring."""

    op_type = "Pow"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.51"
    int_types = "int8/uint8/int16 ^ const, int8/uint8 ^ int8/uint8/int16/int64 -> int8/uint8/int16"
    conformance = Case(inputs=(X, "e"), constants={"e": np.float32(2.0)}, note="constant exponent 2")

    def forward_float(self, node, inputs):
        x, y = (np.asarray(v) for v in inputs[:2])
        if np.issubdtype(x.dtype, np.integer):  # shape subgraphs: ONNX keeps the base's type
            return [np.power(x, y.astype(x.dtype))]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return [np.power(x.astype(np.float32), y.astype(np.float32)).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        z_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(z_qp, "output")
        if 0 in ctx.constants:
            return self._constant_base(ctx, z_qp)
        x_qp = require_qparams(ctx.in_qparams[0], "input 0 (the base)")
        require_per_tensor(x_qp, "input 0 (the base)")
        if 1 in ctx.constants:
            exponent = np.asarray(ctx.constants[1], dtype=np.float64)
            if exponent.size and np.all(exponent == exponent.flat[0]):
                return self._constant_exponent(ctx, x_qp, float(exponent.flat[0]), z_qp)
            return self._kernel(ctx, x_qp, self._constant_exponent_qparams(exponent), z_qp, exponent)
        y_qp = ctx.in_qparams[1]
        if y_qp is None:  # an integer exponent tensor: its values are its codes
            y_qp = QParams(scale=1.0, zero_point=0, bits=INTEGER_EXPONENT_BITS, signed=True)
        require_per_tensor(y_qp, "input 1 (the exponent)")
        return self._kernel(ctx, x_qp, y_qp, z_qp, None)

    @staticmethod
    def _constant_exponent(ctx, x_qp, alpha: float, z_qp) -> QuantizedNode:
        if not np.isfinite(alpha):
            raise QuantizationError(f"the constant exponent is {alpha}")
        if alpha == 2:
            r = float(x_qp.scale[0]) ** 2 / float(z_qp.scale[0])
            m, n = multiplier(r, ctx.options.mbits, "s_x^2 / s_z")
            return QuantizedPowSquare(ctx.node, [x_qp, None], [z_qp], m, n)
        if _singular_at_zero(alpha) and x_qp.bits > MAX_FULL_TABLE_BITS:
            raise QuantizationError(
                f"input 0 has {x_qp.bits} bits: x^{alpha:g} needs a direct table of at most "
                f"{MAX_FULL_TABLE_BITS}-bit codes (no interpolated table follows it near 0)")
        table = lut_within_budget(_exponent_table(alpha), x_qp, z_qp)
        return QuantizedPowTable(ctx.node, [x_qp, None], [z_qp], table, 0)

    @staticmethod
    def _constant_exponent_qparams(exponent: np.ndarray) -> QParams:
        if not np.all(np.isfinite(exponent)):
            raise QuantizationError("the constant exponent holds inf or NaN")
        if np.all(exponent == np.round(exponent)) and np.abs(exponent).max() < 2 ** (CONSTANT_EXPONENT_BITS - 1):
            return QParams(scale=1.0, zero_point=0, bits=CONSTANT_EXPONENT_BITS, signed=True)
        return compute_qparams(exponent.min(), exponent.max(), CONSTANT_EXPONENT_BITS, symmetric=False, signed=True)

    @staticmethod
    def _constant_base(ctx, z_qp) -> QuantizedPowTable:
        if 1 in ctx.constants:
            raise QuantizationError("both inputs are constants (the graph should have folded this node)")
        base = np.asarray(ctx.constants[0], dtype=np.float64)
        if base.size != 1 or not np.isfinite(base.flat[0]) or base.flat[0] <= 0:
            raise QuantizationError("a constant base must be one positive finite value")
        y_qp = require_qparams(ctx.in_qparams[1], "input 1 (the exponent)")
        require_per_tensor(y_qp, "input 1 (the exponent)")
        b = float(base.flat[0])
        fn = LutFunction(f"exp_base_{b:g}", lambda y: np.power(b, y))
        table = lut_within_budget(fn, y_qp, z_qp)
        return QuantizedPowTable(ctx.node, [None, y_qp], [z_qp], table, 1)

    @staticmethod
    def _kernel(ctx, x_qp, y_qp, z_qp, exponent) -> QuantizedPowKernel:
        try:
            kernel = build_pow(x_qp, y_qp, z_qp, mbits=ctx.options.mbits)
        except ValueError as err:
            raise QuantizationError(f"run-time exponent: {err}") from err
        codes = y_qp.quantize(exponent) if exponent is not None else None
        return QuantizedPowKernel(ctx.node, [x_qp, y_qp], [z_qp], kernel, codes)

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        z_qp = q.out_qparams[0]
        if isinstance(q, QuantizedPowSquare):
            x_c = centered(inputs[0], q.in_qparams[0])
            return [requantize(x_c * x_c, q.m, q.n, z_qp.zero_point[0], z_qp.qmin, z_qp.qmax, dtype=z_qp.dtype)]
        if isinstance(q, QuantizedPowTable):
            return [q.table.lookup(np.asarray(inputs[q.table_input]))]
        y = q.exponent_codes if q.exponent_codes is not None else np.asarray(inputs[1])
        return [q.kernel.forward(np.asarray(inputs[0]), y)]
