"""LayerNormalization and InstanceNormalization (ops/normalization.py): the integer forward against a
Python-integer reference of the docstring formula (exact), and against onnxruntime's float op within the
stated LSB bound."""
from __future__ import annotations

from math import isqrt

import numpy as np
import pytest

from op_testing import Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, runtime
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node

MBITS = 15


def _round_half_away(num: int, den: int) -> int:
    q, r = divmod(abs(num), abs(den))
    q += 2 * r >= abs(den)
    return q if (num < 0) == (den < 0) else -q


def _reference(kernel, x_c: np.ndarray, axes, gamma: np.ndarray, beta: np.ndarray, centred: bool = True) -> np.ndarray:
    """The module docstring's formula in Python integers, row by row (gamma, beta: codes broadcast to x);
    `centred=False`: RMSNormalization's (S1 taken as 0)."""
    kept = [a for a in range(x_c.ndim) if a not in axes]
    order = kept + list(axes)
    moved = np.transpose(x_c, order)
    g = np.transpose(np.broadcast_to(gamma, x_c.shape), order)
    b = np.transpose(np.broadcast_to(beta, x_c.shape), order)
    count = int(np.prod([x_c.shape[a] for a in axes]))
    eps_q, sqrt_bits = kernel.constants(count)
    f = kernel.fraction_bits
    stage = kernel.stage
    pre = int(stage.pre_shift[0]) if stage.pre_shift is not None else 0
    m, n = int(stage.m[0]), int(stage.n[0])
    out = np.empty(moved.shape, dtype=np.int64)
    flat, gf, bf, of = (a.reshape(-1, count) for a in (moved, g, b, out))
    for row, grow, brow, orow in zip(flat, gf, bf, of):
        vals = [int(v) for v in row]
        s1, s2 = sum(vals) if centred else 0, sum(v * v for v in vals)
        root = max(isqrt((count * s2 - s1 * s1 + eps_q) << (2 * sqrt_bits)), 1)
        for j, v in enumerate(vals):
            n_f = _round_half_away((count * v - s1) << (f + sqrt_bits), root)
            acc = n_f * int(grow[j]) + int(brow[j])
            if pre:
                acc = (acc + (1 << (pre - 1))) >> pre
            orow[j] = min(max(((acc * m + (1 << (n - 1))) >> n) + stage.zp, stage.lo), stage.hi)
    return np.transpose(out, np.argsort(order))


def _bound(kernel, y_qp, gamma, count):
    n_max = np.sqrt(count - 1)
    _, g = kernel.constants(count)
    return (0.5 + 2 ** y_qp.bits * 2.0 ** -(MBITS - 1) + 2.0 ** -17
            + np.abs(gamma).max() / y_qp.scale[0] * (n_max * (2.0 ** -16 + 2.0 ** -g) + 2.0 ** -kernel.fraction_bits))


