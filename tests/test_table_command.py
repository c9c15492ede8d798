"""`ptq table show|set` and the hand-edited-table workflow: a quant table edited in JSON or with `ptq table set`
loads with notes, drives `ptq report` / `ptq run`, and both routes give the same table."""
import json
from pathlib import Path

import numpy as np
import pytest

from ptq.cli import main
from ptq.core.graph import load_model
from ptq.engine.executor import ExecutorError, prepare
from ptq.data.images import Preprocess
from ptq.core.notes import Note
from ptq.calibration.pipeline import calibrate
from ptq.table.quant_table import load_quant_table, save_quant_table
from reports.layer_nodes import float_node_names
from tiny_models import write_tiny_case

RAW = Preprocess(mean=0, std=255, crop_ratio=1.0)


@pytest.fixture()
def tiny(tmp_path):
    """The tiny Conv/Clip/Gemm model, 5 images, and its table calibrated with extrema."""
    model, images, _ = write_tiny_case(tmp_path, 5)
    result = calibrate(model, images, tmp_path / "out", preprocess=RAW, write_qdq=False, calibrator="extrema")
    return model, images, result.table_path


def test_show_prints_the_choice_the_auto_calibrator_made(tmp_path, capsys):
    model, images, _ = write_tiny_case(tmp_path, 5)
    table_path = calibrate(model, images, tmp_path / "out", preprocess=RAW, calibrator="auto",
                           write_qdq=False).table_path
    status, out, _ = cli(capsys, "table", "show", table_path, "act")
    label = load_quant_table(table_path).tensors["act"].calibrator
    assert status == 0 and label.startswith("auto:") and "of extrema's" in label
    assert out.splitlines()[0] == f"tensor 'act': activation, calibrator {label}, per-tensor"
    status, out, _ = cli(capsys, "table", "show", table_path, "logits")  # a graph output keeps its extremes
    assert status == 0 and out.splitlines()[0].startswith("tensor 'logits': activation, calibrator auto:extrema (")


def cli(capsys, *argv) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def edit_json(path: Path, out: Path, tensor: str, **fields) -> Path:
    data = json.loads(path.read_text())
    data["tensors"][tensor].update(fields)
    out.write_text(json.dumps(data, indent=1))
    return out


def load_edited(path: Path):
    """A hand-edited table: loading it notes the edits."""
    with pytest.warns(Note):
        return load_quant_table(path)


def test_show_prints_one_row_per_tensor(tiny, capsys):
    _, _, table_path = tiny
    table = load_quant_table(table_path)
    status, out, err = cli(capsys, "table", "show", table_path)
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"{table_path}: {len(table.tensors)} tensors (") and "calibrator extrema" in lines[0]
    assert lines[1].split() == ["tensor", "kind", "type", "granularity", "min", "max", "scale", "zero_point", "float"]
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert list(rows) == list(table.tensors)
    act = table.tensors["act"]
    assert rows["act"] == ["act", "activation", "uint8", "tensor", "0", f"{act.max[0]:.6g}",
                           f"{act.qparams.scale[0]:.6g}", "0"]
    w = table.tensors["W"].qparams
    assert rows["W"][2:5] == ["int8", "narrow", "axis"] and rows["W"][5] == "0" and rows["W"][6] == "(4)"
    assert rows["W"][-2] == f"{w.scale.min():.6g}..{w.scale.max():.6g}"


def test_show_prints_a_tensor_in_full_with_the_range_its_grid_covers(tiny, capsys):
    _, _, table_path = tiny
    qp = load_quant_table(table_path).tensors["logits"].qparams
    status, out, _ = cli(capsys, "table", "show", table_path, "logits")
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == "tensor 'logits': activation, calibrator extrema, per-tensor"
    assert lines[1] == "  grid   int8: codes [-128, 127]"
    assert lines[2] == "  float  no"
    lo, hi = (-128 - int(qp.zero_point[0])) * qp.scale[0], (127 - int(qp.zero_point[0])) * qp.scale[0]
    assert lines[-1].split()[-2:] == [f"[{lo:.6g},", f"{hi:.6g}]"]
    status, out, _ = cli(capsys, "table", "show", table_path, "W")
    assert status == 0 and "per-channel along axis 0 (4 channels)" in out
    assert [line.split()[0] for line in out.splitlines()[5:]] == ["0", "1", "2", "3"]


