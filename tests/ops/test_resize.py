"""ops/resize.py: Resize, nearest (every coordinate_transformation_mode x nearest_mode) and linear with integer weights.

nearest: the dequantized integer output equals onnxruntime's float output on the dequantized input exactly
(dequantization is injective, so the codes are the right ones).
linear: (a) forward_int equals a Python-integer reference (source coordinates from the ONNX spec formulas,
evaluated in float32 as onnxruntime does; weights round(frac * 2^k); one loop per output element); (b) the
dequantized output is within the documented LSB bound of onnxruntime.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from op_testing import (
    FORMATS,
    MBITS,
    Check,
    context,
    covers,
    lsb_error,
    random_codes,
    random_qparams,
    ref_requant,
    runtime,
)
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node
from ptq.core.requant import quantize_multiplier


OPSET = 19
COORD_MODES = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
               "tf_crop_and_resize"]
NEAREST_MODES = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]


def _ort_resize(x, attrs, roi=None, scales=None, sizes=None):
    names = ["x", "roi" if roi is not None else "", "scales" if scales is not None else "",
             "sizes" if sizes is not None else ""]
    while names[-1] == "":
        names.pop()
    inits = [numpy_helper.from_array(np.asarray(v, dtype=dt), n) for v, n, dt in
             ((roi, "roi", np.float32), (scales, "scales", np.float32), (sizes, "sizes", np.int64)) if v is not None]
    node = helper.make_node("Resize", names, ["y"], **attrs)
    graph = helper.make_graph([node], "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.astype(np.float32)})[0]


def _node_inputs(roi, scales, sizes):
    names = ["x", "roi" if roi is not None else "", "scales" if scales is not None else "",
             "sizes" if sizes is not None else ""]
    values = [roi, scales, sizes]
    constants = {i + 1: np.asarray(v) for i, v in enumerate(values) if v is not None}
    return names, [None if v is None else np.asarray(v) for v in values], constants


# (shape, scales, sizes): 4-D NCHW with H/W resized, up and down, uneven, and one axis only
GEOMETRIES = [
    ((1, 2, 4, 5), [1, 1, 2.0, 2.0], None),
    ((1, 2, 6, 7), [1, 1, 0.5, 0.6], None),
    ((2, 1, 3, 4), [1, 1, 1.5, 2.5], None),
    ((1, 2, 5, 3), None, [1, 2, 8, 2]),
    ((1, 1, 4, 6), [1, 1, 1, 3.0], None),
]
ROI = np.array([0, 0, -0.2, 0.1, 1, 1, 1.1, 0.8], dtype=np.float32)


@covers("Resize", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("coord", COORD_MODES)
@pytest.mark.parametrize("nearest_mode", NEAREST_MODES)
def test_nearest_matches_onnxruntime_exactly(coord, nearest_mode):
    rng = np.random.default_rng(COORD_MODES.index(coord) * 10 + NEAREST_MODES.index(nearest_mode))
    op = get_op("Resize")
    attrs = {"mode": "nearest", "coordinate_transformation_mode": coord, "nearest_mode": nearest_mode,
             "extrapolation_value": 0.7}
    for (shape, scales, sizes), (bits, signed) in zip(GEOMETRIES, itertools.cycle(FORMATS)):
        roi = ROI if coord == "tf_crop_and_resize" else None
        names, raw, constants = _node_inputs(roi, scales, sizes)
        node = Node("rs", "Resize", names, ["y"], attrs)
        x_qp = random_qparams(rng, -1.0, 2.0, bits, signed=signed)
        x = random_codes(rng, x_qp, shape)
        x_f = x_qp.dequantize(x)
        y_ort = _ort_resize(x_f, attrs, roi, scales, sizes)
        np.testing.assert_array_equal(op.forward_float(node, [x_f] + raw)[0], y_ort)
        q = op.quantize(context(node, [x_qp, None, None, None][:len(names)], [None], constants))
        assert q.out_qparams[0] == x_qp
        (y,) = op.forward_int(q, [x] + raw, runtime())
        assert y.dtype == x.dtype and y.shape == y_ort.shape
        expected = y_ort.copy()
        if coord == "tf_crop_and_resize":  # the extrapolation value itself is quantized (0.5 LSB)
            expected = np.where(y_ort == np.float32(0.7), x_qp.dequantize(x_qp.quantize(np.float32(0.7))), y_ort)
        np.testing.assert_array_equal(x_qp.dequantize(y), expected)


def _spec_coordinate(mode, x, scale, n_in, n_out, roi=(0.0, 1.0)):
    """ONNX Resize spec formulas, evaluated in float32 operation by operation as onnxruntime does
    (half_pixel_symmetric: float32 offset, the rest in double)."""
    f = np.float32
    x, scale, n_in, n_out = f(x), f(scale), f(n_in), f(n_out)
    if mode == "asymmetric":
        return float(x / scale)
    if mode == "align_corners":
        return 0.0 if n_out == 1 else float(x * (n_in - f(1)) / (n_out - f(1)))
    if mode == "pytorch_half_pixel":
        return float((x + f(0.5)) / scale - f(0.5)) if n_out > 1 else 0.0
    if mode == "half_pixel_symmetric":
        adjustment = n_out / (scale * n_in)
        offset = n_in / f(2) * (f(1) - adjustment)
        return float(f(float(offset) + (float(x) + 0.5) / float(scale) - 0.5))
    if mode == "tf_crop_and_resize":
        start, end = f(roi[0]), f(roi[1])
        if n_out == 1:
            return float(f(0.5 * float(start + end) * float(n_in - f(1))))
        return float(start * (n_in - f(1)) + (x * (end - start) * (n_in - f(1))) / (n_out - f(1)))
    return float((x + f(0.5)) / scale - f(0.5))


def _ref_linear(x, x_qp, y_qp, shape, out_shape, scales, coord, k, extrap_code):
    """Python-integer bilinear reference over the resized axes (H and/or W of NCHW)."""
    resized = [a for a in (2, 3) if out_shape[a] != shape[a] or (scales is not None and scales[a] != 1)]
    eff_scale = {a: (np.float32(scales[a]) if scales is not None else np.float32(out_shape[a]) / np.float32(shape[a]))
                 for a in resized}
    roi = {a: (float(ROI[a]), float(ROI[4 + a])) for a in resized}
    taps, outside = {}, {}
    for a in resized:
        taps[a], outside[a] = [], []
        for o in range(out_shape[a]):
            c = _spec_coordinate(coord, o, float(eff_scale[a]), shape[a], out_shape[a], roi[a])
            outside[a].append(coord == "tf_crop_and_resize" and not 0 <= c <= shape[a] - 1)
            c = min(max(c, 0.0), shape[a] - 1)
            i0 = min(int(math.floor(c)), shape[a] - 1)
            i1 = min(i0 + 1, shape[a] - 1)
            w1 = 0 if i0 == i1 else int(round((c - i0) * (1 << k)))
            taps[a].append([(i0, (1 << k) - w1), (i1, w1)])
    xc = x.astype(np.int64) - int(x_qp.zero_point[0])
    m, n = quantize_multiplier(float(x_qp.scale[0]) / float(y_qp.scale[0]), MBITS)
    acc = np.zeros(out_shape, dtype=object)
    mask = np.zeros(out_shape[2:], dtype=bool)
    for oh, ow in itertools.product(range(out_shape[2]), range(out_shape[3])):
        hs = taps[2][oh] if 2 in taps else [(oh, 1)]
        ws = taps[3][ow] if 3 in taps else [(ow, 1)]
        total = 0
        for (ih, wh), (iw, ww) in itertools.product(hs, ws):
            total = total + xc[:, :, ih, iw].astype(object) * (wh * ww)
        acc[:, :, oh, ow] = total
        mask[oh, ow] = (2 in outside and outside[2][oh]) or (3 in outside and outside[3][ow])
    shift = int(n[0]) + k * len(resized)
    y = ref_requant(acc, m[0], shift, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    return np.where(mask, extrap_code, y), len(resized)


@covers("Resize", check=Check.INT_REFERENCE)
@covers("Resize", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("coord", COORD_MODES)
def test_linear_integer_weights(coord):
    rng = np.random.default_rng(40 + COORD_MODES.index(coord))
    op = get_op("Resize")
    attrs = {"mode": "linear", "coordinate_transformation_mode": coord, "extrapolation_value": -0.4}
    for (shape, scales, sizes), (bits, signed) in itertools.product(GEOMETRIES, FORMATS):
        roi = ROI if coord == "tf_crop_and_resize" else None
        names, raw, constants = _node_inputs(roi, scales, sizes)
        node = Node("rs", "Resize", names, ["y"], attrs)
        x_qp = random_qparams(rng, -1.0, 2.0, bits, signed=signed)
        x = random_codes(rng, x_qp, shape)
        x_f = x_qp.dequantize(x)
        y_ort = _ort_resize(x_f, attrs, roi, scales, sizes)
        np.testing.assert_allclose(op.forward_float(node, [x_f] + raw)[0], y_ort, rtol=1e-5, atol=1e-5)
        y_qp = random_qparams(rng, float(y_ort.min()), float(y_ort.max()), bits, signed=signed)
        q = op.quantize(context(node, [x_qp, None, None, None][:len(names)], [y_qp], constants))
        (y,) = op.forward_int(q, [x] + raw, runtime())
        assert y.dtype == y_qp.dtype and y.shape == y_ort.shape

        axes = sum(1 for a in (2, 3) if y_ort.shape[a] != shape[a])
        k = min(16, (61 - MBITS - bits) // axes)
        extrap = int(y_qp.quantize(np.array([-0.4]))[0])
        ref, resized = _ref_linear(x, x_qp, y_qp, shape, y_ort.shape, scales, coord, k, extrap)
        assert resized == axes
        np.testing.assert_array_equal(y, ref)

        spread = (int(x.max()) - int(x.min())) * float(x_qp.scale[0]) / float(y_qp.scale[0])
        big = float(np.max(np.abs(y_ort))) / float(y_qp.scale[0])
        bound = 0.5 + big * (2.0 ** -MBITS + 2.0 ** -20) + axes * 2.0 ** -(k + 1) * spread + 1e-3
        assert lsb_error(y_qp, y, y_ort) <= bound


def test_linear_8bit_upsample_by_two_is_exact_average():
    """Scale 2, half_pixel: weights 1/4 and 3/4 are exact in 2^k, so y = round((3a + b) / 4) per axis."""
    x_qp = random_qparams(np.random.default_rng(0), 0.0, 1.0, 8, signed=False, symmetric=True)
    x = np.array([[[[0, 100]]]], dtype=np.uint8)
    node = Node("rs", "Resize", ["x", "", "scales"], ["y"], {"mode": "linear"})
    scales = np.array([1, 1, 1, 2], dtype=np.float32)
    op = get_op("Resize")
    q = op.quantize(context(node, [x_qp, None, None], [x_qp], {2: scales}))
    (y,) = op.forward_int(q, [x, None, scales], runtime())
    # coordinates -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1)
    np.testing.assert_array_equal(y, [[[[0, 25, 75, 100]]]])


def test_nearest_keep_aspect_ratio_and_axes():
    rng = np.random.default_rng(3)
    x_qp = random_qparams(rng, -1.0, 1.0, 8, signed=True)
    x = random_codes(rng, x_qp, (1, 1, 4, 6))
    x_f = x_qp.dequantize(x)
    op = get_op("Resize")
    for policy in ("not_larger", "not_smaller"):
        attrs = {"mode": "nearest", "keep_aspect_ratio_policy": policy, "axes": [2, 3]}
        sizes = np.array([7, 9], dtype=np.int64)
        node = Node("rs", "Resize", ["x", "", "", "sizes"], ["y"], attrs)
        y_ort = _ort_resize(x_f, attrs, sizes=sizes)
        q = op.quantize(context(node, [x_qp, None, None, None], [None], {3: sizes}))
        (y,) = op.forward_int(q, [x, None, None, sizes], runtime())
        np.testing.assert_array_equal(x_qp.dequantize(y), y_ort)


def test_unsupported_configurations_raise():
    x_qp = random_qparams(np.random.default_rng(0), -1, 1)
    op = get_op("Resize")
    scales = {2: np.array([1, 1, 2, 2], dtype=np.float32)}
    for attrs, match in (({"mode": "cubic"}, "cubic"), ({"mode": "linear", "antialias": 1}, "antialias"),
                         ({"coordinate_transformation_mode": "tf_half_pixel_for_nn"}, "tf_half_pixel_for_nn")):
        node = Node("rs", "Resize", ["x", "", "scales"], ["y"], attrs)
        with pytest.raises(QuantizationError, match=match):
            op.quantize(context(node, [x_qp, None, None], [None], scales))
    node = Node("rs", "Resize", ["x", "", "scales"], ["y"], {})
    with pytest.raises(QuantizationError, match="must be a constant"):
        op.quantize(context(node, [x_qp, None, None], [None], {}))
    with pytest.raises(QuantizationError, match="opset-10"):
        op.quantize(context(Node("rs", "Resize", ["x", "scales"], ["y"], {}), [x_qp, None], [None], {1: scales[2]}))
