"""Outer-scope references of control-flow nodes (If, Loop, Scan): the tensors of the enclosing graph that a
node's subgraph attributes read without the node listing them as inputs. They order the node after their
producers, count as its consumers, and are fed to it when it runs."""
from __future__ import annotations

import onnx


def graph_attributes(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The subgraphs a node holds (If's branches, Loop's and Scan's body)."""
    graphs = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            graphs.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            graphs.extend(attr.graphs)
    return graphs


def outer_references(graph: onnx.GraphProto) -> list[str]:
    """Names `graph` reads (its nodes and their nested subgraphs) that it does not define itself, in order."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    used: dict[str, None] = {}
    for node in graph.node:
        for name in list(node.input) + implicit_inputs(node):
            if name and name not in defined:
                used.setdefault(name)
        defined.update(o for o in node.output if o)
    return [name for name in used if name not in defined]


def implicit_inputs(node: onnx.NodeProto) -> list[str]:
    """The outer-scope tensors a node's subgraphs read, not among its own inputs, in first-use order."""
    explicit = set(node.input)
    names: dict[str, None] = {}
    for graph in graph_attributes(node):
        for name in outer_references(graph):
            if name not in explicit:
                names.setdefault(name)
    return list(names)
