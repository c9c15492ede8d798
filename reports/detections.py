"""Detections compared as detections: the integer run's boxes matched to the float model's (`ptq report --task
detect`).

Two output forms (`detection_task` picks one from the graph):
- raw YOLO-style `[1, 4 + C, A]`: rows 0..3 the boxes (cx, cy, w, h), rows 4.. the class scores of A anchors.
  Each anchor's best class is kept when its score >= score_threshold, then greedy NMS per class at IoU
  `NMS_IOU` (0.7, Ultralytics' default) (`yolo_detections`);
- a NonMaxSuppression node (an op with `selects_boxes`): its inputs boxes [1, A, 4] and scores [1, C, A], and
  its own thresholds; what the node selects is recomputed from each run's inputs in numpy, keeping the scores
  >= max(its score threshold, score_threshold) (`nms_node_detections`). Found without --task when the graph
  has exactly one such node.

Matching (`match`): per class, the float detections by decreasing score each take the unmatched integer
detection of that class with the largest IoU >= match_iou (0.5). Over all images (`DetectionAgreement`):

    recall    = matched / float detections      (1 when float found none)
    precision = matched / integer detections    (1 when the integer run found none)
    identical = images where every detection of either run is matched
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops.nms import select_boxes
from ops.registry import op_of
from ptq.core.graph import Graph
from ptq.core.option_defaults import DEFAULT_MATCH_IOU, DEFAULT_SCORE_THRESHOLD, REPORT_TASKS

SCORE_THRESHOLD = DEFAULT_SCORE_THRESHOLD
MATCH_IOU = DEFAULT_MATCH_IOU
NMS_IOU = 0.7
TASKS = REPORT_TASKS


@dataclass(frozen=True)
class Detections:
    """Boxes [K, 4] as (x1, y1, x2, y2), their scores [K] and classes [K]."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray

    def __len__(self) -> int:
        return len(self.scores)

    def take(self, index: np.ndarray) -> "Detections":
        return Detections(self.boxes[index], self.scores[index], self.classes[index])


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU [N, M] of boxes a [N, 4] and b [M, 4], (x1, y1, x2, y2) with x1 <= x2, y1 <= y2; 0 for empty unions."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    w = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    h = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = w * h
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, limit: Optional[int] = None) -> np.ndarray:
    """Greedy NMS: indices kept, by decreasing score (ties by increasing index); a box is dropped when its IoU
    with a kept box exceeds `iou_threshold`; at most `limit` kept."""
    order = np.lexsort((np.arange(len(scores)), -np.asarray(scores)))
    iou = box_iou(boxes[order], boxes[order])
    kept: list[int] = []
    suppressed = np.zeros(len(order), bool)
    for k in range(len(order)):
        if suppressed[k]:
            continue
        kept.append(int(order[k]))
        if limit is not None and len(kept) == limit:
            break
        suppressed |= iou[k] > iou_threshold
    return np.array(kept, dtype=np.int64)


def per_class_nms(dets: Detections, iou_threshold: float, limit: Optional[int] = None) -> Detections:
    kept = [idx[nms(dets.boxes[idx], dets.scores[idx], iou_threshold, limit)]
            for idx in (np.flatnonzero(dets.classes == c) for c in np.unique(dets.classes))]
    index = np.concatenate(kept) if kept else np.zeros(0, np.int64)
    return dets.take(index)


def yolo_detections(output: np.ndarray, score_threshold: float = SCORE_THRESHOLD,
                    nms_iou: float = NMS_IOU) -> Detections:
    """The detections of one raw YOLO output [4 + C, A] (a leading batch axis of 1 is dropped)."""
    out = np.asarray(output, np.float64)
    out = out.reshape(out.shape[-2:])
    cx, cy, w, h = out[:4]
    scores = out[4:]
    best = scores.argmax(0)
    best_score = scores[best, np.arange(out.shape[1])]
    keep = np.flatnonzero(best_score >= score_threshold)
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
    return per_class_nms(Detections(boxes[keep], best_score[keep], best[keep]), nms_iou)


