"""ops/reduce.py: ReduceMean (axes as an attribute up to opset 17, as an input from 18).

(a) forward_int equals an int64 reference written here (reduced axes summed column by column,
Python-integer requant); (b) the dequantized output is within the documented LSB bound of onnxruntime on the
dequantized input; forward_float matches onnxruntime too.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import (
    FORMATS,
    Check,
    context,
    covers,
    lsb_error,
    mean_bound,
    ort_single,
    proposal_for,
    random_input,
    ref_mean_requant,
    runtime,
)
from ops import get_op
from ptq.core.graph import Node


REDUCE_CASES = [
    ((2, 3, 4, 5), [2, 3], 1),
    ((2, 3, 4, 5), [1], 0),
    ((2, 3, 4, 5), [-1, 0], 1),
    ((3, 4, 5), None, 0),
]


@covers("ReduceMean", check=Check.INT_REFERENCE)
@covers("ReduceMean", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("case", range(len(REDUCE_CASES)))
def test_reduce_mean(case, opset):
    rng = np.random.default_rng(500 + case + opset)
    shape, axes, keepdims = REDUCE_CASES[case]
    op = get_op("ReduceMean")
    attrs = {"keepdims": keepdims}
    constants = {}
    inputs = ["x"]
    if axes is not None and opset >= 18:
        constants = {"axes": np.array(axes, dtype=np.int64)}
        inputs = ["x", "axes"]
    elif axes is not None:
        attrs["axes"] = axes
    node = Node("rm", "ReduceMean", inputs, ["y"], attrs)
    for bits, signed in FORMATS:
        x_qp, x = random_input(rng, shape, bits, signed)
        x_f = x_qp.dequantize(x)
        (y_ort,) = ort_single("ReduceMean", {"x": x_f}, attrs, constants=constants, opset=opset)
        raw = [x_f] + list(constants.values())
        np.testing.assert_allclose(op.forward_float(node, raw)[0], y_ort, rtol=1e-5, atol=1e-6)
        y_qp = proposal_for(rng, y_ort, bits, signed)
        const_inputs = {1: constants["axes"]} if constants else {}
        q = op.quantize(context(node, [x_qp, None][:len(inputs)], [y_qp], const_inputs))
        (y,) = op.forward_int(q, [x] + list(constants.values()), runtime())
        # reference: move the reduced axes last, flatten them, add column by column
        red = [a % len(shape) for a in (axes if axes is not None else range(len(shape)))]
        kept = [a for a in range(len(shape)) if a not in red]
        xc = np.transpose(x.astype(np.int64) - int(x_qp.zero_point[0]), kept + red)
        flat = xc.reshape([shape[a] for a in kept] + [-1])
        acc = np.zeros(flat.shape[:-1], dtype=np.int64)
        for j in range(flat.shape[-1]):
            acc += flat[..., j]
        ref = ref_mean_requant(acc, flat.shape[-1], x_qp, y_qp)
        np.testing.assert_array_equal(y.reshape(ref.shape), ref)
        assert y.shape == y_ort.shape
        assert lsb_error(y_qp, y, y_ort) <= mean_bound(y_ort, y_qp)


def test_reduce_mean_without_proposal_keeps_input_qparams_and_noop():
    rng = np.random.default_rng(7)
    x_qp, x = random_input(rng, (2, 3, 4), 8, True)
    op = get_op("ReduceMean")
    node = Node("rm", "ReduceMean", ["x", "axes"], ["y"], {"noop_with_empty_axes": 1})
    q = op.quantize(context(node, [x_qp, None], [None], {1: np.array([], dtype=np.int64)}))
    assert q.out_qparams[0] == x_qp
    (y,) = op.forward_int(q, [x, np.array([], dtype=np.int64)], runtime())
    np.testing.assert_array_equal(y, x)
