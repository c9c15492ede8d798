"""The QDQ export folds each BatchNormalization the integer run folds into its Conv (issue #26, scope 2), so
onnxruntime on the QDQ model computes what `ptq run` computes: the same folded weights on the same grids, no
extra Q/DQ pair on the Conv's former output and no float BatchNormalization between two of them."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.calibration.pipeline import calibrate
from ptq.qdq.export import export_qdq
from ptq.table.edit import with_float
from test_qdq_export import assert_runs_as_ptq
from tiny_models import make_model


def conv_bn_model(seed: int = 0) -> onnx.ModelProto:
    """input (N,3,8,8) -> Conv 3x3 (no bias) -> BN -> Relu -> Conv 1x1 (bias) -> BN -> out (N,4,8,8).
    The BN scales differ by 80x across channels, so quantizing before or after them is not the same grid."""
    rng = np.random.default_rng(seed)
    arrays = {
        "W1": rng.normal(0, 0.3, (4, 3, 3, 3)), "W2": rng.normal(0, 0.4, (4, 4, 1, 1)), "B2": rng.normal(0, 0.1, 4),
        "g1": np.array([0.1, 3.0, 0.5, 8.0]), "b1": rng.normal(0, 0.5, 4), "m1": rng.normal(0, 0.2, 4),
        "v1": rng.uniform(0.5, 2.0, 4),
        "g2": np.array([2.0, 0.2, 1.0, 5.0]), "b2": rng.normal(0, 0.5, 4), "m2": rng.normal(0, 0.2, 4),
        "v2": rng.uniform(0.5, 2.0, 4),
    }
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]
    nodes = [
        helper.make_node("Conv", ["input", "W1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("BatchNormalization", ["c1", "g1", "b1", "m1", "v1"], ["n1"], name="bn1"),
        helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], name="conv2"),
        helper.make_node("BatchNormalization", ["c2", "g2", "b2", "m2", "v2"], ["out"], name="bn2"),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 8, 8])],
                      [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4, 8, 8])], inits)


@pytest.fixture(scope="module")
def calibrated():
    rng = np.random.default_rng(1)
    result = calibrate(conv_bn_model(), rng.normal(0, 1, (16, 3, 8, 8)).astype(np.float32), write_qdq=False)
    return result.graph, result.table, rng.normal(0, 1, (4, 3, 8, 8)).astype(np.float32)


def test_the_qdq_model_has_no_batchnorm_and_runs_as_the_integer_graph(calibrated, tmp_path):
    graph, table, x = calibrated
    qdq = export_qdq(graph, table)
    assert not [n for n in qdq.graph.node if n.op_type == "BatchNormalization"]
    dq_outputs = {o for n in qdq.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    conv_inputs = [list(n.input) for n in qdq.graph.node if n.op_type == "Conv"]
    assert len(conv_inputs) == 2 and all(w in dq_outputs and b in dq_outputs for _, w, b in conv_inputs)
    assert "c1" not in {o for n in qdq.graph.node for o in n.output}  # the Conv's former output is gone
    lsb = float(table.tensors["out"].qparams.scale[0])
    assert_runs_as_ptq(qdq, graph, table, x, "input", lsb, tmp_path)


def test_a_float_marked_layer_keeps_its_batchnorm(calibrated, tmp_path):
    """`n1` marked float: the integer run runs conv1 and bn1 in float (not folded), the QDQ model too; the
    other BatchNormalization is still folded."""
    graph, table, x = calibrated
    marked = with_float(table, ["n1"])
    qdq = export_qdq(graph, marked)
    bns = [n for n in qdq.graph.node if n.op_type == "BatchNormalization"]
    assert [list(n.input)[1:] for n in bns] == [["g1", "b1", "m1", "v1"]]
    lsb = float(table.tensors["out"].qparams.scale[0])
    assert_runs_as_ptq(qdq, graph, marked, x, "input", lsb, tmp_path)


def test_the_original_model_and_table_are_left_as_they_were(calibrated):
    graph, table, _ = calibrated
    before = set(table.tensors), [n.op_type for n in graph.model.graph.node]
    export_qdq(graph, table)
    assert (set(table.tensors), [n.op_type for n in graph.model.graph.node]) == before
    assert "c1" in table.tensors and "W1" in table.tensors
