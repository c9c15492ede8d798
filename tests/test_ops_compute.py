"""Conv, ConvTranspose, Gemm, MatMul, BatchNormalization, Add, Sub, Mul.

(a) forward_int equals an int64 reference of the op's integer formula written here independently (loops /
einsum over small shapes, Python-integer requant); (b) the dequantized output is within the op's documented
LSB bound of the float op (onnxruntime) run on the dequantized inputs and weights.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    MatmulOnlyBackend,
    context,
    lsb_error,
    ort_single,
    random_qparams,
    ref_requant,
    runtime,
)
from ops import get_op
from ops.registry import IntRuntime, QuantizationError
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams

MBITS = 15


def _check_multiplier(m, n, r, pre_shift=None):
    """M / 2^(N + P) approximates r to the full 15-bit multiplier's precision (an independent sanity check)."""
    r = np.asarray(r, dtype=np.float64)
    shift = np.asarray(n, dtype=np.float64) + (0 if pre_shift is None else np.asarray(pre_shift, dtype=np.float64))
    approx = np.asarray(m, dtype=np.float64) / np.exp2(shift)
    assert np.all(np.abs(approx - r) <= r * 2.0 ** -(MBITS - 1))


def _pre_shift(acc, stage, shape):
    """The stage's accumulator pre-rounding (acc + 2^(P-1)) >> P in Python integers (no P: unchanged)."""
    if stage.pre_shift is None:
        return acc
    p = int(stage.pre_shift[0]) if stage.pre_shift.size == 1 else stage.pre_shift.reshape(shape)
    return ref_requant(acc, 1, p, 0, -2 ** 62, 2 ** 62)


def _bias_scale(s_x, s_w):
    """The QDQ convention: the bias scale is the float32 product s_x * s_w."""
    return (np.float32(s_x) * np.asarray(s_w, dtype=np.float32)).astype(np.float64)


def _saturate(acc, bits):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return np.clip(acc, lo, hi), int(np.count_nonzero((acc < lo) | (acc > hi)))


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
    bias = np.rint(b_f.astype(np.float64) / _bias_scale(x_qp.scale[0], s_w)).astype(np.int64)
    acc = _naive_conv_int(x_q.astype(np.int64) - zx, w_q - zw, stride, pads, dilation, groups)
    acc = acc + bias.reshape(1, -1, 1, 1)
    acc, _ = _saturate(acc, 32 if max(x_bits, w_bits) <= 8 else 48)
    r = acc_scale / y_qp.scale[0]
    stage = q.stage
    _check_multiplier(stage.m, stage.n, r if stage.m.size > 1 else r[:1], stage.pre_shift)
    acc = _pre_shift(acc, stage, (1, cout, 1, 1))
    m = np.broadcast_to(stage.m, cout).reshape(1, -1, 1, 1)
    n = np.broadcast_to(stage.n, cout).reshape(1, -1, 1, 1)
    neg = None
    if activation == "LeakyRelu":
        _check_multiplier(stage.neg_m, stage.neg_n, r * params[0], stage.pre_shift)
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
    acc, count = _saturate(acc, 20)
    assert count > 0 and rt.overflows == {"conv": count}
    np.testing.assert_array_equal(y, ref_requant(acc, q.stage.m, q.stage.n, 0, -128, 127))


