"""AddSoftmax (ops/add_softmax.py): softmax(x + b) with a constant or activation bias, against a
Python-integer reference of the docstring formula (exact) and against numpy's float softmax(x + b) within
the stated LSB bound; a -1e4 padding mask gives exact zeros."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import Check, context, covers, lsb_error, random_codes, random_qparams, ref_requant, runtime
from ops.registry import get_op
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams


def _reference(x_q, bias_x, table, qmax):
    """Rows along the last axis, in Python integers."""
    out = np.empty(x_q.shape, dtype=np.int64)
    logits = x_q.astype(np.int64) + bias_x
    for idx in np.ndindex(x_q.shape[:-1]):
        row = [int(v) for v in logits[idx]]
        top = max(row)
        e = [int(table[min(top - v, table.size - 1)]) for v in row]
        s = sum(e)
        out[idx] = [(v * qmax) // s + (2 * ((v * qmax) % s) >= s) for v in e]
    return out


def _numpy_softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@covers("AddSoftmax", check=Check.INT_REFERENCE, domain="ai.ptq")
@covers("AddSoftmax", check=Check.ONNXRUNTIME, domain="ai.ptq")
@pytest.mark.parametrize("kind", ["constant", "activation", "padding"])
def test_add_softmax(kind):
    rng = np.random.default_rng(len(kind))
    x_qp = random_qparams(rng, -6.0, 7.0, 8)
    x_q = random_codes(rng, x_qp, (2, 3, 9))
    if kind == "padding":
        b = np.where(np.arange(9) >= 6, -1e4, 0.0)[None, :].repeat(3, axis=0)
    else:
        b = rng.uniform(-3.0, 1.0, (3, 9))
    node = Node("s", "AddSoftmax", ["x", "b"], ["y"], attrs={"axis": -1}, domain="ai.ptq")
    op = get_op("AddSoftmax", "ai.ptq")
    x_f = x_qp.dequantize(x_q).astype(np.float64)
    if kind == "activation":
        b_qp = compute_qparams(-3.0, 1.0, 8, symmetric=False)
        b_q = b_qp.quantize(b)
        q = op.quantize(context(node, [x_qp, b_qp], [None]))
        y = op.forward_int(q, [x_q, b_q], runtime())[0]
        b_f = b_qp.dequantize(b_q).astype(np.float64)
        bias_x = ref_requant(b_q.astype(np.int64) - int(b_qp.zero_point[0]), q.m, q.n, 0, -(1 << 40), 1 << 40)
        eps = 0.5 * x_qp.scale[0] + 2 ** 7 * b_qp.scale[0] * 2.0 ** -14
    else:
        q = op.quantize(context(node, [x_qp, None], [None], {1: b}))
        y = op.forward_int(q, [x_q, b], runtime())[0]
        b_f = b
        bias_x = np.array([[round(v / float(x_qp.scale[0])) for v in row] for row in b], dtype=np.int64)
        eps = 0.5 * x_qp.scale[0]
    want = _numpy_softmax(x_f + b_f)
    np.testing.assert_allclose(op.forward_float(node, [x_f, b_f])[0], want, atol=1e-6)
    out_qp = q.out_qparams[0]
    np.testing.assert_array_equal(y, _reference(x_q, bias_x, q.kernel.exp_table, out_qp.qmax))
    assert y.dtype == np.uint8 and out_qp.scale[0] == pytest.approx(1 / 255)
    assert lsb_error(out_qp, y, want) <= 1.0 + out_qp.qmax * eps / 2
    if kind == "padding":
        assert np.all(y[..., 6:] == 0)
