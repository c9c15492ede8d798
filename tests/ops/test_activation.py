"""ops/activation.py: Relu, Clip, LeakyRelu, PRelu.

(a) forward_int equals an independent int64 reference of the op's formula (Python-integer requant); (b) the
dequantized output is within the op's documented LSB bound of the float op (onnxruntime) on the dequantized
input; forward_float matches onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    MBITS,
    QPARAM_CASES,
    Check,
    context,
    covers,
    lsb_error,
    ort_single,
    random_qparams,
    ref_requant,
    runtime,
    seeded_input,
)
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams


def _check_multiplier(m, n, r):
    r = np.asarray(r, dtype=np.float64)
    approx = np.asarray(m, dtype=np.float64) / np.exp2(np.asarray(n, dtype=np.float64))
    assert np.all(np.abs(approx - np.abs(r)) <= np.abs(r) * 2.0 ** -(MBITS - 1) + 2.0 ** -32)


def _linear_bound(x_qp, y_qp, x_q):
    """0.5 LSB + |x_c| * multiplier error (documented in ops.activation), with the error at its worst."""
    r = x_qp.scale[0] / y_qp.scale[0]
    x_c = np.abs(x_q.astype(np.int64) - int(x_qp.zero_point[0])).max()
    return 0.5 + float(x_c) * r * 2.0 ** -(MBITS - 1)


# ------------------------------------------------------------------------------- Relu, Clip, (P)LeakyRelu

@covers("Relu", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("x_bits, x_signed, y_bits", QPARAM_CASES)
def test_relu_int_equals_reference_and_float_bound(x_bits, x_signed, y_bits):
    rng, x_qp, x_q = seeded_input(x_bits + y_bits, x_bits, x_signed)
    x_deq = x_qp.dequantize(x_q)
    y_float = ort_single("Relu", {"x": x_deq})[0]
    y_qp = compute_qparams(0.0, float(y_float.max()), y_bits, symmetric=False)  # unsigned, as 4.54 says
    node = Node("r", "Relu", ["x"], ["y"])
    q = get_op("Relu").quantize(context(node, [x_qp], [y_qp]))
    y = get_op("Relu").forward_int(q, [x_q], runtime())[0]
    _check_multiplier(q.stage.m, q.stage.n, x_qp.scale[0] / y_qp.scale[0])
    zp = int(y_qp.zero_point[0])
    want = ref_requant(x_q.astype(np.int64) - int(x_qp.zero_point[0]), q.stage.m, q.stage.n, zp,
                       max(y_qp.qmin, zp), y_qp.qmax)
    np.testing.assert_array_equal(y, want)
    assert y.dtype == y_qp.dtype
    assert lsb_error(y_qp, y, y_float) <= _linear_bound(x_qp, y_qp, x_q) + 1e-3


@covers("Relu", check=Check.INT_REFERENCE)
def test_relu_without_output_proposal_keeps_input_qparams_and_clamps_codes():
    rng, x_qp, x_q = seeded_input(0, 8, True)
    node = Node("r", "Relu", ["x"], ["y"])
    q = get_op("Relu").quantize(context(node, [x_qp], [None]))
    assert q.out_qparams[0] == x_qp
    y = get_op("Relu").forward_int(q, [x_q], runtime())[0]
    np.testing.assert_array_equal(y, np.maximum(x_q, x_qp.zero_point[0]))


@covers("Clip", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("x_bits, x_signed, y_bits", QPARAM_CASES)
@pytest.mark.parametrize("bounds, as_attrs", [((0.0, 6.0), False), ((-1.5, 2.0), False), ((-1.0, 3.0), True)])
def test_clip_int_equals_reference_and_float_bound(x_bits, x_signed, y_bits, bounds, as_attrs):
    rng, x_qp, x_q = seeded_input(x_bits * 3 + y_bits, x_bits, x_signed)
    x_deq = x_qp.dequantize(x_q)
    cmin, cmax = bounds
    if as_attrs:
        y_float = ort_single("Clip", {"x": x_deq}, {"min": cmin, "max": cmax}, opset=6)[0]
        node = Node("c", "Clip", ["x"], ["y"], {"min": cmin, "max": cmax})
        constants, inputs = {}, [x_q]
    else:
        lo_c, hi_c = np.float32(cmin), np.float32(cmax)
        y_float = ort_single("Clip", {"x": x_deq}, {}, {"lo": lo_c, "hi": hi_c})[0]
        node = Node("c", "Clip", ["x", "lo", "hi"], ["y"])
        constants, inputs = {1: lo_c, 2: hi_c}, [x_q, lo_c, hi_c]
    y_qp = random_qparams(rng, cmin, cmax, y_bits, symmetric=False)  # 4.11: y's range is [cmin, cmax]
    op = get_op("Clip")
    q = op.quantize(context(node, [x_qp, None, None][: len(node.inputs)], [y_qp], constants))
    y = op.forward_int(q, inputs, runtime())[0]
    zp = int(y_qp.zero_point[0])
    c_q = np.clip(np.rint(np.array(bounds) / y_qp.scale[0]) + zp, y_qp.qmin, y_qp.qmax).astype(int)
    want = ref_requant(x_q.astype(np.int64) - int(x_qp.zero_point[0]), q.stage.m, q.stage.n, zp,
                       max(y_qp.qmin, c_q[0]), min(y_qp.qmax, c_q[1]))
    np.testing.assert_array_equal(y, want)
    assert lsb_error(y_qp, y, y_float) <= _linear_bound(x_qp, y_qp, x_q) + 1e-3


@covers("LeakyRelu", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("x_bits, x_signed, y_bits", QPARAM_CASES)
@pytest.mark.parametrize("alpha", [0.1, -0.3, 0.0])
def test_leaky_relu_two_multipliers(x_bits, x_signed, y_bits, alpha):
    rng, x_qp, x_q = seeded_input(x_bits + y_bits + int(alpha * 10), x_bits, x_signed)
    y_float = ort_single("LeakyRelu", {"x": x_qp.dequantize(x_q)}, {"alpha": alpha})[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), y_bits, symmetric=False)
    node = Node("l", "LeakyRelu", ["x"], ["y"], {"alpha": alpha})
    op = get_op("LeakyRelu")
    q = op.quantize(context(node, [x_qp], [y_qp]))
    y = op.forward_int(q, [x_q], runtime())[0]
    r = x_qp.scale[0] / y_qp.scale[0]
    stage = q.stage
    _check_multiplier(stage.m, stage.n, r)
    if alpha != 0:
        _check_multiplier(stage.neg_m, stage.neg_n, r * alpha)
    x_c = x_q.astype(np.int64) - int(x_qp.zero_point[0])
    zp = int(y_qp.zero_point[0])
    pos = ref_requant(x_c, stage.m, stage.n, zp, y_qp.qmin, y_qp.qmax)
    neg = ref_requant(x_c * int(np.sign(alpha)), stage.neg_m, stage.neg_n, zp, y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, np.where(x_c >= 0, pos, neg))
    assert lsb_error(y_qp, y, y_float) <= _linear_bound(x_qp, y_qp, x_q) + 1e-3


@covers("PRelu", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("x_bits, x_signed, y_bits", QPARAM_CASES)
@pytest.mark.parametrize("slope_shape", [(3, 1, 1), (1,), (4,)])
def test_prelu_per_channel_slope(x_bits, x_signed, y_bits, slope_shape):
    rng, x_qp, x_q = seeded_input(x_bits + y_bits + len(slope_shape), x_bits, x_signed)
    slope = rng.uniform(-0.5, 0.8, size=slope_shape).astype(np.float32)
    y_float = ort_single("PRelu", {"x": x_qp.dequantize(x_q)}, {}, {"slope": slope})[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), y_bits, symmetric=False)
    node = Node("p", "PRelu", ["x", "slope"], ["y"])
    op = get_op("PRelu")
    q = op.quantize(context(node, [x_qp, None], [y_qp], {1: slope}))
    y = op.forward_int(q, [x_q, slope], runtime())[0]
    r = x_qp.scale[0] / y_qp.scale[0]
    _check_multiplier(q.stage.neg_m, q.stage.neg_n, r * slope.astype(np.float64))
    x_c = x_q.astype(np.int64) - int(x_qp.zero_point[0])
    zp = int(y_qp.zero_point[0])
    pos = ref_requant(x_c, q.stage.m, q.stage.n, zp, y_qp.qmin, y_qp.qmax)
    sign = np.sign(slope).astype(np.int64)
    neg = ref_requant(x_c * sign, q.stage.neg_m, q.stage.neg_n, zp, y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, np.where(x_c >= 0, pos, neg))
    assert lsb_error(y_qp, y, y_float) <= _linear_bound(x_qp, y_qp, x_q) + 1e-3


def test_prelu_needs_a_constant_slope():
    qp = compute_qparams(-1, 1)
    node = Node("p", "PRelu", ["x", "slope"], ["y"])
    with pytest.raises(QuantizationError, match="slope"):
        get_op("PRelu").quantize(context(node, [qp, qp], [qp]))


@covers("Relu", "LeakyRelu", "PRelu", "Clip", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type, attrs, consts", [
    ("Relu", {}, {}),
    ("LeakyRelu", {"alpha": 0.2}, {}),
    ("PRelu", {}, {"slope": np.array([[[0.1]], [[-0.2]], [[0.3]]], dtype=np.float32)}),
    ("Clip", {}, {"lo": np.float32(-0.5), "hi": np.float32(1.5)}),
])
def test_forward_float_matches_onnxruntime(op_type, attrs, consts):
    x = np.random.default_rng(0).normal(size=(2, 3, 4, 5)).astype(np.float32)
    want = ort_single(op_type, {"x": x}, attrs, consts)[0]
    node = Node("n", op_type, ["x"] + list(consts), ["y"], attrs)
    got = get_op(op_type).forward_float(node, [x] + list(consts.values()))[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
