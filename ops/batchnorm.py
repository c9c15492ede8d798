"""Standalone BatchNormalization (whitepaper 4.5), inference mode, channels on axis 1.

Folded to one multiplier and bias per channel c: w_f[c] = gamma[c] / sqrt(var[c] + eps),
b_f[c] = beta[c] - mean[c] * w_f[c]. The weight is quantized symmetric per channel with
`QuantizeOptions.bn_weight_bits` bits (16 by default, as 4.5 advises; restricted range, so w_q = +-(2^(B-1)-1)):

    acc[c] = (x_q - zp_x) * w_q[c] + b_q[c]           b_q[c] = round_half_even(b_f[c] / fl32(s_x * s_w[c]))
    y_q[c] = clamp(((acc[c] * M[c] + 2^(N[c]-1)) >> N[c]) + zp_y, qmin, qmax),   M[c] / 2^N[c] ~= s_x s_w[c] / s_y

Accumulator: 48 bits (a 16-bit weight; see `ops.linear`), overflow saturated and reported.

LSB bound vs the float op on the dequantized input: 0.5 (final rounding) + 0.5 * s_x * s_w / s_y (bias
rounding) + |y| * (2^-(mbits-1) + 2^-(B-1)) (multiplier and weight relative errors): <= 1 LSB for 8-bit outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ops.base import require_per_tensor, require_qparams
from ops.backend import absmax
from ops.conformance_case import X, Case, uniform_constant
from ops.linear import (
    AccumulatorPlan,
    OutputStage,
    accumulator_bits,
    code_deviation,
    finish_accumulator,
    output_stage,
    per_channel,
    plan_accumulator,
)
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.bias import bias_scale, quantize_bias
from ptq.core.qparams import QParams, compute_qparams
from ptq.core.roles import LayerKind


@dataclass
class QuantizedBatchNorm(QuantizedNode):
    weight_qparams: QParams
    weight: np.ndarray  # int64 (C,) w_q
    bias: np.ndarray  # int64 (C,)
    stage: OutputStage
    acc: AccumulatorPlan


def folded_affine(node, gamma, beta, mean, var) -> tuple[np.ndarray, np.ndarray]:
    """(w_f, b_f) float64 per channel with y = x * w_f + b_f."""
    eps = float(node.attr("epsilon", 1e-5))
    gamma, beta, mean, var = (np.asarray(v, dtype=np.float64).ravel() for v in (gamma, beta, mean, var))
    w = gamma / np.sqrt(var + eps)
    return w, beta - mean * w


@register
class BatchNormalization(OpDef):
    """ONNX BatchNormalization (inference; constant scale, bias, mean, var). Formula and LSB bound: module docstring."""

    op_type = "BatchNormalization"
    lsb_bound = 1.0
    section = "4.5"
    granularity = "per-channel 16-bit weights"
    int_types = "int8/uint8/int16 x int16 -> int48 acc"
    layer_kind = LayerKind.BATCH_NORMALIZATION
    conformance = Case(inputs=(X, "s", "b", "m", "v"),
                       constants={"s": uniform_constant("bns", (3,), 0.5, 1.5), "b": uniform_constant("bnb", (3,)),
                                  "m": uniform_constant("bnm", (3,)), "v": uniform_constant("bnv", (3,), 0.5, 2.0)})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        w, b = folded_affine(node, *inputs[1:5])
        shape = (1, -1) + (1,) * (x.ndim - 2)
        return [(x * w.astype(np.float32).reshape(shape) + b.astype(np.float32).reshape(shape)).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedBatchNorm:
        node = ctx.node
        if node.attr("training_mode", 0):
            raise QuantizationError("training_mode=1 is not an inference op")
        missing = [node.inputs[i] for i in range(1, 5) if i not in ctx.constants]
        if missing:
            raise QuantizationError(f"inputs {missing} must be constants")
        x_qp = require_qparams(ctx.in_qparams[0], "input")
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(x_qp, "input")
        w_f, b_f = folded_affine(node, *(ctx.constants[i] for i in range(1, 5)))
        bits = ctx.options.bn_weight_bits
        w_qp = compute_qparams(w_f, w_f, bits, symmetric=True, signed=True, narrow=True, axis=0)
        w_q = w_qp.quantize(w_f).astype(np.int64)
        acc_scale = float(x_qp.scale[0]) * w_qp.scale
        acc_bits = accumulator_bits((x_qp.bits, bits), ctx.options)
        bias = quantize_bias(b_f, bias_scale(x_qp.scale[0], w_qp.scale), acc_bits)
        bound = code_deviation(x_qp)[0] * absmax(w_q) + absmax(bias)
        return QuantizedBatchNorm(
            node,
            list(ctx.in_qparams),
            [y_qp],
            weight_qparams=w_qp,
            weight=w_q,
            bias=bias,
            stage=output_stage(acc_scale, y_qp, ctx.options.mbits, 1),
            acc=plan_accumulator(acc_bits, bound, bound, ctx.options.mbits),
        )

    def forward_int(self, q: QuantizedBatchNorm, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        if x.ndim < 2 or x.shape[1] != q.weight.size:
            raise ValueError(
                f"input {x.shape} needs {q.weight.size} channels on axis 1")
        xc = x.astype(np.int64) - int(q.in_qparams[0].zero_point[0])
        np.multiply(xc, per_channel(q.weight, 1, x.ndim), out=xc)
        return [finish_accumulator(xc, per_channel(q.bias, 1, x.ndim), q.acc, q.stage, q.node, runtime)]
