"""Transformer rewrites (ptq.engine.rewrites.fuse_transformer): each decomposed pattern, built with onnx.helper,
becomes one node that keeps the pattern's output tensor name; the rewritten graph computes the original in
float (1e-5, against onnxruntime on the original model), and the calibrated integer run agrees with float."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.core.graph import Graph, load_model
from ptq.engine.executor import NodeKind, prepare
from ptq.engine.float_fallback import NodeFloatEvaluator
from ptq.calibration.pipeline import calibrate
from ptq.engine.rewrites import apply_rewrites

SQRT2 = float(np.sqrt(2.0))


def _model(nodes, x_shape, y_shape, initializers, opset=17, x_name="x", y_name="y") -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "pattern",
        [helper.make_tensor_value_info(x_name, TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(y_name, TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(np.asarray(v, dtype=np.float32), k) for k, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_graph_float(graph: Graph, feeds: dict) -> dict[str, np.ndarray]:
    """The rewritten IR in float, node by node (registered ops' forward_float, else onnx's reference)."""
    runner = NodeFloatEvaluator(graph.opset)
    values = dict(graph.initializers)
    values.update(feeds)
    for node in graph.nodes:
        outs = runner.run(node, [values[i] if i else None for i in node.inputs])
        values.update({name: v for name, v in zip(node.outputs, outs) if name})
    return values


def _rewritten(model: onnx.ModelProto) -> tuple[Graph, object]:
    graph = load_model(model)
    return apply_rewrites(graph, NodeFloatEvaluator(graph.opset))


def _check_float_equal(model, rewritten: Graph, x: np.ndarray, x_name="x", y_name="y"):
    want = _ort(model, {x_name: x})[0]
    got = run_graph_float(rewritten, {x_name: x})[y_name]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _integer_run(model, data: np.ndarray, x_name="x", y_name="y"):
    """Calibrate on `data` (batch on axis 0), run every sample in integers: (int outputs, float outputs, graph)."""
    result = calibrate(model, data, write_qdq=False)
    graph = prepare(result.graph, result.table)
    got = np.stack([graph.run({x_name: s[None]}).outputs[y_name] for s in data])
    want = np.stack([_ort(model, {x_name: s[None]})[0] for s in data])
    return got, want, graph


def _cosine(a, b) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# --- GELU -------------------------------------------------------------------------------------------------

def _erf_gelu(variant: str):
    """x * 0.5 * (1 + erf(x / sqrt 2)) in the groupings and operand orders exporters produce."""
    init = {"sqrt2": SQRT2, "inv_sqrt2": 1 / SQRT2, "one": 1.0, "half": 0.5}
    scale = (helper.make_node("Div", ["x", "sqrt2"], ["s"], name="div") if variant != "mul_first"
             else helper.make_node("Mul", ["inv_sqrt2", "x"], ["s"], name="div"))
    head = [scale, helper.make_node("Erf", ["s"], ["e"], name="erf"),
            helper.make_node("Add", ["one", "e"] if variant == "half_first" else ["e", "one"], ["a"], name="add")]
    if variant == "x_first":  # (x * a) * 0.5   -- the torch.onnx export
        tail = [helper.make_node("Mul", ["x", "a"], ["p"], name="mul"),
                helper.make_node("Mul", ["p", "half"], ["y"], name="mul_half")]
    elif variant == "half_first":  # (x * 0.5) * a   -- the Paddle export
        tail = [helper.make_node("Mul", ["half", "x"], ["p"], name="mul_half"),
                helper.make_node("Mul", ["a", "p"], ["y"], name="mul")]
    else:  # (a * 0.5) * x
        tail = [helper.make_node("Mul", ["a", "half"], ["p"], name="mul_half"),
                helper.make_node("Mul", ["x", "p"], ["y"], name="mul")]
    return _model(head + tail, ["N", 4, 16], ["N", 4, 16], init)


def _tanh_gelu(cube: str):
    init = {"three": 3.0, "c": 0.044715, "k": float(np.sqrt(2 / np.pi)), "one": 1.0, "half": 0.5}
    if cube == "pow":
        head = [helper.make_node("Pow", ["x", "three"], ["x3"], name="pow")]
    else:
        head = [helper.make_node("Mul", ["x", "x"], ["x2"], name="sq"),
                helper.make_node("Mul", ["x2", "x"], ["x3"], name="cube")]
    nodes = head + [
        helper.make_node("Mul", ["c", "x3"], ["w"], name="mul_c"),
        helper.make_node("Add", ["x", "w"], ["v"], name="add_x"),
        helper.make_node("Mul", ["v", "k"], ["u"], name="mul_k"),
        helper.make_node("Tanh", ["u"], ["t"], name="tanh"),
        helper.make_node("Add", ["t", "one"], ["a"], name="add_1"),
        helper.make_node("Mul", ["x", "half"], ["p"], name="mul_half"),
        helper.make_node("Mul", ["p", "a"], ["y"], name="mul"),
    ]
    return _model(nodes, ["N", 4, 16], ["N", 4, 16], init)


GELU_MODELS = {
    "erf_x_first": (lambda: _erf_gelu("x_first"), "none"),
    "erf_half_first": (lambda: _erf_gelu("half_first"), "none"),
    "erf_mul_first": (lambda: _erf_gelu("mul_first"), "none"),
    "tanh_pow": (lambda: _tanh_gelu("pow"), "tanh"),
    "tanh_mul": (lambda: _tanh_gelu("mul"), "tanh"),
}


@pytest.mark.parametrize("name", sorted(GELU_MODELS))
def test_gelu_becomes_one_table_op(name):
    build, approximate = GELU_MODELS[name]
    model = build()
    rewritten, log = _rewritten(model)
    assert [(n.op_type, n.outputs) for n in rewritten.nodes] == [("Gelu", ["y"])]
    assert rewritten.nodes[0].attrs == {"approximate": approximate}
    assert [p.op_type for p in log.patterns] == ["Gelu"] and "a" in log.patterns[0].removed_tensors
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, (1, 4, 16)).astype(np.float32)
    _check_float_equal(model, rewritten, x)

    data = rng.normal(0, 2, (12, 4, 16)).astype(np.float32)
    got, want, graph = _integer_run(model, data)
    assert [s.kind for s in graph.steps] == [NodeKind.INTEGER]
    x_qp, y_qp = graph.qparams["x"], graph.qparams["y"]
    # table rounding (0.5 LSB) + the input's rounding through a slope of at most 1.13 (GELU's max |f'|)
    bound = 0.5 * float(y_qp.scale[0]) + 1.13 * 0.5 * float(x_qp.scale[0]) + 1e-6
    assert np.max(np.abs(got - want)) <= bound


def test_gelu_with_a_shared_internal_tensor_is_left_alone():
    model = _erf_gelu("x_first")
    model.graph.output.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, ["N", 4, 16]))
    rewritten, log = _rewritten(model)
    assert not log.patterns and "Erf" in [n.op_type for n in rewritten.nodes]


def test_protected_gelu_nodes_are_not_fused():
    graph = load_model(_erf_gelu("x_first"))
    rewritten, log = apply_rewrites(graph, NodeFloatEvaluator(graph.opset), protected=frozenset({"erf"}))
    assert not log.patterns and len(rewritten.nodes) == 5


# --- LayerNorm --------------------------------------------------------------------------------------------

def decomposed_layer_norm(x: str, y: str, prefix: str, gamma: str, beta: str, square: str = "pow",
                          axes_as_input: bool = False, eps: str = "eps") -> list:
    """ReduceMean -> Sub -> Pow(2) -> ReduceMean -> Add eps -> Sqrt -> Div -> Mul gamma -> Add beta (last axis)."""
    def mean(inp, out, name):
        if axes_as_input:
            return helper.make_node("ReduceMean", [inp, "last_axis"], [out], name=name)
        return helper.make_node("ReduceMean", [inp], [out], axes=[-1], name=name)

    sq = (helper.make_node("Pow", [f"{prefix}_d", "two"], [f"{prefix}_sq"], name=f"{prefix}_pow") if square == "pow"
          else helper.make_node("Mul", [f"{prefix}_d", f"{prefix}_d"], [f"{prefix}_sq"], name=f"{prefix}_pow"))
    return [
        mean(x, f"{prefix}_mean", f"{prefix}_mean"),
        helper.make_node("Sub", [x, f"{prefix}_mean"], [f"{prefix}_d"], name=f"{prefix}_sub"),
        sq,
        mean(f"{prefix}_sq", f"{prefix}_var", f"{prefix}_var"),
        helper.make_node("Add", [f"{prefix}_var", eps], [f"{prefix}_ve"], name=f"{prefix}_add_eps"),
        helper.make_node("Sqrt", [f"{prefix}_ve"], [f"{prefix}_std"], name=f"{prefix}_sqrt"),
        helper.make_node("Div", [f"{prefix}_d", f"{prefix}_std"], [f"{prefix}_n"], name=f"{prefix}_div"),
        helper.make_node("Mul", [f"{prefix}_n", gamma], [f"{prefix}_g"], name=f"{prefix}_mul"),
        helper.make_node("Add", [beta, f"{prefix}_g"], [y], name=f"{prefix}_add"),
    ]


@pytest.mark.parametrize("square, axes_as_input", [("pow", False), ("mul", True)])
def test_layer_norm_becomes_one_integer_op(square, axes_as_input):
    rng = np.random.default_rng(1)
    d = 32
    init = {"two": 2.0, "eps": 1e-5, "gamma": rng.uniform(0.5, 1.5, d), "beta": rng.normal(0, 0.2, d)}
    model = _model(decomposed_layer_norm("x", "y", "ln", "gamma", "beta", square, axes_as_input),
                   ["N", 6, d], ["N", 6, d], init, opset=18 if axes_as_input else 17)
    if axes_as_input:
        model.graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), "last_axis"))
    rewritten, log = _rewritten(model)
    assert [(n.op_type, n.outputs) for n in rewritten.nodes] == [("LayerNormalization", ["y"])]
    assert rewritten.nodes[0].attrs == {"axis": -1, "epsilon": pytest.approx(1e-5)}
    assert log.patterns[0].removed_nodes[0] == "ln_mean" and "ln_var" in log.patterns[0].removed_tensors
    x = (rng.normal(0, 1.5, (1, 6, d)) + rng.normal(0, 2, (1, 6, 1))).astype(np.float32)
    _check_float_equal(model, rewritten, x)

    data = (rng.normal(0, 1.5, (12, 6, d)) + rng.normal(0, 2, (12, 6, 1))).astype(np.float32)
    got, want, graph = _integer_run(model, data)
    assert [s.kind for s in graph.steps] == [NodeKind.INTEGER]
    assert _cosine(got, want) > 0.999
    # the input's rounding error, divided by the row's std and times |gamma|, dominates the op's own ~0.5 LSB
    x_qp, y_qp = graph.qparams["x"], graph.qparams["y"]
    std = data.std(axis=-1).min()
    bound = float(y_qp.scale[0]) + 1.5 * float(x_qp.scale[0]) / std * 1.2
    assert np.max(np.abs(got - want)) <= bound


def test_layer_norm_over_a_shared_variance_is_left_alone():
    rng = np.random.default_rng(2)
    init = {"two": 2.0, "eps": 1e-5, "gamma": rng.uniform(0.5, 1.5, 8), "beta": rng.normal(0, 0.2, 8)}
    model = _model(decomposed_layer_norm("x", "y", "ln", "gamma", "beta"), [1, 3, 8], [1, 3, 8], init)
    model.graph.output.append(helper.make_tensor_value_info("ln_var", TensorProto.FLOAT, [1, 3, 1]))
    rewritten, log = _rewritten(model)
    assert not log.patterns and len(rewritten.nodes) == 9


# --- attention --------------------------------------------------------------------------------------------

def _attention(scale_op: str, mask, rng, opset: int = 17, softmax_axis=-1):
    """Single-head attention: x @ Wq, x @ Wk, scores = q @ k^T scaled by 1/sqrt(d) -> [+ mask] -> Softmax -> @ v.
    mask: False, "bias" (relative-position bias, moderate values) or "padding" (the last two keys at -1e4).
    softmax_axis None: the Softmax without an axis attribute (the opset's default)."""
    t, d = 6, 8
    init = {"Wq": rng.normal(0, 0.5, (d, d)), "Wk": rng.normal(0, 0.5, (d, d)), "Wv": rng.normal(0, 0.5, (d, d)),
            "c": np.sqrt(d) if scale_op == "Div" else 1 / np.sqrt(d)}
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "Wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["x", "Wv"], ["v"], name="v"),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["raw"], name="scores"),
             helper.make_node(scale_op, ["raw", "c"] if scale_op == "Div" else ["c", "raw"], ["scaled"], name="scale")]
    logits = "scaled"
    if mask == "bias":
        init["bias"] = -0.3 * np.abs(np.subtract.outer(np.arange(t), np.arange(t)))
    elif mask == "padding":
        init["bias"] = np.where(np.arange(t) >= t - 2, -1e4, 0.0)[None, :].repeat(t, axis=0)
    if mask:
        nodes.append(helper.make_node("Add", ["bias", "scaled"], ["masked"], name="mask"))
        logits = "masked"
    axis = {} if softmax_axis is None else {"axis": softmax_axis}
    nodes += [helper.make_node("Softmax", [logits], ["probs"], name="softmax", **axis),
              helper.make_node("MatMul", ["probs", "v"], ["y"], name="context")]
    return _model(nodes, ["N", t, d], ["N", t, d], init, opset=opset)


