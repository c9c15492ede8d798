"""A tuned table aligned with its integer run, so that the QDQ model exported from it computes what that run does.

The tuner changes single entries (a tensor to 16 bits, a new range), which can leave entries the integer run
does not read as they were, and the QDQ model reads every entry. Two kinds, both fixed here without changing the
integer run:

1. entries whose qparams the integer graph fixes by rule (a layout op, MaxPool or a nearest Resize moves codes
   and keeps its input's qparams): written as the integer graph has them, as calibration ends
   (`ptq.calibration.steps.align_with_integer_graph`). Measured on a 6-class synthetic classifier at 4 bits,
   Flatten -> Gemm with the input moved to 16 bits: the integer Flatten passes the 16-bit codes on, the QDQ
   model rounded the Flatten's output at its 4-bit entry (validation cosine 0.9977 against 0.9999);
2. entries the integer run fuses away, below.

The integer run fuses a layer with the activation after it (Conv/Gemm -> Relu/Clip) and writes the activation's
tensor straight from the accumulator: the layer's own output has a table entry that the integer run never
uses. The QDQ model has no fused nodes: it rounds that output on its entry's grid, then the activation on its
own. When the tuner moves the activation to 16 bits, the integer run computes it at 16 bits from the
accumulator while the QDQ model first rounds the layer's output at the old width (measured on a 6-class
synthetic classifier at 4 bits: Gemm -> Relu with the Relu's output in 16 bits, the Gemm's at 4; the QDQ model's
validation cosine 0.9957 against the integer graph's 0.9978, 2 of 24 top-1 lost). Widening such an entry to the
width of the tensor it is fused into changes nothing in the integer run (the entry is not read there) and makes
the QDQ model round it on a grid as fine as the integer run's: the two agree again (0.9978 and 0.9978 there).
"""
from __future__ import annotations

import dataclasses

from ptq.calibration.steps import align_with_integer_graph
from ptq.core.graph import Graph
from ptq.engine.executor import prepare
from ptq.table.quant_table import QuantTable
from reports.tables import with_bits


def fused_into(graph: Graph, table: QuantTable) -> dict[str, str]:
    """Each activation of `table` the integer run does not compute -> the first tensor it does compute that the
    entry's value flows into (through further tensors it does not compute), when there is exactly one."""
    computed = set(graph.inputs) | {name for step in prepare(graph, table).steps for name in step.node.outputs}
    consumers = graph.consumers()
    found = {}
    for name, entry in table.tensors.items():
        if entry.kind != "activation" or name in computed or name not in graph.tensors:
            continue
        reached, frontier, seen = set(), [name], {name}
        while frontier:
            for node in consumers.get(frontier.pop(), []):
                for out in node.outputs:
                    if out and out not in seen:
                        seen.add(out)
                        (reached.add if out in computed else frontier.append)(out)
        if len(reached) == 1:
            found[name] = reached.pop()
    return found


def widen_fused_away(graph: Graph, table: QuantTable) -> tuple[QuantTable, list[str]]:
    """`table` with each entry the integer run fuses away at the width of the tensor it is fused into when that
    is wider (module docstring), and the entries widened."""
    widened = []
    for name, into in fused_into(graph, table).items():
        target = table.tensors.get(into)
        if target is not None and target.qparams.bits > table.tensors[name].qparams.bits:
            table = with_bits(table, [name], target.qparams.bits)
            widened.append(name)
    return table, widened


def aligned_for_export(graph: Graph, table: QuantTable) -> tuple[QuantTable, list[str]]:
    """`table` with both kinds of entries of the module docstring aligned with the integer run, and the entries
    changed."""
    aligned = dataclasses.replace(table, tensors=dict(table.tensors))
    changed = align_with_integer_graph(graph, aligned)
    aligned, widened = widen_fused_away(graph, aligned)
    return aligned, list(dict.fromkeys(changed + widened))
