"""The reported tensors ("layers"): those that exist in both the float model and the integer graph.

Layers are named by our own tensor names: graph inputs and the outputs of every non-shape step of the rewritten
graph (a Conv fused with its Clip produces the Clip's output tensor; the raw Conv output has no integer
counterpart and is not reported). A node that only passes its input's codes on (`OpDef.is_noop`: Identity,
inference Dropout, a Cast between float types) gets no row: the layers it feeds list its input instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from ptq.engine.executor import IntegerGraph, NodeKind

INPUT_OP = "Input"


@dataclass(frozen=True)
class LayerSpec:
    """A reported tensor: produced by step `step` of the integer graph (None for a graph input)."""

    name: str
    node: str
    op_type: str
    step: Optional[int]
    inputs: tuple[str, ...]  # the quantized activation tensors the producing step reads
    float_fallback: bool


def layer_specs(prepared: IntegerGraph, float_tensors: Iterable[str]) -> list[LayerSpec]:
    """Every quantized tensor of the integer graph that the float model also has, in topological order."""
    available = set(float_tensors)
    specs = [
        LayerSpec(name, name, INPUT_OP, None, (), False)
        for name in prepared.graph.inputs
        if name in prepared.qparams and name in available
    ]
    constants = prepared.graph.initializers
    source: dict[str, str] = {}  # output of a no-op node -> the tensor whose codes it passes on
    for index, step in enumerate(prepared.steps):
        if step.kind is NodeKind.SHAPE:
            continue
        node = step.node
        inputs = tuple(source.get(i, i) for i in node.inputs if i and i not in constants and i in prepared.qparams)
        if step.kind is NodeKind.INTEGER and step.op.is_noop(node) and inputs:
            source[node.outputs[0]] = inputs[0]
            continue
        for name, qp in zip(node.outputs, step.out_qparams):
            if name and qp is not None and name in available:
                specs.append(LayerSpec(name, node.name, node.op_type, index, inputs, step.kind is NodeKind.FLOAT))
    return specs
