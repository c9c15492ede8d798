"""`ptq run MODEL --quant Q.json --images DIR`: classify images (or `--data` samples) with the model run in
integers.

Images are preprocessed as at calibration: the quant table records the preprocessing it was calibrated
with, and any preprocessing flag given here overrides that field (`--config FILE` replaces the recorded
preprocessing; flags still override the file). Per sample the top-k classes are printed with their
probabilities (softmax of the dequantized logits); then a summary: the top-1 agreement with the float model,
the top-1 accuracy when the samples are labelled (a labels file, or images named `name_LABEL.jpg`), nodes
that ran in float and nodes whose int32 accumulator saturated.
"""
from __future__ import annotations

import argparse

from ptq.commands.data_options import add_data_arguments, data_kwargs
from ptq.commands.report import add_backend_argument, add_strict_argument

HELP = "run a calibrated model in integer arithmetic on images or samples and print the top-k classes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the float ONNX model")
    parser.add_argument("--quant", required=True, help="the quantization table (.quant.json) from `ptq calibrate`")
    parser.add_argument("--top", type=int, default=5, help="classes printed per sample (default 5)")
    parser.add_argument(
        "--float-nodes",
        nargs="+",
        default=[],
        metavar="NAME",
        help="node names, output tensor names or op types to run in float (dequantize -> float op -> quantize)",
    )
    add_strict_argument(parser)
    add_backend_argument(parser)
    add_data_arguments(parser)


def print_result(result) -> None:
    """Per sample its top-k, then the summary."""
    from ptq.compile_notice import first_run_note

    for s in result.samples:
        if s.classes is None:
            print(f"{s.path.name}: skipped ({s.skipped})")
        else:
            print(f"{s.path.name}: " + "  ".join(f"{c}:{p:.4f}" for c, p in s.classes))
    skipped = f", {result.skipped} skipped" if result.skipped else ""
    print(f"\n{result.images} image(s) in integers, {1000 * result.seconds / result.images:.1f} ms per image{skipped}"
          f"{first_run_note()}")
    agree = sum(bool(s.agrees) for s in result.classified)
    print(f"top-1 agreement with the float model {agree}/{result.images}")
    if result.labelled:
        how = result.inputs.get("labels") or "their file name (name_LABEL.jpg)"
        print(f"top-1 accuracy {result.correct}/{result.labelled} on the images labelled by {how}")
    else:
        print("no labels")
    if result.float_nodes:
        print(f"{len(result.float_nodes)} node(s) ran in float:")
        for f in result.float_nodes:
            print(f"  {f.name} ({f.op_type}): {f.reason}")
    else:
        print("every node ran in integers")
    if result.overflows:
        print(f"{len(result.overflows)} node(s) saturated their int32 accumulator (values over all samples):")
        for node, count in sorted(result.overflows.items()):
            print(f"  {node}: {count}")
    else:
        print("no int32 accumulator overflow")


def run(args: argparse.Namespace) -> int:
    from ptq.api import run as run_samples

    print_result(run_samples(args.model, quant=args.quant, top=args.top, float_nodes=args.float_nodes,
                             strict=args.strict, backend=args.backend, **data_kwargs(args)))
    return 0
