"""Dense convolution and Gemm on 16-bit input codes through the 8-bit integer dot-product tiles, exactly.

A 16-bit code is read as the unsigned value u (x_q itself for uint16, x_q + 32768 for int16; zp_u likewise,
u - zp_u = x_q - zp_x) and split into its bytes, u = 256 * h + l with h, l in 0..255. Each byte plane is a
row of unsigned 8-bit codes, which `ops.compiled.int_dense`'s tiles multiply with the int8 (int16 for
`vpmaddwd`) weight under the bound they already check when the weight is packed:

    H[p, m] = sum_k h[p, k] * w[m, k],   L[p, m] = sum_k l[p, k] * w[m, k],
    |H|, |L| <= 255 * max_m sum_k |w[m, k]| < 2^31                               (exact int32)
    A[p, m] = 256 * H[p, m] + L[p, m]  +  (b_q[m] - zp_u * sum_k w[m, k])      (int64)
    y_q[p, m] = epilogue(A)      (`ops.compiled.requant`: saturation if unproven, M/2^N, zp, clamp)

|256 H + L| <= 65535 * max_m sum_k |w[m, k]| < 2^47. A equals the numpy path's int64 accumulator
sum_k x_q w + (b_q - zp_x sum_k w) (`ops.linear.finish_accumulator`), and the epilogue is the numpy path's
formula on it (`requant.requant_positions`, the 64-bit lanes of `ops.compiled.epilogue` in its common case):
the same codes, so the LSB bound of `ops.conv`, `ops.gemm` holds unchanged. For int16 the high byte of the
code ^ 0x80 is the high byte of u; the low byte is the code's own. The planes are split a block of rows at a
time (`BLOCK`, as the 8-bit kernel runs) into small buffers that stay in L1: no pass over the whole input.
16-bit outputs need nothing more: the epilogue clamps to the output type's range and stores in its dtype.
"""
from __future__ import annotations

import numba
import numpy as np

from ops.compiled.int_dense import BLOCK, NO_FLIP, DenseOperands, _block_dot
from ops.compiled.requant import FAST, HI, LO, SIGN_BIT, SUB, lane_params, requant_positions
from ops.compiled.scratch import scratch
from ops.compiled.vnni import ELEMENTS, LANE_BYTES, LANES

U16_OFFSET = 1 << 15  # int16 codes read as x + 32768


def zero_point16(codes: np.ndarray, zx: int) -> int:
    """zp_u of the unsigned 16-bit values u the kernel reads for codes of this dtype (module docstring)."""
    return zx + U16_OFFSET if codes.dtype == np.int16 else zx


# a byte plane's element: the byte itself for `vpdpbusd`, zero-extended to 16 bits for `vpmaddwd`
PLANE_DTYPE = np.dtype(np.uint8 if ELEMENTS == 4 else np.uint16)


@numba.njit(cache=True, nogil=True, inline="always")
def _split(x, p0, count, depth, high_flip, low, high, columns) -> None:
    """low[r * columns + k], high[r * columns + k] = the low byte and the high byte (^ high_flip: u's for int16)
    of the 16-bit code of row p0 + r, column k (x: the flat codes (P rows of `depth`) as uint16), for r < count,
    k < depth; the columns past depth are left as they are (zeros). Whole 16-bit loads narrowed, which
    vectorizes (byte-strided loads do not)."""
    for r in range(count):
        s0 = np.uint64((p0 + r) * depth)
        d0 = np.uint64(r * columns)
        for k in range(depth):
            i = np.uint64(k)
            v = x[s0 + i]
            low[d0 + i] = np.uint8(v & np.uint16(0xFF))
            high[d0 + i] = np.uint8(v >> np.uint16(8)) ^ high_flip


@numba.njit(cache=True, nogil=True, inline="always")
def _combine(acc_low, acc_high, width, count, channels, wide) -> None:
    """wide[r, c] = 256 * acc_high[r * width + c] + acc_low[r * width + c] in int64, r < count, c < channels."""
    for r in range(count):
        a0 = np.uint64(r * width)
        for c in range(channels):
            i = np.uint64(c)
            wide[r, c] = np.int64(acc_high[a0 + i]) * 256 + np.int64(acc_low[a0 + i])


@numba.njit(cache=True, nogil=True, inline="always")
def _rows64_pair(acc_low, acc_high, width, count, channels, lanes, sub, lo, hi, out, out_at) -> None:
    """The epilogue's common case (`ops.compiled.epilogue._rows64`) on A = 256 * high + low, 64-bit lanes."""
    m32, k_row, shift = lanes
    for r in range(count):
        a0 = np.uint64(r * width)
        o0 = np.uint64(out_at + r * channels)
        for c in range(channels):
            i = np.uint64(c)
            a = np.int64(acc_high[a0 + i]) * 256 + np.int64(acc_low[a0 + i])
            y = np.int64((np.uint64(a * np.int64(m32[i]) + k_row[i]) ^ SIGN_BIT) >> shift[i])
            out[o0 + i] = min(max(y - sub[i], lo), hi)


