"""The operator registry. Importing this package imports every module in it, which registers the ops those
modules define (`@register`), so adding an op is adding one module. Subpackages (kernel collections) are
imported by the modules that use them, not here.
"""
from __future__ import annotations

import importlib
import pkgutil

from ops.registry import REGISTRY, OpDef, QuantizedNode, QuantizeContext, get_op, register

for _module in pkgutil.iter_modules(__path__):
    if not _module.ispkg:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["REGISTRY", "OpDef", "QuantizedNode", "QuantizeContext", "get_op", "register"]