def test_show_names_the_closest_tensors_for_a_typo(tiny, capsys):
    _, _, table_path = tiny
    status, _, err = cli(capsys, "table", "show", table_path, "logit")
    assert status == 2
    assert err == "ptq table: error: tensor 'logit' is not in the quant table; did you mean 'logits'?\n"


def test_set_range_recomputes_the_grid_writes_out_and_leaves_the_input_alone(tiny, capsys):
    _, _, table_path = tiny
    before = table_path.read_bytes()
    old = load_quant_table(table_path).tensors["act"]
    out_path = table_path.parent / "edited.quant.json"
    status, out, err = cli(capsys, "table", "set", table_path, "act", "--range=0,3", "--out", out_path)
    assert status == 0 and err == ""
    scale = float(np.float32(3 / 255))  # unsigned asymmetric 8 bits over [0, 3]
    assert out.splitlines() == [
        f"act: max: {old.max[0]:.9g} -> 3; scale: {old.qparams.scale[0]:.9g} -> {scale:.9g}", f"wrote {out_path}"]
    assert table_path.read_bytes() == before
    qp = load_quant_table(out_path).tensors["act"].qparams
    assert (qp.scale[0], qp.zero_point[0], qp.signed) == (scale, 0, False)


def test_set_in_place_and_its_refusals(tiny, capsys):
    _, _, table_path = tiny
    status, out, _ = cli(capsys, "table", "set", table_path, "logits", "--zero-point", "5", "--bits", "16")
    assert status == 0 and "zero_point: " in out and "bits: 8 -> 16" in out
    qp = load_quant_table(table_path).tensors["logits"].qparams
    assert (qp.bits, qp.zero_point[0]) == (16, 5)  # a grid given with the bits is taken as given
    assert sorted(p.name for p in table_path.parent.iterdir()) == ["tiny.quant.json"]  # no temp file left
    before = table_path.read_bytes()
    for argv, message in [
        (["W", "--range=-1,1"], "tensor 'W' is per-channel (4 channels along axis 0): --range, --scale and "
                                "--zero-point set one value; edit its lists in the JSON instead"),
        (["W", "--float"], f"{table_path}: tensor 'W': 'float' is true on a weight; mark the output of the layer "
                           "using it (an activation) float instead"),
        (["act", "--scale", "-1"], f"{table_path}: tensor 'act': 'scale' -1 is not positive; give the step between "
                                   "codes (> 0), or delete 'scale' and 'zero_point' to have them recomputed"),
        (["act", "--bits", "17"], f"{table_path}: tensor 'act': 'bits' must be an integer from 2 to 16, got 17"),
        (["act", "--range=2,1"], f"{table_path}: tensor 'act': 'min' 2 > 'max' 1; swap them, or give min <= max"),
        (["act"], "nothing to change: give --bits, --range, --scale, --zero-point, --float or --no-float"),
    ]:
        status, _, err = cli(capsys, "table", "set", table_path, *argv)
        assert status == 2 and err.startswith(f"ptq table: error: {message}") and err.count("\n") == 1, err
    assert table_path.read_bytes() == before


