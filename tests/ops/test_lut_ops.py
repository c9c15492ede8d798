"""ops/lut_ops.py: Sigmoid, Tanh, HardSwish, HardSigmoid through lookup tables.

(a) forward_int equals an independent reference: for 8-bit inputs the correctly rounded function computed
here in float64, for 16-bit inputs the interpolated lookup redone in Python integers; (b) the dequantized
output is within the op's documented LSB bound of the float op (onnxruntime) on the dequantized input;
forward_float matches onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import expit

from op_testing import (
    QPARAM_CASES,
    Check,
    context,
    covers,
    lsb_error,
    ort_single,
    random_qparams,
    runtime,
    seeded_input,
)
from ops import get_op
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams


def _hardswish(x):
    return x * np.clip(x / 6 + 0.5, 0, 1)


LUT_CASES = [
    ("Sigmoid", {}, lambda x: expit(x)),
    ("Tanh", {}, np.tanh),
    ("HardSwish", {}, _hardswish),
    ("HardSigmoid", {"alpha": 0.25, "beta": 0.4}, lambda x: np.clip(0.25 * x + 0.4, 0, 1)),
]


def _interp_ref(table, q_in, x_q):
    """lut's interpolated lookup redone in Python integers: y = (e_i 2^s + (e_i+1 - e_i) f + 2^(s+g-1)) >> (s+g)."""
    s, g = table.shift, table.frac_bits
    e = [int(v) for v in table.table]
    out = []
    for code in x_q.ravel().tolist():
        idx = abs(code) if table.half else code - q_in.qmin
        i, f = idx >> s, idx & ((1 << s) - 1)
        e1 = e[min(i + 1, len(e) - 1)]
        y = ((e[i] << s) + (e1 - e[i]) * f + (1 << (s + g - 1))) >> (s + g)
        if table.half and table.mirror == "odd" and code < 0:
            y = table.mirror_sum - y
        out.append(y)
    oq = table.out_qparams
    return np.clip(np.array(out, dtype=np.int64), oq.qmin, oq.qmax).reshape(x_q.shape)


@covers("Sigmoid", "Tanh", "HardSwish", "HardSigmoid", check=Check.INT_REFERENCE)
@covers("Sigmoid", "Tanh", "HardSwish", "HardSigmoid", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type, attrs, fn", LUT_CASES)
@pytest.mark.parametrize("x_bits, x_signed, y_bits", QPARAM_CASES)
def test_lut_op_int_equals_reference_and_float_bound(op_type, attrs, fn, x_bits, x_signed, y_bits):
    rng, x_qp, x_q = seeded_input(x_bits + y_bits + len(op_type), x_bits, x_signed, lo=-6.0, hi=6.0)
    x_deq = x_qp.dequantize(x_q)
    y_float = ort_single(op_type, {"x": x_deq}, attrs, opset=17 if op_type != "HardSwish" else 14)[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), y_bits, symmetric=False)
    node = Node("f", op_type, ["x"], ["y"], attrs)
    op = get_op(op_type)
    q = op.quantize(context(node, [x_qp], [y_qp]))
    y = op.forward_int(q, [x_q], runtime())[0]
    assert y.dtype == y_qp.dtype
    exact = np.clip(np.rint(fn((x_q.astype(np.float64) - x_qp.zero_point[0]) * x_qp.scale[0]) / y_qp.scale[0])
                    + y_qp.zero_point[0], y_qp.qmin, y_qp.qmax)
    if x_bits <= 8:
        assert not q.table.interpolated
        np.testing.assert_array_equal(y, exact)  # the table is the correctly rounded function
        bound = 0.5
    else:
        assert q.table.interpolated and q.table.table.size <= 257
        np.testing.assert_array_equal(y, _interp_ref(q.table, x_qp, x_q))
        assert np.abs(y - exact).max() <= q.table.max_error_lsb
        bound = 0.5 + q.table.max_error_lsb
    np.testing.assert_allclose(op.forward_float(node, [x_deq])[0], y_float, rtol=1e-5, atol=1e-6)
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-3


def test_wide_lut_op_grows_its_table_until_the_error_budget_holds():
    """Sigmoid over a 16-bit input spanning [-24, 24]: 257 nodes leave more than 2 LSB (the chords are 4x
    longer than over [-6, 6]), so the op takes more nodes, and its max error meets the budget."""
    from lut.table import build_table
    from ops.lut_ops import WIDE_TABLE_BUDGET_LSB

    x_qp = compute_qparams(-24.0, 24.0, 16, symmetric=True)
    y_qp = compute_qparams(0.0, 1.0, 16, symmetric=False)
    fn = get_op("Sigmoid").function(Node("s", "Sigmoid", ["x"], ["y"]))
    default = build_table(fn, x_qp, y_qp, symmetry=fn.symmetry, center=fn.center, entries=257).report()
    assert default.max_error_lsb > WIDE_TABLE_BUDGET_LSB
    q = get_op("Sigmoid").quantize(context(Node("s", "Sigmoid", ["x"], ["y"]), [x_qp], [y_qp]))
    report = q.table.report()
    assert report.max_error_lsb <= WIDE_TABLE_BUDGET_LSB < default.max_error_lsb
    assert report.entries > default.entries
