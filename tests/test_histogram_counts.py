"""The compiled counting pass of the histogram (`calibrators.histogram_counts`) counts what the numpy formula
(`flat_bin_index`, then `np.bincount`) counts, exactly, on short rows and on long ones (counted in lanes)."""
from __future__ import annotations

import numpy as np
import pytest

from calibrators.collectors import as_channels
from calibrators.histogram import EMPTY_EXPONENT, HistogramCollector, flat_bin_index, width_exponent
from calibrators.histogram_counts import LANES_FROM, add_counts


def _formula(values: np.ndarray, exponent: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts (C, 2, B), zeros (C,)) by the numpy formula."""
    flat = flat_bin_index(values, exponent, bins)
    counts = np.bincount(flat, minlength=values.shape[0] * 2 * bins).reshape(values.shape[0], 2, bins)
    return counts, np.count_nonzero(values == 0, axis=1)


def _rows(rng, channels: int, n: int, dtype) -> np.ndarray:
    x = (rng.standard_cauchy((channels, n)) * 10.0 ** rng.integers(-20, 20)).astype(dtype)
    x[:, ::4] = np.maximum(x[:, ::4], 0)  # a Relu's zeros
    x[0, :7] = -0.0
    if channels > 2:
        x[2] = 0  # a channel with only zeros: no width yet
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [50, LANES_FROM * 2 * 64 + 3])  # one histogram; the lanes
def test_the_counts_are_the_formulas(dtype, n):
    rng = np.random.default_rng(n)
    for _ in range(5):
        x = _rows(rng, 4, n, dtype)
        exponent = width_exponent(np.abs(x.astype(np.float64)).max(axis=1), 64)
        assert exponent[2] == EMPTY_EXPONENT
        want_counts, want_zeros = _formula(x, exponent, 64)
        counts, zeros = np.zeros((4, 2, 64), dtype=np.int64), np.zeros(4, dtype=np.int64)
        scale = np.where(exponent > EMPTY_EXPONENT, np.ldexp(1.0, -np.maximum(exponent, -1022)), 0.0)
        assert add_counts(x, scale, counts, zeros) == 0
        assert np.array_equal(counts, want_counts) and np.array_equal(zeros, want_zeros)
        assert counts.sum() == x.size


def test_a_value_past_the_widest_bin_is_left_out_and_counted():
    x = np.array([[0.5, 1.5, -3.0, 40.0]])
    counts, zeros = np.zeros((1, 2, 4), dtype=np.int64), np.zeros(1, dtype=np.int64)
    assert add_counts(x, np.array([1.0]), counts, zeros) == 1  # 40 past bin 3
    assert counts.tolist() == [[[1, 1, 0, 0], [0, 0, 0, 1]]] and zeros.tolist() == [0]


def test_a_collector_fed_in_batches_holds_the_formulas_counts():
    """Batches that widen the bins (coarsening what was counted) give the counts of the formula over all of them."""
    rng = np.random.default_rng(7)
    batches = [rng.normal(0, scale, (2, 3, 40, 40)).astype(np.float32) for scale in (0.1, 3.0, 0.5, 40.0)]
    collector = HistogramCollector(256)
    for b in batches:
        collector.update(as_channels(b, 1))
    every = np.concatenate([as_channels(b, 1).values for b in batches], axis=1)
    counts, zeros = _formula(every, collector.exponent, 256)
    assert np.array_equal(collector.counts, counts) and np.array_equal(collector.zeros, zeros)
