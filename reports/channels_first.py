"""Codes in C order: the compiled convolutions hand over channels-last views (N, C, H, W with the channel
stride 1), and the report reads codes in C order (`reports.pair_sums`).

For 8-bit codes the copy is a compiled blocked transpose: each block of 16 positions x 16 channels is loaded as
sixteen 16-byte vectors (one per position) and transposed by four rounds of byte interleaving (vector shuffles),
then stored as sixteen vectors (one per channel); blocks of 8 x 8 along the leftover channels and positions are
read as eight 64-bit words and transposed by masked shifts (on a little-endian machine; numpy copies on any
other); what is left is copied byte by byte. numpy's copy
walks the output in C order and reads the input at the channel stride: 4.6-5 ms for the 58 channels-last
tensors of one EfficientNet-Lite0 image (6.9 M codes), where this kernel takes ~1 ms (0.06 ns per byte when the
tensor is in cache, the rest is memory traffic). Other dtypes and layouts are copied by numpy.
"""
from __future__ import annotations

import sys

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_M4 = np.uint64(0x00000000FFFFFFFF)
_M2 = np.uint64(0x0000FFFF0000FFFF)
_M1 = np.uint64(0x00FF00FF00FF00FF)
_S4 = np.uint64(32)
_S2 = np.uint64(16)
_S1 = np.uint64(8)


def _is_bytes(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.uint8 and arr.ndim == 1 and arr.layout == "C"


@intrinsic
def _load8(typingctx, arr, index):
    """The 8 bytes arr[index:index + 8] as one little-endian uint64 (an unaligned load; no bounds check)."""
    if not _is_bytes(arr):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        load = builder.load(pointer)
        load.align = 1
        return load

    return types.uint64(arr, types.intp), codegen


@intrinsic
def _store8(typingctx, arr, index, value):
    """arr[index:index + 8] = the 8 bytes of `value`, little-endian (an unaligned store; no bounds check)."""
    if not (_is_bytes(arr) and value == types.uint64):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], pointer).align = 1
        return context.get_dummy_value()

    return types.none(arr, types.intp, types.uint64), codegen


_LOW = [k for i in range(8) for k in (i, 16 + i)]  # unpack-low of two 16-byte vectors: bytes interleaved
_HIGH = [k for i in range(8, 16) for k in (i, 16 + i)]  # unpack-high


@intrinsic
def _transpose16(typingctx, src, i, src_stride, dst, o, dst_stride):
    """dst[o + c * dst_stride + p] = src[i + p * src_stride + c] for p, c < 16: sixteen 16-byte rows loaded, four
    rounds of byte interleaving of row k with row k + 8 (each round's output rows 2k, 2k + 1 the low and high
    halves: after four rounds row c holds column c), sixteen rows stored (unaligned; no bounds check)."""
    if not (_is_bytes(src) and _is_bytes(dst)):
        return None

    def codegen(context, builder, signature, args):
        src_data = context.make_array(signature.args[0])(context, builder, args[0]).data
        dst_data = context.make_array(signature.args[3])(context, builder, args[3]).data
        vector = ir.VectorType(ir.IntType(8), 16)
        intp = context.get_value_type(types.intp)
        rows = []
        for k in range(16):
            at = builder.add(args[1], builder.mul(args[2], ir.Constant(intp, k)))
            load = builder.load(builder.bitcast(builder.gep(src_data, [at]), vector.as_pointer()))
            load.align = 1
            rows.append(load)
        low = ir.Constant(ir.VectorType(ir.IntType(32), 16), _LOW)
        high = ir.Constant(ir.VectorType(ir.IntType(32), 16), _HIGH)
        for _ in range(4):
            rows = [row for k in range(8) for row in (builder.shuffle_vector(rows[k], rows[k + 8], low),
                                                        builder.shuffle_vector(rows[k], rows[k + 8], high))]
        for k in range(16):
            at = builder.add(args[4], builder.mul(args[5], ir.Constant(intp, k)))
            builder.store(rows[k], builder.bitcast(builder.gep(dst_data, [at]), vector.as_pointer())).align = 1
        return context.get_dummy_value()

    return types.none(src, types.intp, types.intp, dst, types.intp, types.intp), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _swap(a, b, shift, mask):
    """Swap the `mask` bytes of b with the bytes `shift` bits higher in a."""
    t = ((a >> shift) ^ b) & mask
    return a ^ (t << shift), b ^ t


