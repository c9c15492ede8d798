"""ops/softmax.py: Softmax (whitepaper 4.66).

(a) forward_int equals an independent Python-integer reference (the 2^20-scaled exp table recomputed here, the
division rounded by its remainder); (b) the dequantized output is within 1 LSB of the float op (onnxruntime)
on the dequantized input; forward_float matches onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, runtime, seeded_input,
)
from ops import get_op
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams


def _softmax_ref(x_q, s_x, q_out, axis):
    """Whitepaper 4.66 in Python integers: 2^20-scaled exp table, integer sum, division rounded by remainder."""
    x = np.moveaxis(x_q.astype(np.int64), axis, -1)
    out = np.zeros(x.shape, dtype=np.int64)
    for idx in np.ndindex(*x.shape[:-1]):
        row = [int(v) for v in x[idx]]
        top = max(row)
        e = [int(np.rint(np.exp(-(top - v) * s_x) * 2 ** 20)) for v in row]
        total = sum(e)
        for j, ej in enumerate(e):
            quotient, remainder = divmod(ej * q_out, total)
            out[idx + (j,)] = quotient + (2 * remainder >= total)
    return np.moveaxis(out, -1, axis)


@covers("Softmax", check=Check.INT_REFERENCE)
@covers("Softmax", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("x_bits, x_signed, y_bits", [(8, True, 8), (8, False, 8), (16, True, 16), (16, True, 8)])
@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_int_equals_reference_and_float_bound(x_bits, x_signed, y_bits, axis):
    rng, x_qp, x_q = seeded_input(x_bits + y_bits + axis, x_bits, x_signed, shape=(2, 5, 7), lo=-3.0, hi=4.0)
    x_deq = x_qp.dequantize(x_q)
    y_float = ort_single("Softmax", {"x": x_deq}, {"axis": axis})[0]
    proposal = compute_qparams(0.0, 1.0, y_bits, symmetric=False)
    node = Node("s", "Softmax", ["x"], ["y"], {"axis": axis})
    op = get_op("Softmax")
    q = op.quantize(context(node, [x_qp], [proposal]))
    y_qp = q.out_qparams[0]
    q_out = (1 << y_bits) - 1
    assert y_qp == QParams(scale=1.0 / q_out, zero_point=0, bits=y_bits, signed=False)
    y = op.forward_int(q, [x_q], runtime())[0]
    np.testing.assert_array_equal(y, _softmax_ref(x_q, float(x_qp.scale[0]), q_out, axis))
    np.testing.assert_allclose(op.forward_float(node, [x_deq])[0], y_float, rtol=1e-5, atol=1e-7)
    assert lsb_error(y_qp, y, y_float) <= 1.0


# ------------------------------------------------ both opset semantics (Softmax, LogSoftmax, Hardmax)
# The Softmax family under both ONNX semantics (issue: opset < 13 coerces the input to 2-D at `axis`, default
# 1; opset >= 13 reduces one axis, default -1): float forward and integer run against onnxruntime at opsets 11,
# 12 and 13, axis 1 and -1 (and the default), 2-D to 4-D inputs; the integer kernel against a Python-integer
# reference of the softmax formula on the coerced rows.

SHAPES = [(3, 7), (2, 3, 5), (2, 3, 4, 5)]
AXES = [None, 1, -1]


def _node(op_type: str, opset: int, axis) -> Node:
    return Node("n", op_type, ["x"], ["y"], {} if axis is None else {"axis": axis}, opset=opset)


def _softmax_reference(x_q: np.ndarray, kernel, opset: int, axis) -> np.ndarray:
    """round(e_i * Q / S) per row in Python integers, rows as the opset's semantics define them."""
    if opset >= 13:
        rows = np.moveaxis(x_q, -1 if axis is None else axis, -1)
        back = lambda y: np.moveaxis(y, -1, -1 if axis is None else axis)  # noqa: E731
    else:
        a = (1 if axis is None else axis) % x_q.ndim
        rows = x_q.reshape(int(np.prod(x_q.shape[:a])), -1)
        back = lambda y: y.reshape(x_q.shape)  # noqa: E731
    table = [int(v) for v in kernel.exp_table]
    q = kernel.out_qparams.qmax
    out = np.empty(rows.shape, dtype=np.int64)
    for index in np.ndindex(rows.shape[:-1]):
        row = [int(v) for v in rows[index]]
        e = [table[max(row) - v] if max(row) - v < len(table) else 0 for v in row]
        total = sum(e)
        out[index] = [(ei * q) // total + (2 * ((ei * q) % total) >= total) for ei in e]
    return back(out)


@covers("Softmax", "LogSoftmax", "Hardmax", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset", [11, 12, 13])
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("shape", SHAPES)
def test_float_forward_matches_onnxruntime_at_each_opset(op_type, opset, axis, shape):
    x = np.random.default_rng(len(shape) * 7 + opset).normal(0, 2, shape).astype(np.float32)
    want = ort_single(op_type, {"x": x}, {} if axis is None else {"axis": axis}, opset=opset)[0]
    got = get_op(op_type).forward_float(_node(op_type, opset, axis), [x])[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@covers("Softmax", check=Check.INT_REFERENCE)
@covers("Softmax", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("opset", [11, 12, 13])
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("shape", SHAPES)
def test_integer_softmax_follows_the_opset(opset, axis, shape):
    rng = np.random.default_rng(len(shape) + opset)
    x_qp = random_qparams(rng, -4.0, 4.0, 8)
    x_q = random_codes(rng, x_qp, shape)
    node = _node("Softmax", opset, axis)
    q = get_op("Softmax").quantize(context(node, [x_qp], [None]))
    y = get_op("Softmax").forward_int(q, [x_q], runtime())[0]
    np.testing.assert_array_equal(y, _softmax_reference(x_q, q.kernel, opset, axis))
    want = ort_single("Softmax", {"x": x_qp.dequantize(x_q)}, {} if axis is None else {"axis": axis}, opset=opset)[0]
    assert np.max(np.abs(q.out_qparams[0].dequantize(y) - want)) <= 1.0 / 255 + 1e-6  # at most 1 LSB


@covers("LogSoftmax", "Hardmax", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("shape", SHAPES)
def test_integer_log_softmax_and_hardmax_follow_the_opset(opset, shape):
    rng = np.random.default_rng(3 * len(shape) + opset)
    x_qp = random_qparams(rng, -4.0, 4.0, 8)
    x_q = random_codes(rng, x_qp, shape)
    x = x_qp.dequantize(x_q)
    log_want = ort_single("LogSoftmax", {"x": x}, {}, opset=opset)[0]
    y_qp = random_qparams(rng, float(log_want.min()), 0.0, 8, symmetric=False)
    q = get_op("LogSoftmax").quantize(context(_node("LogSoftmax", opset, None), [x_qp], [y_qp]))
    y = get_op("LogSoftmax").forward_int(q, [x_q], runtime())[0]
    lo = y_qp.real_range()[0][0]
    assert np.max(np.abs(y_qp.dequantize(y) - np.clip(log_want, lo, 0))) <= 1.0 * y_qp.scale[0] + 1e-6

    hard_qp = random_qparams(rng, 0.0, 1.0, 8, symmetric=False)
    q = get_op("Hardmax").quantize(context(_node("Hardmax", opset, None), [x_qp], [hard_qp]))
    y = get_op("Hardmax").forward_int(q, [x_q], runtime())[0]
    np.testing.assert_array_equal(hard_qp.dequantize(y), ort_single("Hardmax", {"x": x}, {}, opset=opset)[0])


def _rows_of(x_q: np.ndarray, opset: int) -> np.ndarray:
    """The rows each semantics reduces over, default axis: the last axis (13+) or the 2-D coercion at 1."""
    return x_q.reshape(-1, x_q.shape[-1]) if opset >= 13 else x_q.reshape(x_q.shape[0], -1)


def _log_softmax_reference(x_q: np.ndarray, kernel, opset: int) -> np.ndarray:
    """lut.log_softmax's formula per row in Python integers: d_i = max - x_i, S = sum exp_table[d], log2 S from
    its leading one and the Q16 log2(1 + m) table (linear between nodes), y = zp - round((d*A + log2S*B) / 2^P)."""
    table, log2_table = [int(v) for v in kernel.exp_table], [int(v) for v in kernel.log2_table]
    oq = kernel.out_qparams
    zp, shift = int(oq.zero_point[0]), kernel.shift
    out = []
    for row in _rows_of(x_q, opset).tolist():
        d = [max(row) - v for v in row]
        total = sum(table[min(g, len(table) - 1)] for g in d)
        k = total.bit_length() - 1
        mantissa = ((total << 16) >> k) - (1 << 16)
        i, f = mantissa >> 8, mantissa & 255
        e0, e1 = log2_table[i], log2_table[min(i + 1, len(log2_table) - 1)]
        log2_sum = ((k - 20) << 16) + (((e0 << 8) + (e1 - e0) * f + 128) >> 8)
        out.append([min(max(zp - ((g * kernel.d_factor + log2_sum * kernel.log_factor + (1 << (shift - 1))) >> shift),
                            oq.qmin), oq.qmax) for g in d])
    return np.array(out, dtype=np.int64).reshape(x_q.shape)


@covers("LogSoftmax", "Hardmax", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 5)])
def test_integer_log_softmax_and_hardmax_equal_python_integer_references(opset, shape):
    rng = np.random.default_rng(5 * len(shape) + opset)
    x_qp = random_qparams(rng, -4.0, 4.0, 8)
    x_q = random_codes(rng, x_qp, shape)
    y_qp = random_qparams(rng, -12.0, 0.0, 8, symmetric=False)
    q = get_op("LogSoftmax").quantize(context(_node("LogSoftmax", opset, None), [x_qp], [y_qp]))
    y = get_op("LogSoftmax").forward_int(q, [x_q], runtime())[0]
    np.testing.assert_array_equal(y, _log_softmax_reference(x_q, q.kernel, opset))

    hard_qp = random_qparams(rng, 0.0, 1.0, 8, symmetric=False)
    q = get_op("Hardmax").quantize(context(_node("Hardmax", opset, None), [x_qp], [hard_qp]))
    y = get_op("Hardmax").forward_int(q, [x_q], runtime())[0]
    zero, one = (int(c) for c in hard_qp.quantize(np.array([0.0, 1.0])))
    want = []
    for row in _rows_of(x_q, opset).tolist():  # the first maximum of the codes, as Python lists
        first = row.index(max(row))
        want.append([one if j == first else zero for j in range(len(row))])
    np.testing.assert_array_equal(y, np.array(want).reshape(shape))


@covers("Softmax", check=Check.INT_REFERENCE)
@covers("Softmax", "LogSoftmax", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("opset, axis, shape", [(11, 1, (1, 8, 32, 32)), (11, 2, (1, 3, 18710)), (13, -1, (2, 65536))])
def test_long_rows_follow_the_widened_table(opset, axis, shape):
    # rows past 4096 terms (issue 24): an opset-11 Softmax(axis=1) on a (1, 8, 32, 32) map (one row of 8192),
    # an OCR head over 18,710 classes, 65,536 terms; the row length comes from the static shape at prepare
    rng = np.random.default_rng(shape[-1])
    x = rng.normal(-6.0, 2.0, shape)
    x.reshape(-1, shape[-1])[:, rng.integers(0, shape[-1])] = 8.0  # a confident peak per last-axis row
    x_qp = compute_qparams(x.min(), x.max(), 8, symmetric=True)
    x_q = x_qp.quantize(x)
    node = _node("Softmax", opset, axis)
    ctx = context(node, [x_qp], [None])
    ctx.in_shapes = [shape]
    q = get_op("Softmax").quantize(ctx)
    n = int(np.prod(shape[axis:])) if opset < 13 else shape[axis]
    one_bits = (n - 1).bit_length() + 8  # E = ceil(log2 n) + 8 (lut.softmax), recomputed here
    assert [t.one_bits for t in q.kernel.tables] == [one_bits]
    y = get_op("Softmax").forward_int(q, [x_q], runtime())[0]
    rows = x_q.astype(np.int64).reshape(int(np.prod(shape[:axis])), -1) if opset < 13 else x_q.astype(np.int64)
    want_int = np.empty(rows.shape, dtype=np.int64)
    s_x = float(x_qp.scale[0])
    for r, row in enumerate(rows):
        e = [int(v) for v in np.rint(np.exp(-(int(row.max()) - row) * s_x) * 2.0**one_bits)]
        total = sum(e)
        want_int[r] = [(ei * 255) // total + (2 * ((ei * 255) % total) >= total) for ei in e]
    np.testing.assert_array_equal(y.reshape(want_int.shape), want_int)
    want = ort_single("Softmax", {"x": x_qp.dequantize(x_q)}, {"axis": axis}, opset=opset)[0]
    bound = 0.5 + 255 * (n + 1) / 2.0 ** (one_bits + 1)  # lut.softmax's proven bound, < 1 LSB
    assert bound < 1 and np.max(np.abs(q.out_qparams[0].dequantize(y) - want)) <= bound / 255 + 1e-6

    log_want = ort_single("LogSoftmax", {"x": x_qp.dequantize(x_q)}, {"axis": axis}, opset=opset)[0]
    y_qp = compute_qparams(float(log_want.min()), 0.0, 8, symmetric=False)
    ctx = context(_node("LogSoftmax", opset, axis), [x_qp], [y_qp])
    ctx.in_shapes = [shape]
    q = get_op("LogSoftmax").quantize(ctx)
    y = get_op("LogSoftmax").forward_int(q, [x_q], runtime())[0]
    assert np.max(np.abs(y_qp.dequantize(y) - log_want)) <= 1.0 * y_qp.scale[0] + 1e-6