def test_a_tensor_marked_float_runs_its_fused_layer_in_float(tiny, capsys):
    """`ptq table set --float act`: the Conv and the Clip fused into it run in float, exactly as
    `--float-nodes` with the layer's nodes (what `ptq debug --fake-quant act` floats) on the unmarked table."""
    model, images, table_path = tiny
    plain = load_quant_table(table_path)
    assert cli(capsys, "table", "set", table_path, "act", "--float")[0] == 0
    marked = load_quant_table(table_path)
    graph = load_model(model)
    prepared = prepare(graph, marked)
    assert [(f.name, f.reason) for f in prepared.float_nodes] == [
        ("conv", "float in the quant table ('act')"), ("clip", "float in the quant table ('act')")]
    nodes = float_node_names(prepare(graph, plain), ["act"])
    assert nodes == ["conv", "clip"]
    x = np.random.default_rng(1).uniform(0, 1, (2, 3, 8, 8)).astype(np.float32)
    by_flag = prepared.run({"input": x}).outputs["logits"]
    by_option = prepare(graph, plain, float_nodes=nodes).run({"input": x}).outputs["logits"]
    np.testing.assert_array_equal(by_flag, by_option)
    status, out, _ = cli(capsys, "run", model, "--quant", table_path, "--images", images, "--mean", "0", "--std",
                         "255", "--crop-ratio", "1")
    assert status == 0 and "2 node(s) run in float" in out and "conv (Conv): float in the quant table ('act')" in out
    assert cli(capsys, "table", "set", table_path, "act", "--no-float")[0] == 0
    assert load_quant_table(table_path).tensors == plain.tensors


def test_export_writes_the_qdq_model_of_an_edited_table_beside_it_and_onnxruntime_runs_it(tiny, capsys):
    """`ptq table export` after `table set --float` and `--bits 16`: the model is written beside the table,
    checked on the samples given (preprocessed as the table records), and onnxruntime at its default
    optimizations computes what `ptq run` computes on the edited table."""
    import onnxruntime as ort

    from ptq.data.images import InputSpec, load_image

    model, images, table_path = tiny
    assert cli(capsys, "table", "set", table_path, "act", "--float")[0] == 0
    assert cli(capsys, "table", "set", table_path, "logits", "--bits", "16")[0] == 0
    qdq_path = table_path.parent / "tiny.qdq.onnx"
    status, out, err = cli(capsys, "table", "export", model, "--quant", table_path, "--images", images)
    assert status == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0] == f"QDQ model: {qdq_path} (target ort-cpu)"
    assert lines[1].startswith("QDQ model in onnxruntime (target ort-cpu), output cosine to float on 5 samples: ")
    assert lines[2:] == ["2 node(s) in float (weights and biases kept float): conv ('act'), clip ('act')",
                         "1 tensor(s) wider than 8 bits: logits"]
    table = load_quant_table(table_path)
    x = np.stack([load_image(p, RAW, InputSpec("NCHW", 3, 8, 8)) for p in sorted(images.iterdir())])
    session = ort.InferenceSession(str(qdq_path), providers=["CPUExecutionProvider"])
    got = np.concatenate([session.run(None, {"input": x[k:k + 1]})[0] for k in range(len(x))])
    want = prepare(load_model(model), table).run({"input": x}).outputs["logits"]
    cosines = [float(g @ w / np.linalg.norm(g) / np.linalg.norm(w)) for g, w in zip(got, want)]
    assert np.mean(cosines) >= 0.998 and min(cosines) >= 0.995, cosines  # the bound of the QDQ tests

    status, out, _ = cli(capsys, "table", "export", model, "--quant", table_path, "--out", qdq_path.with_name("b.onnx"))
    assert status == 0 and out.splitlines()[0] == f"QDQ model: {qdq_path.with_name('b.onnx')} (target ort-cpu)"
    assert out.splitlines()[-1] == ("not checked in onnxruntime: give --images or --data to run it against MODEL on a "
                                    "few samples")
    assert qdq_path.with_name("b.onnx").read_bytes() == qdq_path.read_bytes()  # same table, same model
    assert cli(capsys, "table", "export", model, "--quant", table_path, "-q", "--qdq-target", "none")[1] == ""


