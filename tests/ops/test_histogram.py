"""Histogram (ops/histogram.py, ai.ptq): (a) the integer counts equal a Python-integer reference of the
docstring formula; (b) the float forward equals a numpy formula of TensorFlow's histogram_fixed_width, and
the integer counts equal it on the dequantized input for the codes not within 1e-4 codes of a bin edge."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from op_testing import Check, context, covers, random_codes, random_qparams, runtime
from ops import get_op
from ops.registry import QuantizationError, check_quantized
from ptq.core.graph import Node

F = 16


@covers("Histogram", check=Check.INT_REFERENCE, domain="ai.ptq")
@pytest.mark.parametrize("low,high,nbins", [(-1.0, 1.0, 10), (-0.3, 0.45, 7), (0.1, 5.0, 3), (-2.5, 2.5, 64)])
def test_histogram(low, high, nbins):
    rng = np.random.default_rng(nbins)
    node = Node("h", "Histogram", ["x"], ["y"], {"min": low, "max": high, "nbins": nbins}, domain="ai.ptq")
    op = get_op("Histogram", "ai.ptq")
    for bits, signed in [(8, True), (8, False), (16, True)]:
        qp = random_qparams(rng, -1.5, 1.5, bits, signed=signed)
        x = random_codes(rng, qp, (5, 40))
        q = op.quantize(context(node, [qp], [None]))
        check_quantized(q)
        y = op.forward_int(q, [x], runtime())[0]
        assert y.dtype == np.int64 and y.shape == (nbins,)

        s, zp = Fraction(float(qp.scale[0])), int(qp.zero_point[0])
        a_f = round((Fraction(low) / s + zp) * 2 ** F)
        w_f = round(Fraction(high - low) / s * 2 ** F)
        ref = [0] * nbins
        for v in x.ravel().tolist():
            ref[min(max(((v * 2 ** F - a_f) * nbins) // w_f, 0), nbins - 1)] += 1
        np.testing.assert_array_equal(y, ref)

        # vs the float op: the codes that are not within 1e-4 codes of a bin edge (there the float32 op and any
        # rounding of the bounds may disagree; a symmetric grid puts codes right on the edges of [-1, 1] / 10)
        edges_in_codes = (low + (high - low) * np.arange(nbins + 1) / nbins) / float(s) + zp
        far = np.min(np.abs(x.astype(np.float64).ravel()[:, None] - edges_in_codes), axis=1) > 1e-4
        x_far = x.ravel()[far]
        assert x_far.size > x.size // 2
        x_f = qp.dequantize(x_far).astype(np.float64)
        want = np.bincount(np.clip(np.floor((x_f - low) / (high - low) * nbins), 0, nbins - 1).astype(int),
                           minlength=nbins)
        np.testing.assert_array_equal(op.forward_float(node, [qp.dequantize(x_far)])[0], want)
        np.testing.assert_array_equal(op.forward_int(q, [x_far], runtime())[0], want)


def test_bad_range_is_named():
    node = Node("h", "Histogram", ["x"], ["y"], {"min": 1.0, "max": 1.0, "nbins": 4}, domain="ai.ptq")
    qp = random_qparams(np.random.default_rng(0), -1, 1, 8)
    with pytest.raises(ValueError, match="min < max"):
        get_op("Histogram", "ai.ptq").quantize(context(node, [qp], [None]))
    node = Node("h", "Histogram", ["x"], ["y"], {"min": 0.0, "max": 1e-12, "nbins": 4}, domain="ai.ptq")
    with pytest.raises(QuantizationError, match="int64 bins"):
        get_op("Histogram", "ai.ptq").quantize(context(node, [qp], [None]))
