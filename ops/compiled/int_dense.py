"""Dense convolution and Gemm on integer dot products (`ops.compiled.vnni` tiles), requant epilogue fused.

    A[p, m] = sum_k u[p, k] * w[m, k]  +  (b_q[m] - zp_u * sum_k w[m, k])          (int32 dot product)
    y_q[p, m] = epilogue(A)      (`ops.compiled.requant`: saturation if unproven, M/2^N, zp, clamp)

u are the input codes as unsigned bytes: x_q itself for uint8, x_q + 128 for int8 (zp_u = zp_x, or zp_x + 128:
u - zp_u = x_q - zp_x), one row of K codes per pixel (channels-last); w = w_q - zp_w the centered weight,
which must fit int8. Every partial result is a wrapped int32; the final one is the true sum because

    |sum_k u[p, k] w[m, k]| <= 255 * max_m sum_k |w[m, k]| < 2^31,

checked once per layer when its weight is packed (`DenseOperands`); a layer beyond it, or a CPU without VNNI,
keeps the float-BLAS path of `ops.compiled.pointwise` (a weight past int8 but within int16 runs
`ops.compiled.int_wide_weight`; 16-bit codes `ops.compiled.int_dense16`). The offset is added in
int64 by the epilogue, which is the numpy path's `finish_accumulator` on the same integer A: the same codes.

Pixels run in blocks of `BLOCK` rows (their codes stay in L1), each block in tiles of `ROWS` rows x 32 output
channels (two vectors of 16, 12 accumulators; a last group of 16 channels runs a one-vector tile); the rows
left after the last full tile run one by one (a Gemm's single row streams the weight once). The epilogue
then runs along the block's channels.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import numba
import numpy as np

from ops.compiled.epilogue import params32, requant_rows
from ops.compiled.requant import lane_params
from ops.compiled.scratch import scratch
from ops.compiled.vnni import ELEMENTS, LANE_BYTES, LANES, WEIGHT_RANGE, pack_weight, tile_kernel

INT32_LIMIT = 1 << 31
U8_MAX = 255
FLIP_SIGN = np.uint32(0x80808080)  # int8 bytes read as uint8 codes + 128
NO_FLIP = np.uint32(0)
ROWS = 6  # pixels per tile
BLOCK = 8 * ROWS  # pixels per block (codes and accumulators in L1 while the epilogue reads them)

_tile_two = tile_kernel(ROWS, 2)
_tile_one = tile_kernel(ROWS, 1)
_row_two = tile_kernel(1, 2)
_row_one = tile_kernel(1, 1)


@dataclass(frozen=True)
class DenseOperands:
    """A layer's weight packed for the tiles (`vnni.pack_weight` of the centered (M, K) weight), its row sums
    (int64, (M,)) and K."""

    packed: np.ndarray
    weight_sum: np.ndarray
    depth: int

    @property
    def quads(self) -> int:
        return self.packed.shape[1]


_OPERANDS: dict = {}


def dense_operands(q, weight_rows: np.ndarray) -> Optional[DenseOperands]:
    """The packed operands of the quantized node q whose centered weight, one row per output channel, is
    `weight_rows` (M, K); None when the integer kernel cannot run it exactly (no VNNI, a weight outside int8,
    or 255 * max_m sum_k |w[m, k]| >= 2^31). Cached per node, dropped with it."""
    key = id(q)
    if key not in _OPERANDS:
        _OPERANDS[key] = _pack(weight_rows)
        weakref.finalize(q, _OPERANDS.pop, key, None)
    return _OPERANDS[key]


def _pack(weight_rows: np.ndarray) -> Optional[DenseOperands]:
    if LANES == 0 or weight_rows.size == 0:
        return None
    w = weight_rows.astype(np.int64)
    if w.min() < WEIGHT_RANGE[0] or w.max() > WEIGHT_RANGE[1]:
        return None
    if U8_MAX * int(np.abs(w).sum(axis=1).max()) >= INT32_LIMIT:
        return None
    return DenseOperands(pack_weight(w), w.sum(axis=1), w.shape[1])


@numba.njit(cache=True, nogil=True, inline="always")
def _block_dot(x, x_stride, p0, count, flip, w, quads, groups, acc, width):
    """acc[r, :] (r < count <= BLOCK; a row of `width` int32) = the dot products of input row p0 + r with
    every packed channel group: per pair of groups (the last group alone when their count is odd), tiles of
    ROWS rows, then the rows left one at a time. Groups outermost: a pair's weight panel (32 x K bytes) stays
    in L1 while the block's rows pass over it."""
    w_stride = quads * LANES * ELEMENTS
    g = 0
    while g < groups:
        pair = g + 2 <= groups
        t = 0
        while t + ROWS <= count:
            at = (p0 + t) * x_stride
            if pair:
                _tile_two(x, at, x_stride, flip, w, g * w_stride, w_stride, quads, acc, t * width + g * LANES, width)
            else:
                _tile_one(x, at, x_stride, flip, w, g * w_stride, w_stride, quads, acc, t * width + g * LANES, width)
            t += ROWS
        while t < count:
            at = (p0 + t) * x_stride
            if pair:
                _row_two(x, at, x_stride, flip, w, g * w_stride, w_stride, quads, acc, t * width + g * LANES, width)
            else:
                _row_one(x, at, x_stride, flip, w, g * w_stride, w_stride, quads, acc, t * width + g * LANES, width)
            t += 1
        g += 2 if pair else 1


