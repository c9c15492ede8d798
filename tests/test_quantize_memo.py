"""`prepare(..., memo=...)` (`ptq.engine.quantize_memo`): a node whose quantize context is unchanged gets the quantized
node of an earlier prepare, one whose entry, input qparams or constants changed is quantized again, and the codes
are a fresh prepare's bit for bit."""
from __future__ import annotations

import gc

import numpy as np
import onnx

from ptq.core.graph import load_model
from ptq.engine.executor import prepare
from ptq.engine.quantize_memo import ObjectDigests, QuantizeMemo
from ptq.tuning.prefix_cache import step_key
from reports.tables import with_bits
from tests.test_tune_speed import _chain_case


def _same_run(a, b, inputs) -> None:
    """Every tensor of the two integer graphs' runs equal, dtype and codes."""
    for x in inputs:
        got, want = a.run(x).tensors, b.run(x).tensors
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def _touching(prepared, tensor: str) -> list[str]:
    return [s.node.name for s in prepared.steps if tensor in s.node.inputs or tensor in s.node.outputs]


def test_the_same_graph_and_table_reuse_every_quantized_node(tmp_path):
    graph, table, inputs = _chain_case(tmp_path)
    memo = QuantizeMemo()
    first = prepare(graph, table, memo=memo)
    again = prepare(graph, table, memo=memo)
    assert memo.hits == len(first.steps) >= 4
    assert all(a.quantized is b.quantized for a, b in zip(first.steps, again.steps))
    _same_run(again, prepare(graph, table), inputs)


def test_a_changed_entry_requantizes_the_nodes_writing_and_reading_it(tmp_path):
    graph, table, inputs = _chain_case(tmp_path)
    memo = QuantizeMemo()
    base = prepare(graph, table, memo=memo)
    changed = with_bits(table, ["a2"], 16)
    other = prepare(graph, changed, memo=memo)
    rebuilt = [s.node.name for s, b in zip(other.steps, base.steps) if s.quantized is not b.quantized]
    assert rebuilt == _touching(other, "a2") and len(rebuilt) == 2  # the fused depthwise Conv and the projection
    assert other.qparams["a2"].bits == 16
    _same_run(other, prepare(graph, changed), inputs)
    back = prepare(graph, table, memo=memo)  # the first table again: every node as first quantized
    assert all(a.quantized is b.quantized for a, b in zip(back.steps, base.steps))


def test_a_changed_constant_requantizes_the_node_reading_it(tmp_path):
    graph, table, inputs = _chain_case(tmp_path)
    memo = QuantizeMemo()
    base = prepare(graph, table, memo=memo)
    model = onnx.load_from_string(graph.model.SerializeToString())
    for init in model.graph.initializer:
        if init.name == "B4":  # the last layer's bias moved, as a bias re-correction moves it
            init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) + np.float32(0.25), "B4"))
    moved = load_model(model)
    other = prepare(moved, table, memo=memo)
    rebuilt = [s.node.name for s, b in zip(other.steps, base.steps) if s.quantized is not b.quantized]
    assert rebuilt == _touching(other, "B4") and len(rebuilt) == 1
    _same_run(other, prepare(moved, table), inputs)
    assert not np.array_equal(other.run(inputs[0]).outputs["out"], base.run(inputs[0]).outputs["out"])


def test_nodes_no_recent_prepare_used_are_dropped(tmp_path):
    graph, table, _ = _chain_case(tmp_path)
    changed = with_bits(table, ["a2"], 16)
    for kept, reused in ((1, 2), (2, 4)):  # kept 1: the nodes of `changed` only; 2: those of `table` too
        memo = QuantizeMemo(kept=kept)
        prepare(graph, table, memo=memo)
        prepare(graph, changed, memo=memo)
        hits = memo.hits
        prepare(graph, table, memo=memo)
        assert memo.hits - hits == reused


def test_step_keys_of_a_memoized_prepare_are_a_fresh_ones(tmp_path):
    """The prefix cache (`ptq.tuning.prefix_cache`) matches the steps of memoized and fresh prepares alike."""
    graph, table, _ = _chain_case(tmp_path)
    memo, digests = QuantizeMemo(), ObjectDigests()
    prepare(graph, with_bits(table, ["a2"], 16), memo=memo)
    memoized, fresh = prepare(graph, table, memo=memo), prepare(graph, table)
    assert memo.hits == 2  # conv1 and expand from the first prepare, not the same objects as fresh ones
    keys = [step_key(memoized, i, quantized_digest=digests) for i in range(len(memoized.steps))]
    assert keys == [step_key(fresh, i, quantized_digest=digests) for i in range(len(fresh.steps))]
    assert None not in keys and len(set(keys)) == len(keys)


def test_an_object_digest_is_dropped_with_its_object():
    digests = ObjectDigests()
    a = np.arange(6.0)
    first = digests(a)
    assert first == digests(np.arange(6.0)) and first != digests(np.arange(7.0))
    assert id(a) in digests.by_id
    key = id(a)
    del a
    gc.collect()
    assert key not in digests.by_id and len(digests.by_id) == 0
