"""`ptq run MODEL --quant Q.json --images DIR`: classify images with the model run in integers.

Images are preprocessed as at calibration: the quant table records the preprocessing it was calibrated
with, and any preprocessing flag given here overrides that field (`--config FILE` replaces the recorded
preprocessing; flags still override the file). Images named `name_LABEL.jpg` count towards a top-1 accuracy. Per image the top-k classes are printed
with their probabilities (softmax of the dequantized logits); then a summary: nodes that ran in float and
nodes whose int32 accumulator saturated.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ptq.commands.report import add_backend_argument, add_strict_argument
from ptq.parallel import add_parallel_arguments

HELP = "run a calibrated model in integer arithmetic on images and print the top-k classes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the float ONNX model")
    parser.add_argument("--quant", required=True, help="the quantization table (.quant.json) from `ptq calibrate`")
    parser.add_argument("--images", required=True, help="an image file or a folder of images (searched recursively)")
    parser.add_argument("--top", type=int, default=5, help="classes printed per image (default 5)")
    parser.add_argument(
        "--float-nodes",
        nargs="+",
        default=[],
        metavar="NAME",
        help="node names, output tensor names or op types to run in float (dequantize -> float op -> quantize)",
    )
    add_strict_argument(parser)
    add_backend_argument(parser)
    add_parallel_arguments(parser)
    pre = parser.add_argument_group("preprocessing (default: what the quant table was calibrated with)")
    pre.add_argument("--config", help="JSON file with preprocessing keys (mean, std, resize, crop_ratio, bgr, layout)")
    pre.add_argument("--mean", help="per-channel mean in pixel units, e.g. 123.675,116.28,103.53")
    pre.add_argument("--std", help="per-channel std in pixel units, e.g. 58.395,57.12,57.375")
    pre.add_argument("--resize", type=int, help="short side after resizing, before the center crop")
    pre.add_argument("--crop-ratio", type=float, help="crop size / resized short side (default 0.875)")
    pre.add_argument("--bgr", action="store_true", default=None, help="feed channels in BGR order")
    pre.add_argument("--layout", choices=("NCHW", "NHWC"), help="input layout (default: from the model)")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities along the last axis (float64, max-subtracted)."""
    z = np.asarray(logits, dtype=np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def top_k(probs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most probable classes of a 1-D probability vector, most probable first (ties: lower index)."""
    order = np.argsort(-probs, kind="stable")[:k]
    return [(int(c), float(probs[c])) for c in order]


def _preprocess(args: argparse.Namespace, recorded: dict | None):
    from ptq.images import Preprocess

    flags = {"mean": args.mean, "std": args.std, "resize": args.resize, "crop_ratio": args.crop_ratio,
             "bgr": args.bgr, "layout": args.layout}
    if args.config:
        return Preprocess.from_config(args.config, **flags)
    fields = dict(recorded or {})
    fields.update({k: v for k, v in flags.items() if v is not None})
    return Preprocess(**fields)


def _image_files(images: str) -> list[Path]:
    from ptq.images import ImageLog, select_files

    path = Path(images)
    if path.is_file():
        return [path]
    files = select_files(path, ImageLog())
    if not files:
        raise ValueError(f"no image files in {path}")
    return files


@dataclass
class Tally:
    """What the per-image loop accumulates for the summary."""

    images: int = 0
    skipped: int = 0
    seconds: float = 0.0
    labelled: int = 0
    correct: int = 0
    overflows: dict[str, int] = field(default_factory=dict)


def _print_summary(tally: Tally, float_nodes) -> None:
    skipped = f", {tally.skipped} skipped" if tally.skipped else ""
    print(f"\n{tally.images} image(s) in integers, {1000 * tally.seconds / tally.images:.1f} ms per image{skipped}")
    if tally.labelled:
        print(f"top-1 accuracy {tally.correct}/{tally.labelled} on the images labelled by their file name (name_LABEL.jpg)")
    if float_nodes:
        print(f"{len(float_nodes)} node(s) ran in float:")
        for f in float_nodes:
            print(f"  {f.name} ({f.op_type}): {f.reason}")
    else:
        print("every node ran in integers")
    if tally.overflows:
        print(f"{len(tally.overflows)} node(s) saturated their int32 accumulator (values over all images):")
        for node, count in sorted(tally.overflows.items()):
            print(f"  {node}: {count}")
    else:
        print("no int32 accumulator overflow")


def run(args: argparse.Namespace) -> int:
    from ptq.pipeline import input_spec
    from ptq.executor import ExecutorOptions, prepare
    from ptq.float_run import image_input
    from ptq.adjusted_model import load_model_for_table
    from ptq.parallel import choose_workers
    from ptq.quant_table import load_quant_table
    from ptq.run_shards import RunContext, classify_image, classify_on_workers, print_outcome, tally_outcome
    from reports.labels import LabelResolver

    if args.top <= 0:
        raise ValueError(f"--top must be positive, got {args.top}")
    table = load_quant_table(args.quant)
    graph = load_model_for_table(args.model, table, args.quant)
    image_input(graph)  # one float input, or a clear error
    if len(graph.outputs) != 1:
        raise ValueError(f"`ptq run` prints classes of a model with one output; this one has {graph.outputs}")
    pre = _preprocess(args, table.options.preprocess)
    spec = input_spec(graph, pre)
    files = _image_files(args.images)
    labels = LabelResolver.from_option(None, files)
    prepared = prepare(graph, table, float_nodes=args.float_nodes, backend=args.backend,
                       options=ExecutorOptions(strict=args.strict))
    tally = Tally()
    workers = choose_workers(args.workers, len(files))
    if workers > 1 or args.ray is not None:
        classify_on_workers(args, graph, table, pre, files, tally, labels, workers)
    else:
        context = RunContext(graph, prepared, spec)
        for path in files:
            outcome = classify_image(context, path, pre, args.top)
            tally_outcome(tally, outcome, labels(path))
            print_outcome(outcome)
    if not tally.images:
        raise ValueError(f"no image of {args.images} could be decoded")
    _print_summary(tally, prepared.float_nodes)
    return 0
