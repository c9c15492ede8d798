"""AdaRound-style rounding (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training
Quantization"), layer by layer, in numpy.

For a Conv/Gemm whose weight has table qparams (scale s_c per output channel or one s, zero point 0), each
weight chooses its code q = clamp(floor(W / s) + r, qmin, qmax) with r in {0, 1}. Layer output error on the
calibration inputs, per output channel c of group g (x: the K = C/g * kh * kw inputs of one output position):

    E_c = mean_x ((W_soft[c] - W[c]) . x)^2 = D_c^T H_g D_c,   H_g = mean_x x x^T,   D_c = W_soft[c] - W[c]

so the images enter only through H_g (K x K per group), accumulated from a sample of `positions` output
positions per image: memory is bounded by the layer's H, not by the data. The relaxed problem (rectified
sigmoid h(V) = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1), W_soft = s * clamp(floor(W/s) + h(V))) adds
lambda * sum(1 - |2h - 1|^beta) with beta annealed from 20 to 2, minimized with Adam; then r = [h >= 0.5].
V starts where h(V) = frac(W / s). The reconstruction term is divided by round-to-nearest's error (lambda is then
scale-free, 3 by default); `refine` ends with a greedy descent on the exact error (single flips). A layer keeps
round-to-nearest
when the learned rounding does not lower E (so AdaRound never makes a layer's output error worse), and a layer
with fewer sampled inputs than weights per channel (H singular: e.g. a classifier Gemm fed one row per image)
keeps round-to-nearest too.

The result is the dequantized weight s * q: it lies on the table's grid, so the executor's round-half-even
quantization gives back exactly q.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ops.registry import channel_groups, layer_kind
from ptq.adjust.bias_correction import conv_geometry, weighted_layers, BiasCorrectionLog
from ptq.core.graph import Graph, Node
from ptq.core.roles import LayerKind
from ptq.engine.float_run import layer_inputs
from ptq.table.quant_table import QuantTable

ZETA, GAMMA = 1.1, -0.1


@dataclass
class AdaRoundLog:
    layers: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> (E nearest, E learned)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        better = sum(1 for a, b in self.layers.values() if b < a)
        return f"adaround: {len(self.layers)} layers, {better} with a lower output error than round-to-nearest"


def sample_patches(x: np.ndarray, node: Node, w: np.ndarray, positions: int, rng: np.random.Generator) -> np.ndarray:
    """[S, C, kh, kw] zero-padded input patches at up to `positions` random output positions per sample."""
    pads, strides, dilations = conv_geometry(node, w)
    kh, kw = w.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    ho = (xp.shape[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    wo = (xp.shape[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    count = min(positions, ho * wo)
    n = np.repeat(np.arange(x.shape[0]), count)
    flat = np.concatenate([rng.choice(ho * wo, count, replace=False) for _ in range(x.shape[0])])
    rows = (flat // wo)[:, None, None] * strides[0] + np.arange(kh)[None, :, None] * dilations[0]
    cols = (flat % wo)[:, None, None] * strides[1] + np.arange(kw)[None, None, :] * dilations[1]
    return xp[n[:, None, None], :, rows, cols].transpose(0, 3, 1, 2)  # [S, kh, kw, C] -> [S, C, kh, kw]


def _rect_sigmoid(v):
    return np.clip(1.0 / (1.0 + np.exp(-v)) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def refine(q: np.ndarray, w: np.ndarray, scale: np.ndarray, qmin: int, qmax: int, h: np.ndarray,
           base: np.ndarray, passes: int = 32) -> np.ndarray:
    """Greedy descent on the exact error: per channel and pass, flip the one weight (floor <-> ceil) that
    lowers D^T H D most, dE = 2 delta (H D)_j + delta^2 H_jj; stops when no flip helps."""
    q = q.copy()
    diag = np.einsum("gkk->gk", h)[:, None, :]
    for _ in range(passes):
        d = q * scale - w
        hd = np.matmul(d, h)
        target = np.where(q > base, base, base + 1)
        allowed = (target >= qmin) & (target <= qmax)
        delta = (target - q) * scale
        gain = np.where(allowed, 2 * delta * hd + delta ** 2 * diag, np.inf)
        best = np.argmin(gain, axis=2)
        best_gain = np.take_along_axis(gain, best[..., None], axis=2)[..., 0]
        flip = best_gain < -1e-15 * (1 + np.abs(np.einsum("gok,gol->go", d, hd)))
        if not flip.any():
            break
        g, o = np.nonzero(flip)
        q[g, o, best[g, o]] = target[g, o, best[g, o]]
    return q


def learn_rounding(w: np.ndarray, scale: np.ndarray, qmin: int, qmax: int, h: np.ndarray, *, iters: int = 300,
                   lam: float = 3.0, lr: float = 0.05) -> tuple[np.ndarray, float, float]:
    """Codes q [G, O, K] minimizing sum D^T H_g D (module docstring); w [G, O, K], scale [G, O, 1], h [G, K, K].
    Returns (q, E of round-to-nearest, E of q)."""
    base = np.floor(w / scale)
    frac = w / scale - base
    p = np.clip((frac - GAMMA) / (ZETA - GAMMA), 1e-4, 1 - 1e-4)
    v = np.log(p / (1 - p))

    def error(q):
        d = q * scale - w
        return float(np.sum(np.matmul(d, h) * d))

    nearest = np.clip(np.rint(w / scale), qmin, qmax)
    norm = error(nearest) + 1e-30  # the reconstruction term is relative to round-to-nearest's error

    m1, m2 = np.zeros_like(v), np.zeros_like(v)
    for t in range(iters):
        beta = 20.0 + (2.0 - 20.0) * t / max(iters - 1, 1)
        sig = 1.0 / (1.0 + np.exp(-v))
        hv = np.clip(sig * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)
        q = np.clip(base + hv, qmin, qmax)
        d = q * scale - w
        grad_q = 2.0 * np.matmul(d, h) * scale / norm
        inside = (q > qmin) & (q < qmax)
        grad_h = grad_q * inside
        if t > iters // 5:  # warm-up without the regularizer, as in the paper
            u = 2 * hv - 1
            grad_h = grad_h - lam * beta * np.abs(u) ** (beta - 1) * np.sign(u) * 2 / w.size
        active = (hv > 0) & (hv < 1)
        grad_v = grad_h * active * sig * (1 - sig) * (ZETA - GAMMA)
        m1 = 0.9 * m1 + 0.1 * grad_v
        m2 = 0.999 * m2 + 0.001 * grad_v ** 2
        v -= lr * (m1 / (1 - 0.9 ** (t + 1))) / (np.sqrt(m2 / (1 - 0.999 ** (t + 1))) + 1e-8)
    learned = refine(np.clip(base + (_rect_sigmoid(v) >= 0.5), qmin, qmax), w, scale, qmin, qmax, h, base)
    return learned, error(nearest), error(learned)


def adaround(graph: Graph, table: QuantTable, batches: Iterable[np.ndarray], *, positions: int = 256,
             iters: int = 300, seed: int = 0) -> tuple[dict[str, np.ndarray], AdaRoundLog]:
    """Weight name -> the learned dequantized weight (on the table's grid), for every Conv/Gemm with a
    symmetric (zero point 0) table entry; see the module docstring."""
    log = AdaRoundLog()
    layers = [n for n in weighted_layers(graph, table, BiasCorrectionLog())
              if not np.any(table.tensors[n.inputs[1]].qparams.zero_point)]
    rng = np.random.default_rng(seed)
    hess: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for node, x in layer_inputs(graph, layers, batches):
        w = graph.initializers[node.inputs[1]]
        if layer_kind(node) is LayerKind.CONVOLUTION:
            group = channel_groups(node)
            patches = sample_patches(x.astype(np.float64), node, w, positions, rng)
            xg = patches.reshape(patches.shape[0], group, -1).transpose(1, 0, 2)  # [G, S, K]
        else:
            xg = x.reshape(1, -1, x.shape[-1]).astype(np.float64)
        hess[node.name] = hess.get(node.name, 0) + np.matmul(xg.transpose(0, 2, 1), xg)
        counts[node.name] = counts.get(node.name, 0) + xg.shape[1]
    learned = {}
    for node in layers:
        if node.name not in hess:
            continue
        name = node.inputs[1]
        w = graph.initializers[name].astype(np.float64)
        qp = table.tensors[name].qparams
        if counts[node.name] < hess[node.name].shape[-1]:
            log.skipped.append((node.name, f"{counts[node.name]} input samples for {hess[node.name].shape[-1]} "
                                           "weights per channel: H is singular, rounding would overfit"))
            continue
        convolution = layer_kind(node) is LayerKind.CONVOLUTION
        if convolution:
            group = channel_groups(node)
            wg = w.reshape(group, w.shape[0] // group, -1)
            scale = np.broadcast_to(qp.scale.reshape(-1, 1) if qp.axis is not None else qp.scale.reshape(1, 1),
                                    (w.shape[0], 1)).reshape(group, -1, 1)
        else:
            wm = w if node.attr("transB", 0) else w.T  # [N, K]
            wg = wm[None]
            axis_is_out = qp.axis is None or (qp.axis == (0 if node.attr("transB", 0) else 1))
            if not axis_is_out:
                log.skipped.append((node.name, "per-channel axis is not the output axis"))
                continue
            scale = np.broadcast_to(qp.scale.reshape(-1, 1), (wm.shape[0], 1))[None]
        q, before, after = learn_rounding(wg, scale, qp.qmin, qp.qmax, hess[node.name] / counts[node.name],
                                          iters=iters)
        if after >= before:
            q = np.clip(np.rint(wg / scale), qp.qmin, qp.qmax)
            after = before
        value = (q * scale).astype(np.float32)
        if convolution:
            value = value.reshape(w.shape)
        else:
            value = value[0] if node.attr("transB", 0) else value[0].T
        learned[name] = np.ascontiguousarray(value.astype(graph.initializers[name].dtype))
        log.layers[node.name] = (before, after)
    return learned, log
