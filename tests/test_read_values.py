"""`auto` scores a tensor whose one reader keeps its grid on what that reader passes on
(`ptq.calibration.read_values`; issue #26, scope 1)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from calibrators import TensorStatistics, get_calibrator
from calibrators.methods.auto import Auto
from ptq.calibration.pipeline import calibrate
from ptq.calibration.read_values import read_values_tensor
from ptq.core.graph import load_model

SHAPE = [1, 4, 512, 256]


def pooled_model() -> onnx.ModelProto:
    """x -> Relu -> r -> MaxPool 4x4 -> p -> Sigmoid -> y;  x -> Split -> (a, b) -> Add -> s (a second output)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[4, 4], strides=[4, 4]),
             helper.make_node("Sigmoid", ["p"], ["y"]),
             helper.make_node("Neg", ["x"], ["n"]),
             helper.make_node("Split", ["n"], ["a", "b"], axis=1),
             helper.make_node("Add", ["a", "b"], ["s"])]
    graph = helper.make_graph(
        nodes, "pooled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 128, 64]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 2, 512, 256])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_grid_keeping_reader_with_one_output_is_read_through(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(pooled_model(), path)
    graph = load_model(str(path))
    known, consumers = set(graph.activations), graph.consumers()
    assert read_values_tensor(graph, "r", known, consumers) == "p"  # the MaxPool passes on its windows' maxima
    assert read_values_tensor(graph, "n", known, consumers) == "n"  # a Split's parts are read together
    assert read_values_tensor(graph, "x", known, consumers) == "x"  # two readers
    assert read_values_tensor(graph, "r", known - {"p"}, consumers) == "r"  # no statistics for the output
    assert get_calibrator("auto").scores_read_values and not get_calibrator("extrema").scores_read_values


def test_auto_chooses_a_pooled_tensor_range_on_the_maxima_it_passes_on(tmp_path):
    """Normal values with two spikes at 16 in 2M: on the ReLU output one value in a million is a spike and
    auto's expected error is least for a range that clips it (the finer step pays for it); the 4x4 max pooling
    passes on one value in 16, the spikes among them, where clipping them costs 16 times as much. The range
    auto gives `r` must (nearly) keep the spikes, as `p` (run on `r`'s grid) needs."""
    rng = np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    files = []
    for k in range(4):
        x = rng.normal(0, 1, SHAPE).astype(np.float32)
        if k < 2:
            x[0, k, 100 + k, 50] = 16.0
        files.append(tmp_path / "data" / f"{k}.npy")
        np.save(files[-1], x)
    path = tmp_path / "m.onnx"
    onnx.save(pooled_model(), path)
    table = calibrate(str(path), data=files, out_dir=tmp_path / "out", calibrator="auto", write_qdq=False).table
    assert float(table.tensors["r"].max[0]) > 14.0, table.tensors["r"].calibrator
    stats = TensorStatistics(Auto.needs)
    for f in files:
        stats.update(np.maximum(np.load(f), 0))
    assert get_calibrator("auto").compute(stats, 8)[1][0] < 10.0  # scored on the ReLU output itself: clipped
