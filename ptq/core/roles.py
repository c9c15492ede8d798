"""The roles a constant input can play in an op: a weight (quantized per channel along an axis) or a bias
(int32, scale = scale(data input) * scale(weight)); and the kind of layer an op is to the weight adjustments.

Which input of which op plays which role is the op's own fact (`OpDef.weight_role` / `OpDef.bias_role` in
`ops.registry`); this module only defines the types, so that calibration, the quantize rules and the QDQ
export all read the same answer from the registry.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional


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


@dataclass(frozen=True)
class BiasSlot:
    """Where an op can take a constant bias (one value per output channel): the input it goes to and the axis
    of the op's output its values run along. A per-channel constant added after the op folds into it
    (`ptq.engine.bias_add_fold`)."""

    input_index: int
    output_axis: int
    in_onnx: bool = True  # the ONNX op has that input (Conv, Gemm); False: only ptq's integer graph (MatMul)


class LayerKind(Enum):
    """What a node is to the weight adjustments (`ptq.adjust`), as its op declares it (`OpDef.layer_kind`): the
    layout of its weight and the formula its output follows, which their per-layer algebra depends on."""

    CONVOLUTION = "convolution"  # y = x * W + b (cross-correlation), W [C_out, C_in / group, k...], channels axis 1
    FULLY_CONNECTED = "fully connected"  # y = alpha A B' + beta C (Gemm), B' = B or B^T (transB)
    BATCH_NORMALIZATION = "batch normalization"  # y = gamma (x - mean) / sqrt(var + eps) + beta, per channel (axis 1)
