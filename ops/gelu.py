"""Gelu (ONNX opset 20, approximate="none" | "tanh") as one lookup table (whitepaper 3.3.2.2 tables; GELU has
no chapter 4 entry: the issue's decomposed `x * 0.5 * (1 + erf(x / sqrt(2)))` would need Div, Erf, Add and
two Mul, each its own quantization point). `ptq.engine.rewrites.fuse_gelu` turns both decomposed forms into this op.

    none: f(x) = 0.5 x (1 + erf(x / sqrt(2)))      tanh: f(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    T[x_q] = clamp(round_half_even(f((x_q - zp_x) * s_x) / s_y) + zp_y, qmin, qmax)   (ONNX convention)

Inputs of at most 10 bits get a direct table (exact by construction); 16-bit inputs lut's interpolated table
(`ops.lut_ops.lut_within_budget`). The ONNX name is used (domain ""), so native opset-20 Gelu nodes run
through the same table. LSB bound vs the float op on the dequantized input: 0.5 LSB for direct tables,
0.5 + the table's reported `max_error_lsb` for interpolated ones.
"""
from __future__ import annotations

from lut.functions import FUNCTIONS, LutFunction
from ops.conformance_case import Case
from ops.lut_ops import _LutOp
from ops.registry import QuantizationError, register

APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


@register
class Gelu(_LutOp):
    """ONNX Gelu (opset 20) as a lookup table (module docstring)."""

    op_type = "Gelu"
    lsb_bound = 0.5
    section = "3.3.2.2 (LUT; no chapter 4 entry)"
    conformance = Case(opset=20)

    def function(self, node) -> LutFunction:
        approximate = node.attr("approximate", "none")
        approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
        if approximate not in APPROXIMATIONS:
            raise QuantizationError(f"attribute approximate must be 'none' or 'tanh', got {approximate!r}")
        return FUNCTIONS[APPROXIMATIONS[approximate]]
