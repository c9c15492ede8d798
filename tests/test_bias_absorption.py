"""High-bias absorption inside equalization: the float function is unchanged to 1e-6, each absorbed constant
is the closed-form lower bound max(0, b + hi * sum of the negative taps) of a Conv fed by Clip(0, hi), the
activation's range shrinks by it, and a Conv2 that pads is left alone."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ptq.adjust.bias_absorption import output_lower_bound
from ptq.core.graph import load_model
from ptq.adjust.equalize import equalize
from tests.test_bias_correction import run as run_with_outputs
from tests.tiny_models import make_model


def high_bias_chain(act: str, pads2=(0, 0, 0, 0)) -> onnx.ModelProto:
    """input -> Clip(0, 6) -> Conv 3x3 pads 1 (8 ch; channels 0-3 all-positive taps, biases 1..4) -> act ->
    Conv (4, kernel 1x1 or 3x3 with pads2) -> out."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.1, (8, 3, 3, 3))
    w1[:4] = np.abs(w1[:4])
    b1 = np.array([1.0, 2.0, 3.0, 4.0, 0.5, -0.5, 2.0, 0.1])
    k = 3 if any(pads2) else 1
    w2 = rng.normal(0, 0.3, (4, 8, k, k))
    b2 = rng.normal(0, 0.1, 4)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for a, n in ((w1, "W1"), (b1, "B1"), (w2, "W2"), (b2, "B2"))]
    inits += [numpy_helper.from_array(np.float32(v), n) for v, n in ((0, "zero"), (6, "six"), (5, "five"))]
    act_node = (helper.make_node("Relu", ["c1"], ["a1"], name="act") if act == "Relu" else
                helper.make_node("Clip", ["c1", "zero", "five"], ["a1"], name="act"))
    nodes = [
        helper.make_node("Clip", ["input", "zero", "six"], ["x"], name="clip_in"),
        helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        act_node,
        helper.make_node("Conv", ["a1", "W2", "B2"], ["out"], pads=list(pads2), name="conv2"),
    ]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 6, 6])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4, 6, 6])
    return make_model(nodes, [inp], [out], inits)


def run(model, x, names=("out",)):
    return run_with_outputs(model, x, list(names))


def inits(model):
    return {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}


def test_lower_bound_of_a_grouped_conv_by_hand():
    w = np.array([[[1.0, -2.0]], [[-1.0, 3.0]]])  # 2 outputs, group 2, one input channel each, 2 taps
    lo, hi = np.array([0.0, -1.0]), np.array([2.0, 1.0])
    bound = output_lower_bound(w, np.array([0.5, 0.0]), lo, hi, group=2)
    np.testing.assert_allclose(bound, [0.5 + 0 - 4, 0.0 - 1 - 3])
    assert output_lower_bound(w[:1], np.zeros(1), np.array([0.0]), np.array([np.inf]), 1)[0] == -np.inf


def test_relu_pair_absorbs_the_proven_constant_and_keeps_the_function():
    model = high_bias_chain("Relu")
    graph = load_model(model)
    plain, _ = equalize(graph, absorb_biases=False)
    absorbed, log = equalize(graph)
    assert set(log.absorption.absorbed) == {"conv1"}
    x = np.random.default_rng(1).normal(2, 4, (5, 3, 6, 6)).astype(np.float32)  # Clip(0, 6) hits both ends
    ref = run(model, x)["out"]
    np.testing.assert_allclose(run(absorbed, x)["out"], ref, rtol=0, atol=1e-6 * max(1.0, np.abs(ref).max()))
    p, a = inits(plain), inits(absorbed)
    # closed form on the equalized weights: inputs in [0, 6] (padded zeros included) -> L = b + 6 * sum(W-)
    expected = np.maximum(0, p["B1"] + 6 * np.minimum(p["W1"], 0).reshape(8, -1).sum(axis=1))
    assert np.all(expected[:4] > 0)  # the all-positive channels with biases 1..4 (rescaled by equalization)
    np.testing.assert_allclose(p["B1"] - a["B1"], expected, atol=1e-6)
    np.testing.assert_allclose(a["B2"] - p["B2"], p["W2"].reshape(4, 8) @ expected, atol=1e-5)
    # the Relu's output loses the constant: its minimum over the data is 0 where it was the constant
    before, after = run(plain, x, ("a1",))["a1"], run(absorbed, x, ("a1",))["a1"]
    np.testing.assert_allclose(before.min(axis=(0, 2, 3)) - after.min(axis=(0, 2, 3)), expected, atol=1e-5)


def test_clip_pair_lowers_the_per_channel_bound_too():
    model = high_bias_chain("Clip")
    graph = load_model(model)
    absorbed, log = equalize(graph)
    assert "conv1" in log.absorption.absorbed
    x = np.random.default_rng(2).normal(2, 4, (5, 3, 6, 6)).astype(np.float32)
    ref = run(model, x)["out"]
    np.testing.assert_allclose(run(absorbed, x)["out"], ref, rtol=0, atol=1e-6 * max(1.0, np.abs(ref).max()))
    plain = inits(equalize(graph, absorb_biases=False)[0])
    a = inits(absorbed)
    c = plain["B1"] - a["B1"]
    bound_names = [n for n in a if n.endswith("equalized_bound")]
    np.testing.assert_allclose(inits(equalize(graph, absorb_biases=False)[0])[bound_names[0]].ravel() - c,
                               a[bound_names[0]].ravel(), atol=1e-6)


def test_a_padded_second_conv_is_left_alone():
    model = high_bias_chain("Relu", pads2=(1, 1, 1, 1))
    graph = load_model(model)
    absorbed, log = equalize(graph)
    assert log.absorption.absorbed == {} and [n for n, _ in log.absorption.skipped] == ["conv2"]
    np.testing.assert_array_equal(inits(absorbed)["B1"], inits(equalize(graph, absorb_biases=False)[0])["B1"])
