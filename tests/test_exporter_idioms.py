"""Exporter idioms of transformer blocks (issue 25, scope 2): tf2onnx's LayerNorm with Reciprocal (or
Pow(-0.5)), RMSNorm written out, and tanh-GELU in the jax2tf/tf2onnx form each become one integer op; the QDQ
export leaves the fused patterns' internal tensors (a Tanh input calibrated to +-1e4) unquantized, as the
integer graph does; the bundled tf2onnx-style classifier runs wholly in integers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.core.graph import load_model
from ptq.engine.executor import NodeKind, prepare
from ptq.engine.float_fallback import NodeFloatEvaluator
from ptq.calibration.pipeline import calibrate
from ptq.qdq.export import export_qdq
from ptq.engine.rewrites import apply_rewrites

D = 16
CLASSIFIER = Path(__file__).resolve().parents[1] / "bench" / "models" / "gelu_classifier.onnx"


def _model(nodes, init: dict, opset: int = 15) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "idiom", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5, D])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in init.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _inverse_root(var: str, d: str, out: str, form: str) -> list:
    """d / sqrt(var + eps) as tf2onnx writes it (Reciprocal), as Pow(-0.5), or with Div."""
    nodes = [helper.make_node("Add", [var, "eps"], ["ve"], name="add_eps")]
    if form == "pow":
        return nodes + [helper.make_node("Pow", ["ve", "minus_half"], ["inv"], name="rsqrt"),
                        helper.make_node("Mul", [d, "inv"], [out], name="normalize")]
    nodes.append(helper.make_node("Sqrt", ["ve"], ["std"], name="sqrt"))
    if form == "div":
        return nodes + [helper.make_node("Div", [d, "std"], [out], name="normalize")]
    return nodes + [helper.make_node("Reciprocal", ["std"], ["inv"], name="reciprocal"),
                    helper.make_node("Mul", [d, "inv"], [out], name="normalize")]


def layer_norm(form: str) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1], name="mean"),
             helper.make_node("Sub", ["x", "mean"], ["d"], name="sub"),
             helper.make_node("Mul", ["d", "d"], ["sq"], name="square"),
             helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], name="var")]
    nodes += _inverse_root("var", "d", "n", form)
    nodes += [helper.make_node("Mul", ["n", "gamma"], ["g"], name="gamma"),
              helper.make_node("Add", ["g", "beta"], ["y"], name="beta")]
    init = {"eps": 1e-5, "minus_half": -0.5, "gamma": rng.uniform(0.5, 1.5, D), "beta": rng.normal(0, 0.2, D)}
    return _model(nodes, init)


def rms_norm(form: str) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"], name="square"),
             helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], name="ms")]
    nodes += _inverse_root("ms", "x", "n", form)
    nodes.append(helper.make_node("Mul", ["n", "gamma"], ["y"], name="gamma"))
    return _model(nodes, {"two": 2.0, "eps": 1e-6, "minus_half": -0.5, "gamma": rng.uniform(0.5, 1.5, D)})


def tf2onnx_gelu() -> onnx.ModelProto:
    """x -> MatMul W (outputs up to +-100) -> x * ((1 + tanh(0.79788 (x + 0.044715 x^3))) * 0.5), the cube as
    x * x * x, the half applied after the 1 + tanh (jax.nn.gelu through tf2onnx)."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="dense"),
             helper.make_node("Mul", ["h", "h"], ["h2"], name="square"),
             helper.make_node("Mul", ["h2", "h"], ["h3"], name="cube"),
             helper.make_node("Mul", ["h3", "c"], ["cubic"], name="cubic"),
             helper.make_node("Add", ["h", "cubic"], ["inner"], name="inner"),
             helper.make_node("Mul", ["inner", "k"], ["arg"], name="arg"),
             helper.make_node("Tanh", ["arg"], ["t"], name="tanh"),
             helper.make_node("Add", ["t", "one"], ["one_plus"], name="one_plus"),
             helper.make_node("Mul", ["one_plus", "half"], ["cdf"], name="cdf"),
             helper.make_node("Mul", ["h", "cdf"], ["y"], name="gelu")]
    init = {"W": rng.normal(0, 12.0, (D, D)), "c": 0.044715, "k": 0.7978845608, "one": 1.0, "half": 0.5}
    return _model(nodes, init)


