"""Div with numpy broadcasting (whitepaper 4.23), in the ONNX convention (a_c = a_q - zp_a, b_c = b_q - zp_b),
and Reciprocal, 1 / x, as the integer division of a constant numerator (end of this docstring).

A constant divisor b (x / 6 in a decomposed hard-swish, x / sqrt(2) in GELU) is folded, per element of b,
into the requant multiplier: nothing of b is quantized, so the only errors are the multiplier's and the final
rounding's:

    y_q = clamp(((a_c * sign(b) * M_b + 2^(N_b-1)) >> N_b) + zp_y, qmin, qmax),   M_b / 2^N_b ~= s_a / (|b| s_y)
    LSB bound vs the float op on the dequantized a: 0.5 + |y_q - zp_y| * 2^-(mbits-1)

A divisor computed at run time takes the whitepaper's integer division, rounded by the remainder:

    q   = round_half_away(a_c * M / b_c)            (integer quotient, then one step up when 2 * rem >= |b_c|)
    y_q = clamp(((q + 2^(N-1)) >> N) + zp_y, qmin, qmax),                       M / 2^N ~= s_a / (s_b s_y)
    LSB bound: 0.5 + 0.5 * 2^-N + |y_q - zp_y| * 2^-(mbits-1)

or, with `QuantizeOptions.reciprocal_div`, the LUT variant of 4.23 (`lut.arith.build_divider`: a 16-bit
reciprocal table on b, at most 10-bit b, R(b_c) = round_half_away(32767 / b_c) computed in integers).
b_c = 0 saturates with the sign of a (zp_y when a_c = 0), in both variants. LSB bound of the table variant:
0.5 + |y_c| * (0.5 * |b_c| / 32767 + 2^-(mbits-1)), at most 1.5 for 8-bit codes (tests/ops/test_div.py checks
every pair of 8-bit codes). A constant numerator is quantized per tensor on its own range with 16 bits.

Reciprocal, y = 1 / x (x_c = x_q - zp_x): 1 / x_f / s_y = K / x_c with K = 1 / (s_x s_y) ~= M * 2^E (M of mbits
bits: E = -N <= 0 from `quantize_multiplier`, else E > 0 for K >= 2^mbits), so

    y_q = clamp(round_half_away((M << max(E, 0)) / (x_c << max(-E, 0))) + zp_y, qmin, qmax)

an integer division rounded by its remainder, for inputs of any width; x_c = 0 (x_f = 0, 1 / x = +inf)
saturates to qmax. LSB bound vs the float op on the dequantized x: 0.5 + |y_c| * 2^-(mbits-1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from lut.arith import Divider, build_divider
from ops.base import multiplier, require_per_tensor, require_qparams
from ops.conformance_case import X, Case, uniform_constant
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.qparams import compute_qparams
from ptq.core.requant import requantize

CONSTANT_NUMERATOR_BITS = 16
ZERO_DIVISOR_QUOTIENT = 1 << 60  # what x / 0 gives before the requant: saturates any output, fits int64


@dataclass
class QuantizedDiv(QuantizedNode):
    numerator_codes: Optional[np.ndarray]  # a constant numerator's codes (None: an activation)
    sign: Optional[np.ndarray]  # constant divisor: sign(b), int64 in b's shape
    m: np.ndarray  # constant divisor: per element of b; run-time divisor: one value
    n: np.ndarray
    divider: Optional[Divider]  # the reciprocal-table variant


def divide_rounded(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """round_half_away(num / den) of int64 arrays (den != 0), by integer division and its remainder."""
    q, rem = np.divmod(np.abs(num), np.abs(den))
    q = q + (2 * rem >= np.abs(den))
    return np.where((num < 0) != (den < 0), -q, q)


@register
class Div(OpDef):
    """ONNX Div (broadcasting). Integer formulas and LSB bounds: module docstring."""

    op_type = "Div"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.23"
    int_types = "int8/uint8/int16 / constant or int8/uint8/int16 -> int8/uint8/int16"
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("div", (5,), 0.5, 2.0)},
                       note="constant divisor")

    def forward_float(self, node, inputs):
        a, b = (np.asarray(v, dtype=np.float32) for v in inputs[:2])
        with np.errstate(divide="ignore", invalid="ignore"):
            return [(a / b).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedDiv:
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(y_qp, "output")
        if 1 in ctx.constants:
            return self._constant_divisor(ctx, y_qp)
        b_qp = require_qparams(ctx.in_qparams[1], "input 1 (the divisor)")
        require_per_tensor(b_qp, "input 1 (the divisor)")
        codes = None
        if 0 in ctx.constants:
            value = np.asarray(ctx.constants[0], dtype=np.float64)
            a_qp = compute_qparams(value.min(initial=0.0), value.max(initial=0.0), CONSTANT_NUMERATOR_BITS,
                                   symmetric=False)
            codes = a_qp.quantize(value)
        else:
            a_qp = require_qparams(ctx.in_qparams[0], "input 0")
        require_per_tensor(a_qp, "input 0")
        in_qp = [a_qp, b_qp]
        if ctx.options.reciprocal_div:
            divider = build_divider(a_qp, b_qp, y_qp, mbits=ctx.options.mbits)
            return QuantizedDiv(ctx.node, in_qp, [y_qp], codes, None, np.zeros(1, np.int64), np.zeros(1, np.int64),
                                divider)
        r = float(a_qp.scale[0]) / (float(b_qp.scale[0]) * float(y_qp.scale[0]))
        m, n = multiplier(r, ctx.options.mbits, "s_a / (s_b * s_y)")
        return QuantizedDiv(ctx.node, in_qp, [y_qp], codes, None, m, n, None)

    @staticmethod
    def _constant_divisor(ctx: QuantizeContext, y_qp) -> QuantizedDiv:
        if 0 in ctx.constants:
            raise QuantizationError("both inputs are constants (the graph should have folded this node)")
        a_qp = require_qparams(ctx.in_qparams[0], "input 0")
        require_per_tensor(a_qp, "input 0")
        b = np.asarray(ctx.constants[1], dtype=np.float64)
        if not np.all(np.isfinite(b)) or np.any(b == 0):
            raise QuantizationError("the constant divisor holds 0, inf or NaN; the float model divides by it too")
        r = float(a_qp.scale[0]) / (np.abs(b) * float(y_qp.scale[0]))
        m, n = multiplier(r.ravel(), ctx.options.mbits, "s_a / (|b| * s_y)")
        sign = np.sign(b).astype(np.int64)
        return QuantizedDiv(ctx.node, [a_qp, None], [y_qp], None, sign, m.reshape(b.shape), n.reshape(b.shape), None)

    def forward_int(self, q: QuantizedDiv, inputs, runtime: IntRuntime):
        y_qp = q.out_qparams[0]
        a_q = q.numerator_codes if q.numerator_codes is not None else np.asarray(inputs[0])
        if q.sign is not None:
            a_c = a_q.astype(np.int64) - int(q.in_qparams[0].zero_point[0])
            return [requantize(a_c * q.sign, q.m, q.n, y_qp.zero_point[0], y_qp.qmin, y_qp.qmax, dtype=y_qp.dtype)]
        if q.divider is not None:
            return [q.divider.forward(a_q, np.asarray(inputs[1]))]
        a_c = a_q.astype(np.int64) - int(q.in_qparams[0].zero_point[0])
        b_c = np.asarray(inputs[1]).astype(np.int64) - int(q.in_qparams[1].zero_point[0])
        a_c, b_c = np.broadcast_arrays(a_c, b_c)
        num = a_c * int(q.m[0])
        zero = b_c == 0
        quotient = divide_rounded(num, np.where(zero, 1, b_c))
        # b = 0: the largest quotient of the right sign saturates the output (0 / 0 gives 0)
        quotient = np.where(zero, np.sign(num) * ZERO_DIVISOR_QUOTIENT, quotient)
        return [requantize(quotient, 1, q.n, y_qp.zero_point[0], y_qp.qmin, y_qp.qmax, dtype=y_qp.dtype)]


RECIPROCAL_NUMERATOR_LIMIT = 1 << 62


@dataclass
class QuantizedReciprocal(QuantizedNode):
    numerator: int  # M << max(E, 0)
    shift: int  # max(-E, 0): the divisor is x_c << shift


@register
class Reciprocal(OpDef):
    """ONNX Reciprocal, 1 / x, by integer division (module docstring)."""

    op_type = "Reciprocal"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.23 (Div with the constant numerator 1)"
    int_types = "int8/uint8/int16 -> int8/uint8/int16"
    conformance = Case(data="positive")

    def forward_float(self, node, inputs):
        with np.errstate(divide="ignore"):
            return [(np.float32(1.0) / np.asarray(inputs[0], dtype=np.float32)).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedReciprocal:
        x_qp = require_qparams(ctx.in_qparams[0], "input")
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(x_qp, "input")
        require_per_tensor(y_qp, "output")
        k = 1.0 / (float(x_qp.scale[0]) * float(y_qp.scale[0]))
        limit = (1 << ctx.options.mbits) - 1
        e = max(0, int(np.ceil(np.log2(k / limit)))) if k > limit else 0
        m, n = multiplier(k / 2.0 ** e, ctx.options.mbits, "1 / (s_x * s_y)")
        numerator = int(m[0]) << e
        if numerator >= RECIPROCAL_NUMERATOR_LIMIT:
            raise QuantizationError(f"1 / (s_x * s_y) = {k:g} is too large for an int64 division")
        return QuantizedReciprocal(ctx.node, [x_qp], [y_qp], numerator, int(n[0]))

    def forward_int(self, q: QuantizedReciprocal, inputs, runtime: IntRuntime):
        y_qp = q.out_qparams[0]
        x_c = np.asarray(inputs[0]).astype(np.int64) - int(q.in_qparams[0].zero_point[0])
        zero = x_c == 0
        quotient = divide_rounded(np.full(x_c.shape, q.numerator, dtype=np.int64), np.where(zero, 1, x_c) << q.shift)
        y = np.where(zero, y_qp.qmax, np.clip(quotient + int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
        return [y.astype(y_qp.dtype)]
