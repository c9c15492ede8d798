"""Gemm and MatMul (whitepaper 4.32 FullyConnected, 4.42 MatMul).

Gemm, Y = alpha * A' @ B' + beta * C with B, C constants (A' = A^T if transA, B' = B^T if transB):

    acc[:, n] = sum_k (a_q[:, k] - zp_a) * sign(alpha) * (w_q[k, n] - zp_w[n]) + c_q[:, n]
    c_q = round_half_even(beta * C / (|alpha| * fl32(s_a * s_w[n]))),   M[n] / 2^N[n] ~= |alpha| * s_a * s_w[n] / s_y
    y_q = clamp(((acc * M + 2^(N-1)) >> N) + zp_y, lo, hi)            (fused Relu/Clip/LeakyRelu as Conv)

Einsum of two activations whose equation is a batched matrix product, "<batch>ik,<batch>kj-><batch>ij" or
"<batch>ik,<batch>jk-><batch>ij" (B transposed: torchvision's MaxViT attention, `einsum("bghid,bghjd->bghij")`),
is MatMul(A, B) or MatMul(A, B^T) on the codes; any other equation raises QuantizationError (float fallback).

MatMul with a constant B is the same without C (per-channel along B's last axis), or with C when the rewrites
folded a constant added after it into its bias (`ptq.engine.bias_add_fold`: an input 2 that only ptq's integer graph
has, c_q = round_half_even(C / fl32(s_a * s_w[n]))); with two activations
(both per tensor), both zero points are folded around the backend's raw-code product:

    acc = A_q @ B_q - zp_b * rowsum(A_q) - zp_a * colsum(B_q) + K * zp_a * zp_b,   M / 2^N ~= s_a * s_b / s_y

The backend always sees raw codes (the input zero point is folded as sum (a - zp_a) w = sum a w - zp_a sum w).

LSB bound vs the float op on dequantized inputs and weights: as Conv, <= 1 LSB for outputs below 2^(mbits-2)
codes (0.5 LSB rounding + M/2^N relative error 2^-(mbits-1) + bias rounding 0.5 * s_a * s_w / s_y).
"""
from __future__ import annotations

# imports inside functions: `ops.compiled`'s numba kernels, imported by the first run that takes the compiled path
# (numba's import costs about half a second; `ops.compiled.enabled` decides)

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops import compiled
from ops.base import require_per_tensor, require_qparams
from ops.backend import absmax
from ops.conformance_case import X, Case, uniform_constant
from ops.linear import (
    AccumulatorPlan,
    OutputStage,
    accumulator_bits,
    code_deviation,
    finish_accumulator,
    apply_float_activation,
    fused_activation,
    output_stage,
    quantize_weight,
    plan_accumulator,
)
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.bias import bias_scale, quantize_bias
from ptq.core.roles import BiasRole, BiasSlot, LayerKind, WeightRole


@dataclass
class QuantizedGemm(QuantizedNode):
    weight_codes: np.ndarray  # w_q as stored in the model's orientation (what a QDQ export writes)
    weight: np.ndarray  # centered int32 (K, N) operand, sign(alpha) folded in
    weight_sum: np.ndarray  # int64 (N,): sum over K of `weight` (input zero point fold)
    bias: np.ndarray  # int64, broadcastable to (M, N); zeros without C
    stage: OutputStage
    acc: AccumulatorPlan


@dataclass
class QuantizedMatMul(QuantizedNode):
    stage: OutputStage
    acc: AccumulatorPlan  # activation x activation: `safe` is decided per call from K
    weight_codes: Optional[np.ndarray] = None  # constant B only
    weight: Optional[np.ndarray] = None  # centered int32 B (constant B only)
    weight_sum: Optional[np.ndarray] = None  # int64 (..., 1, N) sum over K of `weight`
    transpose_b: bool = False  # Einsum "...ik,...jk->...ij": B's codes swap their last two axes first
    bias: Optional[np.ndarray] = None  # int64 (N,) folded constant add (constant B only), else zeros


def _weight_plan(bits: int, x_qp, weight: np.ndarray, wsum: np.ndarray, bias: np.ndarray,
                 mbits: int) -> AccumulatorPlan:
    terms = weight.shape[-2] if weight.ndim > 1 else weight.shape[0]
    x_dev, x_abs = code_deviation(x_qp)
    w_abs, b_abs = absmax(weight), absmax(bias)
    fold = terms * x_abs * w_abs + abs(int(x_qp.zero_point[0])) * absmax(wsum) + b_abs
    return plan_accumulator(bits, terms * x_dev * w_abs + b_abs, fold, mbits)


