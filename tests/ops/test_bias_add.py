"""BiasAdd (ops/bias_add.py, ai.ptq): forward_int equals a Python-integer reference of the docstring formula
(bias codes round(B / s_x), one requant by s_x / s_y); forward_float equals the numpy formula x + B along
`axis`; the integer output is within the stated bound of the float op on the dequantized input."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import Check, context, covers, lsb_error, random_codes, random_qparams, ref_requant, runtime
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node

PTQ = "ai.ptq"
MBITS = 15


@covers("BiasAdd", check=Check.INT_REFERENCE, domain=PTQ)
@covers("BiasAdd", check=Check.ONNXRUNTIME, domain=PTQ)
@pytest.mark.parametrize("bits,signed", [(8, True), (8, False), (16, True)])
@pytest.mark.parametrize("axis", [1, -1])
def test_bias_add_int_equals_reference_and_float_bound(bits, signed, axis):
    rng = np.random.default_rng(bits + signed + 7 * axis)
    shape = (2, 3, 4, 5)
    x_qp = random_qparams(rng, -2.0, 3.0, bits, signed=signed)
    x = random_codes(rng, x_qp, shape)
    bias = rng.normal(0, 1, shape[axis]).astype(np.float32)
    node = Node("ba", "BiasAdd", ["x", "b"], ["y"], {"axis": axis}, domain=PTQ)
    op = get_op("BiasAdd", PTQ)
    x_f = x_qp.dequantize(x)
    bshape = [1] * 4
    bshape[axis] = -1
    y_want = x_f.astype(np.float64) + bias.reshape(bshape)  # numpy formula
    np.testing.assert_allclose(op.forward_float(node, [x_f, bias])[0], y_want, rtol=1e-6, atol=1e-6)
    y_qp = random_qparams(rng, float(y_want.min()), float(y_want.max()), bits, signed=signed)
    q = op.quantize(context(node, [x_qp, None], [y_qp], {1: bias}))
    y = op.forward_int(q, [x, bias], runtime())[0]
    assert y.dtype == y_qp.dtype
    s_x = float(x_qp.scale[0])
    b_q = np.array([round(float(b) / s_x) for b in bias], dtype=np.int64).reshape(bshape)
    acc = x.astype(np.int64) - int(x_qp.zero_point[0]) + b_q
    want = ref_requant(acc, q.m, q.n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want)
    r = s_x / float(y_qp.scale[0])
    assert abs(int(q.m[0]) / 2.0 ** int(q.n[0]) - r) <= r * 2.0 ** -(MBITS - 1)
    bound = 0.5 + 0.5 * r + 2 ** bits * 2.0 ** -(MBITS - 1)
    assert lsb_error(y_qp, y, y_want) <= bound + 1e-6


def test_bias_must_be_a_constant_vector_of_the_axis_size():
    qp = random_qparams(np.random.default_rng(0), -1.0, 1.0, 8)
    node = Node("ba", "BiasAdd", ["x", "b"], ["y"], {}, domain=PTQ)
    op = get_op("BiasAdd", PTQ)
    with pytest.raises(QuantizationError, match="must be a constant"):
        op.quantize(context(node, [qp, qp], [qp]))
    with pytest.raises(ValueError, match="vector of 3 values"):
        op.forward_float(node, [np.zeros((2, 3, 4), np.float32), np.zeros(4, np.float32)])
