"""Max / Min (ops/minmax.py): each input requantized to the output grid, then max / min; against a Python-integer
reference (exact) and onnxruntime's float op within 0.5 + the multipliers' error."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, ref_requant, runtime,
)
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node


def _quantize_ref(value: float, qp) -> int:
    """clamp(round_half_even(value / s) + zp) in Python floats and ints."""
    return min(max(round(value / float(qp.scale[0])) + int(qp.zero_point[0]), qp.qmin), qp.qmax)


@covers("Max", "Min", check=Check.INT_REFERENCE)
@covers("Max", "Min", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type", ["Max", "Min"])
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("with_constant", [False, True])
def test_extremum_equals_reference_and_onnxruntime(op_type, bits, with_constant):
    rng = np.random.default_rng(bits + 3 * with_constant + len(op_type))
    a_qp = random_qparams(rng, -3.0, 2.0, bits)
    b_qp = random_qparams(rng, -1.0, 4.0, bits)
    a_q = random_codes(rng, a_qp, (2, 3, 4))
    b_q = random_codes(rng, b_qp, (3, 1))
    inputs = {"a": a_qp.dequantize(a_q), "b": b_qp.dequantize(b_q)}
    constants = {"c": np.array([0.0, 0.7, -0.3, 6.0], np.float32)} if with_constant else {}
    y_float = ort_single(op_type, inputs, constants=constants)[0]
    y_qp = random_qparams(rng, -2.0, 3.0, bits, symmetric=False)  # both ends clip some values
    names = ["a", "b"] + list(constants)
    node = Node("mm", op_type, names, ["y"])
    op = get_op(op_type)
    ctx = context(node, [a_qp, b_qp] + [None] * len(constants), [y_qp], {2: constants["c"]} if constants else {})
    q = op.quantize(ctx)
    y = op.forward_int(q, [a_q, b_q] + list(constants.values()), runtime())[0]
    assert y.dtype == y_qp.dtype

    zp = int(y_qp.zero_point[0])
    operands = [ref_requant(codes.astype(np.int64) - int(qp.zero_point[0]), q.m[i], q.n[i], zp, y_qp.qmin, y_qp.qmax)
                for i, (codes, qp) in enumerate(((a_q, a_qp), (b_q, b_qp)))]
    if constants:
        operands.append(np.array([_quantize_ref(float(c), y_qp) for c in constants["c"]]))
    pick = np.maximum if op_type == "Max" else np.minimum
    want = pick(pick(operands[0], operands[1]), operands[2]) if constants else pick(*operands)
    np.testing.assert_array_equal(y, want)

    bound = 0.5
    for i, (codes, qp) in enumerate(((a_q, a_qp), (b_q, b_qp))):
        ratio = float(qp.scale[0]) / float(y_qp.scale[0])
        err = abs(int(q.m[i]) / 2.0 ** int(q.n[i]) - ratio)
        bound = max(bound, 0.5 + float(np.abs(codes.astype(np.int64) - int(qp.zero_point[0])).max()) * err)
    assert lsb_error(y_qp, y, y_float) <= bound + 1e-3


def test_integer_inputs_keep_their_dtype_in_the_float_forward():
    node = Node("mx", "Max", ["a", "b"], ["y"])
    y = get_op("Max").forward_float(node, [np.array([1, 5], np.int64), np.array([3], np.int64)])[0]
    assert y.dtype == np.int64 and y.tolist() == [3, 5]


def test_all_constant_inputs_are_refused():
    qp = random_qparams(np.random.default_rng(0), -1.0, 1.0, 8)
    node = Node("mx", "Min", ["a", "b"], ["y"])
    with pytest.raises(QuantizationError, match="all inputs are constants"):
        get_op("Min").quantize(context(node, [None, None], [qp], {0: np.ones(2), 1: np.zeros(2)}))
