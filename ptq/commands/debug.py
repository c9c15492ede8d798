"""`ptq debug MODEL --quant Q --images DIR (--fake-quant L1,L2 | --fake-quant-ops Sigmoid,Softmax | --auto K)`

- `--fake-quant` / `--fake-quant-ops`: the chosen layers (tensor or node names) or op types run in float inside
  the integer graph; prints the output metrics before and after and the per-layer cumulative cosine.
- `--auto K`: the report's top K suspects, each tried alone in float and in 16 bits; prints the ranked table
  and a mixed-precision suggestion, written as a quant table with `--write-quant`.
- `--dump DIR`: the float and integer tensors of the chosen (or all) layers as .npy, with `index.json`.
`debug.json` in `--out` holds everything printed.
"""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

import argparse

from ptq.commands.data_options import data_kwargs
from ptq.commands.report import DEFAULT_ISOLATED_IMAGES, add_common_arguments, isolated_images

HELP = "fake-quant debugging: run suspect layers in float or 16 bits and measure the recovery"


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more comma-separated names")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--fake-quant", type=_names, metavar="LAYER[,LAYER...]",
                      help="layers (tensor or node names, as in the report) to run in float; a name a rewrite "
                      "fused away (a Conv's raw output before its Relu/Clip) floats the node that absorbed it")
    mode.add_argument("--fake-quant-ops", type=_names, metavar="OP[,OP...]", help="op types to run in float")
    mode.add_argument("--auto", type=int, metavar="K", help="try the top K suspects of the report in float and int16")
    parser.add_argument("--out", required=True, help="output folder for debug.json (and the report with --auto)")
    parser.add_argument("--write-quant", help="with --auto: write the suggested mixed-precision quant table here")
    parser.add_argument("--isolated-images", type=isolated_images, default=DEFAULT_ISOLATED_IMAGES, metavar="N|all",
                        help=f"with --auto: isolated metrics over the first N images (default {DEFAULT_ISOLATED_IMAGES})")
    parser.add_argument("--dump", help="save float and integer tensors of the chosen (default: all) layers here")
    parser.add_argument("--dump-images", type=int, default=1, help="images to dump (default 1)")


DEBUG_FLAGS = ("quant", "out", "fake_quant", "fake_quant_ops", "auto", "write_quant", "isolated_images", "dump",
               "dump_images", "strict", "backend")


def run(args: argparse.Namespace) -> int:
    from ptq.api import debug
    from reports.console import auto_table, fake_quant_table
    from reports.writers import summary_text

    result = debug(args.model, **{name: getattr(args, name) for name in DEBUG_FLAGS}, **data_kwargs(args))
    if result.auto is not None:
        print(summary_text(result.auto.report, top=args.auto))
        print()
        print(auto_table(result.auto))
        if result.written_quant is not None:
            if result.auto.mixed_table is None:
                print("no 16-bit tensor suggested: --write-quant writes the table unchanged")
            print(f"wrote {result.written_quant}")
    elif result.fake_quant is not None:
        print(fake_quant_table(result.fake_quant))
    if result.dump_index is not None:
        print(f"dumped tensors: {result.dump_index}")
    print(f"wrote {result.json_path}")
    return 0
