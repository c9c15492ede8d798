"""ops/batchnorm.py: a standalone BatchNormalization (16-bit weights, 48-bit accumulator).

(a) forward_int equals an int64 reference of the op's integer formula written here independently (loops /
einsum over small shapes, Python-integer requant); (b) the dequantized output is within the op's documented
LSB bound of the float op (onnxruntime) run on the dequantized inputs and weights; forward_float matches
onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    Check,
    apply_pre_shift,
    assert_forward_float_matches_onnxruntime,
    bias_scale,
    check_multiplier,
    context,
    covers,
    lsb_error,
    ort_single,
    random_qparams,
    ref_requant,
    runtime,
)
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams


@covers("BatchNormalization", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("x_bits, signed", [(8, False), (8, True), (16, True)])
def test_batchnorm_int_equals_reference_and_float_bound(x_bits, signed):
    rng = np.random.default_rng(x_bits + signed)
    c = 4
    x_f = rng.normal(0.5, 2.0, size=(2, c, 3, 5)).astype(np.float32)
    gamma, beta, mean = (rng.normal(size=c).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.1, 3.0, size=c).astype(np.float32)
    x_qp = random_qparams(rng, float(x_f.min()), float(x_f.max()), x_bits, signed=signed)
    x_q = x_qp.quantize(x_f)
    consts = {"scale": gamma, "bias": beta, "mean": mean, "var": var}
    y_float = ort_single("BatchNormalization", {"x": x_qp.dequantize(x_q)}, {"epsilon": 1e-3}, consts)[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("bn", "BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], {"epsilon": 1e-3})
    op = get_op("BatchNormalization")
    q = op.quantize(context(node, [x_qp] + [None] * 4, [y_qp], {1: gamma, 2: beta, 3: mean, 4: var}))
    y = op.forward_int(q, [x_q, gamma, beta, mean, var], runtime())[0]

    w = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + 1e-3)
    b = beta - mean * w
    assert q.weight_qparams.bits == 16 and q.acc.bits == 48
    s_w = q.weight_qparams.scale
    np.testing.assert_allclose(s_w, np.abs(w) / 32767, rtol=1e-6)  # one weight per channel: full 16-bit code
    w_q = np.rint(w / s_w).astype(np.int64)
    acc_scale = x_qp.scale[0] * s_w
    acc = (x_q.astype(np.int64) - int(x_qp.zero_point[0])) * w_q.reshape(1, -1, 1, 1)
    acc = acc + np.rint(b / bias_scale(x_qp.scale[0], s_w)).astype(np.int64).reshape(1, -1, 1, 1)
    check_multiplier(q.stage.m, q.stage.n, acc_scale / y_qp.scale[0], q.stage.pre_shift)
    acc = apply_pre_shift(acc, q.stage, (1, c, 1, 1))
    want = ref_requant(acc, q.stage.m.reshape(1, -1, 1, 1), q.stage.n.reshape(1, -1, 1, 1),
                       int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, want)
    assert lsb_error(y_qp, y, y_float) <= 1.0 + 1e-3


def test_batchnorm_training_mode_is_rejected():
    qp = compute_qparams(-1, 1)
    node = Node("bn", "BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], {"training_mode": 1})
    ones = np.ones(2, dtype=np.float32)
    with pytest.raises(QuantizationError, match="training_mode"):
        get_op("BatchNormalization").quantize(context(node, [qp] + [None] * 4, [qp], {i: ones for i in range(1, 5)}))


FLOAT_CASES = [
    ("BatchNormalization", {"epsilon": 1e-3}, [(2, 3, 4, 4)], [(3,), (3,), (3,), (3,)]),
]


@covers("BatchNormalization", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type, attrs, input_shapes, const_shapes", FLOAT_CASES)
def test_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes):
    assert_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes)
