"""Dense (groups = 1) convolution as one exact float BLAS GEMM with the requant epilogue fused after it.

    A[n, m, p] = sum_k w[m, k] * cols[n, k, p]  +  (b_q[m] - zp_x * sum_k w[m, k])
    y_q[n, m, p] = epilogue(A)      (`ops.compiled.requant`: saturation if unproven, M/2^N, zp, clamp)

cols are the raw input codes (the input itself for a pointwise 1x1 convolution, else `ops.conv_kernels.im2col`
of the input padded with zp_x), w the centered weight w_q - zp_w; the zero-point fold is the numpy path's.
The GEMM runs in float32 when K * max|x_q| * max|w| < 2^24, in float64 below 2^53 (the exactness bound of
`ops.backend`: every partial sum is an integer the float type represents, whatever the summation order), so
the float result holds the exact integer dot product; the epilogue converts it to int64 as it reads it,
instead of a separate int32 pass. Deeper products (int64 matmul) run the numpy path.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import numpy as np

from ops.backend import dtype_absmax, matmul_method
from ops.compiled.requant import finish_channels, pack_stage
from ops.compiled.scratch import scratch
from ops.conv_kernels import im2col, pad_input

# (float weight (M, K), offset (M,)) by (id(q), float type), dropped with the quantized node
_OPERANDS: dict = {}


def _operands(q, ftype, zx: int) -> tuple[np.ndarray, np.ndarray]:
    key = (id(q), ftype)
    if key not in _OPERANDS:
        weight = np.ascontiguousarray(q.weight.reshape(q.weight.shape[0], -1), dtype=ftype)
        _OPERANDS[key] = (weight, (q.bias - zx * q.weight_sum).astype(np.int64))
        weakref.finalize(q, _OPERANDS.pop, key, None)
    return _OPERANDS[key]


def conv_dense(x: np.ndarray, q, geom, acc_bits: Optional[int]) -> Optional[tuple[np.ndarray, int]]:
    """(output codes, overflow count) of a groups = 1 Conv (`ops.conv.QuantizedConv` q, resolved geometry);
    None when the dot product needs int64 or the stage is not laid out per channel."""
    if q.groups != 1 or x.dtype.kind not in "iu":
        return None
    channels = q.weight.shape[0]
    k = math.prod(q.weight.shape[1:])
    method = matmul_method(k, dtype_absmax(x), q.weight_absmax)
    packed = pack_stage(q.stage, channels, acc_bits)
    if method == "int64" or packed is None:
        return None
    ftype = np.float32 if method == "float32" else np.float64
    zx = int(q.in_qparams[0].zero_point[0])
    weight, offset = _operands(q, ftype, zx)
    n = x.shape[0]
    if geom.is_pointwise:
        cols = x.reshape(n, x.shape[1], -1)
        out_spatial = x.shape[2:]
    else:
        xp = pad_input(x, geom, zx)
        cols = im2col(xp, geom)
        out_spatial = geom.padded_out_shape(xp.shape[2:])
    operand = scratch("gemm_operand", cols.shape, ftype)
    np.copyto(operand, cols, casting="unsafe")  # integer codes: exact in the float type
    acc = np.matmul(weight, operand, out=scratch("gemm_result", (n, channels, cols.shape[-1]), ftype))
    out = np.empty((n, channels) + tuple(out_spatial), dtype=q.stage.dtype)
    over = finish_channels(acc, offset, packed, out.reshape(acc.shape))
    return out, over
