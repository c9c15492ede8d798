"""ops/concat.py: Concat requantizes each input to the output qparams.

(a) forward_int equals a Python-integer requant per input; (b) the dequantized output is within 0.5 LSB +
the multiplier error of onnxruntime, and forward_float equals onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    FORMATS,
    MBITS,
    Check,
    context,
    covers,
    lsb_error,
    ort_single,
    random_codes,
    random_qparams,
    ref_requant,
    runtime,
)
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node
from ptq.core.requant import quantize_multiplier


I64 = np.int64


@covers("Concat", check=Check.INT_REFERENCE)
@covers("Concat", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("axis", [1, -1])
def test_concat_requantizes_each_input(axis):
    rng = np.random.default_rng(20 + axis)
    op = get_op("Concat")
    shapes = [(2, 3, 4), (2, 3, 4), (2, 3, 4)]
    for bits, signed in FORMATS:
        qps = [random_qparams(rng, -rng.uniform(0.1, 3), rng.uniform(0.1, 3), bits, signed=signed) for _ in shapes]
        xs = [random_codes(rng, qp, s) for qp, s in zip(qps, shapes)]
        xfs = [qp.dequantize(x) for qp, x in zip(qps, xs)]
        const = rng.uniform(-1, 1, size=(2, 3, 4)).astype(np.float32)
        inputs = {"a": xfs[0], "b": xfs[1], "c": xfs[2]}
        (y_ort,) = ort_single("Concat", inputs, {"axis": axis}, constants={"k": const})
        node = Node("cat", "Concat", ["a", "b", "c", "k"], ["y"], {"axis": axis})
        np.testing.assert_array_equal(op.forward_float(node, xfs + [const])[0], y_ort)
        y_qp = random_qparams(rng, float(y_ort.min()), float(y_ort.max()), bits, signed=signed)
        in_qps = [qps[0], y_qp, qps[2], None]  # input b already carries the output qparams: copied as is
        xs[1] = random_codes(rng, y_qp, shapes[1])
        xfs[1] = y_qp.dequantize(xs[1])
        inputs["b"] = xfs[1]
        (y_ort,) = ort_single("Concat", inputs, {"axis": axis}, constants={"k": const})
        q = op.quantize(context(node, in_qps, [y_qp], {3: const}))
        (y,) = op.forward_int(q, xs + [const], runtime())
        assert y.dtype == y_qp.dtype
        parts = []
        for x, qp in zip(xs, in_qps[:3]):
            m, n = quantize_multiplier(float(qp.scale[0]) / float(y_qp.scale[0]), MBITS)
            parts.append(ref_requant(x.astype(I64) - int(qp.zero_point[0]), m[0], n[0], int(y_qp.zero_point[0]),
                                     y_qp.qmin, y_qp.qmax))
        parts.append(np.clip(np.rint(const / y_qp.scale[0]) + y_qp.zero_point[0], y_qp.qmin, y_qp.qmax))
        np.testing.assert_array_equal(y, np.concatenate(parts, axis=axis))
        np.testing.assert_array_equal(np.take(y, range(4, 8) if axis == -1 else range(3, 6), axis=axis), xs[1])
        biggest = max(float(np.abs(xf).max()) for xf in xfs) / float(y_qp.scale[0])
        assert lsb_error(y_qp, y, y_ort) <= 0.5 + biggest * 2.0 ** -MBITS + 1e-3


def test_concat_output_qparams_fallback():
    rng = np.random.default_rng(5)
    qp = random_qparams(rng, -1, 1)
    op = get_op("Concat")
    node = Node("cat", "Concat", ["a", "b"], ["y"], {"axis": 0})
    q = op.quantize(context(node, [qp, qp], [None]))
    assert q.out_qparams[0] == qp
    other = random_qparams(rng, -2, 2)
    with pytest.raises(QuantizationError, match="qparams differ"):
        op.quantize(context(node, [qp, other], [None]))
    with pytest.raises(QuantizationError, match="axis"):
        op.quantize(context(Node("cat", "Concat", ["a"], ["y"]), [qp], [None]))
