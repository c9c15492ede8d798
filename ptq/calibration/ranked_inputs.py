"""The tensors whose largest values a consumer ranks (`OpDef.ranks_input`: Softmax, LogSoftmax, Hardmax, ArgMax,
ArgMin, TopK), directly or through ops that only move codes (`OpDef.keeps_input_qparams`: Reshape, Transpose,
Squeeze, MaxPool, ...), which pass a clipped code on unchanged.

Such a consumer reads the leaders of each row: Softmax's derivative dp_i/dx_i = p_i (1 - p_i) is largest where
p_i is, on the largest logits, and vanishes on the small ones whose rounding a clipping range refines. Clipping
the top values of a row makes them equal, so the argmax, the top-k and the sharpness of the distribution change
exactly where the output is decided. An error proxy that weighs every value alike (`auto`'s expected squared
error) cannot see that: on bench/models' CRNN recognizer (`python bench/detectors.py --models crnn --calibrator
auto`), `auto` clipped the logits feeding the Softmax over 6,625 classes at their 99.999th percentile (48.9
instead of 67.3, E 0.67 of extrema's), and greedy CTC decodes agreeing with float fell from 0.961 (extrema) to
0.895; that one tensor on extrema's range gave back 0.047 of it. So the default calibrator keeps such a tensor's
observed extremes (`Calibrator.unclipped`); a calibrator a user names is used as named.

A graph output counts as ranked too: its reader is the user, who takes a classifier's top logits, a detector's
scores above a threshold, a regression's largest values as they come (on EfficientNet-Lite0 `auto` clipped the
logits at their 99.99th percentile; kept whole, the cosine on the 20 eval photos rose by 4e-5).
"""
from __future__ import annotations

from ops.registry import op_of
from ptq.core.graph import Graph


def ranked_tensors(graph: Graph) -> dict[str, str]:
    """Activation -> what ranks its values (the first reader met), for every graph output, every activation
    read as input 0 by an op that ranks its input, and every one read by a code-moving op whose output is such a
    tensor."""
    consumers = graph.consumers()
    ranked: dict[str, str] = {name: "the graph output's reader" for name in graph.outputs}
    for name in reversed(graph.activations):  # topological order reversed: a code-moving op's output first
        for node in consumers.get(name, []):
            op = op_of(node)
            if op is None or not node.inputs or node.inputs[0] != name:
                continue
            if op.ranks_input:
                ranked[name] = f"{node.op_type} {node.name!r}"
                break
            moved = node.outputs[0] if node.outputs else ""
            if op.keeps_input_qparams and moved in ranked:
                ranked[name] = ranked[moved]
                break
    return ranked
