"""AdaRound: each weight rounds to floor or ceil; the layer's output error on the inputs (D^T H D) is never
above round-to-nearest's and close to the brute-force optimum on a layer small enough to enumerate."""
from __future__ import annotations

import itertools

import numpy as np

from ptq.adjust.adaround import learn_rounding, sample_patches
from ptq.core.graph import Node


def brute_force(w, scale, h):
    """Smallest D^T H D over every floor/ceil choice of one channel (2^K candidates)."""
    base = np.floor(w / scale)
    best = np.inf
    for bits in itertools.product((0, 1), repeat=w.size):
        d = (base + np.array(bits)) * scale - w
        best = min(best, float(d @ h @ d))
    return best


def test_learned_rounding_beats_nearest_and_nears_the_optimum():
    rng = np.random.default_rng(0)
    k = 8
    x = rng.normal(0, 1, (400, k)) + rng.normal(0, 1, (1, k)) * 2  # correlated inputs with a mean
    h = x.T @ x / len(x)
    total_opt = total_near = total_learned = 0.0
    for c in range(4):
        w = rng.normal(0, 1, (1, 1, k))
        scale = np.full((1, 1, 1), np.max(np.abs(w)) / 7)  # 4-bit symmetric grid
        q, near, learned = learn_rounding(w, scale, -7, 7, h[None])
        assert np.all((q == np.floor(w / scale)) | (q == np.floor(w / scale) + 1))
        d = q * scale - w
        np.testing.assert_allclose(learned, float(np.einsum("gok,gkl,gol->", d, h[None], d)))
        total_opt += brute_force(w.ravel(), scale.item(), h)
        total_near += near
        total_learned += learned
    assert total_learned < 0.6 * total_near
    assert total_learned <= 1.25 * total_opt


def test_patches_are_the_zero_padded_windows_of_the_output_positions():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (2, 3, 7, 6))
    w = np.zeros((4, 3, 3, 2))
    node = Node("conv", "Conv", ["x", "w"], ["y"], {"pads": [1, 0, 2, 1], "strides": [2, 1], "dilations": [1, 2]})
    patches = sample_patches(x, node, w, 10 ** 6, np.random.default_rng(0))
    xp = np.pad(x, ((0, 0), (0, 0), (1, 2), (0, 1)))
    ho, wo = (xp.shape[2] - 3) // 2 + 1, (xp.shape[3] - 3) // 1 + 1
    assert patches.shape == (2 * ho * wo, 3, 3, 2)
    expected = {(n, i, j): xp[n, :, 2 * i: 2 * i + 3, j: j + 3: 2] for n in range(2) for i in range(ho) for j in range(wo)}
    for p in patches[: ho * wo]:
        assert any(np.array_equal(p, e) for key, e in expected.items() if key[0] == 0)
    for p in patches[ho * wo:]:
        assert any(np.array_equal(p, e) for key, e in expected.items() if key[0] == 1)


def test_layer_weights_land_on_the_table_grid_and_an_underdetermined_gemm_is_skipped():
    from ptq.adjust.adaround import adaround
    from ptq.core.graph import load_model
    from tests.test_bias_correction import coarse_table, random_grouped_conv_gemm

    rng = np.random.default_rng(4)
    graph = load_model(random_grouped_conv_gemm(rng))
    table = coarse_table(graph.initializers["W"], graph.initializers["WG"])
    x = rng.normal(0.5, 1.0, (3, 4, 9, 9)).astype(np.float32)
    learned, log = adaround(graph, table, iter([x]), positions=64)
    assert set(learned) == {"W"} and [n for n, _ in log.skipped] == ["gemm"]  # 3 rows for 6 weights
    qp = table.tensors["W"].qparams
    codes = learned["W"] / qp.scale[0]
    np.testing.assert_allclose(codes, np.rint(codes), atol=1e-4)
    np.testing.assert_array_equal(qp.dequantize(qp.quantize(learned["W"])), learned["W"])
    w = graph.initializers["W"]
    assert np.all(np.abs(learned["W"] - w) <= qp.scale[0] * (1 + 1e-6))  # floor or ceil, never further
    before, after = log.layers["conv"]
    assert after <= before
