"""Integer square root on int64 arrays, by Newton's method in integers (shared by ReduceL2 and the norms).

    isqrt(n) = floor(sqrt(n))   for 0 <= n < 2^62, exact

Start from x_0 = 2^ceil(bits(n) / 2) >= sqrt(n) and iterate x_{k+1} = (x_k + n // x_k) >> 1 while it
decreases: the sequence falls monotonically to floor(sqrt(n)) (at most ~6 steps for 62-bit n from this
start). Only integer operations (comparisons, shifts, floor division).
"""
from __future__ import annotations

import numpy as np

ISQRT_LIMIT = 1 << 62


def bit_length(n: np.ndarray) -> np.ndarray:
    """Number of bits of each non-negative int64 (0 for 0), by a binary search on shifts."""
    v = np.asarray(n, dtype=np.int64).copy()
    bits = np.zeros(v.shape, dtype=np.int64)
    for s in (32, 16, 8, 4, 2, 1):
        big = v >= (np.int64(1) << s)
        bits += s * big
        v >>= s * big
    return bits + (v > 0)


def isqrt(n) -> np.ndarray:
    """floor(sqrt(n)) of a non-negative int64 array below 2^62 (ValueError otherwise)."""
    n = np.asarray(n, dtype=np.int64)
    if n.size and (n.min() < 0 or n.max() >= ISQRT_LIMIT):
        raise ValueError(f"isqrt takes integers in [0, 2^62), got [{n.min()}, {n.max()}]")
    safe = np.maximum(n, 1)
    x = np.int64(1) << ((bit_length(safe) + 1) >> 1)
    while True:
        y = (x + safe // x) >> 1
        smaller = y < x
        if not smaller.any():
            break
        x = np.where(smaller, y, x)
    return np.where(n == 0, 0, x)
