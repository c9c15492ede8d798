"""Detections compared as detections (`reports.detections`): hand-built detection sets with known recall and
precision, NMS against onnxruntime's, the task found from the graph, and `ptq report --task detect`."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ptq
from ptq.core.graph import load_model
from reports.detections import (
    DetectionAgreement, Detections, box_iou, detection_task, match, nms, nms_node_detections, yolo_detections,
)
from reports.writers import summary_text


def _dets(rows) -> Detections:
    """rows of (class, score, x1, y1, x2, y2)."""
    a = np.array(rows, float).reshape(-1, 6)
    return Detections(a[:, 2:], a[:, 1], a[:, 0].astype(int))


def test_box_iou_of_known_boxes():
    a = np.array([[0, 0, 10, 10]])
    b = np.array([[0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30], [0, 0, 10, 5]])
    assert box_iou(a, b)[0] == pytest.approx([1.0, 50 / 150, 0.0, 0.5])


def test_match_gives_known_recall_and_precision():
    reference = _dets([(0, 0.9, 0, 0, 10, 10), (0, 0.8, 50, 50, 70, 70), (1, 0.7, 100, 100, 120, 120)])
    test = _dets([
        (0, 0.85, 1, 0, 11, 10),        # IoU 90/110 = 0.82 with the first: matched
        (0, 0.6, 55, 50, 75, 70),       # IoU 300/500 = 0.6 with the second: matched
        (2, 0.7, 100, 100, 120, 120),   # the third's box, another class: not matched
        (0, 0.5, 200, 200, 210, 210),   # nothing there in float
    ])
    assert match(reference, test) == 2
    agreement = DetectionAgreement()
    agreement.update(reference, test)
    assert (agreement.recall, agreement.precision) == (pytest.approx(2 / 3), pytest.approx(2 / 4))
    assert agreement.identical == 0
    agreement.update(reference, reference)
    assert (agreement.reference, agreement.test, agreement.matched, agreement.identical) == (6, 7, 5, 1)
    d = agreement.to_dict()
    assert (d["recall"], d["precision"], d["samples"]) == (pytest.approx(5 / 6), pytest.approx(5 / 7), 2)


def test_each_test_detection_matches_once_and_iou_below_half_does_not():
    reference = _dets([(0, 0.9, 0, 0, 10, 10), (0, 0.8, 0, 0, 10, 10)])
    assert match(reference, _dets([(0, 0.9, 0, 0, 10, 10)])) == 1
    assert match(_dets([(0, 0.9, 0, 0, 10, 10)]), _dets([(0, 0.9, 0, 0, 10, 4.9)])) == 0  # IoU 0.49
    assert match(_dets([]), _dets([(0, 0.9, 0, 0, 10, 10)])) == 0
    empty = DetectionAgreement()
    empty.update(_dets([]), _dets([]))
    assert (empty.recall, empty.precision, empty.identical) == (1.0, 1.0, 1)


def test_merged_agreements_add_up():
    a, b = DetectionAgreement(samples=2, reference=5, test=4, matched=3, identical=1), DetectionAgreement(
        samples=1, reference=1, test=2, matched=1, identical=0)
    merged = a.merge(b)
    assert (merged.samples, merged.reference, merged.test, merged.matched, merged.identical) == (3, 6, 6, 4, 1)


def test_yolo_output_decodes_best_class_threshold_and_per_class_nms():
    # 5 anchors, 2 classes: rows cx, cy, w, h, score0, score1
    out = np.array([
        [10, 11, 50, 80, 80],
        [10, 10, 50, 80, 80],
        [10, 10, 20, 10, 10],
        [10, 10, 20, 10, 10],
        [0.9, 0.8, 0.1, 0.2, 0.3],
        [0.1, 0.1, 0.2, 0.6, 0.9],
    ], np.float32)[None]
    d = yolo_detections(out)
    # anchors 0 and 1 (class 0) overlap at IoU 0.82 > 0.7: 1 is dropped; anchor 2 scores 0.2 < 0.25; anchors 3
    # and 4 are both class 1 on the same box: 3 (0.6) is dropped by 4 (0.9)
    order = np.argsort(d.classes, kind="stable")
    assert d.classes[order].tolist() == [0, 1]
    assert d.scores[order] == pytest.approx([0.9, 0.9])
    assert d.boxes[order].tolist() == [[5, 5, 15, 15], [75, 75, 85, 85]]


def test_nms_keeps_the_best_and_drops_overlaps_above_the_threshold():
    boxes = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [20, 20, 30, 30], [0, 0, 10, 10]], float)
    scores = np.array([0.5, 0.9, 0.7, 0.5])
    assert nms(boxes, scores, 0.7).tolist() == [1, 2]
    assert nms(boxes, scores, 0.9).tolist() == [1, 2, 0]  # 0 and 3 are equal: the lower index first
    assert nms(boxes, scores, 0.9, limit=2).tolist() == [1, 2]


def _nms_model(path, center_point_box: int, score_threshold: float):
    inputs = [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 40, 4]),
              helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 3, 40])]
    node = helper.make_node("NonMaxSuppression", ["boxes", "scores", "limit", "iou", "thr"], ["selected"],
                            name="nms", center_point_box=center_point_box)
    inits = [numpy_helper.from_array(np.array([12], np.int64), "limit"),
             numpy_helper.from_array(np.array([0.45], np.float32), "iou"),
             numpy_helper.from_array(np.array([score_threshold], np.float32), "thr")]
    graph = helper.make_graph([node], "nms", inputs,
                              [helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return path


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_nms_node_detections_select_what_onnxruntime_selects(tmp_path, center_point_box):
    rng = np.random.default_rng(center_point_box)
    corners = rng.uniform(0, 50, (40, 2))
    sizes = rng.uniform(5, 25, (40, 2))
    if center_point_box:
        boxes = np.concatenate([corners, sizes], 1)
    else:  # [y1, x1, y2, x2], some with the other diagonal
        boxes = np.concatenate([corners, corners + sizes], 1)
        boxes[::3] = boxes[::3][:, [2, 3, 0, 1]]
    boxes = boxes.astype(np.float32)[None]
    scores = rng.uniform(0, 1, (1, 3, 40)).astype(np.float32)
    path = _nms_model(tmp_path / "nms.onnx", center_point_box, 0.3)
    selected = ort.InferenceSession(str(path)).run(None, {"boxes": boxes, "scores": scores})[0]
    dets = nms_node_detections(boxes[0], scores[0], center_point_box=center_point_box, iou_threshold=0.45,
                               score_threshold=0.3, max_per_class=12)
    expected = sorted((int(c), float(scores[0, c, i])) for _, c, i in selected)
    assert sorted(zip(dets.classes.tolist(), dets.scores.tolist())) == expected  # float32 scores, exact
    task = detection_task(load_model(path), None)
    assert (task.form, task.tensors, task.nms_iou, task.max_per_class) == ("nms", ("boxes", "scores"),
                                                                           pytest.approx(0.45), 12)
    assert task.nms_score == pytest.approx(0.3) and task.center_point_box == center_point_box


def _yolo_like(path):
    """x [1, 6, 40] -> Concat(boxes = x[:4] mapped to pixels, scores = Sigmoid) on axis 1: [1, 4 + 2, 40]."""
    nodes = [
        helper.make_node("Split", ["x", "split"], ["raw_boxes", "raw_scores"], name="split", axis=1),
        helper.make_node("Sigmoid", ["raw_boxes"], ["unit_boxes"], name="box_sigmoid"),
        helper.make_node("Mul", ["unit_boxes", "size"], ["boxes"], name="pixels"),
        helper.make_node("Sigmoid", ["raw_scores"], ["scores"], name="sigmoid"),
        helper.make_node("Concat", ["boxes", "scores"], ["out"], name="join", axis=1),
    ]
    graph = helper.make_graph(
        nodes, "yolo_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 40])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 6, 40])],
        [numpy_helper.from_array(np.array([4, 2], np.int64), "split"),
         numpy_helper.from_array(np.array([[[160.0], [160.0], [60.0], [60.0]]], np.float32), "size")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return path


def test_task_from_the_graph(tmp_path):
    graph = load_model(_yolo_like(tmp_path / "y.onnx"))
    assert detection_task(graph, None) is None  # a raw output is not unambiguous: only with --task detect
    task = detection_task(graph, "detect", score_threshold=0.4)
    assert (task.form, task.tensors, task.score_threshold) == ("yolo", ("out",), 0.4)
    assert detection_task(graph, "classify") is None
    with pytest.raises(ValueError, match="task must be one of"):
        detection_task(graph, "segment")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 10])
    plain = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])])
    onnx.save(helper.make_model(plain, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "plain.onnx")
    with pytest.raises(ValueError, match="no NonMaxSuppression node and no output shaped"):
        detection_task(load_model(tmp_path / "plain.onnx"), "detect")


def test_report_task_detect_counts_float_detections_and_matches(tmp_path):
    model = _yolo_like(tmp_path / "y.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    samples = []
    for k in range(6):
        x = rng.normal(0, 1.5, (1, 6, 40)).astype(np.float32)
        x[:, 4:] -= 2.0  # most anchors score low, a few pass 0.25
        samples.append(x)
        np.save(data / f"{k}.npy", x)
    cal = ptq.calibrate(model, data=data, out=tmp_path / "cal", quiet=True)
    result = ptq.report(model, quant=cal.table_path, data=data, out=tmp_path / "report", task="detect", quiet=True)
    session = ort.InferenceSession(str(model))
    float_count = sum(len(yolo_detections(session.run(None, {"x": x})[0])) for x in samples)
    d = result.report.detections
    assert float_count > 0 and d["float_detections"] == float_count and d["samples"] == 6
    assert 0 <= d["matched"] <= min(d["float_detections"], d["int_detections"])
    assert d["recall"] == pytest.approx(d["matched"] / float_count)
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["outputs"]["detections"] == d
    assert "detections (score >= 0.25, IoU >= 0.5, same class): recall" in summary_text(result.report)
    assert "detections decoded from raw YOLO output out [1, 4 + C, A]" in result.report.notes
    assert "recall" in (tmp_path / "report" / "report.html").read_text()
    # two workers merge into the same detections, output parts and channels as one process
    sharded = ptq.report(model, quant=cal.table_path, data=data, task="detect", workers=2, quiet=True).report
    assert sharded.to_dict()["outputs"] == result.report.to_dict()["outputs"]
    assert sharded.to_dict()["outputs"]["tensors"][0]["parts"][1]["name"] == "scores"


def test_report_finds_the_nms_node_and_compares_what_it_selects(tmp_path):
    nodes = [
        helper.make_node("Sigmoid", ["raw_boxes"], ["unit_boxes"], name="box_sigmoid"),
        helper.make_node("Mul", ["unit_boxes", "size"], ["boxes"], name="pixels"),
        helper.make_node("Sigmoid", ["raw_scores"], ["scores"], name="sigmoid"),
        helper.make_node("NonMaxSuppression", ["boxes", "scores", "limit", "iou", "thr"], ["selected"], name="nms"),
    ]
    inits = [numpy_helper.from_array(np.array(100.0, np.float32), "size"),
             numpy_helper.from_array(np.array([20], np.int64), "limit"),
             numpy_helper.from_array(np.array([0.5], np.float32), "iou"),
             numpy_helper.from_array(np.array([0.3], np.float32), "thr")]
    graph = helper.make_graph(
        nodes, "nms_model", [helper.make_tensor_value_info("raw_boxes", TensorProto.FLOAT, [1, 40, 4]),
                             helper.make_tensor_value_info("raw_scores", TensorProto.FLOAT, [1, 3, 40])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 3, 40]),
         helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3])], inits)
    model = tmp_path / "nms_model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), model)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    session = ort.InferenceSession(str(model))
    float_count = 0
    for k in range(4):
        feeds = {"raw_boxes": rng.normal(0, 1.5, (1, 40, 4)).astype(np.float32),
                 "raw_scores": rng.normal(-1.5, 1.5, (1, 3, 40)).astype(np.float32)}
        np.savez(data / f"{k}.npz", **feeds)
        float_count += len(session.run(["selected"], feeds)[0])  # its score threshold 0.3 is above 0.25
    cal = ptq.calibrate(model, data=data, out=tmp_path / "cal", quiet=True)
    report = ptq.report(model, quant=cal.table_path, data=data, quiet=True).report  # no task: found from the graph
    d = report.detections
    assert d["samples"] == 4 and d["float_detections"] == float_count > 0
    assert d["matched"] <= min(d["float_detections"], d["int_detections"])
    assert d["recall"] > 0.5  # 8-bit boxes and scores keep most of what NMS selects
    assert "detections decoded from the NonMaxSuppression inputs boxes, scores" in report.notes
    assert ptq.report(model, quant=cal.table_path, data=data, task="classify", quiet=True).report.detections is None
