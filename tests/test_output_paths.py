"""Every command that writes checks its output paths before any work (one line, exit 2), and says which existing
outputs it replaces (issue 27, items 1 and 11)."""

import pytest

from ptq.cli import main
from ptq.calibration.pipeline import calibrate
from tiny_models import write_tiny_case
from test_table_command import RAW


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Conv/Clip/Gemm model, 5 images, its calibrated table, and a plain file where users put --out."""
    folder = tmp_path_factory.mktemp("tiny")
    model, images, _ = write_tiny_case(folder, 5)
    table = calibrate(model, images, folder / "table", preprocess=RAW, write_qdq=False).table_path
    afile = folder / "afile"
    afile.write_text("not a folder")
    return model, images, table, afile


def cli(capsys, *argv) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def commands(model, images, table, out):
    """Each writing command with `out` as its output, reading images from a folder that does not exist: a
    command that checked its output first names the output, one that started work names the images."""
    missing = images.parent / "no-such-images"
    data = ["--images", missing]
    return {
        "calibrate": ["calibrate", model, "--out", out, *data],
        "report": ["report", model, "--quant", table, "--out", out, *data],
        "debug --auto": ["debug", model, "--quant", table, "--auto", "2", "--out", out, *data],
        "debug --fake-quant": ["debug", model, "--quant", table, "--fake-quant", "conv", "--out", out, *data],
        "tune": ["tune", model, "--quant", table, "--target-cosine", "0.99", "--out", out, *data],
        "dsp-report": ["dsp-report", model, "--quant", table, "--out", out],
    }


@pytest.mark.parametrize("command", ["calibrate", "report", "debug --auto", "debug --fake-quant", "tune",
                                     "dsp-report"])
def test_an_output_folder_that_is_a_file_fails_first_in_one_line(tiny, capsys, command):
    model, images, table, afile = tiny
    for out in (afile, afile / "below"):
        status, stdout, err = cli(capsys, *commands(model, images, table, out)[command])
        name = command.split()[0]
        assert status == 2 and stdout == ""
        assert err.count("\n") == 1 and err.startswith(f"ptq {name}: error: --out {out}")
        assert "is a file, not a folder" in err


def test_file_outputs_are_checked_first(tiny, capsys, tmp_path):
    model, images, table, afile = tiny
    folder = tmp_path / "folder"
    folder.mkdir()
    missing = ["--images", tmp_path / "no-such-images", "--out", tmp_path / "debug"]
    cases = [
        (["debug", model, "--quant", table, "--auto", "2", "--write-quant", folder, *missing],
         f"ptq debug: error: --write-quant {folder} is a folder; give a file name"),
        (["debug", model, "--quant", table, "--auto", "2", "--write-quant", afile / "x.json", *missing],
         f"ptq debug: error: --write-quant {afile} is a file, not a folder"),
        (["debug", model, "--quant", table, "--dump", afile, *missing],
         f"ptq debug: error: --dump {afile} is a file, not a folder"),
        (["table", "export", model, "--quant", table, "--out", folder],
         f"ptq table: error: --out {folder} is a folder; give a file name"),
        (["table", "set", table, "conv", "--bits", "7", "--out", afile / "t.json"],
         f"ptq table: error: --out {afile} is a file, not a folder"),
    ]
    for argv, line in cases:
        status, stdout, err = cli(capsys, *argv)
        assert (status, stdout, err) == (2, "", line + "\n")


def test_tune_checks_its_outputs_before_tuning(tiny, capsys, monkeypatch):
    import ptq.tuning.tuner

    model, images, table, afile = tiny
    monkeypatch.setattr(ptq.tuning.tuner, "tune", lambda *a, **k: pytest.fail("tuning started"))
    status, _, err = cli(capsys, "tune", model, "--quant", table, "--target-cosine", "0.99", "--out", afile,
                         "--images", images, "--mean", "0", "--std", "255")
    assert status == 2 and err == f"ptq tune: error: --out {afile} is a file, not a folder\n"


def test_a_second_run_into_the_same_folder_says_what_it_replaces(tiny, capsys, tmp_path):
    model, images, table, _ = tiny
    out = tmp_path / "out"
    raw = ["--mean", "0", "--std", "255", "--crop-ratio", "1"]
    status, _, first = cli(capsys, "calibrate", model, "--images", images, "--out", out, *raw, "--no-check")
    assert status == 0 and "replacing" not in first
    status, _, second = cli(capsys, "calibrate", model, "--images", images, "--out", out, *raw, "--no-check")
    assert status == 0
    assert f"ptq calibrate: note: replacing the existing tiny.quant.json, tiny.qdq.onnx in {out}\n" in second
    report = ["report", model, "--quant", table, "--images", images, "--out", out]
    status, _, first = cli(capsys, *report)
    assert status == 0 and "replacing" not in first
    status, _, second = cli(capsys, *report)
    assert f"ptq report: note: replacing the existing report.json, report.csv, report.html in {out}\n" in second
    status, _, quiet = cli(capsys, *report, "-q")
    assert status == 0 and "replacing" not in quiet
    status, _, _ = cli(capsys, "table", "set", table, "conv", "--bits", "7", "--out", out / "t.json")
    status, _, again = cli(capsys, "table", "set", table, "conv", "--bits", "6", "--out", out / "t.json")
    assert status == 0 and f"ptq table: note: replacing the existing {out / 't.json'}\n" in again
