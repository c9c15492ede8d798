"""ptq: post-training quantization for ONNX models.

The public API is imported lazily so that `import ptq` stays cheap (no onnxruntime at import time). One
function per command (`ptq.calibrate`, `ptq.run`, `ptq.report`, `ptq.debug`, `ptq.tune`, `ptq.export_table`,
in `ptq.api`) takes the command's flags as keyword arguments and returns its result as an object.
"""
from __future__ import annotations

import importlib
import time

__version__ = "0.1.0"
IMPORTED_AT = time.time()  # before any other module of the project: `ptq.engine.compile_notice.compiled_here` reads it

_EXPORTS = {
    "QParams": "ptq.core.qparams",
    "compute_qparams": "ptq.core.qparams",
    "quantize_multiplier": "ptq.core.requant",
    "requantize": "ptq.core.requant",
    "load_model": "ptq.core.graph",
    "ModelError": "ptq.core.graph",
    "Preprocess": "ptq.data.images",
    "calibrate": "ptq.api",
    "run": "ptq.api",
    "report": "ptq.api",
    "debug": "ptq.api",
    "tune": "ptq.api",
    "export_table": "ptq.api",
    "ExportResult": "ptq.api",
    "CalibrationResult": "ptq.calibration.pipeline",
    "RunResult": "ptq.api",
    "SampleResult": "ptq.api",
    "ReportResult": "ptq.api",
    "DebugResult": "ptq.api",
    "TuneResult": "ptq.tuning.tuner",
    "DataOptions": "ptq.data_options",
    "CalibrationOptions": "ptq.table.quant_table",
    "QuantTable": "ptq.table.quant_table",
    "TensorEntry": "ptq.table.quant_table",
    "QuantTableError": "ptq.table.quant_table",
    "load_quant_table": "ptq.table.quant_table",
    "save_quant_table": "ptq.table.quant_table",
    "export_qdq": "ptq.qdq.export",
    "prepare": "ptq.engine.executor",
    "run_int": "ptq.engine.executor",
    "IntegerGraph": "ptq.engine.executor",
    "IntRunResult": "ptq.engine.executor",
    "ExecutorOptions": "ptq.engine.executor",
    "QuantizeOptions": "ops.registry",
    "get_backend": "ptq.engine.backends",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ptq' has no attribute {name!r}")
