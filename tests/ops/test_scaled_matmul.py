"""ScaledMatMul (ops/scaled_matmul.py): alpha * (A @ B) of two activations, against a Python-integer
reference of the docstring formula (exact) and against numpy's float alpha * (A @ B) within the LSB bound."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import Check, context, covers, lsb_error, random_codes, random_qparams, ref_requant, runtime
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node

MBITS = 15


@covers("ScaledMatMul", check=Check.INT_REFERENCE, domain="ai.ptq")
@covers("ScaledMatMul", check=Check.ONNXRUNTIME, domain="ai.ptq")
@pytest.mark.parametrize("alpha", [0.125, 0.35355339, 3.0])
def test_scaled_matmul(alpha):
    rng = np.random.default_rng(int(alpha * 100))
    a_qp = random_qparams(rng, -2.0, 2.5, 8)
    b_qp = random_qparams(rng, -1.5, 1.0, 8)
    a_q = random_codes(rng, a_qp, (2, 5, 16))
    b_q = random_codes(rng, b_qp, (2, 16, 7))
    node = Node("s", "ScaledMatMul", ["a", "b"], ["y"], attrs={"alpha": alpha}, domain="ai.ptq")
    op = get_op("ScaledMatMul", "ai.ptq")
    a_f, b_f = a_qp.dequantize(a_q).astype(np.float64), b_qp.dequantize(b_q).astype(np.float64)
    want = alpha * (a_f @ b_f)
    np.testing.assert_allclose(op.forward_float(node, [a_f, b_f])[0], want, rtol=1e-5, atol=1e-5)
    y_qp = random_qparams(rng, float(want.min()), float(want.max()), 8, symmetric=False)
    q = op.quantize(context(node, [a_qp, b_qp], [y_qp]))
    y = op.forward_int(q, [a_q, b_q], runtime())[0]
    a_c = a_q.astype(object) - int(a_qp.zero_point[0])
    b_c = b_q.astype(object) - int(b_qp.zero_point[0])
    acc = np.einsum("bmk,bkn->bmn", a_c, b_c)
    pre = int(q.stage.pre_shift[0]) if q.stage.pre_shift is not None else 0
    if pre:
        acc = ref_requant(acc, 1, pre, 0, -(1 << 62), 1 << 62)
    want_q = ref_requant(acc, q.stage.m, q.stage.n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want_q)
    assert lsb_error(y_qp, y, want) <= 0.5 + 2 ** 8 * 2.0 ** -(MBITS - 1) + 1e-6


def test_non_positive_alpha_and_constant_operands_are_refused():
    qp = random_qparams(np.random.default_rng(0), -1.0, 1.0, 8)
    op = get_op("ScaledMatMul", "ai.ptq")
    with pytest.raises(QuantizationError, match="alpha"):
        op.quantize(context(Node("s", "ScaledMatMul", ["a", "b"], ["y"], attrs={"alpha": -1.0}, domain="ai.ptq"),
                            [qp, qp], [qp]))
    with pytest.raises(QuantizationError, match="input B must be an activation"):
        op.quantize(context(Node("s", "ScaledMatMul", ["a", "b"], ["y"], attrs={"alpha": 1.0}, domain="ai.ptq"),
                            [qp, qp], [qp], {1: np.ones((4, 4))}))
