"""ops/gemm.py: Gemm, MatMul.

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
    saturate,
)
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams


# ----------------------------------------------------------------------------------------- Gemm

@covers("Gemm", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("trans_a, trans_b, alpha, beta, c_shape, per_channel, x_bits", [
    (0, 0, 1.0, 1.0, (5,), True, 8),
    (1, 1, 0.5, 2.0, (1, 5), True, 8),
    (0, 1, -1.5, 0.5, (3, 5), False, 8),
    (0, 0, 1.0, 1.0, None, True, 16),
    (1, 0, 2.0, 1.0, (3, 1), True, 8),
])
def test_gemm_int_equals_reference_and_float_bound(trans_a, trans_b, alpha, beta, c_shape, per_channel, x_bits):
    rng = np.random.default_rng(int(abs(alpha) * 10) + x_bits + trans_a)
    m_, k_, n_ = 3, 6, 5
    a_f = rng.normal(size=(k_, m_) if trans_a else (m_, k_)).astype(np.float32)
    b_f = rng.normal(0, 0.5, size=(n_, k_) if trans_b else (k_, n_)).astype(np.float32)
    a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), x_bits, signed=bool(rng.integers(2)))
    axis = 0 if trans_b else 1
    if per_channel:
        w_qp = random_qparams(rng, b_f.min(axis=1 - axis), b_f.max(axis=1 - axis), 8, signed=True, axis=axis)
    else:
        w_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), 8, signed=True)
    a_q = a_qp.quantize(a_f)
    w_q = w_qp.quantize(b_f)
    attrs = {"alpha": alpha, "beta": beta, "transA": trans_a, "transB": trans_b}
    consts = {"b": w_qp.dequantize(w_q)}
    inputs_node = ["a", "b"]
    constants = {1: b_f}
    c_f = None
    if c_shape is not None:
        c_f = rng.normal(size=c_shape).astype(np.float32)
        consts["c"] = c_f
        inputs_node.append("c")
        constants[2] = c_f
    y_float = ort_single("Gemm", {"a": a_qp.dequantize(a_q)}, attrs, consts)[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("gemm", "Gemm", inputs_node, ["y"], attrs)
    op = get_op("Gemm")
    q = op.quantize(context(node, [a_qp, w_qp] + [None] * (len(inputs_node) - 2), [y_qp], constants))
    y = op.forward_int(q, [a_q, b_f] + ([c_f] if c_f is not None else []), runtime())[0]

    a_c = a_q.astype(np.int64) - int(a_qp.zero_point[0])
    a_c = a_c.T if trans_a else a_c
    w_c = w_q.astype(np.int64) - w_qp.broadcast(w_qp.zero_point, 2)
    w_c = w_c.T if trans_b else w_c
    s_w = np.broadcast_to(w_qp.scale, n_)
    acc_scale = abs(alpha) * a_qp.scale[0] * s_w
    acc = np.einsum("mk,kn->mn", a_c, w_c) * int(np.sign(alpha))
    if c_f is not None:
        c_scale = abs(alpha) * bias_scale(a_qp.scale[0], s_w)
        acc = acc + np.rint(beta * c_f.astype(np.float64) / c_scale).astype(np.int64)
    acc, _ = saturate(acc, 32 if x_bits <= 8 else 48)
    m = np.broadcast_to(q.stage.m, n_)
    n = np.broadcast_to(q.stage.n, n_)
    check_multiplier(m, n, acc_scale / y_qp.scale[0], q.stage.pre_shift)
    acc = apply_pre_shift(acc, q.stage, (1, n_))
    np.testing.assert_array_equal(y, ref_requant(acc, m, n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    assert lsb_error(y_qp, y, y_float) <= 1.0 + 1e-3


# --------------------------------------------------------------------------------------- MatMul

@covers("MatMul", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("a_shape, b_shape, b_const, per_channel, bits", [
    ((4, 6), (6, 3), True, True, 8),
    ((2, 4, 6), (6, 3), True, False, 8),
    ((2, 4, 6), (2, 6, 3), True, True, 16),
    ((2, 1, 4, 6), (3, 6, 5), False, False, 8),  # two activations, broadcast batch
    ((6,), (6, 3), True, True, 8),                # 1-D A
    ((3, 6), (6,), False, False, 16),             # 1-D activation B
])
def test_matmul_int_equals_reference_and_float_bound(a_shape, b_shape, b_const, per_channel, bits):
    rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape) + bits)
    a_f = rng.normal(0.5, 1.0, size=a_shape).astype(np.float32)
    b_f = rng.normal(0, 0.5, size=b_shape).astype(np.float32)
    a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), bits, signed=bool(rng.integers(2)))
    if per_channel:
        red = tuple(range(b_f.ndim - 1))
        b_qp = random_qparams(rng, b_f.min(axis=red), b_f.max(axis=red), 8, signed=True, axis=b_f.ndim - 1)
    else:
        b_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), bits if not b_const else 8,
                              signed=bool(rng.integers(2)))
    a_q = a_qp.quantize(a_f)
    b_q = b_qp.quantize(b_f)
    if b_const:
        y_float = ort_single("MatMul", {"a": a_qp.dequantize(a_q)}, {}, {"b": b_qp.dequantize(b_q)})[0]
    else:
        y_float = ort_single("MatMul", {"a": a_qp.dequantize(a_q), "b": b_qp.dequantize(b_q)})[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("mm", "MatMul", ["a", "b"], ["y"])
    op = get_op("MatMul")
    q = op.quantize(context(node, [a_qp, b_qp], [y_qp], {1: b_f} if b_const else {}))
    y = op.forward_int(q, [a_q, b_f if b_const else b_q], runtime())[0]

    a_c = a_q.astype(np.int64) - int(a_qp.zero_point[0])
    b_c = b_q.astype(np.int64) - b_qp.broadcast(b_qp.zero_point, b_q.ndim)
    acc = np.matmul(a_c, b_c)  # int64 matmul of centered codes (numpy's integer path, no BLAS)
    acc, _ = saturate(acc, 32 if bits <= 8 else 48)
    s_b = b_qp.scale if per_channel else b_qp.scale[:1]
    r = a_qp.scale[0] * s_b / y_qp.scale[0]
    check_multiplier(q.stage.m, q.stage.n, r, q.stage.pre_shift)
    acc = apply_pre_shift(acc, q.stage, (1, q.stage.m.size))
    m = q.stage.m if q.stage.m.size == 1 else q.stage.m.reshape(-1)
    n = q.stage.n if q.stage.n.size == 1 else q.stage.n.reshape(-1)
    assert y.shape == y_float.shape
    np.testing.assert_array_equal(y, ref_requant(acc, m, n, int(y_qp.zero_point[0]), y_qp.qmin, y_qp.qmax))
    assert lsb_error(y_qp, y, y_float) <= 1.0 + 1e-3


def test_matmul_rejects_constant_a():
    qp = compute_qparams(-1, 1)
    node = Node("mm", "MatMul", ["a", "b"], ["y"])
    with pytest.raises(QuantizationError, match="activation"):
        get_op("MatMul").quantize(context(node, [qp, qp], [qp], {0: np.ones((2, 2)), 1: np.ones((2, 2))}))


FLOAT_CASES = [
    ("Gemm", {"alpha": 0.5, "beta": 2.0, "transA": 1, "transB": 1}, [(5, 3)], [(4, 5), (4,)]),
    ("MatMul", {}, [(2, 3, 5)], [(5, 4)]),
    ("MatMul", {}, [(2, 3, 5), (2, 5, 4)], []),
]


@covers("Gemm", "MatMul", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type, attrs, input_shapes, const_shapes", FLOAT_CASES)
def test_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes):
    assert_forward_float_matches_onnxruntime(op_type, attrs, input_shapes, const_shapes)


EINSUM_EQUATIONS = [
    ("B G H I D, B G H J D -> B G H I J", (1, 2, 3, 4, 6), (1, 2, 3, 5, 6)),  # MaxViT's q k^T (torchvision)
    ("B G H I J, B G H J D -> B G H I D", (1, 2, 3, 4, 5), (1, 2, 3, 5, 6)),  # MaxViT's attn v
    ("ik,kj->ij", (4, 6), (6, 3)),
]


@covers("Einsum", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("equation, a_shape, b_shape", EINSUM_EQUATIONS)
def test_einsum_int_equals_reference_and_float_bound(equation, a_shape, b_shape):
    rng = np.random.default_rng(len(a_shape) + b_shape[-1])
    a_f = rng.normal(0.5, 1.0, size=a_shape).astype(np.float32)
    b_f = rng.normal(0, 0.5, size=b_shape).astype(np.float32)
    a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), 8, signed=False)
    b_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), 8, signed=True)
    a_q, b_q = a_qp.quantize(a_f), b_qp.quantize(b_f)
    attrs = {"equation": equation}
    y_float = ort_single("Einsum", {"a": a_qp.dequantize(a_q), "b": b_qp.dequantize(b_q)}, attrs)[0]
    y_qp = random_qparams(rng, float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    node = Node("es", "Einsum", ["a", "b"], ["y"], attrs)
    op = get_op("Einsum")
    q = op.quantize(context(node, [a_qp, b_qp], [y_qp]))
    y = op.forward_int(q, [a_q, b_q], runtime())[0]

    a_c = a_q.astype(object) - int(a_qp.zero_point[0])  # Python-int einsum of the centered codes
    b_c = b_q.astype(object) - int(b_qp.zero_point[0])
    acc = np.einsum(equation, a_c, b_c).astype(np.int64)
    check_multiplier(q.stage.m, q.stage.n, a_qp.scale[0] * b_qp.scale[0] / y_qp.scale[0], q.stage.pre_shift)
    acc = apply_pre_shift(acc, q.stage, (1, 1))
    assert y.shape == y_float.shape
    np.testing.assert_array_equal(y, ref_requant(acc, q.stage.m, q.stage.n, int(y_qp.zero_point[0]), y_qp.qmin,
                                                 y_qp.qmax))
    assert lsb_error(y_qp, y, y_float) <= 1.0 + 1e-3


@pytest.mark.parametrize("equation", ["bij,bjk->bki", "ii,ij->ij", "i,i->", "...ij,...jk->...ik", "ij,jk,kl->il"])
def test_einsum_other_equations_are_refused(equation):
    qp = compute_qparams(-1, 1)
    node = Node("es", "Einsum", ["a", "b"], ["y"], {"equation": equation})
    with pytest.raises(QuantizationError, match="not a batched matrix product"):
        get_op("Einsum").quantize(context(node, [qp, qp], [qp]))


def test_einsum_rejects_a_constant_b():
    qp = compute_qparams(-1, 1)
    node = Node("es", "Einsum", ["a", "b"], ["y"], {"equation": "ij,jk->ik"})
    with pytest.raises(QuantizationError, match="two activations"):
        get_op("Einsum").quantize(context(node, [qp, qp], [qp], {1: np.ones((2, 2))}))


@covers("Einsum", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("equation, a_shape, b_shape", EINSUM_EQUATIONS)
def test_einsum_forward_float_matches_onnxruntime(equation, a_shape, b_shape):
    assert_forward_float_matches_onnxruntime("Einsum", {"equation": equation}, [a_shape, b_shape], [])
