"""How many threads a pass may use: the cores this process may run on, and onnxruntime sessions that use no more
threads than they are given and do not spin.

onnxruntime's defaults start one intra-op thread per core and keep them spinning between operators: a single
calibration process on 16 cores kept 11.8 cores busy for the work four single-thread workers did with a tenth of
the CPU (issue 29). Every session ptq opens goes through `session_options`: spinning off, the intra-op pool sized
by the caller (the float reference of a report and each worker: 1; a single process: its usable cores).
"""
from __future__ import annotations

import os
from typing import Optional


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def session_options(intra_op_threads: Optional[int] = None):
    """onnxruntime `SessionOptions` with `intra_op_threads` intra-op threads (None: the usable cores), one
    inter-op thread (ptq runs sequential graphs) and no spinning in either pool."""
    import onnxruntime as ort  # imported here: it is slow to import, and the command line's parser must not

    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads or usable_cores()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def session_errors() -> tuple[type, ...]:
    """The exceptions an onnxruntime session raises for a model or feed it cannot run (to catch them by name)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state  # imported here: as in `session_options`

    return (state.Fail, state.InvalidArgument, state.InvalidGraph, state.NotImplemented, state.RuntimeException)
