"""Downsampled tables with integer linear interpolation.

A table of K + 1 = 2^k + 1 nodes covers the table index a in [0, K * 2^s] with one node every 2^s codes.
At run time, with i = a >> s and f = a & (2^s - 1) and nodes stored with g fractional bits:

    y = (e[i] * 2^s + (e[i+1] - e[i]) * f + 2^(s+g-1)) >> (s + g)        (int64, round half up)

The nodes are fitted offline in float64; v(a) = (1 - w) e[i] + w e[i+1] with w = f / 2^s is linear in them.

- `fit_nodes`: least squares on the exact real-valued output code of every index, then a few Lawson
  reweighting steps towards the minimax fit (low mean error; sampling f at the nodes would leave the whole
  chord error h^2/8 * max|f''|, least squares 2/3 of it, minimax 1/2).
- `minimax_nodes`: the linear programme  min t  s.t.  |v(a) - r| <= t  over rows (a, r) of integer
  reference codes (one per input code; a side is left open where the lookup's clamp makes overshooting it
  free). Cutting planes: solve on a few rows, add per segment the rows the solution misses most, repeat;
  stop early once t proves a given fit optimal. The rounded output is within k of r only if
  |v - r| <= k + 1/2, so no choice of nodes has a max error below ceil(t* - 1/2) LSB: the error floor.
- `closest_nodes`: a second LP, the nodes nearest the least-squares ones (least sum |e - e_ls|) that keep
  every row within the band |v - r| < k + 1/2 of the floor k: the floor's max error with about the
  least-squares mean error. Only needed when least squares misses the floor.
"""
from __future__ import annotations

# imports inside functions: scipy, at first use (scipy.special, .sparse, .optimize each take about half a second to
# import; `import ops` and the `ptq` command would pay for them otherwise)

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import scipy.sparse as sp

# scipy is imported where a fit runs: at module level it would cost every `ptq` command (even `--help`) about
# a second of import time, and most runs fit no interpolated table

LAWSON_STEPS = 8
_MIN_WEIGHT = 1e-3  # keeps every node determined when the error vanishes somewhere
MAX_CUT_ROUNDS = 12
CUT_TOLERANCE = 1e-6  # LSB: a row this far past the LP's t is still counted as met


@dataclass(frozen=True)
class Rows:
    """Constraints on the interpolated value v at table index `index`: v - target <= t unless `upper_open`,
    target - v <= t unless `lower_open` (the lookup clamps there, so overshooting that side costs nothing)."""

    index: np.ndarray  # int64
    target: np.ndarray  # float64
    upper_open: np.ndarray  # bool
    lower_open: np.ndarray  # bool


def _weights(index: np.ndarray, shift: int, nodes: int):
    """(i, j, w): v(a) = (1 - w) e[i] + w e[j] at every index a."""
    i = index >> shift
    w = (index & ((1 << shift) - 1)) / float(1 << shift)
    return i, np.minimum(i + 1, nodes - 1), w  # the last index may sit exactly on the last node (w = 0)


def _evaluate(values: np.ndarray, i: np.ndarray, j: np.ndarray, w: np.ndarray) -> np.ndarray:
    return values[i] * (1 - w) + values[j] * w


def _weighted_fit(target: np.ndarray, i: np.ndarray, j: np.ndarray, w: np.ndarray, weight: np.ndarray,
                  nodes: int) -> np.ndarray:
    diag = np.bincount(i, weight * (1 - w) ** 2, nodes) + np.bincount(j, weight * w**2, nodes)
    off = np.bincount(i, weight * (1 - w) * w, nodes)[:-1]  # couples node i and i+1
    rhs = np.bincount(i, weight * (1 - w) * target, nodes) + np.bincount(j, weight * w * target, nodes)
    banded = np.zeros((3, nodes))
    banded[0, 1:] = off
    banded[1] = np.where(diag > 0, diag, 1.0)  # a node no index reaches stays 0 (never read)
    banded[2, :-1] = off
    from scipy.linalg import solve_banded

    return solve_banded((1, 1), banded, rhs)


def fit_nodes(target: np.ndarray, shift: int, nodes: int) -> np.ndarray:
    """Node values (float64, `nodes` of them) of a piecewise-linear fit to `target[a]`, a = 0..len-1,
    one node every 2^shift indices; `len(target) <= (nodes - 1) * 2^shift + 1`."""
    i, j, w = _weights(np.arange(target.size, dtype=np.int64), shift, nodes)
    weight = np.ones_like(target)
    best, best_err = None, np.inf
    for _ in range(LAWSON_STEPS + 1):
        values = _weighted_fit(target, i, j, w, weight, nodes)
        err = np.abs(_evaluate(values, i, j, w) - target)
        if err.max() < best_err:
            best, best_err = values, err.max()
        weight = np.maximum(weight * err / max(float(np.mean(weight * err)), 1e-300), _MIN_WEIGHT)
    return best


def _excess(values: np.ndarray, rows: Rows, i, j, w) -> tuple[np.ndarray, np.ndarray]:
    """(v - target where the upper side is constrained, target - v where the lower side is), else -inf."""
    d = _evaluate(values, i, j, w) - rows.target
    return np.where(rows.upper_open, -np.inf, d), np.where(rows.lower_open, -np.inf, -d)


def _segment_argmax(score: np.ndarray, segment: np.ndarray, above: float) -> np.ndarray:
    """Per segment, the first row with the segment's largest score if that exceeds `above`; `segment` is
    sorted (rows grouped by segment)."""
    starts = np.flatnonzero(np.r_[True, segment[1:] != segment[:-1]])
    group = np.cumsum(np.r_[False, segment[1:] != segment[:-1]])
    best = np.maximum.reduceat(score, starts)
    hit = np.flatnonzero((score == best[group]) & (score > above))
    return hit[np.r_[True, group[hit][1:] != group[hit][:-1]]] if hit.size else hit