def corner_boxes(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """ONNX NonMaxSuppression boxes [A, 4] as (x1, y1, x2, y2): [y1, x1, y2, x2] with any diagonal
    (center_point_box=0) or [xc, yc, w, h] (1)."""
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    if center_point_box:
        return np.stack([b[:, 0] - b[:, 2] / 2, b[:, 1] - b[:, 3] / 2, b[:, 0] + b[:, 2] / 2, b[:, 1] + b[:, 3] / 2], 1)
    return np.stack([np.minimum(b[:, 1], b[:, 3]), np.minimum(b[:, 0], b[:, 2]),
                     np.maximum(b[:, 1], b[:, 3]), np.maximum(b[:, 0], b[:, 2])], 1)


def nms_node_detections(boxes: np.ndarray, scores: np.ndarray, *, center_point_box: int, iou_threshold: float,
                        score_threshold: float, max_per_class: int) -> Detections:
    """What an ONNX NonMaxSuppression selects from one sample's boxes [A, 4] and scores [C, A], as detections
    (per class, scores > score_threshold, IoU > iou_threshold suppressed, at most max_per_class)."""
    corners = corner_boxes(boxes, center_point_box)
    s = np.asarray(scores, np.float64).reshape(-1, corners.shape[0])
    # the NonMaxSuppression op's own selection loop (ops.nms), in float64; IoU is the same on (x, y) corners
    selected = select_boxes(corners[None], s[None], max_per_class, lambda v: v > score_threshold,
                            lambda inter, union: inter / union > iou_threshold)
    classes, index = selected[:, 1], selected[:, 2]
    return Detections(corners[index].reshape(-1, 4), s[classes, index], classes)


def match(reference: Detections, test: Detections, iou_threshold: float = MATCH_IOU) -> int:
    """How many reference detections find a test detection of the same class with IoU >= iou_threshold, each
    test detection matched once (greedy by decreasing reference score, the best IoU first)."""
    matched = 0
    for c in np.unique(reference.classes):
        ref = np.flatnonzero(reference.classes == c)
        ref = ref[np.argsort(-reference.scores[ref], kind="stable")]
        cand = np.flatnonzero(test.classes == c)
        if cand.size == 0:
            continue
        iou = box_iou(reference.boxes[ref], test.boxes[cand])
        free = np.ones(cand.size, bool)
        for row in iou:
            row = np.where(free & (row >= iou_threshold), row, -1.0)
            best = int(np.argmax(row))
            if row[best] >= 0:
                free[best] = False
                matched += 1
    return matched


@dataclass
class DetectionAgreement:
    """Counts over the images of the integer run's detections against the float model's (module docstring)."""

    score_threshold: float = SCORE_THRESHOLD
    match_iou: float = MATCH_IOU
    samples: int = 0
    reference: int = 0
    test: int = 0
    matched: int = 0
    identical: int = 0

    def update(self, reference: Detections, test: Detections) -> None:
        matched = match(reference, test, self.match_iou)
        self.samples += 1
        self.reference += len(reference)
        self.test += len(test)
        self.matched += matched
        self.identical += int(matched == len(reference) == len(test))

    def merge(self, other: "DetectionAgreement") -> "DetectionAgreement":
        return DetectionAgreement(self.score_threshold, self.match_iou, self.samples + other.samples,
                                  self.reference + other.reference, self.test + other.test,
                                  self.matched + other.matched, self.identical + other.identical)

    @property
    def recall(self) -> float:
        return self.matched / self.reference if self.reference else 1.0

    @property
    def precision(self) -> float:
        return self.matched / self.test if self.test else 1.0

    def to_dict(self) -> dict:
        return {"samples": self.samples, "score_threshold": self.score_threshold, "match_iou": self.match_iou,
                "float_detections": self.reference, "int_detections": self.test, "matched": self.matched,
                "recall": self.recall, "precision": self.precision, "identical_images": self.identical}


def detection_line(d: dict) -> str:
    """The console line of `DetectionAgreement.to_dict()`."""
    return (f"detections (score >= {d['score_threshold']:g}, IoU >= {d['match_iou']:g}, same class): recall "
            f"{d['recall']:.3f}  precision {d['precision']:.3f} against float ({d['matched']} matched of "
            f"{d['float_detections']} float, {d['int_detections']} integer; {d['identical_images']} of "
            f"{d['samples']} images identical)")


@dataclass(frozen=True)
class DetectionTask:
    """Where a model's detections are and how to decode them: `tensors` are read from both runs (float
    values), `decode` turns one sample's values into `Detections`."""

    form: str  # "yolo" or "nms"
    tensors: tuple[str, ...]
    score_threshold: float = SCORE_THRESHOLD
    match_iou: float = MATCH_IOU
    center_point_box: int = 0
    nms_iou: float = NMS_IOU
    nms_score: float = -np.inf
    max_per_class: int = 0

    def decode(self, values: dict) -> Detections:
        if self.form == "yolo":
            return yolo_detections(values[self.tensors[0]], self.score_threshold, self.nms_iou)
        boxes, scores = values[self.tensors[0]], values[self.tensors[1]]
        return nms_node_detections(np.asarray(boxes)[0], np.asarray(scores)[0],
                                   center_point_box=self.center_point_box, iou_threshold=self.nms_iou,
                                   score_threshold=max(self.nms_score, self.score_threshold),
                                   max_per_class=self.max_per_class)

    def agreement(self) -> DetectionAgreement:
        return DetectionAgreement(self.score_threshold, self.match_iou)

    def describe(self) -> str:
        if self.form == "yolo":
            return f"raw YOLO output {self.tensors[0]} [1, 4 + C, A]"
        return f"the NonMaxSuppression inputs {self.tensors[0]}, {self.tensors[1]}"


def _scalar(graph: Graph, name: str, default: float) -> Optional[float]:
    """A constant scalar input of a node (default when omitted; None when computed at run time)."""
    if not name:
        return default
    value = graph.initializers.get(name)
    return None if value is None else float(np.asarray(value).ravel()[0])


def _nms_task(graph: Graph, node, score_threshold: float, match_iou: float) -> DetectionTask:
    inputs = list(node.inputs) + [""] * (5 - len(node.inputs))
    limit, iou, score = (_scalar(graph, inputs[2], 0), _scalar(graph, inputs[3], 0.0),
                         _scalar(graph, inputs[4], -np.inf))
    if limit is None or iou is None or score is None:
        raise ValueError(f"--task detect: NonMaxSuppression {node.name!r} takes a threshold computed at run time")
    return DetectionTask("nms", (inputs[0], inputs[1]), score_threshold, match_iou,
                         int(node.attr("center_point_box", 0)), iou, score, int(limit))


def _yolo_output(graph: Graph) -> Optional[str]:
    """The one output shaped [1, 4 + C, A] with C >= 1 and A > 4 + C (static)."""
    found = []
    for name in graph.outputs:
        info = graph.tensors.get(name)
        shape = None if info is None or not info.is_float else info.shape
        if shape and len(shape) == 3 and all(isinstance(d, int) for d in shape) and shape[0] == 1 \
                and shape[1] >= 5 and shape[2] > shape[1]:
            found.append(name)
    return found[0] if len(found) == 1 else None


def detection_task(graph: Graph, task: Optional[str], score_threshold: float = SCORE_THRESHOLD,
                   match_iou: float = MATCH_IOU) -> Optional[DetectionTask]:
    """The detections to compare: task "detect" needs one (a NonMaxSuppression node, else one raw YOLO output);
    "auto" (or None) takes the NonMaxSuppression node when the graph has exactly one; "classify": none."""
    if task not in (None,) + TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "classify":
        return None
    selectors = [n for n in graph.nodes if (op := op_of(n)) is not None and op.selects_boxes]
    if len(selectors) == 1:
        return _nms_task(graph, selectors[0], score_threshold, match_iou)
    if task != "detect":
        return None
    if selectors:
        raise ValueError(f"--task detect: {len(selectors)} NonMaxSuppression nodes, expected one")
    output = _yolo_output(graph)
    if output is None:
        raise ValueError("--task detect: no NonMaxSuppression node and no output shaped [1, 4 + C, A] "
                         f"(outputs: {', '.join(graph.outputs)})")
    return DetectionTask("yolo", (output,), score_threshold, match_iou)
