"""16-bit DSP lanes (`ptq tune --scheme int4-dsp`, "16 bits where nothing else holds"): the cost of a 16-bit dot
product, which tensors a 16-bit layer widens and how the other layers keep their operands, bit-exactness through
`dsp:lanes`, the bias of a bias-corrected table, and the tuner's 16-bit step."""
from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsp.backend import DspLanesBackend
from dsp.packing import CodeRange, Int16x1
from dsp.plan import plan_dot
from ptq.calibration.pipeline import calibrate
from ptq.core.graph import load_model
from ptq.data.image_source import ArraySamples
from ptq.engine.executor import prepare
from ptq.tuning.lane_mix import Int4Grid, LaneMix, lane_throughput
from ptq.tuning.data import Validation
from ptq.tuning.lane_tuner import tune_lanes
from ptq.tuning.tuner import fit_statistics
from reports.dsp_resources import dsp_report, report_text
from reports.lane_pareto import lanes_html, lanes_text
from test_lane_mix import LAYERS, residual_net
from tiny_models import make_model

CRUDE = Int4Grid(pow2=True, weight_fit="max", activation_calibrator="extrema", bias_correction=False)


def forked_net(seed: int = 0):
    """input (1,3,8,8) -> Conv 3x3 (c0) -> Clip (t) -> {Conv 1x1 (b), Conv 1x1 (c)} -> Add -> GlobalAveragePool ->
    Flatten -> Gemm: the tensor t is read by two layers."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
    for name, shape in {"W0": (8, 3, 3, 3), "Wb": (8, 8, 1, 1), "Wc": (8, 8, 1, 1)}.items():
        fan_in = int(np.prod(shape[1:]))
        inits.append(numpy_helper.from_array(rng.normal(0, 1.5 / math.sqrt(fan_in), shape).astype(np.float32), name))
        inits.append(numpy_helper.from_array(rng.normal(0, 0.1, shape[0]).astype(np.float32), "B" + name[1:]))
    inits += [numpy_helper.from_array(rng.normal(0, 0.3, (10, 8)).astype(np.float32), "WG"),
              numpy_helper.from_array(rng.normal(0, 0.1, 10).astype(np.float32), "BG")]
    nodes = [helper.make_node("Conv", ["input", "W0", "B0"], ["c0"], name="conv_c0", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c0", "lo", "hi"], ["t"], name="clip_t"),
             helper.make_node("Conv", ["t", "Wb", "Bb"], ["b"], name="conv_b"),
             helper.make_node("Conv", ["t", "Wc", "Bc"], ["c"], name="conv_c"),
             helper.make_node("Add", ["b", "c"], ["s"], name="add"),
             helper.make_node("GlobalAveragePool", ["s"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "WG", "BG"], ["logits"], name="fc", transB=1)]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 8, 8])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])
    return make_model(nodes, [inp], [out], inits)


def side_net(k: float = 30.0, seed: int = 0):
    """input (1,3,8,8) -> {side: Conv 1x1 (k (x1 - x0), x2), every pixel to the Gemm; big: Conv 3x3 3->32 -> Relu
    -> GlobalAveragePool} -> Concat -> Gemm. With x1 = x0 + a small difference, the 8-bit input grid loses most
    of the side path's signal, which 16 bits keep; the big layer holds almost all the MACs."""
    rng = np.random.default_rng(seed)
    ws = np.zeros((2, 3, 1, 1), np.float32)
    ws[0, 0], ws[0, 1], ws[1, 2] = -k, k, 1.0
    wg = np.concatenate([rng.normal(0, 0.3 / 8, (10, 128)), rng.normal(0, 0.3, (10, 32))], axis=1)
    inits = [numpy_helper.from_array(ws, "Ws"), numpy_helper.from_array(np.zeros(2, np.float32), "Bs"),
             numpy_helper.from_array(rng.normal(0, 1.5 / math.sqrt(27), (32, 3, 3, 3)).astype(np.float32), "Wb"),
             numpy_helper.from_array(rng.normal(0, 0.1, 32).astype(np.float32), "Bb"),
             numpy_helper.from_array(wg.astype(np.float32), "WG"),
             numpy_helper.from_array(rng.normal(0, 0.1, 10).astype(np.float32), "BG")]
    nodes = [helper.make_node("Conv", ["input", "Ws", "Bs"], ["s"], name="side"),
             helper.make_node("Flatten", ["s"], ["fs"], name="flat_s"),
             helper.make_node("Conv", ["input", "Wb", "Bb"], ["b"], name="big", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["b"], ["h"], name="relu"),
             helper.make_node("GlobalAveragePool", ["h"], ["gp"], name="gap"),
             helper.make_node("Flatten", ["gp"], ["fb"], name="flat_b"),
             helper.make_node("Concat", ["fs", "fb"], ["f"], name="cat", axis=1),
             helper.make_node("Gemm", ["f", "WG", "BG"], ["logits"], name="fc", transB=1)]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 8, 8])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])
    return make_model(nodes, [inp], [out], inits)


