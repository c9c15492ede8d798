"""Calibration as a list of steps (`ptq.calibration.steps`): the list the options ask for, a state each step
returns new (the one it was given stays as it was), AdaRound's weights handed to bias correction through the
state, and the range search step that `ptq tune` runs keeping tensors at another width."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ptq.calibration.pipeline import calibrate
from ptq.calibration.steps import (
    AdaRound, AlignWithIntegerGraph, BiasCorrection, CalibrationSamples, CalibrationState, FoldBatchNorm, InputGrid,
    RangeSearch, RangeStatistics, Ranges, calibration_steps, run_steps,
)
from ptq.core.graph import load_model
from ptq.table.quant_table import CalibrationOptions
from reports.tables import with_bits
from tests.test_analytic_bias_correction import bn_graph


def _names(**options) -> list[str]:
    return [step.name for step in calibration_steps(CalibrationOptions(**options))]


def test_the_options_choose_the_steps_in_order():
    assert _names() == ["range statistics", "ranges", "input grid", "align with the integer graph"]
    assert _names(bits=16) == _names(bits=6) == ["range statistics", "ranges", "align with the integer graph"]
    assert _names(equalize=True, bias_correction=True) == [
        "fold BatchNorm", "equalize", "range statistics", "ranges", "input grid", "bias correction",
        "align with the integer graph"]
    assert _names(adaround=True, bias_correction=True, range_search=True) == [
        "fold BatchNorm", "range statistics", "ranges", "range search", "input grid", "AdaRound", "bias correction",
        "align with the integer graph"]
    assert _names(analytic_bias_correction=True, scheme="int4-dsp") == [
        "fold BatchNorm", "int4-dsp Requantize nodes", "range statistics", "ranges", "analytic bias correction",
        "align with the integer graph"]
    steps = calibration_steps(CalibrationOptions(adaround=True), align=False)
    assert [s.name for s in steps][-1] == "AdaRound" and steps[-1] == AdaRound(defer_write=False)
    assert calibration_steps(CalibrationOptions(adaround=True, bias_correction=True))[-3] == AdaRound(defer_write=True)
    with pytest.raises(ValueError, match="choose one bias correction"):
        calibration_steps(CalibrationOptions(bias_correction=True, analytic_bias_correction=True))


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    model = bn_graph(rng.uniform(0.5, 2, 4), rng.normal(0, 1, 4), rng.normal(0, 0.3, (3, 4, 3, 3)),
                     rng.normal(0, 0.1, 3))
    samples = rng.normal(0, 1, (6, 4, 8, 8)).astype(np.float32)
    options = CalibrationOptions(adaround=True, bias_correction=True, batch_size=2)
    return model, samples, options


def test_steps_return_a_new_state_and_adaround_hands_its_weights_to_bias_correction(setup):
    model, samples, options = setup
    graph = load_model(model)
    start = CalibrationState(graph, options, CalibrationSamples(samples, None, 0), model)
    folded = FoldBatchNorm().apply(start)
    assert start.graph is graph and start.batchnorm == {} and [n.name for n in graph.nodes][1] == "bn"
    assert "bn" not in [n.name for n in folded.graph.nodes] and set(folded.batchnorm) == {"bn"}
    ranged = InputGrid().apply(Ranges().apply(RangeStatistics().apply(folded)))
    assert folded.table is None and ranged.table is not None and ranged.image_log.used
    rounded = AdaRound(defer_write=True).apply(ranged)
    assert rounded.graph is ranged.graph and set(rounded.rounded_weights) == {"W0", "W1"}
    corrected = BiasCorrection().apply(rounded)
    assert corrected.rounded_weights == {}
    for name, value in rounded.rounded_weights.items():  # the graph holds AdaRound's weights now
        np.testing.assert_array_equal(corrected.graph.initializers[name], value)
    assert not np.array_equal(corrected.graph.initializers["B1"], ranged.graph.initializers["B1"])
    # the list calibrate runs is these steps: the same table and graph
    final = AlignWithIntegerGraph().apply(corrected)
    result = calibrate(model, samples, write_qdq=False, calibrator=options.calibrator, adaround=True,
                       bias_correction=True, batch_size=2)
    assert final.table.tensors.keys() == result.table.tensors.keys()
    for name, entry in result.table.tensors.items():
        assert entry.qparams == final.table.tensors[name].qparams, name
    for name, value in result.graph.initializers.items():
        np.testing.assert_array_equal(final.graph.initializers[name], value)
    assert run_steps(calibration_steps(options), start).table.tensors.keys() == result.table.tensors.keys()


def test_range_search_keeps_tensors_at_another_width(setup):
    """`ptq tune` widens tensors to 16 bits, then may search the 8-bit ranges: the 16-bit ones keep their
    entries (the candidates are computed at the table's width)."""
    model, samples, _ = setup
    options = CalibrationOptions(calibrator="mse", range_search=True)
    state = Ranges().apply(RangeStatistics().apply(
        CalibrationState(load_model(model), options, CalibrationSamples(samples, None, 0), model)))
    searched = RangeSearch().apply(state)
    changed = [n for n, e in searched.table.tensors.items() if e.qparams != state.table.tensors[n].qparams]
    assert changed, "the search changed no range: the test needs a model where it does"
    wide = dataclasses.replace(state, table=with_bits(state.table, changed, 16))
    kept = RangeSearch().apply(wide)
    for name in changed:
        assert kept.table.tensors[name] == wide.table.tensors[name]
