"""Joins of widely different ranges keep one grid per part (issue 24, `ptq.joined_ranges`): a YOLOv8-style head
concatenates 4 box rows in pixels (0..320) with 18 sigmoid score rows (0..1) into a [1, 22, 2100] output. With
one 8-bit grid (step 1.25) every score is code 0 or 1; by default the output now gets a grid per part (per
channel along the concat axis) and the score rows keep cosine >= 0.99 in the integer run and in the QDQ model
in onnxruntime. Behind a Transpose, the joined tensor goes to 16 bits instead."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.core.graph import load_model
from ptq.core.qparams import compute_qparams
from ptq.executor import NodeKind, prepare
from ptq.pipeline import calibrate
from ptq.qdq_export import export_qdq
from ptq.quant_table import QuantTable, TensorEntry, load_quant_table, save_quant_table

H, W = 42, 50  # 2100 anchors
BOXES, CLASSES = 4, 18


def _yolo_head(transpose: bool = False, opset: int = 17) -> onnx.ModelProto:
    """image -> Conv 3x3 + Relu (16 ch) -> box branch: Conv 1x1 -> Sigmoid -> Mul 320 (pixels, 0..320);
    score branch: Conv 1x1 (bias -5: most anchors score ~0.01, under 1% above 0.25, peaks near 1) -> Sigmoid (0..1) -> each Reshape to [1, rows, 2100]
    -> Concat(axis 1) -> [1, 22, 2100] (-> Transpose to [1, 2100, 22])."""
    rng = np.random.default_rng(0)
    init = {
        "w_stem": rng.normal(0, 0.4, (16, 3, 3, 3)), "b_stem": rng.uniform(-0.2, 0.2, 16),
        "w_box": rng.normal(0, 0.3, (BOXES, 16, 1, 1)), "b_box": np.zeros(BOXES),
        "w_cls": rng.normal(0, 0.5, (CLASSES, 16, 1, 1)), "b_cls": np.full(CLASSES, -5.0),
        "pixels": np.array(320.0), "box_shape": np.array([1, BOXES, H * W], np.int64),
        "cls_shape": np.array([1, CLASSES, H * W], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["image", "w_stem", "b_stem"], ["stem"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["stem"], ["feat"], name="stem_relu"),
        helper.make_node("Conv", ["feat", "w_box", "b_box"], ["box_logit"], name="box_conv"),
        helper.make_node("Sigmoid", ["box_logit"], ["box_unit"], name="box_sigmoid"),
        helper.make_node("Mul", ["box_unit", "pixels"], ["box_px"], name="box_scale"),
        helper.make_node("Reshape", ["box_px", "box_shape"], ["boxes"], name="box_flat"),
        helper.make_node("Conv", ["feat", "w_cls", "b_cls"], ["cls_logit"], name="cls_conv"),
        helper.make_node("Sigmoid", ["cls_logit"], ["cls_score"], name="cls_sigmoid"),
        helper.make_node("Reshape", ["cls_score", "cls_shape"], ["scores"], name="cls_flat"),
        helper.make_node("Concat", ["boxes", "scores"], ["joined"], name="head_concat", axis=1),
    ]
    out_shape = [1, BOXES + CLASSES, H * W]
    if transpose:
        nodes.append(helper.make_node("Transpose", ["joined"], ["output"], name="head_transpose", perm=[0, 2, 1]))
        out_name, out_shape = "output", [1, H * W, BOXES + CLASSES]
    else:
        out_name = "joined"
    graph = helper.make_graph(
        nodes, "yolo_head", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, H, W])],
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(np.asarray(v, dtype=v.dtype if v.dtype == np.int64 else np.float32), k)
         for k, v in init.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _images(n: int, seed: int) -> np.ndarray:
    """Dim noise with three bright blocks per image (the 'objects')."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 0.3, (n, 3, H, W))
    for k in range(n):
        for _ in range(3):
            r, c = rng.integers(0, H - 8), rng.integers(0, W - 8)
            h, w = rng.integers(4, 9, 2)
            x[k, :, r:r + h, c:c + w] += rng.uniform(-2.5, 2.5, (3, 1, 1))
    return x.astype(np.float32)


