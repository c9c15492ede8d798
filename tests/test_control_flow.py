"""Control flow (If, Loop): calibration collects the tensors of their subgraphs (which read outer-scope
tensors); If branches run in integers as graphs of their own, Loop bodies as a visible float node."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.core.graph import load_model
from ptq.engine.executor import ExecutorError, ExecutorOptions, NodeKind, prepare
from ptq.calibration.pipeline import calibrate

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
    W1 and W2 from the outer graph; `nested` puts If(max(x) > 1, a + t, a - t) inside the then branch."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (8, 8)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.normal(0, 0.5, (8, 8)).astype(np.float32), "W2"),
             numpy_helper.from_array(np.float32(0), "zero"), numpy_helper.from_array(np.float32(1), "one")]
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="positive"),
             helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0, name="peak"),
             helper.make_node("Greater", ["peak", "one"], ["c2"], name="high"),
             helper.make_node("If", ["c"], ["b"], then_branch=_branch("then", "W1", "Tanh", nested),
                              else_branch=_branch("else", "W2", "Relu"), name="if"),
             helper.make_node("Add", ["b", "a"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "if_model", [helper.make_tensor_value_info("x", F, [1, 8])],
                              [helper.make_tensor_value_info("y", F, [1, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def loop_model(scan: bool = False) -> onnx.ModelProto:
    """h = x; three times: h = tanh(h @ W + a) with `a` = Relu(x) read from the outer graph; y = h * x
    (`scan`: y = h * x + the sum over iterations of the scanned 0.5 * h)."""
    rng = np.random.default_rng(1)
    body_nodes = [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep"),
                  helper.make_node("MatMul", ["h_in", "W"], ["hw"], name="hw"),
                  helper.make_node("Add", ["hw", "a"], ["pre"], name="pre"),
                  helper.make_node("Tanh", ["pre"], ["h_out"], name="tanh")]
    body_outputs = [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                    helper.make_tensor_value_info("h_out", F, [1, 8])]
    if scan:
        body_nodes.append(helper.make_node("Mul", ["h_out", "half"], ["h_half"], name="half"))
        body_outputs.append(helper.make_tensor_value_info("h_half", F, [1, 8]))
    body = helper.make_graph(
        body_nodes, "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", F, [1, 8])],
        body_outputs)
    inits = [numpy_helper.from_array(rng.normal(0, 0.4, (8, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array(3, np.int64), "trips"), numpy_helper.from_array(np.array(True), "true")]
    if scan:
        inits += [numpy_helper.from_array(np.float32(0.5), "half"), numpy_helper.from_array(np.array([0], np.int64), "axis0")]
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Loop", ["trips", "true", "x"], ["h", "halves"] if scan else ["h"], body=body,
                              name="loop")]
    if scan:
        nodes += [helper.make_node("ReduceSum", ["halves", "axis0"], ["total"], keepdims=0, name="total"),
                  helper.make_node("Mul", ["h", "x"], ["hx"], name="mul"),
                  helper.make_node("Add", ["hx", "total"], ["y"], name="add")]
    else:
        nodes.append(helper.make_node("Mul", ["h", "x"], ["y"], name="mul"))
    graph = helper.make_graph(nodes, "loop_model", [helper.make_tensor_value_info("x", F, [1, 8])],
                              [helper.make_tensor_value_info("y", F, [1, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _ort(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _calibrated(model, samples=24, seed=2, sign=None):
    rng = np.random.default_rng(seed)
    data = rng.normal(0, 1, (samples, 1, 8)).astype(np.float32)
    if sign is not None:  # every sample takes one branch
        data = sign * np.abs(data)
    return calibrate(model, data[:, 0], write_qdq=False), data


def _max_error(prepared, model, data) -> float:
    got = np.concatenate([prepared.run({"x": s}, keep_all=False).outputs["y"] for s in data])
    want = np.concatenate([_ort(model, s) for s in data])
    return float(np.abs(got - want).max()) / float(prepared.qparams["y"].scale[0])


@pytest.mark.parametrize("nested", [False, True])
def test_if_branches_run_in_integers(nested):
    """Calibration collects every branch tensor (ptq's float run of the branch each sample takes); the If's
    branches then run as integer graphs of their own, the If output within a few LSB of onnxruntime."""
    model = if_model(nested)
    result, data = _calibrated(model)
    inner = ["then_mm", "then_out", "else_mm", "else_out"] + (["then_nested", "in_t", "in_e"] if nested else [])
    assert all(result.table.tensors[t].kind == "activation" for t in inner)
    assert {"W1", "W2"} <= set(result.table.tensors)  # weights read inside the branches
    prepared = prepare(result.graph, result.table, options=ExecutorOptions(strict=True))
    kinds = {s.node.name: s.kind for s in prepared.steps}
    assert kinds["if"] is NodeKind.CONTROL and not prepared.float_nodes
    assert all(k is NodeKind.INTEGER for name, k in kinds.items() if name != "if")
    assert _max_error(prepared, model, data) <= 3.0


def test_a_branch_node_without_an_integer_kernel_is_a_float_node_of_the_branch():
    model = if_model()
    branch = next(a.g for n in model.graph.node if n.op_type == "If" for a in n.attribute if a.name == "then_branch")
    branch.node[1].op_type = "Atan"  # then_act: not registered
    result, data = _calibrated(model)
    prepared = prepare(result.graph, result.table)
    assert [(f.name, f.reason) for f in prepared.float_nodes] == [("if/then_branch/then_act", "not registered")]
    assert _max_error(prepared, model, data) <= 3.0


def test_an_if_whose_branch_no_sample_took_runs_that_branch_in_float_with_the_reason():
    """The taken branch runs in integers; the other, without table entries, runs in float when taken (the If
    output quantized to its calibrated grid) and is listed as a float node (before: the whole If in float)."""
    model = if_model()
    data = np.random.default_rng(2).normal(1.5, 1.0, (24, 1, 8)).astype(np.float32)
    assert data.sum(axis=(1, 2)).min() > 0 and data.min() < -0.8  # the else branch never runs
    result = calibrate(model, data[:, 0], write_qdq=False)
    assert "else_mm" not in result.table.tensors
    prepared = prepare(result.graph, result.table)
    assert {s.node.name: s.kind for s in prepared.steps}["if"] is NodeKind.CONTROL
    (node,) = prepared.float_nodes
    assert node.name == "if/else_branch" and "no calibration sample took that branch" in node.reason
    assert _max_error(prepared, model, data) <= 3.0  # as in integers: the calibrated branch
    x = np.array([[-0.8] * 6 + [1.5, 1.5]], np.float32)  # sum(x) < 0: the else branch, relu(a @ W2), a != 0
    run = prepared.run({"x": x})
    a = prepared.qparams["a"].dequantize(run.tensors["a"])
    w2 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "W2"))
    want = prepared.qparams["b"].quantize(np.maximum(a @ w2, 0).astype(np.float32))
    assert np.abs(run.tensors["b"].astype(int) - want.astype(int)).max() <= 1 and np.any(want != want.min())
    with pytest.raises(ExecutorError, match="no calibration sample took that branch"):
        prepare(result.graph, result.table, options=ExecutorOptions(strict=True))


@pytest.mark.parametrize("scan", [False, True])
def test_loop_body_runs_in_integers(scan):
    """The body's tensors are calibrated over every iteration; the body runs as one integer graph per
    iteration, the carried value requantized between the grids (and the scan output stacked)."""
    model = loop_model(scan)
    graph = load_model(model)
    node = next(n for n in graph.nodes if n.name == "loop")
    assert "a" in node.implicit_inputs and node.all_inputs[:len(node.inputs)] == node.inputs
    result, data = _calibrated(model)
    assert result.table.tensors["h_out"].kind == "activation" and result.table.tensors["h_in"].kind == "activation"
    prepared = prepare(result.graph, result.table, options=ExecutorOptions(strict=True))
    kinds = {s.node.name: s.kind for s in prepared.steps}
    assert kinds["loop"] is NodeKind.CONTROL and not prepared.float_nodes
    assert all(k is NodeKind.INTEGER for name, k in kinds.items() if name != "loop")
    assert _max_error(prepared, model, data) <= 4.0


def test_a_loop_marked_float_runs_as_a_visible_float_node():
    model = loop_model()
    result, data = _calibrated(model)
    prepared = prepare(result.graph, result.table, float_nodes=["loop"])
    assert [(f.name, f.reason) for f in prepared.float_nodes] == [("loop", "marked float")]
    assert _max_error(prepared, model, data) <= 6.0  # the outer tensors reach the body quantized


def test_a_tensor_read_only_by_a_subgraph_counts_as_consumed():
    """`a` is read by the If's branches and by Add: two consumers, so no rewrite takes it as single-use."""
    graph = load_model(if_model())
    users = [n.name for n in graph.consumers()["a"]]
    assert sorted(users) == ["add", "if"]


def test_a_table_with_branch_tensors_matches_its_model(tmp_path):
    """The table's entries for branch tensors are the model's: `ptq table export` accepts it."""
    from ptq.qdq.export import check_table_matches

    model = if_model()
    result, _ = _calibrated(model)
    check_table_matches(load_model(model), result.table)


def test_an_lstm_inside_a_branch_runs_in_integers(tmp_path):
    """A VAD-like step: If(mode) picks one of two LSTM cells over the frame features, each reading the outer
    state; the branch LSTM runs in integers inside the integer branch."""
    rng = np.random.default_rng(5)
    steps, feats, hidden = 20, 8, 12

    def branch(name):
        w = numpy_helper.from_array((rng.normal(0, 1, (1, 4 * hidden, feats)) / np.sqrt(feats)).astype(np.float32),
                                    f"{name}_W")
        r = numpy_helper.from_array((rng.normal(0, 1, (1, 4 * hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
                                    f"{name}_R")
        nodes = [helper.make_node("LSTM", ["xt", f"{name}_W", f"{name}_R", "", "", "h0"], ["", f"{name}_h"],
                                  hidden_size=hidden, name=f"{name}_lstm")]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_h", F, [1, 1, hidden])],
                                 [w, r])

    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2], name="time_first"),
             helper.make_node("ReduceMean", ["x"], ["level"], keepdims=0, name="level"),
             helper.make_node("Greater", ["level", "zero"], ["loud"], name="loud"),
             helper.make_node("If", ["loud"], ["h"], then_branch=branch("loud_cell"),
                              else_branch=branch("quiet_cell"), name="pick"),
             helper.make_node("Sigmoid", ["h"], ["y"], name="prob")]
    graph = helper.make_graph(nodes, "vad", [helper.make_tensor_value_info("x", F, [1, steps, feats]),
                                             helper.make_tensor_value_info("h0", F, [1, 1, hidden])],
                              [helper.make_tensor_value_info("y", F, [1, 1, hidden])],
                              [numpy_helper.from_array(np.float32(0), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    samples = [{"x": (rng.normal(0, 1, (1, steps, feats)) + rng.choice([-0.3, 0.3])).astype(np.float32),
                "h0": rng.uniform(-0.5, 0.5, (1, 1, hidden)).astype(np.float32)} for _ in range(16)]
    for k, sample in enumerate(samples):
        np.savez(tmp_path / f"s{k:02d}.npz", **sample)
    onnx.save(model, tmp_path / "vad.onnx")
    result = calibrate(tmp_path / "vad.onnx", out_dir=tmp_path, data=tmp_path)
    prepared = prepare(result.graph, result.table, options=ExecutorOptions(strict=True))
    pick = next(s for s in prepared.steps if s.node.name == "pick")
    assert pick.kind is NodeKind.CONTROL
    for branch_graph in (pick.control.then_branch, pick.control.else_branch):
        assert [s.kind for s in branch_graph.steps] == [NodeKind.INTEGER]  # the LSTM
    # y, a Sigmoid at the output, is at 16 bits (ptq.calibration.output_scores): the bound is 3 steps of an
    # 8-bit grid over its range, the error the 8-bit cell makes
    y = result.table.tensors["y"]
    scale = float(y.max.max() - y.min.min()) / 255
    for sample in samples:
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, sample)[0]
        assert np.abs(prepared.run(sample).outputs["y"] - want).max() <= 3 * scale


def test_a_scan_calibrates_and_runs_as_a_visible_float_node():
    """Scan: its body is not collected (no table entries), calibration does not fail, the node runs in float."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "row"], ["acc_out"], name="acc"),
         helper.make_node("Tanh", ["acc_out"], ["row_out"], name="squash")],
        "scan_body", [helper.make_tensor_value_info("acc_in", F, [1]), helper.make_tensor_value_info("row", F, [1])],
        [helper.make_tensor_value_info("acc_out", F, [1]), helper.make_tensor_value_info("row_out", F, [1])])
    inits = [numpy_helper.from_array(np.zeros(1, np.float32), "start"),
             numpy_helper.from_array(np.array([8, 1], np.int64), "rows_shape"),
             numpy_helper.from_array(np.array([1, 8], np.int64), "back")]
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Reshape", ["a", "rows_shape"], ["rows"], name="rows"),
             helper.make_node("Scan", ["start", "rows"], ["total", "squashed"], body=body, num_scan_inputs=1,
                              name="scan"),
             helper.make_node("Reshape", ["squashed", "back"], ["flat"], name="back"),
             helper.make_node("Add", ["flat", "x"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "scan_model", [helper.make_tensor_value_info("x", F, [1, 8])],
                              [helper.make_tensor_value_info("y", F, [1, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result, data = _calibrated(model)
    assert "acc_out" not in result.table.tensors
    prepared = prepare(result.graph, result.table)
    (node,) = prepared.float_nodes
    assert node.name == "scan" and "only If branches and Loop bodies" in node.reason
    assert _max_error(prepared, model, data) <= 4.0
