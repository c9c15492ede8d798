"""Class scores at a graph output keep 16 bits with their logits (issue 24, `ptq.calibration.output_scores`).

A CTC-style head: features [1, 128, 16] -> MatMul over 3,000 classes -> Add bias -> Softmax -> output. The
features lie on their 8-bit grid and the weights on their own per-column 8-bit grids, so the integer
accumulators are exact. Before, the logits (about -16..16) took an 8-bit grid of step 0.125: the top two
classes of a time step could share a code and the integer argmax took the first, not float's (on 4 to 9 of
the 128 steps of each sample); now the logits, the
bias Add and the Softmax output are at 16 bits and every step's argmax is float's.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ptq.calibration.pipeline import calibrate
from ptq.core.graph import load_model
from ptq.engine.executor import prepare
from ptq.qdq.export import export_qdq

STEPS, FEATURES, CLASSES = 128, 16, 3000


def _head(softmax_inside: bool = False) -> onnx.ModelProto:
    """`softmax_inside`: a MatMul reads the Softmax (an attention-like use) and gives the output instead."""
    rng = np.random.default_rng(7)
    codes = rng.integers(-127, 128, (FEATURES, CLASSES))
    codes[:2] = np.array([[127], [-127]])  # each column's grid steps exactly 0.02
    init = {"w": codes * 0.02, "b": rng.normal(0, 1, CLASSES)}
    if softmax_inside:
        init["v"] = rng.normal(0, 1, (CLASSES, 4))
    tensors = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in init.items()]
    nodes = [helper.make_node("MatMul", ["feat", "w"], ["logits_nobias"], name="fc"),
             helper.make_node("Add", ["logits_nobias", "b"], ["logits"], name="fc_bias"),
             helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1)]
    output = helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, STEPS, CLASSES])
    if softmax_inside:
        nodes.append(helper.make_node("MatMul", ["probs", "v"], ["mixed"], name="mix"))
        output = helper.make_tensor_value_info("mixed", TensorProto.FLOAT, [1, STEPS, 4])
    graph = helper.make_graph(nodes, "ctc_head", [helper.make_tensor_value_info("feat", TensorProto.FLOAT,
                                                                                 [1, STEPS, FEATURES])],
                              [output], tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _feat(n: int, seed: int) -> np.ndarray:
    """Codes of the 8-bit grid of [0, 1], each sample reaching both ends."""
    x = np.random.default_rng(seed).integers(0, 256, (n, STEPS, FEATURES)).astype(np.float64)
    x[:, 0, 0], x[:, 0, 1] = 0, 255
    return (x / 255).astype(np.float32)


def _float(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"feat": x})[0]


def test_output_softmax_its_logits_and_their_bias_add_take_16_bits_and_the_argmax_is_floats():
    model = _head()
    table = calibrate(model, _feat(8, 1), write_qdq=False).table
    for name in ("logits_nobias", "logits", "probs"):
        entry = table.tensors[name]
        assert entry.qparams.bits == 16 and "gives the scores of output 'probs'" in entry.why, name
    assert table.tensors["feat"].qparams.bits == 8  # the MatMul's input keeps the calibrator's grid
    integer = prepare(load_model(model), table)
    qdq = export_qdq(load_model(model), table)
    for seed in (2, 3, 4):
        x = _feat(1, seed)
        ref = _float(model, x)
        top2 = np.sort(np.log(ref[0]), -1)[:, -2:]
        assert np.mean(top2[:, 1] - top2[:, 0] < 0.125) > 0.05  # near ties an 8-bit grid of the logits merges
        for y in (integer.run({"feat": x}).outputs["probs"], _float(qdq, x)):
            np.testing.assert_array_equal(y.argmax(-1), ref.argmax(-1))
            assert np.abs(y - ref).max() < 1e-3


def test_a_softmax_inside_the_network_keeps_its_grid():
    table = calibrate(_head(softmax_inside=True), _feat(8, 1), write_qdq=False).table
    assert all(table.tensors[name].qparams.bits == 8 and table.tensors[name].why == ""
               for name in ("logits", "probs"))


def test_a_sigmoid_map_at_the_output_and_its_conv_output_take_16_bits():
    # a text detector's probability map: Conv -> Sigmoid -> output, thresholded downstream
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.normal(0, 1, (1, 4, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["feat", "w"], ["logit"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["logit"], ["map"], name="sigmoid")]
    graph = helper.make_graph(nodes, "text_map", [helper.make_tensor_value_info("feat", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("map", TensorProto.FLOAT, [1, 1, 8, 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    # 8-bit data (steps of 1/32 over [-4, 4)), so the input keeps 8 bits (`ptq.calibration.input_grid`)
    feat = np.clip(np.round(rng.normal(0, 1, (8, 4, 8, 8)) * 32), -128, 127) / 32
    table = calibrate(model, feat.astype(np.float32), write_qdq=False).table
    assert table.tensors["logit"].qparams.bits == table.tensors["map"].qparams.bits == 16
    assert "Sigmoid 'sigmoid' gives the scores of output 'map'" in table.tensors["map"].why
    assert table.tensors["feat"].qparams.bits == 8
