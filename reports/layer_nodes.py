"""A layer name (tensor or node, as in the report) resolved to the nodes of the model that compute it.

Floating a Conv or Gemm also floats the BatchNormalization and the Relu/Clip/LeakyRelu the executor fused into
it, so the whole fused layer runs in float. A name a rewrite removed (a Conv's raw output before the Clip fused
into it, or the fused activation / folded BatchNormalization node) resolves to the node that absorbed it, with a
note.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ptq.executor import IntegerGraph


@dataclass(frozen=True)
class ResolvedLayer:
    """A layer name resolved to the node of the integer graph that computes it."""

    node: str
    note: Optional[str] = None  # set when the name was removed by a rewrite: which node absorbed it


def absorbed_names(prepared: IntegerGraph) -> dict[str, str]:
    """Names the rewrites removed -> the node of the integer graph that absorbed them: a BatchNormalization
    folded into its Conv and a Relu/Clip/LeakyRelu fused into its Conv/Gemm, each by the removed node's name
    and by the tensor the host produced before (e.g. a Conv's raw output, now internal to Conv+Clip)."""
    rewrites = prepared.rewrites
    hosts = {}
    for fold in rewrites.batchnorm_folds:
        hosts[fold.batchnorm] = hosts[fold.removed_tensor] = fold.conv
    for fusion in rewrites.fusions:
        hosts[fusion.activation] = hosts[fusion.removed_tensor] = fusion.host
    return hosts


def resolve_layer(prepared: IntegerGraph, layer: str) -> ResolvedLayer:
    """The node computing `layer`: a node name, the producer of a tensor name, or, for a name a rewrite
    removed, the node that absorbed it (with a note saying so)."""
    steps = {step.node.name: step for step in prepared.steps}
    producer = {out: step.node.name for step in prepared.steps for out in step.node.outputs if out}
    if layer in steps:
        return ResolvedLayer(layer)
    if layer in producer:
        return ResolvedLayer(producer[layer])
    if layer in prepared.graph.inputs:
        raise ValueError(f"{layer!r} is a graph input: it has no layer to run in float")
    host = absorbed_names(prepared).get(layer)
    if host is None:
        raise ValueError(f"{layer!r} is neither a tensor nor a node of the integer graph")
    node = steps[host].node
    outputs = ", ".join(repr(o) for o in node.outputs if o)
    return ResolvedLayer(host, f"{layer!r} is not in the integer graph: a rewrite fused it into {node.op_type} node "
                               f"{host!r} (output {outputs}); that node runs in float")


def layer_nodes(prepared: IntegerGraph, layer: str) -> list[str]:
    """The original node names that make up a layer (tensor or node name of the integer graph, or a name a
    rewrite fused away): its producing node plus whatever the rewrites folded or fused into it."""
    node = resolve_layer(prepared, layer).node
    rewrites = prepared.rewrites
    extra = [f.activation for f in rewrites.fusions if f.host == node]
    extra += [f.batchnorm for f in rewrites.batchnorm_folds if f.conv == node]
    return [node] + extra


def float_node_names(prepared: IntegerGraph, layers: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(name for layer in layers for name in layer_nodes(prepared, layer)))
