"""`auto` (the default): per tensor, the range among several calibrators' with the least expected quantization error on the grid it gets.

Candidates (`CANDIDATES`, all computed from the one histogram pass): extrema, 99.999percentile,
99.99percentile, 99.9percentile, mse and kld (KLD searched for the grid, `for_grid`). For each candidate's
range [a, b] (per channel) the grid is the one the pipeline builds from it
(`ptq.core.qparams.compute_qparams(a, b, bits, symmetric)`): scale s, zero point z, representable range
[lo, hi] = [(qmin - z) s, (qmax - z) s]. On the signed histogram (values uniform inside a bin) its expected
squared error is

    E = clip_weight * ( sum_{x > hi} (x - hi)^2 + sum_{x < lo} (lo - x)^2 )  +  s^2 / 12 * #(x != 0 in [lo, hi])

(exact zeros are left out of the rounding term: zero is on every grid, and after a ReLU they are half of the
tensor). The candidate with the smallest E is kept; among equal errors the earlier candidate (extrema first,
the widest range).

Why this proxy, and not the tensor's KL divergence or its consumers' error: the error a consumer (a Conv, a
Gemm, an Add) sees from a perturbation e of its input is linear in e, so for one tensor the candidates are
ranked by ||e||^2 times the same gain; and E is ||e||^2's expectation computed on the exact grid the tensor
will get (its real zero point, its real number of levels, saturation at both ends), which neither the MSE
calibrator (a symmetric threshold t) nor KLD (a distribution distance, blind to how far clipped values move)
measure. A spike of saturated values at the top of the range (the 1.0 of a hard-sigmoid gate, the 6 of a
ReLU6) costs its full distance when clipped. `clip_weight` (default 1: E is the expected squared error
itself) can count clipping error above rounding error, for a consumer in which rounding noise, independent
from value to value, averages out while clipping removes the largest values of the same features together;
measured on bench/models' MobileNetV3-small (int run, cosine to float on 40 held-out crops) the weights 1, 2,
4 and 8 gave 0.9993, 0.9989, 0.9992 and 0.9993: no gain to justify a constant, so the default is 1.

A tensor that every consumer clamps to [l, u] (a ReLU6, the flat parts of a HardSwish or a HardSigmoid;
`within`) is scored as the consumer sees it: each candidate's range intersected with [l, u] (as the table
folds it), the histogram's values beyond the clamp moved into the bin that holds the bound (their error beyond
the clamp is no error; inside that bin they count as spread over it, like every bin's values: E then
overstates the rounding error of the clamped values, which sit exactly on the bound, by up to that bin's share).
Without it the choice and its E were made for values the range never held: on EfficientNet-Lite0, 22 of the
tensors feeding a ReLU6 recorded `auto:mse (E 0.57 of extrema's)` for the range [0, 6] that extrema gives too.

A tensor whose largest values a consumer ranks (a Softmax, LogSoftmax, Hardmax, ArgMax/ArgMin or TopK,
directly or through ops that only move codes: `ptq.calibration.ranked_inputs`, `unclipped`) keeps extrema's
range: E weighs every value alike, but such a consumer reads only the leaders of each row (Softmax's dp_i/dx_i =
p_i (1 - p_i) vanishes on the small logits whose rounding a clipping range refines) and clipping ties them. On
bench/models' CRNN recognizer the 99.999th-percentile logits (E 0.67 of extrema's) took the greedy CTC decode
agreement from 0.961 (extrema) to 0.895; never clipping them gives 0.941 (`python bench/detectors.py --models crnn
--calibrator auto`, 256 eval arrays).

A tensor whose one reader keeps its grid and has one output (a MaxPool, a Reshape: `ptq.calibration.read_values`,
`scores_read_values`) is scored on that reader's output statistics, the values actually read on its grid: a
MaxPool passes on only each window's maximum, the input's upper tail, which E on the input's histogram
underweights. On the CRNN (three ReLU -> MaxPool pairs) that took the decode agreement from 0.941 to 0.961.
A graph output keeps its extremes too (its reader is the user: top logits, scores above a threshold).

Measured against extrema (the default until issue 26), int run, same arrays (`python bench/first_try.py --no-peers
--calibrators auto [--lite0-crops 200]`; `python bench/detectors.py --no-ort --no-nncf [--calibrator auto]`):

| figure | extrema | auto |
|---|---:|---:|
| EfficientNet-Lite0, cosine (20 eval photos) | 0.992125 | 0.991638 |
| EfficientNet-Lite0, cosine (200 crops of the eval photos) | 0.993318 | 0.993259 |
| MobileNetV3-small, cosine (200 held-out crops) | 0.999178 | 0.999119 |
| DBNet-style detector, cosine / text IoU (256 pages) | 0.999876 / 0.9957 | 0.999935 / 0.9968 |
| ALBERT-style tagger, tag agreement | 0.999485 | 0.999743 |
| CRNN recognizer, greedy decode agreement (256) | 0.9609 | 0.9609 |
| YOLO-style detector, recall / precision (256) | 0.9797 / 0.9713 | 0.9826 / 0.9700 |
| YOLO-style detector, output / score / box cosine | 0.9998 / 0.9997 / 0.9998 | 0.9997 / 0.9996 / 0.9997 |

(NNCF's best: 0.9538, 0.99909, 0.999877, 0.9923 on the first_try models.) The classifier differences are at
the noise floor of their figures: `python bench/range_jitter.py --tensor getitem_15` shrinks one Lite0 tensor's
range by 1% and the 20-photo cosine falls from 0.992125 to 0.991523; with `--lite0-crops 200` single tensors at
±1% move it by up to 5e-5; on MobileNetV3-small (`--model mobilenet_v3_small --tensor /8/Add_output_0`) 1-3%
move it by up to 3e-5. `python bench/calibrator_swap.py efficientnet_lite0` sets each of auto's 49 differing
entries back to extrema's one at a time: each gains (sum +0.0022) while all together gain 0.0005, so the
tensors interact and no class of tensor stands out. YOLO is different: there the swaps' gains are mostly
positive (`bench/calibrator_swap.py yolo --eval 128`: sum +0.0010, the largest in the s3/s4 stages' residual
Adds, C2f Concats and SiLU outputs, E 0.8-0.97 of extrema's), so clipping costs more downstream than E says,
and on DBNet they are mostly negative (clipping helps, diffusely, 1e-6 each). A local squared error cannot tell
the two apart: the gain from a tensor to the output differs between its large and small values by model (a
DBNet map saturates its Sigmoid where activations are large; YOLO's box distances and a classifier's logits
grow with them), which needs the output's sensitivity, not one pass of statistics.

The table records each tensor's choice and why, as its calibrator: `auto:mse (E 0.31 of extrema's; next kld
0.35)`; a per-channel tensor records the choice of most channels.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ptq.core.qparams import compute_qparams, integer_range

from calibrators.methods.mse import clipping_error
from calibrators.registry import Calibrator, get_calibrator, register_calibrator
from calibrators.statistics import Stat

CANDIDATES = ("extrema", "99.999percentile", "99.99percentile", "99.9percentile", "mse", "kld")
DEFAULT_CLIP_WEIGHT = 1.0


def clamped_sides(hist, bounds: Optional[tuple]) -> tuple:
    """(positive side, negative side) bin counts (C, B) of the histogram's nonzero values, clamped to `bounds`
    (lo, hi) when given: a side whose bound is 0 has no nonzero value left (clamped to exact zeros); otherwise
    the counts of the bins beyond the bound move into the bin that holds it."""
    pos = hist.counts[:, 0].astype(np.float64)
    neg = hist.counts[:, 1].astype(np.float64)
    pos[:, 0] -= hist.zeros
    if bounds is None:
        return pos, neg
    width = np.where(hist.width > 0, hist.width, 1.0)
    lo, hi = bounds
    return _clamp_side(pos, width, hi), _clamp_side(neg, width, -lo)


def _clamp_side(counts: np.ndarray, width: np.ndarray, bound: float) -> np.ndarray:
    if bound <= 0:
        return np.zeros_like(counts)
    if not np.isfinite(bound):
        return counts
    holder = np.minimum(np.floor(bound / width), counts.shape[1] - 1).astype(np.int64)  # (C,)
    bins = np.arange(counts.shape[1])[None, :]
    beyond = np.where(bins > holder[:, None], counts, 0.0).sum(axis=1)
    out = np.where(bins > holder[:, None], 0.0, counts)
    out[np.arange(len(holder)), holder] += beyond
    return out


def grid_error(hist, lo: np.ndarray, hi: np.ndarray, scale: np.ndarray, clip_weight: float = 1.0,
               bounds: Optional[tuple] = None) -> np.ndarray:
    """(C, K) expected squared error per value of quantizing the histogram's values (clamped to `bounds` when
    given) on K grids per channel, each with step `scale` covering [lo, hi] (lo <= 0 <= hi; arrays (C, K)): the
    module docstring's E divided by the count. All K grids share one pass of suffix sums over the bins."""
    pos, neg = clamped_sides(hist, bounds)
    width = np.where(hist.width > 0, hist.width, 1.0)
    err_pos, n_pos = clipping_error(pos, width, np.maximum(hi, 0.0))
    err_neg, n_neg = clipping_error(neg, width, np.maximum(-lo, 0.0))
    nonzero = (pos.sum(axis=1) + neg.sum(axis=1))[:, None]
    inside = np.maximum(nonzero - n_pos - n_neg, 0.0)
    error = clip_weight * (err_pos + err_neg) + scale**2 / 12.0 * inside
    return error / np.maximum(hist.total, 1)[:, None]


