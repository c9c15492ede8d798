"""The weight adjustments of calibration, in order: BatchNorm folded into the model (`ptq.adjust.batchnorm_stats`, so
that every adjustment sees the Conv the integer graph runs, and keeping the BatchNorm statistics), cross-layer
equalization before the statistics (data-free, `ptq.adjust.equalize`), then, with the table's weight qparams, bias
correction (empirical on the calibration images, `ptq.adjust.bias_correction`, or analytic from the BatchNorm
statistics, `ptq.adjust.analytic_bias_correction`) and AdaRound (`ptq.adjust.adaround`). Each returns a new Graph; the
table's activation entries stay those calibrated on the equalized model (bias correction moves a channel's
mean by a fraction of an LSB)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ops.registry import bias_role, layer_kind
from ptq.adjust.adaround import adaround
from ptq.adjust.adjusted_model import save_adjusted
from ptq.adjust.analytic_bias_correction import correct_biases_analytic
from ptq.adjust.batchnorm_stats import ChannelStats, batchnorm_statistics, fold_batchnorms
from ptq.adjust.bias_correction import correct_biases
from ptq.adjust.equalize import equalize
from ptq.core.graph import Graph, load_model
from ptq.core.roles import LayerKind
from ptq.table.quant_table import QuantTable

logger = logging.getLogger("ptq.calibration.adjustments")


def batchnorm_folded(graph: Graph, input_shapes: Optional[dict]) -> tuple[Graph, dict]:
    """The graph with its BatchNormalizations folded, and their statistics by output tensor."""
    stats = batchnorm_statistics(graph)
    model, folded = fold_batchnorms(graph)
    if not folded:
        return graph, stats
    logger.info("folded %d BatchNormalization nodes into their Convs", folded)
    return load_model(model, input_shapes), stats


def equalized(graph: Graph, input_shapes: Optional[dict], stats: Optional[dict] = None) -> tuple[Graph, dict]:
    """The equalized graph, and the BatchNorm statistics of `stats` moved with it (`rescaled_statistics`)."""
    model, log = equalize(graph)
    logger.info("%s", log.summary())
    after = load_model(model, input_shapes)
    return after, rescaled_statistics(graph, after, stats or {})


def rescaled_statistics(before: Graph, after: Graph, stats: dict) -> dict:
    """Statistics of Conv outputs after equalization (W'_c = W_c / s_c, any new bias b'): a channel's values
    become (y - b_c) / s_c + b'_c, so mean' = (mean - b_c) / s_c + b'_c and std' = std / s_c."""
    producer_before, producer_after = before.producer(), after.producer()
    out = {}
    for tensor, st in stats.items():
        n0, n1 = producer_before.get(tensor), producer_after.get(tensor)
        if n0 is None or n1 is None or not (layer_kind(n0) is layer_kind(n1) is LayerKind.CONVOLUTION):
            out[tensor] = st
            continue
        w0, w1 = (g.initializers[n.inputs[1]].astype(np.float64) for g, n in ((before, n0), (after, n1)))
        r0, r1 = (np.abs(w).reshape(w.shape[0], -1).max(axis=1) for w in (w0, w1))
        s = np.where((r0 > 0) & (r1 > 0), r0 / np.where(r1 > 0, r1, 1), 1.0)
        b0, b1 = (_bias(g, n, len(s)) for g, n in ((before, n0), (after, n1)))
        out[tensor] = ChannelStats((st.mean - b0) / s + b1, st.std / s)
    return out


def _bias(graph: Graph, node, channels: int) -> np.ndarray:
    """The node's bias (its op's `bias_role`) as float64, zeros when it has none."""
    role = bias_role(node)
    if role is None or len(node.inputs) <= role.input_index or not node.inputs[role.input_index]:
        return np.zeros(channels)
    return graph.initializers[node.inputs[role.input_index]].astype(np.float64)


def analytic_corrected(graph: Graph, table: QuantTable, stats: dict, input_shapes: Optional[dict]) -> Graph:
    """The graph with its biases corrected from the BatchNorm statistics (`ptq.adjust.analytic_bias_correction`)."""
    model, log = correct_biases_analytic(graph, table, stats)
    logger.info("%s", log.summary())
    return load_model(model, input_shapes)


def adarounded(graph: Graph, table: QuantTable, batches: Iterable[np.ndarray]) -> dict[str, np.ndarray]:
    """Weight name -> the weight on the table's grid with its rounding learned (`ptq.adjust.adaround`)."""
    learned, log = adaround(graph, table, batches)
    logger.info("%s", log.summary())
    return learned


def bias_corrected(graph: Graph, table: QuantTable, batches: Iterable[np.ndarray], rounded: dict[str, np.ndarray],
                   input_shapes: Optional[dict]) -> Graph:
    """The graph with its biases corrected for the mean shift of the table's weight rounding, or of `rounded`
    (AdaRound's weights, which the corrected graph then holds) against the float weights
    (`ptq.adjust.bias_correction`)."""
    model, log = correct_biases(graph, table, batches, quantized=rounded or None)
    logger.info("%s", log.summary())
    return load_model(model, input_shapes)


def with_rounded_weights(graph: Graph, rounded: dict[str, np.ndarray], input_shapes: Optional[dict]) -> Graph:
    """The graph holding AdaRound's weights (`adarounded`) instead of its float ones."""
    return load_model(with_initializers(graph.model, rounded), input_shapes)


def with_initializers(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` with the named initializers replaced."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    return out


def write_adjusted(graph: Graph, table_path: Path) -> tuple[str, str]:
    _, relative, digest = save_adjusted(graph.model, table_path)
    return relative, digest
