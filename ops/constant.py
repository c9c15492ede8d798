"""ONNX Constant as an op (whitepaper 4.13): a tensor with no inputs, its value in an attribute.

`ptq.core.graph.load_model` folds Constant nodes into initializers, so this op runs only in graphs built or
edited after loading. Attributes: `value` (a tensor), `value_float(s)` or `value_int(s)`.

- A float constant is quantized once, at quantize time, with the quant table's qparams for the output, else
  with its own range [min(v, 0), max(v, 0)] (asymmetric, 8 bits):
      y_q = clamp(round_half_even(v / s_y) + zp_y, qmin, qmax)
  LSB bound vs the float value clamped to the output range: 0.5 (the rounding).
- An integer (index-like) constant keeps scale 1 and zero point 0 (4.13): its codes are its values. In ptq
  that is an index output (int64 as in ONNX, no qparams), passed on unchanged. LSB bound: 0 (exact).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ops.base import require_per_tensor
from ops.conformance_case import Case, uniform_constant
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams

OWN_RANGE_BITS = 8
VALUE_ATTRS = ("value", "value_float", "value_floats", "value_int", "value_ints")


def constant_value(node: Node) -> np.ndarray:
    """The node's value: a `value` tensor, `value_float(s)` as float32 or `value_int(s)` as int64."""
    given = [a for a in VALUE_ATTRS if node.attr(a) is not None]
    if len(given) != 1:
        raise ValueError(f"exactly one of the attributes {', '.join(VALUE_ATTRS)} is required, got {given or 'none'}")
    name = given[0]
    if name == "value":
        return np.asarray(node.attr(name))
    return np.asarray(node.attr(name), dtype=np.float32 if "float" in name else np.int64)


def _is_index(value: np.ndarray) -> bool:
    return value.dtype.kind in "iub"


@dataclass
class QuantizedConstant(QuantizedNode):
    codes: np.ndarray  # the output: quantized codes of a float constant, the value itself for an index constant


@register
class Constant(OpDef):
    """ONNX Constant. Quantization and LSB bound: module docstring."""

    op_type = "Constant"
    section = "4.13"
    int_types = "float -> int8/uint8/int16; integer -> int64 (scale 1, zp 0)"
    lsb_bound = 0.5
    conformance = Case(shape=(), inputs=(), attrs={"value": uniform_constant("const", (3, 4), -2, 2)}, path="direct",
                       note="no input (load_model folds Constant nodes; the op is run directly)")

    def index_outputs(self, node):
        return frozenset({0}) if _is_index(constant_value(node)) else frozenset()

    def forward_float(self, node, inputs):
        value = constant_value(node)
        return [value if _is_index(value) else value.astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedConstant:
        value = constant_value(ctx.node)
        if _is_index(value):
            return QuantizedConstant(ctx.node, [], [None], value.copy())
        value = value.astype(np.float64)
        if not np.all(np.isfinite(value)):
            raise ValueError("the constant holds inf or NaN")
        y_qp = ctx.out_qparams[0] if ctx.out_qparams and ctx.out_qparams[0] is not None else compute_qparams(
            min(float(value.min(initial=0.0)), 0.0), max(float(value.max(initial=0.0)), 0.0), OWN_RANGE_BITS,
            symmetric=False)
        require_per_tensor(y_qp, "output")
        return QuantizedConstant(ctx.node, [], [y_qp], y_qp.quantize(value))

    def forward_int(self, q: QuantizedConstant, inputs, runtime: IntRuntime):
        return [q.codes.copy()]
