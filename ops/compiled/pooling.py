"""Compiled 2-D pooling windows (`ops.pooling`, NCHW), over the taps inside the input only:

    MaxPool:     y_q[n, c, oh, ow] = max_{kh, kw} x_q[n, c, oh*sh + kh*dh - pt, ow*sw + kw*dw - pl]
                 (padding never wins; a window with no tap inside the input gives the dtype's minimum,
                 the numpy path's padding value)
    AveragePool: acc[n, c, oh, ow] = sum_{kh, kw} (x_q[n, c, ...] - zp_x)   in int64 (padding adds 0)

The average's requant (`ops.common.MeanRequant`: saturation, one (M, N) per window count) follows in numpy
on the int64 sums, as in the numpy path.
The same integers as the numpy path, so the LSB bound stated in `ops.pooling` holds unchanged.
"""
from __future__ import annotations

from typing import Optional

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _window(size, o, s, d, k, pad):
    """The taps t < k with 0 <= o*s + t*d - pad < size: (first, end)."""
    start = o * s - pad
    first = 0
    while first < k and start + first * d < 0:
        first += 1
    end = k
    while end > first and start + (end - 1) * d >= size:
        end -= 1
    return first, end


@numba.njit(cache=True, nogil=True)
def max_pool(x, kh, kw, sh, sw, dh, dw, pt, pl, floor, out) -> None:
    for n in range(out.shape[0]):
        for c in range(out.shape[1]):
            for oh in range(out.shape[2]):
                h0, h1 = _window(x.shape[2], oh, sh, dh, kh, pt)
                for ow in range(out.shape[3]):
                    w0, w1 = _window(x.shape[3], ow, sw, dw, kw, pl)
                    best = floor
                    for i in range(h0, h1):
                        for j in range(w0, w1):
                            v = x[n, c, oh * sh + i * dh - pt, ow * sw + j * dw - pl]
                            if v > best:
                                best = v
                    out[n, c, oh, ow] = best


@numba.njit(cache=True, nogil=True)
def window_sums(x, zx, kh, kw, sh, sw, dh, dw, pt, pl, out) -> None:
    for n in range(out.shape[0]):
        for c in range(out.shape[1]):
            for oh in range(out.shape[2]):
                h0, h1 = _window(x.shape[2], oh, sh, dh, kh, pt)
                for ow in range(out.shape[3]):
                    w0, w1 = _window(x.shape[3], ow, sw, dw, kw, pl)
                    total = np.int64(0)
                    for i in range(h0, h1):
                        for j in range(w0, w1):
                            total += np.int64(x[n, c, oh * sh + i * dh - pt, ow * sw + j * dw - pl]) - zx
                    out[n, c, oh, ow] = total


def _args(g) -> tuple[int, ...]:
    return (g.kernel[0], g.kernel[1], g.strides[0], g.strides[1], g.dilations[0], g.dilations[1],
            g.pads_begin[0], g.pads_begin[1])


def max_pool_2d(x: np.ndarray, g) -> Optional[np.ndarray]:
    """MaxPool of (N, C, H, W) integer codes with `ops.pooling.PoolGeometry` g; None unless 2-D."""
    if x.ndim != 4 or x.dtype.kind not in "iu":
        return None
    out = np.empty(x.shape[:2] + tuple(g.out), dtype=x.dtype)
    max_pool(np.ascontiguousarray(x), *_args(g), np.iinfo(x.dtype).min, out)
    return out


def window_sums_2d(x: np.ndarray, zx: int, g) -> Optional[np.ndarray]:
    """int64 window sums of x - zx over the taps inside (N, C, H, W) codes; None unless 2-D."""
    if x.ndim != 4 or x.dtype.kind not in "iu":
        return None
    out = np.empty(x.shape[:2] + tuple(g.out), dtype=np.int64)
    window_sums(np.ascontiguousarray(x), zx, *_args(g), out)
    return out
