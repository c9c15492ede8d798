"""Data movement (ops/movement.py): (a) forward_int equals a reference written here element by element, from
the index formula of each op (y[out] = x[source(out)], or zp_x where the op creates a zero); (b) the ONNX ops'
dequantized output equals onnxruntime's float output on the dequantized input exactly (LSB bound 0), and
every output keeps the input's qparams whatever the table proposes."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from op_testing import Check, context, covers, ort_single, random_codes, random_qparams, runtime
from ops import get_op
from ops.registry import check_quantized
from ptq.core.graph import Node

FORMATS = [(8, True), (8, False), (16, True)]
PTQ = "ai.ptq"


def _by_index(x: np.ndarray, out_shape, source, fill) -> np.ndarray:
    """y[o] = x[source(o)] for every output index o (source None: `fill`), one element at a time."""
    y = np.empty(out_shape, dtype=x.dtype)
    for o in itertools.product(*(range(d) for d in out_shape)):
        s = source(o)
        y[o] = fill if s is None else x[s]
    return y


def _run(op_type, x_shape, attrs, consts, source, out_shape, domain="", seed=0, ort=True):
    """Quantize and run one node in every format: codes == the element reference; with `ort`, the dequantized
    output == onnxruntime's float output; the float forward == the element reference on floats."""
    rng = np.random.default_rng(seed)
    op = get_op(op_type, domain)
    node = Node(op_type.lower(), op_type, ["x"] + list(consts), ["y"], attrs, domain=domain)
    raw = list(consts.values())
    for bits, signed in FORMATS:
        x_qp = random_qparams(rng, -rng.uniform(0.1, 2), rng.uniform(0.1, 2), bits, signed=signed)
        x = random_codes(rng, x_qp, x_shape)
        x_f = x_qp.dequantize(x)
        q = op.quantize(context(node, [x_qp] + [None] * len(raw), [random_qparams(rng, -1.0, 1.0, bits)],
                                {i + 1: v for i, v in enumerate(raw)}))
        assert q.out_qparams == [x_qp]
        y = op.forward_int(q, [x] + raw, runtime())[0]
        assert y.dtype == x.dtype
        np.testing.assert_array_equal(y, _by_index(x, out_shape, source, x_qp.zero_point[0]))
        y_f = op.forward_float(node, [x_f] + raw)[0]
        np.testing.assert_array_equal(y_f, _by_index(x_f, out_shape, source, 0.0))
        if ort:
            want = ort_single(op_type, {"x": x_f}, attrs, constants=consts)[0]
            np.testing.assert_array_equal(x_qp.dequantize(y), want)
            np.testing.assert_array_equal(y_f, want)


