"""Streaming, mergeable statistics of a tensor: min/max, moments, per-batch extrema.

Every collector folds a batch given as `ChannelRows`: values of shape (C, n), one row per channel
(C = 1 for per-tensor statistics), produced and validated by `as_channels`. Collectors keep O(C) state
(O(C * batches) for `MomentsCollector` and `BatchExtremaCollector`), never the batches themselves, and
`merge` combines two collectors over disjoint shards into the collector over all the data. The histogram
lives in `calibrators.histogram`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class ChannelRows:
    """A validated batch, one row per channel: `values` (C, n) float32 or float64 (never copied to a wider
    type: every collector is exact or accumulates in float64 on float32 input), and each row's `min` and
    `max` as float64 (computed once, shared by the collectors)."""

    values: np.ndarray
    min: np.ndarray
    max: np.ndarray

    @property
    def channels(self) -> int:
        return self.values.shape[0]


def as_channels(batch, axis: Optional[int] = None) -> ChannelRows:
    """`batch` as finite rows of shape (C, n): channel `axis` first, everything else flattened.

    `axis=None` gives one row with every element. float32/float64 stay as they are; other real dtypes
    become float64. Raises ValueError for an empty batch, a bad axis, a non-real dtype, NaN or +-Inf
    (the message names the problem; the caller adds the tensor name).
    """
    x = np.asarray(batch)
    if x.dtype == np.bool_ or not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"batch must hold real numbers, got dtype {x.dtype}")
    if x.size == 0:
        raise ValueError(f"batch is empty (shape {x.shape})")
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    if axis is None:
        values = x.reshape(1, -1)
    else:
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(f"channel axis {axis} out of range for a batch of shape {x.shape}")
        values = np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)
    lo, hi = values.min(axis=1), values.max(axis=1)
    # NaN propagates into min/max and an Inf is itself an extreme, so finite extremes mean finite values
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        n_nan = int(np.count_nonzero(np.isnan(values)))
        n_pinf = int(np.count_nonzero(values == np.inf))
        n_ninf = int(np.count_nonzero(values == -np.inf))
        raise ValueError(
            f"batch contains non-finite values ({n_nan} NaN, {n_pinf} +Inf, {n_ninf} -Inf out of {values.size})"
        )
    return ChannelRows(values, lo.astype(np.float64), hi.astype(np.float64))


def check_channels(expected: Optional[int], got: int, what: str) -> int:
    """The channel count after folding `got` channels into a collector that has seen `expected` (None: none)."""
    if expected is not None and expected != got:
        raise ValueError(f"{what}: channel count changed from {expected} to {got}")
    return got


@dataclass
class MinMaxCollector:
    """Per-channel minimum and maximum. Merging is exact: min of mins, max of maxes."""

    min: Optional[np.ndarray] = None  # (C,) float64
    max: Optional[np.ndarray] = None

    @property
    def channels(self) -> Optional[int]:
        return None if self.min is None else self.min.size

    def update(self, rows: ChannelRows) -> None:
        check_channels(self.channels, rows.channels, "MinMaxCollector")
        lo, hi = rows.min, rows.max
        if self.min is None:
            self.min, self.max = lo.copy(), hi.copy()
        else:
            self.min, self.max = np.minimum(self.min, lo), np.maximum(self.max, hi)

    def merge(self, other: "MinMaxCollector") -> None:
        if other.min is None:
            return
        check_channels(self.channels, other.channels, "MinMaxCollector.merge")
        if self.min is None:
            self.min, self.max = other.min.copy(), other.max.copy()
        else:
            self.min, self.max = np.minimum(self.min, other.min), np.maximum(self.max, other.max)


@dataclass
class MomentsCollector:
    """Per-channel count, mean and M2 = sum((x - mean)^2), combined by Chan et al.'s parallel formula:

        n = na + nb,  d = mean_b - mean_a,
        mean = mean_a + d * nb / n,  M2 = M2_a + M2_b + d^2 * na * nb / n

    A batch's own (mean, M2) is computed two-pass (subtract its mean first), so no catastrophic
    cancellation; `std = sqrt(M2 / n)` is the population standard deviation (numpy's default, ddof=0).

    The formula is not associative in floating point, so the collector keeps every batch's (n, mean, M2)
    (O(C * batches) state, like `BatchExtremaCollector`) and folds them left to right, in the order folded,
    when read: a merge appends the other shard's batches, so shards merged in order give bit for bit what
    one pass over the same batches gives.
    """

    parts: list = field(default_factory=list)  # one (n, mean, M2) triple of (C,) float64 arrays per batch
    _folded: Optional[tuple] = field(default=None, repr=False, compare=False)  # (len(parts), n, mean, M2)

    @property
    def channels(self) -> Optional[int]:
        return self.parts[0][0].size if self.parts else None

    @property
    def count(self) -> Optional[np.ndarray]:
        return self._fold()[0]

    @property
    def mean(self) -> Optional[np.ndarray]:
        return self._fold()[1]

    @property
    def m2(self) -> Optional[np.ndarray]:
        return self._fold()[2]

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / self.count)

    def update(self, rows: ChannelRows) -> None:
        check_channels(self.channels, rows.channels, "MomentsCollector")
        values = rows.values
        n = np.full(values.shape[0], float(values.shape[1]))
        mean = values.mean(axis=1, dtype=np.float64)
        centred = values - mean[:, None]  # float64
        m2 = np.einsum("ij,ij->i", centred, centred)
        self.parts.append((n, mean, m2))

    def merge(self, other: "MomentsCollector") -> None:
        if not other.parts:
            return
        check_channels(self.channels, other.channels, "MomentsCollector.merge")
        self.parts.extend(tuple(a.copy() for a in part) for part in other.parts)

    def _fold(self) -> tuple:
        if not self.parts:
            return None, None, None
        if self._folded is None or self._folded[0] != len(self.parts):
            done, n, mean, m2 = self._folded or (1, *self.parts[0])
            for nb, mean_b, m2_b in self.parts[done:]:
                total = n + nb
                delta = mean_b - mean
                mean = mean + delta * (nb / total)
                m2 = m2 + m2_b + np.square(delta) * (n * nb / total)
                n = total
            self._folded = (len(self.parts), n, mean, m2)
        return self._folded[1:]


@dataclass
class BatchExtremaCollector:
    """The minimum and maximum of every batch, in the order folded (a merge appends the other shard's).

    State is O(C * number of batches): one (min, max) pair per batch and channel.
    """

    mins: list = field(default_factory=list)  # list of (C,) float64, one per batch
    maxs: list = field(default_factory=list)

    @property
    def channels(self) -> Optional[int]:
        return self.mins[0].size if self.mins else None

    @property
    def batches(self) -> int:
        return len(self.mins)

    def update(self, rows: ChannelRows) -> None:
        check_channels(self.channels, rows.channels, "BatchExtremaCollector")
        self.mins.append(rows.min)
        self.maxs.append(rows.max)

    def merge(self, other: "BatchExtremaCollector") -> None:
        if not other.mins:
            return
        check_channels(self.channels, other.channels, "BatchExtremaCollector.merge")
        self.mins.extend(m.copy() for m in other.mins)
        self.maxs.extend(m.copy() for m in other.maxs)

    def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(mins, maxs), each of shape (batches, C)."""
        return np.stack(self.mins), np.stack(self.maxs)
