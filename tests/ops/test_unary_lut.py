"""Table ops (ops/unary_lut.py): the integer forward against a Python-float/int reference of the table formula
(exact for 8-bit inputs), against onnxruntime's float op (within 0.5 LSB for direct tables, 0.5 + the table's
measured error for 16-bit inputs), and the custom-domain ops' float forward against a numpy formula."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lut.table import MAX_FULL_TABLE_BITS
from op_testing import Check, context, covers, lsb_error, ort_single, random_qparams, runtime
from ops.lut_ops import WIDE_TABLE_BUDGET_LSB
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node

FLOAT_SLACK = 1e-3  # LSB: float32 evaluation in onnxruntime vs the float64 table


def _selu(x, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    return gamma * (x if x > 0 else alpha * math.expm1(x))


def _nonneg(f):
    return lambda x: f(max(x, 0.0))


def _rsqrt(x):
    return math.inf if x == 0 else 1.0 / math.sqrt(x)


def _log(x):
    return -math.inf if x == 0 else math.log(x)


# op type -> (scalar reference in Python floats, input range, ONNX attributes)
ONNX_CASES = {
    "Exp": (math.exp, (-4.0, 3.0), {}),
    "Log": (_nonneg(_log), (0.0, 6.0), {}),
    "Erf": (math.erf, (-3.0, 3.0), {}),
    "Sin": (math.sin, (-4.0, 4.0), {}),
    "Cos": (math.cos, (-4.0, 4.0), {}),
    "Sqrt": (_nonneg(math.sqrt), (0.0, 9.0), {}),
    "Elu": (lambda x: x if x > 0 else 0.7 * math.expm1(x), (-4.0, 3.0), {"alpha": 0.7}),
    "Selu": (_selu, (-4.0, 3.0), {}),
    "Softplus": (lambda x: math.log1p(math.exp(x)), (-6.0, 6.0), {}),
    "Softsign": (lambda x: x / (1 + abs(x)), (-8.0, 8.0), {}),
}
CUSTOM_CASES = {
    "Rsqrt": (_nonneg(_rsqrt), (0.0, 9.0), lambda x: 1.0 / np.sqrt(x)),
    "BNLL": (lambda x: x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x)), (-6.0, 6.0),
             lambda x: np.where(x > 0, x + np.log1p(np.exp(-x)), np.log1p(np.exp(x)))),
}
SMOOTH = ["Exp", "Erf", "Sin", "Cos", "Elu", "Selu", "Softplus", "Softsign", "BNLL"]


def _node(op_type: str, attrs=None) -> Node:
    domain = "ai.ptq" if op_type in CUSTOM_CASES else ""
    return Node(op_type.lower(), op_type, ["x"], ["y"], dict(attrs or {}), domain)


def _reference(f, x_qp, y_qp, codes) -> np.ndarray:
    """clamp(round_half_even(f((x_q - zp_x) * s_x) / s_y) + zp_y) per code, in Python floats and ints."""
    out = []
    for q in codes.ravel().tolist():
        v = f((q - int(x_qp.zero_point[0])) * float(x_qp.scale[0])) / float(y_qp.scale[0])
        r = v if math.isinf(v) else round(v)  # Python's round is half to even
        out.append(min(max(r + int(y_qp.zero_point[0]), y_qp.qmin), y_qp.qmax))
    return np.array(out, dtype=np.int64).reshape(codes.shape)


def _output_qparams(rng, y_float, bits):
    finite = y_float[np.isfinite(y_float)]
    return random_qparams(rng, float(finite.min()), float(finite.max()), bits)


def _all_codes(qp) -> np.ndarray:
    return np.arange(qp.qmin, qp.qmax + 1).astype(qp.dtype).reshape(1, -1)


def _run(op_type, node, x_qp, y_qp, codes):
    op = get_op(op_type, node.domain)
    q = op.quantize(context(node, [x_qp], [y_qp]))
    y = op.forward_int(q, [codes], runtime())[0]
    assert y.dtype == y_qp.dtype
    return q, y


@covers(*ONNX_CASES, check=Check.INT_REFERENCE)
@covers(*ONNX_CASES, check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type", sorted(ONNX_CASES))
@pytest.mark.parametrize("symmetric", [False, True])
def test_table_op_equals_reference_and_onnxruntime(op_type, symmetric):
    f, (lo, hi), attrs = ONNX_CASES[op_type]
    rng = np.random.default_rng(sum(map(ord, op_type)) + symmetric)
    x_qp = random_qparams(rng, lo, hi, 8, symmetric=symmetric)
    codes = _all_codes(x_qp)
    y_float = ort_single(op_type, {"x": x_qp.dequantize(codes)}, attrs)[0]
    y_qp = _output_qparams(rng, y_float, 8)
    q, y = _run(op_type, _node(op_type, attrs), x_qp, y_qp, codes)
    np.testing.assert_array_equal(y, _reference(f, x_qp, y_qp, codes))
    assert lsb_error(y_qp, y, y_float) <= 0.5 + FLOAT_SLACK


@covers(*CUSTOM_CASES, check=Check.INT_REFERENCE, domain="ai.ptq")
@covers(*CUSTOM_CASES, check=Check.ONNXRUNTIME, domain="ai.ptq")
@pytest.mark.parametrize("op_type", sorted(CUSTOM_CASES))
def test_custom_table_op_equals_reference_and_numpy_formula(op_type):
    f, (lo, hi), formula = CUSTOM_CASES[op_type]
    rng = np.random.default_rng(sum(map(ord, op_type)))
    x_qp = random_qparams(rng, lo, hi, 8)
    codes = _all_codes(x_qp)
    x = x_qp.dequantize(codes)
    node = _node(op_type)
    with np.errstate(divide="ignore"):
        want = formula(x.astype(np.float64))
    y_float = get_op(op_type, "ai.ptq").forward_float(node, [x])[0]
    assert y_float.dtype == np.float32
    np.testing.assert_allclose(y_float, want, rtol=1e-6, atol=1e-6)
    y_qp = _output_qparams(rng, y_float, 8)
    q, y = _run(op_type, node, x_qp, y_qp, codes)
    np.testing.assert_array_equal(y, _reference(f, x_qp, y_qp, codes))
    assert lsb_error(y_qp, y, want) <= 0.5 + FLOAT_SLACK


@pytest.mark.parametrize("op_type", SMOOTH)
def test_16_bit_input_interpolates_within_the_stated_bound(op_type):
    f, (lo, hi), attrs = ONNX_CASES[op_type] if op_type in ONNX_CASES else CUSTOM_CASES[op_type][:2] + ({},)
    rng = np.random.default_rng(7 + sum(map(ord, op_type)))
    x_qp = random_qparams(rng, lo, hi, 16)
    codes = _all_codes(x_qp)[:, ::7]
    node = _node(op_type, attrs)
    x = x_qp.dequantize(codes)
    if op_type in ONNX_CASES:
        y_float = ort_single(op_type, {"x": x}, attrs)[0]
    else:
        y_float = CUSTOM_CASES[op_type][2](x.astype(np.float64))
    y_qp = _output_qparams(rng, y_float, 16)
    q, y = _run(op_type, node, x_qp, y_qp, codes)
    report = q.table.report()
    assert report.interpolated and report.max_error_lsb <= WIDE_TABLE_BUDGET_LSB
    # the table's measured error is against the reference formula: check it on these codes independently
    assert np.max(np.abs(y.astype(np.int64) - _reference(f, x_qp, y_qp, codes))) <= report.max_error_lsb
    assert lsb_error(y_qp, y, y_float) <= 0.5 + report.max_error_lsb + FLOAT_SLACK


@pytest.mark.parametrize("op_type", ["Log", "Sqrt", "Rsqrt"])
def test_singular_ops_refuse_wide_inputs_and_read_negative_codes_as_zero(op_type):
    rng = np.random.default_rng(1)
    node = _node(op_type)
    domain = node.domain
    y_qp = random_qparams(rng, -3.0, 3.0, 8)
    with pytest.raises(QuantizationError, match=f"at most {MAX_FULL_TABLE_BITS}-bit"):
        get_op(op_type, domain).quantize(context(node, [random_qparams(rng, 0.0, 4.0, 16)], [y_qp]))
    x_qp = random_qparams(rng, -1.0, 4.0, 8, symmetric=False)
    negative = np.arange(x_qp.qmin, int(x_qp.zero_point[0]) + 1).astype(x_qp.dtype)
    _, y = _run(op_type, node, x_qp, y_qp, negative)
    assert np.all(y == y[-1])  # every code at or below zero reads f(0)
