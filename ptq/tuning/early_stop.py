"""Early decisions of `ptq tune`: stop scoring a candidate once no cosines of the photos left could make it pass.

A candidate passes when the bound of its validation score, mean - z sem over the photos' cosines
(`ptq.tuning.data.Score`), is at least a threshold (reaching the goal: `z` of the rule; keeping a step: the
mean, z = 0, at least the current mean + `min_gain`). With k of n photos scored (their means a_1..a_k), the
bound of the full pass is f(x) = mean(a, x) - z sem(a, x) for the n - k means x still unknown, each a cosine in
[-1, 1]. The mean is linear in x and the standard error a norm of an affine function of x, so f is concave;
it is symmetric in the unknown means, so its maximum over the box [-1, 1]^(n-k) is taken where they are all
equal (the average of a maximizer's permutations is one): the best the candidate can still reach is
max over c in [-1, 1] of f(a, c, ..., c), a one-dimensional concave maximum (`best_bound`, golden-section
search). When it is below the threshold (by more than `SLACK`, far above float rounding), the candidate fails
whatever the other photos score, and the pass stops: the decision is the full pass's, exactly.

The photos are scored hardest first (`hardest_first`: lowest cosine in the tuner's first, full pass): a
candidate that fails, fails on the photos that lose most, so it is found out after a few of them. A pass
that is not stopped holds every photo's cosines and gives the full pass's score bit for bit (the values are
put back in sample order before the mean is taken).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

SLACK = 1e-9  # a candidate is out of reach when even its best completion misses the threshold by more than this
COSINE_RANGE = (-1.0, 1.0)  # what an unscored photo's mean cosine can be
_GOLDEN = (math.sqrt(5) - 1) / 2
_ITERATIONS = 80  # golden-section steps: the interval shrinks by 0.618^80 ~ 2e-17


def bound(values: Sequence[float], z: float) -> float:
    """mean - z sem of `values` (sem: sample standard deviation / sqrt(n), 0 for one value), as `Score` takes it."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean - z * math.sqrt(var / n)


def best_bound(known: Sequence[float], total: int, z: float) -> float:
    """The highest mean - z sem that `total` photo means can have when `known` are some of them and the
    others are cosines in [-1, 1] (module docstring: all others equal at the maximum)."""
    missing = total - len(known)
    if missing < 0:
        raise ValueError(f"{len(known)} known values of {total}")
    if missing == 0:
        return bound(known, z)

    def f(c: float) -> float:
        return bound(list(known) + [c] * missing, z)

    lo, hi = COSINE_RANGE
    a, b = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(_ITERATIONS):
        if fa < fb:
            lo, a, fa = a, b, fb
            b = lo + _GOLDEN * (hi - lo)
            fb = f(b)
        else:
            hi, b, fb = b, a, fa
            a = hi - _GOLDEN * (hi - lo)
            fa = f(a)
    return max(fa, fb, f(COSINE_RANGE[0]), f(COSINE_RANGE[1]))


@dataclass(frozen=True)
class PassRule:
    """What a candidate must reach to pass: mean - `z` sem of its photos' cosines >= `threshold`; `order`: the
    photos (indices into the score's photos) in the order to score them."""

    threshold: float
    z: float
    order: tuple[int, ...]

    def out_of_reach(self, known: Sequence[float], total: int) -> bool:
        """Whether no cosines of the `total - len(known)` photos left can make the candidate pass."""
        return best_bound(known, total, self.z) < self.threshold - SLACK


def hardest_first(photo_means: Sequence[float]) -> tuple[int, ...]:
    """The photos by ascending mean cosine (ties: in photo order)."""
    return tuple(sorted(range(len(photo_means)), key=lambda k: (photo_means[k], k)))
