"""Analytic bias correction: the Gaussian expectations match numerical integration, BatchNorm folding keeps
the float function and returns (beta, |gamma|), and on a Conv -> BatchNorm -> Relu -> Conv graph fed the very
distribution the statistics describe, the correction equals the closed form and removes the planted shift."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from scipy import integrate, stats

from ptq.adjust.analytic_bias_correction import clipped_mean, correct_biases_analytic, relu_mean
from ptq.adjust.batchnorm_stats import batchnorm_statistics, fold_batchnorms
from ptq.core.graph import load_model
from ptq.core.qparams import compute_qparams
from ptq.calibration.pipeline import calibrate
from ptq.table.quant_table import CalibrationOptions, QuantTable, TensorEntry
from tests.test_bias_correction import with_weights
from tests.tiny_models import make_model

EPS = 1e-5


def bn_graph(gamma, beta, w1, b1) -> onnx.ModelProto:
    """input (N,4,8,8) -> Conv 1x1 identity -> BatchNormalization (mean 0, var 1 - eps: y = gamma x + beta) ->
    Relu -> Conv 3x3 pads 1 (3 out) -> out."""
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for a, n in (
        (np.eye(4).reshape(4, 4, 1, 1), "W0"), (gamma, "gamma"), (beta, "beta"), (np.zeros(4), "mean"),
        (np.full(4, 1 - EPS), "var"), (w1, "W1"), (b1, "B1"))]
    nodes = [
        helper.make_node("Conv", ["input", "W0"], ["c0"], name="conv0"),
        helper.make_node("BatchNormalization", ["c0", "gamma", "beta", "mean", "var"], ["bn"], epsilon=EPS, name="bn"),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "W1", "B1"], ["out"], pads=[1, 1, 1, 1], name="conv1"),
    ]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4, 8, 8])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3, 8, 8])
    return make_model(nodes, [inp], [out], inits)


def run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def numeric_clipped_mean(mu, sigma, lo, hi):
    f = lambda x: np.clip(x, lo, hi) * stats.norm.pdf(x, mu, sigma)  # noqa: E731
    return integrate.quad(f, mu - 12 * sigma, mu + 12 * sigma, points=[p for p in (lo, hi) if np.isfinite(p)],
                          limit=200)[0]


@pytest.mark.parametrize("mu,sigma,lo,hi", [(0.3, 1.2, 0.0, np.inf), (-1.0, 0.5, 0.0, np.inf),
                                            (2.0, 3.0, 0.0, 6.0), (5.5, 1.0, 0.0, 6.0), (0.1, 2.0, -1.0, 1.5)])
def test_gaussian_expectations_match_numerical_integration(mu, sigma, lo, hi):
    got = clipped_mean(np.array([mu]), np.array([sigma]), np.array([lo]), np.array([hi]))[0]
    assert abs(got - numeric_clipped_mean(mu, sigma, lo, hi)) < 1e-7
    assert relu_mean(np.array([2.0]), np.array([0.0]), 0.5)[0] == 1.5  # no spread: max(mu - t, 0)


def test_batchnorm_fold_keeps_the_function_and_returns_beta_and_gamma():
    rng = np.random.default_rng(0)
    gamma, beta = np.array([0.5, -1.0, 2.0, 1.5]), np.array([0.2, 1.0, -0.5, 0.0])
    model = bn_graph(gamma, beta, rng.normal(0, 0.3, (3, 4, 3, 3)), rng.normal(0, 0.1, 3))
    graph = load_model(model)
    st = batchnorm_statistics(graph)
    np.testing.assert_allclose(st["bn"].mean, beta)
    np.testing.assert_allclose(st["bn"].std, np.abs(gamma))
    folded, count = fold_batchnorms(graph)
    assert count == 1 and [n.op_type for n in folded.graph.node] == ["Conv", "Relu", "Conv"]
    assert folded.graph.node[0].output[0] == "bn"  # the folded Conv writes the BatchNorm's tensor
    x = rng.normal(0, 1, (2, 4, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(folded, x), run(model, x), atol=1e-5)


def coarse_table(w) -> QuantTable:
    m = float(np.max(np.abs(w)))
    qp = compute_qparams(np.array([-m]), np.array([m]), 4, symmetric=True, narrow=True)
    return QuantTable(CalibrationOptions(weight_bits=4, per_channel=False),
                      {"W1": TensorEntry("weight", "extrema", np.array([-m]), np.array([m]), qp)})


def test_correction_is_the_closed_form_and_removes_the_planted_shift():
    rng = np.random.default_rng(1)
    gamma, beta = np.array([0.5, 1.0, 2.0, 1.5]), np.array([0.2, 1.0, -0.5, 0.8])
    w1, b1 = rng.normal(0, 0.4, (3, 4, 3, 3)), rng.normal(0, 0.1, 3)
    model = bn_graph(gamma, beta, w1, b1)
    graph = load_model(model)
    table = coarse_table(graph.initializers["W1"])
    corrected, log = correct_biases_analytic(graph, table, batchnorm_statistics(graph))
    assert set(log.corrected) == {"conv1"}  # conv0 has no table entry here
    new_b = {i.name: numpy_helper.to_array(i) for i in corrected.graph.initializer}["B1"].astype(np.float64)

    # closed form: E[relu(N(beta, gamma^2))] by integration; tap (i, j) of a 3x3 pad-1 Conv on 8x8 reads the
    # input at 7 of 8 rows when i != 1 (8 of 8 when i == 1), same for columns
    qp = table.tensors["W1"].qparams
    w = graph.initializers["W1"].astype(np.float64)
    delta = qp.dequantize(qp.quantize(w)).astype(np.float64) - w
    mu = np.array([numeric_clipped_mean(b, abs(g), 0.0, np.inf) for g, b in zip(gamma, beta)])
    share = np.array([7 / 8, 1.0, 7 / 8])
    coverage = share[:, None] * share[None, :]
    expected = np.einsum("ckij,k,ij->c", delta, mu, coverage)
    np.testing.assert_allclose(graph.initializers["B1"] - new_b, expected, atol=1e-6)

    # the data the statistics describe: x ~ N(0, 1) makes the BatchNorm output N(beta, gamma^2) exactly
    x = rng.normal(0, 1, (400, 4, 8, 8)).astype(np.float32)
    w_q = qp.dequantize(qp.quantize(graph.initializers["W1"])).astype(np.float32)

    def with_values(values):
        return with_weights(model, values)

    ref = run(model, x)
    planted = (run(with_values({"W1": w_q}), x) - ref).mean(axis=(0, 2, 3))
    fixed = (run(with_values({"W1": w_q, "B1": new_b}), x) - ref).mean(axis=(0, 2, 3))
    assert np.max(np.abs(planted)) > 0.03
    assert np.max(np.abs(fixed)) < np.max(np.abs(planted)) / 10


def test_calibrate_folds_batchnorm_and_records_the_option(tmp_path):
    rng = np.random.default_rng(2)
    model = bn_graph(np.array([0.5, 1.0, 2.0, 1.5]), np.array([0.2, 1.0, -0.5, 0.8]),
                     rng.normal(0, 0.4, (3, 4, 3, 3)), rng.normal(0, 0.1, 3))
    path = tmp_path / "bn.onnx"
    onnx.save(model, path)
    x = rng.normal(0, 1, (4, 4, 8, 8)).astype(np.float32)
    result = calibrate(path, x, tmp_path / "out", write_qdq=False, analytic_bias_correction=True)
    assert result.table.options.analytic_bias_correction and result.table.options.adjusted_model
    assert "BatchNormalization" not in [n.op_type for n in result.graph.nodes]
    # the empirical correction and equalization see the folded Conv too (the one the integer graph runs)
    empirical = calibrate(path, x, tmp_path / "emp", write_qdq=False, bias_correction=True)
    assert "BatchNormalization" not in [n.op_type for n in empirical.graph.nodes]
    with pytest.raises(ValueError, match="choose one"):
        calibrate(path, x, None, write_qdq=False, analytic_bias_correction=True, bias_correction=True)


def test_statistics_move_with_equalization():
    """Folded, then equalized (conv0 -> Relu -> conv1 is a pair): the rescaled statistics are those of the
    equalized Conv's output on the data the BatchNorm describes."""
    from ptq.calibration.adjustments import batchnorm_folded, equalized

    rng = np.random.default_rng(3)
    gamma, beta = np.array([0.05, 1.0, 4.0, 1.5]), np.array([0.2, 1.0, -0.5, 0.8])
    model = bn_graph(gamma, beta, rng.normal(0, 0.4, (3, 4, 3, 3)), rng.normal(0, 0.1, 3))
    graph, st = batchnorm_folded(load_model(model), None)
    after, moved = equalized(graph, None, st)
    assert not np.allclose(moved["bn"].std, st["bn"].std)  # equalization did rescale the channels
    x = rng.normal(0, 1, (64, 4, 8, 8)).astype(np.float32)
    probe = onnx.ModelProto()
    probe.CopyFrom(after.model)
    probe.graph.output.append(helper.make_tensor_value_info("bn", TensorProto.FLOAT, None))
    y = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"]).run(["bn"], {"input": x})[0]
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), moved["bn"].mean, atol=0.02 * moved["bn"].std.max())
    np.testing.assert_allclose(y.std(axis=(0, 2, 3)), moved["bn"].std, rtol=0.03)
