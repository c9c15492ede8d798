"""Codes in C order: the compiled convolutions hand over channels-last views (N, C, H, W with the channel
stride 1), and the report reads codes in C order (`reports.pair_sums`).

For 8-bit codes the copy is a compiled blocked transpose: each 8 positions x 8 channels block is read as eight
64-bit words (one per position), transposed in registers by three rounds of masked shifts (4-, 2-, then 1-byte
blocks swapped across the diagonal) and written as eight words (one per channel). The positions and channels
left over when a count is not a multiple of 8 are copied byte by byte. numpy's copy walks the output in C order
and reads the input at the channel stride; this kernel measured 1.4-1.9 ms against numpy's 4.6-5 ms for the
58 channels-last tensors of one EfficientNet-Lite0 image (6.9 M codes). Other dtypes and layouts are copied by
numpy.
"""
from __future__ import annotations

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


@numba.njit(cache=True, nogil=True, inline="always")
def _swap(a, b, shift, mask):
    """Swap the `mask` bytes of b with the bytes `shift` bits higher in a."""
    t = ((a >> shift) ^ b) & mask
    return a ^ (t << shift), b ^ t


@numba.njit(cache=True, nogil=True)
def _transpose_bytes(src, dst, rows, positions, channels):
    """dst[r, c, p] = src[r, p, c], both flat uint8 arrays of rows * positions * channels bytes."""
    for r in range(rows):
        base = r * positions * channels
        for p in range(0, positions - 7, 8):
            for c in range(0, channels - 7, 8):
                i = base + p * channels + c
                w0 = _load8(src, i)
                w1 = _load8(src, i + channels)
                w2 = _load8(src, i + 2 * channels)
                w3 = _load8(src, i + 3 * channels)
                w4 = _load8(src, i + 4 * channels)
                w5 = _load8(src, i + 5 * channels)
                w6 = _load8(src, i + 6 * channels)
                w7 = _load8(src, i + 7 * channels)
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
                o = base + c * positions + p
                _store8(dst, o, w0)
                _store8(dst, o + positions, w1)
                _store8(dst, o + 2 * positions, w2)
                _store8(dst, o + 3 * positions, w3)
                _store8(dst, o + 4 * positions, w4)
                _store8(dst, o + 5 * positions, w5)
                _store8(dst, o + 6 * positions, w6)
                _store8(dst, o + 7 * positions, w7)
        for c in range(channels - channels % 8, channels):  # the channels beyond the last block of 8
            for p in range(positions):
                dst[base + c * positions + p] = src[base + p * channels + c]
        for p in range(positions - positions % 8, positions):  # the positions beyond the last block of 8
            for c in range(channels - channels % 8):
                dst[base + c * positions + p] = src[base + p * channels + c]


def channels_first(a: np.ndarray) -> np.ndarray:
    """`a` C-contiguous (itself when it is): 8-bit channels-last views by the blocked transpose, the rest by
    numpy."""
    if a.flags.c_contiguous:
        return a
    if a.ndim >= 3 and a.dtype.itemsize == 1:
        last = a.transpose(0, *range(2, a.ndim), 1)  # the memory order of a channels-last view
        if last.flags.c_contiguous:
            out = np.empty(a.shape, dtype=a.dtype)
            rows, channels = a.shape[:2]
            _transpose_bytes(last.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8), rows,
                             a.size // (rows * channels) if a.size else 0, channels)
            return out
    return np.ascontiguousarray(a)
