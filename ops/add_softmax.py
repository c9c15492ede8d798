"""AddSoftmax (ai.ptq): y = softmax(x + b) along `axis` -- attention scores plus a mask or position bias,
fused so that the sum is never quantized (a padding mask of -1e4 would otherwise stretch the 8-bit range of
the masked scores to ~40 per LSB and wipe out the scores; measured cosine 0.60 on a small attention).
`ptq.engine.rewrites.fuse_masked_softmax` produces it from `Add -> Softmax -> MatMul`. Whitepaper 4.66 (Softmax).

The bias is brought to the scores' LSB in integers, added in int64 (no clamp), and the row goes through
Softmax's exp table (`lut.softmax`, built from s_x; exp(0) = 2^20, or 2^E with E = ceil(log2 n) + 8 for rows
over 4096 terms, as Softmax):

    constant b:    b_x = round_half_even(b / s_x)                    (offline, clipped to +-2^40)
    activation b:  b_x = ((b_q - zp_b) * M + 2^(N-1)) >> N,          M / 2^N ~= s_b / s_x
                   or, for a mask grid far coarser than the scores' (s_b / s_x >= 2^mbits: a mask of
                   finfo.min or -1e9 from an attention_mask input), b_x = clip((b_q - zp_b) * M, +-2^40) << L,
                   M * 2^L ~= s_b / s_x with L <= 41 (every nonzero code then saturates: a masked position)
    b_x is clipped to +-2^40 in both cases.
    l_i = x_q[i] + b_x[i];  d_i = max_j l_j - l_i;  e_i = exp_table[min(d_i, len - 1)];  S = sum_i e_i
    y_q[i] = floor(e_i * Q / S) + (2 * (e_i * Q mod S) >= S),        Q = 2^B - 1

The table runs on to its first zero entry (gap ceil(ln(2^(E+1)) / s_x)), whatever the input's code range: a
logit gap beyond the input range (a bias of a few units) reads its true exp, and a masked position
(b ~ -1e4) lands past the first zero entry: e_i = 0 exactly, as exp(-1e4) is 0 in float. Output qparams as Softmax: unsigned B bits, scale 1 / Q, zero point 0.
LSB bound vs the float softmax(x + b) on the dequantized x (and b): Softmax's (<= 1 LSB for 8-bit outputs)
plus the bias rounding eps per logit -- 0.5 * s_x (constant b), 0.5 * s_x + |b_c| * s_b * 2^-(mbits-1)
(activation b) -- which moves each output by at most eps / 2: 1 + Q * s_x / 4 LSB for a constant b.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from lut.softmax import SoftmaxKernel, build_softmax, divide_rounded, row_terms
from ops.base import multiplier, require_per_tensor, require_qparams
from ops.conformance_case import X, Case, uniform_constant
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register
from ptq.core.requant import requantize

BIAS_CODE_LIMIT = 1 << 40
MAX_LEFT_SHIFT = 41  # 2^41 > BIAS_CODE_LIMIT: any nonzero code saturates


@dataclass
class QuantizedAddSoftmax(QuantizedNode):
    kernel: SoftmaxKernel
    bias_codes: Optional[np.ndarray]  # constant b in units of s_x (int64)
    m: int = 0  # activation b: M, N of s_b / s_x
    n: int = 0
    left_shift: int = 0  # activation b with s_b / s_x >= 2^mbits: M * 2^left_shift ~= s_b / s_x (n = 0)


def _add_softmax_reference(x, b):
    """The conformance case's numpy formula: softmax(x + b) along the last axis."""
    v = x + b
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return [e / e.sum(axis=-1, keepdims=True)]


@register
class AddSoftmax(OpDef):
    """ai.ptq AddSoftmax: softmax(x + b) along `axis` (default -1). Formula and LSB bound: module docstring."""

    op_type = "AddSoftmax"
    lsb_bound = 2.0  # 1 + Q * s_x / 4 with s_x <= 1/64 (8-bit scores within +-2)
    domain = "ai.ptq"
    section = "4.66 (Softmax, with the mask added in the scores' LSB)"
    int_types = "int8/uint8/int16 + constant or int8/uint8/int16 -> uint8/uint16"
    conformance = Case(path="direct", reference=_add_softmax_reference, inputs=(X, "b"),
                       constants={"b": uniform_constant("mask", (4, 5), -3, 0)}, attrs={"axis": -1})

    def forward_float(self, node, inputs):
        z = np.asarray(inputs[0], dtype=np.float32) + np.asarray(inputs[1], dtype=np.float32)
        axis = int(node.attr("axis", -1))
        e = np.exp(z - z.max(axis=axis, keepdims=True))
        return [(e / e.sum(axis=axis, keepdims=True)).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedAddSoftmax:
        x_qp = require_qparams(ctx.in_qparams[0], "input 0 (scores)")
        require_per_tensor(x_qp, "input 0 (scores)")
        proposal = ctx.out_qparams[0] if ctx.out_qparams else None
        s_x = float(x_qp.scale[0])
        # a bias spreads the logits past the input's code range: the table must run on to its first zero entry
        axis = int(ctx.node.attr("axis", -1))
        shape = ctx.in_shape(0)
        n = shape[axis] if shape and -len(shape) <= axis < len(shape) and shape[axis] else None
        kernel = build_softmax(x_qp, proposal.bits if proposal is not None else 8, axis, n, cover_gaps=True)
        if 1 in ctx.constants:
            b = np.asarray(ctx.constants[1], dtype=np.float64)
            codes = np.clip(np.rint(b / s_x), -BIAS_CODE_LIMIT, BIAS_CODE_LIMIT).astype(np.int64)
            return QuantizedAddSoftmax(ctx.node, [x_qp, None], [kernel.out_qparams], kernel, codes)
        b_qp = require_qparams(ctx.in_qparams[1], "input 1 (bias)")
        require_per_tensor(b_qp, "input 1 (bias)")
        ratio = float(b_qp.scale[0]) / s_x
        mmax = (1 << ctx.options.mbits) - 1
        if ratio < mmax:
            m, n = multiplier(ratio, ctx.options.mbits, "s_b / s_x")
            return QuantizedAddSoftmax(ctx.node, [x_qp, b_qp], [kernel.out_qparams], kernel, None, int(m[0]),
                                       int(n[0]))
        shift = min(int(np.ceil(np.log2(ratio / mmax))), MAX_LEFT_SHIFT)
        m_big = int(np.clip(np.rint(ratio / 2.0 ** shift), 1, mmax))
        return QuantizedAddSoftmax(ctx.node, [x_qp, b_qp], [kernel.out_qparams], kernel, None, m_big, 0, shift)

    def forward_int(self, q: QuantizedAddSoftmax, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0]).astype(np.int64)
        if q.bias_codes is not None:
            bias = q.bias_codes
        else:
            b_c = np.asarray(inputs[1]).astype(np.int64) - int(q.in_qparams[1].zero_point[0])
            if q.left_shift:
                bound = (BIAS_CODE_LIMIT >> q.left_shift) + 1
                bias = np.clip(np.clip(b_c * q.m, -bound, bound) << q.left_shift, -BIAS_CODE_LIMIT, BIAS_CODE_LIMIT)
            else:
                bias = requantize(b_c, q.m, q.n, 0, -BIAS_CODE_LIMIT, BIAS_CODE_LIMIT)
        logits = x + bias
        _, e, total, _ = row_terms(q.kernel, logits)
        return [divide_rounded(e, total, q.kernel.out_qparams)]
