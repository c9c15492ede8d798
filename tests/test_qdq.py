import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.calibration.entries import build_table
from ptq.calibration.pipeline import calibrate
from ptq.engine.float_run import collect_statistics
from ptq.core.graph import load_model
from ptq.qdq.export import MS_DOMAIN, export_qdq
from ptq.core.qparams import QParams
from ptq.table.quant_table import CalibrationOptions, QuantTable, TensorEntry
from calibrators import required_stats
from tiny_models import conv_relu_gemm, make_model
from test_graph import shape_subgraph_model, vi


def run(model: onnx.ModelProto, feeds: dict, optimized: bool = False) -> list:
    """onnxruntime, by default with graph optimizations off: the QDQ graph's own semantics, op by op."""
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def entry(kind, qp):
    lo, hi = qp.real_range()
    return TensorEntry(kind, "manual", lo, hi, qp)


def table(**entries):
    return QuantTable(CalibrationOptions(), dict(entries))


def fake_quant(x, scale, zp, qmin, qmax):
    """Independent numpy reference: x_q = clamp(rint(x / s) + zp), back to float."""
    q = np.clip(np.rint(np.asarray(x, np.float64) / scale) + zp, qmin, qmax)
    return (q - zp) * scale


def conv1x1_model(opset=17):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.5, (2, 3, 1, 1)).astype(np.float32)
    b = np.array([0.3, -0.2], np.float32)
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["y"])]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")]
    return make_model(nodes, [vi("x", [1, 3, 4, 4])], [vi("y", [1, 2, 4, 4])], inits, opset=opset), w, b


def test_conv_qdq_matches_numpy_fake_quant_reference():
    model, w, b = conv1x1_model()
    g = load_model(model)
    s_in, zp_in, s_out, zp_out = 0.02, -10, 0.05, 3
    amax = np.abs(w).reshape(2, -1).max(axis=1)
    s_w = (amax / 127).astype(np.float32).astype(np.float64)
    t = table(
        x=entry("activation", QParams(np.float32(s_in), zp_in, 8, True)),
        W=entry("weight", QParams(s_w, [0, 0], 8, True, axis=0, narrow=True)),
        y=entry("activation", QParams(np.float32(s_out), zp_out, 8, True)),
    )
    qdq = export_qdq(g, t)
    x = np.random.default_rng(1).uniform(-2.5, 2.5, (1, 3, 4, 4)).astype(np.float32)
    (got,) = run(qdq, {"x": x})

    s_in, s_out = float(np.float32(s_in)), float(np.float32(s_out))
    xq = fake_quant(x, s_in, zp_in, -128, 127)
    wq = fake_quant(w.reshape(2, 3), s_w[:, None], 0, -127, 127)
    bias_scale = (np.float32(s_in) * s_w.astype(np.float32)).astype(np.float64)
    bq = np.rint(b / bias_scale) * bias_scale
    acc = np.einsum("oc,nchw->nohw", wq, xq) + bq[None, :, None, None]
    expected = fake_quant(acc, s_out, zp_out, -128, 127)
    assert np.abs(got - expected).max() <= s_out * 1.001  # float32 accumulation may flip a rounding tie
    assert np.mean(np.isclose(got, expected, atol=1e-6)) > 0.95


@pytest.mark.parametrize("target, dtype, shift", [("none", np.int8, 0), ("ort-cpu", np.uint8, 128)])
def test_weights_are_stored_quantized_and_bias_as_int32(target, dtype, shift):
    """`none` stores the table's int8 codes; `ort-cpu` the same codes + 128 as uint8 (zero point + 128)."""
    model, w, b = conv1x1_model()
    g = load_model(model)
    s_w = np.array([0.004, 0.003])
    t = table(
        x=entry("activation", QParams(0.02, 0, 8, True)),
        W=entry("weight", QParams(s_w, [0, 0], 8, True, axis=0)),
    )
    qdq = export_qdq(g, t, target)
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    assert "W" not in inits and "B" not in inits
    wq = inits["W_quantized"]
    assert wq.dtype == dtype and inits["W_zero_point"].dtype == dtype
    np.testing.assert_array_equal(inits["W_zero_point"], [shift, shift])
    s_w32 = s_w.astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(wq, np.clip(np.rint(w / s_w32[:, None, None, None]), -128, 127) + shift)
    bq = inits["B_quantized"]
    bias_scale = np.float32(0.02) * s_w.astype(np.float32)
    assert bq.dtype == np.int32
    np.testing.assert_array_equal(bq, np.rint(b.astype(np.float64) / bias_scale.astype(np.float64)))
    np.testing.assert_array_equal(inits["B_scale"], bias_scale)
    np.testing.assert_array_equal(inits["B_zero_point"], [0, 0])
    dq = {n.output[0]: n for n in qdq.graph.node if n.op_type == "DequantizeLinear"}
    assert helper.get_attribute_value(dq["W"].attribute[0]) == 0 and dq["B"].input[0] == "B_quantized"


