"""Streaming collectors: exact merges, chunking/order invariance, per-channel = per-tensor, bad input."""
import pickle

import numpy as np
import pytest

from calibrators import Stat, TensorStatistics
from calibrators.collectors import as_channels
from calibrators.histogram import DEFAULT_BINS, HistogramCollector

ALL = frozenset(Stat)


def reference_histogram(x: np.ndarray, width: float, num_bins: int) -> np.ndarray:
    """(2, B) counts from np.histogram: row 0 for x >= 0 over [j w, (j+1) w), row 1 for |x| of x < 0."""
    edges = np.arange(num_bins + 1) * width
    pos, _ = np.histogram(x[x >= 0], bins=edges)
    neg, _ = np.histogram(-x[x < 0], bins=edges)
    return np.stack([pos, neg])


def reference_width(amax: float, num_bins: int) -> float:
    """The smallest power of two w with amax < num_bins * w (found by walking powers of two)."""
    w = 2.0**-1074
    while amax >= num_bins * w:
        w *= 2.0
    return w


def fold(batches, axis=None, num_bins=DEFAULT_BINS) -> TensorStatistics:
    stats = TensorStatistics(ALL, axis=axis, num_bins=num_bins)
    for b in batches:
        stats.update(b)
    return stats


def assert_same(a: TensorStatistics, b: TensorStatistics, moments_rtol=1e-12):
    np.testing.assert_array_equal(a.minmax.min, b.minmax.min)
    np.testing.assert_array_equal(a.minmax.max, b.minmax.max)
    np.testing.assert_array_equal(a.moments.count, b.moments.count)
    np.testing.assert_allclose(a.moments.mean, b.moments.mean, rtol=moments_rtol, atol=1e-15)
    np.testing.assert_allclose(a.moments.std, b.moments.std, rtol=moments_rtol)
    np.testing.assert_array_equal(a.histogram.exponent, b.histogram.exponent)
    np.testing.assert_array_equal(a.histogram.counts, b.histogram.counts)
    np.testing.assert_array_equal(a.histogram.zeros, b.histogram.zeros)


@pytest.fixture(scope="module")
def samples():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((40, 8, 16)) * 1.5 + 0.3
    x[3, 2, 5] = 0.0
    x[11, 0, 0] = 0.0
    return x


def test_values_match_numpy(samples):
    stats = fold([samples])
    assert stats.minmax.min[0] == samples.min() and stats.minmax.max[0] == samples.max()
    assert stats.moments.mean[0] == pytest.approx(samples.mean(), rel=1e-13)
    assert stats.moments.std[0] == pytest.approx(samples.std(), rel=1e-13)
    hist = stats.histogram
    w = reference_width(np.abs(samples).max(), DEFAULT_BINS)
    assert hist.width[0] == w
    np.testing.assert_array_equal(hist.counts[0], reference_histogram(samples.ravel(), w, DEFAULT_BINS))
    assert hist.zeros[0] == 2
    abs_reference, _ = np.histogram(np.abs(samples), np.arange(DEFAULT_BINS + 1) * w)
    np.testing.assert_array_equal(hist.abs_counts()[0], abs_reference)


def test_chunking_invariance_one_batch_vs_forty(samples):
    assert_same(fold([samples]), fold(list(samples)))


def test_order_invariance(samples):
    rng = np.random.default_rng(3)
    assert_same(fold(list(samples)), fold(list(samples[rng.permutation(40)])))


def test_merge_two_halves_equals_one_pass(samples):
    whole = fold(list(samples))
    merged = fold(list(samples[:13])).merge(fold(list(samples[13:])))
    assert_same(whole, merged)
    # merging into an empty collector, and merging an empty one, change nothing
    assert_same(whole, TensorStatistics(ALL).merge(whole))
    assert_same(whole, fold(list(samples)).merge(TensorStatistics(ALL)))


