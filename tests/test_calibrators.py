"""Calibrators against hand computation and brute force on the raw samples."""
import warnings
from dataclasses import dataclass

import numpy as np
import pytest

from calibrators import (
    Calibrator,
    Stat,
    TensorStatistics,
    available_calibrators,
    calibrate_array,
    get_calibrator,
    register_calibrator,
    required_stats,
)
from calibrators.histogram import DEFAULT_BINS
from calibrators.registry import describe_calibrators
from calibrators.methods.kld import kld_sweep
from ptq.core.qparams import compute_qparams


def stats_of(batches, spec, axis=None, num_bins=DEFAULT_BINS) -> TensorStatistics:
    stats = TensorStatistics(get_calibrator(spec).needs, axis=axis, num_bins=num_bins)
    for b in batches:
        stats.update(b)
    return stats


def brute_force_mse(x: np.ndarray, thresholds, bits: int, signed: bool) -> np.ndarray:
    """Mean squared quantize/dequantize error of the samples for each threshold, on compute_qparams' grid."""
    out = []
    for t in thresholds:
        qp = compute_qparams(-t if signed else 0.0, t, bits, symmetric=True, signed=signed)
        out.append(np.mean((qp.dequantize(qp.quantize(x)).astype(np.float64) - x) ** 2))
    return np.array(out)


def loop_kl(h: np.ndarray, i: int, levels: int) -> float:
    """TensorRT's KL(P || Q) for candidate i, written as the slides' loops (h already zero-spike-fixed)."""
    p = h[:i].astype(np.float64)
    p[-1] += h[i:].sum()
    m = i // levels
    q = np.zeros(i)
    for g in range(levels):
        start, stop = g * m, (i if g == levels - 1 else (g + 1) * m)
        nonzero = p[start:stop] != 0
        if nonzero.any():
            q[start:stop][nonzero] = h[start:stop].sum() / nonzero.sum()
    p, q = p / p.sum(), q / q.sum()
    keep = p > 0
    if np.any(q[keep] == 0):
        return np.inf
    return float(np.sum(p[keep] * np.log(p[keep] / q[keep])))


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(2024)


# ---------------------------------------------------------------- parsing and registry


def test_parse_names():
    assert get_calibrator("3std").n == 3.0
    assert get_calibrator("2.5std").n == 2.5
    assert get_calibrator("99.99percentile").percent == 99.99
    assert get_calibrator("0.9mean").momentum == 0.9
    assert get_calibrator("mean").momentum is None
    assert get_calibrator(" KLD ").name == "kld"
    for spelling in [
        "extrema", "mean", "0.9mean", "3std", "2.5std", "99.99percentile", "99.99999percentile", "kld", "mse", "auto"
    ]:
        assert get_calibrator(spelling).spelling == spelling
        assert get_calibrator(get_calibrator(spelling).spelling) == get_calibrator(spelling)
    assert [available_calibrators()[k].split()[0] for k in range(7)] == [
        "auto", "extrema", "kld", "mean", "mse", "percentile", "nstd"]


def test_names_a_person_types():
    """`nstd` and `percentile` alone take their defaults (3, 99.99); any case; `4std`, `99.9percentile`."""
    assert get_calibrator("nstd") == get_calibrator("3std") == get_calibrator("NStd") == get_calibrator("std")
    assert get_calibrator("4std").n == 4.0
    assert get_calibrator("percentile") == get_calibrator("99.99percentile") == get_calibrator("Percentile")
    assert get_calibrator("99.9percentile").percent == 99.9
    lines = describe_calibrators()
    assert len(lines) == len(available_calibrators()) and all(": " in line for line in lines)
    assert any(line.startswith("nstd") and "standard deviations" in line for line in lines)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("median", "unknown calibrator 'median'; available: auto, extrema, kld"),
        ("3kld", "takes no number"),
        ("-3std", "unknown calibrator"),
        ("0std", "positive"),
        ("150percentile", r"\(50, 100\]"),
        ("1.5mean", r"\(0, 1\)"),
    ],
)
def test_bad_names_raise(spec, message):
    with pytest.raises(ValueError, match=message):
        get_calibrator(spec)


def test_bad_options_and_bits_raise():
    with pytest.raises(ValueError, match="bad options"):
        get_calibrator("kld", levels=7)
    stats = stats_of([np.arange(5.0)], "extrema")
    with pytest.raises(ValueError, match="bits"):
        get_calibrator("extrema").compute(stats, bits=1)
    with pytest.raises(ValueError, match="'histogram' was not collected"):
        get_calibrator("kld").compute(stats)
    with pytest.raises(ValueError, match="no data"):
        get_calibrator("kld").compute(TensorStatistics({Stat.HISTOGRAM}))


