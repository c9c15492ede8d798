"""Quantization pieces shared by the linear ops (Conv, ConvTranspose, Gemm, MatMul, BatchNormalization).

Whitepaper 4.14 in the ONNX convention, per output channel c:

    acc[c] = sum (x_q - zp_x) * (w_q[c] - zp_w[c]) + b_q[c]          b_q = round_half_even(b_f / fl32(s_x * s_w[c]))
    y_q[c] = clamp(((acc[c] * M[c] + 2^(N[c]-1)) >> N[c]) + zp_y, lo, hi)     M[c] / 2^N[c] ~= s_x * s_w[c] / s_y

When r = s_x * s_w[c] / s_y is below min(2^(mbits-32), 2^-17) (e.g. 16-bit x 16-bit operands), N <= 31 would
leave M only a few bits; the accumulator is then first rounded by P bits, acc' = (acc + 2^(P-1)) >> P, with
M / 2^N ~= 2^P * r at full width (both steps through `ptq.core.requant`; the pre-rounding costs < 2^-17 LSB).

A fused Clip/Relu only narrows [lo, hi] to the quantized clip bounds (4.14); a fused LeakyRelu uses a second
multiplier M'/2^N' ~= alpha * s_x * s_w[c] / s_y for negative accumulators (one rounding, instead of the
whitepaper's two-step `alpha_q / 2^N_alpha` on the requantized value).

Accumulator width: 32 bits when activation and weight are both at most 8 bits (the hardware default,
`QuantizeOptions.accumulator_bits`). Chapter 4 of the whitepaper only ever names a 32-bit accumulator (4.66,
Softmax: 2^20 * 4096 terms) and says nothing of wider ones, while a 16-bit activation times an 8-bit weight
reaches 2^23 per product and overflows 32 bits after ~256 terms (one 3x3x32 window). We therefore give any
operand wider than 8 bits a 48-bit accumulator, the width of the DSP48E2 P register that the planned
packed-DSP backend emulates; overflow of whichever width applies is saturated and reported via `record_overflow`.
"""
from __future__ import annotations

# imports inside functions: `ops.compiled`'s numba kernels, imported by the first run that takes the compiled path
# (numba's import costs about half a second; `ops.compiled.enabled` decides)

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops import compiled
from ops.base import multiplier
from ops.registry import QuantizationError, QuantizeOptions, absorbable_ops, is_absorbable
from ptq.core.qparams import QParams
from ptq.core.requant import (
    MAX_SHIFT,
    quantize_multiplier,
    requantize,
    saturate_int32,
    shift_round,
)

WIDE_ACCUMULATOR_BITS = 48
PRE_SHIFT_LIMIT = 2.0 ** -17  # a pre-rounded accumulator's factor stays below 2 * this: error < 2^-17 LSB


def accumulator_bits(operand_bits: tuple[int, ...], options: QuantizeOptions) -> int:
    """The accumulator width for a dot product of operands of the given bit widths (see module docstring)."""
    if max(operand_bits) <= 8:
        return options.accumulator_bits
    return max(options.accumulator_bits, WIDE_ACCUMULATOR_BITS)


def saturate(acc: np.ndarray, bits: int) -> tuple[np.ndarray, int]:
    """Clamp an int64 accumulator to a signed `bits`-wide register; returns (acc, overflow count)."""
    if bits == 32:
        return saturate_int32(acc)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    acc = np.asarray(acc, dtype=np.int64)
    count = int(np.count_nonzero((acc < lo) | (acc > hi)))
    return (np.clip(acc, lo, hi) if count else acc), count


@dataclass(frozen=True)
class AccumulatorPlan:
    """The accumulator register of a dot-product op and what static bounds prove about it.

    `safe`: the true accumulator can never overflow `bits` (bound = terms * max|x - zp_x| * max|w| + max|b|),
    and the raw dot product and its offset each stay below 2^(62 - mbits) (so each times M < 2^mbits, and
    their sum, fit int64), so the overflow check is skipped (it would count 0) and the offset is folded into
    the requant constant.
    """

    bits: int
    safe: bool


def plan_accumulator(bits: int, true_bound: int, fold_bound: int, mbits: int) -> AccumulatorPlan:
    """`fold_bound` bounds both |raw dot product| and |offset| (see `AccumulatorPlan`)."""
    return AccumulatorPlan(bits, true_bound < (1 << (bits - 1)) and fold_bound < (1 << (62 - mbits)))


def code_deviation(qp: QParams) -> tuple[int, int]:
    """(max |x_q - zp|, max |x_q|) over every code of a per-tensor QParams."""
    zp = int(qp.zero_point[0])
    return max(qp.qmax - zp, zp - qp.qmin), max(abs(qp.qmin), abs(qp.qmax))


