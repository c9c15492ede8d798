"""Resize (whitepaper 4.58): nearest and (n-)linear, ONNX convention.

Geometry (which input elements feed an output element, and with which fraction) follows the ONNX spec as
onnxruntime computes it, in float32: output size int(scale * in) or `sizes` (keep_aspect_ratio_policy
stretch / not_larger / not_smaller), source coordinate per coordinate_transformation_mode (half_pixel,
half_pixel_symmetric, pytorch_half_pixel, align_corners, asymmetric, tf_crop_and_resize with roi and
extrapolation_value), an axis whose scale is exactly 1 mapped to itself. Geometry is data-independent: it is
derived once per input shape and cached; the integer forward only gathers and multiply-adds integers.

nearest (nearest_mode round_prefer_floor / round_prefer_ceil / floor / ceil): s_y = s_x, zp_y = zp_x (the
rule overrides the table's proposal) and

    y_q = x_q[nearest source index]           exact (LSB bound 0)

linear: per resized axis a source coordinate c, clamped to [0, n-1], i0 = floor(c), i1 = min(i0 + 1, n-1),
and an integer weight w1 = round((c - i0) * 2^k), w0 = 2^k - w1 (whitepaper 4.58: weights scaled by 2^k).
Axis by axis, exactly in int64 (no rounding in between):

    acc = w0 * acc[i0] + w1 * acc[i1]         starting from acc = x_q - zp_x
    y_q = clamp(((acc * M + 2^(N+kA-1)) >> (N + kA)) + zp_y, qmin, qmax),   M / 2^N ~= s_x / s_y

with A resized axes. Output qparams: the table's proposal, else the input's (then M / 2^N = 1 exactly).
k = min(16, (61 - mbits - input bits) // A) keeps |acc * M| < 2^61.
LSB bound vs the float op on the dequantized input:
    0.5 + |y_f| / s_y * 2^-mbits + A * 2^-(k+1) * (max x_q - min x_q) * s_x / s_y
(rounding, multiplier error, weight rounding: each axis moves a result by at most 2^-(k+1) times the spread
of the values it blends).

tf_crop_and_resize: an output whose source coordinate falls outside [0, n-1] on any axis takes
extrapolation_value quantized with the output qparams (0.5 LSB). cubic mode and antialias are not supported
(QuantizationError: the node can run in float).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ops.base import activation_qparams, multiplier, optional_input, proposed_or
from ops.conformance_case import X, Case
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node
from ptq.core.requant import requantize

MAX_WEIGHT_BITS = 16
INT64_HEADROOM_BITS = 61
COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                    "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
F32 = np.float32


def weight_bits(resized_axes: int, data_bits: int, mbits: int) -> int:
    """Fraction bits k of the linear weights: 2^(data_bits + k * axes + mbits) stays below 2^61."""
    if resized_axes == 0:
        return 0
    k = min(MAX_WEIGHT_BITS, (INT64_HEADROOM_BITS - mbits - data_bits) // resized_axes)
    if k < 1:
        raise QuantizationError(f"Resize: {resized_axes} interpolated axes leave no bits for the weights")
    return k


def _text(node: Node, name: str, default: str) -> str:
    value = node.attr(name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class ResizeAttrs:
    mode: str
    coordinate_mode: str
    nearest_mode: str
    extrapolation_value: float
    policy: str
    axes: Optional[tuple[int, ...]]

    @classmethod
    def of(cls, node: Node) -> "ResizeAttrs":
        attrs = cls(
            mode=_text(node, "mode", "nearest"),
            coordinate_mode=_text(node, "coordinate_transformation_mode", "half_pixel"),
            nearest_mode=_text(node, "nearest_mode", "round_prefer_floor"),
            extrapolation_value=float(F32(node.attr("extrapolation_value", 0.0))),  # a float32 attribute
            policy=_text(node, "keep_aspect_ratio_policy", "stretch"),
            axes=None if node.attr("axes") is None else tuple(int(a) for a in node.attr("axes")),
        )
        if attrs.mode not in ("nearest", "linear"):
            raise QuantizationError(f"mode {attrs.mode!r} is not supported (nearest, linear)")
        if attrs.coordinate_mode not in COORDINATE_MODES:
            raise QuantizationError(f"coordinate_transformation_mode {attrs.coordinate_mode!r} "
                                    "is not supported")
        if attrs.nearest_mode not in NEAREST_MODES:
            raise QuantizationError(f"nearest_mode {attrs.nearest_mode!r} is not supported")
        if attrs.policy not in ("stretch", "not_larger", "not_smaller"):
            raise QuantizationError(f"keep_aspect_ratio_policy {attrs.policy!r} is not supported")
        if node.attr("antialias", 0):
            raise QuantizationError("antialias is not supported")
        return attrs


@dataclass(frozen=True)
class AxisMap:
    """How one resized axis is sampled: nearest uses `index0`; linear blends index0 / index1 with the
    integer weights (2^k - weight1, weight1) and, for the float forward, the exact fraction `frac`."""

    axis: int
    index0: np.ndarray
    index1: Optional[np.ndarray] = None
    weight1: Optional[np.ndarray] = None
    frac: Optional[np.ndarray] = None
    outside: Optional[np.ndarray] = None  # tf_crop_and_resize: source coordinate outside [0, n-1]


@dataclass(frozen=True)
class ResizePlan:
    out_shape: tuple[int, ...]
    maps: tuple[AxisMap, ...]
    weight_bits: int

    def outside_mask(self) -> Optional[np.ndarray]:
        """Boolean mask broadcastable to the output: positions that take the extrapolation value."""
        mask = None
        for m in self.maps:
            if m.outside is not None and m.outside.any():
                shape = [1] * len(self.out_shape)
                shape[m.axis] = -1
                part = m.outside.reshape(shape)
                mask = part if mask is None else (mask | part)
        return mask


def _present(value) -> Optional[np.ndarray]:
    if value is None:
        return None
    arr = np.asarray(value)
    return arr if arr.size else None


def _scales_and_sizes(node: Node, attrs: ResizeAttrs, in_shape: tuple[int, ...],
                      inputs) -> tuple[np.ndarray, list[int]]:
    """float32 scale and output size per axis (onnxruntime's ParseScalesData / ParseSizesData)."""
    rank = len(in_shape)
    axes = list(range(rank)) if attrs.axes is None else [a % rank for a in attrs.axes]
    scales_in, sizes_in = _present(optional_input(inputs, 2)), _present(optional_input(inputs, 3))
    scales = np.ones(rank, dtype=F32)
    sizes = list(in_shape)
    if scales_in is not None:
        if scales_in.size != len(axes):
            raise ValueError(f"{scales_in.size} scales for {len(axes)} axes")
        for a, s in zip(axes, scales_in.astype(F32).ravel()):
            scales[a] = s
        if np.any(scales <= 0):
            raise ValueError(f"scales must be positive, got {scales}")
        sizes = [int(F32(s) * F32(n)) for s, n in zip(scales, in_shape)]
    elif sizes_in is not None:
        if sizes_in.size != len(axes):
            raise ValueError(f"{sizes_in.size} sizes for {len(axes)} axes")
        for a, s in zip(axes, sizes_in.astype(np.int64).ravel()):
            sizes[a] = int(s)
        scales = np.array([F32(o) / F32(n) if n else F32(1) for o, n in zip(sizes, in_shape)], dtype=F32)
        if attrs.policy != "stretch":
            pick = np.min if attrs.policy == "not_larger" else np.max
            common = F32(pick(scales[axes]))
            for a in range(rank):
                scales[a] = common if a in axes else F32(1)
                # std::round: half away from zero
                sizes[a] = int(np.floor(F32(common) * F32(in_shape[a]) + 0.5)) if a in axes else in_shape[a]
    else:
        raise ValueError("neither scales nor sizes given")
    return scales, sizes


def source_coordinates(mode: str, out_len: int, in_len: int, scale, roi_start=0.0, roi_end=1.0) -> np.ndarray:
    """Source coordinate of each output index along one axis, in float32 as onnxruntime computes it."""
    x = np.arange(out_len, dtype=F32)
    scale, n_out, n_in = F32(scale), F32(out_len), F32(in_len)
    half = F32(0.5)
    if mode == "asymmetric":
        return x / scale
    if mode == "pytorch_half_pixel":
        return (x + half) / scale - half if out_len > 1 else np.zeros(out_len, dtype=F32)
    if mode == "align_corners":
        return x * (n_in - F32(1)) / (n_out - F32(1)) if out_len > 1 else np.zeros(out_len, dtype=F32)
    if mode == "tf_crop_and_resize":
        start, end = F32(roi_start), F32(roi_end)
        if out_len > 1:
            return start * (n_in - F32(1)) + (x * (end - start) * (n_in - F32(1))) / (n_out - F32(1))
        return np.full(out_len, 0.5 * (float(start) + float(end)) * float(n_in - F32(1)), dtype=F32)
    if mode == "half_pixel_symmetric":
        adjustment = n_out / (scale * n_in)
        offset = (n_in / F32(2)) * (F32(1) - adjustment)
        # onnxruntime evaluates this one in double and rounds the result to float
        return (float(offset) + (x.astype(np.float64) + 0.5) / float(scale) - 0.5).astype(F32)
    return (x + half) / scale - half  # half_pixel


# onnxruntime (1.31, measured) treats a coordinate within 1e-6 of a half-way point as a tie
TIE_TOLERANCE = F32(1e-6)


def nearest_index(c: np.ndarray, mode: str, in_len: int) -> np.ndarray:
    """onnxruntime's nearest pixel for float32 coordinates, clamped to [0, n-1]."""
    low = np.floor(c)
    if mode == "floor":
        idx = low
    elif mode == "ceil":
        idx = np.ceil(c)
    else:
        frac = c - low
        tie = np.abs(frac - F32(0.5)) < TIE_TOLERANCE
        up = tie if mode == "round_prefer_ceil" else np.zeros_like(tie)
        idx = low + np.where(tie, up, frac > F32(0.5))
    return np.clip(idx.astype(np.int64), 0, in_len - 1)


def resize_plan(node: Node, attrs: ResizeAttrs, in_shape: tuple[int, ...], inputs, data_bits: int,
                mbits: int) -> ResizePlan:
    """The sampling plan of a Resize node for one input shape (see the module docstring)."""
    rank = len(in_shape)
    scales, sizes = _scales_and_sizes(node, attrs, in_shape, inputs)
    roi = None  # only tf_crop_and_resize reads the roi input
    if attrs.coordinate_mode == "tf_crop_and_resize":
        roi = _present(optional_input(inputs, 1))
        if roi is None:
            raise ValueError("tf_crop_and_resize needs a roi input")
        roi = roi.astype(F32).ravel()
        if attrs.axes is not None:
            full = np.concatenate([np.zeros(rank, F32), np.ones(rank, F32)])
            for i, a in enumerate(attrs.axes):
                full[a % rank], full[rank + a % rank] = roi[i], roi[len(attrs.axes) + i]
            roi = full
        if roi.size != 2 * rank:
            raise ValueError(f"roi has {roi.size} values for rank {rank}")
    resized = [a for a in range(rank) if scales[a] != F32(1)]
    k = weight_bits(len(resized), data_bits, mbits) if attrs.mode == "linear" else 0
    maps = []
    for a in resized:
        n_in, n_out = in_shape[a], sizes[a]
        start, end = (roi[a], roi[rank + a]) if roi is not None else (0.0, 1.0)
        c = source_coordinates(attrs.coordinate_mode, n_out, n_in, scales[a], start, end)
        outside = (c < 0) | (c > F32(n_in - 1)) if attrs.coordinate_mode == "tf_crop_and_resize" else None
        if attrs.mode == "nearest":
            maps.append(AxisMap(a, nearest_index(c, attrs.nearest_mode, n_in), outside=outside))
            continue
        c = np.clip(c, F32(0), F32(n_in - 1))
        i0 = np.minimum(c.astype(np.int64), n_in - 1)
        i1 = np.minimum(i0 + 1, n_in - 1)
        frac = np.where(i0 == i1, 0.0, c.astype(np.float64) - i0)
        w1 = np.rint(frac * (1 << k)).astype(np.int64)
        maps.append(AxisMap(a, i0, i1, w1, frac, outside))
    return ResizePlan(tuple(sizes), tuple(maps), k)


@dataclass
class QuantizedResize(QuantizedNode):
    attrs: ResizeAttrs
    m: int  # M / 2^N ~= s_x / s_y (linear; nearest copies codes)
    n: int
    mbits: int
    extrapolation_code: int  # extrapolation_value in the output qparams
    plans: dict[tuple[int, ...], ResizePlan] = field(default_factory=dict, repr=False)  # by input shape

    def plan(self, shape: tuple[int, ...], inputs) -> ResizePlan:
        if shape not in self.plans:
            self.plans[shape] = resize_plan(self.node, self.attrs, shape, inputs, self.in_qparams[0].bits, self.mbits)
        return self.plans[shape]


def _with_extrapolation(y: np.ndarray, plan: ResizePlan, value) -> np.ndarray:
    mask = plan.outside_mask()
    return y if mask is None else np.where(mask, np.asarray(value, dtype=y.dtype), y)


@register
class Resize(OpDef):
    """ONNX Resize (opset >= 11 inputs X, roi, scales, sizes). Formulas and LSB bounds: module docstring."""

    op_type = "Resize"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.58"
    int_types = "int8/uint8/int16/uint16 -> int8/uint8/int16/uint16"
    conformance = Case(inputs=(X, "", "scales"), constants={"scales": np.array([1, 1, 2, 2], np.float32)},
                       attrs={"mode": "linear"})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        attrs = ResizeAttrs.of(node)
        plan = resize_plan(node, attrs, x.shape, inputs, 8, 15)
        y = x.astype(np.float64)
        for m in plan.maps:
            if attrs.mode == "nearest":
                y = np.take(y, m.index0, axis=m.axis)
            else:
                frac = m.frac.reshape([-1 if d == m.axis else 1 for d in range(y.ndim)])
                y = np.take(y, m.index0, axis=m.axis) * (1.0 - frac) + np.take(y, m.index1, axis=m.axis) * frac
        return [_with_extrapolation(y.astype(np.float32), plan, attrs.extrapolation_value)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedResize:
        node = ctx.node
        attrs = ResizeAttrs.of(node)
        if len(node.inputs) < 3:
            raise QuantizationError("the opset-10 form (X, scales) is not supported")
        for i in (1, 2, 3):
            if i < len(node.inputs) and node.inputs[i] and i not in ctx.constants:
                raise QuantizationError(f"input {i} (roi/scales/sizes) must be a constant")
        x_qp = activation_qparams(ctx)
        if attrs.mode == "nearest":
            y_qp, m, n = x_qp, 1, 0
        else:
            y_qp = proposed_or(ctx, x_qp)
            mm, nn = multiplier(float(x_qp.scale[0]) / float(y_qp.scale[0]), ctx.options.mbits, "s_x / s_y")
            m, n = int(mm[0]), int(nn[0])
        code = int(y_qp.quantize(np.array([attrs.extrapolation_value]))[0])
        return QuantizedResize(node, list(ctx.in_qparams), [y_qp], attrs, m, n, ctx.options.mbits, code)

    def forward_int(self, q: QuantizedResize, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        plan = q.plan(x.shape, inputs)
        y_qp = q.out_qparams[0]
        if q.attrs.mode == "nearest":
            for m in plan.maps:
                x = np.take(x, m.index0, axis=m.axis)
            return [_with_extrapolation(x, plan, q.extrapolation_code)]
        acc = x.astype(np.int64) - int(q.in_qparams[0].zero_point[0])
        one = np.int64(1) << plan.weight_bits
        for m in plan.maps:
            w1 = m.weight1.reshape([-1 if d == m.axis else 1 for d in range(acc.ndim)])
            acc = np.take(acc, m.index0, axis=m.axis) * (one - w1) + np.take(acc, m.index1, axis=m.axis) * w1
        shift = q.n + plan.weight_bits * len(plan.maps)
        y = requantize(acc, q.m, shift, y_qp.zero_point[0], y_qp.qmin, y_qp.qmax, dtype=y_qp.dtype)
        return [_with_extrapolation(y, plan, q.extrapolation_code)]