def test_a_new_calibrator_is_one_decorated_class():
    @register_calibrator("test_midrange")
    @dataclass(frozen=True)
    class MidRange(Calibrator):
        needs = frozenset({Stat.MINMAX})

        def _compute(self, stats, bits, signed):
            mid = (stats.minmax.min + stats.minmax.max) / 2
            return mid - 1, mid + 1

    assert "test_midrange" in available_calibrators()
    rmin, rmax = calibrate_array("test_midrange", np.array([2.0, 6.0]))
    assert (rmin[0], rmax[0]) == (3.0, 5.0)


def test_required_stats_is_the_union():
    assert required_stats(["extrema", "3std", "kld", "mean"]) == frozenset(Stat)


# ---------------------------------------------------------------- extrema, mean, Nstd


def test_extrema_per_tensor_and_per_channel(rng):
    x = rng.standard_normal((4, 6, 10)) * np.arange(1, 7)[None, :, None]
    rmin, rmax = calibrate_array("extrema", x)
    assert (rmin[0], rmax[0]) == (x.min(), x.max())
    rmin, rmax = calibrate_array("extrema", x, axis=1)
    np.testing.assert_array_equal(rmin, x.min(axis=(0, 2)))
    np.testing.assert_array_equal(rmax, x.max(axis=(0, 2)))
    assert rmin.dtype == np.float64 and rmin.shape == (6,)


def test_mean_plain_and_momentum_by_hand():
    batches = [np.array([-1.0, 2.0]), np.array([-3.0, 4.0, 0.0]), np.array([-2.0, 9.0])]
    stats = stats_of(batches, "mean")
    rmin, rmax = get_calibrator("mean").compute(stats)
    assert rmin[0] == pytest.approx((-1 - 3 - 2) / 3) and rmax[0] == pytest.approx((2 + 4 + 9) / 3)
    # EMA r <- 0.5 r + 0.5 x, from r = x0: weights 0.25, 0.25, 0.5
    rmin, rmax = get_calibrator("0.5mean").compute(stats)
    assert rmin[0] == pytest.approx(0.25 * -1 + 0.25 * -3 + 0.5 * -2)
    assert rmax[0] == pytest.approx(0.25 * 2 + 0.25 * 4 + 0.5 * 9)
    # momentum 0.9 by iterating the EMA itself
    ema_min, ema_max = -1.0, 2.0
    for lo, hi in [(-3.0, 4.0), (-2.0, 9.0)]:
        ema_min, ema_max = 0.9 * ema_min + 0.1 * lo, 0.9 * ema_max + 0.1 * hi
    rmin, rmax = get_calibrator("0.9mean").compute(stats)
    assert rmin[0] == pytest.approx(ema_min) and rmax[0] == pytest.approx(ema_max)


def test_mean_per_channel(rng):
    batches = [rng.standard_normal((3, 50)) for _ in range(5)]
    rmin, rmax = get_calibrator("mean").compute(stats_of(batches, "mean", axis=0))
    np.testing.assert_allclose(rmin, np.mean([b.min(axis=1) for b in batches], axis=0), rtol=1e-14)
    np.testing.assert_allclose(rmax, np.mean([b.max(axis=1) for b in batches], axis=0), rtol=1e-14)


def test_nstd_against_numpy_and_clipped_to_observed(rng):
    x = rng.standard_normal(10_000) * 2 + 0.5
    rmin, rmax = calibrate_array("2.5std", x)
    assert rmin[0] == pytest.approx(x.mean() - 2.5 * x.std(), rel=1e-12)
    assert rmax[0] == pytest.approx(x.mean() + 2.5 * x.std(), rel=1e-12)
    u = rng.uniform(-1, 3, 1000)  # mean +- 3 std = 1 +- 3.46 lies outside [-1, 3]
    rmin, rmax = calibrate_array("3std", u)
    assert (rmin[0], rmax[0]) == (u.min(), u.max())
    y = rng.standard_normal((5, 400)) * np.arange(1, 6)[:, None]
    rmin, rmax = calibrate_array("1std", y, axis=0)
    np.testing.assert_allclose(rmin, y.mean(axis=1) - y.std(axis=1), rtol=1e-12)
    np.testing.assert_allclose(rmax, y.mean(axis=1) + y.std(axis=1), rtol=1e-12)


