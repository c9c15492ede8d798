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


def requantize(acc, m, n, zp_out, qmin: int, qmax: int, axis: Optional[int] = None, dtype=None) -> np.ndarray:
    """Scale an integer accumulator by M / 2^N, add the output zero point and saturate to [qmin, qmax].

    Per-channel `m`, `n`, `zp_out` (length C) are laid along `axis` of `acc`.
    """
    acc = np.asarray(acc)
    m, n, zp_out = (np.asarray(v, dtype=np.int64) for v in (m, n, zp_out))
    if axis is not None:
        shape = [1] * acc.ndim
        shape[axis % acc.ndim] = -1
        m, n, zp_out = (v.reshape(shape) if v.size > 1 else v.reshape(()) for v in (m, n, zp_out))
    else:
        m, n, zp_out = (v.reshape(()) if v.size == 1 else v for v in (m, n, zp_out))
    y = np.clip(shift_round(acc, m, n) + zp_out, qmin, qmax)
    return y.astype(dtype) if dtype is not None else y


def saturate_int32(acc: np.ndarray) -> tuple[np.ndarray, int]:
    """Clamp an int64 accumulator to int32 the way hardware saturates; returns (acc, overflow count)."""
    acc = np.asarray(acc, dtype=np.int64)
    overflow = int(np.count_nonzero((acc < INT32_MIN) | (acc > INT32_MAX)))
    if overflow:
        acc = np.clip(acc, INT32_MIN, INT32_MAX)
    return acc, overflow


def requantize_inplace(acc: np.ndarray, m, n, zp_out, qmin: int, qmax: int, axis: Optional[int] = None,
                       dtype=None, offset=None) -> np.ndarray:
    """`requantize(acc + offset, ...)` computed in the int64 array `acc` itself (overwritten), with no
    full-size temporaries (they dominate the time on large activations):

        acc = clamp((acc * M + (offset * M + 2^(N-1) + zp_out * 2^N)) >> N, qmin, qmax)

    The same integers as `requantize`: zp_out * 2^N is a multiple of 2^N, so it passes through the shift.
    `offset` (a bias / zero-point fold, broadcastable to `acc`): |acc| * M + |offset| * M + 2^(N-1) +
    |zp_out| * 2^N must stay within int64; callers check this with a static bound.
    """
    if not isinstance(acc, np.ndarray) or acc.dtype != np.int64 or not acc.flags.writeable:
        raise ValueError("requantize_inplace needs a writable int64 array")
    m, n, zp_out = (np.asarray(v, dtype=np.int64) for v in (m, n, zp_out))
    if axis is not None:
        shape = [1] * acc.ndim
        shape[axis % acc.ndim] = -1
        m, n, zp_out = (v.reshape(shape) if v.size > 1 else v.reshape(()) for v in (m, n, zp_out))
    else:
        m, n, zp_out = (v.reshape(()) if v.size == 1 else v for v in (m, n, zp_out))
    const = ((np.int64(1) << n) >> 1) + zp_out * (np.int64(1) << n)
    if offset is not None:
        const = const + np.asarray(offset, dtype=np.int64) * m
    np.multiply(acc, m, out=acc)
    np.add(acc, const, out=acc)
    np.right_shift(acc, n, out=acc)
    np.clip(acc, qmin, qmax, out=acc)
    return acc.astype(dtype) if dtype is not None else acc
