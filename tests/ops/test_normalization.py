"""LayerNormalization and InstanceNormalization (ops/normalization.py): the integer forward against a
Python-integer reference of the docstring formula (exact), and against onnxruntime's float op within the
stated LSB bound."""
from __future__ import annotations

from math import isqrt

import numpy as np
import pytest

from op_testing import Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, runtime
from ops.registry import get_op
from ptq.core.graph import Node
from ptq.core.requant import quantize_multiplier

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


@covers("LayerNormalization", check=Check.INT_REFERENCE)
@covers("LayerNormalization", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("shape, axis", [((2, 5, 16), -1), ((3, 4, 6), 1)])
def test_layer_norm_mean_and_inv_std_dev_outputs(shape, axis):
    """The optional Mean and InvStdDev outputs in integers: equal to the module docstring's formulas in Python
    integers, within 0.6 LSB of onnxruntime's float statistics."""
    rng = np.random.default_rng(40 + len(shape) + axis)
    x_qp = random_qparams(rng, -3.0, 2.0, 8)
    x_q = random_codes(rng, x_qp, shape)
    norm_shape = shape[axis:]
    gamma = rng.uniform(0.5, 1.5, norm_shape).astype(np.float32)
    attrs = {"axis": axis, "epsilon": 1e-5}
    want = ort_single("LayerNormalization", {"x": x_qp.dequantize(x_q)}, attrs, constants={"gamma": gamma}, outputs=3)
    y_qp, mean_qp, inv_qp = (random_qparams(rng, float(w.min()), float(w.max()), 8, symmetric=False) for w in want)
    node = Node("ln", "LayerNormalization", ["x", "gamma"], ["y", "mean", "inv"], attrs=attrs)
    op = get_op("LayerNormalization")
    q = op.quantize(context(node, [x_qp, None], [y_qp, mean_qp, inv_qp], {1: gamma}))
    y, mean, inv = op.forward_int(q, [x_q, gamma], runtime())
    assert (y.dtype, mean.dtype, inv.dtype) == (y_qp.dtype, mean_qp.dtype, inv_qp.dtype)
    assert mean.shape == inv.shape == want[1].shape

    axes = tuple(range(axis % len(shape), len(shape)))
    x_c = x_q.astype(np.int64) - int(x_qp.zero_point[0])
    np.testing.assert_array_equal(y, _reference(q.kernel, x_c, axes, q.kernel.gamma, np.zeros_like(q.kernel.beta)))
    count = int(np.prod(norm_shape))
    eps_q, g = q.kernel.constants(count)
    m_m, n_m = (int(v[0]) for v in quantize_multiplier(x_qp.scale[0] / (count * mean_qp.scale[0]), MBITS))
    m_i, n_i = (int(v[0]) for v in quantize_multiplier(1.0 / (x_qp.scale[0] * inv_qp.scale[0]), MBITS))
    rows = np.moveaxis(x_c, [a for a in range(len(shape)) if a not in axes], list(range(len(shape) - len(axes))))
    rows = rows.reshape(-1, count)
    want_mean, want_inv, dens = [], [], []
    for row in rows:
        vals = [int(v) for v in row]
        s1, s2 = sum(vals), sum(v * v for v in vals)
        den = count * s2 - s1 * s1 + eps_q
        root = max(isqrt(den << (2 * g)), 1)
        want_mean.append(min(max(((s1 * m_m + (1 << (n_m - 1))) >> n_m) + int(mean_qp.zero_point[0]),
                                 mean_qp.qmin), mean_qp.qmax))
        want_inv.append(min(max(_round_half_away((count * m_i) << g, root << n_i) + int(inv_qp.zero_point[0]),
                                inv_qp.qmin), inv_qp.qmax))
        dens.append(den)
    np.testing.assert_array_equal(mean.ravel(), want_mean)
    np.testing.assert_array_equal(inv.ravel(), want_inv)

    assert lsb_error(mean_qp, mean, want[1]) <= 0.5 + 2 ** 8 * 2.0 ** -(MBITS - 1) + 1e-3
    inv_c = np.abs(inv.astype(np.int64) - int(inv_qp.zero_point[0]))
    assert lsb_error(inv_qp, inv, want[2]) <= 0.5 + inv_c.max() * (2.0 ** -(MBITS - 1) + 2.0 ** -g
                                                                   + 0.25 / min(dens)) + 1e-3
    floats = op.forward_float(node, [x_qp.dequantize(x_q), gamma])
    for got, ref in zip(floats, want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("float_layer", [False, True])
def test_a_layer_norm_with_its_statistics_consumed_runs_end_to_end(float_layer):
    """F4: LayerNormalization with Mean / InvStdDev outputs read downstream used to fall back to float and then
    fail with KeyError: 'mean' (its float forward returned Y only). Now it runs in integers, and in float when
    marked so, with every output."""
    from onnx import TensorProto, helper, numpy_helper

    from ptq.engine.executor import NodeKind, prepare
    from ptq.calibration.pipeline import calibrate
    from tiny_models import make_model

    rng = np.random.default_rng(4)
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y", "mean", "inv"], name="ln"),
             helper.make_node("Mul", ["y", "mean"], ["z"], name="mul")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16])],
                       [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4, 16]),
                        helper.make_tensor_value_info("inv", TensorProto.FLOAT, [1, 4, 1])],
                       [numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "g"),
                        numpy_helper.from_array(rng.normal(0, 0.1, 16).astype(np.float32), "b")])
    x = (rng.normal(0, 2, (8, 1, 4, 16)) + 1).astype(np.float32)
    result = calibrate(model, x[:, 0], write_qdq=False)
    graph = prepare(result.graph, result.table, float_nodes=["ln"] if float_layer else ())
    ln = next(s for s in graph.steps if s.node.name == "ln")
    assert ln.kind is (NodeKind.FLOAT if float_layer else NodeKind.INTEGER)
    got = graph.run({"x": x[0]})
    want = ort_single("LayerNormalization", {"x": x[0]}, {}, constants={"g": numpy_helper.to_array(model.graph.initializer[0]),
                      "b": numpy_helper.to_array(model.graph.initializer[1])}, outputs=3)
    inv_qp = graph.qparams["inv"]
    assert lsb_error(inv_qp, inv_qp.quantize(got.outputs["inv"]), want[2]) <= 0.6
    np.testing.assert_allclose(got.outputs["z"], want[0] * want[1], atol=4 * float(graph.qparams["z"].scale[0]))
