"""ReduceSum/Max/Min/Prod/L2 and Moments (ops/reductions.py): each integer forward against a Python-integer
reference of its docstring formula (exact), and against onnxruntime's float op (numpy for Moments) within the
stated LSB bound; axes as attribute (old opsets) and as input (new opsets)."""
from __future__ import annotations

from math import isqrt as py_isqrt

import numpy as np
import pytest

from op_testing import Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, ref_requant, runtime
from ops.int_sqrt import isqrt
from ops.registry import get_op
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams

MBITS = 15
SHAPE = (2, 3, 4, 5)


def _node(op_type, axes, as_input, keepdims=1, domain=""):
    if as_input:
        return Node("r", op_type, ["x", "axes"], ["y"], attrs={"keepdims": keepdims}, domain=domain)
    return Node("r", op_type, ["x"], ["y"], attrs={"keepdims": keepdims, "axes": list(axes)}, domain=domain)


def _ort(op_type, x, axes, as_input, keepdims):
    if as_input:
        opset = 13 if op_type == "ReduceSum" else 18
        return ort_single(op_type, {"x": x}, {"keepdims": keepdims},
                          constants={"axes": np.array(axes, np.int64)}, opset=opset)[0]
    return ort_single(op_type, {"x": x}, {"keepdims": keepdims, "axes": list(axes)}, opset=11)[0]


def _run(op_type, node, x_qp, y_qp, x_q, axes, as_input):
    op = get_op(op_type)
    q = op.quantize(context(node, [x_qp, None], [y_qp]))
    args = [x_q, np.array(axes, np.int64)] if as_input else [x_q]
    return q, op.forward_int(q, args, runtime())[0]


def _python_rows(x_c, axes, keep):
    """Reduced rows as lists of Python ints, and the reduced shape."""
    kept = [a for a in range(x_c.ndim) if a not in axes]
    moved = np.transpose(x_c, kept + list(axes))
    rows = moved.reshape(moved.shape[:len(kept)] + (-1,))
    shape = tuple(1 if a in axes else n for a, n in enumerate(x_c.shape)) if keep else tuple(x_c.shape[a] for a in kept)
    return [[int(v) for v in row] for row in rows.reshape(-1, rows.shape[-1])], shape


def _requant_one(a, m, n, zp, lo, hi):
    return min(max(((a * m + ((1 << n) >> 1)) >> n) + zp, lo), hi)


CASES = [((1,), False, 1), ((0, 2), True, 0), ((-1,), True, 1), ((1, 3), False, 0)]


