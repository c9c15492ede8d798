"""Whether a graph output is class scores: `class_count`. A module of its own, without the metrics: `ptq run` and
the loading of every command ask it, and `reports.evaluate` (which imports the compiled comparison, numba) is
the report's."""
from __future__ import annotations

from typing import Optional

from ptq.core.graph import Graph


def class_count(graph: Graph, name: str) -> Optional[int]:
    """The classes of a classification output (a float tensor with one non-batch axis of more than one
    class), else None."""
    info = graph.tensors.get(name)
    if info is None or not info.is_float or info.shape is None:
        return None
    dims = [d for d in info.shape[1:] if d != 1]
    return dims[0] if len(dims) == 1 and (dims[0] or 0) > 1 else None
