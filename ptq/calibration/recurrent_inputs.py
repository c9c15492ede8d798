"""A recurrent cell's input sequence at 16 bits (`OpDef.wide_input`: LSTM, GRU).

The cell computes with 16-bit weights, 16-bit gates and states (`ops.recurrent`); its input X is the one
8-bit grid on its path, and the recurrence carries each step's input error into every later state. Measured
on bench/models/gru_tagger.onnx (X = the model's input frames through a Transpose; 1,000 drawn sequences of 50
frames, `bench/sequence_models.py --more-gru`): 44 frames of 50,000 disagree with float with X at 8 bits, 14 at
16 bits (onnxruntime's quantizer: 19, NNCF: 8; both keep the GRU and its input in float). Running the cell
itself in float changed nothing (400 sequences): the error is X's grid, not the cell.

The X tensor gets 16 bits over its calibrated range, and so does each tensor before it that only ops keeping
their input's grid (`OpDef.keeps_input_qparams`: Transpose, Reshape, Squeeze, ...) lead from: those ops pass
codes on unchanged, so X can only be as wide as their input. Another reader of such a tensor then reads 16-bit
codes too. Each entry's `why` says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from ops.registry import op_of
from ptq.core.graph import Graph
from ptq.table.quant_table import CalibrationOptions, TensorEntry

WIDE_BITS = 16


@dataclass(frozen=True)
class WideInput:
    node: str
    tensors: tuple[str, ...]
    why: str


def _code_moving_chain(graph: Graph, tensor: str) -> list[str]:
    """`tensor` and the tensors before it that reach it only through ops keeping their input's grid."""
    producer = graph.producer()
    chain = [tensor]
    while tensor in producer:
        node = producer[tensor]
        op = op_of(node)
        if op is None or not op.keeps_input_qparams or not node.inputs or node.inputs[0] not in graph.activations:
            break
        tensor = node.inputs[0]
        chain.append(tensor)
    return chain


def widen_recurrent_inputs(graph: Graph, entries: dict[str, TensorEntry],
                           options: CalibrationOptions) -> list[WideInput]:
    """Give the input sequence of every LSTM/GRU (and its code-moving chain) 16 bits, in place on `entries`."""
    changed = []
    for node in graph.nodes:
        op = op_of(node)
        if op is None or not op.wide_input or not node.inputs or node.inputs[0] not in entries:
            continue
        tensors = [t for t in _code_moving_chain(graph, node.inputs[0])
                   if t in entries and entries[t].qparams.bits < WIDE_BITS and not entries[t].qparams.per_channel]
        if not tensors:
            continue
        why = (f"the input sequence of {node.op_type} {node.name!r} at {WIDE_BITS} bits: the recurrence carries "
               "each step's input error into every later state")
        for name in tensors:
            entry = entries[name]
            qp = options.derive_qparams("activation", entry.min, entry.max, WIDE_BITS)
            entries[name] = TensorEntry("activation", entry.calibrator, entry.min, entry.max, qp,
                                        entry.run_in_float, why)
        changed.append(WideInput(node.name, tuple(tensors), why))
    return changed
