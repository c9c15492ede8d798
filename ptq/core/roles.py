"""Which constant inputs of an op are weights (quantized per channel along an axis) or biases (int32).

Calibration uses this to quantize weights and biases for the QDQ export; op quantize rules use the same
table, so both agree on every weight's QParams.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ptq.core.graph import Node


@dataclass(frozen=True)
class WeightRole:
    input_index: int
    channel_axis: Optional[int]  # the output-channel axis for per-channel quantization; None: per-tensor only


@dataclass(frozen=True)
class BiasRole:
    """An int32 input quantized with scale = scale(input) * scale(weight), zero point 0."""

    input_index: int
    data_index: int
    weight_index: int


def weight_role(node: Node) -> Optional[WeightRole]:
    """The weight input of a Conv/ConvTranspose/Gemm/MatMul node, with its output-channel axis."""
    if node.op_type == "Conv":
        return WeightRole(1, 0)
    if node.op_type == "ConvTranspose":
        return WeightRole(1, 1)
    if node.op_type == "Gemm":
        return WeightRole(1, 0 if node.attr("transB", 0) else 1)
    if node.op_type == "MatMul":
        return WeightRole(1, -1)
    return None


def bias_role(node: Node) -> Optional[BiasRole]:
    if node.op_type in ("Conv", "ConvTranspose", "Gemm") and len(node.inputs) > 2 and node.inputs[2]:
        return BiasRole(2, 0, 1)
    return None
