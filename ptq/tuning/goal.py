"""What `ptq tune` aims at on its validation samples (`Goal`), and what a score misses of it.

Two targets, either or both (both must hold when both are given):
- the logits cosine: the validation mean minus `z` standard errors over photos at least `cosine + margin`
  (`ptq.tuning.data`: what that bound estimates);
- the user's metric (`ptq.tuning.metric`): the float model's figure minus the quantized one at most `max_drop`.

Whatever the goal, the search keeps a step when it raises the validation cosine by at least `min_gain`: the
fine-grained guide. A 0/1 metric over a few photos does not move for most steps, and moves by one photo's
flip either way for others (measured on a 6-class synthetic classifier at 4 bits: a rule that also asked the
metric not to drop threw away every activation in 16 bits, +0.016 cosine, for one flipped sample of 60, and
ended short of the goal); the goal decides when to stop and what `minimize` may give back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ptq.tuning.data import Score
from ptq.tuning.defaults import DEFAULT_MARGIN, DEFAULT_Z
from ptq.tuning.metric import MetricTarget

ROUNDING = 1e-9  # a metric drop this far above max_drop is the float sum's rounding, not a drop


@dataclass(frozen=True)
class Goal:
    """`cosine`: the target logits cosine (None: none); `metric`: the target on the user's metric (None: none)."""

    cosine: Optional[float] = None
    margin: float = DEFAULT_MARGIN
    z: float = DEFAULT_Z
    metric: Optional[MetricTarget] = None

    def __post_init__(self):
        if self.cosine is None and self.metric is None:
            raise ValueError("tune needs a target: a cosine (--target-cosine) or a metric (--max-accuracy-drop, "
                             "metric=)")

    @property
    def bound(self) -> Optional[float]:
        """What the validation cosine's mean minus z standard errors must reach (None: no cosine target)."""
        return None if self.cosine is None else self.cosine + self.margin

    def shortfalls(self, score: Score) -> list[str]:
        """What of the goal `score` misses, each with by how much; empty when it reaches it."""
        missed = []
        if self.bound is not None and score.bound(self.z) < self.bound:
            missed.append(f"logits cosine mean - {self.z:g} sem {score.bound(self.z):.5f} < {self.bound:.5f} "
                          f"({self.bound - score.bound(self.z):.5f} short)")
        if self.metric is not None:
            m = score.metric
            if m is None:
                missed.append(f"{self.metric.name} not measured")
            elif m.drop > self.metric.max_drop + ROUNDING:
                missed.append(f"{m.name} {m.value:.4f} against float {m.reference:.4f} {m.over()}: drop {m.drop:.4f} "
                              f"> {self.metric.max_drop:g} ({m.drop - self.metric.max_drop:.4f} short)")
        return missed

    def reaches(self, score: Score) -> bool:
        return not self.shortfalls(score)

    def describe(self, score: Score) -> str:
        """`score` against each target, e.g. "mean - 2 sem 0.99837 vs target 0.998; top-1 accuracy 0.8500 against
        float 0.8500 over 7 photos (drop 0.0000, max 0.01)"."""
        parts = []
        if self.cosine is not None:
            part = f"mean - {self.z:g} sem {score.bound(self.z):.5f} vs target {self.cosine}"
            parts.append(part + (f" + margin {self.margin}" if self.margin else ""))
        if self.metric is not None and score.metric is not None:
            m = score.metric
            parts.append(f"{m.name} {m.value:.4f} against float {m.reference:.4f} {m.over()} (drop {m.drop:.4f}, "
                         f"max {self.metric.max_drop:g})")
        return "; ".join(parts)
