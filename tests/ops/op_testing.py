"""Helpers for the op tests: single-node onnxruntime runs, random qparams, an independent requant reference,
and the coverage declaration (`covers`) that `test_coverage.py` holds every registered op to."""
from __future__ import annotations

from enum import Enum
from typing import Callable, Optional

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ops import get_op
from ops.backend import NumpyBackend
from ops.registry import IntRuntime, QuantizeContext, QuantizeOptions
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams
from ptq.core.requant import quantize_multiplier

MBITS = 15  # the default multiplier width (ptq.core.requant.DEFAULT_MBITS), restated independently
FORMATS = [(8, True), (8, False), (16, True), (16, False)]  # (bits, signed) of the activation codes
QPARAM_CASES = [  # x bits, x signed, y bits
    (8, True, 8),
    (8, False, 8),
    (16, True, 16),
    (16, True, 8),
    (8, True, 16),
]


class Check(Enum):
    """The comparisons that count as testing an op (see `covers`)."""

    ONNXRUNTIME = "forward_float equals onnxruntime running the op as a one-node ONNX model"
    INT_REFERENCE = "forward_int equals an independent int64 / Python-integer / numpy reference of its formula"


def covers(*op_types: str, check: Check, domain: str = "") -> Callable:
    """Declare that the decorated test performs `check` for each of `op_types` (ops of `domain`).
    Apply it only to a test that really makes that comparison: `test_coverage.py` trusts it."""
    if not op_types or not all(isinstance(t, str) and t for t in op_types):
        raise ValueError(f"covers needs one or more op type names, got {op_types!r}")
    if not isinstance(check, Check):
        raise TypeError(f"covers: check must be a Check, got {check!r}")

    def declare(test: Callable) -> Callable:
        test.op_coverage = getattr(test, "op_coverage", frozenset()) | {((domain, t), check) for t in op_types}
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


def check_multiplier(m, n, r, pre_shift=None):
    """M / 2^(N + P) approximates r to the full 15-bit multiplier's precision (an independent sanity check)."""
    r = np.asarray(r, dtype=np.float64)
    shift = np.asarray(n, dtype=np.float64) + (0 if pre_shift is None else np.asarray(pre_shift, dtype=np.float64))
    approx = np.asarray(m, dtype=np.float64) / np.exp2(shift)
    assert np.all(np.abs(approx - r) <= r * 2.0 ** -(MBITS - 1))


def apply_pre_shift(acc, stage, shape):
    """The stage's accumulator pre-rounding (acc + 2^(P-1)) >> P in Python integers (no P: unchanged)."""
    if stage.pre_shift is None:
        return acc
    p = int(stage.pre_shift[0]) if stage.pre_shift.size == 1 else stage.pre_shift.reshape(shape)
    return ref_requant(acc, 1, p, 0, -2 ** 62, 2 ** 62)


def bias_scale(s_x, s_w):
    """The QDQ convention: the bias scale is the float32 product s_x * s_w."""
    return (np.float32(s_x) * np.asarray(s_w, dtype=np.float32)).astype(np.float64)


def saturate(acc, bits):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return np.clip(acc, lo, hi), int(np.count_nonzero((acc < lo) | (acc > hi)))


def seeded_input(seed, x_bits, x_signed, shape=(2, 3, 5, 4), lo=-4.0, hi=5.0):
    """(rng, x_qp, x_q): random qparams over [lo, hi] and random codes of `shape`, from one seed."""
    rng = np.random.default_rng(seed)
    x_qp = random_qparams(rng, lo, hi, x_bits, signed=x_signed)
    x_q = random_codes(rng, x_qp, shape)
    return rng, x_qp, x_q


def random_input(rng, shape, bits, signed):
    """(qp, codes) over a random range around 0."""
    qp = random_qparams(rng, -rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), bits, signed=signed)
    return qp, random_codes(rng, qp, shape)


def proposal_for(rng, y_float, bits, signed):
    """A quant table's proposal for the output: random qparams over the float output's range."""
    lo, hi = float(y_float.min()), float(y_float.max())
    return random_qparams(rng, lo, hi, bits, signed=signed)


def mean_bound(y_float, y_qp):
    """0.5 LSB rounding + the multiplier's relative error (2^-15) + float32 noise of the reference."""
    big = float(np.max(np.abs(y_float))) / float(y_qp.scale[0])
    return 0.5 + big * (2.0 ** -MBITS + 2.0 ** -20) + 1e-3


def ref_mean_requant(acc, counts, x_qp, y_qp):
    """Python-integer requant of window sums with (M, N) ~= s_x / (s_y * count) per position."""
    acc = np.asarray(acc, dtype=np.int64)
    counts = np.broadcast_to(np.asarray(counts, dtype=np.int64), acc.shape)
    m = np.empty(acc.shape, dtype=np.int64)
    n = np.empty(acc.shape, dtype=np.int64)
    for idx in np.ndindex(*acc.shape):
        r = float(x_qp.scale[0]) / (float(y_qp.scale[0]) * int(counts[idx]))
        mm, nn = quantize_multiplier(r, MBITS)
        assert abs(mm[0] / 2.0 ** nn[0] - r) <= r * 2.0 ** -MBITS
        m[idx], n[idx] = mm[0], nn[0]
    flat = [v.reshape(-1) for v in (acc, m, n)]  # ref_requant needs at least one dimension
    return ref_requant(*flat, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax).reshape(acc.shape)


def assert_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes):
    """forward_float of one node equals onnxruntime on random inputs (graph inputs) and constants (initializers)."""
    rng = np.random.default_rng(len(op_type) + len(input_shapes))
    inputs = {f"i{k}": rng.normal(size=s).astype(np.float32) for k, s in enumerate(input_shapes)}
    consts = {f"c{k}": rng.uniform(0.2, 1.5, size=s).astype(np.float32) for k, s in enumerate(const_shapes)}
    want = ort_single(op_type, inputs, attrs, consts)[0]
    node = Node("n", op_type, list(inputs) + list(consts), ["y"], attrs)
    got = get_op(op_type).forward_float(node, list(inputs.values()) + list(consts.values()))[0]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def lsb_error(out_qp: QParams, y_int: np.ndarray, y_float: np.ndarray) -> float:
    """max |dequantize(y_int) - clamp(y_float)| in output LSBs (the float result clamped to the output range)."""
    lo, hi = out_qp.real_range()
    clamped = np.clip(np.asarray(y_float, dtype=np.float64), lo[0], hi[0])
    return float(np.max(np.abs(out_qp.dequantize(y_int).astype(np.float64) - clamped)) / out_qp.scale[0])
