"""Crop (ops/crop.py, ai.ptq): forward_int equals a reference built element by element from the index
formula y[i] = x[i + starts]; forward_float equals the numpy slice formula and, exactly, the dequantized
integer output (LSB bound 0); the output keeps the input's qparams."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from op_testing import Check, context, covers, random_codes, random_qparams, runtime
from ops import get_op
from ptq.core.graph import Node

PTQ = "ai.ptq"


def _ref(x, starts, ends):
    shape = tuple(e - s for s, e in zip(starts, ends))
    y = np.empty(shape, dtype=x.dtype)
    for o in itertools.product(*(range(d) for d in shape)):
        y[o] = x[tuple(i + s for i, s in zip(o, starts))]
    return y


@covers("Crop", check=Check.INT_REFERENCE, domain=PTQ)
@covers("Crop", check=Check.ONNXRUNTIME, domain=PTQ)
@pytest.mark.parametrize("bits,signed", [(8, True), (8, False), (16, True)])
@pytest.mark.parametrize("starts,ends", [([0, 1, 2, 1], [2, 3, 5, 4]), ([1, 0, -3, 0], [2, 3, 6, -1])])
def test_crop_int_equals_reference_and_float_formula(bits, signed, starts, ends):
    rng = np.random.default_rng(bits + signed)
    x_qp = random_qparams(rng, -2.0, 3.0, bits, signed=signed)
    x = random_codes(rng, x_qp, (2, 3, 6, 5))
    attrs = {"starts": starts, "ends": ends}
    node = Node("crop", "Crop", ["x"], ["y"], attrs, domain=PTQ)
    op = get_op("Crop", PTQ)
    q = op.quantize(context(node, [x_qp], [random_qparams(rng, -1.0, 1.0, bits)]))
    assert q.out_qparams == [x_qp]
    y = op.forward_int(q, [x], runtime())[0]
    absolute = [(s % d, e % d if e < 0 else e) for s, e, d in zip(starts, ends, x.shape)]
    np.testing.assert_array_equal(y, _ref(x, [a for a, _ in absolute], [b for _, b in absolute]))
    x_f = x_qp.dequantize(x)
    y_f = op.forward_float(node, [x_f])[0]
    np.testing.assert_array_equal(y_f, x_f[tuple(slice(a, b) for a, b in absolute)])  # numpy's slice formula
    np.testing.assert_array_equal(x_qp.dequantize(y), y_f)


@pytest.mark.parametrize("attrs,match", [({"starts": [0, 0]}, "starts and ends are required"),
                                         ({"starts": [0], "ends": [1]}, "one value per axis"),
                                         ({"starts": [0, 2], "ends": [1, 1]}, "do not fit axis 1")])
def test_bad_crop_attributes_are_named(attrs, match):
    node = Node("crop", "Crop", ["x"], ["y"], attrs, domain=PTQ)
    with pytest.raises(ValueError, match=match):
        get_op("Crop", PTQ).forward_float(node, [np.zeros((3, 4), np.float32)])
