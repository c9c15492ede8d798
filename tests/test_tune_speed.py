"""`ptq tune`'s cheaper passes decide as the full ones: a pass resumed after a shared prefix of the integer graph
gives the full run's outputs bit for bit; a pass stopped early stops only when no cosines of the photos left
could pass; the layers' route of `minimize` measures only heads that could keep fewer 16-bit tensors."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import onnx
import pytest

from ptq.calibration.pipeline import calibrate
from ptq.core.graph import load_model
from ptq.engine.executor import prepare
from ptq.table.quant_table import load_quant_table
from ptq.tuning.data import Score, Validation
from ptq.tuning.early_stop import PassRule, best_bound, bound, hardest_first
from ptq.tuning.prefix_cache import PrefixCache, checkpoints, live_tensors
from ptq.data.image_source import ArraySamples
from reports.tables import with_bits
from tests.test_equalize import chain
from tests.test_tune import RAW, _Known, setup
from tests.tiny_models import write_images


def _chain_case(tmp_path):
    model_path = tmp_path / "chain.onnx"
    onnx.save(chain(), model_path)
    write_images(tmp_path / "img", 4, size=(10, 10))
    calibrate(model_path, tmp_path / "img", tmp_path / "out", preprocess=RAW, write_qdq=False, calibrator="extrema")
    graph, table = load_model(model_path), load_quant_table(tmp_path / "out" / "chain.quant.json")
    x = np.random.default_rng(3).normal(0.5, 0.3, (6, 3, 10, 10)).astype(np.float32)
    return graph, table, [{"input": x[k:k + 1]} for k in range(len(x))]


def test_live_tensors_and_checkpoints_of_a_chain(tmp_path):
    graph, table, _ = _chain_case(tmp_path)
    prepared = prepare(graph, table)
    live = live_tensors(prepared)
    assert len(live) == len(prepared.steps) + 1
    assert live[0] == {"input"} and live[-1] == set(prepared.graph.outputs)
    for i, step in enumerate(prepared.steps):  # one tensor flows down the chain: it is all a resumed step needs
        assert set(n for n in step.node.inputs if n not in prepared.graph.initializers) <= live[i]
    assert checkpoints(live, 100) == set(range(1, len(prepared.steps)))
    assert checkpoints(live, 0) == set()


@pytest.mark.parametrize("changed", ["c3", "a2", "out", "input"])
def test_a_pass_resumed_after_the_shared_prefix_gives_the_full_runs_outputs(tmp_path, changed):
    graph, table, inputs = _chain_case(tmp_path)
    cache = PrefixCache(count=100)
    first = cache.runner(prepare(graph, table))
    for k, x in enumerate(inputs):
        first.outputs(k, x)
    assert first.resumed_steps == 0
    other = prepare(graph, with_bits(table, [changed], 16))
    run = cache.runner(other)
    for k, x in enumerate(inputs):
        got = run.outputs(k, x)
        want = other.run(x, keep_all=False).outputs
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name])
    producer = next(i for i, s in enumerate(other.steps) if changed in s.node.outputs) if changed != "input" else 0
    assert run.prefix == producer  # the steps before the one writing the changed tensor were reused
    assert run.resumed_steps == producer * len(inputs)
    again = cache.runner(prepare(graph, table))  # back to the first table: resumed from its own pass, to the end
    assert again.prefix == len(other.steps)
    for k, x in enumerate(inputs):
        assert np.array_equal(again.outputs(k, x)[graph.outputs[0]], first.prepared.run(x).outputs[graph.outputs[0]])


def test_the_input_codes_are_quantized_once_per_sample_and_input_key(tmp_path, monkeypatch):
    """A pass from the input (the first step changed) reads the codes an earlier pass with the same input qparams
    quantized; a candidate that changes the input's qparams quantizes again. Outputs as a full run's."""
    from ptq.engine.executor import IntegerGraph

    graph, table, inputs = _chain_case(tmp_path)
    calls = []
    quantized_inputs = IntegerGraph.quantized_inputs
    monkeypatch.setattr(IntegerGraph, "quantized_inputs", lambda self, x: calls.append(1) or quantized_inputs(self, x))
    cache = PrefixCache(count=0)  # no checkpoints: every pass starts from the input
    for candidate in (table, with_bits(table, ["c3"], 16), with_bits(table, ["input"], 16)):
        prepared = prepare(graph, candidate)
        run = cache.runner(prepared)
        for k, x in enumerate(inputs):
            assert np.array_equal(run.outputs(k, x)[graph.outputs[0]],
                                  prepared.run(x, keep_all=False).outputs[graph.outputs[0]])
    assert len(calls) == 2 * len(inputs)  # the first table's pass and the 16-bit input's


def test_re_corrected_biases_count_as_a_change(tmp_path):
    graph, table, inputs = _chain_case(tmp_path)
    cache = PrefixCache(count=100)
    run = cache.runner(prepare(graph, table))
    run.outputs(0, inputs[0])
    model = onnx.load_from_string(graph.model.SerializeToString())
    for init in model.graph.initializer:
        if init.name == "B4":  # the last layer's bias moved, as a re-correction moves it
            b = onnx.numpy_helper.to_array(init) + np.float32(0.25)
            init.CopyFrom(onnx.numpy_helper.from_array(b, "B4"))
    other = prepare(load_model(model), table)
    resumed = cache.runner(other)
    got = resumed.outputs(0, inputs[0])[graph.outputs[0]]
    assert resumed.prefix == len(other.steps) - 1  # only the last Conv reads B4
    assert np.array_equal(got, other.run(inputs[0]).outputs[graph.outputs[0]])
    assert not np.array_equal(got, run.prepared.run(inputs[0]).outputs[graph.outputs[0]])


def test_bound_and_best_bound_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        known = list(rng.uniform(0.97, 1.0, rng.integers(1, 5)))
        total, z = len(known) + int(rng.integers(0, 4)), float(rng.choice([0.0, 1.0, 2.0]))
        best = best_bound(known, total, z)
        def f(c):
            return bound(known + [c] * (total - len(known)), z)

        grid = np.linspace(-1, 1, 4001)
        top = grid[int(np.argmax([f(c) for c in grid]))]
        brute = max(f(c) for c in np.linspace(max(top - 5e-4, -1), min(top + 5e-4, 1), 20001))
        assert best >= brute - 1e-12 and best <= brute + 1e-6
        for _ in range(50):  # no completion, equal or not, beats it
            rest = list(rng.uniform(-1, 1, total - len(known)) ** 2 * rng.choice([-1, 1]))
            assert bound(known + rest, z) <= best + 1e-12
        if total > 1:
            s = Score.of(known + [0.99] * (total - len(known)))
            assert bound(known + [0.99] * (total - len(known)), z) == pytest.approx(s.bound(z), abs=1e-12)
    assert best_bound([0.9, 0.9], 2, 2.0) == pytest.approx(0.9)


def test_hardest_photos_come_first():
    assert hardest_first([0.99, 0.95, 0.999, 0.95]) == (1, 3, 0, 2)


def _array_validation(graph, table, count=8):
    x = np.random.default_rng(5).normal(0.5, 0.3, (count, 3, 10, 10)).astype(np.float32)
    check = Validation.create(graph, ArraySamples(x))
    return check, check.cosine(graph, table)


def test_a_pass_that_is_not_stopped_is_the_full_pass_bit_for_bit(tmp_path):
    graph, table, _ = _chain_case(tmp_path)
    check, full = _array_validation(graph, table)
    order = hardest_first(full.photo_means)
    again = dataclass_copy(check).cosine(graph, table, rule=PassRule(full.bound(2.0) - 1e-6, 2.0, order))
    assert again.scored is None and again.mean == full.mean and again.sem == full.sem


def dataclass_copy(check: Validation) -> Validation:
    """The validation with an empty prefix cache (a pass from scratch)."""
    return Validation(check.inputs, check.reference, groups=check.groups)


def test_a_pass_stops_only_when_the_full_pass_would_fail(tmp_path):
    graph, table, _ = _chain_case(tmp_path)
    check, full = _array_validation(graph, table)
    order = hardest_first(full.photo_means)
    worse = with_bits(table, ["c3"], 4)  # a candidate that loses
    full_worse = dataclass_copy(check).cosine(graph, worse)
    for threshold, z in itertools.product(np.linspace(full_worse.bound(2.0) - 0.02, 1.0, 9), (0.0, 2.0)):
        score = dataclass_copy(check).cosine(graph, worse, rule=PassRule(float(threshold), z, order))
        if score.scored is not None:  # stopped: the full pass fails the rule, and so does the partial score
            assert score.scored < check.photos and full_worse.bound(z) < threshold
            assert score.bound(z) < threshold
        else:
            assert score == full_worse
    stopped = dataclass_copy(check).cosine(graph, worse, rule=PassRule(1.0, 2.0, order))
    assert stopped.scored == 1  # one photo below 1 and a target of 1: out of reach at once


def test_the_layers_route_measures_one_head_when_it_cannot_keep_fewer(tmp_path):
    from ptq.tuning.tuner import _State, _Tuner, layer_head, layer_units

    model_path, table_path = setup(tmp_path)
    table, graph = load_quant_table(table_path), load_model(model_path)
    ranking = ["c3", "a2", "out", "a1", "input"]
    units = layer_units(graph, table, ranking)  # [c3 W3] [a2 W2] [out W4] [a1 W1] [input] [c1] [c2]
    assert layer_head(units, ["c3", "a2"]) == 0  # a layer is 2 tensors: no head keeps fewer than 2
    assert layer_head(units, ["c3", "a2", "out", "a1", "input"]) == 2
    assert layer_head(units, ["c3", "a2", "X"]) == 0  # X outside every layer stays: 1 + 2 is not fewer than 3
    check = _Known(["c3", "a2", "out", "a1"])  # the tensors' route keeps these 4; a head of fewer than 4 tensors
    # of layers is [c3 W3] alone, which does not reach: one pass on the layers, not a bisection of 7
    tuner = _Tuner(graph, table, None, check, 0.998, 2.0, 1e-5)
    acts = [n for n, e in table.tensors.items() if e.kind == "activation"]
    tuner.saved = {n: table.tensors[n] for n in acts}
    tuner.state = _State(with_bits(table, acts, 16), graph, check.cosine(graph, with_bits(table, acts, 16)),
                         int16=list(acts))
    calls = check.calls
    tuner.minimize(ranking)
    assert sorted(tuner.state.int16) == ["a1", "a2", "c3", "out"] and tuner.done()
    layer_steps = [s for s in tuner.steps if "layers" in s.change]
    assert len(layer_steps) == 1 and not layer_steps[0].kept
    assert layer_steps[0].change == "int16: the 1 most useful of 7 layers, to remove layer by layer"
    assert check.calls - calls == sum(1 for s in tuner.steps if s.change.startswith(("back", "int16")))


def test_a_graph_with_re_corrected_biases_is_the_reloaded_one():
    from ptq.calibration.adjustments import with_initializers
    from ptq.tuning.tuner import with_biases

    graph = load_model(chain())
    biases = {"B1": np.linspace(-1, 1, 8).astype(np.float32), "B4": np.float32([0.5, 0.25, -0.125, 2.0])}
    fast, reloaded = with_biases(graph, biases), load_model(with_initializers(graph.model, biases))
    assert fast.initializers.keys() == reloaded.initializers.keys()
    for name, value in reloaded.initializers.items():
        assert fast.initializers[name].dtype == value.dtype and np.array_equal(fast.initializers[name], value)
    assert [(n.name, n.op_type, n.inputs, n.outputs) for n in fast.nodes] == \
        [(n.name, n.op_type, n.inputs, n.outputs) for n in reloaded.nodes]
    assert fast.model.SerializeToString() == with_initializers(graph.model, biases).SerializeToString()
    assert np.array_equal(graph.initializers["B1"], load_model(chain()).initializers["B1"])  # the source unchanged


def test_the_saved_tensors_stay_within_the_byte_limit(tmp_path):
    graph, table, inputs = _chain_case(tmp_path)
    prepared = prepare(graph, table)
    free = PrefixCache(count=100)
    run = free.runner(prepared)
    for k, x in enumerate(inputs):
        run.outputs(k, x)
    per_sample = run.record.nbytes // len(inputs)
    assert per_sample > 0
    limited = PrefixCache(count=100, limit=per_sample * 2 + per_sample // 2)  # room for 2.5 samples' tensors
    first = limited.runner(prepared)
    for k, x in enumerate(inputs):
        first.outputs(k, x)
    assert first.record.nbytes <= limited.limit
    full = [run.record.saved[k].keys() == first.record.saved[k].keys() for k in range(len(inputs))]
    assert full[:2] == [True, True] and not any(full[3:])  # then only what fits: fewer checkpoints
    other = prepare(graph, with_bits(table, ["out"], 16))
    again = limited.runner(other)
    for k, x in enumerate(inputs):  # samples without saved tensors run from the input, with the same outputs
        assert np.array_equal(again.outputs(k, x)[graph.outputs[0]], other.run(x).outputs[graph.outputs[0]])
    assert 0 < again.resumed_steps < again.prefix * len(inputs)


def test_on_the_bundled_model_a_resumed_pass_is_the_full_run(tmp_path, model_path, calib_dir):
    from ptq.data.image_source import ImageSet
    from ptq.data.images import Preprocess

    calibrate(model_path, calib_dir, tmp_path, num_images=3, write_qdq=False)
    table, graph = load_quant_table(tmp_path / "efficientnet_lite0.quant.json"), load_model(model_path)
    samples = [x for _, x, _ in ImageSet.from_folder(calib_dir, Preprocess(), limit=2).samples(graph)]
    base = prepare(graph, table)
    late = next(out for step in base.steps[40:] for out in step.node.outputs if out in table.tensors)
    other = prepare(graph, with_bits(table, [late], 16))  # a tensor two thirds down the graph in 16 bits
    cache = PrefixCache()
    first = cache.runner(base)
    for k, x in enumerate(samples):
        first.outputs(k, x)
    run = cache.runner(other)
    assert run.prefix >= 40
    for k, x in enumerate(samples):
        got, want = run.outputs(k, x), other.run(x, keep_all=False).outputs
        assert all(np.array_equal(got[n], want[n]) for n in want)
    assert run.resumed_steps >= 2 * 30  # resumed past most of the shared steps


def test_a_pass_in_threads_gives_the_cosines_of_one_thread(tmp_path, monkeypatch):
    """`Validation.threads`: the samples of a pass run several at a time, each resumed from the prefix cache as
    in one thread, with the same cosines in the same order and the same tensors saved for later passes."""
    import threading

    from ptq.tuning.prefix_cache import PrefixRun

    graph, table, _ = _chain_case(tmp_path)
    check, _ = _array_validation(graph, table, count=12)
    one, four = dataclass_copy(check), dataclasses.replace(dataclass_copy(check), threads=4)
    names = set()
    outputs = PrefixRun.outputs

    def recorded(self, sample, inputs):
        names.add(threading.current_thread().name)
        return outputs(self, sample, inputs)

    monkeypatch.setattr(PrefixRun, "outputs", recorded)
    for candidate in (table, with_bits(table, ["c3"], 16), with_bits(table, ["a2"], 16), table):
        names.clear()
        assert four.cosines(graph, candidate) == one.cosines(graph, candidate)
        assert len(names) >= 2 and all(n.startswith("ptq-tune") for n in names - {threading.main_thread().name})
        mine, theirs = four.prefix.current, one.prefix.current
        assert mine.resumed_steps == theirs.resumed_steps and mine.record.nbytes == theirs.record.nbytes
        assert {k: v.keys() for k, v in mine.record.saved.items()} == \
            {k: v.keys() for k, v in theirs.record.saved.items()}
