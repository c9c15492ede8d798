"""The int4-dsp scheme (ptq/calibration/int4_dsp.py, `calibrate --scheme int4-dsp`) on a small residual model: WP521's
equation-1 power-of-two scales, ShareQuantize groups over chained Adds, Requantize edges into the 4-bit
convolutions, shift-only requantization, the same integers through `dsp:int4`, and the CLI."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.cli import main
from ptq.core.graph import load_model
from ptq.engine.executor import NodeKind, prepare
from ptq.calibration.int4_dsp import share_groups, tqt_qparams, tqt_scale, wide_tensors, with_requantize
from ptq.calibration.pipeline import calibrate
from ptq.table.quant_table import load_quant_table
from tiny_models import make_model, write_images


def residual_model(seed: int = 0) -> onnx.ModelProto:
    """input (N,3,8,8) -> Conv 3x3 (t0) -> [Conv 1x1 -> Clip(0,6) -> Conv 1x1 (p1)] + t0 = a1
    -> Conv 1x1 (p2) + a1 = a2 -> Conv 1x1 -> Clip(0,6) (act) -> Conv 1x1 -> y (graph output)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
    shapes = {"W0": (4, 3, 3, 3), "W1": (8, 4, 1, 1), "W2": (4, 8, 1, 1), "W3": (4, 4, 1, 1), "W4": (6, 4, 1, 1),
              "W5": (5, 6, 1, 1)}
    for name, shape in shapes.items():
        inits.append(numpy_helper.from_array(rng.normal(0, 0.5, shape).astype(np.float32), name))
        inits.append(numpy_helper.from_array(rng.normal(0, 0.2, shape[0]).astype(np.float32), "B" + name[1:]))
    conv = lambda x, w, y, **kw: helper.make_node("Conv", [x, w, "B" + w[1:]], [y], name="conv_" + y, **kw)  # noqa: E731
    nodes = [
        conv("input", "W0", "t0", pads=[1, 1, 1, 1]),
        conv("t0", "W1", "e1"), helper.make_node("Clip", ["e1", "lo", "hi"], ["h1"], name="clip1"),
        conv("h1", "W2", "p1"),
        helper.make_node("Add", ["p1", "t0"], ["a1"], name="add1"),
        conv("a1", "W3", "p2"),
        helper.make_node("Add", ["p2", "a1"], ["a2"], name="add2"),
        conv("a2", "W4", "e3"), helper.make_node("Clip", ["e3", "lo", "hi"], ["act"], name="clip3"),
        conv("act", "W5", "y"),
    ]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 8, 8])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5, 8, 8])
    return make_model(nodes, [inp], [out], inits)


