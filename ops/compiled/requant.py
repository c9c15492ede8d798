"""Compiled requantization epilogue: integer accumulators to output codes in one pass, no int64 temporaries.

Per element of output channel c, with A = acc + offset[c] in int64 (`OutputStage.apply` after
`ops.linear.finish_accumulator`, i.e. `ptq.core.requant.requantize`):

    A = clamp(A, -2^(B-1), 2^(B-1) - 1)                        only when the accumulator plan cannot rule out
                                                                overflow of its B-bit register (counted)
    A = (A + 2^(P[c]-1)) >> P[c]                                pre-rounding (P = 0: none)
    y = (A * M[c] + 2^(N[c]-1) + zp * 2^N[c]) >> N[c]            A >= 0, or no negative-side multiplier
    y = (A * (s[c] M'[c]) + 2^(N'[c]-1) + zp * 2^N'[c]) >> N'[c]  A < 0 with a fused LeakyRelu (s = sign of slope)
    out = clamp(y, lo, hi), stored in the output dtype

int64 arithmetic, round half up, arithmetic shift; zp * 2^N is a multiple of 2^N, so it passes through the
shift exactly as `requantize` folds it. The callers bound |A| * M within int64 as the numpy path does.

AVX2 has no 64-bit arithmetic shift (and no variable one), so the common case shifts logically: for an int64
v and 1 <= N <= 62, v >> N = ((v + 2^63) >>> N) - 2^(63-N) exactly (2^63 is a multiple of 2^N, and v + 2^63,
computed as v with its sign bit flipped, lies in [0, 2^64) as an unsigned integer), which vectorizes.
The same integers as the numpy path, so the LSB bound stated in `ops.linear` holds unchanged.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import numba
import numpy as np
from numba import types
from numba.extending import overload

INT32_MAX = (1 << 31) - 1
# rows of the packed per-channel parameters (SUB: 2^(63-N), the logical shift's correction)
M, N, K, NEG_M, NEG_N, NEG_K, PRE, SUB = range(8)
# entries of the packed scalars (FAST: no saturation check, no negative-side multiplier, no pre-rounding,
# every M an int32 and every N in [1, 62]: the vectorized loop)
LO, HI, SAT_LO, SAT_HI, CHECK, HAS_NEG, FAST = range(7)
SIGN_BIT = np.uint64(1 << 63)


# packed parameters by (id(stage), channels, acc_bits), dropped when the stage is garbage-collected
_PACKED: dict = {}


def pack_stage(stage, channels: int, acc_bits: Optional[int] = None) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(per-channel int64 params (8, C), int64 scalars (7,)) of an `ops.linear.OutputStage` for an accumulator
    with `channels` channels, saturated to `acc_bits` (None: no check); None when a parameter is not laid
    out per channel (length 1 or C) and the numpy path must run. Cached per stage (stages are not changed
    once the quantize rule has built them)."""
    key = (id(stage), channels, acc_bits)
    if key not in _PACKED:
        _PACKED[key] = _pack(stage, channels, acc_bits)
        weakref.finalize(stage, _PACKED.pop, key, None)
    return _PACKED[key]


def _pack(stage, channels: int, acc_bits: Optional[int]) -> Optional[tuple[np.ndarray, np.ndarray]]:
    arrays = [stage.m, stage.n]
    if stage.neg_m is not None:
        arrays += [stage.neg_m, stage.neg_n, stage.neg_sign]
    if stage.pre_shift is not None:
        arrays.append(stage.pre_shift)
    if any(np.ndim(a) > 1 or np.size(a) not in (1, channels) for a in arrays):
        return None
    prm = np.zeros((8, channels), dtype=np.int64)
    prm[M] = stage.m
    prm[N] = stage.n
    prm[K] = ((np.int64(1) << prm[N]) >> 1) + np.int64(stage.zp) * (np.int64(1) << prm[N])
    if stage.neg_m is not None:
        prm[NEG_M] = np.asarray(stage.neg_m, dtype=np.int64) * np.asarray(stage.neg_sign, dtype=np.int64)
        prm[NEG_N] = stage.neg_n
        prm[NEG_K] = ((np.int64(1) << prm[NEG_N]) >> 1) + np.int64(stage.zp) * (np.int64(1) << prm[NEG_N])
    if stage.pre_shift is not None:
        prm[PRE] = stage.pre_shift
    shiftable = (prm[N] >= 1) & (prm[N] <= 62)
    prm[SUB] = np.where(shiftable, np.int64(1) << np.where(shiftable, 63 - prm[N], 0), 0)
    check = acc_bits is not None
    fast = (not check and stage.neg_m is None and not prm[PRE].any() and bool(shiftable.all())
            and int(prm[M].max()) <= INT32_MAX)
    bits = acc_bits if check else 64
    lim = np.array([stage.lo, stage.hi, -(1 << (bits - 1)) if check else 0, (1 << (bits - 1)) - 1 if check else 0,
                    int(check), int(stage.neg_m is not None), int(fast)], dtype=np.int64)
    return prm, lim


