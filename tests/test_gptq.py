"""GPTQ-style rounding (ptq/adjust/gptq.py): the column update against its two-column closed form, round to
nearest when H is diagonal, a lower output error than nearest with correlated inputs, and on a Conv through
the float graph's patches."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.adjust.gptq import DAMP, gptq, gptq_round, layer_hessians, output_error, sample_damp
from ptq.core.graph import load_model
from ptq.core.qparams import QParams
from tiny_models import make_model


def test_diagonal_hessian_is_round_to_nearest():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (1, 6, 5))
    scale = np.full((1, 6, 1), 0.3)
    h = np.diag(rng.uniform(0.5, 2.0, 5))[None]
    assert np.array_equal(gptq_round(w, scale, -8, 7, h, damp=0.0), np.clip(np.rint(w / scale), -8, 7))


def test_two_columns_follow_the_closed_form_update():
    # H_00 > H_11: column 0 first; then w1 + (w0 - s q0) H01 / H11 minimizes the error left (d0 fixed)
    h = np.array([[[4.0, 1.5], [1.5, 1.0]]])
    w = np.array([[[0.62, -0.31], [1.13, 0.47], [-0.88, 0.05]]])
    s = 0.25
    q = gptq_round(w, np.full((1, 3, 1), s), -8, 7, h, damp=0.0)
    q0 = np.rint(w[..., 0] / s)
    q1 = np.rint((w[..., 1] + (w[..., 0] - s * q0) * 1.5 / 1.0) / s)
    assert np.array_equal(q[..., 0], q0) and np.array_equal(q[..., 1], q1)


def test_correlated_inputs_lower_the_output_error_below_nearest():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (4000, 24)) @ rng.normal(0, 1, (24, 24))  # strongly correlated inputs
    h = (x.T @ x)[None]
    w = rng.normal(0, 0.2, (1, 16, 24))
    scale = np.abs(w).max(axis=2, keepdims=True) / 7
    q = gptq_round(w, scale, -8, 7, h)
    nearest = np.clip(np.rint(w / scale), -8, 7)
    assert q.min() >= -8 and q.max() <= 7 and np.array_equal(q, np.round(q))
    assert output_error(w, q * scale, h) < 0.7 * output_error(w, nearest * scale, h)



def test_an_input_dead_on_the_samples_keeps_its_weights_rounded_to_nearest():
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (500, 12)) @ rng.normal(0, 1, (12, 12))
    x[:, 5] = 0.0  # never active on these samples (a ReLU channel other photos may switch on)
    w = rng.normal(0, 0.2, (1, 8, 12))
    scale = np.abs(w).max(axis=2, keepdims=True) / 7
    q = gptq_round(w, scale, -8, 7, (x.T @ x)[None])
    assert np.array_equal(q[..., 5], np.clip(np.rint(w[..., 5] / scale[..., 0]), -8, 7)) and np.any(q[..., 5] != 0)


def _rare_patches(rng, images: int, inputs: int = 64, rare: int = 24, on: float = 0.15) -> np.ndarray:
    """Patches of post-ReLU activations, 16 positions per image; the last `rare` inputs are active (and large) on
    a fraction `on` of the images only, as channels firing on some subjects are."""
    x = np.maximum(rng.normal(0.5, 1, (images, 16, inputs)), 0)
    x[:, :, inputs - rare:] *= (rng.random((images, 1, rare)) < on) * 3
    return x.reshape(-1, inputs)


def test_few_photos_damp_more_and_keep_the_held_out_error_below_nearest():
    """From 8 photos (n = 128 patches for K = 64 weights per channel), H is a noisy estimate: GPTQ at the fixed
    0.01 dampening fits it and rounds worse than nearest on other photos; dampened by K / n (`sample_damp`) it
    stays below nearest on them."""
    assert sample_damp(DAMP, 64, 256) == 0.25 and sample_damp(DAMP, 64, 64000) == DAMP
    rng = np.random.default_rng(3)
    fit, held = _rare_patches(rng, 8), _rare_patches(rng, 2000)
    h_fit, h_held = (fit.T @ fit)[None], (held.T @ held)[None]
    w = rng.normal(0, 0.2, (1, 32, 64))
    scale = np.abs(w).max(axis=2, keepdims=True) / 7
    nearest = output_error(w, np.clip(np.rint(w / scale), -8, 7) * scale, h_held)
    fixed = output_error(w, gptq_round(w, scale, -8, 7, h_fit, DAMP) * scale, h_held)
    damped = output_error(w, gptq_round(w, scale, -8, 7, h_fit, sample_damp(DAMP, 64, len(fit))) * scale, h_held)
    assert damped < nearest < fixed


def _conv_model():
    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.3, (6, 4, 3, 3)).astype(np.float32)
    mix = rng.normal(0, 1, (4, 4)).astype(np.float32)  # the 1x1 conv before correlates the channels
    inits = [numpy_helper.from_array(mix.reshape(4, 4, 1, 1), "M"), numpy_helper.from_array(w, "W"),
             numpy_helper.from_array(np.zeros(6, np.float32), "B")]
    nodes = [helper.make_node("Conv", ["input", "M"], ["x"], name="mix"),
             helper.make_node("Conv", ["x", "W", "B"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4, 6, 6])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 6, 6])
    return make_model(nodes, [inp], [out], inits)


def test_conv_weight_on_its_grid_with_a_lower_error_on_the_patches():
    graph = load_model(_conv_model())
    conv = next(n for n in graph.nodes if n.name == "conv")
    batches = [{"input": x[None]} for x in np.random.default_rng(3).normal(0, 1, (10, 4, 6, 6)).astype(np.float32)]
    w = graph.initializers["W"]
    scale = np.abs(w).reshape(6, -1).max(axis=1) / 7
    qp = QParams(scale=scale, zero_point=np.zeros(6, dtype=np.int64), bits=4, signed=True, axis=0)
    rounded, log = gptq(graph, [conv], {"W": qp}, batches)
    codes = rounded["W"] / scale.reshape(-1, 1, 1, 1)
    assert np.allclose(codes, np.round(codes), atol=1e-5) and codes.min() >= -8 - 1e-5 and codes.max() <= 7 + 1e-5
    before, after = log.layers["conv"]
    assert after < before
    # H from every output position (36 of 6x6) gives E as a direct convolution of the error measures it
    (h, count), = layer_hessians(graph, [conv], batches, positions=36).values()
    assert count == 10 * 36
    nearest = np.clip(np.round(w / scale.reshape(-1, 1, 1, 1)), -8, 7) * scale.reshape(-1, 1, 1, 1)
    wg = w.reshape(1, 6, -1).astype(np.float64)
    assert output_error(wg, rounded["W"].reshape(1, 6, -1), h) < output_error(wg, nearest.reshape(1, 6, -1), h)
    direct = _conv_error(batches, graph, rounded["W"]), _conv_error(batches, graph, nearest)
    assert direct[0] < direct[1]
    assert direct[0] == pytest.approx(output_error(wg, rounded["W"].reshape(1, 6, -1), h), rel=1e-6)


def _conv_error(batches, graph, w_hat):
    """sum over samples and positions of ((W_hat - W) * patch)^2, by a direct convolution of the input."""
    m = graph.initializers["M"].reshape(4, 4).astype(np.float64)
    d = (w_hat - graph.initializers["W"]).astype(np.float64)
    total = 0.0
    for b in batches:
        x = np.einsum("oc,chw->ohw", m, b["input"][0].astype(np.float64))
        xp = np.pad(x, ((0, 0), (1, 1), (1, 1)))
        out = np.zeros((6, 6, 6))
        for i in range(3):
            for j in range(3):
                out += np.einsum("oc,chw->ohw", d[:, :, i, j], xp[:, i:i + 6, j:j + 6])
        total += float(np.sum(out ** 2))
    return total
