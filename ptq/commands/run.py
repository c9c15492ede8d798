"""`ptq run MODEL --quant Q.json --images DIR`: classify images (or `--data` samples) with the model run in
integers.

Images are preprocessed as at calibration: the quant table records the preprocessing it was calibrated
with, and any preprocessing flag given here overrides that field (`--config FILE` replaces the recorded
preprocessing; flags still override the file). Per sample the top-k classes are printed with their
probabilities (softmax of the dequantized logits); then a summary: the top-1 agreement with the float model,
the top-1 accuracy when the samples are labelled (a labels file, or images named `name_LABEL.jpg`), nodes
that ran in float and nodes whose int32 accumulator saturated. An output that is no class-score vector (ArgMax
tags, TopK indices, a mask, per-frame scores) is compared value by value instead: per sample how many of its
values (for float outputs: argmax decisions over a last axis of 2 or more) equal the float model's, then the
agreement of that output over all samples; a float output with nothing to take the argmax over (a probability
[1, 1]) by its cosine. The figures are of the model's first output, named as they are printed.
"""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

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
    add_backend_argument(parser, auto=True)
    add_data_arguments(parser)


def print_result(result) -> None:
    """Per sample its top-k, then the summary."""
    from ptq.engine.compile_notice import first_run_note

    for s in result.samples:
        if s.classes is None:
            print(f"{s.path.name}: skipped ({s.skipped})")
        elif s.matched is not None:
            print(f"{s.path.name}: output {result.output}: {s.matched[0]}/{s.matched[1]} values as in float")
        elif s.cosine is not None:
            print(f"{s.path.name}: output {result.output}: cosine {s.cosine:.6f} with float")
        else:
            print(f"{s.path.name}: " + "  ".join(f"{c}:{p:.4f}" for c, p in s.classes))
    skipped = f", {result.skipped} skipped" if result.skipped else ""
    print(f"\n{result.images} image(s) in integers, {1000 * result.seconds / result.images:.1f} ms per image{skipped}"
          f" ({result.backend} kernels){first_run_note()}")
    if result.output_cosine is not None:
        print(f"cosine of output {result.output} with the float model {result.output_cosine:.6f} "
              f"(mean over {result.images} samples)")
    elif not result.class_scores:
        equal = sum(s.matched[0] for s in result.classified)
        total = sum(s.matched[1] for s in result.classified)
        print(f"agreement of output {result.output} with the float model {result.output_agreement:.4f} "
              f"({equal}/{total} values)")
    if not result.class_scores:
        print_float_nodes_and_overflows(result)
        return
    agree = sum(bool(s.agrees) for s in result.classified)
    print(f"top-1 agreement of output {result.output} with the float model {agree}/{result.images}")
    if result.labelled:
        how = result.inputs.get("labels") or "their file name (name_LABEL.jpg)"
        print(f"top-1 accuracy {result.correct}/{result.labelled} on the images labelled by {how}")
    else:
        print("no labels")
    print_float_nodes_and_overflows(result)


def print_float_nodes_and_overflows(result) -> None:
    from ptq.engine.executor import float_node_lines  # at run time: module comment

    print("\n".join(float_node_lines(result.float_nodes, result.overflows)))


def run(args: argparse.Namespace) -> int:
    from ptq.api import run as run_samples

    print_result(run_samples(args.model, quant=args.quant, top=args.top, float_nodes=args.float_nodes,
                             strict=args.strict, backend=args.backend, **data_kwargs(args)))
    return 0
