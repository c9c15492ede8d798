"""Analytic (data-free) bias correction (Nagel et al. 2019, "Data-Free Quantization", section 4.2).

The empirical correction (`ptq.adjust.bias_correction`) measures E[x] on images; here it comes from BatchNorm
statistics instead. A tensor written by a BatchNormalization (folded or not, `ptq.adjust.batchnorm_stats`) is taken
as Gaussian per channel, N(beta_c, gamma_c^2). Through a clipping activation y = clip(x, lo, hi) (Relu:
lo = 0, hi = inf; Clip; an equalized Clip's per-channel Min), with relu(x) = max(x, 0),

    E[relu(x - t)] = (mu - t) Phi((mu - t) / sigma) + sigma phi((mu - t) / sigma)
    E[clip(x, lo, hi)] = lo + E[relu(x - lo)] - E[relu(x - hi)]

and mean-preserving ops after it (GlobalAveragePool, Flatten, Identity) keep E[y]. A Conv consuming y sees
the mean input patch P[k, i, j] = E[y_k] * f[i, j], f[i, j] the share of output positions where tap (i, j)
lands inside the input rather than on padding (exact when E[y_k] is the same at every position), and the
bias is corrected by shift_c = sum (W_q - W)[c] P as in the empirical module. Layers whose input mean is
unknown (no BatchNorm behind it) keep their bias.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper
from scipy.special import ndtr

from ops.registry import layer_kind, op_of
from ptq.adjust.batchnorm_stats import ChannelStats
from ptq.adjust.bias_correction import (
    bias_target, conv_geometry, corrected_bias, layer_shift, mean_patch, rounding_delta, weighted_layers,
)
from ptq.core.graph import Graph
from ptq.core.roles import LayerKind
from ptq.table.quant_table import QuantTable


@dataclass
class AnalyticLog:
    corrected: dict[str, float] = field(default_factory=dict)  # node name -> max |shift_c|
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        worst = max(self.corrected.values(), default=0.0)
        return (f"analytic bias correction: {len(self.corrected)} layers (largest shift {worst:.3g}), "
                f"{len(self.skipped)} without BatchNorm statistics")


def relu_mean(mu: np.ndarray, sigma: np.ndarray, t) -> np.ndarray:
    """E[max(x - t, 0)] for x ~ N(mu, sigma^2) (module docstring); sigma 0 gives max(mu - t, 0)."""
    d = np.asarray(mu, dtype=np.float64) - t
    s = np.asarray(sigma, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(s > 0, d / np.where(s > 0, s, 1), 0.0)
        value = d * ndtr(z) + s * np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi)
    value = np.where(s > 0, value, np.maximum(d, 0.0))
    return np.where(np.isinf(d), np.where(d > 0, np.inf, 0.0), value)


def clipped_mean(mu: np.ndarray, sigma: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """E[clip(x, lo, hi)] for x ~ N(mu, sigma^2), per channel; lo/hi may be infinite."""
    lo, hi = np.broadcast_to(lo, mu.shape), np.broadcast_to(hi, mu.shape)
    out = np.where(np.isfinite(lo), lo + relu_mean(mu, sigma, np.where(np.isfinite(lo), lo, 0.0)), mu)
    return out - np.where(np.isfinite(hi), relu_mean(mu, sigma, np.where(np.isfinite(hi), hi, 0.0)), 0.0)


def expected_input(graph: Graph, tensor: str, stats: dict[str, ChannelStats]) -> Optional[np.ndarray]:
    """E[tensor] per channel, walking back through mean-preserving ops, then clipping ops, to a tensor with
    BatchNorm statistics (module docstring); None when there is none."""
    producer = graph.producer()
    node = producer.get(tensor)
    while node is not None and _preserves_mean(node) and tensor not in stats:
        tensor = node.inputs[0]
        node = producer.get(tensor)
    lo, hi = -np.inf, np.inf
    while tensor not in stats:
        node = producer.get(tensor)
        op = op_of(node) if node is not None else None
        bounds = op.clamp_bounds(node, graph.constant_lookup(node)) if op is not None else None
        if bounds is None:
            return None
        lo = np.maximum(lo, np.reshape(bounds[0], -1))
        hi = np.minimum(hi, np.reshape(bounds[1], -1))
        tensor = node.inputs[0]
    s = stats[tensor]
    return clipped_mean(s.mean, s.std, lo, hi)


def _preserves_mean(node) -> bool:
    op = op_of(node)
    return op is not None and op.preserves_channel_mean


def tap_coverage(shape, kernel, pads, strides, dilations) -> Optional[np.ndarray]:
    """f[i, j]: the share of output positions where tap (i, j) reads the input, not padding."""
    if shape is None or len(shape) != 4 or any(not isinstance(d, int) or d <= 0 for d in shape[2:]):
        return None
    total, count = mean_patch(np.ones((1, 1) + tuple(shape[2:])), kernel, pads, strides, dilations)
    return total[0] / count


def correct_biases_analytic(graph: Graph, table: QuantTable,
                            stats: dict[str, ChannelStats]) -> tuple[onnx.ModelProto, AnalyticLog]:
    """A copy of `graph.model` whose Conv/Gemm biases are corrected for the table's weight rounding, from
    BatchNorm statistics (module docstring)."""
    log = AnalyticLog()
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    inits = {init.name: init for init in model.graph.initializer}
    consumers = graph.consumers()
    shared = {name for name, users in consumers.items() if len(users) > 1}
    for node in weighted_layers(graph, table, log):
        mean = expected_input(graph, node.inputs[0], stats)
        bias_name, sign = bias_target(graph, node, shared, consumers)
        if mean is None or not bias_name:
            log.skipped.append((node.name, "no BatchNorm statistics for its input" if mean is None else "no own bias"))
            continue
        w = graph.initializers[node.inputs[1]]
        if layer_kind(node) is LayerKind.CONVOLUTION:
            pads, strides, dilations = conv_geometry(node, w)
            coverage = tap_coverage(graph.tensors[node.inputs[0]].shape, w.shape[2:], pads, strides, dilations)
            patch = mean[:, None, None] * (np.ones(w.shape[2:]) if coverage is None else coverage)
        else:
            patch = mean
        shift = layer_shift(node, rounding_delta(w, table.tensors[node.inputs[1]].qparams), patch)
        inits[bias_name].CopyFrom(numpy_helper.from_array(corrected_bias(graph, bias_name, shift, sign), bias_name))
        log.corrected[node.name] = float(np.max(np.abs(shift)))
    return model, log
