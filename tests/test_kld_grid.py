"""KLD that knows its grid: an asymmetric grid is searched on the signed histogram against 2^bits levels."""
from __future__ import annotations

import numpy as np

from calibrators import calibrate_array, get_calibrator

KLD = get_calibrator("kld")
KLD_ASYM = KLD.for_grid(symmetric=False)


def grid_mse(x: np.ndarray, lo: float, hi: float, bits: int = 8) -> float:
    """Mean squared error of x on the asymmetric grid of 2^bits levels over [lo, hi] (independent numpy)."""
    scale = (hi - lo) / (2 ** bits - 1)
    zp = np.round(-lo / scale)
    q = np.clip(np.round(x / scale) + zp, 0, 2 ** bits - 1)
    return float(np.mean(((q - zp) * scale - x) ** 2))


def test_a_stray_negative_value_does_not_halve_the_levels():
    rng = np.random.default_rng(0)
    relu = np.maximum(rng.normal(0, 1, 10 ** 6), 0)
    stray = relu.copy()
    stray[0] = -1e-3
    unsigned = calibrate_array(KLD, relu, bits=8)
    np.testing.assert_array_equal(calibrate_array(KLD_ASYM, stray, bits=8)[1], unsigned[1])
    assert calibrate_array(KLD, stray, bits=8)[1][0] != unsigned[1][0]  # the |x| search at 128 levels


def test_asymmetric_search_beats_the_symmetric_one_on_an_asymmetric_grid():
    x = np.random.default_rng(1).normal(2, 1, 10 ** 6)
    old = calibrate_array(KLD, x, bits=8)
    new = calibrate_array(KLD_ASYM, x, bits=8)
    assert new[0][0] > old[0][0]  # the lower side is no longer mirrored from the upper one
    assert grid_mse(x, new[0][0], new[1][0]) < grid_mse(x, old[0][0], old[1][0])


def test_mirrored_data_gives_the_mirrored_range():
    x = np.random.default_rng(2).gamma(2.0, 1.0, 10 ** 6) - 0.5
    lo, hi = calibrate_array(KLD_ASYM, x, bits=8)
    mlo, mhi = calibrate_array(KLD_ASYM, -x, bits=8)
    width = 2.0 ** np.ceil(np.log2(np.max(np.abs(x)) / 4096))
    assert abs(mhi[0] + lo[0]) <= 2 * width and abs(mlo[0] + hi[0]) <= 2 * width


def test_sixteen_bits_keep_the_observed_range():
    x = np.random.default_rng(3).normal(1, 1, 10 ** 5)
    lo, hi = calibrate_array(KLD_ASYM, x, bits=16)
    assert (lo[0], hi[0]) == (x.min(), x.max())


def test_other_calibrators_ignore_the_grid():
    assert get_calibrator("extrema").for_grid(False) == get_calibrator("extrema")
