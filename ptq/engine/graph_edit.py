"""Small edits of the IR shared by the graph rewrites (ptq.engine.rewrites, ptq.engine.transformer_patterns)."""
from __future__ import annotations

import numpy as np

from ptq.core.graph import Graph, Node, TensorInfo


def make_constant(graph: Graph, name: str, value: np.ndarray) -> None:
    value = np.asarray(value)
    graph.initializers[name] = value
    graph.constants.add(name)
    graph.tensors[name] = TensorInfo(name, value.dtype, tuple(value.shape))
    if name in graph.activations:
        graph.activations.remove(name)


def single_consumer(graph: Graph, consumers: dict[str, list[Node]], tensor: str) -> bool:
    return len(consumers.get(tensor, [])) == 1 and tensor not in graph.outputs


def unique_name(graph: Graph, base: str) -> str:
    name, k = base, 1
    while name in graph.tensors or name in graph.initializers:
        name, k = f"{base}_{k}", k + 1
    return name


def drop_activation(graph: Graph, tensor: str) -> None:
    if tensor in graph.activations:
        graph.activations.remove(tensor)
