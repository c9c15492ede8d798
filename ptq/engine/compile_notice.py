"""A notice when the first integer run of a process takes long: after installation numba compiles the kernels
(`ops/compiled`, `reports.pair_sums`) on their first use, 10-40 s on two cores, and caches them on disk, so
without a word the user's first `ptq run` or `ptq report` would seem to hang. A process that loads them from
the cache starts its first run in about 1 s (3 s on a loaded machine), hence the notice only after
NOTICE_AFTER seconds. It goes to the "ptq.kernels" logger at INFO level, which `ptq.cli` shows unless --quiet.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator

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
