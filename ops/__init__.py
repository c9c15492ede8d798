"""Operator registry; importing this package registers every op module."""
from ops.registry import REGISTRY, OpDef, QuantizedNode, QuantizeContext, get_op, register

__all__ = ["REGISTRY", "OpDef", "QuantizedNode", "QuantizeContext", "get_op", "register"]
