"""The QDQ export of what a tuned or edited table holds besides 8-bit integers: layers the table marks float
(`"float": true`) and 16-bit tensors. The reference is `ptq run`'s integer graph on the same table
(`ptq.engine.executor.prepare`), against which onnxruntime runs the exported model, with graph optimizations off (the
QDQ graph's own arithmetic) and at its default (fused kernels, what a user deploying the model gets)."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from ptq.cli import main
from ptq.core.graph import load_model
from ptq.engine.executor import prepare
from ptq.calibration.pipeline import calibrate
from ptq.qdq.export import MS_DOMAIN, check_table_matches, export_qdq
from ptq.table.quant_table import load_quant_table
from ptq.table.edit import edit_entry, with_float
from test_graph import vi
from tiny_models import conv_relu_gemm, make_model

pytestmark = pytest.mark.skipif("CPUExecutionProvider" not in ort.get_available_providers(),
                                reason="onnxruntime has no CPU provider")


def ort_run(model: onnx.ModelProto, feeds: dict, optimized: bool, saved_to=None) -> np.ndarray:
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if saved_to is not None:  # the graph onnxruntime really runs, after its optimizations
        options.optimized_model_filepath = str(saved_to)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def initializers(model: onnx.ModelProto) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def assert_runs_as_ptq(qdq: onnx.ModelProto, graph, table, x: np.ndarray, name: str, lsb: float, tmp_path=None):
    """onnxruntime on the QDQ model, optimizations off and on, within one output LSB of the integer graph."""
    prepared = prepare(graph, table)
    want = np.concatenate([prepared.run({name: x[k:k + 1]}).outputs[graph.outputs[0]] for k in range(len(x))])
    for optimized in (False, True):
        saved = tmp_path / "optimized.onnx" if optimized and tmp_path is not None else None
        got = np.concatenate([ort_run(qdq, {name: x[k:k + 1]}, optimized, saved) for k in range(len(x))])
        assert np.abs(got - want).max() <= lsb * 1.001, (optimized, np.abs(got - want).max() / lsb)
    return want


@pytest.fixture(scope="module")
def tiny():
    """The Conv/Clip/Gemm model (conv -> act -> pool -> flat -> logits), calibrated on 16 random samples."""
    rng = np.random.default_rng(0)
    model = conv_relu_gemm(batch=None)
    calib = rng.uniform(0, 1, (16, 3, 8, 8)).astype(np.float32)
    result = calibrate(model, calib, write_qdq=False)
    return result.graph, result.table, rng.uniform(0, 1, (6, 3, 8, 8)).astype(np.float32)


def test_a_float_marked_conv_keeps_float_weights_and_runs_as_the_integer_graph(tmp_path):
    """`act` marked float: the executor runs its layer (the Conv and the Clip fused into it) in float. The QDQ
    model keeps that Conv's weight and bias float (the Gemm's stay quantized), and onnxruntime, optimized or
    not, computes what `ptq run` computes on the marked table, which differs from the unmarked table's run
    (4-bit weights, so that floating the Conv moves the logits by several LSBs)."""
    rng = np.random.default_rng(0)
    result = calibrate(conv_relu_gemm(batch=None), rng.uniform(0, 1, (16, 3, 8, 8)).astype(np.float32),
                       weight_bits=4, write_qdq=False)
    graph, table, x = result.graph, result.table, rng.uniform(0, 1, (6, 3, 8, 8)).astype(np.float32)
    marked = with_float(table, ["act"])
    qdq = export_qdq(graph, marked)
    stored, original = initializers(qdq), graph.initializers
    np.testing.assert_array_equal(stored["W"], original["W"])
    np.testing.assert_array_equal(stored["B"], original["B"])
    assert stored["W"].dtype == np.float32 and "W_quantized" not in stored and "B_quantized" not in stored
    assert "WG" not in stored and stored["WG_quantized"].dtype == np.uint8  # ort-cpu: int8 codes + 128
    conv = next(n for n in qdq.graph.node if n.op_type == "Conv")
    assert list(conv.input[1:]) == ["W", "B"]
    lsb = float(marked.qparams("logits").scale[0])
    want = assert_runs_as_ptq(qdq, graph, marked, x, "input", lsb, tmp_path)
    # onnxruntime kept the Conv in float: no integer kernel of its own, no weight it quantized itself
    ran = onnx.load(str(tmp_path / "optimized.onnx"))
    assert not [n for n in ran.graph.node if n.op_type == "QLinearConv" or "weight_q" in n.name]
    plain = prepare(graph, table)
    unmarked = np.concatenate([plain.run({"input": x[k:k + 1]}).outputs["logits"] for k in range(len(x))])
    assert np.abs(unmarked - want).max() > 2 * lsb  # the flag changes the result: the comparison can fail


def test_the_plain_table_quantizes_that_conv(tiny):
    """Without the flag the same Conv reads dequantized weights and an int32 bias, as before."""
    graph, table, _ = tiny
    qdq = export_qdq(graph, table)
    stored = initializers(qdq)
    assert "W" not in stored and "B" not in stored and stored["B_quantized"].dtype == np.int32
    assert not [n for n in qdq.graph.node if n.output[0].endswith("_float_dq")]


def test_a_weight_shared_with_an_integer_conv_is_read_from_a_float_copy(tmp_path):
    rng = np.random.default_rng(6)
    w = rng.normal(0, 0.5, (3, 3, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["a"], name="first"),
             helper.make_node("Conv", ["a", "W"], ["y"], name="second")]
    model = make_model(nodes, [vi("x", [1, 3, 4, 4])], [vi("y", [1, 3, 4, 4])], [numpy_helper.from_array(w, "W")])
    result = calibrate(model, rng.normal(size=(8, 3, 4, 4)).astype(np.float32), write_qdq=False)
    marked = with_float(result.table, ["a"])
    qdq = export_qdq(result.graph, marked)
    stored = initializers(qdq)
    convs = {n.name: n for n in qdq.graph.node if n.op_type == "Conv"}
    assert convs["first"].input[1] == "W_float" and convs["second"].input[1] == "W"
    np.testing.assert_array_equal(stored["W_float"], w)
    assert "W" not in stored and "W_quantized" in stored
    x = rng.normal(size=(4, 3, 4, 4)).astype(np.float32)
    assert_runs_as_ptq(qdq, result.graph, marked, x, "x", float(marked.qparams("y").scale[0]), tmp_path)


def conv_bn_relu_gemm(rng) -> onnx.ModelProto:
    """x -> Conv -> BatchNormalization -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> logits."""
    c = 4
    inits = {
        "W": rng.normal(0, 0.4, (c, 3, 3, 3)), "B": rng.normal(0, 0.1, c), "gamma": rng.uniform(0.5, 1.5, c),
        "beta": rng.normal(0, 0.2, c), "mean": rng.normal(0, 0.2, c), "var": rng.uniform(0.5, 2.0, c),
        "WG": rng.normal(0, 0.5, (5, c)), "BG": rng.normal(0, 0.1, 5),
    }
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["conv", "gamma", "beta", "mean", "var"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["relu"], name="relu"),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"], name="pool"),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "WG", "BG"], ["logits"], name="gemm", transB=1),
    ]
    return make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("logits", [1, 5])],
                      [numpy_helper.from_array(v.astype(np.float32), n) for n, v in inits.items()])


@pytest.mark.parametrize("tensor", ["relu", "flat"])
def test_each_node_of_a_float_layer_runs_in_float(tmp_path, tensor):
    """`relu` marked float floats Conv, BatchNormalization and Relu (the layer the rewrites fuse); `flat` a
    Flatten (no weights: its QDQ model is the plain one). Either way onnxruntime computes `ptq run`'s result."""
    rng = np.random.default_rng(11)
    model = conv_bn_relu_gemm(rng)
    result = calibrate(model, rng.normal(size=(16, 3, 8, 8)).astype(np.float32), write_qdq=False)
    marked = with_float(result.table, [tensor])
    qdq = export_qdq(result.graph, marked)
    stored = initializers(qdq)
    assert ("W" in stored) == (tensor == "relu") and "WG_quantized" in stored
    x = rng.normal(size=(4, 3, 8, 8)).astype(np.float32)
    assert_runs_as_ptq(qdq, result.graph, marked, x, "x", float(marked.qparams("logits").scale[0]))


