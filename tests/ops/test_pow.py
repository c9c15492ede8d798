"""Pow (ops/pow.py): constant exponents through a table (exponent 2 through the exact square rule), run-time
exponents through lut.arith's log/exp kernel, a constant base through a table on the exponent; each against a
Python reference of its formula (exact) and onnxruntime's float Pow (within the stated bound)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from op_testing import (
    Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, ref_requant, runtime,
)
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams

FLOAT_SLACK = 1e-3


def _quantize_ref(value: float, qp) -> int:
    if math.isinf(value):
        return qp.qmax if value > 0 else qp.qmin
    return min(max(round(value / float(qp.scale[0])) + int(qp.zero_point[0]), qp.qmin), qp.qmax)


def _pow_ref(x: float, alpha: float) -> float:
    if alpha != round(alpha):
        x = max(x, 0.0)
    if x == 0 and alpha < 0:
        return math.inf
    return x ** alpha


def _run(node, in_qp, out_qp, args, constants=None):
    op = get_op("Pow")
    q = op.quantize(context(node, in_qp, [out_qp], constants))
    z = op.forward_int(q, args, runtime())[0]
    assert z.dtype == out_qp.dtype
    return q, z


@covers("Pow", check=Check.INT_REFERENCE)
@covers("Pow", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("alpha,lo,hi,bits", [
    (2.0, -3.0, 2.0, 8), (3.0, -2.0, 2.0, 8), (0.5, 0.0, 6.0, 8), (1.5, 0.0, 4.0, 8), (-1.0, 0.0, 4.0, 8),
    (2.0, -3.0, 2.0, 16), (3.0, -2.0, 2.0, 16), (1.5, 0.0, 4.0, 16),  # 16 bits: not singular at 0
])
def test_constant_exponent(alpha, lo, hi, bits):
    rng = np.random.default_rng(int(10 * abs(alpha)) + bits)
    x_qp = random_qparams(rng, lo, hi, bits)
    codes = np.arange(x_qp.qmin, x_qp.qmax + 1, 1 if bits == 8 else 5).astype(x_qp.dtype)
    x = x_qp.dequantize(codes)
    exponent = np.array(alpha, np.float32)
    z_float = ort_single("Pow", {"x": x}, constants={"e": exponent})[0]
    finite = z_float[np.isfinite(z_float)]
    z_qp = random_qparams(rng, float(finite.min()), float(finite.max()), bits, symmetric=False)
    node = Node("pow", "Pow", ["x", "e"], ["z"])
    q, z = _run(node, [x_qp, None], z_qp, [codes, exponent], {1: exponent})
    x_c = codes.astype(np.int64) - int(x_qp.zero_point[0])
    if alpha == 2:
        want = ref_requant(x_c * x_c, q.m, q.n, int(z_qp.zero_point[0]), z_qp.qmin, z_qp.qmax)
        r = float(x_qp.scale[0]) ** 2 / float(z_qp.scale[0])
        bound = 0.5 + float(np.max(x_c * x_c)) * abs(int(q.m[0]) / 2.0 ** int(q.n[0]) - r)
        np.testing.assert_array_equal(z, want)
    else:
        want = np.array([_quantize_ref(_pow_ref(int(c) * float(x_qp.scale[0]), alpha), z_qp) for c in x_c])
        table_error = q.table.report().max_error_lsb
        bound = 0.5 + table_error
        assert np.abs(z.astype(np.int64) - want).max() <= table_error  # 0 for 8-bit direct tables
        if bits == 8:
            np.testing.assert_array_equal(z, want)
    assert lsb_error(z_qp, z, z_float) <= bound + FLOAT_SLACK


def test_singular_exponents_refuse_wide_inputs():
    x_qp = random_qparams(np.random.default_rng(0), 0.0, 4.0, 16)
    node = Node("pow", "Pow", ["x", "e"], ["z"])
    with pytest.raises(QuantizationError, match="at most 10-bit"):
        get_op("Pow").quantize(context(node, [x_qp, None], [x_qp], {1: np.array(0.5, np.float32)}))


def _kernel_ref(q, x_q, y_q) -> np.ndarray:
    """z = sign * EXP(requant((y - zp_y) * (LOG(x) - zp_L))) written out in Python integers (lut.arith's formula),
    with the tables' own entries (LOG, EXP lookups) as the only shared part."""
    k = q.kernel
    lq, vq, oq = k.log_table.out_qparams, k.exp_table.in_qparams, k.out_qparams
    out = []
    for x, y in zip(x_q.ravel().tolist(), y_q.ravel().tolist()):
        y_c = y - int(k.y_qparams.zero_point[0])
        x_c = x - int(k.x_qparams.zero_point[0])
        log_c = int(k.log_table.lookup(np.array([x]))[0]) - int(lq.zero_point[0])
        v = int(ref_requant(np.array([y_c * log_c]), k.multiplier, k.shift, int(vq.zero_point[0]), vq.qmin, vq.qmax)[0])
        mag = int(k.exp_table.lookup(np.array([v]))[0])
        if x_c == 0:
            z = int(oq.zero_point[0]) if y_c > 0 else (k.one_code if y_c == 0 else oq.qmax)
        elif x_c < 0:
            z = int(oq.zero_point[0]) + (-mag if y_c % 2 else mag) if k.integer_exponent else int(oq.zero_point[0])
        else:
            z = int(oq.zero_point[0]) + mag
        out.append(min(max(z, oq.qmin), oq.qmax))
    return np.array(out).reshape(x_q.shape)


@pytest.mark.parametrize("integer_exponent", [False, True])
def test_runtime_exponent(integer_exponent):
    rng = np.random.default_rng(11 + integer_exponent)
    if integer_exponent:  # an int64 exponent tensor and a signed base: (-x)^odd < 0
        x_qp = random_qparams(rng, -2.0, 2.0, 8)
        y_q = rng.integers(-2, 4, size=(4, 6)).astype(np.int64)
        y_qp, y_float_in = None, y_q.astype(np.float32)
    else:
        x_qp = compute_qparams(0.0, 4.0, 8, symmetric=False)
        y_qp = random_qparams(rng, -1.5, 2.0, 8)
        y_q = random_codes(rng, y_qp, (4, 6))
        y_float_in = y_qp.dequantize(y_q)
    x_q = random_codes(rng, x_qp, (3, 4, 6))
    x_q[np.abs(x_qp.dequantize(x_q)) < 0.3] = x_qp.quantize(np.array([0.5]))[0]  # keep |z| calibratable
    z_float = ort_single("Pow", {"x": x_qp.dequantize(x_q), "y": y_float_in})[0]
    z_qp = random_qparams(rng, float(z_float.min()), float(z_float.max()), 8, symmetric=False)
    node = Node("pow", "Pow", ["x", "y"], ["z"])
    q, z = _run(node, [x_qp, y_qp], z_qp, [x_q, y_q])
    np.testing.assert_array_equal(z, _kernel_ref(q, x_q, np.broadcast_to(y_q, x_q.shape)))
    assert lsb_error(z_qp, z, z_float) <= 1.0 + FLOAT_SLACK


def test_constant_exponent_with_several_values_runs_through_the_kernel():
    rng = np.random.default_rng(5)
    x_qp = compute_qparams(0.0, 3.0, 8, symmetric=False)
    x_q = random_codes(rng, x_qp, (2, 3))
    x_q[x_qp.dequantize(x_q) < 0.3] = x_qp.quantize(np.array([1.0]))[0]
    exponent = np.array([1.0, 2.0, -1.0], np.float32)
    z_float = ort_single("Pow", {"x": x_qp.dequantize(x_q)}, constants={"e": exponent})[0]
    z_qp = compute_qparams(0.0, float(z_float.max()), 8, symmetric=False)
    node = Node("pow", "Pow", ["x", "e"], ["z"])
    q, z = _run(node, [x_qp, None], z_qp, [x_q, exponent], {1: exponent})
    assert q.kernel.integer_exponent and q.exponent_codes.tolist() == [1, 2, -1]
    np.testing.assert_array_equal(z, _kernel_ref(q, x_q, np.broadcast_to(q.exponent_codes, x_q.shape)))
    assert lsb_error(z_qp, z, z_float) <= 1.0 + FLOAT_SLACK


def _ort_constant_base(base: np.ndarray, y: np.ndarray) -> np.ndarray:
    """onnxruntime's Pow(b, y) with b an initializer (ort_single puts graph inputs first)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph([helper.make_node("Pow", ["b", "y"], ["z"])], "pow",
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y.shape)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(base, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"y": y})[0]


def test_constant_base_is_a_table_on_the_exponent():
    rng = np.random.default_rng(6)
    y_qp = random_qparams(rng, -3.0, 3.0, 8)
    y_q = np.arange(y_qp.qmin, y_qp.qmax + 1).astype(y_qp.dtype)
    base = np.array(2.0, np.float32)
    z_float = _ort_constant_base(base, y_qp.dequantize(y_q))
    z_qp = compute_qparams(0.0, float(z_float.max()), 8, symmetric=False)
    node = Node("pow", "Pow", ["b", "y"], ["z"])
    q, z = _run(node, [None, y_qp], z_qp, [base, y_q], {0: base})
    want = [_quantize_ref(2.0 ** ((int(c) - int(y_qp.zero_point[0])) * float(y_qp.scale[0])), z_qp) for c in y_q]
    np.testing.assert_array_equal(z, want)
    assert lsb_error(z_qp, z, z_float) <= 0.5 + FLOAT_SLACK


def test_wide_base_with_a_runtime_exponent_is_refused():
    node = Node("pow", "Pow", ["x", "y"], ["z"])
    q16 = QParams(0.001, 0, 16, True)
    q8 = QParams(0.05, 0, 8, True)
    with pytest.raises(QuantizationError, match="run-time exponent"):
        get_op("Pow").quantize(context(node, [q16, q8], [q8]))