def test_streamed_and_merged_stats_calibrate_identically(rng):
    x = rng.laplace(size=(20, 500))
    for spec in ["extrema", "3std", "99.9percentile", "kld", "mse"]:
        one = get_calibrator(spec).compute(stats_of([x], spec))
        merged = stats_of(list(x[:7]), spec).merge(stats_of(list(x[7:]), spec))
        two = get_calibrator(spec).compute(merged)
        np.testing.assert_allclose(two, one, rtol=1e-12)


# ---------------------------------------------------------------- percentile


@pytest.mark.parametrize("dist", ["normal", "relu", "shifted_laplace"])
@pytest.mark.parametrize("percent", [90.0, 99.0, 99.9, 99.99])
def test_percentile_against_numpy(dist, percent):
    rng = np.random.default_rng(int(percent * 100))
    x = {
        "normal": rng.standard_normal(200_000),
        "relu": np.maximum(rng.standard_normal(200_000), 0),
        "shifted_laplace": rng.laplace(size=200_000) + 2,
    }[dist]
    stats = stats_of([x], f"{percent}percentile")
    w = stats.histogram.width[0]
    rmin, rmax = get_calibrator(f"{percent}percentile").compute(stats)
    sorted_x = np.sort(x)
    for got, q in [(rmin[0], 1 - percent / 100), (rmax[0], percent / 100)]:
        rank = int(np.ceil(q * x.size))  # the rank the histogram quantile lands on, up to one sample
        assert sorted_x[max(rank - 2, 0)] - w <= got <= sorted_x[min(rank, x.size - 1)] + w
        assert abs(got - np.percentile(x, 100 * q)) <= 3 * w


def test_percentile_100_is_extrema_and_per_channel(rng):
    x = rng.standard_normal((3, 5000)) * np.array([[0.1], [1.0], [10.0]])
    rmin, rmax = calibrate_array("100percentile", x, axis=0)
    np.testing.assert_array_equal(rmin, x.min(axis=1))
    np.testing.assert_array_equal(rmax, x.max(axis=1))
    stats = stats_of([x], "99percentile", axis=0)
    rmin, rmax = get_calibrator("99percentile").compute(stats)
    for c in range(3):
        w = stats.histogram.width[c]
        assert abs(rmin[c] - np.percentile(x[c], 1)) <= 3 * w
        assert abs(rmax[c] - np.percentile(x[c], 99)) <= 3 * w


# ---------------------------------------------------------------- mse


@pytest.mark.parametrize(
    "dist, bits", [("relu", 8), ("normal", 8), ("laplace", 8), ("normal", 4)]
)
def test_mse_against_brute_force_on_samples(dist, bits):
    rng = np.random.default_rng(bits)
    x = {
        "relu": np.maximum(rng.standard_normal(200_000), 0),
        "normal": rng.standard_normal(200_000),
        "laplace": rng.laplace(size=200_000),
    }[dist]
    signed = dist != "relu"
    stats = stats_of([x], "mse")
    rmin, rmax = get_calibrator("mse").compute(stats, bits=bits)
    t = rmax[0]
    assert rmin[0] == (max(-t, x.min()) if signed else 0.0)
    w = stats.histogram.width[0]
    grid = np.arange(1, stats.histogram.occupied_bins()[0] + 1) * w
    grid = grid[(grid > 0.8 * t) & (grid < 1.25 * t)][::2]
    errors = brute_force_mse(x, grid, bits, signed)
    best = grid[np.argmin(errors)]
    assert grid[0] < best < grid[-1]  # the brute-force optimum is inside the searched window
    assert brute_force_mse(x, [t], bits, signed)[0] <= 1.005 * errors.min()
    assert abs(t - best) <= 0.04 * best
    # a far-off threshold is clearly worse: the comparison has teeth
    assert brute_force_mse(x, [0.8 * t], bits, signed)[0] > 1.2 * errors.min()


# ---------------------------------------------------------------- kld


