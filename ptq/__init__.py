"""ptq: post-training quantization for ONNX models.

The public API is imported lazily so that `import ptq` stays cheap (no onnxruntime at import time). One
function per command (`ptq.calibrate`, `ptq.run`, `ptq.report`, `ptq.debug`, `ptq.tune`, `ptq.export_table`,
in `ptq.api`) takes the command's flags as keyword arguments and returns its result as an object.
"""
from __future__ import annotations

import importlib
import time

__version__ = "0.1.0"
IMPORTED_AT = time.time()  # before any other module of the project: `ptq.compile_notice.compiled_here` reads it

_EXPORTS = {
    "QParams": "ptq.core.qparams",
    "compute_qparams": "ptq.core.qparams",
    "quantize_multiplier": "ptq.core.requant",
    "requantize": "ptq.core.requant",
    "load_model": "ptq.core.graph",
    "ModelError": "ptq.core.graph",
    "Preprocess": "ptq.images",
    "calibrate": "ptq.api",
    "run": "ptq.api",
    "report": "ptq.api",
    "debug": "ptq.api",
    "tune": "ptq.api",
    "export_table": "ptq.api",
    "ExportResult": "ptq.api",
    "CalibrationResult": "ptq.pipeline",
    "RunResult": "ptq.api",
    "SampleResult": "ptq.api",
    "ReportResult": "ptq.api",
    "DebugResult": "ptq.api",
    "TuneResult": "ptq.tuning",
    "DataOptions": "ptq.data_options",
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
