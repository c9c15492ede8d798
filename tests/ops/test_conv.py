"""ops/conv.py: Conv (with its fused activation), ConvTranspose.

(a) forward_int equals an int64 reference of the op's integer formula written here independently (loops /
einsum over small shapes, Python-integer requant); (b) the dequantized output is within the op's documented
LSB bound of the float op (onnxruntime) run on the dequantized inputs and weights; forward_float matches
onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    Check,
    MBITS,
    MatmulOnlyBackend,
    apply_pre_shift,
    assert_forward_float_matches_onnxruntime,
    bias_scale,
    check_multiplier,
    context,
    covers,
    lsb_error,
    ort_single,
    random_qparams,
    ref_requant,
    runtime,
    saturate,
)
from ops import get_op
from ops.registry import IntRuntime, QuantizationError
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams


def _float_activation(y, activation, params):
    if activation == "Relu":
        return np.maximum(y, 0)
    if activation == "Clip":
        return np.clip(y, params[0], params[1])
    if activation == "LeakyRelu":
        return np.where(y >= 0, y, y * params[0])
    return y


def _activation_ref(acc, stage_m, stage_n, neg, y_qp, activation, params):
    """The requant + fused activation of an accumulator, in Python integers."""
    zp = int(y_qp.zero_point[0])
    lo, hi = y_qp.qmin, y_qp.qmax
    if activation == "Relu":
        lo = max(lo, zp)
    if activation == "Clip":
        cq = np.clip(np.rint(np.array(params) / y_qp.scale[0]) + zp, y_qp.qmin, y_qp.qmax)
        lo, hi = max(lo, int(cq[0])), min(hi, int(cq[1]))
    pos = ref_requant(acc, stage_m, stage_n, zp, lo, hi)
    if neg is None:
        return pos
    neg_m, neg_n, neg_sign = neg
    negative = ref_requant(acc * neg_sign, neg_m, neg_n, zp, lo, hi)
    return np.where(acc >= 0, pos, negative)


# ---------------------------------------------------------------------------------------------- Conv

def _naive_conv_int(xc, w, stride, pads, dilation, groups):
    """Zero-padded direct convolution of centered int64 codes: einsum per output position."""
    xp = np.pad(xc, [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    n, c, h, wd = xp.shape
    m, cg, kh, kw = w.shape
    oh = (h - (kh - 1) * dilation[0] - 1) // stride[0] + 1
    ow = (wd - (kw - 1) * dilation[1] - 1) // stride[1] + 1
    y = np.zeros((n, m, oh, ow), dtype=np.int64)
    mg = m // groups
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride[0]: i * stride[0] + (kh - 1) * dilation[0] + 1: dilation[0],
                       j * stride[1]: j * stride[1] + (kw - 1) * dilation[1] + 1: dilation[1]]
            for g in range(groups):
                y[:, g * mg:(g + 1) * mg, i, j] = np.einsum(
                    "nckl,mckl->nm", patch[:, g * cg:(g + 1) * cg], w[g * mg:(g + 1) * mg])
    return y


CONV_CASES = [
    # groups, cin, cout, kernel, stride, pads, dilation, x_bits, w_bits, per_channel, activation
    (1, 3, 4, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 8, 8, True, None),
    (1, 3, 4, (3, 3), (2, 2), (0, 1, 1, 0), (1, 1), 8, 8, False, "Relu"),
    (1, 2, 3, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 8, 8, True, "Clip"),
    (2, 4, 6, (3, 2), (1, 2), (1, 0, 1, 1), (2, 1), 8, 8, True, "LeakyRelu"),
    (4, 4, 4, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 8, 8, True, "Clip"),   # depthwise
    (3, 3, 6, (5, 5), (1, 1), (2, 2, 2, 2), (1, 1), 8, 8, True, None),     # depthwise, multiplier 2
    (1, 3, 4, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 16, 8, True, None),    # 16-bit activations
    (4, 4, 4, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 16, 8, True, "Relu"),  # 16-bit depthwise
    (1, 3, 2, (2, 2), (1, 1), (0, 0, 0, 0), (1, 1), 8, 16, False, None),   # 16-bit weights
    (1, 2, 3, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 16, 16, True, "Relu"),  # 16 x 16 bits, per channel
]


def _conv_setup(seed, case, out_bits=8):
    groups, cin, cout, kernel, stride, pads, dilation, x_bits, w_bits, per_channel, activation = case
    rng = np.random.default_rng(seed)
    x_f = rng.normal(0.3, 1.5, size=(2, cin, 7, 6)).astype(np.float32)
    w_f = rng.normal(0, 0.5, size=(cout, cin // groups) + kernel).astype(np.float32)
    b_f = rng.normal(0, 0.5, size=cout).astype(np.float32)
    x_qp = random_qparams(rng, float(x_f.min()), float(x_f.max()), x_bits, signed=bool(rng.integers(2)))
    if per_channel:
        flat = w_f.reshape(cout, -1)
        w_qp = random_qparams(rng, flat.min(1), flat.max(1), w_bits, signed=True, axis=0)
    else:
        w_qp = random_qparams(rng, float(w_f.min()), float(w_f.max()), w_bits, signed=True)
    params = {"Clip": [-0.5, 2.0], "LeakyRelu": [0.1], "Relu": None, None: None}[activation]
    attrs = {"group": groups, "strides": list(stride), "pads": list(pads), "dilations": list(dilation)}
    if activation:
        attrs["activation"] = activation
        if params is not None:
            attrs["activation_params"] = params
    x_q = x_qp.quantize(x_f)
    w_deq = w_qp.dequantize(w_qp.quantize(w_f))
    plain = {k: v for k, v in attrs.items() if not k.startswith("activation")}
    y_float = ort_single("Conv", {"x": x_qp.dequantize(x_q)}, plain, {"w": w_deq, "b": b_f})[0]
    y_float = _float_activation(y_float, activation, params)
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), out_bits, symmetric=False)
    node = Node("conv", "Conv", ["x", "w", "b"], ["y"], attrs)
    return node, x_q, x_qp, w_f, w_qp, b_f, y_qp, y_float, activation, params


@covers("Conv", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("seed, out_bits", [(0, 8), (1, 8), (2, 16)])
def test_conv_int_equals_reference_and_float_bound(case, seed, out_bits):
    node, x_q, x_qp, w_f, w_qp, b_f, y_qp, y_float, activation, params = _conv_setup(seed, case, out_bits)
    groups, _, cout, _, stride, pads, dilation, x_bits, w_bits = case[:9]
    op = get_op("Conv")
    q = op.quantize(context(node, [x_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f}))
    y = op.forward_int(q, [x_q, w_f, b_f], runtime())[0]
    assert y.dtype == y_qp.dtype

    # (a) the integer formula, independently
    zx = int(x_qp.zero_point[0])
    w_q = w_qp.quantize(w_f).astype(np.int64)
    zw = w_qp.zero_point.reshape(-1, 1, 1, 1) if w_qp.per_channel else int(w_qp.zero_point[0])
    s_w = np.broadcast_to(w_qp.scale, cout)
    acc_scale = x_qp.scale[0] * s_w
    bias = np.rint(b_f.astype(np.float64) / bias_scale(x_qp.scale[0], s_w)).astype(np.int64)
    acc = _naive_conv_int(x_q.astype(np.int64) - zx, w_q - zw, stride, pads, dilation, groups)
    acc = acc + bias.reshape(1, -1, 1, 1)
    acc, _ = saturate(acc, 32 if max(x_bits, w_bits) <= 8 else 48)
    r = acc_scale / y_qp.scale[0]
    stage = q.stage
    check_multiplier(stage.m, stage.n, r if stage.m.size > 1 else r[:1], stage.pre_shift)
    acc = apply_pre_shift(acc, stage, (1, cout, 1, 1))
    m = np.broadcast_to(stage.m, cout).reshape(1, -1, 1, 1)
    n = np.broadcast_to(stage.n, cout).reshape(1, -1, 1, 1)
    neg = None
    if activation == "LeakyRelu":
        check_multiplier(stage.neg_m, stage.neg_n, r * params[0], stage.pre_shift)
        neg = (stage.neg_m.reshape(1, -1, 1, 1), stage.neg_n.reshape(1, -1, 1, 1), 1)
    np.testing.assert_array_equal(y.astype(np.int64), _activation_ref(acc, m, n, neg, y_qp, activation, params))

    # (b) within the documented bound of the float op on the dequantized input and weight
    # documented bound: 0.5 (rounding) + bias rounding + |y codes| * 2^-(mbits-1) (multiplier error)
    codes = float(np.abs(y.astype(np.int64) - int(y_qp.zero_point[0])).max())
    bound = 0.5 + 0.5 * float(np.max(acc_scale)) / y_qp.scale[0] + codes * 2.0 ** -(MBITS - 1)
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-3
    if y_qp.bits == 8:
        assert bound <= 1.0


def test_conv_depthwise_through_backend_matmul_gives_the_same_codes():
    node, x_q, x_qp, w_f, w_qp, b_f, y_qp, *_ = _conv_setup(3, CONV_CASES[4])
    op = get_op("Conv")
    q = op.quantize(context(node, [x_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f}))
    backend = MatmulOnlyBackend()
    y_backend = op.forward_int(q, [x_q, w_f, b_f], IntRuntime(backend))[0]
    assert backend.calls == 1
    np.testing.assert_array_equal(y_backend, op.forward_int(q, [x_q, w_f, b_f], runtime())[0])


@covers("Conv", check=Check.INT_REFERENCE)
def test_conv_accumulator_overflow_is_saturated_and_reported():
    rng = np.random.default_rng(5)
    x_qp = QParams(scale=0.05, zero_point=0, bits=8, signed=True)
    w_qp = QParams(scale=0.01, zero_point=0, bits=8, signed=True)
    y_qp = QParams(scale=40.0, zero_point=0, bits=8, signed=True)
    x_q = rng.integers(100, 128, size=(1, 8, 4, 4)).astype(np.int8)
    w_f = np.full((2, 8, 3, 3), 1.27, dtype=np.float32)
    w_f[1] = -1.27
    node = Node("conv", "Conv", ["x", "w"], ["y"], {"pads": [1, 1, 1, 1]})
    op = get_op("Conv")
    q = op.quantize(context(node, [x_qp, w_qp], [y_qp], {1: w_f}, accumulator_bits=20))
    rt = runtime()
    y = op.forward_int(q, [x_q, w_f], rt)[0]
    acc = _naive_conv_int(x_q.astype(np.int64), np.full((2, 8, 3, 3), 127) * np.array([1, -1]).reshape(2, 1, 1, 1),
                          (1, 1), (1, 1, 1, 1), (1, 1), 1)
    acc, count = saturate(acc, 20)
    assert count > 0 and rt.overflows == {"conv": count}
    np.testing.assert_array_equal(y, ref_requant(acc, q.stage.m, q.stage.n, 0, -128, 127))


def test_conv_16bit_activations_use_a_48bit_accumulator():
    node, x_q, x_qp, w_f, w_qp, b_f, y_qp, *_ = _conv_setup(0, CONV_CASES[6])
    q = get_op("Conv").quantize(context(node, [x_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f}))
    assert q.acc.bits == 48
    node8, _, x8, w8f, w8, b8, y8, *_ = _conv_setup(0, CONV_CASES[0])
    assert get_op("Conv").quantize(context(node8, [x8, w8, None], [y8], {1: w8f, 2: b8})).acc.bits == 32


@covers("Conv", check=Check.ONNXRUNTIME)
def test_conv_float_forward_matches_onnxruntime_and_bad_input_is_named():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 4, 8, 8)).astype(np.float32)
    w = rng.normal(size=(4, 1, 3, 3)).astype(np.float32)
    attrs = {"group": 4, "auto_pad": "SAME_UPPER", "strides": [2, 2]}
    node = Node("c", "Conv", ["x", "w"], ["y"], attrs)
    got = get_op("Conv").forward_float(node, [x, w])[0]
    np.testing.assert_allclose(got, ort_single("Conv", {"x": x}, attrs, {"w": w})[0], rtol=1e-5, atol=1e-5)
    x_qp = compute_qparams(-1, 1)
    with pytest.raises(QuantizationError, match="weight"):
        get_op("Conv").quantize(context(node, [x_qp, None], [x_qp], {1: w}))


# ------------------------------------------------------------------------------------- ConvTranspose

def _naive_conv_transpose_int(xc, w, stride, pads, dilation, groups, out_pad):
    n, c, h, wd = xc.shape
    _, mg, kh, kw = w.shape
    cg = c // groups
    fh = (h - 1) * stride[0] + (kh - 1) * dilation[0] + 1 + out_pad[0]
    fw = (wd - 1) * stride[1] + (kw - 1) * dilation[1] + 1 + out_pad[1]
    full = np.zeros((n, groups * mg, fh, fw), dtype=np.int64)
    for ci in range(c):
        g = ci // cg
        for i in range(h):
            for j in range(wd):
                for a in range(kh):
                    for b in range(kw):
                        oi, oj = i * stride[0] + a * dilation[0], j * stride[1] + b * dilation[1]
                        full[:, g * mg:(g + 1) * mg, oi, oj] += xc[:, ci, i, j, None] * w[ci, :, a, b]
    return full[:, :, pads[0]: fh - pads[2], pads[1]: fw - pads[3]]


@covers("ConvTranspose", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("groups, stride, pads, dilation, out_pad, per_channel", [
    (1, (2, 2), (0, 0, 0, 0), (1, 1), (0, 0), True),
    (1, (2, 1), (1, 0, 1, 1), (1, 2), (1, 0), False),
    (2, (1, 2), (0, 1, 0, 1), (1, 1), (0, 1), True),
])
def test_conv_transpose_int_equals_reference_and_float_bound(groups, stride, pads, dilation, out_pad, per_channel):
    rng = np.random.default_rng(groups + stride[1])
    cin, mg = 4, 3
    x_f = rng.normal(size=(1, cin, 4, 3)).astype(np.float32)
    w_f = rng.normal(0, 0.5, size=(cin, mg, 3, 2)).astype(np.float32)
    b_f = rng.normal(size=groups * mg).astype(np.float32)
    x_qp = random_qparams(rng, float(x_f.min()), float(x_f.max()), 8, signed=False)
    if per_channel:
        w_qp = random_qparams(rng, w_f.min(axis=(0, 2, 3)), w_f.max(axis=(0, 2, 3)), 8, signed=True, axis=1)
    else:
        w_qp = random_qparams(rng, float(w_f.min()), float(w_f.max()), 8, signed=True)
    attrs = {"group": groups, "strides": list(stride), "pads": list(pads), "dilations": list(dilation),
             "output_padding": list(out_pad)}
    x_q = x_qp.quantize(x_f)
    w_q = w_qp.quantize(w_f)
    y_float = ort_single("ConvTranspose", {"x": x_qp.dequantize(x_q)}, attrs,
                         {"w": w_qp.dequantize(w_q), "b": b_f})[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("ct", "ConvTranspose", ["x", "w", "b"], ["y"], attrs)
    op = get_op("ConvTranspose")
    q = op.quantize(context(node, [x_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f}))
    y = op.forward_int(q, [x_q, w_f, b_f], runtime())[0]

    zw = w_qp.zero_point.reshape(1, -1, 1, 1) if per_channel else int(w_qp.zero_point[0])
    s_w = np.tile(np.broadcast_to(w_qp.scale, mg), groups)
    acc_scale = x_qp.scale[0] * s_w
    acc = _naive_conv_transpose_int(x_q.astype(np.int64) - int(x_qp.zero_point[0]), w_q.astype(np.int64) - zw,
                                    stride, pads, dilation, groups, out_pad)
    acc = acc + np.rint(b_f / bias_scale(x_qp.scale[0], s_w)).astype(np.int64).reshape(1, -1, 1, 1)
    m = np.broadcast_to(q.stage.m, groups * mg).reshape(1, -1, 1, 1)
    n = np.broadcast_to(q.stage.n, groups * mg).reshape(1, -1, 1, 1)
    check_multiplier(m.ravel(), n.ravel(), acc_scale / y_qp.scale[0], q.stage.pre_shift)
    acc = apply_pre_shift(acc, q.stage, (1, groups * mg, 1, 1))
    assert y.shape == y_float.shape
    np.testing.assert_array_equal(y, ref_requant(acc, m, n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    assert lsb_error(y_qp, y, y_float) <= 1.0 + 1e-3


@covers("ConvTranspose", check=Check.ONNXRUNTIME)
def test_conv_transpose_output_shape_and_float_forward():
    rng = np.random.default_rng(9)
    x = rng.normal(size=(1, 2, 3, 3)).astype(np.float32)
    w = rng.normal(size=(2, 3, 3, 3)).astype(np.float32)
    attrs = {"strides": [2, 2], "output_shape": [6, 6], "auto_pad": "SAME_UPPER"}  # total padding 2: even
    node = Node("ct", "ConvTranspose", ["x", "w"], ["y"], attrs)
    got = get_op("ConvTranspose").forward_float(node, [x, w])[0]
    want = ort_single("ConvTranspose", {"x": x}, attrs, {"w": w})[0]
    assert got.shape == (1, 3, 6, 6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@covers("Conv", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("groups, stride", [(1, 2), (3, 1)])
def test_conv_1d_int_equals_reference(groups, stride):
    """N-d support: a 1-d Conv is the 2-d reference with a height-1 kernel."""
    rng = np.random.default_rng(groups)
    x_f = rng.normal(size=(2, 3, 11)).astype(np.float32)
    w_f = rng.normal(size=(6, 3 // groups, 3)).astype(np.float32)
    x_qp = random_qparams(rng, float(x_f.min()), float(x_f.max()), 8, signed=False)
    w_qp = random_qparams(rng, w_f.min(axis=(1, 2)), w_f.max(axis=(1, 2)), 8, signed=True, axis=0)
    y_qp = random_qparams(rng, -4.0, 4.0, 8, symmetric=False)
    attrs = {"group": groups, "strides": [stride], "pads": [1, 2]}
    node = Node("c1", "Conv", ["x", "w"], ["y"], attrs)
    op = get_op("Conv")
    q = op.quantize(context(node, [x_qp, w_qp], [y_qp], {1: w_f}))
    x_q = x_qp.quantize(x_f)
    y = op.forward_int(q, [x_q, w_f], runtime())[0]
    w_c = w_qp.quantize(w_f).astype(np.int64) - w_qp.zero_point.reshape(-1, 1, 1)
    acc = _naive_conv_int((x_q.astype(np.int64) - int(x_qp.zero_point[0]))[:, :, None, :], w_c[:, :, None, :],
                          (1, stride), (0, 1, 0, 2), (1, 1), groups)[:, :, 0, :]
    want = ref_requant(acc, q.stage.m.reshape(1, -1, 1), q.stage.n.reshape(1, -1, 1), int(y_qp.zero_point[0]),
                       y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want)


FLOAT_CASES = [
    ("Conv", {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]},
     [(1, 4, 7, 8)], [(6, 2, 3, 2), (6,)]),
    ("ConvTranspose", {"group": 2, "strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]},
     [(1, 4, 3, 4)], [(4, 3, 3, 3), (6,)]),
]


@covers("Conv", "ConvTranspose", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type, attrs, input_shapes, const_shapes", FLOAT_CASES)
def test_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes):
    assert_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes)