def test_conv_16bit_activations_use_a_48bit_accumulator():
    node, x_q, x_qp, w_f, w_qp, b_f, y_qp, *_ = _conv_setup(0, CONV_CASES[6])
    q = get_op("Conv").quantize(context(node, [x_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f}))
    assert q.acc.bits == 48
    node8, _, x8, w8f, w8, b8, y8, *_ = _conv_setup(0, CONV_CASES[0])
    assert get_op("Conv").quantize(context(node8, [x8, w8, None], [y8], {1: w8f, 2: b8})).acc.bits == 32


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
    acc = acc + np.rint(b_f / _bias_scale(x_qp.scale[0], s_w)).astype(np.int64).reshape(1, -1, 1, 1)
    m = np.broadcast_to(q.stage.m, groups * mg).reshape(1, -1, 1, 1)
    n = np.broadcast_to(q.stage.n, groups * mg).reshape(1, -1, 1, 1)
    _check_multiplier(m.ravel(), n.ravel(), acc_scale / y_qp.scale[0], q.stage.pre_shift)
    acc = _pre_shift(acc, q.stage, (1, groups * mg, 1, 1))
    assert y.shape == y_float.shape
    np.testing.assert_array_equal(y, ref_requant(acc, m, n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    assert lsb_error(y_qp, y, y_float) <= 1.0 + 1e-3


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


# ----------------------------------------------------------------------------------------- Gemm

@pytest.mark.parametrize("trans_a, trans_b, alpha, beta, c_shape, per_channel, x_bits", [
    (0, 0, 1.0, 1.0, (5,), True, 8),
    (1, 1, 0.5, 2.0, (1, 5), True, 8),
    (0, 1, -1.5, 0.5, (3, 5), False, 8),
    (0, 0, 1.0, 1.0, None, True, 16),
    (1, 0, 2.0, 1.0, (3, 1), True, 8),
])
def test_gemm_int_equals_reference_and_float_bound(trans_a, trans_b, alpha, beta, c_shape, per_channel, x_bits):
    rng = np.random.default_rng(int(abs(alpha) * 10) + x_bits + trans_a)
    m_, k_, n_ = 3, 6, 5
    a_f = rng.normal(size=(k_, m_) if trans_a else (m_, k_)).astype(np.float32)
    b_f = rng.normal(0, 0.5, size=(n_, k_) if trans_b else (k_, n_)).astype(np.float32)
    a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), x_bits, signed=bool(rng.integers(2)))
    axis = 0 if trans_b else 1
    if per_channel:
        w_qp = random_qparams(rng, b_f.min(axis=1 - axis), b_f.max(axis=1 - axis), 8, signed=True, axis=axis)
    else:
        w_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), 8, signed=True)
    a_q = a_qp.quantize(a_f)
    w_q = w_qp.quantize(b_f)
    attrs = {"alpha": alpha, "beta": beta, "transA": trans_a, "transB": trans_b}
    consts = {"b": w_qp.dequantize(w_q)}
    inputs_node = ["a", "b"]
    constants = {1: b_f}
    c_f = None
    if c_shape is not None:
        c_f = rng.normal(size=c_shape).astype(np.float32)
        consts["c"] = c_f
        inputs_node.append("c")
        constants[2] = c_f
    y_float = ort_single("Gemm", {"a": a_qp.dequantize(a_q)}, attrs, consts)[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("gemm", "Gemm", inputs_node, ["y"], attrs)
    op = get_op("Gemm")
    q = op.quantize(context(node, [a_qp, w_qp] + [None] * (len(inputs_node) - 2), [y_qp], constants))
    y = op.forward_int(q, [a_q, b_f] + ([c_f] if c_f is not None else []), runtime())[0]

    a_c = a_q.astype(np.int64) - int(a_qp.zero_point[0])
    a_c = a_c.T if trans_a else a_c
    w_c = w_q.astype(np.int64) - w_qp.broadcast(w_qp.zero_point, 2)
    w_c = w_c.T if trans_b else w_c
    s_w = np.broadcast_to(w_qp.scale, n_)
    acc_scale = abs(alpha) * a_qp.scale[0] * s_w
    acc = np.einsum("mk,kn->mn", a_c, w_c) * int(np.sign(alpha))
    if c_f is not None:
        c_scale = abs(alpha) * _bias_scale(a_qp.scale[0], s_w)
        acc = acc + np.rint(beta * c_f.astype(np.float64) / c_scale).astype(np.int64)
    acc, _ = _saturate(acc, 32 if x_bits <= 8 else 48)
    m = np.broadcast_to(q.stage.m, n_)
    n = np.broadcast_to(q.stage.n, n_)
    _check_multiplier(m, n, acc_scale / y_qp.scale[0], q.stage.pre_shift)
    acc = _pre_shift(acc, q.stage, (1, n_))
    np.testing.assert_array_equal(y, ref_requant(acc, m, n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    assert lsb_error(y_qp, y, y_float) <= 1.0 + 1e-3


# --------------------------------------------------------------------------------------- MatMul

@pytest.mark.parametrize("a_shape, b_shape, b_const, per_channel, bits", [
    ((4, 6), (6, 3), True, True, 8),
    ((2, 4, 6), (6, 3), True, False, 8),
    ((2, 4, 6), (2, 6, 3), True, True, 16),
    ((2, 1, 4, 6), (3, 6, 5), False, False, 8),  # two activations, broadcast batch
    ((6,), (6, 3), True, True, 8),                # 1-D A
    ((3, 6), (6,), False, False, 16),             # 1-D activation B
])
def test_matmul_int_equals_reference_and_float_bound(a_shape, b_shape, b_const, per_channel, bits):
    rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape) + bits)
    a_f = rng.normal(0.5, 1.0, size=a_shape).astype(np.float32)
    b_f = rng.normal(0, 0.5, size=b_shape).astype(np.float32)
    a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), bits, signed=bool(rng.integers(2)))
    if per_channel:
        red = tuple(range(b_f.ndim - 1))
        b_qp = random_qparams(rng, b_f.min(axis=red), b_f.max(axis=red), 8, signed=True, axis=b_f.ndim - 1)
    else:
        b_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), bits if not b_const else 8,
                              signed=bool(rng.integers(2)))
    a_q = a_qp.quantize(a_f)
    b_q = b_qp.quantize(b_f)
    if b_const:
        y_float = ort_single("MatMul", {"a": a_qp.dequantize(a_q)}, {}, {"b": b_qp.dequantize(b_q)})[0]
    else:
        y_float = ort_single("MatMul", {"a": a_qp.dequantize(a_q), "b": b_qp.dequantize(b_q)})[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("mm", "MatMul", ["a", "b"], ["y"])
    op = get_op("MatMul")
    q = op.quantize(context(node, [a_qp, b_qp], [y_qp], {1: b_f} if b_const else {}))
    y = op.forward_int(q, [a_q, b_f if b_const else b_q], runtime())[0]

    a_c = a_q.astype(np.int64) - int(a_qp.zero_point[0])
    b_c = b_q.astype(np.int64) - b_qp.broadcast(b_qp.zero_point, b_q.ndim)
    acc = np.matmul(a_c, b_c)  # int64 matmul of centered codes (numpy's integer path, no BLAS)
    acc, _ = _saturate(acc, 32 if bits <= 8 else 48)
    s_b = b_qp.scale if per_channel else b_qp.scale[:1]
    r = a_qp.scale[0] * s_b / y_qp.scale[0]
    _check_multiplier(q.stage.m, q.stage.n, r, q.stage.pre_shift)
    acc = _pre_shift(acc, q.stage, (1, q.stage.m.size))
    m = q.stage.m if q.stage.m.size == 1 else q.stage.m.reshape(-1)
    n = q.stage.n if q.stage.n.size == 1 else q.stage.n.reshape(-1)
    assert y.shape == y_float.shape
    np.testing.assert_array_equal(y, ref_requant(acc, m, n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    assert lsb_error(y_qp, y, y_float) <= 1.0 + 1e-3


def test_matmul_rejects_constant_a():
    qp = compute_qparams(-1, 1)
    node = Node("mm", "MatMul", ["a", "b"], ["y"])
    with pytest.raises(QuantizationError, match="activation"):
        get_op("MatMul").quantize(context(node, [qp, qp], [qp], {0: np.ones((2, 2)), 1: np.ones((2, 2))}))


# ----------------------------------------------------------------------------- BatchNormalization

@pytest.mark.parametrize("x_bits, signed", [(8, False), (8, True), (16, True)])
def test_batchnorm_int_equals_reference_and_float_bound(x_bits, signed):
    rng = np.random.default_rng(x_bits + signed)
    c = 4
    x_f = rng.normal(0.5, 2.0, size=(2, c, 3, 5)).astype(np.float32)
    gamma, beta, mean = (rng.normal(size=c).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.1, 3.0, size=c).astype(np.float32)
    x_qp = random_qparams(rng, float(x_f.min()), float(x_f.max()), x_bits, signed=signed)
    x_q = x_qp.quantize(x_f)
    consts = {"scale": gamma, "bias": beta, "mean": mean, "var": var}
    y_float = ort_single("BatchNormalization", {"x": x_qp.dequantize(x_q)}, {"epsilon": 1e-3}, consts)[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("bn", "BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], {"epsilon": 1e-3})
    op = get_op("BatchNormalization")
    q = op.quantize(context(node, [x_qp] + [None] * 4, [y_qp], {1: gamma, 2: beta, 3: mean, 4: var}))
    y = op.forward_int(q, [x_q, gamma, beta, mean, var], runtime())[0]

    w = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + 1e-3)
    b = beta - mean * w
    assert q.weight_qparams.bits == 16 and q.acc.bits == 48
    s_w = q.weight_qparams.scale
    np.testing.assert_allclose(s_w, np.abs(w) / 32767, rtol=1e-6)  # one weight per channel: full 16-bit code
    w_q = np.rint(w / s_w).astype(np.int64)
    acc_scale = x_qp.scale[0] * s_w
    acc = (x_q.astype(np.int64) - int(x_qp.zero_point[0])) * w_q.reshape(1, -1, 1, 1)
    acc = acc + np.rint(b / _bias_scale(x_qp.scale[0], s_w)).astype(np.int64).reshape(1, -1, 1, 1)
    _check_multiplier(q.stage.m, q.stage.n, acc_scale / y_qp.scale[0], q.stage.pre_shift)
    acc = _pre_shift(acc, q.stage, (1, c, 1, 1))
    want = ref_requant(acc, q.stage.m.reshape(1, -1, 1, 1), q.stage.n.reshape(1, -1, 1, 1),
                       int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want)
    assert lsb_error(y_qp, y, y_float) <= 1.0 + 1e-3


def test_batchnorm_training_mode_is_rejected():
    qp = compute_qparams(-1, 1)
    node = Node("bn", "BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], {"training_mode": 1})
    ones = np.ones(2, dtype=np.float32)
    with pytest.raises(QuantizationError, match="training_mode"):
        get_op("BatchNormalization").quantize(context(node, [qp] + [None] * 4, [qp], {i: ones for i in range(1, 5)}))


# ------------------------------------------------------------------------------------ Add, Sub, Mul

ELEMENTWISE_CASES = [
    # a_shape, b_shape, bits_a, bits_b, bits_y, b_constant
    ((2, 3, 4), (2, 3, 4), 8, 8, 8, False),
    ((2, 3, 4), (3, 1), 8, 8, 8, False),
    ((1, 3, 1, 1), (2, 3, 4, 4), 8, 16, 8, False),
    ((2, 5), (5,), 16, 16, 16, False),
    ((2, 3, 4, 4), (3, 1, 1), 8, None, 8, True),
]


def _elementwise_setup(seed, case, op_type):
    a_shape, b_shape, bits_a, bits_b, bits_y, b_constant = case
    rng = np.random.default_rng(seed)
    a_f = rng.normal(0.2, 1.0, size=a_shape).astype(np.float32)
    b_f = rng.normal(-0.1, 3.0, size=b_shape).astype(np.float32)
    a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), bits_a, signed=bool(rng.integers(2)))
    a_q = a_qp.quantize(a_f)
    if b_constant:
        b_qp = compute_qparams(float(b_f.min()), float(b_f.max()), bits_a, symmetric=False)
        inputs = {"a": a_qp.dequantize(a_q)}
        consts = {"b": b_qp.dequantize(b_qp.quantize(b_f))}
        b_q = None
    else:
        b_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), bits_b, signed=bool(rng.integers(2)))
        b_q = b_qp.quantize(b_f)
        inputs = {"a": a_qp.dequantize(a_q), "b": b_qp.dequantize(b_q)}
        consts = {}
    y_float = ort_single(op_type, inputs, {}, consts)[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), bits_y, symmetric=False)
    return a_f, a_q, a_qp, b_f, b_q, b_qp, y_qp, y_float