@pytest.fixture(scope="module")
def samples():
    return np.random.default_rng(1).normal(0, 1, (6, 3, 8, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def result(samples):
    return calibrate(residual_model(), samples, scheme="int4-dsp", write_qdq=False)


def _is_pow2(x: float) -> bool:
    return math.frexp(float(x))[0] == 0.5


def test_tqt_scale_is_wp521_equation_1():
    # s = 2^ceil(log2 t) / 2^(b-1) signed, / 2^b unsigned
    assert tqt_scale(6.0, 4, signed=False) == 0.5  # ReLU6 at uint4: 8 / 16
    assert tqt_scale(1.0, 4, signed=True) == 0.125  # an image in [-1, 1] at int4: 1 / 8
    assert tqt_scale(47.5, 8, signed=True) == 0.5  # 64 / 128
    assert tqt_scale(0.3, 4, signed=True) == 2.0 ** -4  # 2^-1 / 8
    assert tqt_scale(0.0, 4, signed=True) == 1.0
    qp = tqt_qparams(-3.0, 2.0, 4, offset_binary=True)  # signed at 4 bits: offset binary uint4
    assert (qp.bits, qp.signed, int(qp.zero_point[0]), float(qp.scale[0])) == (4, False, 8, 0.5)
    np.testing.assert_array_equal(qp.real_range(), ([-4.0], [3.5]))  # the int4 grid [-8, 7] * 0.5
    qp = tqt_qparams(0.0, 6.0, 4, offset_binary=True)  # non-negative: plain uint4
    assert (qp.signed, int(qp.zero_point[0]), float(qp.scale[0])) == (False, 0, 0.5)


def test_share_groups_join_a_residual_chain_and_outputs_are_wide():
    graph = load_model(residual_model())
    assert share_groups(graph) == [["t0", "p1", "a1", "p2", "a2"]]
    assert wide_tensors(graph) == {"t0", "p1", "a1", "p2", "a2", "y"}


def test_requantize_sits_on_every_edge_from_an_8_bit_tensor_into_a_convolution():
    graph, copies = with_requantize(load_model(residual_model()))
    assert copies == {"t0": "t0_uint4", "a1": "a1_uint4", "a2": "a2_uint4"}
    by_output = {n.outputs[0]: n for n in graph.nodes}
    for source, copy in copies.items():
        assert (by_output[copy].op_type, by_output[copy].domain, by_output[copy].inputs) == ("Requantize", "ai.ptq",
                                                                                             [source])
    assert by_output["e1"].inputs[0] == "t0_uint4" and by_output["a1"].inputs == ["p1", "t0"]
    assert by_output["p2"].inputs[0] == "a1_uint4" and by_output["a2"].inputs == ["p2", "a1"]
    assert by_output["e3"].inputs[0] == "a2_uint4"
    again, more = with_requantize(graph)  # idempotent: the copies are 4-bit and feed the convolutions
    assert more == {} and len(again.nodes) == len(graph.nodes)


def test_table_follows_the_scheme(result):
    table, graph = result.table, result.graph
    assert table.options.scheme == "int4-dsp" and table.options.bits == 4 and table.options.pow2
    group = ["t0", "p1", "a1", "p2", "a2"]
    for name, entry in table.tensors.items():
        qp = entry.qparams
        assert all(_is_pow2(s) for s in qp.scale), name
        if entry.kind == "weight":
            assert (qp.bits, qp.signed, qp.narrow, qp.axis) == (4, True, False, 0) and not np.any(qp.zero_point)
        elif name in group or name == "y":
            assert (qp.bits, qp.signed, int(qp.zero_point[0])) == (8, True, 0), name
        else:  # uint4: plain for a non-negative tensor, offset binary (zp 8) for a signed one
            assert (qp.bits, qp.signed) == (4, False), name
            assert int(qp.zero_point[0]) == (8 if entry.min[0] < 0 else 0), name
    shared = table.tensors["t0"].qparams
    assert all(table.tensors[t].qparams == shared for t in group)
    widest = max(max(-table.tensors[t].min[0], table.tensors[t].max[0]) for t in group)
    assert float(shared.scale[0]) == tqt_scale(widest, 8, signed=True)
    assert [n.op_type for n in graph.nodes].count("Requantize") == 3
    summary = result.summary()
    assert "scheme: int4-dsp" in summary
    assert f"6 at 8 bits, {len(graph.activations) - 6} at 4 bits" in summary


def _multipliers(quantized) -> list[np.ndarray]:
    stage = getattr(quantized, "stage", None)
    return [stage.m, stage.n] if stage is not None else [quantized.m, quantized.n]


def test_every_requantization_is_a_shift(result):
    """Power-of-two scales everywhere: each (M, N) of the integer graph has M a power of two, i.e. it is a
    rounding shift by N - log2(M) (the Requantize nodes use M = 1 or a left shift)."""
    integer = prepare(result.graph, result.table)
    kinds = {s.node.op_type for s in integer.steps}
    assert kinds == {"Conv", "Add", "Requantize"}
    for step in integer.steps:
        assert step.kind is NodeKind.INTEGER
        m, _n = _multipliers(step.quantized)
        assert all(_is_pow2(v) for v in np.ravel(m)), step.node.name
        if step.node.op_type == "Requantize":
            assert step.quantized.shift_only
        if step.node.op_type == "Add":  # shared scale: both inputs pass at ratio 1
            assert all(int(v) == 1 << int(n) for v, n in zip(step.quantized.m, step.quantized.n))


def test_dsp_int4_gives_the_integers_of_the_plain_backend(result, samples):
    plain = prepare(result.graph, result.table, backend="numpy")
    dsp = prepare(result.graph, result.table, backend="dsp:int4")
    want = plain.run({"input": samples[:2]}).tensors
    got = dsp.run({"input": samples[:2]}).tensors
    for name, codes in want.items():
        assert np.array_equal(got[name], codes), name
    assert dsp.backend.stats.macs > 0


def test_a_dead_channel_gets_a_power_of_two_scale_its_int32_bias_fits(samples):
    """A channel of near-zero weights with a bias: its extrema scale would put b / (s_x s_w) far beyond int32;
    the weight-scale floor raises it, to a power of two."""
    model = residual_model()
    weights = {t.name: t for t in model.graph.initializer}
    w0 = numpy_helper.to_array(weights["W0"]).copy()
    w0[1] *= 1e-11
    b0 = numpy_helper.to_array(weights["B0"]).copy()
    b0[1] = 2.0
    weights["W0"].CopyFrom(numpy_helper.from_array(w0, "W0"))
    weights["B0"].CopyFrom(numpy_helper.from_array(b0, "B0"))
    result = calibrate(model, samples, scheme="int4-dsp", write_qdq=False)
    qp = result.table.tensors["W0"].qparams
    s_x = float(result.table.tensors["input"].qparams.scale[0])
    bias = abs(float(numpy_helper.to_array(weights["B0"])[1]))
    assert bias / (s_x * tqt_scale(float(np.abs(w0[1]).max()), 4, signed=True)) > 2 ** 31  # the extrema scale
    assert _is_pow2(qp.scale[1]) and bias / (s_x * qp.scale[1]) < 2 ** 31
    run = prepare(result.graph, result.table).run({"input": samples[:2]})
    assert run.overflows == {}


def test_scheme_fixes_the_grid_options(samples):
    with pytest.raises(ValueError, match="scheme int4-dsp fixes bits, pow2"):
        calibrate(residual_model(), samples, scheme="int4-dsp", bits=6, pow2=True, write_qdq=False)
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        calibrate(residual_model(), samples, scheme="int3", write_qdq=False)


def test_cli_scheme_writes_the_model_with_requantize_nodes_that_run_loads(tmp_path, capsys):
    model = tmp_path / "res.onnx"
    onnx.save(residual_model(), model)
    images = tmp_path / "images"
    write_images(images, 5, size=(8, 8))
    out = tmp_path / "out"
    assert main(["calibrate", str(model), "--images", str(images), "--out", str(out), "--scheme", "int4-dsp",
                 "--quiet"]) == 0
    table = load_quant_table(out / "res.quant.json")
    assert table.options.scheme == "int4-dsp" and table.options.adjusted_model == "res.adjusted.onnx"
    adjusted = onnx.load(out / "res.adjusted.onnx")
    assert sum(n.op_type == "Requantize" for n in adjusted.graph.node) == 3
    assert "t0_uint4" in table.tensors
    capsys.readouterr()
    assert main(["run", str(model), "--quant", str(out / "res.quant.json"), "--images", str(images),
                 "--backend", "dsp:int4"]) == 0
    assert "using the adjusted weights" in capsys.readouterr().err
    assert main(["calibrate", str(model), "--images", str(images), "--out", str(out), "--scheme", "int4-dsp",
                 "--bits", "8", "--weight-bits", "2", "--quiet"]) == 2
    assert "scheme int4-dsp fixes weight_bits" in capsys.readouterr().err
