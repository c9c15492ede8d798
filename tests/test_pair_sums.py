"""`reports.pair_sums.compare`: the report's one-pass comparison of a float tensor with integer codes, checked
against float64/exact references and against the separate accumulators it replaces in the report loop."""
import math

import numpy as np
import pytest

from ptq.core.qparams import QParams, compute_qparams
from reports.grid import dequantize32, grid_bounds
from reports.metrics import ClipAccumulator
from reports.pair_sums import CHUNK, compare, from_order_key
from reports.value_histogram import ValueHistogram


def _exact(values) -> float:
    return math.fsum(np.asarray(values, dtype=np.float64).ravel())


def _tensor(rng, shape, qp):
    """A float tensor and its integer codes, a few values beyond the grid."""
    x = (rng.standard_t(4, size=shape) * 0.8 + 0.3).astype(np.float32)
    codes = qp.quantize(x + rng.normal(scale=0.02, size=shape))
    return x, codes


def test_sums_are_float64_exact_to_1e12_on_a_tensor_not_a_multiple_of_the_chunk():
    rng = np.random.default_rng(3)
    x = rng.normal(size=300_001).astype(np.float32)
    y = (x + rng.normal(scale=0.01, size=x.size)).astype(np.float32)
    sums, grid = compare(x, y)
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    d = (x - y).astype(np.float64)  # the difference rounded once in float32, as numpy computes it
    assert grid is None and sums.n == x.size
    assert sums.dot == pytest.approx(_exact(xd * yd), rel=1e-12)  # products of float32 values are exact in float64
    assert sums.xx == pytest.approx(_exact(xd * xd), rel=1e-12)
    assert sums.yy == pytest.approx(_exact(yd * yd), rel=1e-12)
    assert sums.se == pytest.approx(_exact(d * d), rel=1e-12)
    assert sums.max_err == float(np.abs(x - y).max())


@pytest.mark.parametrize("shape", [(1, 24, 56, 56), (2, 3, 7, 5), (1, 1000), (CHUNK + 3,)])
def test_codes_compared_in_one_pass_equal_the_separate_accumulators(shape):
    rng = np.random.default_rng(len(shape))
    qp = compute_qparams(-1.0, 2.5, 8, signed=False)
    x, codes = _tensor(rng, shape, qp)
    bounds = grid_bounds(qp, x.ndim)
    h = ValueHistogram.for_grid(qp, x.ndim)
    sums, grid = compare(x, codes, qp, histogram=h, grid=bounds)
    # the float path on the dequantized codes gives the same bits (the codes are dequantized as dequantize32 does)
    assert compare(x, dequantize32(qp, codes))[0] == sums
    reference = ValueHistogram.for_grid(qp, x.ndim)
    reference.update(x)
    np.testing.assert_array_equal(grid.counts, reference.counts)
    assert (grid.min, grid.max) == (reference.min, reference.max)
    clip = ClipAccumulator()
    clip.update(x, *bounds)
    assert grid.below + grid.above == clip.clipped > 0
    assert (grid.below, grid.above) == (reference.below, reference.above)
    y = qp.dequantize(codes).astype(np.float64)
    assert sums.dot == pytest.approx(_exact(x.astype(np.float64) * y), rel=1e-12)
    assert sums.max_err == float(np.abs(x - qp.dequantize(codes)).max())


def test_values_on_the_bin_edges_are_binned_as_the_histogram_bins_them():
    """Every inner bin edge (low and high included) among uniform values, one chunk holding a value beyond."""
    rng = np.random.default_rng(2)
    qp = compute_qparams(-1.0, 3.0, 8, signed=False)
    h = ValueHistogram.for_grid(qp)
    edges = h.edges()[h.margin:h.margin + h.inner + 1]
    x = rng.uniform(h.low, h.high, size=5 * CHUNK)
    x[:edges.size] = edges  # every inner edge, low and high included
    x[3 * CHUNK + 5] = h.high + 0.5
    x = x.astype(np.float32)
    _, grid = compare(x, x, histogram=h, grid=grid_bounds(qp, 1))
    h.update(x)
    np.testing.assert_array_equal(grid.counts, h.counts)


