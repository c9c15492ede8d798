"""Per-layer DSP lanes (ptq/tuning/lane_mix.py, lane_tuner.py; `tune --scheme int4-dsp`) on a small residual
model: the mixed graph and table, bit-exactness through `dsp:lanes` (every 4-bit layer on int4 lanes, every
8-bit one on int8 lanes), the throughput figure, the 4-bit grids, and the tuner's greedy and its record."""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsp.backend import DspBackend, DspLanesBackend
from ptq.calibration.pipeline import calibrate
from ptq.core.graph import load_model
from ptq.data.image_source import ArraySamples
from ptq.engine.backends import get_backend
from ptq.engine.executor import prepare
from ptq.engine.float_run import layer_inputs
from ptq.tuning.lane_mix import Int4Grid, LaneMix, four_bit_macs, lane_throughput, weight_scales
from ptq.tuning.lane_tuner import cross_fitted_sensitivities, tune_lanes
from ptq.tuning.tuner import fit_statistics
from tiny_models import make_model


def residual_net(seed: int = 0) -> onnx.ModelProto:
    """input (1,3,8,8) -> Conv 3x3 -> Clip(0,6) (t0) -> [Conv 1x1 -> Clip -> Conv 1x1] + t0 -> Conv 3x3 stride 2
    -> Clip -> GlobalAveragePool -> Flatten -> Gemm (10 logits). Fixed batch 1 (the DSP cost needs shapes)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
    shapes = {"W0": (8, 3, 3, 3), "W1": (16, 8, 1, 1), "W2": (8, 16, 1, 1), "W3": (12, 8, 3, 3)}
    for name, shape in shapes.items():
        fan_in = int(np.prod(shape[1:]))
        inits.append(numpy_helper.from_array(rng.normal(0, 1.5 / math.sqrt(fan_in), shape).astype(np.float32), name))
        inits.append(numpy_helper.from_array(rng.normal(0, 0.1, shape[0]).astype(np.float32), "B" + name[1:]))
    inits.append(numpy_helper.from_array(rng.normal(0, 0.3, (10, 12)).astype(np.float32), "WG"))
    inits.append(numpy_helper.from_array(rng.normal(0, 0.1, 10).astype(np.float32), "BG"))
    conv = lambda x, w, y, **kw: helper.make_node("Conv", [x, w, "B" + w[1:]], [y], name="conv_" + y, **kw)  # noqa: E731
    clip = lambda x, y: helper.make_node("Clip", [x, "lo", "hi"], [y], name="clip_" + y)  # noqa: E731
    nodes = [
        conv("input", "W0", "c0", pads=[1, 1, 1, 1]), clip("c0", "t0"),
        conv("t0", "W1", "e1"), clip("e1", "h1"),
        conv("h1", "W2", "p1"),
        helper.make_node("Add", ["p1", "t0"], ["a1"], name="add1"),
        conv("a1", "W3", "c3", pads=[1, 1, 1, 1], strides=[2, 2]), clip("c3", "h3"),
        helper.make_node("GlobalAveragePool", ["h3"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "WG", "BG"], ["logits"], name="fc", transB=1),
    ]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 8, 8])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])
    return make_model(nodes, [inp], [out], inits)


LAYERS = ["conv_c0", "conv_e1", "conv_p1", "conv_c3", "fc"]


@pytest.fixture(scope="module")
def arrays():
    return np.random.default_rng(1).normal(0, 1, (12, 3, 8, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def setup(arrays):
    graph = load_model(residual_net())
    table = calibrate(residual_net(), arrays[:8], write_qdq=False).table
    fit = ArraySamples(arrays[:8])
    stats = fit_statistics(graph, fit, ["mse"])
    mix = LaneMix(graph, table, stats, Int4Grid(pow2=True), (x for _, x, _ in fit.samples(graph)))
    return graph, table, mix


def _int_run(graph, table, x, backend):
    return prepare(graph, table, backend=backend).run({"input": x[None]}, keep_all=True).tensors


def test_layers_and_their_dsp_operations(setup):
    _, _, mix = setup
    assert [layer.node for layer in mix.layers] == LAYERS
    macs = {layer.node: layer.macs for layer in mix.layers}
    assert macs["conv_c0"] == 8 * 8 * 8 * 3 * 9 and macs["conv_c3"] == 12 * 4 * 4 * 8 * 9 and macs["fc"] == 120
    for layer in mix.layers:  # 4-bit lanes take half the slices of 8-bit ones, up to odd-count padding
        assert layer.ops_at(8) * 2 >= layer.macs >= layer.ops_at(8) and layer.ops_at(4) * 4 >= layer.macs
        # the Gemm of one sample has one row: a 2x2 int4 block keeps only 2 of its 4 lanes, as int8 does
        assert layer.ops_at(4) < layer.ops_at(8) if layer.node != "fc" else layer.ops_at(4) == layer.ops_at(8) == 60
    total = sum(macs.values())
    assert lane_throughput(mix.layers, []) == pytest.approx(total / sum(l.ops_at(8) for l in mix.layers))
    assert lane_throughput(mix.layers, LAYERS) == pytest.approx(total / sum(l.ops_at(4) for l in mix.layers))
    assert four_bit_macs(mix.layers, ["conv_c0"]) == pytest.approx(macs["conv_c0"] / total)


def test_mixed_graph_requantizes_only_the_inputs_of_4_bit_layers(setup):
    graph, table, mix = setup
    four = ["conv_e1", "conv_c3"]
    g, t = mix.build(four)
    requant = [n for n in g.nodes if n.op_type == "Requantize"]
    assert sorted(n.inputs[0] for n in requant) == ["a1", "t0"]
    readers = {n.name: n for n in g.nodes}
    for name in LAYERS:
        node = readers[name]
        entry_w, entry_x = t.tensors[node.inputs[1]], t.tensors[node.inputs[0]]
        if name in four:
            assert node.inputs[0].endswith("_lanes4") and entry_x.qparams.bits == 4 and not entry_x.qparams.signed
            assert entry_w.qparams.bits == 4 and entry_w.qparams.axis == 0
            assert all(math.frexp(float(s))[0] == 0.5 for s in entry_w.qparams.scale)  # WP521: powers of two
        else:
            assert node.inputs[0] in graph.tensors and entry_x == mix.table.tensors[node.inputs[0]]
            assert entry_w == table.tensors[node.inputs[1]]
    assert t.tensors["a1"] == table.tensors["a1"]  # the Add's output keeps its 8-bit grid for its other readers


def test_a_16_bit_layer_operand_takes_8_bits_for_the_lanes(setup):
    # the samples are continuous: calibration gives the graph input 16 bits (ptq.calibration.input_grid); a DSP
    # lane multiplies 8- or 4-bit operands, so the mix reads it on the 8-bit grid of the same range
    graph, table, mix = setup
    wide, lanes = table.tensors["input"], mix.table.tensors["input"]
    assert wide.qparams.bits == 16 and lanes.qparams.bits == 8 and "8 bits for the DSP lanes" in lanes.why
    assert float(lanes.min[0]) == float(wide.min[0]) and float(lanes.max[0]) == float(wide.max[0])
    assert all(mix.table.tensors[n] == e for n, e in table.tensors.items() if n != "input")
    g, t = mix.build([])
    assert t.tensors["input"].qparams.bits == 8


def test_every_edge_graph_runs_the_same_integers(setup, arrays):
    """An 8-bit layer's Requantize in the shared graph is the identity: the same logits codes as the graph with
    Requantize nodes on the 4-bit layers only."""
    _, _, mix = setup
    four = ["conv_c0", "conv_p1"]
    for x in arrays[8:10]:
        few = _int_run(*mix.build(four), x, "numpy")
        every = _int_run(*mix.build(four, every_edge=True), x, "numpy")
        assert np.array_equal(few["logits"], every["logits"])
        assert not np.array_equal(few["logits"], _int_run(*mix.build([]), x, "numpy")["logits"])


@pytest.fixture(scope="module")
def default_mix(setup, arrays):
    """The default 4-bit grids (free scales fitted to the output error, bias correction) and GPTQ rounding."""
    graph, table, _ = setup
    fit = ArraySamples(arrays[:8])
    return LaneMix(graph, table, fit_statistics(graph, fit, ["mse"]), Int4Grid(rounding="gptq"),
                   (x for _, x, _ in fit.samples(graph)))


@pytest.mark.parametrize("grid", ["pow2", "default"])
@pytest.mark.parametrize("four", [[], ["conv_e1", "conv_c3"], LAYERS])
def test_every_tensor_bit_exact_through_dsp_lanes(setup, default_mix, arrays, four, grid):
    """Every integer tensor of the mixed model identical between the plain backend and `dsp:lanes`, each
    4-bit layer on int4 lanes and each 8-bit one on int8 lanes."""
    mix = setup[2] if grid == "pow2" else default_mix
    g, t = mix.build(four)
    for x in arrays[8:10]:
        lanes = DspLanesBackend()
        plain, dsp = _int_run(g, t, x, "numpy"), _int_run(g, t, x, lanes)
        assert plain.keys() == dsp.keys()
        for name in plain:
            assert np.array_equal(plain[name], dsp[name]), name
        assert lanes.lanes == {"int4": len(four), "int8": len(LAYERS) - len(four), "wide": 0}


def test_lanes_backend_dispatches_by_code_width():
    rng = np.random.default_rng(0)
    backend = get_backend("dsp:lanes")
    cases = [(rng.integers(0, 16, (5, 9)), rng.integers(-8, 8, (9, 3)), "int4"),
             (rng.integers(0, 256, (5, 9)), rng.integers(-8, 8, (9, 3)), "int8"),
             (rng.integers(-128, 128, (4, 9)), rng.integers(-128, 128, (9, 2)), "int8"),
             (rng.integers(-3000, 3000, (4, 9)), rng.integers(-128, 128, (9, 2)), "wide")]
    for a, b, path in cases:
        before = dict(backend.lanes)
        assert np.array_equal(backend.matmul(a, b), a @ b)
        assert backend.lanes[path] == before[path] + 1
    assert backend.int4.stats.macs == 5 * 9 * 3 and isinstance(backend.int8, DspBackend)


def test_weight_grids():
    rng = np.random.default_rng(3)
    w = rng.standard_t(3, (6, 4, 3, 3)).astype(np.float32)  # heavy tails: clipping pays
    rows = w.reshape(6, -1).astype(np.float64)

    def err(scales):
        s = scales[:, None]
        return np.sum((np.clip(np.round(rows / s), -8, 7) * s - rows) ** 2, axis=1)

    peak = np.abs(rows).max(axis=1)
    pow2_mse = weight_scales(w, 0, Int4Grid(pow2=True))
    pow2_max = weight_scales(w, 0, Int4Grid(pow2=True, weight_fit="max"))
    free_mse = weight_scales(w, 0, Int4Grid(pow2=False))
    assert all(math.frexp(float(s))[0] == 0.5 for s in np.concatenate([pow2_mse, pow2_max]))
    assert np.all(pow2_max * 8 >= peak) and np.all(pow2_max * 4 < peak)  # 2^ceil(log2 t) / 8
    assert np.all(err(pow2_mse) <= err(pow2_max) + 1e-12) and np.all(err(free_mse) <= err(peak / 7) + 1e-12)
    assert np.sum(err(free_mse)) < np.sum(err(pow2_mse))


def test_bias_correction_lowers_the_mean_error_of_a_4_bit_layer(setup, arrays):
    graph, table, mix = setup
    plain = LaneMix(graph, table, fit_statistics(graph, ArraySamples(arrays[:8]), ["mse"]),
                    Int4Grid(pow2=True, bias_correction=False))
    assert "conv_c3" in mix.biases4 and not plain.biases4
    g_bc, _ = mix.build(["conv_c3"])
    g_plain, _ = plain.build(["conv_c3"])
    assert not np.array_equal(g_bc.initializers["B3"], g_plain.initializers["B3"])
    assert np.array_equal(g_bc.initializers["B1"], g_plain.initializers["B1"])  # 8-bit layers untouched


def test_tune_lanes_keeps_the_target_and_records_the_points(arrays):
    graph = load_model(residual_net())
    table = calibrate(residual_net(), arrays[:8], write_qdq=False).table
    samples = ArraySamples(arrays)
    crude = Int4Grid(pow2=True, weight_fit="max", activation_calibrator="extrema", bias_correction=False)
    easy = tune_lanes(graph, table, samples, 0.5, reference=graph, z=0.0, grid=crude)
    # every layer on 4-bit lanes but the one-row Gemm, which they would not speed up
    assert easy.reached and sorted(easy.lanes.chosen.four) == sorted(set(LAYERS) - {"fc"})
    assert easy.lanes.chosen.throughput == pytest.approx(easy.lanes.points[1].throughput)
    labels = [p.label for p in easy.lanes.points]
    assert labels[:2] == ["all int8", "all int4"]
    all8, all4 = easy.lanes.points[:2]
    assert all8.throughput < all4.throughput and all8.cosine > all4.cosine
    mid = (all8.cosine + easy.lanes.chosen.cosine) / 2  # between all-8-bit and every speeding layer at 4 bits
    tuned = tune_lanes(graph, table, samples, mid, reference=graph, z=0.0, grid=crude)
    chosen = tuned.lanes.chosen
    assert tuned.reached and chosen.cosine >= mid and 0 < len(chosen.four) < len(LAYERS)
    assert all8.throughput < chosen.throughput < easy.lanes.chosen.throughput
    assert all(p.throughput <= chosen.throughput for p in tuned.lanes.points if p.reached)
    record = tuned.lanes.to_dict()
    assert [row["node"] for row in record["layers"]] == LAYERS
    assert {row["node"] for row in record["layers"] if row["lanes"] == 4} == set(chosen.four)
    assert all(row["sensitivity"] != 0 for row in record["layers"])
    # the tuned graph and table give the cosine the record states on the validation samples (every 4th)
    session = ort.InferenceSession(residual_net().SerializeToString(), providers=["CPUExecutionProvider"])
    held = arrays[3::4]
    assert tuned.validation_samples == len(held)
    prepared = prepare(tuned.graph, tuned.table)
    cosines = []
    for x in held:
        y = prepared.run({"input": x[None]}).outputs["logits"].astype(np.float64).ravel()
        r = session.run(None, {"input": x[None]})[0].astype(np.float64).ravel()
        cosines.append(float(y @ r / np.linalg.norm(y) / np.linalg.norm(r)))
    assert np.mean(cosines) == pytest.approx(chosen.cosine, abs=1e-5)
    impossible = tune_lanes(graph, table, samples, 1.0, reference=graph, z=0.0, grid=crude)
    assert not impossible.reached and impossible.lanes.chosen.four == []


@pytest.mark.parametrize("rounding", ["adaround", "gptq"])
def test_learned_rounding_puts_the_4_bit_weights_on_their_grid_rounded_for_the_output(setup, arrays, rounding):
    graph, table, _ = setup
    fit = ArraySamples(arrays[:8])
    stats = fit_statistics(graph, fit, ["mse"])
    learned = LaneMix(graph, table, stats, Int4Grid(rounding=rounding, bias_correction=False),
                      (x for _, x, _ in fit.samples(graph)))
    g, t = learned.build(["conv_e1"])
    w, w4 = graph.initializers["W1"], g.initializers["W1"]
    qp = t.tensors["W1"].qparams
    codes = w4 / qp.scale.reshape(-1, 1, 1, 1)
    assert np.allclose(codes, np.round(codes), atol=1e-4) and np.round(codes).min() >= -8 and np.round(codes).max() <= 7
    nearest = np.clip(np.round(w / qp.scale.reshape(-1, 1, 1, 1)), -8, 7)
    assert np.any(np.round(codes) != nearest)  # some weights rounded the other way
    assert np.array_equal(g.initializers["W2"], graph.initializers["W2"])  # an 8-bit layer keeps its weight


def test_an_unknown_rounding_is_a_one_line_error():
    with pytest.raises(ValueError, match="rounding must be one of nearest, adaround, gptq, got 'up'"):
        Int4Grid(rounding="up")


def test_a_table_that_is_not_8_bit_is_a_one_line_error(arrays):
    graph = load_model(residual_net())
    table = calibrate(residual_net(), arrays[:8], scheme="int4-dsp", write_qdq=False).table
    with pytest.raises(ValueError, match=r"tunes from an 8-bit table .*layer conv_c0 reads 'input' at 4 bits"):
        tune_lanes(graph, table, ArraySamples(arrays), 0.9, reference=graph)


def _output_errors(graph, node, w4, copy, batches):
    """The layer's output error from its weight's rounding, sum (Q(W) - W) H (Q(W) - W)^T, and from its input's,
    sum ||W (Q(x) - x)||^2, over every output position of `batches` (float inputs)."""
    w = graph.initializers[node.inputs[1]].astype(np.float64)
    rows = w.reshape(w.shape[0], -1)
    qw = w4.qparams.dequantize(w4.qparams.quantize(w)).reshape(rows.shape) - rows
    weight_err = input_err = 0.0
    for _, x in layer_inputs(graph, [node], batches):  # a 1x1 convolution: a patch is one pixel's channels
        patches = x.astype(np.float64).reshape(x.shape[1], -1).T
        weight_err += float(np.sum((patches @ qw.T) ** 2))
        qp = copy.qparams
        input_err += float(np.sum(((qp.dequantize(qp.quantize(patches)) - patches) @ rows.T) ** 2))
    return weight_err, input_err


def test_output_fit_lowers_both_output_errors_of_a_4_bit_layer(arrays):
    graph = load_model(residual_net())
    table = calibrate(residual_net(), arrays[:8], write_qdq=False).table
    fit = ArraySamples(arrays[:8])
    stats = fit_statistics(graph, fit, ["mse"])
    tensor = LaneMix(graph, table, stats, Int4Grid(output_fit=False, bias_correction=False),
                     (x for _, x, _ in fit.samples(graph)))
    output = LaneMix(graph, table, stats, Int4Grid(bias_correction=False), (x for _, x, _ in fit.samples(graph)))
    node = next(n for n in graph.nodes if n.name == "conv_e1")  # 1x1 on 8x8: 64 positions, all sampled
    batches = [x for _, x, _ in fit.samples(graph)]
    before = _output_errors(graph, node, tensor.weights4["conv_e1"], tensor.inputs4["conv_e1"], batches)
    after = _output_errors(graph, node, output.weights4["conv_e1"], output.inputs4["conv_e1"], batches)
    assert after[0] < before[0] and after[1] < before[1]
    assert output.weights4["conv_e1"].calibrator == output.inputs4["conv_e1"].calibrator == "int4-output"
    assert output.weights4["fc"] == tensor.weights4["fc"]  # a one-row Gemm saves no DSP operation: not refitted
    g, t = output.build(["conv_e1"])
    assert t.tensors["W1"] is output.weights4["conv_e1"]


def test_a_dead_channel_keeps_the_other_channels_on_their_fitted_4_bit_grids(arrays):
    """A channel whose weights are ~0 gets its scale raised (`floor_weight_scales`); the layer's other channels
    keep the scales the 4-bit fit chose (they went back to max|w| / 7.5 when the entry's range was the extrema)."""
    model = residual_net()
    w1 = next(init for init in model.graph.initializer if init.name == "W1")
    dead = numpy_helper.to_array(w1).copy()
    dead[0] *= 1e-7
    w1.CopyFrom(numpy_helper.from_array(dead, "W1"))
    graph = load_model(model)
    table = calibrate(model, arrays[:8], write_qdq=False).table
    fit = ArraySamples(arrays[:8])
    mix = LaneMix(graph, table, fit_statistics(graph, fit, ["mse"]), Int4Grid(), (x for _, x, _ in fit.samples(graph)))
    fitted = mix.weights4["conv_e1"].qparams.scale
    used = mix.build(["conv_e1"])[1].tensors["W1"].qparams.scale
    assert used[0] > fitted[0]  # the dead channel is floored
    assert np.array_equal(used[1:], fitted[1:])
    assert not np.allclose(fitted[1:], np.abs(dead[1:]).reshape(15, -1).max(axis=1) / 7.5)  # fitted, not extrema


def test_sensitivities_are_measured_on_the_half_the_4_bit_layers_were_not_fitted_to(arrays):
    """Each layer's sensitivity: the mean over the fit samples of the cosine lost with it alone at 4 bits, each
    sample scored by the 4-bit layers fitted to the other half (samples 0, 2, 4, 6 / 1, 3, 5, 7)."""
    graph = load_model(residual_net())
    table = calibrate(residual_net(), arrays[:8], write_qdq=False).table
    got = cross_fitted_sensitivities(graph, table, ArraySamples(arrays[:8]), graph, Int4Grid())
    drops = {name: [] for name in LAYERS}
    session = ort.InferenceSession(residual_net().SerializeToString(), providers=["CPUExecutionProvider"])
    for fitted, measured in ((arrays[0:8:2], arrays[1:8:2]), (arrays[1:8:2], arrays[0:8:2])):
        fit = ArraySamples(fitted)
        mix = LaneMix(graph, table, fit_statistics(graph, fit, ["mse"]), Int4Grid(),
                      (x for _, x, _ in fit.samples(graph)))
        for x in measured:
            ref = session.run(None, {"input": x[None]})[0].astype(np.float64).ravel()

            def cosine(four):
                y = prepare(*mix.build(four, every_edge=True)).run({"input": x[None]}).outputs["logits"]
                y = y.astype(np.float64).ravel()
                return float(y @ ref / np.linalg.norm(y) / np.linalg.norm(ref))
            base = cosine([])
            for name in LAYERS:
                drops[name].append(base - cosine([name]))
    assert got.keys() == drops.keys()
    for name in LAYERS:
        assert got[name] == pytest.approx(np.mean(drops[name]), abs=1e-9)
    in_sample = cross_fitted_sensitivities(graph, table, ArraySamples(arrays[:3]), graph, Int4Grid())
    assert in_sample.keys() == drops.keys()  # 3 samples: measured where fitted