def test_export_refuses_its_inputs_as_output_and_a_table_of_another_model(tiny, tmp_path, capsys):
    model, _, table_path = tiny
    before = {p: p.read_bytes() for p in (model, table_path)}
    for out, what in [(model, "model"), (table_path, "quant table")]:
        status, _, err = cli(capsys, "table", "export", model, "--quant", table_path, "--out", out)
        assert status == 2 and err == f"ptq table: error: refusing to overwrite the input {what} {out} with {out}\n"
    renamed = json.loads(table_path.read_text())
    renamed["tensors"]["activation"] = renamed["tensors"].pop("act")
    other = tmp_path / "other.quant.json"
    other.write_text(json.dumps(renamed))
    status, _, err = cli(capsys, "table", "export", model, "--quant", other)
    assert status == 2 and err == ("ptq table: error: the quant table does not match the model: 1 of its tensors "
                                   "are not in the model ('activation'); was it calibrated on this model?\n")
    assert {p: p.read_bytes() for p in (model, table_path)} == before
    assert not list(tmp_path.rglob("*.qdq.onnx"))


def test_a_per_channel_scale_list_that_does_not_fit_the_weight_is_refused_by_the_executor(tiny, capsys):
    model, _, table_path = tiny
    data = json.loads(table_path.read_text())
    entry = data["tensors"]["W"]
    for key in ("min", "max", "scale", "zero_point"):
        entry[key] = entry[key][:3]
    table_path.write_text(json.dumps(data))
    with pytest.raises(ExecutorError, match=r"quant table: tensor 'W': 'scale' has 3 values but the weight has 4 "
                                            r"channels along axis 0; give one scale, zero_point, min and max per"):
        prepare(load_model(model), load_edited(table_path))


def test_the_cli_prints_each_note_once_as_one_line(tiny, tmp_path, capsys):
    _, _, table_path = tiny
    edited = edit_json(table_path, tmp_path / "e.json", "act", max=[3.0], scale=[0.1])
    edited = edit_json(edited, edited, "logits", max=[20.0])
    status, _, err = cli(capsys, "table", "show", edited)
    assert status == 0
    assert err.splitlines() == [
        f"ptq table: note: {edited}: tensor 'act': 'scale'/'zero_point'/'signed'/'narrow' edited: used as written; "
        "'min'/'max'/'bits' changed too and are kept as written; 'scale' 0.1 is not a float32 value: using the "
        "nearest one, 0.100000001 (scales are float32, as in the QDQ model)",
        f"ptq table: note: {edited}: tensor 'logits': 'min'/'max'/'bits' changed: scale and zero_point recomputed "
        f"from them (scale {load_quant_table(table_path).tensors['logits'].qparams.scale[0]:.9g} -> "
        f"{load_edited(edited).tensors['logits'].qparams.scale[0]:.9g}, zero_point "
        f"{load_quant_table(table_path).tensors['logits'].qparams.zero_point[0]} -> "
        f"{load_edited(edited).tensors['logits'].qparams.zero_point[0]})",
    ]


# The workflow on the bundled EfficientNet-Lite0: one activation's scale divided by 20 by hand.
LAYER = "getitem_6"  # the output of the third Conv: a signed range of about +-50


