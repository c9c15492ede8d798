"""Cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization", section 4.1), data-free.

For two Convs in a chain `Conv1 -> [act | Clip(0, b)] -> Conv2` (Conv1's output and the activation's output
each consumed only by the next node), output channel c of Conv1 feeds input channel c of Conv2. Scaling
channel c by 1/s_c in Conv1 and by s_c in Conv2 keeps the float function, because the activation is
positively homogeneous (act(x/s) = act(x)/s for s > 0: Relu, LeakyRelu, PRelu, as their ops declare,
`OpDef.positively_homogeneous`):

    W1'[c] = W1[c] / s_c,   b1'[c] = b1[c] / s_c,   W2'[:, c] = W2[:, c] * s_c
    s_c = sqrt(r1_c / r2_c),  r1_c = max|W1[c]|,  r2_c = max|W2[:, c]|   (depthwise Conv2: max|W2[c]|)

so that both weights get the per-channel range sqrt(r1_c r2_c) and per-tensor weight grids fit every channel.
Conv2 must be ungrouped or depthwise (group = channels, one output per group); Conv1 may have any group.

Clip(0, b) is homogeneous only when its bound scales with the channel: Clip(x/s_c, 0, b/s_c). ONNX Clip has
scalar bounds, so an equalized Clip(0, b) becomes `Clip(0, max_c b/s_c) -> Min(., b/s_c per channel)`: the same
function exactly, a Clip that still fuses into Conv1 and folds its range, and one extra Min on the codes.
A Clip with a lower bound other than 0 is not homogeneous and its pair is left alone (reported in the log).

Chains share convolutions (a depthwise Conv is Conv2 of one pair and Conv1 of the next), so the pairs are
swept in graph order until no scale moves by more than `tol` (relative), at most `max_sweeps` times. Then
the high biases that provably pass through the activation move into Conv2 (`ptq.adjust.bias_absorption`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ops.registry import channel_groups, layer_kind, op_of
from ptq.adjust.bias_absorption import AbsorptionLog, absorb
from ptq.core.graph import Graph, Node
from ptq.core.roles import LayerKind


@dataclass
class _Pair:
    conv1: Node
    act: Optional[Node]  # the activation between the two Convs (None: linear chain)
    conv2: Node
    bound: Optional[np.ndarray]  # a clamping activation's upper bound per channel (None: unbounded or none)
    clamped: bool = False  # the activation clamps its output to [0, bound] (Relu, Clip(0, b))


@dataclass
class EqualizeLog:
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (conv1, conv2) node names equalized
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (node name, why) chains left alone
    sweeps: int = 0
    absorption: Optional[AbsorptionLog] = None

    def summary(self) -> str:
        text = f"equalized {len(self.pairs)} Conv pairs in {self.sweeps} sweeps"
        if self.skipped:
            text += f"; {len(self.skipped)} chains left alone (" + "; ".join(f"{n}: {w}" for n, w in self.skipped) + ")"
        if self.absorption is not None:
            text += f"; {self.absorption.summary()}"
        return text


def _conv_weight(graph: Graph, node: Node) -> Optional[np.ndarray]:
    if layer_kind(node) is not LayerKind.CONVOLUTION or len(node.inputs) < 2:
        return None
    w = graph.initializers.get(node.inputs[1])
    return w if w is not None and np.issubdtype(w.dtype, np.floating) else None


def _only_consumer(graph: Graph, consumers: dict, tensor: str) -> Optional[Node]:
    users = consumers.get(tensor, [])
    if len(users) != 1 or tensor in graph.outputs or users[0].inputs[0] != tensor:
        return None
    return users[0]


def _clip_range(graph: Graph, node: Node) -> Optional[tuple[float, float]]:
    """The interval the node clamps its input to (`OpDef.clip_range`), None when it is no clamp with constant
    bounds."""
    op = op_of(node)
    return op.clip_range(node, graph.constant_lookup(node)) if op is not None else None


def _activation(graph: Graph, node: Node, channels: int, log: EqualizeLog) -> Optional[tuple[Optional[np.ndarray], bool]]:
    """(per-channel upper bound, clamps to [0, bound]) of an activation equalization scales through: a positively
    homogeneous op, or a clamp to [0, b] (Clip) whose bound `_split_clip` scales with the channel; None for any
    other node (logged when it is a clamp to another interval)."""
    op = op_of(node)
    bounds = _clip_range(graph, node)
    if op is not None and op.positively_homogeneous:
        return None, bounds is not None
    if bounds is None:
        return None
    if bounds[0] != 0.0:
        log.skipped.append((node.name, f"{node.op_type} bounds {bounds} are not [0, b]: not homogeneous"))
        return None
    if node.opset < 11:  # load_model converts old opsets; attribute bounds are not rescaled here
        log.skipped.append((node.name, f"{node.op_type} bounds given as attributes (opset < 11) are not rescaled"))
        return None
    return (np.full(channels, bounds[1], dtype=np.float64) if np.isfinite(bounds[1]) else None), True


def find_pairs(graph: Graph, log: EqualizeLog) -> list[_Pair]:
    """The chains Conv1 -> [Relu | Clip(0, b)] -> Conv2 that equalization may rescale exactly."""
    consumers = graph.consumers()
    pairs = []
    for conv1 in graph.nodes:
        w1 = _conv_weight(graph, conv1)
        if w1 is None or len(conv1.outputs) != 1:
            continue
        nxt = _only_consumer(graph, consumers, conv1.outputs[0])
        act, bound, clamped = None, None, False
        if nxt is not None and _conv_weight(graph, nxt) is None:
            found = _activation(graph, nxt, w1.shape[0], log)
            if found is None:
                continue
            act, (bound, clamped) = nxt, found
            nxt = _only_consumer(graph, consumers, nxt.outputs[0])
        w2 = _conv_weight(graph, nxt) if nxt is not None else None
        if w2 is None:
            continue
        group = channel_groups(nxt)
        channels = w1.shape[0]
        if not (group == 1 and w2.shape[1] == channels) and not (group == channels == w2.shape[0] and w2.shape[1] == 1):
            log.skipped.append((nxt.name, f"group {group} is neither 1 nor depthwise"))
            continue
        pairs.append(_Pair(conv1, act, nxt, bound, clamped))
    return pairs


def _channel_range(w: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(np.abs(w), axis, 0)
    return moved.reshape(moved.shape[0], -1).max(axis=1).astype(np.float64)


def equalization_scales(w1: np.ndarray, w2: np.ndarray, depthwise2: bool) -> np.ndarray:
    """s_c = sqrt(r1_c / r2_c) (module docstring); 1 where either range is 0."""
    r1 = _channel_range(w1, 0)
    r2 = _channel_range(w2, 0 if depthwise2 else 1)
    s = np.ones_like(r1)
    ok = (r1 > 0) & (r2 > 0)
    s[ok] = np.sqrt(r1[ok] / r2[ok])
    return s


def equalize(graph: Graph, *, max_sweeps: int = 50, tol: float = 1e-4,
             absorb_biases: bool = True) -> tuple[onnx.ModelProto, EqualizeLog]:
    """A copy of `graph.model` with every equalizable Conv pair rescaled (module docstring) and its log;
    `absorb_biases`: then the provable high biases absorbed into the next Conv (`ptq.adjust.bias_absorption`)."""
    log = EqualizeLog()
    pairs = find_pairs(graph, log)
    weights: dict[str, np.ndarray] = {}
    biases: dict[str, np.ndarray] = {}

    def weight(node: Node) -> np.ndarray:
        return weights.setdefault(node.inputs[1], graph.initializers[node.inputs[1]].astype(np.float64))

    def bias(node: Node, channels: int) -> np.ndarray:
        key = node.name
        if key not in biases:
            name = node.inputs[2] if len(node.inputs) > 2 else ""
            biases[key] = graph.initializers[name].astype(np.float64) if name else np.zeros(channels)
        return biases[key]

    for sweep in range(max_sweeps):
        log.sweeps = sweep + 1
        moved = 0.0
        for pair in pairs:
            w1, w2 = weight(pair.conv1), weight(pair.conv2)
            depthwise2 = channel_groups(pair.conv2) > 1
            s = equalization_scales(w1, w2, depthwise2)
            moved = max(moved, float(np.max(np.abs(np.log(s)))))
            shape1 = (-1,) + (1,) * (w1.ndim - 1)
            w1 /= s.reshape(shape1)
            b1 = bias(pair.conv1, w1.shape[0])
            b1 /= s
            w2 *= s.reshape(shape1) if depthwise2 else s.reshape((1, -1) + (1,) * (w2.ndim - 2))
            if pair.bound is not None:
                pair.bound /= s
        if moved < tol:
            break
    log.pairs = [(p.conv1.name, p.conv2.name) for p in pairs]
    if absorb_biases:
        log.absorption = absorb(pairs, weight, bias, _input_bounds(graph, pairs))
    return _write(graph, pairs, weights, biases), log


def _input_bounds(graph: Graph, pairs: list[_Pair]):
    """tensor, channels -> per-channel (lo, hi) of the tensor when a clamp (Relu, Clip: `OpDef.clip_range`)
    bounds it, else None; a pair's activation output reads the pair's current per-channel bound (lowered by
    absorption as it goes)."""
    producer = graph.producer()
    by_output = {p.act.outputs[0]: p for p in pairs if p.act is not None}

    def bounds(tensor: str, channels: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
        pair = by_output.get(tensor)
        if pair is not None:
            if not pair.clamped:
                return None
            hi = pair.bound if pair.bound is not None else np.full(channels, np.inf)
            return np.zeros(channels), np.array(hi, dtype=np.float64)
        node = producer.get(tensor)
        clamp = _clip_range(graph, node) if node is not None else None
        if clamp is None:
            return None
        lo, hi = clamp
        if not np.isfinite(lo) and not np.isfinite(hi):
            return None
        return np.full(channels, lo), np.full(channels, hi)

    return bounds


def _write(graph: Graph, pairs: list[_Pair], weights: dict, biases: dict) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    inits = {init.name: init for init in model.graph.initializer}
    taken = set(inits) | {o for n in model.graph.node for o in n.output} | {n.name for n in model.graph.node}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        return name

    def put(name: str, value: np.ndarray) -> None:
        dtype = graph.initializers[name].dtype if name in graph.initializers else np.float32
        inits[name].CopyFrom(numpy_helper.from_array(value.astype(dtype), name))

    shared = {name for name, users in graph.consumers().items() if len(users) > 1 and name in graph.initializers}
    nodes = {n.name: n for n in model.graph.node}
    for name, value in weights.items():
        if name in shared:
            raise ValueError(f"weight {name!r} is shared by several nodes; equalization cannot rescale it")
        put(name, value)
    for node_name, b in biases.items():
        proto = nodes[node_name]
        if len(proto.input) > 2 and proto.input[2]:
            if proto.input[2] in shared:
                raise ValueError(f"bias {proto.input[2]!r} is shared by several nodes; equalization cannot rescale it")
            put(proto.input[2], b)
        else:
            name = fresh(f"{node_name}.equalized_bias")
            model.graph.initializer.append(numpy_helper.from_array(b.astype(np.float32), name))
            while len(proto.input) < 2:
                proto.input.append("")
            proto.input.append(name)
    replaced = set()
    for pair in pairs:
        if pair.bound is not None:
            replaced.update(nodes[pair.act.name].input[1:])
            _split_clip(model, nodes[pair.act.name], pair.bound, weights[pair.conv1.inputs[1]].ndim - 2, fresh)
    used = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    kept = [init for init in model.graph.initializer if init.name in used or init.name not in replaced]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)  # the replaced Clip bounds
    return model


def _split_clip(model: onnx.ModelProto, clip: onnx.NodeProto, bound: np.ndarray, spatial: int, fresh) -> None:
    """Clip(0, b) -> Clip(0, max b) -> Min(., b per channel) (module docstring), in place. The clamp is a Clip:
    the only op whose `OpDef.clip_range` has a finite upper bound (Relu's is infinite)."""
    lo = fresh(f"{clip.name}.equalized_min")
    hi = fresh(f"{clip.name}.equalized_max")
    per_channel = fresh(f"{clip.name}.equalized_bound")
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array(0.0, dtype=np.float32), lo),
        numpy_helper.from_array(np.array(np.max(bound), dtype=np.float32), hi),
        numpy_helper.from_array(bound.astype(np.float32).reshape((-1,) + (1,) * spatial), per_channel),
    ])
    source, out = clip.input[0], clip.output[0]
    mid = fresh(f"{out}.clipped")
    del clip.input[:]
    clip.input.extend([source, lo, hi])
    clip.output[0] = mid
    index = list(model.graph.node).index(clip)
    model.graph.node.insert(index + 1, helper.make_node("Min", [mid, per_channel], [out], name=fresh(f"{clip.name}.bound")))
