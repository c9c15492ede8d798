"""Gelu (ops/gelu.py): the table against a Python reference of the docstring formula (math.erf / math.tanh
per code, exact), and against onnxruntime's Gelu (opset 20) within 0.5 LSB (direct) or the table's bound."""
from __future__ import annotations

import math

import numpy as np
import pytest

from op_testing import Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, runtime
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node


def _python_gelu(x: float, approximate: str) -> float:
    if approximate == "none":
        return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


@covers("Gelu", check=Check.INT_REFERENCE)
@covers("Gelu", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bits", [8, 16])
def test_gelu_table(approximate, bits):
    rng = np.random.default_rng(bits + len(approximate))
    x_qp = random_qparams(rng, -6.0, 5.0, bits)
    x_q = random_codes(rng, x_qp, (4, 300))
    want = ort_single("Gelu", {"x": x_qp.dequantize(x_q)}, {"approximate": approximate}, opset=20)[0]
    y_qp = random_qparams(rng, -0.2, float(want.max()), bits, symmetric=False)
    node = Node("g", "Gelu", ["x"], ["y"], attrs={"approximate": approximate})
    op = get_op("Gelu")
    q = op.quantize(context(node, [x_qp], [y_qp]))
    y = op.forward_int(q, [x_q], runtime())[0]
    assert y.dtype == y_qp.dtype
    s_x, zp_x, s_y, zp_y = float(x_qp.scale[0]), int(x_qp.zero_point[0]), float(y_qp.scale[0]), int(y_qp.zero_point[0])
    ref = np.array([min(max(round(_python_gelu((int(c) - zp_x) * s_x, approximate) / s_y) + zp_y, y_qp.qmin),
                        y_qp.qmax) for c in x_q.ravel()]).reshape(x_q.shape)
    table_error = q.table.report().max_error_lsb
    if bits == 8:
        np.testing.assert_array_equal(y, ref)
    else:  # interpolated table: within its reported error of the reference codes
        assert np.max(np.abs(y.astype(np.int64) - ref)) <= table_error
    assert lsb_error(y_qp, y, want) <= 0.5 + table_error + 1e-3
    np.testing.assert_allclose(op.forward_float(node, [x_qp.dequantize(x_q)])[0], want, atol=1e-6)


def test_unknown_approximation_is_refused():
    qp = random_qparams(np.random.default_rng(0), -1.0, 1.0, 8)
    with pytest.raises(QuantizationError, match="approximate"):
        get_op("Gelu").quantize(context(Node("g", "Gelu", ["x"], ["y"], attrs={"approximate": "erf"}), [qp], [qp]))
