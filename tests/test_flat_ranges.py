"""Calibration folds a tensor's range to where its consumers' outputs are not flat (issue #26, scope 1): Relu
and Clip clamp, HardSwish is 0 below -3, HardSigmoid saturates outside its linear part. The fold is exact:
op(x) == op(clamp(x, lo, hi))."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ops.registry import op_of
from ptq.engine.clip_ranges import folded_ranges
from ptq.core.graph import load_model
from tiny_models import make_model


def activation_model(op_type: str, **attrs):
    node = helper.make_node(op_type, ["x"], ["y"], name="act", **attrs)
    grow = helper.make_node("Mul", ["input", "input"], ["x"], name="square")  # x is an activation
    return load_model(make_model([grow, node], [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 64])],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])]))


@pytest.mark.parametrize("op_type, attrs, span", [
    ("HardSwish", {}, (-3.0, np.inf)),
    ("HardSigmoid", {}, (-2.5, 2.5)),
    ("HardSigmoid", {"alpha": 1 / 6, "beta": 0.5}, (-3.0, 3.0)),
])
def test_the_range_folds_to_where_the_output_is_not_flat_and_the_fold_is_exact(op_type, attrs, span):
    graph = activation_model(op_type, **attrs)
    lo, hi = folded_ranges(graph)["x"]
    assert lo == pytest.approx(span[0]) and hi == pytest.approx(span[1])
    x = np.linspace(-20, 20, 4001, dtype=np.float32)
    node = graph.nodes[-1]
    forward = op_of(node).forward_float
    np.testing.assert_array_equal(forward(node, [np.clip(x, lo, hi).astype(np.float32)])[0],
                                  forward(node, [x])[0])


def test_a_tensor_with_another_consumer_keeps_its_range():
    graph = activation_model("HardSwish")
    graph.outputs.append("x")
    assert "x" not in folded_ranges(graph)