def identity_model(opset=17):
    nodes = [helper.make_node("Neg", ["x"], ["y"])]
    return make_model(nodes, [vi("x", [1, 64])], [vi("y", [1, 64])], opset=opset)


@pytest.mark.parametrize(
    "bits, signed, narrow, zp, scale",
    [(4, True, False, 2, 0.25), (4, False, False, 5, 0.25), (8, True, True, 0, 0.25), (3, True, False, -1, 0.25),
     (12, True, False, 7, 0.03125)],
)
@pytest.mark.parametrize("target", ["none", "ort-cpu"])  # ort-cpu stores signed 8-bit codes as uint8 + 128
def test_codes_narrower_than_the_container_clamp_to_their_own_range(bits, signed, narrow, zp, scale, target):
    g = load_model(identity_model(opset=21))
    qp = QParams(scale, zp, bits, signed, narrow=narrow)
    qmin, qmax = qp.qmin, qp.qmax
    assert (qmin, qmax) != ((-128, 127) if bits <= 8 else (-32768, 32767))
    qdq = export_qdq(g, table(y=entry("activation", qp)), target)
    x = np.linspace(-200, 200, 64, dtype=np.float32)[None]
    expected = fake_quant(-x, scale, zp, qmin, qmax)
    for optimized in (False, True):  # onnxruntime's graph fusions must not drop the Clip
        (got,) = run(qdq, {"x": x}, optimized)
        np.testing.assert_array_equal(got, expected.astype(np.float32))
        assert got.min() == (qmin - zp) * scale and got.max() == (qmax - zp) * scale


