"""Joins of widely different ranges keep one grid per part (issue 24; whitepaper 5.1.3 keeps detection scores
in int16).

A YOLO-style head concatenates 4 box rows in pixels (0..320) with sigmoid class scores (0..1) into one output.
One 8-bit grid over the joined range has a step of 320 / 255 = 1.25: every score lands on code 0 or 1, while
the output's cosine (dominated by the boxes) still reads 0.999. So, by default, when an op that joins its
inputs along an axis (`OpDef.joins_along`: Concat) joins activations whose range widths differ by more than
RANGE_RATIO, and its output reaches a graph output either directly or through ops that only move codes
(`OpDef.keeps_input_qparams`: Reshape, Transpose, Flatten, ...; each with that one consumer):

- every part's size along the axis is static and every op of the chain keeps the channels whole along one
  axis (`OpDef.moved_axis`: Transpose, Reshape, Flatten, ...): **one grid per part**, a per-channel activation
  entry along the join axis whose channels take their part's range (a constant part its own per-channel
  range), and the same grid on each tensor of the chain along the axis its channels moved to. Calibrated
  alike, a part's channels get the part's own grid, so the integer Concat copies its codes (`ops.concat`),
  the chain moves them (`ops.layout`), and the QDQ model quantizes those tensors per axis;
- otherwise (unknown sizes, or a Split/Slice in the chain): **16 bits** for the joined tensor and the chain
  after it, over the join's calibrated range (2^16 steps: a part 1/256 of the range keeps the resolution an
  8-bit grid of its own would give it).

Either way the joined tensor, the chain after it and **the tail that feeds only its parts** take 16 bits
(whitepaper 5.1.3 keeps detection outputs in int16): walking back from the join, every activation whose
consumers all lie in that tail, up to and including the output of the nearest layer with a weight
(`OpDef.weight_role`: Conv, Gemm, MatMul), whose inputs keep the calibrator's grid. In a YOLO head that is
the class logits' Conv outputs, their Reshapes and Concat and the Sigmoid (a score of 0.25 sits where an
8-bit logit grid over -45..5 steps 0.2, i.e. 0.04 in score), and the box decode after the DFL Conv (the
anchors' Sub/Add, Concat and the stride Mul, which an 8-bit grid over 0..580 pixels steps 2.3 pixels): with
8 bits these flip detections near the score threshold and the NMS IoU, at 16 bits they leave the error of
the 8-bit network before them.

Each changed entry says why in its `why` field. Joins inside the network (FPN concats feeding a Conv) keep
the calibrator's grid: their consumers need one per-tensor grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops.registry import op_of, reads_values
from ptq.core.bodies import has_bodies
from ptq.core.graph import Graph, Node
from ptq.table.quant_table import CalibrationOptions, TensorEntry

RANGE_RATIO = 16.0  # range widths differing more than this get a grid per part
WIDE_BITS = 16


@dataclass(frozen=True)
class JoinedRanges:
    """One join whose parts got their own grids: the tensors whose entries changed and why."""

    node: str
    tensors: tuple[str, ...]  # the joined tensor and the chain after it
    ratio: float
    per_channel: bool
    why: str
    tail: tuple[str, ...] = ()  # the activations feeding only the parts, at 16 bits


def _width(entry: TensorEntry) -> float:
    return float(np.max(entry.max) - np.min(entry.min))


def chain_to_output(graph: Graph, consumers: dict[str, list[Node]], tensor: str) -> Optional[list[Node]]:
    """The single-consumer code-moving nodes after `tensor` up to a graph output ([] when `tensor` is itself a
    graph output with no consumer), or None when it does not end there."""
    chain = []
    while True:
        users = consumers.get(tensor, [])
        if not users:
            return chain if tensor in graph.outputs else None
        if tensor in graph.outputs or len(users) != 1:
            return None
        op = op_of(users[0])
        outputs = [o for o in users[0].outputs if o]
        if op is None or not op.keeps_input_qparams or len(outputs) != 1 or users[0].inputs[0] != tensor:
            return None
        tensor = outputs[0]
        chain.append(users[0])


def _moved_axes(graph: Graph, chain: list[Node], axis: int) -> Optional[list[int]]:
    """The axis holding the joined channels on each tensor of the chain, or None where an op cuts them."""
    axes = []
    for node in chain:
        shapes = [graph.tensors[n].shape if n in graph.tensors else None for n in (node.inputs[0], node.outputs[0])]
        moved = op_of(node).moved_axis(node, axis, *shapes)
        if moved is None:
            return None
        axes.append(axis := moved)
    return axes


def _static_sizes(graph: Graph, node: Node, axis: int) -> Optional[list[int]]:
    sizes = []
    for name in node.inputs:
        shape = graph.tensors[name].shape if name in graph.tensors else None
        if shape is None or not -len(shape) <= axis < len(shape) or shape[axis] is None:
            return None
        sizes.append(int(shape[axis]))
    return sizes


def _part_ranges(graph: Graph, entries: dict[str, TensorEntry], node: Node, axis: int,
                 sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per output channel along `axis`: the range of the part it comes from (a constant part: its own values
    per channel)."""
    lo, hi = [], []
    for name, size in zip(node.inputs, sizes):
        if name in entries:
            lo.append(np.full(size, float(np.min(entries[name].min))))
            hi.append(np.full(size, float(np.max(entries[name].max))))
        else:
            value = np.moveaxis(np.asarray(graph.initializers[name], dtype=np.float64), axis, 0).reshape(size, -1)
            lo.append(value.min(axis=1))
            hi.append(value.max(axis=1))
    return np.concatenate(lo), np.concatenate(hi)


