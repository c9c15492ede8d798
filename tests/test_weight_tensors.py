"""ptq.engine.weight_tensors: the weights a table quantizes, a weight computed from initializers included (torch's
exporter without constant folding writes nn.Linear as MatMul(x, Transpose(W)))."""
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ptq.core.graph import load_model
from ptq.engine.executor import ExecutorOptions, prepare
from ptq.calibration.pipeline import calibrate
from ptq.engine.weight_tensors import weight_tensors
from tiny_models import make_model


def transposed_linear_model(w):
    nodes = [helper.make_node("Transpose", ["W"], ["wt"], perm=[1, 0], name="transpose"),
             helper.make_node("MatMul", ["x", "wt"], ["y"], name="matmul")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w.shape[1]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w.shape[0]])
    return make_model(nodes, [x], [y], [numpy_helper.from_array(w, "W")])


def test_a_weight_computed_from_an_initializer_is_listed_under_its_own_name():
    w = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    found = list(weight_tensors(load_model(transposed_linear_model(w)), per_channel=True))
    assert [(name, axis) for name, _, axis in found] == [("wt", 1)]  # MatMul's output channels: B's last axis
    np.testing.assert_array_equal(found[0][1], w.T)


def test_a_transposed_linear_weight_calibrates_and_runs_in_integers():
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.5, (3, 5)).astype(np.float32)
    model = transposed_linear_model(w)
    samples = rng.uniform(-1, 1, (8, 5)).astype(np.float32)
    result = calibrate(model, samples, write_qdq=False)
    assert result.table.tensors["wt"].kind == "weight"
    y_qp = result.table.qparams("y")
    out = prepare(result.graph, result.table, options=ExecutorOptions(strict=True)).run({"x": samples[:1]})
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": samples[:1]})
    # 8-bit input and per-channel weight: a few output LSBs at most (MatMul's own bound is 1 LSB)
    assert np.max(np.abs(out.outputs["y"] - want)) <= 4 * y_qp.scale[0]
