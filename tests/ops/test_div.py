"""Div (ops/div.py): constant divisor folded into the multiplier, run-time divisor by integer division rounded
by the remainder, and the reciprocal-table variant; each against a Python-integer reference of its formula
(exact) and against onnxruntime's float Div (within the stated LSB bound)."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, ref_requant, runtime,
)
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams
from ptq.core.requant import quantize_multiplier

MBITS = 15


def _round_half_away(num: int, den: int) -> int:
    """Python-integer reference of round(num / den), halves away from zero."""
    q, r = divmod(abs(num), abs(den))
    q += 2 * r >= abs(den)
    return q if (num < 0) == (den < 0) else -q


@covers("Div", check=Check.ONNXRUNTIME)
@covers("Div", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("b_shape", [(), (1, 3, 1, 1), (2, 3, 4, 5)])
@pytest.mark.parametrize("bits", [8, 16])
def test_constant_divisor_is_folded_into_the_multiplier(b_shape, bits):
    rng = np.random.default_rng(len(b_shape) + bits)
    a_qp = random_qparams(rng, -3.0, 5.0, bits)
    a_q = random_codes(rng, a_qp, (2, 3, 4, 5))
    if b_shape:
        b = (rng.choice([-1, 1], size=b_shape) * rng.uniform(0.3, 8.0, size=b_shape)).astype(np.float32)
    else:
        b = np.array(6.0, np.float32)  # the divisor of a decomposed hard-swish
    y_float = ort_single("Div", {"a": a_qp.dequantize(a_q)}, constants={"b": b})[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), bits, symmetric=False)
    node = Node("div", "Div", ["a", "b"], ["y"])
    q = get_op("Div").quantize(context(node, [a_qp, None], [y_qp], {1: b}))
    y = get_op("Div").forward_int(q, [a_q, b], runtime())[0]

    r = a_qp.scale[0] / (np.abs(b.astype(np.float64)) * y_qp.scale[0])
    assert np.all(np.abs(q.m / np.exp2(q.n) - r) <= r * 2.0 ** -(MBITS - 1))
    a_c = (a_q.astype(np.int64) - int(a_qp.zero_point[0])) * np.sign(b).astype(np.int64)
    want = ref_requant(a_c, q.m, q.n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want)
    assert y.dtype == y_qp.dtype
    bound = 0.5 + (2 ** bits) * 2.0 ** -(MBITS - 1)
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-6


@pytest.mark.parametrize("signed_b", [False, True])
def test_runtime_divisor_int_equals_reference_and_float_bound(signed_b):
    rng = np.random.default_rng(3 + signed_b)
    a_qp = random_qparams(rng, -4.0, 4.0, 8)
    b_qp = random_qparams(rng, -2.0 if signed_b else 0.25, 2.0, 8)
    a_q = random_codes(rng, a_qp, (3, 4, 6))
    b_q = random_codes(rng, b_qp, (4, 6))
    b_q[np.abs(b_qp.dequantize(b_q)) < 0.25] = b_qp.quantize(np.array([0.5]))[0]  # keep |y| in a sane range
    y_float = ort_single("Div", {"a": a_qp.dequantize(a_q), "b": b_qp.dequantize(b_q)})[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("div", "Div", ["a", "b"], ["y"])
    q = get_op("Div").quantize(context(node, [a_qp, b_qp], [y_qp]))
    y = get_op("Div").forward_int(q, [a_q, b_q], runtime())[0]
    assert y.dtype == y_qp.dtype
    a_c = (a_q.astype(np.int64) - int(a_qp.zero_point[0]))
    b_c = np.broadcast_to(b_q.astype(np.int64) - int(b_qp.zero_point[0]), a_c.shape)
    m, n = int(q.m[0]), int(q.n[0])
    quotient = np.array([_round_half_away(int(x) * m, int(d)) for x, d in zip(a_c.ravel(), b_c.ravel())])
    want = ref_requant(quotient.reshape(a_c.shape), 1, n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want)
    bound = 0.5 + 0.5 * 2.0 ** -n + 2 ** 8 * 2.0 ** -(MBITS - 1)
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-6


RECIPROCAL_MAX = 32767  # the 16-bit reciprocal code of |b_c| = 1 (lut.arith), restated


@covers("Div", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("b_range, b_symmetric", [((-2.0, 2.0), True), ((-0.7, 3.0), False), ((0.0, 2.5), False)])
def test_reciprocal_div_on_every_code_pair(b_range, b_symmetric):
    """QuantizeOptions(reciprocal_div=True), all 65,536 pairs of 8-bit codes, the zero divisor included: equal to
    a Python-integer reference (R = round_half_away(32767 / b_c), R(0) unused: b_f = 0 saturates with the sign
    of a, 0 / 0 gives zp_y), and within 0.5 + |y_c| (0.5 |b_c| / 32767 + 2^-14) LSB of the exact a_f / b_f."""
    a_qp = compute_qparams(-3.0, 4.0, 8, symmetric=False)
    b_qp = compute_qparams(*b_range, 8, symmetric=b_symmetric)
    y_qp = compute_qparams(-16.0, 16.0, 8, symmetric=False)
    a_q, b_q = (np.array(v, dtype=np.int8).ravel() for v in np.meshgrid(np.arange(-128, 128), np.arange(-128, 128)))
    if not b_qp.signed:
        b_q = (b_q.astype(np.int64) + 128).astype(np.uint8)
    node = Node("div", "Div", ["a", "b"], ["y"])
    q = get_op("Div").quantize(context(node, [a_qp, b_qp], [y_qp], reciprocal_div=True))
    y = get_op("Div").forward_int(q, [a_q, b_q], runtime())[0]

    a_c = a_q.astype(np.int64) - int(a_qp.zero_point[0])
    b_c = b_q.astype(np.int64) - int(b_qp.zero_point[0])
    r = np.array([_round_half_away(RECIPROCAL_MAX, int(d)) if d else 0 for d in b_c], dtype=np.int64)
    s_r = 1.0 / (float(b_qp.scale[0]) * RECIPROCAL_MAX)
    m, n = quantize_multiplier(float(a_qp.scale[0]) * s_r / float(y_qp.scale[0]), MBITS)
    want = ref_requant(a_c * r, int(m[0]), int(n[0]), int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    want = np.where(b_c != 0, want, np.where(a_c > 0, y_qp.qmax, np.where(a_c < 0, y_qp.qmin, y_qp.zero_point[0])))
    np.testing.assert_array_equal(y, want)

    a_f, b_f = a_qp.dequantize(a_q).astype(np.float64), b_qp.dequantize(b_q).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = np.where((a_c == 0) & (b_c == 0), 0.0, a_f / b_f)  # +-inf for b_f = 0: the output saturates
    lo, hi = (float(v[0]) for v in y_qp.real_range())
    err = np.abs(y_qp.dequantize(y).astype(np.float64) - np.clip(exact, lo, hi)) / float(y_qp.scale[0])
    y_c = np.abs(y.astype(np.int64) - int(y_qp.zero_point[0]))
    bound = 0.5 + y_c * (0.5 * np.abs(b_c) / RECIPROCAL_MAX + 2.0 ** -(MBITS - 1)) + 1e-9
    assert np.all(err <= bound), f"{np.count_nonzero(err > bound)} pairs over the bound, worst {err.max():.2f} LSB"
    assert np.all(err <= 1.5)


def test_zero_divisor_saturates_with_the_sign_of_a():
    qp = random_qparams(np.random.default_rng(0), -2.0, 2.0, 8, symmetric=True)
    node = Node("div", "Div", ["a", "b"], ["y"])
    q = get_op("Div").quantize(context(node, [qp, qp], [qp]))
    a_q = np.array([-50, 0, 50], np.int8)
    y = get_op("Div").forward_int(q, [a_q, np.zeros(3, np.int8)], runtime())[0]
    np.testing.assert_array_equal(y, [qp.qmin, 0, qp.qmax])


def test_a_zero_constant_divisor_is_refused():
    qp = random_qparams(np.random.default_rng(0), -2.0, 2.0, 8)
    node = Node("div", "Div", ["a", "b"], ["y"])
    with pytest.raises(QuantizationError, match="divisor holds 0"):
        get_op("Div").quantize(context(node, [qp, None], [qp], {1: np.array([1.0, 0.0], np.float32)}))


def test_a_graph_with_div_runs_in_integers_end_to_end():
    """The one new file is all it takes: calibration, the integer graph and the QDQ export handle Div."""
    from onnx import TensorProto, helper, numpy_helper
    import onnxruntime as ort

    from ptq.engine.executor import NodeKind, prepare
    from ptq.calibration.pipeline import calibrate
    from tiny_models import make_model

    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.4, (4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Div", ["c", "six"], ["d"], name="div"),
             helper.make_node("Div", ["d", "c"], ["y"], name="ratio")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6]),
                        helper.make_tensor_value_info("d", TensorProto.FLOAT, [1, 4, 6, 6])],
                       [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.float32(6), "six")])
    x = rng.normal(0, 1, (16, 1, 3, 6, 6)).astype(np.float32)
    result = calibrate(model, x[:, 0], write_qdq=False)
    graph = prepare(result.graph, result.table)
    assert [s.node.op_type for s in graph.steps if s.kind is NodeKind.INTEGER] == ["Conv", "Div", "Div"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for sample in x[:4]:
        want = sess.run(["d"], {"x": sample})[0]
        got = graph.run({"x": sample}).outputs["d"]
        cosine = float(np.sum(got * want) / (np.linalg.norm(got) * np.linalg.norm(want)))
        assert cosine > 0.999


@covers("Reciprocal", check=Check.INT_REFERENCE)
@covers("Reciprocal", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("x_range, y_range, bits", [
    ((0.0, 4.0), (0.0, 10.0), 8),  # a positive input down to 0 (the saturated code)
    ((-3.0, 2.0), (-4.0, 4.0), 8),  # both signs, asymmetric
    ((0.001, 0.03), (30.0, 1000.0), 8),  # K = 1 / (s_x s_y) > 2^15: the numerator is shifted left
    ((-2.0, 6.0), (-8.0, 8.0), 16),
])
def test_reciprocal_on_every_code(x_range, y_range, bits):
    x_qp = compute_qparams(*x_range, bits, symmetric=False)
    y_qp = compute_qparams(*y_range, bits, symmetric=False)
    x_q = np.arange(x_qp.qmin, x_qp.qmax + 1, dtype=np.int64).astype(x_qp.dtype)
    node = Node("r", "Reciprocal", ["x"], ["y"])
    q = get_op("Reciprocal").quantize(context(node, [x_qp], [y_qp]))
    y = get_op("Reciprocal").forward_int(q, [x_q], runtime())[0]
    assert y.dtype == y_qp.dtype

    k = 1.0 / (float(x_qp.scale[0]) * float(y_qp.scale[0]))
    e = max(0, int(np.ceil(np.log2(k / (2 ** MBITS - 1)))))
    m, n = (int(v[0]) for v in quantize_multiplier(k / 2.0 ** e, MBITS))
    assert abs(m * 2.0 ** (e - n) - k) <= k * 2.0 ** -(MBITS - 1)
    zp_y = int(y_qp.zero_point[0])
    want = []
    for code in x_q.astype(np.int64):
        x_c = int(code) - int(x_qp.zero_point[0])
        y_c = y_qp.qmax - zp_y if x_c == 0 else _round_half_away(m << e, x_c << n)
        want.append(min(max(y_c + zp_y, y_qp.qmin), y_qp.qmax))
    np.testing.assert_array_equal(y, want)

    x_f = x_qp.dequantize(x_q)
    with np.errstate(divide="ignore"):
        y_float = ort_single("Reciprocal", {"x": x_f})[0]
    assert np.all(y[x_f == 0] == y_qp.qmax) and np.isinf(y_float[x_f == 0]).all()
    y_c = np.abs(y.astype(np.int64) - zp_y)
    lo, hi = (float(v[0]) for v in y_qp.real_range())
    err = np.abs(y_qp.dequantize(y).astype(np.float64) - np.clip(y_float.astype(np.float64), lo, hi)) / y_qp.scale[0]
    assert np.all(err <= 0.5 + y_c * 2.0 ** -(MBITS - 1) + 1e-3)
