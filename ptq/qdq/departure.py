"""Where a QDQ model first computes otherwise than the integer run of the same graph and table.

The QDQ model rounds every tensor of the table on its grid (Q/DQ), the integer run computes the same tensors in
integers; the two should hold the same values up to rounding. `first_departure` runs both on a few samples and
names the first tensor of the table, in the integer run's order, whose dequantized values differ from the QDQ
model's (optimizations off: its own arithmetic), over the samples together, by more than `TOLERANCE` in
centred cosine (the correlation: a
Relu's output, all positive, has a plain cosine near 1 whatever its error), with the node writing it and the
tensors the QDQ model rounds on the way that the integer run fuses away (`fused_away`: a layer's output before
the Relu/Clip fused into it, whose entry the integer run never reads).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import helper

from ptq.core.graph import Graph
from ptq.engine.executor import prepare
from ptq.qdq.check import TOLERANCE, QDQCheckError, qdq_session, run_session
from ptq.table.quant_table import QuantTable


def centred_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """cos(a - mean(a), b - mean(b)) of two flattened float64 arrays (1.0 when both are constant and equal)."""
    a, b = a - a.mean(), b - b.mean()
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / norm) if norm > 0 else float(np.allclose(a, b))


def first_departure(graph: Graph, table: QuantTable, qdq_model: onnx.ModelProto, samples: Sequence[dict],
                    where: str) -> Optional[str]:
    """The module docstring's tensor over `samples` (model inputs by name; `where`: what the message calls them),
    with the node writing it and the tensors the QDQ model rounds before it that the integer run fuses away; None
    when no tensor departs."""
    prepared = prepare(graph, table)
    runs = [prepared.run(inputs, keep_all=True) for inputs in samples]
    run = runs[0]
    written = {name for node in qdq_model.graph.node for name in node.output}
    order = [(name, step.node) for step in prepared.steps for name in step.node.outputs
             if name in table.tensors and name in run.qparams and name in run.tensors and name in written]
    probe = onnx.ModelProto()
    probe.CopyFrom(qdq_model)
    present = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                              for name, _ in order if name not in present)
    try:
        session = qdq_session(probe, optimize=False)
        theirs = [run_session(session, inputs) for inputs in samples]
    except QDQCheckError as exc:
        return f"(the QDQ model's tensors could not be read in onnxruntime: {exc})"
    for name, node in order:
        ours = np.concatenate([np.asarray(r.qparams[name].dequantize(r.tensors[name]), dtype=np.float64).ravel()
                               for r in runs])
        other = np.concatenate([np.asarray(t[name], dtype=np.float64).ravel() for t in theirs])
        if ours.size != other.size:
            continue
        cosine = centred_cosine(ours, other)
        if cosine < 1 - TOLERANCE:
            found = (f"the QDQ model first departs from the integer run at tensor {name!r} (written by "
                     f"{node.op_type} {node.name!r}): centred cosine {cosine:.4f} between the two runs' values on "
                     f"{where}")
            rounded = fused_away(graph, table, run.tensors, written, name)
            if rounded:
                found += ("; on the way the QDQ model rounds " + ", ".join(
                    f"{t!r} ({table.tensors[t].qparams.bits} bits)" for t in rounded) +
                    f", which the integer run fuses away (its entry is not used there), against "
                    f"{table.tensors[name].qparams.bits} bits for {name!r}")
            return found
    return None


def fused_away(graph: Graph, table: QuantTable, computed, written, name: str) -> list[str]:
    """The tensors with a table entry between `name` and the nearest tensors the integer run computes, going up
    `graph` (the user's nodes, before fusion): rounded by the QDQ model (in `written`), never computed by the
    integer run (not in `computed`)."""
    producers = {out: node for node in graph.nodes for out in node.outputs}
    found, frontier, seen = [], [name], {name}
    while frontier:
        node = producers.get(frontier.pop())
        for tensor in node.inputs if node is not None else ():
            if tensor in seen or tensor in computed or tensor in graph.initializers:
                continue
            seen.add(tensor)
            if tensor in table.tensors and tensor in written:
                found.append(tensor)
            frontier.append(tensor)
    return found
