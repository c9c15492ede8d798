"""Sigmoid, Tanh, HardSigmoid, HardSwish through lookup tables (whitepaper 4.62, 4.74, 4.36; tables per 3.3.2.2).

Offline (float64, ONNX convention): T[x_q] = clamp(round_half_even(f((x_q - zp_x) * s_x) / s_y) + zp_y, qmin, qmax)
for every input code (inputs of at most 10 bits: a direct table, exact by construction); 16-bit inputs use
lut's interpolated wide table (integer linear interpolation): 257 nodes, or 513 / 1025 when fewer leave more
than `WIDE_TABLE_BUDGET_LSB` of error (exp-like curves over wide ranges). At run time y_q = T[x_q], integer
indexing only (`lut.LookupTable.lookup`).

LSB bound vs the float op on the dequantized input: 0.5 LSB for direct tables (the table is the correctly
rounded result; float32 evaluation of f may flip a tie); 0.5 + the table's own `max_error_lsb` (reported by
lut; at most `WIDE_TABLE_BUDGET_LSB` unless 1025 nodes cannot reach it) for interpolated ones.
"""
from __future__ import annotations

# imports inside functions: `ops.compiled`'s numba kernels, imported by the first run that takes the compiled path
# (numba's import costs about half a second; `ops.compiled.enabled` decides)

from dataclasses import dataclass

import numpy as np

from lut.functions import FUNCTIONS, LutFunction
from lut.table import MAX_FULL_TABLE_BITS, LookupTable, build_table
from ops import compiled
from ops.base import require_per_tensor, require_qparams
from ops.conformance_case import Case
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register


WIDE_TABLE_BUDGET_LSB = 2
WIDE_TABLE_ENTRIES = (257, 513, 1025)


@dataclass
class QuantizedLut(QuantizedNode):
    table: LookupTable


def lut_within_budget(fn: LutFunction, x_qp, y_qp) -> LookupTable:
    """A direct table for inputs of at most 10 bits; for wider ones the smallest interpolated table of
    `WIDE_TABLE_ENTRIES` whose max error is within `WIDE_TABLE_BUDGET_LSB` (else the largest)."""
    if x_qp.bits <= MAX_FULL_TABLE_BITS:
        return build_table(fn, x_qp, y_qp, symmetry=fn.symmetry, center=fn.center)
    for entries in WIDE_TABLE_ENTRIES:
        table = build_table(fn, x_qp, y_qp, symmetry=fn.symmetry, center=fn.center, entries=entries)
        if table.report().max_error_lsb <= WIDE_TABLE_BUDGET_LSB:
            break
    return table


class _LutOp(OpDef):
    int_types = "int8/uint8/int16 -> int8/uint8/int16"

    def function(self, node) -> LutFunction:
        raise NotImplementedError

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        return [self.function(node)(x).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedLut:
        node = ctx.node
        x_qp = require_qparams(ctx.in_qparams[0], "input")
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(x_qp, "input")
        require_per_tensor(y_qp, "output")
        fn = self.function(node)
        return QuantizedLut(node, list(ctx.in_qparams), [y_qp], lut_within_budget(fn, x_qp, y_qp))

    def forward_int(self, q: QuantizedLut, inputs, runtime: IntRuntime):
        if compiled.enabled(runtime):
            from ops.compiled.lut import lookup

            y = lookup(q.table, inputs[0])
            if y is not None:
                return [y]
        return [q.table.lookup(np.asarray(inputs[0]))]


@register
class Sigmoid(_LutOp):
    """ONNX Sigmoid as a lookup table (module docstring)."""

    op_type = "Sigmoid"
    gives_scores = True
    lsb_bound = 0.5
    section = "4.62"
    conformance = Case()

    def function(self, node) -> LutFunction:
        return FUNCTIONS["sigmoid"]


@register
class Tanh(_LutOp):
    """ONNX Tanh as a lookup table (module docstring)."""

    op_type = "Tanh"
    lsb_bound = 0.5
    section = "4.74"
    conformance = Case()

    def function(self, node) -> LutFunction:
        return FUNCTIONS["tanh"]


@register
class HardSwish(_LutOp):
    """ONNX HardSwish, x * max(0, min(1, x / 6 + 1/2)), as a lookup table (module docstring)."""

    op_type = "HardSwish"
    lsb_bound = 0.5
    section = "4.36"
    conformance = Case()

    def function(self, node) -> LutFunction:
        return FUNCTIONS["hardswish"]

    def clip_range(self, node, constant):
        return -3.0, np.inf  # HardSwish(x) = 0 = HardSwish(-3) for every x <= -3


@register
class HardSigmoid(_LutOp):
    """ONNX HardSigmoid, max(0, min(1, alpha * x + beta)) (defaults 0.2, 0.5), as a lookup table."""

    op_type = "HardSigmoid"
    lsb_bound = 0.5
    section = "3.3.2.2 (LUT; no chapter 4 entry)"
    conformance = Case()

    def function(self, node) -> LutFunction:
        alpha = float(node.attr("alpha", 0.2))
        beta = float(node.attr("beta", 0.5))
        return LutFunction(f"hardsigmoid_{alpha:g}_{beta:g}", lambda x: np.clip(alpha * x + beta, 0.0, 1.0))

    def clip_range(self, node, constant):
        """The input interval where the output is not saturated: alpha * x + beta in [0, 1]."""
        alpha = float(node.attr("alpha", 0.2))
        beta = float(node.attr("beta", 0.5))
        if alpha <= 0:
            return None
        return -beta / alpha, (1.0 - beta) / alpha
