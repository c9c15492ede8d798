"""ops/conv_kernels.py: the convolution kernels under Conv/ConvTranspose (geometry, padding, im2col)."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import ort_single
from ops.backend import exact_matmul
from ops.conv_kernels import conv_geometry, conv_padded, im2col, pad_input


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
