"""Models from other exporters run in integers end to end: calibrate -> run -> report -> debug through the
CLI, the integer outputs agree with the float model, index tensors are exact, and the only float nodes are
ops without an integer kernel. Bad models get a one-line error, never a traceback."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import zoo_models
from ops.registry import get_op
from ptq.cli import main as cli_main
from ptq.core.graph import load_model
from ptq.engine.executor import prepare
from ptq.table.quant_table import load_quant_table
from tiny_models import write_images

SMALL_MODELS = {
    "paddle": zoo_models.paddle_style,
    "tensorflow": zoo_models.tensorflow_style,
    "legacy_opset9": zoo_models.legacy_opset9,
}


def _cli(*args) -> None:
    assert cli_main([str(a) for a in args]) == 0


def _end_to_end(model_path: Path, calib: Path, evals: Path, out: Path, preprocess=(), eval_images=None) -> dict:
    """calibrate, run, report, debug --dump through the CLI; returns report.json."""
    _cli("calibrate", model_path, "--images", calib, "--out", out, "--quiet", *preprocess)
    table = out / f"{model_path.stem}.quant.json"
    limit = () if eval_images is None else ("--num-images", eval_images)
    _cli("run", model_path, "--quant", table, "--images", evals)
    _cli("report", model_path, "--quant", table, "--images", evals, "--out", out / "report", *limit)
    _cli("debug", model_path, "--quant", table, "--images", evals, "--out", out / "debug", "--dump",
         out / "dump", *limit)
    return json.loads((out / "report" / "report.json").read_text())


def _unregistered(report: dict, model: onnx.ModelProto) -> list[str]:
    """The report's float nodes whose op type has no integer kernel (the only ones allowed to run in float)."""
    types = {n.name: n.op_type for n in load_model(model).nodes}
    return [name for name in report["float_nodes"] if get_op(types[name]) is not None]


@pytest.fixture(scope="module")
def tiny_images(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("zoo_images")
    write_images(root / "calib", 8, size=(20, 20), seed=1)
    write_images(root / "eval", 3, size=(20, 20), seed=2)
    return root / "calib", root / "eval"


@pytest.mark.parametrize("style", sorted(SMALL_MODELS))
def test_exporter_idioms_run_in_integers_end_to_end(style, tiny_images, tmp_path):
    model = SMALL_MODELS[style]()
    path = tmp_path / f"{style}.onnx"
    onnx.save(model, str(path))
    before = path.read_bytes()
    report = _end_to_end(path, *tiny_images, tmp_path / "out", preprocess=("--resize", "16"))
    assert path.read_bytes() == before  # the user's model is never written to
    assert _unregistered(report, model) == [], report["float_reasons"]
    (output,) = report["outputs"]["tensors"]
    assert output["cosine"] >= 0.98, output
    assert (tmp_path / "out" / "dump" / "index.json").is_file()


def test_paddle_idioms_keep_their_names_and_the_decomposed_hardswish_is_no_suspect(tiny_images, tmp_path):
    model = zoo_models.paddle_style()
    path = tmp_path / "paddle.onnx"
    onnx.save(model, str(path))
    report = _end_to_end(path, *tiny_images, tmp_path / "out", preprocess=("--resize", "16"))
    layers = {layer["name"]: layer for layer in report["layers"]}
    # no-op nodes (Identity, the dropout left as Mul by 1 is a real Mul, Cast between floats) get no row
    assert not {"image/id:0", "image/id:1", "cast:0"} & set(layers)
    assert not [layer for layer in report["layers"] if layer["op_type"] in ("Identity", "Cast")]
    # the x + 3 of x * clip(x + 3, 0, 6) / 6 is folded to the Clip's [0, 6] by calibration: by design
    assert layers["hs/add:0"]["clipped_fraction"] == 0.0
    assert "hs/add:0" not in [b["name"] for b in report["bottlenecks"][:3]]
    names = [n.name for n in load_model(model).nodes]
    assert len(set(names)) == len(names) and "identity" in names and "identity_2" in names
    index = json.loads((tmp_path / "out" / "dump" / "index.json").read_text())
    for files in index["images"][0]["files"].values():
        assert all("/" not in f and ":" not in f for f in files.values())


@pytest.fixture(scope="module")
def lite0_variants(model_path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lite0_variants")
    paths = {}
    for name, build in (("opset11", zoo_models.lite0_opset11), ("dynamic_batch", zoo_models.lite0_dynamic_batch)):
        model = build(model_path)
        onnx.checker.check_model(model)
        paths[name] = root / f"lite0_{name}.onnx"
        onnx.save(model, str(paths[name]))
    return paths


@pytest.mark.parametrize("variant", ["opset11", "dynamic_batch"])
def test_bundled_model_variants_run_in_integers(variant, lite0_variants, calib_dir, eval_dir, tmp_path):
    path = lite0_variants[variant]
    report = _end_to_end(path, calib_dir, eval_dir, tmp_path, ("--mean", "127", "--std", "128"), eval_images=4)
    assert report["float_nodes"] == []
    (logits,) = report["outputs"]["tensors"]
    assert logits["cosine"] >= 0.99


def test_index_tensors_are_exact_and_never_quantized(lite0_variants, calib_dir, tmp_path):
    path = lite0_variants["dynamic_batch"]
    _cli("calibrate", path, "--images", calib_dir, "--out", tmp_path, "--quiet", "--num-images", "4")
    table = load_quant_table(tmp_path / f"{path.stem}.quant.json")
    shape_names = ["dyn_shape", "dyn_batch", "dyn_batch1", "dyn_newshape"]
    assert not set(shape_names) & set(table.tensors)  # never calibrated, never in the table
    graph = load_model(path)
    prepared = prepare(graph, table)
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 224, 224)).astype(np.float32)
    result = prepared.run({"input": x})
    model = onnx.load(str(path))
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.INT64, None) for n in shape_names)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = dict(zip(shape_names, session.run(shape_names, {"input": x})))
    for name in shape_names:
        value = result.tensors[name]
        assert value.dtype == np.int64
        np.testing.assert_array_equal(value, expected[name])


@pytest.mark.parametrize("problem", ["checker", "opset6", "not_an_image", "external_data"])
def test_bad_models_get_a_one_line_error(problem, tmp_path, capsys, calib_dir):
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])
    opset, expected = 13, ""
    if problem == "checker":
        nodes, inits, expected = [helper.make_node("Add", ["x", "missing"], ["y"])], [], "invalid ONNX model"
    elif problem == "opset6":
        nodes, inits, opset, expected = [helper.make_node("Relu", ["x"], ["y"])], [], 6, "opset 6"
    elif problem == "not_an_image":
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 40])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 40])
        nodes, inits, expected = [helper.make_node("Relu", ["x"], ["y"])], [], "needs an image input"
    else:
        nodes = [helper.make_node("Conv", ["x", "W"], ["y"])]
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])
        inits, expected = [numpy_helper.from_array(np.ones((2, 3, 3, 3), np.float32), "W")], "'W' is missing"
    model = helper.make_model(helper.make_graph(nodes, "bad", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", opset)], ir_version=7)
    path = tmp_path / "bad.onnx"
    if problem == "external_data":
        onnx.save(model, str(path), save_as_external_data=True, location="bad.bin", size_threshold=0)
        (tmp_path / "bad.bin").unlink()
    else:
        onnx.save(model, str(path))
    code = cli_main(["calibrate", str(path), "--images", str(calib_dir), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and expected in err, err
