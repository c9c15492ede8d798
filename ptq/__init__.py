"""ptq: post-training quantization for ONNX models.

The public API is imported lazily so that `import ptq` stays cheap (no onnxruntime at import time).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "QParams": "ptq.core.qparams",
    "compute_qparams": "ptq.core.qparams",
    "quantize_multiplier": "ptq.core.requant",
    "requantize": "ptq.core.requant",
    "load_model": "ptq.core.graph",
    "ModelError": "ptq.core.graph",
    "Preprocess": "ptq.images",
    "calibrate": "ptq.pipeline",
    "CalibrationResult": "ptq.pipeline",
    "CalibrationOptions": "ptq.quant_table",
    "QuantTable": "ptq.quant_table",
    "TensorEntry": "ptq.quant_table",
    "QuantTableError": "ptq.quant_table",
    "load_quant_table": "ptq.quant_table",
    "save_quant_table": "ptq.quant_table",
    "export_qdq": "ptq.qdq_export",
    "prepare": "ptq.executor",
    "run_int": "ptq.executor",
    "IntegerGraph": "ptq.executor",
    "IntRunResult": "ptq.executor",
    "ExecutorOptions": "ptq.executor",
    "QuantizeOptions": "ops.registry",
    "get_backend": "ptq.backends",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ptq' has no attribute {name!r}")