@numba.njit(cache=True, nogil=True)
def _dense_codes16(x, depth, high_flip, low, high, low8, high8, w, quads, offset, prm, lim, acc_low, acc_high, wide,
                   out) -> int:
    """out (P, M) = epilogue(256 * (high plane . w) + (low plane . w) + offset) of the 16-bit codes x (flat
    uint16, P rows of `depth`); the planes are split a block at a time into low, high (BLOCK rows of
    quads * E plane elements, zero past depth; low8, high8 their bytes). Returns the overflow count."""
    x_stride = quads * LANE_BYTES
    groups = w.size // (quads * LANES * ELEMENTS)
    width = groups * LANES
    channels = out.shape[1]
    lanes = lane_params(offset, prm)
    flat = out.reshape(-1)
    over = 0
    for p0 in range(0, out.shape[0], BLOCK):
        count = min(BLOCK, out.shape[0] - p0)
        _split(x, p0, count, depth, high_flip, low, high, quads * ELEMENTS)
        _block_dot(low8, x_stride, 0, count, NO_FLIP, w, quads, groups, acc_low, width)
        _block_dot(high8, x_stride, 0, count, NO_FLIP, w, quads, groups, acc_high, width)
        if lim[FAST] != 0:
            _rows64_pair(acc_low, acc_high, width, count, channels, lanes, prm[SUB], lim[LO], lim[HI], flat,
                         p0 * channels)
        else:
            _combine(acc_low, acc_high, width, count, channels, wide)
            over += requant_positions(wide[:count], offset, prm, lim, lanes, out[p0:p0 + count])
    return over


@numba.njit(cache=True, nogil=True)
def _dense_acc16(x, depth, high_flip, low, high, low8, high8, w, quads, acc_low, acc_high, out) -> None:
    """out (P, M) int64 = 256 * (high plane . w) + (low plane . w) (`_dense_codes16`'s operands)."""
    x_stride = quads * LANE_BYTES
    groups = w.size // (quads * LANES * ELEMENTS)
    width = groups * LANES
    for p0 in range(0, out.shape[0], BLOCK):
        count = min(BLOCK, out.shape[0] - p0)
        _split(x, p0, count, depth, high_flip, low, high, quads * ELEMENTS)
        _block_dot(low8, x_stride, 0, count, NO_FLIP, w, quads, groups, acc_low, width)
        _block_dot(high8, x_stride, 0, count, NO_FLIP, w, quads, groups, acc_high, width)
        _combine(acc_low, acc_high, width, count, out.shape[1], out[p0:p0 + count])


def _operands(codes: np.ndarray, ops: DenseOperands) -> tuple:
    """(x, depth, high_flip, low, high, low8, high8, w, quads): the kernels' operands for (P, K) 16-bit codes.
    The planes are fresh zeros (their padding columns must be zero; a block's planes are small)."""
    x = np.ascontiguousarray(codes).reshape(-1).view(np.uint16)
    planes = np.zeros((2, BLOCK * ops.quads * ELEMENTS), dtype=PLANE_DTYPE)
    return (x, codes.shape[1], np.uint8(0x80 if codes.dtype == np.int16 else 0), planes[0], planes[1],
            planes[0].view(np.uint8), planes[1].view(np.uint8), ops.packed.reshape(-1), ops.quads)


def _accumulators(ops: DenseOperands) -> tuple[np.ndarray, np.ndarray]:
    width = ops.packed.shape[0] * LANES
    return (scratch("int_dense16_low", (BLOCK * width,), np.int32),
            scratch("int_dense16_high", (BLOCK * width,), np.int32))


def dense_codes16(codes: np.ndarray, ops: DenseOperands, offset: np.ndarray, packed_stage, out: np.ndarray) -> int:
    """out (P, M) = the epilogue of the exact dot products of 16-bit codes (P, K; int16 or uint16) with the
    layer's weight plus `offset` (int64 (M,), the zero point of u already folded in: `zero_point16`);
    returns the overflow count."""
    wide = scratch("int_dense16_wide", (BLOCK, out.shape[1]), np.int64)
    return int(_dense_codes16(*_operands(codes, ops), offset, packed_stage[0], packed_stage[1], *_accumulators(ops),
                              wide, out))


def dense_acc16(codes: np.ndarray, ops: DenseOperands) -> np.ndarray:
    """The int64 (P, M) dot products sum_k u[p, k] w[m, k] of 16-bit codes (P, K; int16 or uint16, read as the
    unsigned values u of the module docstring) with the layer's weight."""
    out = np.empty((codes.shape[0], ops.weight_sum.shape[0]), dtype=np.int64)
    _dense_acc16(*_operands(codes, ops), *_accumulators(ops), out)
    return out
