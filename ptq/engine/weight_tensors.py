"""The weights a table quantizes: the float initializers that an op declares in a weight role
(`ops.registry.weight_role`), each once, with the axis of its per-output-channel scales. A weight computed
from initializers only (torch's exporter without constant folding writes a Linear's weight as
Transpose(W) -> MatMul) is the constant the executor's `fold_static` makes of it, under the same name."""
from __future__ import annotations

from collections import ChainMap
from typing import Iterator, Optional

import numpy as np

from ops.registry import weight_role
from ptq.core.bodies import all_bodies, has_bodies
from ptq.core.graph import Graph


def with_static_weights(graph: Graph) -> Graph:
    """`graph` itself unless a weight-role input is computed from initializers only; then a copy with its
    static subgraphs folded (`ptq.engine.rewrites.fold_static`), so computed weights become initializers."""
    computed: set[str] = set()  # outputs of nodes whose inputs are all initializers or such outputs
    for node in graph.nodes:
        present = [i for i in node.inputs if i]
        if present and all(i in graph.initializers or i in computed for i in present):
            computed.update(node.outputs)
    for node in graph.nodes:
        role = weight_role(node)
        if role is not None and len(node.inputs) > role.input_index and node.inputs[role.input_index] in computed:
            from ptq.engine.float_fallback import NodeFloatEvaluator  # only such models pay for the rewrites' imports
            from ptq.engine.rewrites import copy_graph, fold_static

            folded = copy_graph(graph)
            fold_static(folded, NodeFloatEvaluator(graph.opset))
            return folded
    return graph


def weight_tensors(graph: Graph, per_channel: bool) -> Iterator[tuple[str, np.ndarray, Optional[int]]]:
    """(name, value, axis) per weight in node order; axis is the output-channel axis with `per_channel` and a
    weight of rank >= 2 whose role has one, else None (one scale for the tensor)."""
    seen = set()
    graph = with_static_weights(graph)
    bodies = all_bodies(graph) if any(has_bodies(n) for n in graph.nodes) else []
    initializers = ChainMap(graph.initializers, *(b.initializers for b in bodies))
    for node in graph.nodes + [n for b in bodies for n in b.nodes]:  # If / Loop bodies' weights too
        role = weight_role(node)
        if role is None or len(node.inputs) <= role.input_index:
            continue
        name = node.inputs[role.input_index]
        if name in seen or name not in initializers:
            continue
        w = initializers[name]
        if not np.issubdtype(w.dtype, np.floating):
            continue
        seen.add(name)
        axis = None
        if per_channel and role.channel_axis is not None and w.ndim >= 2:
            axis = role.channel_axis % w.ndim
        yield name, w, axis
