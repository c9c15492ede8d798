"""LayerNormalization (ONNX opset 17), RMSNormalization (opset 23) and InstanceNormalization in integers (whitepaper 4.5 / 4.46: integer
mean and variance; ONNX convention x_c = x_q - zp_x; D = number of normalized elements per row).

Per row, everything in exact int64 (s_x cancels: the normalized value does not depend on the input scale):

    S1 = sum x_c,  S2 = sum x_c^2
    num = D * x_c - S1                                  ( = D (x - mean) / s_x)
    den = D * S2 - S1^2 + eps_q,   eps_q = round(eps * D^2 / s_x^2)    ( = D^2 (var + eps) / s_x^2)
    r   = isqrt(den * 4^G)                              (`ops.int_sqrt`: integer Newton, exact floor)
    n_F = round_half_away(num * 2^(F+G) / r)            ( = n * 2^F, n = (x - mean) / sqrt(var + eps))

then the per-channel affine with 16-bit gamma codes (one per-tensor scale s_g = max|gamma| / 32767) and an
int64 beta at the accumulator scale s_g / 2^F, requantized once (an `ops.linear.OutputStage`, which pre-rounds
the accumulator when the factor is tiny):

    g_q = round(gamma / s_g),  b_q = round(beta * 2^F / s_g)
    y_q = clamp(((n_F * g_q + b_q) * M + 2^(N-1)) >> N) + zp_y, qmin, qmax),   M / 2^N ~= s_g / (2^F s_y)

F = `NORM_FRACTION_BITS`; G (the square root's extra bits) and eps_q depend on D only and are derived once
per D (cached), G as large as keeps den * 4^G and num * 2^(F+G) below 2^61 (13 for 8-bit rows of 768).

LSB bound vs the float op on the dequantized input, with n_max = max |n| <= sqrt(D - 1):
    0.5 + |y_q - zp_y| * 2^-(mbits-1) + 2^-17 + (max|gamma| / s_y) * (n_max * (2^-16 + 2^-G) + 2^-F)
(final rounding; multiplier; pre-rounding; gamma codes, square root and n_F roundings) -- plus the
rounding of eps_q, n * |eps_q - eps D^2/s_x^2| / (2 den), negligible unless var ~ eps.

RMSNormalization (ONNX opset 23; `ptq.engine.transformer_patterns` fuses the written-out RMSNorm into it): the same
kernel without the mean, S1 taken as 0 (x_c = x_q - zp is x / s_x exactly, so no centring is lost):

    num = D * x_c,  den = D * S2 + eps_q                ( = D^2 (mean(x^2) + eps) / s_x^2)

and the same LSB bound with n_max = sqrt(D).

LayerNormalization: axis (default -1) to the last axis are normalized; Scale and B broadcast against them.
Its optional Mean and InvStdDev outputs (axes kept with size 1) come from the same row sums, on their own
calibrated grids:

    mean_q = clamp(((S1 * M_m + 2^(N_m-1)) >> N_m) + zp_m),             M_m / 2^N_m ~= s_x / (D s_m)
    inv_q  = clamp(round_half_away(D * M_i * 2^G / (r * 2^N_i)) + zp_i),  M_i / 2^N_i ~= 1 / (s_x s_i)

(1 / sqrt(var + eps) = D / (s_x sqrt(den)) and r ~= sqrt(den) 2^G). LSB bounds vs the float statistics of
the dequantized input: Mean 0.5 + |mean_c| 2^-(mbits-1); InvStdDev 0.5 + |inv_c| (2^-(mbits-1) + 2^-G) plus
the eps_q rounding's share, all under 0.6 LSB for 8-bit outputs. InstanceNormalization: axes 2.. are
normalized per (n, c); scale and B are per channel (axis 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ops.base import activation_qparams, centered, multiplier, normalize_axes, require_per_tensor, require_qparams
from ops.conformance_case import X, Case, uniform_constant
from ops.div import divide_rounded
from ops.int_sqrt import isqrt
from ops.linear import OutputStage, code_deviation, output_stage
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.qparams import QParams
from ptq.core.requant import requantize

NORM_FRACTION_BITS = 16
GAMMA_BITS = 16
MAX_SQRT_BITS = 16
INT64_BUDGET_BITS = 61
BETA_LIMIT = 1 << 44


@dataclass
class RowStatistics:
    count: int  # D
    g: int  # the square root's extra bits G
    s1: np.ndarray  # S1 = sum x_c per row (int64, normalized axes kept)
    root: np.ndarray  # r = isqrt(den * 4^G) per row (int64, >= 1)


@dataclass
class TrainingOutputs:
    """LayerNormalization's optional Mean and InvStdDev outputs in integers (module docstring); their (M, N)
    depend on D, known with the input's shape, and are derived once per D."""

    x_qp: QParams
    mean_qp: Optional[QParams]
    inv_qp: Optional[QParams]
    mbits: int
    _per_count: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)

    def _mean_multiplier(self, count: int) -> tuple[int, int]:
        if count not in self._per_count:
            m, n = multiplier(float(self.x_qp.scale[0]) / (count * float(self.mean_qp.scale[0])), self.mbits,
                              "s_x / (D * s_mean)")
            self._per_count[count] = (int(m[0]), int(n[0]))
        return self._per_count[count]

    def mean(self, stats: RowStatistics) -> np.ndarray:
        qp = self.mean_qp
        m, n = self._mean_multiplier(stats.count)
        return requantize(stats.s1, m, n, qp.zero_point[0], qp.qmin, qp.qmax, dtype=qp.dtype)

    def inv_std_dev(self, stats: RowStatistics, m: int, n: int) -> np.ndarray:
        qp = self.inv_qp
        inv_c = divide_rounded(np.full(stats.root.shape, (stats.count * m) << stats.g, dtype=np.int64),
                               stats.root << n)
        return np.clip(inv_c + int(qp.zero_point[0]), qp.qmin, qp.qmax).astype(qp.dtype)


