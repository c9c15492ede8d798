"""`ptq ops`: the operator registry as a table (op, domain, integer types, granularity, whitepaper section), then
how many of the whitepaper's 79 chapter-4 operators the registry implements (`ptq.opdocs.whitepaper`)."""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

import argparse

HELP = "list the operators ptq runs in integers, with their quantization rule's whitepaper section"

COLUMNS = ("op", "domain", "integer in/out types", "granularity", "whitepaper")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domain", help="only the ops of this domain ('ai.onnx' for the default domain)")


def registry_rows(domain: str | None = None) -> list[tuple[str, str, str, str, str]]:
    """One row per registered op, sorted by domain then op type."""
    from ops.registry import REGISTRY  # iterating it imports every op module

    rows = []
    for (op_domain, op_type), op in REGISTRY.items():
        shown = op_domain or "ai.onnx"
        if domain is not None and shown != domain:
            continue
        rows.append((op_type, shown, op.int_types, op.granularity, op.section or "-"))
    return sorted(rows, key=lambda r: (r[1] != "ai.onnx", r[1], r[0]))


def format_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[k])) for r in [COLUMNS, *rows]) for k in range(len(COLUMNS))]

    def line(row) -> str:
        return "  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip()

    return "\n".join([line(COLUMNS), line(["-" * w for w in widths]), *map(line, rows)])


def run(args: argparse.Namespace) -> int:
    rows = registry_rows(args.domain)
    if not rows:
        raise ValueError("no op is registered" if args.domain is None else f"no registered op in domain {args.domain!r}")
    print(format_table(rows))
    print(f"\n{len(rows)} op(s)")
    from ptq.opdocs.whitepaper import implemented_summary

    print(implemented_summary())
    return 0