def finish_accumulator(acc: np.ndarray, offset, plan: AccumulatorPlan, stage: "OutputStage", node,
                       runtime) -> np.ndarray:
    """Output codes of the accumulator `acc + offset` (`acc` of any integer dtype): saturated to `plan.bits`
    with overflows recorded, unless the plan proves no overflow can occur (the offset then folds into the
    requant constant)."""
    if compiled.enabled(runtime):
        from ops.compiled.requant import finish

        done = finish(acc, offset, stage, None if plan.safe else plan.bits)
        if done is not None:
            runtime.record_overflow(node, done[1])
            return done[0]
    if plan.safe:
        return stage.apply(acc, offset=offset)
    if offset is not None:
        acc = np.add(acc, offset, dtype=np.int64)
    acc, overflow = saturate(acc, plan.bits)
    runtime.record_overflow(node, overflow)
    return stage.apply(acc)


def per_channel(arr: np.ndarray, axis: Optional[int], ndim: int) -> np.ndarray:
    """A length-1 or length-C array shaped to broadcast along `axis` of a rank-`ndim` tensor."""
    arr = np.asarray(arr)
    if arr.size == 1 or axis is None:
        return arr.reshape(()) if arr.size == 1 else arr
    shape = [1] * ndim
    shape[axis % ndim] = arr.size
    return arr.reshape(shape)


def quantize_weight(w_f: np.ndarray, qp: QParams, channel_axis: Optional[int], node) -> tuple[np.ndarray, np.ndarray]:
    """(codes in qp.dtype, centered int32 codes w_q - zp_w) of a float weight."""
    if qp.per_channel:
        if channel_axis is None or qp.axis % w_f.ndim != channel_axis % w_f.ndim:
            raise QuantizationError(
                f"weight qparams are per-channel along axis {qp.axis}, "
                f"expected axis {channel_axis} of the weight {w_f.shape}"
            )
        if qp.scale.size != w_f.shape[channel_axis]:
            raise QuantizationError(
                f"{qp.scale.size} weight scales for {w_f.shape[channel_axis]} channels"
            )
    codes = qp.quantize(w_f)
    centered = codes.astype(np.int32) - qp.broadcast(qp.zero_point, codes.ndim).astype(np.int32)
    return codes, centered


