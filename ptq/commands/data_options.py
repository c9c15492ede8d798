"""The flags every data-reading command shares (`ptq.data_options.DataOptions`): `add_data_arguments` adds
them, `data_kwargs` hands them to the `ptq.api` function as keyword arguments of the same names."""
from __future__ import annotations

# imports inside functions: every `ptq ...` call, `--help` included, builds the whole parser, so what a command
# runs is imported when it runs (tests/test_cli_imports.py)

import argparse
from dataclasses import fields

from ptq.core.option_defaults import LAYOUTS
from ptq.parallel.workers import add_parallel_arguments

PARALLEL = ("workers", "ray")


def add_data_arguments(parser: argparse.ArgumentParser, *, labels: bool = True, required: bool = True,
                       parallel: bool = True) -> None:
    """--images/--data (`required`: one of them must be given), preprocessing, [--labels], --num-images, --seed,
    --batch-size, --quiet, [--workers, --ray]."""
    src = parser.add_argument_group("samples (one of --images, --data)" if required else
                                    "samples (optional: --images or --data)")
    where = src.add_mutually_exclusive_group(required=required)
    where.add_argument("--images", metavar="DIR|FILE", help="an image file or a folder of images (searched recursively)")
    where.add_argument("--data", metavar="DIR|FILE",
                       help="a folder (or file) of .npy/.npz samples, already model inputs: .npy for a one-input "
                       "model, .npz with one array per input name; each array one sample, batch axis of 1 or none")
    if labels:
        src.add_argument("--labels", metavar="FILE",
                         help="labels file (JSON {file: label} or 'NAME LABEL' lines); default for images: the number "
                         "at the end of each file name when every image has one (imagenet_00_243.jpg -> 243)")
    src.add_argument("--num-images", type=int, metavar="N", help="use N samples, drawn with --seed (default: all)")
    src.add_argument("--seed", type=int, default=0, help="seed for drawing --num-images (default: 0)")
    src.add_argument("--batch-size", type=int, default=8, metavar="B",
                     help="samples per float batch of the statistics passes (calibrate, tune; default 8)")
    src.add_argument("--quiet", "-q", action="store_true", help="no progress bars, no warnings")

    pre = parser.add_argument_group("preprocessing of --images (default: what the quant table records; calibrate: "
                                    "the defaults below)")
    pre.add_argument("--config", metavar="FILE", help="JSON file with preprocessing keys (mean, std, resize, "
                     "crop_ratio, bgr, layout); replaces the table's; flags override it")
    pre.add_argument("--mean", metavar="R,G,B", help="per-channel mean in pixel units, R,G,B or one value "
                     "(default: 123.675,116.28,103.53)")
    pre.add_argument("--std", metavar="R,G,B", help="per-channel std in pixel units, R,G,B or one value "
                     "(default: 58.395,57.12,57.375)")
    pre.add_argument("--resize", type=int, metavar="N", help="resize the short side to N pixels (default: crop / "
                     "crop ratio)")
    pre.add_argument("--crop-ratio", type=float, metavar="R", help="center crop = this fraction of the resized "
                     "image (default: 0.875)")
    pre.add_argument("--bgr", action="store_const", const=True, help="feed channels in BGR order (default: RGB)")
    pre.add_argument("--layout", choices=LAYOUTS, help="input layout (default: from the model's input shape)")
    if parallel:
        add_parallel_arguments(parser)


def data_kwargs(args: argparse.Namespace) -> dict:
    """The shared options the command was given, as keyword arguments for `ptq.api`."""
    from ptq.data_options import DataOptions

    return {f.name: getattr(args, f.name) for f in fields(DataOptions) if hasattr(args, f.name)}
