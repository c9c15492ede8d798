"""`mse`: the threshold t minimizing the expected quantization MSE (clipping + rounding) on the histogram.

The grid is the one `ptq.core.qparams.compute_qparams(-t, t)` (symmetric, full range) / `(0, t)` builds:

    signed:   scale s = t / ((2^b - 1) / 2),  values clip at -2^(b-1) * s and (2^(b-1) - 1) * s
    unsigned: scale s = t / (2^b - 1),        values clip at 0 and t

    N * MSE(t) = sum over clipped x of (|x| - T_side)^2  +  (s^2 / 12) * #(non-zero x inside the range)

Values are taken as uniform inside their bin (a bin [a, a + w) wholly beyond T contributes
n * ((c - T)^2 + w^2 / 12) with c its centre; the bin holding T contributes its part beyond T), and
exact zeros are left out of the rounding term because zero is exactly representable (after a ReLU they
are half of the tensor). Candidates are the bin edges t = j * w for j = 1 .. occupied bins, all evaluated
at once from suffix sums. Result: (-t, t) signed, (0, t) unsigned, clipped to the observed min/max.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calibrators.registry import Calibrator, clip_symmetric, register_calibrator
from calibrators.statistics import Stat


def _suffix(a: np.ndarray) -> np.ndarray:
    """(C, B) -> (C, B + 2): out[:, k] = sum(a[:, k:]), zero for k >= B."""
    s = np.cumsum(a[:, ::-1], axis=1)[:, ::-1]
    return np.concatenate([s, np.zeros((a.shape[0], 2))], axis=1)


def clipping_error(counts: np.ndarray, width: np.ndarray, clip: np.ndarray) -> tuple:
    """(sum over values beyond `clip` of (|x| - clip)^2, their number), per (channel, candidate).

    `counts` (C, B): one side's histogram of |x| (bin j = [j*w, (j+1)*w)); `clip` (C, K) levels >= 0.
    """
    w = width[:, None]
    centre = (np.arange(counts.shape[1]) + 0.5) * w
    s0 = _suffix(counts)
    s1 = _suffix(counts * centre)
    s2 = _suffix(counts * (centre**2 + w**2 / 12.0))
    padded = np.concatenate([counts, np.zeros((counts.shape[0], 1))], axis=1)
    k = np.minimum(np.floor(clip / w), counts.shape[1]).astype(np.int64)  # the bin holding the clip level
    part = np.where(k < counts.shape[1], (k + 1) * w - clip, 0.0)  # its length beyond the clip level
    n_k = np.take_along_axis(padded, k, axis=1)
    beyond = k + 1
    a0 = np.take_along_axis(s0, beyond, axis=1)
    a1 = np.take_along_axis(s1, beyond, axis=1)
    a2 = np.take_along_axis(s2, beyond, axis=1)
    error = a2 - 2.0 * clip * a1 + clip**2 * a0 + n_k * part**3 / (3.0 * w)
    return np.maximum(error, 0.0), a0 + n_k * part / w


def mse_threshold_bins(counts: np.ndarray, zeros: np.ndarray, width: np.ndarray, bits: int, signed: bool):
    """(C,) the best j per channel (threshold j * w) for the (C, 2, B) signed histogram `counts`."""
    pos = counts[:, 0].astype(np.float64)
    neg = counts[:, 1].astype(np.float64)
    pos[:, 0] -= zeros  # exact zeros: no clipping and no rounding error
    nbins = pos.shape[1]
    w = np.where(width > 0, width, 1.0)
    occupied_mask = (counts[:, 0] + counts[:, 1]) > 0
    occupied = np.where(occupied_mask.any(axis=1), nbins - np.argmax(occupied_mask[:, ::-1], axis=1), 0)
    j = np.arange(1, nbins + 1, dtype=np.float64)[None, :]
    t = j * w[:, None]
    if signed:
        scale = t / (((1 << bits) - 1) / 2.0)
        clip_pos, clip_neg = ((1 << (bits - 1)) - 1) * scale, (1 << (bits - 1)) * scale
    else:
        scale = t / ((1 << bits) - 1)
        clip_pos, clip_neg = t, np.zeros_like(t)
    err_pos, n_pos = clipping_error(pos, w, clip_pos)
    err_neg, n_neg = clipping_error(neg, w, clip_neg)
    inside = (pos.sum(axis=1) + neg.sum(axis=1))[:, None] - n_pos - n_neg
    total = err_pos + err_neg + scale**2 / 12.0 * np.maximum(inside, 0.0)
    total = np.where(j <= occupied[:, None], total, np.inf)
    return np.where(occupied > 0, np.argmin(total, axis=1) + 1, 0)


@register_calibrator("mse")
@dataclass(frozen=True)
class MSE(Calibrator):
    """Minimum expected quantization MSE for the given bit width (see the module docstring)."""

    needs = frozenset({Stat.HISTOGRAM})

    def _compute(self, stats, bits, signed):
        hist = stats.histogram
        best = mse_threshold_bins(hist.counts, hist.zeros, hist.width, bits, signed)
        return clip_symmetric(best * hist.width, stats, signed)