@dataclass
class NormKernel:
    """The integer normalization of the module docstring; per-D constants (eps_q, G) are cached."""

    x_qp: QParams
    eps: float
    gamma: np.ndarray  # int64 gamma codes, shaped to broadcast against the rows (see `params`)
    beta: np.ndarray  # int64 beta at scale s_g / 2^F
    stage: OutputStage
    fraction_bits: int = NORM_FRACTION_BITS
    centred: bool = True  # False: RMSNormalization (no mean subtracted)
    _per_count: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)

    def constants(self, count: int) -> tuple[int, int]:
        """(eps_q, G) for rows of `count` elements."""
        if count not in self._per_count:
            if count <= 0:
                raise ValueError("normalization over an empty axis")
            eps_q = int(np.rint(self.eps * count * count / float(self.x_qp.scale[0]) ** 2))
            dev, _ = code_deviation(self.x_qp)
            den_bits = int((count * count * dev * dev + eps_q).bit_length())
            num_bits = int((count * dev).bit_length())
            g = min(MAX_SQRT_BITS, (INT64_BUDGET_BITS - den_bits) // 2,
                    INT64_BUDGET_BITS - self.fraction_bits - num_bits)
            if g < 0:
                raise ValueError(f"rows of {count} elements overflow the int64 normalization")
            self._per_count[count] = (eps_q, g)
        return self._per_count[count]

    def statistics(self, xc: np.ndarray, axes: tuple[int, ...]) -> RowStatistics:
        """S1 and r = isqrt(den * 4^G) per row of int64 x_c over `axes` (kept as size-1 axes)."""
        count = int(np.prod([xc.shape[a] for a in axes], dtype=np.int64))
        eps_q, g = self.constants(count)
        s1 = xc.sum(axis=axes, keepdims=True) if self.centred else np.zeros((1,) * xc.ndim, dtype=np.int64)
        s2 = (xc * xc).sum(axis=axes, keepdims=True)
        den = count * s2 - s1 * s1 + eps_q
        root = np.maximum(isqrt(den << (2 * g)), 1)  # den = 0 only for a constant row without eps: num = 0
        return RowStatistics(count, g, s1, root)

    def normalized(self, xc: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        """n_F = round(n * 2^F) of int64 x_c, normalized over `axes` (same shape as x_c)."""
        return self.normalized_by(xc, self.statistics(xc, axes))

    def normalized_by(self, xc: np.ndarray, stats: RowStatistics) -> np.ndarray:
        return divide_rounded((stats.count * xc - stats.s1) << (self.fraction_bits + stats.g), stats.root)

    def apply(self, xc: np.ndarray, axes: tuple[int, ...], gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
        return self.stage.apply(self.normalized(xc, axes) * gamma + beta)


def quantize_affine(x_qp: QParams, y_qp: QParams, gamma_f: np.ndarray, beta_f: Optional[np.ndarray],
                    eps: float, mbits: int, centred: bool = True) -> NormKernel:
    """gamma, beta (float constants of one broadcast shape) -> codes and the output stage (module docstring)."""
    gamma_f = np.asarray(gamma_f, dtype=np.float64)
    beta_f = np.zeros_like(gamma_f) if beta_f is None else np.asarray(beta_f, dtype=np.float64)
    if not (np.all(np.isfinite(gamma_f)) and np.all(np.isfinite(beta_f))):
        raise QuantizationError("scale or bias holds inf or NaN")
    if eps < 0:
        raise QuantizationError(f"epsilon must be >= 0, got {eps}")
    gmax = float(np.abs(gamma_f).max(initial=0.0))
    s_g = gmax / ((1 << (GAMMA_BITS - 1)) - 1) if gmax > 0 else 1.0
    f = NORM_FRACTION_BITS
    g_q = np.rint(gamma_f / s_g).astype(np.int64)
    b_real = beta_f * 2.0 ** f / s_g
    if np.any(np.abs(b_real) >= BETA_LIMIT):
        raise QuantizationError("bias too large for the scale (|B| / max|scale| >= 2^13)")
    b_q = np.rint(b_real).astype(np.int64)
    stage = output_stage(s_g / 2.0 ** f, y_qp, mbits, None)
    return NormKernel(x_qp, float(eps), g_q, b_q, stage, centred=centred)


@dataclass
class QuantizedNorm(QuantizedNode):
    kernel: NormKernel
    training: Optional[TrainingOutputs] = None  # LayerNormalization's Mean / InvStdDev outputs, when present
    inv_m: int = 0  # InvStdDev: M / 2^N ~= 1 / (s_x * s_inv)
    inv_n: int = 0


def _constant(ctx: QuantizeContext, index: int, what: str) -> Optional[np.ndarray]:
    if index >= len(ctx.node.inputs) or not ctx.node.inputs[index]:
        return None
    if index not in ctx.constants:
        raise QuantizationError(f"{what} (input {index}) must be a constant")
    return np.asarray(ctx.constants[index], dtype=np.float64)


def _output_qparams(ctx: QuantizeContext) -> QParams:
    qp = require_qparams(ctx.out_qparams[0] if ctx.out_qparams else None, "output")
    require_per_tensor(qp, "output")
    return qp


def layer_norm_axes(node, rank: int) -> tuple[int, ...]:
    axis = normalize_axes([int(node.attr("axis", -1))], rank)[0]
    return tuple(range(axis, rank))


def _float_normalize(x: np.ndarray, axes, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


@register
class LayerNormalization(OpDef):
    """ONNX LayerNormalization (opset 17) in integers. Formula and LSB bound: module docstring."""

    op_type = "LayerNormalization"
    lsb_bound = 0.6  # 8-bit rows of a few dozen values: the n_max terms stay under 0.1
    section = "4.5 / 4.46 (integer mean and variance; no chapter 4 entry of its own)"
    int_types = "int8/uint8/int16 -> int64 statistics, int16 scale -> int8/uint8/int16"
    granularity = "per-tensor activations; per-element scale and bias (16-bit codes)"
    conformance = Case(inputs=(X, "g", "b"), attrs={"axis": -1},
                       constants={"g": uniform_constant("lng", (5,), 0.5, 1.5), "b": uniform_constant("lnb", (5,))})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        axes = layer_norm_axes(node, x.ndim)
        eps = float(node.attr("epsilon", 1e-5))
        n = _float_normalize(x, axes, eps)
        y = n * np.asarray(inputs[1], dtype=np.float64)
        if len(inputs) > 2 and inputs[2] is not None:
            y = y + np.asarray(inputs[2], dtype=np.float64)
        x64 = x.astype(np.float64)
        mean = x64.mean(axis=axes, keepdims=True)
        inv = 1.0 / np.sqrt(((x64 - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
        return [y.astype(np.float32), mean.astype(np.float32), inv.astype(np.float32)][:len(node.outputs)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNorm:
        x_qp, y_qp = activation_qparams(ctx), _output_qparams(ctx)
        gamma = _constant(ctx, 1, "Scale")
        if gamma is None:
            raise QuantizationError("Scale (input 1) is required")
        kernel = quantize_affine(x_qp, y_qp, gamma, _constant(ctx, 2, "B"), float(ctx.node.attr("epsilon", 1e-5)),
                                 ctx.options.mbits)
        outputs = ctx.node.outputs
        stat_qp = [_training_qparams(ctx, i) if i < len(outputs) and outputs[i] else None for i in (1, 2)]
        if not any(stat_qp):
            return QuantizedNorm(ctx.node, list(ctx.in_qparams), [y_qp] + [None] * (len(outputs) - 1), kernel)
        training = TrainingOutputs(x_qp, stat_qp[0], stat_qp[1], ctx.options.mbits)
        inv_m = inv_n = 0
        if stat_qp[1] is not None:
            m, n = multiplier(1.0 / (float(x_qp.scale[0]) * float(stat_qp[1].scale[0])), ctx.options.mbits,
                              "1 / (s_x * s_inv)")
            inv_m, inv_n = int(m[0]), int(n[0])
        return QuantizedNorm(ctx.node, list(ctx.in_qparams), [y_qp] + stat_qp[:len(outputs) - 1], kernel, training,
                             inv_m, inv_n)

    def forward_int(self, q: QuantizedNorm, inputs, runtime: IntRuntime):
        xc = centered(inputs[0], q.in_qparams[0])
        k = q.kernel
        axes = layer_norm_axes(q.node, xc.ndim)
        if q.training is None:
            return [k.apply(xc, axes, k.gamma, k.beta)]
        stats = k.statistics(xc, axes)
        y = k.stage.apply(k.normalized_by(xc, stats) * k.gamma + k.beta)
        mean = q.training.mean(stats) if q.training.mean_qp is not None else None
        inv = q.training.inv_std_dev(stats, q.inv_m, q.inv_n) if q.training.inv_qp is not None else None
        return [y, mean, inv][:len(q.node.outputs)]


def _training_qparams(ctx: QuantizeContext, index: int) -> QParams:
    what = ("Mean", "InvStdDev")[index - 1]
    qp = require_qparams(ctx.out_qparams[index] if index < len(ctx.out_qparams) else None, f"output {index} ({what})")
    require_per_tensor(qp, f"output {index} ({what})")
    return qp


@register
class RMSNormalization(OpDef):
    """ONNX RMSNormalization (opset 23): x / sqrt(mean(x^2) + eps) * scale over axis.. in integers, the
    LayerNormalization kernel without the mean. Formula and LSB bound: module docstring."""

    op_type = "RMSNormalization"
    lsb_bound = 0.6
    section = "4.5 / 4.46 (integer mean of squares; no chapter 4 entry of its own)"
    int_types = "int8/uint8/int16 -> int64 statistics, int16 scale -> int8/uint8/int16"
    granularity = "per-tensor activations; per-element scale (16-bit codes)"
    conformance = Case(inputs=(X, "g"), constants={"g": uniform_constant("rmsg", (5,), 0.5, 1.5)}, attrs={"axis": -1},
                       opset=23, path="direct",
                       note="opset 23, past what ptq loads: the rewrites fuse a written-out RMSNorm")

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float64)
        axes = layer_norm_axes(node, x.ndim)
        n = x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + float(node.attr("epsilon", 1e-5)))
        return [(n * np.asarray(inputs[1], dtype=np.float64)).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNorm:
        x_qp, y_qp = activation_qparams(ctx), _output_qparams(ctx)
        gamma = _constant(ctx, 1, "scale")
        if gamma is None:
            raise QuantizationError("scale (input 1) is required")
        kernel = quantize_affine(x_qp, y_qp, gamma, None, float(ctx.node.attr("epsilon", 1e-5)), ctx.options.mbits,
                                 centred=False)
        return QuantizedNorm(ctx.node, list(ctx.in_qparams), [y_qp], kernel)

    def forward_int(self, q: QuantizedNorm, inputs, runtime: IntRuntime):
        xc = centered(inputs[0], q.in_qparams[0])
        k = q.kernel
        return [k.apply(xc, layer_norm_axes(q.node, xc.ndim), k.gamma, k.beta)]


def _per_channel(values: np.ndarray, rank: int) -> np.ndarray:
    return values.reshape((1, -1) + (1,) * (rank - 2))


@register
class InstanceNormalization(OpDef):
    """ONNX InstanceNormalization in integers (axes 2.. per (n, c), per-channel scale and B). Module docstring."""

    op_type = "InstanceNormalization"
    lsb_bound = 0.6  # 8-bit rows of a few dozen values: the n_max terms stay under 0.1
    section = "4.5 / 4.46 (integer mean and variance; no chapter 4 entry of its own)"
    int_types = "int8/uint8/int16 -> int64 statistics, int16 scale -> int8/uint8/int16"
    granularity = "per-tensor activations; per-channel scale and bias (16-bit codes)"
    conformance = Case(inputs=(X, "g", "b"),
                       constants={"g": uniform_constant("ing", (3,), 0.5, 1.5), "b": uniform_constant("inb", (3,))})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        if x.ndim < 3:
            raise ValueError(f"input must be at least 3-D (N, C, D1, ...), got shape {x.shape}")
        n = _float_normalize(x, tuple(range(2, x.ndim)), float(node.attr("epsilon", 1e-5)))
        gamma, beta = (_per_channel(np.asarray(v, dtype=np.float64), x.ndim) for v in inputs[1:3])
        return [(n * gamma + beta).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNorm:
        x_qp, y_qp = activation_qparams(ctx), _output_qparams(ctx)
        gamma, beta = _constant(ctx, 1, "scale"), _constant(ctx, 2, "B")
        if gamma is None or beta is None:
            raise QuantizationError("scale (input 1) and B (input 2) are required")
        if gamma.ndim != 1 or beta.shape != gamma.shape:
            raise QuantizationError(f"scale and B must be 1-D of one length, got {gamma.shape} and {beta.shape}")
        kernel = quantize_affine(x_qp, y_qp, gamma, beta, float(ctx.node.attr("epsilon", 1e-5)), ctx.options.mbits)
        return QuantizedNorm(ctx.node, list(ctx.in_qparams), [y_qp], kernel)

    def forward_int(self, q: QuantizedNorm, inputs, runtime: IntRuntime):
        xc = centered(inputs[0], q.in_qparams[0])
        if xc.ndim < 3:
            raise ValueError(f"input must be at least 3-D (N, C, D1, ...), got shape {xc.shape}")
        k = q.kernel
        if k.gamma.size != xc.shape[1]:
            raise ValueError(f"{k.gamma.size} scales for {xc.shape[1]} channels")
        return [k.apply(xc, tuple(range(2, xc.ndim)), _per_channel(k.gamma, xc.ndim), _per_channel(k.beta, xc.ndim))]
