import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator
from PIL import Image

from ptq.calibration.pipeline import calibrate
from ptq.cli import main
from ptq.data.images import InputSpec, Preprocess, load_image
from ptq.qdq.export import export_qdq
from ptq.table.quant_table import load_quant_table
from tiny_models import conv_relu_gemm, write_tiny_case

RAW = Preprocess(mean=0, std=255, crop_ratio=1.0)  # 8x8 images into an 8x8 input: no resize, x = pixel / 255
RAW_FLAGS = ["--mean", "0", "--std", "255", "--crop-ratio", "1", "-q"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ort_run(model_path, x, optimized=False):
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i : i + 1]})[0] for i in range(len(x))])


@pytest.fixture()
def tiny(tmp_path):
    """A dynamic-batch Conv/Clip/Gemm model file and a folder of 8x8 lossless images."""
    return write_tiny_case(tmp_path, 7)


def test_extrema_ranges_match_the_reference_evaluator(tiny, tmp_path):
    model_path, images, paths = tiny
    result = calibrate(model_path, images, tmp_path / "out", preprocess=RAW, batch_size=3, calibrator="extrema")
    assert result.images_used == 7 and result.images_skipped == 0 and result.tensors_calibrated == 6

    x = np.stack([np.asarray(Image.open(p)).transpose(2, 0, 1) / 255.0 for p in paths]).astype(np.float32)
    names = ["input", "conv", "act", "pool", "flat", "logits"]
    ref = dict(zip(names, ReferenceEvaluator(onnx.load(model_path)).run(names, {"input": x})))
    for name in names:
        lo, hi = float(ref[name].min()), float(ref[name].max())
        if name == "conv":  # its only consumer is Clip(0, 6): the range is narrowed to the Clip bounds
            lo, hi = min(max(lo, 0.0), 6.0), min(max(hi, 0.0), 6.0)
        entry = result.table.tensors[name]
        assert entry.kind == "activation" and entry.calibrator == "extrema"
        np.testing.assert_allclose([entry.min[0], entry.max[0]], [lo, hi], rtol=1e-5, atol=1e-6)
    logits = result.table.tensors["logits"].qparams  # asymmetric int8 over [min(lo, 0), max(hi, 0)]
    lo, hi = min(float(ref["logits"].min()), 0.0), max(float(ref["logits"].max()), 0.0)
    assert logits.scale[0] == pytest.approx((hi - lo) / 255, rel=1e-6)
    assert logits.zero_point[0] == round(-128 - lo / logits.scale[0])

    w = onnx.numpy_helper.to_array(next(i for i in onnx.load(model_path).graph.initializer if i.name == "W"))
    weight = result.table.tensors["W"]
    assert weight.kind == "weight" and weight.qparams.axis == 0 and weight.qparams.narrow
    np.testing.assert_allclose(weight.qparams.scale, np.abs(w).reshape(4, -1).max(axis=1) / 127, rtol=1e-6)
    np.testing.assert_array_equal(weight.min, w.reshape(4, -1).min(axis=1))


def test_table_and_qdq_files_are_written_and_load_back(tiny, tmp_path):
    model_path, images, _ = tiny
    out = tmp_path / "out"
    result = calibrate(model_path, images, out, preprocess=RAW)
    assert result.table_path == out / "tiny.quant.json" and result.qdq_path == out / "tiny.qdq.onnx"
    loaded = load_quant_table(result.table_path)
    assert loaded.options == result.table.options
    assert loaded.tensors == result.table.tensors
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left behind
    x = np.random.default_rng(0).uniform(0, 1, (3, 3, 8, 8)).astype(np.float32)
    assert ort_run(result.qdq_path, x, optimized=True).shape == (3, 5)


@pytest.mark.parametrize("name", ["mean", "kld", "3std", "extrema"])
def test_fixed_batch_1_model_gives_the_same_table_as_a_dynamic_batch(tiny, tmp_path, name):
    _, images, _ = tiny
    fixed = tmp_path / "fixed.onnx"
    onnx.save(conv_relu_gemm(batch=1), fixed)
    dynamic = tmp_path / "dynamic.onnx"
    onnx.save(conv_relu_gemm(batch=None), dynamic)
    # "mean" averages per-batch extrema: equal only if the batch-1 model sees the same batches of 4; the
    # others are folded sample by sample on the batch-1 model and must not depend on the grouping
    a = calibrate(fixed, images, calibrator=name, preprocess=RAW, batch_size=4, write_qdq=False)
    b = calibrate(dynamic, images, calibrator=name, preprocess=RAW, batch_size=4, write_qdq=False)
    for name, entry in a.table.tensors.items():
        np.testing.assert_allclose(entry.min, b.table.tensors[name].min, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(entry.max, b.table.tensors[name].max, rtol=1e-6, atol=1e-7)


def test_bad_files_are_skipped_and_counted(tiny, tmp_path, capsys, caplog):
    model_path, images, _ = tiny
    (images / "readme.txt").write_text("not an image")
    (images / "sub").mkdir()
    (images / "sub" / "broken.png").write_bytes(b"\x89PNG garbage")
    rc = main(["calibrate", str(model_path), "--images", str(images), "--out", str(tmp_path / "o"),
               "--mean", "0", "--std", "255", "--crop-ratio", "1"])
    out = capsys.readouterr()
    assert rc == 0
    assert "images used: 7, skipped: 2" in out.out
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "ptq.data.images"]
    assert len(warnings) == 2 and "readme.txt" in warnings[0] and "broken.png" in warnings[1]
    assert "quantization table: " in out.out and "QDQ model: " in out.out


