"""Requantization with integer multipliers: a positive real factor r is applied as M / 2^N.

    y = clamp(((acc * M + 2^(N-1)) >> N) + zp_out, qmin, qmax)      (int64, round half up, arithmetic shift)

M has at most `mbits` bits (15 by default, the hardware multiplier width) and 0 <= N <= 31. Every integer
path in ptq requantizes through `requantize`; per-channel requant passes one (M, N) pair per channel.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

DEFAULT_MBITS = 15
MAX_SHIFT = 31
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def quantize_multiplier(r, mbits: int = DEFAULT_MBITS) -> tuple[np.ndarray, np.ndarray]:
    """(M, N) int64 arrays with M / 2^N ~= r, M < 2^mbits, 0 <= N <= 31, N as large as those allow.

    When 2^(mbits-1) <= M (every r in [2^(mbits-1-31), 2^(mbits-1)]), the relative error is at most
    2^-mbits. Smaller r lose relative precision (M shrinks); r >= 2^mbits cannot be represented.
    """
    r = np.atleast_1d(np.asarray(r, dtype=np.float64))
    if not np.all(np.isfinite(r)) or np.any(r <= 0):
        raise ValueError(f"requant factor must be finite and positive, got {r}")
    mmax = (1 << mbits) - 1
    if np.any(r > mmax):
        raise ValueError(f"requant factor {r.max():g} too large for a {mbits}-bit multiplier")
    n = np.floor(np.log2(mmax / r)).astype(np.int64)
    n = np.clip(n, 0, MAX_SHIFT)
    m = np.rint(r * np.exp2(n)).astype(np.int64)
    over = m > mmax  # log2 rounding put us one shift too far
    n = np.where(over, n - 1, n)
    m = np.where(over, np.rint(r * np.exp2(n)).astype(np.int64), m)
    return m, n


def multiplier_value(m, n) -> np.ndarray:
    """The real factor an (M, N) pair stands for."""
    return np.asarray(m, dtype=np.float64) / np.exp2(np.asarray(n, dtype=np.float64))


def shift_round(acc: np.ndarray, m, n) -> np.ndarray:
    """(acc * M + 2^(N-1)) >> N in int64; `m`, `n` broadcast against `acc`."""
    acc = np.asarray(acc, dtype=np.int64)
    m = np.asarray(m, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    return (acc * m + ((np.int64(1) << n) >> 1)) >> n


def _along(values, axis: Optional[int], ndim: int) -> tuple[np.ndarray, ...]:
    """int64 per-channel arrays laid along `axis` of a rank-`ndim` tensor (scalars stay scalars)."""
    out = []
    for v in values:
        v = np.asarray(v, dtype=np.int64)
        if v.size == 1:
            v = v.reshape(())
        elif axis is not None:
            shape = [1] * ndim
            shape[axis % ndim] = -1
            v = v.reshape(shape)
        out.append(v)
    return tuple(out)


def requantize(acc, m, n, zp_out, qmin: int, qmax: int, axis: Optional[int] = None, dtype=None,
               offset=None) -> np.ndarray:
    """Scale the integer accumulator `acc + offset` by M / 2^N, add the output zero point, saturate:

        y = clamp((acc * M + (offset * M + 2^(N-1) + zp_out * 2^N)) >> N, qmin, qmax)

    the same integers as clamp((((acc + offset) * M + 2^(N-1)) >> N) + zp_out, qmin, qmax), since
    zp_out * 2^N is a multiple of 2^N and passes through the shift. Per-channel `m`, `n`, `zp_out` (length C)
    are laid along `axis` of `acc`; `offset` (a bias / zero-point fold) broadcasts against `acc`.

    int64 arithmetic: |acc| * M + |offset| * M + 2^(N-1) + |zp_out| * 2^N must fit (callers bound it). `acc`,
    of any integer dtype, is not modified: one multiply converts it while it scales, an add and a shift follow
    in place, and the clamp writes straight into the output dtype (full-size temporaries dominate the time
    on large activations).
    """
    acc = np.asarray(acc)
    m, n, zp_out = _along((m, n, zp_out), axis, acc.ndim)
    const = ((np.int64(1) << n) >> 1) + zp_out * (np.int64(1) << n)
    if offset is not None:
        const = const + np.asarray(offset, dtype=np.int64) * m
    shape = np.broadcast_shapes(acc.shape, m.shape, n.shape, const.shape)
    y = np.empty(shape, dtype=np.int64)
    np.multiply(acc, m, out=y)
    np.add(y, const, out=y)
    np.right_shift(y, n, out=y)
    out = np.empty(shape, dtype=np.int64 if dtype is None else dtype)
    np.clip(y, qmin, qmax, out=out, casting="unsafe")
    return out


def saturate_int32(acc: np.ndarray) -> tuple[np.ndarray, int]:
    """Clamp an int64 accumulator to int32 the way hardware saturates; returns (acc, overflow count)."""
    acc = np.asarray(acc, dtype=np.int64)
    overflow = int(np.count_nonzero((acc < INT32_MIN) | (acc > INT32_MAX)))
    if overflow:
        acc = np.clip(acc, INT32_MIN, INT32_MAX)
    return acc, overflow
