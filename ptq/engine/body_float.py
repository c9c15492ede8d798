"""Float values of the tensors inside control-flow bodies (If's branches, Loop's body), for calibration.

onnxruntime runs a model's If and Loop nodes but exposes no tensor of their subgraphs. `BodyEvaluator` runs
the bodies again in ptq's own float mode (node by node: a registered op's `forward_float`, else onnx.reference,
`ptq.engine.float_fallback`), starting from the graph tensors onnxruntime computed for the same batch: the branch the
condition selects, every iteration of a loop. The values it returns are folded into the same collectors as
the graph's activations, so the quant table holds every body tensor (`ptq.core.bodies`) and the executor can
run the bodies in integers.

A body tensor computed in several loop iterations is returned as one [1, N] array of all its values; a body
that does not run for a batch (the branch not taken) returns nothing for it, nor does a Scan's body (the Scan is
evaluated whole by onnx.reference, and runs in float).
"""
from __future__ import annotations

from collections import ChainMap
from typing import Mapping, MutableMapping

import numpy as np

from ptq.core.bodies import Body, node_bodies
from ptq.core.graph import Graph, Node, domain_opsets
from ptq.engine.float_fallback import NodeFloatEvaluator


class BodyEvaluator:
    """Runs the bodies of a graph's control-flow nodes in float from the graph's float tensors."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.opsets = domain_opsets(graph.model)
        self.evaluator = NodeFloatEvaluator(graph.opset)
        self._bodies: dict[str, dict[str, Body]] = {}
        self.control = [n for n in graph.nodes if self.bodies(n)]
        # the graph tensors the bodies start from (onnxruntime must return them too)
        self.needed = list(dict.fromkeys(i for n in self.control for i in n.all_inputs
                                         if i and i not in graph.initializers))

    def bodies(self, node: Node) -> dict[str, Body]:
        """A node's bodies by attribute name (empty for an ordinary node)."""
        if node.name not in self._bodies:
            self._bodies[node.name] = {b.attribute: b for b in node_bodies(node, self.opsets)}
        return self._bodies[node.name]

    def evaluate(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The body tensors of one batch, from the graph tensors `values` (inputs included)."""
        found: dict[str, list[np.ndarray]] = {}
        scope = ChainMap(dict(values), self.graph.initializers)
        for node in self.control:
            self._run_node(node, scope, found)
        return {name: arrays[0] if len(arrays) == 1 else
                np.concatenate([np.ravel(a) for a in arrays])[None] for name, arrays in found.items()}

    def _run_node(self, node: Node, scope: Mapping, found: dict) -> list[np.ndarray]:
        bodies = self.bodies(node)
        if "then_branch" in bodies:  # If
            cond = bool(np.asarray(scope[node.inputs[0]]).reshape(-1)[0])
            body = bodies["then_branch" if cond else "else_branch"]
            local = self._run_body(body, scope, {}, found)
            return [local[o] for o in body.outputs]
        if "body" in bodies and node.attr("num_scan_inputs") is None:  # Loop
            return self._run_loop(node, bodies["body"], scope, found)
        # another node with a body (Scan): run whole by onnx.reference, its body tensors not collected (the
        # executor runs it in float)
        return self.evaluator.run(node, [scope[i] if i else None for i in node.all_inputs])

    def _run_loop(self, node: Node, body: Body, scope: Mapping, found: dict) -> list[np.ndarray]:
        trips = node.inputs[0] if node.inputs else ""
        limit = int(np.asarray(scope[trips]).reshape(-1)[0]) if trips else None
        cond_name = node.inputs[1] if len(node.inputs) > 1 else ""
        cond = bool(np.asarray(scope[cond_name]).reshape(-1)[0]) if cond_name else True
        carried = [scope[i] for i in node.inputs[2:]]
        scans: list[list[np.ndarray]] = []
        step = 0
        while cond and (limit is None or step < limit):
            feeds = dict(zip(body.inputs, [np.array(step, np.int64), np.array(cond)] + carried))
            local = self._run_body(body, scope, feeds, found)
            results = [local[o] for o in body.outputs]
            cond = bool(np.asarray(results[0]).reshape(-1)[0])
            carried = results[1:1 + len(carried)]
            scans.append(results[1 + len(carried):])
            step += 1
        stacked = [np.stack(parts) for parts in zip(*scans)] if scans else []
        return carried + stacked

    def _run_body(self, body: Body, outer: Mapping, feeds: Mapping, found: dict) -> MutableMapping:
        local: dict[str, np.ndarray] = dict(feeds)
        scope = ChainMap(local, body.initializers, outer)
        for node in body.nodes:
            args = [scope[i] if i else None for i in node.all_inputs]
            outs = self._run_node(node, scope, found) if self.bodies(node) else self.evaluator.run(node, args)
            local.update((name, value) for name, value in zip(node.outputs, outs) if name)
        for name in body.float_tensors:
            if name in local:
                found.setdefault(name, []).append(np.asarray(local[name], dtype=np.float32))
        return scope
