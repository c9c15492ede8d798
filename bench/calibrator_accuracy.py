"""Which activation calibrator should be the default? Mean logits cosine of the QDQ model on the eval photos.

    python bench/calibrator_accuracy.py

Statistics are collected once (every calibrator's needs) from the calibration photos; each calibrator x
{asymmetric, symmetric} then gives a table and a QDQ model (weights: the defaults, per-channel symmetric
int8), scored by the mean cosine of its logits to the float model's on the eval photos, with onnxruntime's
graph optimizations off (the QDQ graph's own arithmetic), plus top-1 agreement with the float model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from calibrators import required_stats  # noqa: E402
from ptq.calibration.entries import build_table  # noqa: E402
from ptq.calibration.statistics import collect_image_statistics  # noqa: E402
from ptq.core.graph import load_model  # noqa: E402
from ptq.data.images import InputSpec, Preprocess, load_image  # noqa: E402
from ptq.qdq.export import export_qdq  # noqa: E402
from ptq.table.quant_table import CalibrationOptions  # noqa: E402

CALIBRATORS = ("extrema", "mean", "3std", "99.99percentile", "99.999percentile", "kld", "mse")


def logits(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i : i + 1]})[0] for i in range(len(x))])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "efficientnet_lite0.onnx"))
    parser.add_argument("--images", default=str(REPO / "examples" / "calib"))
    parser.add_argument("--eval", default=str(REPO.parent / "shared" / "assets" / "images" / "eval"))
    parser.add_argument("--calibrators", default=",".join(CALIBRATORS))
    args = parser.parse_args()

    pre = Preprocess(mean=127, std=128)
    names = args.calibrators.split(",")
    graph = load_model(args.model)
    stats, _ = collect_image_statistics(graph, args.images, required_stats(names), preprocess=pre)
    files = sorted(Path(args.eval).glob("*.jpg"))
    x = np.stack([load_image(f, pre, InputSpec("NCHW", 3, 224, 224)) for f in files])
    ref = logits(graph.model.SerializeToString(), x)
    print("| calibrator | asymmetric: cosine | top-1 agreement | symmetric: cosine | top-1 agreement |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        cells = []
        for symmetric in (False, True):
            table = build_table(graph, stats, CalibrationOptions(calibrator=name, symmetric=symmetric))
            got = logits(export_qdq(graph, table).SerializeToString(), x)
            cosine = np.sum(ref * got, axis=1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
            cells += [f"{cosine.mean():.4f}", f"{np.mean(got.argmax(1) == ref.argmax(1)):.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
