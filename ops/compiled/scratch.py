"""Scratch buffers reused across kernel calls, one set per thread.

A fresh multi-megabyte numpy array is mapped anew by the allocator on every call and pays a page fault per
4 KiB page on first touch; the kernels' working arrays (padded planes, accumulators, the float copy of a GEMM
operand and its result) are the same few sizes image after image, so each is kept and reused. Per thread,
because a report runs isolated steps in a worker thread beside the main run.
"""
from __future__ import annotations

import math
import threading

import numpy as np

_LOCAL = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized C-contiguous array of `shape` and `dtype`, the same memory on every call with this
    `name` in this thread (grown when too small): valid until the next call with the same name."""
    pool = _LOCAL.__dict__.setdefault("pool", {})
    dtype = np.dtype(dtype)
    size = math.prod(shape)
    key = (name, dtype)
    buf = pool.get(key)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=dtype)
        pool[key] = buf
    return buf[:size].reshape(shape)
