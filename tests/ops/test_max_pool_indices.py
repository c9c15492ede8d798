"""MaxPool with its Indices output (ops/pooling.py, whitepaper 4.44): (a) values and indices equal a reference
written here window by window over the codes (first maximum in scan order, flat input index); (b) the same
indices, and the dequantized values, as onnxruntime's float MaxPool on the dequantized input (exact)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from op_testing import Check, context, covers, random_codes, random_qparams, runtime
from ops import get_op
from ops.registry import check_quantized
from ort_untyped import ort_run
from ptq.core.graph import Node
from ptq.core.qparams import QParams


def _reference(x, kernel, strides, pads, dilations, out, storage_order):
    n, c, h, w = x.shape
    values = np.empty((n, c) + out, x.dtype)
    index = np.empty((n, c) + out, np.int64)
    for b, ch, oh, ow in itertools.product(range(n), range(c), range(out[0]), range(out[1])):
        best = None
        for kh, kw in itertools.product(range(kernel[0]), range(kernel[1])):
            hh = oh * strides[0] - pads[0] + kh * dilations[0]
            ww = ow * strides[1] - pads[1] + kw * dilations[1]
            if 0 <= hh < h and 0 <= ww < w and (best is None or int(x[b, ch, hh, ww]) > best[0]):
                spatial = hh * w + ww if storage_order == 0 else ww * h + hh
                best = (int(x[b, ch, hh, ww]), (b * c + ch) * h * w + spatial)
        values[b, ch, oh, ow], index[b, ch, oh, ow] = best
    return values, index


@covers("MaxPool", check=Check.INT_REFERENCE)
@covers("MaxPool", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("kernel,strides,pads,dilations,storage_order", [
    ((2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 0),
    ((3, 3), (1, 2), (1, 1, 1, 1), (1, 1), 0),
    ((3, 2), (2, 1), (1, 0, 1, 1), (1, 1), 1),
    ((2, 2), (1, 1), (0, 0, 0, 0), (2, 2), 0),
])
def test_max_pool_indices(kernel, strides, pads, dilations, storage_order):
    rng = np.random.default_rng(sum(kernel) + storage_order)
    attrs = {"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads),
             "dilations": list(dilations), "storage_order": storage_order}
    node = Node("mp", "MaxPool", ["x"], ["y", "i"], attrs)
    op = get_op("MaxPool")
    for bits, signed in [(8, True), (8, False), (16, True)]:
        x_qp = random_qparams(rng, -1.0, 1.0, bits, signed=signed)
        x = random_codes(rng, x_qp, (2, 3, 7, 6))
        x[0, 0, :3, :3] = x_qp.qmin  # ties at the lowest code, beside the padding
        q = op.quantize(context(node, [x_qp], [x_qp, None]))
        check_quantized(q)
        assert q.out_qparams == [x_qp, None]
        y, idx = op.forward_int(q, [x], runtime())
        out = y.shape[2:]
        ref_y, ref_i = _reference(x, kernel, strides, pads, dilations, out, storage_order)
        np.testing.assert_array_equal(y, ref_y)
        np.testing.assert_array_equal(idx, ref_i)
        want_y, want_i = ort_run("MaxPool", {"x": x_qp.dequantize(x)}, attrs, outputs=2)
        np.testing.assert_array_equal(x_qp.dequantize(y), want_y)
        np.testing.assert_array_equal(idx, want_i)


def test_float_forward_gives_the_same_indices():
    x = np.random.default_rng(0).normal(size=(1, 2, 5, 5)).astype(np.float32)
    node = Node("mp", "MaxPool", ["x"], ["y", "i"], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]})
    y, idx = get_op("MaxPool").forward_float(node, [x])
    want_y, want_i = ort_run("MaxPool", {"x": x}, node.attrs, outputs=2)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(idx, want_i)
    qp = QParams(np.array([1.0]), np.array([0]))
    q = get_op("MaxPool").quantize(context(Node("mp1", "MaxPool", ["x"], ["y"], node.attrs), [qp], [None]))
    assert len(get_op("MaxPool").forward_int(q, [np.zeros((1, 1, 4, 4), np.int8)], runtime())) == 1
