"""Conv and ConvTranspose (whitepaper 4.14 Convolution2D, 4.15 ConvTranspose2D, 4.22 Depthwise, 4.35 Group).

Integer forward, per output channel m (ONNX convention; `ops.linear` has the requant stage and fused
Relu/Clip/LeakyRelu):

    acc[m] = sum_{c, t} (x_q[c, o*s + t*d] - zp_x) * (w_q[m, c, t] - zp_w[m]) + b_q[m]
    y_q[m] = clamp(((acc[m] * M[m] + 2^(N[m]-1)) >> N[m]) + zp_y, lo, hi)      M[m] / 2^N[m] ~= s_x s_w[m] / s_y
    b_q[m] = round_half_even(b_f[m] / fl32(s_x * s_w[m]))   (the float32 bias scale a QDQ export writes)

Padding is a real zero, i.e. the code zp_x. The dot product runs on the runtime's backend with the raw input
codes and the input zero point is folded out afterwards: sum (x - zp_x) w = sum x w - zp_x * sum w (with the
bias, one per-channel offset folded into the requant constant). ConvTranspose centers its input first (its
border outputs have fewer terms, so no single fold applies). Depthwise convolution runs as an exact integer
multiply-accumulate per kernel tap when the backend allows it (`direct_depthwise`), else through its matmul.
The accumulator is 32-bit for 8-bit operands, 48-bit otherwise (`ops.linear`); a static bound skips the
overflow check when no overflow is possible, otherwise overflows are saturated and reported.

LSB bound vs the float op on the dequantized input and weights (the accumulator itself is exact):

    |y_int - y_float| <= 0.5 + 0.5 * s_x * s_w[m] / s_y + |y_q - zp_y| * 2^-(mbits-1)   LSB

(final rounding, bias rounding, multiplier error): below 1 LSB for 8-bit outputs with the default 15-bit
multipliers; quantizing x and w adds their own error against the unquantized float op.
"""
from __future__ import annotations

# imports inside functions: `ops.compiled`'s numba kernels, imported by the first run that takes the compiled path
# (numba's import costs about half a second; `ops.compiled.enabled` decides)

import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops import compiled
from ops.base import require_per_tensor, require_qparams
from ops.backend import absmax, dtype_absmax
from ops.conformance_case import X, Case, uniform_constant
from ops.conv_kernels import conv_geometry, conv_padded, conv_transpose_full, pad_input
from ops.linear import (
    AccumulatorPlan,
    OutputStage,
    accumulator_bits,
    apply_float_activation,
    code_deviation,
    finish_accumulator,
    fused_activation,
    output_stage,
    per_channel,
    plan_accumulator,
    quantize_weight,
)
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.bias import bias_scale, quantize_bias
from ptq.core.roles import BiasRole, BiasSlot, LayerKind, WeightRole


@dataclass
class QuantizedConv(QuantizedNode):
    weight_codes: np.ndarray  # w_q in the weight's storage dtype (what a QDQ export writes)
    weight: np.ndarray  # centered int32 weight w_q - zp_w, the operand of the dot product
    weight_sum: np.ndarray  # int64 per output channel: sum of the centered weight (input zero point fold)
    weight_absmax: int  # max |centered weight|
    bias: np.ndarray  # int64 per output channel (int32 range; 48-bit for 16-bit operands), zeros without a bias
    stage: OutputStage
    acc: AccumulatorPlan
    groups: int


def _bias_role(node) -> Optional[BiasRole]:
    """Input 2, when present: b_q = b_f / (s_x * s_w[c]) (data input 0, weight input 1)."""
    return BiasRole(2, 0, 1) if len(node.inputs) > 2 and node.inputs[2] else None