@pytest.mark.parametrize("scale_op, mask", [("Div", False), ("Mul", "bias"), ("Div", "padding")])
def test_attention_scale_folds_into_the_scores_matmul(scale_op, mask):
    rng = np.random.default_rng(3)
    model = _attention(scale_op, mask, rng)
    rewritten, log = _rewritten(model)
    fused = [n for n in rewritten.nodes if n.op_type == "ScaledMatMul"]
    assert len(fused) == 1 and fused[0].outputs == ["scaled"] and fused[0].inputs == ["q", "kt"]
    assert fused[0].attrs["alpha"] == pytest.approx(1 / np.sqrt(8), rel=1e-6)
    assert log.patterns[0].removed_tensors == ["raw"] and "scores" in [n.name for n in rewritten.nodes]
    assert [f.removed_tensors for f in log.patterns[1:]] == ([["masked"]] if mask else [])
    types = [n.op_type for n in rewritten.nodes]
    assert "Mul" not in types and "Div" not in types and "Add" not in types
    assert types[-2:] == (["AddSoftmax", "MatMul"] if mask else ["Softmax", "MatMul"])
    assert rewritten.nodes[-2].outputs == ["probs"] and rewritten.nodes[-2].inputs[0] == "scaled"
    x = rng.normal(0, 1, (1, 6, 8)).astype(np.float32)
    _check_float_equal(model, rewritten, x)

    data = rng.normal(0, 1, (16, 6, 8)).astype(np.float32)
    got, want, graph = _integer_run(model, data)
    assert all(s.kind is NodeKind.INTEGER for s in graph.steps)
    assert _cosine(got, want) > 0.995


