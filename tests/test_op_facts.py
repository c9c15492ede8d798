"""Algorithms ask the op (`ops.registry.OpDef`), they do not compare op-type strings.

`test_no_op_type_compared_outside_ops` walks the syntax tree of every module of the packages and fails on a
comparison (==, !=, in, not in) between an `.op_type` (or `.op`) attribute and a string literal, a tuple, list or
set of string literals, or a module-level name bound to one of those. The places allowed to name op types:

- `ops/`: the ops themselves;
- `ptq/engine/rewrites.py`, `ptq/engine/transformer_patterns.py`: graph patterns are written in op types;
- `ptq/opdocs/conformance.py`: the conformance cases are op documentation, one per op type;
- `ptq/core/graph.py`: the graph IR loads ONNX Constant nodes as initializers; it stands below the registry.

Not flagged, on purpose: a comparison with a value that is not a literal, e.g. the executor's
`--float-node` specs matched against node op types (`ptq.engine.executor._resolve_float_nodes`): the user
selecting nodes by op type is a user's choice, not an algorithm switching on types. The QDQ export finds the
DequantizeLinear nodes it wrote by the builder's own record of them, not by their type.

The other tests check the facts the algorithms now read (`OpDef.layer_kind`, `channel_groups`,
`clamp_bounds`, `positively_homogeneous`, `preserves_channel_mean`) and what reading them changed:
equalization now scales through a LeakyRelu (positively homogeneous, as the registry already declared it
absorbable), and `own_bias` reads the op's `bias_role`.
"""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ops.registry import channel_groups, get_op, layer_kind, op_of
from ptq.adjust.bias_correction import own_bias
from ptq.adjust.equalize import equalize
from ptq.core.graph import Node, load_model
from ptq.core.roles import LayerKind

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ptq", "reports", "calibrators", "lut", "dsp")
ALLOWED = ("ops/", "ptq/engine/rewrites.py", "ptq/engine/transformer_patterns.py", "ptq/opdocs/conformance.py",
           "ptq/core/graph.py")
OP_ATTRIBUTES = ("op_type", "op")


def _is_literal(node: ast.AST, names: dict[str, ast.AST]) -> bool:
    if isinstance(node, ast.Name) and node.id in names:
        return _is_literal(names[node.id], {})
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_literal(e, {}) for e in node.elts)
    return False


