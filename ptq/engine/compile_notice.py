"""A notice when the first integer run of a process takes long: after installation numba compiles the kernels
(`ops/compiled`, `reports.pair_sums`) on their first use, 10-40 s on two cores, and caches them on disk, so
without a word the user's first `ptq run` or `ptq report` would seem to hang. A process that loads them from
the cache starts its first run in about 1 s (3 s on a loaded machine), hence the notice only after
NOTICE_AFTER seconds. It goes to the "ptq.kernels" logger at INFO level, which `ptq.cli` shows unless --quiet.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

from ptq import IMPORTED_AT

NOTICE_AFTER = 5.0
MESSAGE = ("compiling the integer kernels: the first run after installing ptq takes 10-40 s more; numba caches "
           "them on disk for every later run")

logger = logging.getLogger("ptq.kernels")
_first_run_seen = threading.Event()


@contextmanager
def first_run_notice(after: float = NOTICE_AFTER) -> Iterator[None]:
    """Around an integer run: the first one of the process logs MESSAGE if it has not ended after `after`
    seconds; later ones are left alone."""
    if _first_run_seen.is_set():
        yield
        return
    _first_run_seen.set()
    timer = threading.Timer(after, logger.info, args=(MESSAGE,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


PROJECT_PACKAGES = ("ptq", "ops", "reports", "calibrators", "lut", "dsp")


def compiled_here() -> list[str]:
    """What this process compiled that later runs load from caches, for a note beside a time it prints:
    "the numba kernels" when a numba kernel (an integer kernel, the histogram counter) missed its disk cache, "ptq's Python modules" when the bytecode
    of a module of the project was written after `ptq` was imported (a fresh clone or install: 2.4 s of
    `ptq calibrate` took 11 s the first time)."""
    compiled = []
    modules = [m for name, m in list(sys.modules.items()) if name.split(".")[0] in PROJECT_PACKAGES]
    if "numba" in sys.modules:
        from numba.core.registry import CPUDispatcher  # only once numba is loaded: importing it costs 0.2 s

        kernels = [v for m in modules for v in list(vars(m).values()) if isinstance(v, CPUDispatcher)]
        if any(sum(kernel.stats.cache_misses.values()) for kernel in kernels):
            compiled.append("the numba kernels")
    for module in modules:
        cached = getattr(module, "__cached__", None)
        if cached and os.path.exists(cached) and os.path.getmtime(cached) >= IMPORTED_AT:
            compiled.append("ptq's Python modules")
            break
    return compiled


def first_run_note() -> str:
    """" (first run: it compiled ...; later runs skip that)" when `compiled_here` names something, else ""."""
    compiled = compiled_here()
    return f" (a first run: it compiled {' and '.join(compiled)}; later runs skip that)" if compiled else ""
