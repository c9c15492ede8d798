"""Add, Sub, Mul with numpy broadcasting (whitepaper 4.24 ElementwiseAdd, 4.28 ElementwiseSub, 4.27 ElementwiseMul).

Add / Sub rescale both inputs to one common scale s_y / 2^L with their own (M, N) pairs, add, and requantize
the sum by a plain rounding shift of L bits (L = `COMMON_SHIFT`):

    a_c = ((a_q - zp_a) * 2^L * M_a + 2^(N_a-1)) >> N_a           M_a / 2^N_a ~= s_a / s_y
    b_c = ((b_q - zp_b) * 2^L * M_b + 2^(N_b-1)) >> N_b           M_b / 2^N_b ~= s_b / s_y
    y_q = clamp(((a_c +- b_c + 2^(L-1)) >> L) + zp_y, qmin, qmax)

This is the whitepaper's y = ((a - zp_a) M' + (b - zp_b) M'') / 2^N' with M', M'' kept within `mbits` bits
each (the products M_2 M_3 2^(N_1-N_2) of 4.24 can reach 30+ bits). LSB bound vs the float op on the
dequantized inputs: 0.5 (final rounding) + 2^-L (intermediate roundings) + sum_i |x_i - zp_i| * err_i with
err_i = |M_i / 2^N_i - s_i / s_y| <= (s_i / s_y) * 2^-(mbits-1): under 0.6 LSB for 8-bit operands.

Mul: y_q = clamp((((a_q - zp_a) * (b_q - zp_b) * M + 2^(N-1)) >> N) + zp_y, qmin, qmax), M / 2^N ~= s_a s_b / s_y.
LSB bound: 0.5 + |(a - zp_a)(b - zp_b)| * |M / 2^N - s_a s_b / s_y| (under 0.52 for 8-bit operands whose
product fits the output range; at most 2^-32 absolute error per unit of product when the factor is tiny).
A factor too large for an mbits multiplier (an attention mask: `(1 - mask) * finfo(float32).min` onto a grid of
a few units, `ptq.engine.float_run`) is M * 2^L, L <= 40, and saturates:
y_q = clamp((clip(P * M, +-2^17) << L) + zp_y, qmin, qmax), P = (a_q - zp_a)(b_q - zp_b) -- every nonzero product
lands on the end of the grid it points to, as the float product does; zero stays zero (exact).

A constant input (e.g. a bias-like addend or a scale) is quantized per tensor with the qparams the quant
table gives for it, else with its own min/max (asymmetric, as many bits as the other input).
"""
from __future__ import annotations

# imports inside functions: `ops.compiled`'s numba kernels, imported by the first run that takes the compiled path
# (numba's import costs about half a second; `ops.compiled.enabled` decides)

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops import compiled
from ops.base import multiplier, require_per_tensor, require_qparams
from ops.conformance_case import X, Case, uniform_constant
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.qparams import QParams, compute_qparams
from ptq.core.requant import requantize, shift_round

COMMON_SHIFT = 16
SATURATING_SHIFT = 40  # Mul's left shift for a factor >= 2^mbits (past 2^17 every code saturates anyway)
SATURATING_PRODUCT = 1 << 17  # |P * M| kept below this before the left shift: beyond any 16-bit grid


@dataclass
class QuantizedElementwise(QuantizedNode):
    constant_codes: tuple[Optional[np.ndarray], Optional[np.ndarray]]  # quantized constant inputs (None: activation)
    m: np.ndarray  # Add/Sub: (M_a, M_b); Mul: (M,)
    n: np.ndarray
    shift: int  # Add/Sub: L; Mul: 0
    left_shift: int = 0  # Mul with s_a s_b / s_y >= 2^mbits: M * 2^left_shift ~= s_a s_b / s_y (N = 0)


def _input_qparams(ctx: QuantizeContext) -> tuple[list[QParams], list[Optional[np.ndarray]]]:
    node = ctx.node
    if len(node.inputs) != 2:
        raise QuantizationError(f"expected 2 inputs, got {len(node.inputs)}")
    qps: list[Optional[QParams]] = [None, None]
    codes: list[Optional[np.ndarray]] = [None, None]
    for i in (0, 1):
        if i not in ctx.constants:
            qps[i] = require_qparams(ctx.in_qparams[i], f"input {i}")
            require_per_tensor(qps[i], f"input {i}")
    for i in (0, 1):
        if i in ctx.constants:
            value = np.asarray(ctx.constants[i], dtype=np.float64)
            qp = ctx.in_qparams[i]
            if qp is None:
                other = qps[1 - i]
                bits = other.bits if other is not None else 8
                qp = compute_qparams(value.min(initial=0.0), value.max(initial=0.0), bits, symmetric=False)
            require_per_tensor(qp, f"constant input {i}")
            qps[i] = qp
            codes[i] = qp.quantize(value)
    return qps, codes


def _codes(q: QuantizedElementwise, inputs) -> list[np.ndarray]:
    """The two inputs' integer codes (constants from their quantized codes)."""
    return [q.constant_codes[i] if q.constant_codes[i] is not None else np.asarray(inputs[i]) for i in (0, 1)]