@pytest.mark.parametrize("op_type", ["Add", "Sub"])
@pytest.mark.parametrize("case", ELEMENTWISE_CASES)
def test_add_sub_int_equals_reference_and_float_bound(op_type, case):
    a_f, a_q, a_qp, b_f, b_q, b_qp, y_qp, y_float = _elementwise_setup(len(case[0]) + case[2], case, op_type)
    b_constant = case[5]
    node = Node("e", op_type, ["a", "b"], ["y"])
    op = get_op(op_type)
    ctx = context(node, [a_qp, None if b_constant else b_qp], [y_qp], {1: b_f} if b_constant else {})
    q = op.quantize(ctx)
    y = op.forward_int(q, [a_q, b_f if b_constant else b_q], runtime())[0]

    if b_constant:
        assert q.in_qparams[1] == b_qp  # quantized per tensor with its own min/max
        b_q = b_qp.quantize(b_f)
    shift = 16
    ra, rb = a_qp.scale[0] / y_qp.scale[0], b_qp.scale[0] / y_qp.scale[0]
    _check_multiplier(q.m, q.n, np.array([ra, rb]))
    a_c = ref_requant((a_q.astype(np.int64) - int(a_qp.zero_point[0])) * (1 << shift), q.m[0], q.n[0], 0, -2**62, 2**62)
    b_c = ref_requant((b_q.astype(np.int64) - int(b_qp.zero_point[0])) * (1 << shift), q.m[1], q.n[1], 0, -2**62, 2**62)
    total = a_c + b_c if op_type == "Add" else a_c - b_c
    want = ref_requant(total, 1, shift, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want)
    codes = max(2 ** a_qp.bits * ra, 2 ** b_qp.bits * rb)
    bound = 0.5 + 2.0 ** -shift + 2 * codes * 2.0 ** -(MBITS - 1)
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-3


