"""The logical family and Where (ops/logical.py): comparisons on the common integer grid against a Python-integer
reference (exact) and against onnxruntime's float comparison (equal outside the stated rounding band d); the
bool ops against Python booleans and onnxruntime; Where against a Python requant reference and onnxruntime;
and a graph where Greater, Not and Where run in integers end to end."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from op_testing import (
    Check, context, covers, lsb_error, random_codes, random_qparams, ref_requant, runtime,
)
from ops.logical import CONSTANT_FRACTION_BITS
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node
from ptq.core.qparams import QParams

COMPARES = {"Equal": lambda a, b: a == b, "Greater": lambda a, b: a > b, "GreaterOrEqual": lambda a, b: a >= b,
            "Less": lambda a, b: a < b, "LessOrEqual": lambda a, b: a <= b}
MIRRORED = {"Equal": "Equal", "Greater": "Less", "Less": "Greater", "GreaterOrEqual": "LessOrEqual",
            "LessOrEqual": "GreaterOrEqual"}
BOOL_OPS = {"And": lambda a, b: a and b, "Or": lambda a, b: a or b, "Xor": lambda a, b: a != b}


def ort_typed(op_type: str, inputs: dict, constants=None, attrs=None, out_type=TensorProto.BOOL) -> np.ndarray:
    """onnxruntime on one node whose inputs keep their numpy dtypes (bool, float32) and `constants` follow them."""
    constants = constants or {}
    tensor = helper.np_dtype_to_tensor_dtype
    graph = helper.make_graph(
        [helper.make_node(op_type, list(inputs) + list(constants), ["out"], **(attrs or {}))], "single",
        [helper.make_tensor_value_info(k, tensor(v.dtype), v.shape) for k, v in inputs.items()],
        [helper.make_tensor_value_info("out", out_type, None)],
        [numpy_helper.from_array(v, k) for k, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)[0]


def _compare(op_type, qps, args, constants=None):
    node = Node("cmp", op_type, ["a", "b"], ["y"])
    op = get_op(op_type)
    q = op.quantize(context(node, qps, [None], constants))
    assert q.out_qparams == [None] and op.index_outputs(node) == {0}
    y = op.forward_int(q, args, runtime())[0]
    assert y.dtype == np.bool_
    return q, y


@covers(*COMPARES, check=Check.INT_REFERENCE)
@covers(*COMPARES, check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type", sorted(COMPARES))
@pytest.mark.parametrize("grids", ["same", "pow2", "other"])
def test_comparison_of_two_activations(op_type, grids):
    rng = np.random.default_rng(len(op_type) + len(grids))
    a_qp = random_qparams(rng, -2.0, 3.0, 8)
    if grids == "same":
        b_qp = a_qp
    elif grids == "pow2":
        b_qp = QParams(scale=a_qp.scale / 4, zero_point=3, bits=8, signed=True)
    else:
        b_qp = random_qparams(rng, -1.3, 1.7, 8)
    a_q = random_codes(rng, a_qp, (6, 40))
    b_q = random_codes(rng, b_qp, (40,))
    a_q[0] = a_qp.quantize(b_qp.dequantize(b_q))  # a row of (near-)ties: equal values where the grids allow
    q, y = _compare(op_type, [a_qp, b_qp], [a_q, b_q])

    f0, f1 = q.factors
    a_c = (a_q.astype(np.int64) - int(a_qp.zero_point[0])).tolist()
    b_c = (b_q.astype(np.int64) - int(b_qp.zero_point[0])).tolist()
    want = [[COMPARES[op_type](x * f0, z * f1) for x, z in zip(row, b_c)] for row in a_c]
    np.testing.assert_array_equal(y, want)

    a_f, b_f = a_qp.dequantize(a_q), b_qp.dequantize(b_q)
    y_float = ort_typed(op_type, {"a": a_f, "b": b_f})
    big, small = (a_qp, b_qp) if a_qp.scale[0] >= b_qp.scale[0] else (b_qp, a_qp)
    m = min(f0, f1)
    n = max(f0, f1).bit_length() - 1
    ratio_err = abs(m / 2.0 ** n - small.scale[0] / big.scale[0])
    small_c = np.abs(np.broadcast_to(b_c if small is b_qp else a_c, a_q.shape))
    band = small_c * float(big.scale[0]) * ratio_err + 1e-6
    differ = y != y_float
    assert np.all(np.abs(a_f - b_f)[differ] <= band[differ])
    if grids != "other":
        np.testing.assert_array_equal(y, y_float)  # equal scales or a power of two apart: exact
        assert np.any(y_float) and not np.all(y_float)


@pytest.mark.parametrize("op_type", sorted(COMPARES))
@pytest.mark.parametrize("constant_first", [False, True])
def test_comparison_with_a_constant(op_type, constant_first):
    rng = np.random.default_rng(len(op_type) + 5 * constant_first)
    x_qp = random_qparams(rng, -2.0, 3.0, 8)
    x_q = np.arange(x_qp.qmin, x_qp.qmax + 1).astype(x_qp.dtype).reshape(-1, 1)
    grid_point = float(x_qp.dequantize(np.array([x_qp.qmax // 2]))[0])
    c = np.array([0.0, 0.5, grid_point, -1e9, np.inf], np.float32)
    if constant_first:
        q, y = _compare(op_type, [None, x_qp], [c, x_q], {0: c})
        # ort_typed puts graph inputs first: L(c, x) is the mirrored comparison of (x, c)
        y_float = ort_typed(MIRRORED[op_type], {"x": x_qp.dequantize(x_q)}, {"c": c})
    else:
        q, y = _compare(op_type, [x_qp, None], [x_q, c], {1: c})
        y_float = ort_typed(op_type, {"x": x_qp.dequantize(x_q)}, {"c": c})
    scale = float(x_qp.scale[0])
    codes = q.constant_codes[0 if constant_first else 1]
    assert codes.tolist()[:3] == [round(float(v) * 2 ** CONSTANT_FRACTION_BITS / scale) for v in c[:3]]
    x_k = ((x_q.astype(np.int64) - int(x_qp.zero_point[0])) << CONSTANT_FRACTION_BITS).tolist()
    pairs = [[(cc, xx[0]) if constant_first else (xx[0], cc) for cc in codes.tolist()] for xx in x_k]
    np.testing.assert_array_equal(y, [[COMPARES[op_type](u, v) for u, v in row] for row in pairs])
    differ = y != y_float
    band = scale * 2.0 ** -(CONSTANT_FRACTION_BITS + 1) + 1e-6
    assert np.all(np.abs(x_qp.dequantize(x_q) - c)[differ] <= band)
    assert not differ[:, 2].any()  # a constant on the grid compares exactly (Equal included)


@covers(*BOOL_OPS, "Not", check=Check.INT_REFERENCE)
@covers(*BOOL_OPS, "Not", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type", sorted(BOOL_OPS) + ["Not"])
def test_bool_ops(op_type):
    a = np.array([[True, False, True, False]])
    b = np.array([[True], [False]])
    op = get_op(op_type)
    names = ["a"] if op_type == "Not" else ["a", "b"]
    node = Node("b", op_type, names, ["y"])
    args = [a] if op_type == "Not" else [a, b]
    q = op.quantize(context(node, [None] * len(args), [None]))
    y = op.forward_int(q, args, runtime())[0]
    if op_type == "Not":
        want = [[not v for v in a[0].tolist()]]
    else:
        want = [[BOOL_OPS[op_type](u, v) for u in a[0].tolist()] for v in b[:, 0].tolist()]
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(op.forward_float(node, args)[0], ort_typed(op_type, dict(zip(names, args))))
    with pytest.raises(ValueError, match="must be bool"):
        op.forward_int(q, [a.astype(np.int8)] + args[1:], runtime())


@covers("Where", check=Check.INT_REFERENCE)
@covers("Where", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("constant_branch", [False, True])
def test_where_requantizes_both_branches(bits, constant_branch):
    rng = np.random.default_rng(bits + constant_branch)
    x_qp = random_qparams(rng, -2.0, 3.0, bits)
    y_qp = random_qparams(rng, -4.0, 1.0, bits)
    cond = rng.integers(0, 2, size=(3, 1, 5)).astype(bool)
    x_q = random_codes(rng, x_qp, (3, 4, 5))
    y_q = random_codes(rng, y_qp, (4, 5))
    z_qp = random_qparams(rng, -3.0, 2.5, bits, symmetric=False)
    node = Node("w", "Where", ["c", "x", "y"], ["z"])
    op = get_op("Where")
    inputs = {"c": cond, "x": x_qp.dequantize(x_q)}
    if constant_branch:
        const = np.array([-1e9, 0.25, 7.0, -0.5, 1.0], np.float32)  # a mask fill, values in and out of range
        q = op.quantize(context(node, [None, x_qp, None], [z_qp], {2: const}))
        z = op.forward_int(q, [cond, x_q, const], runtime())[0]
        other = np.array([min(max(round(float(v) / float(z_qp.scale[0])) + int(z_qp.zero_point[0]), z_qp.qmin),
                              z_qp.qmax) for v in const])
        z_float = ort_typed("Where", inputs, {"y": const}, out_type=TensorProto.FLOAT)
    else:
        q = op.quantize(context(node, [None, x_qp, y_qp], [z_qp]))
        z = op.forward_int(q, [cond, x_q, y_q], runtime())[0]
        other = ref_requant(y_q.astype(np.int64) - int(y_qp.zero_point[0]), q.m[1], q.n[1],
                            int(z_qp.zero_point[0]), z_qp.qmin, z_qp.qmax)
        z_float = ort_typed("Where", {**inputs, "y": y_qp.dequantize(y_q)}, out_type=TensorProto.FLOAT)
    assert z.dtype == z_qp.dtype
    first = ref_requant(x_q.astype(np.int64) - int(x_qp.zero_point[0]), q.m[0], q.n[0], int(z_qp.zero_point[0]),
                        z_qp.qmin, z_qp.qmax)
    np.testing.assert_array_equal(z, np.where(cond, first, other))
    bound = 0.5
    for k, qp in enumerate([x_qp] if constant_branch else [x_qp, y_qp]):
        err = abs(int(q.m[k]) / 2.0 ** int(q.n[k]) - float(qp.scale[0]) / float(z_qp.scale[0]))
        bound = max(bound, 0.5 + 2 ** bits * err)
    assert lsb_error(z_qp, z, z_float) <= bound + 1e-3
    np.testing.assert_array_equal(op.forward_float(node, [cond, inputs["x"], z_float])[0],
                                  np.where(cond, inputs["x"], z_float))


def test_both_constant_comparison_is_refused():
    node = Node("cmp", "Less", ["a", "b"], ["y"])
    with pytest.raises(QuantizationError, match="both inputs are constants"):
        get_op("Less").quantize(context(node, [None, None], [None], {0: np.zeros(1), 1: np.ones(1)}))


def test_greater_not_where_run_in_integers_in_a_graph():
    """Greater on an activation runs its integer forward (an index output, no qparams); Not, reading only bools,
    stays a shape step; Where selects in integers; the result matches onnxruntime."""
    from ptq.engine.executor import NodeKind, prepare
    from ptq.calibration.pipeline import calibrate
    from tiny_models import make_model

    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.4, (4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Greater", ["c", "half"], ["mask"], name="gt"),
             helper.make_node("Not", ["mask"], ["keep"], name="not"),
             helper.make_node("Where", ["keep", "c", "fill"], ["y"], name="where")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6]),
                        helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 4, 6, 6]),
                        helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 4, 6, 6])],
                       [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.float32(0.5), "half"),
                        numpy_helper.from_array(np.float32(-1.0), "fill")])
    x = rng.normal(0, 1, (16, 1, 3, 6, 6)).astype(np.float32)
    result = calibrate(model, x[:, 0], write_qdq=False)
    graph = prepare(result.graph, result.table)
    kinds = {s.node.name: s.kind for s in graph.steps}
    assert kinds == {"conv": NodeKind.INTEGER, "gt": NodeKind.INTEGER, "not": NodeKind.SHAPE,
                     "where": NodeKind.INTEGER}
    assert "mask" not in graph.qparams
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for sample in x[:4]:
        want_c, want_y, want_mask = sess.run(["c", "y", "mask"], {"x": sample})
        run = graph.run({"x": sample})
        conv_q = graph.qparams["c"].dequantize(run.tensors["c"])
        np.testing.assert_array_equal(run.outputs["mask"], conv_q > 0.5)  # exact on the integer conv output
        flipped = run.outputs["mask"] != want_mask  # where the conv output's own error crosses 0.5
        assert flipped.mean() < 0.03
        got, want = run.outputs["y"][~flipped], want_y[~flipped]
        assert float(np.sum(got * want) / (np.linalg.norm(got) * np.linalg.norm(want))) > 0.999


def test_check_quantized_wants_no_qparams_on_index_outputs_only():
    from ops.registry import QuantizedNode, check_quantized

    qp = random_qparams(np.random.default_rng(0), -1.0, 1.0, 8)
    equal = Node("eq", "Equal", ["a", "b"], ["y"])
    check_quantized(QuantizedNode(equal, [qp, qp], [None]))
    with pytest.raises(QuantizationError, match="index output"):
        check_quantized(QuantizedNode(equal, [qp, qp], [qp]))
    with pytest.raises(QuantizationError, match="no qparams after quantize"):
        check_quantized(QuantizedNode(Node("w", "Where", ["c", "a", "b"], ["y"]), [None, qp, qp], [None]))
