"""ops/softmax.py: Softmax (whitepaper 4.66).

(a) forward_int equals an independent Python-integer reference (the 2^20-scaled exp table recomputed here, the
division rounded by its remainder); (b) the dequantized output is within 1 LSB of the float op (onnxruntime)
on the dequantized input; forward_float matches onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import Check, context, covers, lsb_error, ort_single, runtime, seeded_input
from ops import get_op
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams


def _softmax_ref(x_q, s_x, q_out, axis):
    """Whitepaper 4.66 in Python integers: 2^20-scaled exp table, integer sum, division rounded by remainder."""
    x = np.moveaxis(x_q.astype(np.int64), axis, -1)
    out = np.zeros(x.shape, dtype=np.int64)
    for idx in np.ndindex(*x.shape[:-1]):
        row = [int(v) for v in x[idx]]
        top = max(row)
        e = [int(np.rint(np.exp(-(top - v) * s_x) * 2 ** 20)) for v in row]
        total = sum(e)
        for j, ej in enumerate(e):
            quotient, remainder = divmod(ej * q_out, total)
            out[idx + (j,)] = quotient + (2 * remainder >= total)
    return np.moveaxis(out, -1, axis)


@covers("Softmax", check=Check.INT_REFERENCE)
@covers("Softmax", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("x_bits, x_signed, y_bits", [(8, True, 8), (8, False, 8), (16, True, 16), (16, True, 8)])
@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_int_equals_reference_and_float_bound(x_bits, x_signed, y_bits, axis):
    rng, x_qp, x_q = seeded_input(x_bits + y_bits + axis, x_bits, x_signed, shape=(2, 5, 7), lo=-3.0, hi=4.0)
    x_deq = x_qp.dequantize(x_q)
    y_float = ort_single("Softmax", {"x": x_deq}, {"axis": axis})[0]
    proposal = compute_qparams(0.0, 1.0, y_bits, symmetric=False)
    node = Node("s", "Softmax", ["x"], ["y"], {"axis": axis})
    op = get_op("Softmax")
    q = op.quantize(context(node, [x_qp], [proposal]))
    y_qp = q.out_qparams[0]
    q_out = (1 << y_bits) - 1
    assert y_qp == QParams(scale=1.0 / q_out, zero_point=0, bits=y_bits, signed=False)
    y = op.forward_int(q, [x_q], runtime())[0]
    np.testing.assert_array_equal(y, _softmax_ref(x_q, float(x_qp.scale[0]), q_out, axis))
    np.testing.assert_allclose(op.forward_float(node, [x_deq])[0], y_float, rtol=1e-5, atol=1e-7)
    assert lsb_error(y_qp, y, y_float) <= 1.0
