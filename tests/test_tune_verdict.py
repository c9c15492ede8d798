"""`ptq tune`'s verdict (`ptq.tuning.verdict`): "reached" only when the integer graph and the QDQ model written, in
onnxruntime with optimizations off and on, reach the goal on the validation samples; otherwise which fell short
by how much; and a warning that says why when the QDQ model departs from the integer run by more than 0.002."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ptq.calibration.pipeline import calibrate
from ptq.core.graph import load_model
from ptq.data.image_source import ArraySamples
from ptq.qdq.export import export_qdq
from ptq.tuning.data import Score, Validation
from ptq.tuning.goal import Goal
from ptq.tuning.verdict import INTEGER, OPTIMIZED, UNOPTIMIZED, Verdict, judge
from tests.test_equalize import chain

GOAL = Goal(0.998, 0.0, 2.0)


def verdict(integer, off, on, **kw):
    return Verdict(GOAL, Score(integer, 0.0002), Score(off, 0.0002), Score(on, 0.0002), 35, 5, "ort-cpu", **kw)


def test_reached_only_when_all_three_runs_reach_and_otherwise_which_fell_short_by_how_much():
    assert verdict(0.9990, 0.9989, 0.9988).reached
    short = verdict(0.9990, 0.9989, 0.9887)  # issue 26: the integer graph reached, the optimized QDQ model did not
    assert not short.reached
    assert short.shortfalls() == [f"{OPTIMIZED}: logits cosine mean - 2 sem 0.98830 < 0.99800 (0.00970 short)"]
    assert f"target NOT reached: {short.shortfalls()[0]}" in short.lines()
    record = short.to_dict()
    assert record["reached"] is False and record["qdq_optimized"]["cosine"] == 0.9887
    both = verdict(0.9979, 0.9978, 0.9979)
    assert [m.split(":")[0] for m in both.shortfalls()] == [INTEGER, UNOPTIMIZED, OPTIMIZED]


def test_a_qdq_model_onnxruntime_cannot_run_is_not_reached():
    failed = Verdict(GOAL, Score(0.9990, 0.0001), None, None, 35, 5, "ort-cpu", failure="no CPUExecutionProvider")
    assert not failed.reached and failed.check is None
    assert failed.shortfalls() == [f"{UNOPTIMIZED}: onnxruntime could not run it (no CPUExecutionProvider)",
                                   f"{OPTIMIZED}: onnxruntime could not run it (no CPUExecutionProvider)"]


def test_a_disagreement_with_the_integer_run_above_0_002_warns_and_says_why():
    assert verdict(0.9990, 0.9975, 0.9974).warnings() == []  # within 0.002 of the integer graph's 0.9990
    graph_itself = verdict(0.9990, 0.9950, 0.9950, departure="it first departs at 'x'")
    (warning,) = graph_itself.warnings()
    assert "optimizations off against 0.9990 for the integer graph (gap 0.0040 > 0.002); it first departs at 'x'" \
        in warning
    fused = verdict(0.9990, 0.9989, 0.9930)
    (warning,) = fused.warnings()
    assert "with onnxruntime's default optimizations" in warning and "(gap 0.0060 > 0.002)" in warning
    assert "ORT_ENABLE_BASIC" in warning  # the advice for target ort-cpu (`ptq.qdq.check`)
    assert f"warning: {warning}" in fused.lines()


def _chain_case():
    model = chain()
    graph = load_model(model)
    arrays = np.random.default_rng(4).normal(0, 1, (12, 3, 10, 10)).astype(np.float32)
    table = calibrate(model, arrays[:8], write_qdq=False, calibrator="extrema").table
    validation = Validation.create(graph, ArraySamples(arrays[8:]))
    return graph, table, validation


def test_judge_runs_the_qdq_model_over_the_validation_samples_and_names_where_it_departs():
    """The chain graph, 8 bits: its own QDQ export agrees with the integer run; with the Q/DQ scale of the
    depthwise Conv's output ('a2') made 40 times coarser in the QDQ model, the verdict's figures are onnxruntime's,
    it warns, and it names 'a2' and the node writing it as the first tensor where the two runs part."""
    graph, table, validation = _chain_case()
    integer = validation.cosine(graph, table)
    qdq = export_qdq(graph, table, "ort-cpu")
    fine = judge(graph, table, qdq, validation, Goal(0.9, 0.0, 2.0), integer, "ort-cpu")
    assert fine.reached and fine.warnings() == [] and fine.departure is None
    assert abs(fine.qdq_unoptimized.mean - integer.mean) <= 0.002

    broken = onnx.ModelProto()
    broken.CopyFrom(qdq)
    (scale,) = [t for t in broken.graph.initializer if t.name == "a2_scale"]
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 40, "a2_scale"))
    bad = judge(graph, table, broken, validation, Goal(0.9, 0.0, 2.0), integer, "ort-cpu")
    assert bad.qdq_unoptimized.mean < integer.mean - 0.002
    assert bad.departure is not None and bad.departure.startswith(
        "the QDQ model first departs from the integer run at tensor 'a2' (written by Conv")
    (warning,) = bad.warnings()
    assert warning.startswith("the QDQ model written does not compute what the integer run computes") and \
        bad.departure in warning


def test_an_entry_the_integer_run_fuses_away_is_widened_with_the_tensor_it_is_fused_into():
    """Gemm -> Relu at 4 bits, the Relu's output 'a' moved to 16 bits as the tuner does: the integer Gemm+Relu
    writes 'a' at 16 bits from its accumulator, the QDQ model first rounds the Gemm's output 'h' at 4 bits. The
    verdict warns and names both; with 'h' widened (`widen_fused_away`) the integer run is bit for bit the same and
    the QDQ model agrees with it."""
    from reports.tables import with_bits
    from ptq.engine.executor import prepare
    from ptq.tuning.export_alignment import fused_into, widen_fused_away
    from tests.test_tune_metric import classifier

    model = classifier()
    graph = load_model(model)
    x = np.random.default_rng(3).normal(0, 1, (40, 3, 4, 4)).astype(np.float32)
    table = calibrate(model, x[:20], write_qdq=False, bits=4, weight_bits=4, per_channel=False,
                      calibrator="extrema").table
    table = with_bits(table, ["a", "logits"], 16)
    assert fused_into(graph, table) == {"h": "a"}
    validation = Validation.create(graph, ArraySamples(x[20:]))
    integer = validation.cosine(graph, table)
    split = judge(graph, table, export_qdq(graph, table, "ort-cpu"), validation, GOAL, integer, "ort-cpu")
    (warning,) = split.warnings()
    assert "at tensor 'a' (written by Gemm 'fc1')" in warning and "rounds 'h' (4 bits), which the integer run fuses " \
        "away (its entry is not used there), against 16 bits for 'a'" in warning

    widened, names = widen_fused_away(graph, table)
    assert names == ["h"] and widened.tensors["h"].qparams.bits == 16
    ours, again = (prepare(graph, t).run({"input": x[20:]}).outputs["logits"] for t in (table, widened))
    np.testing.assert_array_equal(ours, again)
    agreed = judge(graph, widened, export_qdq(graph, widened, "ort-cpu"), validation, GOAL, integer, "ort-cpu")
    assert agreed.warnings() == [] and abs(agreed.qdq_unoptimized.mean - integer.mean) < 1e-4


def test_alignment_writes_what_the_integer_run_reads_and_changes_nothing_it_computes():
    """The classifier's input moved to 16 bits as the tuner does: the integer Flatten passes the 16-bit codes on,
    so its output 'flat' takes the input's qparams (the rule calibration's alignment writes), and 'h' (fused away)
    the width of 'a'; the integer outputs are bit for bit the same, and the QDQ model agrees with them."""
    from reports.tables import with_bits
    from ptq.engine.executor import prepare
    from ptq.tuning.export_alignment import aligned_for_export
    from tests.test_tune_metric import classifier

    model = classifier()
    graph = load_model(model)
    x = np.random.default_rng(3).normal(0, 1, (40, 3, 4, 4)).astype(np.float32)
    table = calibrate(model, x[:20], write_qdq=False, bits=4, weight_bits=4, per_channel=False,
                      calibrator="extrema").table
    table = with_bits(table, ["input", "a", "logits"], 16)
    aligned, names = aligned_for_export(graph, table)
    assert names == ["flat", "h"] and aligned.tensors["flat"].qparams == table.tensors["input"].qparams
    ours, again = (prepare(graph, t).run({"input": x[20:]}).outputs["logits"] for t in (table, aligned))
    np.testing.assert_array_equal(ours, again)
    validation = Validation.create(graph, ArraySamples(x[20:]))
    integer = validation.cosine(graph, table)
    before = judge(graph, table, export_qdq(graph, table, "ort-cpu"), validation, GOAL, integer, "ort-cpu")
    after = judge(graph, aligned, export_qdq(graph, aligned, "ort-cpu"), validation, GOAL, integer, "ort-cpu")
    assert integer.mean - before.qdq_unoptimized.mean > 0.002 and before.warnings()
    assert abs(after.qdq_unoptimized.mean - integer.mean) < 1e-4 and after.warnings() == []