def _as_int64(value):
    """An accumulator element as int64 (compiled through the overload below)."""
    return np.int64(value)


@overload(_as_int64)
def _as_int64_typed(value):
    # float32 accumulators hold exact integers below 2^24 (the BLAS bound): through int32 the conversion
    # vectorizes (AVX2 has no float-to-int64 vector conversion)
    if isinstance(value, types.Float) and value.bitwidth == 32:
        return lambda value: np.int64(np.int32(value))
    return lambda value: np.int64(value)


@numba.njit(cache=True, nogil=True)
def requant_row(acc, offset, c, prm, lim, out) -> int:
    """out[i] = the epilogue (module docstring) of acc[i] + offset for channel c; returns the overflow count."""
    lo = lim[LO]
    hi = lim[HI]
    m = prm[M, c]
    n = prm[N, c]
    k = prm[K, c]
    if lim[FAST] != 0:
        # the common case, a tight loop: acc * M + (offset * M + k), the offset folded as `requantize` does;
        # M as a sign-extended int32 lets a 32x32->64-bit SIMD multiply do it for int32 accumulators
        m32 = np.int64(np.int32(m))
        k_row = offset * m + k
        sub = prm[SUB, c]
        shift = np.uint64(n)
        for i in range(acc.shape[0]):
            y = np.int64((np.uint64(_as_int64(acc[i]) * m32 + k_row) ^ SIGN_BIT) >> shift) - sub
            out[i] = min(max(y, lo), hi)
        return 0
    over = 0
    p = prm[PRE, c]
    pk = (np.int64(1) << p) >> 1
    for i in range(acc.shape[0]):
        a = _as_int64(acc[i]) + offset
        if lim[CHECK] != 0:
            if a < lim[SAT_LO]:
                a = lim[SAT_LO]
                over += 1
            elif a > lim[SAT_HI]:
                a = lim[SAT_HI]
                over += 1
        a = (a + pk) >> p
        if a < 0 and lim[HAS_NEG] != 0:
            y = (a * prm[NEG_M, c] + prm[NEG_K, c]) >> prm[NEG_N, c]
        else:
            y = (a * m + k) >> n
        out[i] = min(max(y, lo), hi)
    return over


@numba.njit(cache=True, nogil=True)
def lane_params(offset, prm):
    """(M as int32, offset * M + k, N as uint64) per channel, for `requant_positions` (its FAST case)."""
    channels = prm.shape[1]
    m32 = np.empty(channels, dtype=np.int32)
    k_row = np.empty(channels, dtype=np.int64)
    shift = np.empty(channels, dtype=np.uint64)
    for c in range(channels):
        m32[c] = np.int32(prm[M, c])
        k_row[c] = offset[c] * prm[M, c] + prm[K, c]
        shift[c] = np.uint64(prm[N, c])
    return m32, k_row, shift


@numba.njit(cache=True, nogil=True)
def requant_positions(acc, offset, prm, lim, lanes, out) -> int:
    """out[p, c] = the epilogue of acc[p, c] + offset[c], channels innermost (`lanes` =
    `lane_params(offset, prm)`); returns the overflow count. The common case runs along the channels, the
    SIMD lanes each with their channel's parameters."""
    if lim[FAST] == 0:
        over = 0
        for c in range(acc.shape[1]):
            over += requant_row(acc[:, c], offset[c], c, prm, lim, out[:, c])
        return over
    lo = lim[LO]
    hi = lim[HI]
    m32, k_row, shift = lanes
    sub = prm[SUB]
    for p in range(acc.shape[0]):
        a = acc[p]
        o = out[p]
        for c in range(acc.shape[1]):
            y = np.int64((np.uint64(_as_int64(a[c]) * np.int64(m32[c]) + k_row[c]) ^ SIGN_BIT) >> shift[c]) - sub[c]
            o[c] = min(max(y, lo), hi)
    return 0


