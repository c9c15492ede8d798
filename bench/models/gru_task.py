"""The task of bench/models/gru_tagger.py, numpy only (bench/sequence_models.py draws more evaluation
sequences from it without torch): frames of 16 noisy features; now and then a marker frame lights one of 4
marker channels; every frame is tagged with the last marker seen (0 before the first)."""
from __future__ import annotations

import numpy as np

FRAMES, FEATURES, TAGS = 50, 16, 4


def make_batch(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(0, 0.5, (n, FRAMES, FEATURES)).astype(np.float32)
    tags = np.zeros((n, FRAMES), np.int64)
    for row in range(n):
        current = 0
        for t in range(FRAMES):
            if rng.random() < 0.12:
                current = int(rng.integers(0, TAGS))
                x[row, t, current] += 3.0
            tags[row, t] = current
    return x, tags