def _ort(model: onnx.ModelProto, image: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"image": image})[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _score_cosine(y: np.ndarray, ref: np.ndarray, transposed: bool = False) -> float:
    if transposed:
        y, ref = np.swapaxes(y, 1, 2), np.swapaxes(ref, 1, 2)
    return _cosine(y[:, BOXES:], ref[:, BOXES:])


@pytest.fixture(scope="module")
def head():
    model = _yolo_head()
    return model, calibrate(model, _images(8, 1), write_qdq=False).table


def test_scores_are_realistic(head):
    ref = _ort(head[0], _images(1, 2))
    assert 200 < ref[:, :BOXES].max() <= 320 and ref[:, BOXES:].max() > 0.9
    assert np.median(ref[:, BOXES:]) < 0.02 and 0 < np.mean(ref[:, BOXES:] > 0.25) < 0.02


def test_output_gets_a_grid_per_part_and_says_why(head, tmp_path):
    model, table = head
    entry = table.tensors["joined"]
    assert entry.qparams.axis == 1 and entry.qparams.scale.size == BOXES + CLASSES
    # each part's channels carry the part's own grid: the box rows the boxes', the score rows the scores'
    np.testing.assert_array_equal(entry.qparams.scale[:BOXES], np.repeat(table.qparams("boxes").scale, BOXES))
    np.testing.assert_array_equal(entry.qparams.scale[BOXES:], np.repeat(table.qparams("scores").scale, CLASSES))
    assert "joins parts whose ranges differ" in entry.why and "per channel along axis 1" in entry.why
    path = save_quant_table(table, tmp_path / "t.quant.json")
    assert load_quant_table(path).tensors["joined"].why == entry.why
    concat = next(s for s in prepare(load_model(model), table).steps if s.node.name == "head_concat")
    assert concat.kind is NodeKind.INTEGER and concat.quantized.copy == [True, True]


def test_integer_run_keeps_the_scores(head):
    model, table = head
    integer = prepare(load_model(model), table)
    for seed in (2, 3):
        image = _images(1, seed)
        ref, y = _ort(model, image), integer.run({"image": image}).outputs["joined"]
        assert _score_cosine(y, ref) >= 0.99 and _cosine(y[:, :BOXES], ref[:, :BOXES]) >= 0.99
    # the single 8-bit grid this replaces (step 320/255) leaves the scores dead: what the test guards against
    whole = table.tensors["joined"]
    one_grid = compute_qparams(whole.min.min(), whole.max.max(), 8, symmetric=False)
    single = QuantTable(table.options, {**table.tensors, "joined": TensorEntry(
        "activation", whole.calibrator, whole.min.min(), whole.max.max(), one_grid)})
    image = _images(1, 2)
    y = prepare(load_model(model), single).run({"image": image}).outputs["joined"]
    assert _score_cosine(y, _ort(model, image)) < 0.9


def test_qdq_model_quantizes_the_output_per_axis(head):
    model, table = head
    qdq = export_qdq(load_model(model), table)
    quantize = next(n for n in qdq.graph.node if n.op_type == "QuantizeLinear" and n.output[0].startswith("joined"))
    assert helper.get_attribute_value(next(a for a in quantize.attribute if a.name == "axis")) == 1
    image = _images(1, 3)
    assert _score_cosine(_ort(qdq, image), _ort(model, image)) >= 0.99


def test_behind_a_transpose_the_join_goes_to_16_bits():
    model = _yolo_head(transpose=True)
    table = calibrate(model, _images(8, 1), write_qdq=False).table
    for name in ("joined", "output"):
        entry = table.tensors[name]
        assert entry.qparams.bits == 16 and entry.qparams.axis is None and "16 bits" in entry.why
    image = _images(1, 2)
    ref = _ort(model, image)
    y = prepare(load_model(model), table).run({"image": image}).outputs["output"]
    assert _score_cosine(y, ref, transposed=True) >= 0.99
    assert _score_cosine(_ort(export_qdq(load_model(model), table), image), ref, transposed=True) >= 0.99


def test_similar_ranges_and_inner_joins_keep_one_grid():
    # boxes in 0..12 (within 16x of the scores' 0..1): no change
    model = _yolo_head()
    pixels = next(i for i in model.graph.initializer if i.name == "pixels")
    pixels.CopyFrom(numpy_helper.from_array(np.array(12.0, np.float32), "pixels"))
    table = calibrate(model, _images(4, 1), write_qdq=False).table
    assert table.tensors["joined"].qparams.axis is None and table.tensors["joined"].qparams.bits == 8
    assert table.tensors["joined"].why == ""
    # the join feeds an op that is not code-moving (a Relu): its consumers need one grid
    inner = _yolo_head()
    inner.graph.node.append(helper.make_node("Relu", ["joined"], ["relu_out"], name="after"))
    del inner.graph.output[:]
    inner.graph.output.append(helper.make_tensor_value_info("relu_out", TensorProto.FLOAT, [1, 22, H * W]))
    table = calibrate(inner, _images(4, 1), write_qdq=False).table
    assert table.tensors["joined"].qparams.axis is None and table.tensors["joined"].qparams.bits == 8
