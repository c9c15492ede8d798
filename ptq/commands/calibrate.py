"""`ptq calibrate MODEL --images DIR --out DIR`: the quantization table and a QDQ model."""
from __future__ import annotations

import argparse
import logging

from ptq.images import LAYOUTS, Preprocess
from ptq.parallel import add_parallel_arguments

HELP = "calibrate a model on a folder of images; write <stem>.quant.json and <stem>.qdq.onnx"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from calibrators.registry import describe_calibrators
    from ptq.pipeline import DEFAULT_CALIBRATOR, DEFAULT_WEIGHT_CALIBRATOR

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "calibrators (names are case-insensitive; a number in front sets the parameter):\n" + "\n".join(
        f"  {line}" for line in describe_calibrators())

    parser.add_argument("model", help="the float ONNX model (never modified)")
    parser.add_argument("--images", required=True, help="folder of calibration images (searched recursively)")
    parser.add_argument("--out", default=".", help="output folder (created if needed; default: .)")

    cal = parser.add_argument_group("calibration")
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

    img = parser.add_argument_group("images")
    img.add_argument("--config", help="JSON file with preprocessing keys (mean, std, resize, crop_ratio, bgr, "
                                      "layout); flags override it")
    img.add_argument("--mean", help="per-channel mean in pixel units, R,G,B or one value (default: 123.675,116.28,103.53)")
    img.add_argument("--std", help="per-channel std in pixel units, R,G,B or one value (default: 58.395,57.12,57.375)")
    img.add_argument("--resize", type=int, help="resize the short side to this many pixels (default: crop / crop ratio)")
    img.add_argument("--crop-ratio", type=float, help="center crop = this fraction of the resized image (default: 0.875)")
    img.add_argument("--bgr", action="store_const", const=True, help="feed channels in BGR order (default: RGB)")
    img.add_argument("--layout", choices=LAYOUTS, help="input layout (default: guessed from the model's input shape)")
    img.add_argument("--num-images", type=int, help="use this many images, sampled with --seed (default: all)")
    img.add_argument("--batch-size", type=int, default=8, help="images per statistics batch (default: 8)")
    img.add_argument("--seed", type=int, default=0, help="seed for sampling --num-images (default: 0)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no summary, no warnings")
    add_parallel_arguments(parser)


def preprocess_from_args(args: argparse.Namespace) -> Preprocess:
    flags = {"mean": args.mean, "std": args.std, "resize": args.resize, "crop_ratio": args.crop_ratio,
             "bgr": args.bgr, "layout": args.layout}
    if args.config:
        return Preprocess.from_config(args.config, **flags)
    return Preprocess(**{k: v for k, v in flags.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    from ptq.pipeline import calibrate
    from ptq.core.graph import parse_input_shapes

    logging.basicConfig(format="ptq: warning: %(message)s")
    logger = logging.getLogger("ptq")
    previous_level = logger.level
    logger.setLevel(logging.ERROR if args.quiet else logging.WARNING)
    try:
        result = calibrate(
            args.model,
            args.images,
            args.out,
            calibrator=args.calibrator,
            weight_calibrator=args.weight_calibrator,
            bits=args.bits,
            weight_bits=args.weight_bits,
            symmetric=args.symmetric,
            weight_symmetric=not args.weight_asymmetric,
            narrow=args.narrow,
            weight_narrow=not args.weight_full_range,
            per_channel=not args.per_tensor,
            pow2=args.pow2,
            fold_clip=not args.no_fold_clip,
            preprocess=preprocess_from_args(args),
            num_images=args.num_images,
            batch_size=args.batch_size,
            seed=args.seed,
            input_shapes=parse_input_shapes(args.input_shape),
            progress=not args.quiet,
            workers=args.workers,
            ray=args.ray,
            equalize=args.equalize,
            bias_correction=args.bias_correction,
            adaround=args.adaround,
            analytic_bias_correction=args.analytic_bias_correction,
            range_search=args.range_search,
        )
    finally:
        logger.setLevel(previous_level)
    if not args.quiet:
        print(result.summary())
    return 0