@covers("ReduceMax", "ReduceMin", check=Check.INT_REFERENCE)
@covers("ReduceMax", "ReduceMin", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("axes, as_input, keepdims", CASES)
@pytest.mark.parametrize("op_type", ["ReduceMax", "ReduceMin"])
def test_max_min_move_codes_with_input_qparams(op_type, axes, as_input, keepdims):
    rng = np.random.default_rng(len(axes) + 2 * as_input)
    x_qp = random_qparams(rng, -3.0, 2.0, 8)
    x_q = random_codes(rng, x_qp, SHAPE)
    q, y = _run(op_type, _node(op_type, axes, as_input, keepdims), x_qp, None, x_q, axes, as_input)
    assert q.out_qparams[0] is x_qp and y.dtype == x_qp.dtype
    rows, shape = _python_rows(x_q.astype(np.int64), [a % 4 for a in axes], keepdims)
    pick = max if op_type == "ReduceMax" else min
    np.testing.assert_array_equal(y, np.array([pick(r) for r in rows]).reshape(shape))
    want = _ort(op_type, x_qp.dequantize(x_q), axes, as_input, keepdims)
    assert lsb_error(x_qp, y, want) <= 1e-5


@covers("ReduceSum", check=Check.INT_REFERENCE)
@covers("ReduceSum", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("axes, as_input, keepdims", CASES)
@pytest.mark.parametrize("bits", [8, 16])
def test_reduce_sum(axes, as_input, keepdims, bits):
    rng = np.random.default_rng(bits + len(axes))
    x_qp = random_qparams(rng, -2.0, 3.0, bits)
    x_q = random_codes(rng, x_qp, SHAPE)
    want = _ort("ReduceSum", x_qp.dequantize(x_q), axes, as_input, keepdims)
    y_qp = random_qparams(rng, float(want.min()), float(want.max()), bits, symmetric=False)
    q, y = _run("ReduceSum", _node("ReduceSum", axes, as_input, keepdims), x_qp, y_qp, x_q, axes, as_input)
    rows, shape = _python_rows(x_q.astype(np.int64) - int(x_qp.zero_point[0]), [a % 4 for a in axes], keepdims)
    ref = ref_requant(np.array([sum(r) for r in rows]).reshape(shape), q.m, q.n, int(y_qp.zero_point[0]),
                      y_qp.qmin, y_qp.qmax)
    np.testing.assert_array_equal(y, ref)
    assert lsb_error(y_qp, y, want) <= 0.5 + 2 ** bits * 2.0 ** -(MBITS - 1) + 1e-6


@covers("ReduceL2", check=Check.INT_REFERENCE)
@covers("ReduceL2", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("axes, as_input, keepdims", CASES)
@pytest.mark.parametrize("bits", [8, 16])
def test_reduce_l2(axes, as_input, keepdims, bits):
    rng = np.random.default_rng(10 + bits + len(axes))
    x_qp = random_qparams(rng, -2.0, 3.0, bits)
    x_q = random_codes(rng, x_qp, SHAPE)
    want = _ort("ReduceL2", x_qp.dequantize(x_q), axes, as_input, keepdims)
    y_qp = compute_qparams(0.0, float(want.max()), bits, symmetric=False)
    q, y = _run("ReduceL2", _node("ReduceL2", axes, as_input, keepdims), x_qp, y_qp, x_q, axes, as_input)
    rows, shape = _python_rows(x_q.astype(np.int64) - int(x_qp.zero_point[0]), [a % 4 for a in axes], keepdims)
    m, n, f = int(q.m[0]), int(q.n[0]), q.fraction_bits
    z_max = ((y_qp.qmax - int(y_qp.zero_point[0]) + 1) << f) ** 2
    ref = [_requant_one(py_isqrt(_requant_one(sum(v * v for v in r), m, n, 0, 0, z_max)), 1, f,
                        int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax) for r in rows]
    np.testing.assert_array_equal(y, np.array(ref).reshape(shape))
    assert lsb_error(y_qp, y, want) <= 0.5 + 2.0 ** -f + 2 ** bits * 2.0 ** -MBITS + 1e-6


@covers("ReduceProd", check=Check.INT_REFERENCE)
@covers("ReduceProd", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("axes, as_input, keepdims", CASES + [((0,), False, 1)])
def test_reduce_prod(axes, as_input, keepdims):
    rng = np.random.default_rng(20 + len(axes) + as_input)
    x_qp = random_qparams(rng, -1.6, 1.6, 8)
    x_q = random_codes(rng, x_qp, SHAPE)
    want = _ort("ReduceProd", x_qp.dequantize(x_q), axes, as_input, keepdims)
    y_qp = random_qparams(rng, float(want.min()), float(want.max()), 8, symmetric=False)
    q, y = _run("ReduceProd", _node("ReduceProd", axes, as_input, keepdims), x_qp, y_qp, x_q, axes, as_input)
    rows, shape = _python_rows(x_q.astype(np.int64) - int(x_qp.zero_point[0]), [a % 4 for a in axes], keepdims)
    zp, lim = int(y_qp.zero_point[0]), q.limit
    ref = []
    for r in rows:
        p = _requant_one(r[0] * r[1], *q.first, 0, -lim, lim)
        for v in r[2:]:
            p = _requant_one(p * v, *q.step, 0, -lim, lim)
        ref.append(_requant_one(p, 1, q.fraction_bits, zp, y_qp.qmin, y_qp.qmax))
    np.testing.assert_array_equal(y, np.array(ref).reshape(shape))
    # bound of the docstring with |x| <= 1.6 and at most 12 factors
    c = max(len(r) for r in rows)
    tail = sum(1.6 ** j for j in range(c))
    bound = 0.5 + 2 ** 8 * c * 2.0 ** -(MBITS - 1) + 2.0 ** -(q.fraction_bits + 1) * tail
    assert lsb_error(y_qp, y, want) <= bound


@covers("Moments", check=Check.INT_REFERENCE, domain="ai.ptq")
@covers("Moments", check=Check.ONNXRUNTIME, domain="ai.ptq")
@pytest.mark.parametrize("axes, keepdims, unbiased", [((2, 3), 1, 0), ((0, 2, 3), 0, 1), (None, 1, 0)])
def test_moments(axes, keepdims, unbiased):
    rng = np.random.default_rng(30 + keepdims + unbiased)
    x_qp = random_qparams(rng, -2.0, 3.0, 8)
    x_q = random_codes(rng, x_qp, SHAPE)
    attrs = {"keepdims": keepdims, "unbiased": unbiased}
    if axes is not None:
        attrs["axes"] = list(axes)
    node = Node("m", "Moments", ["x"], ["mean", "var"], attrs=attrs, domain="ai.ptq")
    op = get_op("Moments", "ai.ptq")
    x_f = x_qp.dequantize(x_q).astype(np.float64)
    red = tuple(axes) if axes is not None else tuple(range(4))
    mean_f, var_f = op.forward_float(node, [x_f])
    # the float op vs the numpy formula of tf.nn.moments
    np.testing.assert_allclose(mean_f, x_f.mean(axis=red, keepdims=bool(keepdims)), rtol=1e-6, atol=1e-6)
    c = int(np.prod([SHAPE[a] for a in red]))
    var_np = ((x_f - x_f.mean(axis=red, keepdims=True)) ** 2).sum(axis=red, keepdims=bool(keepdims)) / (c - unbiased)
    np.testing.assert_allclose(var_f, var_np, rtol=1e-5, atol=1e-6)
    mean_qp = random_qparams(rng, float(mean_f.min()), float(mean_f.max()), 8, symmetric=False)
    var_qp = compute_qparams(0.0, float(var_f.max()), 8, symmetric=False)
    q = op.quantize(context(node, [x_qp], [mean_qp, var_qp]))
    mean_q, var_q = op.forward_int(q, [x_q], runtime())
    rows, shape = _python_rows(x_q.astype(np.int64) - int(x_qp.zero_point[0]), list(red), keepdims)
    m_mean, n_mean = q.mean.pair(c)
    stage = q.variance.stage(c)
    pre = int(stage.pre_shift[0]) if stage.pre_shift is not None else 0
    want_mean, want_var = [], []
    for r in rows:
        s1, s2 = sum(r), sum(v * v for v in r)
        want_mean.append(_requant_one(s1, m_mean, n_mean, int(mean_qp.zero_point[0]), mean_qp.qmin, mean_qp.qmax))
        acc = _requant_one(c * s2 - s1 * s1, 1, pre, 0, -(1 << 62), 1 << 62)
        want_var.append(_requant_one(acc, int(stage.m[0]), int(stage.n[0]), int(var_qp.zero_point[0]),
                                     var_qp.qmin, var_qp.qmax))
    np.testing.assert_array_equal(mean_q, np.array(want_mean).reshape(shape))
    np.testing.assert_array_equal(var_q, np.array(want_var).reshape(shape))
    assert lsb_error(mean_qp, mean_q, mean_f) <= 0.5 + 2 ** 8 * 2.0 ** -MBITS + 1e-6
    assert lsb_error(var_qp, var_q, var_f) <= 0.5 + 2 ** 8 * 2.0 ** -(MBITS - 1) + 2.0 ** -17 + 1e-6


def test_moments_variance_defaults_to_the_square_of_the_input_scale():
    x_qp = compute_qparams(-1.0, 1.0, 8)
    node = Node("m", "Moments", ["x"], ["mean", "var"], attrs={"axes": [1]}, domain="ai.ptq")
    q = get_op("Moments", "ai.ptq").quantize(context(node, [x_qp], [None, None]))
    assert q.out_qparams[0] is x_qp
    assert q.out_qparams[1].scale[0] == pytest.approx(float(x_qp.scale[0]) ** 2)
    assert int(q.out_qparams[1].zero_point[0]) == 0 and not q.out_qparams[1].signed


def test_isqrt_is_the_exact_floor_square_root():
    rng = np.random.default_rng(0)
    n = np.concatenate([np.arange(0, 2000), rng.integers(0, 1 << 62, 2000), [(1 << 62) - 1, (1 << 31) ** 2 - 1]])
    got = isqrt(n.astype(np.int64))
    np.testing.assert_array_equal(got, [py_isqrt(int(v)) for v in n])
    with pytest.raises(ValueError, match="isqrt"):
        isqrt(np.array([-1]))
