"""ReduceMean (whitepaper 4.53), ONNX convention.

The mean over the reduced axes (c = product of their sizes) is a window sum followed by one requant that
includes 1/c (`ops.common.MeanRequant`); the whitepaper's s_y = s_x becomes the special case of a proposal
equal to the input's qparams:

    acc = saturate_int32(sum over the reduced axes of (x_q - zp_x))
    y_q = clamp(((acc * M + 2^(N-1)) >> N) + zp_y, qmin, qmax),      M / 2^N ~= s_x / (s_y * c)

Axes come from the `axes` attribute (opset < 18) or the second input (opset >= 18, read at run time: a
shape subgraph may compute it; the (M, N) pair of each count is cached); no axes means all axes, or the
identity (c = 1) with noop_with_empty_axes=1. keepdims defaults to 1.
LSB bound vs the float op on the dequantized input: 0.5 + |y_f| / s_y * 2^-mbits.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from ops.base import centered, int_list, normalize_axes
from ops.conformance_case import Case
from ops.mean_requant import QuantizedMean, quantize_mean
from ops.registry import IntRuntime, OpDef, QuantizeContext, register
from ptq.core.graph import Node


def reduce_axes(node: Node, inputs, rank: int) -> tuple[int, ...]:
    """The reduced axes of a ReduceMean node; () for the noop case."""
    axes = int_list(node, inputs, 1, "axes")
    if not axes:
        return () if node.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(normalize_axes(axes, rank))


@register
class ReduceMean(OpDef):
    """ONNX ReduceMean. Integer formula and LSB bound: module docstring."""

    op_type = "ReduceMean"
    lsb_bound = 0.51  # 0.5 + |y_q - zp_y| * 2^-(mbits-1) or less, 8-bit
    section = "4.53"
    int_types = "int8/uint8/int16/uint16 -> int8/uint8/int16/uint16"
    conformance = Case(attrs={"axes": [2, 3]})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        axes = reduce_axes(node, inputs, x.ndim)
        keep = bool(node.attr("keepdims", 1))
        return [x.astype(np.float64).mean(axis=axes, keepdims=keep).astype(np.float32) if axes else x]

    def quantize(self, ctx: QuantizeContext) -> QuantizedMean:
        return quantize_mean(ctx)

    def forward_int(self, q: QuantizedMean, inputs, runtime: IntRuntime):
        node = q.node
        x = np.asarray(inputs[0])
        axes = reduce_axes(node, inputs, x.ndim)
        if not axes:
            return [q.mean.apply(centered(x, q.in_qparams[0]), 1, partial(runtime.record_overflow, node))]
        count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
        # sum (x_q - zp) = sum x_q - zp * count, in int64: no centered copy of the input
        acc = x.sum(axis=axes, keepdims=bool(node.attr("keepdims", 1)), dtype=np.int64)
        acc -= int(q.in_qparams[0].zero_point[0]) * count
        return [q.mean.apply(acc, count, partial(runtime.record_overflow, node))]