@pytest.fixture(scope="module")
def effnet_table(model_path, calib_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("table")
    assert main(["calibrate", str(model_path), "--images", str(calib_dir), "--out", str(out), "-q",
                 "--num-images", "4"]) == 0
    return out / "efficientnet_lite0.quant.json"


def report(model_path, calib_dir, table: Path, out: Path) -> dict:
    assert main(["report", str(model_path), "--quant", str(table), "--images", str(calib_dir), "--num-images", "1",
                 "--isolated-images", "1", "--out", str(out)]) == 0
    return json.loads((out / "report.json").read_text())


def test_hand_edited_scale_drives_the_report_and_equals_table_set(model_path, calib_dir, effnet_table, tmp_path,
                                                                 capsys):
    saved = json.loads(effnet_table.read_text())["tensors"][LAYER]
    assert saved["kind"] == "activation" and saved["axis"] is None
    by_hand = edit_json(effnet_table, tmp_path / "hand.quant.json", LAYER, scale=[saved["scale"][0] / 20])
    before = report(model_path, calib_dir, effnet_table, tmp_path / "before")
    capsys.readouterr()
    after = report(model_path, calib_dir, by_hand, tmp_path / "after")
    err = capsys.readouterr().err
    assert f"ptq report: note: {by_hand}: tensor '{LAYER}': 'scale'/'zero_point'/'signed'/'narrow' edited: used as " \
           "written" in err and err.count("note:") == 1

    def layer(rep):
        return next(row for row in rep["layers"] if row["name"] == LAYER)

    assert layer(after)["isolated"]["cosine"] < layer(before)["isolated"]["cosine"] - 0.05  # 95% of it saturates
    assert layer(after)["cumulative"]["cosine"] < layer(before)["cumulative"]["cosine"] - 0.05
    assert after["outputs"]["tensors"][0]["cosine"] < before["outputs"]["tensors"][0]["cosine"]
    others = [r["name"] for r in before["layers"] if r["name"] != LAYER][:3]  # upstream layers are untouched
    assert [layer_row["isolated"] for layer_row in before["layers"] if layer_row["name"] in others] == \
        [layer_row["isolated"] for layer_row in after["layers"] if layer_row["name"] in others]

    by_set = tmp_path / "set.quant.json"
    assert main(["table", "set", str(effnet_table), LAYER, "--scale", repr(saved["scale"][0] / 20),
                 "--out", str(by_set)]) == 0
    assert by_set.read_bytes() == save_quant_table(load_edited(by_hand), tmp_path / "resaved.json").read_bytes()


def test_hand_edited_range_recomputes_the_scale_and_equals_table_set(effnet_table, tmp_path, capsys):
    untouched = load_quant_table(effnet_table)
    assert save_quant_table(untouched, tmp_path / "same.json").read_bytes() == effnet_table.read_bytes()
    by_hand = edit_json(effnet_table, tmp_path / "hand.quant.json", LAYER, min=[-10.0], max=[10.0])
    status, _, err = cli(capsys, "table", "show", by_hand, LAYER)
    assert status == 0
    old = untouched.tensors[LAYER].qparams
    scale = float(np.float32(20 / 255))  # asymmetric signed int8 over [-10, 10]
    zp = round(-128 + 10 / scale)
    assert err == (f"ptq table: note: {by_hand}: tensor '{LAYER}': 'min'/'max'/'bits' changed: scale and zero_point "
                   f"recomputed from them (scale {old.scale[0]:.9g} -> {scale:.9g}, zero_point {old.zero_point[0]} "
                   f"-> {zp})\n")
    qp = load_edited(by_hand).tensors[LAYER].qparams
    assert (qp.scale[0], qp.zero_point[0]) == (scale, zp)
    by_set = tmp_path / "set.quant.json"
    assert cli(capsys, "table", "set", effnet_table, LAYER, "--range=-10,10", "--out", by_set)[0] == 0
    assert by_set.read_bytes() == save_quant_table(load_edited(by_hand), tmp_path / "resaved.json").read_bytes()
    changed = [n for n, e in load_quant_table(by_set).tensors.items() if e != untouched.tensors[n]]
    assert changed == [LAYER]


def test_a_negative_range_is_accepted_with_or_without_the_equals_sign(tiny, tmp_path, capsys):
    """Issue 27, item 8: `--range -2,3.5` was `argument --range: expected one argument`."""
    _, _, table_path = tiny
    spaced, joined = tmp_path / "spaced.quant.json", tmp_path / "joined.quant.json"
    assert cli(capsys, "table", "set", table_path, "input", "--range", "-2,3.5", "--out", spaced)[0] == 0
    assert cli(capsys, "table", "set", table_path, "input", "--range=-2,3.5", "--out", joined)[0] == 0
    assert spaced.read_text() == joined.read_text()
    entry = load_quant_table(spaced).tensors["input"]
    assert (float(entry.min[0]), float(entry.max[0])) == (-2.0, 3.5)
    with pytest.raises(SystemExit):  # a flag after --range is not its value
        cli(capsys, "table", "set", table_path, "input", "--range", "--out", joined)
    assert "argument --range: expected one argument" in capsys.readouterr().err
