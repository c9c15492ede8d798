"""ArgMax, ArgMin, TopK, OneHot (ops/selection.py): (a) the integer forward equals a reference written here
with Python loops over the codes; (b) the same indices (and values, dequantized) as onnxruntime's float op
on the dequantized input, exactly; OneHot within 0.5 LSB of onnxruntime's float on/off values."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from op_testing import Check, context, covers, lsb_error, random_codes, random_qparams, runtime
from ops import get_op
from ops.registry import QuantizationError, check_quantized
from ort_untyped import ort_run
from ptq.core.graph import Node

FORMATS = [(8, True), (8, False), (16, True)]


def _lines(shape, axis):
    """Every index tuple of `shape` with `axis` left out, and a function putting position t back in."""
    rest = [range(d) for i, d in enumerate(shape) if i != axis]
    for r in itertools.product(*rest):
        yield r, (lambda t, r=r: r[:axis] + (t,) + r[axis:])


def _arg_reference(x, axis, largest, last, keepdims):
    out = np.empty([d for i, d in enumerate(x.shape) if i != axis], np.int64)
    for r, at in _lines(x.shape, axis):
        best = None
        for t in range(x.shape[axis]):
            v = int(x[at(t)])
            better = best is None or (v > best[0] if largest else v < best[0]) or (last and v == best[0])
            if better:
                best = (v, t)
        out[r] = best[1]
    return np.expand_dims(out, axis) if keepdims else out


@covers("ArgMax", "ArgMin", check=Check.INT_REFERENCE)
@covers("ArgMax", "ArgMin", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis,keepdims,last", [(0, 1, 0), (1, 0, 1), (-1, 1, 1), (2, 0, 0)])
def test_arg_extreme_on_codes(op_type, axis, keepdims, last):
    rng = np.random.default_rng(axis + 3 * keepdims + 5 * last)
    attrs = {"axis": axis, "keepdims": keepdims, "select_last_index": last}
    node = Node("a", op_type, ["x"], ["y"], attrs)
    op = get_op(op_type)
    for bits, signed in FORMATS:
        x_qp = random_qparams(rng, -1.0, 1.0, bits, signed=signed)
        x = random_codes(rng, x_qp, (3, 5, 4))
        x[0, :2] = x[0, 2]  # ties
        q = op.quantize(context(node, [x_qp], [None]))
        check_quantized(q)
        assert q.out_qparams == [None]
        y = op.forward_int(q, [x], runtime())[0]
        assert y.dtype == np.int64
        np.testing.assert_array_equal(y, _arg_reference(x, axis % 3, op_type == "ArgMax", last, keepdims))
        np.testing.assert_array_equal(y, ort_run(op_type, {"x": x_qp.dequantize(x)}, attrs)[0])


def _topk_reference(x, k, axis, largest):
    values = np.empty(x.shape[:axis] + (k,) + x.shape[axis + 1:], x.dtype)
    index = np.empty(values.shape, np.int64)
    for r, at in _lines(x.shape, axis):
        line = [(int(x[at(t)]), t) for t in range(x.shape[axis])]
        line.sort(key=lambda vt: (-vt[0] if largest else vt[0], vt[1]))
        for j, (v, t) in enumerate(line[:k]):
            values[at(j)], index[at(j)] = v, t
    return values, index


@covers("TopK", check=Check.INT_REFERENCE)
@covers("TopK", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("axis,k,largest", [(-1, 3, 1), (0, 2, 0), (1, 5, 1), (1, 0, 1)])
def test_topk_on_codes(axis, k, largest):
    rng = np.random.default_rng(k + 11 * largest)
    attrs = {"axis": axis, "largest": largest, "sorted": 1}
    node = Node("t", "TopK", ["x", "k"], ["v", "i"], attrs)
    kk = np.array([k], np.int64)
    for bits, signed in FORMATS:
        x_qp = random_qparams(rng, -2.0, 1.0, bits, signed=signed)
        x = random_codes(rng, x_qp, (4, 5, 6))
        x[1, 1] = x[1, 0]  # ties, listed by increasing index
        q = get_op("TopK").quantize(context(node, [x_qp, None], [random_qparams(rng, -1, 1, bits), None], {1: kk}))
        check_quantized(q)
        assert q.out_qparams == [x_qp, None]
        values, index = get_op("TopK").forward_int(q, [x, kk], runtime())
        ref_v, ref_i = _topk_reference(x, k, axis % 3, largest)
        np.testing.assert_array_equal(values, ref_v)
        np.testing.assert_array_equal(index, ref_i)
        want_v, want_i = ort_run("TopK", {"x": x_qp.dequantize(x)}, attrs, {"k": kk}, outputs=2)
        np.testing.assert_array_equal(x_qp.dequantize(values), want_v)
        np.testing.assert_array_equal(index, want_i)


def test_an_index_output_with_qparams_is_refused():
    qp = random_qparams(np.random.default_rng(0), -1, 1, 8)
    q = get_op("ArgMax").quantize(context(Node("a", "ArgMax", ["x"], ["y"]), [qp], [None]))
    q.out_qparams = [qp]
    with pytest.raises(QuantizationError, match="index output"):
        check_quantized(q)


def _one_hot_reference(idx, depth, axis, off, on):
    out_shape = idx.shape[:axis] + (depth,) + idx.shape[axis:]
    y = np.empty(out_shape, np.int64)
    for o in itertools.product(*(range(d) for d in out_shape)):
        i = int(idx[o[:axis] + o[axis + 1:]])
        y[o] = on if (i if i >= 0 else i + depth) == o[axis] else off
    return y


@covers("OneHot", check=Check.INT_REFERENCE)
@covers("OneHot", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("axis,values", [(-1, [0.0, 1.0]), (0, [-0.3, 2.7]), (1, [1.25, -0.5])])
def test_one_hot_quantizes_off_and_on_with_the_output_qparams(axis, values):
    rng = np.random.default_rng(axis + 2)
    depth = 5
    idx = rng.integers(-depth - 1, depth + 1, (3, 4)).astype(np.int64)  # some outside [-depth, depth)
    values = np.array(values, np.float32)
    node = Node("o", "OneHot", ["i", "d", "v"], ["y"], {"axis": axis})
    consts = {"i": idx, "d": np.array(depth, np.int64), "v": values}
    want = ort_run("OneHot", {}, {"axis": axis}, consts)[0]
    for proposal in (None, random_qparams(rng, float(values.min()), float(values.max()), 8, symmetric=False)):
        q = get_op("OneHot").quantize(context(node, [None, None, None], [proposal], {1: consts["d"], 2: values}))
        y_qp = q.out_qparams[0]
        if proposal is not None:
            assert y_qp == proposal
        off_q, on_q = (int(np.clip(np.rint(v / y_qp.scale[0]) + y_qp.zero_point[0], y_qp.qmin, y_qp.qmax))
                       for v in values.astype(np.float64))
        y = get_op("OneHot").forward_int(q, [idx, consts["d"], values], runtime())[0]
        assert y.dtype == y_qp.dtype
        np.testing.assert_array_equal(y, _one_hot_reference(idx, depth, axis % 3, off_q, on_q))
        assert lsb_error(y_qp, y, want) <= 0.5 + 1e-6


def test_one_hot_selects_run_time_value_codes():
    qp = random_qparams(np.random.default_rng(1), -1.0, 1.0, 8)
    node = Node("o", "OneHot", ["i", "d", "v"], ["y"])
    q = get_op("OneHot").quantize(context(node, [None, None, qp], [None], {1: np.array(3)}))
    assert q.out_qparams == [qp]
    y = get_op("OneHot").forward_int(q, [np.array([2, 0]), np.array(3), np.array([-5, 9], np.int8)], runtime())[0]
    np.testing.assert_array_equal(y, [[-5, -5, 9], [9, -5, -5]])


def test_one_hot_index_codes_need_scale_one():
    rng = np.random.default_rng(2)
    node = Node("o", "OneHot", ["i", "d", "v"], ["y"])
    idx_qp = random_qparams(rng, 0.0, 10.0, 8)
    with pytest.raises(QuantizationError, match="scale 1"):
        get_op("OneHot").quantize(context(node, [idx_qp, None, None], [None], {2: np.array([0.0, 1.0])}))
    with pytest.raises(ValueError, match="must hold integers"):
        get_op("OneHot").forward_float(node, [np.array([1.5]), np.array(3), np.array([0.0, 1.0])])


def test_index_outputs_run_in_integers_end_to_end():
    """ArgMax (index output only), TopK (values + indices) and a Gather by TopK's indices run as integer steps;
    the indices equal those of the integer graph's own codes, the values its gathered codes."""
    from onnx import TensorProto, helper, numpy_helper

    from ptq.engine.executor import NodeKind, prepare
    from ptq.calibration.pipeline import calibrate
    from tiny_models import make_model

    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.4, (4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("ArgMax", ["c"], ["am"], axis=1, keepdims=0, name="argmax"),
             helper.make_node("TopK", ["c", "k"], ["tv", "ti"], axis=3, name="topk"),
             helper.make_node("Reshape", ["ti", "minus1"], ["flat_ti"], name="flat"),
             helper.make_node("Gather", ["c", "flat_ti"], ["g"], axis=3, name="gather")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                       [helper.make_tensor_value_info("am", TensorProto.INT64, [1, 6, 6]),
                        helper.make_tensor_value_info("tv", TensorProto.FLOAT, [1, 4, 6, 2]),
                        helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, 4, 6, 48])],
                       [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([2], np.int64), "k"),
                        numpy_helper.from_array(np.array([-1], np.int64), "minus1")])
    x = rng.normal(0, 1, (8, 1, 3, 6, 6)).astype(np.float32)
    result = calibrate(model, x[:, 0], write_qdq=False)
    graph = prepare(result.graph, result.table)
    kinds = {s.node.name: s.kind for s in graph.steps}
    assert kinds["argmax"] is kinds["topk"] is kinds["gather"] is NodeKind.INTEGER
    out = graph.run({"x": x[0]})
    c = out.tensors["c"].astype(np.int64)
    np.testing.assert_array_equal(out.outputs["am"], np.argmax(c, axis=1))
    ti = np.argsort(-c, axis=3, kind="stable")[..., :2]
    np.testing.assert_array_equal(out.tensors["ti"], ti)
    np.testing.assert_array_equal(out.tensors["tv"], np.take_along_axis(c, ti, axis=3))
    np.testing.assert_array_equal(out.tensors["g"], np.take(c, ti.ravel(), axis=3))
    assert out.qparams["tv"] == out.qparams["c"] and "ti" not in out.qparams and "am" not in out.qparams