@pytest.fixture(scope="module")
def arrays():
    return np.random.default_rng(1).normal(0, 1, (12, 3, 8, 8)).astype(np.float32)


def _mix(model, arrays, **options):
    calibrated = calibrate(model, arrays[:8], write_qdq=False, **options)
    fit = ArraySamples(arrays[:8])
    graph = calibrated.graph
    return LaneMix(graph, calibrated.table, fit_statistics(graph, fit, ["mse"]), Int4Grid(pow2=True),
                   (x for _, x, _ in fit.samples(graph)))


def test_a_16_bit_dot_product_is_one_product_per_slice_in_one_chain():
    plan = plan_dot("int16", (2, 3, 5), (2, 5, 7), CodeRange(16, True), CodeRange(16, False))
    assert plan.macs == plan.ops == plan.chain_ops == plan.lane_slots == 2 * 3 * 5 * 7
    packed = plan_dot("int8", (2, 3, 5), (2, 5, 7), CodeRange(8, True), CodeRange(8, True))
    assert packed.ops == 2 * min(3 * 4, 2 * 7) * 5  # two products per slice: M * ceil(N / 2) slices per k
    # a 48-bit accumulator sums (2^47 - 1) // 2^30 products of two int16 codes, the largest being (-2^15)^2
    assert Int16x1(CodeRange(16, True), CodeRange(16, True)).depth == (2 ** 47 - 1) // 2 ** 30 == 131071
    with pytest.raises(ValueError, match="at most 16 bits"):
        Int16x1(CodeRange(17, True), CodeRange(8, True))


def test_a_16_bit_layer_widens_its_input_where_it_is_computed(arrays):
    mix = _mix(residual_net(), arrays)
    assert mix.wide_sources("conv_p1") == ["h1", "e1"]  # Clip's input, the 1x1 convolution's output
    assert mix.wide_sources("conv_c3") == ["a1"]  # an Add of two tensors: its output only
    assert mix.wide_sources("conv_c0") == ["input"]
    graph, table = mix.build([], ["conv_p1"])
    assert {name for name, e in table.tensors.items() if e.qparams.bits == 16} == {"h1", "e1", "W2"}
    assert table.tensors["W2"].qparams.axis == mix.table.tensors["W2"].qparams.axis
    assert graph is mix.graph  # no other layer reads h1 or e1: no copy needed


def test_other_layers_keep_their_operands_and_the_mix_is_bit_exact_on_dsp_lanes(arrays):
    mix = _mix(forked_net(), arrays)
    assert mix.wide_sources("conv_b") == ["t", "c0"]
    graph, table = mix.build(["conv_c"], ["conv_b"])
    copy = mix.copies["conv_c"]
    assert table.tensors["t"].qparams.bits == 16 and table.tensors[copy].qparams.bits == 4
    graph8, table8 = mix.build([], ["conv_b"])  # conv_c on 8-bit lanes reads t through an 8-bit copy
    assert table8.tensors[copy] == mix.table.tensors["t"]
    plain = prepare(graph8, table8).run({"input": arrays[9][None]}, keep_all=True).tensors
    ref = prepare(mix.graph, mix.table).run({"input": arrays[9][None]}, keep_all=True).tensors
    assert np.array_equal(plain[copy], ref["t"])  # the 8-bit layer's operand is what it was without 16 bits
    for g, t in ((graph, table), (graph8, table8)):
        backend = DspLanesBackend()
        got = prepare(g, t, backend=backend).run({"input": arrays[9][None]}, keep_all=True).tensors
        want = prepare(g, t, backend="numpy").run({"input": arrays[9][None]}, keep_all=True).tensors
        assert all(np.array_equal(got[name], want[name]) for name in want)
        assert backend.lanes["wide"] >= 1 and backend.lanes["int8"] >= 1
    costs = {layer.node: layer.lanes for layer in dsp_report(graph, table).layers}
    assert costs == {"conv_c0": "int8", "conv_b": "int16", "conv_c": "int4", "fc": "int8"}
    assert "1 on int16" in report_text(dsp_report(graph, table))


def test_16_bit_lanes_cost_one_mac_per_slice_and_bring_the_float_output_back(arrays):
    mix = _mix(residual_net(), arrays)
    every = [layer.node for layer in mix.layers]
    assert lane_throughput(mix.layers, [], every) == pytest.approx(1.0)
    assert lane_throughput(mix.layers, [], ["conv_e1"]) < lane_throughput(mix.layers, [])
    session = ort.InferenceSession(residual_net().SerializeToString(), providers=["CPUExecutionProvider"])
    refs = [session.run(None, {"input": x[None]})[0].ravel() for x in arrays[8:]]
    scores = {}
    for label, sixteen in (("8", []), ("16", every)):
        prepared = prepare(*mix.build([], sixteen))
        ys = [prepared.run({"input": x[None]}).outputs["logits"].ravel() for x in arrays[8:]]
        scores[label] = np.mean([np.sum((y - r) ** 2) / np.sum(r ** 2) for y, r in zip(ys, refs)])
    # the rest (the Add, the pooling, the layers' 8-bit outputs) keeps 8 bits: measured 6.5x less squared error
    assert scores["16"] < scores["8"] / 4


