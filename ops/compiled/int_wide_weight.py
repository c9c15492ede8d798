"""Dense convolution and Gemm with a 16-bit weight on the 8-bit `vpdpbusd` tiles, exactly, as two signed weight
planes and a row sum.

`vpdpbusd` multiplies unsigned bytes of x by signed bytes of w. A centered 16-bit weight w splits as

    w = 256 * wh + wl,   wh = floor(w / 256) in -128..127,   wl = w - 256 * wh in 0..255
      = 256 * wh + (wl - 128) + 128,                          wl - 128 in -128..127

so that, with u the unsigned input bytes of the 8-bit kernels (`ops.compiled.int_dense`),

    sum_k u[p, k] w[m, k] = 256 * H[p, m] + L[p, m] + 128 * S[p]
    H = sum_k u wh,   L = sum_k u (wl - 128),   S = sum_k u   (S: one more row of ones beside the low plane)

each an int32 tile sum bounded by 255 * 128 * K < 2^31 (checked: K < 65,793). A 16-bit input runs its two byte
planes (`ops.compiled.int_dense16`) through the same three sums and combines 256 * (high plane's) + (low
plane's). Everything is combined in int64 (|A| <= 65535 * 32768 * K < 2^63), plus the zero-point offset
b_q - zp_u * sum_k w; the epilogue is the numpy path's (`requant.requant_positions`) on that accumulator: the
same codes, the LSB bound of `ops.conv`, `ops.gemm` unchanged. `vpdpbusd` CPUs only (`vpmaddwd` takes int16
weights directly, under the 8-bit kernels' bound).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import numba
import numpy as np

from ops.compiled.int_dense import BLOCK, NO_FLIP, _block_dot, kernel_rows
from ops.compiled.int_dense16 import _split
from ops.compiled.requant import lane_params, requant_positions
from ops.compiled.scratch import scratch
from ops.compiled.vnni import ELEMENTS, LANE_BYTES, LANES, pack_weight

INT16_RANGE = (-(1 << 15), (1 << 15) - 1)
MAX_DEPTH = ((1 << 31) - 1) // (255 * 128)  # K with 255 * 128 * K < 2^31


@dataclass(frozen=True)
class WideOperands:
    """A 16-bit weight's planes packed for the tiles: `high` (wh, M rows), `low` (wl - 128, M rows, then a row
    of ones); the row sums of w (int64 (M,)) and K."""

    high: np.ndarray
    low: np.ndarray
    weight_sum: np.ndarray
    depth: int

    @property
    def quads(self) -> int:
        return self.high.shape[1]


_OPERANDS: dict = {}


def wide_operands(q, weight_rows: np.ndarray) -> Optional[WideOperands]:
    """The packed planes of the node q's centered weight `weight_rows` (M, K); None when this kernel does not
    cover it (no `vpdpbusd`, a value outside int16, K past `MAX_DEPTH`). Cached per node, dropped with it."""
    key = id(q)
    if key not in _OPERANDS:
        _OPERANDS[key] = _pack(weight_rows)
        weakref.finalize(q, _OPERANDS.pop, key, None)
    return _OPERANDS[key]


def _pack(weight_rows: np.ndarray) -> Optional[WideOperands]:
    if LANES == 0 or ELEMENTS != 4 or weight_rows.size == 0 or weight_rows.shape[1] > MAX_DEPTH:
        return None
    w = weight_rows.astype(np.int64)
    if w.min() < INT16_RANGE[0] or w.max() > INT16_RANGE[1]:
        return None
    high = w >> 8
    low = np.concatenate([(w - 256 * high) - 128, np.ones((1, w.shape[1]), dtype=np.int64)])
    return WideOperands(pack_weight(high), pack_weight(low), w.sum(axis=1), w.shape[1])


@numba.njit(cache=True, nogil=True, inline="always")
def _add_plane(x, x_stride, p0, count, flip, high, low, quads, channels, acc_h, acc_l, scale, wide) -> None:
    """wide[r, m] += scale * (256 * H + L + 128 * S) of rows p0 + r of x (module docstring), r < count."""
    step = quads * LANES * ELEMENTS
    groups_h = high.size // step
    groups_l = low.size // step
    width_h = groups_h * LANES
    width_l = groups_l * LANES
    _block_dot(x, x_stride, p0, count, flip, high, quads, groups_h, acc_h, width_h)
    _block_dot(x, x_stride, p0, count, flip, low, quads, groups_l, acc_l, width_l)
    for r in range(count):
        h0 = np.uint64(r * width_h)
        l0 = np.uint64(r * width_l)
        s = np.int64(acc_l[l0 + np.uint64(channels)]) * 128
        for c in range(channels):
            i = np.uint64(c)
            wide[r, c] += scale * (np.int64(acc_h[h0 + i]) * 256 + np.int64(acc_l[l0 + i]) + s)


@numba.njit(cache=True, nogil=True, inline="always")
def _finish_block(wide, count, offset, prm, lim, lanes, out, p0, raw) -> int:
    """out rows p0.. = wide's (raw: as they are, int64) or their epilogue; returns the overflow count."""
    if raw:
        out[p0:p0 + count] = wide[:count]
        return 0
    return requant_positions(wide[:count], offset, prm, lim, lanes, out[p0:p0 + count])


