"""AveragePool, GlobalAveragePool, MaxPool, GlobalMaxPool, ReduceMean.

(a) forward_int equals an int64 reference written here (explicit loops over output positions, taps counted
one by one, Python-integer requant); (b) the dequantized output is within the documented LSB bound of
onnxruntime running the float op on the dequantized input; forward_float matches onnxruntime too.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from op_testing import context, lsb_error, ort_single, random_codes, random_qparams, ref_requant, runtime
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node
from ptq.core.requant import quantize_multiplier

MBITS = 15
OPSET = 19
FORMATS = [(8, True), (8, False), (16, True), (16, False)]


def _input(rng, shape, bits, signed):
    qp = random_qparams(rng, -rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), bits, signed=signed)
    return qp, random_codes(rng, qp, shape)


def _proposal(rng, y_float, bits, signed):
    lo, hi = float(y_float.min()), float(y_float.max())
    return random_qparams(rng, lo, hi, bits, signed=signed)


def _mean_bound(y_float, y_qp):
    """0.5 LSB rounding + the multiplier's relative error (2^-15) + float32 noise of the reference."""
    big = float(np.max(np.abs(y_float))) / float(y_qp.scale[0])
    return 0.5 + big * (2.0 ** -MBITS + 2.0 ** -20) + 1e-3


def _ref_mean_requant(acc, counts, x_qp, y_qp):
    """Python-integer requant of window sums with (M, N) ~= s_x / (s_y * count) per position."""
    acc = np.asarray(acc, dtype=np.int64)
    counts = np.broadcast_to(np.asarray(counts, dtype=np.int64), acc.shape)
    m = np.empty(acc.shape, dtype=np.int64)
    n = np.empty(acc.shape, dtype=np.int64)
    for idx in np.ndindex(*acc.shape):
        r = float(x_qp.scale[0]) / (float(y_qp.scale[0]) * int(counts[idx]))
        mm, nn = quantize_multiplier(r, MBITS)
        assert abs(mm[0] / 2.0 ** nn[0] - r) <= r * 2.0 ** -MBITS
        m[idx], n[idx] = mm[0], nn[0]
    flat = [v.reshape(-1) for v in (acc, m, n)]  # ref_requant needs at least one dimension
    return ref_requant(*flat, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax).reshape(acc.shape)


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


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("case", range(len(POOL_CASES)))
def test_average_pool(case, include_pad):
    rng = np.random.default_rng(100 + case * 2 + include_pad)
    shape, attrs = POOL_CASES[case]
    attrs = dict(attrs, count_include_pad=include_pad)
    op = get_op("AveragePool")
    node = Node("pool", "AveragePool", ["x"], ["y"], attrs)
    for bits, signed in FORMATS:
        x_qp, x = _input(rng, shape, bits, signed)
        x_f = x_qp.dequantize(x)
        (y_ort,) = ort_single("AveragePool", {"x": x_f}, attrs, opset=OPSET)
        np.testing.assert_allclose(op.forward_float(node, [x_f])[0], y_ort, rtol=1e-5, atol=1e-6)
        y_qp = _proposal(rng, y_ort, bits, signed)
        q = op.quantize(context(node, [x_qp], [y_qp]))
        assert q.out_qparams[0] == y_qp
        (y,) = op.forward_int(q, [x], runtime())
        assert y.dtype == y_qp.dtype and y.shape == y_ort.shape

        kernel, strides, dilations, begin, end = _geometry(shape, attrs, y_ort.shape[2:])
        xc = x.astype(np.int64) - int(x_qp.zero_point[0])
        acc, counts = _ref_pool(xc, kernel, strides, dilations, begin, end, y_ort.shape[2:], include_pad,
                                lambda v: v.sum(axis=-1))
        np.testing.assert_array_equal(y, _ref_mean_requant(acc, counts, x_qp, y_qp))
        assert lsb_error(y_qp, y, y_ort) <= _mean_bound(y_ort, y_qp)


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