@numba.njit(cache=True, nogil=True, inline="always")
def _transpose8(src, i, src_stride, dst, o, dst_stride):
    """dst[o + c * dst_stride + p] = src[i + p * src_stride + c] for p, c < 8: eight 64-bit words transposed in
    registers by three rounds of masked shifts (4-, 2-, then 1-byte blocks swapped across the diagonal)."""
    w0 = _load8(src, i)
    w1 = _load8(src, i + src_stride)
    w2 = _load8(src, i + 2 * src_stride)
    w3 = _load8(src, i + 3 * src_stride)
    w4 = _load8(src, i + 4 * src_stride)
    w5 = _load8(src, i + 5 * src_stride)
    w6 = _load8(src, i + 6 * src_stride)
    w7 = _load8(src, i + 7 * src_stride)
    w0, w4 = _swap(w0, w4, _S4, _M4)
    w1, w5 = _swap(w1, w5, _S4, _M4)
    w2, w6 = _swap(w2, w6, _S4, _M4)
    w3, w7 = _swap(w3, w7, _S4, _M4)
    w0, w2 = _swap(w0, w2, _S2, _M2)
    w1, w3 = _swap(w1, w3, _S2, _M2)
    w4, w6 = _swap(w4, w6, _S2, _M2)
    w5, w7 = _swap(w5, w7, _S2, _M2)
    w0, w1 = _swap(w0, w1, _S1, _M1)
    w2, w3 = _swap(w2, w3, _S1, _M1)
    w4, w5 = _swap(w4, w5, _S1, _M1)
    w6, w7 = _swap(w6, w7, _S1, _M1)
    _store8(dst, o, w0)
    _store8(dst, o + dst_stride, w1)
    _store8(dst, o + 2 * dst_stride, w2)
    _store8(dst, o + 3 * dst_stride, w3)
    _store8(dst, o + 4 * dst_stride, w4)
    _store8(dst, o + 5 * dst_stride, w5)
    _store8(dst, o + 6 * dst_stride, w6)
    _store8(dst, o + 7 * dst_stride, w7)


@numba.njit(cache=True, nogil=True)
def _transpose_bytes(src, dst, rows, positions, channels):
    """dst[r, c, p] = src[r, p, c], both flat uint8 arrays of rows * positions * channels bytes: 16 x 16 blocks,
    then 8 x 8 blocks along the leftover channels and positions, then single bytes."""
    p16 = positions - positions % 16
    c16 = channels - channels % 16
    p8 = positions - positions % 8
    c8 = channels - channels % 8
    for r in range(rows):
        base = r * positions * channels
        for p in range(0, p16, 16):
            for c in range(0, c16, 16):
                _transpose16(src, base + p * channels + c, channels, dst, base + c * positions + p, positions)
        for p in range(0, p8, 8):  # the channels [c16, c8) at every position of [0, p8)
            for c in range(c16, c8, 8):
                _transpose8(src, base + p * channels + c, channels, dst, base + c * positions + p, positions)
        for p in range(p16, p8, 8):  # the positions [p16, p8) of the channels [0, c16)
            for c in range(0, c16, 8):
                _transpose8(src, base + p * channels + c, channels, dst, base + c * positions + p, positions)
        for c in range(c8, channels):  # the channels beyond the last block of 8
            for p in range(positions):
                dst[base + c * positions + p] = src[base + p * channels + c]
        for p in range(p8, positions):  # the positions beyond the last block of 8
            for c in range(c8):
                dst[base + c * positions + p] = src[base + p * channels + c]


def channels_first(a: np.ndarray) -> np.ndarray:
    """`a` C-contiguous (itself when it is): 8-bit channels-last views by the blocked transpose, the rest by
    numpy."""
    if a.flags.c_contiguous:
        return a
    if a.ndim >= 3 and a.dtype.itemsize == 1 and sys.byteorder == "little":  # the 8 x 8 word blocks assume it
        last = a.transpose(0, *range(2, a.ndim), 1)  # the memory order of a channels-last view
        if last.flags.c_contiguous:
            out = np.empty(a.shape, dtype=a.dtype)
            rows, channels = a.shape[:2]
            _transpose_bytes(last.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8), rows,
                             a.size // (rows * channels) if a.size else 0, channels)
            return out
    return np.ascontiguousarray(a)
