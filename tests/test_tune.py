"""`ptq tune`: steps are kept only when they raise the validation cosine, tuning stops at the target, every
figure is measured on validation samples it did not fit on, against the user's model, and the tuned table
reproduces the cosine it reports when run again independently."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from ptq.cli import main
from ptq.core.graph import load_model
from ptq.executor import prepare
from ptq.images import Preprocess
from ptq.pipeline import calibrate
from ptq.quant_table import load_quant_table
from ptq.tuning import tune
from ptq.tune_data import Score, split_samples
from reports.image_source import ArraySamples, ImageSet
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


def setup(tmp_path, count=6, **kw):
    model_path = tmp_path / "chain.onnx"
    onnx.save(chain(), model_path)
    write_images(tmp_path / "img", count, size=(10, 10))
    calibrate(model_path, tmp_path / "img", tmp_path / "out", preprocess=RAW, write_qdq=False, **kw)
    return model_path, tmp_path / "out" / "chain.quant.json"


def test_split_puts_every_third_sample_into_validation():
    arrays = np.arange(8, dtype=np.float32).reshape(8, 1)
    fit, validation = split_samples(ArraySamples(arrays, labels=list(range(8))), 0.3)
    assert validation.arrays.ravel().tolist() == [2, 5] and validation.labels == [2, 5]
    assert fit.arrays.ravel().tolist() == [0, 1, 3, 4, 6, 7]
    with pytest.raises(ValueError, match="cannot be split"):
        split_samples(ArraySamples(arrays[:2]), 0.3)


def test_score_bound_is_mean_minus_z_standard_errors():
    score = Score.of([0.9, 0.95, 1.0])
    assert abs(score.mean - 0.95) < 1e-12
    assert abs(score.sem - 0.05 / np.sqrt(3)) < 1e-12
    assert abs(score.bound(2) - (0.95 - 0.1 / np.sqrt(3))) < 1e-12


def test_per_channel_then_16_bits_until_the_target_on_the_validation_images(tmp_path):
    model_path, table_path = setup(tmp_path, per_channel=False, bits=6)
    table = load_quant_table(table_path)
    graph = load_model(model_path)
    images = ImageSet.from_folder(tmp_path / "img", RAW)
    fit, validation = split_samples(images, 0.3)
    assert [p.name for p in validation.files] == ["img002.png", "img005.bmp"]
    start = cosine_of(graph, table, validation)
    result = tune(graph, table, images, target=0.9995, budget_int16=10, z=1.0)
    assert result.validation_samples == 2
    assert result.steps[0].change == "per-channel weights" and result.steps[0].kept
    assert abs(result.baseline.mean - start) < 1e-6
    assert all(s.gain > 0 for s in result.steps if s.kept and not s.change.startswith("back to"))
    assert result.int16_tensors and result.reached
    assert result.score.mean - result.score.sem >= 0.9995
    assert abs(cosine_of(graph, result.table, validation) - result.cosine) < 1e-6
    assert abs(cosine_of(graph, result.table, fit) - result.cosine) > 1e-6  # the fit images score otherwise
    assert result.table.options.per_channel
    for name in result.int16_tensors:
        assert result.table.tensors[name].qparams.bits == 16


def test_a_separate_validation_folder_is_used_as_given(tmp_path):
    model_path, table_path = setup(tmp_path, per_channel=True, bits=6)
    write_images(tmp_path / "val", 3, size=(10, 10), seed=7)
    table = load_quant_table(table_path)
    graph = load_model(model_path)
    validation = ImageSet.from_folder(tmp_path / "val", RAW)
    result = tune(graph, table, ImageSet.from_folder(tmp_path / "img", RAW), target=0.5, validation=validation)
    assert result.validation_samples == 3 and result.reached and result.steps == []
    assert abs(cosine_of(graph, table, validation) - result.cosine) < 1e-6


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
    # validated on the images themselves and no range step: the float layer is the one step to keep
    result = tune(graph, table, images, target=0.999999, budget_int16=0, allow_float=1, validation=images,
                  range_calibrators=(), range_search=False)
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


def tuned_with_bias_correction(tmp_path):
    """The chain model calibrated per-tensor at 6 bits with bias correction (so that the per-channel and
    16-bit weight steps re-correct biases, and the graph the tuner measures changes), 9 images."""
    from ptq.adjusted_model import load_model_for_table

    model_path = tmp_path / "chain.onnx"
    onnx.save(chain(), model_path)
    write_images(tmp_path / "img", 9, size=(10, 10))
    calibrate(model_path, tmp_path / "img", tmp_path / "out", preprocess=RAW, write_qdq=False, per_channel=False,
              bits=6, bias_correction=True)
    table_path = tmp_path / "out" / "chain.quant.json"
    table = load_quant_table(table_path)
    return (load_model_for_table(model_path, table, table_path), table, load_model(model_path),
            ImageSet.from_folder(tmp_path / "img", RAW))


def tuning_of(result) -> tuple:
    """Everything a tuning decides: the table's bytes, the steps and figures, the graph's initializers."""
    return (json.dumps(result.table.to_dict()), result.to_dict(),
            {name: (v.dtype.str, v.shape, v.tobytes()) for name, v in result.graph.initializers.items()})


@pytest.mark.parametrize("ray", [False, True], ids=["workers", "ray"])
def test_tuning_on_workers_is_the_one_process_tuning(tmp_path, ray):
    """Statistics, ranking and validation cosines on two worker processes (or a local Ray cluster of 2 CPUs,
    skipped only without Ray): the same steps, figures, table and re-corrected biases as one process."""
    graph, table, reference, images = tuned_with_bias_correction(tmp_path)
    kwargs = dict(target=0.9999, budget_int16=10, z=1.0, reference=reference)
    one = tune(graph, table, images, **kwargs)
    if ray:
        ray_module = pytest.importorskip("ray")
        ray_module.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            two = tune(graph, table, images, ray="local", **kwargs)
        finally:
            ray_module.shutdown()
    else:
        two = tune(graph, table, images, workers=2, **kwargs)
    steps = [s.change for s in one.steps]
    # the path this test is for: a kept weight step (biases re-corrected), ranges, the ranking's 16-bit steps
    assert steps[0] == "per-channel weights" and one.steps[0].kept
    assert "activation ranges: per-tensor search" in steps and any(s.startswith("int16: ") for s in steps)
    assert any(not np.array_equal(one.graph.initializers[n], v) for n, v in graph.initializers.items())
    assert tuning_of(two) == tuning_of(one)


def test_a_graph_travels_to_the_workers_as_its_changed_initializers(tmp_path):
    from ptq.adjust import with_initializers
    from ptq.tune_shards import GraphVersion
    from tests.tiny_models import conv_relu_gemm

    graph = load_model(chain())
    assert GraphVersion.of(graph, graph) == GraphVersion() == GraphVersion.of(load_model(chain()), graph)
    changed = load_model(with_initializers(graph.model, {"B2": graph.initializers["B2"] + 1}))
    version = GraphVersion.of(changed, graph)
    assert [name for name, _ in version.initializers] == ["B2"] and len(version.digest) == 64
    assert version == GraphVersion.of(load_model(changed.model), graph)  # the same values: the same digest
    with pytest.raises(ValueError, match="only in initializer values"):
        GraphVersion.of(load_model(conv_relu_gemm()), graph)


def test_a_worker_rebuilds_each_version_once_and_keeps_the_two_latest():
    from ptq.adjust import with_initializers
    from ptq.tune_shards import GraphVersion, TuneContext

    graph = load_model(chain())
    context = TuneContext({"": graph})
    versions = [GraphVersion.of(load_model(with_initializers(graph.model, {"B2": graph.initializers["B2"] + k})),
                                graph) for k in (1, 2, 3)]
    first = context.use(versions[0], None)
    assert np.array_equal(first.initializers["B2"], graph.initializers["B2"] + 1)
    assert np.array_equal(first.initializers["W2"], graph.initializers["W2"])
    context.use(versions[1], None)
    assert context.use(versions[0], None) is first  # back to the kept state after a dropped candidate
    context.use(versions[2], None)  # the least recently used (versions[1]) goes
    assert set(context.graphs) == {"", versions[0].digest, versions[2].digest}
    assert context.use(versions[0], None) is first and context.use(GraphVersion(), None) is graph