@pytest.mark.parametrize("case", range(len(POOL_CASES)))
def test_max_pool(case):
    rng = np.random.default_rng(300 + case)
    shape, attrs = POOL_CASES[case]
    op = get_op("MaxPool")
    node = Node("pool", "MaxPool", ["x"], ["y"], attrs)
    for bits, signed in FORMATS:
        x_qp, x = _input(rng, shape, bits, signed)
        x_f = x_qp.dequantize(x)
        (y_ort,) = ort_single("MaxPool", {"x": x_f}, attrs, opset=OPSET)
        np.testing.assert_array_equal(op.forward_float(node, [x_f])[0], y_ort)
        proposal = _proposal(rng, y_ort, bits, signed)
        q = op.quantize(context(node, [x_qp], [proposal]))
        assert q.out_qparams[0] == x_qp  # the rule overrides the table
        (y,) = op.forward_int(q, [x], runtime())
        assert y.dtype == x.dtype
        kernel, strides, dilations, begin, end = _geometry(shape, attrs, y_ort.shape[2:])
        ref, _ = _ref_pool(x.astype(np.int64), kernel, strides, dilations, begin, end, y_ort.shape[2:], 0,
                           lambda v: v.max(axis=-1))
        np.testing.assert_array_equal(y, ref)
        np.testing.assert_array_equal(x_qp.dequantize(y), y_ort)  # exact: LSB bound 0


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 4, 7), (1, 2, 3, 4, 2)])
def test_global_pools(shape):
    rng = np.random.default_rng(sum(shape))
    for bits, signed in FORMATS:
        x_qp, x = _input(rng, shape, bits, signed)
        x_f = x_qp.dequantize(x)
        spatial = tuple(range(2, len(shape)))
        xc = x.astype(np.int64) - int(x_qp.zero_point[0])

        avg = get_op("GlobalAveragePool")
        node = Node("gap", "GlobalAveragePool", ["x"], ["y"])
        (y_ort,) = ort_single("GlobalAveragePool", {"x": x_f}, opset=OPSET)
        np.testing.assert_allclose(avg.forward_float(node, [x_f])[0], y_ort, rtol=1e-5, atol=1e-6)
        y_qp = _proposal(rng, y_ort, bits, signed)
        (y,) = avg.forward_int(avg.quantize(context(node, [x_qp], [y_qp])), [x], runtime())
        acc = np.zeros(shape[:2], dtype=np.int64)
        for idx in itertools.product(*(range(s) for s in shape[2:])):
            acc += xc[(slice(None), slice(None)) + idx]
        acc = acc.reshape(shape[:2] + (1,) * len(spatial))
        count = int(np.prod(shape[2:]))
        np.testing.assert_array_equal(y, _ref_mean_requant(acc, count, x_qp, y_qp))
        assert y.dtype == y_qp.dtype
        assert lsb_error(y_qp, y, y_ort) <= _mean_bound(y_ort, y_qp)

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


