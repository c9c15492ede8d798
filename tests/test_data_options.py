"""The options every data-reading command shares (issue 17): the same preprocessing flags reach the image loader
from calibrate, run, report, debug and tune (and are recorded); `--data` samples (.npy/.npz) feed models with
non-image or several inputs, and a sample that does not fit is a one-line error naming the file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ptq
import ptq.data.samples
from ptq.cli import main
from ptq.data.images import Preprocess
from ptq.data.samples import ArrayFormat
from tiny_models import conv_relu_gemm, make_model, write_images

FLAGS = ["--mean", "10,20,30", "--std", "2,3,4", "--resize", "9", "--crop-ratio", "1.0", "--bgr", "--layout", "NCHW"]
FLAGGED = Preprocess(mean=(10, 20, 30), std=(2, 3, 4), resize=9, crop_ratio=1.0, bgr=True, layout="NCHW")


@pytest.fixture
def loader_spy(monkeypatch):
    """Every Preprocess the image loader is called with (one process: the commands run without workers)."""
    seen: list[Preprocess] = []
    real = ptq.data.samples.load_image

    def spy(path, pre, spec):
        seen.append(pre)
        return real(path, pre, spec)

    monkeypatch.setattr(ptq.data.samples, "load_image", spy)
    return seen


@pytest.fixture
def tiny(tmp_path):
    model = tmp_path / "tiny.onnx"
    onnx.save(conv_relu_gemm(), model)
    images = tmp_path / "images"
    write_images(images, 3, size=(12, 10))
    return model, images


def test_every_command_takes_the_same_preprocessing_flags_to_the_loader(tiny, tmp_path, loader_spy, capsys):
    model, images = tiny
    out = tmp_path / "out"
    common = ["--images", str(images), "--quiet", *FLAGS]
    assert main(["calibrate", str(model), "--out", str(out), *common]) == 0
    table = out / "tiny.quant.json"
    assert json.loads(table.read_text())["options"]["preprocess"] == FLAGGED.to_dict()
    per_command = {"calibrate": len(loader_spy)}
    commands = {
        "run": ["run", str(model), "--quant", str(table)],
        "report": ["report", str(model), "--quant", str(table), "--out", str(tmp_path / "report")],
        "debug": ["debug", str(model), "--quant", str(table), "--out", str(tmp_path / "debug"),
                  "--fake-quant-ops", "Conv"],
        "tune": ["tune", str(model), "--quant", str(table), "--target-cosine", "0.01", "--out", str(tmp_path / "tune")],
    }
    for name, argv in commands.items():
        before = len(loader_spy)
        assert main([*argv, *common]) == 0, name
        per_command[name] = len(loader_spy) - before
    tune_reads = per_command.pop("tune")  # the target is reached at once: only its validation part (1 of 3) is read
    assert all(count >= 3 for count in per_command.values()) and tune_reads >= 1, per_command  # every image
    assert all(pre == FLAGGED for pre in loader_spy)
    # ... and records what it used
    assert json.loads((tmp_path / "report" / "report.json").read_text())["inputs"]["preprocess"] == FLAGGED.to_dict()
    assert json.loads((tmp_path / "debug" / "debug.json").read_text())["inputs"]["preprocess"] == FLAGGED.to_dict()
    assert json.loads((tmp_path / "tune" / "tiny.tune.json").read_text())["inputs"]["preprocess"] == FLAGGED.to_dict()
    capsys.readouterr()


def test_defaults_come_from_the_table_and_a_flag_overrides_one_field(tiny, tmp_path, loader_spy):
    model, images = tiny
    cal = ptq.calibrate(model, images=images, out=tmp_path, mean=5, std=7, crop_ratio=0.5, quiet=True)
    loader_spy.clear()
    ptq.report(model, quant=cal.table_path, images=images, quiet=True)
    assert set(loader_spy) == {Preprocess(mean=5, std=7, crop_ratio=0.5)}
    loader_spy.clear()
    result = ptq.report(model, quant=cal.table_path, images=images, std=3, quiet=True)
    assert set(loader_spy) == {Preprocess(mean=5, std=3, crop_ratio=0.5)}
    assert result.report.to_dict()["inputs"]["preprocess"]["std"] == [3.0, 3.0, 3.0]


def test_preprocessing_flags_change_what_the_model_sees(tiny, tmp_path):
    """Not only parsed: the integer run's classes follow the mean (a large shift saturates every input)."""
    model, images = tiny
    cal = ptq.calibrate(model, images=images, out=tmp_path, quiet=True)
    plain = ptq.run(model, quant=cal.table_path, images=images, quiet=True)
    shifted = ptq.run(model, quant=cal.table_path, images=images, mean=-1000, quiet=True)
    assert [s.classes for s in plain.samples] != [s.classes for s in shifted.samples]


# ----------------------------------------------------------------------------------------- two inputs, --data

