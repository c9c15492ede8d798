"""MaxRoiPool (ops/roi_pool.py): (a) the integer forward equals a reference written here in Python integers
(box coordinates through M/2^N, bins by exact rational floor/ceil, maxima element by element); (b) the
dequantized output equals onnxruntime's float MaxRoiPool (exact; features non-negative, see the module
docstring on onnxruntime's FLT_MIN start)."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import Check, context, covers, random_codes, random_qparams, runtime
from ops import get_op
from ort_untyped import ort_run
from ptq.core.graph import Node
from ptq.core.qparams import QParams


def _shift(value: int, m: int, n: int) -> int:
    return (value * m + ((1 << n) >> 1)) >> n


def _reference(x, boxes, pooled, empty):
    """boxes: Python-int [batch, x1, y1, x2, y2]; bins by integer floor/ceil division."""
    n, c, h, w = x.shape
    out = np.empty((len(boxes), c) + pooled, x.dtype)
    for r, (b, x1, y1, x2, y2) in enumerate(boxes):
        height, width = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for ph in range(pooled[0]):
            for pw in range(pooled[1]):
                hs = min(max(y1 + (ph * height) // pooled[0], 0), h)
                he = min(max(y1 + -((-(ph + 1) * height) // pooled[0]), 0), h)
                ws = min(max(x1 + (pw * width) // pooled[1], 0), w)
                we = min(max(x1 + -((-(pw + 1) * width) // pooled[1]), 0), w)
                for ch in range(c):
                    cells = [int(x[b, ch, i, j]) for i in range(hs, he) for j in range(ws, we)]
                    out[r, ch, ph, pw] = max(cells) if cells else empty
    return out


ROIS = np.array([[0, 0, 0, 7, 5], [1, 2.5, 1, 11, 9], [0, 6, 4, 6, 4], [1, -3, -2, 20, 30], [0, 9, 9, 3, 2]],
                np.float32)


@covers("MaxRoiPool", check=Check.INT_REFERENCE)
@covers("MaxRoiPool", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("pooled,spatial_scale", [((2, 2), 1.0), ((3, 2), 0.5), ((4, 3), 0.75)])
def test_constant_rois(pooled, spatial_scale):
    rng = np.random.default_rng(pooled[0] + pooled[1])
    attrs = {"pooled_shape": list(pooled), "spatial_scale": spatial_scale}
    node = Node("rp", "MaxRoiPool", ["x", "rois"], ["y"], attrs)
    for bits, signed in [(8, False), (8, True), (16, True)]:
        x_qp = random_qparams(rng, 0.0 if not signed else -1.0, 2.0, bits, signed=signed)
        x = random_codes(rng, x_qp, (2, 3, 10, 12))
        x = np.maximum(x, x_qp.dtype.type(x_qp.zero_point[0]))  # non-negative features (onnxruntime's FLT_MIN)
        q = get_op("MaxRoiPool").quantize(context(node, [x_qp, None], [None], {1: ROIS}))
        assert q.out_qparams == [x_qp]
        y = get_op("MaxRoiPool").forward_int(q, [x, ROIS], runtime())[0]
        boxes = [[int(r[0])] + [int(np.floor(abs(float(np.float32(v) * np.float32(spatial_scale))) + 0.5))
                                * (1 if v >= 0 else -1) for v in r[1:]] for r in ROIS]
        np.testing.assert_array_equal(y, _reference(x, boxes, pooled, int(x_qp.zero_point[0])))
        want = ort_run("MaxRoiPool", {"x": x_qp.dequantize(x)}, attrs, {"rois": ROIS})[0]
        np.testing.assert_allclose(x_qp.dequantize(y), want, rtol=0, atol=1e-30)


@covers("MaxRoiPool", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("spatial_scale", [0.5, 0.3])
def test_run_time_rois_through_the_multiplier(spatial_scale):
    rng = np.random.default_rng(int(spatial_scale * 10))
    attrs = {"pooled_shape": [2, 3], "spatial_scale": spatial_scale}
    node = Node("rp", "MaxRoiPool", ["x", "rois"], ["y"], attrs)
    x_qp = random_qparams(rng, 0.0, 3.0, 8)
    x = random_codes(rng, x_qp, (2, 2, 9, 11))
    r_qp = QParams(np.array([0.25]), np.array([0]), bits=16, signed=True)
    rois = ROIS.copy()
    rois[:, 1:] *= 1.5
    r_q = r_qp.quantize(rois)
    q = get_op("MaxRoiPool").quantize(context(node, [x_qp, r_qp], [None]))
    y = get_op("MaxRoiPool").forward_int(q, [x, r_q], runtime())[0]
    m_b, n_b, m_c, n_c = (int(v[0]) for v in (q.m_batch, q.n_batch, q.m_coord, q.n_coord))
    assert abs(m_c / 2 ** n_c - 0.25 * spatial_scale) <= 0.25 * spatial_scale * 2 ** -14
    boxes = [[_shift(int(r[0]), m_b, n_b)] + [_shift(int(v), m_c, n_c) for v in r[1:]] for r in r_q]
    np.testing.assert_array_equal(y, _reference(x, boxes, (2, 3), int(x_qp.zero_point[0])))
    if spatial_scale == 0.5:  # M / 2^N = s_r * spatial_scale exactly: the float op's boxes
        want = ort_run("MaxRoiPool", {"x": x_qp.dequantize(x)}, attrs, {"rois": r_qp.dequantize(r_q)})[0]
        np.testing.assert_allclose(x_qp.dequantize(y), want, rtol=0, atol=1e-30)


def test_float_forward_keeps_negative_maxima():
    """ptq pools the true maximum where onnxruntime starts every bin at FLT_MIN (~0)."""
    x = -np.ones((1, 1, 4, 4), np.float32)
    node = Node("rp", "MaxRoiPool", ["x", "rois"], ["y"], {"pooled_shape": [1, 1]})
    y = get_op("MaxRoiPool").forward_float(node, [x, np.array([[0, 0, 0, 3, 3]], np.float32)])[0]
    np.testing.assert_array_equal(y, -np.ones((1, 1, 1, 1)))


def test_bad_rois_are_named():
    qp = random_qparams(np.random.default_rng(0), 0, 1, 8)
    node = Node("rp", "MaxRoiPool", ["x", "rois"], ["y"], {"pooled_shape": [2, 2]})
    q = get_op("MaxRoiPool").quantize(context(node, [qp, None], [None], {1: np.array([[3, 0, 0, 1, 1]], np.float32)}))
    with pytest.raises(ValueError, match="batch index 3"):
        get_op("MaxRoiPool").forward_int(q, [np.zeros((1, 1, 4, 4), np.uint8), None], runtime())
    with pytest.raises(ValueError, match="rois"):
        get_op("MaxRoiPool").forward_float(node, [np.zeros((1, 1, 4, 4), np.float32), np.zeros((2, 4), np.float32)])
