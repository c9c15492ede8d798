"""Screening for `minimize`'s bisections: decide each head on the hardest photos, then verify the head chosen on
all of them.

A bisection of `minimize` (`ptq.tuning.tuner._Tuner.bisect`) measures heads whose verdict is mostly "reaches":
those passes cannot stop early (`ptq.tuning.early_stop` stops a pass only when it is out of reach) and score
every photo. A screened bisection scores each head on the `photos` hardest photos only (the tuner's hardest-first
order, that of its early stops) and *predicts* the others: each photo left at its cosine in the bisection's
starting state (a full pass that reaches) minus the mean drop from that state of the photos scored, photo_j =
start_j - max(0, mean_i (start_i - candidate_i)); the head is kept when the goal's bound, mean - z sem, of the
predicted photo cosines reaches it. Measured on the bundled model (both of its calibrated tables, 54 heads of
`minimize` also scored on every photo, 3 of 7 photos screened): the predicted bound is 0.0001 to 0.0003 below
the full pass's on average, one head of 54 predicted to reach fell short, none predicted short reached; the
largest drop instead of the mean rejected 6 heads that reach (more 16-bit tensors kept), the smallest accepted
4 that fall short. The photos that lose most lose most again, the easier ones less: the mean drop of the
hardest is a mild overestimate of the others'. A head out of reach on the photos scored is out of reach on
all (the early stop's rule, exact).

The head a screened bisection ends with is then measured on every photo (`_Tuner.shortest_head`): when it
does not reach, the bisection runs again from its starting state with full passes, between that head (known
not to reach) and all units (known to reach), so the goal the tuned table is kept at is always decided on the
full validation set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ptq.tuning.data import Score
from ptq.tuning.early_stop import hardest_first

SCREEN_FRACTION = 0.4  # of the photos, the hardest, that decide a screened head
LEAST_SCREENED = 3  # photos at least: a prediction from fewer is a guess (with 2 validation photos, none is screened)


@dataclass(frozen=True)
class Screen:
    """`start`: each photo's mean cosine in the state a bisection starts from (a full pass that reaches);
    `photos`: how many of them, hardest first (`order`), decide a head."""

    start: tuple[float, ...]
    order: tuple[int, ...]
    photos: int

    @classmethod
    def of(cls, start: Sequence[float], order: Sequence[int] = (), fraction: float = SCREEN_FRACTION,
           least: int = LEAST_SCREENED) -> Optional["Screen"]:
        """The screen of a starting state's photo means, scoring `fraction` of the photos, `least` at least,
        hardest first in `order` (default: by `start`); None when it would score every photo anyway."""
        photos = max(least, math.ceil(fraction * len(start)))
        if photos >= len(start):
            return None
        return cls(tuple(start), tuple(order) or hardest_first(start), photos)

    @property
    def scored(self) -> tuple[int, ...]:
        """The photos a screened pass scores, in photo order (that of `Score.photo_means`)."""
        return tuple(sorted(self.order[:self.photos]))

    def predicted(self, partial: Score) -> Score:
        """The full-pass score predicted from `partial`, the score of the `scored` photos (module docstring)."""
        if len(partial.photo_means) != self.photos:
            raise ValueError(f"{len(partial.photo_means)} photo cosines for a screen of {self.photos}")
        known = dict(zip(self.scored, partial.photo_means))
        drop = max(0.0, sum(self.start[p] - c for p, c in known.items()) / len(known))
        return Score.of([known.get(p, self.start[p] - drop) for p in range(len(self.start))])
