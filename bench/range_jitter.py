"""How much a first-try figure moves when one activation's range is shrunk by a percent or a few: the noise floor
under which two calibrators' results on a model cannot be told apart.

    python bench/range_jitter.py [--model efficientnet_lite0] --tensor getitem_15 [--factors 1,0.99,0.98,...]
                                 [--lite0-crops N]

Calibrates with extrema (the models and arrays of bench/first_try.py), then for each factor f runs ptq's integer
graph with the one tensor's range [min, max] scaled to [f min, f max] (qparams rebuilt, weight-scale floors
re-raised) and prints the held-out mean cosine to float in onnxruntime. At f = 0.99 no value is clipped on the
calibration data beyond the top 1% of the range, so any change larger than a clipping calibrator's
measured gain or loss is the grid's luck, not its range.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import first_try  # noqa: E402
from ptq.calibration.pipeline import calibrate  # noqa: E402
from ptq.core.qparams import compute_qparams  # noqa: E402
from ptq.engine.weight_scale_floor import floor_weight_scales  # noqa: E402

FACTORS = "1,0.99,0.98,0.97,0.96,0.95,0.94,0.92,0.9,0.85,0.8"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--tensor", required=True)
    parser.add_argument("--factors", default=FACTORS)
    parser.add_argument("--lite0-crops", type=int, default=0, help="as bench/first_try.py's")
    args = parser.parse_args()
    path = first_try.model_path(args.model)
    data = first_try.samples(args.model, 0, args.lite0_crops)
    ref = first_try.ort_outputs(onnx.load(str(path)), data.held_out, optimized=True)
    with tempfile.TemporaryDirectory() as tmp:
        calib = first_try.write_feeds(data.calib, Path(tmp) / "calib")
        result = calibrate(str(path), data=calib, out_dir=Path(tmp) / "out", calibrator="extrema")
    entry = result.table.tensors[args.tensor]
    opts = result.table.options
    print(f"| {args.model} {args.tensor} range factor | cosine |\n|---:|---:|")
    for f in (float(v) for v in args.factors.split(",")):
        lo, hi = entry.min * f, entry.max * f
        qp = compute_qparams(lo, hi, entry.qparams.bits, symmetric=opts.symmetric, narrow=opts.narrow, pow2=opts.pow2)
        tensors = dict(result.table.tensors)
        tensors[args.tensor] = dataclasses.replace(entry, min=lo, max=hi, qparams=qp)
        floor_weight_scales(result.graph, tensors, opts)
        table = dataclasses.replace(result.table, tensors=tensors)
        got = first_try.integer_outputs(result.graph, table, data.held_out)
        print(f"| {f:g} | {first_try.score(got, ref, data.held_out).cosine:.6f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
