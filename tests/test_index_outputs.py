"""Index outputs (issue 25, scope 3): `ptq report` accepts a model whose output is an int64 ArgMax and reports
that output's agreement with float (the logits feeding it compared like any layer); `ptq run` names the figure
it prints; top-1/top-5 only for class scores, top-5 only from 10 classes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import ptq
from ptq.cli import main

T, D = 6, 4


def tagger(classes: int = 12) -> onnx.ModelProto:
    """x [N, T, D] -> MatMul -> logits [N, T, classes] -> ArgMax(axis -1) -> tags int64 [N, T]."""
    w = np.random.default_rng(0).normal(0, 2.0, (D, classes)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["logits"], name="dense"),
             helper.make_node("ArgMax", ["logits"], ["tags"], axis=-1, keepdims=0, name="argmax")]
    graph = helper.make_graph(nodes, "tagger", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, D])],
                              [helper.make_tensor_value_info("tags", TensorProto.INT64, ["N", T])],
                              [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def classifier(classes: int) -> onnx.ModelProto:
    w = np.random.default_rng(1).normal(0, 2.0, (D, classes)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["logits"], name="dense")]
    graph = helper.make_graph(nodes, "classifier", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", D])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
                              [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _samples(folder: Path, shape: tuple, count: int = 12) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(2)
    for k in range(count):
        np.save(folder / f"s{k:02d}.npy", rng.normal(0, 1, shape).astype(np.float32))
    return folder


def test_an_argmax_output_is_reported_and_run_by_its_agreement(tmp_path, capsys):
    model = tmp_path / "tagger.onnx"
    onnx.save(tagger(), model)
    data = _samples(tmp_path / "data", (T, D))
    table = ptq.calibrate(model, data=data, out=tmp_path / "cal", quiet=True).table_path
    # before: "no graph output of the model is quantized (['tags'])"
    result = ptq.report(model, quant=table, data=data, quiet=True)
    agreement = result.report.index_outputs["tags"]
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    prepared = ptq.prepare(ptq.load_model(model), ptq.load_quant_table(table))
    equal = 0
    for path in sorted(data.glob("*.npy")):
        x = np.load(path)[None]
        equal += int(np.count_nonzero(prepared.run({"x": x}).outputs["tags"] == session.run(None, {"x": x})[0]))
    assert agreement["values"] == 12 * T and agreement["equal"] == equal and agreement["agreement"] > 0.9
    assert "logits" in [layer.name for layer in result.report.layers]  # the ArgMax input, like any layer
    assert result.report.classification is None and result.report.outputs == []
    written = json.loads(json.dumps(result.report.to_dict()))
    assert written["outputs"]["index_outputs"] == [{"name": "tags", **agreement}]

    run = ptq.run(model, quant=table, data=data, quiet=True)
    assert run.output == "tags" and not run.class_scores and run.output_agreement == equal / (12 * T)
    capsys.readouterr()
    assert main(["run", str(model), "--quant", str(table), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert f"agreement of output tags with the float model {equal / (12 * T):.4f} ({equal}/{12 * T} values)" in out
    assert "top-1" not in out
    assert main(["debug", str(model), "--quant", str(table), "--data", str(data), "--auto", "1",
                 "--out", str(tmp_path / "debug")]) == 2  # a one-line error, not a StopIteration
    assert "the model's outputs are indices or booleans (['tags'])" in capsys.readouterr().err


def test_top5_only_from_ten_classes(tmp_path, capsys):
    data = _samples(tmp_path / "data", (D,))
    for classes, top5 in ((5, False), (12, True)):
        model = tmp_path / f"c{classes}.onnx"
        onnx.save(classifier(classes), model)
        table = ptq.calibrate(model, data=data, out=tmp_path / f"cal{classes}", quiet=True).table_path
        report = ptq.report(model, quant=table, data=data, quiet=True).report
        assert ("top5_agreement" in report.classification) is top5 and "top1_agreement" in report.classification
        capsys.readouterr()
        assert main(["run", str(model), "--quant", str(table), "--data", str(data)]) == 0
        assert "top-1 agreement of output logits with the float model" in capsys.readouterr().out


def test_a_probability_output_of_a_two_output_model_is_run_by_its_cosine(tmp_path, capsys):
    """p [N, 1] (a speech probability) beside a second output: no classes, no axis to take the argmax of
    (before: `ptq run` refused a model with two outputs)."""
    w = np.random.default_rng(3).normal(0, 1.0, (D, 1)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["logit"], name="dense"),
             helper.make_node("Sigmoid", ["logit"], ["p"], name="sigmoid"),
             helper.make_node("Relu", ["x"], ["state_out"], name="state")]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", D])],
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 1]),
                               helper.make_tensor_value_info("state_out", TensorProto.FLOAT, ["N", D])],
                              [numpy_helper.from_array(w, "W")])
    model = tmp_path / "two.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    data = _samples(tmp_path / "data", (D,))
    table = ptq.calibrate(model, data=data, out=tmp_path / "cal", quiet=True).table_path
    run = ptq.run(model, quant=table, data=data, quiet=True)
    assert run.output == "p" and run.output_agreement is None and 0.999 < run.output_cosine <= 1.0
    capsys.readouterr()
    assert main(["run", str(model), "--quant", str(table), "--data", str(data)]) == 0
    assert f"cosine of output p with the float model {run.output_cosine:.6f} (mean over 12 samples)" in \
        capsys.readouterr().out
