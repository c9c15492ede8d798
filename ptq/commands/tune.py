"""`ptq tune MODEL --images DIR --quant TABLE --target-cosine 0.995 [--max-accuracy-drop D] [--budget-int16 N]
[--allow-float N]`: change the table step by step (`ptq.tuning.tuner`) until the logits cosine on the samples reaches
the target (and/or top-1 accuracy on labelled ones is within D of the float model's); write
`<stem>.tuned.quant.json` (and the adjusted weights the table uses, beside it), its QDQ model
`<stem>.tuned.qdq.onnx` (`--qdq-target`, checked in onnxruntime unless --no-check or -q, as `ptq calibrate`
does) and `<stem>.tune.json` with what each step changed and bought. Decisions are taken on a validation part of the images (or on
--validation DIR), each image with its label-free views (--views), against MODEL itself; "reached" is said when
the integer graph and the QDQ model written (onnxruntime, optimizations off and on) reach the target there
(`ptq.tuning.verdict`), and the exit status is 1 when not; judge the result on other held-out images still."""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

import argparse
import logging

from ptq.commands.data_options import add_data_arguments, data_kwargs
from ptq.commands.qdq_options import add_qdq_arguments, qdq_targets_epilog
from ptq.core.option_defaults import DEFAULT_SCHEME, SCHEMES
from ptq.tuning.defaults import DEFAULT_MARGIN, DEFAULT_VALIDATION_FRACTION, DEFAULT_VIEWS, DEFAULT_Z, INT4_ROUNDINGS

HELP = ("reach a target logits cosine or top-1 accuracy drop: per-channel weights, better ranges, 16-bit tensors, "
        "float as a last resort; write <stem>.tuned.quant.json, <stem>.tuned.qdq.onnx and <stem>.tune.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = qdq_targets_epilog
    parser.add_argument("model", help="the float ONNX model")
    parser.add_argument("--quant", required=True, help="the quantization table (.quant.json) to start from")
    parser.add_argument("--target-cosine", type=float,
                        help="stop when the logits cosine reaches this (this and/or --max-accuracy-drop)")
    parser.add_argument("--max-accuracy-drop", type=float, metavar="D",
                        help="stop when top-1 accuracy on the labelled validation samples (--labels, or file names "
                             "ending in _LABEL) is at most D below the float model's on them. Coarse on few photos: "
                             "over 20 it moves in steps of 0.05, so D < 0.05 asks that no photo's top-1 changes; "
                             "the summary says over how many photos")
    parser.add_argument("--budget-int16", type=int, help="at most this many 16-bit tensors (default: no limit; once "
                        "the target is reached the fewest 16-bit tensors that keep it are searched)")
    parser.add_argument("--allow-float", type=int, default=0, help="at most this many float layers (default 0)")
    parser.add_argument("--validation", help="folder of validation images (or --data samples) to decide on "
                                             "(default: every k-th sample is held out, k = 1 / --validation-fraction)")
    parser.add_argument("--validation-fraction", type=float, default=DEFAULT_VALIDATION_FRACTION,
                        help=f"share of the samples held out to decide on (default {DEFAULT_VALIDATION_FRACTION})")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help=f"reach the target plus this on the validation samples (default {DEFAULT_MARGIN})")
    parser.add_argument("--z", type=float, default=DEFAULT_Z,
                        help=f"the validation mean minus this many standard errors must reach the target "
                             f"(default {DEFAULT_Z:g})")
    parser.add_argument("--views", default=",".join(DEFAULT_VIEWS),
                        help="the views each validation image enters with, comma-separated, or none (default: "
                             "all: %(default)s)")
    parser.add_argument("--scheme", choices=SCHEMES, default=DEFAULT_SCHEME,
                        help="int4-dsp: from an 8-bit table, move layers to 4-bit DSP lanes (4 MACs per DSP48E2) "
                             "while the target holds, for the most MACs per DSP per cycle, and to 16-bit lanes (1 MAC) "
                             "where all-8-bit misses it (default: default)")
    parser.add_argument("--int4-pow2", action="store_true",
                        help="with --scheme int4-dsp: power-of-two 4-bit scales (WP521's grid; default: free scales)")
    parser.add_argument("--int4-no-bias-correction", action="store_true",
                        help="with --scheme int4-dsp: leave the 4-bit layers' biases uncorrected")
    parser.add_argument("--int4-rounding", choices=INT4_ROUNDINGS, default="gptq",
                        help="with --scheme int4-dsp: how the 4-bit weights are rounded: GPTQ's second-order rounding "
                             "(default), AdaRound, or to nearest")
    parser.add_argument("--int4-tensor-fit", action="store_true",
                        help="with --scheme int4-dsp: fit the 4-bit grids to their tensors only, not to the layer's "
                             "output error")
    parser.add_argument("--out", help="output folder (default: the table's folder)")
    add_qdq_arguments(parser, check_help="do not judge the QDQ model written in onnxruntime (optimizations off and "
                                         "on) on the validation samples: 'reached' is then the integer graph's alone "
                                         "(--quiet does not skip it)")
    add_data_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ptq.api import tune
    from ptq.tuning.lane_mix import Int4Grid

    if not args.quiet:  # each step as it is measured
        logging.getLogger("ptq.tune").setLevel(logging.INFO)
    result = tune(args.model, quant=args.quant, target_cosine=args.target_cosine,
                  max_accuracy_drop=args.max_accuracy_drop, budget_int16=args.budget_int16,
                  allow_float=args.allow_float, validation=args.validation,
                  validation_fraction=args.validation_fraction, margin=args.margin, z=args.z, out=args.out,
                  views=[] if args.views.strip().lower() == "none" else [v.strip() for v in args.views.split(",")],
                  qdq_target=args.target, no_check=args.no_check, scheme=args.scheme,
                  int4_grid=Int4Grid(pow2=args.int4_pow2, bias_correction=not args.int4_no_bias_correction,
                                     rounding=args.int4_rounding, output_fit=not args.int4_tensor_fit),
                  **data_kwargs(args))
    print(result.summary())
    if result.float_nodes:
        print(f"the tuned table marks float: {', '.join(result.table.float_tensors())} "
              f"(nodes {' '.join(result.float_nodes)})")
    print(f"wrote {result.table_path}, {result.qdq_path}, {result.record_path}")
    return 0 if result.reached else 1
