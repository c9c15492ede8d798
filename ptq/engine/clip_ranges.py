"""The Relu/Clip folds: a tensor that every consumer clamps to a constant interval needs no range beyond it.
Calibration narrows the tensor's range to it (`ptq.calibration.pipeline`, `ptq.calibration.int4_dsp`); the report checks the table
against the same folds. Apart from the pipeline so that the report does not import calibration."""
from __future__ import annotations

from typing import Optional

from ops.registry import op_of
from ptq.core.graph import Graph, Node


def folded_ranges(graph: Graph) -> dict[str, tuple[float, float]]:
    """Tensors whose every consumer clamps them to a constant interval (an op with a `clip_range`: Relu,
    Clip with constant bounds) -> the union of those intervals."""
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    bounds = {}
    for name in graph.activations:
        users = consumers.get(name, [])
        if not users or name in outputs:
            continue
        spans = [_clip_span(graph, node) if node.inputs[0] == name else None for node in users]
        if all(s is not None for s in spans):
            bounds[name] = (min(s[0] for s in spans), max(s[1] for s in spans))
    return bounds


def _clip_span(graph: Graph, node: Node) -> Optional[tuple[float, float]]:
    op = op_of(node)
    return op.clip_range(node, graph.constant_lookup(node)) if op is not None else None
