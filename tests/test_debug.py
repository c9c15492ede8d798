"""Fake-quant debugging end to end on EfficientNet-Lite0 with deliberately damaged quant tables."""
import json

import numpy as np
import pytest

from ptq.calibration.pipeline import calibrate
from ptq.cli import main
from ptq.engine.executor import NodeKind, prepare
from ptq.core.graph import load_model
from ptq.data.images import Preprocess
from ptq.table.quant_table import load_quant_table
from reports.auto_debug import auto_debug
from reports.build import build_report
from reports.evaluate import evaluate
from reports.fake_quant import fake_quant
from ptq.data.image_source import ImageSet
from reports.layer_nodes import layer_nodes
from reports.output_metrics import OutputMetrics
from reports.tables import scale_range, with_bits

IMAGES = 2  # enough to rank and to measure recovery; keeps the heavy tests short


@pytest.fixture(scope="module")
def setup(model_path, calib_dir, eval_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib")
    result = calibrate(model_path, calib_dir, out, num_images=8)
    graph = load_model(model_path)
    images = ImageSet.from_folder(eval_dir, Preprocess(**result.table.options.preprocess), limit=IMAGES)
    prepared = prepare(graph, result.table)
    convs = [s for s in prepared.steps if s.kind is NodeKind.INTEGER and s.node.op_type == "Conv"]
    mid = convs[len(convs) // 2]
    return graph, result.table, images, mid, result.table_path


def test_damaged_weight_range_is_ranked_first_and_floating_it_recovers(setup):
    graph, table, images, mid, _ = setup
    weight, tensor = mid.node.inputs[1], mid.node.outputs[0]
    damaged = scale_range(table, weight, 1 / 20)  # the layer's weights saturate: range shrunk 20x
    undamaged = OutputMetrics.of(evaluate(graph, table, images, layers=False, isolated=False))
    result = auto_debug(graph, damaged, images, 5)
    assert result.report.bottlenecks[0].name == tensor
    assert result.baseline.cosine < undamaged.cosine - 0.01  # the damage is visible at the output
    row = next(r for r in result.rows if r.layer == tensor)
    assert result.rows[0].layer == tensor  # the best recovery comes from floating the damaged layer
    assert abs(row.float_trial.metrics.cosine - undamaged.cosine) <= 0.001
    assert tensor in result.suggestion.float_layers
    assert mid.node.name in result.suggestion.float_nodes


def test_damaged_activation_range_is_ranked_first(setup):
    graph, table, images, mid, _ = setup
    tensor = mid.node.outputs[0]
    damaged = scale_range(table, tensor, 1 / 20)
    report = build_report(evaluate(graph, damaged, images), "m", "q")
    assert report.bottlenecks[0].name == tensor
    layer = next(l for l in report.layers if l.name == tensor)
    assert layer.isolated.cosine < 0.99 and layer.cosine_drop > 0.01


def test_fake_quant_floats_the_whole_fused_layer(setup):
    graph, table, images, mid, _ = setup
    prepared = prepare(graph, table)
    nodes = layer_nodes(prepared, mid.node.outputs[0])
    assert nodes[0] == mid.node.name
    fused = [f.activation for f in prepared.rewrites.fusions if f.host == mid.node.name]
    assert nodes[1:] == fused
    result = fake_quant(graph, table, images, layers=[mid.node.outputs[0]])
    assert set(nodes) <= set(result.float_nodes)  # (plus any op not registered yet)
    floated = [row.name for row in result.layers if row.floated]
    assert mid.node.outputs[0] in floated
    with pytest.raises(ValueError, match="neither a tensor nor a node"):
        layer_nodes(prepared, "no_such_tensor")


def test_with_bits_recomputes_qparams_from_the_calibrated_range(setup):
    _, table, _, mid, _ = setup
    name = mid.node.outputs[0]
    wide = with_bits(table, [name], 16)
    entry, qp = wide.tensors[name], wide.tensors[name].qparams
    assert qp.bits == 16 and table.tensors[name].qparams.bits == 8
    lo, hi = qp.real_range()
    # the 16-bit grid covers the same calibrated range, 257x finer (asymmetric: (max - min) / 65535)
    assert lo[0] <= entry.min[0] + qp.scale[0] and hi[0] >= entry.max[0] - qp.scale[0]
    assert qp.scale[0] == pytest.approx((max(entry.max[0], 0) - min(entry.min[0], 0)) / 65535, rel=1e-6)
    with pytest.raises(ValueError, match="not in the quantization table"):
        with_bits(table, ["nope"], 16)


def test_cli_report_and_debug(setup, model_path, eval_dir, tmp_path, capsys):
    _, _, _, mid, table_path = setup
    out = tmp_path / "report"
    args = ["--quant", str(table_path), "--images", str(eval_dir), "--num-images", "2"]
    assert main(["report", str(model_path), *args, "--out", str(out), "--isolated-images", "1"]) == 0
    printed = capsys.readouterr().out
    assert "output logits: cosine" in printed and "top 5 suspects (isolated: " in printed
    data = json.loads((out / "report.json").read_text())
    assert data["images"] == 2 and data["isolated_images"] == 1
    assert data["outputs"]["labelled"] == 2  # labels from the file names
    assert (out / "report.csv").read_text().count("\n") == len(data["layers"]) + 1
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")

    dbg, dump = tmp_path / "debug", tmp_path / "dump"
    layer = mid.node.outputs[0]
    code = main(["debug", str(model_path), *args, "--fake-quant", layer, "--out", str(dbg), "--dump", str(dump)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "after (fake quant): output cosine" in printed
    result = json.loads((dbg / "debug.json").read_text())
    assert mid.node.name in result["float_nodes"]
    index = json.loads((dump / "index.json").read_text())
    assert [t["name"] for t in index["tensors"]] == [layer]
    files = index["images"][0]["files"][layer]
    f, q = np.load(dump / files["float"]), np.load(dump / files["int"])
    assert f.shape == q.shape and np.issubdtype(q.dtype, np.integer)
    assert main(["debug", str(model_path), *args, "--out", str(dbg)]) == 2  # no mode chosen
    assert "choose --fake-quant" in capsys.readouterr().err


def _row(layer, float_cos, int16_cos):
    from reports.auto_debug import AutoRow, Trial

    metrics = lambda c: None if c is None else OutputMetrics(c, 0.0, 0.0, None, None)  # noqa: E731
    return AutoRow(layer, "Conv", "", Trial("float", metrics(float_cos)), Trial("int16", metrics(int16_cos)))


def test_suggestion_rules():
    from reports.auto_debug import suggest

    baseline = OutputMetrics(0.90, 0.0, 0.0, None, None)  # lost 0.10: gains under 0.005 do not count
    rows = [
        _row("a", 0.99, 0.98),  # int16 recovers 0.08 >= half of float's 0.09 -> 16 bits
        _row("b", 0.99, 0.92),  # int16 recovers 0.02 < half of 0.09 -> float
        _row("c", 0.903, 0.902),  # both below 5% of the loss -> nothing
        _row("d", None, 0.95),  # a graph input: only int16 is possible
    ]
    s = suggest(baseline, rows)
    assert s.int16_tensors == ["a", "d"]
    assert s.float_layers == ["b"]


def test_mixed_table_round_trips_and_runs(setup, tmp_path):
    from ptq.table.quant_table import save_quant_table

    graph, table, images, mid, _ = setup
    name = mid.node.outputs[0]
    path = save_quant_table(with_bits(table, [name], 16), tmp_path / "mixed.quant.json")
    mixed = load_quant_table(path)
    assert mixed.tensors[name].qparams.bits == 16
    ev = evaluate(graph, mixed, images, layers=True, isolated=False)
    layer = next(s for s in ev.layers if s.name == name)
    assert ev.qparams[layer.name].bits == 16
    assert ev.cumulative[name].result().cosine > 0.95


def test_fake_quant_rejects_unknown_op_types_and_empty_choices(setup):
    graph, table, images, _, _ = setup
    with pytest.raises(ValueError, match="do not occur in the model"):
        fake_quant(graph, table, images, op_types=["Softmax"])
    with pytest.raises(ValueError, match="choose layers"):
        fake_quant(graph, table, images)


def _conv_bn_relu_model():
    """input (N,3,8,8) -> Conv 'conv' -> 'conv_out' -> BatchNormalization 'bn' -> 'bn_out' -> Relu 'relu' -> 'y'.
    The rewrites fold bn into conv (removing 'conv_out') and fuse relu into it (removing 'bn_out')."""
    from onnx import TensorProto, helper, numpy_helper

    from tiny_models import make_model

    rng = np.random.default_rng(0)
    consts = {"W": rng.normal(0, 0.3, (4, 3, 3, 3)), "B": rng.normal(0, 0.1, 4), "gamma": rng.uniform(0.5, 2, 4),
              "beta": rng.normal(0, 0.1, 4), "mean": rng.normal(0, 0.1, 4), "var": rng.uniform(0.5, 2, 4)}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in consts.items()]
    nodes = [
        helper.make_node("Conv", ["input", "W", "B"], ["conv_out"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["conv_out", "gamma", "beta", "mean", "var"], ["bn_out"], name="bn"),
        helper.make_node("Relu", ["bn_out"], ["y"], name="relu"),
    ]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 8, 8])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])
    return make_model(nodes, [inp], [out], inits)


