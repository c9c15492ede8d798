"""Downsampled tables with integer linear interpolation.

A table of K + 1 = 2^k + 1 nodes covers the table index a in [0, K * 2^s] with one node every 2^s codes.
At run time, with i = a >> s and f = a & (2^s - 1) and nodes stored with g fractional bits:

    y = (e[i] * 2^s + (e[i+1] - e[i]) * f + 2^(s+g-1)) >> (s + g)        (int64, round half up)

The nodes are fitted offline (float64) to the exact real-valued output code of every index: least squares,
then a few Lawson reweighting steps towards the minimax fit. Sampling f at the nodes would leave the whole
chord error h^2/8 * max|f''|; least squares brings the worst error to 2/3 of that, minimax to 1/2.
"""
from __future__ import annotations

import numpy as np
from scipy.linalg import solve_banded

LAWSON_STEPS = 8
_MIN_WEIGHT = 1e-3  # keeps every node determined when the error vanishes somewhere


def _weighted_fit(target: np.ndarray, i: np.ndarray, j: np.ndarray, w: np.ndarray, weight: np.ndarray,
                  nodes: int) -> np.ndarray:
    diag = np.bincount(i, weight * (1 - w) ** 2, nodes) + np.bincount(j, weight * w**2, nodes)
    off = np.bincount(i, weight * (1 - w) * w, nodes)[:-1]  # couples node i and i+1
    rhs = np.bincount(i, weight * (1 - w) * target, nodes) + np.bincount(j, weight * w * target, nodes)
    banded = np.zeros((3, nodes))
    banded[0, 1:] = off
    banded[1] = np.where(diag > 0, diag, 1.0)  # a node no index reaches stays 0 (never read)
    banded[2, :-1] = off
    return solve_banded((1, 1), banded, rhs)


def fit_nodes(target: np.ndarray, shift: int, nodes: int) -> np.ndarray:
    """Node values (float64, `nodes` of them) of a piecewise-linear fit to `target[a]`, a = 0..len-1,
    one node every 2^shift indices; `len(target) <= (nodes - 1) * 2^shift + 1`."""
    a = np.arange(target.size, dtype=np.int64)
    i = a >> shift
    w = (a & ((1 << shift) - 1)) / float(1 << shift)
    j = np.minimum(i + 1, nodes - 1)  # the last index may sit exactly on the last node (w = 0)
    weight = np.ones_like(target)
    best, best_err = None, np.inf
    for _ in range(LAWSON_STEPS + 1):
        values = _weighted_fit(target, i, j, w, weight, nodes)
        err = np.abs(values[i] * (1 - w) + values[j] * w - target)
        if err.max() < best_err:
            best, best_err = values, err.max()
        weight = np.maximum(weight * err / max(float(np.mean(weight * err)), 1e-300), _MIN_WEIGHT)
    return best


def interpolate(table: np.ndarray, index: np.ndarray, shift: int, frac_bits: int) -> np.ndarray:
    """Integer linear interpolation of `table` (nodes with `frac_bits` fractional bits) at int64 `index`."""
    i = index >> shift
    f = index & ((1 << shift) - 1)
    e0 = table[i].astype(np.int64)
    e1 = table[np.minimum(i + 1, table.size - 1)].astype(np.int64)
    total = shift + frac_bits
    rounding = (1 << total) >> 1
    return ((e0 << shift) + (e1 - e0) * f + rounding) >> total
