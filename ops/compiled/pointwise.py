"""Dense (groups = 1) convolution and Gemm as one exact float BLAS GEMM with the requant epilogue fused after it.

    A[n, p, m] = sum_k cols[n, p, k] * w[m, k]  +  (b_q[m] - zp_x * sum_k w[m, k])
    y_q[n, p, m] = epilogue(A)      (`ops.compiled.requant`: saturation if unproven, M/2^N, zp, clamp)

cols are the raw input codes (the input itself for a pointwise 1x1 convolution, else `ops.conv_kernels.im2col`
of the input padded with zp_x), w the centered weight w_q - zp_w; the zero-point fold is the numpy path's.
The convolution runs channels innermost (`ops.compiled.layout`): the GEMM reads a channels-last input as it
is (any other through BLAS's transposed operand) and writes positions x channels, the epilogue runs along
the channels, and the output is the (N, C, *spatial) view of the channels-last codes.
Gemm is the same with A (M, K) @ w (K, N) and the output channels along N.
The GEMM runs in float32 when max|x_q| * max_m sum_k |w[m, k]| <= 2^24, in float64 up to 2^53: every
partial sum of a row's products, in whatever order the BLAS adds them, is an integer of magnitude at most
that bound, which the float type represents exactly (the bound of `ops.backend`, with the weight rows' L1
norms in place of K * max|w|: far tighter for real weights, so that deep layers stay in float32). The float
result is then the exact integer dot product; the epilogue converts it to int64 as it reads it, instead of
a separate int32 pass. Larger bounds (int64 matmul) run the numpy path.
The same integers as the numpy path, so the LSB bound stated in `ops.conv`, `ops.gemm` holds unchanged.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import numpy as np

from ops.backend import dtype_absmax
from ops.compiled.int_dense import dense_acc, dense_codes, dense_operands, window_rows, zero_point
from ops.compiled.int_dense16 import dense_acc16, dense_codes16, zero_point16
from ops.compiled.int_wide_weight import WideOperands, wide_acc, wide_codes, wide_operands
from ops.compiled.layout import channels_first, channels_last
from ops.compiled.requant import finish, finish_lanes, pack_stage
from ops.compiled.scratch import scratch
from ops.compiled.vnni import ELEMENTS
from ops.conv_kernels import im2col, pad_input

FLOAT32_EXACT = 1 << 24
FLOAT64_EXACT = 1 << 53
# (float weight transposed (K, M), offset (M,)) by (id(q), float type), and the rows' largest L1 norm by id(q);
# dropped with the quantized node
_OPERANDS: dict = {}


def _cached(key, q, make):
    if key not in _OPERANDS:
        _OPERANDS[key] = make()
        weakref.finalize(q, _OPERANDS.pop, key, None)
    return _OPERANDS[key]


def _operands(q, ftype, zx: int) -> tuple[np.ndarray, np.ndarray]:
    return _cached((id(q), ftype), q, lambda: (
        np.ascontiguousarray(q.weight.reshape(q.weight.shape[0], -1).T, dtype=ftype),
        (q.bias - zx * q.weight_sum).astype(np.int64)))


def _row_l1(q) -> int:
    """max_m sum_k |w[m, k]| of a convolution's centered weight (M, K...)."""
    return _cached((id(q), "l1"), q, lambda: int(
        np.abs(q.weight.reshape(q.weight.shape[0], -1).astype(np.int64)).sum(axis=1).max()))


def _column_l1(q) -> int:
    """max_n sum_k |w[k, n]| of a Gemm's centered weight (K, N)."""
    return _cached((id(q), "l1"), q, lambda: int(np.abs(q.weight.astype(np.int64)).sum(axis=0).max()))


def _int_operands(q, weight_rows: np.ndarray, codes: np.ndarray):
    """The packed weight of the integer dot-product kernels for 8- or 16-bit codes: int8 (`ops.compiled.int_dense`),
    else int16 as two planes (`ops.compiled.int_wide_weight`); None when neither covers it."""
    if codes.dtype.itemsize not in (1, 2):
        return None
    ops = dense_operands(q, weight_rows)
    return ops if ops is not None else wide_operands(q, weight_rows)


def _int_kernels(codes: np.ndarray, ops):
    """(zp_u, codes, acc) functions of the integer dot-product kernels for codes of this width and the packed
    weight `ops`: the 8-bit ones of `ops.compiled.int_dense`, the byte planes of `ops.compiled.int_dense16` for
    16-bit codes, `ops.compiled.int_wide_weight` for a 16-bit weight."""
    zp_of = zero_point if codes.dtype.itemsize == 1 else zero_point16
    if isinstance(ops, WideOperands):
        return zp_of, wide_codes, wide_acc
    if codes.dtype.itemsize == 1:
        return zp_of, dense_codes, dense_acc
    return zp_of, dense_codes16, dense_acc16


