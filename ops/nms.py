"""NonMaxSuppression (ONNX), whitepaper 4.48, ONNX convention.

Per batch b and class c: the boxes whose score passes the score threshold, by decreasing score (equal scores
by increasing index), are selected one by one, up to max_output_boxes_per_class, unless their IoU with a box
already selected exceeds the IoU threshold. Output: int64 (num_selected, 3) [b, c, box], no qparams.

In integers (boxes with one scale s_b, scores with one scale s_s, c = q - zp):
- Box corners are codes: [y1, x1, y2, x2] (center_point_box=0, any diagonal: min/max per axis), or
  [xc, yc, w, h] (center_point_box=1) doubled to stay integer: x_min = 2*xc - w, x_max = 2*xc + w. Areas are
  int64 products of code differences; the IoU is scale-free (inter_f / union_f = inter_c / union_c), so with
  M_iou / 2^N_iou ~= iou_threshold

      suppress  <=>  inter_c * 2^N_iou > union_c * M_iou       (boxes that do not overlap are never suppressed)

- Scores are ordered by their codes (s_s > 0 preserves the order), and with M_s / 2^N_s ~= |score_threshold| / s_s

      keep  <=>  c_s * 2^N_s > sign(score_threshold) * M_s

Both thresholds are the whitepaper's M/2^N. The selected indices equal the float op's on the dequantized boxes
and scores (LSB bound 0: same indices) except where a score lies within the multiplier's relative error
(2^-mbits) of the score threshold, or an IoU within that error of the IoU threshold (onnxruntime's float32
IoU rounds too). A constant box tensor (anchors) is quantized once on its own range with 16 bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ops.base import multiplier, optional_input, require_per_tensor
from ops.conformance_case import X, Case, int64s
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams

CONSTANT_BOX_BITS = 16


@dataclass(frozen=True)
class Threshold:
    """`value * 2^n > sign * m`, the integer form of value > threshold (m / 2^n ~= |threshold| / unit)."""

    sign: int
    m: int
    n: int

    @classmethod
    def of(cls, threshold: float, unit: float, mbits: int, what: str) -> "Threshold":
        if threshold == 0:
            return cls(0, 0, 0)
        m, n = multiplier(abs(threshold) / unit, mbits, what)
        return cls(1 if threshold > 0 else -1, int(m[0]), int(n[0]))

    def exceeded(self, value: np.ndarray, scale_of: Optional[np.ndarray] = None) -> np.ndarray:
        """value > threshold * scale_of (scale_of: the IoU's union; None: 1)."""
        rhs = self.sign * self.m if scale_of is None else scale_of * (self.sign * self.m)
        return (np.asarray(value, dtype=np.int64) << self.n) > rhs


@dataclass
class QuantizedNMS(QuantizedNode):
    box_codes: Optional[np.ndarray]  # a constant box tensor's codes; None: boxes are an activation
    max_per_class: int
    iou: Threshold
    score: Optional[Threshold]  # None: no score threshold


def _corners(boxes: np.ndarray, center: bool, half) -> np.ndarray:
    """(B, N, 4) [y_min, x_min, y_max, x_max]; `half(v)` is v / 2 (float) or v with the centers doubled (int)."""
    if boxes.ndim != 3 or boxes.shape[2] != 4:
        raise ValueError(f"input 0 (boxes) must be (batch, boxes, 4), got shape {boxes.shape}")
    if center:
        xc, yc, w, h = np.moveaxis(boxes, 2, 0)
        xc, yc, w, h = half(xc, yc, w, h)
        return np.stack([yc - h, xc - w, yc + h, xc + w], axis=2)
    y1, x1, y2, x2 = np.moveaxis(boxes, 2, 0)
    return np.stack([np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)], axis=2)


BLOCK = 64  # candidates resolved together: one vectorized test against the kept boxes, one block x block matrix


