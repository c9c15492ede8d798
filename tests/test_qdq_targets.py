"""QDQ export targets (ptq.qdq.export.QDQ_TARGETS): how 8-bit weights are stored, and what onnxruntime's fused
kernels make of each storage.

The fused-kernel tests feed activations whose uint8 codes are 230-255 (onnxruntime turns int8 activations into
uint8 with zero point + 128 on x86) against weights of magnitude 100-127: two such products add up to more
than 32767, the int16 sum that `vpmaddubsw` saturates in onnxruntime's uint8 x int8 GEMM on x86 CPUs without
VNNI. There the `none` export (int8 weights) comes out up to 60 output LSB off; that is not asserted, it
depends on the CPU. What is asserted holds on every CPU: the `ort-cpu` export (uint8 weights) fused by
onnxruntime's default optimizations computes what its unfused QDQ graph describes.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from ptq.core.graph import load_model
from ptq.core.qparams import QParams
from ptq.qdq.export import export_qdq
from ptq.qdq.targets import DEFAULT_TARGET, QDQ_TARGETS, get_target
from ptq.table.quant_table import CalibrationOptions, QuantTable, TensorEntry
from test_graph import vi
from tiny_models import make_model

C = 64  # input channels / reduction depth


def entry(kind, qp):
    lo, hi = qp.real_range()
    return TensorEntry(kind, "manual", lo, hi, qp)


def session(model: onnx.ModelProto, level, optimized_path=None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def weights(rng, shape) -> np.ndarray:
    """Magnitudes 100-127 (in units of 0.001, so codes 100-127 at scale 0.001), random signs."""
    return (rng.integers(100, 128, shape) * rng.choice([-1, 1], shape) * 0.001).astype(np.float32)


# op, input shape, output shape, weight shape, weight channel axis, fused op onnxruntime makes of it
CASES = {
    "pointwise conv": ([helper.make_node("Conv", ["x", "W"], ["y"])], [1, C, 3, 3], [1, 8, 3, 3], (8, C, 1, 1), 0,
                       "QLinearConv"),
    "depthwise conv": ([helper.make_node("Conv", ["x", "W"], ["y"], group=C, kernel_shape=[3, 3], pads=[1] * 4)],
                       [1, C, 3, 3], [1, C, 3, 3], (C, 1, 3, 3), 0, "QLinearConv"),
    "gemm": ([helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], [2, C], [2, 8], (8, C), 0, "QGemm"),
    "matmul": ([helper.make_node("MatMul", ["x", "W"], ["y"])], [2, C], [2, 8], (C, 8), 1, "QLinearMatMul"),
}
ACTIVATIONS = {"uint8": QParams(0.01, 0, 8, False), "int8": QParams(0.01, -128, 8, True)}


def case_model(name: str, activation: str, seed: int = 0):
    """(model, table, x): per-channel symmetric int8 weights, activations whose uint8 codes are 230-255."""
    nodes, x_shape, y_shape, w_shape, axis, _ = CASES[name]
    rng = np.random.default_rng(seed)
    w = weights(rng, w_shape)
    model = make_model(nodes, [vi("x", x_shape)], [vi("y", y_shape)], [numpy_helper.from_array(w, "W")])
    x = (rng.integers(230, 256, x_shape) * 0.01).astype(np.float32)
    float_y = session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"x": x})[0]
    channels = w_shape[axis]
    amax = np.abs(np.moveaxis(w, axis, 0).reshape(channels, -1)).max(axis=1)
    table = QuantTable(CalibrationOptions(), {
        "x": entry("activation", ACTIVATIONS[activation]),
        "W": entry("weight", QParams(amax / 127, [0] * channels, 8, True, axis=axis, narrow=True)),
        "y": entry("activation", QParams(np.abs(float_y).max() / 127, 0, 8, True)),
    })
    return model, table, x


def test_the_inputs_reach_the_saturating_regime():
    """Some pair of adjacent products exceeds the int16 range (else the fused-kernel tests prove nothing)."""
    for name in ("pointwise conv", "gemm", "matmul"):
        model, table, x = case_model(name, "uint8")
        xq = table.tensors["x"].qparams.quantize(x).astype(np.int64)
        xq = xq[0, :, 0, 0] if xq.ndim == 4 else xq[0]  # the C codes one output value reduces over
        wq = table.tensors["W"].qparams.quantize(load_model(model).initializers["W"]).astype(np.int64)
        wq = wq.T if name == "matmul" else wq.reshape(-1, C)  # (output channel, C)
        pairs = xq[0::2] * wq[:, 0::2] + xq[1::2] * wq[:, 1::2]
        assert np.abs(pairs).max() > 32767, name


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_ort_cpu_export_fused_by_onnxruntime_computes_the_qdq_graph(name, activation, tmp_path):
    model, table, x = case_model(name, activation)
    qdq = export_qdq(load_model(model), table, "ort-cpu")
    optimized_path = tmp_path / "optimized.onnx"
    fused = session(qdq, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, optimized_path).run(None, {"x": x})[0]
    assert CASES[name][5] in {n.op_type for n in onnx.load(str(optimized_path)).graph.node}, "not fused"
    unfused = session(qdq, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"x": x})[0]
    lsb = float(table.tensors["y"].qparams.scale[0])
    diff = np.abs(fused - unfused) / lsb
    assert diff.max() <= 1.001 and np.mean(diff > 0.5) <= 0.01, (diff.max(), np.mean(diff > 0.5))


@pytest.mark.parametrize("name", sorted(CASES))
def test_targets_store_the_same_values(name):
    """Unfused, every target's QDQ graph computes bit for bit the same outputs: only the storage differs."""
    model, table, x = case_model(name, "int8")
    graph = load_model(model)
    outputs = [session(export_qdq(graph, table, target), ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
               .run(None, {"x": x})[0] for target in QDQ_TARGETS]
    for got in outputs[1:]:
        np.testing.assert_array_equal(got, outputs[0])


def _stored(qdq: onnx.ModelProto, name: str) -> tuple[np.ndarray, np.ndarray]:
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    return inits[f"{name}_quantized"], inits[f"{name}_zero_point"]


@pytest.mark.parametrize("bits, narrow", [(8, True), (8, False), (4, False), (6, True)])
def test_ort_cpu_moves_signed_weights_up_by_128(bits, narrow):
    model, table, _ = case_model("pointwise conv", "uint8")
    graph = load_model(model)
    w = graph.initializers["W"]
    qp = QParams(np.abs(w).reshape(8, -1).max(axis=1) / 5, [1] * 8, bits, True, axis=0, narrow=narrow)
    table.tensors["W"] = entry("weight", qp)
    codes, zp = _stored(export_qdq(graph, table, "none"), "W")
    moved, moved_zp = _stored(export_qdq(graph, table, "ort-cpu"), "W")
    assert codes.dtype == np.int8 and moved.dtype == np.uint8 and moved_zp.dtype == np.uint8
    np.testing.assert_array_equal(moved.astype(np.int64), codes.astype(np.int64) + 128)
    np.testing.assert_array_equal(moved_zp.astype(np.int64), zp.astype(np.int64) + 128)
    assert codes.min() < 0 < codes.max()  # both signs really occur


def test_wider_and_unsigned_weights_keep_their_storage():
    model, table, _ = case_model("pointwise conv", "uint8")
    graph = load_model(model)
    w = graph.initializers["W"]
    for qp, dtype in ((QParams(np.abs(w).max() / 30000, 0, 16, True), np.int16),
                      (QParams(np.abs(w).max() / 100, 128, 8, False), np.uint8)):
        table.tensors["W"] = entry("weight", qp)
        for target in QDQ_TARGETS:
            codes, zp = _stored(export_qdq(graph, table, target), "W")
            assert codes.dtype == dtype
            np.testing.assert_array_equal(codes, qp.quantize(w))


def test_conv_transpose_with_uint8_weights_runs_optimized():
    """onnxruntime's CPU provider does not fuse ConvTranspose; the uint8 weights must still load and run."""
    rng = np.random.default_rng(1)
    w = weights(rng, (C, 8, 1, 1))
    model = make_model([helper.make_node("ConvTranspose", ["x", "W"], ["y"])], [vi("x", [1, C, 3, 3])],
                       [vi("y", [1, 8, 3, 3])], [numpy_helper.from_array(w, "W")])
    x = (rng.integers(230, 256, (1, C, 3, 3)) * 0.01).astype(np.float32)
    amax = np.abs(w).reshape(C, -1).max(axis=1)
    table = QuantTable(CalibrationOptions(), {
        "x": entry("activation", ACTIVATIONS["uint8"]),
        "W": entry("weight", QParams(amax / 127, [0] * C, 8, True, axis=0, narrow=True)),
    })
    qdq = export_qdq(load_model(model), table, "ort-cpu")
    assert _stored(qdq, "W")[0].dtype == np.uint8
    fused = session(qdq, ort.GraphOptimizationLevel.ORT_ENABLE_ALL).run(None, {"x": x})[0]
    unfused = session(qdq, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"x": x})[0]
    np.testing.assert_allclose(fused, unfused, rtol=1e-5, atol=1e-5)