@numba.njit(cache=True, nogil=True)
def _wide8(x, x_stride, flip, high, low, quads, offset, prm, lim, acc_h, acc_l, wide, out, raw) -> int:
    """out (P, M) = epilogue(A + offset) (raw: A) of the 8-bit rows of x (`int_dense.kernel_rows`)."""
    channels = out.shape[1]
    lanes = lane_params(offset, prm)
    over = 0
    for p0 in range(0, out.shape[0], BLOCK):
        count = min(BLOCK, out.shape[0] - p0)
        wide[:count, :] = 0
        _add_plane(x, x_stride, p0, count, flip, high, low, quads, channels, acc_h, acc_l, np.int64(1), wide)
        over += _finish_block(wide, count, offset, prm, lim, lanes, out, p0, raw)
    return over


@numba.njit(cache=True, nogil=True)
def _wide16(x, depth, high_flip, plane_low, plane_high, high, low, quads, offset, prm, lim, acc_h, acc_l, wide, out,
            raw) -> int:
    """`_wide8` of 16-bit codes x (flat uint16, P rows of `depth`), their byte planes split a block at a time
    into plane_low, plane_high (uint8, zeros past depth): 256 * (high plane's A) + (low plane's A)."""
    channels = out.shape[1]
    lanes = lane_params(offset, prm)
    x_stride = quads * LANE_BYTES
    over = 0
    for p0 in range(0, out.shape[0], BLOCK):
        count = min(BLOCK, out.shape[0] - p0)
        _split(x, p0, count, depth, high_flip, plane_low, plane_high, quads * ELEMENTS)
        wide[:count, :] = 0
        _add_plane(plane_low, x_stride, 0, count, NO_FLIP, high, low, quads, channels, acc_h, acc_l, np.int64(1),
                   wide)
        _add_plane(plane_high, x_stride, 0, count, NO_FLIP, high, low, quads, channels, acc_h, acc_l, np.int64(256),
                   wide)
        over += _finish_block(wide, count, offset, prm, lim, lanes, out, p0, raw)
    return over


def _run(codes: np.ndarray, ops: WideOperands, offset, prm, lim, out: np.ndarray, raw: bool) -> int:
    width_h, width_l = ops.high.shape[0] * LANES, ops.low.shape[0] * LANES
    acc_h = scratch("int_wide_high", (BLOCK * width_h,), np.int32)
    acc_l = scratch("int_wide_low", (BLOCK * width_l,), np.int32)
    wide = scratch("int_wide_acc", (BLOCK, out.shape[1]), np.int64)
    high, low = ops.high.reshape(-1), ops.low.reshape(-1)
    if codes.dtype.itemsize == 1:
        x, stride, flip = kernel_rows(codes, ops.quads)
        return int(_wide8(x, stride, flip, high, low, ops.quads, offset, prm, lim, acc_h, acc_l, wide, out, raw))
    x = np.ascontiguousarray(codes).reshape(-1).view(np.uint16)
    planes = np.zeros((2, BLOCK * ops.quads * ELEMENTS), dtype=np.uint8)
    return int(_wide16(x, codes.shape[1], np.uint8(0x80 if codes.dtype == np.int16 else 0), planes[0], planes[1],
                       high, low, ops.quads, offset, prm, lim, acc_h, acc_l, wide, out, raw))


def wide_codes(codes: np.ndarray, ops: WideOperands, offset: np.ndarray, packed_stage, out: np.ndarray) -> int:
    """out (P, M) = the epilogue of the exact dot products of codes (P, K; 8- or 16-bit) with the layer's 16-bit
    weight plus `offset` (int64 (M,), the zero point of the unsigned codes folded in); the overflow count."""
    return _run(codes, ops, offset, packed_stage[0], packed_stage[1], out, False)


def wide_acc(codes: np.ndarray, ops: WideOperands) -> np.ndarray:
    """The int64 (P, M) dot products sum_k u[p, k] w[m, k] of codes (P, K; 8- or 16-bit, read as their unsigned
    values u) with the layer's 16-bit weight."""
    out = np.empty((codes.shape[0], ops.weight_sum.shape[0]), dtype=np.int64)
    none = np.zeros(out.shape[1], dtype=np.int64)
    _run(codes, ops, none, np.zeros((8, out.shape[1]), dtype=np.int64), np.zeros(7, dtype=np.int64), out, True)
    return out