def test_empty_folder_and_no_valid_image_fail_with_a_clear_message(tiny, tmp_path, capsys):
    model_path, _, _ = tiny
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["calibrate", str(model_path), "--images", str(empty), "--out", str(tmp_path / "o")] + RAW_FLAGS) == 2
    assert f"image folder {empty} is empty" in capsys.readouterr().err
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.jpg").write_bytes(b"nope")
    (junk / "b.txt").write_text("nope")
    assert main(["calibrate", str(model_path), "--images", str(junk), "--out", str(tmp_path / "o")] + RAW_FLAGS) == 2
    assert "no valid image" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_input_model_is_never_modified(tiny):
    model_path, images, _ = tiny
    before = sha256(model_path)
    assert main(["calibrate", str(model_path), "--images", str(images), "--out", str(model_path.parent)] + RAW_FLAGS) == 0
    assert sha256(model_path) == before
    assert (model_path.parent / "tiny.qdq.onnx").exists()
    # an output path that is the input model (through a symlink) is refused
    alias = model_path.parent / "alias"
    alias.mkdir()
    os.symlink(model_path, alias / "tiny.qdq.onnx")
    with pytest.raises(ValueError, match="refusing to overwrite the input model"):
        calibrate(model_path, images, alias, preprocess=RAW)
    assert sha256(model_path) == before


@pytest.mark.parametrize("name", ["extrema", "mean", "3std", "99.9percentile", "kld", "mse"])
def test_each_calibrator_writes_both_files_and_the_qdq_model_runs(tiny, tmp_path, name):
    model_path, images, _ = tiny
    out = tmp_path / "out"
    assert main(["calibrate", str(model_path), "--images", str(images), "--out", str(out),
                 "--calibrator", name] + RAW_FLAGS) == 0
    table = load_quant_table(out / "tiny.quant.json")
    assert table.options.calibrator == name
    assert {e.calibrator for e in table.tensors.values() if e.kind == "activation"} == {name}
    x = np.random.default_rng(1).uniform(0, 1, (2, 3, 8, 8)).astype(np.float32)
    assert np.isfinite(ort_run(out / "tiny.qdq.onnx", x)).all()


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("symmetric, per_channel", [(True, True), (False, False)])
def test_bit_widths_symmetry_and_granularity(tiny, bits, symmetric, per_channel):
    model_path, images, paths = tiny
    result = calibrate(model_path, images, preprocess=RAW, bits=bits, weight_bits=bits,
                       symmetric=symmetric, per_channel=per_channel)
    for entry in result.table.tensors.values():
        qp = entry.qparams
        assert qp.bits == bits
        if entry.kind == "weight":
            assert (qp.axis is not None) == per_channel and qp.symmetric
        else:
            assert qp.axis is None and qp.signed == bool(entry.min[0] < 0)
            if symmetric:
                assert qp.symmetric
    act = result.table.tensors["act"]  # after Clip(0, 6): unsigned, zp 0 either way
    assert not act.qparams.signed and act.qparams.zero_point[0] == 0
    assert act.qparams.scale[0] == pytest.approx(act.max[0] / (2**bits - 1), rel=1e-6)
    x = np.stack([load_image(p, RAW, InputSpec("NCHW", 3, 8, 8)) for p in paths])
    got = ort_run_proto(export_qdq(result.graph, result.table), x)
    ref = ort_run_proto(result.graph.model, x)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < {4: 0.6, 8: 0.05, 16: 0.001}[bits]


def ort_run_proto(model, x):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0]


def test_pow2_scales_are_powers_of_two(tiny):
    model_path, images, _ = tiny
    result = calibrate(model_path, images, preprocess=RAW, pow2=True, write_qdq=False)
    for entry in result.table.tensors.values():
        exponents = np.log2(entry.qparams.scale)
        np.testing.assert_array_equal(exponents, np.round(exponents))
        lo, hi = entry.qparams.real_range()
        assert np.all(hi >= entry.max - 1e-9)  # rounding the scale up keeps the range covered


def test_num_images_and_seed_are_recorded(tiny):
    model_path, images, _ = tiny
    result = calibrate(model_path, images, preprocess=RAW, num_images=3, seed=5, write_qdq=False)
    assert result.images_used == 3
    assert result.table.options.num_images == 3 and result.table.options.seed == 5
    assert result.table.options.preprocess["std"] == [255.0, 255.0, 255.0]