def _activation_qparams(ctx: QuantizeContext, index: int, what: str):
    if index in ctx.constants:
        raise QuantizationError(f"{what} must be an activation, not a constant")
    qp = require_qparams(ctx.in_qparams[index], what)
    require_per_tensor(qp, what)
    return qp


@register
class Gemm(OpDef):
    """ONNX Gemm (alpha, beta, transA, transB, constant B and C) with an optional fused activation.
    Formula and LSB bound: module docstring."""

    op_type = "Gemm"
    lsb_bound = 1.0
    section = "4.32"
    granularity = "per-channel weights"
    int_types = "int8/uint8/int16 x int8/int16 -> int32 (48 for 16-bit) acc"
    absorbs_activation = True
    layer_kind = LayerKind.FULLY_CONNECTED
    conformance = Case(shape=(1, 6), inputs=(X, "w", "b"), attrs={"transB": 1},
                       constants={"w": uniform_constant("gemmw", (4, 6), -0.5, 0.5),
                                  "b": uniform_constant("gemmb", (4,))})

    def weight_role(self, node):
        """B, per output channel: its axis 0 when transposed (transB=1), else axis 1."""
        return WeightRole(1, 0 if node.attr("transB", 0) else 1)

    def bias_role(self, node):
        """C, when present: c_q = beta * c_f / (s_A * s_B[n])."""
        return BiasRole(2, 0, 1) if len(node.inputs) > 2 and node.inputs[2] else None

    def bias_slot(self, node):
        """C along the output's columns, when beta = 1 (a constant added after the Gemm is then C's share)."""
        return BiasSlot(2, 1) if float(node.attr("beta", 1.0)) == 1.0 else None

    def summed_input_axis(self, node):
        """A's columns (its rows when transposed, transA=1): the axis summed against B."""
        return 0 if node.attr("transA", 0) else 1

    def forward_float(self, node, inputs):
        a, b = (np.asarray(v, dtype=np.float32) for v in inputs[:2])
        a = a.T if node.attr("transA", 0) else a
        b = b.T if node.attr("transB", 0) else b
        y = np.float32(node.attr("alpha", 1.0)) * (a @ b)
        if len(inputs) > 2 and inputs[2] is not None:
            y = y + np.float32(node.attr("beta", 1.0)) * np.asarray(inputs[2], dtype=np.float32)
        activation, params = fused_activation(node)
        return [apply_float_activation(y.astype(np.float32), activation, params)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedGemm:
        node = ctx.node
        a_qp = _activation_qparams(ctx, 0, "input A")
        w_qp = require_qparams(ctx.in_qparams[1], "weight B")
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        if 1 not in ctx.constants:
            raise QuantizationError("B must be a constant (use MatMul for two activations)")
        alpha = float(node.attr("alpha", 1.0))
        if alpha == 0:
            raise QuantizationError("alpha = 0 leaves no product to quantize")
        w_f = np.asarray(ctx.constants[1], dtype=np.float64)
        codes, centered = quantize_weight(w_f, w_qp, self.weight_role(node).channel_axis, node)
        kn = centered.T if node.attr("transB", 0) else centered
        kn = np.ascontiguousarray(kn * np.int32(1 if alpha > 0 else -1))
        s_w = w_qp.scale if w_qp.per_channel else np.full(1, w_qp.scale[0])
        acc_scale = abs(alpha) * float(a_qp.scale[0]) * s_w
        acc_bits = accumulator_bits((a_qp.bits, w_qp.bits), ctx.options)
        bias = np.zeros(kn.shape[1], dtype=np.int64)
        if len(node.inputs) > 2 and node.inputs[2]:
            if 2 not in ctx.constants:
                raise QuantizationError("C must be a constant")
            c = float(node.attr("beta", 1.0)) * np.asarray(ctx.constants[2], dtype=np.float64)
            scale = abs(alpha) * bias_scale(a_qp.scale[0], s_w)
            bias = quantize_bias(c, np.broadcast_to(scale, kn.shape[1]), acc_bits)
        activation, params = fused_activation(node)
        wsum = kn.sum(axis=0, dtype=np.int64)
        return QuantizedGemm(
            node,
            list(ctx.in_qparams),
            [y_qp],
            weight_codes=codes,
            weight=kn,
            weight_sum=wsum,
            bias=bias,
            stage=output_stage(acc_scale, y_qp, ctx.options.mbits, -1, activation, params),
            acc=_weight_plan(acc_bits, a_qp, kn, wsum, bias, ctx.options.mbits),
        )

    def forward_int(self, q: QuantizedGemm, inputs, runtime: IntRuntime):
        a = np.asarray(inputs[0])
        if a.ndim != 2:
            raise ValueError(f"A must be 2-D, got shape {a.shape}")
        a = a.T if q.node.attr("transA", 0) else a
        if compiled.enabled(runtime):
            from ops.compiled.pointwise import gemm_dense

            done = gemm_dense(a, q, None if q.acc.safe else q.acc.bits)
            if done is not None:
                runtime.record_overflow(q.node, done[1])
                return [done[0]]
        za = int(q.in_qparams[0].zero_point[0])
        acc = runtime.backend.matmul(a, q.weight)
        return [finish_accumulator(acc, q.bias - za * q.weight_sum, q.acc, q.stage, q.node, runtime)]


def _promote(a: np.ndarray, b: np.ndarray):
    """numpy matmul's 1-D rules: a (K,) -> (1, K), b (K,) -> (K, 1); returns the axes to squeeze after."""
    squeeze = []
    if b.ndim == 1:
        b = b[:, None]
        squeeze.append(-1)
    if a.ndim == 1:
        a = a[None, :]
        squeeze.append(-2)
    return a, b, tuple(squeeze)


@register
class MatMul(OpDef):
    """ONNX MatMul (numpy semantics): constant B per-channel along its last axis, or two activations with
    both zero points folded. Formula and LSB bound: module docstring."""

    op_type = "MatMul"
    lsb_bound = 1.0
    section = "4.42"
    granularity = "per-channel constant B; per-tensor activations"
    int_types = "int8/uint8/int16 x int8/uint8/int16 -> int32 (48 for 16-bit) acc"
    conformance = Case(inputs=(X, "w"), constants={"w": uniform_constant("mmw", (5, 3), -0.5, 0.5)})

    def weight_role(self, node):
        """B, when it is a constant: per output channel along its last axis."""
        return WeightRole(1, -1)

    def bias_role(self, node):
        """C (input 2, a folded constant add), when present: c_q = c_f / (s_A * s_B[n])."""
        return BiasRole(2, 0, 1) if len(node.inputs) > 2 and node.inputs[2] else None

    def bias_slot(self, node):
        """A bias along the output's last axis, in ptq's integer graph only (ONNX MatMul has no such input)."""
        return BiasSlot(2, -1, in_onnx=False)

    def summed_input_axis(self, node):
        """A's last axis: the one summed against B."""
        return -1

    def forward_float(self, node, inputs):
        a, b = (np.asarray(v, dtype=np.float32) for v in inputs[:2])
        y = np.matmul(a, b)
        if len(inputs) > 2 and inputs[2] is not None:
            y = y + np.asarray(inputs[2], dtype=np.float32)
        return [y.astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedMatMul:
        node = ctx.node
        a_qp = _activation_qparams(ctx, 0, "input A")
        b_qp = require_qparams(ctx.in_qparams[1], "input B")
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        acc_bits = accumulator_bits((a_qp.bits, b_qp.bits), ctx.options)
        if 1 not in ctx.constants:
            if len(node.inputs) > 2 and node.inputs[2]:
                raise QuantizationError("a MatMul bias needs a constant B")
            require_per_tensor(b_qp, "input B (an activation)")
            acc_scale = float(a_qp.scale[0]) * b_qp.scale
            stage = output_stage(acc_scale, y_qp, ctx.options.mbits, None)
            plan = AccumulatorPlan(acc_bits, safe=False)
            return QuantizedMatMul(node, list(ctx.in_qparams), [y_qp], stage=stage, acc=plan)
        w_f = np.asarray(ctx.constants[1], dtype=np.float64)
        if w_f.ndim == 1 and b_qp.per_channel:
            raise QuantizationError("a 1-D B has no output channels; quantize it per tensor")
        codes, centered = quantize_weight(w_f, b_qp, self.weight_role(node).channel_axis, node)
        s_w = b_qp.scale if b_qp.per_channel else np.full(1, b_qp.scale[0])
        stage = output_stage(float(a_qp.scale[0]) * s_w, y_qp, ctx.options.mbits, -1)
        col = centered[:, None] if centered.ndim == 1 else centered
        wsum = col.sum(axis=-2, keepdims=True, dtype=np.int64)
        bias = np.zeros(1, dtype=np.int64)
        if len(node.inputs) > 2 and node.inputs[2]:
            if 2 not in ctx.constants or centered.ndim == 1:
                raise QuantizationError("a MatMul bias must be a constant, with a 2-D or batched B")
            bias = quantize_bias(np.asarray(ctx.constants[2], dtype=np.float64).reshape(-1),
                                 np.broadcast_to(bias_scale(a_qp.scale[0], s_w), col.shape[-1]), acc_bits)
        return QuantizedMatMul(
            node,
            list(ctx.in_qparams),
            [y_qp],
            stage=stage,
            acc=_weight_plan(acc_bits, a_qp, col, wsum, bias, ctx.options.mbits),
            weight_codes=codes,
            weight=centered,
            weight_sum=wsum,
            bias=bias,
        )

    def forward_int(self, q: QuantizedMatMul, inputs, runtime: IntRuntime):
        a_raw = np.asarray(inputs[0])
        za = int(q.in_qparams[0].zero_point[0])
        plan = q.acc
        if q.weight is not None:
            a, w, squeeze = _promote(a_raw, q.weight)
            acc = runtime.backend.matmul(a, w)
            offset = -za * q.weight_sum + (q.bias if q.bias is not None else 0)
        else:
            b_raw = np.swapaxes(inputs[1], -1, -2) if q.transpose_b else np.asarray(inputs[1])
            zb = int(q.in_qparams[1].zero_point[0])
            a, b, squeeze = _promote(a_raw, b_raw)
            k = a.shape[-1]
            row = a.sum(axis=-1, keepdims=True, dtype=np.int64)  # (..., M, 1)
            col = b.sum(axis=-2, keepdims=True, dtype=np.int64)  # (..., 1, N)
            acc = runtime.backend.matmul(a, b) - zb * row - za * col + k * za * zb
            offset = None
            a_dev, _ = code_deviation(q.in_qparams[0])
            b_dev, _ = code_deviation(q.in_qparams[1])
            bound = k * a_dev * b_dev
            plan = plan_accumulator(plan.bits, bound, bound, int(q.stage.m.max()).bit_length())
        if squeeze:
            acc = acc.squeeze(axis=squeeze)
            offset = offset.squeeze(axis=squeeze) if offset is not None else None
        return [finish_accumulator(acc, offset, plan, q.stage, q.node, runtime)]


def einsum_transposes_b(equation: str) -> bool:
    """Whether a batched-matmul Einsum equation takes B transposed ("...ik,...jk->...ij": True;
    "...ik,...kj->...ij": False, batch letters equal in both operands and the output); QuantizationError for
    any other equation."""
    terms = equation.replace(" ", "")
    lhs, _, out = terms.partition("->")
    operands = lhs.split(",")
    if len(operands) == 2 and "." not in terms:
        a, b = operands
        batch = a[:-2]
        if len(a) >= 2 and len(set(a)) == len(a) and b[:-2] == out[:-2] == batch and len(b) == len(out) == len(a):
            (i, k), j = a[-2:], out[-1]
            if out[-2] == i and len({i, j, k}) == 3 and j not in batch:
                if b[-2:] == k + j:
                    return False
                if b[-2:] == j + k:
                    return True
    raise QuantizationError(f"Einsum {equation!r} is not a batched matrix product of two operands "
                            f"('...ik,...kj->...ij' or '...ik,...jk->...ij'); it runs in float")


@register
class Einsum(MatMul):
    """ONNX Einsum whose equation is a batched matrix product of two activations: MatMul(A, B) or
    MatMul(A, B^T) on the codes (`einsum_transposes_b`). Formula and LSB bound: MatMul's, module docstring."""

    op_type = "Einsum"
    granularity = "per-tensor activations (batched-matmul equations)"
    conformance = Case(inputs=(X, X), attrs={"equation": "bcik,bcjk->bcij"}, note="x x^T, two activations")

    def weight_role(self, node):
        return None

    def forward_float(self, node, inputs):
        a, b = (np.asarray(v, dtype=np.float32) for v in inputs[:2])
        return [np.einsum(node.attr("equation"), a, b).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedMatMul:
        transpose_b = einsum_transposes_b(ctx.node.attr("equation"))
        if 1 in ctx.constants:
            raise QuantizationError("Einsum runs in integers with two activations only; B is a constant")
        q = super().quantize(ctx)
        q.transpose_b = transpose_b
        return q
