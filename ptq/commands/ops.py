"""`ptq ops [MODEL] [--quant TABLE]`: with a model, will it run? Its nodes by op type, how many run in integers,
in float or as shape computations, and why each float node is float (`ptq.opdocs.model_ops`), before calibrating
(a provisional table) or with the user's table. Without a model, the operator registry (op, whitepaper section,
integer types, granularity), then how many of the whitepaper's 79 chapter-4 operators it implements
(`ptq.opdocs.whitepaper`). Both in 80 columns."""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

import argparse
import textwrap

HELP = "list how a model's nodes run (integer or float, and why), or the operators ptq runs in integers"

WIDTH = 80
COLUMNS = ("op", "domain", "integer in/out types", "granularity", "whitepaper")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="a float ONNX model: how each of its nodes runs")
    parser.add_argument("--quant", help="with MODEL: the quantization table to prepare it with (default: a "
                        "provisional one from one random sample per input)")
    parser.add_argument("--input-shape", action="append", metavar="NAME:D0,D1,...",
                        help="with MODEL: fix dynamic input dimensions, e.g. input:1,3,224,224 (repeatable)")
    parser.add_argument("--domain", help="without MODEL: only the ops of this domain ('ai.onnx' for the default "
                        "domain)")


def registry_rows(domain: str | None = None) -> list[tuple[str, str, str, str, str]]:
    """One row per registered op (op, domain, integer types, granularity, section), by domain then op type."""
    from ops.registry import REGISTRY  # iterating it imports every op module

    rows = []
    for (op_domain, op_type), op in REGISTRY.items():
        shown = op_domain or "ai.onnx"
        if domain is not None and shown != domain:
            continue
        rows.append((op_type, shown, op.int_types, op.granularity, op.section or "-"))
    return sorted(rows, key=lambda r: (r[1] != "ai.onnx", r[1], r[0]))


def wrapped_row(cells: tuple[str, ...], widths: tuple[int, ...], details: list[str] = ()) -> list[str]:
    """The cells in their columns, the last one wrapped to WIDTH, then `details` wrapped under it."""
    indent = sum(w + 2 for w in widths)
    head = "  ".join(c.ljust(w) for c, w in zip(cells, widths))
    lines = textwrap.wrap(cells[-1], WIDTH - indent, break_on_hyphens=False) or [""]
    out = [(head + "  " + lines[0]).rstrip()]
    out += [" " * indent + line for line in lines[1:]]
    for detail in details:
        out += [" " * indent + line for line in textwrap.wrap(detail, WIDTH - indent, break_on_hyphens=False)]
    return out


def format_registry(rows: list[tuple[str, ...]]) -> str:
    """The registry in 80 columns: op (and a domain other than ai.onnx), section, integer types; a granularity
    other than per-tensor and the section's remarks on the lines below."""
    lines = []
    widths = (24, 9)
    lines += wrapped_row(("op", "section", "integer in/out types"), widths)
    lines.append("  ".join("-" * w for w in (*widths, WIDTH - sum(widths) - 4)))
    for op, domain, types, granularity, section in rows:
        name = op if domain == "ai.onnx" else f"{op} [{domain}]"
        number, _, remark = section.partition(" ")
        remark = remark and f"({remark.strip('()')})"
        if len(number) > widths[1]:  # several sections: on their own line
            number, remark = "", f"sections {section}"
        details = [d for d in (remark, "" if granularity == "per-tensor" else granularity) if d]
        lines += wrapped_row((name, number, types), widths, details)
    return "\n".join(lines)


def format_model_ops(model: str, result, provisional: bool) -> str:
    """How the model's nodes run, in 80 columns."""
    lines = textwrap.wrap(
        f"{model}: {result.model_nodes} nodes; after the rewrites {result.nodes} run ({result.folded} folded into "
        f"constants, {result.fused} BatchNormalization folds and activation fusions): "
        f"{sum(op.integer for op in result.ops)} in integers, {len(result.float_nodes)} in float, "
        f"{sum(op.shape for op in result.ops)} shape computations", WIDTH)
    if provisional:
        lines += textwrap.wrap("(prepared with ranges from one random sample: whether a node quantizes does not "
                               "depend on them; --quant TABLE prepares it with a calibrated table)", WIDTH)
    lines += ["", f"{'op type':<28}{'nodes':>8}{'integer':>10}{'float':>8}{'shape':>8}", "-" * 62]
    for op in result.ops:
        lines.append(f"{op.op_type[:28]:<28}{op.nodes:>8}{op.integer:>10}{op.float or '-':>8}{op.shape or '-':>8}")
    lines.append("")
    if not result.float_nodes:
        lines.append("every node that computes values runs in integers")
    else:
        lines.append(f"{len(result.float_nodes)} node(s) run in float (dequantize, float op, quantize):")
        for node in result.float_nodes:
            lines += textwrap.wrap(f"{node.name} ({node.op_type}): {node.reason}", WIDTH, initial_indent="  ",
                                   subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)


def run_model(args: argparse.Namespace) -> int:
    from ptq.adjust.adjusted_model import load_model_for_table
    from ptq.core.graph import load_model, parse_input_shapes
    from ptq.opdocs.model_ops import model_ops
    from ptq.table.quant_table import load_quant_table

    if args.domain is not None:
        raise ValueError("--domain lists the registry's ops: not with MODEL")
    if args.quant is not None:
        if args.input_shape:
            raise ValueError("--input-shape: the quant table records the input shapes; give one or the other")
        table = load_quant_table(args.quant)
        graph = load_model_for_table(args.model, table, args.quant)
    else:
        table, graph = None, load_model(args.model, parse_input_shapes(args.input_shape))
    print(format_model_ops(args.model, model_ops(graph, table), provisional=table is None))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        return run_model(args)
    if args.quant is not None or args.input_shape:
        raise ValueError("--quant and --input-shape go with MODEL: ptq ops MODEL --quant TABLE")
    rows = registry_rows(args.domain)
    if not rows:
        raise ValueError("no op is registered" if args.domain is None else f"no registered op in domain {args.domain!r}")
    print(format_registry(rows))
    print(f"\n{len(rows)} op(s); `ptq ops MODEL` tells how each node of a model runs")
    from ptq.opdocs.whitepaper import implemented_summary

    print(implemented_summary())
    return 0
