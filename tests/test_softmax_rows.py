"""Softmax rows past the whitepaper's 4096 terms (issue 24) through prepare and the integer run: the row length
is read from the static shapes at prepare; rows up to 2^24 terms run in integers (lut.softmax: the table's
exp(0) grows to 2^(ceil(log2 n) + 8), int64 sums), a longer row runs in float with the reason, at prepare."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ptq.core.graph import load_model
from ptq.core.qparams import QParams, compute_qparams
from ptq.engine.executor import NodeKind, prepare
from ptq.table.quant_table import CalibrationOptions, QuantTable, TensorEntry


def _graph(op_type: str, shape, opset: int, axis: int):
    node = helper.make_node(op_type, ["x"], ["y"], name="sm", axis=axis)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7))


def _table(entries: dict[str, QParams]) -> QuantTable:
    tensors = {name: TensorEntry("activation", "extrema", *qp.real_range(), qp) for name, qp in entries.items()}
    return QuantTable(options=CalibrationOptions(), tensors=tensors)


def _coerced_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """opset < 13 Softmax: rows are the input flattened from `axis` (float64)."""
    rows = x.astype(np.float64).reshape(int(np.prod(x.shape[:axis])), -1)
    e = np.exp(rows - rows.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).reshape(x.shape)


def _run(graph, x_qp: QParams, x: np.ndarray, y_qp: QParams):
    integer = prepare(graph, _table({"x": x_qp, "y": y_qp}))
    step = next(s for s in integer.steps if s.node.name == "sm")
    return step, integer.run({"x": x.astype(np.float32)})


def test_opset11_softmax_axis1_on_a_feature_map_runs_in_integers():
    # a segmentation export's Softmax(axis=1) at opset 11 on (1, 8, 32, 32): one row of 8 * 32 * 32 = 8192
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 2.0, (1, 8, 32, 32))
    x_qp = compute_qparams(x.min(), x.max(), 8, symmetric=True)
    step, result = _run(_graph("Softmax", [1, 8, 32, 32], 11, 1), x_qp, x, compute_qparams(0, 1, 8, symmetric=False))
    assert step.kind is NodeKind.INTEGER and result.float_nodes == []
    assert [t.one_bits for t in step.quantized.kernel.tables] == [21]
    # within the kernel's bound (< 1 LSB, lut.softmax) of the float op on the dequantized input
    expected = _coerced_softmax(x_qp.dequantize(x_qp.quantize(x)), 1)
    y_qp = result.qparams["y"]
    assert np.abs(result.outputs["y"] - expected).max() <= float(y_qp.scale[0])


def test_ocr_softmax_over_18710_classes_runs_in_integers():
    # a CTC head at opset 11: Softmax(axis=2) over (1, 40, 18710) logits, one confident class per step
    rng = np.random.default_rng(1)
    x = rng.normal(-4.0, 2.0, (1, 40, 18710))
    x[0, np.arange(40), rng.integers(0, 18710, 40)] = rng.uniform(8.0, 14.0, 40)
    x_qp = compute_qparams(x.min(), x.max(), 8, symmetric=True)
    step, result = _run(_graph("Softmax", [1, 40, 18710], 11, 2), x_qp, x, compute_qparams(0, 1, 8, symmetric=False))
    assert step.kind is NodeKind.INTEGER and result.float_nodes == []
    assert [t.one_bits for t in step.quantized.kernel.tables] == [23]
    expected = _coerced_softmax(x_qp.dequantize(x_qp.quantize(x)), 2)
    assert np.abs(result.outputs["y"] - expected).max() <= float(result.qparams["y"].scale[0])
    np.testing.assert_array_equal(result.outputs["y"].argmax(axis=2), expected.argmax(axis=2))


def test_log_softmax_over_65536_terms_runs_in_integers():
    rng = np.random.default_rng(2)
    x = rng.normal(0.0, 3.0, (2, 65536))
    x_qp = compute_qparams(x.min(), x.max(), 8, symmetric=True)
    xd = x_qp.dequantize(x_qp.quantize(x)).astype(np.float64)
    shifted = xd - xd.max(axis=1, keepdims=True)
    expected = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    y_qp = compute_qparams(expected.min(), 0.0, 8, symmetric=False)
    step, result = _run(_graph("LogSoftmax", [2, 65536], 13, -1), x_qp, x, y_qp)
    assert step.kind is NodeKind.INTEGER and [t.one_bits for t in step.quantized.kernel.tables] == [24]
    assert np.abs(result.outputs["y"] - expected).max() <= float(y_qp.scale[0])


def test_row_past_the_int64_limit_runs_in_float_from_prepare():
    # 2^24 + 1 terms: refused by the quantize rule at prepare (static shape), not at run time
    n = (1 << 24) + 1
    x_qp = QParams(0.05, 0, 8, True)
    integer = prepare(_graph("Softmax", [1, n], 13, -1),
                      _table({"x": x_qp, "y": compute_qparams(0, 1, 8, symmetric=False)}))
    [node] = integer.float_nodes
    assert node.name == "sm" and "16777216 terms" in node.reason and node.reason.startswith("cannot quantize")
