"""ops/pooling.py: AveragePool, GlobalAveragePool, MaxPool, GlobalMaxPool.

(a) forward_int equals an int64 reference written here (explicit loops over output positions, taps counted
one by one, Python-integer requant); (b) the dequantized output is within the documented LSB bound of
onnxruntime running the float op on the dequantized input; forward_float matches onnxruntime too.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from op_testing import (
    FORMATS,
    Check,
    context,
    covers,
    lsb_error,
    mean_bound,
    ort_single,
    proposal_for,
    random_input,
    random_qparams,
    ref_mean_requant,
    runtime,
)
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node


OPSET = 19


def _ref_pool(x, kernel, strides, dilations, begin, end, out, include_pad, reduce):
    """Loop over output positions; per axis the taps p*s - b + k*d. Returns (result, counts):
    `reduce` sees the values at the taps inside the input, counts follow count_include_pad."""
    n_, c_ = x.shape[:2]
    spatial = x.shape[2:]
    result = np.zeros((n_, c_) + tuple(out), dtype=np.int64)
    counts = np.zeros(tuple(out), dtype=np.int64)
    for pos in itertools.product(*(range(o) for o in out)):
        inside, counted = [], 1
        for p, k, s, d, b, e, size in zip(pos, kernel, strides, dilations, begin, end, spatial):
            taps = [p * s - b + t * d for t in range(k)]
            inside.append([t for t in taps if 0 <= t < size])
            counted *= len([t for t in taps if -b <= t < size + e]) if include_pad else len(inside[-1])
        values = np.stack([x[(slice(None), slice(None)) + idx] for idx in itertools.product(*inside)], axis=-1)
        result[(slice(None), slice(None)) + pos] = reduce(values.astype(np.int64))
        counts[pos] = counted
    return result, counts


def _same_pads(spatial, kernel, strides, dilations, out, mode):
    begin, end = [], []
    for n, k, s, d, o in zip(spatial, kernel, strides, dilations, out):
        total = max((o - 1) * s + (k - 1) * d + 1 - n, 0)
        small, big = total // 2, total - total // 2
        begin.append(small if mode == "SAME_UPPER" else big)
        end.append(big if mode == "SAME_UPPER" else small)
    return begin, end


POOL_CASES = [
    ((1, 3, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((2, 2, 7, 6), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    ((1, 2, 8, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 0], ceil_mode=1)),
    ((1, 2, 7, 8), dict(kernel_shape=[3, 2], strides=[2, 3], auto_pad="SAME_UPPER")),
    ((1, 2, 7, 8), dict(kernel_shape=[3, 2], strides=[2, 3], auto_pad="SAME_LOWER")),
    ((1, 2, 9, 9), dict(kernel_shape=[2, 2], dilations=[2, 2], pads=[1, 1, 0, 0])),
    ((1, 2, 6, 8), dict(kernel_shape=[2, 3], strides=[1, 2], pads=[0, 1, 1, 0], auto_pad="NOTSET")),
    ((1, 3, 10), dict(kernel_shape=[3], strides=[2], pads=[1, 1], ceil_mode=1)),
    ((1, 2, 4, 5, 5), dict(kernel_shape=[2, 2, 3], strides=[2, 1, 2], pads=[0, 1, 1, 1, 0, 1])),
]


def _geometry(shape, attrs, out):
    nd = len(shape) - 2
    kernel = attrs["kernel_shape"]
    strides = attrs.get("strides", [1] * nd)
    dilations = attrs.get("dilations", [1] * nd)
    if attrs.get("auto_pad", "NOTSET").startswith("SAME"):
        begin, end = _same_pads(shape[2:], kernel, strides, dilations, out, attrs["auto_pad"])
    else:
        pads = attrs.get("pads", [0] * 2 * nd)
        begin, end = pads[:nd], pads[nd:]
    return kernel, strides, dilations, begin, end


@covers("AveragePool", check=Check.INT_REFERENCE)
@covers("AveragePool", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("case", range(len(POOL_CASES)))
def test_average_pool(case, include_pad):
    rng = np.random.default_rng(100 + case * 2 + include_pad)
    shape, attrs = POOL_CASES[case]
    attrs = dict(attrs, count_include_pad=include_pad)
    op = get_op("AveragePool")
    node = Node("pool", "AveragePool", ["x"], ["y"], attrs)
    for bits, signed in FORMATS:
        x_qp, x = random_input(rng, shape, bits, signed)
        x_f = x_qp.dequantize(x)
        (y_ort,) = ort_single("AveragePool", {"x": x_f}, attrs, opset=OPSET)
        np.testing.assert_allclose(op.forward_float(node, [x_f])[0], y_ort, rtol=1e-5, atol=1e-6)
        y_qp = proposal_for(rng, y_ort, bits, signed)
        q = op.quantize(context(node, [x_qp], [y_qp]))
        assert q.out_qparams[0] == y_qp
        (y,) = op.forward_int(q, [x], runtime())
        assert y.dtype == y_qp.dtype and y.shape == y_ort.shape

        kernel, strides, dilations, begin, end = _geometry(shape, attrs, y_ort.shape[2:])
        xc = x.astype(np.int64) - int(x_qp.zero_point[0])
        acc, counts = _ref_pool(xc, kernel, strides, dilations, begin, end, y_ort.shape[2:], include_pad,
                                lambda v: v.sum(axis=-1))
        np.testing.assert_array_equal(y, ref_mean_requant(acc, counts, x_qp, y_qp))
        assert lsb_error(y_qp, y, y_ort) <= mean_bound(y_ort, y_qp)


def test_average_pool_variable_divisor_gets_per_position_multipliers():
    """3x3 windows with one pixel of excluded padding: corners average 4, edges 6, the inside 9 elements."""
    x_qp = random_qparams(np.random.default_rng(0), -1.0, 1.0, 8, signed=True, symmetric=True)
    x = np.full((1, 1, 3, 3), 36, dtype=np.int8)
    x[0, 0, 0, 0] = 0
    node = Node("pool", "AveragePool", ["x"], ["y"], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]})
    op = get_op("AveragePool")
    (y,) = op.forward_int(op.quantize(context(node, [x_qp], [x_qp])), [x], runtime())
    # top-left window: (0 + 36 * 3) / 4 = 27; top edge: (0 + 36 * 5) / 6 = 30; centre: 36 * 8 / 9 = 32
    assert y[0, 0, 0, 0] == 27 and y[0, 0, 0, 1] == 30 and y[0, 0, 1, 1] == 32 and y[0, 0, 2, 2] == 36


@covers("MaxPool", check=Check.INT_REFERENCE)
@covers("MaxPool", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("case", range(len(POOL_CASES)))
def test_max_pool(case):
    rng = np.random.default_rng(300 + case)
    shape, attrs = POOL_CASES[case]
    op = get_op("MaxPool")
    node = Node("pool", "MaxPool", ["x"], ["y"], attrs)
    for bits, signed in FORMATS:
        x_qp, x = random_input(rng, shape, bits, signed)
        x_f = x_qp.dequantize(x)
        (y_ort,) = ort_single("MaxPool", {"x": x_f}, attrs, opset=OPSET)
        np.testing.assert_array_equal(op.forward_float(node, [x_f])[0], y_ort)
        proposal = proposal_for(rng, y_ort, bits, signed)
        q = op.quantize(context(node, [x_qp], [proposal]))
        assert q.out_qparams[0] == x_qp  # the rule overrides the table
        (y,) = op.forward_int(q, [x], runtime())
        assert y.dtype == x.dtype
        kernel, strides, dilations, begin, end = _geometry(shape, attrs, y_ort.shape[2:])
        ref, _ = _ref_pool(x.astype(np.int64), kernel, strides, dilations, begin, end, y_ort.shape[2:], 0,
                           lambda v: v.max(axis=-1))
        np.testing.assert_array_equal(y, ref)
        np.testing.assert_array_equal(x_qp.dequantize(y), y_ort)  # exact: LSB bound 0


@covers("GlobalAveragePool", "GlobalMaxPool", check=Check.INT_REFERENCE)
@covers("GlobalAveragePool", "GlobalMaxPool", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 4, 7), (1, 2, 3, 4, 2)])
def test_global_pools(shape):
    rng = np.random.default_rng(sum(shape))
    for bits, signed in FORMATS:
        x_qp, x = random_input(rng, shape, bits, signed)
        x_f = x_qp.dequantize(x)
        spatial = tuple(range(2, len(shape)))
        xc = x.astype(np.int64) - int(x_qp.zero_point[0])

        avg = get_op("GlobalAveragePool")
        node = Node("gap", "GlobalAveragePool", ["x"], ["y"])
        (y_ort,) = ort_single("GlobalAveragePool", {"x": x_f}, opset=OPSET)
        np.testing.assert_allclose(avg.forward_float(node, [x_f])[0], y_ort, rtol=1e-5, atol=1e-6)
        y_qp = proposal_for(rng, y_ort, bits, signed)
        (y,) = avg.forward_int(avg.quantize(context(node, [x_qp], [y_qp])), [x], runtime())
        acc = np.zeros(shape[:2], dtype=np.int64)
        for idx in itertools.product(*(range(s) for s in shape[2:])):
            acc += xc[(slice(None), slice(None)) + idx]
        acc = acc.reshape(shape[:2] + (1,) * len(spatial))
        count = int(np.prod(shape[2:]))
        np.testing.assert_array_equal(y, ref_mean_requant(acc, count, x_qp, y_qp))
        assert y.dtype == y_qp.dtype
        assert lsb_error(y_qp, y, y_ort) <= mean_bound(y_ort, y_qp)

        gmax = get_op("GlobalMaxPool")
        node = Node("gmp", "GlobalMaxPool", ["x"], ["y"])
        (y_ort,) = ort_single("GlobalMaxPool", {"x": x_f}, opset=OPSET)
        np.testing.assert_array_equal(gmax.forward_float(node, [x_f])[0], y_ort)
        q = gmax.quantize(context(node, [x_qp], [None]))
        (y,) = gmax.forward_int(q, [x], runtime())
        ref = np.full(shape[:2], np.iinfo(np.int64).min, dtype=np.int64)
        for idx in itertools.product(*(range(s) for s in shape[2:])):
            ref = np.maximum(ref, x[(slice(None), slice(None)) + idx])
        np.testing.assert_array_equal(y.reshape(shape[:2]), ref)
        assert q.out_qparams[0] == x_qp
        np.testing.assert_array_equal(x_qp.dequantize(y), y_ort)


def test_bad_inputs_raise_clear_errors():
    x_qp = random_qparams(np.random.default_rng(2), -1, 1)
    node = Node("pool", "AveragePool", ["x"], ["y"], {"kernel_shape": [2, 2]})
    q = get_op("AveragePool").quantize(context(node, [x_qp], [None]))
    with pytest.raises(ValueError, match="spatial"):
        get_op("AveragePool").forward_int(q, [np.zeros((1, 2, 4), np.int8)], runtime())
    with pytest.raises(QuantizationError, match="no qparams"):
        get_op("AveragePool").quantize(context(node, [None], [None]))
