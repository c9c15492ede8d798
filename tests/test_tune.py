"""`ptq tune`: steps are kept only when they raise the measured cosine, tuning stops at the target, and the
tuned table reproduces the cosine it reports when run again independently."""
from __future__ import annotations

import json

import numpy as np
import onnx

from ptq.cli import main
from ptq.core.graph import load_model
from ptq.executor import prepare
from ptq.images import Preprocess
from ptq.pipeline import calibrate
from ptq.quant_table import load_quant_table
from ptq.tuning import tune
from reports.image_source import ImageSet
from tests.test_equalize import chain
from tests.tiny_models import write_images

RAW = Preprocess(mean=0, std=1)


def cosine_of(graph, table, images):
    """Mean per-image cosine of the integer graph against onnxruntime (independent of ptq.tuning)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(graph.model.SerializeToString(), providers=["CPUExecutionProvider"])
    prepared = prepare(graph, table)
    values = []
    for _, x, _ in images.samples(graph):  # x: {input name: sample}
        ref = sess.run(None, x)[0].ravel()
        out = prepared.run(x).outputs[graph.outputs[0]].ravel()
        values.append(float(np.dot(ref, out) / np.linalg.norm(ref) / np.linalg.norm(out)))
    return float(np.mean(values))


def setup(tmp_path, **kw):
    model_path = tmp_path / "chain.onnx"
    onnx.save(chain(), model_path)
    write_images(tmp_path / "img", 2, size=(10, 10))
    calibrate(model_path, tmp_path / "img", tmp_path / "out", preprocess=RAW, write_qdq=False, **kw)
    return model_path, tmp_path / "out" / "chain.quant.json"


def test_per_channel_then_16_bits_until_the_target(tmp_path):
    model_path, table_path = setup(tmp_path, per_channel=False, bits=6)
    table = load_quant_table(table_path)
    graph = load_model(model_path)
    images = ImageSet.from_folder(tmp_path / "img", RAW)
    start = cosine_of(graph, table, images)
    result = tune(graph, table, images, target=0.9995, budget_int16=10)
    assert result.steps[0].change == "per-channel weights" and result.steps[0].kept
    assert abs(result.baseline - start) < 1e-6
    assert all(s.gain > 0 for s in result.steps if s.kept and not s.change.startswith("back to"))
    assert all(s.cosine >= 0.9995 for s in result.steps if s.kept and s.change.startswith("back to"))
    assert result.int16_tensors and result.reached
    assert abs(cosine_of(graph, result.table, images) - result.cosine) < 1e-6
    assert result.table.options.per_channel
    for name in result.int16_tensors:
        assert result.table.tensors[name].qparams.bits == 16


def test_no_budget_no_16_bits_and_the_cli_says_not_reached(tmp_path, capsys):
    model_path, table_path = setup(tmp_path, per_channel=True, bits=4)
    code = main(["tune", str(model_path), "--quant", str(table_path), "--images", str(tmp_path / "img"),
                 "--target-cosine", "0.999999", "--budget-int16", "0"])
    assert code == 1
    record = json.loads((tmp_path / "out" / "chain.tune.json").read_text())
    assert record["reached"] is False and record["int16_tensors"] == []
    tuned = load_quant_table(tmp_path / "out" / "chain.tuned.quant.json")
    assert all(e.qparams.bits in (4, 8) for e in tuned.tensors.values())
    assert "NOT reached" in capsys.readouterr().out


def test_float_layers_are_marked_in_the_tuned_table_which_reproduces_the_cosine(tmp_path):
    model_path, table_path = setup(tmp_path, per_channel=True, bits=4)
    table = load_quant_table(table_path)
    graph = load_model(model_path)
    images = ImageSet.from_folder(tmp_path / "img", RAW)
    result = tune(graph, table, images, target=0.999999, budget_int16=0, allow_float=1)
    kept = [s for s in result.steps if s.kept and s.float_layers]
    assert len(kept) == 1 and result.float_nodes
    assert result.table.float_tensors() == kept[0].float_layers
    assert not table.float_tensors()  # the table tuning started from is unchanged
    # prepared without any float_nodes argument: the table alone runs the layer in float
    assert [f.name for f in prepare(graph, result.table).float_nodes] == result.float_nodes
    assert abs(cosine_of(graph, result.table, images) - result.cosine) < 1e-6


def test_recalibrated_ranges_keep_the_float_flags(tmp_path):
    from calibrators import required_stats
    from ptq.pipeline import collect_image_statistics
    from ptq.table_edit import with_float
    from ptq.tuning import recalibrated

    model_path, table_path = setup(tmp_path)
    table, graph = load_quant_table(table_path), load_model(model_path)
    name = next(n for n, e in table.tensors.items() if e.kind == "activation" and n not in graph.inputs)
    stats, _ = collect_image_statistics(graph, tmp_path / "img", required_stats(["mse"]), preprocess=RAW)
    result = recalibrated(graph, with_float(table, [name]), stats, "mse")
    assert result.float_tensors() == [name] and result.tensors[name].calibrator == "mse"
