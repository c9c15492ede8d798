"""Control flow (If, Loop): subgraphs that read outer-scope tensors run, as visible float nodes fed with the
dequantized outer tensors; calibration, the integer run and strict mode treat them like any float node."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.core.graph import load_model
from ptq.executor import SUBGRAPHS_IN_FLOAT, ExecutorError, ExecutorOptions, NodeKind, prepare
from ptq.pipeline import calibrate

F = TensorProto.FLOAT


def _branch(name: str, weight: str, act: str, inner_if: bool = False) -> onnx.GraphProto:
    nodes = [helper.make_node("MatMul", ["a", weight], [f"{name}_mm"], name=f"{name}_mm"),
             helper.make_node(act, [f"{name}_mm"], [f"{name}_out"], name=f"{name}_act")]
    if inner_if:  # a nested If reading the outer graph's `a` and this branch's tensor
        inner_then = helper.make_graph([helper.make_node("Add", ["a", f"{name}_out"], ["in_t"], name="in_t")],
                                       "inner_then", [], [helper.make_tensor_value_info("in_t", F, [1, 8])])
        inner_else = helper.make_graph([helper.make_node("Sub", ["a", f"{name}_out"], ["in_e"], name="in_e")],
                                       "inner_else", [], [helper.make_tensor_value_info("in_e", F, [1, 8])])
        nodes.append(helper.make_node("If", ["c2"], [f"{name}_nested"], then_branch=inner_then,
                                      else_branch=inner_else, name=f"{name}_if"))
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_nested", F, [1, 8])])
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_out", F, [1, 8])])


def if_model(nested: bool = False) -> onnx.ModelProto:
    """a = Relu(x); c = sum(x) > 0; b = If(c, tanh(a @ W1), relu(a @ W2)); y = b + a. The branches read `a`,
    W1 and W2 from the outer graph."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (8, 8)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.normal(0, 0.5, (8, 8)).astype(np.float32), "W2"),
             numpy_helper.from_array(np.float32(0), "zero")]
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="positive"),
             helper.make_node("Less", ["s", "zero"], ["c2"], name="negative"),
             helper.make_node("If", ["c"], ["b"], then_branch=_branch("then", "W1", "Tanh", nested),
                              else_branch=_branch("else", "W2", "Relu"), name="if"),
             helper.make_node("Add", ["b", "a"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "if_model", [helper.make_tensor_value_info("x", F, [1, 8])],
                              [helper.make_tensor_value_info("y", F, [1, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def loop_model() -> onnx.ModelProto:
    """h = x; three times: h = tanh(h @ W + a) with `a` = Relu(x) read from the outer graph; y = h."""
    rng = np.random.default_rng(1)
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep"),
         helper.make_node("MatMul", ["h_in", "W"], ["hw"], name="hw"),
         helper.make_node("Add", ["hw", "a"], ["pre"], name="pre"),
         helper.make_node("Tanh", ["pre"], ["h_out"], name="tanh")],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", F, [1, 8])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("h_out", F, [1, 8])])
    inits = [numpy_helper.from_array(rng.normal(0, 0.4, (8, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array(3, np.int64), "trips"), numpy_helper.from_array(np.array(True), "true")]
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Loop", ["trips", "true", "x"], ["h"], body=body, name="loop"),
             helper.make_node("Mul", ["h", "x"], ["y"], name="mul")]
    graph = helper.make_graph(nodes, "loop_model", [helper.make_tensor_value_info("x", F, [1, 8])],
                              [helper.make_tensor_value_info("y", F, [1, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _ort(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("build, float_node", [(lambda: if_model(), "if"), (lambda: if_model(nested=True), "if"),
                                                (loop_model, "loop")])
def test_control_flow_runs_as_a_visible_float_node(build, float_node):
    model = build()
    graph = load_model(model)
    node = next(n for n in graph.nodes if n.name == float_node)
    assert "a" in node.implicit_inputs and node.all_inputs[:len(node.inputs)] == node.inputs
    rng = np.random.default_rng(2)
    data = rng.normal(0, 1, (24, 1, 8)).astype(np.float32)
    result = calibrate(model, data[:, 0], write_qdq=False)
    prepared = prepare(result.graph, result.table)
    kinds = {s.node.name: (s.kind, s.reason) for s in prepared.steps}
    assert kinds[float_node] == (NodeKind.FLOAT, SUBGRAPHS_IN_FLOAT)
    assert all(k is NodeKind.INTEGER for name, (k, _) in kinds.items() if name != float_node)
    got = np.concatenate([prepared.run({"x": s}, keep_all=False).outputs["y"] for s in data])
    want = np.concatenate([_ort(model, s) for s in data])
    scale = float(prepared.qparams["y"].scale[0])
    assert np.abs(got - want).max() < 6 * scale  # a few LSB: the outer tensors reach the subgraph quantized
    assert [f.name for f in prepared.run({"x": data[0]}).float_nodes] == [float_node]
    with pytest.raises(ExecutorError, match="control flow"):
        prepare(result.graph, result.table, options=ExecutorOptions(strict=True))


def test_a_tensor_read_only_by_a_subgraph_counts_as_consumed():
    """`a` is read by the If's branches and by Add: two consumers, so no rewrite takes it as single-use."""
    graph = load_model(if_model())
    users = [n.name for n in graph.consumers()["a"]]
    assert sorted(users) == ["add", "if"]
