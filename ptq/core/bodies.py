"""The subgraphs of control-flow nodes (If's branches, Loop's body) as IR: their nodes, tensors and constants.

A body reads tensors of the graphs around it (`ptq.core.subgraphs`); its own tensors are what calibration
collects for it (ptq's float evaluation of the body, `ptq.engine.body_float`, since onnxruntime exposes no tensor of a
subgraph) and what the executor quantizes when it runs the body in integers. Names inside bodies are unique
across the model (ONNX's SSA rule), so the quant table keys them like any tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from ptq.core.graph import FLOAT_DTYPES, Graph, Node, TensorInfo, domain_opsets, ir_node, tensor_info

@dataclass
class Body:
    """One subgraph of a control-flow node, in topological order (ONNX requires it within a graph)."""

    owner: str  # the control-flow node's name
    attribute: str  # then_branch | else_branch | body
    nodes: list[Node]
    inputs: list[str]  # the body's graph inputs (Loop: iteration number, condition, carried values)
    outputs: list[str]
    initializers: dict[str, np.ndarray]
    tensors: dict[str, TensorInfo]  # the body's typed tensors (inputs, value_info, outputs, initializers)

    @property
    def float_tensors(self) -> list[str]:
        """Float tensors the body computes or receives (Loop's carried values), in order: what is calibrated."""
        names = [n for n in self.inputs if self.is_float(n)]
        names += [o for node in self.nodes for o in node.outputs if o and self.is_float(o)]
        return list(dict.fromkeys(names))

    def is_float(self, name: str) -> bool:
        info = self.tensors.get(name)
        return info is not None and info.dtype in FLOAT_DTYPES


def has_bodies(node: Node) -> bool:
    """Whether a node holds subgraphs (If, Loop, Scan)."""
    return any(isinstance(v, onnx.GraphProto) for v in node.attrs.values())


def node_bodies(node: Node, opsets: dict[str, int]) -> list[Body]:
    """The bodies of one node (none for a node without subgraph attributes)."""
    found = []
    for attribute, value in node.attrs.items():
        if isinstance(value, onnx.GraphProto):
            found.append(_body(node.name, attribute, value, opsets))
    return found


def _body(owner: str, attribute: str, proto: onnx.GraphProto, opsets: dict[str, int]) -> Body:
    tensors = {vi.name: tensor_info(vi) for vi in list(proto.input) + list(proto.value_info) + list(proto.output)}
    initializers = {t.name: numpy_helper.to_array(t) for t in proto.initializer}
    for name, value in initializers.items():
        tensors[name] = TensorInfo(name, value.dtype, tuple(value.shape))
    prefix = f"{owner}/{attribute}"
    nodes = [ir_node(n, f"{prefix}/{n.name or f'{n.op_type}_{k}'}", opsets) for k, n in enumerate(proto.node)]
    return Body(owner, attribute, nodes, [i.name for i in proto.input if i.name not in initializers],
                [o.name for o in proto.output], initializers, tensors)


def all_bodies(graph: Graph) -> list[Body]:
    """Every body of the model, nested ones after the body holding them."""
    opsets = domain_opsets(graph.model)
    pending = [b for node in graph.nodes for b in node_bodies(node, opsets)]
    found = []
    while pending:
        body = pending.pop(0)
        found.append(body)
        pending[:0] = [b for node in body.nodes for b in node_bodies(node, opsets)]
    return found


def body_activations(graph: Graph) -> list[str]:
    """The float tensors of every body, calibrated beside the graph's activations."""
    return list(dict.fromkeys(name for body in all_bodies(graph) for name in body.float_tensors))


def calibrated_tensors(graph: Graph) -> list[str]:
    """What calibration collects: the graph's activations, then the float tensors of its bodies."""
    known = set(graph.activations)
    return graph.activations + [t for t in body_activations(graph) if t not in known]


def body_weights(graph: Graph) -> set[str]:
    """The constants the bodies define themselves (their initializers)."""
    return {name for body in all_bodies(graph) for name in body.initializers}
