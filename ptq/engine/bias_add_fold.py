"""A per-channel constant added after a Conv/ConvTranspose/Gemm/MatMul is the layer's bias (issue 24: Paddle exports
put 75 of a text detector's 83 Conv biases in an `Add` after a bias-less Conv). Folded, the layer's bias takes
the int32 bias path (b_q = b / (s_x * s_w[c])), bias correction corrects it, and one requantized tensor less
is left (the layer's raw output no longer exists).

    y = host(x [, W, b]);   z = y + c   (Add; Sub(y, c) adds -c)
    ->  z = host(x, W, b'),  b'[k] = b[k] + sign * c[k]     (b = 0 when the host has none)

when the host can take a bias (`OpDef.bias_slot`: the bias input and the output axis its values run along,
channel axis 1 for Conv/ConvTranspose, columns for a Gemm with beta = 1, the last axis for a MatMul, whose
bias input exists only in ptq's integer graph) and has a constant weight, the adder is an op whose
`sum_signs` give y the sign +1 (Add, Sub), `c` is a constant whose broadcast to y's shape varies only along the
bias axis (shapes [C,1,1], [1,C,1,1], [1] for a Conv's NCHW output; [N], [1,N] for a Gemm's or a MatMul's; a
[C] on a 4-D output broadcasts along W and is no bias), and y feeds nothing else and is no graph output. Exact in float
(up to float32 rounding of b + c).

Ops are told apart by the registry's facts, never by their type names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops.registry import bias_slot, op_of, weight_role
from ptq.core.graph import Graph, Node
from ptq.engine.graph_edit import drop_activation, make_constant, single_consumer, unique_name


@dataclass(frozen=True)
class BiasAddFold:
    host: str  # node names
    adder: str
    bias: str  # the host's new bias initializer
    constant: str  # the adder's constant input (folded into `bias`)
    removed_tensor: str  # the host's former output (no longer exists; the host now outputs the adder's tensor)


@dataclass(frozen=True)
class BiasAdd:
    """A foldable `host -> adder(c)` pair (module docstring)."""

    host: Node
    adder: Node
    constant: str  # the adder's constant input
    sign: int  # the sign c takes in the sum
    channels: int  # the host's output channels (along its bias axis)

    def folded_bias(self, graph: Graph) -> np.ndarray:
        """The host's bias once c is folded in: b + sign * c, one value per output channel (float64)."""
        c = np.asarray(graph.initializers[self.constant], dtype=np.float64).reshape(-1)  # 1 or C values
        own = _own_bias(graph, self.host)
        return np.broadcast_to(own, (self.channels,)) + self.sign * np.broadcast_to(c, (self.channels,))


def _own_bias(graph: Graph, host: Node) -> np.ndarray:
    """The host's constant bias input flattened (float64), [0] without one."""
    slot = bias_slot(host)
    present = len(host.inputs) > slot.input_index and host.inputs[slot.input_index]
    return np.asarray(graph.initializers[host.inputs[slot.input_index]], dtype=np.float64).reshape(-1) if present \
        else np.zeros(1)


def _static_shape(graph: Graph, name: str) -> Optional[tuple]:
    info = graph.tensors.get(name)
    if info is None or info.shape is None or any(d is None for d in info.shape):
        return None
    return tuple(int(d) for d in info.shape)


def bias_add_after(graph: Graph, host: Node, consumers: dict[str, list[Node]]) -> Optional[BiasAdd]:
    """The foldable constant add after `host` (module docstring), or None."""
    slot = bias_slot(host)
    if slot is None or not host.outputs or not single_consumer(graph, consumers, host.outputs[0]):
        return None
    if "activation" in host.attrs:  # a fused activation comes after the bias: c would land after the clamp
        return None
    role = weight_role(host)  # a bias is quantized on s_x * s_w: the layer needs a constant weight
    if role is None or len(host.inputs) <= role.input_index or host.inputs[role.input_index] not in graph.initializers:
        return None
    present = len(host.inputs) > slot.input_index and host.inputs[slot.input_index]
    if present and host.inputs[slot.input_index] not in graph.initializers:
        return None
    y = host.outputs[0]
    shape = _static_shape(graph, y)
    if shape is None or not -len(shape) <= slot.output_axis < len(shape):
        return None
    axis = slot.output_axis % len(shape)
    if _own_bias(graph, host).size not in (1, shape[axis]):
        return None
    [adder] = consumers[y]
    op = op_of(adder)
    if op is None or op.sum_signs is None or len(adder.inputs) != 2 or len([o for o in adder.outputs if o]) != 1:
        return None
    position = adder.inputs.index(y)
    other = adder.inputs[1 - position]
    if other == y or other not in graph.initializers or op.sum_signs[position] != 1:
        return None
    c = graph.initializers[other]
    if c.dtype != np.float32 or c.ndim > len(shape) or _static_shape(graph, adder.outputs[0]) != shape:
        return None
    full = (1,) * (len(shape) - c.ndim) + tuple(c.shape)
    if any(d != 1 for a, d in enumerate(full) if a != axis) or full[axis] not in (1, shape[axis]):
        return None
    return BiasAdd(host, adder, other, int(op.sum_signs[1 - position]), shape[axis])


def fold_bias_adds(graph: Graph, protected: frozenset = frozenset()) -> list[BiasAddFold]:
    """Fold every foldable constant add into its host's bias, in place on `graph` (a copy the caller owns);
    nodes in `protected` take no part."""
    folds, removed = [], set()
    consumers = graph.consumers()
    for host in graph.nodes:
        if host.name in protected:
            continue
        match = bias_add_after(graph, host, consumers)
        if match is None or match.adder.name in protected:
            continue
        slot = bias_slot(host)
        name = unique_name(graph, f"{host.name}_bias_{match.constant}")
        make_constant(graph, name, match.folded_bias(graph).astype(np.float32))
        host.inputs = list(host.inputs) + [""] * (slot.input_index + 1 - len(host.inputs))
        host.inputs[slot.input_index] = name
        old_out = host.outputs[0]
        host.outputs[0] = match.adder.outputs[0]
        drop_activation(graph, old_out)
        removed.add(match.adder.name)
        folds.append(BiasAddFold(host.name, match.adder.name, name, match.constant, old_out))
    graph.nodes = [n for n in graph.nodes if n.name not in removed]
    return folds


def effective_bias(graph: Graph, host: Node) -> Optional[np.ndarray]:
    """The bias `host` computes with once folded (`BiasAdd.folded_bias`), or None without a foldable add."""
    match = bias_add_after(graph, host, graph.consumers())
    return None if match is None else match.folded_bias(graph)
