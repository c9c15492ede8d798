"""The integer dot product under Conv, ConvTranspose, Gemm and MatMul, and the exact-BLAS helper behind it.

`exact_matmul(a, b)` returns the exact integer product of two integer arrays. It runs on floating-point BLAS
when a bound proves the result exact, and on numpy's (slow, but always exact) int64 matmul otherwise:

    every product a[i,k] * b[k,j] and every partial sum of K of them is an integer of magnitude at most
    B = K * max|a| * max|b|;  a binary floating-point type with a p-bit significand represents every
    integer of magnitude <= 2^p exactly, so when B < 2^p no rounding happens, whatever order (or FMA) the
    BLAS kernel sums in.

float32 (p = 24) is used when B < 2^24, float64 (p = 53) when B < 2^53, int64 otherwise. The result is int32
when B < 2^31 (half the bytes for the requant that follows), int64 otherwise. The bound uses the
true extrema of the operands unless the caller passes smaller-or-equal known bounds (`a_absmax`,
`b_absmax`), which saves a pass over a large im2col matrix.

`NumpyBackend` is the reference `DotBackend` (numpy kernels in the ops); `CompiledBackend`, the default, has
the same dot products and lets the ops run their compiled kernels (`ops.compiled`, same integers); a
packed-DSP emulation can replace either without touching the ops.
Its `direct_depthwise = True` lets Conv run depthwise layers as an exact per-tap integer multiply-accumulate
(`ops.conv_kernels`) instead of an im2col matmul; a backend without the attribute gets every dot product.

Threads: numpy's OpenBLAS spreads even small GEMMs over all cores; on a loaded machine its threads wait on
each other (measured here: 6 ms instead of 0.26 ms for a 16x32x12544 sgemm). Run inference with
OPENBLAS_NUM_THREADS=1 (set before numpy is imported) when the machine is shared.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

FLOAT32_EXACT = 1 << 24  # integers of magnitude <= 2^24 are exact in float32
FLOAT64_EXACT = 1 << 53
INT32_MAX = (1 << 31) - 1


def absmax(x: np.ndarray) -> int:
    """max |x| of an integer array as a Python int (no int8 abs wrap-around); 0 for an empty array."""
    if x.size == 0:
        return 0
    return max(abs(int(x.max())), abs(int(x.min())))


def dtype_absmax(x: np.ndarray) -> int:
    """The largest |value| the dtype of an integer array can hold (a free bound for 8/16-bit codes)."""
    info = np.iinfo(x.dtype)
    return max(abs(int(info.min)), abs(int(info.max)))


def _operand_bound(x: np.ndarray, given: Optional[int], k: int, other: int) -> int:
    """An upper bound of max|x|: the caller's, else the dtype's when that already proves float32
    exactness (no pass over a large activation), else the true extremum."""
    if given is not None:
        return int(given)
    if x.dtype.itemsize <= 2 and k * dtype_absmax(x) * other < FLOAT32_EXACT:
        return dtype_absmax(x)
    return absmax(x)


def matmul_method(k: int, a_absmax: int, b_absmax: int) -> str:
    """Which arithmetic `exact_matmul` uses for a K-deep dot product of operands bounded as given."""
    bound = int(k) * int(a_absmax) * int(b_absmax)
    if bound < FLOAT32_EXACT:
        return "float32"
    if bound < FLOAT64_EXACT:
        return "float64"
    return "int64"


def _check_integer(name: str, x: np.ndarray) -> None:
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"exact_matmul: {name} must be an integer array, got {x.dtype}")


def exact_matmul(
    a: np.ndarray,
    b: np.ndarray,
    a_absmax: Optional[int] = None,
    b_absmax: Optional[int] = None,
) -> np.ndarray:
    """`a @ b` (numpy matmul broadcasting) of integer arrays, exact, on BLAS whenever the bound allows; int32
    when the bound proves |a @ b| < 2^31, else int64.

    `a_absmax`/`b_absmax`, when given, must be upper bounds of max|a| and max|b| (they are not checked).
    """
    a = np.asarray(a)
    b = np.asarray(b)
    _check_integer("a", a)
    _check_integer("b", b)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("exact_matmul: operands must have at least one dimension")
    k = a.shape[-1]
    if b.shape[0 if b.ndim == 1 else -2] != k:
        raise ValueError(f"exact_matmul: inner dimensions differ: a {a.shape} @ b {b.shape}")
    if b_absmax is None and b.size <= a.size:  # the weight side is usually the small one: measure it first
        bmax = absmax(b)
        amax = _operand_bound(a, a_absmax, k, bmax)
    else:
        amax = absmax(a) if a_absmax is None else int(a_absmax)
        bmax = _operand_bound(b, b_absmax, k, amax)
    method = matmul_method(k, amax, bmax)
    if method == "int64":
        return np.matmul(a.astype(np.int64, copy=False), b.astype(np.int64, copy=False))
    ftype = np.float32 if method == "float32" else np.float64
    out = np.matmul(a.astype(ftype, copy=False), b.astype(ftype, copy=False))
    return out.astype(np.int32 if k * amax * bmax <= INT32_MAX else np.int64)


class NumpyBackend:
    """The default dot-product backend: `exact_matmul` (float BLAS when provably exact, else int64)."""

    name = "numpy"
    # Depthwise convolution (a dot product only kernel-taps deep) may run as an exact integer multiply-
    # accumulate per tap instead of an im2col matmul; a backend emulating hardware sets this False.
    direct_depthwise = True

    # The ops run their numpy kernels (the reference for the compiled ones).
    compiled = False

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return exact_matmul(a, b)


class CompiledBackend(NumpyBackend):
    """The default backend: `NumpyBackend`'s exact dot products, with the ops' hot loops (grouped and
    depthwise convolution, the requant epilogue, elementwise, pooling, lookup tables) run as the compiled
    kernels of `ops.compiled`, which give the same integers as the numpy kernels."""

    name = "compiled"
    compiled = True

