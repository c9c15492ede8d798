"""Cast (ops/cast.py): float -> float keeps the codes; float -> integer/bool is a table equal to onnxruntime's
Cast of every dequantized code (exact); integer/bool -> float requantizes the integer onto the output grid
(a Python-integer reference, and onnxruntime within the stated bound)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from op_testing import Check, context, covers, lsb_error, random_codes, random_qparams, ref_requant, runtime
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node
from test_logical import ort_typed

INDEX_TARGETS = [TensorProto.INT64, TensorProto.INT32, TensorProto.INT8, TensorProto.UINT8, TensorProto.BOOL]


def _cast(to, in_qp, out_qp, x):
    node = Node("cast", "Cast", ["x"], ["y"], {"to": to})
    op = get_op("Cast")
    q = op.quantize(context(node, [in_qp], [out_qp]))
    return op, node, q, op.forward_int(q, [x], runtime())[0]


@covers("Cast", check=Check.INT_REFERENCE)
@covers("Cast", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("to", INDEX_TARGETS)
@pytest.mark.parametrize("bits", [8, 16])
def test_cast_to_an_index_type_equals_onnxruntime_on_every_code(to, bits):
    rng = np.random.default_rng(to + bits)
    x_qp = random_qparams(rng, -3.0, 9.0 if to == TensorProto.UINT8 else 3.0, bits)
    codes = np.arange(x_qp.qmin, x_qp.qmax + 1).astype(x_qp.dtype)
    if to == TensorProto.UINT8:  # negative floats to uint8 are undefined in C++: keep them out
        codes = codes[x_qp.dequantize(codes) >= 0]
    op, node, q, y = _cast(to, x_qp, None, codes)
    assert q.out_qparams == [None] and op.index_outputs(node) == {0}
    want = ort_typed("Cast", {"x": x_qp.dequantize(codes)}, attrs={"to": to}, out_type=to)
    assert y.dtype == want.dtype
    np.testing.assert_array_equal(y, want)
    # independent reference of the rule: truncation toward zero of the real value (bool: nonzero)
    scale, zp = float(x_qp.scale[0]), int(x_qp.zero_point[0])
    real = [(int(c) - zp) * scale for c in codes]
    ref = [v != 0 for v in real] if to == TensorProto.BOOL else [int(v) for v in real]  # int() truncates
    differ = np.flatnonzero(np.asarray(ref) != y)
    # only where float32 dequantization itself crosses an integer (the table follows the float op there)
    assert all(abs(real[i] - round(real[i])) < 1e-5 * max(1.0, abs(real[i])) for i in differ)


def test_cast_between_float_types_keeps_the_codes():
    qp = random_qparams(np.random.default_rng(0), -1.0, 2.0, 8)
    x = random_codes(np.random.default_rng(1), qp, (3, 4))
    op, node, q, y = _cast(TensorProto.FLOAT16, qp, None, x)
    assert q.out_qparams == [qp] and op.index_outputs(node) == frozenset()
    np.testing.assert_array_equal(y, x)
    f = qp.dequantize(x)
    np.testing.assert_array_equal(op.forward_float(node, [f])[0], ort_typed("Cast", {"x": f}, attrs={"to": 10},
                                                                           out_type=TensorProto.FLOAT16))


@pytest.mark.parametrize("bool_input", [False, True])
def test_cast_from_an_index_tensor_requantizes_onto_the_output_grid(bool_input):
    rng = np.random.default_rng(4 + bool_input)
    if bool_input:
        x = rng.integers(0, 2, size=(4, 5)).astype(bool)
    else:
        x = np.concatenate([np.arange(-40, 300, 7), [10 ** 12, -(10 ** 12)]]).astype(np.int64)
    y_qp = random_qparams(rng, -30.0, 250.0, 8, symmetric=False)
    op, node, q, y = _cast(TensorProto.FLOAT, None, y_qp, x)
    assert y.dtype == y_qp.dtype
    y_float = ort_typed("Cast", {"x": x}, attrs={"to": TensorProto.FLOAT}, out_type=TensorProto.FLOAT)
    if bool_input:
        codes = [min(max(round(v / float(y_qp.scale[0])) + int(y_qp.zero_point[0]), y_qp.qmin), y_qp.qmax)
                 for v in (0.0, 1.0)]
        np.testing.assert_array_equal(y, np.where(x, codes[1], codes[0]))
        bound = 0.5
    else:
        lo, hi = q.clip
        want = ref_requant(np.clip(x, lo, hi), q.m, q.n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
        np.testing.assert_array_equal(y, want)
        bound = 0.5 + (hi + 1) * abs(int(q.m[0]) / 2.0 ** int(q.n[0]) - 1 / float(y_qp.scale[0]))
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-6


def test_index_to_index_cast_is_not_quantized_and_bad_targets_are_named():
    node = Node("cast", "Cast", ["x"], ["y"], {"to": TensorProto.INT32})
    with pytest.raises(QuantizationError, match="no qparams"):
        get_op("Cast").quantize(context(node, [None], [None]))
    assert get_op("Cast").forward_float(node, [np.array([2, -3], np.int64)])[0].dtype == np.int32
    node = Node("cast", "Cast", ["x"], ["y"], {"to": TensorProto.STRING})
    with pytest.raises(ValueError, match="attribute to=8"):
        get_op("Cast").index_outputs(node)


def test_cast_to_int64_runs_in_integers_in_a_graph():
    """A Cast of an activation to int64 is an integer step with an unquantized index output."""
    from ptq.engine.executor import NodeKind, prepare
    from ptq.calibration.pipeline import calibrate
    from tiny_models import make_model

    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"], name="mul"),
             helper.make_node("Cast", ["sq"], ["idx"], to=TensorProto.INT64, name="cast")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                       [helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 8]),
                        helper.make_tensor_value_info("sq", TensorProto.FLOAT, [1, 8])])
    x = np.random.default_rng(0).uniform(-3, 3, (8, 1, 8)).astype(np.float32)
    result = calibrate(model, x[:, 0], write_qdq=False)
    graph = prepare(result.graph, result.table)
    assert [s.kind for s in graph.steps] == [NodeKind.INTEGER, NodeKind.INTEGER]
    run = graph.run({"x": x[0]})
    assert run.outputs["idx"].dtype == np.int64
    np.testing.assert_array_equal(run.outputs["idx"], run.outputs["sq"].astype(np.int64))
