import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import ptq.core.atomic
from ptq.core.notes import Note
from ptq.core.atomic import atomic_write_text
from ptq.core.qparams import QParams
from ptq.table.quant_table import (
    CalibrationOptions,
    QuantTable,
    QuantTableError,
    TensorEntry,
    load_quant_table,
    save_quant_table,
)
from ptq.table.edit import edit_entry


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


def saved(tmp_path) -> tuple[Path, dict]:
    path = save_quant_table(sample_table(), tmp_path / "t.json")
    return path, json.loads(path.read_text())


def corrupt(tmp_path, edit):
    path, data = saved(tmp_path)
    edit(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.pop("tensors"), "missing key 'tensors'"),
        (lambda d: d["tensors"]["a"].pop("min"), "tensor 'a': missing key 'min'; add it"),
        (lambda d: d["tensors"]["a"].pop("scale"), "tensor 'a': missing key 'scale'; give it with 'zero_point', or "
         "delete both to have them recomputed from 'min'/'max'"),
        (lambda d: d["tensors"]["a"].update(bits="8"), "tensor 'a': 'bits' must be an integer from 2 to 16, got '8'; "
         "use e.g. 8 or 16"),
        (lambda d: d["tensors"]["a"].update(bits=1), "tensor 'a': 'bits' must be an integer from 2 to 16, got 1"),
        (lambda d: d["tensors"]["a"].update(bits=8.5), "tensor 'a': 'bits' must be an integer from 2 to 16, got 8.5"),
        (lambda d: d["tensors"]["a"].update(zero_point=[300]),
         r"tensor 'a': 'zero_point' 300 is outside \[-128, 127\] \(signed 8 bits\); use a value in that range"),
        (lambda d: d["tensors"]["w"].update(zero_point=[0, -8, 0]),
         r"tensor 'w': 'zero_point' -8 is outside \[-7, 7\] \(signed 4 bits, narrow\)"),
        (lambda d: d["tensors"]["a"].update(zero_point=[1.5]), "tensor 'a': 'zero_point' must be an integer, got 1.5; "
         "codes are integers: round it"),
        (lambda d: d["tensors"]["a"].update(scale=[-1.0]), "tensor 'a': 'scale' -1 is not positive; give the step "
         "between codes"),
        (lambda d: d["tensors"]["a"].update(scale=[0.0]), "tensor 'a': 'scale' 0 is not positive"),
        (lambda d: d["tensors"]["a"].update(scale=[1e-50]), "tensor 'a': 'scale' 1e-50 is outside float32's range"),
        (lambda d: d["tensors"]["a"].update(scale=["x"]), "tensor 'a': 'scale' must hold finite numbers, got 'x'"),
        (lambda d: d["tensors"]["w"].update(scale=[0.1, 0.2]), "tensor 'w': 'scale' has 2 values, 'min'/'max' have 3 "
         "\\(one per channel\\); give one scale per channel"),
        (lambda d: d["tensors"]["w"].update(max=[0.2, 0.005]), "tensor 'w': 'min' has 3 values, 'max' 2"),
        (lambda d: d["tensors"]["a"].update(scale=[0.5, 0.5], zero_point=[0, 0], min=[0, 0], max=[1, 1]),
         "tensor 'a': 'min'/'max' have 2 values but the entry is per-tensor \\('axis' null\\); give one value each, "
         "or set 'axis'"),
        (lambda d: d["tensors"]["a"].update(min=[30.0]), "tensor 'a': 'min' 30 > 'max' 25.1; swap them"),
        (lambda d: d["tensors"]["w"].update(min=[-0.3, 0.01, 0.0]), "tensor 'w': 'min' 0.01 > 'max' 0.005 "
         "\\(channel 1\\)"),
        (lambda d: d["tensors"]["a"].update(kind="bias"), "tensor 'a': 'kind' must be \"activation\" or \"weight\""),
        (lambda d: d["tensors"]["a"].update(axis="0"), "tensor 'a': 'axis' must be an integer"),
        (lambda d: d["tensors"]["a"].update(signed="yes"), "tensor 'a': 'signed' must be true or false"),
        (lambda d: d["tensors"]["w"].update({"float": True}), "tensor 'w': 'float' is true on a weight; mark the "
         "output of the layer using it \\(an activation\\) float instead"),
        (lambda d: d["tensors"]["a"].update(scael=[0.1]), "tensor 'a': unknown key 'scael'; the keys are kind"),
        (lambda d: d["tensors"]["a"].update(check="edited"), "tensor 'a': 'check' 'edited' is not a fingerprint ptq "
         "wrote; delete it"),
        (lambda d: d["options"].update(colour="blue"), "unknown options"),
        (lambda d: d["options"].update(bits=99), "bits must be an integer"),
        (lambda d: d.update(tensors=[]), "'tensors' must be an object"),
    ],
)
def test_load_rejects_inconsistent_tables_naming_tensor_field_and_fix(tmp_path, edit, message):
    with pytest.raises(QuantTableError, match=message) as info:
        load_quant_table(corrupt(tmp_path, edit))
    assert "\n" not in str(info.value)


