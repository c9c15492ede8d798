"""The report separates where error is made from where it is amplified, says when the loss is spread over many
layers, and points to `ptq tune` with the command when no single layer recovers (issue 27, item 3)."""
import json

import pytest

from reports.auto_debug import AutoResult, AutoRow, Suggestion, Trial
from reports.console import auto_table
from reports.diagnosis import loss_spread, suggested_target, tune_command
from reports.layers import OutputReport, Report, cosine_drops, rank_bottlenecks
from reports.output_metrics import OutputMetrics
from reports.writers import report_json, summary_text
from test_report import _layer, _sim


def _report(layers, output_cosine):
    drops = cosine_drops([l.name for l in layers], {l.name: l.inputs for l in layers},
                         {l.name: l.cumulative.cosine for l in layers})
    for layer in layers:
        layer.cosine_drop = drops[layer.name]
    return Report(model="m.onnx", quant="m.quant.json", images=4, layers=layers,
                  outputs=[OutputReport("logits", _sim(output_cosine))], classification=None,
                  bottlenecks=rank_bottlenecks(layers), inputs={"images": "photos"})


def amplified():
    """conv makes the error (alone 0.99); the final MatMul adds nothing alone (0.99999) but the cumulative cosine
    falls 0.19 across it (the Paddle classifier of the issue)."""
    return _report([_layer("input", [], 1.0, 1.0, op="Input"), _layer("conv", ["input"], 0.99, 0.99),
                    _layer("matmul", ["conv"], 0.80, 0.99999, op="MatMul")], 0.80)


def spread(n=30):
    """n layers in a chain, each adding a little error alone (its isolated loss: its input's quantization, 0.002,
    and its own, about 0.002), the cumulative cosine falling step by step."""
    layers = [_layer("input", [], 0.998, 0.998, op="Input")]
    for k in range(n):
        layers.append(_layer(f"l{k}", [layers[-1].name], 0.998 - 0.0025 * (k + 1), 0.996))
    return _report(layers, 1.0 - 0.0025 * n)


def test_each_suspect_prints_its_isolated_and_cumulative_cosine_and_whether_it_makes_or_amplifies_error():
    report = amplified()
    assert [b.name for b in report.bottlenecks] == ["matmul", "conv"]  # the drop of 0.19 still ranks first
    text = summary_text(report)
    assert "  1. matmul: amplifies its inputs' error (MatMul): isolated cosine 0.99999, adds 0.0000 alone; " \
           "cumulative cosine 0.80000, falls 0.1900" in text
    assert "  2. conv: makes error (Conv): isolated cosine 0.99000, adds 0.0100 alone; cumulative cosine " \
           "0.99000, falls 0.0100" in text
    assert "an amplifier adds almost nothing alone: it carries error made upstream further" in text
    assert [b["kind"] for b in json.loads(report_json(report))["bottlenecks"]] == ["amplifies", "makes"]


def test_a_loss_spread_over_many_layers_is_said_with_the_tune_command():
    report = spread()
    found = loss_spread(report)
    assert found.spread and found.layers == 31 and found.half == 16 and found.top_share < 0.05
    text = summary_text(report)
    assert "the loss is spread over many layers: 31 layers lose cosine alone, 16 of them make half of it" in text
    assert "ptq tune changes many tensors step by step until the output reaches a target: ptq tune m.onnx " \
           "--quant m.quant.json --images photos --target-cosine 0.99" in text
    assert json.loads(report_json(report))["loss_spread"]["spread"] is True
    concentrated = loss_spread(amplified())
    assert not concentrated.spread and concentrated.top_layer == "conv" and concentrated.top_share == 1.0
    assert "ptq tune" not in summary_text(amplified())


def test_tune_targets_and_commands():
    assert suggested_target(0.932) == 0.99 and suggested_target(0.995) == 0.999 and suggested_target(0.9995) is None
    report = spread()
    report.inputs = {"data": "my samples"}
    assert tune_command(report) == "ptq tune m.onnx --quant m.quant.json --data 'my samples' --target-cosine 0.99"
    report.inputs = {}
    assert tune_command(report) is None


def test_auto_that_recovers_nothing_points_to_tune_with_the_command():
    report = spread()
    baseline = OutputMetrics(0.925, 0.1, 10.0, None, None)
    rows = [AutoRow("l3", "Conv", "", Trial("float", baseline), Trial("int16", baseline))]
    text = auto_table(AutoResult(report, baseline, rows, Suggestion(), None))
    assert text.splitlines()[-1] == (
        "suggestion: none of these layers recovers the output alone (the error is made in many places); ptq tune "
        "changes many tensors step by step until the output reaches a target: ptq tune m.onnx --quant m.quant.json "
        "--images photos --target-cosine 0.99")
    assert "keep the table as it is" not in text


@pytest.mark.parametrize("make", [amplified, spread])
def test_the_page_says_it_too(make):
    from reports.html import render_html

    page = render_html(make())
    assert "amplifies error made upstream" in page
    assert ("the loss is spread over many layers" in page) == (make is spread)
