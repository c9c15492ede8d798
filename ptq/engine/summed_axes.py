"""The activations that layers sum over against a constant weight, and the axis they sum along (MatMul's A along
its last axis, Gemm's A by transA: `OpDef.summed_input_axis`). Calibration collects per-channel ranges of these
tensors along that axis (`ptq.engine.float_run.collect_statistics`) to find outlier channels
(`ptq.calibration.outlier_channels`)."""
from __future__ import annotations

from ops.registry import summed_input_axis, weight_role
from ptq.core.graph import Graph


def summed_input_axes(graph: Graph) -> dict[str, int]:
    """{activation: axis} for every activation that is input 0 of a layer with a constant weight summing over
    it (the first such layer's axis when several read it)."""
    axes: dict[str, int] = {}
    activations = set(graph.activations)
    for node in graph.nodes:
        axis = summed_input_axis(node)
        role = weight_role(node)
        if axis is None or role is None or not node.inputs or node.inputs[0] not in activations:
            continue
        weight = node.inputs[role.input_index] if role.input_index < len(node.inputs) else ""
        if weight and weight in graph.constants:
            axes.setdefault(node.inputs[0], axis)
    return axes
