import numpy as np
import pytest

from ptq.core.requant import multiplier_value, quantize_multiplier, requantize, saturate_int32


def test_multiplier_relative_error_bound():
    rng = np.random.default_rng(0)
    r = np.exp(rng.uniform(np.log(2.0 ** -16), np.log(2.0 ** 13), 20000))
    m, n = quantize_multiplier(r)
    assert np.all(m < 2 ** 15) and np.all((n >= 0) & (n <= 31))
    assert np.all(m >= 2 ** 14)  # full precision in this range
    rel = np.abs(multiplier_value(m, n) - r) / r
    assert rel.max() <= 2.0 ** -15


@pytest.mark.parametrize("mbits", [8, 15, 24])
def test_multiplier_width(mbits):
    m, n = quantize_multiplier([0.001, 0.37, 3.0], mbits=mbits)
    assert np.all(m < 2 ** mbits)
    # rounding M costs at most half a unit of M
    assert np.all(np.abs(multiplier_value(m, n) / [0.001, 0.37, 3.0] - 1) <= 0.5 / m)


def test_multiplier_rejects_bad_factors():
    for r in (0.0, -1.0, np.inf, 2.0 ** 20):
        with pytest.raises(ValueError):
            quantize_multiplier(r)


def test_requantize_matches_int64_formula_and_rounds_half_up():
    rng = np.random.default_rng(1)
    acc = rng.integers(-(2 ** 24), 2 ** 24, 5000)
    m, n = quantize_multiplier(0.0123)
    expected = np.clip(((acc * int(m[0]) + (1 << (int(n[0]) - 1))) >> int(n[0])) + 3, -128, 127)
    assert np.array_equal(requantize(acc, m, n, 3, -128, 127), expected)
    # M/2^N = 1/2: -3 * 0.5 = -1.5 rounds half up to -1, 3 * 0.5 = 1.5 to 2
    assert list(requantize(np.array([-3, 3]), 1, 1, 0, -128, 127)) == [-1, 2]


def test_requantize_per_channel_axis():
    acc = np.arange(24).reshape(2, 3, 4) * 100
    m, n = quantize_multiplier([0.5, 0.25, 0.125])
    out = requantize(acc, m, n, [0, 1, 2], 0, 255, axis=1)
    for c in range(3):
        ref = requantize(acc[:, c], m[c], n[c], c, 0, 255)
        assert np.array_equal(out[:, c], ref)


def test_requantize_error_within_half_lsb_plus_multiplier_error():
    rng = np.random.default_rng(2)
    acc = rng.integers(-(2 ** 20), 2 ** 20, 10000)
    r = 0.0003721
    m, n = quantize_multiplier(r)
    y = requantize(acc, m, n, 0, -(2 ** 31), 2 ** 31 - 1)
    bound = 0.5 + np.abs(acc).max() * r * 2.0 ** -15
    assert np.abs(y - acc * r).max() <= bound


def test_saturate_int32_counts_overflow():
    acc, n = saturate_int32(np.array([2 ** 31, -(2 ** 31) - 5, 7]))
    assert n == 2 and list(acc) == [2 ** 31 - 1, -(2 ** 31), 7]


@pytest.mark.parametrize("axis, offset_shape", [(None, None), (1, (1, 5, 1, 1)), (1, (2, 5, 3, 4)), (None, (4,))])
@pytest.mark.parametrize("acc_dtype", [np.int32, np.int64])
def test_requantize_folds_the_offset_exactly_and_leaves_acc_alone(axis, offset_shape, acc_dtype):
    """requantize(acc, offset=o) (o * M folded into the rounding constant) gives the integers of the int64
    formula on acc + o, for int32 and int64 accumulators, and does not modify acc."""
    rng = np.random.default_rng(7)
    wide = 1 << (30 if acc_dtype is np.int32 else 40)
    acc = rng.integers(-wide, wide, size=(2, 5, 3, 4)).astype(acc_dtype)
    acc[0, 0, 0, :2] = [-wide, wide - 1]
    size = 5 if axis is not None else 1
    m = rng.integers(1, 1 << 15, size=size)
    n = rng.integers(0, 32, size=size)
    offset = None if offset_shape is None else rng.integers(-(1 << 30), 1 << 30, size=offset_shape)
    zp = int(rng.integers(-100, 100))
    total = acc.astype(np.int64) + (0 if offset is None else offset)
    shape = (1, -1, 1, 1) if axis is not None else (-1,)
    mm, nn = m.reshape(shape), n.reshape(shape)
    want = np.clip(((total * mm + ((1 << nn) >> 1)) >> nn) + zp, -32768, 32767)
    before = acc.copy()
    got = requantize(acc, m, n, zp, -32768, 32767, axis=axis, dtype=np.int16, offset=offset)
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(acc, before)
