"""`ptq table show TABLE [TENSOR...]` and `ptq table set TABLE TENSOR [--bits B] [--range=MIN,MAX] [--scale S]
[--zero-point Z] [--float | --no-float] [--out PATH]`: read and change a quant table without editing its JSON.

`show` prints every entry as one row (per-channel entries summarized), or the named tensors' entries in full
(per channel, with the real range their grid covers). `set` changes one tensor's entry the way a hand edit of
the JSON does (`ptq.table.edit`): a new range or bit width recomputes scale and zero point with the table's
options, a scale / zero point is taken as given, `--float` runs the layer computing the tensor in float; then
it writes the table atomically (to the same path, or `--out`) and prints what changed.

`ptq table export MODEL --quant TABLE [--out FILE] [--qdq-target T] [--images DIR | --data DIR]`: the QDQ
model of MODEL with any table (`ptq.api.export_table`), checked in onnxruntime when samples are given.
"""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

import argparse

from ptq.commands.data_options import add_data_arguments, data_kwargs
from ptq.commands.qdq_options import add_qdq_arguments, qdq_targets_epilog

HELP = "print a quant table's entries, change one tensor's bits, range, scale or float flag, or export its QDQ model"


def _range(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two numbers), got {text!r}") from None
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="table_action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print all entries as a table, or the named tensors' entries in full",
                              description="print all entries as a table, or the named tensors' entries in full")
    show.add_argument("table", help="the quantization table (.quant.json)")
    show.add_argument("tensors", nargs="*", metavar="TENSOR", help="tensors to print in full")
    show.set_defaults(table_run=run_show)
    change = actions.add_parser("set", help="change one tensor's entry and write the table",
                                description="change one tensor's entry (what follows from it is recomputed) and "
                                "write the table atomically")
    change.add_argument("table", help="the quantization table (.quant.json)")
    change.add_argument("tensor", help="the tensor whose entry changes")
    change.add_argument("--bits", type=int, help="bit width (2-16); scale and zero point follow from the range")
    change.add_argument("--range", type=_range, metavar="MIN,MAX", dest="value_range",
                        help="new range; scale and zero point follow (--range -1.5,6 and --range=-1.5,6 both work)")
    change.add_argument("--scale", type=float, help="new scale, taken as given (rounded to float32)")
    change.add_argument("--zero-point", type=int, help="new zero point, taken as given")
    flag = change.add_mutually_exclusive_group()
    flag.add_argument("--float", dest="run_in_float", action="store_const", const=True,
                      help="run the layer computing this activation in float")
    flag.add_argument("--no-float", dest="run_in_float", action="store_const", const=False,
                      help="run it in integers again")
    change.add_argument("--out", help="write the changed table here (default: overwrite TABLE)")
    change.set_defaults(table_run=run_set)
    export = actions.add_parser("export", help="write the QDQ model of MODEL with any quant table (tuned, edited)",
                                description="write the QDQ model of MODEL with the quant table (float layers kept "
                                "float, 16-bit tensors\nas int16/uint16), atomically; with --images or --data, check "
                                "it in onnxruntime\nagainst MODEL as `ptq calibrate` does",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=qdq_targets_epilog)
    export.add_argument("model", help="the float ONNX model (never modified; the adjusted weights the table "
                                      "records are used)")
    export.add_argument("--quant", required=True, help="the quantization table (.quant.json)")
    export.add_argument("--out", metavar="FILE", help="the QDQ model to write (default: beside the table, "
                                                      "<stem>.qdq.onnx; never MODEL or the table)")
    add_qdq_arguments(export)
    add_data_arguments(export, labels=False, required=False, parallel=False)
    export.set_defaults(table_run=run_export)


def run(args: argparse.Namespace) -> int:
    return args.table_run(args)


def _num(value) -> str:
    return f"{value:.6g}"


def _span(values) -> str:
    lo, hi = min(values), max(values)
    return _num(lo) if lo == hi else f"{_num(lo)}..{_num(hi)}"


def _grid_type(qp) -> str:
    return f"{'int' if qp.signed else 'uint'}{qp.bits}{' narrow' if qp.narrow else ''}"