def gemm_dense(a: np.ndarray, q, acc_bits: Optional[int]) -> Optional[tuple[np.ndarray, int]]:
    """(output codes, overflow count) of a Gemm (`ops.gemm.QuantizedGemm` q) on A (M, K) codes; None when
    the bound needs int64 or the bias is not one value per output column."""
    if a.ndim != 2 or a.dtype.kind not in "iu" or np.ndim(q.bias) > 1:
        return None
    za = int(q.in_qparams[0].zero_point[0])
    ops = _int_operands(q, q.weight.T, a)
    if ops is not None:
        zp_of, codes_of, acc_of = _int_kernels(a, ops)
        zp_u = zp_of(a, za)
        offset = _cached((id(q), "int", zp_u), q, lambda: q.bias - zp_u * ops.weight_sum)
        packed = pack_stage(q.stage, ops.weight_sum.shape[0], acc_bits)
        if packed is None:
            return finish(acc_of(a, ops), offset, q.stage, acc_bits)
        out = np.empty((a.shape[0], ops.weight_sum.shape[0]), dtype=q.stage.dtype)
        return out, codes_of(a, ops, offset, packed, out)
    bound = dtype_absmax(a) * _column_l1(q)
    if bound > FLOAT64_EXACT:
        return None
    ftype = np.float32 if bound <= FLOAT32_EXACT else np.float64
    weight = _cached((id(q), ftype), q, lambda: np.ascontiguousarray(q.weight, dtype=ftype))
    operand = scratch("gemm_operand", a.shape, ftype)
    np.copyto(operand, a, casting="unsafe")
    acc = np.matmul(operand, weight, out=scratch("gemm_result", (a.shape[0], weight.shape[1]), ftype))
    return finish(acc, q.bias - za * q.weight_sum, q.stage, acc_bits)


def conv_dense(x: np.ndarray, q, geom, acc_bits: Optional[int]) -> Optional[tuple[np.ndarray, int]]:
    """(output codes, overflow count) of a groups = 1 Conv (`ops.conv.QuantizedConv` q, resolved geometry);
    None when the dot product needs int64 or the stage is not laid out per channel."""
    if q.groups != 1 or x.dtype.kind not in "iu":
        return None
    channels = q.weight.shape[0]
    packed = pack_stage(q.stage, channels, acc_bits)
    if packed is None:
        return None
    zx = int(q.in_qparams[0].zero_point[0])
    n = x.shape[0]
    ops = _int_operands(q, q.weight.reshape(channels, -1), x)
    if ops is not None:
        return _conv_int(x, q, geom, ops, zx, packed)
    bound = dtype_absmax(x) * _row_l1(q)
    if bound > FLOAT64_EXACT:
        return None
    ftype = np.float32 if bound <= FLOAT32_EXACT else np.float64
    weight_t, offset = _operands(q, ftype, zx)
    rows = channels_last(x) if geom.is_pointwise else None
    if rows is not None:  # channels-last codes: (N, P, K) as they are
        rows = rows.reshape(n, -1, x.shape[1])
        operand = scratch("gemm_operand", rows.shape, ftype)
        np.copyto(operand, rows, casting="unsafe")  # integer codes: exact in the float type
        out_spatial = x.shape[2:]
    else:
        if geom.is_pointwise:
            cols = x.reshape(n, x.shape[1], -1)
            out_spatial = x.shape[2:]
        else:
            xp = pad_input(x, geom, zx)
            cols = im2col(xp, geom)
            out_spatial = geom.padded_out_shape(xp.shape[2:])
        operand = scratch("gemm_operand", cols.shape, ftype)
        np.copyto(operand, cols, casting="unsafe")
        operand = operand.transpose(0, 2, 1)  # (N, P, K): BLAS reads the operand transposed
    acc = np.matmul(operand, weight_t, out=scratch("gemm_result", (n, operand.shape[1], channels), ftype))
    data = np.empty((n,) + tuple(out_spatial) + (channels,), dtype=q.stage.dtype)
    over = finish_lanes(acc, offset, packed, data.reshape(acc.shape))
    return channels_first(data), over


def _conv_int(x: np.ndarray, q, geom, ops, zx: int, packed) -> tuple[np.ndarray, int]:
    """`conv_dense` on the integer dot products of `ops.compiled.int_dense` (8-bit codes, an int8 weight; 16-bit
    codes as two byte planes, `ops.compiled.int_dense16`; a 16-bit weight as two planes,
    `ops.compiled.int_wide_weight`)."""
    n, channels = x.shape[0], q.weight.shape[0]
    zp_of, codes_of, _ = _int_kernels(x, ops)
    zp_u = zp_of(x, zx)
    offset = _cached((id(q), "int", zp_u), q, lambda: q.bias - zp_u * ops.weight_sum)
    if geom.is_pointwise:
        rows = channels_last(x)
        if rows is None:
            rows = np.ascontiguousarray(np.moveaxis(x, 1, -1))
        out_spatial = x.shape[2:]
    elif x.ndim == 4:  # the windows gathered straight into rows, zero-padded to the kernel's groups
        out_spatial = geom.out_shape(x.shape[2:])
        raw = np.dtype(f"u{x.dtype.itemsize}")  # the codes' bits, the padding zx's
        rows = np.zeros((n * math.prod(out_spatial), ops.quads * ELEMENTS), dtype=raw)
        window_rows(x.view(raw), raw.type(zx & np.iinfo(raw).max), geom.kernel[0], geom.kernel[1], geom.strides[0],
                    geom.strides[1], geom.dilations[0], geom.dilations[1], geom.pads_begin[0], geom.pads_begin[1],
                    rows, out_spatial[0], out_spatial[1])
        rows = rows.view(x.dtype)
    else:
        xp = pad_input(x, geom, zx)
        cols = im2col(xp, geom)  # (N, K, P)
        rows = np.ascontiguousarray(cols.transpose(0, 2, 1))
        out_spatial = geom.padded_out_shape(xp.shape[2:])
    data = np.empty((n,) + tuple(out_spatial) + (channels,), dtype=q.stage.dtype)
    over = codes_of(rows.reshape(-1, rows.shape[-1]), ops, offset, packed, data.reshape(-1, channels))
    return channels_first(data), over
