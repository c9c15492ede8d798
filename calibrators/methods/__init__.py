"""Calibration methods: one module per calibrator, each registered by `@register_calibrator`.

Every module in this package is imported here, so adding a calibrator is adding one module.
"""
from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
