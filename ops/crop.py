"""Crop (whitepaper 4.18), custom domain `ai.ptq`: y = x[starts[0]:ends[0], starts[1]:ends[1], ...].

Attributes `starts` and `ends` (one per axis, ends exclusive, 0 <= start <= end <= dim; negative values
count from the end as in Python). From y_f = Crop(x_f) with s_y = s_x and zp_y = zp_x (ONNX convention):

    y_q = Crop(x_q)

The output takes the input's qparams. LSB bound vs the float op on the dequantized input: 0 (exact).
"""
from __future__ import annotations

import numpy as np

from ops.base import activation_qparams, float_or_index
from ops.conformance_case import Case
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node

PTQ_DOMAIN = "ai.ptq"


def crop_slices(node: Node, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """One slice per axis from `starts` / `ends`; ValueError naming the attribute when they do not fit."""
    starts, ends = node.attr("starts"), node.attr("ends")
    if starts is None or ends is None:
        raise ValueError("attributes starts and ends are required")
    starts, ends = [int(v) for v in np.atleast_1d(starts)], [int(v) for v in np.atleast_1d(ends)]
    if len(starts) != len(shape) or len(ends) != len(shape):
        raise ValueError(f"starts {starts} and ends {ends} need one value per axis of the input shape {shape}")
    slices = []
    for axis, (start, end, dim) in enumerate(zip(starts, ends, shape)):
        start, end = (start + dim if start < 0 else start), (end + dim if end < 0 else end)
        if not 0 <= start <= end <= dim:
            raise ValueError(f"starts/ends [{start}, {end}) do not fit axis {axis} of size {dim}")
        slices.append(slice(start, end))
    return tuple(slices)


@register
class Crop(OpDef):
    """ai.ptq Crop. Formula and LSB bound: module docstring."""

    op_type = "Crop"
    domain = PTQ_DOMAIN
    section = "4.18"
    int_types = "any -> same as input"
    keeps_input_qparams = True
    lsb_bound = 0.0
    conformance = Case(path="direct", reference=lambda x: [x[:, 1:3, 1:4, 0:4]],
                       attrs={"starts": [0, 1, 1, 0], "ends": [1, 3, 4, 4]})

    def forward_float(self, node, inputs):
        x = float_or_index(inputs[0])
        return [x[crop_slices(node, x.shape)].copy()]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [activation_qparams(ctx)])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        return [x[crop_slices(q.node, x.shape)].copy()]