@numba.njit(cache=True, nogil=True)
def _dense_codes(x, x_stride, flip, w, quads, offset, prm, lim, acc, out) -> int:
    """out (P, M) = epilogue(dot products of the P rows of x with the packed weight + offset); overflows."""
    groups = w.size // (quads * LANES * ELEMENTS)
    width = groups * LANES
    channels = out.shape[1]
    lanes = lane_params(offset, prm)
    lanes32 = params32(offset, prm)
    flat = out.reshape(-1)
    over = 0
    for p0 in range(0, out.shape[0], BLOCK):
        count = min(BLOCK, out.shape[0] - p0)
        _block_dot(x, x_stride, p0, count, flip, w, quads, groups, acc, width)
        over += requant_rows(acc, width, count, channels, offset, prm, lim, lanes, lanes32, flat, p0 * channels,
                             out[p0:p0 + count])
    return over


@numba.njit(cache=True, nogil=True)
def _dense_acc(x, x_stride, flip, w, quads, acc, out) -> None:
    """out (P, M) int32 = the dot products of the P rows of x with the packed weight."""
    groups = w.size // (quads * LANES * ELEMENTS)
    width = groups * LANES
    grid = acc.reshape(-1, width)
    for p0 in range(0, out.shape[0], BLOCK):
        count = min(BLOCK, out.shape[0] - p0)
        _block_dot(x, x_stride, p0, count, flip, w, quads, groups, acc, width)
        out[p0:p0 + count] = grid[:count, :out.shape[1]]


@numba.njit(cache=True, nogil=True)
def window_rows(x, zx, kh, kw, sh, sw, dh, dw, pt, pl, rows, oh_count, ow_count) -> None:
    """rows[(n * OH + oh) * OW + ow, (c * KH + i) * KW + j] = x[n, c, oh * sh + i * dh - pt, ow * sw + j * dw - pl]
    (the byte zx where that is in the padding): im2col of a 2-D convolution's codes x (N, C, H, W, any layout)
    straight into the rows of the dense kernel, in the weight's (c, taps) order; columns past C * KH * KW are
    left as they are (zeros)."""
    n_count, channels, height, width = x.shape
    for n in range(n_count):
        for oh in range(oh_count):
            base = (n * oh_count + oh) * ow_count
            for c in range(channels):
                for i in range(kh):
                    ih = oh * sh + i * dh - pt
                    inside = 0 <= ih < height
                    for j in range(kw):
                        k = (c * kh + i) * kw + j
                        for ow in range(ow_count):
                            iw = ow * sw + j * dw - pl
                            if inside and 0 <= iw < width:
                                rows[base + ow, k] = x[n, c, ih, iw]
                            else:
                                rows[base + ow, k] = zx


def kernel_rows(codes: np.ndarray, quads: int) -> tuple[np.ndarray, int, np.uint32]:
    """(flat bytes, row stride in bytes, flip) the tiles read for (P, K) 8-bit codes: for `vpdpbusd` the codes
    themselves (copied only when K is not a multiple of 4: rows padded with zeros), the sign bit flipped by the
    kernel for int8 (flip); for `vpmaddwd` the unsigned codes (x, or x + 128 for int8) as uint16 rows of
    2 * quads values, zero-padded (flip 0)."""
    signed = codes.dtype == np.int8
    stride = quads * LANE_BYTES
    if ELEMENTS == 4:
        flip = FLIP_SIGN if signed else NO_FLIP
        if codes.shape[1] == stride and codes.flags.c_contiguous:
            return codes.reshape(-1).view(np.uint8), stride, flip
        padded = np.zeros((codes.shape[0], stride), dtype=np.uint8)
        padded[:, :codes.shape[1]] = codes.view(np.uint8)
        return padded.reshape(-1), stride, flip
    wide = scratch("int_dense_rows16", (codes.shape[0], 2 * quads), np.uint16)
    wide[:, codes.shape[1]:] = 0
    if signed:
        np.bitwise_xor(codes.view(np.uint8), np.uint8(0x80), out=wide[:, :codes.shape[1]], casting="unsafe")
    else:
        wide[:, :codes.shape[1]] = codes.view(np.uint8)
    return wide.reshape(-1).view(np.uint8), stride, NO_FLIP


def _accumulators(ops: DenseOperands) -> np.ndarray:
    return scratch("int_dense_acc", (BLOCK * ops.packed.shape[0] * LANES,), np.int32)


def zero_point(codes: np.ndarray, zx: int) -> int:
    """zp_u of the unsigned bytes the kernel reads for codes of this dtype (module docstring)."""
    return zx + 128 if codes.dtype == np.int8 else zx


def dense_codes(codes: np.ndarray, ops: DenseOperands, offset: np.ndarray, packed_stage, out: np.ndarray) -> int:
    """out (P, M) = the epilogue of the integer dot products of codes (P, K; int8 or uint8) with the layer's
    weight plus `offset` (int64 (M,), the zero point of the unsigned bytes already folded in:
    `zero_point`); returns the overflow count."""
    x, stride, flip = kernel_rows(codes, ops.quads)
    return int(_dense_codes(x, stride, flip, ops.packed.reshape(-1), ops.quads, offset, packed_stage[0],
                            packed_stage[1], _accumulators(ops), out))


def dense_acc(codes: np.ndarray, ops: DenseOperands) -> np.ndarray:
    """The int32 (P, M) dot products sum_k u[p, k] w[m, k] of codes (P, K; int8 or uint8, read as the unsigned
    bytes u of the module docstring) with the layer's weight."""
    x, stride, flip = kernel_rows(codes, ops.quads)
    out = np.empty((codes.shape[0], ops.weight_sum.shape[0]), dtype=np.int32)
    _dense_acc(x, stride, flip, ops.packed.reshape(-1), ops.quads, _accumulators(ops), out)
    return out
