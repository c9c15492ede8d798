"""ReduceSum, ReduceMax, ReduceMin, ReduceProd, ReduceL2 (whitepaper 4.53) and Moments (4.46, ai.ptq),
in the ONNX convention (x_c = x_q - zp_x; c = number of reduced elements; ReduceMean is `ops/reduce.py`).

Axes come from the second input when present (ReduceSum from opset 13, the others from opset 18) or the
`axes` attribute (older opsets), read at run time; no axes means all axes, or the identity with
noop_with_empty_axes=1; keepdims defaults to 1.

ReduceMax / ReduceMin (data movement): y_q = max / min of x_q, with the input's qparams. Exact.

ReduceSum:  y_q = clamp(((saturate_int32(sum x_c) * M + 2^(N-1)) >> N) + zp_y, qmin, qmax),  M/2^N ~= s_x/s_y
    LSB bound: 0.5 + |y_q - zp_y| * 2^-(mbits-1).

ReduceProd: a running product at the working scale t = s_y / 2^L (L chosen so every factor fits the
multiplier, at most `PROD_FRACTION_BITS`), requantized after each factor:
    p_1 = x_c[1] (scale s_x);  p_2 = rq(p_1 * x_c[2], s_x^2 / t);  p_k = rq(p_(k-1) * x_c[k], s_x)  (k >= 3)
    y_q = clamp(((p_c + 2^(L-1)) >> L) + zp_y, qmin, qmax)        (c = 1: y_q = rq(x_c, s_x / s_y) + zp_y)
with rq(a, r) = (a * M_r + 2^(N_r-1)) >> N_r; running products are saturated at +-2^(61 - mbits - bits_x).
    LSB bound (running products in range): 0.5 + |y_q - zp_y| * c * 2^-(mbits-1)
    + 2^-(L+1) * sum_k prod_(j>k) |x_j|   (each intermediate rounding, scaled by the later factors).

ReduceL2: acc = sum x_c^2 (int64);  z = clamp((acc * M + 2^(N-1)) >> N, 0, z_max),  M/2^N ~= (s_x/s_y)^2 4^F
    y_q = clamp(((isqrt(z) + 2^(F-1)) >> F) + zp_y, qmin, qmax)           (`ops.int_sqrt`, exact floor sqrt)
    LSB bound: 0.5 + 2^-F + |y_q - zp_y| * 2^-mbits.

Moments (ai.ptq; attributes axes (default all), keepdims (default 1), unbiased (default 0)); outputs the
mean and the variance (4.46's delta = mean(x^2) - mean(x)^2, in integers):
    mean_q = ReduceMean's integer mean (`ops.mean_requant.MeanRequant`)
    acc    = c * sum x_c^2 - (sum x_c)^2          ( = c^2 * var / s_x^2, exact in int64)
    var_q  = requant(acc, s_x^2 / (d * s_v)) + zp_v,   d = c^2 (biased) or c (c - 1) (unbiased)
    (an `ops.linear.OutputStage`: tiny factors are pre-rounded, as in the linear ops)
    LSB bound: 0.5 + |var_q - zp_v| * 2^-(mbits-1) + 2^-17 for the variance; the mean's is ReduceMean's.
Without a proposal, the variance gets s_v = s_x^2, zp_v = 0, unsigned (4.46's choice) at the input's bits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import numpy as np

from ops.base import activation_qparams, centered, multiplier, normalize_axes, require_per_tensor, require_qparams
from ops.conformance_case import X, Case, int64s
from ops.int_sqrt import isqrt
from ops.linear import OutputStage, output_stage
from ops.mean_requant import MeanRequant
from ops.reduce import reduce_axes
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.qparams import QParams, compute_qparams
from ptq.core.requant import requantize, saturate_int32

PROD_FRACTION_BITS = 16
L2_FRACTION_BITS = 8


def _keepdims(node) -> bool:
    return bool(node.attr("keepdims", 1))


def _float_reduce(node, inputs, fn):
    x = np.asarray(inputs[0], dtype=np.float32)
    axes = reduce_axes(node, inputs, x.ndim)
    if not axes:
        return [x]
    return [fn(x.astype(np.float64), axes, _keepdims(node)).astype(np.float32)]


def _output_qparams(ctx: QuantizeContext) -> QParams:
    qp = require_qparams(ctx.out_qparams[0] if ctx.out_qparams else None, "output")
    require_per_tensor(qp, "output")
    return qp


def _rows(x: np.ndarray, axes: tuple[int, ...], keep: bool) -> tuple[np.ndarray, tuple[int, ...]]:
    """x with the reduced axes moved last and flattened, (..., c); and the shape of the reduced result."""
    kept = [a for a in range(x.ndim) if a not in axes]
    moved = np.transpose(x, kept + list(axes))
    rows = moved.reshape(moved.shape[:len(kept)] + (-1,))
    if keep:
        out_shape = tuple(1 if a in axes else x.shape[a] for a in range(x.ndim))
    else:
        out_shape = tuple(x.shape[a] for a in kept)
    return rows, out_shape


class _DataMovementReduce(OpDef):
    int_types = "any -> same as input"
    keeps_input_qparams = True
    section = "4.53"

    def reduce(self, x, axes, keep):
        raise NotImplementedError

    def forward_float(self, node, inputs):
        return _float_reduce(node, inputs, self.reduce)

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        x_qp = activation_qparams(ctx)
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [x_qp])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        axes = reduce_axes(q.node, inputs, x.ndim)
        return [self.reduce(x, axes, _keepdims(q.node)) if axes else x]


@register
class ReduceMax(_DataMovementReduce):
    """ONNX ReduceMax: y_q = max of x_q over the axes, input qparams (module docstring)."""

    op_type = "ReduceMax"
    lsb_bound = 0.0
    conformance = Case(attrs={"axes": [1]})

    def reduce(self, x, axes, keep):
        return x.max(axis=axes, keepdims=keep)


@register
class ReduceMin(_DataMovementReduce):
    """ONNX ReduceMin: y_q = min of x_q over the axes, input qparams (module docstring)."""

    op_type = "ReduceMin"
    lsb_bound = 0.0
    conformance = Case(attrs={"axes": [3], "keepdims": 0})

    def reduce(self, x, axes, keep):
        return x.min(axis=axes, keepdims=keep)


@dataclass
class QuantizedScaledReduce(QuantizedNode):
    m: np.ndarray  # ReduceSum: s_x / s_y; ReduceL2: (s_x / s_y)^2 * 4^F
    n: np.ndarray
    fraction_bits: int = 0  # ReduceL2: F


@register
class ReduceSum(OpDef):
    """ONNX ReduceSum (axes as input from opset 13). Integer formula and LSB bound: module docstring."""

    op_type = "ReduceSum"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.53"
    int_types = "int8/uint8/int16 -> int32 acc -> int8/uint8/int16"
    conformance = Case(inputs=(X, "axes"), constants={"axes": int64s(1)}, opset=13)

    def forward_float(self, node, inputs):
        return _float_reduce(node, inputs, lambda x, axes, keep: x.sum(axis=axes, keepdims=keep))

    def quantize(self, ctx: QuantizeContext) -> QuantizedScaledReduce:
        x_qp, y_qp = activation_qparams(ctx), _output_qparams(ctx)
        m, n = multiplier(float(x_qp.scale[0]) / float(y_qp.scale[0]), ctx.options.mbits, "s_x / s_y")
        return QuantizedScaledReduce(ctx.node, list(ctx.in_qparams), [y_qp], m, n)

    def forward_int(self, q: QuantizedScaledReduce, inputs, runtime: IntRuntime):
        xc = centered(inputs[0], q.in_qparams[0])
        axes = reduce_axes(q.node, inputs, xc.ndim)
        acc = xc.sum(axis=axes, keepdims=_keepdims(q.node)) if axes else xc
        acc, overflow = saturate_int32(acc)
        runtime.record_overflow(q.node, overflow)
        y = q.out_qparams[0]
        return [requantize(acc, q.m, q.n, y.zero_point[0], y.qmin, y.qmax, dtype=y.dtype)]


@register
class ReduceL2(OpDef):
    """ONNX ReduceL2, sqrt(sum x^2), with an integer square root. Formula and LSB bound: module docstring."""

    op_type = "ReduceL2"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.53"
    int_types = "int8/uint8/int16 -> int64 acc -> int8/uint8/int16"
    conformance = Case(attrs={"axes": [3]})

    def forward_float(self, node, inputs):
        return _float_reduce(node, inputs, lambda x, axes, keep: np.sqrt((x * x).sum(axis=axes, keepdims=keep)))

    def quantize(self, ctx: QuantizeContext) -> QuantizedScaledReduce:
        x_qp, y_qp = activation_qparams(ctx), _output_qparams(ctx)
        ratio = (float(x_qp.scale[0]) / float(y_qp.scale[0])) ** 2
        limit = float(1 << (ctx.options.mbits - 1))
        frac = L2_FRACTION_BITS
        while frac > 0 and ratio * 4.0 ** frac >= limit:
            frac -= 1
        m, n = multiplier(ratio * 4.0 ** frac, ctx.options.mbits, "(s_x / s_y)^2 * 4^F")
        return QuantizedScaledReduce(ctx.node, list(ctx.in_qparams), [y_qp], m, n, frac)

    def forward_int(self, q: QuantizedScaledReduce, inputs, runtime: IntRuntime):
        xc = centered(inputs[0], q.in_qparams[0])
        axes = reduce_axes(q.node, inputs, xc.ndim)
        sq = xc * xc
        acc = sq.sum(axis=axes, keepdims=_keepdims(q.node)) if axes else sq
        y = q.out_qparams[0]
        f = q.fraction_bits
        z_max = ((y.qmax - int(y.zero_point[0]) + 1) << f) ** 2  # beyond it the output saturates anyway
        z = requantize(acc, q.m, q.n, 0, 0, z_max)
        root = isqrt(z)
        return [requantize(root, 1, f, y.zero_point[0], y.qmin, y.qmax, dtype=y.dtype)]


@dataclass
class QuantizedProd(QuantizedNode):
    first: tuple[int, int]  # (M, N) of s_x^2 / t  (second factor)
    step: tuple[int, int]  # (M, N) of s_x        (later factors)
    single: tuple[int, int]  # (M, N) of s_x / s_y  (c = 1)
    fraction_bits: int  # L
    limit: int  # running products saturate at +-limit


@register
class ReduceProd(OpDef):
    """ONNX ReduceProd with a requantized running product. Formula and LSB bound: module docstring."""

    op_type = "ReduceProd"
    lsb_bound = 0.55  # three factors: 0.5 + 3 * 2^8 * 2^-(mbits-1)
    section = "4.53"
    int_types = "int8/uint8/int16 -> int64 running product -> int8/uint8/int16"
    conformance = Case(attrs={"axes": [1]}, data="positive")

    def forward_float(self, node, inputs):
        return _float_reduce(node, inputs, lambda x, axes, keep: x.prod(axis=axes, keepdims=keep))

    def quantize(self, ctx: QuantizeContext) -> QuantizedProd:
        x_qp, y_qp = activation_qparams(ctx), _output_qparams(ctx)
        mbits = ctx.options.mbits
        s_x, s_y = float(x_qp.scale[0]), float(y_qp.scale[0])
        dev_bits = max(abs(x_qp.qmin - int(x_qp.zero_point[0])), abs(x_qp.qmax - int(x_qp.zero_point[0]))).bit_length()
        limit_bits = 61 - mbits - dev_bits
        frac = min(PROD_FRACTION_BITS, limit_bits - y_qp.bits - 2)
        while frac > 0 and s_x * s_x * 2.0 ** frac / s_y >= float(1 << (mbits - 1)):
            frac -= 1
        if frac < 0:
            raise QuantizationError(f"{x_qp.bits}-bit input leaves no room for the running product")
        pairs = [multiplier(r, mbits, what) for r, what in ((s_x * s_x * 2.0 ** frac / s_y, "s_x^2 * 2^L / s_y"),
                                                            (s_x, "s_x"), (s_x / s_y, "s_x / s_y"))]
        first, step, single = ((int(m[0]), int(n[0])) for m, n in pairs)
        return QuantizedProd(ctx.node, list(ctx.in_qparams), [y_qp], first, step, single, frac, 1 << limit_bits)

    def forward_int(self, q: QuantizedProd, inputs, runtime: IntRuntime):
        xc = centered(inputs[0], q.in_qparams[0])
        y = q.out_qparams[0]
        axes = reduce_axes(q.node, inputs, xc.ndim)
        if not axes:
            return [requantize(xc, q.single[0], q.single[1], y.zero_point[0], y.qmin, y.qmax, dtype=y.dtype)]
        rows, shape = _rows(xc, axes, _keepdims(q.node))
        count = rows.shape[-1]
        if count == 1:
            return [requantize(rows[..., 0].reshape(shape), q.single[0], q.single[1], y.zero_point[0], y.qmin, y.qmax,
                               dtype=y.dtype)]
        p = requantize(rows[..., 0] * rows[..., 1], q.first[0], q.first[1], 0, -q.limit, q.limit)
        for k in range(2, count):
            p = requantize(p * rows[..., k], q.step[0], q.step[1], 0, -q.limit, q.limit)
        return [requantize(p.reshape(shape), 1, q.fraction_bits, y.zero_point[0], y.qmin, y.qmax, dtype=y.dtype)]


def moments_axes(node, rank: int) -> tuple[int, ...]:
    axes = node.attr("axes")
    if axes is None:
        return tuple(range(rank))
    return tuple(normalize_axes([int(a) for a in np.atleast_1d(axes)], rank))


def variance_divisor(count: int, unbiased: bool) -> int:
    """d in var = acc / d with acc = c * sum x^2 - (sum x)^2."""
    if unbiased and count < 2:
        raise ValueError(f"unbiased variance over {count} element(s)")
    return count * (count - 1) if unbiased else count * count


@dataclass
class VarianceRequant:
    """acc = c * sum x_c^2 - (sum x_c)^2 -> variance codes, one `OutputStage` per element count (cached)."""

    x_qp: QParams
    v_qp: QParams
    mbits: int
    unbiased: bool
    _stages: dict[int, OutputStage] = field(default_factory=dict, repr=False)

    def stage(self, count: int) -> OutputStage:
        if count not in self._stages:
            d = variance_divisor(count, self.unbiased)
            self._stages[count] = output_stage(float(self.x_qp.scale[0]) ** 2 / d, self.v_qp, self.mbits, None)
        return self._stages[count]


def sums(xc: np.ndarray, axes: tuple[int, ...], keep: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """(sum x_c, sum x_c^2, c) over `axes` of the int64 array x_c."""
    count = int(np.prod([xc.shape[a] for a in axes], dtype=np.int64))
    return xc.sum(axis=axes, keepdims=keep), (xc * xc).sum(axis=axes, keepdims=keep), count


@dataclass
class QuantizedMoments(QuantizedNode):
    mean: MeanRequant
    variance: VarianceRequant


def _moments_reference(x):
    """The conformance case's numpy formula: mean and (biased) variance over axes 2, 3."""
    return [x.mean(axis=(2, 3), keepdims=True), x.var(axis=(2, 3), keepdims=True)]


