"""A layer input with outlier channels gets 16 bits (`ptq.calibration.outlier_channels`): a few channels that
span a far wider range than the others would put every ordinary channel on a handful of 8-bit codes, and the
MatMul summing them against its weight would lose them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from calibrators import Stat, TensorStatistics
from ptq.calibration.pipeline import calibrate
from ptq.engine.executor import prepare

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def _matmul_model(rng) -> onnx.ModelProto:
    """y = x @ W, x [1, 16, 8]; W's rows for channels 0 and 1 are zero (a layer that learned to read the
    ordinary channels), the others N(0, 0.5)."""
    w = rng.normal(0, 0.5, (8, 8)).astype(np.float32)
    w[:2] = 0.0
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8])],
                              [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _samples(rng, gain: float, count: int) -> np.ndarray:
    x = rng.normal(0, 1, (count, 1, 16, 8)).astype(np.float32)
    x[..., :2] *= gain  # the outlier channels
    return x


def _cosine(a, b) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("gain, bits", [(1.0, 8), (100.0, 16)])
def test_outlier_channels_give_the_matmul_input_16_bits(gain, bits):
    rng = np.random.default_rng(0)
    model = _matmul_model(rng)
    result = calibrate(model, _samples(rng, gain, 16)[:, 0], write_qdq=False)
    entry = result.table.tensors["x"]
    assert entry.qparams.bits == bits
    assert ("outlier" not in entry.why) if bits == 8 else ("2 of its 8 channels along axis -1" in entry.why)
    prepared = prepare(result.graph, result.table)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for x in _samples(rng, gain, 4):
        # 8 bits over the outliers' range put the ordinary channels on ~3 codes: y's cosine 0.83-0.90
        assert _cosine(prepared.run({"x": x}).outputs["y"], session.run(None, {"x": x})[0]) >= 0.999


def test_channel_ranges_merge_across_shards_as_one_run():
    rng = np.random.default_rng(1)
    batches = [rng.normal(0, 1, (2, 5, 4)) * np.arange(1, 5) for _ in range(4)]
    whole = TensorStatistics(frozenset({Stat.MINMAX}), channel_axis=-1)
    first, second = (TensorStatistics(frozenset({Stat.MINMAX}), channel_axis=-1) for _ in range(2))
    for k, batch in enumerate(batches):
        whole.update(batch)
        (first if k < 2 else second).update(batch)
    first.merge(second)
    stacked = np.concatenate(batches).reshape(-1, 4)
    for stats in (whole, first):
        np.testing.assert_array_equal(stats.channel_minmax.min, stacked.min(axis=0))
        np.testing.assert_array_equal(stats.channel_minmax.max, stacked.max(axis=0))
    np.testing.assert_array_equal(whole.minmax.min, [stacked.min()])  # the per-tensor statistics stay as they were
    with pytest.raises(ValueError, match="channel axis"):
        whole.merge(TensorStatistics(frozenset({Stat.MINMAX})))


def test_the_gelu_classifier_agrees_with_float_on_every_eval_sample():
    """bench/models/gelu_classifier.onnx: two LayerNorm channels with gain 120; with 8 bits on that LayerNorm's
    output 198 of 200 samples kept float's class (NNCF: 200)."""
    data = MODELS / "gelu_classifier_data"
    result = calibrate(MODELS / "gelu_classifier.onnx", data=data / "calib", write_qdq=False)
    assert result.table.tensors["ln1/out"].qparams.bits == 16
    prepared = prepare(result.graph, result.table)
    session = ort.InferenceSession(str(MODELS / "gelu_classifier.onnx"), providers=["CPUExecutionProvider"])
    agree = 0
    files = sorted((data / "eval").glob("*.npy"))
    for path in files:
        tokens = np.load(path)
        got = prepared.run({"tokens": tokens}, keep_all=False).outputs["logits"]
        agree += int(got.argmax() == session.run(None, {"tokens": tokens})[0].argmax())
    assert agree == len(files) == 200