@pytest.mark.parametrize("opset, domain", [(17, MS_DOMAIN), (21, "")])
def test_16_bit_uses_contrib_qdq_before_opset_21(opset, domain):
    g = load_model(identity_model(opset=opset))
    qp = QParams(0.001, -5, 16, True)
    qdq = export_qdq(g, table(x=entry("activation", qp), y=entry("activation", qp)))
    q_nodes = [n for n in qdq.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert len(q_nodes) == 4 and all(n.domain == domain for n in q_nodes)
    assert not any(n.op_type == "Clip" for n in qdq.graph.node)
    x = np.linspace(-40, 40, 64, dtype=np.float32)[None]
    (got,) = run(qdq, {"x": x})
    s = float(np.float32(0.001))
    expected = fake_quant(-fake_quant(x, s, -5, -32768, 32767), s, -5, -32768, 32767)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert got.max() < 33 and got.min() > -33  # saturated at the 16-bit range, not clipped to 8 bits


def test_per_channel_weights_on_opset_11_model_are_converted_to_opset_13():
    model, w, _ = conv1x1_model(opset=11)
    g = load_model(model)
    t = table(
        x=entry("activation", QParams(0.02, 0, 8, True)),
        W=entry("weight", QParams([0.004, 0.003], [0, 0], 8, True, axis=0)),
    )
    qdq = export_qdq(g, t)
    assert max(o.version for o in qdq.opset_import if o.domain == "") == 13
    x = np.random.default_rng(2).uniform(-1, 1, (1, 3, 4, 4)).astype(np.float32)
    (got,) = run(qdq, {"x": x})
    assert got.shape == (1, 2, 4, 4) and np.isfinite(got).all()


def test_names_are_preserved_and_every_activation_is_quantized_once():
    g = load_model(conv_relu_gemm(batch=None))
    x = np.random.default_rng(3).uniform(-1, 1, (6, 3, 8, 8)).astype(np.float32)
    stats = collect_statistics(g, [x[:4], x[4:]], g.activations, required_stats(["extrema"]))
    t = build_table(g, stats, CalibrationOptions())
    qdq = export_qdq(g, t)
    assert [i.name for i in qdq.graph.input] == ["input"] and [o.name for o in qdq.graph.output] == ["logits"]
    quantized = [n.output[0] for n in qdq.graph.node if n.op_type == "DequantizeLinear"]
    assert sorted(quantized) == sorted(g.activations[1:] + ["input_dq", "W", "B", "WG", "BG"])
    (got,) = run(qdq, {"input": x})
    (ref,) = run(g.model, {"input": x})
    assert got.shape == ref.shape == (6, 5)
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def test_gemm_weight_without_transpose_is_per_channel_on_axis_1():
    rng = np.random.default_rng(4)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    w[:, 2] *= 10  # channel 2 has a 10x wider range
    nodes = [helper.make_node("Gemm", ["x", "W"], ["y"])]
    model = make_model(nodes, [vi("x", [None, 4])], [vi("y", [None, 3])], [numpy_helper.from_array(w, "W")])
    x = rng.normal(size=(5, 4)).astype(np.float32)
    result = calibrate(model, x, write_qdq=False)
    qp = result.table.tensors["W"].qparams
    assert qp.axis == 1
    np.testing.assert_allclose(qp.scale, np.abs(w).max(axis=0) / 127, rtol=1e-6)
    qdq = export_qdq(result.graph, result.table)
    (got,) = run(qdq, {"x": x})
    assert np.abs(got - x @ w).max() < 0.05 * np.abs(x @ w).max()


def test_shape_tensors_are_never_quantized():
    g = load_model(shape_subgraph_model())
    x = np.random.default_rng(5).normal(size=(1, 2, 3, 4)).astype(np.float32)
    stats = collect_statistics(g, [x], g.activations, required_stats(["extrema"]))
    t = build_table(g, stats, CalibrationOptions())
    assert set(t.tensors) == {"x", "r", "flat", "y"}
    qdq = export_qdq(g, t)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in g.model.graph.value_info}
    for node in qdq.graph.node:
        if node.op_type == "QuantizeLinear":
            assert types.get(node.input[0].replace("_prequant", ""), TensorProto.FLOAT) == TensorProto.FLOAT
    (got,) = run(qdq, {"x": x})
    assert got.shape == (1, 24)


def test_shared_weight_gets_one_dequantize():
    w = np.random.default_rng(6).normal(size=(3, 3, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["a"]), helper.make_node("Conv", ["a", "W"], ["y"])]
    model = make_model(nodes, [vi("x", [1, 3, 2, 2])], [vi("y", [1, 3, 2, 2])], [numpy_helper.from_array(w, "W")])
    x = np.random.default_rng(7).normal(size=(1, 3, 2, 2)).astype(np.float32)
    result = calibrate(model, x[None][0], write_qdq=False)
    qdq = export_qdq(result.graph, result.table)
    assert sum(n.op_type == "DequantizeLinear" and n.output[0] == "W" for n in qdq.graph.node) == 1
    (got,) = run(qdq, {"x": x})
    assert got.shape == (1, 3, 2, 2)


def test_per_channel_activation_qparams_are_exported_per_axis():
    """A per-channel activation grid (a join of widely different ranges, ptq.calibration.joined_ranges) becomes a
    per-axis QuantizeLinear -> DequantizeLinear pair whose codes onnxruntime computes channel by channel."""
    g = load_model(identity_model())
    scales = np.linspace(0.01, 0.64, 64)
    qp = QParams(scales, [0] * 64, 8, True, axis=1)
    qdq = export_qdq(g, table(y=entry("activation", qp)), target="none")
    (quantize,) = [n for n in qdq.graph.node if n.op_type == "QuantizeLinear" and n.output[0] == "y_quantized"]
    assert helper.get_attribute_value(next(a for a in quantize.attribute if a.name == "axis")) == 1
    x = np.linspace(-40, 40, 64, dtype=np.float32)[None]
    (y,) = ort.InferenceSession(qdq.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    expected = np.clip(np.round(-x / scales), -128, 127) * scales
    np.testing.assert_allclose(y, expected.astype(np.float32), rtol=1e-6)


def test_a_table_from_another_model_is_rejected():
    model, _, _ = conv1x1_model()
    g = load_model(model)
    with pytest.raises(ValueError, match="does not match its table entry"):
        export_qdq(g, table(W=entry("weight", QParams([0.1] * 5, [0] * 5, 8, True, axis=0))))
