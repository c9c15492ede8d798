"""Concat (whitepaper 4.12), ONNX convention.

From y_f = Concat(x1_f, x2_f, ...) with (y_q - zp_y) s_y = Concat((x_i_q - zp_i) s_i), each input is
requantized to the output qparams on its own:

    y_q = Concat_i( clamp((((x_i_q - zp_i) * M_i + 2^(N_i-1)) >> N_i) + zp_y, qmin, qmax) ),  M_i / 2^N_i ~= s_i / s_y

An input whose qparams equal the output's is copied (M_i / 2^N_i = 1 exactly: the same codes). A constant
input is quantized directly with the output qparams. Output qparams: the quant table's proposal (the
calibrated range of the concatenation), else the inputs' when they all agree. The whitepaper's speed-up
(tune every branch to share the output's qparams) is a calibration choice; this rule is exact either way.

LSB bound vs the float op on the dequantized inputs: 0.5 + max_i |x_i_q - zp_i| * s_i / s_y * 2^-mbits
(rounding plus the multiplier's relative error); 0 for copied inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops.base import centered, multiplier, normalize_axes, require_per_tensor, require_qparams
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.qparams import QParams
from ptq.core.requant import requantize


@dataclass
class QuantizedConcat(QuantizedNode):
    constant_codes: list[Optional[np.ndarray]]  # per input: codes in the output qparams (None: activation)
    copy: list[bool]  # per input: qparams equal the output's, the codes pass through
    m: np.ndarray  # per input (1 for constants and copies)
    n: np.ndarray


@register
class Concat(OpDef):
    """ONNX Concat. Integer formula and LSB bound: module docstring."""

    op_type = "Concat"
    joins_inputs = True
    lsb_bound = 0.51  # 0.5 + |y_q - zp_y| * 2^-(mbits-1) or less, 8-bit
    section = "4.12"
    int_types = "int8/uint8/int16/uint16 -> int8/uint8/int16/uint16"

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
        require_per_tensor(y_qp, "output")
        codes, copy, ms, ns = [], [], [], []
        for i in range(len(node.inputs)):
            qp: Optional[QParams] = act.get(i)
            codes.append(y_qp.quantize(ctx.constants[i]) if qp is None else None)
            copy.append(qp is not None and qp == y_qp)
            m, n = np.array([1]), np.array([0])
            if qp is not None and not copy[-1]:
                m, n = multiplier(float(qp.scale[0]) / float(y_qp.scale[0]), ctx.options.mbits, f"input {i} scale ratio")
            ms.append(int(m[0]))
            ns.append(int(n[0]))
        in_qp = [act.get(i) for i in range(len(node.inputs))]
        return QuantizedConcat(node, in_qp, [y_qp], codes, copy, np.array(ms, np.int64), np.array(ns, np.int64))

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
                parts.append(requantize(xc, q.m[i], q.n[i], y.zero_point[0], y.qmin, y.qmax, dtype=y.dtype))
        axis = normalize_axes([int(q.node.attr("axis"))], parts[0].ndim)[0]
        return [np.concatenate(parts, axis=axis)]
