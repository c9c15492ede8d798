"""BiasAdd (whitepaper 4.8), custom domain `ai.ptq`: y = x + B, B a constant vector along `axis` (default 1,
the channel axis of NCHW; the whitepaper's NHWC last axis is axis=-1).

The bias takes the input's scale and zero point 0 (4.8's restriction), as int32 codes, so the add is exact
and one requant follows (ONNX convention):

    B_q = round_half_even(B / s_x)                                    (int32; refused when it does not fit)
    y_q = clamp((((x_q - zp_x) + B_q) * M + 2^(N-1)) >> N) + zp_y, qmin, qmax),     M / 2^N ~= s_x / s_y

LSB bound vs the float op on the dequantized input: 0.5 (final rounding) + 0.5 * s_x / s_y (the bias
rounding) + |y_q - zp_y| * 2^-(mbits-1) (the multiplier); 1.0 + 2^-6 for 8-bit codes with s_y >= s_x.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ops.base import activation_qparams, multiplier, proposed_or
from ops.conformance_case import X, Case, uniform_constant
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node
from ptq.core.requant import requantize

PTQ_DOMAIN = "ai.ptq"
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def _axis(node: Node, rank: int) -> int:
    axis = int(node.attr("axis", 1))
    if not -rank <= axis < rank:
        raise ValueError(f"attribute axis {axis} out of range for an input of rank {rank}")
    return axis % rank


def _bias_shape(node: Node, bias: np.ndarray, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    """B's shape broadcast along `axis` of x; ValueError when B is not a vector of x's size there."""
    axis = _axis(node, len(x_shape))
    if bias.ndim != 1 or bias.shape[0] != x_shape[axis]:
        raise ValueError(f"input 1 (the bias) must be a vector of {x_shape[axis]} values (axis {axis}), "
                         f"got shape {bias.shape}")
    shape = [1] * len(x_shape)
    shape[axis] = bias.shape[0]
    return tuple(shape)


@dataclass
class QuantizedBiasAdd(QuantizedNode):
    bias_codes: np.ndarray  # B_q = round(B / s_x), int64 holding int32 values
    m: np.ndarray
    n: np.ndarray


@register
class BiasAdd(OpDef):
    """ai.ptq BiasAdd. Formula and LSB bound: module docstring."""

    op_type = "BiasAdd"
    domain = PTQ_DOMAIN
    section = "4.8"
    int_types = "int8/uint8/int16 + int32 bias (scale s_x, zp 0) -> int8/uint8/int16"
    granularity = "per-tensor activations; bias per channel"
    lsb_bound = 1.0 + 2.0 ** -6
    conformance = Case(path="direct", reference=lambda x, b: [x + b.reshape(1, 3, 1, 1)], inputs=(X, "b"),
                       constants={"b": uniform_constant("bias", (3,))})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        bias = np.asarray(inputs[1], dtype=np.float32)
        return [(x + bias.reshape(_bias_shape(node, bias, x.shape))).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedBiasAdd:
        x_qp = activation_qparams(ctx)
        if 1 not in ctx.constants:
            raise QuantizationError("input 1 (the bias) must be a constant")
        bias = np.asarray(ctx.constants[1], dtype=np.float64)
        if bias.ndim != 1 or not np.all(np.isfinite(bias)):
            raise QuantizationError(f"input 1 (the bias) must be a finite vector, got shape {bias.shape}")
        codes = np.round(bias / float(x_qp.scale[0]))
        if codes.min(initial=0) < INT32_MIN or codes.max(initial=0) > INT32_MAX:
            raise QuantizationError("input 1 (the bias) does not fit int32 at the input's scale")
        y_qp = proposed_or(ctx, x_qp)
        m, n = multiplier(float(x_qp.scale[0]) / float(y_qp.scale[0]), ctx.options.mbits, "s_x / s_y")
        return QuantizedBiasAdd(ctx.node, [x_qp, None], [y_qp], codes.astype(np.int64), m, n)

    def forward_int(self, q: QuantizedBiasAdd, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        y_qp = q.out_qparams[0]
        acc = x.astype(np.int64) - int(q.in_qparams[0].zero_point[0])
        acc += q.bias_codes.reshape(_bias_shape(q.node, q.bias_codes, x.shape))
        return [requantize(acc, q.m, q.n, y_qp.zero_point[0], y_qp.qmin, y_qp.qmax, dtype=y_qp.dtype)]
