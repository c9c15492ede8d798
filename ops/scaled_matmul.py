"""ScaledMatMul (ai.ptq): Y = alpha * (A @ B) for two activations -- attention scores with the constant scale
folded into the MatMul's requant (whitepaper 4.42 MatMul; `ptq.engine.rewrites.fuse_attention_scale` produces it
from `MatMul -> Mul/Div by a constant`, so the scaled scores are the only quantized tensor):

    acc = A_q @ B_q - zp_b * rowsum(A_q) - zp_a * colsum(B_q) + K * zp_a * zp_b      (MatMul's integer forward)
    y_q = clamp(((acc * M + 2^(N-1)) >> N) + zp_y, qmin, qmax),     M / 2^N ~= alpha * s_a * s_b / s_y

alpha > 0 (an attention scale 1 / sqrt(d_k)). LSB bound vs the float op on dequantized inputs: MatMul's,
0.5 + |y_q - zp_y| * 2^-(mbits-1) (no extra rounding: alpha costs nothing but the multiplier's error).
"""
from __future__ import annotations

import numpy as np

from ops.base import require_per_tensor, require_qparams
from ops.conformance_case import X, Case, uniform_constant
from ops.gemm import MatMul, QuantizedMatMul
from ops.linear import AccumulatorPlan, accumulator_bits, output_stage
from ops.registry import QuantizationError, QuantizeContext, register


def _alpha(node) -> float:
    alpha = float(node.attr("alpha", 1.0))
    if not (np.isfinite(alpha) and alpha > 0):
        raise QuantizationError(f"attribute alpha must be finite and > 0, got {alpha}")
    return alpha


@register
class ScaledMatMul(MatMul):
    """ai.ptq ScaledMatMul: alpha * (A @ B), A and B activations. Formula and LSB bound: module docstring."""

    op_type = "ScaledMatMul"
    lsb_bound = 1.0
    domain = "ai.ptq"
    section = "4.42 (MatMul with the constant factor folded into M/2^N)"
    granularity = "per-tensor activations"
    conformance = Case(path="direct", reference=lambda x, b: [0.25 * (x @ b)], inputs=(X, "b"),
                       constants={"b": uniform_constant("smm", (5, 3), -2, 2)}, activation_constants=("b",),
                       attrs={"alpha": 0.25}, note="B a second activation (8-bit codes)")

    def weight_role(self, node):
        return None

    def forward_float(self, node, inputs):
        a, b = (np.asarray(v, dtype=np.float32) for v in inputs[:2])
        return [(np.float32(_alpha(node)) * np.matmul(a, b)).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedMatMul:
        alpha = _alpha(ctx.node)
        qps = []
        for index, what in ((0, "input A"), (1, "input B")):
            if index in ctx.constants:
                raise QuantizationError(f"{what} must be an activation, not a constant")
            qp = require_qparams(ctx.in_qparams[index], what)
            require_per_tensor(qp, what)
            qps.append(qp)
        a_qp, b_qp = qps
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        stage = output_stage(alpha * float(a_qp.scale[0]) * float(b_qp.scale[0]), y_qp, ctx.options.mbits, None)
        plan = AccumulatorPlan(accumulator_bits((a_qp.bits, b_qp.bits), ctx.options), safe=False)
        return QuantizedMatMul(ctx.node, list(ctx.in_qparams), [y_qp], stage=stage, acc=plan)
