"""Gather, GatherND (ops/gather.py): (a) the gathered codes equal a reference written here index tuple by
index tuple; (b) the dequantized output equals onnxruntime's float op on the dequantized data exactly (an
activation), or within 0.5 LSB on the float table (a constant table quantized by the rule)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from op_testing import Check, context, covers, random_codes, random_qparams, runtime
from ops import get_op
from ops.registry import QuantizationError
from ort_untyped import ort_run
from ptq.core.graph import Node

FORMATS = [(8, True), (8, False), (16, True)]


def _gather_reference(x, idx, axis):
    out_shape = x.shape[:axis] + idx.shape + x.shape[axis + 1:]
    y = np.empty(out_shape, x.dtype)
    for o in itertools.product(*(range(d) for d in out_shape)):
        i = int(idx[o[axis:axis + idx.ndim]])
        y[o] = x[o[:axis] + (i % x.shape[axis],) + o[axis + idx.ndim:]]
    return y


def _gather_nd_reference(x, idx, b):
    r = idx.shape[-1]
    out_shape = idx.shape[:-1] + x.shape[b + r:]
    y = np.empty(out_shape, x.dtype)
    for o in itertools.product(*(range(d) for d in out_shape)):
        tup = idx[o[:idx.ndim - 1]]
        where = tuple(int(t) % d for t, d in zip(tup, x.shape[b:b + r]))
        y[o] = x[o[:b] + where + o[idx.ndim - 1:]]
    return y


@covers("Gather", check=Check.INT_REFERENCE)
@covers("Gather", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("axis,idx_shape", [(0, (4,)), (1, (2, 3)), (-1, ()), (2, (3, 1))])
def test_gather_moves_activation_codes(axis, idx_shape):
    rng = np.random.default_rng(axis + 7)
    shape = (3, 4, 5)
    node = Node("g", "Gather", ["x", "i"], ["y"], {"axis": axis})
    dim = shape[axis]
    idx = rng.integers(-dim, dim, size=idx_shape).astype(np.int64)
    for bits, signed in FORMATS:
        x_qp = random_qparams(rng, -1.5, 2.0, bits, signed=signed)
        x = random_codes(rng, x_qp, shape)
        q = get_op("Gather").quantize(context(node, [x_qp, None], [random_qparams(rng, -1, 1, bits)]))
        assert q.out_qparams == [x_qp]
        y = get_op("Gather").forward_int(q, [x, idx], runtime())[0]
        np.testing.assert_array_equal(y, _gather_reference(x, idx, axis % 3))
        want = ort_run("Gather", {"x": x_qp.dequantize(x)}, {"axis": axis}, {"i": idx})[0]
        np.testing.assert_array_equal(x_qp.dequantize(y), want)


@covers("Gather", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("with_entry", [False, True])
def test_gather_quantizes_a_constant_embedding_table(with_entry):
    rng = np.random.default_rng(3 + with_entry)
    table = rng.normal(0, 0.7, (10, 6)).astype(np.float32)
    idx = rng.integers(0, 10, (2, 5)).astype(np.int64)
    node = Node("embed", "Gather", ["table", "ids"], ["y"], {"axis": 0})
    entry = random_qparams(rng, -3.0, 3.0, 8, symmetric=True) if with_entry else None
    q = get_op("Gather").quantize(context(node, [entry, None], [None], {0: table}))
    qp = q.out_qparams[0]
    if with_entry:
        assert qp == entry
    else:  # the table's own range, asymmetric over [min, max], 8 bits
        assert qp.bits == 8 and not qp.per_channel
        lo, hi = qp.real_range()  # covers [min, max] up to the zero point's rounding
        assert lo[0] <= table.min() + qp.scale[0] / 2 and table.max() - qp.scale[0] / 2 <= hi[0]
        assert np.isclose(float(qp.scale[0]), (table.max() - table.min()) / 255, rtol=1e-6)
    y = get_op("Gather").forward_int(q, [table, idx], runtime())[0]
    codes = np.clip(np.rint(table.astype(np.float64) / qp.scale[0]) + qp.zero_point[0], qp.qmin, qp.qmax)
    np.testing.assert_array_equal(y, codes[idx])
    want = ort_run("Gather", {}, {"axis": 0}, {"table": table, "ids": idx})[0]
    lo, hi = qp.real_range()
    err = np.abs(qp.dequantize(y).astype(np.float64) - np.clip(want, lo[0], hi[0])) / qp.scale[0]
    assert err.max() <= 0.5 + 1e-6


def test_gather_index_out_of_range_is_named():
    qp = random_qparams(np.random.default_rng(0), -1, 1, 8)
    node = Node("g", "Gather", ["x", "i"], ["y"], {"axis": 1})
    q = get_op("Gather").quantize(context(node, [qp, None], [None]))
    with pytest.raises(ValueError, match="indices"):
        get_op("Gather").forward_int(q, [np.zeros((2, 3), np.int8), np.array([3])], runtime())


@covers("GatherND", check=Check.INT_REFERENCE)
@covers("GatherND", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("x_shape,idx_shape,batch_dims", [
    ((4, 5, 3), (6, 2), 0),
    ((4, 5, 3), (2, 3, 1), 0),
    ((2, 5, 3, 2), (2, 4, 2), 1),
    ((3, 4), (3, 2), 0),
])
def test_gather_nd(x_shape, idx_shape, batch_dims):
    rng = np.random.default_rng(len(idx_shape) + batch_dims)
    r = idx_shape[-1]
    dims = x_shape[batch_dims:batch_dims + r]
    idx = np.stack([rng.integers(-d, d, size=idx_shape[:-1]) for d in dims], axis=-1).astype(np.int64)
    node = Node("g", "GatherND", ["x", "i"], ["y"], {"batch_dims": batch_dims})
    for bits, signed in FORMATS:
        x_qp = random_qparams(rng, -1.0, 1.0, bits, signed=signed)
        x = random_codes(rng, x_qp, x_shape)
        q = get_op("GatherND").quantize(context(node, [x_qp, None], [None]))
        y = get_op("GatherND").forward_int(q, [x, idx], runtime())[0]
        np.testing.assert_array_equal(y, _gather_nd_reference(x, idx, batch_dims))
        if batch_dims == 0 or np.all(idx >= 0):
            want = ort_run("GatherND", {"x": x_qp.dequantize(x)}, {"batch_dims": batch_dims}, {"i": idx})[0]
        else:  # onnxruntime rejects negative indices with batch_dims > 0; compare on the wrapped ones
            wrapped = np.where(idx < 0, idx + np.array(dims), idx)
            want = ort_run("GatherND", {"x": x_qp.dequantize(x)}, {"batch_dims": batch_dims}, {"i": wrapped})[0]
        np.testing.assert_array_equal(x_qp.dequantize(y), want)


def test_per_channel_data_is_refused():
    qp = random_qparams(np.random.default_rng(0), np.full(3, -1.0), np.full(3, 1.0), 8, axis=0)
    node = Node("g", "GatherND", ["x", "i"], ["y"])
    with pytest.raises(QuantizationError, match="per tensor"):
        get_op("GatherND").quantize(context(node, [qp, None], [None]))


@covers("UpsampleByIndex", check=Check.INT_REFERENCE, domain="ai.ptq")
@covers("UpsampleByIndex", check=Check.ONNXRUNTIME, domain="ai.ptq")
@pytest.mark.parametrize("with_shape", [False, True])
def test_upsample_by_index_scatters_codes_like_max_unpool(with_shape):
    """The indices of a MaxPool (no overlap: no index twice) scatter the pooled codes back; the rest is zp_x.
    onnxruntime's MaxUnpool is the float twin of the ai.ptq op."""
    rng = np.random.default_rng(with_shape)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    for bits, signed in FORMATS:
        x_qp = random_qparams(rng, -1.0, 1.0, bits, signed=signed)
        feature = random_codes(rng, x_qp, (2, 3, 6, 8))
        pool = Node("mp", "MaxPool", ["f"], ["x", "i"], attrs)
        x, idx = get_op("MaxPool").forward_int(get_op("MaxPool").quantize(context(pool, [x_qp], [None, None])),
                                               [feature], runtime())
        consts = {"i": idx}
        if with_shape:
            consts["shape"] = np.array([2, 3, 7, 9], np.int64)
        node = Node("up", "UpsampleByIndex", ["x"] + list(consts), ["y"], attrs, domain="ai.ptq")
        op = get_op("UpsampleByIndex", "ai.ptq")
        q = op.quantize(context(node, [x_qp] + [None] * len(consts), [None]))
        assert q.out_qparams == [x_qp]
        y = op.forward_int(q, [x] + list(consts.values()), runtime())[0]
        out_shape = (2, 3, 7, 9) if with_shape else (2, 3, 6, 8)
        ref = np.full(int(np.prod(out_shape)), x_qp.zero_point[0], np.int64)
        for value, flat in zip(x.ravel().tolist(), idx.ravel().tolist()):
            ref[flat] = value
        np.testing.assert_array_equal(y, ref.reshape(out_shape))
        want = ort_run("MaxUnpool", {"x": x_qp.dequantize(x)}, attrs, consts)[0]
        np.testing.assert_array_equal(x_qp.dequantize(y), want)
        np.testing.assert_array_equal(op.forward_float(node, [x_qp.dequantize(x)] + list(consts.values()))[0], want)