def test_a_16_bit_layer_drops_the_8_bit_bias_correction(arrays):
    mix = _mix(residual_net(), arrays, bias_correction=True)
    original = load_model(residual_net()).initializers
    assert set(mix.biases16) == set(LAYERS)
    graph, _ = mix.build([], ["conv_c3"])
    corrected, wide = mix.graph.initializers["B3"], graph.initializers["B3"]
    # the 8-bit correction (the calibrated graph's bias minus the float one) is gone, up to the difference
    # between the calibration's estimate of the mean shift and the lane mix's (same samples)
    assert np.abs(wide - original["B3"]).max() < 0.02 * np.abs(corrected - original["B3"]).max()
    assert np.array_equal(graph.initializers["B1"], mix.graph.initializers["B1"])  # an 8-bit layer keeps its own


def test_the_tuner_puts_layers_on_16_bit_lanes_only_where_8_bits_miss(arrays):
    graph = load_model(residual_net())
    table = calibrate(residual_net(), arrays[:8], write_qdq=False).table
    samples = ArraySamples(arrays)
    easy = tune_lanes(graph, table, samples, 0.5, reference=graph, z=0.0, grid=CRUDE)
    assert easy.lanes.chosen.sixteen == [] and "all int16" not in [p.label for p in easy.lanes.points]
    all8 = easy.lanes.points[0]
    target = all8.cosine + (1 - all8.cosine) / 2  # above all-8-bit, below all-16-bit
    wide = tune_lanes(graph, table, samples, target, reference=graph, z=0.0, grid=CRUDE)
    chosen = wide.lanes.chosen
    assert wide.reached and chosen.cosine >= target and chosen.sixteen
    assert "all int16" in [p.label for p in wide.lanes.points]
    assert chosen.throughput > 1.0  # fewer than every layer at 16 bits
    record = wide.lanes.to_dict()
    assert {row["node"] for row in record["layers"] if row["lanes"] == 16} == set(chosen.sixteen)
    assert all(row["gain16"] is not None for row in record["layers"])
    data = {node.name: node.inputs[0] for node in graph.nodes}
    assert {data[n] for n in chosen.sixteen} <= set(wide.int16_tensors)
    assert all(wide.table.tensors[name].qparams.bits == 16 for name in wide.int16_tensors)
    assert "on 16-bit lanes" in wide.summary()
    text = lanes_text({"target_cosine": target, "lanes": record})
    assert "16-bit gain" in text and "int16 ops" in text
    assert "16-bit gain" in lanes_html({"target_cosine": target, "lanes": record})
    # the tuned graph and table are the recorded point's
    assert {layer.node: layer.lanes for layer in dsp_report(wide.graph, wide.table).layers if layer.lanes == "int16"} \
        == {node: "int16" for node in chosen.sixteen}
    impossible = tune_lanes(graph, table, samples, 1.0, reference=graph, z=0.0, grid=CRUDE)
    assert not impossible.reached and impossible.lanes.chosen.label == "all int16"
    assert sorted(impossible.lanes.chosen.sixteen) == sorted(LAYERS)


def test_a_layer_on_16_bit_lanes_can_make_room_for_4_bit_ones():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (16, 3, 8, 8)).astype(np.float32)
    x[:, 1] = x[:, 0] + 0.02 * rng.normal(0, 1, (16, 8, 8)) + 0.05
    graph = load_model(side_net())
    table = calibrate(side_net(), x[:12], write_qdq=False).table
    fit, held = ArraySamples(x[:12]), ArraySamples(x[12:])
    mix = LaneMix(graph, table, fit_statistics(graph, fit, ["mse"]), Int4Grid(pow2=True),
                  (y for _, y, _ in fit.samples(graph)))
    check = Validation.create(graph, held)
    all8, big4 = (check.cosine(*mix.build(four)).mean for four in ([], ["big"]))
    assert check.cosine(*mix.build(["big"], ["side"])).mean > all8 > big4  # measured 0.9989 > 0.9950 > 0.9945
    target = (all8 + big4) / 2  # all-8-bit reaches it, the big layer on 4-bit lanes alone does not
    options = dict(reference=graph, validation=held, z=0.0, grid=Int4Grid(pow2=True))
    plain = tune_lanes(graph, table, fit, target, exchanges=0, **options).lanes.chosen
    assert plain.four == [] and plain.sixteen == []
    traded = tune_lanes(graph, table, fit, target, **options)
    chosen = traded.lanes.chosen
    assert traded.reached and chosen.four == ["big"] and chosen.sixteen == ["side"]
    assert chosen.throughput > 1.9 * plain.throughput
    assert chosen.label.startswith("16-bit + side")
