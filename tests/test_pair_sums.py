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


def _edge_values(h: ValueHistogram, dtype) -> np.ndarray:
    """Every bin edge of `h` (margins, low, high, the underflow and overflow edges) with its neighbours in
    `dtype`, the edges as float64 computes them and as they round to `dtype`."""
    w = h.width
    edges = np.concatenate([h.low + w * np.arange(-h.margin - 1, h.inner + 1),
                            h.high + w * np.arange(-1, h.margin + 2), [h.low, h.high]])
    values = [edges.astype(dtype)]
    for _ in range(3):  # three neighbours on either side
        values.append(np.nextafter(values[-1], dtype(np.inf)))
    down = edges.astype(dtype)
    for _ in range(3):
        down = np.nextafter(down, dtype(-np.inf))
        values.append(down)
    return np.concatenate(values)


def _histogram(grid):
    """The histogram and grid bounds of a quantization grid (lo, hi, bits, signed), or bins over [low, high]."""
    if len(grid) == 4:
        qp = compute_qparams(*grid[:3], signed=grid[3])
        return ValueHistogram.for_grid(qp), grid_bounds(qp, 1)
    low, high, inner = grid
    return ValueHistogram(low=low, high=high, inner=inner, steps_per_bin=1.0), (np.float64(low), np.float64(high))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("grid", [(-1.0, 3.0, 8, False), (-6.0, 6.0, 8, True), (0.0, 6.0, 4, False),
                                  (-0.37, 0.91, 16, True), (1e4, 1e4 + 3.0, 64), (-2e9, -1.999e9, 64),
                                  (0.1, 0.1 + 2.0 ** -10, 51), (1e4, 1e4 + 0.01, 64)])
def test_bins_near_every_edge_equal_the_float64_formula(dtype, grid):
    """The bins computed in the reference's dtype, with the exact fix-up near the edges, against
    `ValueHistogram.update` (the float64 formula, value by value), on every edge and its neighbours, uniform
    values and far outliers; bins far from zero in bin widths (where float32 cannot tell the bins apart and every
    value takes the float64 formula) included. The clipped counts against `ClipAccumulator`."""
    h, bounds = _histogram(grid)
    rng = np.random.default_rng(len(grid))
    span = h.high - h.low
    x = np.concatenate([_edge_values(h, dtype), rng.uniform(h.low - span, h.high + span, 5000).astype(dtype),
                        np.array([h.low - 1e3 * span, h.high + 1e3 * span, -3e38, 3e38], dtype=dtype)])
    x = rng.permutation(x)
    _, counted = compare(x, x, histogram=h, grid=bounds)
    reference = ValueHistogram(h.low, h.high, h.inner, h.steps_per_bin)
    reference.update(x)
    np.testing.assert_array_equal(counted.counts, reference.counts)
    clip = ClipAccumulator()
    clip.update(x, *bounds)
    assert (counted.below, counted.above) == (reference.below, reference.above)
    assert counted.below + counted.above == clip.clipped
    assert (counted.min, counted.max) == (reference.min, reference.max)


def test_a_grid_other_than_the_histograms_is_clip_counted_against_its_own_bounds():
    """Clipped counts come from the histogram only when the grid is its [low, high]."""
    rng = np.random.default_rng(4)
    qp = compute_qparams(-1.0, 1.0, 8)
    x = rng.normal(scale=1.5, size=20_000).astype(np.float32)
    narrow = (np.float64(-0.5), np.float64(0.75))
    _, counted = compare(x, x, histogram=ValueHistogram.for_grid(qp), grid=narrow)
    clip = ClipAccumulator()
    clip.update(x, *narrow)
    assert (counted.below, counted.above) == (int(np.sum(x < -0.5)), int(np.sum(x > 0.75)))
    assert counted.below + counted.above == clip.clipped


def _channels_last(a: np.ndarray) -> np.ndarray:
    """`a` as the compiled convolutions hand it over: the same codes, the channel axis innermost in memory."""
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(a, 1, -1)), -1, 1)


@pytest.mark.parametrize("shape, per_channel", [((1, 40, 28, 28), False), ((2, 13, 7, 9), False),
                                                ((1, 24, 14, 14), True), ((3, 5, 33, 31), True),
                                                ((1, 96, 1, 1), False)])
def test_channels_last_codes_give_the_same_bits_as_channels_first(shape, per_channel):
    """The compiled convolutions hand over channels-last views: the sums must not depend on the layout (channel
    and position counts that are and are not multiples of the 8 x 8 transpose blocks; per-tensor and per-channel
    grids; a clamp)."""
    rng = np.random.default_rng(sum(shape))
    channels = shape[1]
    if per_channel:
        qp = QParams(scale=rng.uniform(0.005, 0.05, channels).astype(np.float32),
                     zero_point=rng.integers(-20, 20, channels), bits=8, signed=True, axis=1)
    else:
        qp = compute_qparams(-0.5, 3.0, 8, signed=False)
    x, codes = _tensor(rng, shape, qp)
    last = _channels_last(codes)
    assert not last.flags.c_contiguous or math.prod(shape[2:]) == 1
    args = dict(histogram=ValueHistogram.for_grid(qp, x.ndim), grid=grid_bounds(qp, x.ndim), clamp=(-1.0, 2.5))
    first_sums, first_grid = compare(x, codes, qp, **args)
    last_sums, last_grid = compare(x, last, qp, **args)
    assert first_sums == last_sums
    np.testing.assert_array_equal(first_grid.counts, last_grid.counts)
    assert (first_grid.below, first_grid.above, first_grid.min, first_grid.max) == \
        (last_grid.below, last_grid.above, last_grid.min, last_grid.max)
    assert compare(x, last, qp)[0] == compare(x, codes, qp)[0]  # sums only


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


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused(bad):
    x = np.float32([0.0, 1.0, bad])
    with pytest.raises(ValueError, match="finite"):
        compare(x, np.float32([0.0, 1.0, 2.0]))
    qp = compute_qparams(-1.0, 1.0, 8)
    with pytest.raises(ValueError, match="finite"):
        compare(x, qp.quantize(np.zeros(3)), qp, histogram=ValueHistogram.for_grid(qp), grid=grid_bounds(qp, 1))
    # in a later chunk of a channels-last tensor, binned on a per-channel grid
    pc = QParams(scale=np.float32([0.01, 0.02, 0.03]), zero_point=np.array([0, 1, 2]), bits=8, signed=True, axis=1)
    big = np.zeros((1, 3, 40, 40), dtype=np.float32)
    big[0, 2, 39, 7] = bad
    codes = _channels_last(pc.quantize(np.zeros(big.shape)))
    with pytest.raises(ValueError, match="finite"):
        compare(big, codes, pc, histogram=ValueHistogram.for_grid(pc, 4), grid=grid_bounds(pc, 4))


def test_bad_arguments_raise():
    qp = compute_qparams(-1.0, 1.0, 8)
    with pytest.raises(ValueError, match="shape"):
        compare(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="qparams"):
        compare(np.zeros(3, np.float32), np.zeros(3, np.int8))
    with pytest.raises(ValueError, match="together"):
        compare(np.zeros(3, np.float32), np.zeros(3, np.int8), qp, histogram=ValueHistogram.for_grid(qp))