def test_16_bit_activation_and_weight_of_an_edited_table_run_in_onnxruntime(tiny):
    """`act` and the Gemm weight `WG` at 16 bits (`ptq table set --bits 16`, as `ptq tune` writes them): stored
    as uint16 / int16 with onnxruntime's com.microsoft Q/DQ (opset 17 < 21), computed as `ptq run` does."""
    graph, table, x = tiny
    wide = edit_entry(edit_entry(table, "act", bits=16), "WG", bits=16)
    assert wide.qparams("act").bits == wide.qparams("WG").bits == 16
    qdq = export_qdq(graph, wide)
    stored = initializers(qdq)
    assert stored["act_zero_point"].dtype == np.uint16 and stored["WG_quantized"].dtype == np.int16
    dq = {n.output[0]: n for n in qdq.graph.node if n.op_type == "DequantizeLinear"}
    assert dq["act"].domain == dq["WG"].domain == MS_DOMAIN and dq["conv"].domain == ""
    assert_runs_as_ptq(qdq, graph, wide, x, "input", float(wide.qparams("logits").scale[0]))


@pytest.mark.parametrize("opset", [11, 17, 21])
def test_a_float_conv_reading_a_16_bit_input_at_any_opset(opset):
    """The float Conv's own DQ has an axis: an opset 11 model is converted to 13; its 16-bit codes use the
    com.microsoft DQ before opset 21. Per-tensor weights, so that only the float layer asks for an axis."""
    rng = np.random.default_rng(3)
    model = conv_relu_gemm(batch=None, opset=opset)
    result = calibrate(model, rng.uniform(0, 1, (16, 3, 8, 8)).astype(np.float32), per_channel=False,
                       write_qdq=False)
    table = edit_entry(with_float(result.table, ["act"]), "input", bits=16)
    qdq = export_qdq(result.graph, table)
    assert max(o.version for o in qdq.opset_import if o.domain == "") == max(opset, 13)
    own = next(n for n in qdq.graph.node if n.output[0] == "input_dq_float_dq")
    assert own.domain == ("" if opset >= 21 else MS_DOMAIN)
    x = rng.uniform(0, 1, (3, 3, 8, 8)).astype(np.float32)
    assert_runs_as_ptq(qdq, result.graph, table, x, "input", float(table.qparams("logits").scale[0]))


