"""Labels the commands cannot trust mean no labels, said once, never an abort; top-k agreement only where it can
tell anything (issue 27, item 9)."""
import json
import shutil

import pytest

from ptq.cli import main
from ptq.calibration.pipeline import calibrate
from ptq.data.labels import LabelResolver, usable_labels
from reports.metrics import TopKAgreement
from test_table_command import RAW
from tiny_models import write_tiny_case


def test_trusted_and_untrusted_labels():
    named = [f"imagenet_{k:02d}_{label}.jpg" for k, label in enumerate([243, 7, 7, 980])]
    resolver = LabelResolver.from_option(None, named)
    assert usable_labels(resolver, named, 1000) == (resolver, None)
    no, why = usable_labels(resolver, named, 500)
    assert no.labels == {} and why == "the file names give labels outside the model's 500 classes (980)"
    counted = [f"line_{k:02d}.png" for k in range(24)]
    no, why = usable_labels(LabelResolver.from_option(None, counted), counted, 1000)
    assert no.labels == {} and why == "the numbers ending the file names count the files (0..23): not labels"
    some = ["cat_3.jpg", "dog.jpg", "bird.jpg"]
    no, why = usable_labels(LabelResolver.from_option(None, some), some, 10)
    assert no.labels == {} and why == "only 1 of the 3 file names end in _LABEL"
    unnamed = ["cat.jpg", "dog.jpg"]
    assert usable_labels(LabelResolver.from_option(None, unnamed), unnamed, 10)[1] is None  # nothing to say
    partial = LabelResolver({"cat.jpg": 3})
    no, why = usable_labels(partial, ["cat.jpg", "dog.jpg"], 10)
    assert no.labels == {} and why == "the labels file labels 1 of the 2 files"
    outside = LabelResolver({"cat.jpg": 3, "dog.jpg": 12})
    assert usable_labels(outside, ["cat.jpg", "dog.jpg"], 5)[1] == \
        "the labels file give labels outside the model's 5 classes (12)"
    assert usable_labels(outside, ["cat.jpg", "dog.jpg"], None) == (outside, None)  # not a classifier: unchecked


def test_top_k_agreement_only_with_twice_k_classes():
    few, many = TopKAgreement(k=5), TopKAgreement(k=5)
    few.update([0.1, 0.9, 0.0, 0.3], [0.2, 0.8, 0.0, 0.1])
    many.update(list(range(10)), list(range(10)))
    assert few.to_dict() == {"samples": 1, "top1_agreement": 1.0}
    assert many.to_dict() == {"samples": 1, "top1_agreement": 1.0, "top5_agreement": 1.0}
    assert few.merge(TopKAgreement(k=5)).to_dict() == few.to_dict()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny 5-class model and its table."""
    folder = tmp_path_factory.mktemp("tiny")
    model, images, _ = write_tiny_case(folder, 6)
    table = calibrate(model, images, folder / "table", preprocess=RAW, write_qdq=False).table_path
    return model, images, table


def renamed(images, folder, names):
    folder.mkdir()
    for source, name in zip(sorted(images.iterdir()), names):
        shutil.copy(source, folder / name)
    return folder


@pytest.mark.parametrize("names, why", [
    ([f"line_{k:02d}.png" for k in range(6)], "the numbers ending the file names count the files (0..5): not labels"),
    (["a_7.png", "b_9.png", "c_2.png", "d_7.png", "e_1.png", "f_0.png"],
     "the file names give labels outside the model's 5 classes (7, 9)"),
])
@pytest.mark.parametrize("command", ["report", "run", "debug"])
def test_a_command_goes_on_without_labels_and_says_so_once(tiny, tmp_path, capsys, names, why, command):
    model, images, table = tiny
    folder = renamed(images, tmp_path / "named", names)
    argv = [command, str(model), "--quant", str(table), "--images", str(folder)]
    argv += {"report": ["--out", str(tmp_path / "r")], "run": [],
             "debug": ["--fake-quant", "conv", "--out", str(tmp_path / "d")]}[command]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.count(f"ptq {command}: note: no labels: {why}\n") == 1
    assert "accuracy" not in captured.out and "top-5" not in captured.out  # 5 classes: no top-5 either
    if command == "report":
        assert "(no labels: agreement with float only)" in captured.out
        outputs = json.loads((tmp_path / "r" / "report.json").read_text())["outputs"]
        assert set(outputs) == {"tensors", "samples", "top1_agreement"}
