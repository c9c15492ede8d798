"""The exact-BLAS dot product, the default backend, and the convolution kernels under Conv/ConvTranspose."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import ort_single
from ops.backend import FLOAT32_EXACT, FLOAT64_EXACT, NumpyBackend, absmax, exact_matmul, matmul_method
from ops.conv_kernels import conv_geometry, conv_padded, im2col, pad_input
from ops.registry import DotBackend


def _int64_ref(a, b):
    """Python-integer matmul (no float, no int64 wrap): the ground truth."""
    a = a.astype(object)
    b = b.astype(object)
    return np.array([[sum(a[i, k] * b[k, j] for k in range(a.shape[1])) for j in range(b.shape[1])]
                     for i in range(a.shape[0])], dtype=object)


@pytest.mark.parametrize("k, a_range, b_range, method", [
    (300, (-128, 128), (0, 256), "float32"),         # 300 * 128 * 255 < 2^24
    (4096, (-128, 128), (-128, 128), "float64"),     # 2^12 * 2^14 > 2^24
    (2048, (0, 65536), (-32768, 32768), "float64"),  # 16-bit x 16-bit, 2^11 * 2^31 < 2^53
])
def test_exact_matmul_equals_int64_on_large_k(k, a_range, b_range, method):
    rng = np.random.default_rng(k)
    a = rng.integers(*a_range, size=(5, k))
    b = rng.integers(*b_range, size=(k, 7))
    # extreme values everywhere in one row/column: the largest possible partial sums
    a[0] = a_range[0] if abs(a_range[0]) >= abs(a_range[1] - 1) else a_range[1] - 1
    b[:, 0] = b_range[0] if abs(b_range[0]) >= abs(b_range[1] - 1) else b_range[1] - 1
    assert matmul_method(k, absmax(a), absmax(b)) == method
    got = exact_matmul(a.astype(np.int32), b.astype(np.int32))
    # int32 exactly when the bound proves the product fits it
    assert got.dtype == (np.int32 if k * absmax(a) * absmax(b) < (1 << 31) else np.int64)
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


def test_float32_bound_is_tight_at_the_limit():
    k = 1024
    a = np.full((1, k), 127, dtype=np.int8)
    b = np.full((k, 1), 128, dtype=np.int16)  # K * 127 * 128 = 16,646,144 < 2^24
    assert k * 127 * 128 < FLOAT32_EXACT
    assert matmul_method(k, 127, 128) == "float32"
    assert exact_matmul(a, b)[0, 0] == k * 127 * 128
    b[0, 0] = 130  # now the bound fails for float32: 1024 * 127 * 130 > 2^24
    assert k * 127 * 130 >= FLOAT32_EXACT
    assert matmul_method(k, 127, 130) == "float64"
    assert exact_matmul(a, b)[0, 0] == k * 127 * 128 + 2 * 127


def test_int64_fallback_when_float64_bound_fails():
    rng = np.random.default_rng(1)
    a = rng.integers(-(1 << 30), 1 << 30, size=(3, 16), dtype=np.int64)
    b = rng.integers(-(1 << 30), 1 << 30, size=(16, 4), dtype=np.int64)
    a[:, 0] = (1 << 30) + 1  # odd products whose sums need all 62 bits
    b[0, :] = (1 << 30) - 1
    assert 16 * absmax(a) * absmax(b) >= FLOAT64_EXACT
    assert matmul_method(16, absmax(a), absmax(b)) == "int64"
    truth = _int64_ref(a, b)
    got = exact_matmul(a, b)
    assert np.array_equal(got.astype(object), truth)
    # the float64 product really is wrong here: the fallback is needed, not decorative
    float_result = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.int64)
    assert not np.array_equal(float_result.astype(object), truth)


def test_exact_matmul_broadcasts_batches_and_validates():
    rng = np.random.default_rng(2)
    a = rng.integers(-128, 128, size=(2, 3, 4, 5)).astype(np.int8)
    b = rng.integers(0, 256, size=(3, 5, 6)).astype(np.uint8)
    np.testing.assert_array_equal(exact_matmul(a, b), np.matmul(a.astype(np.int64), b.astype(np.int64)))
    with pytest.raises(TypeError, match="integer"):
        exact_matmul(a.astype(np.float32), b)
    with pytest.raises(ValueError, match="inner dimensions"):
        exact_matmul(a, b[:, :4])


def test_absmax_handles_int8_minimum():
    assert absmax(np.array([-128, 5], dtype=np.int8)) == 128
    assert absmax(np.array([], dtype=np.int8)) == 0


def test_numpy_backend_is_a_dot_backend():
    backend: DotBackend = NumpyBackend()
    assert backend.name == "numpy"
    a = np.array([[1, -2]], dtype=np.int8)
    b = np.array([[3], [4]], dtype=np.uint8)
    np.testing.assert_array_equal(backend.matmul(a, b), [[-5]])


def _naive_conv(x, w, stride, pads, dilation, groups):
    """Direct 2-d convolution in int64 loops over outputs and taps."""
    x = np.pad(x.astype(np.int64), [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    oh = (h - (kh - 1) * dilation[0] - 1) // stride[0] + 1
    ow = (wd - (kw - 1) * dilation[1] - 1) // stride[1] + 1
    y = np.zeros((n, m, oh, ow), dtype=np.int64)
    mg = m // groups
    for o in range(m):
        g = o // mg
        for i in range(oh):
            for j in range(ow):
                for ci in range(cg):
                    for a in range(kh):
                        for b in range(kw):
                            y[:, o, i, j] += (x[:, g * cg + ci, i * stride[0] + a * dilation[0],
                                                j * stride[1] + b * dilation[1]] * int(w[o, ci, a, b]))
    return y


@pytest.mark.parametrize("groups, cin, cout, stride, pads, dilation, direct", [
    (1, 3, 4, (1, 1), (0, 0, 0, 0), (1, 1), True),
    (1, 3, 5, (2, 1), (1, 0, 2, 1), (1, 2), True),
    (2, 4, 6, (1, 2), (1, 1, 1, 1), (1, 1), True),
    (4, 4, 4, (2, 2), (1, 1, 1, 1), (1, 1), True),   # depthwise, by taps
    (4, 4, 8, (1, 1), (0, 1, 2, 0), (2, 1), True),   # depthwise with multiplier 2
    (4, 4, 8, (1, 1), (0, 1, 2, 0), (2, 1), False),  # the same through the batched matmul
])
def test_conv_padded_matches_naive_integer_conv(groups, cin, cout, stride, pads, dilation, direct):
    rng = np.random.default_rng(groups + cout)
    x = rng.integers(-128, 128, size=(2, cin, 7, 6)).astype(np.int8)
    w = rng.integers(-128, 128, size=(cout, cin // groups, 3, 2)).astype(np.int32)
    attrs = {"strides": stride, "pads": pads, "dilations": dilation}
    geom = conv_geometry(attrs, x.shape[2:], w.shape[2:])
    got = conv_padded(pad_input(x, geom, 0), w, geom, groups, exact_matmul, np.int64, direct_depthwise=direct)
    np.testing.assert_array_equal(got, _naive_conv(x, w, stride, pads, dilation, groups))


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("spatial, kernel, stride", [((9,), (3,), (2,)), ((5, 6, 4), (2, 3, 3), (1, 2, 1))])
def test_float_conv_geometry_matches_onnxruntime(auto_pad, spatial, kernel, stride):
    rng = np.random.default_rng(len(spatial))
    x = rng.normal(size=(1, 2) + spatial).astype(np.float32)
    w = rng.normal(size=(3, 2) + kernel).astype(np.float32)
    attrs = {"strides": list(stride), "auto_pad": auto_pad}
    geom = conv_geometry(attrs, spatial, kernel)
    got = conv_padded(pad_input(x, geom, 0.0), w, geom, 1, np.matmul, np.float32)
    want = ort_single("Conv", {"x": x}, attrs, {"w": w})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_im2col_pointwise_is_a_view_and_rejects_empty_output():
    x = np.arange(24, dtype=np.int8).reshape(1, 2, 3, 4)
    geom = conv_geometry({}, (3, 4), (1, 1))
    cols = im2col(x, geom)
    assert cols.shape == (1, 2, 12) and np.shares_memory(cols, x)
    with pytest.raises(ValueError, match="empty"):
        conv_geometry({}, (3, 4), (5, 1)).out_shape((3, 4))


@pytest.mark.parametrize("axis, offset_shape", [(None, None), (1, (1, 5, 1, 1)), (1, (2, 5, 3, 4)), (None, (4,))])
@pytest.mark.parametrize("acc_dtype", [np.int32, np.int64])
def test_requantize_folds_the_offset_exactly_and_leaves_acc_alone(axis, offset_shape, acc_dtype):
    """requantize(acc, offset=o) (o * M folded into the rounding constant) gives the integers of the int64
    formula on acc + o, for int32 and int64 accumulators, and does not modify acc."""
    from ptq.core.requant import requantize

    rng = np.random.default_rng(7)
    wide = 1 << (30 if acc_dtype is np.int32 else 40)
    acc = rng.integers(-wide, wide, size=(2, 5, 3, 4)).astype(acc_dtype)
    acc[0, 0, 0, :2] = [-wide, wide - 1]
    size = 5 if axis is not None else 1
    m = rng.integers(1, 1 << 15, size=size)
    n = rng.integers(0, 32, size=size)
    offset = None if offset_shape is None else rng.integers(-(1 << 30), 1 << 30, size=offset_shape)
    zp = int(rng.integers(-100, 100))
    total = acc.astype(np.int64) + (0 if offset is None else offset)
    shape = (1, -1, 1, 1) if axis is not None else (-1,)
    mm, nn = m.reshape(shape), n.reshape(shape)
    want = np.clip(((total * mm + ((1 << nn) >> 1)) >> nn) + zp, -32768, 32767)
    before = acc.copy()
    got = requantize(acc, m, n, zp, -32768, 32767, axis=axis, dtype=np.int16, offset=offset)
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(acc, before)


def test_narrow_dtypes_with_small_values_still_pick_exact_arithmetic():
    """The dtype bound is only a shortcut: when it fails, the true extrema decide (and stay exact)."""
    rng = np.random.default_rng(3)
    a = rng.integers(-3, 4, size=(4, 5000)).astype(np.int16)  # dtype bound 32768 would force float64
    b = rng.integers(0, 256, size=(5000, 3)).astype(np.uint8)
    np.testing.assert_array_equal(exact_matmul(a, b), a.astype(np.int64) @ b.astype(np.int64))
    big = np.full((2, 5000), 32767, dtype=np.int16)
    np.testing.assert_array_equal(exact_matmul(big, b), big.astype(np.int64) @ b.astype(np.int64))