@pytest.mark.parametrize("softmax_axis, fused", [(None, False), (1, False), (2, True), (-1, True)])
def test_opset_11_softmax_fuses_its_mask_only_over_one_axis(softmax_axis, fused):
    """Softmax before opset 13 coerces its input to 2-D at `axis` (default 1): over [N, T, T] scores the default
    reduces over T * T values, which the single-axis AddSoftmax cannot compute (it used to take the axis as
    given: errors 2-4x the output's magnitude). Only an axis that is the last one fuses."""
    rng = np.random.default_rng(11)
    model = _attention("Div", "bias", rng, opset=11, softmax_axis=softmax_axis)
    rewritten, _ = _rewritten(model)
    types = [n.op_type for n in rewritten.nodes]
    assert ("AddSoftmax" in types) == fused and ("Softmax" in types) != fused
    if fused:
        assert next(n for n in rewritten.nodes if n.op_type == "AddSoftmax").attrs["axis"] == -1
    _check_float_equal(model, rewritten, rng.normal(0, 1, (1, 6, 8)).astype(np.float32))

    data = rng.normal(0, 1, (16, 6, 8)).astype(np.float32)
    got, want, graph = _integer_run(model, data)
    assert all(s.kind is NodeKind.INTEGER for s in graph.steps)
    assert _cosine(got, want) > 0.99
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_attention_scale_with_a_constant_operand_is_not_folded():
    """q @ W (a weight) is no attention score: left to the MatMul and Mul ops."""
    init = {"W": np.ones((8, 8)), "c": 0.5}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["raw"], name="mm"),
             helper.make_node("Mul", ["raw", "c"], ["scaled"], name="scale"),
             helper.make_node("Softmax", ["scaled"], ["p"], name="softmax"),
             helper.make_node("MatMul", ["p", "x"], ["y"], name="ctx")]
    rewritten, log = _rewritten(_model(nodes, [1, 8, 8], [1, 8, 8], init))
    assert not log.patterns and [n.op_type for n in rewritten.nodes] == ["MatMul", "Mul", "Softmax", "MatMul"]
