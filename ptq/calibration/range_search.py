"""Per-tensor range search: each activation's range chosen among the calibrators' candidates by the error it
causes in the outputs of the nodes that consume it, not in the tensor itself (issue #15, scope 2).

For an activation t with candidate ranges R_1..R_m (one per calibrator, all computed from one statistics
pass), on each sample image, for each consumer c of t:

    y_c = c(t, other inputs)                    (float)
    y_c(R) = c(fq_R(t), other inputs),   fq_R(t) = dequantize(quantize_R(t))
    score(R) = sum over images and consumers of ||y_c(R) - y_c||^2 / ||y_c||^2

(relative, so consumers of different scales weigh alike; a graph output is scored on itself) and the range
with the lowest score is kept. A clipping range that saturates a few large values usually costs less in a
Conv's output than in the tensor, and the other way round for a tensor feeding a Softmax or an Add with a
large partner; scoring the consumer sees which. Candidates whose qparams coincide are scored once. A tensor
the executor fuses away (a Conv output consumed only by its fused Relu/Clip) is not searched.

Cost: per image, one float run of the model plus m runs of each consumer node; `max_images` bounds it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ptq.calibration.entries import activation_entries
from ptq.core.graph import Graph
from ptq.engine.fused_layers import fused_output
from ptq.engine.float_fallback import NodeFloatEvaluator
from ptq.engine.float_run import FloatRunner
from ptq.table.quant_table import CalibrationOptions, TensorEntry

DEFAULT_CANDIDATES = ("extrema", "mse", "kld", "99.99percentile")
DEFAULT_MAX_IMAGES = 8


@dataclass
class RangeSearchLog:
    chosen: dict[str, str] = field(default_factory=dict)  # tensor -> calibrator kept
    images: int = 0

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for name in self.chosen.values():
            counts[name] = counts.get(name, 0) + 1
        parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
        return f"range search on {self.images} images: {len(self.chosen)} tensors ({parts})"


def _fused_away(graph: Graph, tensor: str, consumers: dict, producer: dict) -> bool:
    host = producer.get(tensor)
    return host is not None and host.outputs[0] == tensor and fused_output(graph, host, consumers) != tensor


def _inputs(node, values: dict, graph: Graph, replaced: str = "", value=None) -> list:
    """The node's inputs from one image's float tensors and the initializers, `replaced` given `value`."""
    return [None if not n else value if n == replaced else values.get(n, graph.initializers.get(n))
            for n in node.inputs]


def _relative_error(a: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    norm = float(np.sum(ref * ref))
    err = float(np.sum((a.astype(np.float64) - ref) ** 2))
    return err / norm if norm > 0 else err


def search_ranges(graph: Graph, candidates: dict[str, dict[str, TensorEntry]], samples: Iterable[np.ndarray],
                  max_images: int = DEFAULT_MAX_IMAGES) -> tuple[dict[str, TensorEntry], RangeSearchLog]:
    """`candidates`: calibrator name -> its activation entries (`ptq.calibration.entries.activation_entries`);
    `samples`: model inputs with a batch axis. Returns the chosen entry per searched tensor and the log."""
    names = list(candidates)
    consumers, producer = graph.consumers(), graph.producer()
    evaluator = NodeFloatEvaluator(graph.opset)
    searched = [t for t in graph.activations if all(t in c for c in candidates.values())
                and not _fused_away(graph, t, consumers, producer)]
    distinct = {}  # tensor -> indices of candidates with distinct qparams
    for t in searched:
        seen: list[int] = []
        for i, n in enumerate(names):
            if not any(candidates[names[j]][t].qparams == candidates[n][t].qparams for j in seen):
                seen.append(i)
        distinct[t] = seen
    searched = [t for t in searched if len(distinct[t]) > 1]
    scores = {t: np.zeros(len(names)) for t in searched}
    runner = FloatRunner.create(graph, graph.activations)
    log = RangeSearchLog()
    for sample in samples:
        if log.images >= max_images:
            break
        values = runner.run_dict(sample)
        log.images += len(sample)
        for t in searched:
            users = [u for u in consumers.get(t, []) if all(not i or i in values or i in graph.initializers
                                                            for i in u.inputs)]
            refs = [values[u.outputs[0]] if u.outputs[0] in values else evaluator.run(u, _inputs(u, values, graph))[0]
                    for u in users]
            for i in distinct[t]:
                qp = candidates[names[i]][t].qparams
                fq = qp.dequantize(qp.quantize(values[t])).astype(values[t].dtype)
                if not users:
                    scores[t][i] += _relative_error(fq, values[t])
                for user, ref in zip(users, refs):
                    out = evaluator.run(user, _inputs(user, values, graph, t, fq))[0]
                    scores[t][i] += _relative_error(out, ref)
        del values
    chosen = {}
    for t in searched:
        best = min(distinct[t], key=lambda i: scores[t][i])
        chosen[t] = candidates[names[best]][t]
        log.chosen[t] = names[best]
    return chosen, log


def candidate_entries(graph: Graph, stats: dict, options: CalibrationOptions,
                      calibrators: Sequence[str] = DEFAULT_CANDIDATES) -> dict[str, dict[str, TensorEntry]]:
    """Calibrator name -> the activation entries it gives on `stats` (same bits, symmetry, Clip folding)."""
    return {name: activation_entries(graph, stats, dataclasses.replace(options, calibrator=name))
            for name in calibrators}
