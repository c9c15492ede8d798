"""Scores at a graph output keep 16 bits, with their logits and the tail that feeds only them (issue 24;
whitepaper 5.1.3 keeps detection scores in int16).

A recognizer's CTC head ends in a Softmax over thousands of classes, read by an argmax per time step. Its
logits span a wide range (-70..67 on the CRNN test model: the thousands of unlikely classes sit far below
the peak), so an 8-bit grid steps 0.54: two classes whose logits differ by less land on one code, and
the integer argmax takes the first of them, whichever float preferred. On that model's 256 eval lines the
greedy CTC decode then equals float's on 82% of them, while the output's cosine reads 0.9995.

A text detector's probability map (a Sigmoid at the output, thresholded at 0.3) is read the same way: its
8-bit grid steps 0.004.

So, by default, an op whose output is a probability from logits (`OpDef.gives_scores`: Softmax, LogSoftmax,
Sigmoid) and reaches a graph output directly or through ops that only move codes
(`ptq.calibration.joined_ranges.chain_to_output`) takes 16 bits for its output and that chain, and for its
input and every activation that feeds only it, up to and including the output of the nearest layer with a
weight (`ptq.calibration.joined_ranges.feeding_only`: the logits' MatMul/Gemm and the bias Add after it),
whose inputs keep the calibrator's grid. The logits then step about 0.002 and what remains is the error of
the 8-bit network before them. A Softmax inside the network (attention, a YOLO DFL) keeps its grid.

Each changed entry says why in its `why` field.
"""
from __future__ import annotations

from ops.registry import op_of
from ptq.calibration.joined_ranges import WIDE_BITS, chain_to_output, feeding_only, widen
from ptq.core.graph import Graph
from ptq.table.quant_table import CalibrationOptions, TensorEntry


def widen_output_scores(graph: Graph, entries: dict[str, TensorEntry], options: CalibrationOptions) -> list[str]:
    """Give each score op that ends in a graph output, its chain to the output and the tail feeding it 16
    bits (module docstring), in place on `entries` (the activation entries); returns the tensors changed."""
    consumers = graph.consumers()
    changed: list[str] = []
    for node in graph.nodes:
        op = op_of(node)
        if op is None or not op.gives_scores or not node.outputs or node.outputs[0] not in entries:
            continue
        chain = chain_to_output(graph, consumers, node.outputs[0])
        if chain is None or any(n.outputs[0] not in entries for n in chain):
            continue
        output = chain[-1].outputs[0] if chain else node.outputs[0]
        why = (f"{node.op_type} {node.name!r} gives the scores of output {output!r}, read by an argmax or a "
               f"threshold: it, its logits and what feeds only them at {WIDE_BITS} bits (whitepaper 5.1.3)")
        tensors = feeding_only(graph, consumers, entries, [node, *chain]) + [node.outputs[0]]
        tensors += [n.outputs[0] for n in chain]
        tensors = [t for t in tensors if entries[t].qparams.bits < WIDE_BITS]
        widen(entries, options, tensors, why)
        changed += tensors
    return changed