@register_calibrator("auto")
@dataclass(frozen=True)
class Auto(Calibrator):
    """Each channel's range among the candidates' with the least expected error on its grid (module docstring)."""

    candidates: tuple = CANDIDATES
    clip_weight: float = DEFAULT_CLIP_WEIGHT
    symmetric_grid: bool = False
    bounds: Optional[tuple] = None  # (lo, hi): every consumer clamps the tensor to it (`within`)
    ranked_by: Optional[str] = None  # the consumer that ranks the tensor's largest values (`unclipped`)
    needs = frozenset({Stat.HISTOGRAM})
    scores_read_values = True

    def __post_init__(self):
        if not self.candidates or "auto" in self.candidates:
            raise ValueError(f"auto: candidates must be other calibrators, got {self.candidates!r}")
        if not self.clip_weight > 0:
            raise ValueError(f"auto: clip_weight must be positive, got {self.clip_weight}")
        for name in self.candidates:
            if not get_calibrator(name).needs <= self.needs | {Stat.MINMAX}:
                raise ValueError(f"auto: candidate {name!r} needs statistics beyond the histogram")

    def for_grid(self, symmetric: bool) -> "Auto":
        return replace(self, symmetric_grid=bool(symmetric))

    def within(self, lo: float, hi: float) -> "Auto":
        return replace(self, bounds=(float(lo), float(hi)))

    def unclipped(self, reason: str) -> "Auto":
        return replace(self, ranked_by=str(reason))

    def scores(self, stats, bits: int, signed: bool) -> tuple:
        """(ranges, errors): each candidate's (rmin, rmax) and its (C,) expected error, as (K, C), in candidate
        order."""
        ranges, grids = [], []
        for name in self.candidates:
            rmin, rmax = get_calibrator(name).for_grid(self.symmetric_grid).compute(stats, bits, signed)
            if self.bounds is not None:  # as the table folds it (ptq.calibration.entries)
                rmin, rmax = np.clip(rmin, *self.bounds), np.clip(rmax, *self.bounds)
            qp = compute_qparams(rmin, rmax, bits, symmetric=self.symmetric_grid, axis=None if rmin.size == 1 else 0)
            qmin, qmax = integer_range(bits, qp.signed, qp.narrow)
            ranges.append((rmin, rmax))
            grids.append(((qmin - qp.zero_point) * qp.scale, (qmax - qp.zero_point) * qp.scale, qp.scale))
        lo, hi, scale = (np.stack([np.broadcast_to(g[k], stats.channels) for g in grids], axis=1) for k in range(3))
        return ranges, grid_error(stats.histogram, lo, hi, scale, self.clip_weight, self.bounds).T

    def _explained(self, stats, bits, signed):
        if self.ranked_by is not None:
            rmin, rmax = get_calibrator("extrema").compute(stats, bits, signed)
            return rmin, rmax, f"auto:extrema ({self.ranked_by} ranks its largest values: never clipped)"
        ranges, errors = self.scores(stats, bits, signed)
        best = np.argmin(errors, axis=0)  # first of equals: candidate order
        channels = np.arange(errors.shape[1])
        rmin = np.stack([r[0] for r in ranges])[best, channels]
        rmax = np.stack([r[1] for r in ranges])[best, channels]
        return rmin, rmax, self._label(errors, best)

    def _label(self, errors: np.ndarray, best: np.ndarray) -> str:
        """`auto:<choice> (E <ratio> of extrema's; next <runner-up> <ratio>)`, for the choice of most channels."""
        chosen = int(np.bincount(best, minlength=len(self.candidates)).argmax())
        total = errors.sum(axis=1)
        base = total[0] if total[0] > 0 else 1.0
        others = [k for k in np.argsort(total, kind="stable") if k != chosen]
        runner = f"; next {self.candidates[others[0]]} {total[others[0]] / base:.2g}" if others else ""
        return f"auto:{self.candidates[chosen]} (E {total[chosen] / base:.2g} of extrema's{runner})"

    def _compute(self, stats, bits, signed):
        rmin, rmax, _ = self._explained(stats, bits, signed)
        return rmin, rmax
