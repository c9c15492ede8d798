"""`kld`: the threshold minimizing KL(P || Q) over the histogram of |x| (TensorRT 2017, slides 37-39).

On the |x| histogram h (bins of width w; between B/2 + 1 and B bins occupied, see HistogramCollector;
the default B = 4096 gives at least TensorRT's 2048 bins), with L = 2^(bits-1) levels for a signed
tensor and 2^bits for an unsigned one (128 / 256 at 8 bits), for every candidate i in [L, n]
(n = occupied bins):

    P   = h[:i] with the tail sum(h[i:]) added to its last bin, normalized by its sum
    Q   = h[:i] (no tail) merged into L groups of m = i // L bins (the last group takes the remainder),
          each group's sum spread evenly over the bins of the group where P is non-zero, normalized
    KL  = sum_j P_j log(P_j / Q_j);  a candidate whose Q is 0 where P is not scores +inf
    threshold = i * w (the upper edge of bin i - 1) for the i with the smallest KL (ties: smallest i)

Before the search h[0] is set to h[1]: the spike of exact zeros after a ReLU otherwise dominates P and
drags the threshold far down (measured on 10^6 ReLU(N(0, 1)) samples at 8 bits: 1.5 without the fix,
4.47 with it, brute-force MSE optimum 4.2); `zero_spike_fix=False` turns this off. If n <= L no
clipping is possible at this resolution and the threshold is n * w.

A candidate may clip at most `max_clipped` (1%) of the values; one that clips more scores +inf (and a
channel left with no finite candidate keeps its whole range). KL(P || Q) is blind to how far the clipped
values move: when every value lies far from 0 in bins above the L-th (a squeeze-excitation gate, the
hard-sigmoid of small inputs: everything near 0.5), or the histogram is sparse (a small output over a few
images), the candidate at the smallest value folds all values into its last bin, P = Q = that one spike and
KL = 0, so every value is clipped to one level. Measured before this guard on bench/models'
MobileNetV3-small: its five SE gates had 100% of their values clipped (e.g. all of [0.30, 0.83] onto 0.153)
and the model's cosine to float was 0.1628 (0.9929 with the guard); issue #26's OCR direction classifier, a
MobileNetV3-like model, collapsed to 0.7185 (top-1 agreement 1/20) the same way. Dense activations are
clipped far less than 1% by KLD, so the guard leaves them alone.

A saturation spike at the top of the range is kept (`keep_saturation`): when the last occupied bin holds at
least 8 values and 16 times the mean count of the 64 bins below it (the 6.0 of a ReLU6, the 1.0 of a gate),
the threshold is the observed end. KL again does not see how far the clipped spike moves: measured on the
bundled EfficientNet-Lite0 (ReLU6 outputs whose top bin holds 48 to 11,376 values against a mean of 0.1 to
15 in the bins below), KLD put the threshold at 4.0 on the [0, 6] outputs, an expected squared error up to
359 times the best candidate's, and the model's cosine to float was 0.9794 (extrema 0.9921); issue #26
measured the same lag on EfficientNet-Lite2 (0.9825 against 0.9913). In the asymmetric search the rule
applies to each end.

Vectorized sweep: with cumulative sums cs (of h), nz (of h > 0) and xl (of h log h), and N = sum(h),
for candidate i with group sums S_g, P-masses T_g (= S_g, plus the tail for the last group) and
non-zero counts k_g:

    KL_i = (xl[i-1] + f(h[i-1] + tail) - sum_g T_g log(S_g / k_g)) / N - log N + log cs[i],  f(a) = a log a

The first L - 1 groups depend on i only through m = i // L, so their sum is computed once per
(channel, m), O(C * B) in all, and each candidate adds its last group in O(1): the whole sweep is a few
vectorized passes over (channel, candidate) arrays.

Result: (-t, t) for a signed tensor, (0, t) for an unsigned one, clipped to the observed min/max.

Asymmetric grid (`for_grid(symmetric=False)`, what the pipeline asks for unless activations are symmetric):
a signed tensor's grid spends all 2^bits levels on [rmin, rmax], so the search runs on the signed
histogram against 2^bits levels (an unsigned tensor with one stray negative value no longer drops to 128
levels over |x|). Two one-sided sweeps of the same KL search: the rows start at the lowest occupied bin and
the upper end is searched (rmin fixed at the observed min), then the rows are reversed from the chosen upper
end (the clipped upper mass added to the new first bin) and the lower end is searched. The bin holding 0 gets
its upper neighbour's count first (the zero spike, as above). The result always contains 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from calibrators.registry import Calibrator, clip_symmetric, register_calibrator
from calibrators.statistics import Stat

MAX_CLIPPED = 0.01  # the largest fraction of values a threshold may clip (the degenerate P = Q = one spike)
SPIKE_RATIO = 16  # a top bin holding this many times the mean of the bins below it is a saturation spike
SPIKE_WINDOW = 64  # ... of the SPIKE_WINDOW bins below it
SPIKE_MIN_COUNT = 8  # ... and at least this many values


def _xlogx(a: np.ndarray) -> np.ndarray:
    return a * np.log(np.where(a > 0, a, 1.0))


def occupied_bins(counts: np.ndarray) -> np.ndarray:
    """(C,) index of the last non-empty bin plus one, 0 for an empty row."""
    mask = counts > 0
    return np.where(mask.any(axis=1), counts.shape[1] - np.argmax(mask[:, ::-1], axis=1), 0)


def kld_sweep(abs_counts: np.ndarray, levels: int, zero_spike_fix: bool = True,
              max_clipped: float = MAX_CLIPPED) -> tuple:
    """KL(P || Q) of every candidate of every channel: (channel, candidate i, kl), flat arrays, grouped
    by channel in order and i ascending within a channel (see the module docstring for P, Q and i).
    A candidate clipping more than `max_clipped` of the values scores +inf (module docstring)."""
    nbins = abs_counts.shape[1]
    h = abs_counts.astype(np.float64)
    if zero_spike_fix and nbins > 1:
        h[:, 0] = h[:, 1]
    ncand = np.maximum(occupied_bins(abs_counts) - levels + 1, 0)
    chan = np.repeat(np.arange(h.shape[0]), ncand)
    cand = levels + np.arange(chan.size) - np.repeat(np.cumsum(ncand) - ncand, ncand)
    if chan.size == 0:
        return chan, cand, np.empty(0)

    zero = np.zeros((h.shape[0], 1))
    cs = np.concatenate([zero, np.cumsum(h, axis=1)], axis=1)
    nz = np.concatenate([zero, np.cumsum(h > 0, axis=1, dtype=np.float64)], axis=1)
    xl = np.concatenate([zero, np.cumsum(_xlogx(h), axis=1)], axis=1)
    total = cs[:, -1]

    # The first L - 1 groups depend on the candidate only through m = i // L: one row per (channel, m).
    m_values = np.arange(1, cand.max() // levels + 1)
    start = np.arange(levels - 1)[None, :] * m_values[:, None]  # (M, L - 1)
    stop = start + m_values[:, None]
    s = cs[:, stop] - cs[:, start]  # (C, M, L - 1)
    k = nz[:, stop] - nz[:, start]
    head = np.sum(s * np.log(np.where(s > 0, s, 1.0) / np.maximum(k, 1.0)), axis=2)  # (C, M)

    m = cand // levels
    last_start = (levels - 1) * m
    tail = total[chan] - cs[chan, cand]
    last = h[chan, cand - 1]
    s_last = cs[chan, cand] - cs[chan, last_start]
    k_last = nz[chan, cand] - nz[chan, last_start] + ((last == 0) & (tail > 0))  # the tail fills P's last bin
    t_last = s_last + tail
    cross = head[chan, m - 1] + t_last * np.log(np.where(s_last > 0, s_last, 1.0) / np.maximum(k_last, 1.0))
    entropy = xl[chan, cand - 1] + _xlogx(last + tail)
    kept = cs[chan, cand]  # sum of Q before normalization; 0 only when Q is 0 everywhere (scored +inf)
    kl = (entropy - cross) / total[chan] - np.log(total[chan]) + np.log(np.maximum(kept, 1.0))
    invalid = ((t_last > 0) & (s_last == 0)) | (tail > max_clipped * total[chan])
    return chan, cand, np.where(invalid, np.inf, kl)


def saturation_spike(counts: np.ndarray) -> np.ndarray:
    """(C,) whether each row's last occupied bin is a saturation spike: at least SPIKE_MIN_COUNT values and
    SPIKE_RATIO times the mean count of the SPIKE_WINDOW bins below it (the 6 of a ReLU6, the 1 of a gate)."""
    last = occupied_bins(counts) - 1
    rows = np.arange(counts.shape[0])
    top = counts[rows, np.maximum(last, 0)].astype(np.float64)
    csum = np.concatenate([np.zeros((counts.shape[0], 1)), np.cumsum(counts, axis=1, dtype=np.float64)], axis=1)
    start = np.maximum(last - SPIKE_WINDOW, 0)
    below = (csum[rows, np.maximum(last, 0)] - csum[rows, start]) / np.maximum(last - start, 1)
    return (last >= 1) & (top >= SPIKE_MIN_COUNT) & (top >= SPIKE_RATIO * below)


def kld_threshold_bins(abs_counts: np.ndarray, levels: int, zero_spike_fix: bool = True,
                       max_clipped: float = MAX_CLIPPED, keep_saturation: bool = True) -> np.ndarray:
    """(C,) the best candidate i per channel (the threshold is i * bin width); see the module docstring.
    A channel with no finite candidate, or (`keep_saturation`) whose top bin is a saturation spike, keeps every
    value (i = occupied bins)."""
    best = occupied_bins(abs_counts)
    kept = best.copy()
    chan, cand, kl = kld_sweep(abs_counts, levels, zero_spike_fix, max_clipped)
    if chan.size:
        order = np.lexsort((kl, chan))  # stable: among equal KL the smallest candidate comes first
        per_channel = np.bincount(chan, minlength=best.size)
        first = order[(np.cumsum(per_channel) - per_channel)[per_channel > 0]]
        finite = np.isfinite(kl[first])
        best[chan[first[finite]]] = cand[first[finite]]
    return np.where(saturation_spike(abs_counts), kept, best) if keep_saturation else best


def _gather_rows(counts: np.ndarray, start: np.ndarray, length: np.ndarray, step: int) -> np.ndarray:
    """rows[c, j] = counts[c, start_c + step * j] for j < length_c, 0 beyond (C, max length)."""
    width = max(int(length.max(initial=0)), 1)
    j = np.arange(width)[None, :]
    index = start[:, None] + step * j
    valid = j < length[:, None]
    return np.where(valid, counts[np.arange(counts.shape[0])[:, None], np.clip(index, 0, counts.shape[1] - 1)], 0)


def asymmetric_threshold_bins(signed_counts: np.ndarray, levels: int, zero_spike_fix: bool = True,
                              max_clipped: float = MAX_CLIPPED, keep_saturation: bool = True) -> tuple:
    """(lo, hi) per channel: signed-histogram bin edges of the range chosen against `levels` levels spread
    over [lo, hi] (the module docstring's asymmetric search); bin k covers [(k - B) w, (k - B + 1) w)."""
    h = signed_counts.astype(np.float64)
    nbins = h.shape[1] // 2
    if zero_spike_fix:
        h[:, nbins] = h[:, nbins + 1]
    mask = signed_counts > 0
    first = np.argmax(mask, axis=1)
    last = h.shape[1] - np.argmax(mask[:, ::-1], axis=1)  # one past the last occupied bin
    up = _gather_rows(h, first, last - first, 1)
    top = first + kld_threshold_bins(up, levels, zero_spike_fix=False, max_clipped=max_clipped,
                                     keep_saturation=keep_saturation)
    down = _gather_rows(h, last - 1, last - first, -1)
    bottom = last - kld_threshold_bins(down, levels, zero_spike_fix=False, max_clipped=max_clipped,
                                       keep_saturation=keep_saturation)
    empty = ~mask.any(axis=1)
    return np.where(empty, nbins, bottom), np.where(empty, nbins, top)


@register_calibrator("kld")
@dataclass(frozen=True)
class KLD(Calibrator):
    """TensorRT's entropy calibration on the |x| histogram (see the module docstring)."""

    zero_spike_fix: bool = True
    symmetric_grid: bool = True
    max_clipped: float = MAX_CLIPPED
    keep_saturation: bool = True
    needs = frozenset({Stat.HISTOGRAM})

    def for_grid(self, symmetric: bool) -> "KLD":
        return replace(self, symmetric_grid=bool(symmetric))

    def _compute(self, stats, bits, signed):
        hist = stats.histogram
        if signed and not self.symmetric_grid:
            lo, hi = asymmetric_threshold_bins(hist.signed_counts(), 1 << bits, self.zero_spike_fix, self.max_clipped,
                                               self.keep_saturation)
            offset = hist.num_bins
            rmin = np.minimum((lo - offset) * hist.width, 0.0)
            rmax = np.maximum((hi - offset) * hist.width, 0.0)
            return np.maximum(rmin, np.minimum(stats.minmax.min, 0.0)), np.minimum(rmax, np.maximum(stats.minmax.max, 0.0))
        levels = 1 << (bits - 1 if signed else bits)
        threshold = kld_threshold_bins(hist.abs_counts(), levels, self.zero_spike_fix, self.max_clipped,
                                       self.keep_saturation) * hist.width
        return clip_symmetric(threshold, stats, signed)
