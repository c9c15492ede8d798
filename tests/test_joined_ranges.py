"""Joins of widely different ranges keep one grid per part (issue 24, `ptq.calibration.joined_ranges`): a YOLOv8-style head
concatenates 4 box rows in pixels (0..320) with 18 sigmoid score rows (0..1) into a [1, 22, 2100] output. With
one 8-bit grid (step 1.25) every score is code 0 or 1; by default the output now gets a grid per part (per
channel along the concat axis) and the score rows keep cosine >= 0.99 in the integer run and in the QDQ model
in onnxruntime. Behind a Transpose, the joined tensor goes to 16 bits instead."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.models.yolo_head import BOXES, CLASSES, PATHS, build, images as _images
from ptq.core.graph import load_model
from ptq.core.qparams import compute_qparams
from ptq.engine.executor import NodeKind, prepare
from ptq.calibration.pipeline import calibrate
from ptq.qdq.export import export_qdq
from ptq.table.quant_table import QuantTable, TensorEntry, load_quant_table, save_quant_table



def _yolo_head(transpose: bool = False) -> onnx.ModelProto:
    """The committed YOLOv8-style head (bench/models/yolo_head.py: 4 pixel box rows, 18 sigmoid score rows,
    Concat on axis 1 into [1, 22, 2100]; `transpose`: then [1, 2100, 22])."""
    return onnx.load(PATHS[transpose])


def test_committed_models_are_the_build_scripts():
    for transpose in (False, True):
        assert _yolo_head(transpose).SerializeToString() == build(transpose).SerializeToString()


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
def calibrated():
    model = _yolo_head()
    return model, calibrate(model, _images(8, 1), write_qdq=False)


@pytest.fixture(scope="module")
def head(calibrated):
    return calibrated[0], calibrated[1].table


def test_calibrate_says_which_grid_it_chose(calibrated):
    assert "own grid for 'joined': Concat 'head_concat' joins parts whose ranges differ" in calibrated[1].summary()


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


def test_behind_a_transpose_the_grids_follow_the_channels():
    model = _yolo_head(transpose=True)
    table = calibrate(model, _images(8, 1), write_qdq=False).table
    joined, output = table.tensors["joined"], table.tensors["output"]
    assert (joined.qparams.axis, output.qparams.axis) == (1, 2) and output.qparams.bits == 16
    np.testing.assert_array_equal(output.qparams.scale, joined.qparams.scale)
    assert "moved to axis 2 of 'output'" in output.why
    transpose = next(s for s in prepare(load_model(model), table).steps if s.node.name == "head_transpose")
    assert transpose.kind is NodeKind.INTEGER and transpose.out_qparams[0] == output.qparams
    image = _images(1, 2)
    ref = _ort(model, image)
    y = prepare(load_model(model), table).run({"image": image}).outputs["output"]
    assert _score_cosine(y, ref, transposed=True) >= 0.99
    assert _score_cosine(_ort(export_qdq(load_model(model), table), image), ref, transposed=True) >= 0.99


def test_behind_a_slice_the_join_goes_to_16_bits():
    # a Slice may cut the channels: the joined tensor and the chain after it take 16 bits instead
    model = _yolo_head()
    model.graph.initializer.extend([numpy_helper.from_array(np.array([v], np.int64), n)
                                    for n, v in (("starts", 0), ("ends", 2000), ("axes", 2))])
    model.graph.node.append(helper.make_node("Slice", ["joined", "starts", "ends", "axes"], ["kept"], name="cut"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("kept", TensorProto.FLOAT, [1, 22, 2000]))
    table = calibrate(model, _images(8, 1), write_qdq=False).table
    for name in ("joined", "kept"):
        entry = table.tensors[name]
        assert entry.qparams.bits == 16 and entry.qparams.axis is None and "16 bits" in entry.why
    image = _images(1, 2)
    ref = _ort(model, image)
    y = prepare(load_model(model), table).run({"image": image}).outputs["kept"]
    assert _score_cosine(y, ref) >= 0.99
    assert _score_cosine(_ort(export_qdq(load_model(model), table), image), ref) >= 0.99


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
    inner.graph.output.append(helper.make_tensor_value_info("relu_out", TensorProto.FLOAT, [1, 22, 2100]))
    table = calibrate(inner, _images(4, 1), write_qdq=False).table
    assert table.tensors["joined"].qparams.axis is None and table.tensors["joined"].qparams.bits == 8


ANCHORS = 64


def _exact_head(box_conv_is_output: bool = False) -> onnx.ModelProto:
    """feat [1, 8, 1, 64] -> cls Conv 1x1 (logits -23..5) -> Sigmoid -> Reshape [1, 3, 64]; box Conv 1x1 -> Relu
    -> Mul 8 (pixels 0..~460) -> Reshape [1, 4, 64]; Concat axis 1 -> out [1, 7, 64]. The weights lie on their
    own 8-bit per-channel grids and `_feat` on the input's 8-bit grid, so the integer accumulators are exact:
    what remains is the grids after the Convs (`box_conv_is_output`: the box Conv output is also an output)."""
    rng = np.random.default_rng(5)
    codes_c, codes_b = rng.integers(-127, 128, (3, 8)), rng.integers(-20, 128, (4, 8))
    codes_c[:, :2] = codes_b[:, :2] = (127, -127)  # each channel's grid: step exactly 0.05 / 0.12
    init = {"w_cls": (codes_c * 0.05).reshape(3, 8, 1, 1), "b_cls": np.array([-8.0, -6.0, -7.0]),
            "w_box": (codes_b * 0.12).reshape(4, 8, 1, 1), "b_box": np.zeros(4), "stride": np.array(8.0)}
    tensors = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in init.items()]
    tensors += [numpy_helper.from_array(np.array([1, rows, ANCHORS], np.int64), f"shape{rows}") for rows in (3, 4)]
    nodes = [
        helper.make_node("Conv", ["feat", "w_cls", "b_cls"], ["logit"], name="cls_conv"),
        helper.make_node("Sigmoid", ["logit"], ["score"], name="cls_sigmoid"),
        helper.make_node("Reshape", ["score", "shape3"], ["scores"], name="cls_flat"),
        helper.make_node("Conv", ["feat", "w_box", "b_box"], ["box_raw"], name="box_conv"),
        helper.make_node("Relu", ["box_raw"], ["box_pos"], name="box_relu"),
        helper.make_node("Mul", ["box_pos", "stride"], ["box_px"], name="box_scale"),
        helper.make_node("Reshape", ["box_px", "shape4"], ["boxes"], name="box_flat"),
        helper.make_node("Concat", ["boxes", "scores"], ["out"], name="join", axis=1),
    ]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 7, ANCHORS])]
    if box_conv_is_output:
        outputs.append(helper.make_tensor_value_info("box_raw", TensorProto.FLOAT, [1, 4, 1, ANCHORS]))
    graph = helper.make_graph(nodes, "exact_head", [helper.make_tensor_value_info("feat", TensorProto.FLOAT,
                                                                                  [1, 8, 1, ANCHORS])],
                              outputs, tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feat(n: int, seed: int) -> np.ndarray:
    """Codes of the 8-bit grid of [0, 1] (step 1/255), each sample reaching both ends."""
    x = np.random.default_rng(seed).integers(0, 256, (n, 8, 1, ANCHORS)).astype(np.float64)
    x[:, :, :, 0], x[:, :, :, 1] = 0, 255
    return (x / 255).astype(np.float32)


def test_the_tail_feeding_only_the_parts_takes_16_bits_and_the_scores_follow_float():
    """Before: the logits' 8-bit grid over -23..5 steps 0.11 (a score of 0.25 moves by up to 0.01, enough to
    cross the detection threshold) and the pixels' grid over 0..460 steps 1.8; now every tensor after the Convs
    is at 16 bits, and with exact accumulators the integer scores are within 2e-4 of float, the boxes within
    0.02 pixels, in the integer run and in the QDQ model."""
    model = _exact_head()
    table = calibrate(model, _feat(8, 1), write_qdq=False).table
    tail = ("logit", "score", "scores", "box_raw", "box_pos", "box_px", "boxes")
    for name in tail:
        entry = table.tensors[name]
        assert entry.qparams.bits == 16 and "feeds only the parts of Concat 'join'" in entry.why, name
    assert table.tensors["out"].qparams.bits == 16 and table.tensors["feat"].qparams.bits == 8
    integer = prepare(load_model(model), table)
    qdq = export_qdq(load_model(model), table)
    dequantized = {n.output[0]: n for n in qdq.graph.node if n.op_type == "DequantizeLinear"}
    zero_points = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    assert all(zero_points[dequantized[name].input[2]].dtype.itemsize == 2 for name in (*tail, "out"))
    for seed in (2, 3):
        x = _feat(1, seed)
        ref = _ort_feat(model, x)
        assert 0 < np.mean(ref[:, BOXES:] > 0.25) < 0.5 and ref[:, :BOXES].max() > 300
        for y in (integer.run({"feat": x}).outputs["out"], _ort_feat(qdq, x)):
            assert np.abs(y[:, BOXES:] - ref[:, BOXES:]).max() < 2e-4
            assert np.abs(y[:, :BOXES] - ref[:, :BOXES]).max() < 0.02


def _ort_feat(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["out"], {"feat": x})[0]


def test_the_tail_stops_at_a_tensor_read_elsewhere():
    # the box Conv's output is also a graph output: it keeps the calibrator's grid, the Relu after it widens
    table = calibrate(_exact_head(box_conv_is_output=True), _feat(8, 1), write_qdq=False).table
    assert table.tensors["box_raw"].qparams.bits == 8 and table.tensors["box_raw"].why == ""
    assert table.tensors["box_pos"].qparams.bits == 16 and table.tensors["logit"].qparams.bits == 16
