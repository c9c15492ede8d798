"""The 4-bit grids of a layer fitted to the layer's output error (`Int4Grid.output_fit`), not to the tensors'.

A 4-bit layer y = W x loses accuracy through its weight's rounding and its input's. Fitting each grid to its own
tensor (the weight's MSE per channel, the input's histogram MSE) treats every weight and every input channel
alike; the output error weighs them by what they carry. Over the float input patches x of the fit samples
(im2col, up to `positions` output positions per image; `ptq.adjust.gptq.grouped_patches`):

- weights, per output channel c: the clipping threshold t_c = r max|w_c| (r in WEIGHT_RATIOS, scale t_c / 7)
  minimizing the channel's output error (Q(w_c) - w_c) H (Q(w_c) - w_c)^T, H = sum x x^T;
- the input copy (uint4): the range [f lo, f hi] (f in RANGE_FACTORS, [lo, hi] the calibrator's 4-bit range,
  cut to the 8-bit entry's range, which the copy is requantized from) minimizing sum_x || W (Q(x) - x) ||^2.

The candidates include the tensor fits (r of the weight's MSE fit, f = 1), so each grid's output error on the fit
samples is at most theirs. Free scales only (a power-of-two grid keeps its tensor fit). Measured on Lite0 (14
layers holding 40 % of the MACs, bias-corrected base; bench/int4_mix.py), validation / eval cosine: tensor fits
0.9755 / 0.9757, output fits 0.9776 / 0.9769 (rounded to nearest); with GPTQ 0.9768 / 0.9798 and 0.9796 / 0.9807.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import numpy as np

from ptq.adjust.gptq import grouped_patches, layer_matrix
from ptq.core.graph import Graph, Node
from ptq.core.qparams import QParams
from ptq.engine.float_run import layer_inputs
from ptq.table.quant_table import TensorEntry

WEIGHT_RATIOS = np.linspace(0.30, 1.0, 36)  # t_c / max|w_c|, as the tensor fit (`lane_mix.CLIP_RATIOS`)
RANGE_FACTORS = np.linspace(0.4, 1.6, 25)
POSITIONS = 512  # output positions sampled per image and layer


def uint4_qparams(lo: float, hi: float) -> QParams:
    """The asymmetric uint4 grid of [lo, hi] (lo <= 0 <= hi): scale (hi - lo) / 15, zero point round(-lo / s)."""
    scale = (hi - lo) / 15 if hi > lo else 1.0
    return QParams(scale=scale, zero_point=int(np.clip(round(-lo / scale), 0, 15)), bits=4, signed=False)


def int4_weight_entry(entry: TensorEntry, scale: np.ndarray, calibrator: str) -> TensorEntry:
    """`entry` (a 4-bit weight's) on the per-channel grid `scale`, its range +-7.5 s_c: the range whose symmetric
    grid `compute_qparams` gives back as s_c, so the table's range and scale agree; `floor_weight_scales`, which
    raises the scale of a dead channel by recomputing every channel from the range, keeps the others' fitted
    scales (a range of the weight's extrema put every channel of such a layer back on max|w| / 7.5)."""
    scale = np.asarray(scale, dtype=np.float32).astype(np.float64)  # the float32 grid compute_qparams rounds to
    return dataclasses.replace(entry, calibrator=calibrator, min=-7.5 * scale, max=7.5 * scale,
                               qparams=dataclasses.replace(entry.qparams, scale=scale))


def _range(entry: TensorEntry) -> tuple[float, float]:
    return float(np.min(entry.min)), float(np.max(entry.max))


def _candidate_ranges(copy: TensorEntry, wide: TensorEntry) -> list[tuple[float, float]]:
    (lo, hi), (wide_lo, wide_hi) = _range(copy), _range(wide)
    return [(max(lo * f, min(wide_lo, 0.0)), min(hi * f, max(wide_hi, 0.0))) for f in RANGE_FACTORS]


def fitted_grids(graph: Graph, layers: Sequence[Node], weights: Mapping[str, TensorEntry],
                 copies: Mapping[str, TensorEntry], wide: Mapping[str, TensorEntry], batches: Iterable, *,
                 positions: int = POSITIONS, seed: int = 0) -> tuple[dict[str, TensorEntry], dict[str, TensorEntry]]:
    """(node -> weight entry, node -> input copy entry) fitted to the output error (module docstring), for each of
    `layers` (Convs and Gemms); `weights`/`copies`: their tensor-fitted 4-bit entries by node, `wide`: the 8-bit
    entries of their inputs by node."""
    rng = np.random.default_rng(seed)
    hessians: dict[str, np.ndarray] = {}
    errors: dict[str, np.ndarray] = {}
    candidates = {node.name: [uint4_qparams(lo, hi) for lo, hi in _candidate_ranges(copies[node.name], wide[node.name])]
                  for node in layers}
    matrices = {node.name: layer_matrix(node, graph.initializers[node.inputs[1]].astype(np.float64),
                                        weights[node.name].qparams) for node in layers}
    for node, x in layer_inputs(graph, layers, batches):
        w = graph.initializers[node.inputs[1]]
        patches = grouped_patches(x, node, w, positions, rng)  # [G, S, K]
        hessians[node.name] = hessians.get(node.name, 0.0) + np.matmul(patches.transpose(0, 2, 1), patches)
        matrix = matrices[node.name]
        if matrix is None:
            continue
        wg = matrix[0]
        err = [float(np.sum(np.matmul(qp.dequantize(qp.quantize(patches)) - patches, wg.transpose(0, 2, 1)) ** 2))
               for qp in candidates[node.name]]
        errors[node.name] = errors.get(node.name, 0.0) + np.array(err)
    new_weights, new_copies = {}, {}
    for node in layers:
        if node.name not in hessians or matrices[node.name] is None:
            continue
        wg, _ = matrices[node.name]
        h = hessians[node.name]
        peak = np.abs(wg).max(axis=2, keepdims=True)  # [G, O, 1]
        best, best_scale = None, None
        for ratio in WEIGHT_RATIOS:
            scale = np.where(peak > 0, peak * ratio / 7, 1.0)
            d = np.clip(np.rint(wg / scale), -8, 7) * scale - wg
            err = np.sum(np.matmul(d, h) * d, axis=2, keepdims=True)
            if best is None:
                best, best_scale = err, scale
            else:
                better = err < best
                best, best_scale = np.where(better, err, best), np.where(better, scale, best_scale)
        entry = weights[node.name]
        if np.asarray(entry.qparams.scale).size == best_scale.size:  # per channel (a per-tensor grid keeps its fit)
            new_weights[node.name] = int4_weight_entry(entry, best_scale.reshape(-1), "int4-output")
        k = int(np.argmin(errors[node.name]))
        lo, hi = _candidate_ranges(copies[node.name], wide[node.name])[k]
        new_copies[node.name] = dataclasses.replace(copies[node.name], calibrator="int4-output", min=lo, max=hi,
                                                    qparams=candidates[node.name][k])
    return new_weights, new_copies
