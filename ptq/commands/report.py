"""`ptq report MODEL --quant Q.json --images DIR --out DIR`: per-layer quantization report.

Runs the float model and the integer graph on the images and writes `report.json`, `report.csv` and a
self-contained `report.html` (see `reports/`), then prints the output metrics and the top suspects.
Images are preprocessed as the quant table records it was calibrated (a flag overrides a field; report.json
records what was used), or `--data` gives the model inputs directly. The isolated metrics (each layer
alone on its quantized float inputs) cost a second integer pass per image, so by default they are
accumulated over the first 2 images only (`--isolated-images N|all`); the cumulative and output metrics
always cover every image.
"""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

import argparse

from ptq.core.option_defaults import DEFAULT_ISOLATED_IMAGES, DEFAULT_MATCH_IOU, DEFAULT_SCORE_THRESHOLD, REPORT_TASKS
from ptq.commands.data_options import add_data_arguments, data_kwargs

HELP = "compare the integer graph with the float model layer by layer and rank the bottlenecks"


def isolated_images(text: str):
    """--isolated-images: a positive number, or 'all' (None)."""
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'all', got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'all', got {text!r}")
    return value


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL, --quant, the shared sample options, --strict, --backend: shared by `ptq report`, `ptq debug`."""
    parser.add_argument("model", help="the float ONNX model")
    parser.add_argument("--quant", required=True, help="the quantization table (.quant.json) from `ptq calibrate`")
    add_data_arguments(parser)
    add_strict_argument(parser)
    add_backend_argument(parser)


def add_strict_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strict", action="store_true",
                        help="fail if any node would run in float (not registered, or a rule that cannot quantize "
                        "it) instead of running it in float with a notice")


def add_backend_argument(parser: argparse.ArgumentParser, auto: bool = False) -> None:
    """--backend: the dot product under Conv, ConvTranspose, Gemm and MatMul (`ptq.engine.backends`); `auto`
    (`ptq run`): 'auto' is a choice and the default (`ptq.engine.backends.resolve_backend`)."""
    from ptq.engine.backends import AUTO_BACKEND_NAME, AUTO_NUMPY_UP_TO, BACKEND_NAMES, DEFAULT_BACKEND_NAME

    default = AUTO_BACKEND_NAME if auto else DEFAULT_BACKEND_NAME
    choices = ((AUTO_BACKEND_NAME,) if auto else ()) + BACKEND_NAMES
    parser.add_argument("--backend", choices=choices, default=default,
                        help=(f"auto (the default): numpy on up to {AUTO_NUMPY_UP_TO} samples (no numba start-up), "
                              "compiled on more; " if auto else "") +
                        f"integer kernels: compiled (numba{'' if auto else ', the default'}), numpy (the reference; "
                        "same codes), or a packed-DSP48E2 emulation of the dot products, dsp:int8 (2 MACs per DSP) "
                        "or dsp:int4 (4 per DSP); ':naive' slices lanes without the sign correction")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--out", required=True, help="output folder for report.json, report.csv, report.html")
    parser.add_argument("--isolated-images", type=isolated_images, default=DEFAULT_ISOLATED_IMAGES,
                        metavar="N|all",
                        help=f"accumulate the isolated metrics over the first N images (default "
                        f"{DEFAULT_ISOLATED_IMAGES}; 'all' for every image): they cost one more integer pass "
                        "per image, and a few images rank the layers as well as many")
    parser.add_argument("--float-nodes", nargs="+", default=[], metavar="NAME",
                        help="node names, output tensor names or op types to run in float")
    parser.add_argument("--top", type=int, default=5, help="suspects printed on stdout (default 5)")
    parser.add_argument("--task", choices=REPORT_TASKS, default="auto",
                        help="detect: match the integer run's detections to float's and report recall and "
                        "precision (a raw YOLO output [1, 4+C, A], or the inputs of a NonMaxSuppression node); "
                        "auto (default): detect when the graph has one NonMaxSuppression node")
    parser.add_argument("--score-threshold", type=float, default=DEFAULT_SCORE_THRESHOLD,
                        help=f"--task detect: detections scoring at least this count (default "
                        f"{DEFAULT_SCORE_THRESHOLD})")
    parser.add_argument("--match-iou", type=float, default=DEFAULT_MATCH_IOU,
                        help=f"--task detect: IoU at which an integer detection matches a float one of its class "
                        f"(default {DEFAULT_MATCH_IOU})")
    parser.add_argument("--tune", metavar="TUNE.json",
                        help="the <stem>.tune.json of `ptq tune --scheme int4-dsp`: report.html also draws its "
                        "accuracy against DSP throughput (Pareto front) and lists each layer's lanes")


def run(args: argparse.Namespace) -> int:
    from ptq.api import report
    from reports.writers import summary_text

    if args.top <= 0:
        raise ValueError(f"--top must be positive, got {args.top}")
    result = report(args.model, quant=args.quant, out=args.out, isolated_images=args.isolated_images,
                    float_nodes=args.float_nodes, strict=args.strict, backend=args.backend, task=args.task,
                    score_threshold=args.score_threshold, match_iou=args.match_iou, tune=args.tune,
                    **data_kwargs(args))
    print(summary_text(result.report, top=args.top))
    if result.dsp is not None:  # with a DSP backend: the resource report beside the accuracy ranks
        from reports.dsp_resources import accuracy_ranks, report_text

        print()
        print(report_text(result.dsp, args.top, accuracy_ranks(result.report.to_dict())))
    print("wrote " + ", ".join(str(p) for p in result.paths))
    return 0