def _suppression(corners: np.ndarray, area: np.ndarray, a: np.ndarray, b: np.ndarray, suppress) -> np.ndarray:
    """Whether box a[i] and box b[j] overlap with an IoU above the threshold (index arrays, broadcast)."""
    h = np.minimum(corners[a, 2], corners[b, 2]) - np.maximum(corners[a, 0], corners[b, 0])
    w = np.minimum(corners[a, 3], corners[b, 3]) - np.maximum(corners[a, 1], corners[b, 1])
    inter = h * w
    union = area[a] + area[b] - inter
    overlap = (h > 0) & (w > 0) & (area[a] > 0) & (area[b] > 0) & (union > 0)
    return overlap & suppress(inter, union)


def _greedy(corners: np.ndarray, area: np.ndarray, order: np.ndarray, max_per_class: int, suppress) -> list[int]:
    """The boxes of `order` (candidates by priority) that no earlier selected box suppresses, at most
    `max_per_class`. Blocks of candidates are first tested against the boxes kept so far, then resolved in order
    with their own pairwise matrix: the same pairs are tested as one candidate at a time."""
    kept: list[int] = []
    for start in range(0, order.size, BLOCK):
        if len(kept) >= max_per_class:
            break
        block = order[start:start + BLOCK]
        alive = np.ones(block.size, dtype=bool)
        if kept:
            alive &= ~_suppression(corners, area, np.array(kept)[:, None], block[None, :], suppress).any(axis=0)
        pairs = _suppression(corners, area, block[:, None], block[None, :], suppress)
        for i in range(block.size):
            if alive[i]:
                kept.append(int(block[i]))
                if len(kept) >= max_per_class:
                    break
                alive[i + 1:] &= ~pairs[i, i + 1:]
    return kept


def select_boxes(corners: np.ndarray, scores: np.ndarray, max_per_class: int,
                 keep: Callable[[np.ndarray], np.ndarray],
                 suppress: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """The NMS loop (module docstring) over corners (B, N, 4) and scores (B, C, N): `keep(scores)` is the
    score test, `suppress(inter, union)` the IoU test on overlapping pairs. Returns int64 (k, 3)."""
    if scores.ndim != 3 or scores.shape[0] != corners.shape[0] or scores.shape[2] != corners.shape[1]:
        raise ValueError(f"input 1 (scores) must be (batch, classes, {corners.shape[1]}) for boxes "
                         f"{corners.shape}, got {scores.shape}")
    selected = []
    for b in range(corners.shape[0]):
        box = corners[b]
        area = (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
        for c in range(scores.shape[1]):
            s = scores[b, c]
            candidates = np.nonzero(keep(s))[0]
            order = candidates[np.lexsort((candidates, -s[candidates]))]
            selected += [(b, c, i) for i in _greedy(box, area, order, max_per_class, suppress)]
    return np.array(selected, dtype=np.int64).reshape(-1, 3)


def _scalar(inputs, index: int, what: str):
    value = optional_input(inputs, index)
    if value is None or np.size(value) == 0:
        return None
    if np.size(value) != 1:
        raise ValueError(f"input {index} ({what}) must be a scalar, got shape {np.shape(value)}")
    return np.asarray(value).ravel()[0]


def _max_per_class(inputs) -> int:
    value = _scalar(inputs, 2, "max_output_boxes_per_class")
    return 0 if value is None else max(int(value), 0)


def _center(node: Node) -> bool:
    center = int(node.attr("center_point_box", 0))
    if center not in (0, 1):
        raise ValueError(f"center_point_box must be 0 or 1, got {center}")
    return bool(center)


_CASE_BOXES = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, 0.9, 1, 1.9], [0, 3, 1, 4], [0.5, 0.5, 1.5, 1.5]]],
                       np.float32)  # the conformance case's boxes: the first two overlap above its IoU threshold 0.5


