"""Compiled Add / Sub / Mul on integer codes (`ops.elementwise`), one pass, int64 arithmetic per element.

Add / Sub (L = the common shift, M_a/2^N_a ~= s_a/s_y, M_b/2^N_b ~= s_b/s_y, sign = +1 or -1):

    a_c = (((a_q - zp_a) * 2^L) * M_a + 2^(N_a-1)) >> N_a
    b_c = (((b_q - zp_b) * 2^L) * M_b + 2^(N_b-1)) >> N_b
    y_q = clamp((a_c + sign * b_c + 2^(L-1) + zp_y * 2^L) >> L, qmin, qmax)

Mul (M/2^N ~= s_a s_b / s_y):

    y_q = clamp(((a_q - zp_a) * (b_q - zp_b) * M + 2^(N-1) + zp_y * 2^N) >> N, qmin, qmax)

the integers of the numpy path (`shift_round` and `requantize` of `ptq.core.requant`). Operands of the same
shape (read in their common memory order, plain or channels-last, which the output keeps), or one of them a
single value; other broadcasts run the numpy path.
The same integers as the numpy path, so the LSB bound stated in `ops.elementwise` holds unchanged.
"""
from __future__ import annotations

from typing import Optional

import numba
import numpy as np

from ops.compiled.layout import memory_order


@numba.njit(cache=True, nogil=True)
def add_sub(a, b, za, zb, ma, na, mb, nb, shift, sign, zp, lo, hi, out) -> None:
    """out[i] = the Add/Sub formula (module docstring) of a[i] and b[i] (b[0] when b has one value)."""
    ka = (np.int64(1) << na) >> 1
    kb = (np.int64(1) << nb) >> 1
    k = ((np.int64(1) << shift) >> 1) + (np.int64(zp) << shift)
    scalar = b.shape[0] == 1
    for i in range(a.shape[0]):
        bi = b[0] if scalar else b[i]
        ac = (((np.int64(a[i]) - za) << shift) * ma + ka) >> na
        bc = (((np.int64(bi) - zb) << shift) * mb + kb) >> nb
        y = (ac + sign * bc + k) >> shift
        out[i] = min(max(y, lo), hi)


@numba.njit(cache=True, nogil=True)
def mul(a, b, za, zb, m, n, zp, lo, hi, out) -> None:
    """out[i] = the Mul formula (module docstring) of a[i] and b[i] (b[0] when b has one value)."""
    k = ((np.int64(1) << n) >> 1) + (np.int64(zp) << n)
    scalar = b.shape[0] == 1
    for i in range(a.shape[0]):
        bi = b[0] if scalar else b[i]
        y = ((np.int64(a[i]) - za) * (np.int64(bi) - zb) * m + k) >> n
        out[i] = min(max(y, lo), hi)


def _flat_pair(a: np.ndarray, b: np.ndarray):
    """(a, b) flattened with the larger first, the output shape, the axes order of the flat data (None:
    plain C order) and whether they were swapped; None when neither the shapes are equal nor one operand is
    a single value that broadcasts into the other's shape. Operands of one shape that share a memory order
    (the channels-last codes of the compiled convolutions, `ops.compiled.layout`) are read in that order."""
    if a.dtype.kind not in "iu" or b.dtype.kind not in "iu":
        return None
    shape = np.broadcast_shapes(a.shape, b.shape)
    if a.shape == b.shape:
        common = memory_order(a, b)
        if common is not None:
            at, bt, axes = common
            return at.reshape(-1), bt.reshape(-1), shape, axes, False
    if a.shape == b.shape or (b.size == 1 and a.shape == shape):
        return np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1), shape, None, False
    if a.size == 1 and b.shape == shape:
        return np.ascontiguousarray(b).reshape(-1), np.ascontiguousarray(a).reshape(-1), shape, None, True
    return None


def _output(shape: tuple[int, ...], axes, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(the output array, its flat data in the operands' memory order `axes`)."""
    if axes is None:
        out = np.empty(shape, dtype=dtype)
        return out, out.reshape(-1)
    data = np.empty(tuple(shape[i] for i in axes), dtype=dtype)
    return data.transpose(np.argsort(axes)), data.reshape(-1)


def add_sub_codes(a, b, zps, m, n, shift: int, sign: int, y_qp) -> Optional[np.ndarray]:
    """Add (sign 1) or Sub (sign -1) of integer codes a, b with zero points `zps` and (M, N) pairs `m`, `n`
    per input; None when the broadcast is not one this kernel covers."""
    pair = _flat_pair(np.asarray(a), np.asarray(b))
    if pair is None:
        return None
    first, second, shape, axes, swapped = pair
    i, j = (1, 0) if swapped else (0, 1)
    if swapped and sign < 0:  # a single-valued minuend: the numpy path
        return None
    out, flat = _output(shape, axes, y_qp.dtype)
    add_sub(first, second, int(zps[i]), int(zps[j]), int(m[i]), int(n[i]), int(m[j]), int(n[j]), shift, sign,
            int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax, flat)
    return out


def mul_codes(a, b, zps, m: int, n: int, y_qp) -> Optional[np.ndarray]:
    """Mul of integer codes a, b with zero points `zps`; None when the broadcast is not covered."""
    pair = _flat_pair(np.asarray(a), np.asarray(b))
    if pair is None:
        return None
    first, second, shape, axes, swapped = pair
    za, zb = (int(zps[1]), int(zps[0])) if swapped else (int(zps[0]), int(zps[1]))
    out, flat = _output(shape, axes, y_qp.dtype)
    mul(first, second, za, zb, int(m), int(n), int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax, flat)
    return out