def two_input_model() -> onnx.ModelProto:
    """x float [N, 4] and ids int64 [N, 3] -> mean of the ids' embeddings + x -> MatMul -> logits [N, 5]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 1, (10, 4)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.normal(0, 0.5, (4, 5)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["tok"], axis=0, name="gather"),
             helper.make_node("ReduceMean", ["tok", "axes"], ["pooled"], keepdims=0, name="pool"),
             helper.make_node("Add", ["pooled", "x"], ["sum"], name="add"),
             helper.make_node("MatMul", ["sum", "W"], ["logits"], name="matmul")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
              helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 3])]
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])
    return make_model(nodes, inputs, [out], inits, opset=18)


@pytest.fixture
def two(tmp_path):
    model = tmp_path / "two.onnx"
    onnx.save(two_input_model(), model)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    samples = {}
    for k in range(6):
        x, ids = rng.normal(0, 1, 4), rng.integers(0, 10, 3)
        if k % 2:  # with the batch axis of 1, float64: both accepted
            np.savez(data / f"s{k}.npz", x=x[None], ids=ids[None])
        else:
            np.savez(data / f"s{k}.npz", x=x.astype(np.float32), ids=ids)
        samples[f"s{k}.npz"] = (x.astype(np.float32), ids)
    (data / "README.txt").write_text("not a sample: skipped with a warning")
    return model, data, samples


def float_logits(model: Path, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x[None], "ids": ids[None]})[0][0]


def test_two_input_model_calibrated_and_reported_from_npz_samples(two, tmp_path, capsys):
    model, data, samples = two
    out = tmp_path / "out"
    assert main(["calibrate", str(model), "--data", str(data), "--out", str(out), "--quiet"]) == 0
    table = json.loads((out / "two.quant.json").read_text())
    assert table["options"]["preprocess"] is None
    # the float input's range is the samples' extrema (float64 samples cast to float32)
    xs = np.stack([x for x, _ in samples.values()])
    assert table["tensors"]["x"]["min"] == [float(min(xs.min(), 0))]
    assert table["tensors"]["x"]["max"] == [float(max(xs.max(), 0))]
    assert "ids" not in table["tensors"]  # token ids stay integers

    labels = tmp_path / "labels.txt"
    truth = {name: int(np.argmax(float_logits(model, x, ids))) for name, (x, ids) in samples.items()}
    labels.write_text("".join(f"{name} {label}\n" for name, label in truth.items()))
    assert main(["report", str(model), "--quant", str(out / "two.quant.json"), "--data", str(data),
                 "--labels", str(labels), "--out", str(tmp_path / "report"), "--isolated-images", "all"]) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["images"] == 6 and report["inputs"]["data"] == str(data)
    assert report["outputs"]["tensors"][0]["cosine"] > 0.999
    assert report["outputs"]["labelled"] == 6 and report["outputs"]["float_accuracy"] == 1.0
    assert "logits" in {layer["name"] for layer in report["layers"]}
    capsys.readouterr()

    result = ptq.run(model, quant=out / "two.quant.json", data=data, labels=labels, quiet=True)
    assert [s.path.name for s in result.samples] == sorted(samples)
    assert [s.float_class for s in result.samples] == [truth[name] for name in sorted(samples)]
    assert result.agreement == 1.0 and result.accuracy == 1.0


def test_data_shards_give_the_one_process_table_and_report(two, tmp_path):
    model, data, _ = two
    one = ptq.calibrate(model, data=data, out=tmp_path / "one", calibrator="mean", batch_size=2, quiet=True)
    two_workers = ptq.calibrate(model, data=data, out=tmp_path / "two", calibrator="mean", batch_size=2, workers=2,
                                quiet=True)
    assert one.table_path.read_bytes() == two_workers.table_path.read_bytes()
    reports = [ptq.report(model, quant=one.table_path, data=data, quiet=True, workers=w).report.to_dict()
               for w in (1, 2)]
    assert reports[0]["images"] == 6 and reports[1] == reports[0]


@pytest.mark.parametrize("arrays, message", [
    ({"x": np.zeros(4, np.float32)}, r"missing input\(s\) \['ids'\]"),
    ({"x": np.zeros(4, np.float32), "ids": np.zeros(3, np.int64), "y": np.zeros(1)}, r"unknown array\(s\) \['y'\]"),
    ({"x": np.zeros((4, 1), np.float32), "ids": np.zeros(3, np.int64)},
     r"input 'x' has shape \(4, 1\); the model's input is \(N, 4\): one sample per file, \(4,\) or \(N, 4\) "
     r"\(dimension 1 must be 4\)$"),
    ({"x": np.zeros((2, 2, 4), np.float32), "ids": np.zeros(3, np.int64)}, r"shape \(2, 2, 4\); .*\(4,\) or \(N, 4\)"),
    ({"x": np.zeros(5, np.float32), "ids": np.zeros(3, np.int64)}, r"dimension 1 must be 4"),
    ({"x": np.zeros(4, np.float32), "ids": np.zeros(3, np.float32)}, r"input 'ids' is float32, .* int64"),
    ({"x": np.zeros(4, np.int32), "ids": np.zeros(3, np.int64)}, r"input 'x' is int32, .* float"),
    ({"x": np.zeros(4, np.float32), "ids": np.zeros(3, np.uint64) + 2 ** 63}, r"outside the model's int64"),
])
def test_a_sample_that_does_not_fit_is_a_one_line_error_naming_the_file(two, tmp_path, capsys, arrays, message):
    model, _, _ = two
    data = tmp_path / "bad"
    data.mkdir()
    np.savez(data / "broken.npz", **arrays)
    assert main(["calibrate", str(model), "--data", str(data), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{data / 'broken.npz'}: " in err
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_npy_sample_fits_a_one_input_model_only(two, tiny, tmp_path, capsys):
    model, _, _ = two
    data = tmp_path / "npy"
    data.mkdir()
    np.save(data / "one.npy", np.zeros(4, np.float32))
    assert main(["calibrate", str(model), "--data", str(data)]) == 2
    assert "one.npy: an .npy file holds one array, the model has inputs ['x', 'ids']" in capsys.readouterr().err
    image_model, _ = tiny
    np.save(data / "one.npy", np.random.default_rng(0).normal(0, 1, (3, 8, 8)))  # float64, no batch axis
    result = ptq.calibrate(image_model, data=data, quiet=True)
    assert result.images_used == 1 and result.table.options.preprocess is None


def test_data_refuses_preprocessing_and_needs_one_source(two, tmp_path, capsys):
    model, data, _ = two
    assert main(["report", str(model), "--quant", "q.json", "--data", str(data), "--out", str(tmp_path),
                 "--mean", "127"]) == 2
    assert "--mean preprocess images; --data samples are model inputs already" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one of the two is required, not both
        main(["calibrate", str(model), "--data", str(data), "--images", str(data)])
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['imgs'\]"):
        ptq.calibrate(model, imgs=data)


def test_array_reader_casts_by_the_documented_rule(tmp_path):
    from ptq.core.graph import load_model

    reader = ArrayFormat().reader(load_model(two_input_model()))
    path = tmp_path / "s.npz"
    np.savez(path, x=np.full((1, 4), 0.1, np.float64), ids=np.arange(3, dtype=np.int16))
    sample = reader.read(path)
    assert sample["x"].dtype == np.float32 and sample["x"].shape == (1, 4) and sample["x"][0, 0] == np.float32(0.1)
    assert sample["ids"].dtype == np.int64 and sample["ids"].tolist() == [[0, 1, 2]]  # a batch axis of 1 added


class _Terminal:
    """A stderr that says it is a terminal (tqdm draws its bars only there) and keeps what is written."""

    def __init__(self):
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("command", ["calibrate", "run", "report", "debug", "tune"])
def test_progress_bars_on_a_terminal_and_quiet_silences_them(command, tiny, tmp_path, monkeypatch, capsys):
    model, images = tiny
    table = ptq.calibrate(model, images=images, out=tmp_path / "table", quiet=True).table_path
    argv = {
        "calibrate": ["calibrate", str(model), "--out", str(tmp_path / "cal")],
        "run": ["run", str(model), "--quant", str(table)],
        "report": ["report", str(model), "--quant", str(table), "--out", str(tmp_path / "report")],
        "debug": ["debug", str(model), "--quant", str(table), "--out", str(tmp_path / "debug"), "--fake-quant-ops",
                  "Conv"],
        "tune": ["tune", str(model), "--quant", str(table), "--target-cosine", "0.01", "--out", str(tmp_path / "t")],
    }[command] + ["--images", str(images)]
    for quiet in (False, True):
        terminal = _Terminal()
        monkeypatch.setattr("sys.stderr", terminal)
        assert main(argv + (["--quiet"] if quiet else [])) == 0
        monkeypatch.undo()
        # a bar over the 3 images ("0/3 [00:00<?, ?img/s]"); tune reaching its target at once: over the 7 views
        # (ptq.data.views) of its 1 validation image
        bars = "/3 [" in terminal.text or (command == "tune" and "/7 [" in terminal.text)
        assert bars != quiet, terminal.text
    capsys.readouterr()


@pytest.mark.parametrize("function, own", [("report", ["out", "quant", "isolated_images", "float_nodes"]),
                                            ("calibrate", ["out", "calibrator", "input_shape"]),
                                            ("tune", ["out", "quant", "target_cosine"])])
def test_an_unknown_keyword_lists_the_functions_own_keywords_with_the_closest(function, own):
    """Issue 27, item 7: `ptq.report(..., outdir=...)` listed the shared options only, not `out`, `quant`, ..."""
    import ptq

    required = {"report": {"quant": "q.json"}, "calibrate": {}, "tune": {"quant": "q.json", "target_cosine": 0.9}}
    with pytest.raises(TypeError) as caught:
        getattr(ptq, function)("model.onnx", outdir="o", images="x", **required[function])
    message = str(caught.value)
    assert message.startswith(f"ptq.{function}() got unexpected keyword argument(s) ['outdir'] (did you mean 'out'")
    own_part = message.split("its own keywords are ")[1].split("], the shared options")[0]
    assert all(repr(name) in own_part for name in own)
