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
code ^ 0x80 is the high byte of u (the tiles' sign flip, as for int8 codes); the low byte is the code's own.
16-bit outputs need nothing more: the epilogue clamps to the output type's range and stores in its dtype.
"""
from __future__ import annotations

import numba
import numpy as np

from ops.compiled.int_dense import BLOCK, FLIP_SIGN, NO_FLIP, DenseOperands, _block_dot
from ops.compiled.requant import FAST, HI, LO, SIGN_BIT, SUB, lane_params, requant_positions
from ops.compiled.scratch import scratch
from ops.compiled.vnni import ELEMENTS, LANE_BYTES, LANES

U16_OFFSET = 1 << 15  # int16 codes read as x + 32768


def zero_point16(codes: np.ndarray, zx: int) -> int:
    """zp_u of the unsigned 16-bit values u the kernel reads for codes of this dtype (module docstring)."""
    return zx + U16_OFFSET if codes.dtype == np.int16 else zx


def byte_planes(codes: np.ndarray, quads: int) -> tuple[np.ndarray, np.ndarray, int, np.uint32]:
    """(low bytes, high bytes, row stride in bytes, flip) of (P, K) 16-bit codes as the tiles read them: two flat
    byte planes of P rows (zero-padded to the kernel's depth); flip turns the int16 high byte into u's. For
    `vpmaddwd` the planes are uint16 rows (flip 0, the high bytes already flipped)."""
    pairs = np.ascontiguousarray(codes).view(np.uint8).reshape(codes.shape[0], codes.shape[1], 2)  # little-endian: (low, high)
    signed = codes.dtype == np.int16
    stride = quads * LANE_BYTES
    if ELEMENTS == 4:
        planes = np.zeros((2, codes.shape[0], stride), dtype=np.uint8)
        np.copyto(planes[:, :, :codes.shape[1]], pairs.transpose(2, 0, 1))
        return planes[0].reshape(-1), planes[1].reshape(-1), stride, FLIP_SIGN if signed else NO_FLIP
    planes = np.zeros((2, codes.shape[0], 2 * quads), dtype=np.uint16)
    planes[0, :, :codes.shape[1]] = pairs[:, :, 0]
    if signed:
        np.bitwise_xor(pairs[:, :, 1], np.uint8(0x80), out=planes[1, :, :codes.shape[1]], casting="unsafe")
    else:
        planes[1, :, :codes.shape[1]] = pairs[:, :, 1]
    return planes[0].reshape(-1).view(np.uint8), planes[1].reshape(-1).view(np.uint8), stride, NO_FLIP


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
def _dense_codes16(low, high, x_stride, flip, w, quads, offset, prm, lim, acc_low, acc_high, wide, out) -> int:
    """out (P, M) = epilogue(256 * (high plane . w) + (low plane . w) + offset); returns the overflow count."""
    groups = w.size // (quads * LANES * ELEMENTS)
    width = groups * LANES
    channels = out.shape[1]
    lanes = lane_params(offset, prm)
    flat = out.reshape(-1)
    over = 0
    for p0 in range(0, out.shape[0], BLOCK):
        count = min(BLOCK, out.shape[0] - p0)
        _block_dot(low, x_stride, p0, count, NO_FLIP, w, quads, groups, acc_low, width)
        _block_dot(high, x_stride, p0, count, flip, w, quads, groups, acc_high, width)
        if lim[FAST] != 0:
            _rows64_pair(acc_low, acc_high, width, count, channels, lanes, prm[SUB], lim[LO], lim[HI], flat,
                         p0 * channels)
        else:
            _combine(acc_low, acc_high, width, count, channels, wide)
            over += requant_positions(wide[:count], offset, prm, lim, lanes, out[p0:p0 + count])
    return over


@numba.njit(cache=True, nogil=True)
def _dense_acc16(low, high, x_stride, flip, w, quads, acc_low, acc_high, out) -> None:
    """out (P, M) int64 = 256 * (high plane . w) + (low plane . w)."""
    groups = w.size // (quads * LANES * ELEMENTS)
    width = groups * LANES
    for p0 in range(0, out.shape[0], BLOCK):
        count = min(BLOCK, out.shape[0] - p0)
        _block_dot(low, x_stride, p0, count, NO_FLIP, w, quads, groups, acc_low, width)
        _block_dot(high, x_stride, p0, count, flip, w, quads, groups, acc_high, width)
        _combine(acc_low, acc_high, width, count, out.shape[1], out[p0:p0 + count])


def _scratch(ops: DenseOperands) -> tuple[np.ndarray, np.ndarray]:
    width = ops.packed.shape[0] * LANES
    return (scratch("int_dense16_low", (BLOCK * width,), np.int32),
            scratch("int_dense16_high", (BLOCK * width,), np.int32))


def dense_codes16(codes: np.ndarray, ops: DenseOperands, offset: np.ndarray, packed_stage, out: np.ndarray) -> int:
    """out (P, M) = the epilogue of the exact dot products of 16-bit codes (P, K; int16 or uint16) with the
    layer's weight plus `offset` (int64 (M,), the zero point of u already folded in: `zero_point16`);
    returns the overflow count."""
    low, high, stride, flip = byte_planes(codes, ops.quads)
    acc_low, acc_high = _scratch(ops)
    wide = scratch("int_dense16_wide", (BLOCK, out.shape[1]), np.int64)
    return int(_dense_codes16(low, high, stride, flip, ops.packed.reshape(-1), ops.quads, offset, packed_stage[0],
                              packed_stage[1], acc_low, acc_high, wide, out))


def dense_acc16(codes: np.ndarray, ops: DenseOperands) -> np.ndarray:
    """The int64 (P, M) dot products sum_k u[p, k] w[m, k] of 16-bit codes (P, K; int16 or uint16, read as the
    unsigned values u of the module docstring) with the layer's weight."""
    low, high, stride, flip = byte_planes(codes, ops.quads)
    acc_low, acc_high = _scratch(ops)
    out = np.empty((codes.shape[0], ops.weight_sum.shape[0]), dtype=np.int64)
    _dense_acc16(low, high, stride, flip, ops.packed.reshape(-1), ops.quads, acc_low, acc_high, out)
    return out
