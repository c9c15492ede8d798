"""Requantize (ai.ptq): y = x in float; in integers the codes move from the input's grid to the output's.

The `int4-dsp` scheme (`ptq.calibration.int4_dsp`, Xilinx WP521's "requantize") puts one on every edge where an 8-bit
tensor (an Add's shared-scale input or output) feeds a 4-bit convolution. In a model file it is a
model-local function whose body is ONNX Identity, so onnxruntime runs the float model unchanged.

ONNX convention, r = s_x / s_y:

    power-of-two ratio r = 2^-k (shift only, what WP521's hardware does):
        k > 0:   y_q = clamp(((x_q - zp_x + 2^(k-1)) >> k) + zp_y, qmin, qmax)     (round half up)
        k <= 0:  y_q = clamp(((x_q - zp_x) << -k) + zp_y, qmin, qmax)              (exact)
    any other ratio:
        y_q = clamp((((x_q - zp_x) * M + 2^(N-1)) >> N) + zp_y, qmin, qmax),   M / 2^N ~= r

Both run through `ptq.core.requant.requantize`; the shift form is (M, N) = (1, k) or (2^-k, 0).
LSB bound vs the float op on the dequantized input: 0.5 for a power-of-two ratio (the rounding alone), else
0.5 + |x_q - zp_x| * r * 2^-(mbits-1) (under 0.51 for 8-bit codes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops.base import activation_qparams, multiplier, require_per_tensor, require_qparams
from ops.conformance_case import Case
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register
from ptq.core.requant import MAX_SHIFT, requantize

PTQ_DOMAIN = "ai.ptq"


def shift_multiplier(r: float, mbits: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(M, N) = (1, k) for r = 2^-k with 0 < k <= 31, (2^-k, 0) for r = 2^-k with 2^-k < 2^mbits;
    None when r is not an exact power of two (or out of those ranges)."""
    mantissa, exponent = math.frexp(float(r))  # r = mantissa * 2^exponent, mantissa in [0.5, 1)
    if mantissa != 0.5:
        return None
    k = 1 - exponent  # r = 2^-k
    if 0 < k <= MAX_SHIFT:
        return np.array([1], dtype=np.int64), np.array([k], dtype=np.int64)
    if k <= 0 and -k < mbits:
        return np.array([1 << -k], dtype=np.int64), np.array([0], dtype=np.int64)
    return None


@dataclass
class QuantizedRequantize(QuantizedNode):
    m: np.ndarray
    n: np.ndarray
    shift_only: bool  # the ratio is a power of two: M is 1 (right shift) or 2^j (left shift)


@register
class Requantize(OpDef):
    """ai.ptq Requantize: identity in float, codes moved to the output's grid. Formula and LSB bound: module
    docstring."""

    op_type = "Requantize"
    domain = PTQ_DOMAIN
    section = ""  # not a chapter-4 operator: the edge between two precisions (WP521)
    int_types = "any -> any (the quant table's output qparams)"
    lsb_bound = 0.51
    conformance = Case(path="direct", reference=lambda x: [x],
                       note="identity in float: the codes move to the output's grid")

    def forward_float(self, node, inputs):
        return [np.asarray(inputs[0], dtype=np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedRequantize:
        x_qp = activation_qparams(ctx)
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(y_qp, "output")
        r = float(x_qp.scale[0]) / float(y_qp.scale[0])
        shift = shift_multiplier(r, ctx.options.mbits)
        m, n = shift if shift is not None else multiplier(r, ctx.options.mbits, "s_x / s_y")
        return QuantizedRequantize(ctx.node, [x_qp], [y_qp], m=m, n=n, shift_only=shift is not None)

    def forward_int(self, q: QuantizedRequantize, inputs, runtime: IntRuntime):
        x_qp, y_qp = q.in_qparams[0], q.out_qparams[0]
        x = np.asarray(inputs[0])
        return [requantize(x, q.m[0], q.n[0], int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax, dtype=y_qp.dtype,
                           offset=-int(x_qp.zero_point[0]))]
