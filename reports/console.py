"""The debug tools' stdout tables: the fake-quant comparison and the ranked `--auto` table."""
from __future__ import annotations

from reports.auto_debug import AutoResult, Trial
from reports.diagnosis import tune_command
from reports.fake_quant import FakeQuantResult


def fake_quant_table(result: FakeQuantResult) -> str:
    """Notes, floated nodes, output metrics before and after, and each layer's cumulative cosine, for stdout."""
    lines = [f"note: {note}" for note in result.notes]
    lines.append(f"float nodes: {', '.join(result.float_nodes) or 'none'}")
    lines.append(f"before (integer):  output {result.before.line()}")
    lines.append(f"after (fake quant): output {result.after.line()}")
    width = max(len(r.name) for r in result.layers)
    lines.append(f"{'layer':<{width}} {'op':<10} {'cos before':>10} {'cos after':>10}")
    for row in result.layers:
        mark = "  (float)" if row.floated else ""
        lines.append(f"{row.name:<{width}} {row.op_type:<10} {row.cosine_before:10.6f} {row.cosine_after:10.6f}{mark}")
    return "\n".join(lines)


def auto_table(result: AutoResult) -> str:
    """The ranked --auto table for stdout."""
    def cell(t: Trial) -> str:
        if t.metrics is None:
            return f"{'n/a':>9} {'':>6}"
        top1 = "" if t.metrics.top1_agreement is None else f"{t.metrics.top1_agreement:.3f}"
        return f"{t.metrics.cosine:9.6f} {top1:>6}"

    b = result.baseline
    width = max([len(r.layer) for r in result.rows] + [5])
    top1 = "" if b.top1_agreement is None else f", top-1 agreement {b.top1_agreement:.3f}"
    lines = [f"integer baseline: output cosine {b.cosine:.6f}{top1}",
             f"{'rank':<4} {'layer':<{width}} {'op':<10} {'float cos':>9} {'top-1':>6} {'int16 cos':>9} {'top-1':>6}"]
    for k, row in enumerate(result.rows, 1):
        lines.append(f"{k:<4} {row.layer:<{width}} {row.op_type:<10} {cell(row.float_trial)} {cell(row.int16_trial)}")
    s = result.suggestion
    if not (s.int16_tensors or s.float_layers):
        command = tune_command(result.report)
        lines.append("suggestion: none of these layers recovers the output alone (the error is made in many places)"
                     + (f"; ptq tune changes many tensors step by step until the output reaches a target: {command}"
                        if command else ""))
    else:
        if s.int16_tensors:
            lines.append(f"suggestion: 16 bits for {', '.join(s.int16_tensors)}")
        if s.float_layers:
            lines.append(f"suggestion: float for {', '.join(s.float_layers)} "
                         f"(ptq run/report --float-nodes {' '.join(s.float_nodes)})")
        if s.metrics is not None:
            lines.append(f"with the suggestion: output {s.metrics.line()}")
    for name, fraction in s.saturating:
        lines.append(f"note: {name} saturates {100 * fraction:.1f}% of its float values; a floated or 16-bit layer "
                     "still writes that tensor on the same range, so recalibrate it (its range is too small)")
    return "\n".join(lines)
