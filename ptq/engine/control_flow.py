"""If in integers: each branch is a graph of its own, quantized and run by the same executor (integer where its
nodes can be, visible float where not), on the codes of the outer tensors it reads.

Calibration gives every branch tensor a table entry (`ptq.engine.body_float`). At run time the condition (a bool,
computed exactly: an index output) picks the branch; the branch's outputs leave on the qparams its last ops
decided and are brought to the If outputs' own qparams (calibrated over both branches) with one integer
requant each:

    y_q = clamp(((b_q - zp_b) * M + 2^(N-1)) >> N) + zp_y),   M / 2^N ~= s_b / s_y   (identity when equal)

LSB bound of that step vs the branch output: 0.5 + |y_c| 2^-(mbits-1). A branch that no calibration sample
took has no table entries: it runs in float when taken (`FloatBranch`: the If evaluated by onnx.reference on
the dequantized outer tensors, its outputs quantized to the If outputs' qparams) and is listed as a float node
`owner/else_branch` with that reason; the branch the samples took still runs in integers. An If neither of
whose branches any sample took runs in float whole.

Loop in integers: the body is one integer graph run once per iteration. Its carried float inputs have table
entries calibrated over every iteration, so each carried value lives on that grid between iterations: the
initial value is requantized onto it, each iteration's carried output too (the same requant as above), the
last one onto the Loop output's grid; scan outputs are requantized to theirs and stacked. The trip count and
the condition are integers computed exactly. Scan nodes run in float (visible).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import numpy as np

from ops.base import multiplier
from ops.registry import IntRuntime, QuantizationError
from ptq.core.qparams import QParams
from ptq.core.graph import Node
from ptq.core.requant import requantize
from ptq.engine.float_fallback import NodeFloatEvaluator

if TYPE_CHECKING:
    from ptq.engine.executor import FloatNode, IntegerGraph


@dataclass
class BranchOutput:
    """How one branch output reaches the If output: its qparams there, and the requant (None: same grid)."""

    source: Optional[QParams]  # None: a non-float output, passed on as it is
    target: Optional[QParams]
    ratio: Optional[tuple[int, int]]


@dataclass
class FloatBranch:
    """A branch no calibration sample took, run in float when taken: the If node evaluated by onnx.reference on
    the dequantized outer tensors (it takes this same branch), each float output quantized to the If output's
    qparams."""

    node: Node
    in_qparams: list[Optional[QParams]]  # aligned with the If node's all_inputs (None: passed as it is)
    out_qparams: list[Optional[QParams]]
    node_float: NodeFloatEvaluator
    float_node: "FloatNode"  # how it is listed: `owner/else_branch`, with the reason

    def run(self, args: list) -> list[np.ndarray]:
        floats = [qp.dequantize(a) if qp is not None and a is not None else a for a, qp in zip(args, self.in_qparams)]
        results = self.node_float.run(self.node, floats)
        return [value if qp is None else qp.quantize(value) for value, qp in zip(results, self.out_qparams)]


@dataclass
class IfStep:
    """An If node run in integers: the two branches prepared as integer graphs (or a branch no sample took, in
    float when taken)."""

    then_branch: Union["IntegerGraph", FloatBranch]
    else_branch: Union["IntegerGraph", FloatBranch]
    then_outputs: list[BranchOutput]
    else_outputs: list[BranchOutput]

    def run(self, inputs: list[str], args: list, runtime: IntRuntime) -> list[np.ndarray]:
        """`args` align with the If node's `all_inputs` (`inputs`): the condition, then the outer tensors."""
        cond = bool(np.asarray(args[0]).reshape(-1)[0])
        branch, outputs = (self.then_branch, self.then_outputs) if cond else (self.else_branch, self.else_outputs)
        if isinstance(branch, FloatBranch):
            return branch.run(args)
        values = branch.run_values(dict(zip(inputs, args)), runtime)
        return [_to_target(values[name], out) for name, out in zip(branch.graph.outputs, outputs)]

    def float_nodes(self) -> list["FloatNode"]:
        return [found for branch in (self.then_branch, self.else_branch)
                for found in ([branch.float_node] if isinstance(branch, FloatBranch) else branch.float_nodes)]


