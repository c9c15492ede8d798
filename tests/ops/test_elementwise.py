"""ops/elementwise.py: Add, Sub, Mul.

(a) forward_int equals an int64 reference of the op's integer formula written here independently (loops /
einsum over small shapes, Python-integer requant); (b) the dequantized output is within the op's documented
LSB bound of the float op (onnxruntime) run on the dequantized inputs and weights; forward_float matches
onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    Check,
    MBITS,
    assert_forward_float_matches_onnxruntime,
    check_multiplier,
    context,
    covers,
    lsb_error,
    ort_single,
    random_qparams,
    ref_requant,
    runtime,
)
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams


ELEMENTWISE_CASES = [
    # a_shape, b_shape, bits_a, bits_b, bits_y, b_constant
    ((2, 3, 4), (2, 3, 4), 8, 8, 8, False),
    ((2, 3, 4), (3, 1), 8, 8, 8, False),
    ((1, 3, 1, 1), (2, 3, 4, 4), 8, 16, 8, False),
    ((2, 5), (5,), 16, 16, 16, False),
    ((2, 3, 4, 4), (3, 1, 1), 8, None, 8, True),
]


def _elementwise_setup(seed, case, op_type):
    a_shape, b_shape, bits_a, bits_b, bits_y, b_constant = case
    rng = np.random.default_rng(seed)
    a_f = rng.normal(0.2, 1.0, size=a_shape).astype(np.float32)
    b_f = rng.normal(-0.1, 3.0, size=b_shape).astype(np.float32)
    a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), bits_a, signed=bool(rng.integers(2)))
    a_q = a_qp.quantize(a_f)
    if b_constant:
        b_qp = compute_qparams(float(b_f.min()), float(b_f.max()), bits_a, symmetric=False)
        inputs = {"a": a_qp.dequantize(a_q)}
        consts = {"b": b_qp.dequantize(b_qp.quantize(b_f))}
        b_q = None
    else:
        b_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), bits_b, signed=bool(rng.integers(2)))
        b_q = b_qp.quantize(b_f)
        inputs = {"a": a_qp.dequantize(a_q), "b": b_qp.dequantize(b_q)}
        consts = {}
    y_float = ort_single(op_type, inputs, {}, consts)[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), bits_y, symmetric=False)
    return a_f, a_q, a_qp, b_f, b_q, b_qp, y_qp, y_float


@covers("Add", "Sub", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("op_type", ["Add", "Sub"])
@pytest.mark.parametrize("case", ELEMENTWISE_CASES)
def test_add_sub_int_equals_reference_and_float_bound(op_type, case):
    a_f, a_q, a_qp, b_f, b_q, b_qp, y_qp, y_float = _elementwise_setup(len(case[0]) + case[2], case, op_type)
    b_constant = case[5]
    node = Node("e", op_type, ["a", "b"], ["y"])
    op = get_op(op_type)
    ctx = context(node, [a_qp, None if b_constant else b_qp], [y_qp], {1: b_f} if b_constant else {})
    q = op.quantize(ctx)
    y = op.forward_int(q, [a_q, b_f if b_constant else b_q], runtime())[0]

    if b_constant:
        assert q.in_qparams[1] == b_qp  # quantized per tensor with its own min/max
        b_q = b_qp.quantize(b_f)
    shift = 16
    ra, rb = a_qp.scale[0] / y_qp.scale[0], b_qp.scale[0] / y_qp.scale[0]
    check_multiplier(q.m, q.n, np.array([ra, rb]))
    a_c = ref_requant((a_q.astype(np.int64) - int(a_qp.zero_point[0])) * (1 << shift), q.m[0], q.n[0], 0, -2**62, 2**62)
    b_c = ref_requant((b_q.astype(np.int64) - int(b_qp.zero_point[0])) * (1 << shift), q.m[1], q.n[1], 0, -2**62, 2**62)
    total = a_c + b_c if op_type == "Add" else a_c - b_c
    want = ref_requant(total, 1, shift, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want)
    codes = max(2 ** a_qp.bits * ra, 2 ** b_qp.bits * rb)
    bound = 0.5 + 2.0 ** -shift + 2 * codes * 2.0 ** -(MBITS - 1)
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-3


@covers("Mul", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("case", ELEMENTWISE_CASES)
def test_mul_int_equals_reference_and_float_bound(case):
    a_f, a_q, a_qp, b_f, b_q, b_qp, y_qp, y_float = _elementwise_setup(len(case[1]) + case[2], case, "Mul")
    b_constant = case[5]
    node = Node("e", "Mul", ["a", "b"], ["y"])
    op = get_op("Mul")
    ctx = context(node, [a_qp, None if b_constant else b_qp], [y_qp], {1: b_f} if b_constant else {})
    q = op.quantize(ctx)
    y = op.forward_int(q, [a_q, b_f if b_constant else b_q], runtime())[0]
    if b_constant:
        b_q = b_qp.quantize(b_f)
    r = a_qp.scale[0] * b_qp.scale[0] / y_qp.scale[0]
    check_multiplier(q.m, q.n, r)
    prod = (a_q.astype(np.int64) - int(a_qp.zero_point[0])) * (b_q.astype(np.int64) - int(b_qp.zero_point[0]))
    np.testing.assert_array_equal(y, ref_requant(prod, q.m, q.n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    bound = 0.5 + float(np.abs(prod).max()) * abs(q.m[0] / 2.0 ** q.n[0] - r)
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-3


def test_elementwise_needs_input_qparams():
    qp = compute_qparams(-1, 1)
    node = Node("e", "Add", ["a", "b"], ["y"])
    with pytest.raises(QuantizationError, match="input 1"):
        get_op("Add").quantize(context(node, [qp, None], [qp]))


@covers("Sub", check=Check.INT_REFERENCE)
def test_sub_with_a_constant_first_input():
    """Sub is not symmetric: a constant minuend is quantized per tensor with its own min/max and the
    activation is subtracted from it."""
    rng = np.random.default_rng(11)
    a_f = rng.normal(size=(3, 1)).astype(np.float32)
    b_f = rng.normal(size=(2, 3, 4)).astype(np.float32)
    b_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), 8, signed=False)
    b_q = b_qp.quantize(b_f)
    a_qp = compute_qparams(float(a_f.min()), float(a_f.max()), 8, symmetric=False)
    y_float = a_qp.dequantize(a_qp.quantize(a_f)) - b_qp.dequantize(b_q)  # float64-exact Sub of the grids
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("s", "Sub", ["a", "b"], ["y"])
    q = get_op("Sub").quantize(context(node, [None, b_qp], [y_qp], {0: a_f}))
    assert q.in_qparams[0] == a_qp
    y = get_op("Sub").forward_int(q, [a_f, b_q], runtime())[0]
    a_c = ref_requant((a_qp.quantize(a_f).astype(np.int64) - int(a_qp.zero_point[0])) << 16, q.m[0], q.n[0], 0,
                      -2**62, 2**62)
    b_c = ref_requant((b_q.astype(np.int64) - int(b_qp.zero_point[0])) << 16, q.m[1], q.n[1], 0, -2**62, 2**62)
    np.testing.assert_array_equal(y, ref_requant(a_c - b_c, 1, 16, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    assert lsb_error(y_qp, y, y_float) <= 0.6


FLOAT_CASES = [
    ("Add", {}, [(2, 3, 4), (3, 1)], []),
    ("Sub", {}, [(2, 3, 4)], [(4,)]),
    ("Mul", {}, [(2, 3, 4), (2, 1, 4)], []),
]


@covers("Add", "Sub", "Mul", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type, attrs, input_shapes, const_shapes", FLOAT_CASES)
def test_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes):
    assert_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes)


@covers("Mul", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("factor", [-3.4028234663852886e+38, -1e9, 3e6])
def test_mul_by_a_factor_beyond_the_multiplier_saturates(factor):
    """(1 - mask) * finfo.min onto a [-1e4, 0] grid: s_a s_b / s_y ~ 1e34, no 15-bit multiplier (before: a
    QuantizationError, the node in float). Every nonzero product saturates to the end of the grid it points
    to, zero stays zero: the docstring's clip-and-shift formula, and the float product clamped to the grid."""
    a_qp = compute_qparams(0.0, 1.0, 8, symmetric=False, signed=False)
    lo, hi = (-1e4, 0.0) if factor < 0 else (0.0, 1e4)
    y_qp = compute_qparams(lo, hi, 8, symmetric=False)
    node = Node("m", "Mul", ["a", "c"], ["y"])
    op = get_op("Mul")
    q = op.quantize(context(node, [a_qp, None], [y_qp], {1: np.float32(factor)}))
    a_q = np.arange(256, dtype=np.uint8)
    y = op.forward_int(q, [a_q, None], runtime())[0]
    c_codes = q.constant_codes[1].astype(np.int64) - int(q.in_qparams[1].zero_point[0])
    product = [int(v) * int(c_codes.ravel()[0]) * int(q.m[0]) for v in a_q.astype(np.int64)]
    reference = [min(max((max(-(1 << 17), min(1 << 17, p)) << q.left_shift) + int(y_qp.zero_point[0]), y_qp.qmin),
                     y_qp.qmax) for p in product]
    np.testing.assert_array_equal(y, reference)
    want = y_qp.quantize(np.clip(a_qp.dequantize(a_q).astype(np.float64) * factor, *y_qp.real_range()))
    np.testing.assert_array_equal(y, want)
