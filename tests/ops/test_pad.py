"""ops/pad.py: Pad in every mode, opset 2 attributes and opset 18 axes.

(a) forward_int equals numpy's pad of the codes; (b) the dequantized output equals onnxruntime's float
output on the dequantized input exactly (a quantized constant value within 0.5 LSB), forward_float equals
onnxruntime, and the output qparams are the input's.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import FORMATS, Check, context, covers, lsb_error, ort_single, random_codes, random_qparams, runtime
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node


I64 = np.int64


def _pad_reference(x, widths, mode, code):
    if mode == "constant":
        return np.pad(x, widths, mode="constant", constant_values=code)
    return np.pad(x, widths, mode={"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode])


@covers("Pad", check=Check.INT_REFERENCE)
@covers("Pad", check=Check.ONNXRUNTIME)
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


@covers("Pad", check=Check.INT_REFERENCE)
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
