"""The table written by calibration carries the qparams the integer graph fixes by rule (MaxPool, layout ops)."""
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ptq.calibration.pipeline import calibrate
from ptq.engine.executor import prepare
from ptq.qdq.export import export_qdq
from tiny_models import make_model


def conv_maxpool_model():
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.4, (4, 3, 3, 3)).astype(np.float32)
    b = rng.normal(0, 0.1, 4).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["conv"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("MaxPool", ["conv"], ["pool"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
             helper.make_node("Flatten", ["pool"], ["y"], name="flatten")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")]
    return make_model(nodes, [x], [y], inits), rng.normal(0, 1, (6, 3, 8, 8)).astype(np.float32)


def test_maxpool_and_flatten_outputs_take_their_input_qparams_in_the_table():
    model, samples = conv_maxpool_model()
    # extrema: its proposal for the pool is a narrower range than the conv's, another grid (auto chooses the
    # conv's range on what the MaxPool passes on, `ptq.calibration.read_values`, and may propose the same one)
    result = calibrate(model, samples, write_qdq=False, calibrator="extrema")
    conv = result.table.qparams("conv")
    assert result.table.qparams("pool") == conv and result.table.qparams("y") == conv
    unaligned = calibrate(model, samples, write_qdq=False, align=False, calibrator="extrema").table
    assert unaligned.qparams("pool") != conv


def test_qdq_model_then_equals_the_integer_run():
    model, samples = conv_maxpool_model()
    result = calibrate(model, samples, write_qdq=False)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(export_qdq(result.graph, result.table).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    prepared = prepare(result.graph, result.table)
    for x in samples:
        (qdq,) = session.run(None, {"x": x[None]})
        integer = prepared.run({"x": x[None]}).outputs["y"]
        lsb = result.table.qparams("y").scale[0]
        assert np.max(np.abs(qdq - integer)) <= lsb * 1.0001  # the Conv's requant may round 1 LSB apart