def test_kld_sweep_equals_the_slides_loops():
    rng = np.random.default_rng(1)
    h = np.round(rng.exponential(1.0, size=(3, 300)) * rng.integers(0, 2, size=(3, 300)) * 50).astype(np.int64)
    h[1, 250:] = 0
    h[1, 290] = 3  # an isolated outlier: candidates in the gap have Q = 0 where P > 0
    h[2, 40:] = 0
    for levels in (16, 7):
        chan, cand, kl = kld_sweep(h, levels, max_clipped=1.0)  # the slides, no clipping guard
        fixed = h.copy()
        fixed[:, 0] = fixed[:, 1]
        expected = np.array([loop_kl(fixed[c], i, levels) for c, i in zip(chan, cand)])
        assert np.isinf(expected).sum() > 0
        np.testing.assert_array_equal(np.isinf(kl), np.isinf(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(kl[finite], expected[finite], rtol=1e-9, atol=1e-12)
        for c in range(3):
            assert set(cand[chan == c]) == set(range(levels, np.nonzero(h[c])[0][-1] + 2))


@pytest.mark.parametrize("signed", [True, False])
def test_kld_threshold_is_the_loop_argmin_with_levels_from_bits_and_sign(signed):
    rng = np.random.default_rng(3)
    x = rng.laplace(size=50_000)
    x = x if signed else np.abs(x)
    bits, num_bins = 6, 256
    stats = stats_of([x], "kld", num_bins=num_bins)
    hist = stats.histogram
    w = hist.width[0]
    assert np.abs(x).max() < num_bins * w <= 2 * np.abs(x).max()  # smallest power of two that fits
    assert np.log2(w) == np.round(np.log2(w))
    h, _ = np.histogram(np.abs(x), bins=np.arange(num_bins + 1) * w)
    levels = 32 if signed else 64  # 2^(bits-1) signed, 2^bits unsigned
    fixed = h.copy()
    fixed[0] = fixed[1]
    last = np.nonzero(h)[0][-1] + 1
    kls = [loop_kl(fixed, i, levels) for i in range(levels, last + 1)]
    t = (levels + int(np.argmin(kls))) * w
    rmin, rmax = get_calibrator("kld").compute(stats, bits=bits)
    assert rmax[0] == pytest.approx(min(t, x.max()))
    assert rmin[0] == pytest.approx(max(-t, x.min()) if signed else 0.0)


def test_kld_relu_normal_near_mse_optimum_and_zero_spike_fix_matters():
    rng = np.random.default_rng(0)
    x = np.maximum(rng.standard_normal(1_000_000), 0)
    stats = stats_of([x], "kld")
    rmin, rmax = get_calibrator("kld").compute(stats, bits=8)
    assert rmin[0] == 0.0
    grid = np.arange(3.0, 5.5, 0.05)
    optimum = grid[np.argmin(brute_force_mse(x, grid, 8, signed=False))]
    assert 3.6 < optimum < 4.6
    assert abs(rmax[0] - optimum) <= 0.15 * optimum
    _, collapsed = get_calibrator("kld", zero_spike_fix=False).compute(stats, bits=8)
    assert collapsed[0] < 0.6 * optimum


def test_kld_laplace_clips_below_max_and_is_symmetric():
    rng = np.random.default_rng(4)
    x = rng.laplace(size=1_000_000)
    rmin, rmax = calibrate_array("kld", x)
    assert 4.0 < rmax[0] < 0.9 * x.max()
    assert rmin[0] == max(-rmax[0], x.min())


def test_kld_per_channel_equals_per_tensor_channel_by_channel(rng):
    x = rng.laplace(size=(4, 20_000)) * np.array([[0.5], [1.0], [2.0], [4.0]])
    x[3] = np.abs(x[3])  # one non-negative channel: the tensor as a whole is still signed
    rmin, rmax = calibrate_array("kld", x, axis=0)
    for c in range(4):
        single_min, single_max = calibrate_array("kld", x[c], signed=True)
        assert (rmin[c], rmax[c]) == (single_min[0], single_max[0])


def test_mse_per_channel_equals_per_tensor_channel_by_channel(rng):
    x = rng.standard_normal((3, 20_000)) * np.array([[0.5], [1.0], [3.0]])
    rmin, rmax = calibrate_array("mse", x, axis=0, bits=4)
    for c in range(3):
        single_min, single_max = calibrate_array("mse", x[c], bits=4)
        assert (rmin[c], rmax[c]) == (single_min[0], single_max[0])


@pytest.mark.parametrize("spec", ["extrema", "mean", "0.9mean", "3std", "99percentile", "kld", "mse"])
def test_degenerate_tensors_give_sane_ranges_without_warnings(spec):
    x = np.random.default_rng(8).standard_normal((3, 1000))
    x[1] = 0.0  # an all-zero channel
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rmin, rmax = calibrate_array(spec, x, axis=0)
        assert (rmin[1], rmax[1]) == (0.0, 0.0)
        assert np.all(rmin <= rmax) and np.all(rmin >= x.min(axis=1)) and np.all(rmax <= x.max(axis=1))
        for single in (np.array([5.0]), np.array([-2.0, -2.0]), np.zeros(4), np.array([0.0, 0.0, 1e-3, 7.0])):
            rmin, rmax = calibrate_array(spec, single)
            assert min(single.min(), 0.0) <= rmin[0] <= rmax[0] <= max(single.max(), 0.0)