def summary_rows(table) -> list[tuple[str, ...]]:
    """One row per tensor: name, kind, type, granularity, min, max, scale, zero_point, float."""
    rows = []
    for name, entry in table.tensors.items():
        qp = entry.qparams
        granularity = "tensor" if qp.axis is None else f"axis {qp.axis} ({qp.scale.size})"
        rows.append((name, entry.kind, _grid_type(qp), granularity, _num(entry.min.min()), _num(entry.max.max()),
                     _span(qp.scale), _span(qp.zero_point), "float" if entry.run_in_float else ""))
    return rows


def format_rows(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]

    def line(row) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()

    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def entry_text(name: str, entry) -> str:
    """One tensor's entry in full: range, grid, the real range the grid covers, per channel when per-channel."""
    qp = entry.qparams
    lo, hi = qp.real_range()
    where = "per-tensor" if qp.axis is None else f"per-channel along axis {qp.axis} ({qp.scale.size} channels)"
    lines = [f"tensor {name!r}: {entry.kind}, calibrator {entry.calibrator}, {where}",
             f"  grid   {_grid_type(qp)}: codes [{qp.qmin}, {qp.qmax}]",
             f"  float  {'yes: the layer computing it runs in float' if entry.run_in_float else 'no'}"]
    header = ("channel", "min", "max", "scale", "zero_point", "covers")
    rows = [(str(c), _num(entry.min[c]), _num(entry.max[c]), f"{qp.scale[c]:.9g}", str(qp.zero_point[c]),
             f"[{_num(lo[c])}, {_num(hi[c])}]") for c in range(qp.scale.size)]
    if qp.axis is None:
        header, rows = header[1:], [r[1:] for r in rows]
    table = format_rows(header, rows)
    return "\n".join(lines + ["  " + line for line in table.splitlines()])


def run_show(args: argparse.Namespace) -> int:
    from ptq.table.quant_table import load_quant_table
    from ptq.table.edit import table_entry

    table = load_quant_table(args.table)
    if args.tensors:
        print("\n\n".join(entry_text(name, table_entry(table, name)) for name in args.tensors))
        return 0
    o = table.options
    kinds = [e.kind for e in table.tensors.values()]
    print(f"{args.table}: {len(kinds)} tensors ({kinds.count('activation')} activations, {kinds.count('weight')} "
          f"weights); calibrator {o.calibrator}, bits {o.bits} (weights {o.weight_bits}), symmetric "
          f"{str(o.symmetric).lower()} (weights {str(o.weight_symmetric).lower()}), per_channel "
          f"{str(o.per_channel).lower()}, pow2 {str(o.pow2).lower()}")
    print(format_rows(("tensor", "kind", "type", "granularity", "min", "max", "scale", "zero_point", "float"),
                      summary_rows(table)))
    floats = table.float_tensors()
    if floats:
        print(f"{len(floats)} tensor(s) marked float: {', '.join(floats)}")
    return 0


def run_set(args: argparse.Namespace) -> int:
    from ptq.output_paths import check_file, note_replaced
    from ptq.table.quant_table import load_quant_table, save_quant_table
    from ptq.table.edit import edit_entry, entry_changes

    target = args.out or args.table
    replaced = check_file(target, "--out" if args.out else "TABLE")
    table = load_quant_table(args.table)
    if replaced and args.out:
        note_replaced([target])
    edited = edit_entry(table, args.tensor, bits=args.bits, value_range=args.value_range, scale=args.scale,
                        zero_point=args.zero_point, run_in_float=args.run_in_float, source=args.table)
    changes = entry_changes(table.tensors[args.tensor], edited.tensors[args.tensor])
    path = save_quant_table(edited, args.out or args.table)
    changes = changes or ["no change (the entry already had these values)"]
    if args.scale is not None and edited.tensors[args.tensor].qparams.scale[0] != args.scale:
        changes.append(f"(scale {args.scale!r} is not a float32 value: the nearest one is used)")
    print(f"{args.tensor}: " + "; ".join(changes))
    print(f"wrote {path}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from ptq.api import export_table

    samples = args.images is not None or args.data is not None
    result = export_table(args.model, quant=args.quant, out=args.out, qdq_target=args.target, no_check=args.no_check,
                          **{k: v for k, v in data_kwargs(args).items() if samples or k == "quiet"})
    if not args.quiet:
        print(result.summary())
        if not samples and not args.no_check:
            print("not checked in onnxruntime: give --images or --data to run it against MODEL on a few samples")
    return 0
