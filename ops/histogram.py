"""Histogram (ai.ptq), whitepaper 4.37, ONNX convention.

The float op is TensorFlow's histogram_fixed_width: attributes `min` < `max` and `nbins`; element x falls
in bin clamp(floor((x - min) / (max - min) * nbins), 0, nbins - 1); the output holds the int64 count of every
bin (an index-like output: no qparams).

The whitepaper quantizes the range bounds with the input's qparams offline and counts on the codes. In the
ONNX convention the bounds in code units are A = min / s_x + zp_x and W = (max - min) / s_x; ptq keeps F = 16
fractional bits of each (the whitepaper's round(min / s_x + zp_x) is F = 0):

    A_F = round(A * 2^F),  W_F = round(W * 2^F)
    bin = clamp(floor(((x_q * 2^F) - A_F) * nbins / W_F), 0, nbins - 1)         (int64 floor division)

A count differs from the float op's on the dequantized input only for an element whose code lies within
2^-F codes of a bin edge (each rounded bound moves an edge by at most 2^-(F+1) codes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ops.base import activation_qparams
from ops.conformance_case import Case
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node

FRACTION_BITS = 16


@dataclass
class QuantizedHistogram(QuantizedNode):
    low: int  # A_F: min in codes, F fractional bits
    width: int  # W_F: max - min in codes, F fractional bits


def _params(node: Node) -> tuple[float, float, int]:
    low, high, nbins = node.attr("min"), node.attr("max"), node.attr("nbins")
    if low is None or high is None or nbins is None:
        raise ValueError("attributes min, max and nbins are required")
    low, high, nbins = float(low), float(high), int(nbins)
    if not low < high or nbins < 1:
        raise ValueError(f"need min < max and nbins >= 1, got min={low}, max={high}, nbins={nbins}")
    return low, high, nbins


def _count(bins: np.ndarray, nbins: int) -> np.ndarray:
    return np.bincount(np.clip(bins, 0, nbins - 1).ravel(), minlength=nbins).astype(np.int64)


def _histogram_reference(x):
    """The conformance case's numpy formula: 6 bins over [-1.5, 1.5), values outside counted in the end bins."""
    bins = np.clip(np.floor((x - (-1.5)) / 3.0 * 6), 0, 5).astype(np.int64)
    return [np.bincount(bins.ravel(), minlength=6).astype(np.int64)]


@register
class Histogram(OpDef):
    """ai.ptq Histogram (min, max, nbins): bin counts on the codes with bounds in 2^-16 codes (module
    docstring). Whitepaper 4.37."""

    op_type = "Histogram"
    lsb_bound = 0.0
    domain = "ai.ptq"
    section = "4.37"
    int_types = "int8/uint8/int16 -> int64 counts"
    conformance = Case(path="direct", reference=_histogram_reference, attrs={"min": -1.5, "max": 1.5, "nbins": 6})

    def index_outputs(self, node):
        return frozenset({0})

    def forward_float(self, node, inputs):
        low, high, nbins = _params(node)
        x = np.asarray(inputs[0], dtype=np.float32)
        scaled = (x - np.float32(low)) / np.float32(high - low) * np.float32(nbins)
        return [_count(np.floor(scaled).astype(np.int64), nbins)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedHistogram:
        low, high, nbins = _params(ctx.node)
        x_qp = activation_qparams(ctx)
        s, zp = float(x_qp.scale[0]), int(x_qp.zero_point[0])
        a_f = int(np.rint((low / s + zp) * 2.0 ** FRACTION_BITS))
        w_f = int(np.rint((high - low) / s * 2.0 ** FRACTION_BITS))
        bound = (abs(a_f) + (1 << (x_qp.bits + FRACTION_BITS))) * nbins
        if w_f < 1 or bound >= 1 << 62:
            raise QuantizationError(f"min={low}, max={high}, nbins={nbins} do not fit int64 bins on codes of "
                                    f"scale {s:g}")
        return QuantizedHistogram(ctx.node, [x_qp], [None], a_f, w_f)

    def forward_int(self, q: QuantizedHistogram, inputs, runtime: IntRuntime):
        nbins = _params(q.node)[2]
        x = np.asarray(inputs[0]).astype(np.int64)
        return [_count(((x << FRACTION_BITS) - q.low) * nbins // q.width, nbins)]
