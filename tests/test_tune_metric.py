"""A tuning target on the user's metric (`ptq.tuning.metric`, `ptq.tuning.goal`): `ptq tune --max-accuracy-drop D`
tunes until top-1 accuracy on the labelled validation samples is within D of the float model's on them, and
`ptq.tune(metric=fn, max_drop=D)` does the same with any `fn(outputs, sample) -> float`; the figures are the
integer graph's and the QDQ model's on the validation samples, and the summary says over how many samples."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

import ptq
from ptq.calibration.pipeline import calibrate
from ptq.cli import main
from ptq.core.graph import load_model
from ptq.data.image_source import ArraySamples, ImageSet
from ptq.data.images import Preprocess
from ptq.engine.executor import prepare
from ptq.tuning.data import Score, Validation
from ptq.tuning.goal import Goal
from ptq.tuning.metric import MetricScore, MetricTarget, ValidationSample, accuracy_target, top1_accuracy
from ptq.tuning.tuner import tune
from tests.tiny_models import make_model

CLASSES = 6
PIXELS = Preprocess(mean=127.5, std=64.0, crop_ratio=1.0)


def classifier(seed=0) -> onnx.ModelProto:
    """input (N,3,4,4) -> Flatten -> Gemm (24) -> Relu -> Gemm (6 classes): random inputs spread over the
    classes, and at 4 bits some samples near a tie change their top-1."""
    rng = np.random.default_rng(seed)
    w1, b1 = rng.normal(0, 0.4, (24, 48)).astype(np.float32), rng.normal(0, 0.2, 24).astype(np.float32)
    w2, b2 = rng.normal(0, 0.4, (CLASSES, 24)).astype(np.float32), rng.normal(0, 0.1, CLASSES).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "W1"), (b1, "B1"), (w2, "W2"), (b2, "B2"))]
    nodes = [helper.make_node("Flatten", ["input"], ["flat"], name="flatten"),
             helper.make_node("Gemm", ["flat", "W1", "B1"], ["h"], transB=1, name="fc1"),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("Gemm", ["a", "W2", "B2"], ["logits"], transB=1, name="fc2")]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 4, 4])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])
    return make_model(nodes, [inp], [out], inits)


def float_logits(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0]


def sample(label):
    return ValidationSample({}, None, label, "", 0)


def test_top1_accuracy_and_the_targets_refuse_what_they_cannot_mean():
    assert top1_accuracy({"logits": np.array([[0.1, 0.7, 0.2]])}, sample(1)) == 1.0
    assert top1_accuracy({"logits": np.array([[0.1, 0.7, 0.2]]), "other": np.zeros(9)}, sample(2)) == 0.0
    with pytest.raises(ValueError, match="no label for top-1 accuracy"):
        top1_accuracy({"logits": np.zeros((1, 3))}, sample(None))
    with pytest.raises(ValueError, match=">= 0"):
        accuracy_target(-0.01)
    with pytest.raises(TypeError, match="callable"):
        MetricTarget("accuracy", 0.01)
    with pytest.raises(ValueError, match="tune needs a target"):
        Goal()


def test_the_goal_names_what_the_metric_misses_by_how_much_and_over_how_many_samples():
    goal = Goal(None, metric=accuracy_target(0.05))
    within = Score(0.99, 0.001, metric=MetricScore("top-1 accuracy", 0.80, 0.85, 20, 20))
    assert goal.reaches(within) and goal.shortfalls(within) == []
    beyond = Score(0.99, 0.001, metric=MetricScore("top-1 accuracy", 0.70, 0.85, 140, 20))
    assert goal.shortfalls(beyond) == ["top-1 accuracy 0.7000 against float 0.8500 over 20 photos, 140 samples with "
                                       "their views: drop 0.1500 > 0.05 (0.1000 short)"]
    both = Goal(0.999, metric=accuracy_target(0.05))  # both targets must hold
    assert [m.split(" ")[0] for m in both.shortfalls(beyond)] == ["logits", "top-1"]


def test_the_validation_scores_the_metric_of_the_integer_graph_and_of_the_float_model():
    model = classifier()
    graph = load_model(model)
    x = np.random.default_rng(3).normal(0, 1, (30, 3, 4, 4)).astype(np.float32)
    labels = np.random.default_rng(5).integers(0, CLASSES, 30).tolist()
    table = calibrate(model, x[:10], write_qdq=False, bits=4, weight_bits=4, per_channel=False).table
    validation = Validation.create(graph, ArraySamples(x, labels), metric=accuracy_target(0.0))
    score = validation.cosine(graph, table)
    ours = prepare(graph, table).run({"input": x}).outputs["logits"]
    assert score.metric.reference == pytest.approx(np.mean(float_logits(model, x).argmax(1) == labels))
    assert score.metric.value == pytest.approx(np.mean(ours.argmax(1) == labels))
    assert score.metric.samples == score.metric.photos == 30 and score.metric.over() == "over 30 samples"


def test_tuning_to_an_accuracy_drop_reaches_it_and_the_tuned_table_reproduces_it():
    """4-bit weights and activations lose top-1 on a quarter of the 60 validation samples (labels: the float model's
    top-1, so the float accuracy is 1); tuned to a drop of at most 0.02 (one sample) with no cosine target, the
    tuned table loses at most one sample's top-1 when run again."""
    model = classifier()
    graph = load_model(model)
    x = np.random.default_rng(3).normal(0, 1, (80, 3, 4, 4)).astype(np.float32)
    labels = float_logits(model, x).argmax(1).tolist()
    table = calibrate(model, x[:20], write_qdq=False, bits=4, weight_bits=4, per_channel=False,
                      calibrator="extrema").table
    result = tune(graph, table, ArraySamples(x[:20], labels[:20]), None, views=(),
                  validation=ArraySamples(x[20:], labels[20:]), metric=accuracy_target(0.02))
    assert result.target is None and result.baseline.metric.drop > 0.2
    assert result.reached and result.score.metric.drop <= 0.02 and result.int16_tensors
    again = prepare(result.graph, result.table).run({"input": x[20:]}).outputs["logits"]
    accuracy = np.mean(again.argmax(1) == labels[20:])
    assert accuracy == pytest.approx(result.score.metric.value) and accuracy >= 0.98
    assert "validation top-1 accuracy over 60 samples (coarse: one sample is 0.017): 0.7500 -> " in result.summary()