def _bias_float(ctx: QuantizeContext, channels: int) -> Optional[np.ndarray]:
    node = ctx.node
    if len(node.inputs) > 2 and node.inputs[2]:
        if 2 not in ctx.constants:
            raise QuantizationError(f"bias {node.inputs[2]!r} must be a constant")
        b = np.asarray(ctx.constants[2], dtype=np.float64).ravel()
        if b.size != channels:
            raise QuantizationError(f"bias has {b.size} values, expected {channels}")
        return b
    return None


def _quantize_conv_like(ctx: QuantizeContext, out_channel_axis: int, out_channels_of) -> QuantizedConv:
    node = ctx.node
    x_qp = require_qparams(ctx.in_qparams[0], "input")
    require_per_tensor(x_qp, "input")
    w_qp = require_qparams(ctx.in_qparams[1], "weight")
    y_qp = require_qparams(ctx.out_qparams[0], "output")
    if 1 not in ctx.constants:
        raise QuantizationError(f"weight {node.inputs[1]!r} must be a constant")
    w_f = np.asarray(ctx.constants[1], dtype=np.float64)
    groups = int(node.attr("group", 1))
    channels = out_channels_of(w_f, groups)
    codes, centered = quantize_weight(w_f, w_qp, out_channel_axis, node)
    s_w = w_qp.scale if w_qp.per_channel else np.full(1, w_qp.scale[0])
    if w_qp.per_channel and out_channel_axis != 0:  # ConvTranspose: (C, M/g, ...) scales along axis 1
        s_w = np.tile(s_w, groups)
    acc_scale = float(x_qp.scale[0]) * s_w
    b_f = _bias_float(ctx, channels)
    acc_bits = accumulator_bits((x_qp.bits, w_qp.bits), ctx.options)
    bias = np.zeros(channels, dtype=np.int64)
    if b_f is not None:
        bias = quantize_bias(b_f, np.broadcast_to(bias_scale(x_qp.scale[0], s_w), channels), acc_bits)
    activation, params = fused_activation(node)
    stage = output_stage(acc_scale, y_qp, ctx.options.mbits, 1, activation, params)
    reduce_axes = tuple(i for i in range(centered.ndim) if i != out_channel_axis)
    x_dev, x_abs = code_deviation(x_qp)
    w_abs = absmax(centered)
    b_abs = absmax(bias)
    if out_channel_axis == 0:
        wsum = centered.sum(axis=reduce_axes, dtype=np.int64)
        terms = int(np.prod(centered.shape[1:]))
        fold_bound = terms * x_abs * w_abs + abs(int(x_qp.zero_point[0])) * absmax(wsum) + b_abs
    else:
        wsum = np.zeros(channels, dtype=np.int64)  # ConvTranspose centers its input instead
        terms = centered.shape[0] // groups * int(np.prod(centered.shape[2:]))
        fold_bound = terms * x_dev * w_abs + b_abs
    plan = plan_accumulator(acc_bits, terms * x_dev * w_abs + b_abs, fold_bound, ctx.options.mbits)
    return QuantizedConv(
        node,
        list(ctx.in_qparams),
        [y_qp],
        weight_codes=codes,
        weight=centered,
        weight_sum=wsum,
        weight_absmax=w_abs,
        bias=bias,
        stage=stage,
        acc=plan,
        groups=groups,
    )


# resolved geometry by (id(q), input spatial shape), dropped with the quantized node: resolving the attributes
# on every call of a run costs more than a small layer's kernel
_GEOMETRY: dict = {}


def _geometry(q: QuantizedConv, spatial: tuple[int, ...]):
    key = (id(q), spatial)
    geom = _GEOMETRY.get(key)
    if geom is None:
        geom = _GEOMETRY[key] = conv_geometry(q.node.attrs, spatial, q.weight.shape[2:])
        weakref.finalize(q, _GEOMETRY.pop, key, None)
    return geom


def _acc_dtype(terms: int, x_absmax: int, w_absmax: int):
    return np.int32 if terms * x_absmax * w_absmax < (1 << 31) else np.int64