def test_a_table_that_does_not_match_the_model_is_a_one_line_error(tiny):
    graph, table, _ = tiny
    check_table_matches(graph, table)
    other = load_model(conv_bn_relu_gemm(np.random.default_rng(1)))
    with pytest.raises(ValueError, match=r"^the quant table does not match the model: 2 of its tensors are not in "
                                         r"the model \('input', 'act'\); was it calibrated on this model\?$"):
        check_table_matches(other, table)
    partial = dataclasses.replace(table, tensors={n: e for n, e in table.tensors.items() if n != "pool"})
    with pytest.raises(ValueError, match=r"1 activations of the model have no entry \('pool'\)"):
        check_table_matches(graph, partial)
    swapped = dataclasses.replace(table, tensors={**table.tensors, "W": table.tensors["act"]})
    with pytest.raises(ValueError, match=r"the kind \(activation or weight\) it gives 'W' is not the model's"):
        check_table_matches(graph, swapped)


# The bundled EfficientNet-Lite0: one Conv floated and one activation at 16 bits with `ptq table set`, the QDQ
# model written by `ptq table export`, run by onnxruntime at its default optimizations on 4 eval photos.

def test_efficientnet_edited_table_exports_a_qdq_model_that_agrees_with_ptq_run(model_path, calib_dir, eval_dir,
                                                                                 tmp_path, capsys):
    from ptq.data.images import ImageLog, Preprocess, load_image, select_files
    from ptq.calibration.pipeline import input_spec

    assert main(["calibrate", str(model_path), "--images", str(calib_dir), "--out", str(tmp_path), "-q",
                 "--num-images", "4", "--no-check"]) == 0
    table_path, edited = tmp_path / "efficientnet_lite0.quant.json", tmp_path / "edited.quant.json"
    assert main(["table", "set", str(table_path), "getitem_132", "--float", "--out", str(edited)]) == 0
    assert main(["table", "set", str(edited), "getitem_6", "--bits", "16"]) == 0
    capsys.readouterr()
    assert main(["table", "export", str(model_path), "--quant", str(edited), "--images", str(calib_dir),
                 "--num-images", "2"]) == 0
    out = capsys.readouterr().out
    assert f"QDQ model: {tmp_path / 'edited.qdq.onnx'} (target ort-cpu)" in out
    assert "output cosine to float on 2 samples" in out
    assert "1 node(s) in float (weights and biases kept float): node_Conv_869 ('getitem_132')" in out
    qdq = onnx.load(str(tmp_path / "edited.qdq.onnx"))
    conv = next(n for n in qdq.graph.node if n.name == "node_Conv_869")
    assert initializers(qdq)[conv.input[1]].dtype == np.float32

    table, graph = load_quant_table(edited), load_model(model_path)
    pre = Preprocess(**table.options.preprocess)
    files = select_files(eval_dir, ImageLog())[:4]
    x = np.concatenate([load_image(p, pre, input_spec(graph, pre))[None] for p in files])
    prepared = prepare(graph, table)
    assert [f.name for f in prepared.float_nodes] == ["node_Conv_869"]
    ints = [prepared.run({"input": x[k:k + 1]}).outputs["logits"] for k in range(len(x))]
    qdqs = [ort_run(qdq, {"input": x[k:k + 1]}, optimized=True) for k in range(len(x))]
    floats = [ort_run(graph.model, {"input": x[k:k + 1]}, optimized=True) for k in range(len(x))]
    agreement = [cosine(i, q) for i, q in zip(ints, qdqs)]
    assert np.mean(agreement) >= 0.998 and min(agreement) >= 0.995, agreement
    to_float = [np.mean([cosine(a, f) for a, f in zip(run, floats)]) for run in (ints, qdqs)]
    assert abs(to_float[0] - to_float[1]) <= 0.002, to_float
