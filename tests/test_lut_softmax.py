"""lut.build_softmax: integer softmax against round((2^B - 1) * softmax(dequantized x)) in float64."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lut import build_log_softmax, build_softmax, softmax_out_qparams
from lut.softmax import INT32_ROW_LIMIT, MAX_ROW, WHITEPAPER_ROW
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
    y = k.forward(np.full((1, WHITEPAPER_ROW), 7, dtype=np.int8))
    assert y.sum() == 0 and k.table_for(WHITEPAPER_ROW).one_bits == 20
    # a kernel built for a known row length refuses a longer row; a row past MAX_ROW is refused when built
    with pytest.raises(ValueError, match="limited to 4096 terms, got 4097"):
        build_softmax(QParams(0.05, 0, 8, True), row_length=4000).forward(np.zeros((1, 4097), dtype=np.int8))
    with pytest.raises(ValueError, match="16777216 terms"):
        build_softmax(QParams(0.05, 0, 8, True), row_length=MAX_ROW + 1)


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


# ------------------------------------------------------------------ rows longer than the whitepaper's 4096
# OCR heads have 6k-19k classes. The table's exp(0) grows to 2^E, E = ceil(log2 n) + 8, with an int64 sum
# (lut.softmax): checked against a Python-integer reference of that formula (exact) and against the float
# softmax within the proven bound 0.5 + Q (n + 1) / 2^(E+1) LSB (< 1 LSB at 8 bits).

SEA_SCALE = math.log(2**20 / 0.45) / 100  # a gap of 100 codes: 2^20 * exp(-gap * s) = 0.45, rounded to 0


def _long_rows(n: int, rows: int, seed: int) -> tuple[np.ndarray, QParams]:
    """Codes of a confident classifier: one peak per row over a sea of logits 100 to 103 codes below it, whose
    exps are 0.45 to 0.29 of a 2^20 table's LSB (the case where that table rounds away the sea's mass)."""
    rng = np.random.default_rng(seed)
    peak = rng.integers(120, 128, (rows, 1))
    q = peak - rng.integers(100, 104, (rows, n))
    q[np.arange(rows), rng.integers(0, n, rows)] = peak[:, 0]
    return q.astype(np.int8), QParams(SEA_SCALE, 0, 8, True)


def _reference(q: np.ndarray, in_q: QParams, one_bits: int, levels: int) -> np.ndarray:
    """round(Q * e_i / S) per row in Python integers, e_i = round(2^E * exp(-d_i * s_x)) (half even)."""
    out = np.zeros(q.shape, dtype=np.int64)
    for r, row in enumerate(q.astype(np.int64)):
        gaps = int(row.max()) - row
        e = [int(v) for v in np.rint(np.exp(-gaps * float(in_q.scale[0])) * 2.0**one_bits)]
        total = sum(e)
        for j, ej in enumerate(e):
            quotient, remainder = divmod(ej * levels, total)
            out[r, j] = quotient + (2 * remainder >= total)
    return out


@pytest.mark.parametrize("n, one_bits", [(8192, 21), (18710, 23), (65536, 24)])
def test_long_rows_exact_and_within_the_bound(n, one_bits):
    q, in_q = _long_rows(n, 3, n)
    k = build_softmax(in_q, row_length=n)
    assert [(t.one_bits, t.max_row) for t in k.tables] == [(one_bits, 1 << (one_bits - 8))]
    assert not k.int32_accumulator(n)
    y = k.forward(q).astype(np.int64)
    np.testing.assert_array_equal(y, _reference(q, in_q, one_bits, 255))
    bound = 0.5 + 255 * (n + 1) / 2.0 ** (one_bits + 1)
    assert bound < 1.0
    assert np.abs(y - float_reference(q, in_q, 255)).max() <= bound
    # the whitepaper's 2^20 table on the same rows loses the sea's mass (0.4 n of 2^20): past ~10k terms the
    # peak is off by more than 1 LSB (why the table grows with the row rather than only the sum widening)
    err_2_20 = np.abs(_reference(q, in_q, 20, 255) - float_reference(q, in_q, 255)).max()
    assert err_2_20 > 1 if n > 10000 else err_2_20 <= 1


def test_unknown_row_length_carries_both_tables():
    k = build_softmax(QParams(0.1, 0, 8, True))
    assert [(t.one_bits, t.max_row) for t in k.tables] == [(20, 4096), (32, MAX_ROW)]
    assert k.tables[1].values.dtype == np.int64 and int(k.tables[1].values[0]) == 1 << 32
    q, in_q = _long_rows(5000, 2, 5)
    y = build_softmax(in_q).forward(q).astype(np.int64)
    np.testing.assert_array_equal(y, _reference(q, in_q, 32, 255))
    assert np.abs(y - float_reference(q, in_q, 255)).max() <= 1


@pytest.mark.parametrize("n", [18710, 65536])
def test_log_softmax_long_rows_within_one_lsb(n):
    q, in_q = _long_rows(n, 2, n + 1)
    xf = (q.astype(np.int64) - int(in_q.zero_point[0])) * float(in_q.scale[0])
    shifted = xf - xf.max(axis=-1, keepdims=True)
    ls = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    out_q = compute_qparams(ls.min(), 0, 8, symmetric=False)
    k = build_log_softmax(in_q, out_q, row_length=n)
    assert k.tables[0].one_bits == (n - 1).bit_length() + 8
    y = k.forward(q).astype(np.int64)
    ref = np.clip(np.rint(ls / float(out_q.scale[0])) + int(out_q.zero_point[0]), out_q.qmin, out_q.qmax)
    assert np.abs(y - ref).max() <= 1
