"""lut.tune_input_range: flat tails cut where the whitepaper's notes put them, hand-derived cut points."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lut import FUNCTIONS, tune_input_range

GRID = 40 / 8192  # sample spacing of a [-20, 20] range


def test_sigmoid_cut_near_six():
    # 8-bit output over (0, 1): LSB 1/255; cut where 1 - sigmoid(x) = 1/510, i.e. e^-x = 1/509.
    lo, hi = tune_input_range("sigmoid", -20, 20)
    assert hi == pytest.approx(math.log(509), abs=GRID) and lo == pytest.approx(-math.log(509), abs=GRID)


def test_tanh_cut_near_three():
    # LSB 2/255; cut where 1 - tanh(x) = 1/255: 2 e^-2x / (1 + e^-2x) = 1/255 -> x = ln(509) / 2.
    lo, hi = tune_input_range("tanh", -20, 20)
    assert hi == pytest.approx(math.log(509) / 2, abs=GRID) and lo == pytest.approx(-hi, abs=1e-12)


def test_exp_keeps_its_top_and_cuts_the_flat_left_tail():
    # LSB e^2 / 255; cut where e^x = LSB / 2 -> x = 2 - ln(510); the steep right end stays.
    lo, hi = tune_input_range("exp", -20, 2)
    assert hi == 2.0 and lo == pytest.approx(2 - math.log(510), abs=22 / 8192)


def test_sixteen_bit_outputs_cut_further_out():
    lo8, hi8 = tune_input_range("sigmoid", -20, 20)
    lo16, hi16 = tune_input_range("sigmoid", -20, 20, out_bits=16)
    assert hi16 == pytest.approx(math.log(2 * 65535 - 1), abs=GRID) and hi16 > hi8


def test_sixteen_bit_exp_flat_tail_starts_near_minus_twelve():
    # LSB 1/65535 over [0, 1]; cut where e^x - e^-20 = 1/131070, so a 16-bit [-8, 0] range has no flat tail.
    lo, hi = tune_input_range("exp", -20, 0, out_bits=16)
    assert hi == 0 and lo == pytest.approx(math.log(1 / 131070 + math.exp(-20)), abs=20 / 8192)
    assert tune_input_range("exp", -8, 0, out_bits=16) == (-8, 0)


@pytest.mark.parametrize("name,rmin,rmax", [("elu", -20, 5), ("selu", -20, 5), ("softplus", -30, 5),
                                            ("bnll", -30, 5), ("sigmoid", -20, 20), ("hardswish", -10, 10)])
def test_clamping_to_the_tuned_range_costs_at_most_half_an_lsb(name, rmin, rmax):
    f = FUNCTIONS[name]
    lo, hi = tune_input_range(f, rmin, rmax)
    assert rmin < lo < hi <= rmax
    x = np.linspace(rmin, rmax, 100001)
    y = f(x)
    lsb = (max(y.max(), 0) - min(y.min(), 0)) / 255
    assert np.max(np.abs(f(np.clip(x, lo, hi)) - y)) <= 0.5 * lsb * 1.01  # 1 % for the sampling grid


@pytest.mark.parametrize("name,rmin,rmax", [("square", -3, 3), ("sin", -3, 3), ("log", 0, 10), ("sigmoid", -5, 5)])
def test_functions_without_flat_tails_keep_their_range(name, rmin, rmax):
    assert tune_input_range(name, rmin, rmax) == (rmin, rmax)


def test_bad_ranges_are_rejected():
    with pytest.raises(ValueError, match="rmin <= rmax"):
        tune_input_range("tanh", 1, -1)
    with pytest.raises(ValueError, match="rmin <= rmax"):
        tune_input_range("tanh", -np.inf, 1)
    assert tune_input_range("tanh", 2.0, 2.0) == (2.0, 2.0)