@covers("InTopK", check=Check.INT_REFERENCE, domain="ai.ptq")
@pytest.mark.parametrize("k", [1, 3, 6])
def test_in_top_k(k):
    rng = np.random.default_rng(k)
    node = Node("t", "InTopK", ["p", "t"], ["y"], {"k": k}, domain="ai.ptq")
    op = get_op("InTopK", "ai.ptq")
    for bits, signed in FORMATS:
        qp = random_qparams(rng, -1.0, 1.0, bits, signed=signed)
        p = random_codes(rng, qp, (7, 6))
        p[0, :4] = p[0, 4]  # the target tied with several classes
        targets = rng.integers(0, 6, 7)
        targets[0] = 4
        q = op.quantize(context(node, [qp, None], [None]))
        check_quantized(q)
        y = op.forward_int(q, [p, targets], runtime())[0]
        ref = [sum(int(v) > int(row[t]) for v in row) < k for row, t in zip(p, targets)]
        assert y.dtype == bool
        np.testing.assert_array_equal(y, ref)
        # the float op, a numpy formula of TensorFlow's in_top_k, gives the same on the dequantized predictions
        f = qp.dequantize(p)
        np.testing.assert_array_equal(op.forward_float(node, [f, targets])[0],
                                      (f > f[np.arange(7), targets][:, None]).sum(axis=1) < k)
        np.testing.assert_array_equal(op.forward_float(node, [f, targets])[0], y)