def _zero_points(q: QuantizedElementwise) -> tuple[int, int]:
    return int(q.in_qparams[0].zero_point[0]), int(q.in_qparams[1].zero_point[0])


def _operands(q: QuantizedElementwise, inputs) -> list[np.ndarray]:
    """The two inputs as centered int64 codes x_q - zp (constants from their quantized codes)."""
    out = []
    for i in (0, 1):
        raw = q.constant_codes[i] if q.constant_codes[i] is not None else np.asarray(inputs[i])
        out.append(raw.astype(np.int64) - int(q.in_qparams[i].zero_point[0]))
    return out


class _AddSub(OpDef):
    sign: int = 1
    sums_inputs = True
    int_types = "int8/uint8/int16 -> int8/uint8/int16"

    def forward_float(self, node, inputs):
        a, b = (np.asarray(v, dtype=np.float32) for v in inputs[:2])
        return [(a + b if self.sign > 0 else a - b).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedElementwise:
        qps, codes = _input_qparams(ctx)
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(y_qp, "output")
        r = np.array([qps[0].scale[0], qps[1].scale[0]]) / float(y_qp.scale[0])
        m, n = multiplier(r, ctx.options.mbits, "input/output scale ratio")
        return QuantizedElementwise(ctx.node, qps + list(ctx.in_qparams[2:]), [y_qp], (codes[0], codes[1]),
                                    m, n, COMMON_SHIFT)

    def forward_int(self, q: QuantizedElementwise, inputs, runtime: IntRuntime):
        if compiled.enabled(runtime):
            from ops.compiled.elementwise import add_sub_codes

            y = add_sub_codes(*_codes(q, inputs), _zero_points(q), q.m, q.n, q.shift, self.sign, q.out_qparams[0])
            if y is not None:
                return [y]
        a, b = _operands(q, inputs)
        a_c = shift_round(a << q.shift, q.m[0], q.n[0])
        b_c = shift_round(b << q.shift, q.m[1], q.n[1])
        total = a_c + b_c if self.sign > 0 else a_c - b_c
        y_qp = q.out_qparams[0]
        return [requantize(total, 1, q.shift, y_qp.zero_point[0], y_qp.qmin, y_qp.qmax, dtype=y_qp.dtype)]


@register
class Add(_AddSub):
    """ONNX Add (broadcasting). Integer formula and LSB bound: module docstring."""

    op_type = "Add"
    lsb_bound = 0.6
    section = "4.24"
    sign = 1
    sum_signs = (1, 1)
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("add", (4, 5))})


@register
class Sub(_AddSub):
    """ONNX Sub (broadcasting): Add with the second input's rescaled value subtracted (module docstring)."""

    op_type = "Sub"
    lsb_bound = 0.6
    section = "4.28"
    sign = -1
    sum_signs = (1, -1)
    conformance = Case(inputs=("c", X), constants={"c": uniform_constant("sub", (5,))})


@register
class Mul(OpDef):
    """ONNX Mul (broadcasting). Integer formula and LSB bound: module docstring."""

    op_type = "Mul"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.27"
    int_types = "int8/uint8/int16 -> int8/uint8/int16"
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("mul", (3, 1, 1), -2, 2)})

    def forward_float(self, node, inputs):
        a, b = (np.asarray(v, dtype=np.float32) for v in inputs[:2])
        return [(a * b).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedElementwise:
        qps, codes = _input_qparams(ctx)
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(y_qp, "output")
        r = float(qps[0].scale[0]) * float(qps[1].scale[0]) / float(y_qp.scale[0])
        mmax = (1 << ctx.options.mbits) - 1
        if r >= mmax and np.isfinite(r):
            left = min(int(np.ceil(np.log2(r / mmax))), SATURATING_SHIFT)
            m = np.array([int(np.clip(np.rint(r / 2.0 ** left), 1, mmax))], dtype=np.int64)
            return QuantizedElementwise(ctx.node, qps + list(ctx.in_qparams[2:]), [y_qp], (codes[0], codes[1]), m,
                                        np.zeros(1, dtype=np.int64), 0, left)
        m, n = multiplier(r, ctx.options.mbits, "s_a * s_b / s_y")
        return QuantizedElementwise(ctx.node, qps + list(ctx.in_qparams[2:]), [y_qp], (codes[0], codes[1]), m, n, 0)

    def forward_int(self, q: QuantizedElementwise, inputs, runtime: IntRuntime):
        if q.left_shift:
            a, b = _operands(q, inputs)
            y_qp = q.out_qparams[0]
            product = np.clip(a * b * int(q.m[0]), -SATURATING_PRODUCT, SATURATING_PRODUCT) << q.left_shift
            return [np.clip(product + int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax).astype(y_qp.dtype)]
        if compiled.enabled(runtime):
            from ops.compiled.elementwise import mul_codes

            y = mul_codes(*_codes(q, inputs), _zero_points(q), int(q.m[0]), int(q.n[0]), q.out_qparams[0])
            if y is not None:
                return [y]
        a, b = _operands(q, inputs)
        y_qp = q.out_qparams[0]
        return [requantize(a * b, q.m, q.n, y_qp.zero_point[0], y_qp.qmin, y_qp.qmax, dtype=y_qp.dtype)]
