"""Requantize (ops/requantize.py, ai.ptq): forward_int equals a Python-integer reference of the docstring formula
(a pure shift for power-of-two scale ratios, M / 2^N otherwise); forward_float is the identity onnxruntime runs
through the model-local function the int4-dsp scheme writes; the integer output is within the stated bound."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from op_testing import Check, context, covers, lsb_error, random_codes, runtime
from ops import get_op
from ops.requantize import shift_multiplier
from ptq.core.graph import Node
from ptq.core.qparams import QParams
from ptq.calibration.int4_dsp import requantize_function

PTQ = "ai.ptq"
MBITS = 15


def _shift_reference(x, zp_x: int, k: int, zp_y: int, lo: int, hi: int) -> np.ndarray:
    """Python integers: ((x - zp_x + 2^(k-1)) >> k) for k > 0, (x - zp_x) << -k otherwise; + zp_y, clamped."""
    def one(v):
        c = int(v) - zp_x
        y = (c + (1 << (k - 1))) >> k if k > 0 else c << -k
        return min(max(y + zp_y, lo), hi)
    return np.vectorize(one, otypes=[np.int64])(x)


def _node():
    return Node("rq", "Requantize", ["x"], ["y"], {}, domain=PTQ)


@covers("Requantize", check=Check.INT_REFERENCE, domain=PTQ)
@pytest.mark.parametrize("x_qp,y_qp,k", [
    # int8 on a shared Add scale -> the offset-binary uint4 of a signed 4-bit grid (the int4-dsp edge)
    (QParams(0.5, 0, bits=8, signed=True), QParams(8.0, 8, bits=4, signed=False), 4),
    (QParams(0.25, 0, bits=8, signed=True), QParams(0.125, 8, bits=4, signed=False), -1),  # a left shift
    (QParams(2.0 ** -3, 3, bits=8, signed=False), QParams(2.0 ** -1, 0, bits=4, signed=False), 2),
    (QParams(1.0, -5, bits=16, signed=True), QParams(2.0 ** 10, 0, bits=8, signed=True), 10),
    (QParams(0.5, 0, bits=8, signed=True), QParams(0.5, 8, bits=4, signed=False), 0),  # same scale: a move
])
def test_power_of_two_ratio_is_a_shift_equal_to_the_reference(x_qp, y_qp, k):
    rng = np.random.default_rng(k + 20)
    x = np.concatenate([np.arange(x_qp.qmin, x_qp.qmax + 1), random_codes(rng, x_qp, (300,))]).astype(x_qp.dtype)
    op = get_op("Requantize", PTQ)
    q = op.quantize(context(_node(), [x_qp], [y_qp]))
    assert q.shift_only and (int(q.m[0]), int(q.n[0])) == ((1, k) if k > 0 else (1 << -k, 0))
    y = op.forward_int(q, [x], runtime())[0]
    assert y.dtype == y_qp.dtype
    want = _shift_reference(x, int(x_qp.zero_point[0]), k, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want)
    assert lsb_error(y_qp, y, x_qp.dequantize(x)) <= 0.5 + 1e-9


@covers("Requantize", check=Check.INT_REFERENCE, domain=PTQ)
def test_other_ratios_use_a_multiplier_equal_to_the_reference():
    x_qp = QParams(0.037, 3, bits=8, signed=True)
    y_qp = QParams(0.3, 2, bits=4, signed=False)
    x = np.arange(-128, 128).astype(np.int8)
    op = get_op("Requantize", PTQ)
    q = op.quantize(context(_node(), [x_qp], [y_qp]))
    assert not q.shift_only
    m, n = int(q.m[0]), int(q.n[0])
    r = float(x_qp.scale[0]) / float(y_qp.scale[0])
    assert abs(m / 2.0 ** n - r) <= r * 2.0 ** -(MBITS - 1)
    y = op.forward_int(q, [x], runtime())[0]
    want = [min(max((((int(v) - 3) * m + (1 << (n - 1))) >> n) + 2, 0), 15) for v in x]
    assert y.tolist() == want
    assert lsb_error(y_qp, y, x_qp.dequantize(x)) <= 0.5 + 256 * r * 2.0 ** -(MBITS - 1) + 1e-9


@covers("Requantize", check=Check.ONNXRUNTIME, domain=PTQ)
def test_float_forward_is_the_identity_onnxruntime_runs_through_the_local_function():
    x = np.random.default_rng(0).normal(0, 3, (2, 5)).astype(np.float32)
    node = helper.make_node("Requantize", ["x"], ["y"], domain=PTQ)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PTQ, 1)],
                              functions=[requantize_function(17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, {"x": x})[0]
    np.testing.assert_array_equal(get_op("Requantize", PTQ).forward_float(_node(), [x])[0], want)
    np.testing.assert_array_equal(want, x)


def test_shift_multiplier_recognizes_exact_powers_of_two_only():
    assert shift_multiplier(2.0 ** -7, MBITS) == (1, 7)
    assert shift_multiplier(8.0, MBITS) == (8, 0)
    assert shift_multiplier(1.0, MBITS) == (1, 0)
    assert shift_multiplier(0.75, MBITS) is None
    assert shift_multiplier(2.0 ** -40, MBITS) is None  # beyond a 31-bit shift
    assert shift_multiplier(2.0 ** 15, MBITS) is None  # 2^15 does not fit a 15-bit multiplier
