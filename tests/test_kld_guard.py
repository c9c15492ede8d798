"""KLD where every value lies far from 0 or the histogram is sparse (issue #26, scope 5): the candidate at the
smallest value makes P = Q = one spike (KL = 0); the guard keeps KLD from clipping more than 1% of values."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from calibrators import TensorStatistics, get_calibrator
from calibrators.methods.kld import kld_threshold_bins


def logits(n: int, seed: int = 0) -> np.ndarray:
    """Two logits per image, both positive (class 1 wins): (2 + noise, 5 + noise)."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.normal(2.0, 0.5, n), rng.normal(5.0, 0.8, n)], axis=1)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n", [10, 23, 46])
def test_the_logits_of_a_few_images_keep_their_order(n, symmetric):
    """Before the guard the symmetric search chose a threshold at the smallest |x| (P = Q = one spike,
    KL = 0): both logits clipped to one level, every argmax a tie. Now at most 1% of values are clipped."""
    x = logits(n)
    stats = TensorStatistics(get_calibrator("kld").needs)
    stats.update(x)
    rmin, rmax = get_calibrator("kld").for_grid(symmetric).compute(stats, 8)
    assert np.mean(x > rmax[0]) <= 0.01 and np.mean(x < rmin[0]) <= 0.01
    assert rmax[0] > x[:, 0].max()  # the losing logit is never clipped to the winner's level


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_squeeze_excitation_gate_is_not_clipped_onto_one_level(symmetric):
    """A hard-sigmoid gate of small inputs: 5000 values near 0.5. Before the guard KLD put the threshold below
    all of them (MobileNetV3-small's gates: 100% clipped, model cosine 0.16)."""
    rng = np.random.default_rng(5)
    x = np.clip(0.5 + rng.normal(0, 1, 5000) / 12, 0, 1)
    stats = TensorStatistics(get_calibrator("kld").needs)
    stats.update(x)
    rmin, rmax = get_calibrator("kld").for_grid(symmetric).compute(stats, 8)
    assert np.mean(x > rmax[0]) <= 0.01
    free = get_calibrator("kld", max_clipped=1.0).for_grid(symmetric).compute(stats, 8)[1][0]
    assert np.mean(x > free) > 0.5  # what the search without the guard does


def test_the_degenerate_candidate_is_what_the_guard_removes():
    """The |x| histogram of 20 values far from 0: without the guard the best candidate clips nearly all of
    them; with it none is clipped beyond 1%."""
    counts = np.zeros((1, 4096), np.int64)
    counts[0, [2100, 2500, 2900, 3300, 4000]] = 4
    assert kld_threshold_bins(counts, 128, zero_spike_fix=False, max_clipped=1.0)[0] <= 2101
    assert kld_threshold_bins(counts, 128, zero_spike_fix=False)[0] == 4001


def test_dense_activations_are_searched_as_before():
    """On 10^6 ReLU(N(0, 1)) values KLD clips well under 1%: the guard does not bind."""
    rng = np.random.default_rng(0)
    x = np.maximum(rng.normal(0, 1, 1_000_000), 0)
    stats = TensorStatistics(get_calibrator("kld").needs)
    stats.update(x)
    guarded = get_calibrator("kld").compute(stats, 8)[1][0]
    free = get_calibrator("kld", max_clipped=1.0).compute(stats, 8)[1][0]
    assert guarded == free and guarded < x.max()


DATA = Path(__file__).resolve().parent / "data"


def relu6_output() -> np.ndarray:
    """The bundled EfficientNet-Lite0's `hardtanh_31` (a ReLU6 output) over the 23 calibration photos, rebuilt
    from its histogram (bin width 2^-9, each value at its bin's lower edge): half zeros, a body that thins out
    below 5, and 0.1% of the values at exactly 6."""
    saved = np.load(DATA / "efficientnet_lite0_relu6_histogram.npz")
    return np.repeat(saved["bins"] * 2.0**-9, saved["counts"])


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_relu6_saturation_spike_is_kept(symmetric):
    """KLD without the rule puts the threshold at 4.02 and moves every 6.0 there; with it the range is [0, 6]."""
    x = relu6_output()
    stats = TensorStatistics(get_calibrator("kld").needs)
    stats.update(x)
    assert get_calibrator("kld").for_grid(symmetric).compute(stats, 8)[1][0] == 6.0
    assert get_calibrator("kld", keep_saturation=False).for_grid(symmetric).compute(stats, 8)[1][0] < 4.1


def test_a_saturation_spike_at_the_bottom_of_a_signed_tensor_is_kept_by_the_asymmetric_search():
    x = relu6_output()
    stats = TensorStatistics(get_calibrator("kld").needs)
    stats.update(-x)
    rmin, rmax = get_calibrator("kld").for_grid(False).compute(stats, 8)
    assert rmin[0] == -6.0 and rmax[0] == 0.0
    assert get_calibrator("kld", keep_saturation=False).for_grid(False).compute(stats, 8)[0][0] > -5.5
