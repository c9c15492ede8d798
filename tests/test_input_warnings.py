"""Warnings on input that runs but is likely wrong (issue 27, items 2 and 12): a normalization in 0..1 units,
a calibration on fewer than 16 readable images, --workers on too few samples."""
import logging
import warnings

import pytest

from ptq.cli import main
from ptq.core.notes import Note
from ptq.parallel.workers import choose_workers
from tiny_models import write_images, write_tiny_case

TORCHVISION = ["--mean", "0.485,0.456,0.406", "--std", "0.229,0.224,0.225"]
RAW = ["--mean", "0", "--std", "255", "--crop-ratio", "1"]


def data_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ptq.data" and r.levelno == logging.WARNING]


@pytest.fixture()
def tiny(tmp_path):
    model, images, _ = write_tiny_case(tmp_path, 4)
    return model, images


def calibrate_cli(model, images, out, *flags) -> int:
    return main(["calibrate", str(model), "--images", str(images), "--out", str(out), "--no-check", *flags])


def test_torchvision_normalization_in_0_1_units_is_a_warning_with_the_pixel_units(tiny, tmp_path, caplog):
    model, images = tiny
    assert calibrate_cli(model, images, tmp_path / "a", *TORCHVISION) == 0
    unit = [w for w in data_warnings(caplog) if "0..1" in w]
    assert unit == ["mean 0.485,0.456,0.406 and std 0.229,0.224,0.225 look like 0..1 units, but ptq reads pixels as "
                    "0..255: the inputs span -2.12..1136; in pixel units: --mean 123.675,116.28,103.53 "
                    "--std 58.395,57.12,57.375"]
    caplog.clear()
    assert calibrate_cli(model, images, tmp_path / "b", *RAW) == 0  # pixel units: no such warning
    assert calibrate_cli(model, images, tmp_path / "c") == 0  # the defaults
    assert not [w for w in data_warnings(caplog) if "0..1" in w]
    caplog.clear()
    assert calibrate_cli(model, images, tmp_path / "d", *TORCHVISION, "-q") == 0
    assert data_warnings(caplog) == []


def test_fewer_than_16_readable_calibration_images_is_a_warning(tmp_path, caplog):
    model, images, _ = write_tiny_case(tmp_path, 2)
    (images / "broken.jpg").write_bytes(b"not a jpeg")
    (images / "broken2.png").write_bytes(b"not a png")
    assert calibrate_cli(model, images, tmp_path / "a", *RAW) == 0
    few = [w for w in data_warnings(caplog) if "readable" in w]
    assert few == ["calibrated on 2 readable image(s) of 4: fewer than 16 give ranges that miss the values other "
                   "inputs reach; calibrate on a few hundred representative images"]
    caplog.clear()
    write_images(images, 16, size=(8, 8), prefix="more")
    assert calibrate_cli(model, images, tmp_path / "b", *RAW) == 0
    assert not [w for w in data_warnings(caplog) if "readable" in w]


def test_workers_on_too_few_samples_is_a_note_and_automatic_workers_pick_one():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert choose_workers(2, 19) == 2
        assert choose_workers(3, 150) == 3  # enough samples for three: no note
        assert choose_workers(None, 19) == 1
    notes = [str(w.message) for w in caught if issubclass(w.category, Note)]
    assert notes == ["--workers 2 on 19 samples: a worker's start-up is the work of 20-60 samples, so one process "
                     "is likely faster below 100 (without --workers ptq starts one per 50 samples)"]


def test_the_command_line_prints_the_workers_note_once(tiny, tmp_path, capsys):
    model, images = tiny
    assert calibrate_cli(model, images, tmp_path / "a", *RAW, "--workers", "2") == 0
    err = capsys.readouterr().err
    assert err.count("ptq calibrate: note: --workers 2 on 4 samples: ") == 1