def feeding_only(graph: Graph, consumers: dict[str, list[Node]], entries: dict[str, TensorEntry],
               joined: list[Node]) -> list[str]:
    """The activations that feed only the `joined` nodes (the join and its chain): walking the graph backwards
    from them, a node joins the tail when each of its outputs is an activation read only by the tail (or by
    nodes that read its shape alone: Shape, Size); a layer with a weight, a node with bodies (If, Loop: their
    layers are inside) and an unregistered op join it (their outputs) but do not pull their own inputs in."""
    pulling = {id(node) for node in joined}
    tail = []
    for node in reversed(graph.nodes):
        outputs = [o for o in node.outputs if o]
        if not outputs or id(node) in pulling or any(o not in entries or o in graph.outputs for o in outputs):
            continue
        readers = [[user for user in consumers.get(o, []) if reads_values(user)] for o in outputs]
        if not all(users and all(id(user) in pulling for user in users) for users in readers):
            continue
        tail += outputs
        op = op_of(node)
        if op is not None and op.weight_role(node) is None and not has_bodies(node):
            pulling.add(id(node))
    return tail[::-1]


def widen(entries: dict[str, TensorEntry], options: CalibrationOptions, names: list[str], why: str) -> None:
    """The entries of `names` at WIDE_BITS over their calibrated ranges (per tensor or per channel as they
    are), each saying `why`."""
    for name in names:
        entry = entries[name]
        qp = options.derive_qparams("activation", entry.min, entry.max, WIDE_BITS, entry.qparams.axis)
        entries[name] = TensorEntry("activation", entry.calibrator, entry.min, entry.max, qp, entry.run_in_float, why)


def separate_joined_parts(graph: Graph, entries: dict[str, TensorEntry],
                          options: CalibrationOptions) -> list[JoinedRanges]:
    """Give the joins of widely different ranges that end in a graph output one grid per part, or 16 bits
    (module docstring), in place on `entries` (the activation entries); returns what changed."""
    consumers = graph.consumers()
    changed = []
    for node in graph.nodes:
        op = op_of(node)
        axis = op.joins_along(node) if op is not None else None
        if axis is None or not node.outputs or node.outputs[0] not in entries:
            continue
        if any(name not in entries and name not in graph.initializers for name in node.inputs):
            continue
        widths = [_width(entries[name]) for name in node.inputs if name in entries]
        widths = [w for w in widths if w > 0]
        if len(widths) < 2 or max(widths) <= RANGE_RATIO * min(widths):
            continue
        out = node.outputs[0]
        chain = chain_to_output(graph, consumers, out)
        if chain is None:
            continue
        ratio = max(widths) / min(widths)
        joined = entries[out]
        rank = len(graph.tensors[out].shape or ()) if out in graph.tensors else 0
        sizes = _static_sizes(graph, node, axis) if rank else None
        axes = _moved_axes(graph, chain, axis % rank) if sizes is not None else None
        tensors = [out] + [n.outputs[0] for n in chain]
        tail = feeding_only(graph, consumers, entries, [node, *chain])
        label = f"{node.op_type} {node.name!r} joins parts whose ranges differ {ratio:.0f}x (> {RANGE_RATIO:g}x)"
        widen(entries, options, tail, f"feeds only the parts of {label} into output {tensors[-1]!r}: "
                                       f"{WIDE_BITS} bits, as the joined output (whitepaper 5.1.3)")
        if axes is not None:
            axis %= rank
            lo, hi = _part_ranges(graph, entries, node, axis, sizes)
            why = f"{label}: one grid per part, per channel along axis {axis}, at {WIDE_BITS} bits (whitepaper 5.1.3)"
            for name, along in zip(tensors, [axis] + axes):
                qp = options.derive_qparams("activation", lo, hi, WIDE_BITS, along)
                entries[name] = TensorEntry("activation", joined.calibrator, lo, hi, qp, entries[name].run_in_float,
                                            why if name == out else f"{why} (moved to axis {along} of {name!r})")
            changed.append(JoinedRanges(node.name, tuple(tensors), ratio, True, why, tuple(tail)))
            continue
        why = f"{label}: the joined tensor at {WIDE_BITS} bits (whitepaper 5.1.3)"
        qp = options.derive_qparams("activation", joined.min, joined.max, WIDE_BITS)
        for name in tensors:
            entries[name] = TensorEntry("activation", joined.calibrator, joined.min, joined.max, qp,
                                        entries[name].run_in_float, why)
        changed.append(JoinedRanges(node.name, tuple(tensors), ratio, False, why, tuple(tail)))
    return changed
