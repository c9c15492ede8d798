"""A layer name (tensor or node name) resolved, on a rewritten graph (`ptq.engine.rewrites`), to the nodes of the
original model that compute it.

Floating a Conv or Gemm also floats the BatchNormalization and the Relu/Clip/LeakyRelu the rewrites fused into
it, so the whole fused layer runs in float. A name a rewrite removed (a Conv's raw output before the Clip fused
into it, or the fused activation / folded BatchNormalization node) resolves to the node that absorbed it, with a
note. Used by the executor (tensors a quant table marks float) and by `reports.layer_nodes` (debug, tune).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ops.registry import op_of
from ptq.core.graph import Graph, Node
from ptq.core.names import did_you_mean
from ptq.engine.rewrites import RewriteLog


@dataclass(frozen=True)
class ResolvedLayer:
    """A layer name resolved to the node of the rewritten graph that computes it."""

    node: str
    note: Optional[str] = None  # set when the name was removed by a rewrite: which node absorbed it


def absorbed_names(rewrites: RewriteLog) -> dict[str, str]:
    """Names the rewrites removed -> the node of the rewritten graph that absorbed them: a BatchNormalization
    folded into its Conv, a constant Add folded into its layer's bias and a Relu/Clip/LeakyRelu fused into its
    Conv/Gemm, each by the removed node's name and by the tensor the host produced before (e.g. a Conv's raw
    output, now internal to Conv+Clip)."""
    hosts = {}
    for fold in rewrites.batchnorm_folds:
        hosts[fold.batchnorm] = hosts[fold.removed_tensor] = fold.conv
    for bias_add in rewrites.bias_adds:
        hosts[bias_add.adder] = hosts[bias_add.removed_tensor] = bias_add.host
    for fusion in rewrites.fusions:
        hosts[fusion.activation] = hosts[fusion.removed_tensor] = fusion.host
    return hosts


def fused_output(graph: Graph, node: Node, consumers: dict[str, list[Node]]) -> str:
    """The tensor `node` writes once the rewrites fuse an activation into it: the output of its first output's
    only consumer when the node absorbs activations and that consumer is absorbable (`OpDef.absorbs_activation`,
    `OpDef.absorbable`), else its first output. `consumers`: `graph.consumers()`."""
    name = node.outputs[0]
    users = consumers.get(name, [])
    if len(users) != 1 or name in graph.outputs:
        return name
    host, act = op_of(node), op_of(users[0])
    return users[0].outputs[0] if host is not None and host.absorbs_activation and act is not None \
        and act.absorbable else name


def resolve_layer(graph: Graph, rewrites: RewriteLog, layer: str) -> ResolvedLayer:
    """The node of the rewritten `graph` computing `layer`: a node name, the producer of a tensor name, or, for
    a name a rewrite removed, the node that absorbed it (with a note saying so)."""
    nodes = {node.name: node for node in graph.nodes}
    producer = {out: node.name for node in graph.nodes for out in node.outputs if out}
    if layer in nodes:
        return ResolvedLayer(layer)
    if layer in producer:
        return ResolvedLayer(producer[layer])
    if layer in graph.inputs:
        raise ValueError(f"{layer!r} is a graph input: it has no layer to run in float")
    host = absorbed_names(rewrites).get(layer)
    if host is None:
        known = [*nodes, *producer, *absorbed_names(rewrites)]
        raise ValueError(f"{layer!r} is neither a tensor nor a node of the integer graph{did_you_mean(layer, known)}")
    node = nodes[host]
    outputs = ", ".join(repr(o) for o in node.outputs if o)
    return ResolvedLayer(host, f"{layer!r} is not in the integer graph: a rewrite fused it into {node.op_type} node "
                               f"{host!r} (output {outputs}); that node runs in float")


def layer_nodes(graph: Graph, rewrites: RewriteLog, layer: str) -> list[str]:
    """The original node names that make up a layer: its producing node in the rewritten `graph` plus whatever
    the rewrites folded or fused into it."""
    node = resolve_layer(graph, rewrites, layer).node
    extra = [f.activation for f in rewrites.fusions if f.host == node]
    extra += [f.batchnorm for f in rewrites.batchnorm_folds if f.conv == node]
    extra += [f.adder for f in rewrites.bias_adds if f.host == node]
    return [node] + extra
