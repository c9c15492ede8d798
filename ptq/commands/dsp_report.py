"""`ptq dsp-report MODEL --quant Q.json`: what the model costs on packed DSP48E2 slices, int8 beside int4.

Per layer (every Conv, ConvTranspose, Gemm, MatMul, depthwise included): MACs, packed DSP operations, cycles
on an array of `--dsps` slices at `--clock-mhz`, lanes lost to odd channel counts and to chaining; model totals
and MACs per DSP per cycle; the layers ranked by cycles. With `--accuracy report.json` (from `ptq report`) each
layer also shows its accuracy-bottleneck rank and isolated cosine: where the model loses time beside where
it loses accuracy. `--out DIR` writes `dsp_report.json`.
"""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

import argparse
import json
from pathlib import Path

from ptq.core.option_defaults import DEFAULT_CLOCK_MHZ, DEFAULT_DSPS

HELP = "per-layer packed-DSP48E2 cost (int8 and int4 side by side), layers ranked by cycles"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the float ONNX model")
    parser.add_argument("--quant", required=True, help="the quantization table (.quant.json) from `ptq calibrate`")
    parser.add_argument("--dsps", type=int, default=DEFAULT_DSPS,
                        help=f"DSP48E2 slices in the array (default {DEFAULT_DSPS}: a ZCU102's XCZU9EG)")
    parser.add_argument("--clock-mhz", type=float, default=DEFAULT_CLOCK_MHZ,
                        help=f"DSP clock (default {DEFAULT_CLOCK_MHZ:g} MHz, WP521's 4-bit XDPU)")
    parser.add_argument("--top", type=int, default=10, help="layers printed, most cycles first (default 10)")
    parser.add_argument("--accuracy", help="a report.json of `ptq report` on the same model and table: show each "
                        "layer's accuracy-bottleneck rank and isolated cosine next to its cycles")
    parser.add_argument("--tune", help="the <stem>.tune.json of `ptq tune --scheme int4-dsp`: list each layer's "
                        "lanes, MACs and sensitivity and the lane assignments tried; with --out also draw their "
                        "cosine against MACs per DSP per cycle (the Pareto front) as lanes_pareto.svg")
    parser.add_argument("--out", help="write dsp_report.json (and lanes_pareto.svg with --tune) here")


def run(args: argparse.Namespace) -> int:
    from ptq.adjust.adjusted_model import load_model_for_table
    from ptq.output_paths import check_outputs
    from ptq.table.quant_table import load_quant_table
    from ptq.core.atomic import atomic_write_text
    from reports.dsp_resources import DspArray, accuracy_ranks, dsp_report, report_text
    from reports.lane_pareto import lanes_record, lanes_text, pareto_svg

    if args.top <= 0:
        raise ValueError(f"--top must be positive, got {args.top}")
    if args.out:
        check_outputs(args.out, ("dsp_report.json",))
    table = load_quant_table(args.quant)
    graph = load_model_for_table(args.model, table, args.quant)
    report = dsp_report(graph, table, DspArray(args.dsps, args.clock_mhz))
    accuracy = accuracy_ranks(json.loads(Path(args.accuracy).read_text(encoding="utf-8"))) if args.accuracy else None
    record = lanes_record(args.tune) if args.tune else None
    print(report_text(report, args.top, accuracy))
    if record is not None:
        print("\n" + lanes_text(record))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "dsp_report.json"
        atomic_write_text(path, json.dumps(report.to_dict(), indent=1) + "\n")
        print(f"wrote {path}")
        if record is not None:
            lanes = record["lanes"]
            svg = pareto_svg(lanes["points"], lanes["chosen"], record["target_cosine"],
                             f"{Path(args.model).name}: validation cosine against DSP throughput")
            print(f"wrote {atomic_write_text(out / 'lanes_pareto.svg', svg + chr(10))}")
    return 0
