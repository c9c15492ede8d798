"""If in integers: each branch is a graph of its own, quantized and run by the same executor (integer where its
nodes can be, visible float where not), on the codes of the outer tensors it reads.

Calibration gives every branch tensor a table entry (`ptq.body_float`). At run time the condition (a bool,
computed exactly: an index output) picks the branch; the branch's outputs leave on the qparams its last ops
decided and are brought to the If outputs' own qparams (calibrated over both branches) with one integer
requant each:

    y_q = clamp(((b_q - zp_b) * M + 2^(N-1)) >> N) + zp_y),   M / 2^N ~= s_b / s_y   (identity when equal)

LSB bound of that step vs the branch output: 0.5 + |y_c| 2^-(mbits-1). A branch that no calibration sample
took has no table entries: the If then runs in float, with that reason. Loop bodies run in float (visible).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from ops.base import multiplier
from ops.registry import IntRuntime, QuantizationError
from ptq.core.qparams import QParams
from ptq.core.requant import requantize

if TYPE_CHECKING:
    from ptq.executor import FloatNode, IntegerGraph


@dataclass
class BranchOutput:
    """How one branch output reaches the If output: its qparams there, and the requant (None: same grid)."""

    source: Optional[QParams]  # None: a non-float output, passed on as it is
    target: Optional[QParams]
    ratio: Optional[tuple[int, int]]


@dataclass
class IfStep:
    """An If node run in integers: the two branches prepared as integer graphs."""

    then_branch: "IntegerGraph"
    else_branch: "IntegerGraph"
    then_outputs: list[BranchOutput]
    else_outputs: list[BranchOutput]

    def run(self, inputs: list[str], args: list, runtime: IntRuntime) -> list[np.ndarray]:
        """`args` align with the If node's `all_inputs` (`inputs`): the condition, then the outer tensors."""
        cond = bool(np.asarray(args[0]).reshape(-1)[0])
        branch, outputs = (self.then_branch, self.then_outputs) if cond else (self.else_branch, self.else_outputs)
        values = branch.run_values(dict(zip(inputs, args)), runtime)
        return [_to_target(values[name], out) for name, out in zip(branch.graph.outputs, outputs)]

    def float_nodes(self) -> list["FloatNode"]:
        return self.then_branch.float_nodes + self.else_branch.float_nodes


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