def _to_target(codes: np.ndarray, out: BranchOutput) -> np.ndarray:
    if out.ratio is None:
        return codes
    src, dst = out.source, out.target
    m, n = out.ratio
    centered = np.asarray(codes).astype(np.int64) - int(src.zero_point[0])
    return requantize(centered, m, n, dst.zero_point[0], dst.qmin, dst.qmax, dtype=dst.dtype)


def branch_output(source: Optional[QParams], target: Optional[QParams], mbits: int, name: str) -> BranchOutput:
    """The requant of a branch output `name` from its qparams to the If output's."""
    if source is None or target is None:
        if source is not target:
            raise QuantizationError(f"branch output {name!r} is quantized on one side only")
        return BranchOutput(None, None, None)
    if source.per_channel or target.per_channel:
        raise QuantizationError(f"branch output {name!r} must be quantized per tensor")
    if source == target:
        return BranchOutput(source, target, None)
    m, n = multiplier(float(source.scale[0]) / float(target.scale[0]), mbits, "s_branch / s_if")
    return BranchOutput(source, target, (int(m[0]), int(n[0])))


@dataclass
class LoopStep:
    """A Loop node run in integers: its body prepared as an integer graph, the requants between grids."""

    body: "IntegerGraph"
    explicit: int  # the Loop node's own inputs (trip count, condition, initial values); outer tensors follow
    initial_codes: list[Optional[np.ndarray]]  # a constant initial value's codes on its carried grid
    into_body: list[BranchOutput]  # initial value -> carried input grid
    around: list[BranchOutput]  # carried output -> carried input grid (the next iteration)
    final_from_body: list[BranchOutput]  # last carried output -> Loop output grid
    final_from_initial: list[BranchOutput]  # initial value -> Loop output grid (no iteration ran)
    scans: list[BranchOutput]  # scan output of an iteration -> the Loop's scan output grid

    def run(self, inputs: list[str], args: list, runtime: IntRuntime) -> list[np.ndarray]:
        """`args` align with the Loop node's `all_inputs` (`inputs`)."""
        outer = dict(zip(inputs[self.explicit:], args[self.explicit:]))
        limit = None if args[0] is None else int(np.asarray(args[0]).reshape(-1)[0])
        cond = True if len(args) < 2 or args[1] is None else bool(np.asarray(args[1]).reshape(-1)[0])
        initial = [codes if codes is not None else arg
                   for codes, arg in zip(self.initial_codes, args[2:self.explicit])]
        carried = [_to_target(v, route) for v, route in zip(initial, self.into_body)]
        names_in, names_out = self.body.graph.inputs, self.body.graph.outputs
        count = len(carried)
        last: Optional[list[np.ndarray]] = None
        scanned: list[list[np.ndarray]] = [[] for _ in self.scans]
        step = 0
        while cond and (limit is None or step < limit):
            feeds = dict(outer)
            feeds.update(zip(names_in, [np.array(step, np.int64), np.array(cond)] + carried))
            values = self.body.run_values(feeds, runtime)
            cond = bool(np.asarray(values[names_out[0]]).reshape(-1)[0])
            last = [values[n] for n in names_out[1:1 + count]]
            carried = [_to_target(v, route) for v, route in zip(last, self.around)]
            for parts, name, route in zip(scanned, names_out[1 + count:], self.scans):
                parts.append(_to_target(values[name], route))
            step += 1
        finals = [_to_target(v, r) for v, r in zip(last, self.final_from_body)] if last is not None else \
            [_to_target(v, r) for v, r in zip(initial, self.final_from_initial)]
        stacked = [np.stack(parts) if parts else np.zeros((0,), dtype=r.target.dtype if r.target else np.float32)
                   for parts, r in zip(scanned, self.scans)]
        return finals + stacked

    def float_nodes(self) -> list["FloatNode"]:
        return self.body.float_nodes
