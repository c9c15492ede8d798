"""A layer name (tensor or node, as in the report) resolved to the nodes of the model that compute it, on a
prepared integer graph (`ptq.engine.fused_layers` on its rewritten graph).

Floating a Conv or Gemm also floats the BatchNormalization and the Relu/Clip/LeakyRelu the executor fused into
it, so the whole fused layer runs in float. A name a rewrite removed (a Conv's raw output before the Clip fused
into it, or the fused activation / folded BatchNormalization node) resolves to the node that absorbed it, with a
note.
"""
from __future__ import annotations

from typing import Sequence

from ptq.engine import fused_layers
from ptq.engine.executor import IntegerGraph
from ptq.engine.fused_layers import ResolvedLayer


def absorbed_names(prepared: IntegerGraph) -> dict[str, str]:
    """Names the rewrites removed -> the node of the integer graph that absorbed them."""
    return fused_layers.absorbed_names(prepared.rewrites)


def resolve_layer(prepared: IntegerGraph, layer: str) -> ResolvedLayer:
    """The node computing `layer` (`ptq.engine.fused_layers.resolve_layer` on the integer graph)."""
    return fused_layers.resolve_layer(prepared.graph, prepared.rewrites, layer)


def layer_nodes(prepared: IntegerGraph, layer: str) -> list[str]:
    """The original node names that make up a layer (tensor or node name of the integer graph, or a name a
    rewrite fused away): its producing node plus whatever the rewrites folded or fused into it."""
    return fused_layers.layer_nodes(prepared.graph, prepared.rewrites, layer)


def float_node_names(prepared: IntegerGraph, layers: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(name for layer in layers for name in layer_nodes(prepared, layer)))
