"""Empirical bias correction: with the corrected bias, the quantized-weight layer's per-channel output mean
equals the float layer's on the images (closed form: the shift is linear in the mean input patch)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ptq.adjust.bias_correction import correct_biases, mean_patches, recorrected_biases
from ptq.core.graph import load_model
from ptq.core.qparams import compute_qparams
from ptq.table.quant_table import CalibrationOptions, QuantTable, TensorEntry
from tests.tiny_models import make_model


def grouped_conv_gemm(w, b, wg, bg) -> onnx.ModelProto:
    """input (N,4,9,9) -> Conv 3x3 group 2, stride 2, asymmetric pads -> Relu -> GlobalAveragePool -> Flatten
    -> Gemm (transB)."""
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for a, n in ((w, "W"), (b, "B"), (wg, "WG"), (bg, "BG"))]
    nodes = [
        helper.make_node("Conv", ["input", "W", "B"], ["c"], pads=[1, 0, 2, 1], strides=[2, 2], group=2, name="conv"),
        helper.make_node("Relu", ["c"], ["a"], name="relu"),
        helper.make_node("GlobalAveragePool", ["a"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "WG", "BG"], ["out"], transB=1, name="gemm"),
    ]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4, 9, 9])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3])
    return make_model(nodes, [inp], [out], inits)


def random_grouped_conv_gemm(rng: np.random.Generator) -> onnx.ModelProto:
    """`grouped_conv_gemm` with weights and biases drawn from `rng` (conv weights N(0, 0.4), biases N(0, 0.1),
    Gemm weights N(0, 0.5))."""
    return grouped_conv_gemm(rng.normal(0, 0.4, (6, 2, 3, 3)), rng.normal(0, 0.1, 6), rng.normal(0, 0.5, (3, 6)),
                             rng.normal(0, 0.1, 3))


def run(model, x, names):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in names:
        if name not in [o.name for o in m.graph.output]:
            m.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(names, sess.run(names, {"input": x})))


def coarse_table(w, wg) -> QuantTable:
    """4-bit per-tensor weights: rounding errors large enough to plant a visible mean shift."""
    tensors = {}
    for name, value in (("W", w), ("WG", wg)):
        m = float(np.max(np.abs(value)))
        qp = compute_qparams(np.array([-m]), np.array([m]), 4, symmetric=True, narrow=True)
        tensors[name] = TensorEntry("weight", "extrema", np.array([-m]), np.array([m]), qp)
    return QuantTable(CalibrationOptions(weight_bits=4, per_channel=False), tensors)


def with_weights(model, values: dict) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for init in m.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(values[init.name].astype(np.float32), init.name))
    return m


def test_corrected_bias_removes_the_planted_mean_shift():
    rng = np.random.default_rng(0)
    float_model = random_grouped_conv_gemm(rng)
    x = (rng.normal(0.8, 1.0, (10, 4, 9, 9)) + np.arange(4)[None, :, None, None]).astype(np.float32)
    graph = load_model(float_model)
    table = coarse_table(graph.initializers["W"], graph.initializers["WG"])
    corrected, log = correct_biases(graph, table, iter([x[:4], x[4:]]))
    assert set(log.corrected) == {"conv", "gemm"}

    quantized = {k: table.tensors[k].qparams.dequantize(table.tensors[k].qparams.quantize(graph.initializers[k]))
                 for k in ("W", "WG")}
    ref = run(float_model, x, ["c", "out"])
    planted = run(with_weights(float_model, quantized), x, ["c"])["c"]
    new_b = {i.name: numpy_helper.to_array(i) for i in corrected.graph.initializer}["B"]
    fixed = run(with_weights(float_model, {**quantized, "B": new_b}), x, ["c"])["c"]

    shift_before = (planted - ref["c"]).mean(axis=(0, 2, 3))
    shift_after = (fixed - ref["c"]).mean(axis=(0, 2, 3))
    assert np.max(np.abs(shift_before)) > 0.05  # 4-bit weights planted a visible per-channel shift
    np.testing.assert_allclose(shift_after, 0, atol=2e-5)

    # the Gemm: its input is the float model's pooled activation; E[(WG_q - WG) f] is removed the same way
    f = run(float_model, x, ["f"])["f"].astype(np.float64)
    new_bg = {i.name: numpy_helper.to_array(i) for i in corrected.graph.initializer}["BG"]
    gemm_q = f @ quantized["WG"].astype(np.float64).T + new_bg
    gemm_f = f @ graph.initializers["WG"].astype(np.float64).T + graph.initializers["BG"]
    np.testing.assert_allclose((gemm_q - gemm_f).mean(axis=0), 0, atol=2e-5)


def test_weights_are_untouched_and_layers_without_a_table_entry_are_not_corrected():
    rng = np.random.default_rng(1)
    graph = load_model(random_grouped_conv_gemm(rng))
    table = coarse_table(graph.initializers["W"], graph.initializers["WG"])
    del table.tensors["WG"]
    x = rng.normal(0, 1, (3, 4, 9, 9)).astype(np.float32)
    corrected, log = correct_biases(graph, table, iter([x]))
    values = {i.name: numpy_helper.to_array(i) for i in corrected.graph.initializer}
    assert set(log.corrected) == {"conv"}
    np.testing.assert_array_equal(values["W"], graph.initializers["W"])
    np.testing.assert_array_equal(values["BG"], graph.initializers["BG"])
    assert not np.array_equal(values["B"], graph.initializers["B"])


def test_recorrected_bias_moves_the_correction_to_the_new_grid():
    """A graph corrected for 4-bit weights, its conv weight moved to 6 bits: the re-corrected bias removes the
    mean shift of the 6-bit weights (and is no longer right for the 4-bit ones)."""
    rng = np.random.default_rng(2)
    float_model = random_grouped_conv_gemm(rng)
    x = (rng.normal(0.8, 1.0, (10, 4, 9, 9)) + np.arange(4)[None, :, None, None]).astype(np.float32)
    graph = load_model(float_model)
    old = coarse_table(graph.initializers["W"], graph.initializers["WG"])
    corrected = load_model(correct_biases(graph, old, iter([x]))[0])
    m = float(np.max(np.abs(graph.initializers["W"])))
    qp6 = compute_qparams(np.array([-m]), np.array([m]), 6, symmetric=True, narrow=True)
    new = QuantTable(old.options, {**old.tensors, "W": TensorEntry("weight", "extrema", np.array([-m]),
                                                                     np.array([m]), qp6)})
    patches = mean_patches(corrected, [n for n in corrected.nodes if n.op_type == "Conv"], iter([x]))
    biases = recorrected_biases(corrected, old, new, ["W"], patches)
    assert set(biases) == {"B"}  # only the moved weight's layer

    w6 = qp6.dequantize(qp6.quantize(graph.initializers["W"]))
    ref = run(float_model, x, ["c"])["c"]
    fixed = run(with_weights(float_model, {"W": w6, "B": biases["B"]}), x, ["c"])["c"]
    stale = run(with_weights(float_model, {"W": w6, "B": corrected.initializers["B"]}), x, ["c"])["c"]
    assert np.max(np.abs((stale - ref).mean(axis=(0, 2, 3)))) > 0.02  # the 4-bit correction is wrong for 6 bits
    np.testing.assert_allclose((fixed - ref).mean(axis=(0, 2, 3)), 0, atol=2e-5)


def test_recorrected_biases_from_kept_shifts_are_the_computed_ones(monkeypatch):
    """`shifts`: a weight moved between the same grids again reads the shift kept (no rounding computed again),
    the same biases; another grid is computed anew."""
    import ptq.adjust.bias_correction as bc

    rng = np.random.default_rng(3)
    x = rng.normal(0.5, 1.0, (6, 4, 9, 9)).astype(np.float32)
    graph = load_model(random_grouped_conv_gemm(rng))
    old = coarse_table(graph.initializers["W"], graph.initializers["WG"])
    corrected = load_model(correct_biases(graph, old, iter([x]))[0])
    patches = mean_patches(corrected, [n for n in corrected.nodes if n.op_type == "Conv"], iter([x]))
    m = float(np.max(np.abs(graph.initializers["W"])))

    def moved(bits):
        qp = compute_qparams(np.array([-m]), np.array([m]), bits, symmetric=True, narrow=True)
        return QuantTable(old.options, {**old.tensors, "W": TensorEntry("weight", "extrema", np.array([-m]),
                                                                         np.array([m]), qp)})

    six, seven = moved(6), moved(7)
    fresh = recorrected_biases(corrected, old, six, ["W"], patches)
    calls = []
    rounding = bc.rounding_delta
    monkeypatch.setattr(bc, "rounding_delta", lambda w, qp: calls.append(qp) or rounding(w, qp))
    shifts: dict = {}
    first = recorrected_biases(corrected, old, six, ["W"], patches, shifts)
    again = recorrected_biases(corrected, old, six, ["W"], patches, shifts)
    assert len(calls) == 2 and len(shifts) == 1  # the old and the new rounding, once
    assert np.array_equal(first["B"], fresh["B"]) and np.array_equal(again["B"], fresh["B"])
    other = recorrected_biases(corrected, old, seven, ["W"], patches, shifts)
    assert len(calls) == 4 and len(shifts) == 2
    assert not np.array_equal(other["B"], fresh["B"])
