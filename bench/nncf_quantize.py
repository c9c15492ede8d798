"""NNCF's post-training quantization of an ONNX model on .npy calibration arrays, for the peer comparisons of
`bench/detectors.py`. Runs in NNCF's own venv (ptq never imports nncf):

    /work/nncfenv/bin/python bench/nncf_quantize.py MODEL CALIB_DIR OUT.onnx

CALIB_DIR holds one `.npy` per sample, the model's one input with its batch axis of 1 (`ptq --data`'s format).
`nncf.quantize` with its defaults (preset performance: symmetric int8 activations, per-channel int8 weights,
min/max statistics with its own range estimators, fast bias correction) on every array; the QDQ model is saved
to OUT.onnx. A model below opset 13 is first converted to opset 13 (`onnx.version_converter`): NNCF quantizes
weights per channel only from 13 on, and falls back to per-tensor below (its warning says so).
"""
from __future__ import annotations

import sys
from pathlib import Path

import nncf
import numpy as np
import onnx
from onnx import version_converter


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    model_path, calib, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    model = onnx.load(model_path)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < 13:
        model = version_converter.convert_version(model, 13)
    name = model.graph.input[0].name
    arrays = [np.load(f).astype(np.float32) for f in sorted(calib.glob("*.npy"))]
    dataset = nncf.Dataset(arrays, lambda a: {name: a})
    quantized = nncf.quantize(model, dataset, subset_size=len(arrays))
    onnx.save(quantized, out)
    print(f"wrote {out} ({len(arrays)} calibration samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
