"""Exact unary rules (ops/unary_exact.py): Abs, Neg, Sign, CRelu map every input code exactly (checked over all
codes of 8- and 16-bit grids against Python-integer references and onnxruntime / numpy at 0 LSB); Square
against a Python-integer requant reference and onnxruntime within its stated bound."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, ref_requant, runtime,
)
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node

MBITS = 15
GRIDS = [(8, False), (8, True), (16, False), (16, True)]  # (bits, symmetric)


def _all_codes(qp) -> np.ndarray:
    return np.arange(qp.qmin, qp.qmax + 1).astype(qp.dtype)


def _run(op_type, x_qp, codes, domain="", attrs=None, y_qp=None):
    node = Node(op_type.lower(), op_type, ["x"], ["y"], dict(attrs or {}), domain)
    op = get_op(op_type, domain)
    q = op.quantize(context(node, [x_qp], [y_qp]))
    y = op.forward_int(q, [codes], runtime())[0]
    assert y.dtype == q.out_qparams[0].dtype
    return q.out_qparams[0], y, node


@covers("Abs", "Neg", "Sign", check=Check.INT_REFERENCE)
@covers("Abs", "Neg", "Sign", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type", ["Abs", "Neg", "Sign"])
@pytest.mark.parametrize("bits,symmetric", GRIDS)
def test_exact_rules_map_every_code_exactly(op_type, bits, symmetric):
    rng = np.random.default_rng(bits + symmetric)
    x_qp = random_qparams(rng, -2.5, 1.5, bits, symmetric=symmetric)
    codes = _all_codes(x_qp)
    y_qp, y, _ = _run(op_type, x_qp, codes)
    zp, lo, hi = int(x_qp.zero_point[0]), x_qp.qmin, x_qp.qmax
    ints = codes.astype(np.int64).tolist()
    want = {"Abs": [abs(q - zp) for q in ints],
            "Neg": [lo + hi - q for q in ints],
            "Sign": [(q > zp) - (q < zp) for q in ints]}[op_type]
    np.testing.assert_array_equal(y, want)
    assert y_qp.qmin <= min(want) and max(want) <= y_qp.qmax
    y_float = ort_single(op_type, {"x": x_qp.dequantize(codes)})[0]
    np.testing.assert_array_equal(y_qp.dequantize(y), y_float)  # 0 LSB: the very same float values


@covers("CRelu", check=Check.INT_REFERENCE, domain="ai.ptq")
@covers("CRelu", check=Check.ONNXRUNTIME, domain="ai.ptq")
@pytest.mark.parametrize("bits,symmetric", GRIDS)
@pytest.mark.parametrize("axis", [1, -1])
def test_crelu_concatenates_both_halves_exactly(bits, symmetric, axis):
    rng = np.random.default_rng(bits + 2 * symmetric)
    x_qp = random_qparams(rng, -1.0, 3.0, bits, symmetric=symmetric)
    codes = random_codes(rng, x_qp, (2, 3, 4, 5))
    y_qp, y, node = _run("CRelu", x_qp, codes, domain="ai.ptq", attrs={"axis": axis})
    x_c = codes.astype(np.int64) - int(x_qp.zero_point[0])
    want = np.concatenate([np.where(x_c > 0, x_c, 0), np.where(x_c < 0, -x_c, 0)], axis=axis)
    np.testing.assert_array_equal(y, want)
    x = x_qp.dequantize(codes)
    y_float = get_op("CRelu", "ai.ptq").forward_float(node, [x])[0]
    np.testing.assert_array_equal(y_float, np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], axis=axis))
    np.testing.assert_array_equal(y_qp.dequantize(y), y_float)


@covers("Square", check=Check.INT_REFERENCE, domain="ai.ptq")
@covers("Square", check=Check.ONNXRUNTIME, domain="ai.ptq")
@pytest.mark.parametrize("bits", [8, 16])
def test_square_requantizes_the_integer_square(bits):
    rng = np.random.default_rng(bits)
    x_qp = random_qparams(rng, -3.0, 2.0, bits)
    codes = _all_codes(x_qp)
    x = x_qp.dequantize(codes)
    want_float = x.astype(np.float64) ** 2
    y_qp = random_qparams(rng, 0.0, float(want_float.max()) * 0.8, bits)  # the top saturates
    node = Node("sq", "Square", ["x"], ["y"], {}, "ai.ptq")
    op = get_op("Square", "ai.ptq")
    q = op.quantize(context(node, [x_qp], [y_qp]))
    y = op.forward_int(q, [codes], runtime())[0]
    x_c = codes.astype(np.int64) - int(x_qp.zero_point[0])
    np.testing.assert_array_equal(y, ref_requant(x_c * x_c, q.m, q.n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    np.testing.assert_array_equal(op.forward_float(node, [x])[0], x * x)
    r = float(x_qp.scale[0]) ** 2 / float(y_qp.scale[0])
    bound = 0.5 + float(np.max(x_c * x_c)) * abs(int(q.m[0]) / 2.0 ** int(q.n[0]) - r)
    assert lsb_error(y_qp, y, ort_single("Mul", {"a": x, "b": x})[0]) <= bound + 1e-3


def test_integer_inputs_keep_their_dtype_in_the_float_forward():
    """Shape subgraphs run these ops' float forward on int64 tensors."""
    node = Node("abs", "Abs", ["x"], ["y"])
    x = np.array([-3, 0, 4], np.int64)
    for op_type, want in (("Abs", [3, 0, 4]), ("Neg", [3, 0, -4]), ("Sign", [-1, 0, 1])):
        y = get_op(op_type).forward_float(node, [x])[0]
        assert y.dtype == np.int64
        np.testing.assert_array_equal(y, want)


def test_square_needs_output_qparams():
    qp = random_qparams(np.random.default_rng(0), -1.0, 1.0, 8)
    node = Node("sq", "Square", ["x"], ["y"], {}, "ai.ptq")
    with pytest.raises(QuantizationError, match="output has no qparams"):
        get_op("Square", "ai.ptq").quantize(context(node, [qp], [None]))
