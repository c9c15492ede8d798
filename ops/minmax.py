"""Max, Min with numpy broadcasting over any number of inputs (whitepaper 4.25 ElementwiseMax, 4.26 ElementwiseMin).

ONNX convention. Every activation input is requantized to the output grid, then the integer max / min is taken:

    y_i = clamp(((x_i,q - zp_i) * M_i + 2^(N_i-1)) >> N_i) + zp_y, qmin, qmax),     M_i / 2^N_i ~= s_i / s_y
    y_q = max_i y_i  (min_i y_i)

Requantization is monotone, so this equals requantizing the float max of the dequantized inputs (the
whitepaper's form max(a_c M_1, b_c M_3) >> N_1 up to the rounding of each operand). A constant input is
quantized straight onto the output grid, y_i = clamp(round_half_even(c / s_y) + zp_y) (Max(x, 0), Min(x, 6)).
LSB bound vs the float op on the dequantized inputs: 0.5 + max_i |x_i,q - zp_i| * |M_i / 2^N_i - s_i / s_y|
(under 0.51 for 8-bit operands on comparable grids).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Optional

import numpy as np

from ops.base import centered, multiplier, require_per_tensor, require_qparams
from ops.conformance_case import X, Case, uniform_constant
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.requant import requantize


@dataclass
class QuantizedExtremum(QuantizedNode):
    constant_codes: list[Optional[np.ndarray]]  # per input: a constant's codes on the output grid (None: activation)
    m: np.ndarray  # per input (1 for constants, unused): M_i / 2^N_i ~= s_i / s_y
    n: np.ndarray


class _Extremum(OpDef):
    int_types = "int8/uint8/int16 -> int8/uint8/int16"
    reduce_fn = staticmethod(np.maximum)

    def forward_float(self, node, inputs):
        arrays = [np.asarray(v) for v in inputs if v is not None]
        if not arrays:
            raise ValueError("needs at least one input")
        if not all(np.issubdtype(a.dtype, np.integer) for a in arrays):  # int64 operands in shape subgraphs
            arrays = [a.astype(np.float32) for a in arrays]
        return [np.asarray(reduce(self.reduce_fn, arrays))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedExtremum:
        if not ctx.node.inputs:
            raise QuantizationError("needs at least one input")
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(y_qp, "output")
        in_qp, codes, ratios = [], [], []
        for i in range(len(ctx.node.inputs)):
            if i in ctx.constants:
                codes.append(y_qp.quantize(np.asarray(ctx.constants[i], dtype=np.float64)))
                in_qp.append(None)
                ratios.append(1.0)
                continue
            qp = require_qparams(ctx.in_qparams[i], f"input {i}")
            require_per_tensor(qp, f"input {i}")
            codes.append(None)
            in_qp.append(qp)
            ratios.append(float(qp.scale[0]) / float(y_qp.scale[0]))
        if all(c is not None for c in codes):
            raise QuantizationError("all inputs are constants (the graph should have folded this node)")
        m, n = multiplier(np.array(ratios), ctx.options.mbits, "s_i / s_y")
        return QuantizedExtremum(ctx.node, in_qp, [y_qp], codes, m, n)

    def forward_int(self, q: QuantizedExtremum, inputs, runtime: IntRuntime):
        y_qp = q.out_qparams[0]
        zp = int(y_qp.zero_point[0])
        operands = []
        for i, (qp, codes) in enumerate(zip(q.in_qparams, q.constant_codes)):
            if codes is not None:
                operands.append(codes.astype(np.int64))
            else:
                operands.append(requantize(centered(inputs[i], qp), q.m[i], q.n[i], zp, y_qp.qmin, y_qp.qmax))
        return [reduce(self.reduce_fn, operands).astype(y_qp.dtype)]


@register
class Max(_Extremum):
    """ONNX Max (variadic, broadcasting): each input requantized to the output grid, then max (module docstring)."""

    op_type = "Max"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.25"
    reduce_fn = staticmethod(np.maximum)
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("max", (4, 5))})


@register
class Min(_Extremum):
    """ONNX Min (variadic, broadcasting): each input requantized to the output grid, then min (module docstring)."""

    op_type = "Min"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.26"
    reduce_fn = staticmethod(np.minimum)
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("min", (4, 5))})

    def clamp_bounds(self, node, constant):
        """Min(x, b) with a constant b clamps x from above to b (per channel for a (C, 1, ...) b: the bound of
        an equalized Clip, `ptq.adjust.equalize`)."""
        bound = constant(1) if len(node.inputs) == 2 else None
        return None if bound is None else (-np.inf, np.asarray(bound, dtype=np.float64))
