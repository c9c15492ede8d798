"""The tensor whose statistics describe the values a tensor's grid is read on, for a calibrator that chooses a
range by the error it causes (`Calibrator.scores_read_values`: `auto`).

An op that keeps its input's grid (`OpDef.keeps_input_qparams`: Reshape, Transpose, Pad, Slice, MaxPool, ...)
passes codes on, so a tensor whose one reader is such an op is read, on its own grid, as that op's output: a
Reshape's output holds the same values, but a MaxPool's holds only each window's maximum, the input's upper
tail, and a Slice's only the part it keeps. Scoring the candidates on the input's histogram underweights the
values that are read: on bench/models' CRNN recognizer (three ReLU -> MaxPool pairs) `auto` scored on the ReLU
outputs agreed with float's greedy CTC decode on 0.941 of 256 samples; scored on what the MaxPools pass on,
0.961, extrema's figure (`python bench/detectors.py --models crnn --calibrator auto`).
"""
from __future__ import annotations

from ops.registry import op_of
from ptq.core.graph import Graph


def read_values_tensor(graph: Graph, name: str, known: set, consumers: dict) -> str:
    """`name`, or, while its one reader is an op keeping its input's grid (input 0) with one output, in `known`
    (it has statistics), that output; a graph output is read as itself."""
    outputs = set(graph.outputs)
    while name not in outputs:
        readers = consumers.get(name, [])
        if len(readers) != 1:
            break
        node = readers[0]
        op = op_of(node)
        if op is None or not op.keeps_input_qparams or node.inputs[0] != name or len(node.outputs) != 1 \
                or node.outputs[0] not in known:  # a Split's parts are read together: the input's values
            break
        name = node.outputs[0]
    return name
