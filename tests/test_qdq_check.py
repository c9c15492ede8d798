"""The check of the exported QDQ model in onnxruntime (ptq.qdq.check) and how `ptq calibrate` reports it."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ptq.qdq.output
from ptq.cli import main
from ptq.calibration.pipeline import calibrate
from ptq.qdq.check import CHECK_SAMPLES, TOLERANCE, QDQCheck, QDQCheckError, check_qdq
from ptq.qdq.export import export_qdq
from tiny_models import conv_relu_gemm, write_tiny_case

RAW_FLAGS = ["--mean", "0", "--std", "255", "--crop-ratio", "1"]


@pytest.fixture()
def tiny(tmp_path):
    model_path, images, _ = write_tiny_case(tmp_path, 10)
    return model_path, images


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_check_figures_are_the_mean_output_cosines_of_both_runs():
    model = conv_relu_gemm(batch=None)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (12, 3, 8, 8)).astype(np.float32)
    result = calibrate(model, x, write_qdq=False)
    qdq = export_qdq(result.graph, result.table, "ort-cpu")
    feeds = [{"input": x[k: k + 1]} for k in range(5)]
    check = check_qdq(model, qdq, feeds, "ort-cpu")

    def figure(level):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        qdq_session = ort.InferenceSession(qdq.SerializeToString(), options, providers=["CPUExecutionProvider"])
        float_session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return np.mean([_cosine(float_session.run(None, f)[0], qdq_session.run(None, f)[0]) for f in feeds])

    assert check.samples == 5 and check.target == "ort-cpu"
    assert check.cosine_unoptimized == pytest.approx(figure(ort.GraphOptimizationLevel.ORT_DISABLE_ALL), abs=1e-12)
    assert check.cosine_optimized == pytest.approx(figure(ort.GraphOptimizationLevel.ORT_ENABLE_ALL), abs=1e-12)
    assert 0.9 < check.cosine_optimized < 1 and check.holds


def test_check_without_samples_or_with_a_broken_model_raises_check_error():
    model = conv_relu_gemm(batch=None)
    with pytest.raises(QDQCheckError, match="no samples"):
        check_qdq(model, model, [], "none")
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(QDQCheckError):
        check_qdq(model, broken, [{"input": np.zeros((1, 3, 8, 8), np.float32)}], "none")


def test_warning_only_beyond_the_tolerance_with_advice_per_target():
    assert QDQCheck("ort-cpu", 8, 0.9934, 0.9934 - TOLERANCE / 2).warning() is None
    lost = QDQCheck("none", 8, 0.9934, 0.9357)
    assert not lost.holds and lost.gap == pytest.approx(0.0577)
    assert "0.9357 against 0.9934" in lost.warning() and "--qdq-target ort-cpu" in lost.warning()
    assert "ORT_ENABLE_BASIC" in QDQCheck("ort-cpu", 8, 0.99, 0.95).warning()
    assert QDQCheck("ort-cpu", 1, 0.5, 0.25).summary() == (
        "QDQ model in onnxruntime (target ort-cpu), output cosine to float on 1 calibration sample: 0.5000 with "
        "graph optimizations off, 0.2500 with the default (on)")


def test_calibrate_checks_up_to_8_calibration_samples(tiny, tmp_path):
    model_path, images = tiny
    result = calibrate(model_path, images, tmp_path / "out", check_qdq=True, qdq_target="none")
    assert result.qdq_check is not None and result.qdq_check.samples == CHECK_SAMPLES == 8
    assert result.qdq_check.target == result.qdq_target == "none"
    assert result.qdq_check.summary() in result.summary()
    few = calibrate(model_path, images, None, check_qdq=True, num_images=3)
    assert few.qdq_check.samples == 3
    assert calibrate(model_path, images, None).qdq_check is None  # the API checks only when asked


def test_cli_prints_both_figures_and_the_target(tiny, tmp_path, capsys):
    model_path, images = tiny
    assert main(["calibrate", str(model_path), "--images", str(images), "--out", str(tmp_path / "o"),
                 *RAW_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "(target ort-cpu)" in out
    line = next(l for l in out.splitlines() if l.startswith("QDQ model in onnxruntime"))
    assert "with graph optimizations off" in line and "with the default (on)" in line
    qdq = onnx.load(str(tmp_path / "o" / "tiny.qdq.onnx"))
    assert {i.data_type for i in qdq.graph.initializer if i.name.endswith("W_quantized")} == {onnx.TensorProto.UINT8}


@pytest.mark.parametrize("flag", ["--no-check", "-q"])
def test_cli_no_check_and_quiet_skip_the_check(tiny, tmp_path, capsys, monkeypatch, flag):
    model_path, images = tiny

    def refuse(*args, **kwargs):
        raise AssertionError("the check ran")

    monkeypatch.setattr(ptq.qdq.output, "check_qdq", refuse)
    assert main(["calibrate", str(model_path), "--images", str(images), "--out", str(tmp_path / "o"),
                 *RAW_FLAGS, flag]) == 0
    assert "QDQ model in onnxruntime" not in capsys.readouterr().out


def test_cli_target_none_writes_int8_weights_and_a_gap_is_a_warning(tiny, tmp_path, caplog, monkeypatch):
    model_path, images = tiny
    monkeypatch.setattr(ptq.qdq.output, "check_qdq", lambda float_model, qdq, feeds, target, source:
                        QDQCheck(target, len(feeds), 0.99, 0.9))
    with caplog.at_level(logging.WARNING, logger="ptq"):
        assert main(["calibrate", str(model_path), "--images", str(images), "--out", str(tmp_path / "o"),
                     *RAW_FLAGS, "--target", "NONE"]) == 0
    # (the tiny calibration set also draws the few-images warning of the ptq.data logger)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name != "ptq.data"]
    assert len(warnings) == 1 and "optimized run of the QDQ model loses accuracy: output cosine to float 0.9000 " \
        "against 0.9900" in warnings[0]
    qdq = onnx.load(str(tmp_path / "o" / "tiny.qdq.onnx"))
    assert {i.data_type for i in qdq.graph.initializer if i.name.endswith("W_quantized")} == {onnx.TensorProto.INT8}


def test_cli_rejects_an_unknown_target(tiny, tmp_path, capsys):
    model_path, images = tiny
    with pytest.raises(SystemExit):
        main(["calibrate", str(model_path), "--images", str(images), "--target", "tflite"])
    assert "ort-cpu" in capsys.readouterr().err


def test_a_failing_check_is_a_warning_not_an_error(tiny, tmp_path, caplog, monkeypatch):
    model_path, images = tiny

    def fail(*args, **kwargs):
        raise QDQCheckError("onnxruntime has no CPUExecutionProvider")

    monkeypatch.setattr(ptq.qdq.output, "check_qdq", fail)
    with caplog.at_level(logging.WARNING, logger="ptq"):
        result = calibrate(model_path, images, tmp_path / "o", check_qdq=True)
    assert result.qdq_check is None and result.qdq_path.exists()
    assert "could not check the QDQ model in onnxruntime: onnxruntime has no CPUExecutionProvider" in caplog.text
