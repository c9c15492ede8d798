"""A per-channel constant added after a Conv/Gemm is the layer's bias (issue 24, `ptq.engine.bias_add_fold`): folded
by the rewrites (float outputs unchanged), run on the int32 bias path by the integer executor, corrected by bias
correction, and exported folded to QDQ. Shapes that are no per-channel bias are left alone."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.adjust.bias_correction import correct_biases
from ptq.core.graph import load_model
from ptq.engine.executor import NodeKind, prepare
from ptq.engine.float_fallback import NodeFloatEvaluator
from ptq.calibration.pipeline import calibrate
from ptq.qdq.export import export_qdq
from ptq.engine.rewrites import apply_rewrites

OPSET = 17
C = 8


def _model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v, dtype=np.float32), k) for k, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)


def _conv_add(c_shape, adder="Add", conv_bias=False, constant_first=False, extra_consumer=False, width=16):
    """x -> Conv (3 -> C, 3x3) [-> Add/Sub(c)] -> Relu -> Conv (C -> 4, 1x1) -> y; a Paddle-style bias."""
    rng = np.random.default_rng(0)
    init = {"W": rng.normal(0, 0.3, (C, 3, 3, 3)), "W2": rng.normal(0, 0.3, (4, C, 1, 1)),
            "c": rng.uniform(-1.5, 1.5, c_shape)}
    conv_in = ["x", "W"] + (["b"] if conv_bias else [])
    if conv_bias:
        init["b"] = rng.uniform(-0.5, 0.5, C)
    add_in = ["c", "conv"] if constant_first else ["conv", "c"]
    nodes = [helper.make_node("Conv", conv_in, ["conv"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node(adder, add_in, ["biased"], name="add"),
             helper.make_node("Relu", ["biased"], ["relu"], name="relu"),
             helper.make_node("Conv", ["relu", "W2"], ["y"], name="conv2")]
    outputs = [("y", [1, 4, width, width])]
    if extra_consumer:
        outputs.append(("conv", [1, C, width, width]))
    return _model(nodes, [("x", [1, 3, width, width])], outputs, init)


def _rewritten(model):
    graph = load_model(model)
    return apply_rewrites(graph, NodeFloatEvaluator(graph.opset))


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("c_shape", [(C, 1, 1), (1, C, 1, 1), (1,), ()])
@pytest.mark.parametrize("adder, conv_bias, constant_first", [("Add", False, False), ("Add", True, True),
                                                              ("Sub", False, False)])
def test_constant_add_after_conv_becomes_its_bias(c_shape, adder, conv_bias, constant_first):
    model = _conv_add(c_shape, adder, conv_bias, constant_first)
    graph, log = _rewritten(model)
    [fold] = log.bias_adds
    assert (fold.host, fold.adder, fold.removed_tensor) == ("conv", "add", "conv")
    conv = next(n for n in graph.nodes if n.name == "conv")
    assert conv.inputs[2] == fold.bias and "add" not in {n.name for n in graph.nodes}
    c = np.broadcast_to(numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "c")).reshape(-1), C)
    b = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "b")) if conv_bias else 0.0
    np.testing.assert_allclose(graph.initializers[fold.bias], b + (c if adder == "Add" else -c), rtol=1e-6)
    # the float graph computes the same: the folded graph is the QDQ export's, run in onnxruntime
    x = np.random.default_rng(1).normal(0, 1, (1, 3, 16, 16)).astype(np.float32)
    run = prepare(load_model(model), calibrate(model, x[None].repeat(4, 0)[:, 0], write_qdq=False).table)
    assert [s.node.name for s in run.steps if s.kind is NodeKind.INTEGER] == ["conv", "conv2"]


@pytest.mark.parametrize("case", ["vector along W", "constant first in Sub", "second consumer", "spatial"])
def test_adds_that_are_no_bias_stay(case):
    model = {
        # [C] on an NCHW output broadcasts along W (here W == C): a per-column constant, not a bias
        "vector along W": lambda: _conv_add((C,), width=C),
        "constant first in Sub": lambda: _conv_add((C, 1, 1), "Sub", constant_first=True),
        "second consumer": lambda: _conv_add((C, 1, 1), extra_consumer=True),
        "spatial": lambda: _conv_add((C, 16, 16)),
    }[case]()
    graph, log = _rewritten(model)
    assert log.bias_adds == [] and "add" in {n.name for n in graph.nodes}


def _gemm_add(c_shape, beta=1.0):
    rng = np.random.default_rng(2)
    init = {"W": rng.normal(0, 0.3, (16, C)), "c": rng.uniform(-1, 1, c_shape)}
    nodes = [helper.make_node("Gemm", ["x", "W"], ["g"], name="gemm", beta=beta),
             helper.make_node("Add", ["g", "c"], ["y"], name="add")]
    return _model(nodes, [("x", [1, 16])], [("y", [1, C])], init)


@pytest.mark.parametrize("c_shape", [(C,), (1, C)])
def test_constant_add_after_gemm_becomes_its_bias(c_shape):
    model = _gemm_add(c_shape)
    graph, log = _rewritten(model)
    [fold] = log.bias_adds
    gemm = next(n for n in graph.nodes if n.name == "gemm")
    assert gemm.inputs[2] == fold.bias and gemm.outputs == ["y"]
    x = np.random.default_rng(3).normal(0, 1, (32, 16)).astype(np.float32)
    table = calibrate(model, x, write_qdq=False).table
    integer = prepare(load_model(model), table)
    [step] = [s for s in integer.steps if s.kind is NodeKind.INTEGER]
    assert step.node.name == "gemm" and np.any(step.quantized.bias != 0)
    y = integer.run({"x": x[:1]}).outputs["y"]
    expected = _ort(model, {"x": x[:1]})[0]
    assert np.abs(y - expected).max() <= 2 * float(table.qparams("y").scale[0])


def test_gemm_with_beta_keeps_its_add():
    assert _rewritten(_gemm_add((C,), beta=0.5))[1].bias_adds == []


def _samples(n=8):
    return np.random.default_rng(4).normal(0, 1, (n, 3, 16, 16)).astype(np.float32)


def test_integer_run_uses_the_int32_bias_and_matches_float():
    model = _conv_add((1, C, 1, 1))
    result = calibrate(model, _samples(), write_qdq=False)
    integer = prepare(load_model(model), result.table)
    conv = next(s for s in integer.steps if s.node.name == "conv")
    assert conv.node.outputs == ["relu"]  # Add folded, Relu fused: one requantized tensor for the layer
    # the bias in int32 on s_x * s_w[c]: b_q = round(c / (s_x s_w))
    c = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "c")).reshape(-1)
    s_b = np.float32(result.table.qparams("x").scale[0]) * result.table.qparams("W").scale.astype(np.float32)
    np.testing.assert_array_equal(conv.quantized.bias, np.rint(c / s_b.astype(np.float64)))
    x = _samples(1)
    y = integer.run({"x": x}).outputs["y"]
    ref = _ort(model, {"x": x})[0]
    assert float(np.dot(y.ravel(), ref.ravel()) / np.linalg.norm(y) / np.linalg.norm(ref)) > 0.999


def _constant(model, name="c") -> np.ndarray:
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


def test_bias_correction_corrects_the_added_constant():
    # Sub(conv, c) and Add(conv, -c) are the same layer: their corrected constants must stay opposite
    sub = _conv_add((C, 1, 1), "Sub")
    add = _conv_add((C, 1, 1), "Add")
    add.graph.initializer[[i.name for i in add.graph.initializer].index("c")].CopyFrom(
        numpy_helper.from_array(-_constant(sub), "c"))
    table = calibrate(sub, _samples(), write_qdq=False).table
    corrected = {}
    for name, model in (("sub", sub), ("add", add)):
        corrected[name], log = correct_biases(load_model(model), table, [_samples()])
        assert "conv" in log.corrected and all(node != "conv" for node, _ in log.skipped)
        moved = _constant(corrected[name]) - _constant(model)
        assert moved.shape == (C, 1, 1) and np.isclose(np.abs(moved).max(), log.corrected["conv"], atol=1e-6)
    np.testing.assert_allclose(_constant(corrected["sub"]), -_constant(corrected["add"]), atol=1e-7)
    assert np.abs(_constant(corrected["sub"]) - _constant(sub)).max() > 1e-5


def test_qdq_export_writes_the_folded_layer():
    model = _conv_add((1, C, 1, 1))
    result = calibrate(model, _samples(), write_qdq=False)
    graph = load_model(model)
    qdq = export_qdq(graph, result.table)
    assert not any(n.op_type == "Add" for n in qdq.graph.node)
    conv = next(n for n in qdq.graph.node if n.name == "conv")
    bias_dq = next(n for n in qdq.graph.node if n.output[0] == conv.input[2])
    assert bias_dq.op_type == "DequantizeLinear"
    stored = next(i for i in qdq.graph.initializer if i.name == bias_dq.input[0])
    assert stored.data_type == TensorProto.INT32
    x = _samples(1)
    integer = prepare(graph, result.table).run({"x": x}).outputs["y"]
    np.testing.assert_allclose(_ort(qdq, {"x": x})[0], integer, atol=2 * float(result.table.qparams("y").scale[0]))


def _matmul_add(c_shape, adder="Add"):
    """x [1, T, 16] @ W [16, C] + c: a linear layer over a sequence (a recognizer's classifier)."""
    rng = np.random.default_rng(5)
    init = {"W": rng.normal(0, 0.3, (16, C)), "c": rng.uniform(-1, 1, c_shape)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"], name="matmul"),
             helper.make_node(adder, ["mm", "c"], ["y"], name="add")]
    return _model(nodes, [("x", [1, 6, 16])], [("y", [1, 6, C])], init)


@pytest.mark.parametrize("c_shape, adder", [((C,), "Add"), ((1, C), "Sub"), ((1, 1, C), "Add")])
def test_constant_add_after_matmul_becomes_its_bias(c_shape, adder):
    model = _matmul_add(c_shape, adder)
    graph, log = _rewritten(model)
    [fold] = log.bias_adds
    matmul = next(n for n in graph.nodes if n.name == "matmul")
    assert matmul.inputs[2] == fold.bias and matmul.outputs == ["y"]
    x = np.random.default_rng(6).normal(0, 1, (16, 6, 16)).astype(np.float32)
    table = calibrate(model, x, write_qdq=False).table
    integer = prepare(load_model(model), table)
    [step] = [s for s in integer.steps if s.kind is NodeKind.INTEGER]
    c = np.broadcast_to(_constant(model).reshape(-1), C) * (1 if adder == "Add" else -1)
    s_b = np.float32(table.qparams("x").scale[0]) * table.qparams("W").scale.astype(np.float32)
    np.testing.assert_array_equal(step.quantized.bias, np.rint(c / s_b.astype(np.float64)))
    expected = _ort(model, {"x": x[:1]})[0]
    y = integer.run({"x": x[:1]}).outputs["y"]
    step_y = float(table.qparams("y").scale[0])
    assert np.abs(y - expected).max() <= 2 * step_y
    # QDQ: MatMul has no bias input in ONNX, so the int32 bias is added right after it, with no Q/DQ between
    qdq = export_qdq(load_model(model), table)
    add = next(n for n in qdq.graph.node if n.name == "add")
    assert add.op_type == "Add" and add.input[0] == "mm"
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "mm" for n in qdq.graph.node)
    bias_dq = next(n for n in qdq.graph.node if n.output[0] == add.input[1])
    assert bias_dq.op_type == "DequantizeLinear"
    np.testing.assert_allclose(_ort(qdq, {"x": x[:1]})[0], y, atol=1.01 * step_y)


