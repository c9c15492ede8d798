"""Relu, Clip, LeakyRelu, PRelu: piecewise-linear activations as requant stages (whitepaper 4.54, 4.11, 4.39, 4.52).

With x_c = x_q - zp_x and M / 2^N ~= s_x / s_y (ONNX convention):

    Relu:      y_q = clamp(((x_c * M + 2^(N-1)) >> N) + zp_y, max(qmin, zp_y), qmax)
    Clip:      y_q = clamp(((x_c * M + 2^(N-1)) >> N) + zp_y, max(qmin, cmin_q), min(qmax, cmax_q)),
               cmin_q / cmax_q = the clip bounds quantized with the output qparams
    LeakyRelu: x_c >= 0 as Relu (without its clamp); x_c < 0 uses sign(alpha) * M' / 2^N' ~= alpha * s_x / s_y
    PRelu:     LeakyRelu with one (M', N') per slope value (per channel for a (C, 1, 1) slope)

When the output qparams equal the input's (Relu, Clip), M / 2^N = 2^14 / 2^14 is exact and the op is a
clamp of the codes. LeakyRelu uses one rounding of alpha * x (the whitepaper rounds alpha to alpha_q / 2^N_a
and multiplies the requantized value: two roundings).

LSB bound vs the float op on the dequantized input: 0.5 LSB (final rounding) + |x_c| * |M / 2^N - s_x / s_y|
(the multiplier's error, <= |y| * 2^-(mbits-1) LSB): <= 0.51 LSB for 8-bit outputs, 0 when s_y = s_x.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ops.base import require_per_tensor, require_qparams
from ops.conformance_case import X, Case, uniform_constant
from ops.linear import OutputStage, output_stage
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.clip import clip_bounds

LEAKY_RELU_DEFAULT_ALPHA = 0.01


@dataclass
class QuantizedActivation(QuantizedNode):
    stage: OutputStage


def _in_out(ctx: QuantizeContext):
    x_qp = require_qparams(ctx.in_qparams[0], "input")
    require_per_tensor(x_qp, "input")
    y_qp = ctx.out_qparams[0] if ctx.out_qparams and ctx.out_qparams[0] is not None else x_qp
    require_per_tensor(y_qp, "output")
    return x_qp, y_qp


def _build(ctx: QuantizeContext, activation=None, params=None, neg_slope=None) -> QuantizedActivation:
    x_qp, y_qp = _in_out(ctx)
    stage = output_stage(x_qp.scale, y_qp, ctx.options.mbits, None, activation, params, neg_slope)
    return QuantizedActivation(ctx.node, list(ctx.in_qparams), [y_qp], stage)


def _run(q: QuantizedActivation, inputs) -> list[np.ndarray]:
    x = np.asarray(inputs[0])
    return [q.stage.apply(x.astype(np.int64) - int(q.in_qparams[0].zero_point[0]))]


@register
class Relu(OpDef):
    """ONNX Relu; output qparams from the quant table (unsigned per 4.54) or the input's. See module docstring."""

    op_type = "Relu"
    lsb_bound = 0.51  # 0.5 + |y_q - zp_y| * 2^-(mbits-1) or less, 8-bit
    int_types = "int8/uint8/int16 -> uint8/uint16 (4.54) or the input's type"
    section = "4.54"
    absorbable = True
    positively_homogeneous = True
    conformance = Case()

    def clip_range(self, node, constant):
        return 0.0, np.inf

    def activation_params(self, node, constant):
        return []

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        return [np.maximum(x, np.float32(0))]

    def quantize(self, ctx):
        return _build(ctx, "Relu")

    def forward_int(self, q, inputs, runtime: IntRuntime):
        return _run(q, inputs)


def _clip_bounds(node, constant) -> tuple[float, float]:
    """(min, max) of a Clip whose bounds are constants (`ptq.core.clip`); QuantizationError otherwise."""
    bounds = clip_bounds(node, constant)
    if bounds is None:
        raise QuantizationError(f"the bounds {node.inputs[1:]} must be constant scalars")
    return bounds


