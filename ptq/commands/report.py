"""`ptq report MODEL --quant Q.json --images DIR --out DIR`: per-layer quantization report.

Runs the float model and the integer graph on the images and writes `report.json`, `report.csv` and a
self-contained `report.html` (see `reports/`), then prints the output metrics and the top suspects.
Images are preprocessed as the quant table records it was calibrated. The isolated metrics (each layer
alone on its quantized float inputs) cost a second integer pass per image, so by default they are
accumulated over the first 2 images only (`--isolated-images N|all`); the cumulative and output metrics
always cover every image.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ptq.parallel import add_parallel_arguments, choose_workers

HELP = "compare the integer graph with the float model layer by layer and rank the bottlenecks"
DEFAULT_ISOLATED_IMAGES = 2


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
    """MODEL, --quant, --images, --labels, --num-images: shared by `ptq report` and `ptq debug`."""
    parser.add_argument("model", help="the float ONNX model")
    parser.add_argument("--quant", required=True, help="the quantization table (.quant.json) from `ptq calibrate`")
    parser.add_argument("--images", required=True, help="an image file or a folder of images (searched recursively)")
    parser.add_argument("--labels", help="labels file (JSON {file: label} or 'NAME LABEL' lines); default: the "
                        "number at the end of each file name, e.g. imagenet_00_243.jpg -> 243")
    parser.add_argument("--num-images", type=int, help="use only the first N images")
    add_strict_argument(parser)
    add_backend_argument(parser)


def add_strict_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strict", action="store_true",
                        help="fail if any node would run in float (not registered, or a rule that cannot quantize "
                        "it) instead of running it in float with a notice")


def require_integer_graph(args: argparse.Namespace, graph, table) -> None:
    """With --strict: prepare the graph in strict mode, so that the first node that would run in float is
    an error naming it and the reason."""
    if args.strict:
        from ptq.executor import ExecutorOptions, prepare

        prepare(graph, table, options=ExecutorOptions(strict=True))


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """--backend: the dot product under Conv, ConvTranspose, Gemm and MatMul (`ptq.backends`)."""
    from ptq.backends import BACKEND_NAMES, DEFAULT_BACKEND_NAME

    parser.add_argument("--backend", choices=BACKEND_NAMES, default=DEFAULT_BACKEND_NAME,
                        help="integer kernels: compiled (numba, the default), numpy (the reference; same codes), or "
                        "a packed-DSP48E2 emulation of the dot products, dsp:int8 (2 MACs per DSP) or dsp:int4 (4 "
                        "per DSP); ':naive' slices lanes without the sign correction")


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
    add_parallel_arguments(parser)


def load_inputs(args: argparse.Namespace):
    """(graph, table, images) from the common arguments."""
    from ptq.adjusted_model import load_model_for_table
    from ptq.images import Preprocess
    from ptq.quant_table import load_quant_table
    from reports.image_source import ImageSet

    table = load_quant_table(args.quant)
    graph = load_model_for_table(args.model, table, args.quant)
    pre = Preprocess(**(table.options.preprocess or {}))
    images = ImageSet.from_folder(args.images, pre, args.labels, args.num_images)
    return graph, table, images


def write_report(report, out_dir: Path) -> list[Path]:
    from reports.html import write_html
    from reports.writers import write_csv, write_json

    out_dir.mkdir(parents=True, exist_ok=True)
    return [write_json(report, out_dir / "report.json"), write_csv(report, out_dir / "report.csv"),
            write_html(report, out_dir / "report.html")]


def run(args: argparse.Namespace) -> int:
    from reports.build import build_report
    from reports.evaluate import evaluate
    from reports.writers import summary_text

    if args.top <= 0:
        raise ValueError(f"--top must be positive, got {args.top}")
    graph, table, images = load_inputs(args)
    require_integer_graph(args, graph, table)
    workers = choose_workers(args.workers, images.expected)
    if workers > 1 or args.ray is not None:
        from reports.evaluate_shards import sharded_evaluate

        # the loaded model (the adjusted one when the table records weight adjustments) goes to the workers
        ev = sharded_evaluate(graph.model, table, images, workers=workers, ray=args.ray,
                              float_nodes=args.float_nodes, isolated_images=args.isolated_images, progress=True,
                              backend=args.backend)
    else:
        ev = evaluate(graph, table, images, float_nodes=args.float_nodes, isolated_images=args.isolated_images,
                      progress=True, backend=args.backend)
    report = build_report(ev, str(args.model), str(args.quant))
    paths = write_report(report, Path(args.out))
    print(summary_text(report, top=args.top))
    if args.backend.startswith("dsp:"):
        paths.append(_dsp_section(graph, table, report, Path(args.out), args.top))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _dsp_section(graph, table, report, out_dir: Path, top: int) -> Path:
    """With a DSP backend: the resource report (`ptq dsp-report`, default array) beside the accuracy ranks."""
    import json

    from reports.dsp_resources import accuracy_ranks, dsp_report, report_text

    resources = dsp_report(graph, table)
    print()
    print(report_text(resources, top, accuracy_ranks(report.to_dict())))
    path = out_dir / "dsp_report.json"
    path.write_text(json.dumps(resources.to_dict(), indent=1) + "\n", encoding="utf-8")
    return path