@pytest.mark.parametrize("case", ELEMENTWISE_CASES)
def test_mul_int_equals_reference_and_float_bound(case):
    a_f, a_q, a_qp, b_f, b_q, b_qp, y_qp, y_float = _elementwise_setup(len(case[1]) + case[2], case, "Mul")
    b_constant = case[5]
    node = Node("e", "Mul", ["a", "b"], ["y"])
    op = get_op("Mul")
    ctx = context(node, [a_qp, None if b_constant else b_qp], [y_qp], {1: b_f} if b_constant else {})
    q = op.quantize(ctx)
    y = op.forward_int(q, [a_q, b_f if b_constant else b_q], runtime())[0]
    if b_constant:
        b_q = b_qp.quantize(b_f)
    r = a_qp.scale[0] * b_qp.scale[0] / y_qp.scale[0]
    _check_multiplier(q.m, q.n, r)
    prod = (a_q.astype(np.int64) - int(a_qp.zero_point[0])) * (b_q.astype(np.int64) - int(b_qp.zero_point[0]))
    np.testing.assert_array_equal(y, ref_requant(prod, q.m, q.n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    bound = 0.5 + float(np.abs(prod).max()) * abs(q.m[0] / 2.0 ** q.n[0] - r)
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-3


def test_elementwise_needs_input_qparams():
    qp = compute_qparams(-1, 1)
    node = Node("e", "Add", ["a", "b"], ["y"])
    with pytest.raises(QuantizationError, match="input 1"):
        get_op("Add").quantize(context(node, [qp, None], [qp]))


def test_sub_with_a_constant_first_input():
    """Sub is not symmetric: a constant minuend is quantized per tensor with its own min/max and the
    activation is subtracted from it."""
    rng = np.random.default_rng(11)
    a_f = rng.normal(size=(3, 1)).astype(np.float32)
    b_f = rng.normal(size=(2, 3, 4)).astype(np.float32)
    b_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), 8, signed=False)
    b_q = b_qp.quantize(b_f)
    a_qp = compute_qparams(float(a_f.min()), float(a_f.max()), 8, symmetric=False)
    y_float = a_qp.dequantize(a_qp.quantize(a_f)) - b_qp.dequantize(b_q)  # float64-exact Sub of the grids
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("s", "Sub", ["a", "b"], ["y"])
    q = get_op("Sub").quantize(context(node, [None, b_qp], [y_qp], {0: a_f}))
    assert q.in_qparams[0] == a_qp
    y = get_op("Sub").forward_int(q, [a_f, b_q], runtime())[0]
    a_c = ref_requant((a_qp.quantize(a_f).astype(np.int64) - int(a_qp.zero_point[0])) << 16, q.m[0], q.n[0], 0,
                      -2**62, 2**62)
    b_c = ref_requant((b_q.astype(np.int64) - int(b_qp.zero_point[0])) << 16, q.m[1], q.n[1], 0, -2**62, 2**62)
    np.testing.assert_array_equal(y, ref_requant(a_c - b_c, 1, 16, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    assert lsb_error(y_qp, y, y_float) <= 0.6


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


@pytest.mark.parametrize("r, mbits, want_shift", [(2.0 ** -20, 15, 3), (2.0 ** -17, 15, 0), (2.0 ** -10, 31, 0),
                                                  (2.0 ** -19.5, 31, 3), (2.0 ** -30, 8, 6)])
def test_tiny_requant_factors_pre_round_the_accumulator(r, mbits, want_shift):
    """r below min(2^(mbits-32), 2^-17) gets P pre-shift bits so that M keeps its width; the real factor
    M / 2^(N+P) stays within M's precision of r, and the pre-rounding costs below 2^-17 LSB."""
    from ops.linear import output_stage

    y_qp = QParams(scale=1.0, zero_point=0, bits=16, signed=True)
    stage = output_stage(np.array([r]), y_qp, mbits, None)
    shift = 0 if stage.pre_shift is None else int(stage.pre_shift[0])
    assert shift == want_shift
    assert int(stage.m[0]) >= 2 ** (min(mbits, 15) - 1)
    assert abs(stage.m[0] / 2.0 ** (stage.n[0] + shift) - r) <= r * 2.0 ** -(min(mbits, 15) - 1)
    assert 0.5 * r * 2 ** shift < 2.0 ** -17 or shift == 0
    acc = np.array([-(1 << 40) - 12345, -7, 0, 5, (1 << 40) + 99], dtype=np.int64)
    pre = ref_requant(acc, 1, shift, 0, -2 ** 62, 2 ** 62) if shift else acc
    np.testing.assert_array_equal(stage.apply(acc.copy()), ref_requant(pre, stage.m, stage.n, 0, -32768, 32767))


FLOAT_CASES = [
    ("Conv", {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]},
     [(1, 4, 7, 8)], [(6, 2, 3, 2), (6,)]),
    ("ConvTranspose", {"group": 2, "strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]},
     [(1, 4, 3, 4)], [(4, 3, 3, 3), (6,)]),
    ("Gemm", {"alpha": 0.5, "beta": 2.0, "transA": 1, "transB": 1}, [(5, 3)], [(4, 5), (4,)]),
    ("MatMul", {}, [(2, 3, 5)], [(5, 4)]),
    ("MatMul", {}, [(2, 3, 5), (2, 5, 4)], []),
    ("BatchNormalization", {"epsilon": 1e-3}, [(2, 3, 4, 4)], [(3,), (3,), (3,), (3,)]),
    ("Add", {}, [(2, 3, 4), (3, 1)], []),
    ("Sub", {}, [(2, 3, 4)], [(4,)]),
    ("Mul", {}, [(2, 3, 4), (2, 1, 4)], []),
]


@pytest.mark.parametrize("op_type, attrs, input_shapes, const_shapes", FLOAT_CASES)
def test_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes):
    rng = np.random.default_rng(len(op_type) + len(input_shapes))
    inputs = {f"i{k}": rng.normal(size=s).astype(np.float32) for k, s in enumerate(input_shapes)}
    consts = {f"c{k}": rng.uniform(0.2, 1.5, size=s).astype(np.float32) for k, s in enumerate(const_shapes)}
    want = ort_single(op_type, inputs, attrs, consts)[0]
    node = Node("n", op_type, list(inputs) + list(consts), ["y"], attrs)
    got = get_op(op_type).forward_float(node, list(inputs.values()) + list(consts.values()))[0]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