def test_channels_last_codes_give_the_same_bits_as_channels_first():
    """The compiled convolutions hand over channels-last views: the sums must not depend on the layout."""
    rng = np.random.default_rng(7)
    qp = compute_qparams(-0.5, 3.0, 8, signed=False)
    x, codes = _tensor(rng, (1, 40, 28, 28), qp)
    last = np.ascontiguousarray(codes.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    assert not last.flags.c_contiguous
    args = dict(histogram=ValueHistogram.for_grid(qp, 4), grid=grid_bounds(qp, 4))
    first_sums, first_grid = compare(x, codes, qp, **args)
    last_sums, last_grid = compare(x, last, qp, **args)
    assert first_sums == last_sums
    np.testing.assert_array_equal(first_grid.counts, last_grid.counts)


def test_folded_clamp_equals_comparing_the_clipped_tensor():
    rng = np.random.default_rng(11)
    qp = compute_qparams(0.0, 6.0, 8, signed=False)
    x = rng.normal(2.0, 3.0, size=(1, 8, 30, 30)).astype(np.float32)
    codes = qp.quantize(np.clip(x, 0.0, 6.0))
    span = (0.0, 6.0000001)  # a bound that is no float32 value: np.clip rounds it the same way
    args = dict(histogram=ValueHistogram.for_grid(qp, 4), grid=grid_bounds(qp, 4))
    clamped_sums, clamped_grid = compare(x, codes, qp, clamp=span, **args)
    clipped = np.clip(x, *span).astype(np.float32)
    sums, grid = compare(clipped, codes, qp, **args)
    assert clamped_sums == sums
    np.testing.assert_array_equal(clamped_grid.counts, grid.counts)
    assert clamped_grid.min == 0.0 and grid.below == 0


def test_per_channel_codes_are_dequantized_and_clip_counted_per_channel():
    rng = np.random.default_rng(5)
    qp = QParams(scale=np.array([0.01, 0.05, 0.02], dtype=np.float32), zero_point=np.array([0, 10, -3]), bits=8,
                 signed=True, axis=1)
    x = rng.normal(size=(2, 3, 9, 9)).astype(np.float32) * np.float32([0.5, 4.0, 1.0]).reshape(1, 3, 1, 1)
    codes = qp.quantize(x)
    bounds = grid_bounds(qp, 4)
    sums, grid = compare(x, codes, qp, histogram=ValueHistogram.for_grid(qp, 4), grid=bounds)
    y = qp.dequantize(codes)
    clip = ClipAccumulator()
    clip.update(x, *bounds)
    assert grid.below + grid.above == clip.clipped > 0
    assert sums.yy == pytest.approx(_exact(y.astype(np.float64) ** 2), rel=1e-12)
    assert sums.max_err == float(np.abs(x - y).max())


def test_float64_reference_against_float32_test_differs_in_float64():
    x = np.array([1.0 + 2.0 ** -40, 2.0, -3.0])
    y = np.float32([1.0, 2.0, -3.5])
    sums, _ = compare(x, y)
    assert sums.max_err == 0.5 and sums.se == 0.25 + 2.0 ** -80


def test_extremes_are_exact_and_order_keys_invert():
    for dtype in (np.float32, np.float64):
        values = np.array([-np.inf, -2.5, -0.0, 0.0, 1e-30, 3.0, np.inf], dtype=dtype)
        for v in values:
            assert from_order_key(_key(v), dtype) == v
        assert [_key(v) for v in values] == sorted(_key(v) for v in values)  # the keys order as the floats do
    x = np.float32([-0.0, 0.0, 2.0, -1.5])
    h = ValueHistogram(low=-1.0, high=1.0, inner=4, steps_per_bin=1.0)
    _, grid = compare(x, x, histogram=h, grid=(np.float64(-1.0), np.float64(1.0)))
    assert (grid.min, grid.max, grid.below, grid.above) == (-1.5, 2.0, 1, 1)


def _key(v) -> int:
    """The order key as the kernel computes it (a float's bits, negatives flipped), computed here in numpy."""
    itype = np.int32 if v.dtype == np.float32 else np.int64
    bits = int(np.array(v).view(itype))
    return bits ^ (np.iinfo(itype).max if bits < 0 else 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_are_refused(bad):
    x = np.float32([0.0, 1.0, bad])
    with pytest.raises(ValueError, match="finite"):
        compare(x, np.float32([0.0, 1.0, 2.0]))
    qp = compute_qparams(-1.0, 1.0, 8)
    with pytest.raises(ValueError, match="finite"):
        compare(x, qp.quantize(np.zeros(3)), qp, histogram=ValueHistogram.for_grid(qp), grid=grid_bounds(qp, 1))


def test_bad_arguments_raise():
    qp = compute_qparams(-1.0, 1.0, 8)
    with pytest.raises(ValueError, match="shape"):
        compare(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="qparams"):
        compare(np.zeros(3, np.float32), np.zeros(3, np.int8))
    with pytest.raises(ValueError, match="together"):
        compare(np.zeros(3, np.float32), np.zeros(3, np.int8), qp, histogram=ValueHistogram.for_grid(qp))