REDUCE_CASES = [
    ((2, 3, 4, 5), [2, 3], 1),
    ((2, 3, 4, 5), [1], 0),
    ((2, 3, 4, 5), [-1, 0], 1),
    ((3, 4, 5), None, 0),
]


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("case", range(len(REDUCE_CASES)))
def test_reduce_mean(case, opset):
    rng = np.random.default_rng(500 + case + opset)
    shape, axes, keepdims = REDUCE_CASES[case]
    op = get_op("ReduceMean")
    attrs = {"keepdims": keepdims}
    constants = {}
    inputs = ["x"]
    if axes is not None and opset >= 18:
        constants = {"axes": np.array(axes, dtype=np.int64)}
        inputs = ["x", "axes"]
    elif axes is not None:
        attrs["axes"] = axes
    node = Node("rm", "ReduceMean", inputs, ["y"], attrs)
    for bits, signed in FORMATS:
        x_qp, x = _input(rng, shape, bits, signed)
        x_f = x_qp.dequantize(x)
        (y_ort,) = ort_single("ReduceMean", {"x": x_f}, attrs, constants=constants, opset=opset)
        raw = [x_f] + list(constants.values())
        np.testing.assert_allclose(op.forward_float(node, raw)[0], y_ort, rtol=1e-5, atol=1e-6)
        y_qp = _proposal(rng, y_ort, bits, signed)
        const_inputs = {1: constants["axes"]} if constants else {}
        q = op.quantize(context(node, [x_qp, None][:len(inputs)], [y_qp], const_inputs))
        (y,) = op.forward_int(q, [x] + list(constants.values()), runtime())
        # reference: move the reduced axes last, flatten them, add column by column
        red = [a % len(shape) for a in (axes if axes is not None else range(len(shape)))]
        kept = [a for a in range(len(shape)) if a not in red]
        xc = np.transpose(x.astype(np.int64) - int(x_qp.zero_point[0]), kept + red)
        flat = xc.reshape([shape[a] for a in kept] + [-1])
        acc = np.zeros(flat.shape[:-1], dtype=np.int64)
        for j in range(flat.shape[-1]):
            acc += flat[..., j]
        ref = _ref_mean_requant(acc, flat.shape[-1], x_qp, y_qp)
        np.testing.assert_array_equal(y.reshape(ref.shape), ref)
        assert y.shape == y_ort.shape
        assert lsb_error(y_qp, y, y_ort) <= _mean_bound(y_ort, y_qp)


def test_reduce_mean_without_proposal_keeps_input_qparams_and_noop():
    rng = np.random.default_rng(7)
    x_qp, x = _input(rng, (2, 3, 4), 8, True)
    op = get_op("ReduceMean")
    node = Node("rm", "ReduceMean", ["x", "axes"], ["y"], {"noop_with_empty_axes": 1})
    q = op.quantize(context(node, [x_qp, None], [None], {1: np.array([], dtype=np.int64)}))
    assert q.out_qparams[0] == x_qp
    (y,) = op.forward_int(q, [x, np.array([], dtype=np.int64)], runtime())
    np.testing.assert_array_equal(y, x)


def test_mean_overflow_is_saturated_and_reported():
    """16-bit codes summed over 256 * 264 elements exceed int32: saturated, counted per node."""
    x_qp = random_qparams(np.random.default_rng(1), -1.0, 1.0, 16, signed=True, symmetric=True)
    x = np.full((1, 1, 256, 264), x_qp.qmax, dtype=x_qp.dtype)
    node = Node("gap", "GlobalAveragePool", ["x"], ["y"])
    op = get_op("GlobalAveragePool")
    rt = runtime()
    (y,) = op.forward_int(op.quantize(context(node, [x_qp], [x_qp])), [x], rt)
    assert rt.overflows == {"gap": 1}
    saturated = np.full((1, 1, 1, 1), 2**31 - 1, dtype=np.int64)
    np.testing.assert_array_equal(y, _ref_mean_requant(saturated, 256 * 264, x_qp, x_qp))
    assert y.item() == 31775  # (2^31 - 1) / 67584 = 31775.03, below the true mean 32767


def test_bad_inputs_raise_clear_errors():
    x_qp = random_qparams(np.random.default_rng(2), -1, 1)
    node = Node("pool", "AveragePool", ["x"], ["y"], {"kernel_shape": [2, 2]})
    q = get_op("AveragePool").quantize(context(node, [x_qp], [None]))
    with pytest.raises(ValueError, match="spatial"):
        get_op("AveragePool").forward_int(q, [np.zeros((1, 2, 4), np.int8)], runtime())
    with pytest.raises(QuantizationError, match="no qparams"):
        get_op("AveragePool").quantize(context(node, [None], [None]))