def write_labelled_images(folder, model, count, seed):
    """`count` random 4x4 photos named `photo_<k>_<label>.png`, the label the float model's top-1 on it."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (count, 4, 4, 3), dtype=np.uint8)
    x = ((pixels.astype(np.float32) - 127.5) / 64.0).transpose(0, 3, 1, 2)
    for k, (rgb, label) in enumerate(zip(pixels, float_logits(model, x).argmax(1))):
        Image.fromarray(rgb).save(folder / f"photo_{k:02d}_{label}.png")


@pytest.fixture
def labelled(tmp_path):
    model = classifier()
    onnx.save(model, tmp_path / "cls.onnx")
    write_labelled_images(tmp_path / "calib", model, 12, seed=1)
    write_labelled_images(tmp_path / "val", model, 24, seed=2)
    calibrate(tmp_path / "cls.onnx", tmp_path / "calib", tmp_path / "out", preprocess=PIXELS, write_qdq=False,
              bits=4, weight_bits=4, per_channel=False, calibrator="extrema")
    return tmp_path


def test_the_cli_tunes_to_a_top1_drop_on_labelled_photos_and_says_over_how_many(labelled, capsys):
    out = labelled / "out"
    code = main(["tune", str(labelled / "cls.onnx"), "--quant", str(out / "cls.quant.json"), "--images",
                 str(labelled / "calib"), "--validation", str(labelled / "val"), "--max-accuracy-drop", "0",
                 "--views", "none", "-q"])
    printed = capsys.readouterr().out.splitlines()
    record = json.loads((out / "cls.tune.json").read_text())
    assert code == 0 and record["reached"] and record["target_cosine"] is None and record["max_metric_drop"] == 0
    assert record["metric"] == {"name": "top-1 accuracy", "value": 1.0, "float": 1.0, "drop": 0.0, "samples": 24,
                                "photos": 24}
    assert record["baseline_metric"]["value"] < 1.0
    assert any(line.startswith("validation top-1 accuracy over 24 samples (coarse: one sample is 0.042): ")
               for line in printed)
    for run in ("qdq_unoptimized", "qdq_optimized"):  # the QDQ model written keeps every top-1 too
        assert record["verdict"][run]["metric"]["value"] == 1.0
    assert "target reached by the integer graph and the QDQ model written (onnxruntime, optimizations off and on)" \
        in printed


def test_unlabelled_validation_photos_are_a_clear_error_before_any_tuning(labelled, capsys):
    unlabelled = labelled / "unlabelled"
    unlabelled.mkdir()
    for k, path in enumerate(sorted((labelled / "val").iterdir())[:6]):
        path.rename(unlabelled / f"photo{k}.png")
    code = main(["tune", str(labelled / "cls.onnx"), "--quant", str(labelled / "out" / "cls.quant.json"),
                 "--images", str(labelled / "calib"), "--validation", str(unlabelled), "--max-accuracy-drop", "0.1"])
    err = capsys.readouterr().err
    assert code == 2 and "--max-accuracy-drop needs labelled validation samples (6 of the 6 samples have no label)" \
        in err
    assert not (labelled / "out" / "cls.tuned.quant.json").exists()


def test_the_api_takes_a_metric_callable_with_its_maximal_drop(labelled):
    """`ptq.tune(metric=fn, max_drop=...)`: fn gets every output by name and the sample (its file, its view); the
    figure is the mean over the validation photos, the float model's on the same samples beside it."""
    seen = []

    def margin_kept(outputs, sample):  # the float top-1 class still wins by at least a margin
        seen.append((tuple(outputs), sample.path.parent.name, sample.view))
        logits = outputs["logits"].ravel()
        label = int(sample.path.stem.rsplit("_", 1)[1])
        return float(logits[label] - np.delete(logits, label).max() > 0.05)

    out = labelled / "out"
    result = ptq.tune(labelled / "cls.onnx", quant=out / "cls.quant.json", images=labelled / "calib",
                      validation=labelled / "val", metric=margin_kept, max_drop=0.0, views=["photo", "mirror"],
                      out=labelled / "api", quiet=True)
    assert set(seen) == {(("logits",), "val", "photo"), (("logits",), "val", "mirror")}
    assert result.reached and result.metric_target.name == "margin_kept" and result.score.metric.photos == 24
    assert result.score.metric.samples == 48 and result.score.metric.drop <= 0
    assert result.verdict.qdq_optimized.metric.drop <= 0
    with pytest.raises(ValueError, match="metric= needs max_drop="):
        ptq.tune(labelled / "cls.onnx", quant=out / "cls.quant.json", images=labelled / "calib", metric=margin_kept)
    with pytest.raises(ValueError, match="give metric= too"):
        ptq.tune(labelled / "cls.onnx", quant=out / "cls.quant.json", images=labelled / "calib", max_drop=0.1)
    with pytest.raises(ValueError, match="either --max-accuracy-drop or metric="):
        ptq.tune(labelled / "cls.onnx", quant=out / "cls.quant.json", images=labelled / "calib", metric=margin_kept,
                 max_drop=0.1, max_accuracy_drop=0.1)
    with pytest.raises(ValueError, match="tune needs a target"):
        ptq.tune(labelled / "cls.onnx", quant=out / "cls.quant.json", images=labelled / "calib")