def _check_rank(x: np.ndarray, rank: int) -> None:
    if x.ndim != rank:
        raise ValueError(f"input has rank {x.ndim}, weight implies rank {rank}")


@register
class Conv(OpDef):
    """ONNX Conv (N-d, group, depthwise, pads/strides/dilations/auto_pad) with an optional fused Relu, Clip
    or LeakyRelu (attrs `activation`, `activation_params`). Formula and LSB bound: module docstring."""

    op_type = "Conv"
    lsb_bound = 1.0
    section = "4.14/4.22/4.35"
    granularity = "per-channel weights"
    absorbs_activation = True
    absorbs_batchnorm = True
    layer_kind = LayerKind.CONVOLUTION
    conformance = Case(inputs=(X, "w", "b"), constants={"w": uniform_constant("convw", (4, 3, 3, 3), -0.5, 0.5),
                                                  "b": uniform_constant("convb", (4,))}, attrs={"pads": [1, 1, 1, 1]})

    def weight_role(self, node):
        return WeightRole(1, 0)

    def channel_groups(self, node):
        return int(node.attr("group", 1))

    def bias_role(self, node):
        return _bias_role(node)

    def bias_slot(self, node):
        """Input 2, one value per output channel (axis 1 of the output)."""
        return BiasSlot(2, 1)
    int_types = "int8/uint8/int16 x int8/int16 -> int32 (48 for 16-bit) acc"

    def forward_float(self, node, inputs):
        x, w = (np.asarray(v, dtype=np.float32) for v in inputs[:2])
        groups = int(node.attr("group", 1))
        geom = conv_geometry(node.attrs, x.shape[2:], w.shape[2:])
        y = conv_padded(pad_input(x, geom, 0.0), w, geom, groups, np.matmul, np.float32)
        if len(inputs) > 2 and inputs[2] is not None:
            y = y + per_channel(np.asarray(inputs[2], dtype=np.float32), 1, y.ndim)
        activation, params = fused_activation(node)
        return [apply_float_activation(y.astype(np.float32), activation, params)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedConv:
        return _quantize_conv_like(ctx, 0, lambda w, g: w.shape[0])

    def forward_int(self, q: QuantizedConv, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        if compiled.enabled(runtime):
            from ops.compiled.conv_plan import planned_conv

            done = planned_conv(x, q)  # the hot layouts, planned once per layer
            if done is not None:
                runtime.record_overflow(q.node, done[1])
                return [done[0]]
        _check_rank(x, q.weight.ndim)
        zx = int(q.in_qparams[0].zero_point[0])
        geom = _geometry(q, x.shape[2:])
        if compiled.enabled(runtime):
            from ops.compiled.depthwise import conv2d_grouped
            from ops.compiled.pointwise import conv_dense

            kernel = conv_dense if q.groups == 1 else conv2d_grouped
            done = kernel(x, q, geom, None if q.acc.safe else q.acc.bits)
            if done is not None:
                runtime.record_overflow(q.node, done[1])
                return [done[0]]
        xp = pad_input(x, geom, zx)
        terms = int(np.prod(q.weight.shape[1:]))
        acc_dtype = _acc_dtype(terms, dtype_absmax(x), q.weight_absmax)
        direct = getattr(runtime.backend, "direct_depthwise", False)
        acc = conv_padded(xp, q.weight, geom, q.groups, runtime.backend.matmul, acc_dtype, direct_depthwise=direct)
        offset = (q.bias - zx * q.weight_sum).reshape((1, -1) + (1,) * (acc.ndim - 2))
        return [finish_accumulator(acc, offset, q.acc, q.stage, q.node, runtime)]


def _transpose_output_geometry(node, x_spatial, kernel, strides, dilations):
    """(pads_begin, output size) of ConvTranspose per the ONNX spec (output_shape / auto_pad / pads)."""
    n = len(kernel)
    out_pad = list(node.attr("output_padding") or [0] * n)[:n]
    full = [s * (i - 1) + op + (k - 1) * d + 1
            for i, s, op, k, d in zip(x_spatial, strides, out_pad, kernel, dilations)]
    output_shape = node.attr("output_shape")
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = list(output_shape)[-n:] if output_shape is not None else [i * s for i, s in zip(x_spatial, strides)]
        total = [f - o for f, o in zip(full, out)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
        return begin, out, full
    pads = list(node.attr("pads") or [0] * (2 * n))
    if auto_pad == "VALID":
        pads = [0] * (2 * n)
    out = [f - b - e for f, b, e in zip(full, pads[:n], pads[n:])]
    return pads[:n], out, full


@register
class ConvTranspose(OpDef):
    """ONNX ConvTranspose (N-d, group, strides, dilations, pads, output_padding, output_shape, auto_pad).

    acc[m, o] = sum_{c, i, t: i*s + t*d - pad_begin = o} (x_q[c, i] - zp_x) * (w_q[c, m, t] - zp_w[m]) + b_q[m],
    requantized as Conv (same LSB bound). Odd total padding from auto_pad/output_shape follows the ONNX
    spec (SAME_UPPER puts the extra pad at the end), which onnxruntime's CPU kernel does not.
    """

    op_type = "ConvTranspose"
    lsb_bound = 1.0
    section = "4.15"
    granularity = "per-channel weights"
    conformance = Case(inputs=(X, "w", "b"), constants={"w": uniform_constant("ctw", (3, 2, 2, 2), -0.5, 0.5),
                                                  "b": uniform_constant("ctb", (2,))}, attrs={"strides": [2, 2]})

    def weight_role(self, node):
        return WeightRole(1, 1)

    def channel_groups(self, node):
        return int(node.attr("group", 1))

    def bias_role(self, node):
        return _bias_role(node)

    def bias_slot(self, node):
        """Input 2, one value per output channel (axis 1 of the output)."""
        return BiasSlot(2, 1)
    int_types = "int8/uint8/int16 x int8/int16 -> int32 (48 for 16-bit) acc"

    @staticmethod
    def _run(node, x, w, matmul, acc_dtype, groups):
        n = x.ndim - 2
        kernel = w.shape[2:]
        strides = list(node.attr("strides") or [1] * n)
        dilations = list(node.attr("dilations") or [1] * n)
        begin, out, full = _transpose_output_geometry(node, x.shape[2:], kernel, strides, dilations)
        geom = conv_geometry({"strides": strides, "dilations": dilations}, x.shape[2:], kernel)
        size = [max(f, b + o) for f, b, o in zip(full, begin, out)]
        y = conv_transpose_full(x, w, geom, groups, tuple(size), matmul, acc_dtype)
        index = (slice(None), slice(None)) + tuple(slice(b, b + o) for b, o in zip(begin, out))
        return y[index]

    def forward_float(self, node, inputs):
        x, w = (np.asarray(v, dtype=np.float32) for v in inputs[:2])
        y = self._run(node, x, w, np.matmul, np.float32, int(node.attr("group", 1)))
        if len(inputs) > 2 and inputs[2] is not None:
            y = y + per_channel(np.asarray(inputs[2], dtype=np.float32), 1, y.ndim)
        activation, params = fused_activation(node)
        return [apply_float_activation(y.astype(np.float32), activation, params)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedConv:
        return _quantize_conv_like(ctx, 1, lambda w, g: w.shape[1] * g)

    def forward_int(self, q: QuantizedConv, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        _check_rank(x, q.weight.ndim)
        zx = int(q.in_qparams[0].zero_point[0])
        xc = x.astype(np.int32) - zx
        acc = self._run(q.node, xc, q.weight, runtime.backend.matmul, np.int64, q.groups)
        offset = q.bias.reshape((1, -1) + (1,) * (acc.ndim - 2))
        return [finish_accumulator(acc, offset, q.acc, q.stage, q.node, runtime)]
