"""The operator registry. Each module of this package registers the ops it defines (`@register`); the registry
imports a module when one of its ops is first looked up (`ops.index.OP_MODULES` names the module of every op),
or every module when it is iterated. Adding an op is adding its module, with the op's conformance case declared in
its class (`OpDef.conformance`), and its test, then `python -m ops.index --write` (a test fails while the index is
stale; docs/architecture.md, "How to add an op"). Subpackages (kernel collections) are imported by the modules that
use them.
"""
from __future__ import annotations

from ops.registry import REGISTRY, OpDef, QuantizedNode, QuantizeContext, get_op, register

__all__ = ["REGISTRY", "OpDef", "QuantizedNode", "QuantizeContext", "get_op", "register"]