@register
class Moments(OpDef):
    """ai.ptq Moments: mean and variance over `axes` (TensorFlow's tf.nn.moments). Module docstring."""

    op_type = "Moments"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    domain = "ai.ptq"
    section = "4.46"
    int_types = "int8/uint8/int16 -> int8/uint8/int16 mean, uint8/uint16 variance"
    conformance = Case(path="direct", reference=_moments_reference, outputs=2, attrs={"axes": [2, 3]})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float64)
        axes, keep = moments_axes(node, x.ndim), _keepdims(node)
        ddof = 1 if node.attr("unbiased", 0) else 0
        return [x.mean(axis=axes, keepdims=keep).astype(np.float32),
                x.var(axis=axes, keepdims=keep, ddof=ddof).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedMoments:
        x_qp = activation_qparams(ctx)
        proposals = list(ctx.out_qparams) + [None] * (2 - len(ctx.out_qparams))
        mean_qp = proposals[0] if proposals[0] is not None else x_qp
        var_qp: Optional[QParams] = proposals[1]
        if var_qp is None:
            s = float(x_qp.scale[0]) ** 2
            var_qp = compute_qparams(0.0, s * ((1 << x_qp.bits) - 1), x_qp.bits, symmetric=False, signed=False)
        require_per_tensor(mean_qp, "output 0 (mean)")
        require_per_tensor(var_qp, "output 1 (variance)")
        mbits = ctx.options.mbits
        unbiased = bool(ctx.node.attr("unbiased", 0))
        return QuantizedMoments(ctx.node, list(ctx.in_qparams), [mean_qp, var_qp], MeanRequant(x_qp, mean_qp, mbits),
                                VarianceRequant(x_qp, var_qp, mbits, unbiased))

    def forward_int(self, q: QuantizedMoments, inputs, runtime: IntRuntime):
        xc = centered(inputs[0], q.in_qparams[0])
        axes = moments_axes(q.node, xc.ndim)
        s1, s2, count = sums(xc, axes, _keepdims(q.node))
        mean = q.mean.apply(s1, count, partial(runtime.record_overflow, q.node))
        acc = count * s2 - s1 * s1
        return [mean, q.variance.stage(count).apply(acc)]
