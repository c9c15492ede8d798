"""The operator registry: per op type a float forward, a quantize rule and an integer forward.

An op is a subclass of `OpDef` registered with `@register`. The executor calls, per node:

    q = op.quantize(QuantizeContext(...))        # once: output qparams, integer constants, (M, N), tables
    outs = op.forward_int(q, int_inputs, runtime) # per run: integer arrays in, integer arrays out

`quantize` returns a `QuantizedNode` (or an op-specific subclass holding that op's integer constants as typed
fields). `check_quantized` then verifies that every output has complete qparams.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Protocol

import numpy as np

from ptq.core.graph import Node
from ptq.core.qparams import QParams
from ptq.core.requant import DEFAULT_MBITS


class DotBackend(Protocol):
    """The integer dot product under Conv, Gemm and MatMul: (..., M, K) @ (..., K, N) -> int64 (..., M, N),
    batch dimensions broadcast as in numpy.matmul (grouped conv and activation @ activation use them).
    The result must be a new array: the ops requantize it in place."""

    name: str

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray: ...


@dataclass
class IntRuntime:
    """What an integer forward may use besides its inputs: the dot-product backend and an overflow log."""

    backend: DotBackend
    overflows: dict[str, int] = field(default_factory=dict)  # node name -> saturated accumulator count

    def record_overflow(self, node: Node, count: int) -> None:
        if count:
            self.overflows[node.name] = self.overflows.get(node.name, 0) + count


@dataclass(frozen=True)
class QuantizeOptions:
    mbits: int = DEFAULT_MBITS  # multiplier width of (M, N) pairs
    accumulator_bits: int = 32
    bn_weight_bits: int = 16  # standalone BatchNormalization weights (whitepaper 4.5 advises 16)


@dataclass
class QuantizeContext:
    node: Node
    in_qparams: list[Optional[QParams]]  # per input; None for index/shape inputs, omitted inputs and biases
    out_qparams: list[Optional[QParams]]  # the calibrated proposal from the quant table, per output
    constants: dict[int, np.ndarray]  # float (or index) values of the constant inputs, by input position
    options: QuantizeOptions = field(default_factory=QuantizeOptions)


@dataclass
class QuantizedNode:
    """The result of a quantize rule. Ops that need integer constants subclass it with typed fields."""

    node: Node
    in_qparams: list[Optional[QParams]]
    out_qparams: list[Optional[QParams]]


class OpDef:
    op_type: ClassVar[str]
    domain: ClassVar[str] = ""
    section: ClassVar[str] = ""  # the whitepaper chapter 4 section of the quantization rule
    int_types: ClassVar[str] = "int8/uint8/int16"
    granularity: ClassVar[str] = "per-tensor"

    def forward_float(self, node: Node, inputs: list[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        raise NotImplementedError

    def forward_int(self, q: QuantizedNode, inputs: list[np.ndarray], runtime: IntRuntime) -> list[np.ndarray]:
        raise NotImplementedError


REGISTRY: dict[tuple[str, str], OpDef] = {}


def register(cls: type[OpDef]) -> type[OpDef]:
    key = (cls.domain, cls.op_type)
    if key in REGISTRY:
        raise ValueError(f"op {cls.domain or 'ai.onnx'}::{cls.op_type} registered twice")
    REGISTRY[key] = cls()
    return cls


def get_op(op_type: str, domain: str = "") -> Optional[OpDef]:
    return REGISTRY.get((domain, op_type))


class QuantizationError(ValueError):
    """A quantize rule left an output without complete qparams, or got inputs it cannot handle."""


def check_quantized(q: QuantizedNode) -> None:
    for name, qp in zip(q.node.outputs, q.out_qparams):
        if name and not isinstance(qp, QParams):
            raise QuantizationError(f"{q.node.op_type} {q.node.name!r}: output {name!r} has no qparams after quantize")