def test_histogram_growth_is_exact_and_width_depends_only_on_global_max():
    rng = np.random.default_rng(11)
    small = rng.standard_normal(5000) * 1e-3
    big = rng.standard_normal(5000) * 50.0
    stats = fold([small, big, small * 3])
    x = np.concatenate([small, big, small * 3])
    w = reference_width(np.abs(x).max(), DEFAULT_BINS)
    assert stats.histogram.width[0] == w
    assert np.abs(x).max() / w > DEFAULT_BINS // 2  # more than half the bins are in use
    np.testing.assert_array_equal(stats.histogram.counts[0], reference_histogram(x, w, DEFAULT_BINS))
    np.testing.assert_array_equal(stats.histogram.counts, fold([x]).histogram.counts)


def test_outlier_in_first_batch_survives():
    rng = np.random.default_rng(5)
    first = rng.standard_normal(1000)
    first[17] = -250.0
    rest = [rng.standard_normal(1000) for _ in range(30)]
    stats = fold([first] + rest)
    hist = stats.histogram
    w = hist.width[0]
    assert stats.minmax.min[0] == -250.0
    assert hist.counts[0, 1, int(250.0 // w)] == 1
    assert hist.counts[0, 1, int(250.0 // w) + 1 :].sum() == 0
    assert hist.total[0] == 31000
    assert hist.occupied_bins()[0] == int(250.0 // w) + 1


def test_all_zero_start_then_values():
    x = np.concatenate([np.zeros(100), np.linspace(-3, 2, 501)])
    stats = fold([np.zeros(100), np.linspace(-3, 2, 501)])
    one = fold([x])
    assert_same(stats, one)
    assert stats.histogram.zeros[0] == 101
    zeros_only = fold([np.zeros(10)])
    assert zeros_only.histogram.width[0] == 0.0 and zeros_only.histogram.counts[0, 0, 0] == 10


def test_per_channel_equals_per_tensor_channel_by_channel(samples):
    per_channel = fold(list(samples), axis=0)  # each batch is one (8, 16) sample: channels first
    assert per_channel.channels == 8
    whole = fold([samples], axis=1)
    assert_same(per_channel, whole)
    for c in range(8):
        single = fold(list(samples[:, c, :]))
        assert per_channel.minmax.min[c] == single.minmax.min[0]
        assert per_channel.minmax.max[c] == single.minmax.max[0]
        assert per_channel.moments.mean[c] == pytest.approx(single.moments.mean[0], rel=1e-12)
        assert per_channel.moments.std[c] == pytest.approx(single.moments.std[0], rel=1e-12)
        assert per_channel.histogram.exponent[c] == single.histogram.exponent[0]
        np.testing.assert_array_equal(per_channel.histogram.counts[c], single.histogram.counts[0])
        mins, maxs = per_channel.batch_extrema.as_arrays()
        np.testing.assert_array_equal(mins[:, c], samples[:, c, :].min(axis=1))
        np.testing.assert_array_equal(maxs[:, c], samples[:, c, :].max(axis=1))


def test_per_channel_histogram_widths_differ_per_channel():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3000)) * np.array([[1e-2], [1.0], [30.0], [0.0]])
    hist = fold([x], axis=0).histogram
    for c in range(3):
        assert hist.width[c] == reference_width(np.abs(x[c]).max(), DEFAULT_BINS)
        np.testing.assert_array_equal(hist.counts[c], reference_histogram(x[c], hist.width[c], DEFAULT_BINS))
    assert hist.width[3] == 0.0 and hist.zeros[3] == 3000


def test_negative_axis_and_moments_merge_against_numpy():
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((6, 5, 4)) + 1e6, rng.standard_normal((9, 5, 4)) * 3 + 1e6
    merged = fold([a], axis=-2).merge(fold([b], axis=-2))
    full = np.concatenate([a, b])
    np.testing.assert_allclose(merged.moments.mean, full.mean(axis=(0, 2)), rtol=1e-14)
    np.testing.assert_allclose(merged.moments.std, full.std(axis=(0, 2)), rtol=1e-9)


def test_batch_extrema_record_each_batch_and_merge_appends(samples):
    stats = fold(list(samples[:3])).merge(fold(list(samples[3:5])))
    mins, maxs = stats.batch_extrema.as_arrays()
    np.testing.assert_array_equal(mins[:, 0], samples[:5].min(axis=(1, 2)))
    np.testing.assert_array_equal(maxs[:, 0], samples[:5].max(axis=(1, 2)))


@pytest.mark.parametrize(
    "bad, word", [(np.nan, "NaN"), (np.inf, r"\+Inf"), (-np.inf, "-Inf")]
)
def test_non_finite_values_raise(bad, word):
    x = np.ones((2, 3))
    x[1, 2] = bad
    with pytest.raises(ValueError, match=f"1 {word}"):
        TensorStatistics(ALL).update(x)
    with pytest.raises(ValueError, match="non-finite"):
        TensorStatistics(ALL, axis=1).update(x)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="empty"):
        as_channels(np.zeros((0, 3)))
    with pytest.raises(ValueError, match="axis 2 out of range"):
        as_channels(np.zeros((2, 3)), axis=2)
    with pytest.raises(ValueError, match="real numbers"):
        as_channels(np.zeros(3, dtype=complex))
    stats = TensorStatistics(ALL, axis=0)
    stats.update(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="channel count changed from 3 to 4"):
        stats.update(np.zeros((4, 4)))
    with pytest.raises(ValueError, match="incompatible"):
        TensorStatistics(ALL).merge(TensorStatistics({Stat.MOMENTS}))
    with pytest.raises(ValueError, match="power of two"):
        HistogramCollector(1000)


def test_integer_batches_are_accepted():
    stats = fold([np.arange(-5, 6, dtype=np.int8)])
    assert stats.minmax.min[0] == -5.0 and stats.moments.mean[0] == 0.0


def test_statistics_pickle_round_trip_and_merge(samples):
    """Shards computed in other processes travel pickled; the copy merges like the original."""
    shard = pickle.loads(pickle.dumps(fold(list(samples[20:]))))
    assert_same(fold(list(samples)), fold(list(samples[:20])).merge(shard))


def test_float32_batches_bin_exactly_like_float64():
    rng = np.random.default_rng(12)
    scales = np.array([[1e-40], [1e-30], [1.0], [1e30]])  # 1e-40: float32 subnormals
    x32 = (rng.standard_normal((4, 20_000)) * scales).astype(np.float32)
    x32[2, :50] = np.float32(2.0) ** -5 * np.arange(50)  # values on bin edges
    x64 = x32.astype(np.float64)
    a, b = fold([x32], axis=0), fold([x64], axis=0)
    assert_same(a, b)
    for c in range(4):
        w = reference_width(np.abs(x64[c]).max(), DEFAULT_BINS)
        np.testing.assert_array_equal(a.histogram.counts[c], reference_histogram(x64[c], w, DEFAULT_BINS))


@pytest.mark.parametrize("magnitude", [1e-310, 1e-300, 1e-200, 1e300])
def test_histogram_of_extreme_magnitudes_is_exact(magnitude):
    x = np.random.default_rng(1).standard_normal(5000) * magnitude
    x[0] = 0.0
    hist = fold([x]).histogram
    w = reference_width(np.abs(x).max(), DEFAULT_BINS)
    assert hist.width[0] == w
    np.testing.assert_array_equal(hist.counts[0], reference_histogram(x, w, DEFAULT_BINS))


def test_shards_merged_in_order_equal_one_pass_bit_for_bit():
    """Every collector of 3 shards merged in shard order equals one pass over the same batches exactly
    (moments included: their batch triples are folded left to right whichever way they were grouped)."""
    rng = np.random.default_rng(7)
    batches = [rng.standard_normal((4, 3, 5)).astype(np.float32) * (1 + k) + k for k in range(9)]
    one = fold(batches, axis=1)
    shards = [fold(batches[:2], axis=1), fold(batches[2:7], axis=1), fold(batches[7:], axis=1)]
    merged = shards[0]
    for shard in shards[1:]:
        merged.merge(pickle.loads(pickle.dumps(shard)))  # as a worker process would send it
    for read in (lambda s: s.minmax.min, lambda s: s.minmax.max, lambda s: s.moments.count,
                 lambda s: s.moments.mean, lambda s: s.moments.m2, lambda s: s.batch_extrema.as_arrays()[0],
                 lambda s: s.batch_extrema.as_arrays()[1], lambda s: s.histogram.counts,
                 lambda s: s.histogram.exponent):
        assert read(merged).tobytes() == read(one).tobytes()
