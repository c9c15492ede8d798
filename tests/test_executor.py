"""The integer executor: float fallback, input checks, qparams flow, memory option, errors.

Unregistered ops (Atan, Asinh) exercise the float fallback; their expected outputs are written out by hand here
as quantize(f(dequantize(codes))) with numpy.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ops.registry import get_op
from ptq.engine.executor import ExecutorError, ExecutorOptions, IntRunResult, NodeKind, prepare, run_int
from ptq.core.graph import load_model
from ptq.core.qparams import QParams
from ptq.table.quant_table import CalibrationOptions, QuantTable, TensorEntry, save_quant_table

OPSET = 18


def _model(nodes, inputs, outputs, initializers=None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)


def _table(entries: dict[str, QParams]) -> QuantTable:
    tensors = {}
    for name, qp in entries.items():
        lo, hi = qp.real_range()
        tensors[name] = TensorEntry("activation", "extrema", lo, hi, qp)
    return QuantTable(options=CalibrationOptions(), tensors=tensors)


QX = QParams(scale=0.025, zero_point=120, bits=8, signed=False)  # codes 0..255
QC = QParams(scale=1 / 127, zero_point=-3, bits=8, signed=True)  # codes -128..127
QS = QParams(scale=0.9 / 32767, zero_point=0, bits=16, signed=True)


@pytest.fixture
def atan_asinh():
    assert get_op("Atan") is None and get_op("Asinh") is None, "the test needs unregistered ops"
    nodes = [helper.make_node("Atan", ["x"], ["c"], name="atan"), helper.make_node("Asinh", ["c"], ["s"], name="asinh")]
    model = _model(nodes, [("x", [2, 5])], [("s", [2, 5])])
    return load_model(model), _table({"x": QX, "c": QC, "s": QS})


def _by_hand(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sx, sc, ss = np.float32(0.025), np.float32(1 / 127), np.float32(0.9 / 32767)
    xq = np.clip(np.rint(x.astype(np.float64) / sx) + 120, 0, 255)
    c = np.arctan(((xq - 120) * sx).astype(np.float32))
    cq = np.clip(np.rint(c.astype(np.float64) / sc) - 3, -128, 127)
    s = np.arcsinh(((cq + 3) * sc).astype(np.float32))
    sq = np.clip(np.rint(s.astype(np.float64) / ss), -32768, 32767)
    return xq, cq, sq


def test_unregistered_ops_run_in_float_with_quantized_borders(atan_asinh):
    graph, table = atan_asinh
    x = np.random.default_rng(0).uniform(-3, 3, (2, 5)).astype(np.float32)
    result = prepare(graph, table).run({"x": x})
    xq, cq, sq = _by_hand(x)
    np.testing.assert_array_equal(result.tensors["x"], xq)
    np.testing.assert_array_equal(result.tensors["c"], cq)
    np.testing.assert_array_equal(result.tensors["s"], sq)
    assert result.tensors["s"].dtype == np.int16
    np.testing.assert_allclose(result.outputs["s"], sq * np.float32(0.9 / 32767), rtol=1e-6)
    assert [(f.name, f.op_type, f.reason) for f in result.float_nodes] == [
        ("atan", "Atan", "not registered"),
        ("asinh", "Asinh", "not registered"),
    ]
    assert "atan (Atan): not registered" in result.summary()
    assert result.qparams["c"] == QC and result.overflows == {}


def test_fallback_output_without_table_qparams_is_a_clear_error(atan_asinh):
    graph, _ = atan_asinh
    with pytest.raises(ExecutorError, match="'c'.*no qparams"):
        prepare(graph, _table({"x": QX, "s": QS}))


def test_graph_input_without_qparams_is_a_clear_error(atan_asinh):
    graph, _ = atan_asinh
    with pytest.raises(ExecutorError, match="graph input 'x'"):
        prepare(graph, _table({"c": QC, "s": QS}))


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({}, "missing \\['x'\\]"),
        ({"x": np.zeros((2, 5), np.float32), "y": np.zeros(1, np.float32)}, "unexpected \\['y'\\]"),
        ({"x": np.zeros((2, 5), np.float64)}, "dtype float64"),
        ({"x": np.zeros((5, 2), np.float32)}, "shape \\(5, 2\\)"),
        ({"x": np.zeros((2, 5, 1), np.float32)}, "shape \\(2, 5, 1\\)"),
        ({"x": np.full((2, 5), np.nan, np.float32)}, "NaN or Inf"),
        ({"x": np.full((2, 5), np.inf, np.float32)}, "NaN or Inf"),
        ({"x": [[0.0] * 5] * 2}, "numpy array"),
    ],
)
def test_bad_inputs_are_rejected(atan_asinh, inputs, message):
    graph, table = atan_asinh
    with pytest.raises(ExecutorError, match=message):
        prepare(graph, table).run(inputs)


def test_keep_outputs_only_drops_intermediates(atan_asinh):
    graph, table = atan_asinh
    x = np.random.default_rng(1).uniform(-3, 3, (2, 5)).astype(np.float32)
    prepared = prepare(graph, table)
    full, lean = prepared.run({"x": x}), prepared.run({"x": x}, keep_all=False)
    assert set(lean.tensors) == {"s"}
    np.testing.assert_array_equal(lean.outputs["s"], full.outputs["s"])


def test_caller_graph_is_not_mutated(atan_asinh):
    graph, table = atan_asinh
    before = [(n.name, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in graph.nodes]
    prepare(graph, table)
    assert [(n.name, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in graph.nodes] == before


def test_unknown_float_node_is_an_error(atan_asinh):
    graph, table = atan_asinh
    with pytest.raises(ExecutorError, match="'nope'"):
        prepare(graph, table, float_nodes=["nope"])


def test_run_int_from_files(tmp_path, atan_asinh):
    graph, table = atan_asinh
    model_path = tmp_path / "m.onnx"
    onnx.save(graph.model, str(model_path))
    save_quant_table(table, tmp_path / "m.quant.json")
    x = np.random.default_rng(2).uniform(-3, 3, (2, 5)).astype(np.float32)
    result = run_int(model_path, tmp_path / "m.quant.json", {"x": x})
    assert isinstance(result, IntRunResult)
    np.testing.assert_array_equal(result.tensors["s"], _by_hand(x)[2])


def test_shape_subgraph_on_dynamic_batch_runs_at_run_time():
    # y = Atan(Reshape(x, Shape(x))): the Shape cannot be folded (dynamic batch) and is never quantized
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Atan", ["x"], ["c"], name="atan"),
        helper.make_node("Reshape", ["c", "s"], ["y"], name="reshape"),
    ]
    graph = load_model(_model(nodes, [("x", ["n", 4])], [("y", ["n", 4])]))
    table = _table({"x": QX, "c": QC, "y": QC})
    prepared = prepare(graph, table, float_nodes=["Reshape"])
    assert [s.kind for s in prepared.steps] == [NodeKind.SHAPE, NodeKind.FLOAT, NodeKind.FLOAT]
    x = np.random.default_rng(3).uniform(-3, 3, (3, 4)).astype(np.float32)
    result = prepared.run({"x": x})
    np.testing.assert_array_equal(result.tensors["s"], [3, 4])
    np.testing.assert_array_equal(result.tensors["y"], result.tensors["c"])
    assert [f.reason for f in result.float_nodes] == ["not registered", "marked float"]


def test_cli_ops_lists_every_registered_op(capsys):
    from ops.registry import REGISTRY
    from ptq.cli import main

    assert main(["ops"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["op", "section"]
    rows = set()
    for line in lines[2:-3]:  # an op's first line; its details are indented, a domain other than ai.onnx bracketed
        if line.strip() and not line.startswith(" "):
            words = line.split()
            rows.add((words[0], words[1][1:-1] if words[1].startswith("[") else "ai.onnx"))
    assert rows == {(op_type, domain or "ai.onnx") for domain, op_type in REGISTRY}
    assert lines[-2] == f"{len(REGISTRY)} op(s); `ptq ops MODEL` tells how each node of a model runs"
    assert lines[-1] == "79 of 79 whitepaper chapter-4 operators implemented"


def test_cli_ops_unknown_domain_is_an_error(capsys):
    from ptq.cli import main

    assert main(["ops", "--domain", "no.such.domain"]) == 2
    assert "no registered op in domain 'no.such.domain'" in capsys.readouterr().err


def test_cli_run_missing_quant_table_is_an_error(tmp_path, capsys):
    from ptq.cli import main

    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    status = main(["run", str(model), "--quant", str(tmp_path / "nope.json"), "--images", str(tmp_path)])
    assert status == 2
    assert "quantization table not found" in capsys.readouterr().err


def _conv_bn_graph():
    rng = np.random.default_rng(5)
    init = {
        "W": rng.normal(size=(3, 2, 1, 1)).astype(np.float32),
        "gamma": np.array([0.5, 2.0, 4.0], np.float32),
        "beta": np.zeros(3, np.float32),
        "mean": np.zeros(3, np.float32),
        "var": np.ones(3, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], name="bn", epsilon=0.0),
    ]
    return load_model(_model(nodes, [("x", [1, 2, 2, 2])], [("y", [1, 3, 2, 2])], init)), init["W"]


def _weight_entry(qp: QParams) -> TensorEntry:
    lo, hi = qp.real_range()
    return TensorEntry("weight", "extrema", lo, hi, qp)


@pytest.mark.parametrize("per_channel", [True, False])
def test_folded_weight_gets_recomputed_symmetric_qparams(per_channel):
    graph, w = _conv_bn_graph()
    k = np.array([0.5, 2.0, 4.0])
    folded = w.astype(np.float64) * k[:, None, None, None]
    if per_channel:
        amax = np.abs(w).reshape(3, -1).max(1)
        original = QParams(scale=amax / 127.5, zero_point=np.zeros(3), bits=8, signed=True, axis=0)
        want = np.abs(folded).reshape(3, -1).max(1) / 127.5
    else:
        original = QParams(scale=np.abs(w).max() / 127.5, zero_point=0, bits=8, signed=True)
        want = np.array([np.abs(folded).max() / 127.5])
    table = _table({"x": QX, "y": QC})
    table.tensors["W"] = _weight_entry(original)
    prepared = prepare(graph, table)
    fold = prepared.rewrites.batchnorm_folds[0]
    qp = prepared.qparams[fold.weight]
    assert (qp.axis == 0) == per_channel and qp.symmetric and qp.bits == 8
    np.testing.assert_allclose(qp.scale, want, rtol=1e-6)
    assert prepared.steps[0].quantized.in_qparams[1] == qp


def test_table_entry_for_the_folded_weight_wins():
    graph, w = _conv_bn_graph()
    table = _table({"x": QX, "y": QC})
    table.tensors["W"] = _weight_entry(QParams(scale=[0.01, 0.02, 0.03], zero_point=[0, 0, 0], axis=0))
    own = QParams(scale=[0.1, 0.2, 0.3], zero_point=[0, 0, 0], axis=0)
    table.tensors["W_bnfold"] = _weight_entry(own)
    prepared = prepare(graph, table)
    assert prepared.rewrites.batchnorm_folds[0].weight == "W_bnfold"
    assert prepared.qparams["W_bnfold"] == own


def test_missing_weight_qparams_is_a_clear_error():
    graph, _ = _conv_bn_graph()
    with pytest.raises(ExecutorError, match="weight 'W' of Conv 'conv' has no qparams"):
        prepare(graph, _table({"x": QX, "y": QC}))


def _run_args(**flags):
    import argparse

    from ptq.commands import run as run_cmd

    parser = argparse.ArgumentParser()
    run_cmd.add_arguments(parser)
    argv = ["m.onnx", "--quant", "q.json", "--images", "d"]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return parser.parse_args(argv)


def _preprocess(args, recorded):
    """The preprocessing `ptq run` uses: its flags, parsed, through the shared options."""
    from ptq.commands.data_options import data_kwargs
    from ptq.data_options import DataOptions

    return DataOptions(**data_kwargs(args)).preprocess(recorded)


def test_cli_run_preprocessing_comes_from_the_table_and_flags_override(tmp_path):
    recorded = {"mean": [1.0, 2.0, 3.0], "std": [4.0, 5.0, 6.0], "resize": 300, "crop_ratio": 0.9, "bgr": True,
                "layout": "NHWC"}
    pre = _preprocess(_run_args(), recorded)
    assert (pre.mean, pre.std, pre.resize, pre.crop_ratio, pre.bgr, pre.layout) == (
        (1.0, 2.0, 3.0), (4.0, 5.0, 6.0), 300, 0.9, True, "NHWC")
    pre = _preprocess(_run_args(mean="10,20,30", resize=256), recorded)
    assert pre.mean == (10.0, 20.0, 30.0) and pre.resize == 256 and pre.std == (4.0, 5.0, 6.0)
    config = tmp_path / "pre.json"
    config.write_text('{"mean": 0, "std": 1}')
    pre = _preprocess(_run_args(config=config, crop_ratio=1.0), recorded)
    assert (pre.mean, pre.std, pre.resize, pre.crop_ratio, pre.bgr) == ((0.0,) * 3, (1.0,) * 3, None, 1.0, False)


def test_unknown_custom_op_fails_at_prepare_naming_the_node():
    from ptq.engine.float_fallback import FloatFallbackError

    node = helper.make_node("Frobnicate", ["x"], ["y"], name="frob", domain="my.ops")
    graph_proto = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(
        graph_proto, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("my.ops", 1)], ir_version=9
    )
    with pytest.raises(FloatFallbackError, match="Frobnicate node 'frob' \\(domain 'my.ops'\\) has no registered op"):
        prepare(load_model(model), _table({"x": QX, "y": QC}))


def test_shared_checks_name_the_node_once():
    """The executor checks integer codes in and prefixes op errors with the node, once, for every op."""
    relu = helper.make_node("Relu", ["x"], ["y"], name="relu")
    graph = prepare(load_model(_model([relu], [("x", [2, 5])], [("y", [2, 5])])), _table({"x": QX, "y": QX}))
    (step,) = [s for s in graph.steps if s.kind is NodeKind.INTEGER]
    with pytest.raises(ExecutorError, match=r"^Relu 'relu': input 0 'x' must be integer codes, got float32$"):
        graph.run_step(step, [np.zeros((2, 5), np.float32)])
    resize = helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", mode="cubic")
    model = _model([resize], [("x", [1, 1, 2, 2])], [("y", [1, 1, 4, 4])],
                   {"scales": np.array([1, 1, 2, 2], np.float32)})
    with pytest.raises(ValueError) as err:
        prepare(load_model(model), _table({"x": QX, "y": QX}), options=ExecutorOptions(strict=True))
    assert str(err.value).startswith("Resize 'up': mode 'cubic' is not supported")
    assert str(err.value).count("'up'") == 1


def test_a_node_its_rule_cannot_quantize_runs_in_float_with_the_reason():
    """An unsupported Resize mode falls back to float with the reason (strict mode makes it an error, above)."""
    resize = helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", mode="cubic")
    model = _model([resize], [("x", [1, 1, 2, 2])], [("y", [1, 1, 4, 4])],
                   {"scales": np.array([1, 1, 2, 2], np.float32)})
    graph = prepare(load_model(model), _table({"x": QX, "y": QX}))
    (node,) = graph.float_nodes
    assert (node.name, node.reason) == ("up", "cannot quantize: mode 'cubic' is not supported (nearest, linear)")
    x = np.linspace(-2, 2, 4, dtype=np.float32).reshape(1, 1, 2, 2)
    y = graph.run({"x": x}).outputs["y"]
    assert y.shape == (1, 1, 4, 4) and np.all(np.isfinite(y))


def test_strict_mode_refuses_an_unregistered_op(atan_asinh):
    graph, table = atan_asinh
    with pytest.raises(ExecutorError, match=r"^Atan 'atan' would run in float \(not registered\); strict"):
        prepare(graph, table, options=ExecutorOptions(strict=True))


@pytest.mark.parametrize("bits", [16, 8])
def test_bn_weight_bits_set_through_the_public_options_reach_a_standalone_batchnorm(bits):
    import ptq

    gamma = np.array([0.5, -2.0, 4.0], np.float32)
    var = np.array([1.0, 3.0, 0.25], np.float32)
    init = {"gamma": gamma, "beta": np.zeros(3, np.float32), "mean": np.zeros(3, np.float32), "var": var}
    node = helper.make_node("BatchNormalization", ["x", "gamma", "beta", "mean", "var"], ["y"], name="bn", epsilon=0.0)
    graph = load_model(_model([node], [("x", [1, 3, 2, 2])], [("y", [1, 3, 2, 2])], init))
    table = _table({"x": QC, "y": QC})
    options = ptq.ExecutorOptions(quantize=ptq.QuantizeOptions(bn_weight_bits=bits))
    quantized = ptq.prepare(graph, table, options=options).steps[0].quantized
    assert quantized.weight_qparams.bits == bits
    # each channel's weight gamma / sqrt(var) alone on a symmetric narrow grid: the code +-(2^(bits-1) - 1)
    sign = np.sign(gamma.astype(np.float64) / np.sqrt(var.astype(np.float64)))
    np.testing.assert_array_equal(quantized.weight, sign * (2 ** (bits - 1) - 1))
    default = ptq.prepare(graph, table).steps[0].quantized
    assert default.weight_qparams.bits == ptq.QuantizeOptions().bn_weight_bits == 16


@pytest.mark.parametrize("op_type, attrs, out_type", [
    ("NonZero", {}, TensorProto.INT64),
    ("IsNaN", {}, TensorProto.BOOL),
    ("IsInf", {}, TensorProto.BOOL),
])
def test_an_unregistered_op_reading_an_activation_is_a_float_node_whatever_its_output_dtype(op_type, attrs, out_type):
    """F2: NonZero/IsNaN/IsInf of a quantized activation used to become a "shape" step: run in float on the
    dequantized values, absent from float_nodes, accepted by strict mode."""
    assert get_op(op_type) is None, "the test needs an unregistered op"
    nodes = [helper.make_node("Atan", ["x"], ["c"], name="atan"),
             helper.make_node(op_type, ["c"], ["i"], name="index", **attrs)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 5]),
                               helper.make_tensor_value_info("i", out_type, [2, None] if op_type == "NonZero" else [2, 5])])
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9))
    table = _table({"x": QX, "c": QC})
    prepared = prepare(model, table, float_nodes=["Atan"])
    step = next(s for s in prepared.steps if s.node.name == "index")
    assert step.kind is NodeKind.FLOAT and step.reason == "not registered"
    x = np.array([[-1.0, 0.0, 0.5, 0.0, 2.0], [0.0, 0.0, -0.25, 1.0, 0.0]], np.float32)
    result = prepared.run({"x": x})
    assert [(f.name, f.reason) for f in result.float_nodes] == [("atan", "marked float"), ("index", "not registered")]
    c = QC.dequantize(result.tensors["c"])
    want = {"NonZero": np.array(np.nonzero(c)), "IsNaN": np.isnan(c), "IsInf": np.isinf(c)}[op_type]
    np.testing.assert_array_equal(result.outputs["i"], want)
    with pytest.raises(ExecutorError, match=rf"^{op_type} 'index' would run in float \(not registered\); strict"):
        prepare(model, table, float_nodes=["Atan"], options=ExecutorOptions(strict=True))


def test_shape_of_an_activation_stays_a_shape_step():
    """Shape reads only its input's shape: no float node, even on a quantized activation."""
    nodes = [helper.make_node("Atan", ["x"], ["c"], name="atan"),
             helper.make_node("Shape", ["c"], ["s"], name="shape"),
             helper.make_node("Reshape", ["c", "s"], ["y"], name="reshape")]
    graph = load_model(_model(nodes, [("x", ["n", 4])], [("y", ["n", 4])]))
    prepared = prepare(graph, _table({"x": QX, "c": QC, "y": QC}))
    kinds = {s.node.name: s.kind for s in prepared.steps}
    assert kinds["shape"] is NodeKind.SHAPE and kinds["reshape"] is NodeKind.INTEGER