def _row_matrix(sub: np.ndarray, rows: Rows, i, j, w, nodes: int) -> tuple[sp.csr_matrix, np.ndarray]:
    """(A, b): A @ e - b = sign * (v - target) for the constrained sides of the rows `sub` (sign +1 for the
    upper side, -1 for the lower), so |v - target| <= slack reads A @ e <= b + slack."""
    import scipy.sparse as sp

    up = sub[~rows.upper_open[sub]]
    lo = sub[~rows.lower_open[sub]]
    pick = np.r_[up, lo]
    sign = np.r_[np.ones(up.size), -np.ones(lo.size)]
    line = np.arange(pick.size)
    a = sp.csr_matrix((np.r_[sign * (1 - w[pick]), sign * w[pick]], (np.r_[line, line], np.r_[i[pick], j[pick]])),
                      shape=(pick.size, nodes))
    return a, sign * rows.target[pick]


def _linprog(c, a_ub, b_ub, bounds) -> np.ndarray:
    from scipy.optimize import linprog

    res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"lut.interp: the LP solver failed ({res.message})")
    return res.x


def _cutting_planes(rows: Rows, i, j, w, sub: np.ndarray, solve, enough: float = np.inf):
    """Solve on the rows `sub`, add per segment the rows the solution misses most, repeat (module doc).
    `solve(sub) -> (values, level)` must keep the rows of `sub` within `level`."""
    for _ in range(MAX_CUT_ROUNDS):
        values, level = solve(sub)
        if level >= enough:
            break
        hi, lo = _excess(values, rows, i, j, w)
        missed = np.union1d(_segment_argmax(hi, i, level + CUT_TOLERANCE),
                            _segment_argmax(lo, i, level + CUT_TOLERANCE))
        if missed.size == 0:
            break
        sub = np.union1d(sub, missed)
    return values, level


def _sorted_rows(rows: Rows) -> Rows:
    order = np.argsort(rows.index, kind="stable")
    return Rows(*(field[order] for field in (rows.index, rows.target, rows.upper_open, rows.lower_open)))


def minimax_nodes(rows: Rows, shift: int, start: np.ndarray, box: tuple[float, float],
                  enough: float = np.inf) -> tuple[np.ndarray, float]:
    """(values, t): nodes in `box` minimizing max over rows of the constrained |v - target| (module doc),
    and the LP optimum t over the rows used, a lower bound for the max over all rows.

    Cutting planes start from the per-segment worst rows of `start` (as many nodes as `start`) and stop once
    no row exceeds t, once t reaches `enough` (the caller's fit is then proven as good as any), or after
    `MAX_CUT_ROUNDS` rounds; t is a valid lower bound in every case, the values are the last LP solution."""
    nodes = start.size
    rows = _sorted_rows(rows)
    i, j, w = _weights(rows.index, shift, nodes)
    c = np.r_[np.zeros(nodes), 1.0]
    bounds = [box] * nodes + [(0, None)]
    import scipy.sparse as sp

    def solve(sub):
        a, b = _row_matrix(sub, rows, i, j, w, nodes)
        x = _linprog(c, sp.hstack([a, -np.ones((a.shape[0], 1))]), b, bounds)  # A e - t <= b
        return x[:nodes], float(x[-1])

    hi, lo = _excess(start, rows, i, j, w)
    sub = np.union1d(_segment_argmax(hi, i, -np.inf), _segment_argmax(lo, i, -np.inf))
    return _cutting_planes(rows, i, j, w, sub, solve, enough)


def closest_nodes(rows: Rows, shift: int, start: np.ndarray, feasible: np.ndarray, band: float,
                  box: tuple[float, float]) -> np.ndarray:
    """Nodes in `box` with every row's constrained |v - target| <= max(band, that of `feasible`) and the
    least sum |e - start|: they move away from `start` only near the rows it misses (the minimax max error
    with about the mean error of `start`). `feasible` (e.g. the minimax nodes) proves the band reachable."""
    nodes = start.size
    rows = _sorted_rows(rows)
    i, j, w = _weights(rows.index, shift, nodes)
    hi, lo = _excess(feasible, rows, i, j, w)
    band = max(band, float(max(hi.max(), lo.max())))
    c = np.r_[np.zeros(nodes), np.ones(nodes)]  # variables e, then d >= |e - start|
    import scipy.sparse as sp

    eye = sp.identity(nodes, format="csr")
    bounds = [box] * nodes + [(0, None)] * nodes

    def solve(sub):
        a, b = _row_matrix(sub, rows, i, j, w, nodes)
        a_ub = sp.vstack([sp.hstack([a, sp.csr_matrix((a.shape[0], nodes))]),
                          sp.hstack([eye, -eye]), sp.hstack([-eye, -eye])])
        return _linprog(c, a_ub, np.r_[b + band, start, -start], bounds)[:nodes], band

    hi, lo = _excess(start, rows, i, j, w)
    sub = np.union1d(_segment_argmax(hi, i, band), _segment_argmax(lo, i, band))
    return _cutting_planes(rows, i, j, w, sub, solve)[0]


def interpolate(table: np.ndarray, index: np.ndarray, shift: int, frac_bits: int) -> np.ndarray:
    """Integer linear interpolation of `table` (nodes with `frac_bits` fractional bits) at int64 `index`."""
    i = index >> shift
    f = index & ((1 << shift) - 1)
    e0 = table[i].astype(np.int64)
    e1 = table[np.minimum(i + 1, table.size - 1)].astype(np.int64)
    total = shift + frac_bits
    rounding = (1 << total) >> 1
    return ((e0 << shift) + (e1 - e0) * f + rounding) >> total
