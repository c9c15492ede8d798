"""Channels-last activations, the layout the compiled convolutions hand to each other.

A compiled convolution writes its output codes channels innermost, (N, *spatial, C) in memory, and returns
the (N, C, *spatial) view of them (`channels_first`): the same array to every reader (numpy indexing,
reshapes, comparisons, other ops see an ordinary NCHW tensor with other strides), but the next compiled
convolution, Add or Sub finds the channels-innermost data behind it (`channels_last`) and reads it as it is,
without a transposition: the depthwise kernels and the BLAS GEMM both want the channels innermost.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


def channels_last(x: np.ndarray) -> Optional[np.ndarray]:
    """The C-contiguous (N, *spatial, C) array behind an (N, C, *spatial) array x, or None when x is not laid
    out channels innermost (an ordinary C-contiguous tensor, unless C or the spatial size is 1)."""
    if x.ndim < 3:
        return None
    moved = x.transpose(_LAST[x.ndim])
    return moved if moved.flags.c_contiguous else None


def channels_first(data: np.ndarray) -> np.ndarray:
    """The (N, C, *spatial) view of channels-last data (N, *spatial, C)."""
    return data.transpose(_FIRST[data.ndim])


# axes orders (a plain transpose costs a tenth of np.moveaxis's argument normalization, per step of a run)
_LAST = {ndim: (0,) + tuple(range(2, ndim)) + (1,) for ndim in range(3, 9)}
_FIRST = {ndim: (0, ndim - 1) + tuple(range(1, ndim - 1)) for ndim in range(3, 9)}


def memory_order(a: np.ndarray, b: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray, tuple[int, ...]]]:
    """(a', b', axes): two arrays of one shape transposed by `axes` to C-contiguous arrays, the same axes for
    both (their common memory order: plain, or channels innermost); None when they share neither."""
    orders = [tuple(range(a.ndim))]
    if a.ndim >= 3:
        orders.append((0,) + tuple(range(2, a.ndim)) + (1,))
    for axes in orders:
        at, bt = a.transpose(axes), b.transpose(axes)
        if at.flags.c_contiguous and bt.flags.c_contiguous:
            return at, bt, axes
    return None
