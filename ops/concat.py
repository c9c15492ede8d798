"""Concat (whitepaper 4.12), ONNX convention.

From y_f = Concat(x1_f, x2_f, ...) with (y_q - zp_y) s_y = Concat((x_i_q - zp_i) s_i), each input is
requantized to the output qparams on its own:

    y_q = Concat_i( clamp((((x_i_q - zp_i) * M_i + 2^(N_i-1)) >> N_i) + zp_y, qmin, qmax) ),  M_i / 2^N_i ~= s_i / s_y

An input whose qparams equal the output's is copied (M_i / 2^N_i = 1 exactly: the same codes). A constant
input is quantized directly with the output qparams. Output qparams: the quant table's proposal (the
calibrated range of the concatenation), else the inputs' when they all agree. The whitepaper's speed-up
(tune every branch to share the output's qparams) is a calibration choice; this rule is exact either way.

Per-channel output along the concat axis (issue 24: parts whose ranges differ widely, such as pixel boxes
joined with sigmoid scores, each keep their own grid; `ptq.calibration.joined_ranges` proposes it): input i covers the
output channels [a_i, b_i) (static sizes along the axis), and each of its channels c is requantized to
(s_y[c], zp_y[c]) with its own M_i[c] / 2^N_i[c] ~= s_i / s_y[c] -- the same formula per channel. A part whose
channels all have the input's own grid is copied (exact).

LSB bound vs the float op on the dequantized inputs: 0.5 + max_i |x_i_q - zp_i| * s_i / s_y * 2^-mbits
(rounding plus the multiplier's relative error), per channel for a per-channel output; 0 for copied inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops.base import centered, multiplier, normalize_axes, require_per_tensor, require_qparams
from ops.conformance_case import X, Case, uniform_constant
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.qparams import QParams
from ptq.core.requant import requantize


@dataclass
class QuantizedConcat(QuantizedNode):
    constant_codes: list[Optional[np.ndarray]]  # per input: codes in the output qparams (None: activation)
    copy: list[bool]  # per input: its grid is the output's (on its channels), the codes pass through
    m: list[np.ndarray]  # per input: 1 value (per-tensor output) or one per channel of its part
    n: list[np.ndarray]
    zero_points: list[np.ndarray]  # per input: the output zero point(s) on its part
    axis: int  # the concat axis (non-negative when the output is per channel, else as written)


def _segments(ctx: QuantizeContext, axis: int) -> list[int]:
    """The size of every input along the concat axis, from the static shapes (per-channel output only)."""
    sizes = []
    for i in range(len(ctx.node.inputs)):
        shape = tuple(np.shape(ctx.constants[i])) if i in ctx.constants else ctx.in_shape(i)
        if shape is None or not -len(shape) <= axis < len(shape) or shape[axis] is None:
            raise QuantizationError(f"a per-channel output needs the static size of input {i} along axis {axis}")
        sizes.append(int(shape[axis]))
    return sizes


def _part(qp: QParams, lo: int, hi: int, axis: int) -> QParams:
    """Channels [lo, hi) of a per-channel QParams (along `axis`), or `qp` itself when per tensor."""
    if not qp.per_channel:
        return qp
    return QParams(scale=qp.scale[lo:hi], zero_point=qp.zero_point[lo:hi], bits=qp.bits, signed=qp.signed,
                   axis=axis, narrow=qp.narrow)


def _same_grid(x_qp: QParams, part: QParams) -> bool:
    """Whether every channel of `part` has the grid of the per-tensor `x_qp` (the codes then pass through)."""
    return ((x_qp.bits, x_qp.signed, x_qp.narrow) == (part.bits, part.signed, part.narrow)
            and bool(np.all(part.scale == x_qp.scale[0])) and bool(np.all(part.zero_point == x_qp.zero_point[0])))


@register
class Concat(OpDef):
    """ONNX Concat. Integer formula and LSB bound: module docstring."""

    op_type = "Concat"
    lsb_bound = 0.51  # 0.5 + |y_q - zp_y| * 2^-(mbits-1) or less, 8-bit
    section = "4.12"
    int_types = "int8/uint8/int16/uint16 -> int8/uint8/int16/uint16"
    granularity = "per-tensor; output per channel along the axis"
    conformance = Case(inputs=(X, "c"), constants={"c": uniform_constant("concat", (1, 2, 4, 5), -3, 3)},
                       attrs={"axis": 1})

    def joins_along(self, node):
        return int(node.attr("axis")) if node.attr("axis") is not None else None

    def forward_float(self, node, inputs):
        return [np.concatenate([np.asarray(x, dtype=np.float32) for x in inputs], axis=int(node.attr("axis")))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedConcat:
        node = ctx.node
        if node.attr("axis") is None:
            raise QuantizationError("attribute axis is required")
        act = {}
        for i in range(len(node.inputs)):
            if i not in ctx.constants:
                act[i] = require_qparams(ctx.in_qparams[i], f"input {i}")
                require_per_tensor(act[i], f"input {i}")
        y_qp = ctx.out_qparams[0] if ctx.out_qparams and ctx.out_qparams[0] is not None else None
        if y_qp is None:
            distinct = list(act.values())
            if not distinct or any(qp != distinct[0] for qp in distinct):
                raise QuantizationError("no output qparams and the inputs' qparams differ")
            y_qp = distinct[0]
        axis = int(node.attr("axis"))
        bounds = [(0, 1)] * len(node.inputs)
        if y_qp.per_channel:
            sizes = _segments(ctx, axis)
            rank = len(ctx.in_shape(next(iter(act)))) if act else np.ndim(ctx.constants[0])
            axis = axis % rank
            if y_qp.axis % rank != axis or y_qp.scale.size != sum(sizes):
                raise QuantizationError(f"a per-channel output must run along the concat axis {axis} with one "
                                        f"scale per channel ({sum(sizes)}), got axis {y_qp.axis} with "
                                        f"{y_qp.scale.size}")
            edges = np.cumsum([0] + sizes)
            bounds = list(zip(edges[:-1].tolist(), edges[1:].tolist()))
        codes, copy, ms, ns, zps = [], [], [], [], []
        for i in range(len(node.inputs)):
            qp: Optional[QParams] = act.get(i)
            part = _part(y_qp, *bounds[i], axis)
            codes.append(part.quantize(ctx.constants[i]) if qp is None else None)
            copy.append(qp is not None and _same_grid(qp, part))
            m, n = np.array([1]), np.array([0])
            if qp is not None and not copy[-1]:
                m, n = multiplier(float(qp.scale[0]) / part.scale.astype(np.float64), ctx.options.mbits,
                                  f"input {i} scale ratio")
            ms.append(np.asarray(m, np.int64))
            ns.append(np.asarray(n, np.int64))
            zps.append(np.asarray(part.zero_point, np.int64))
        in_qp = [act.get(i) for i in range(len(node.inputs))]
        return QuantizedConcat(node, in_qp, [y_qp], codes, copy, ms, ns, zps, axis)

    def forward_int(self, q: QuantizedConcat, inputs, runtime: IntRuntime):
        y = q.out_qparams[0]
        parts = []
        for i, x in enumerate(inputs):
            if q.constant_codes[i] is not None:
                parts.append(q.constant_codes[i])
            elif q.copy[i]:
                parts.append(np.asarray(x).astype(y.dtype, copy=False))
            else:
                xc = centered(x, q.in_qparams[i])
                along = q.axis if q.m[i].size > 1 else None
                parts.append(requantize(xc, q.m[i], q.n[i], q.zero_points[i], y.qmin, y.qmax, axis=along,
                                        dtype=y.dtype))
        axis = normalize_axes([q.axis], parts[0].ndim)[0]
        return [np.concatenate(parts, axis=axis)]