def test_the_bundled_model_tuned_to_a_top1_drop_on_the_eval_photos(model_path, calib_dir, eval_dir, tmp_path, capsys):
    """EfficientNet-Lite0 calibrated on 4 photos, judged on the 20 labelled eval photos: the float model's top-1
    accuracy there (onnxruntime on the same preprocessed photos) is the reference the summary prints, over 20
    samples, in steps of 0.05."""
    ptq.calibrate(model_path, images=calib_dir, out=tmp_path, num_images=4, mean=127, std=128, quiet=True)
    code = main(["tune", str(model_path), "--quant", str(tmp_path / "efficientnet_lite0.quant.json"), "--images",
                 str(calib_dir), "--num-images", "4", "--validation", str(eval_dir), "--views", "none",
                 "--max-accuracy-drop", "0.05", "-q"])
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / "efficientnet_lite0.tune.json").read_text())
    graph = load_model(model_path)
    photos = ImageSet.from_folder(eval_dir, Preprocess(mean=127, std=128))
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    hits = [int(np.argmax(session.run(None, x)[0])) == label for _, x, label in photos.samples(graph)]
    assert len(hits) == 20 and record["metric"]["float"] == pytest.approx(np.mean(hits))
    assert "validation top-1 accuracy over 20 samples (coarse: one sample is 0.050): " in printed
    assert code == (0 if record["reached"] else 1)
    assert record["verdict"]["qdq_optimized"]["metric"]["samples"] == 20
    if record["reached"]:
        assert all(record["verdict"][run]["metric"]["drop"] <= 0.05 + 1e-9
                   for run in ("integer", "qdq_unoptimized", "qdq_optimized"))
