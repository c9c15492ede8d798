"""A recurrent cell's input sequence at 16 bits (`ptq.calibration.recurrent_inputs`), and the tensors before
it that reach it through ops passing codes on (their output keeps their input's grid)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.calibration.pipeline import calibrate
from ptq.engine.executor import prepare


def _lstm_model(second_reader: bool):
    """x [1, 6, 3] -> Transpose -> LSTM (hidden 4); `second_reader`: x also feeds a Relu graph output."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], name="to_time", perm=[1, 0, 2]),
             helper.make_node("LSTM", ["xt", "W", "R"], ["y"], name="lstm", hidden_size=4)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 1, 1, 4])]
    if second_reader:
        nodes.append(helper.make_node("Relu", ["x"], ["r"], name="relu"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 6, 3]))
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (1, 16, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(0, 0.5, (1, 16, 4)).astype(np.float32), "R")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 3])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("second_reader", [False, True])
def test_the_cell_input_and_its_code_moving_chain_get_16_bits(second_reader):
    samples = np.random.default_rng(1).normal(0, 1, (8, 1, 6, 3)).astype(np.float32)
    result = calibrate(_lstm_model(second_reader), samples[:, 0], write_qdq=False)
    for name in ("x", "xt"):  # the Transpose keeps x's grid: xt is 16-bit only if x is
        entry = result.table.tensors[name]
        assert entry.qparams.bits == 16 and "input sequence of LSTM 'lstm'" in entry.why
    assert result.table.tensors["y"].qparams.bits == 8
    prepared = prepare(result.graph, result.table)
    assert prepared.qparams["xt"].bits == 16 and not prepared.float_nodes  # the Relu reads 16-bit codes too