def _signed_multiplier(r: np.ndarray, mbits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(M, N, sign) with sign * M / 2^N ~= r for real r of any sign (M = 0 where r = 0)."""
    r = np.asarray(r, dtype=np.float64)
    sign = np.sign(r).astype(np.int64)
    m = np.zeros(r.shape, dtype=np.int64)
    n = np.zeros(r.shape, dtype=np.int64)
    nz = r != 0
    if np.any(nz):
        m[nz], n[nz] = quantize_multiplier(np.abs(r[nz]), mbits)
    return m, n, sign


@dataclass
class OutputStage:
    """acc (int64, real value acc * s_acc[c]) -> output codes: per-channel M/2^N, zero point, clamp [lo, hi].

    With `neg_m` set (fused LeakyRelu / PRelu), negative accumulators use neg_sign * neg_m / 2^neg_n instead.
    With `pre_shift` set (factors too small for a full-width M with N <= 31, e.g. 16-bit x 16-bit operands),
    the accumulator is first rounded by P bits through the same helper, acc' = (acc + 2^(P-1)) >> P, and
    M / 2^N ~= r * 2^P keeps min(mbits, 15) bits or more (the pre-rounding costs under 2^-17 LSB).
    """

    m: np.ndarray  # length 1 or C
    n: np.ndarray
    zp: int
    lo: int
    hi: int
    axis: Optional[int]  # channel axis of the accumulator the per-channel arrays lie along
    dtype: np.dtype
    neg_m: Optional[np.ndarray] = None
    neg_n: Optional[np.ndarray] = None
    neg_sign: Optional[np.ndarray] = None
    pre_shift: Optional[np.ndarray] = None  # P per channel (None: no pre-rounding anywhere)

    def apply(self, acc: np.ndarray, offset=None) -> np.ndarray:
        """Output codes of the integer accumulator `acc + offset` (`acc` is not modified)."""
        if self.pre_shift is not None:
            acc = np.add(acc, 0 if offset is None else offset, dtype=np.int64)
            acc = shift_round(acc, 1, per_channel(self.pre_shift, self.axis, acc.ndim))
            offset = None
        if self.neg_m is None:
            axis = self.axis if self.m.size > 1 else None
            return requantize(acc, self.m, self.n, self.zp, self.lo, self.hi, axis=axis, dtype=self.dtype,
                              offset=offset)
        if offset is not None:
            acc = acc + offset
        nd = acc.ndim
        pos = acc >= 0
        m = np.where(pos, per_channel(self.m, self.axis, nd), per_channel(self.neg_m, self.axis, nd))
        n = np.where(pos, per_channel(self.n, self.axis, nd), per_channel(self.neg_n, self.axis, nd))
        signed_acc = np.where(pos, acc, acc * per_channel(self.neg_sign, self.axis, nd))
        return requantize(signed_acc, m, n, self.zp, self.lo, self.hi, dtype=self.dtype)


def activation_bounds(out_qp: QParams, activation: Optional[str], params) -> tuple[int, int]:
    """[lo, hi] output codes after a fused Relu / Clip (the quantized clip bounds, 4.14)."""
    lo, hi = out_qp.qmin, out_qp.qmax
    zp = int(out_qp.zero_point[0])
    if activation == "Relu":
        lo = max(lo, zp)
    elif activation == "Clip":
        if params is None or len(params) != 2:
            raise QuantizationError(f"fused Clip needs activation_params [min, max], got {params}")
        cmin, cmax = (int(v) for v in out_qp.quantize(np.asarray(params, dtype=np.float64)))
        lo, hi = max(lo, cmin), min(hi, cmax)
    return lo, hi


def output_stage(
    acc_scale: np.ndarray,
    out_qp: QParams,
    mbits: int,
    axis: Optional[int],
    activation: Optional[str] = None,
    params=None,
    neg_slope: Optional[np.ndarray] = None,
) -> OutputStage:
    """The requant + activation stage for accumulators of real scale `acc_scale` (length 1 or C).

    `neg_slope` (length 1 or C) gives the slope of negative values (LeakyRelu alpha, PRelu slopes).
    """
    if out_qp.per_channel:
        raise QuantizationError(f"output qparams must be per tensor, got axis={out_qp.axis}")
    if activation is not None and not is_absorbable(activation):
        raise QuantizationError(f"unsupported fused activation {activation!r}; expected one of {absorbable_ops()}")
    r = np.atleast_1d(np.asarray(acc_scale, dtype=np.float64)) / float(out_qp.scale[0])
    # Below 2^(mbits-1-31), N <= 31 leaves M short of mbits bits. Pre-rounding by P bits costs up to
    # 0.5 * r * 2^P LSB, so it lifts r only to PRE_SHIFT_LIMIT (<= 2^-17): wide multipliers (mbits > 15)
    # keep at least 15 bits without it.
    threshold = min(2.0 ** (mbits - 1 - MAX_SHIFT), PRE_SHIFT_LIMIT)
    pre_shift = np.where(r < threshold, np.ceil(np.log2(threshold / r)), 0).astype(np.int64)
    r = r * np.exp2(pre_shift)
    m, n = multiplier(r, mbits, "requant factor s_acc / s_y")
    lo, hi = activation_bounds(out_qp, activation, params)
    stage = OutputStage(m, n, int(out_qp.zero_point[0]), lo, hi, axis, out_qp.dtype,
                        pre_shift=pre_shift if np.any(pre_shift) else None)
    if activation == "LeakyRelu":
        if params is None or len(params) != 1:
            raise QuantizationError(f"fused LeakyRelu needs activation_params [alpha], got {params}")
        neg_slope = np.asarray(params, dtype=np.float64)
    if neg_slope is not None:
        neg = r * np.asarray(neg_slope, dtype=np.float64)  # PRelu keeps its slope's broadcast shape (r has 2^P)
        stage.neg_m, stage.neg_n, stage.neg_sign = _signed_multiplier(neg, mbits)
    return stage


def fused_activation(node) -> tuple[Optional[str], Optional[list]]:
    """The (activation, activation_params) a fusion rewrite put on a Conv/Gemm node (FusedConv convention)."""
    activation = node.attr("activation")
    if activation in (None, ""):
        return None, None
    params = node.attr("activation_params")
    return activation, (list(params) if params is not None else None)


def apply_float_activation(y: np.ndarray, activation: Optional[str], params) -> np.ndarray:
    """The float fused activation (Relu, Clip [min, max], LeakyRelu [alpha])."""
    if activation is None:
        return y
    if activation == "Relu":
        return np.maximum(y, 0).astype(y.dtype)
    if activation == "Clip":
        return np.clip(y, params[0], params[1]).astype(y.dtype)
    if activation == "LeakyRelu":
        return np.where(y >= 0, y, y * np.float32(params[0])).astype(y.dtype)
    raise ValueError(f"unsupported fused activation {activation!r}")
