"""Compiled integer kernels (numba), the hot loops of the default `compiled` backend.

Each module holds a few `@numba.njit(cache=True)` kernels and the thin numpy wrapper an op calls; every
kernel computes exactly the integers of the numpy reference path (`--backend numpy`), and its docstring
states the formula. The ops consult `enabled(runtime)` at their hot call sites and fall back to the numpy
path for any variant a kernel does not cover (a wrapper returns None then).

Nothing here imports numba: the kernel modules are imported (and compiled, or loaded from numba's on-disk
cache) on the first run that uses them, so `import ptq`, `import ops` and `ptq --help` stay cheap. numba
keys a cached kernel on its own source file: `requant.py` and `epilogue.py` hold the epilogues the other
kernels call, `vnni.py` the multiply-add tiles they inline (and `int_dense.py`, `int_depthwise.py`,
`int_dense16.py` the loops the 16-bit kernels inline), so an edit to one of these alone needs the cache of its
callers cleared (delete `ops/compiled/__pycache__`).

The integer dot products (`vnni`, `int_dense`, `int_depthwise`, planned per layer by `conv_plan`; 16-bit inputs
as two byte planes on the same tiles, `int_dense16`, `int_depthwise16`, and 16-bit weights as int8 planes,
`int_wide_weight`, `int_depthwise16.depthwise_wide`) use the multiply-add instruction of the CPU numba compiles for (VNNI `vpdpbusd`, else `vpmaddwd`); numba's cache is
keyed on that CPU too.
"""
from __future__ import annotations


def enabled(runtime) -> bool:
    """Whether the integer run `runtime` (an `ops.registry.IntRuntime`) uses the compiled kernels."""
    return getattr(runtime.backend, "compiled", False) is True
