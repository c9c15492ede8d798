import numpy as np
import pytest

from ptq.core.qparams import QParams, compute_qparams
from reports.grid import grid_bounds
from reports.metrics import ClipAccumulator
from reports.value_histogram import MARGIN, ValueHistogram, inner_bins


def _reference_counts(x, low, high, inner, margin):
    """np.histogram over edges built here, plus the values beyond them (random data: no value on an edge)."""
    w = (high - low) / inner
    edges = np.concatenate([low + w * np.arange(-margin, inner), high + w * np.arange(0, margin + 1)])
    x = np.asarray(x, dtype=np.float64)
    finite, _ = np.histogram(x, bins=edges)
    return np.concatenate([[np.sum(x < edges[0])], finite, [np.sum(x >= edges[-1])]])


@pytest.mark.parametrize("codes, bins", [(256, 64), (255, 51), (65536, 64), (16, 16), (15, 15), (127, 64)])
def test_inner_bins_hold_whole_codes_when_a_divisor_allows(codes, bins):
    assert inner_bins(codes) == bins


def test_counts_equal_numpy_histogram_over_the_grid_and_its_margins():
    rng = np.random.default_rng(0)
    qp = compute_qparams(-1.5, 2.0, 8)
    x = (rng.standard_t(3, size=(7, 5000)) * 0.9).astype(np.float32)  # heavy tails: every kind of bin is hit
    h = ValueHistogram.for_grid(qp)
    for row in x:
        h.update(row)
    lo, hi = qp.real_range()
    low, high = lo[0] - qp.scale[0] / 2, hi[0] + qp.scale[0] / 2
    assert (h.low, h.high, h.inner, h.margin, h.steps_per_bin) == (low, high, 64, MARGIN, 4.0)
    expected = _reference_counts(x, low, high, 64, MARGIN)
    assert h.counts[0] > 0 and h.counts[-1] > 0 and h.counts[1] > 0 and h.counts[-2] > 0
    np.testing.assert_array_equal(h.counts, expected)
    assert h.total == x.size
    assert (h.min, h.max) == (float(x.min()), float(x.max()))
    np.testing.assert_allclose(h.edges()[MARGIN:MARGIN + 65], low + 4 * qp.scale[0] * np.arange(65))


def test_values_on_the_grid_bounds_are_clipped_exactly_as_clip_accumulator_counts():
    qp = QParams(scale=np.array([2.0 ** -4]), zero_point=np.array([3]), bits=8, signed=True)
    low, high = (float(b) for b in grid_bounds(qp, 0))
    assert np.float32(low) == low and np.float32(high) == high  # the bounds are float32 values here
    at = np.array([low, high], dtype=np.float32)
    just_out = np.array([np.nextafter(np.float32(low), np.float32(-np.inf)),
                         np.nextafter(np.float32(high), np.float32(np.inf))])
    x = np.concatenate([at, just_out, np.float32([0.0, 1.0])])
    h = ValueHistogram.for_grid(qp)
    h.update(x)
    clip = ClipAccumulator()
    clip.update(x, low, high)
    assert (h.below, h.above) == (1, 1) == (clip.clipped // 2, clip.clipped // 2)
    first, last = 1 + h.margin, h.margin + h.inner  # the first and last inner bins hold low and high
    assert h.counts[first] == 1 and h.counts[last] == 1
    assert h.counts[first - 1] == 1 and h.counts[last + 1] == 1  # just outside: the margin bins next to them


def test_bounds_between_two_float32_values_are_compared_in_float64():
    """low and high are not float32 values: rounding them to float32 would move -1.0 and 1.0 inside."""
    low, high = -1.0 + 1e-9, 1.0 - 1e-9
    x = np.float32([-1.0, 1.0, 0.5])
    h = ValueHistogram(low=low, high=high, inner=8, steps_per_bin=1.0)
    h.update(x)
    clip = ClipAccumulator()
    clip.update(x, np.asarray(low), np.asarray(high))  # as the report passes them: float64 arrays
    assert (h.below, h.above, clip.clipped) == (1, 1, 2)


def test_nan_is_refused_and_other_dtypes_are_read_as_float64():
    h = ValueHistogram(low=-1.0, high=1.0, inner=4, steps_per_bin=1.0)
    with pytest.raises(ValueError, match="1 NaN"):
        h.update(np.float32([0.0, np.nan]))
    h = ValueHistogram(low=-1.0, high=1.0, inner=4, steps_per_bin=1.0)
    h.update(np.array([[-3, 0], [1, 2]], dtype=np.int8))
    assert (h.below, h.above, h.min, h.max, h.total) == (1, 1, -3.0, 2.0, 4)


def test_shards_in_any_order_merge_into_the_one_pass_histogram():
    rng = np.random.default_rng(1)
    qp = compute_qparams(-0.2, 6.0, 8, signed=False)
    batches = [rng.normal(2.0, 2.5, size=1000 + 37 * k).astype(np.float32) for k in range(6)]
    whole = ValueHistogram.for_grid(qp)
    for b in batches:
        whole.update(b)
    parts = []
    for shard in ([4, 0], [5, 2, 1], [3]):
        h = ValueHistogram.for_grid(qp)
        for k in shard:
            h.update(batches[k])
        parts.append(h)
    merged = parts[2].merge(parts[0]).merge(parts[1])
    np.testing.assert_array_equal(merged.counts, whole.counts)
    assert (merged.min, merged.max) == (whole.min, whole.max)
    np.testing.assert_array_equal(parts[0].counts + parts[1].counts + parts[2].counts, whole.counts)
    with pytest.raises(ValueError, match="cannot merge"):
        whole.merge(ValueHistogram.for_grid(compute_qparams(-0.2, 6.5, 8, signed=False)))


def test_per_channel_grid_bins_over_the_union_of_the_channels():
    qp = QParams(scale=np.array([0.01, 0.05]), zero_point=np.array([0, 10]), bits=8, axis=1)
    h = ValueHistogram.for_grid(qp, ndim=4)
    lo, hi = qp.real_range()
    assert h.low == pytest.approx(min(lo - qp.scale / 2)) and h.high == pytest.approx(max(hi + qp.scale / 2))
    assert h.inner == 64


def test_dict_lists_every_count_and_the_tails():
    h = ValueHistogram.for_grid(compute_qparams(-1.0, 1.0, 4))
    h.update(np.float32([-3.0, 0.1, 0.2, 5.0]))
    d = h.to_dict()
    assert d["inner_bins"] == 16 and d["steps_per_bin"] == 1.0
    assert len(d["counts"]) == 16 + 2 * MARGIN + 2 and sum(d["counts"]) == 4
    assert (d["below"], d["above"], d["min"], d["max"]) == (1, 1, -3.0, 5.0)
    assert ValueHistogram.for_grid(compute_qparams(-1.0, 1.0, 4)).to_dict()["min"] is None
