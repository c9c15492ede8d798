"""ops/concat.py: Concat requantizes each input to the output qparams.

(a) forward_int equals a Python-integer requant per input; (b) the dequantized output is within 0.5 LSB +
the multiplier error of onnxruntime, and forward_float equals onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    FORMATS,
    MBITS,
    Check,
    context,
    covers,
    lsb_error,
    ort_single,
    random_codes,
    random_qparams,
    ref_requant,
    runtime,
)
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node
from ptq.core.requant import quantize_multiplier


I64 = np.int64


@covers("Concat", check=Check.INT_REFERENCE)
@covers("Concat", check=Check.ONNXRUNTIME)
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


@covers("Concat", check=Check.INT_REFERENCE)
@covers("Concat", check=Check.ONNXRUNTIME)
def test_per_channel_output_along_the_axis_keeps_each_part_on_its_grid():
    # pixel boxes (0..320, 4 rows) joined with sigmoid scores (0..1, 3 rows) and a constant row: each output
    # channel has its own grid; the box part's channels carry its own grid (copied), the others requantize
    from ptq.core.qparams import QParams, compute_qparams

    rng = np.random.default_rng(9)
    op = get_op("Concat")
    box_qp = compute_qparams(0.0, 320.0, 8, symmetric=False)
    score_qp = compute_qparams(0.0, 1.0, 8, symmetric=False)
    boxes, scores = random_codes(rng, box_qp, (1, 4, 6)), random_codes(rng, score_qp, (1, 3, 6))
    const = rng.uniform(0, 2, (1, 1, 6)).astype(np.float32)
    score_out = compute_qparams(np.zeros(3), np.array([1.0, 0.5, 1.2]), 8, symmetric=False, axis=0)
    y_qp = QParams(scale=np.concatenate([np.repeat(box_qp.scale, 4), score_out.scale, [2 / 255]]),
                   zero_point=np.zeros(8, np.int64), bits=8, signed=False, axis=1)
    node = Node("cat", "Concat", ["b", "s", "k"], ["y"], {"axis": -2})
    ctx = context(node, [box_qp, score_qp, None], [y_qp], {2: const})
    ctx.in_shapes = [(1, 4, 6), (1, 3, 6), (1, 1, 6)]
    q = op.quantize(ctx)
    assert q.copy == [True, False, False] and q.axis == 1
    (y,) = op.forward_int(q, [boxes, scores, const], runtime())
    np.testing.assert_array_equal(y[:, :4], boxes)
    for c in range(3):
        m, n = quantize_multiplier(float(score_qp.scale[0]) / float(score_out.scale[c]), MBITS)
        ref = ref_requant(scores[:, c].astype(I64) - int(score_qp.zero_point[0]), m[0], n[0], 0, 0, 255)
        np.testing.assert_array_equal(y[:, 4 + c], ref)
    np.testing.assert_array_equal(y[:, 7], np.clip(np.rint(const[:, 0] / np.float32(2 / 255)), 0, 255))
    (y_ort,) = ort_single("Concat", {"b": box_qp.dequantize(boxes), "s": score_qp.dequantize(scores)}, {"axis": -2},
                          constants={"k": const})
    lo, hi = (v.reshape(1, -1, 1) for v in y_qp.real_range())
    per_channel_lsb = np.abs(y_qp.dequantize(y) - np.clip(y_ort, lo, hi)) / y_qp.scale.reshape(1, -1, 1)
    assert per_channel_lsb.max() <= 0.5 + 255 * 2.0 ** -MBITS + 1e-3
    ctx.in_shapes = [None, (1, 3, 6), (1, 1, 6)]
    with pytest.raises(QuantizationError, match="static size of input 0"):
        op.quantize(ctx)
