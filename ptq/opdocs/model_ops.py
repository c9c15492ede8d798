"""Will my model run? Which nodes of a model run in integers, which in float and why (`ptq ops MODEL`).

The answer is the executor's own (`ptq.engine.executor.prepare`: the rewrites, then every op's quantize rule), with the
user's quant table, or before calibration with a provisional one: ranges from one random sample per input
(N(0, 1) for a float input, zeros for an integer one). Whether a rule can quantize a node depends on the op,
its attributes and constants, not on the ranges, so the provisional answer is the calibrated one for every
model tried; ranges only matter for range-dependent limits, which a calibrated table (`--quant`) settles.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np

from calibrators import required_stats
from ptq.calibration.entries import build_table
from ptq.core.graph import Graph
from ptq.engine.executor import FloatNode, NodeKind, prepare
from ptq.engine.float_run import collect_statistics
from ptq.table.quant_table import CalibrationOptions, QuantTable


@dataclass(frozen=True)
class OpCount:
    """The nodes of one op type after the rewrites, by how they run."""

    op_type: str
    integer: int = 0
    float: int = 0
    shape: int = 0

    @property
    def nodes(self) -> int:
        return self.integer + self.float + self.shape


@dataclass(frozen=True)
class ModelOps:
    """How a model's nodes run: per op type, the float nodes with the reason, and what the rewrites removed
    (nodes folded into constants, BatchNormalizations folded and activations fused into their host)."""

    ops: list[OpCount]
    float_nodes: list[FloatNode]
    model_nodes: int  # in the model as given
    folded: int  # constant and shape subgraphs evaluated once, zero initial states left to their cell
    fused: int  # BatchNormalization folds and activation / pattern fusions

    @property
    def nodes(self) -> int:
        return sum(op.nodes for op in self.ops)


def provisional_table(graph: Graph) -> QuantTable:
    """A table from one random sample per input: enough for every rule to decide whether it quantizes a node."""
    rng = np.random.default_rng(0)
    batch = {}
    for name in graph.inputs:
        info = graph.tensors[name]
        shape = tuple(d or 1 for d in info.shape)
        dtype = info.dtype or np.dtype(np.float32)
        batch[name] = (rng.standard_normal(shape).astype(dtype) if info.is_float else np.zeros(shape, dtype))
    options = CalibrationOptions()
    stats = collect_statistics(graph, [batch], graph.activations, required_stats([options.calibrator]))
    return build_table(graph, stats, options)


def model_ops(graph: Graph, table: Optional[QuantTable] = None) -> ModelOps:
    """How `graph` runs with `table` (None: a provisional table)."""
    prepared = prepare(graph, table if table is not None else provisional_table(graph))
    counts: dict[str, Counter] = {}
    for step in prepared.steps:
        kind = NodeKind.INTEGER if step.kind is NodeKind.CONTROL else step.kind  # its bodies' float nodes are listed
        counts.setdefault(step.node.op_type, Counter())[kind] += 1
    ops = [OpCount(op, c[NodeKind.INTEGER], c[NodeKind.FLOAT], c[NodeKind.SHAPE]) for op, c in counts.items()]
    ops.sort(key=lambda op: (-op.nodes, op.op_type))
    log = prepared.rewrites
    return ModelOps(ops, prepared.float_nodes, len(graph.nodes), len(log.folded_nodes) + len(log.zero_states),
                    len(log.batchnorm_folds) + len(log.fusions) + len(log.patterns))
