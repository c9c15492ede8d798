"""MaxRoiPool (ONNX), whitepaper 4.45, ONNX convention.

Each ROI [batch, x1, y1, x2, y2] (input 1) becomes a box of feature-map pixels, start/end = round(coordinate *
spatial_scale), height = max(y2 - y1 + 1, 1) (width alike); output bin (ph, pw) of pooled_shape (PH, PW) covers
rows [y1 + floor(ph * height / PH), y1 + ceil((ph + 1) * height / PH)) clipped to the map (columns alike), and
holds the maximum of its elements, 0.0 for an empty bin. As for MaxPool (4.43), s_y = s_x and zp_y = zp_x:

    y_q[r, c, ph, pw] = max over the bin of x_q[batch_r, c],  or zp_x for an empty bin

The float spatial_scale becomes an integer multiplier (the whitepaper's M/2^N). ROIs given as codes
(r_c = r_q - zp_r, one scale s_r):

    batch = (r_c[0] * M_b + 2^(N_b-1)) >> N_b,            M_b / 2^N_b ~= s_r
    x1, y1, x2, y2 = (r_c[i] * M + 2^(N-1)) >> N,          M / 2^N ~= s_r * spatial_scale

A constant ROI tensor is turned into pixel boxes once, when the node is quantized, exactly as the float op
does (float32 product, round half away from zero). The bins are then integer divisions.

LSB bound vs the float op on the dequantized input: 0 (exact) whenever the integer box equals the float
box: always for constant ROIs; for run-time ROIs unless a coordinate lands within the multiplier error
(2^-mbits relative) of a rounding boundary, or on a negative half (half up vs half away from zero).
onnxruntime starts every non-empty bin at FLT_MIN (~1.2e-38) instead of -inf, so it returns ~0 where
all the elements of a bin are negative; ptq returns their maximum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops.base import activation_qparams, multiplier, require_per_tensor
from ops.conformance_case import X, Case
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node
from ptq.core.qparams import QParams
from ptq.core.requant import requantize

_WIDE = np.iinfo(np.int64)


@dataclass
class QuantizedRoiPool(QuantizedNode):
    boxes: Optional[np.ndarray]  # constant ROIs: int64 (R, 5) [batch, x1, y1, x2, y2] in pixels; else None
    m_batch: np.ndarray  # run-time ROIs: M_b / 2^N_b ~= s_r
    n_batch: np.ndarray
    m_coord: np.ndarray  # M / 2^N ~= s_r * spatial_scale
    n_coord: np.ndarray


def _pooled_shape(node: Node) -> tuple[int, int]:
    shape = [int(v) for v in node.attr("pooled_shape", [])]
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"pooled_shape must be two positive ints, got {shape}")
    return shape[0], shape[1]


def _spatial_scale(node: Node) -> float:
    scale = float(node.attr("spatial_scale", 1.0))
    if not scale > 0:
        raise ValueError(f"spatial_scale must be positive, got {scale}")
    return scale


def float_boxes(rois: np.ndarray, spatial_scale: float) -> np.ndarray:
    """Pixel boxes of float ROIs as the float op computes them: batch truncated, coordinates
    round_half_away(float32(c) * float32(spatial_scale))."""
    rois = _rois(rois)
    scaled = rois[:, 1:].astype(np.float32) * np.float32(spatial_scale)
    coords = np.sign(scaled) * np.floor(np.abs(scaled.astype(np.float64)) + 0.5)
    return np.concatenate([np.trunc(rois[:, :1]), coords], axis=1).astype(np.int64)


def _rois(rois) -> np.ndarray:
    rois = np.asarray(rois)
    if rois.ndim != 2 or rois.shape[1] != 5:
        raise ValueError(f"input 1 (rois) must be (num_rois, 5) [batch, x1, y1, x2, y2], got shape {rois.shape}")
    return rois


def roi_max(x: np.ndarray, boxes: np.ndarray, pooled: tuple[int, int], empty) -> np.ndarray:
    """(R, C, PH, PW): the maximum of each bin of each box (module docstring), `empty` for an empty bin."""
    if x.ndim != 4:
        raise ValueError(f"expected an (N, C, H, W) input, got shape {x.shape}")
    n, c, h, w = x.shape
    ph_n, pw_n = pooled
    y = np.empty((len(boxes), c, ph_n, pw_n), dtype=x.dtype)
    rows = np.empty((c, ph_n, w), dtype=x.dtype)  # per bin row: the maxima over its rows, every column
    for r, (b, x1, y1, x2, y2) in enumerate(boxes.tolist()):
        if not 0 <= b < n:
            raise ValueError(f"input 1 (rois): batch index {b} of roi {r} outside [0, {n})")
        height, width = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        row_empty = []
        for ph in range(ph_n):
            h0 = min(max(y1 + ph * height // ph_n, 0), h)
            h1 = min(max(y1 - (-(ph + 1) * height // ph_n), 0), h)
            row_empty.append(h1 <= h0)
            if h1 > h0:
                rows[:, ph] = x[b, :, h0:h1].max(axis=1)
        for pw in range(pw_n):
            w0 = min(max(x1 + pw * width // pw_n, 0), w)
            w1 = min(max(x1 - (-(pw + 1) * width // pw_n), 0), w)
            y[r, :, :, pw] = rows[:, :, w0:w1].max(axis=2) if w1 > w0 else empty
        y[r, :, np.array(row_empty, dtype=bool)] = empty
    return y


@register
class MaxRoiPool(OpDef):
    """ONNX MaxRoiPool (pooled_shape, spatial_scale): bin maxima of the codes (module docstring). Whitepaper 4.45."""

    op_type = "MaxRoiPool"
    lsb_bound = 0.0
    section = "4.45"
    int_types = "any (rois: codes or constant) -> same as input"
    keeps_input_qparams = True
    conformance = Case(inputs=(X, "rois"), constants={"rois": np.array([[0, 0, 0, 3, 2], [0, 1, 1, 4, 3]], np.float32)},
                       attrs={"pooled_shape": [2, 2], "spatial_scale": 1.0})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        boxes = float_boxes(inputs[1], _spatial_scale(node))
        return [roi_max(x, boxes, _pooled_shape(node), np.float32(0))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedRoiPool:
        x_qp = activation_qparams(ctx)
        node = ctx.node
        scale = _spatial_scale(node)
        one = np.ones(1, np.int64)
        if 1 in ctx.constants:
            boxes = float_boxes(ctx.constants[1], scale)
            return QuantizedRoiPool(node, [x_qp, None], [x_qp], boxes, one, one * 0, one, one * 0)
        r_qp = ctx.in_qparams[1] if len(ctx.in_qparams) > 1 else None
        if not isinstance(r_qp, QParams):
            raise QuantizationError("input 1 (rois) is neither a constant nor quantized")
        require_per_tensor(r_qp, "input 1 (rois)")
        s_r = float(r_qp.scale[0])
        m_b, n_b = multiplier(s_r, ctx.options.mbits, "s_rois")
        m_c, n_c = multiplier(s_r * scale, ctx.options.mbits, "s_rois * spatial_scale")
        return QuantizedRoiPool(node, [x_qp, r_qp], [x_qp], None, m_b, n_b, m_c, n_c)

    def forward_int(self, q: QuantizedRoiPool, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        boxes = q.boxes
        if boxes is None:
            r_c = _rois(inputs[1]).astype(np.int64) - int(q.in_qparams[1].zero_point[0])
            batch = requantize(r_c[:, :1], q.m_batch, q.n_batch, 0, _WIDE.min, _WIDE.max)
            coords = requantize(r_c[:, 1:], q.m_coord, q.n_coord, 0, _WIDE.min, _WIDE.max)
            boxes = np.concatenate([batch, coords], axis=1)
        return [roi_max(x, boxes, _pooled_shape(q.node), x.dtype.type(q.in_qparams[0].zero_point[0]))]