def test_load_rejects_missing_and_non_json_files(tmp_path):
    with pytest.raises(QuantTableError, match="not found"):
        load_quant_table(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(QuantTableError, match="not valid JSON"):
        load_quant_table(tmp_path / "bad.json")
    (tmp_path / "nan.json").write_text('{"ptq_version": "0", "options": {}, "tensors": {"a": {"kind": "activation", '
                                       '"calibrator": "x", "min": [NaN], "max": [1], "scale": [1], "zero_point": [0], '
                                       '"bits": 8, "signed": true, "axis": null}}}')
    with pytest.raises(QuantTableError, match="'min' must hold finite numbers, got nan"):
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

    monkeypatch.setattr(ptq.core.atomic.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "three")
    assert path.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def load_noting(path) -> tuple[QuantTable, list[str]]:
    """The table and the notes loading it issued."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = load_quant_table(path)
    return table, [str(w.message) for w in caught if issubclass(w.category, Note)]


def test_a_saved_table_loads_without_notes_and_saves_back_byte_for_byte(tmp_path):
    path, data = saved(tmp_path)
    table, notes = load_noting(path)
    assert notes == []
    again = save_quant_table(table, tmp_path / "again.json")
    assert again.read_bytes() == path.read_bytes()
    assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{8}", e["check"]) for e in data["tensors"].values())
    assert "float" not in json.dumps(data["tensors"])  # written only when set


def test_a_table_without_fingerprints_loads_with_identical_numbers(tmp_path):
    """Tables written before fingerprints existed: every field as written, no note."""
    path, data = saved(tmp_path)
    for entry in data["tensors"].values():
        del entry["check"]
    path.write_text(json.dumps(data))
    table, notes = load_noting(path)
    assert notes == [] and table.tensors == sample_table().tensors


def test_an_edited_scale_is_rounded_to_float32_and_used_with_a_note(tmp_path):
    path, data = saved(tmp_path)
    written = data["tensors"]["a"]["scale"][0] / 20
    assert float(np.float32(written)) != written  # the case the old loader rejected
    data["tensors"]["a"]["scale"] = [written]
    path.write_text(json.dumps(data, indent=2))  # reformatted by an editor: values count, not text
    table, notes = load_noting(path)
    entry = table.tensors["a"]
    assert entry.qparams.scale[0] == float(np.float32(written))
    assert entry.qparams.zero_point[0] == -3 and entry.min[0] == -12.7 and entry.max[0] == 25.1  # the rest as saved
    assert len(notes) == 1  # one note for the tensor, saying both things
    assert "tensor 'a': 'scale'/'zero_point'/'signed'/'narrow' edited: used as written" in notes[0]
    assert f"'scale' {written!r} is not a float32 value: using the nearest one, {np.float32(written):.9g}" in notes[0]
    assert table.tensors["w"] == sample_table().tensors["w"]


def test_an_edited_range_recomputes_scale_and_zero_point_with_a_note(tmp_path):
    path, data = saved(tmp_path)
    data["tensors"]["a"].update(min=[-2.0], max=[6.0])
    path.write_text(json.dumps(data))
    table, notes = load_noting(path)
    qp = table.tensors["a"].qparams
    # the table's options: asymmetric int8 activations, x_f = (x_q - zp) * s over [-2, 6]
    scale = float(np.float32(8.0 / 255))
    assert qp.scale[0] == scale and qp.zero_point[0] == round(-128 + 2.0 / scale) == -64 and qp.signed
    assert notes == ["%s: tensor 'a': 'min'/'max'/'bits' changed: scale and zero_point recomputed from them "
                     "(scale %.9g -> %.9g, zero_point -3 -> -64)" % (path, np.float32(0.1), scale)]


def test_an_edited_bit_width_recomputes_the_grid_for_the_new_codes(tmp_path):
    path, data = saved(tmp_path)
    data["tensors"]["a"]["bits"] = 16
    data["tensors"]["w"]["bits"] = 8  # per-channel weights: symmetric, narrow, one scale per channel
    path.write_text(json.dumps(data))
    table, notes = load_noting(path)
    qp = table.tensors["a"].qparams
    scale = float(np.float32((25.1 + 12.7) / 65535))
    assert (qp.bits, qp.scale[0], qp.zero_point[0]) == (16, scale, round(-32768 + 12.7 / scale))
    w = table.tensors["w"].qparams
    amax = np.maximum(np.abs([-0.3, -0.001, 0.0]), [0.2, 0.005, 1e-4])
    np.testing.assert_array_equal(w.scale, (amax / 127).astype(np.float32).astype(np.float64))
    assert w.bits == 8 and w.narrow and list(w.zero_point) == [0, 0, 0] and len(notes) == 2


def test_range_and_grid_both_edited_use_the_grid_as_written(tmp_path):
    path, data = saved(tmp_path)
    data["tensors"]["a"].update(min=[-1.0], max=[1.0], scale=[0.25], zero_point=[4])
    path.write_text(json.dumps(data))
    table, notes = load_noting(path)
    qp = table.tensors["a"].qparams
    assert (qp.scale[0], qp.zero_point[0], table.tensors["a"].min[0]) == (0.25, 4, -1.0)
    assert notes[0].endswith("edited: used as written; 'min'/'max'/'bits' changed too and are kept as written")


def test_deleting_scale_and_zero_point_recomputes_them_even_without_fingerprints(tmp_path):
    path, data = saved(tmp_path)
    for key in ("scale", "zero_point", "check", "signed"):
        del data["tensors"]["u"][key]
    path.write_text(json.dumps(data))
    table, notes = load_noting(path)
    qp = table.tensors["u"].qparams  # [0, 7.99] at 16 bits: unsigned, zero point 0
    assert (qp.signed, qp.zero_point[0], qp.scale[0]) == (False, 0, float(np.float32(7.99 / 65535)))
    assert "tensor 'u': no 'scale'/'zero_point': computed from 'min'/'max'" in notes[0]


def test_the_float_flag_is_saved_only_when_set_and_loads_back(tmp_path):
    path, data = saved(tmp_path)
    data["tensors"]["a"]["float"] = True
    path.write_text(json.dumps(data))
    table, notes = load_noting(path)
    assert notes == [] and table.tensors["a"].run_in_float and table.float_tensors() == ["a"]
    resaved = json.loads(save_quant_table(table, tmp_path / "again.json").read_text())
    assert resaved["tensors"]["a"]["float"] is True and "float" not in resaved["tensors"]["u"]
    assert load_quant_table(tmp_path / "again.json").tensors == table.tensors


def test_the_why_note_is_saved_only_when_set_kept_on_load_and_outside_the_fingerprints(tmp_path):
    path, data = saved(tmp_path)
    data["tensors"]["a"]["why"] = "a note on the grid"  # the saved fingerprints still match: no edit noted
    path.write_text(json.dumps(data))
    table, notes = load_noting(path)
    assert notes == [] and table.tensors["a"].why == "a note on the grid" and table.tensors["u"].why == ""
    resaved = json.loads(save_quant_table(table, tmp_path / "again.json").read_text())
    assert resaved["tensors"]["a"]["why"] == "a note on the grid" and "why" not in resaved["tensors"]["u"]
    data["tensors"]["a"]["why"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(QuantTableError, match="'why' must be a string"):
        load_quant_table(path)


@pytest.mark.parametrize("json_edit, change", [
    (lambda e: e.update(scale=[e["scale"][0] / 20]), {"scale": float(np.float32(0.1)) / 20}),
    (lambda e: e.update(min=[-2.0], max=[6.0]), {"value_range": (-2.0, 6.0)}),
    (lambda e: e.update(bits=16), {"bits": 16}),
    (lambda e: e.update(bits=16, scale=[0.001], zero_point=[-5]), {"bits": 16, "scale": 0.001, "zero_point": -5}),
    (lambda e: e.update({"float": True}), {"run_in_float": True}),
])
def test_edit_entry_gives_the_table_a_json_edit_gives(tmp_path, json_edit, change):
    path, data = saved(tmp_path)
    json_edit(data["tensors"]["a"])
    path.write_text(json.dumps(data))
    by_hand, _ = load_noting(path)
    by_api = edit_entry(load_quant_table(save_quant_table(sample_table(), tmp_path / "s.json")), "a", **change)
    assert by_api.tensors == by_hand.tensors
    assert save_quant_table(by_api, tmp_path / "api.json").read_bytes() == \
        save_quant_table(by_hand, tmp_path / "hand.json").read_bytes()


def test_edit_entry_refuses_one_value_for_a_per_channel_entry_and_unknown_tensors():
    with pytest.raises(ValueError, match=r"tensor 'w' is per-channel \(3 channels along axis 0\): --range, --scale"):
        edit_entry(sample_table(), "w", value_range=(-1, 1))
    with pytest.raises(ValueError, match="tensor 'aa' is not in the quant table; did you mean 'a'"):
        edit_entry(sample_table(), "aa", bits=16)
    with pytest.raises(ValueError, match="nothing to change"):
        edit_entry(sample_table(), "a")
    narrower = edit_entry(sample_table(), "w", bits=8)  # --bits is fine per channel
    assert narrower.tensors["w"].qparams.bits == 8 and narrower.tensors["w"].qparams.scale.size == 3
