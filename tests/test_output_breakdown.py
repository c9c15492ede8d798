"""Output parts and channels (`reports.output_breakdown`): a dead part cannot hide behind the output's cosine."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ptq
from ptq.core.graph import load_model
from ptq.core.qparams import QParams, compute_qparams
from ptq.table.quant_table import TensorEntry, load_quant_table, save_quant_table
from reports.output_breakdown import GroupAccumulator, OutputGroups, channel_groups, join_parts, output_groups
from reports.writers import summary_text

A = 32  # anchors


def _uint8(scale: float) -> QParams:
    return QParams(scale=np.array([scale]), zero_point=np.array([0]), bits=8, signed=False)


def _detector_like(path, transpose: bool = False):
    """x [1, 4, A] -> Concat(boxes = (x + 3) * 50 on 0..300, scores = Sigmoid(x) on 0..1) on axis 1: [1, 8, A]
    (then Transpose to [1, A, 8] when `transpose`)."""
    nodes = [
        helper.make_node("Add", ["x", "three"], ["shifted"], name="shift"),
        helper.make_node("Mul", ["shifted", "fifty"], ["boxes"], name="pixels"),
        helper.make_node("Sigmoid", ["x"], ["scores"], name="sigmoid"),
        helper.make_node("Concat", ["boxes", "scores"], ["joined" if transpose else "out"], name="join", axis=1),
    ]
    shape = [1, 8, A]
    if transpose:
        nodes.append(helper.make_node("Transpose", ["joined"], ["out"], name="tr", perm=[0, 2, 1]))
        shape = [1, A, 8]
    graph = helper.make_graph(
        nodes, "detector_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, A])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.array(3.0, np.float32), "three"),
         numpy_helper.from_array(np.array(50.0, np.float32), "fifty")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(model, path)
    return path


def _data(folder, count: int, seed: int = 0):
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for k in range(count):
        np.save(folder / f"{k:03d}.npy", np.clip(rng.normal(0, 1.2, (1, 4, A)), -3, 3).astype(np.float32))
    return folder


def test_group_metrics_pool_every_sample_and_count_codes():
    labels = np.array([[0, 0, 1, 1, 1]], np.int32)
    acc = GroupAccumulator(OutputGroups("parts", ["boxes", "scores"], labels, ["a", "b"]))
    qp = _uint8(1.0)
    x1, q1 = np.array([[10.0, 20.0, 0.1, 0.9, 0.4]]), np.array([[10, 21, 0, 1, 0]], np.uint8)
    x2, q2 = np.array([[30.0, 40.0, 0.7, 0.2, 0.0]]), np.array([[30, 40, 1, 0, 0]], np.uint8)
    acc.update(x1, q1, qp)
    acc.update(x2, q2, qp)
    boxes, scores = acc.result()
    xb, yb = np.array([10, 20, 30, 40.0]), np.array([10, 21, 30, 40.0])
    assert boxes.cosine == pytest.approx(xb @ yb / math.sqrt((xb @ xb) * (yb @ yb)), rel=1e-12)
    assert boxes.mse == pytest.approx(1 / 4)
    xs, ys = np.array([0.1, 0.9, 0.4, 0.7, 0.2, 0.0]), np.array([0, 1, 0, 1, 0, 0.0])
    assert scores.cosine == pytest.approx(xs @ ys / math.sqrt((xs @ xs) * (ys @ ys)), rel=1e-12)
    assert scores.max_abs_err == pytest.approx(0.4)
    assert (boxes.codes, scores.codes) == (4, 2)  # 10, 21, 30, 40 / 0, 1
    assert (scores.float_min, scores.float_max) == (0.0, 0.9)
    assert (boxes.needed, scores.needed) == (2, 3)  # per sample: 2 box values, 3 distinct score values
    assert not scores.dead and not boxes.dead  # too few values to need more than 4 codes
    assert acc.merge(GroupAccumulator(acc.groups)).result() == acc.result()


def test_scores_on_a_pixel_grid_are_dead_a_confident_softmax_row_is_not():
    labels = np.broadcast_to(np.arange(2, dtype=np.int32)[None, :, None], (1, 2, 50)).copy()
    acc = GroupAccumulator(OutputGroups("channels", ["scores", "softmax"], labels))
    # channel 0 on a grid sized for pixel boxes, channel 1 (a softmax row) on its own 1/255 grid
    qp = QParams(scale=np.array([300 / 255, 1 / 255]), zero_point=np.array([0, 0]), bits=8, signed=False, axis=1)
    rng = np.random.default_rng(0)
    for _ in range(3):
        peak = np.full(50, 1e-5)
        peak[rng.integers(50)] = 0.9995  # one class near 1, the rest near 0: 2 codes on any grid
        x = np.stack([rng.uniform(0, 1, 50), peak])[None]
        acc.update(x, np.rint(x / qp.scale[None, :, None]).astype(np.uint8), qp)
    scores, softmax = acc.result()
    assert scores.codes <= 2 and scores.needed == 5 and scores.dead
    assert softmax.codes == 2 and softmax.needed == 2 and not softmax.dead
    assert softmax.cosine > 0.9999


def test_constant_group_is_not_dead_and_codes_count_stops_above_four():
    labels = np.array([[0] * 6 + [1] * 6], np.int32)
    acc = GroupAccumulator(OutputGroups("channels", ["0", "1"], labels))
    acc.update(np.array([[0.5] * 6 + list(range(6))], float), np.array([[1] * 6 + list(range(6))], np.uint8),
               _uint8(1.0))
    constant, ramp = acc.result()
    assert not constant.dead and constant.codes == 1
    assert not ramp.dead and ramp.codes == 5  # counted up to DEAD_CODES + 1
    assert ramp.to_dict()["distinct_codes"] == ">4"


def test_shards_merge_into_the_one_pass_result():
    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(3, dtype=np.int32), 4)[None]
    groups = OutputGroups("parts", ["a", "b", "c"], labels)
    whole, first, second = GroupAccumulator(groups), GroupAccumulator(groups), GroupAccumulator(groups)
    for k in range(6):
        x = rng.normal(size=(1, 12))
        q = np.clip(np.round(x * 20) + 128, 0, 255).astype(np.uint8)
        qp = QParams(scale=np.array([0.05]), zero_point=np.array([128]), bits=8, signed=False)
        whole.update(x, q, qp)
        (first if k < 2 else second).update(x, q, qp)
    assert GroupAccumulator(groups).merge(first).merge(second).result() == whole.result()


def test_parts_follow_the_join_through_a_transpose(tmp_path):
    graph = load_model(_detector_like(tmp_path / "m.onnx", transpose=True))
    parts = join_parts(graph, "out")
    assert parts.names == ["boxes", "scores"]
    assert parts.labels.shape == (1, A, 8)
    assert (parts.labels[0, :, :4] == 0).all() and (parts.labels[0, :, 4:] == 1).all()
    assert parts.spans == ["axis 2 [0:4]", "axis 2 [4:8]"]
    assert len(channel_groups(graph, "out").names) == A  # axis 1 whatever it holds, up to 256
    assert [g.kind for g in output_groups(graph, "out")] == ["parts", "channels"]


def test_a_dimension_unknown_on_one_branch_is_taken_from_the_others(tmp_path):
    graph = load_model(_detector_like(tmp_path / "m.onnx"))
    # a torch export's view(n, ...) leaves the batch dimension of the box branch unknown
    graph.tensors["boxes"] = dataclasses.replace(graph.tensors["boxes"], shape=(None, 4, A))
    parts = join_parts(graph, "out")
    assert parts.labels.shape == (1, 8, A) and parts.spans == ["axis 1 [0:4]", "axis 1 [4:8]"]
    graph.tensors["scores"] = dataclasses.replace(graph.tensors["scores"], shape=(1, None, A))
    graph.tensors["boxes"] = dataclasses.replace(graph.tensors["boxes"], shape=(1, None, A))
    assert join_parts(graph, "out") is None  # the joined axis itself unknown: no parts


def test_output_without_a_join_has_channels_only(tmp_path):
    graph = load_model(_detector_like(tmp_path / "m.onnx"))
    assert join_parts(graph, "scores") is None
    kinds = [g.kind for g in output_groups(graph, "out")]
    assert kinds == ["parts", "channels"]
    assert output_groups(graph, "out")[1].names == [str(c) for c in range(8)]


def test_planted_dead_part_raises_the_warning_and_report_json_has_part_metrics(tmp_path):
    model = _detector_like(tmp_path / "det.onnx")
    calib, evald = _data(tmp_path / "calib", 8), _data(tmp_path / "eval", 4, seed=1)
    cal = ptq.calibrate(model, data=calib, out=tmp_path / "cal", quiet=True)
    # one grid over the whole output, sized for the pixel boxes: the scores (0..1) land on codes 0 and 1 (the
    # calibration gives each part its own grid, ptq.calibration.joined_ranges: replaced by hand here)
    table = load_quant_table(cal.table_path)
    table.tensors["out"] = TensorEntry("activation", "extrema", np.float64(0.0), np.float64(300.0),
                                       compute_qparams(0.0, 300.0, 8))
    quant = save_quant_table(table, tmp_path / "one_grid.quant.json")
    result = ptq.report(model, quant=quant, data=evald, out=tmp_path / "report", quiet=True)
    report = result.report
    assert report.outputs[0].similarity.cosine > 0.99  # the whole output looks fine ...
    assert any("part scores" in w and "integer code" in w for w in report.warnings)  # ... the scores are dead
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    tensor = data["outputs"]["tensors"][0]
    parts = {p["name"]: p for p in tensor["parts"]}
    assert set(parts) == {"boxes", "scores"}
    assert parts["scores"]["dead"] and parts["scores"]["distinct_codes"] <= 2
    assert parts["scores"]["cosine"] < 0.9
    assert not parts["boxes"]["dead"] and parts["boxes"]["cosine"] > 0.999
    assert parts["scores"]["span"] == "axis 1 [4:8]"
    assert tensor["channel_cosine"]["worst_channel"] >= 4  # a score row
    assert data["warnings"] == report.warnings
    assert summary_text(report).splitlines()[0].startswith("warning: output out: part scores")
    html = (tmp_path / "report" / "report.html").read_text()
    assert html.index('id="warnings"') < html.index("<h2>Summary</h2>")


def test_joined_tensors_of_one_range_give_no_warning(tmp_path):
    model = _detector_like(tmp_path / "det.onnx")
    calib = _data(tmp_path / "calib", 8)
    cal = ptq.calibrate(model, data=calib, out=tmp_path / "cal", quiet=True)
    # the scores alone on their own grid: a plain output, no join, no dead channel
    m = onnx.load(model)
    m.graph.output[0].name = "scores"
    del m.graph.output[0].type.tensor_type.shape.dim[:]
    for d in (1, 4, A):
        m.graph.output[0].type.tensor_type.shape.dim.add().dim_value = d
    onnx.save(m, tmp_path / "scores.onnx")
    cal = ptq.calibrate(tmp_path / "scores.onnx", data=calib, out=tmp_path / "cal2", quiet=True)
    report = ptq.report(tmp_path / "scores.onnx", quant=cal.table_path, data=calib, quiet=True).report
    assert report.warnings == []
    assert report.outputs[0].breakdown.parts is None
    assert len(report.outputs[0].breakdown.channels) == 4


def test_the_yolo_test_model_output_is_boxes_then_scores():
    """bench/models/yolo_detector.onnx (a torch export: the box branch has a dynamic batch dimension)."""
    from pathlib import Path

    from reports.detections import detection_task

    graph = load_model(Path(__file__).resolve().parents[1] / "bench" / "models" / "yolo_detector.onnx")
    parts = join_parts(graph, "output0")
    assert parts.spans == ["axis 1 [0:4]", "axis 1 [4:22]"] and parts.names[1] == "/Sigmoid_output_0"
    assert detection_task(graph, "detect").tensors == ("output0",)
