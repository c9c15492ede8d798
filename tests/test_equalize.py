"""Cross-layer equalization: the float function is unchanged, the channel ranges of each pair match
(sqrt(r1 r2) per channel), and the adjusted model reaches every command through the quant table."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.adjust.adjusted_model import load_model_for_table
from ptq.core.graph import load_model
from ptq.adjust.equalize import equalize
from ptq.engine.executor import prepare
from ptq.data.images import Preprocess
from ptq.calibration.pipeline import calibrate
from ptq.table.quant_table import QuantTableError, load_quant_table
from tests.tiny_models import make_model, write_images

RAW = Preprocess(mean=0, std=1)


def chain(seed=0, clip_low=0.0) -> onnx.ModelProto:
    """input (N,3,10,10) -> Conv 3x3 (8) -> Clip(lo,6) -> depthwise 3x3 (8) -> Relu -> Conv 1x1 (5) -> Conv 1x1 (4),
    the channels' weight ranges spread over three decades."""
    rng = np.random.default_rng(seed)
    spread = np.logspace(-1.5, 1.5, 8)
    w1 = (rng.normal(0, 0.3, (8, 3, 3, 3)) * spread[:, None, None, None]).astype(np.float32)
    b1 = rng.normal(0, 0.5, 8).astype(np.float32)
    w2 = (rng.normal(0, 0.3, (8, 1, 3, 3)) / spread[:, None, None, None]).astype(np.float32)
    b2 = rng.normal(0, 0.2, 8).astype(np.float32)
    w3 = rng.normal(0, 0.3, (5, 8, 1, 1)).astype(np.float32)
    w4 = rng.normal(0, 0.3, (4, 5, 1, 1)).astype(np.float32)
    b4 = rng.normal(0, 0.1, 4).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in
             ((w1, "W1"), (b1, "B1"), (w2, "W2"), (b2, "B2"), (w3, "W3"), (w4, "W4"), (b4, "B4"))]
    inits += [numpy_helper.from_array(np.float32(clip_low), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
    nodes = [
        helper.make_node("Conv", ["input", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Clip", ["c1", "lo", "hi"], ["a1"], name="clip1"),
        helper.make_node("Conv", ["a1", "W2", "B2"], ["c2"], pads=[1, 1, 1, 1], group=8, strides=[2, 2], name="dw"),
        helper.make_node("Relu", ["c2"], ["a2"], name="relu"),
        helper.make_node("Conv", ["a2", "W3"], ["c3"], name="project"),
        helper.make_node("Conv", ["c3", "W4", "B4"], ["out"], name="expand"),
    ]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 10, 10])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4, 5, 5])
    return make_model(nodes, [inp], [out], inits)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def channel_max(w, axis):
    return np.abs(np.moveaxis(w, axis, 0)).reshape(w.shape[axis], -1).max(axis=1)


def test_float_function_unchanged_and_ranges_equalized():
    graph = load_model(chain())
    model, log = equalize(graph)
    assert log.pairs == [("conv1", "dw"), ("dw", "project"), ("project", "expand")]
    x = np.random.default_rng(1).normal(0, 2, (3, 3, 10, 10)).astype(np.float32)
    before, after = run(graph.model, x), run(model, x)
    assert np.max(np.abs(after - before)) <= 1e-6 * max(1.0, np.max(np.abs(before))) * 10
    w = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    # at convergence every pair's two ranges meet: max|W1'[c]| == max|W2'[:, c]|
    np.testing.assert_allclose(channel_max(w["W1"], 0), channel_max(w["W2"], 0), rtol=1e-3)
    np.testing.assert_allclose(channel_max(w["W2"], 0), channel_max(w["W3"], 1), rtol=1e-3)
    np.testing.assert_allclose(channel_max(w["W3"], 0), channel_max(w["W4"], 1), rtol=1e-3)
    # the three-decade spread of conv1's channel ranges is gone
    orig = channel_max(graph.initializers["W1"], 0)
    new = channel_max(w["W1"], 0)
    assert orig.max() / orig.min() > 300 and new.max() / new.min() < orig.max() / orig.min() / 10
    # the Clip(0, 6) became Clip(0, max b/s) -> Min(per-channel b/s); project got a bias of zeros (no bias before)
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Conv", "Clip", "Min", "Conv", "Relu", "Conv", "Conv"]


