"""The weights a table quantizes: the float initializers that an op declares in a weight role
(`ops.registry.weight_role`), each once, with the axis of its per-output-channel scales."""
from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from ops.registry import weight_role
from ptq.core.graph import Graph


def weight_tensors(graph: Graph, per_channel: bool) -> Iterator[tuple[str, np.ndarray, Optional[int]]]:
    """(name, value, axis) per weight in node order; axis is the output-channel axis with `per_channel` and a
    weight of rank >= 2 whose role has one, else None (one scale for the tensor)."""
    seen = set()
    for node in graph.nodes:
        role = weight_role(node)
        if role is None or len(node.inputs) <= role.input_index:
            continue
        name = node.inputs[role.input_index]
        if name in seen or name not in graph.initializers:
            continue
        w = graph.initializers[name]
        if not np.issubdtype(w.dtype, np.floating):
            continue
        seen.add(name)
        axis = None
        if per_channel and role.channel_axis is not None and w.ndim >= 2:
            axis = role.channel_axis % w.ndim
        yield name, w, axis
