"""The default's per-tensor chooser never clips a tensor whose largest values a consumer ranks
(`OpDef.ranks_input`, `ptq.calibration.ranked_inputs`; issue #26, scope 1)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ops.registry import get_op
from ptq.calibration.pipeline import calibrate
from ptq.calibration.ranked_inputs import ranked_tensors
from ptq.core.graph import load_model

ROWS, ROW = 8, 4000
SHAPE = [1, ROWS, ROW]


def scores_model(last_op: str) -> onnx.ModelProto:
    """x -> Mul(2) -> logits -> Reshape -> `last_op` -> y (opset 13)."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["logits"]),
             helper.make_node("Reshape", ["logits", "shape"], ["rows"]),
             helper.make_node(last_op, ["rows"], ["y"], **({"axis": -1} if last_op == "Softmax" else {}))]
    graph = helper.make_graph(
        nodes, "scores", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, ROW])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
         helper.make_tensor("shape", TensorProto.INT64, [2], [ROWS, ROW])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def heavy_tailed_samples(folder, count: int = 4) -> list:
    """Student-t(3) logits: rare large values, where a clipping range has the least squared error."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    files = []
    for k in range(count):
        files.append(folder / f"{k}.npy")
        np.save(files[-1], rng.standard_t(3, SHAPE).astype(np.float32))
    return files


@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax", "Hardmax", "ArgMax", "ArgMin", "TopK"])
def test_ops_that_rank_their_input_say_so(op_type):
    assert get_op(op_type).ranks_input


@pytest.mark.parametrize("op_type", ["Sigmoid", "Relu", "Conv", "Add", "Reshape"])
def test_other_ops_do_not(op_type):
    assert not get_op(op_type).ranks_input


def test_ranked_tensors_follow_code_moving_ops_back(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(scores_model("Softmax"), path)
    ranked = ranked_tensors(load_model(str(path)))
    assert set(ranked) == {"rows", "logits", "y"}  # logits reach the Softmax through a Reshape; x feeds a Mul
    assert ranked["logits"].startswith("Softmax")
    onnx.save(scores_model("Sigmoid"), path)
    assert set(ranked_tensors(load_model(str(path)))) == {"y"}  # the graph output, read by the user


def test_auto_keeps_the_extremes_of_logits_a_softmax_ranks_and_clips_them_for_a_sigmoid(tmp_path):
    files = heavy_tailed_samples(tmp_path / "data")
    top = 2.0 * max(float(np.load(f).max()) for f in files)
    for op_type, clipped in (("Sigmoid", True), ("Softmax", False)):
        path = tmp_path / f"{op_type}.onnx"
        onnx.save(scores_model(op_type), path)
        table = calibrate(str(path), data=files, out_dir=tmp_path / op_type, calibrator="auto",
                          write_qdq=False).table
        entry = table.tensors["logits"]
        if clipped:
            assert float(entry.max[0]) < 0.95 * top, entry.calibrator
        else:
            assert float(entry.max[0]) == pytest.approx(top, rel=1e-6)
            assert "ranks its largest values" in entry.calibrator


def test_a_named_calibrator_is_used_as_named(tmp_path):
    files = heavy_tailed_samples(tmp_path / "data")
    path = tmp_path / "m.onnx"
    onnx.save(scores_model("Softmax"), path)
    table = calibrate(str(path), data=files, out_dir=tmp_path / "out", calibrator="99.9percentile",
                      write_qdq=False).table
    assert table.tensors["logits"].calibrator == "99.9percentile"
    assert float(table.tensors["logits"].max[0]) < 0.9 * 2.0 * max(float(np.load(f).max()) for f in files)