@numba.njit(cache=True, nogil=True)
def _finish_lanes(acc, offset, prm, lim, out) -> int:
    lanes = lane_params(offset, prm)
    over = 0
    for o in range(acc.shape[0]):
        over += requant_positions(acc[o], offset, prm, lim, lanes, out[o])
    return over


def finish_lanes(acc: np.ndarray, offset: np.ndarray, packed, out: np.ndarray) -> int:
    """out (O, P, C) = the epilogue of acc (O, P, C; integers, or floats holding exact integers) + offset[c],
    channels innermost, with `pack_stage`'s parameters; returns the overflow count."""
    return int(_finish_lanes(acc, offset, packed[0], packed[1], out))


@numba.njit(cache=True, nogil=True)
def _finish(acc, offset, prm, lim, out) -> int:
    over = 0
    for o in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            over += requant_row(acc[o, c], offset[c], c, prm, lim, out[o, c])
    return over


def finish_channels(acc: np.ndarray, offset: np.ndarray, packed, out: np.ndarray) -> int:
    """out (O, C, I) = the epilogue of acc (O, C, I; integers, or floats holding exact integers) + offset[c]
    with `pack_stage`'s parameters; returns the overflow count."""
    return int(_finish(acc, offset, packed[0], packed[1], out))


def _channel_offset(offset, shape: tuple[int, ...], axis: Optional[int]) -> Optional[np.ndarray]:
    """`offset` (None, or broadcasting against `shape` along `axis` only) as an int64 vector of the channels."""
    channels = shape[axis] if axis is not None else 1
    if offset is None:
        return np.zeros(channels, dtype=np.int64)
    off = np.asarray(offset)
    if off.ndim > len(shape):
        return None
    full = (1,) * (len(shape) - off.ndim) + off.shape
    if any(d != 1 for i, d in enumerate(full) if i != axis):
        return None
    if off.size not in (1, channels):
        return None
    return np.ascontiguousarray(np.broadcast_to(off.reshape(-1).astype(np.int64, copy=False), (channels,)))


def finish(acc: np.ndarray, offset, stage, acc_bits: Optional[int]) -> Optional[tuple[np.ndarray, int]]:
    """(output codes, overflow count) of the accumulator `acc + offset` through `stage` (an
    `ops.linear.OutputStage`), saturated to `acc_bits` first unless None; None when the layout is not one
    this kernel covers (non-contiguous acc, an offset varying along another axis). `acc` is int32, int64, or
    a float BLAS result proven to hold exact integers (`ops.compiled.pointwise`)."""
    acc = np.asarray(acc)
    if acc.dtype not in (np.int32, np.int64, np.float32, np.float64) or acc.ndim == 0 or not acc.flags.c_contiguous:
        return None
    axis = stage.axis % acc.ndim if stage.axis is not None and stage.m.size > 1 else None
    if axis is None and offset is not None and np.size(offset) > 1:
        axis = _offset_axis(np.shape(offset), acc.ndim)
        if axis is None:
            return None
    off = _channel_offset(offset, acc.shape, axis)
    channels = acc.shape[axis] if axis is not None else 1
    packed = pack_stage(stage, channels, acc_bits)
    if off is None or packed is None:
        return None
    outer = math.prod(acc.shape[:axis]) if axis is not None else 1
    acc3 = acc.reshape(outer, channels, -1)
    out = np.empty(acc.shape, dtype=stage.dtype)
    return out, finish_channels(acc3, off, packed, out.reshape(acc3.shape))


def _offset_axis(shape: tuple[int, ...], ndim: int) -> Optional[int]:
    """The one axis (of a rank-`ndim` tensor) along which an offset of `shape` varies; None if several."""
    full = (1,) * (ndim - len(shape)) + tuple(shape)
    axes = [i for i, d in enumerate(full) if d != 1]
    return axes[0] if len(axes) == 1 else None