def test_cli_errors_are_one_line(tiny, tmp_path, capsys):
    model_path, images, _ = tiny
    assert main(["calibrate", str(model_path), "--images", str(images), "--calibrator", "magic"] + RAW_FLAGS) == 2
    assert "unknown calibrator 'magic'" in capsys.readouterr().err
    assert main(["calibrate", str(model_path), "--images", str(images), "--bits", "1"] + RAW_FLAGS) == 2
    assert "bits must be an integer in [2, 16]" in capsys.readouterr().err
    assert main(["calibrate", str(tmp_path / "nope.onnx"), "--images", str(images)] + RAW_FLAGS) == 2
    assert "model file not found" in capsys.readouterr().err


def test_quiet_prints_nothing(tiny, tmp_path, capsys, caplog):
    model_path, images, _ = tiny
    (images / "x.txt").write_text("skip me")
    assert main(["calibrate", str(model_path), "--images", str(images), "--out", str(tmp_path / "q")] + RAW_FLAGS) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_efficientnet_per_channel_int8_reaches_cosine_0_99(model_path, calib_dir, eval_dir, tmp_path):
    """The real model: default calibration, QDQ logits vs float logits on the 20 eval photos."""
    result = calibrate(model_path, calib_dir, tmp_path, preprocess=Preprocess(mean=127, std=128))
    assert result.images_used == 23 and result.tensors_calibrated == 95
    pre, spec = Preprocess(mean=127, std=128), InputSpec("NCHW", 3, 224, 224)
    files = sorted(eval_dir.glob("*.jpg"))
    x = np.stack([load_image(f, pre, spec) for f in files])
    ref = ort_run(model_path, x)
    got = ort_run(result.qdq_path, x)
    cosine = np.sum(ref * got, axis=1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
    assert len(files) == 20 and cosine.mean() >= 0.99
    labels = np.array([int(f.stem.rsplit("_", 1)[1]) for f in files])
    assert (got.argmax(axis=1) == labels).mean() >= (ref.argmax(axis=1) == labels).mean() - 0.05


def test_models_ptq_cannot_feed_images_to_are_clear_errors(tiny, tmp_path):
    _, images, _ = tiny
    fixed2 = tmp_path / "fixed2.onnx"
    onnx.save(conv_relu_gemm(batch=2), fixed2)
    with pytest.raises(ValueError, match="fixed batch of 2; ptq needs batch 1 or a dynamic batch"):
        calibrate(fixed2, images, preprocess=RAW)
    nodes = [onnx.helper.make_node("Add", ["a", "b"], ["y"])]
    two_inputs = onnx.helper.make_model(onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 3, 8, 8]) for n in "ab"],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3, 8, 8])]),
        opset_imports=[onnx.helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match="one float input"):
        calibrate(two_inputs, images, preprocess=RAW)


def test_every_calibrator_gives_a_runnable_qdq_efficientnet(model_path, calib_dir):
    """Statistics collected once (4 photos) for every calibrator; each table exports a QDQ model that runs."""
    from calibrators import required_stats
    from ptq.calibration.entries import build_table
    from ptq.calibration.statistics import collect_image_statistics
    from ptq.core.graph import load_model
    from ptq.table.quant_table import CalibrationOptions

    names = ["extrema", "mean", "3std", "99.99percentile", "kld", "mse"]
    pre = Preprocess(mean=127, std=128)
    graph = load_model(model_path)
    stats, log = collect_image_statistics(graph, calib_dir, required_stats(names), preprocess=pre, num_images=4)
    assert len(log.used) == 4
    x = load_image(log.used[0], pre, InputSpec("NCHW", 3, 224, 224))[None]
    ref = ort_run_proto(graph.model, x)
    for name in names:
        table = build_table(graph, stats, CalibrationOptions(calibrator=name))
        assert len(table.tensors) == 95 + 50
        got = ort_run_proto(export_qdq(graph, table), x)
        assert got.shape == (1, 1000) and np.isfinite(got).all()
        assert float(np.dot(got[0], ref[0]) / np.linalg.norm(got) / np.linalg.norm(ref)) > 0.5


def test_dynamic_spatial_model_needs_input_shape(tiny, tmp_path, capsys):
    _, images, _ = tiny
    model = conv_relu_gemm(batch=None)
    for dim in model.graph.input[0].type.tensor_type.shape.dim[2:]:
        dim.dim_param = "S"
    path = tmp_path / "spatial.onnx"
    onnx.save(model, path)
    assert main(["calibrate", str(path), "--images", str(images)] + RAW_FLAGS) == 2
    assert "--input-shape input:" in capsys.readouterr().err
    out = tmp_path / "o"
    assert main(["calibrate", str(path), "--images", str(images), "--out", str(out),
                 "--input-shape", "input:1,3,8,8"] + RAW_FLAGS) == 0
    assert load_quant_table(out / "spatial.quant.json").options.input_shapes == {"input": [1, 3, 8, 8]}