@covers("LayerNormalization", check=Check.INT_REFERENCE)
@covers("LayerNormalization", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("shape, axis", [((2, 5, 16), -1), ((3, 4, 6), 1), ((4, 32), -1)])
@pytest.mark.parametrize("bits", [8, 16])
def test_layer_norm(shape, axis, bits):
    rng = np.random.default_rng(len(shape) + bits + axis)
    x_qp = random_qparams(rng, -3.0, 2.0, bits)
    x_q = random_codes(rng, x_qp, shape)
    norm_shape = shape[axis:]
    gamma = rng.uniform(-1.5, 1.5, norm_shape).astype(np.float32)
    beta = rng.uniform(-0.5, 0.5, norm_shape).astype(np.float32)
    want = ort_single("LayerNormalization", {"x": x_qp.dequantize(x_q)}, {"axis": axis, "epsilon": 1e-5},
                      constants={"gamma": gamma, "beta": beta})[0]
    y_qp = random_qparams(rng, float(want.min()), float(want.max()), bits, symmetric=False)
    node = Node("ln", "LayerNormalization", ["x", "gamma", "beta"], ["y"], attrs={"axis": axis, "epsilon": 1e-5})
    op = get_op("LayerNormalization")
    q = op.quantize(context(node, [x_qp, None, None], [y_qp], {1: gamma, 2: beta}))
    y = op.forward_int(q, [x_q, gamma, beta], runtime())[0]
    assert y.dtype == y_qp.dtype
    axes = tuple(range(axis % len(shape), len(shape)))
    x_c = x_q.astype(np.int64) - int(x_qp.zero_point[0])
    np.testing.assert_array_equal(y, _reference(q.kernel, x_c, axes, q.kernel.gamma, q.kernel.beta))
    count = int(np.prod(norm_shape))
    assert lsb_error(y_qp, y, want) <= _bound(q.kernel, y_qp, gamma, count)
    np.testing.assert_allclose(op.forward_float(node, [x_qp.dequantize(x_q), gamma, beta])[0], want, atol=1e-5)


@covers("RMSNormalization", check=Check.INT_REFERENCE)
@covers("RMSNormalization", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("shape, axis", [((2, 5, 16), -1), ((3, 4, 6), 1)])
@pytest.mark.parametrize("bits", [8, 16])
def test_rms_norm(shape, axis, bits):
    rng = np.random.default_rng(len(shape) + bits - axis)
    x_qp = random_qparams(rng, -2.0, 3.0, bits)
    x_q = random_codes(rng, x_qp, shape)
    gamma = rng.uniform(-1.5, 1.5, shape[axis:]).astype(np.float32)
    want = ort_single("RMSNormalization", {"x": x_qp.dequantize(x_q)}, {"axis": axis, "epsilon": 1e-5},
                      constants={"gamma": gamma}, opset=23)[0]
    y_qp = random_qparams(rng, float(want.min()), float(want.max()), bits, symmetric=False)
    node = Node("rms", "RMSNormalization", ["x", "gamma"], ["y"], attrs={"axis": axis, "epsilon": 1e-5})
    op = get_op("RMSNormalization")
    q = op.quantize(context(node, [x_qp, None], [y_qp], {1: gamma}))
    y = op.forward_int(q, [x_q, gamma], runtime())[0]
    axes = tuple(range(axis % len(shape), len(shape)))
    x_c = x_q.astype(np.int64) - int(x_qp.zero_point[0])
    np.testing.assert_array_equal(y, _reference(q.kernel, x_c, axes, q.kernel.gamma, q.kernel.beta, centred=False))
    count = int(np.prod(shape[axis:]))
    assert lsb_error(y_qp, y, want) <= _bound(q.kernel, y_qp, gamma, count + 1)  # n_max = sqrt(D)
    np.testing.assert_allclose(op.forward_float(node, [x_qp.dequantize(x_q), gamma])[0], want, atol=1e-5)


@covers("InstanceNormalization", check=Check.INT_REFERENCE)
@covers("InstanceNormalization", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 4, 30)])
@pytest.mark.parametrize("bits", [8, 16])
def test_instance_norm(shape, bits):
    rng = np.random.default_rng(len(shape) * bits)
    x_qp = random_qparams(rng, -1.0, 4.0, bits)
    x_q = random_codes(rng, x_qp, shape)
    c = shape[1]
    gamma = rng.uniform(0.2, 2.0, c).astype(np.float32) * rng.choice([-1, 1], c).astype(np.float32)
    beta = rng.uniform(-1, 1, c).astype(np.float32)
    want = ort_single("InstanceNormalization", {"x": x_qp.dequantize(x_q)}, {"epsilon": 1e-5},
                      constants={"gamma": gamma, "beta": beta})[0]
    y_qp = random_qparams(rng, float(want.min()), float(want.max()), bits, symmetric=False)
    node = Node("in", "InstanceNormalization", ["x", "gamma", "beta"], ["y"], attrs={"epsilon": 1e-5})
    op = get_op("InstanceNormalization")
    q = op.quantize(context(node, [x_qp, None, None], [y_qp], {1: gamma, 2: beta}))
    y = op.forward_int(q, [x_q, gamma, beta], runtime())[0]
    shape_c = (1, c) + (1,) * (len(shape) - 2)
    x_c = x_q.astype(np.int64) - int(x_qp.zero_point[0])
    ref = _reference(q.kernel, x_c, tuple(range(2, len(shape))), q.kernel.gamma.reshape(shape_c),
                     q.kernel.beta.reshape(shape_c))
    np.testing.assert_array_equal(y, ref)
    assert lsb_error(y_qp, y, want) <= _bound(q.kernel, y_qp, gamma, int(np.prod(shape[2:])))


def test_constant_rows_give_beta():
    """var = 0: the row normalizes to 0 (eps keeps the square root positive) and the output is beta."""
    x_qp = random_qparams(np.random.default_rng(0), -1.0, 1.0, 8, symmetric=True)
    y_qp = random_qparams(np.random.default_rng(1), -1.0, 1.0, 8, symmetric=True)
    gamma, beta = np.full(8, 0.7, np.float32), np.linspace(-0.9, 0.9, 8).astype(np.float32)
    node = Node("ln", "LayerNormalization", ["x", "g", "b"], ["y"], attrs={"epsilon": 0.0})
    op = get_op("LayerNormalization")
    q = op.quantize(context(node, [x_qp, None, None], [y_qp], {1: gamma, 2: beta}))
    y = op.forward_int(q, [np.full((2, 8), 17, np.int8), gamma, beta], runtime())[0]
    np.testing.assert_array_equal(y, np.broadcast_to(y_qp.quantize(beta), (2, 8)))


def test_training_outputs_are_refused():
    qp = random_qparams(np.random.default_rng(0), -1.0, 1.0, 8)
    node = Node("ln", "LayerNormalization", ["x", "g"], ["y", "mean", ""])
    with pytest.raises(QuantizationError, match="Mean and InvStdDev"):
        get_op("LayerNormalization").quantize(context(node, [qp, None], [qp, None, None], {1: np.ones(4)}))
