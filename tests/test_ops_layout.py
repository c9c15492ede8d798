"""Identity, Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Split, Slice, Pad, Concat.

Layout ops and Pad: (a) forward_int equals a numpy reference on the codes written here; (b) the dequantized
output equals onnxruntime's float output on the dequantized input exactly (LSB bound 0; a quantized Pad
constant within 0.5 LSB), and the output qparams are the input's whatever the table proposes.
Concat: (a) a Python-integer requant per input; (b) within 0.5 LSB + the multiplier error of onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import context, lsb_error, ort_single, random_codes, random_qparams, ref_requant, runtime
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node
from ptq.core.requant import quantize_multiplier

MBITS = 15
FORMATS = [(8, True), (8, False), (16, True), (16, False)]
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


def test_identity():
    _check_layout("Identity", (2, 3), {}, {}, lambda x: [x])


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


@pytest.mark.parametrize("axis,expected", [(0, (1, 24)), (1, (2, 12)), (-1, (6, 4)), (3, (24, 1))])
def test_flatten(axis, expected):
    _check_layout("Flatten", (2, 3, 4), {"axis": axis}, {}, lambda x: [x.ravel().reshape(expected)])


def test_squeeze_and_unsqueeze_both_opsets():
    _check_layout("Squeeze", (1, 3, 1, 2), {}, {"axes": np.array([0, -2], dtype=I64)},
                  lambda x: [x[0, :, 0, :]], opset=13)
    _check_layout("Squeeze", (1, 3, 1, 2), {"axes": [2]}, {}, lambda x: [x[:, :, 0, :]], opset=11)
    _check_layout("Squeeze", (1, 3, 1, 2), {}, {}, lambda x: [x[0, :, 0, :]], opset=13)
    _check_layout("Unsqueeze", (3, 2), {}, {"axes": np.array([0, -1], dtype=I64)},
                  lambda x: [x[None, :, :, None]], opset=13)
    _check_layout("Unsqueeze", (3, 2), {"axes": [1]}, {}, lambda x: [x[:, None, :]], opset=11)


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


def test_split_variants():
    _check_layout("Split", (2, 7, 3), {"axis": 1}, {"split": np.array([2, 4, 1], dtype=I64)},
                  lambda x: [x[:, :2], x[:, 2:6], x[:, 6:]], opset=13, outputs=3)
    _check_layout("Split", (2, 6), {"axis": -1}, {}, lambda x: [x[:, :3], x[:, 3:]], opset=13, outputs=2)
    _check_layout("Split", (4, 3), {"split": [1, 3]}, {}, lambda x: [x[:1], x[1:]], opset=11, outputs=2)
    _check_layout("Split", (7, 2), {"num_outputs": 3}, {}, lambda x: [x[:3], x[3:6], x[6:]], opset=18, outputs=3)


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


def test_slice_opset1_attributes():
    attrs = {"starts": [1], "ends": [3], "axes": [1]}
    _check_layout("Slice", (2, 4), attrs, {}, lambda x: [x[:, 1:3]], opset=9)


# ---------------------------------------------------------------------------------------------- Pad

def _pad_reference(x, widths, mode, code):
    if mode == "constant":
        return np.pad(x, widths, mode="constant", constant_values=code)
    return np.pad(x, widths, mode={"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_modes(mode):
    rng = np.random.default_rng(["constant", "reflect", "edge", "wrap"].index(mode))
    op = get_op("Pad")
    pads = np.array([0, 1, 2, 1, 0, 1, 1, 0], dtype=I64)  # (N, C, H, W) begins then ends
    widths = [(0, 0), (1, 1), (2, 1), (1, 0)]
    for value in (0.0, 0.37):
        consts = {"pads": pads}
        if mode == "constant":
            consts["value"] = np.array(value, dtype=np.float32)
        node = Node("pad", "Pad", ["x"] + list(consts), ["y"], {"mode": mode})
        raw = list(consts.values())
        for bits, signed in FORMATS:
            x_qp = random_qparams(rng, -1.5, 1.5, bits, signed=signed)
            x = random_codes(rng, x_qp, (1, 2, 4, 3))
            x_f = x_qp.dequantize(x)
            (y_ort,) = ort_single("Pad", {"x": x_f}, {"mode": mode}, constants=consts, opset=19)
            np.testing.assert_array_equal(op.forward_float(node, [x_f] + raw)[0], y_ort)
            q = op.quantize(context(node, [x_qp] + [None] * len(raw), [None], {i + 1: v for i, v in enumerate(raw)}))
            assert q.out_qparams[0] == x_qp
            (y,) = op.forward_int(q, [x] + raw, runtime())
            code = int(np.clip(np.rint(np.float32(value) / x_qp.scale[0]) + x_qp.zero_point[0], x_qp.qmin, x_qp.qmax))
            if value == 0.0:
                assert code == x_qp.zero_point[0]
            np.testing.assert_array_equal(y, _pad_reference(x, widths, mode, code))
            assert y.dtype == x.dtype
            assert lsb_error(x_qp, y, y_ort) <= (0.5 if value else 0.0)


def test_pad_negative_axes_and_old_opset():
    rng = np.random.default_rng(9)
    x_qp = random_qparams(rng, -1, 1, 8, signed=True)
    x = random_codes(rng, x_qp, (2, 5, 4))
    x_f = x_qp.dequantize(x)
    op = get_op("Pad")
    consts = {"pads": np.array([2, -1, -2, 1], I64), "value": np.array(0.0, np.float32), "axes": np.array([1, -1], I64)}
    node = Node("pad", "Pad", ["x", "pads", "value", "axes"], ["y"], {})
    (y_ort,) = ort_single("Pad", {"x": x_f}, {}, constants=consts, opset=18)
    raw = list(consts.values())
    q = op.quantize(context(node, [x_qp, None, None, None], [None], {1: raw[0], 2: raw[1], 3: raw[2]}))
    (y,) = op.forward_int(q, [x] + raw, runtime())
    np.testing.assert_array_equal(x_qp.dequantize(y), y_ort)
    # crop W by one at the start, then pad C by (2, 0) and W by (0, 1) with zp
    np.testing.assert_array_equal(y, np.pad(x[:, :3, 1:], [(0, 0), (2, 0), (0, 1)], constant_values=x_qp.zero_point[0]))

    node = Node("pad", "Pad", ["x"], ["y"], {"pads": [0, 1, 0, 0, 0, 2], "mode": "edge"})
    (y_ort,) = ort_single("Pad", {"x": x_f}, {"pads": [0, 1, 0, 0, 0, 2], "mode": "edge"}, opset=10)
    (y,) = op.forward_int(op.quantize(context(node, [x_qp], [None])), [x], runtime())
    np.testing.assert_array_equal(x_qp.dequantize(y), y_ort)


def test_pad_rejects_runtime_constant_and_unknown_mode():
    x_qp = random_qparams(np.random.default_rng(0), -1, 1)
    op = get_op("Pad")
    with pytest.raises(QuantizationError, match="constant_value must be a constant"):
        op.quantize(context(Node("pad", "Pad", ["x", "pads", "v"], ["y"]), [x_qp, None, None], [None], {}))
    with pytest.raises(QuantizationError, match="unsupported mode"):
        op.quantize(context(Node("pad", "Pad", ["x", "pads"], ["y"], {"mode": "mirror"}), [x_qp, None], [None], {}))


# ---------------------------------------------------------------------------------------------- Concat

@pytest.mark.parametrize("axis", [1, -1])
def test_concat_requantizes_each_input(axis):
    rng = np.random.default_rng(20 + axis)
    op = get_op("Concat")
    shapes = [(2, 3, 4), (2, 3, 4), (2, 3, 4)]
    for bits, signed in FORMATS:
        qps = [random_qparams(rng, -rng.uniform(0.1, 3), rng.uniform(0.1, 3), bits, signed=signed) for _ in shapes]
        xs = [random_codes(rng, qp, s) for qp, s in zip(qps, shapes)]
        xfs = [qp.dequantize(x) for qp, x in zip(qps, xs)]
        const = rng.uniform(-1, 1, size=(2, 3, 4)).astype(np.float32)
        inputs = {"a": xfs[0], "b": xfs[1], "c": xfs[2]}
        (y_ort,) = ort_single("Concat", inputs, {"axis": axis}, constants={"k": const})
        node = Node("cat", "Concat", ["a", "b", "c", "k"], ["y"], {"axis": axis})
        np.testing.assert_array_equal(op.forward_float(node, xfs + [const])[0], y_ort)
        y_qp = random_qparams(rng, float(y_ort.min()), float(y_ort.max()), bits, signed=signed)
        in_qps = [qps[0], y_qp, qps[2], None]  # input b already carries the output qparams: copied as is
        xs[1] = random_codes(rng, y_qp, shapes[1])
        xfs[1] = y_qp.dequantize(xs[1])
        inputs["b"] = xfs[1]
        (y_ort,) = ort_single("Concat", inputs, {"axis": axis}, constants={"k": const})
        q = op.quantize(context(node, in_qps, [y_qp], {3: const}))
        (y,) = op.forward_int(q, xs + [const], runtime())
        assert y.dtype == y_qp.dtype
        parts = []
        for x, qp in zip(xs, in_qps[:3]):
            m, n = quantize_multiplier(float(qp.scale[0]) / float(y_qp.scale[0]), MBITS)
            parts.append(ref_requant(x.astype(I64) - int(qp.zero_point[0]), m[0], n[0], int(y_qp.zero_point[0]),
                                     y_qp.qmin, y_qp.qmax))
        parts.append(np.clip(np.rint(const / y_qp.scale[0]) + y_qp.zero_point[0], y_qp.qmin, y_qp.qmax))
        np.testing.assert_array_equal(y, np.concatenate(parts, axis=axis))
        np.testing.assert_array_equal(np.take(y, range(4, 8) if axis == -1 else range(3, 6), axis=axis), xs[1])
        biggest = max(float(np.abs(xf).max()) for xf in xfs) / float(y_qp.scale[0])
        assert lsb_error(y_qp, y, y_ort) <= 0.5 + biggest * 2.0 ** -MBITS + 1e-3


def test_concat_output_qparams_fallback():
    rng = np.random.default_rng(5)
    qp = random_qparams(rng, -1, 1)
    op = get_op("Concat")
    node = Node("cat", "Concat", ["a", "b"], ["y"], {"axis": 0})
    q = op.quantize(context(node, [qp, qp], [None]))
    assert q.out_qparams[0] == qp
    other = random_qparams(rng, -2, 2)
    with pytest.raises(QuantizationError, match="qparams differ"):
        op.quantize(context(node, [qp, other], [None]))
    with pytest.raises(QuantizationError, match="axis"):
        op.quantize(context(Node("cat", "Concat", ["a"], ["y"]), [qp], [None]))


def test_per_channel_activations_are_rejected():
    per_channel = random_qparams(np.random.default_rng(1), np.array([-1.0, -2.0]), np.array([1.0, 2.0]), axis=1)
    for op_type in ("Identity", "Transpose", "Pad", "Concat", "MaxPool", "AveragePool", "ReduceMean", "Resize"):
        inputs, constants = ["x"], {}
        if op_type == "Resize":
            inputs, constants = ["x", "", "s"], {2: np.array([1, 1, 2, 2], np.float32)}
        node = Node("n", op_type, inputs, ["y"], {"axis": 0, "kernel_shape": [1, 1]})
        with pytest.raises(QuantizationError, match="per tensor"):
            get_op(op_type).quantize(context(node, [per_channel, None, None][:len(inputs)], [None], constants))


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