def test_clip_with_a_nonzero_lower_bound_is_left_alone():
    graph = load_model(chain(clip_low=-1.0))
    model, log = equalize(graph)
    assert [p for p in log.pairs if p[0] == "conv1"] == []
    assert any(name == "clip1" for name, _ in log.skipped)
    x = np.random.default_rng(2).normal(0, 2, (2, 3, 10, 10)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), run(graph.model, x), rtol=1e-5, atol=1e-5)


def test_adjusted_model_is_written_recorded_and_loaded_for_the_table(tmp_path):
    model_path = tmp_path / "chain.onnx"
    onnx.save(chain(), model_path)
    original = model_path.read_bytes()
    images = write_images(tmp_path / "img", 6, size=(10, 10))
    result = calibrate(model_path, tmp_path / "img", tmp_path / "out", preprocess=RAW, per_channel=False,
                       equalize=True)
    assert model_path.read_bytes() == original
    table_path = tmp_path / "out" / "chain.quant.json"
    options = json.loads(table_path.read_text())["options"]
    assert options["equalize"] is True and options["adjusted_model"] == "chain.adjusted.onnx"
    table = load_quant_table(table_path)
    graph = load_model_for_table(model_path, table, table_path, note=False)
    adjusted = onnx.load(tmp_path / "out" / "chain.adjusted.onnx")
    w1 = {i.name: numpy_helper.to_array(i) for i in adjusted.graph.initializer}["W1"]
    np.testing.assert_array_equal(graph.initializers["W1"], w1)
    assert not np.array_equal(w1, load_model(model_path).initializers["W1"])
    # the integer graph runs on the adjusted weights with the per-tensor weight scales computed on them
    x = np.stack([np.asarray(__import__("PIL.Image").Image.open(p), dtype=np.float32).transpose(2, 0, 1)
                  for p in images])
    out = prepare(graph, table).run({"input": x}).outputs["out"]
    ref = run(chain(), x)
    cos = np.sum(out * ref) / np.linalg.norm(out) / np.linalg.norm(ref)
    assert cos > 0.9
    assert result.table.options.adjusted_sha256 == table.options.adjusted_sha256
    # a changed adjusted file is refused
    (tmp_path / "out" / "chain.adjusted.onnx").write_bytes(original)
    with pytest.raises(QuantTableError, match="does not match"):
        load_model_for_table(model_path, table, table_path)


def test_equalization_lifts_per_tensor_weights_on_the_chain(tmp_path):
    """Per-tensor int8 weights lose the small channels of a three-decade spread; equalized, they do not."""
    model_path = tmp_path / "chain.onnx"
    onnx.save(chain(), model_path)
    images = np.random.default_rng(3).normal(0, 2, (8, 3, 10, 10)).astype(np.float32)
    ref = run(chain(), images)

    def cosine(**kw):
        res = calibrate(model_path, images, tmp_path / str(kw), per_channel=False, write_qdq=False, **kw)
        graph = load_model_for_table(model_path, res.table, res.table_path, note=False)
        out = prepare(graph, res.table).run({"input": images}).outputs["out"]
        return np.sum(out * ref) / np.linalg.norm(out) / np.linalg.norm(ref)

    plain, equalized = cosine(), cosine(equalize=True)
    assert equalized > plain and 1 - equalized < (1 - plain) / 3


def test_run_command_uses_the_adjusted_weights_with_a_note(tmp_path, capsys):
    from ptq.cli import main

    model_path = tmp_path / "chain.onnx"
    onnx.save(chain(), model_path)
    write_images(tmp_path / "img", 2, size=(10, 10))
    assert main(["calibrate", str(model_path), "--images", str(tmp_path / "img"), "--out", str(tmp_path / "out"),
                 "--mean", "0", "--std", "1", "--per-tensor", "--equalize", "--bias-correction", "-q"]) == 0
    options = load_quant_table(tmp_path / "out" / "chain.quant.json").options
    assert options.equalize and options.bias_correction and not options.adaround
    capsys.readouterr()
    assert main(["run", str(model_path), "--quant", str(tmp_path / "out" / "chain.quant.json"),
                 "--images", str(tmp_path / "img")]) == 0
    err = capsys.readouterr().err
    assert "using the adjusted weights" in err and "chain.adjusted.onnx" in err