def _activation_zero_points(qdq: onnx.ModelProto) -> dict:
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    return {n.output[0]: inits[n.input[2]] for n in qdq.graph.node
            if n.op_type == "QuantizeLinear"}


@pytest.mark.parametrize("target, dtype, shift", [("none", np.int8, 0), ("ort-cpu-vnni", np.uint8, 128),
                                                  ("ort-cpu", np.uint8, 128)])
def test_signed_activations_are_stored_as_uint8_by_the_ort_targets(target, dtype, shift):
    model, table, _ = case_model("gemm", "int8")
    table.tensors["y"] = entry("activation", QParams(0.05, -3, 8, True))
    zero_points = _activation_zero_points(export_qdq(load_model(model), table, target))
    assert {z.dtype for z in zero_points.values()} == {np.dtype(dtype)}
    assert sorted(int(z) for z in zero_points.values()) == sorted([-128 + shift, -3 + shift])


def residual_model(seed: int = 2) -> tuple[onnx.ModelProto, QuantTable, np.ndarray]:
    """x -> Conv a -> (Conv b, Add(a, b)) -> y: `a` is signed with two consumers, which onnxruntime does not
    move to uint8 itself (its int8 -> uint8 rewrite handles one consumer), so with int8 storage the Convs
    around it are not fused."""
    rng = np.random.default_rng(seed)
    wa, wb = weights(rng, (C, C, 1, 1)), weights(rng, (C, C, 1, 1))
    nodes = [helper.make_node("Conv", ["x", "WA"], ["a"]), helper.make_node("Conv", ["a", "WB"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    model = make_model(nodes, [vi("x", [1, C, 3, 3])], [vi("y", [1, C, 3, 3])],
                       [numpy_helper.from_array(wa, "WA"), numpy_helper.from_array(wb, "WB")])
    x = rng.uniform(0, 1, (1, C, 3, 3)).astype(np.float32)
    names = ["a", "b", "y"]
    values = dict(zip(names, session(helper.make_model(
        helper.make_graph(nodes, "r", [vi("x", [1, C, 3, 3])], [vi(n, None) for n in names], model.graph.initializer),
        opset_imports=model.opset_import), ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(names, {"x": x})))
    tensors = {"x": entry("activation", QParams(1 / 255, 0, 8, False))}
    for n in names:
        lo, hi = min(float(values[n].min()), 0.0), max(float(values[n].max()), 0.0)
        tensors[n] = entry("activation", QParams((hi - lo) / 255, round(-128 - lo / ((hi - lo) / 255)), 8, True))
    for n, w in (("WA", wa), ("WB", wb)):
        tensors[n] = entry("weight", QParams(np.abs(w).reshape(C, -1).max(axis=1) / 127, [0] * C, 8, True, axis=0,
                                             narrow=True))
    return model, QuantTable(CalibrationOptions(), tensors), x


def test_ort_cpu_lets_onnxruntime_fuse_every_conv_and_add(tmp_path):
    model, table, x = residual_model()
    qdq = export_qdq(load_model(model), table, "ort-cpu")
    optimized_path = tmp_path / "optimized.onnx"
    fused = session(qdq, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, optimized_path).run(None, {"x": x})[0]
    ops = [n.op_type for n in onnx.load(str(optimized_path)).graph.node]
    assert ops.count("QLinearConv") == 2 and ops.count("QLinearAdd") == 1 and "Conv" not in ops, ops
    unfused = session(qdq, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"x": x})[0]
    lsb = float(table.tensors["y"].qparams.scale[0])
    assert np.abs(fused - unfused).max() <= 1.001 * lsb


def test_targets_by_name():
    assert DEFAULT_TARGET == "ort-cpu" and get_target("ORT-CPU") is QDQ_TARGETS["ort-cpu"]
    assert get_target(QDQ_TARGETS["none"]) is QDQ_TARGETS["none"]
    flags = {name: (t.unsigned_weights, t.unsigned_activations) for name, t in QDQ_TARGETS.items()}
    assert flags == {"ort-cpu": (True, True), "ort-cpu-vnni": (False, True), "none": (False, False)}
    with pytest.raises(ValueError, match="unknown QDQ target 'tflite'; available: ort-cpu, ort-cpu-vnni, none"):
        get_target("tflite")