@covers("CTCGreedyDecoder", check=Check.INT_REFERENCE, domain="ai.ptq")
@pytest.mark.parametrize("merge", [1, 0])
def test_ctc_greedy_decoder(merge):
    rng = np.random.default_rng(merge)
    node = Node("ctc", "CTCGreedyDecoder", ["x", "len"], ["y"], {"merge_repeated": merge}, domain="ai.ptq")
    op = get_op("CTCGreedyDecoder", "ai.ptq")
    lengths = np.array([9, 5, 0], np.int64)
    for bits, signed in FORMATS:
        qp = random_qparams(rng, -3.0, 3.0, bits, signed=signed)
        x = random_codes(rng, qp, (3, 9, 4))
        x[0, 2:5, 1] = qp.qmax  # a repeated class
        x[0, 6, 3] = qp.qmax  # a blank between two equal classes
        x[0, 5, 1] = x[0, 7, 1] = qp.qmax
        q = op.quantize(context(node, [qp, None], [None]))
        y = op.forward_int(q, [x, lengths], runtime())[0]
        want = np.full((3, 9), -1, np.int64)
        for b in range(3):
            decoded, previous = [], None
            for t in range(int(lengths[b])):
                row = [int(v) for v in x[b, t]]
                c = row.index(max(row))
                if c != 3 and not (merge and c == previous):
                    decoded.append(c)
                previous = c
            want[b, :len(decoded)] = decoded
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(op.forward_float(node, [qp.dequantize(x), lengths])[0], want)
