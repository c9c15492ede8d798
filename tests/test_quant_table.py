import json
import os

import numpy as np
import pytest

import ptq.atomic
from ptq.atomic import atomic_write_text
from ptq.core.qparams import QParams
from ptq.quant_table import (
    CalibrationOptions,
    QuantTable,
    QuantTableError,
    TensorEntry,
    load_quant_table,
    save_quant_table,
)


def sample_table() -> QuantTable:
    act = QParams(np.float32(0.1) * 1.0, -3, 8, True)
    weight = QParams(np.array([0.011, 0.0007, 1.3e-5]), [0, 0, 0], 4, True, axis=0, narrow=True)
    wide = QParams(2.0 ** -12, 7, 16, False)
    return QuantTable(
        CalibrationOptions(calibrator="99.99percentile", bits=8, weight_bits=4, preprocess={"mean": [1.5, 2, 3]}),
        {
            "a": TensorEntry("activation", "99.99percentile", -12.7, 25.1, act),
            "w": TensorEntry("weight", "extrema", [-0.3, -0.001, 0.0], [0.2, 0.005, 1e-4], weight),
            "u": TensorEntry("activation", "kld", 0.0, 7.99, wide),
        },
    )


def test_save_load_roundtrip_is_exact(tmp_path):
    table = sample_table()
    path = save_quant_table(table, tmp_path / "m.quant.json")
    loaded = load_quant_table(path)
    assert loaded.tensors == table.tensors and loaded.options == table.options
    assert loaded.ptq_version == table.ptq_version
    data = json.loads(path.read_text())
    assert set(data) == {"ptq_version", "options", "tensors"}
    assert data["tensors"]["a"]["axis"] is None and data["tensors"]["a"]["scale"] == [float(np.float32(0.1))]
    assert data["tensors"]["w"]["axis"] == 0 and len(data["tensors"]["w"]["zero_point"]) == 3
    for entry in data["tensors"].values():
        assert {"min", "max", "scale", "zero_point", "bits", "signed", "axis", "calibrator", "kind"} <= set(entry)


def corrupt(tmp_path, edit):
    data = json.loads(save_quant_table(sample_table(), tmp_path / "t.json").read_text())
    edit(data)
    (tmp_path / "t.json").write_text(json.dumps(data))
    return tmp_path / "t.json"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.pop("tensors"), "missing key 'tensors'"),
        (lambda d: d["tensors"]["a"].pop("scale"), "tensor 'a': missing key 'scale'"),
        (lambda d: d["tensors"]["a"].update(bits="8"), "'bits' must be int"),
        (lambda d: d["tensors"]["a"].update(bits=1), "bits must be in"),
        (lambda d: d["tensors"]["a"].update(zero_point=[300]), "zero point"),
        (lambda d: d["tensors"]["a"].update(zero_point=[1.5]), "list of integers"),
        (lambda d: d["tensors"]["a"].update(scale=[-1.0]), "scale must be finite and positive"),
        (lambda d: d["tensors"]["a"].update(scale=[0.1]), "float32-representable"),
        (lambda d: d["tensors"]["w"].update(max=[0.2, 0.005]), "same length"),
        (lambda d: d["tensors"]["a"].update(scale=[0.5, 0.5], zero_point=[0, 0], min=[0, 0], max=[1, 1]),
         "per-tensor entry"),
        (lambda d: d["tensors"]["a"].update(min=[30.0]), "min > max"),
        (lambda d: d["tensors"]["a"].update(kind="bias"), "kind must be one of"),
        (lambda d: d["tensors"]["a"].update(axis="0"), "'axis' must be an integer or null"),
        (lambda d: d["options"].update(colour="blue"), "unknown options"),
        (lambda d: d["options"].update(bits=99), "bits must be an integer"),
        (lambda d: d.update(tensors=[]), "'tensors' must be an object"),
    ],
)
def test_load_rejects_inconsistent_tables_with_a_clear_message(tmp_path, edit, message):
    with pytest.raises(QuantTableError, match=message):
        load_quant_table(corrupt(tmp_path, edit))


def test_load_rejects_missing_and_non_json_files(tmp_path):
    with pytest.raises(QuantTableError, match="not found"):
        load_quant_table(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(QuantTableError, match="not valid JSON"):
        load_quant_table(tmp_path / "bad.json")
    (tmp_path / "nan.json").write_text('{"ptq_version": "0", "options": {}, "tensors": {"a": {"kind": "activation", '
                                       '"calibrator": "x", "min": [NaN], "max": [1], "scale": [1], "zero_point": [0], '
                                       '"bits": 8, "signed": true, "axis": null}}}')
    with pytest.raises(QuantTableError, match="finite numbers"):
        load_quant_table(tmp_path / "nan.json")


def test_atomic_write_replaces_and_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ptq.atomic.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "three")
    assert path.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]
