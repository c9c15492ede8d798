"""ops/layout.py: Identity, Dropout, Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Split, Slice.

(a) forward_int equals a numpy reference on the codes written here; (b) the dequantized output equals
onnxruntime's float output on the dequantized input exactly (LSB bound 0), forward_float equals onnxruntime,
and the output qparams are the input's whatever the table proposes.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import FORMATS, Check, context, covers, ort_single, random_codes, random_qparams, runtime
from ops import get_op
from ptq.core.graph import Node


I64 = np.int64


def _check_layout(op_type, shape, attrs, consts, reference, opset=17, outputs=1, seed=0):
    """Run one layout node in every format: ORT float == dequantized integer output, codes == reference."""
    rng = np.random.default_rng(seed)
    op = get_op(op_type)
    out_names = [f"y{i}" for i in range(outputs)]
    node = Node(op_type.lower(), op_type, ["x"] + list(consts), out_names, attrs)
    raw = list(consts.values())
    for bits, signed in FORMATS:
        x_qp = random_qparams(rng, -rng.uniform(0.1, 2), rng.uniform(0.1, 2), bits, signed=signed)
        x = random_codes(rng, x_qp, shape)
        x_f = x_qp.dequantize(x)
        y_ort = ort_single(op_type, {"x": x_f}, attrs, constants=consts, opset=opset, outputs=outputs)
        for got, want in zip(op.forward_float(node, [x_f] + raw), y_ort):
            np.testing.assert_array_equal(got, want)
        proposal = random_qparams(rng, -1.0, 1.0, bits, signed=signed)
        q = op.quantize(context(node, [x_qp] + [None] * len(raw), [proposal] * outputs,
                                {i + 1: v for i, v in enumerate(raw)}))
        assert all(qp == x_qp for qp in q.out_qparams)
        ys = op.forward_int(q, [x] + raw, runtime())
        refs = reference(x)
        assert len(ys) == len(refs) == outputs
        for y, ref, want in zip(ys, refs, y_ort):
            assert y.dtype == x.dtype
            np.testing.assert_array_equal(y, ref)
            np.testing.assert_array_equal(x_qp.dequantize(y), want)


@covers("Dropout", check=Check.INT_REFERENCE)
@covers("Dropout", check=Check.ONNXRUNTIME)
def test_dropout_at_inference_passes_codes_and_reports_no_row():
    """Inference Dropout is the identity on codes (ORT agrees); its mask output is all True, without qparams;
    it is a no-op, so reports name the layer it feeds, not it."""
    _check_layout("Dropout", (2, 3), {}, {}, lambda x: [x])
    node = Node("drop", "Dropout", ["x"], ["y", "mask"])
    qp = random_qparams(np.random.default_rng(1), -1.0, 1.0)
    q = get_op("Dropout").quantize(context(node, [qp], [qp, None]))
    assert q.out_qparams == [qp, None] and get_op("Dropout").index_outputs(node) == frozenset({1})
    x = random_codes(np.random.default_rng(2), qp, (2, 3))
    y, mask = get_op("Dropout").forward_int(q, [x], runtime())
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == bool and mask.all()
    assert get_op("Dropout").is_noop(node) and get_op("Identity").is_noop(node) and not get_op("Relu").is_noop(node)


@covers("Identity", check=Check.INT_REFERENCE)
@covers("Identity", check=Check.ONNXRUNTIME)
def test_identity():
    _check_layout("Identity", (2, 3), {}, {}, lambda x: [x])


@covers("Reshape", check=Check.INT_REFERENCE)
@covers("Reshape", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("target,allowzero,expected", [
    ([0, -1], 0, (2, 12)),
    ([4, 0, 2, -1], 0, (4, 3, 2, 1)),
    ([-1], 0, (24,)),
    ([2, 3, 4], 1, (2, 3, 4)),
])
def test_reshape(target, allowzero, expected):
    consts = {"shape": np.array(target, dtype=I64)}
    _check_layout("Reshape", (2, 3, 4), {"allowzero": allowzero}, consts,
                  lambda x: [x.ravel().reshape(expected)], opset=14)


@covers("Flatten", check=Check.INT_REFERENCE)
@covers("Flatten", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("axis,expected", [(0, (1, 24)), (1, (2, 12)), (-1, (6, 4)), (3, (24, 1))])
def test_flatten(axis, expected):
    _check_layout("Flatten", (2, 3, 4), {"axis": axis}, {}, lambda x: [x.ravel().reshape(expected)])


@covers("Squeeze", "Unsqueeze", check=Check.INT_REFERENCE)
@covers("Squeeze", "Unsqueeze", check=Check.ONNXRUNTIME)
def test_squeeze_and_unsqueeze_both_opsets():
    _check_layout("Squeeze", (1, 3, 1, 2), {}, {"axes": np.array([0, -2], dtype=I64)},
                  lambda x: [x[0, :, 0, :]], opset=13)
    _check_layout("Squeeze", (1, 3, 1, 2), {"axes": [2]}, {}, lambda x: [x[:, :, 0, :]], opset=11)
    _check_layout("Squeeze", (1, 3, 1, 2), {}, {}, lambda x: [x[0, :, 0, :]], opset=13)
    _check_layout("Unsqueeze", (3, 2), {}, {"axes": np.array([0, -1], dtype=I64)},
                  lambda x: [x[None, :, :, None]], opset=13)
    _check_layout("Unsqueeze", (3, 2), {"axes": [1]}, {}, lambda x: [x[:, None, :]], opset=11)


@covers("Transpose", check=Check.INT_REFERENCE)
@covers("Transpose", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("perm", [None, [0, 2, 3, 1], [3, 1, 0, 2]])
def test_transpose(perm):
    attrs = {} if perm is None else {"perm": perm}
    order = perm if perm is not None else [3, 2, 1, 0]

    def reference(x):
        out = np.empty([x.shape[p] for p in order], dtype=x.dtype)
        for idx in np.ndindex(*x.shape):
            out[tuple(idx[p] for p in order)] = x[idx]
        return [out]

    _check_layout("Transpose", (2, 3, 4, 5), attrs, {}, reference)


@covers("Split", check=Check.INT_REFERENCE)
@covers("Split", check=Check.ONNXRUNTIME)
def test_split_variants():
    _check_layout("Split", (2, 7, 3), {"axis": 1}, {"split": np.array([2, 4, 1], dtype=I64)},
                  lambda x: [x[:, :2], x[:, 2:6], x[:, 6:]], opset=13, outputs=3)
    _check_layout("Split", (2, 6), {"axis": -1}, {}, lambda x: [x[:, :3], x[:, 3:]], opset=13, outputs=2)
    _check_layout("Split", (4, 3), {"split": [1, 3]}, {}, lambda x: [x[:1], x[1:]], opset=11, outputs=2)
    _check_layout("Split", (7, 2), {"num_outputs": 3}, {}, lambda x: [x[:3], x[3:6], x[6:]], opset=18, outputs=3)


@covers("Slice", check=Check.INT_REFERENCE)
@covers("Slice", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1, 0], [3, 4], None, None),
    ([-1], [-100], [1], [-1]),
    ([0, 5], [9999, -9999], [2, 1], [2, -2]),
    ([2], [1], [0], [1]),
    ([-3, 1], [-1, 2**62], [-1, 0], [1, 3]),
])
def test_slice(starts, ends, axes, steps):
    consts = {"starts": np.array(starts, I64), "ends": np.array(ends, I64)}
    if axes is not None:
        consts["axes"] = np.array(axes, I64)
    if steps is not None:
        consts["steps"] = np.array(steps, I64)
    shape = (4, 6, 5)

    def reference(x):  # ONNX clamping rules, written out per axis
        index = [slice(None)] * x.ndim
        for i, (s, e) in enumerate(zip(starts, ends)):
            a = (axes[i] if axes is not None else i) % x.ndim
            st = steps[i] if steps is not None else 1
            d = x.shape[a]
            s = s + d if s < 0 else s
            e = e + d if e < 0 else e
            if st > 0:
                picks = list(range(max(0, min(s, d)), max(0, min(e, d)), st))
            else:
                picks = list(range(max(-1, min(s, d - 1)), max(-1, min(e, d - 1)), st))
            index[a] = picks
        out = x
        for a, picks in enumerate(index):
            if not isinstance(picks, slice):
                out = np.take(out, np.array(picks, dtype=np.int64), axis=a)
        return [out]

    _check_layout("Slice", shape, {}, consts, reference, opset=13)


@covers("Slice", check=Check.INT_REFERENCE)
@covers("Slice", check=Check.ONNXRUNTIME)
def test_slice_opset1_attributes():
    attrs = {"starts": [1], "ends": [3], "axes": [1]}
    _check_layout("Slice", (2, 4), attrs, {}, lambda x: [x[:, 1:3]], opset=9)


@pytest.mark.parametrize("op_type,attrs,consts,match", [
    ("Reshape", {}, {"shape": np.array([5, -1], I64)}, "cannot reshape"),
    ("Transpose", {"perm": [0, 0, 1]}, {}, "repeated axis"),
    ("Squeeze", {}, {"axes": np.array([1], I64)}, "not of size 1"),
    ("Split", {"axis": 1}, {"split": np.array([1, 1], I64)}, "do not split"),
    ("Slice", {}, {"starts": np.array([0], I64), "ends": np.array([1], I64), "axes": np.array([0], I64),
                   "steps": np.array([0], I64)}, "step 0"),
    ("Flatten", {"axis": 5}, {}, "out of range"),
])
def test_layout_bad_arguments_raise(op_type, attrs, consts, match):
    qp = random_qparams(np.random.default_rng(2), -1, 1)
    node = Node("n", op_type, ["x"] + list(consts), ["y0", "y1"] if op_type == "Split" else ["y"], attrs)
    op = get_op(op_type)
    constants = {i + 1: v for i, v in enumerate(consts.values())}
    q = op.quantize(context(node, [qp] + [None] * len(consts), [None], constants))
    with pytest.raises(ValueError, match=match):
        op.forward_int(q, [np.zeros((2, 3, 4), np.int8)] + list(consts.values()), runtime())


@covers("Transpose", "Reshape", check=Check.ONNXRUNTIME)
def test_a_per_channel_grid_follows_its_channels():
    # a joined output with one grid per part (ptq.calibration.joined_ranges): Transpose and Reshape move the codes and the
    # grid lands on the axis that now holds the channels; a Slice refuses it (it may cut the channels)
    from ops.registry import QuantizationError
    from ptq.core.qparams import QParams

    rng = np.random.default_rng(4)
    x_qp = QParams(scale=np.linspace(0.004, 1.25, 5), zero_point=np.zeros(5, np.int64), bits=8, signed=False, axis=1)
    x = rng.integers(0, 256, (1, 5, 6)).astype(np.uint8)
    cases = [("Transpose", {"perm": [0, 2, 1]}, {}, (1, 6, 5), 2),
             ("Reshape", {}, {"shape": np.array([1, 5, 2, 3], np.int64)}, (1, 5, 2, 3), 1),
             ("Reshape", {}, {"shape": np.array([5, 6], np.int64)}, (5, 6), 0)]
    for op_type, attrs, consts, out_shape, axis in cases:
        node = Node("n", op_type, ["x"] + list(consts), ["y"], attrs)
        ctx = context(node, [x_qp] + [None] * len(consts), [None], {i + 1: v for i, v in enumerate(consts.values())})
        ctx.in_shapes, ctx.out_shapes = [x.shape] + [None] * len(consts), [out_shape]
        q = get_op(op_type).quantize(ctx)
        y_qp = q.out_qparams[0]
        assert y_qp.axis == axis and np.array_equal(y_qp.scale, x_qp.scale)
        y = get_op(op_type).forward_int(q, [x] + list(consts.values()), runtime())[0]
        want = ort_single(op_type, {"x": x_qp.dequantize(x).astype(np.float32)}, attrs, constants=consts)[0]
        np.testing.assert_array_equal(y_qp.dequantize(y), want)
    node = Node("n", "Reshape", ["x", "s"], ["y"])
    ctx = context(node, [x_qp, None], [None], {1: np.array([1, 30], np.int64)})
    ctx.in_shapes, ctx.out_shapes = [x.shape, None], [(1, 30)]
    with pytest.raises(QuantizationError, match="per channel along axis 1"):
        get_op("Reshape").quantize(ctx)
    node = Node("n", "Slice", ["x", "a", "b"], ["y"])
    ctx = context(node, [x_qp, None, None], [None], {1: np.array([0]), 2: np.array([2])})
    ctx.in_shapes, ctx.out_shapes = [x.shape, None, None], [(1, 5, 6)]
    with pytest.raises(QuantizationError, match="per channel"):
        get_op("Slice").quantize(ctx)
