"""Float evaluation of single nodes: constant folding, shape subgraphs and the executor's float fallback.

A node runs through its registered op's `forward_float` when there is one, otherwise through onnx's reference
implementation of that single node (`onnx.reference.ReferenceEvaluator` over the node alone). A node that
neither knows (a custom domain without a registered op) raises `FloatFallbackError` naming it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ops.registry import QuantizationError, get_op, node_label
from ptq.core.graph import Node

if TYPE_CHECKING:
    from onnx.reference import ReferenceEvaluator


class FloatFallbackError(ValueError):
    """A node cannot be evaluated in float (no registered op and no onnx reference implementation)."""


def _attr_to_proto_value(value):
    if isinstance(value, np.ndarray):
        return numpy_helper.from_array(value)
    return value


def node_proto(node: Node) -> onnx.NodeProto:
    """The ONNX NodeProto of an IR node (attributes converted back to their ONNX form)."""
    attrs = {k: _attr_to_proto_value(v) for k, v in node.attrs.items()}
    return helper.make_node(node.op_type, node.inputs, node.outputs, name=node.name, domain=node.domain, **attrs)


def _graph_of(node: Node) -> onnx.GraphProto:
    """A one-node graph: onnx.reference honours `opsets` for a graph, not for a bare node (it would run
    the newest version of the op, e.g. Unsqueeze-13 with axes as an input, on an opset-12 node)."""
    def untyped(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)

    return helper.make_graph([node_proto(node)], node.name or node.op_type,
                             [untyped(i) for i in dict.fromkeys(node.all_inputs) if i],
                             [untyped(o) for o in node.outputs if o])


class NodeFloatEvaluator:
    """Evaluates single nodes in float: a node's registered `forward_float`, else onnx.reference over the node
    alone (one `ReferenceEvaluator` built per node and reused). Not the whole-model float run: that is
    `ptq.engine.float_run.FloatRunner`."""

    def __init__(self, opset: int):
        self.opset = opset
        self._evaluators: dict[str, ReferenceEvaluator] = {}

    def reference_evaluator(self, node: Node) -> ReferenceEvaluator:
        """The (cached) onnx.reference evaluator of `node`; raises FloatFallbackError when it cannot run it."""
        ev = self._evaluators.get(node.name)
        if ev is None:
            from onnx.reference import ReferenceEvaluator  # imported by the first node that needs it (~40 ms)

            opsets = {"": self.opset}
            if node.domain:
                opsets[node.domain] = 1
            try:
                try:
                    ev = ReferenceEvaluator(_graph_of(node), opsets=opsets)
                except RuntimeError:  # onnx.reference lacks the model's version of this op: take its newest
                    ev = ReferenceEvaluator(node_proto(node), opsets=opsets)
            except Exception as exc:  # onnx raises several types for unknown ops / bad attributes
                raise FloatFallbackError(
                    f"{node.op_type} node {node.name!r} (domain {node.domain or 'ai.onnx'!r}) has no registered op "
                    f"and onnx.reference cannot run it: {exc}"
                ) from exc
            self._evaluators[node.name] = ev
        return ev

    def run_reference(self, node: Node, inputs: list[Optional[np.ndarray]]) -> list[np.ndarray]:
        """The float outputs of `node` by onnx.reference (the registered op is not consulted)."""
        ev = self.reference_evaluator(node)
        feeds = {name: value for name, value in zip(node.all_inputs, inputs) if name}
        try:
            outs = ev.run(None, feeds)
        except Exception as exc:  # reference kernels raise whatever numpy raises
            raise FloatFallbackError(f"onnx.reference failed on {node.op_type} node {node.name!r}: {exc}") from exc
        return [np.asarray(o) for o in outs]

    def run(self, node: Node, inputs: list[Optional[np.ndarray]]) -> list[np.ndarray]:
        """The outputs of `node` from `inputs`, aligned with `node.all_inputs` (its inputs, then the outer-scope
        tensors its subgraphs read): its registered `forward_float` when its data input (the first) is a float
        tensor, else onnx.reference. Index and shape tensors (Shape -> Gather -> Concat -> Reshape, int64 axes,
        bool masks) are thus computed exactly in their own dtype; a registered float forward computes in
        float32."""
        op = get_op(node.op_type, node.domain)
        data = next((np.asarray(x) for x in inputs if x is not None), None)
        if op is not None and (data is None or np.issubdtype(data.dtype, np.floating)):
            try:
                return list(op.forward_float(node, inputs))
            except (NotImplementedError, QuantizationError):
                pass  # an op may leave its float forward (or a configuration it does not support) to onnx.reference
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"{node_label(node)}: {exc}") from exc
        return self.run_reference(node, inputs)
