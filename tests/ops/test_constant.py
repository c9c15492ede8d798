"""Constant (ops/constant.py): float constants quantized once with the output qparams (against a Python
reference of round-half-even, and against onnxruntime's Constant node within 0.5 LSB); integer constants
keep their values (scale 1, zp 0, an index output); a Constant node inserted into a loaded graph runs in
integers through the executor."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from op_testing import Check, context, covers, lsb_error, random_qparams, runtime
from ops import get_op
from ops.registry import check_quantized
from ptq.core.graph import Node


def _ort_constant(attrs: dict) -> np.ndarray:
    node = helper.make_node("Constant", [], ["y"], **attrs)
    graph = helper.make_graph([node], "c", [], [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]


def _ref_codes(value, qp) -> np.ndarray:
    """clamp(round_half_even(v / s) + zp) element by element in Python (round() is half-even)."""
    s, zp = float(qp.scale[0]), int(qp.zero_point[0])
    return np.array([min(max(round(float(v) / s) + zp, qp.qmin), qp.qmax) for v in np.ravel(value)]).reshape(
        np.shape(value))


@covers("Constant", check=Check.INT_REFERENCE)
@covers("Constant", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("proposed", [True, False])
def test_float_constant_is_quantized_with_the_output_qparams(bits, proposed):
    rng = np.random.default_rng(bits + proposed)
    value = rng.normal(0, 2, (3, 4)).astype(np.float32)
    attrs = {"value": numpy_helper.from_array(value)}
    node = Node("c", "Constant", [], ["y"], {"value": value})
    op = get_op("Constant")
    want = _ort_constant(attrs)
    np.testing.assert_array_equal(op.forward_float(node, [])[0], want)
    y_qp = random_qparams(rng, -3.0, 2.5, bits) if proposed else None
    q = op.quantize(context(node, [], [y_qp]))
    check_quantized(q)
    qp = q.out_qparams[0]
    if proposed:
        assert qp == y_qp
    else:  # its own range, 8 bits, asymmetric
        assert qp.bits == 8 and np.isclose(qp.dequantize(np.array([qp.qmax]))[0], value.max(), atol=qp.scale[0])
    y = op.forward_int(q, [], runtime())[0]
    assert y.dtype == qp.dtype
    np.testing.assert_array_equal(y, _ref_codes(value, qp))
    assert lsb_error(qp, y, want) <= 0.5 + 1e-6


@covers("Constant", check=Check.INT_REFERENCE)
@covers("Constant", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("attr,value", [("value_ints", [3, -1, 7]), ("value_int", 5),
                                        ("value", np.array([[0, 2], [1, 1]], np.int64))])
def test_integer_constant_keeps_scale_one_and_zero_point_zero(attr, value):
    attrs = {attr: numpy_helper.from_array(value) if isinstance(value, np.ndarray) else value}
    node = Node("c", "Constant", [], ["y"], {attr: value})
    op = get_op("Constant")
    assert op.index_outputs(node) == {0}
    want = _ort_constant(attrs)
    q = op.quantize(context(node, [], [None]))
    check_quantized(q)
    assert q.out_qparams == [None]
    y = op.forward_int(q, [], runtime())[0]
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, np.asarray(value, dtype=np.int64))
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(op.forward_float(node, [])[0], want)


def test_value_attributes_are_required_once():
    op = get_op("Constant")
    with pytest.raises(ValueError, match="exactly one of the attributes"):
        op.forward_float(Node("c", "Constant", [], ["y"], {}), [])
    with pytest.raises(ValueError, match="exactly one of the attributes"):
        op.forward_float(Node("c", "Constant", [], ["y"], {"value_int": 1, "value_float": 1.0}), [])


def test_a_constant_node_in_a_loaded_graph_runs_in_integers():
    """load_model folds Constant nodes; a graph edited afterwards may hold one: it runs as an integer step."""
    from ptq.core.graph import load_model
    from ptq.engine.executor import NodeKind, prepare
    from ptq.calibration.pipeline import calibrate
    from tiny_models import make_model

    rng = np.random.default_rng(4)
    c = rng.normal(0, 1, (1, 4)).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c), name="const"),
             helper.make_node("Add", ["x", "c"], ["y"], name="add")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4])], [])
    x = rng.normal(0, 1, (16, 3, 4)).astype(np.float32)
    result = calibrate(model, x, write_qdq=False)
    graph = load_model(model)
    assert "c" in graph.initializers  # folded at load: put the Constant node back
    value = graph.initializers.pop("c")
    graph.nodes.insert(0, Node("const", "Constant", [], ["c"], {"value": value}))
    prepared = prepare(graph, result.table)
    kinds = {s.node.op_type: s.kind for s in prepared.steps}
    assert kinds == {"Constant": NodeKind.INTEGER, "Add": NodeKind.INTEGER}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y_qp = prepared.qparams["y"]
    for sample in x[:4, None]:
        x_dq = prepared.qparams["x"].dequantize(prepared.qparams["x"].quantize(sample))
        want = sess.run(["y"], {"x": x_dq})[0]
        got = prepared.run({"x": sample}).outputs["y"]
        assert np.max(np.abs(got - want)) / y_qp.scale[0] <= 1.1  # Add's 0.6 + the constant's 0.5 * s_c / s_y
