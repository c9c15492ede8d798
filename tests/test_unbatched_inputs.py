"""Inputs that are not batched (issue 25, scope 4): a `--data` sample that gives an input's full shape is taken
as it is (a recurrent state [2, 1, 8]); dynamic dimensions past axis 0 take the sample's size; samples are
batched only where every sample agrees (`ptq.data.samples`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import ptq
from ptq.cli import main
from ptq.engine.float_run import batch_size
from ptq.data.samples import iter_sample_batches


def state_model() -> onnx.ModelProto:
    """seq float [N, T, 8] (T dynamic) and state float [2, 1, 8] (axis 0: two layers, no batch) ->
    y [N, 8] = mean over T of seq @ W + sum over the layers of state."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (8, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([1], np.int64), "time_axis"),
             numpy_helper.from_array(np.array([0, 1], np.int64), "layer_axes")]
    nodes = [helper.make_node("MatMul", ["seq", "W"], ["proj"], name="proj"),
             helper.make_node("ReduceMean", ["proj", "time_axis"], ["pooled"], keepdims=0, name="pool"),
             helper.make_node("ReduceSum", ["state", "layer_axes"], ["carried"], keepdims=0, name="carry"),
             helper.make_node("Add", ["pooled", "carried"], ["y"], name="add")]
    inputs = [helper.make_tensor_value_info("seq", TensorProto.FLOAT, ["N", "T", 8]),
              helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, 1, 8])]
    graph = helper.make_graph(nodes, "state", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _write_samples(folder: Path, count: int, steps: int = 5) -> list[dict]:
    folder.mkdir()
    rng = np.random.default_rng(1)
    written = []
    for k in range(count):
        seq = rng.normal(0, 1, (steps, 8)).astype(np.float32)
        sample = {"seq": seq[None] if k % 2 else seq, "state": rng.normal(0, 2, (2, 1, 8)).astype(np.float32)}
        np.savez(folder / f"s{k}.npz", **sample)
        written.append({"seq": seq[None], "state": sample["state"]})
    return written


def test_a_state_input_and_a_dynamic_sequence_calibrate_run_and_report(tmp_path, capsys):
    model = tmp_path / "state.onnx"
    onnx.save(state_model(), model)
    samples = _write_samples(tmp_path / "data", 6)
    out = tmp_path / "out"
    # before: "input 'seq' has dynamic dimensions [0, 1]", and with the shape given "fixed batch of 2"
    assert main(["calibrate", str(model), "--data", str(tmp_path / "data"), "--out", str(out), "--quiet"]) == 0
    table = json.loads((out / "state.quant.json").read_text())
    assert table["options"]["input_shapes"] == {"seq": [None, 5, 8]}  # T from the samples, N left dynamic
    states = np.stack([s["state"] for s in samples])
    assert table["tensors"]["state"]["min"] == [float(states.min())]  # the whole state, no axis taken as batch
    assert table["tensors"]["state"]["max"] == [float(states.max())]

    result = ptq.run(model, quant=out / "state.quant.json", data=tmp_path / "data", quiet=True)
    assert len(result.samples) == 6
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    graph = ptq.load_model(model, result_shapes(table))
    prepared = ptq.prepare(graph, ptq.load_quant_table(out / "state.quant.json"))
    for sample in samples:
        want = session.run(None, sample)[0]
        got = prepared.run(sample).outputs["y"]  # dequantized
        np.testing.assert_allclose(got, want, atol=3 * float(prepared.qparams["y"].scale[0]))
    report = ptq.report(model, quant=out / "state.quant.json", data=tmp_path / "data", quiet=True)
    assert report.report.to_dict()["images"] == 6


def result_shapes(table: dict) -> dict:
    return {name: tuple(shape) for name, shape in table["options"]["input_shapes"].items()}


def test_samples_are_batched_only_where_every_sample_agrees():
    one = {"x": np.zeros((1, 4)), "s": np.zeros((1, 3))}
    other_shape = {"x": np.zeros((1, 5)), "s": np.zeros((1, 3))}
    state = {"x": np.zeros((1, 4)), "s": np.zeros((2, 3))}  # axis 0 of 2: no batch of one
    items = [(Path(f"{k}.npz"), s) for k, s in enumerate([one, one, other_shape, state, one, one, one])]
    batches = list(iter_sample_batches(iter(items), batch_size=2))
    assert [(b["x"].shape, b["s"].shape) for b in batches] == [
        ((2, 4), (2, 3)), ((1, 5), (1, 3)), ((1, 4), (2, 3)), ((2, 4), (2, 3)), ((1, 4), (1, 3))]
    assert [batch_size(b) for b in batches] == [2, 1, 1, 2, 1]
