"""lut.build_softmax: integer softmax against round((2^B - 1) * softmax(dequantized x)) in float64."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lut import build_log_softmax, build_softmax, softmax_out_qparams
from lut.softmax import INT32_ROW_LIMIT, MAX_ROW
from ptq.core.qparams import QParams, compute_qparams


def float_reference(q: np.ndarray, in_q: QParams, levels: int, axis: int = -1) -> np.ndarray:
    x = (q.astype(np.int64) - int(in_q.zero_point[0])) * float(in_q.scale[0])
    p = np.exp(x - x.max(axis=axis, keepdims=True))
    return np.rint(levels * p / p.sum(axis=axis, keepdims=True)).astype(np.int64)


def test_hand_computed_rows():
    # scale ln 2: exp_table = [2^20, 2^19, 2^18, ...]. Row codes [3, 2]: e = [2^20, 2^19], S = 3 * 2^19,
    # y = round(255 * 2/3) = 170 (remainder 2 of 3: rounds up), round(255/3) = 85.
    in_q = QParams(math.log(2), 0, 8, True)
    k = build_softmax(in_q)
    assert k.exp_table[:4].tolist() == [1 << 20, 1 << 19, 1 << 18, 1 << 17] and k.exp_table.dtype == np.int32
    assert k.exp_table[-1] == 0 and k.exp_table.size == 22  # 2^20 * 2^-21 = 0.5 rounds (half even) to 0
    np.testing.assert_array_equal(k.forward(np.array([[3, 2], [-128, -128]], dtype=np.int8)), [[170, 85], [128, 128]])
    assert k.forward(np.array([5, 5, 5], dtype=np.int8)).tolist() == [85, 85, 85]


def test_output_qparams():
    out = softmax_out_qparams(8)
    assert (out.bits, out.signed, int(out.zero_point[0])) == (8, False, 0)
    assert out.scale[0] == np.float32(1 / 255)
    assert build_softmax(QParams(0.1, 0, 8, True), out_bits=16).out_qparams.qmax == 65535


def test_random_logits_accuracy_and_row_sums():
    rng = np.random.default_rng(1234)
    total = within_one = 0
    worst = 0
    for n in (2, 3, 7, 64, 1000, 2047, 2048, 4096):
        for std in (0.3, 1.5, 4.0, 12.0):
            x = rng.normal(0.0, std, (6, n)) + rng.uniform(-5, 5, (6, 1))
            in_q = compute_qparams(x.min(), x.max(), 8, symmetric=bool(n % 2))
            q = in_q.quantize(x)
            k = build_softmax(in_q)
            y = k.forward(q)
            assert y.dtype == np.uint8 and y.shape == q.shape
            y = y.astype(np.int64)
            err = np.abs(y - float_reference(q, in_q, 255))
            total += err.size
            within_one += int(np.count_nonzero(err <= 1))
            worst = max(worst, int(err.max()))
            # Row sums: -n/2 < sum - 255 <= P/2 with P the number of nonzero outputs (see lut.softmax).
            dev = y.sum(axis=-1) - 255
            assert np.all(-n / 2 < dev) and np.all(dev <= np.count_nonzero(y, axis=-1) / 2)
    assert within_one / total >= 0.999 and worst <= 2


def test_sixteen_bit_input_and_output():
    rng = np.random.default_rng(7)
    x = rng.normal(0, 3, (4, 500))
    in_q = compute_qparams(x.min(), x.max(), 16)
    q = in_q.quantize(x)
    k = build_softmax(in_q, out_bits=16)
    assert k.exp_table.size < 65536  # cut after its first zero entry
    y = k.forward(q)
    assert y.dtype == np.uint16
    assert np.abs(y.astype(np.int64) - float_reference(q, in_q, 65535)).max() <= 2


def test_axis():
    rng = np.random.default_rng(3)
    in_q = QParams(0.1, 0, 8, True)
    q = rng.integers(-128, 128, (5, 9, 4)).astype(np.int8)
    y1 = build_softmax(in_q, axis=1).forward(q)
    y_last = build_softmax(in_q).forward(np.moveaxis(q, 1, -1))
    np.testing.assert_array_equal(y1, np.moveaxis(y_last, -1, 1))
    np.testing.assert_array_equal(y1.astype(np.int64), float_reference(q, in_q, 255, axis=1))


def test_accumulator_width_and_row_limit():
    k = build_softmax(QParams(0.05, 0, 8, True))
    assert INT32_ROW_LIMIT * (1 << 20) <= 2**31 - 1 < (INT32_ROW_LIMIT + 1) * (1 << 20)
    assert k.int32_accumulator(2047) and not k.int32_accumulator(2048)
    # worst case for the int64 path: 4096 equal elements, S = 2^32; each output round(255 / 4096) = 0
    y = k.forward(np.full((1, MAX_ROW), 7, dtype=np.int8))
    assert y.sum() == 0
    with pytest.raises(ValueError, match="4096"):
        k.forward(np.zeros((1, MAX_ROW + 1), dtype=np.int8))


def test_bad_inputs():
    k = build_softmax(QParams(0.05, 0, 8, True))
    with pytest.raises(TypeError):
        k.forward(np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="outside"):
        k.forward(np.array([300, 0]))
    with pytest.raises(ValueError, match="out_bits"):
        build_softmax(QParams(0.05, 0, 8, True), out_bits=20)
    with pytest.raises(ValueError, match="per-tensor"):
        build_softmax(QParams([0.1, 0.2], [0, 0], 8, True, axis=0))


def test_log_softmax_hand_example():
    # scale ln 2, row codes [3, 2]: S = 1.5 * 2^20, y_f = [-ln 1.5, -ln 2 - ln 1.5]; output scale 1/64:
    # codes round(-25.95) = -26 and round(-70.31) = -70.
    k = build_log_softmax(QParams(math.log(2), 0, 8, True), QParams(1 / 64, 0, 8, True))
    assert k.forward(np.array([3, 2], dtype=np.int8)).tolist() == [-26, -70]


def test_log_softmax_random_rows_within_one_lsb():
    rng = np.random.default_rng(99)
    for n in (2, 10, 1000, 4096):
        for std in (0.5, 3.0, 10.0):
            x = rng.normal(0.0, std, (4, n))
            in_q = compute_qparams(x.min(), x.max(), 8, symmetric=False)
            q = in_q.quantize(x)
            xf = (q.astype(np.int64) - int(in_q.zero_point[0])) * float(in_q.scale[0])
            shifted = xf - xf.max(axis=-1, keepdims=True)
            ls = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
            out_q = compute_qparams(ls.min(), 0, 8, symmetric=False)
            y = build_log_softmax(in_q, out_q).forward(q)
            assert y.dtype == out_q.dtype
            ref = np.clip(np.rint(ls / float(out_q.scale[0])) + int(out_q.zero_point[0]), out_q.qmin, out_q.qmax)
            err = np.abs(y.astype(np.int64) - ref)
            assert err.max() <= 1 and np.mean(err > 0) < 0.01
