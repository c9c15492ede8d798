"""lut.build_divider / lut.build_pow against the float formulas over every pair of 8-bit codes."""
from __future__ import annotations

import numpy as np
import pytest

from lut import build_divider, build_pow
from ptq.core.qparams import QParams, compute_qparams


def all_pairs(aq: QParams, bq: QParams):
    a, b = np.meshgrid(np.arange(aq.qmin, aq.qmax + 1), np.arange(bq.qmin, bq.qmax + 1), indexing="ij")
    af = (a - int(aq.zero_point[0])) * float(aq.scale[0])
    bf = (b - int(bq.zero_point[0])) * float(bq.scale[0])
    return a.astype(aq.dtype), b.astype(bq.dtype), af, bf


def quantize_ref(v: np.ndarray, q: QParams) -> np.ndarray:
    return np.clip(np.rint(v / float(q.scale[0])) + int(q.zero_point[0]), q.qmin, q.qmax)


DIV_CASES = [((-4, 4), (-2, 2), True), ((-4, 4), (0.5, 3), False), ((0, 6), (-3, 1), False)]


@pytest.mark.parametrize("a_range,b_range,symmetric", DIV_CASES)
def test_div_within_one_lsb(a_range, b_range, symmetric):
    aq = compute_qparams(*a_range, 8, symmetric=symmetric)
    bq = compute_qparams(*b_range, 8, symmetric=symmetric)
    a, b, af, bf = all_pairs(aq, bq)
    nonzero = bf != 0
    quotient = np.where(nonzero, af / np.where(nonzero, bf, 1.0), 0.0)
    lim = np.percentile(np.abs(quotient[nonzero]), 99)  # a calibrated range: saturation is part of the test
    oq = compute_qparams(-lim, lim, 8)
    div = build_divider(aq, bq, oq)
    y = div.forward(a, b)
    assert y.dtype == np.int8
    err = np.abs(y.astype(np.int64) - quantize_ref(quotient, oq))[nonzero]
    assert err.max() <= 1 and np.mean(err > 0) < 0.01
    assert div.reciprocal.report().half == (int(bq.zero_point[0]) == 0 and bq.signed)


def test_div_by_zero_saturates_with_the_sign_of_a():
    aq, bq, oq = QParams(0.05, 0, 8, True), QParams(0.02, 0, 8, True), QParams(0.1, 0, 8, True)
    div = build_divider(aq, bq, oq)
    y = div.forward(np.array([40, -40, 0], dtype=np.int8), np.zeros(3, dtype=np.int8))
    assert y.tolist() == [127, -128, 0]


def test_div_hand_example():
    # a = 1.0 (code 20 at scale 0.05), b = 0.5 (code 25 at scale 0.02): y = 2.0 -> code 20 at scale 0.1
    div = build_divider(QParams(0.05, 0, 8, True), QParams(0.02, 0, 8, True), QParams(0.1, 0, 8, True))
    assert div.forward(np.array([20], dtype=np.int8), np.array([25], dtype=np.int8)).tolist() == [20]
    assert div.forward(np.array([20], dtype=np.int8), np.array([-25], dtype=np.int8)).tolist() == [-20]


POW_CASES = [
    ("positive base, fractional exponent", compute_qparams(0, 4, 8, symmetric=False),
     compute_qparams(-2, 2, 8, symmetric=False)),
    ("signed base, integer exponent", compute_qparams(-3, 3, 8, symmetric=False), QParams(1.0, 0, 8, True)),
    ("small positive base", compute_qparams(0.1, 2, 8, symmetric=False), compute_qparams(0, 3, 8, symmetric=False)),
]


@pytest.mark.parametrize("label,xq,yq", POW_CASES, ids=[c[0] for c in POW_CASES])
def test_pow_within_one_lsb(label, xq, yq):
    x, y, xf, yf = all_pairs(xq, yq)
    keep = np.abs(yf) <= 3  # integer exponents: keep x^y within a calibratable range
    x, y, xf, yf = x[keep], y[keep], xf[keep], yf[keep]
    with np.errstate(all="ignore"):
        zf = np.power(xf, yf)
    finite = np.isfinite(zf)  # 0^negative is +inf (saturates, tested below)
    oq = compute_qparams(zf[finite].min(), zf[finite].max(), 8, symmetric=False)
    kernel = build_pow(xq, yq, oq)
    z = kernel.forward(x, y)
    assert z.dtype == oq.dtype
    err = np.abs(z.astype(np.int64)[finite] - quantize_ref(zf[finite], oq))
    assert err.max() <= 1 and np.mean(err > 0) < 0.01


def test_pow_zero_base_and_negative_base_rules():
    xq = QParams(0.05, 0, 8, True)
    oq = compute_qparams(-8, 8, 8)
    integer_exp = build_pow(xq, QParams(1.0, 0, 8, True), oq)
    # 0^2 = 0, 0^0 = 1, 0^-1 = +inf (saturates); (-1)^3 = -1, (-1)^2 = 1, 2^-1 = 0.5
    x = np.array([0, 0, 0, -20, -20, 40], dtype=np.int8)
    y = np.array([2, 0, -1, 3, 2, -1], dtype=np.int8)
    s = float(oq.scale[0])
    want = [0, round(1 / s), 127, round(-1 / s), round(1 / s), round(0.5 / s)]
    assert np.abs(integer_exp.forward(x, y).astype(np.int64) - want).max() <= 1
    assert integer_exp.forward(x, y)[:3].tolist() == want[:3]
    fractional_exp = build_pow(xq, QParams(0.25, 0, 8, True), oq)
    # a negative base with a fractional exponent scale gives 0 (float: NaN), whatever the exponent code
    z = fractional_exp.forward(np.array([-20, -20], dtype=np.int8), np.array([8, 6], dtype=np.int8))
    assert z.tolist() == [0, 0]


def test_wide_table_inputs_are_rejected():
    q16, q8 = QParams(0.001, 0, 16, True), QParams(0.05, 0, 8, True)
    with pytest.raises(ValueError, match="16 bits"):
        build_divider(q8, q16, q8)
    with pytest.raises(ValueError, match="16 bits"):
        build_pow(q16, q8, q8)
