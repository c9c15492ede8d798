"""GPTQ-style second-order rounding (Frantar et al. 2023, "GPTQ"; Optimal Brain Quantization, Frantar & Alistarh
2022) of a layer's weight onto a fixed per-output-channel grid.

Per channel group g, over the input patches x of the calibration samples (K = C/g * kh * kw values: im2col for a
convolution, the input row for a Gemm), the rounded weight W_hat minimizes the layer's output error

    E(W_hat) = sum_x || (W_hat - W) x ||^2 = sum_c (W_hat - W)_c H (W_hat - W)_c^T,   H = sum_x x x^T

so the images enter only through one K x K sum per group (accumulated from up to `positions` output positions
per image: memory is bounded by the layer, not by the data). GPTQ's rounding: the columns in order of
decreasing H_kk ("act order"); each column rounded to nearest on its channel's grid, and its error spread over
the columns not yet rounded with the upper Cholesky factor U of H^-1 (H + damp * mean(diag H) * I, damp at
least K / n for n patches summed: `sample_damp`), row k:

    q_k = clamp(round(w_k / s), qmin, qmax),   w_j -= (w_k - s q_k) / U_kk * U_kj   for j after k.

With a diagonal H nothing spreads: GPTQ is round-to-nearest. An input that never varies (H_kk = 0) gets
H_kk = 1 and its weights are rounded to nearest: nothing spreads into or out of it (GPTQ's reference code zeroes
them, which breaks an input dead on a few calibration photos but not on others). A layer keeps round-to-nearest
when the rounding does not lower E (GPTQ never makes a layer's output error on the calibration samples
worse), and a layer with fewer sampled positions than weights per channel (H singular: a classifier Gemm fed
one row per image) keeps it too. The result is the dequantized weight s * q: on the grid, so the executor's
quantization gives back exactly q.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from ops.registry import channel_groups, layer_kind
from ptq.adjust.adaround import sample_patches
from ptq.core.graph import Graph, Node
from ptq.core.qparams import QParams
from ptq.core.roles import LayerKind
from ptq.engine.float_run import layer_inputs

DAMP = 0.01  # H + DAMP * mean(diag H) * I: GPTQ's default dampening
POSITIONS = 2048  # output positions sampled per image and layer


@dataclass
class GptqLog:
    layers: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> (E nearest, E GPTQ)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (node, why it kept round-to-nearest)


def grouped_patches(x: np.ndarray, node: Node, w: np.ndarray, positions: int, rng: np.random.Generator) -> np.ndarray:
    """[G, S, K] input patches of a convolution (sampled output positions) or the input rows of a Gemm/MatMul."""
    if layer_kind(node) is LayerKind.CONVOLUTION:
        group = channel_groups(node)
        patches = sample_patches(x.astype(np.float64), node, w, positions, rng)
        return patches.reshape(patches.shape[0], group, -1).transpose(1, 0, 2)
    return x.reshape(1, -1, x.shape[-1]).astype(np.float64)


def layer_hessians(graph: Graph, layers: Sequence[Node], batches: Iterable, *, positions: int = POSITIONS,
                   seed: int = 0) -> dict[str, tuple[np.ndarray, int]]:
    """Node name -> (H [G, K, K] of the module docstring over `batches` (the float graph's activations), the
    number of patches summed)."""
    rng = np.random.default_rng(seed)
    sums: dict[str, tuple[np.ndarray, int]] = {}
    for node, x in layer_inputs(graph, layers, batches):
        patches = grouped_patches(x, node, graph.initializers[node.inputs[1]], positions, rng)
        h, count = sums.get(node.name, (0.0, 0))
        sums[node.name] = (h + np.matmul(patches.transpose(0, 2, 1), patches), count + patches.shape[1])
    return sums


def output_error(w: np.ndarray, w_hat: np.ndarray, h: np.ndarray) -> float:
    """E(W_hat) of the module docstring; w, w_hat [G, O, K], h [G, K, K]."""
    d = w_hat - w
    return float(np.sum(np.matmul(d, h) * d))


def damped(h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """H with H_kk = 1 on the inputs that never vary, plus damp * mean(diag H) * I."""
    h = np.array(h, dtype=np.float64)
    gi, ki = np.nonzero(np.einsum("gkk->gk", h) <= 0)
    h[gi, ki, ki] = 1.0
    return h + (damp * np.einsum("gkk->gk", h).mean(axis=1))[:, None, None] * np.eye(h.shape[-1])


def sample_damp(damp: float, weights: int, count: int) -> float:
    """The dampening of a layer whose H sums `count` patches of `weights` values: at least K / n (`weights` /
    `count`), a shrinkage of H towards its diagonal as its estimate gets noisy. Measured on Lite0's 4-bit layers
    (bench/int4_mix.py; output error on the validation photos, GPTQ against round-to-nearest): n / K >= 28 best
    at 0.01-0.03, n / K ~ 5 at 0.1-0.3 (0.85 -> 0.77 and 0.91 -> 0.79 of nearest's error with 0.01), n / K ~ 4
    at 0.3-1 (1.07 -> 0.91: 0.01 overfits, worse than nearest)."""
    return max(damp, weights / count)


def gptq_round(w: np.ndarray, scale: np.ndarray, qmin: int, qmax: int, h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """Codes q [G, O, K] of `w` [G, O, K] on the grids `scale` [G, O, 1], GPTQ's order and updates with `h`
    [G, K, K] (module docstring)."""
    g_count, _, k_count = w.shape
    h = damped(h, damp)
    w = w.astype(np.float64)  # an input dead on the samples keeps its weights (rounded to nearest: nothing spreads)
    order = np.argsort(-np.einsum("gkk->gk", h), axis=1, kind="stable")  # [G, K]
    hp = h[np.arange(g_count)[:, None, None], order[:, :, None], order[:, None, :]]
    upper = np.linalg.cholesky(np.linalg.inv(hp)).transpose(0, 2, 1)  # H^-1 = U^T U
    wp = np.take_along_axis(w, order[:, None, :], axis=2)
    s = scale[..., 0]
    q = np.empty_like(wp)
    for k in range(k_count):
        column = wp[:, :, k]
        q[:, :, k] = np.clip(np.rint(column / s), qmin, qmax)
        err = (column - q[:, :, k] * s) / upper[:, k, k][:, None]
        wp[:, :, k + 1:] -= err[:, :, None] * upper[:, None, k, k + 1:]
    out = np.empty_like(q)
    np.put_along_axis(out, np.broadcast_to(order[:, None, :], q.shape), q, axis=2)
    return out


def layer_matrix(node: Node, w: np.ndarray, qparams: QParams) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(W [G, O, K], per-row scales [G, O, 1]) of a Conv or a Gemm/MatMul weight; None when the weight's
    channel axis is not its output axis."""
    if layer_kind(node) is LayerKind.CONVOLUTION:
        group = channel_groups(node)
        wg = w.reshape(group, w.shape[0] // group, -1)
        scale = np.broadcast_to(qparams.scale.reshape(-1, 1), (w.shape[0], 1)).reshape(group, -1, 1)
        return wg, scale
    trans_b = bool(node.attr("transB", 0))
    if qparams.axis is not None and qparams.axis != (0 if trans_b else 1):
        return None
    wm = w if trans_b else w.T  # [N, K]
    return wm[None], np.broadcast_to(qparams.scale.reshape(-1, 1), (wm.shape[0], 1))[None]


def weight_of(node: Node, w: np.ndarray, value: np.ndarray) -> np.ndarray:
    """`value` [G, O, K] back in the layout of the weight `w`."""
    if layer_kind(node) is LayerKind.CONVOLUTION:
        return value.reshape(w.shape)
    return value[0] if node.attr("transB", 0) else value[0].T


def gptq(graph: Graph, layers: Sequence[Node], weight_qparams: Mapping[str, QParams], batches: Iterable, *,
         positions: int = POSITIONS, damp: float = DAMP, seed: int = 0) -> tuple[dict[str, np.ndarray], GptqLog]:
    """Weight name -> its GPTQ-rounded dequantized value on the grid `weight_qparams[weight]` (symmetric), for
    each of `layers` (Convs and Gemms, `ptq.adjust.bias_correction.weighted_layers`); see the module docstring."""
    log = GptqLog()
    hessians = layer_hessians(graph, layers, batches, positions=positions, seed=seed)
    out = {}
    for node in layers:
        name = node.inputs[1]
        if node.name not in hessians:
            continue
        h, count = hessians[node.name]
        if count < h.shape[-1]:
            log.skipped.append((node.name, f"{count} input samples for {h.shape[-1]} weights per channel: H is "
                                           "singular, rounding would overfit"))
            continue
        w = graph.initializers[name].astype(np.float64)
        qp = weight_qparams[name]
        matrix = layer_matrix(node, w, qp)
        if matrix is None:
            log.skipped.append((node.name, "per-channel axis is not the output axis"))
            continue
        wg, scale = matrix
        q = gptq_round(wg, scale, qp.qmin, qp.qmax, h, sample_damp(damp, h.shape[-1], count))
        nearest = np.clip(np.rint(wg / scale), qp.qmin, qp.qmax)
        before, after = output_error(wg, nearest * scale, h), output_error(wg, q * scale, h)
        if after >= before:
            q, after = nearest, before
        out[name] = np.ascontiguousarray(weight_of(node, w, q * scale).astype(graph.initializers[name].dtype))
        log.layers[node.name] = (before, after)
    return out, log