def op_type_comparisons(source: str, filename: str = "<string>") -> list[str]:
    """`line: expression` of every comparison of an op-type attribute with a string literal (module docstring)."""
    tree = ast.parse(source, filename)
    constants = {target.id: stmt.value for stmt in tree.body if isinstance(stmt, ast.Assign)
                 for target in stmt.targets if isinstance(target, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare) or not all(
                isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        operands = [node.left] + node.comparators
        if any(isinstance(o, ast.Attribute) and o.attr in OP_ATTRIBUTES for o in operands) and \
                any(_is_literal(o, constants) for o in operands):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_op_type_compared_outside_ops():
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            if where.startswith(ALLOWED):
                continue
            bad += [f"{where}:{hit}" for hit in op_type_comparisons(path.read_text(), where)]
    assert bad == []


def test_the_walker_catches_planted_comparisons(tmp_path):
    planted = tmp_path / "algorithm.py"
    planted.write_text(
        'ACTIVATIONS = ("Relu", "Clip")\n'
        'def f(node, spec, consumers):\n'
        '    a = node.op_type == "Conv"\n'
        '    b = consumers[0].op_type in ("Relu", "Clip")\n'
        '    c = "Gemm" != node.op\n'
        '    d = node.op_type not in ACTIVATIONS\n'
        '    e = node.op_type in ["Min"]\n'
        '    ok1 = node.op_type == spec\n'  # a user's selection, not a literal
        '    ok2 = node.name == "Conv"\n'
        '    ok3 = node.op_type + "_1"\n'
        '    return a, b, c, d, e, ok1, ok2, ok3\n')
    assert op_type_comparisons(planted.read_text()) == [
        "3: node.op_type == 'Conv'", "4: consumers[0].op_type in ('Relu', 'Clip')", "5: 'Gemm' != node.op",
        "6: node.op_type not in ACTIVATIONS", "7: node.op_type in ['Min']"]


def _node(op_type: str, inputs=("x", "w"), **attrs) -> Node:
    return Node(name="n", op_type=op_type, inputs=list(inputs), outputs=["y"], attrs=attrs)


def test_layer_facts():
    assert layer_kind(_node("Conv")) is LayerKind.CONVOLUTION
    assert layer_kind(_node("Gemm")) is LayerKind.FULLY_CONNECTED
    assert layer_kind(_node("BatchNormalization")) is LayerKind.BATCH_NORMALIZATION
    assert layer_kind(_node("ConvTranspose")) is None  # its weight is [C_in, C_out / group, k...]
    assert layer_kind(_node("MatMul")) is None and layer_kind(_node("NoSuchOp")) is None
    assert channel_groups(_node("Conv", group=8)) == 8 and channel_groups(_node("Conv")) == 1
    assert channel_groups(_node("Gemm")) == 1 and channel_groups(_node("NoSuchOp")) == 1


def test_activation_facts():
    homogeneous = {t for t in ("Relu", "Clip", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid")
                   if get_op(t).positively_homogeneous}
    assert homogeneous == {"Relu", "LeakyRelu", "PRelu"}  # Clip(0, b) only with its bound scaled
    assert {t for t in ("GlobalAveragePool", "Flatten", "Identity", "AveragePool", "Relu")
            if get_op(t).preserves_channel_mean} == {"GlobalAveragePool", "Flatten", "Identity"}
    bound = np.array([1.0, 2.0, 3.0]).reshape(3, 1, 1)
    constant = {1: bound}.get
    minimum = _node("Min", ("x", "b"))
    lo, hi = op_of(minimum).clamp_bounds(minimum, constant)
    assert lo == -np.inf and np.array_equal(hi, bound)
    assert op_of(minimum).clip_range(minimum, constant) is None  # range folding is not changed by it
    assert op_of(minimum).clamp_bounds(minimum, lambda i: None) is None  # a run-time operand clamps nothing known
    relu, clip = _node("Relu", ("x",)), _node("Clip", ("x", "lo", "hi"))
    assert op_of(relu).clamp_bounds(relu, constant) == (0.0, np.inf)
    assert op_of(clip).clamp_bounds(clip, {1: np.float32(-1), 2: np.float32(6)}.get) == (-1.0, 6.0)


def _chain(activation: str, seed: int = 0) -> onnx.ModelProto:
    """x -> Conv1 -> activation -> Conv2, channel ranges of Conv1 spread over three decades."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 1, (4, 3, 3, 3)).astype(np.float32) * np.array([0.01, 0.1, 1, 10], np.float32)[:, None, None, None]
    w2 = rng.normal(0, 1, (5, 4, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node(activation, ["c1"], ["a1"], name="act", **({"alpha": 0.2} if activation == "LeakyRelu" else {})),
             helper.make_node("Conv", ["a1", "W2"], ["y"], name="conv2")]
    inits = [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(rng.normal(0, 1, 4).astype(np.float32), "B1"),
             numpy_helper.from_array(w2, "W2")]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("activation", ["LeakyRelu", "PRelu"])
def test_equalization_scales_through_a_positively_homogeneous_activation(activation):
    """Before, equalization named Relu and Clip only; a LeakyRelu pair (which the registry already marked
    absorbable, and which is positively homogeneous) was left alone. Now the op's fact decides."""
    model = _chain(activation)
    if activation == "PRelu":  # a per-channel slope (C, 1, 1)
        model.graph.node[1].input.append("slope")
        model.graph.initializer.append(numpy_helper.from_array(np.array([0.1, 0.2, 0.3, 0.4], np.float32).reshape(4, 1, 1),
                                                               "slope"))
    graph = load_model(model)
    out, log = equalize(graph)
    assert log.pairs == [("conv1", "conv2")]
    def spread(w):
        ranges = np.abs(w).reshape(4, -1).max(axis=1)
        return ranges.max() / ranges.min()

    before = spread(graph.initializers["W1"])
    assert before > 300 and spread({i.name: numpy_helper.to_array(i) for i in out.graph.initializer}["W1"]) < before / 10
    assert [n.op_type for n in out.graph.node] == ["Conv", activation, "Conv"]
    x = np.random.default_rng(1).normal(0, 1, (2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _run(model, x), rtol=1e-4, atol=1e-4)
    # the activation's output is not bounded below: nothing is absorbed through it into a next pair
    assert log.absorption is not None and log.absorption.absorbed == {}


def test_own_bias_reads_the_bias_role():
    model = _chain("Relu")
    graph = load_model(model)
    conv1, _, conv2 = graph.nodes
    assert own_bias(graph, conv1, set()) == "B1"
    assert own_bias(graph, conv1, {"B1"}) == ""  # shared
    assert own_bias(graph, conv2, set()) == ""  # no bias input
    relu = graph.nodes[1]
    assert own_bias(graph, Node(relu.name, relu.op_type, ["c1", "W1", "B1"], relu.outputs), set()) == ""


def test_score_ops():
    # calibration keeps an output Softmax / LogSoftmax / Sigmoid at 16 bits with its logits
    # (ptq.calibration.output_scores)
    assert {t for t in ("Softmax", "LogSoftmax", "Hardmax", "Sigmoid", "Tanh", "ReduceMax")
            if get_op(t).gives_scores} == {"Softmax", "LogSoftmax", "Sigmoid"}