def test_matmul_of_two_activations_keeps_its_add():
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("MatMul", ["x", "z"], ["mm"], name="matmul"),
             helper.make_node("Add", ["mm", "c"], ["y"], name="add")]
    model = _model(nodes, [("x", [1, 6, 16]), ("z", [1, 16, C])], [("y", [1, 6, C])], {"c": rng.uniform(-1, 1, C)})
    assert _rewritten(model)[1].bias_adds == []


def test_constant_add_after_conv_transpose_becomes_its_bias():
    # a DBNet-style upsampling head: ConvTranspose (stride 2) -> Add(c [1, C, 1, 1])
    rng = np.random.default_rng(8)
    init = {"W": rng.normal(0, 0.3, (3, C, 2, 2)), "c": rng.uniform(-1, 1, (1, C, 1, 1))}
    nodes = [helper.make_node("ConvTranspose", ["x", "W"], ["up"], name="up", strides=[2, 2]),
             helper.make_node("Add", ["up", "c"], ["y"], name="add")]
    model = _model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, C, 16, 16])], init)
    [fold] = _rewritten(model)[1].bias_adds
    assert fold.host == "up"
    x = _samples(8)[:, :, :8, :8].copy()
    table = calibrate(model, x, write_qdq=False).table
    integer = prepare(load_model(model), table)
    assert [s.node.name for s in integer.steps if s.kind is NodeKind.INTEGER] == ["up"]
    y, ref = integer.run({"x": x[:1]}).outputs["y"], _ort(model, {"x": x[:1]})[0]
    assert np.abs(y - ref).max() <= 2 * float(table.qparams("y").scale[0])
    np.testing.assert_allclose(_ort(export_qdq(load_model(model), table), {"x": x[:1]})[0], y,
                               atol=1.01 * float(table.qparams("y").scale[0]))