@covers("DepthToSpace", check=Check.INT_REFERENCE)
@covers("DepthToSpace", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(mode):
    b, c = 2, 3

    def source(o):
        n, k, hh, ww = o
        i, j = hh % b, ww % b
        channel = (i * b + j) * c + k if mode == "DCR" else k * b * b + i * b + j
        return n, channel, hh // b, ww // b

    _run("DepthToSpace", (2, c * b * b, 3, 4), {"blocksize": b, "mode": mode}, {}, source, (2, c, 6, 8))


@covers("SpaceToDepth", check=Check.INT_REFERENCE)
@covers("SpaceToDepth", check=Check.ONNXRUNTIME)
def test_space_to_depth():
    b, c = 2, 3

    def source(o):
        n, k, hh, ww = o
        i, j, ch = k // (b * c), (k // c) % b, k % c
        return n, ch, hh * b + i, ww * b + j

    _run("SpaceToDepth", (2, c, 4, 6), {"blocksize": b}, {}, source, (2, c * b * b, 2, 3))


@covers("Tile", check=Check.INT_REFERENCE)
@covers("Tile", check=Check.ONNXRUNTIME)
def test_tile():
    shape, reps = (2, 3, 2), np.array([2, 1, 3], np.int64)
    _run("Tile", shape, {}, {"repeats": reps}, lambda o: tuple(v % d for v, d in zip(o, shape)), (4, 3, 6))


@covers("Expand", check=Check.INT_REFERENCE)
@covers("Expand", check=Check.ONNXRUNTIME)
def test_expand():
    target = np.array([2, 1, 3, 4], np.int64)
    # x (3, 1) against (2, 1, 3, 4): output (2, 1, 3, 4), x[k, 0] at [., ., k, .]
    _run("Expand", (3, 1), {}, {"shape": target}, lambda o: (o[2], 0), (2, 1, 3, 4))


@covers("ReverseSequence", check=Check.INT_REFERENCE)
@covers("ReverseSequence", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("batch_axis,time_axis", [(1, 0), (0, 1)])
def test_reverse_sequence(batch_axis, time_axis):
    lens = np.array([4, 1, 0, 3], np.int64)
    shape = [0, 0, 2]
    shape[batch_axis], shape[time_axis] = 4, 5

    def source(o):
        b, t = o[batch_axis], o[time_axis]
        s = list(o)
        s[time_axis] = lens[b] - 1 - t if t < lens[b] else t
        return tuple(s)

    _run("ReverseSequence", tuple(shape), {"batch_axis": batch_axis, "time_axis": time_axis},
         {"lens": lens}, source, tuple(shape))


@covers("BatchToSpace", check=Check.INT_REFERENCE, domain="ai.ptq")
def test_batch_to_space():
    bh, bw, n, c, h, w = 2, 3, 2, 2, 3, 2
    crops = [1, 0, 2, 1]

    def source(o):
        nn, cc, hh, ww = o
        hh, ww = hh + crops[0], ww + crops[2]
        return ((hh % bh) * bw + ww % bw) * n + nn, cc, hh // bh, ww // bw

    _run("BatchToSpace", (bh * bw * n, c, h, w), {"block_size": [bh, bw], "crops": crops}, {}, source,
         (n, c, h * bh - 1, w * bw - 3), domain=PTQ, ort=False)


@covers("SpaceToBatch", check=Check.INT_REFERENCE, domain="ai.ptq")
def test_space_to_batch_pads_with_the_code_of_zero():
    bh, bw, n, c, h, w = 2, 2, 2, 3, 3, 4
    pads = [1, 0, 1, 1]  # padded 4 x 6

    def source(o):
        b, cc, hh, ww = o
        i, j, nn = b // (bw * n), (b // n) % bw, b % n
        ph, pw = hh * bh + i - pads[0], ww * bw + j - pads[2]
        return (nn, cc, ph, pw) if 0 <= ph < h and 0 <= pw < w else None

    _run("SpaceToBatch", (n, c, h, w), {"block_size": [bh, bw], "pads": pads}, {}, source, (bh * bw * n, c, 2, 3),
         domain=PTQ, ort=False)


def test_space_to_batch_then_batch_to_space_is_the_identity():
    x = np.arange(2 * 3 * 5 * 4, dtype=np.int8).reshape(2, 3, 5, 4)
    attrs = {"block_size": [2, 3], "pads": [1, 0, 1, 1]}
    s2b = get_op("SpaceToBatch", PTQ).apply(Node("s", "SpaceToBatch", ["x"], ["y"], attrs, PTQ), x, [x], np.int8(0))
    back = Node("b", "BatchToSpace", ["y"], ["z"], {"block_size": [2, 3], "crops": [1, 0, 1, 1]}, PTQ)
    np.testing.assert_array_equal(get_op("BatchToSpace", PTQ).apply(back, s2b, [s2b], np.int8(0)), x)


@covers("BatchToDepth", check=Check.INT_REFERENCE, domain="ai.ptq")
def test_batch_to_depth():
    b, c = 3, 2
    _run("BatchToDepth", (2 * b, c, 2, 3), {"block_size": b}, {},
         lambda o: (o[0] * b + o[1] // c, o[1] % c, o[2], o[3]), (2, b * c, 2, 3), domain=PTQ, ort=False)


@covers("DataStride", check=Check.INT_REFERENCE, domain="ai.ptq")
def test_data_stride():
    k, s = (2, 3), (3, 2)  # H: 8 -> windows at 0, 3, 6 (3 x 2); W: 7 -> windows at 0, 2, 4 (3 x 3)

    def source(o):
        n, c, hh, ww = o
        return n, c, (hh // k[0]) * s[0] + hh % k[0], (ww // k[1]) * s[1] + ww % k[1]

    _run("DataStride", (1, 2, 8, 7), {"kernel_shape": list(k), "strides": list(s)}, {}, source, (1, 2, 6, 9),
         domain=PTQ, ort=False)


@covers("Repeat", check=Check.INT_REFERENCE, domain="ai.ptq")
def test_repeat_along_an_axis():
    reps = np.array([2, 0, 3], np.int64)
    starts = np.repeat(np.arange(3), reps)  # output row r comes from input row starts[r]
    _run("Repeat", (2, 3), {"axis": 1}, {"repeats": reps}, lambda o: (o[0], starts[o[1]]), (2, 5), domain=PTQ,
         ort=False)


def test_repeat_without_axis_flattens():
    _run("Repeat", (2, 2), {}, {"repeats": np.array([2], np.int64)}, lambda o: divmod(o[0] // 2, 2), (8,),
         domain=PTQ, ort=False)


@pytest.mark.parametrize("op_type,domain,attrs,consts,match", [
    ("DepthToSpace", "", {"blocksize": 2}, {}, "not divisible"),
    ("Tile", "", {}, {"repeats": np.array([1, 2], np.int64)}, "repeats"),
    ("Repeat", PTQ, {"axis": 0}, {"repeats": np.array([1.0, 2.0], np.float32)}, "must be integers"),
    ("BatchToSpace", PTQ, {"block_size": 2}, {}, "not divisible"),
    ("ReverseSequence", "", {}, {"lens": np.array([9, 1, 1], np.int64)}, "sequence_lens"),
])
def test_bad_attributes_and_inputs_are_named(op_type, domain, attrs, consts, match):
    x = np.zeros((3, 3, 3, 3), np.int8)
    node = Node("n", op_type, ["x"] + list(consts), ["y"], attrs, domain)
    with pytest.raises(ValueError, match=match):
        get_op(op_type, domain).apply(node, x, [x] + list(consts.values()), np.int8(0))


def floats_count(op, node, qps, xs, flags):
    return int(op.forward_float(node, [qp.dequantize(x) for qp, x in zip(qps, xs)] + [flags.astype(np.float32)])[-1])


@covers("Filter", check=Check.INT_REFERENCE, domain="ai.ptq")
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("quantized_selector", [False, True])
def test_filter_packs_selected_slices_and_counts(axis, quantized_selector):
    rng = np.random.default_rng(axis + 2 * quantized_selector)
    op = get_op("Filter", PTQ)
    shapes = [(5, 4, 2), (5, 4)]
    qps = [random_qparams(rng, -1.0, 2.0, 8, signed=s) for s in (True, False)]
    xs = [random_codes(rng, qp, shape) for qp, shape in zip(qps, shapes)]
    flags = np.array([1, 0, 1, 1, 0] if axis == 0 else [0, 1, 0, 1])
    if quantized_selector:
        s_qp = random_qparams(rng, 0.0, 1.0, 8, signed=False, symmetric=False)
        selector, sel_qp = s_qp.quantize(flags.astype(np.float32)), s_qp
    else:
        selector, sel_qp = flags.astype(np.int64), None
    node = Node("f", "Filter", ["a", "b", "s"], ["ya", "yb", "count"], {"axis": axis}, PTQ)
    q = op.quantize(context(node, qps + [sel_qp], [None] * 3))
    check_quantized(q)
    assert q.out_qparams == qps + [None]
    ya, yb, count = op.forward_int(q, xs + [selector], runtime())
    chosen = [i for i, f in enumerate(flags) if f]
    assert count == len(chosen) == floats_count(op, node, qps, xs, flags) and count.dtype == np.int64
    floats = op.forward_float(node, [qps[0].dequantize(xs[0]), qps[1].dequantize(xs[1]), flags.astype(np.float32)])
    for x, y, qp, y_f in ((xs[0], ya, qps[0], floats[0]), (xs[1], yb, qps[1], floats[1])):
        def source(o, x=x):
            if o[axis] >= len(chosen):
                return None
            s = list(o)
            s[axis] = chosen[o[axis]]
            return tuple(s)
        np.testing.assert_array_equal(y, _by_index(x, x.shape, source, qp.zero_point[0]))
        np.testing.assert_array_equal(y_f, _by_index(qp.dequantize(x), x.shape, source, 0.0))


@pytest.mark.parametrize("op_type,consts", [
    ("Tile", [np.array([2], np.int64)]),
    ("Expand", [np.array([2, 3], np.int64)]),
    ("Reshape", [np.array([3, 1], np.int64)]),
])
def test_float_forwards_keep_index_tensors_exact(op_type, consts):
    """A shape subgraph moves int64 indices through these ops at run time: no float32 round trip."""
    big = np.array([2 ** 40 + 1, -7, 2 ** 53 + 3], np.int64)
    node = Node("n", op_type, ["x", "c"], ["y"])
    y = get_op(op_type).forward_float(node, [big] + consts)[0]
    assert y.dtype == np.int64
    assert set(y.ravel().tolist()) == set(big.tolist())
