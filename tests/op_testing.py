"""Helpers for the op tests: single-node onnxruntime runs, random qparams, an independent requant reference."""
from __future__ import annotations

import enum
from typing import Callable, Optional

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ops.backend import NumpyBackend
from ops.registry import IntRuntime, QuantizeContext, QuantizeOptions
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams


class Check(enum.Enum):
    """What an op test compares (tests/ops/test_coverage.py wants at least one per registered op)."""

    ONNXRUNTIME = "float forward or integer run vs onnxruntime's float op"
    INT_REFERENCE = "integer forward vs an independent int64 reference of its formula"


COVERAGE: dict[str, set[Check]] = {}  # op type -> the checks some test declares for it


def covers(*op_types: str, check: Check) -> Callable:
    """Declare that the decorated test performs `check` for each of `op_types` (apply it truthfully)."""
    def declare(test: Callable) -> Callable:
        for op_type in op_types:
            COVERAGE.setdefault(op_type, set()).add(check)
        return test
    return declare


def ort_single(op_type: str, inputs: dict, attrs: Optional[dict] = None, constants: Optional[dict] = None,
               opset: int = 17, outputs: int = 1) -> list[np.ndarray]:
    """Run one ONNX node in onnxruntime: `inputs` are graph inputs (float32), `constants` initializers."""
    constants = constants or {}
    names = list(inputs) + list(constants)
    out_names = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op_type, names, out_names, **(attrs or {}))
    graph = helper.make_graph(
        [node], "single",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in out_names],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: np.asarray(v, dtype=np.float32) for k, v in inputs.items()})


def random_qparams(rng, lo: float, hi: float, bits: int = 8, signed: Optional[bool] = None,
                   symmetric: Optional[bool] = None, axis: Optional[int] = None) -> QParams:
    """QParams over [lo, hi] (arrays per channel with `axis`), symmetric or not at random."""
    if symmetric is None:
        symmetric = bool(rng.integers(2))
    return compute_qparams(lo, hi, bits, symmetric=symmetric, signed=signed, axis=axis)


def random_codes(rng, qp: QParams, shape) -> np.ndarray:
    return rng.integers(qp.qmin, qp.qmax + 1, size=shape).astype(qp.dtype)


def ref_requant(acc, m, n, zp, lo, hi) -> np.ndarray:
    """((acc * M + 2^(N-1)) >> N) + zp clamped to [lo, hi], element by element in Python integers."""
    acc, m, n, zp = np.broadcast_arrays(*(np.asarray(v, dtype=object) for v in (acc, m, n, zp)))

    def one(a, mm, nn, z):
        a, mm, nn, z = int(a), int(mm), int(nn), int(z)
        rounding = (1 << (nn - 1)) if nn > 0 else 0
        return min(max(((a * mm + rounding) >> nn) + z, lo), hi)

    return np.frompyfunc(one, 4, 1)(acc, m, n, zp).astype(np.int64)


def context(node: Node, in_qparams, out_qparams, constants=None, **options) -> QuantizeContext:
    return QuantizeContext(node, list(in_qparams), list(out_qparams), dict(constants or {}), QuantizeOptions(**options))


def runtime() -> IntRuntime:
    return IntRuntime(NumpyBackend())


class MatmulOnlyBackend:
    """A backend without the direct-depthwise shortcut: every dot product goes through `matmul`."""

    name = "matmul-only"

    def __init__(self):
        self.calls = 0

    def matmul(self, a, b):
        self.calls += 1
        return np.matmul(a.astype(np.int64), b.astype(np.int64))


def lsb_error(out_qp: QParams, y_int: np.ndarray, y_float: np.ndarray) -> float:
    """max |dequantize(y_int) - clamp(y_float)| in output LSBs (the float result clamped to the output range)."""
    lo, hi = out_qp.real_range()
    clamped = np.clip(np.asarray(y_float, dtype=np.float64), lo[0], hi[0])
    return float(np.max(np.abs(out_qp.dequantize(y_int).astype(np.float64) - clamped)) / out_qp.scale[0])
