"""The sequence-tagging task of the recurrent taggers (bench/models/build_recurrent.py), numpy only: the tests
and bench/recurrent.py draw their samples from it without torch.

Per frame x_t ~ N(0, 1) in R^8; s_t = 0.8 s_{t-1} + x_t[:2] (s_0 = 0); the label of frame t is the quadrant of
s_t (4 classes), so a frame's label depends on the frames before it.
"""
from __future__ import annotations

import numpy as np

STEPS, FEATURES, CLASSES = 48, 8, 4


def tagger_data(seed: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(x [count, 1, STEPS, FEATURES] float32, labels [count, STEPS] int64)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (count, 1, STEPS, FEATURES)).astype(np.float32)
    s = np.zeros((count, 2))
    labels = np.zeros((count, STEPS), np.int64)
    for t in range(STEPS):
        s = 0.8 * s + x[:, 0, t, :2]
        labels[:, t] = (s[:, 0] > 0) * 2 + (s[:, 1] > 0)
    return x, labels
