"""Backends by name, for `--backend` and `backend=`: `compiled` (the default: exact BLAS dot products and the
numba kernels of `ops.compiled`), `numpy` (the reference kernels, same codes), and the packed-DSP48E2
emulations `dsp:int8` (WP486, two products per slice) and `dsp:int4` (WP521, four), and `dsp:lanes` (each dot
product on the narrowest of the two its codes fit: a mixed 4/8-bit model), each with `:naive` for plain
bit-sliced lane extraction (no sign correction)."""
from __future__ import annotations

# imports inside functions: the command line's parser reads BACKEND_NAMES; a backend's kernels (numba, the
# DSP emulation) are imported when it is made

from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from ops.registry import DotBackend

BACKEND_NAMES = ("compiled", "numpy", "dsp:int8", "dsp:int4", "dsp:lanes", "dsp:int8:naive", "dsp:int4:naive",
                 "dsp:lanes:naive")
DEFAULT_BACKEND_NAME = "compiled"
# `ptq run`'s default: numpy on a few samples, compiled on more. The numpy kernels give the same codes; the
# compiled ones cost numba's start-up first (importing it, its CPU target, the cached kernels: 0.4 s of CPU, and
# 10-40 s to compile them on a first run after installing), then run an image in about 25 ms of CPU against
# numpy's 58 (EfficientNet-Lite0, one BLAS thread: `ptq run` of 1 image 0.5 s of CPU on numpy against 0.9 s
# compiled, of 20 images 1.6 s against 1.4 s), so numpy up to AUTO_NUMPY_UP_TO samples
AUTO_BACKEND_NAME = "auto"
AUTO_NUMPY_UP_TO = 8


def resolve_backend(name: str, samples: int) -> str:
    """The backend `name` stands for on `samples` samples: 'auto' is numpy up to AUTO_NUMPY_UP_TO samples,
    compiled beyond; any other name is itself."""
    if name != AUTO_BACKEND_NAME:
        return name
    return "numpy" if samples <= AUTO_NUMPY_UP_TO else "compiled"


def get_backend(name: Union[str, "DotBackend", None]) -> "DotBackend":
    """A fresh backend for `name` (None: the default, compiled); a backend object is returned as is."""
    if name is not None and not isinstance(name, str):
        return name
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name is None or name == "compiled":
        from ops.backend import CompiledBackend

        return CompiledBackend()
    if name == "numpy":
        from ops.backend import NumpyBackend

        return NumpyBackend()
    from dsp.backend import DspBackend, DspLanesBackend

    parts = name.split(":")
    if parts[1] == "lanes":
        return DspLanesBackend(parts[2] if len(parts) == 3 else "exact")
    return DspBackend(parts[1], parts[2] if len(parts) == 3 else "exact")
