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
    `name` in this thread (grown when too small): valid until the next call with the same name. A view
    already made for this name, shape and dtype is returned as it is (a run asks for the same few views
    image after image)."""
    local = _LOCAL.__dict__
    views = local.get("views")
    if views is None:
        views = local["views"] = {}
        local["pool"] = {}
    view = views.get((name, shape, dtype))
    if view is not None:
        return view
    pool = local["pool"]
    kind = np.dtype(dtype)
    size = math.prod(shape)
    key = (name, kind)
    buf = pool.get(key)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=kind)
        pool[key] = buf
        for stale in [k for k in views if k[0] == name and np.dtype(k[2]) == kind]:
            del views[stale]  # views of the smaller buffer: every view of a name shares one buffer
    view = views[(name, shape, dtype)] = buf[:size].reshape(shape)
    return view