def fast_gelu() -> onnx.ModelProto:
    """HF FastGELU as torch exports it: 0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x * x)))."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="dense"),
             helper.make_node("Mul", ["h", "k"], ["hk"], name="hk"),
             helper.make_node("Mul", ["c", "h"], ["ch"], name="ch"),
             helper.make_node("Mul", ["ch", "h"], ["chh"], name="chh"),
             helper.make_node("Add", ["one", "chh"], ["poly"], name="poly"),
             helper.make_node("Mul", ["hk", "poly"], ["arg"], name="arg"),
             helper.make_node("Tanh", ["arg"], ["t"], name="tanh"),
             helper.make_node("Add", ["one", "t"], ["one_plus"], name="one_plus"),
             helper.make_node("Mul", ["half", "h"], ["half_h"], name="half_h"),
             helper.make_node("Mul", ["half_h", "one_plus"], ["y"], name="gelu")]
    init = {"W": rng.normal(0, 1.0, (D, D)), "c": 0.044715, "k": 0.7978845608, "one": 1.0, "half": 0.5}
    return _model(nodes, init)


def _float(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _cosine(a, b) -> float:
    return float(np.sum(a * b) / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("build, form, op_type", [
    (layer_norm, "reciprocal", "LayerNormalization"), (layer_norm, "pow", "LayerNormalization"),
    (rms_norm, "reciprocal", "RMSNormalization"), (rms_norm, "div", "RMSNormalization"),
    (rms_norm, "pow", "RMSNormalization")])
def test_written_out_norms_become_one_integer_op(build, form, op_type):
    model = build(form)
    graph = load_model(model)
    rewritten, _ = apply_rewrites(graph, NodeFloatEvaluator(graph.opset))
    assert [(n.op_type, n.outputs) for n in rewritten.nodes] == [(op_type, ["y"])]
    rng = np.random.default_rng(3)
    data = (rng.normal(0, 1.5, (16, 5, D)) + rng.normal(0.5, 1, (16, 5, 1))).astype(np.float32)
    result = calibrate(model, data, write_qdq=False)
    prepared = prepare(load_model(model), result.table)
    assert [s.kind for s in prepared.steps] == [NodeKind.INTEGER]  # before: Reciprocal ran in float
    x = data[:4]
    assert _cosine(prepared.run({"x": x}).outputs["y"], _float(model, x)) > 0.999


def test_tf2onnx_gelu_is_one_table_and_its_qdq_leaves_the_tanh_input_alone():
    model = tf2onnx_gelu()
    rng = np.random.default_rng(4)
    data = rng.normal(0, 1, (16, 5, D)).astype(np.float32)
    result = calibrate(model, data, write_qdq=False)
    assert result.table.tensors["arg"].max[0] > 1000  # the Tanh input of a +-100 GELU input
    prepared = prepare(load_model(model), result.table)
    assert [s.node.op_type for s in prepared.steps] == ["MatMul", "Gelu"]
    x = rng.normal(0, 1, (4, 5, D)).astype(np.float32)
    want = _float(model, x)
    assert _cosine(prepared.run({"x": x}).outputs["y"], want) > 0.999
    qdq = export_qdq(load_model(model), result.table)
    quantized = {n.input[0] for n in qdq.graph.node if n.op_type == "QuantizeLinear"}
    assert "y" in {n.output[0] for n in qdq.graph.node} and not quantized & {"arg", "inner", "t", "cdf", "h3"}
    assert _cosine(_float(qdq, x), want) > 0.999  # before: the Tanh input on a grid of ~90 per step


def test_a_regrouped_tanh_gelu_is_recognized_by_its_values():
    """The head x * k * (1 + c x^2) is no structural match of x + c x^3 (before: five nodes left unfused)."""
    model = fast_gelu()
    graph = load_model(model)
    rewritten, log = apply_rewrites(graph, NodeFloatEvaluator(graph.opset))
    assert [(n.op_type, n.inputs, n.outputs) for n in rewritten.nodes][-1] == ("Gelu", ["h"], ["y"])
    assert rewritten.nodes[-1].attrs == {"approximate": "tanh"} and len(rewritten.nodes) == 2
    assert sorted(log.patterns[0].removed_tensors) == sorted(["hk", "ch", "chh", "poly", "arg", "t", "one_plus",
                                                              "half_h"])
    x = np.random.default_rng(6).normal(0, 1, (2, 5, D)).astype(np.float32)
    values = {"x": x, **rewritten.initializers}  # the rewritten graph in float equals the original
    runner = NodeFloatEvaluator(graph.opset)
    for node in rewritten.nodes:
        values.update(zip(node.outputs, runner.run(node, [values[i] for i in node.inputs])))
    np.testing.assert_allclose(values["y"], _float(model, x), atol=1e-5)


def test_a_polynomial_that_is_not_the_gelu_argument_is_left_alone():
    model = fast_gelu()
    for tensor in model.graph.initializer:
        if tensor.name == "c":
            tensor.CopyFrom(numpy_helper.from_array(np.asarray(0.05, np.float32), "c"))
    graph = load_model(model)
    rewritten, log = apply_rewrites(graph, NodeFloatEvaluator(graph.opset))
    assert not log.patterns and "Tanh" in [n.op_type for n in rewritten.nodes]


def test_the_tf2onnx_classifier_runs_in_integers_and_agrees_with_float():
    samples = sorted((CLASSIFIER.parent / "gelu_classifier_data" / "calib").glob("*.npy"))[:16]
    tokens = np.concatenate([np.load(p) for p in samples])
    result = calibrate(CLASSIFIER, tokens, write_qdq=False)
    prepared = prepare(load_model(CLASSIFIER), result.table)
    assert all(s.kind is NodeKind.INTEGER for s in prepared.steps)
    assert {"Gelu", "LayerNormalization", "RMSNormalization"} <= {s.node.op_type for s in prepared.steps}
    held_out = np.concatenate([np.load(p) for p in sorted((CLASSIFIER.parent / "gelu_classifier_data" / "eval")
                                                          .glob("*.npy"))[:20]])
    session = ort.InferenceSession(str(CLASSIFIER), providers=["CPUExecutionProvider"])
    want = session.run(None, {"tokens": held_out})[0]
    got = np.concatenate([prepared.run({"tokens": held_out[i:i + 1]}).outputs["logits"] for i in range(20)])
    assert np.mean(got.argmax(-1) == want.argmax(-1)) == 1.0