@register
class NonMaxSuppression(OpDef):
    """ONNX NonMaxSuppression on box and score codes, thresholds as M/2^N (module docstring). Whitepaper 4.48."""

    op_type = "NonMaxSuppression"
    selects_boxes = True
    lsb_bound = 0.0
    section = "4.48"
    int_types = "boxes, scores: int8/uint8/int16 -> int64 indices"
    conformance = Case(shape=(1, 1, 5), inputs=("boxes", X, "k", "iou", "score"),
                       constants={"boxes": _CASE_BOXES, "k": int64s(3), "iou": np.float32(0.5),
                                  "score": np.float32(0.2)},
                       data="positive", note="x is the (1, 1, 5) scores")

    def index_outputs(self, node):
        return frozenset({0})

    def forward_float(self, node, inputs):
        boxes = np.asarray(inputs[0], dtype=np.float32)
        scores = np.asarray(inputs[1], dtype=np.float32)
        corners = _corners(boxes, _center(node), lambda xc, yc, w, h: (xc, yc, w / 2, h / 2))
        iou = np.float32(_scalar(inputs, 3, "iou_threshold") or 0.0)
        score = _scalar(inputs, 4, "score_threshold")
        keep = (lambda s: np.ones(s.shape, bool)) if score is None else (lambda s: s > np.float32(score))
        return [select_boxes(corners, scores, _max_per_class(inputs), keep, lambda i, u: i / u > iou)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNMS:
        in_qp = list(ctx.in_qparams) + [None] * (5 - len(ctx.in_qparams))
        codes = None
        if 0 in ctx.constants:
            value = np.asarray(ctx.constants[0], dtype=np.float64)
            in_qp[0] = compute_qparams(value.min(initial=0.0), value.max(initial=0.0), CONSTANT_BOX_BITS,
                                       symmetric=False)
            codes = in_qp[0].quantize(value)
        for index, what in ((0, "input 0 (boxes)"), (1, "input 1 (scores)")):
            if not isinstance(in_qp[index], QParams):
                raise QuantizationError(f"{what} has no qparams")
            require_per_tensor(in_qp[index], what)
        consts = [ctx.constants.get(i) for i in range(5)]
        for index, what in ((2, "max_output_boxes_per_class"), (3, "iou_threshold"), (4, "score_threshold")):
            if index < len(ctx.node.inputs) and ctx.node.inputs[index] and consts[index] is None:
                raise QuantizationError(f"input {index} ({what}) must be a constant")
        mbits = ctx.options.mbits
        iou = Threshold.of(float(_scalar(consts, 3, "iou_threshold") or 0.0), 1.0, mbits, "iou_threshold")
        # doubled corners span at most 6 * (qmax - qmin): areas below 2^(2 * bits + 6), shifted by N_iou in int64
        if 2 * in_qp[0].bits + 6 + iou.n > 62:
            raise QuantizationError(f"iou_threshold {_scalar(consts, 3, 'iou_threshold')} is too small for "
                                    f"{in_qp[0].bits}-bit boxes (int64 IoU test)")
        score = _scalar(consts, 4, "score_threshold")
        if score is not None:
            score = Threshold.of(float(score), float(in_qp[1].scale[0]), mbits, "score_threshold / s_scores")
        return QuantizedNMS(ctx.node, in_qp, [None], codes, _max_per_class(consts), iou, score)

    def forward_int(self, q: QuantizedNMS, inputs, runtime: IntRuntime):
        box_qp, score_qp = q.in_qparams[0], q.in_qparams[1]
        boxes = q.box_codes if q.box_codes is not None else np.asarray(inputs[0])
        boxes = boxes.astype(np.int64) - int(box_qp.zero_point[0])
        scores = np.asarray(inputs[1]).astype(np.int64) - int(score_qp.zero_point[0])
        corners = _corners(boxes, _center(q.node), lambda xc, yc, w, h: (2 * xc, 2 * yc, w, h))
        keep = (lambda s: np.ones(s.shape, bool)) if q.score is None else q.score.exceeded
        return [select_boxes(corners, scores, q.max_per_class, keep, lambda i, u: q.iou.exceeded(i, u))]