@register
class Clip(OpDef):
    """ONNX Clip (bounds as constant inputs or attributes). Formula and LSB bound: module docstring."""

    op_type = "Clip"
    lsb_bound = 0.51  # 0.5 + |y_q - zp_y| * 2^-(mbits-1) or less, 8-bit
    int_types = "int8/uint8/int16 -> int8/uint8/int16"
    section = "4.11/4.55"  # 4.55 Relu6 is Clip(0, 6)
    absorbable = True
    conformance = Case(inputs=(X, "lo", "hi"), constants={"lo": np.float32(-0.5), "hi": np.float32(1.5)})

    def clip_range(self, node, constant):
        return clip_bounds(node, constant)

    def activation_params(self, node, constant):
        """[min, max], an omitted bound as the float32 extreme (onnx Clip's default)."""
        bounds = clip_bounds(node, constant)
        if bounds is None:
            return None
        lowest, highest = float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)
        return [max(bounds[0], lowest), min(bounds[1], highest)]

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        lo, hi = _clip_bounds(node, lambda i: inputs[i] if i < len(inputs) else None)
        return [np.clip(x, np.float32(lo), np.float32(hi)).astype(np.float32)]

    def quantize(self, ctx):
        return _build(ctx, "Clip", _clip_bounds(ctx.node, ctx.constants.get))

    def forward_int(self, q, inputs, runtime: IntRuntime):
        return _run(q, inputs)


@register
class LeakyRelu(OpDef):
    """ONNX LeakyRelu (alpha, default 0.01) with two multipliers. Formula and LSB bound: module docstring."""

    op_type = "LeakyRelu"
    lsb_bound = 0.51  # 0.5 + |y_q - zp_y| * 2^-(mbits-1) or less, 8-bit
    int_types = "int8/uint8/int16 -> int8/uint8/int16"
    section = "4.39"
    absorbable = True
    positively_homogeneous = True
    conformance = Case(attrs={"alpha": 0.1})

    def activation_params(self, node, constant):
        return [float(node.attr("alpha", LEAKY_RELU_DEFAULT_ALPHA))]

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        alpha = np.float32(node.attr("alpha", LEAKY_RELU_DEFAULT_ALPHA))
        return [np.where(x >= 0, x, x * alpha).astype(np.float32)]

    def quantize(self, ctx):
        return _build(ctx, neg_slope=np.array([float(ctx.node.attr("alpha", LEAKY_RELU_DEFAULT_ALPHA))]))

    def forward_int(self, q, inputs, runtime: IntRuntime):
        return _run(q, inputs)


@register
class PRelu(OpDef):
    """ONNX PRelu with a constant slope (broadcast to the input; per channel as (C, 1, 1)): LeakyRelu with one
    negative-side multiplier per slope value. Formula and LSB bound: module docstring."""

    op_type = "PRelu"
    lsb_bound = 0.51  # 0.5 + |y_q - zp_y| * 2^-(mbits-1) or less, 8-bit
    int_types = "int8/uint8/int16 -> int8/uint8/int16"
    section = "4.52"
    granularity = "per-channel slope"
    positively_homogeneous = True
    conformance = Case(inputs=(X, "slope"), constants={"slope": uniform_constant("slope", (3, 1, 1), 0.05, 0.5)})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        slope = np.asarray(inputs[1], dtype=np.float32)
        return [np.where(x >= 0, x, x * slope).astype(np.float32)]

    def quantize(self, ctx):
        if 1 not in ctx.constants:
            raise QuantizationError("the slope must be a constant")
        return _build(ctx, neg_slope=np.asarray(ctx.constants[1], dtype=np.float64))

    def forward_int(self, q, inputs, runtime: IntRuntime):
        return _run(q, inputs)
