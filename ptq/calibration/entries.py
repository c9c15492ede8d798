"""The quant table's entries from what calibration measured: activations from their statistics, weights from
their values (the `ranges` step of `ptq.calibration.steps`, and what `ptq tune` recalibrates with).

Activations are calibrated per tensor; weights per channel (or per tensor). With `fold_clip`, a tensor whose
every consumer clamps it (a Relu, a Clip with constant bounds: `OpDef.clip_range`) gets its range intersected
with those bounds (`ptq.engine.clip_ranges`).
"""
from __future__ import annotations

import logging

import numpy as np

from calibrators import TensorStatistics, calibrate_array, get_calibrator
from ptq.calibration.joined_ranges import separate_joined_parts
from ptq.calibration.outlier_channels import widen_outlier_channels
from ptq.calibration.ranked_inputs import ranked_tensors
from ptq.calibration.read_values import read_values_tensor
from ptq.calibration.recurrent_inputs import widen_recurrent_inputs
from ptq.calibration.output_scores import widen_output_scores
from ptq.core.bodies import body_activations, calibrated_tensors
from ptq.core.graph import Graph
from ptq.core.qparams import compute_qparams
from ptq.engine.clip_ranges import folded_ranges
from ptq.engine.weight_scale_floor import floor_weight_scales
from ptq.engine.weight_tensors import weight_tensors
from ptq.table.quant_table import CalibrationOptions, QuantTable, TensorEntry


def activation_entries(
    graph: Graph, stats: dict[str, TensorStatistics], options: CalibrationOptions
) -> dict[str, TensorEntry]:
    """Table entries of the activations from their statistics; a join of widely different ranges that ends in
    a graph output keeps one grid per part (`ptq.calibration.joined_ranges`), class scores at a graph output
    keep 16 bits with their logits (`ptq.calibration.output_scores`); a layer input with outlier channels gets 16
    bits (`ptq.calibration.outlier_channels`), so does a recurrent cell's input sequence
    (`ptq.calibration.recurrent_inputs`)."""
    calibrator = get_calibrator(options.calibrator).for_grid(options.symmetric)
    bounds = folded_ranges(graph) if options.fold_clip else {}
    ranked = ranked_tensors(graph)
    consumers, known = graph.consumers(), {n for n, s in stats.items() if not s.empty}
    entries = {}
    inner = set(body_activations(graph))
    for name in calibrated_tensors(graph):
        if name in inner and (name not in stats or stats[name].empty):
            continue  # a branch no sample took: no entry, and the executor runs that branch in float
        try:
            chooser = calibrator.within(*bounds[name]) if name in bounds else calibrator
            if name in ranked:
                chooser = chooser.unclipped(ranked[name])
            read = read_values_tensor(graph, name, known, consumers) if calibrator.scores_read_values else name
            rmin, rmax, label = chooser.compute_explained(stats[read], bits=options.bits)
        except ValueError as exc:
            raise ValueError(f"calibrating tensor {name!r}: {exc}") from exc
        if name in bounds:
            lo, hi = bounds[name]
            rmin, rmax = np.clip(rmin, lo, hi), np.clip(rmax, lo, hi)
        qp = compute_qparams(rmin, rmax, options.bits, symmetric=options.symmetric, narrow=options.narrow,
                             pow2=options.pow2)
        entries[name] = TensorEntry("activation", label, rmin, rmax, qp)
    log = logging.getLogger("ptq.calibration.pipeline")
    for join in separate_joined_parts(graph, entries, options):
        log.info("%s", join.why)
    for wide in widen_outlier_channels(graph, stats, entries, options):
        log.info("%s: %s", wide.tensor, wide.why)
    for recurrent in widen_recurrent_inputs(graph, entries, options):
        log.info("%s", recurrent.why)
    widen_output_scores(graph, entries, options)
    return entries


def weight_entries(graph: Graph, options: CalibrationOptions) -> dict[str, TensorEntry]:
    """Table entries of the weights (initializers in a weight role, see ptq.core.roles)."""
    calibrator = get_calibrator(options.weight_calibrator).for_grid(options.weight_symmetric)
    entries = {}
    for name, w, axis in weight_tensors(graph, options.per_channel):
        rmin, rmax = calibrate_array(calibrator, w, axis=axis, bits=options.weight_bits)
        qp = compute_qparams(rmin, rmax, options.weight_bits, symmetric=options.weight_symmetric,
                             narrow=options.weight_narrow, pow2=options.pow2, axis=axis)
        entries[name] = TensorEntry("weight", calibrator.spelling, rmin, rmax, qp)
    return entries


def build_table(graph: Graph, stats: dict[str, TensorStatistics], options: CalibrationOptions) -> QuantTable:
    tensors = activation_entries(graph, stats, options)
    tensors.update(weight_entries(graph, options))
    floor_weight_scales(graph, tensors, options)
    return QuantTable(options=options, tensors=tensors)
