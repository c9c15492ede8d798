"""`ptq debug MODEL --quant Q --images DIR (--fake-quant L1,L2 | --fake-quant-ops Sigmoid,Softmax | --auto K)`

- `--fake-quant` / `--fake-quant-ops`: the chosen layers (tensor or node names) or op types run in float inside
  the integer graph; prints the output metrics before and after and the per-layer cumulative cosine.
- `--auto K`: the report's top K suspects, each tried alone in float and in 16 bits; prints the ranked table
  and a mixed-precision suggestion, written as a quant table with `--write-quant`.
- `--dump DIR`: the float and integer tensors of the chosen (or all) layers as .npy, with `index.json`.
`debug.json` in `--out` holds everything printed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ptq.commands.report import (
    DEFAULT_ISOLATED_IMAGES, add_common_arguments, isolated_images, load_inputs, require_integer_graph, write_report,
)
from ptq.parallel import add_parallel_arguments

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
    add_parallel_arguments(parser)


def _fake_quant(args, graph, table, images, evaluator) -> dict:
    from reports.console import fake_quant_table
    from reports.fake_quant import fake_quant

    result = fake_quant(graph, table, images, layers=args.fake_quant or (), op_types=args.fake_quant_ops or (),
                        progress=True, backend=args.backend, evaluator=evaluator)
    print(fake_quant_table(result))
    return {"mode": "fake_quant", **result.to_dict()}


def _auto(args, graph, table, images, out_dir: Path, evaluator) -> dict:
    from ptq.quant_table import save_quant_table
    from reports.auto_debug import auto_debug
    from reports.console import auto_table
    from reports.writers import summary_text

    result = auto_debug(graph, table, images, args.auto, model=str(args.model), quant=str(args.quant),
                        isolated_images=args.isolated_images, progress=True, backend=args.backend,
                        evaluator=evaluator)
    write_report(result.report, out_dir)
    print(summary_text(result.report, top=args.auto))
    print()
    print(auto_table(result))
    data = {"mode": "auto", **result.to_dict()}
    if args.write_quant:
        if result.mixed_table is None:
            print("no 16-bit tensor suggested: --write-quant writes the table unchanged")
        path = save_quant_table(result.mixed_table or table, args.write_quant)
        print(f"wrote {path}")
        data["written_quant"] = str(path)
    return data


def run(args: argparse.Namespace) -> int:
    from reports.dump import dump_tensors
    from reports.writers import finite_or_none

    if args.auto is None and not (args.fake_quant or args.fake_quant_ops or args.dump):
        raise ValueError("choose --fake-quant LAYERS, --fake-quant-ops OPS, --auto K or --dump DIR")
    if args.write_quant and args.auto is None:
        raise ValueError("--write-quant needs --auto")
    graph, table, images = load_inputs(args)
    require_integer_graph(args, graph, table)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    data: dict = {"model": str(args.model), "quant": str(args.quant)}
    if args.auto is not None or args.fake_quant or args.fake_quant_ops:
        from reports.evaluate_shards import choose_evaluator

        with choose_evaluator(graph, table, images, workers=args.workers, ray=args.ray) as evaluator:
            if args.auto is not None:
                data.update(_auto(args, graph, table, images, out_dir, evaluator))
            else:
                data.update(_fake_quant(args, graph, table, images, evaluator))
    if args.dump:
        from ptq.executor import prepare
        from reports.layer_nodes import float_node_names

        chosen = args.fake_quant or []
        float_nodes = float_node_names(prepare(graph, table), chosen) + list(args.fake_quant_ops or [])
        index = dump_tensors(graph, table, images, args.dump, layers=chosen, float_nodes=float_nodes,
                             max_images=args.dump_images, backend=args.backend)
        print(f"dumped tensors: {index}")
        data["dump_index"] = str(index)
    path = out_dir / "debug.json"
    path.write_text(json.dumps(finite_or_none(data), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0