def test_fake_quant_of_a_tensor_fused_away_floats_the_node_that_absorbed_it(tmp_path, capsys):
    import onnx

    from reports.layer_nodes import resolve_layer
    from tiny_models import write_images

    model_path, images = tmp_path / "cbr.onnx", tmp_path / "images"
    onnx.save(_conv_bn_relu_model(), model_path)
    write_images(images, 4, size=(8, 8))
    raw = ["--mean", "0", "--std", "255", "--crop-ratio", "1"]
    assert main(["calibrate", str(model_path), "--images", str(images), "--out", str(tmp_path), "-q", *raw]) == 0
    table_path = tmp_path / "cbr.quant.json"
    prepared = prepare(load_model(model_path), load_quant_table(table_path))
    assert [s.node.name for s in prepared.steps] == ["conv"]  # one fused node, outputting 'y'

    for removed in ("conv_out", "bn_out", "bn", "relu"):
        resolved = resolve_layer(prepared, removed)
        assert resolved.node == "conv" and "Conv node 'conv' (output 'y')" in resolved.note
        assert layer_nodes(prepared, removed) == ["conv", "relu", "bn"]
    assert resolve_layer(prepared, "y").note is None  # names the integer graph has need no note

    args = ["--quant", str(table_path), "--images", str(images), "--out", str(tmp_path / "dbg")]
    assert main(["debug", str(model_path), *args, "--fake-quant", "conv_out", "--dump", str(tmp_path / "d")]) == 0
    printed = capsys.readouterr().out
    note = "note: 'conv_out' is not in the integer graph: a rewrite fused it into Conv node 'conv' (output 'y'); "
    assert note + "that node runs in float\n" in printed
    result = json.loads((tmp_path / "dbg" / "debug.json").read_text())
    assert result["float_nodes"] == ["conv", "bn", "relu"]  # floated nodes are not fused: each runs in float
    assert result["notes"] == [resolve_layer(prepared, "conv_out").note]
    assert [row["name"] for row in result["layers"] if row["float"]] == ["y"]
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    assert [t["name"] for t in index["tensors"]] == ["conv_out"]  # floated nodes are not fused: the tensor exists

    assert main(["debug", str(model_path), *args, "--fake-quant", "nowhere"]) == 2
    assert "'nowhere' is neither a tensor nor a node of the integer graph" in capsys.readouterr().err
