"""The lane trade-off shown (reports/lane_pareto.py, `ptq dsp-report --tune`): the Pareto front of the
assignments `ptq tune --scheme int4-dsp` measured, its SVG, and the CLI from calibrate to the report."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx

from ptq.cli import main
from ptq.table.quant_table import load_quant_table
from reports.lane_pareto import pareto_front, pareto_svg
from test_lane_mix import residual_net


def _point(label, throughput, cosine):
    return {"label": label, "throughput": throughput, "cosine": cosine, "four": [], "four_bit_macs": 0.0}


def _calibrated(tmp_path, samples: int):
    """residual_net saved in tmp_path, `samples` random .npy inputs in tmp_path/data, and its table calibrated by
    the CLI into tmp_path (net.quant.json)."""
    model = tmp_path / "net.onnx"
    onnx.save(residual_net(), model)
    data = tmp_path / "data"
    data.mkdir()
    for k, x in enumerate(np.random.default_rng(1).normal(0, 1, (samples, 3, 8, 8)).astype(np.float32)):
        np.save(data / f"s{k:02d}.npy", x)
    assert main(["calibrate", str(model), "--data", str(data), "--out", str(tmp_path), "-q"]) == 0
    return model, data


def test_front_keeps_the_points_no_other_beats_on_both_axes():
    points = [_point("a", 2.0, 0.99), _point("b", 2.5, 0.995), _point("c", 3.0, 0.97), _point("d", 2.8, 0.96),
              _point("e", 3.6, 0.5), _point("f", 2.5, 0.99)]
    assert [p["label"] for p in pareto_front(points)] == ["b", "c", "e"]


def test_svg_draws_every_point_the_front_and_the_target():
    points = [_point("all int8", 2.0, 0.99), _point("head 3", 2.6, 0.985), _point("all int4", 3.6, 0.4)]
    svg = pareto_svg(points, points[1], 0.98, "model")
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert len(re.findall(r'<circle class="point"', svg)) == 3 and svg.count('class="chosen"') == 1
    front = re.search(r'<polyline class="front" points="([^"]+)"', svg).group(1).split()
    assert len(front) == 3  # all three are on the front (more throughput, less cosine)
    xs = [float(p.split(",")[0]) for p in front]
    assert xs == sorted(xs)
    assert "target 0.98" in svg


def test_cli_tune_int4_dsp_then_dsp_report_lists_lanes_and_draws_the_front(tmp_path, capsys):
    model, data = _calibrated(tmp_path, 12)
    table = tmp_path / "net.quant.json"
    rc = main(["tune", str(model), "--quant", str(table), "--data", str(data), "--target-cosine", "0.5", "--scheme",
               "int4-dsp", "--int4-pow2", "--views", "none", "--z", "0", "--no-check", "-q"])
    out = capsys.readouterr().out
    assert rc == 0 and "layers on 4-bit lanes" in out and "reached" in out
    record = json.loads((tmp_path / "net.tune.json").read_text())
    lanes = record["lanes"]
    assert record["scheme"] == "int4-dsp" and lanes["int4_grid"]["pow2"] is True
    four = {row["node"] for row in lanes["layers"] if row["lanes"] == 4}
    assert four == set(lanes["chosen"]["four"]) and four  # a target of 0.5 puts the speeding layers on 4 bits
    assert main(["dsp-report", str(model), "--quant", str(tmp_path / "net.tuned.quant.json"), "--tune",
                 str(tmp_path / "net.tune.json"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert f"{len(four)} of 5 on int4" in out  # the table's own lanes, from the tuned table alone
    for row in lanes["layers"]:
        assert re.search(rf"{row['node']}\s+{row['lanes']}b\s+{row['macs']:,}", out), row["node"]
    svg = (tmp_path / "rep" / "lanes_pareto.svg").read_text()
    assert svg.count('<circle class="point"') == len(lanes["points"])
    report = json.loads((tmp_path / "rep" / "dsp_report.json").read_text())
    assert {layer["node"] for layer in report["layers"] if layer["lanes"] == "int4"} == four
    assert main(["report", str(model), "--quant", str(tmp_path / "net.tuned.quant.json"), "--data", str(data),
                 "--num-images", "2", "--out", str(tmp_path / "html"), "--tune", str(tmp_path / "net.tune.json")]) == 0
    page = (tmp_path / "html" / "report.html").read_text()
    section = page[page.index("<h2>DSP lanes"):page.index("<h2>Cosine along the graph")]
    assert section.count('<circle class="point"') == len(lanes["points"]) and 'class="chosen"' in section
    layer_rows = re.search(r'<table id="lane-layers">.*?</table>', section).group(0)
    for row in lanes["layers"]:
        assert re.search(rf"<td class=\"t\">{row['node']}</td><td>{row['lanes']}-bit</td><td>{row['macs']:,}</td>",
                         layer_rows), row["node"]
    assert re.search(r'<table id="lane-points">.*?</table>', section).group(0).count("<tr>") + \
        section.count('<tr class="suspect">') == len(lanes["points"]) + 1  # + the header row
    dumps = {}
    for backend in ("numpy", "dsp:lanes"):  # the check: `ptq debug --dump`, plain against DSP lanes
        folder = tmp_path / backend.replace(":", "_")
        assert main(["debug", str(model), "--quant", str(tmp_path / "net.tuned.quant.json"), "--data", str(data),
                     "--num-images", "2", "--out", str(folder), "--dump", str(folder / "dump"), "--dump-images", "2",
                     "--backend", backend]) == 0
        dumps[backend] = folder / "dump"
    files = sorted(p.name for p in dumps["numpy"].glob("*.int.npy"))
    assert sum(name.endswith("_lanes4.int.npy") for name in files) == 2 * len(four)  # the 4-bit copies
    for name in files:
        assert np.array_equal(np.load(dumps["numpy"] / name), np.load(dumps["dsp:lanes"] / name)), name
    capsys.readouterr()
    assert main(["dsp-report", str(model), "--quant", str(table), "--tune", str(table)]) == 2
    assert "has no lanes" in capsys.readouterr().err
    assert main(["report", str(model), "--quant", str(table), "--data", str(data), "--out", str(tmp_path / "bad"),
                 "--tune", str(table)]) == 2
    assert "has no lanes" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_cli_int4_dsp_refuses_the_16_bit_and_float_options(tmp_path, capsys):
    model, data = _calibrated(tmp_path, 4)
    rc = main(["tune", str(model), "--quant", str(tmp_path / "net.quant.json"), "--data", str(data),
               "--target-cosine", "0.9", "--scheme", "int4-dsp", "--allow-float", "1", "-q"])
    assert rc == 2 and "do not apply to --scheme int4-dsp" in capsys.readouterr().err
    assert not (tmp_path / "net.tuned.quant.json").exists()


def test_cli_tune_int4_dsp_default_grids_write_a_table_that_loads_and_runs(tmp_path, capsys):
    model, data = _calibrated(tmp_path, 12)
    rc = main(["tune", str(model), "--quant", str(tmp_path / "net.quant.json"), "--data", str(data), "--target-cosine",
               "0.5", "--scheme", "int4-dsp", "--int4-rounding", "gptq", "--views", "none", "--z", "0", "--no-check",
               "-q"])
    assert rc == 0
    lanes = json.loads((tmp_path / "net.tune.json").read_text())["lanes"]
    assert lanes["int4_grid"]["rounding"] == "gptq" and lanes["int4_grid"]["output_fit"] is True
    tuned = load_quant_table(tmp_path / "net.tuned.quant.json")
    fitted = {name for name, entry in tuned.tensors.items() if entry.calibrator == "int4-output"}
    assert {"W0", "input_lanes4"} <= fitted  # conv_c0's weight and input copy, fitted to its output error
    capsys.readouterr()
    assert main(["run", str(model), "--quant", str(tmp_path / "net.tuned.quant.json"), "--data", str(data),
                 "--num-images", "1", "--backend", "dsp:lanes"]) == 0
