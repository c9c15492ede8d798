"""`ptq calibrate MODEL --images DIR --out DIR`: the quantization table and a QDQ model."""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

import argparse

from ptq.core.option_defaults import DEFAULT_CALIBRATOR, DEFAULT_SCHEME, DEFAULT_WEIGHT_CALIBRATOR, SCHEMES
from ptq.commands.data_options import add_data_arguments, data_kwargs
from ptq.commands.qdq_options import add_qdq_arguments, qdq_targets_epilog

HELP = "calibrate a model on images or --data samples; write <stem>.quant.json and <stem>.qdq.onnx"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = epilog  # a function: the calibrators are imported only when the help is printed

    parser.add_argument("model", help="the float ONNX model (never modified)")
    parser.add_argument("--out", default=".", help="output folder (created if needed; default: .)")

    cal = parser.add_argument_group("calibration")
    cal.add_argument("--scheme", choices=SCHEMES, default=DEFAULT_SCHEME,
                     help="int4-dsp: Xilinx WP521's 4-bit scheme for --backend dsp:int4 (4-bit weights and uint4 "
                          "activations, power-of-two scales, Add groups and outputs at 8 bits); it fixes --bits, "
                          "--weight-bits, --symmetric, --narrow, --weight-full-range, --pow2 (default: default)")
    cal.add_argument("--calibrator", default=DEFAULT_CALIBRATOR,
                     help=f"activation calibrator, e.g. extrema, mean, nstd, 4std, percentile, 99.9percentile, "
                          f"kld, mse; all listed below (default: {DEFAULT_CALIBRATOR})")
    cal.add_argument("--weight-calibrator", default=DEFAULT_WEIGHT_CALIBRATOR,
                     help=f"weight calibrator (default: {DEFAULT_WEIGHT_CALIBRATOR})")
    cal.add_argument("--bits", type=int, default=8, help="activation bits, 2-16 (default: 8)")
    cal.add_argument("--weight-bits", type=int, default=8, help="weight bits, 2-16 (default: 8)")
    cal.add_argument("--symmetric", action="store_true", help="symmetric activations (default: asymmetric)")
    cal.add_argument("--weight-asymmetric", action="store_true", help="asymmetric weights (default: symmetric)")
    cal.add_argument("--narrow", action="store_true",
                     help="restricted signed range [-(2^(b-1)-1), 2^(b-1)-1] for activations")
    cal.add_argument("--weight-full-range", action="store_true",
                     help="full signed range [-2^(b-1), 2^(b-1)-1] for symmetric weights (default: restricted)")
    cal.add_argument("--per-tensor", action="store_true", help="one scale per weight (default: per output channel)")
    cal.add_argument("--pow2", action="store_true", help="round every scale up to a power of two")
    cal.add_argument("--no-fold-clip", action="store_true",
                     help="do not narrow a tensor's range to the bounds of the Relu/Clip that consumes it")
    cal.add_argument("--equalize", action="store_true",
                     help="cross-layer equalization of Conv pairs before calibrating (exact; for per-tensor weights)")
    cal.add_argument("--bias-correction", action="store_true",
                     help="correct each channel's bias for the mean shift weight quantization causes (on the images)")
    cal.add_argument("--range-search", action="store_true",
                     help="pick each activation's range among extrema, mse, kld, 99.99percentile by the error "
                          "of its consumers' outputs on (up to 8 of) the images")
    cal.add_argument("--analytic-bias-correction", action="store_true",
                     help="the same correction from BatchNorm statistics, without images (BatchNorm models only)")
    cal.add_argument("--adaround", action="store_true",
                     help="learn each weight's rounding (up or down) layer by layer on the images")
    cal.add_argument("--input-shape", action="append", metavar="NAME:D0,D1,...",
                     help="fix dynamic input dimensions, e.g. input:1,3,224,224 (repeatable)")
    add_qdq_arguments(parser, "--target")
    add_data_arguments(parser, labels=False)


def epilog() -> str:
    """The calibrators (their names and what range each gives) and the QDQ targets."""
    from calibrators.registry import describe_calibrators

    return ("calibrators (names are case-insensitive; a number in front sets the parameter):\n"
            + "\n".join(f"  {line}" for line in describe_calibrators())
            + "\n\n" + qdq_targets_epilog("--target"))


CALIBRATION_FLAGS = ("out", "calibrator", "weight_calibrator", "bits", "weight_bits", "symmetric", "weight_asymmetric",
                     "narrow", "weight_full_range", "per_tensor", "pow2", "no_fold_clip", "equalize",
                     "bias_correction", "adaround", "analytic_bias_correction", "range_search", "scheme",
                     "target", "no_check", "input_shape")


def run(args: argparse.Namespace) -> int:
    from ptq.api import calibrate

    result = calibrate(args.model, **{name: getattr(args, name) for name in CALIBRATION_FLAGS}, **data_kwargs(args))
    if not args.quiet:
        print(result.summary())
    return 0
