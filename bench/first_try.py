"""A user's first try: `ptq calibrate` with no accuracy flag beside NNCF's and onnxruntime's default quantizers.

    python bench/first_try.py [--models efficientnet_lite0,mobilenet_v3_small] [--calibrators extrema,mse,kld]

Every tool gets the same preprocessed arrays (`bench/models/data/<model>_{calib,eval}.npy`; the bundled
EfficientNet-Lite0's are made here from the calibration and eval photos, the others by their build scripts
under bench/models/). Scored on the held-out eval arrays: mean cosine of the first output to the float model's
(onnxruntime), and top-1 agreement. Rows:

- ptq int: `ptq.calibration.pipeline.calibrate(model, calib)` with its defaults (what `ptq calibrate MODEL --data ...`
  does), run by ptq's integer executor; ptq QDQ: the QDQ model it writes, in onnxruntime with graph
  optimizations off and on. `--calibrators` adds rows for named calibrators (int run only).
- onnxruntime: `quantize_static` QDQ, per-channel weights, MinMax / Percentile / Entropy calibration,
  optimizations off.
- NNCF 3.4.0 (`/work/nncfenv`, a subprocess): `nncf.quantize` with default settings (preset performance:
  symmetric activations), and with `preset=MIXED` (asymmetric activations); per-channel weights; optimizations off.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from ptq.core.graph import load_model  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.calibration.pipeline import calibrate  # noqa: E402

MODELS = REPO / "bench" / "models"
DATA = MODELS / "data"
NNCF_PYTHON = "/work/nncfenv/bin/python"
PHOTOS = next((p / "shared" / "assets" / "images" for p in REPO.parents if (p / "shared" / "assets").is_dir()),
              Path("/work/shared/assets/images"))  # the main checkout's or a worktree's shared folder

NNCF_SCRIPT = """
import sys, numpy as np, onnx, nncf
model, calib, out, preset = onnx.load(sys.argv[1]), np.load(sys.argv[2]), sys.argv[3], sys.argv[4]
name = model.graph.input[0].name
dataset = nncf.Dataset([{name: calib[k:k + 1]} for k in range(len(calib))])
kwargs = {} if preset == "default" else {"preset": nncf.QuantizationPreset.MIXED}
onnx.save(nncf.quantize(model, dataset, subset_size=len(calib), **kwargs), out)
"""


def model_path(name: str) -> Path:
    return REPO / "examples" / "efficientnet_lite0.onnx" if name == "efficientnet_lite0" else MODELS / f"{name}.onnx"


def arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    calib, held_out = DATA / f"{name}_calib.npy", DATA / f"{name}_eval.npy"
    if name == "efficientnet_lite0" and not calib.exists():
        from ptq.data.images import InputSpec, Preprocess, load_image

        pre, spec = Preprocess(mean=127, std=128), InputSpec("NCHW", 3, 224, 224)
        DATA.mkdir(exist_ok=True)
        for folder, path in ((REPO / "examples" / "calib", calib), (PHOTOS / "eval", held_out)):
            files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
            np.save(path, np.stack([load_image(f, pre, spec) for f in files]).astype(np.float32))
    if not calib.exists():
        raise SystemExit(f"{calib} is missing: run bench/models/{name}.py first")
    return np.load(calib), np.load(held_out)


def ort_outputs(model: onnx.ModelProto, x: np.ndarray, optimized: bool = False) -> np.ndarray:
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[k:k + 1]})[0] for k in range(len(x))])


def score(got: np.ndarray, ref: np.ndarray) -> str:
    a, b = got.reshape(len(got), -1).astype(np.float64), ref.reshape(len(ref), -1).astype(np.float64)
    cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return f"{cosine.mean():.5f} | {np.mean(a.argmax(1) == b.argmax(1)):.2f}"


def integer_outputs(graph, table, x: np.ndarray) -> np.ndarray:
    plan = prepare(graph, table)
    name, out = graph.inputs[0], graph.outputs[0]
    return np.concatenate([plan.run({name: x[k:k + 1]}).outputs[out] for k in range(len(x))])


class Reader:
    """onnxruntime's CalibrationDataReader over the calibration array."""

    def __init__(self, name: str, x: np.ndarray):
        self.feeds = iter([{name: x[k:k + 1]} for k in range(len(x))])

    def get_next(self):
        return next(self.feeds, None)


def ort_quantized(path: Path, calib: np.ndarray, method: str, out: Path) -> onnx.ModelProto:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = out.with_suffix(".pre.onnx")
    if not pre.exists():
        quant_pre_process(str(path), str(pre), skip_symbolic_shape=True)
    name = onnx.load(str(pre)).graph.input[0].name
    quantize_static(str(pre), str(out), Reader(name, calib), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=getattr(CalibrationMethod, method))
    return onnx.load(str(out))


def nncf_quantized(path: Path, calib_path: Path, preset: str, out: Path) -> onnx.ModelProto:
    subprocess.run([NNCF_PYTHON, "-c", NNCF_SCRIPT, str(path), str(calib_path), str(out), preset], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return onnx.load(str(out))


def bench(name: str, calibrators: list[str], peers: bool) -> list[str]:
    path = model_path(name)
    calib, held_out = arrays(name)
    model = onnx.load(str(path))
    ref = ort_outputs(model, held_out)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        result = calibrate(str(path), calib, tmp)
        seconds = time.perf_counter() - start
        print(result.summary(), file=sys.stderr)
        rows.append(f"| {name} | ptq default (int) | {score(integer_outputs(result.graph, result.table, held_out), ref)}"
                    f" | {seconds:.1f} s |")
        qdq = onnx.load(str(result.qdq_path))
        for optimized in (False, True):
            rows.append(f"| {name} | ptq default (QDQ, ort opt {'on' if optimized else 'off'}) | "
                        f"{score(ort_outputs(qdq, held_out, optimized), ref)} | |")
        for calibrator in calibrators:
            start = time.perf_counter()
            result = calibrate(str(path), calib, tmp / calibrator, calibrator=calibrator)
            seconds = time.perf_counter() - start
            rows.append(f"| {name} | ptq {calibrator} (int) | "
                        f"{score(integer_outputs(result.graph, result.table, held_out), ref)} | {seconds:.1f} s |")
        if peers:
            for method in ("MinMax", "Percentile", "Entropy"):
                start = time.perf_counter()
                quantized = ort_quantized(path, calib, method, tmp / f"ort_{method}.onnx")
                rows.append(f"| {name} | onnxruntime {method} | {score(ort_outputs(quantized, held_out), ref)} | "
                            f"{time.perf_counter() - start:.1f} s |")
            calib_path = tmp / "calib.npy"
            np.save(calib_path, calib)
            for preset in ("default", "mixed"):
                start = time.perf_counter()
                quantized = nncf_quantized(path, calib_path, preset, tmp / f"nncf_{preset}.onnx")
                rows.append(f"| {name} | NNCF {preset} | {score(ort_outputs(quantized, held_out), ref)} | "
                            f"{time.perf_counter() - start:.1f} s |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="efficientnet_lite0,mobilenet_v3_small")
    parser.add_argument("--calibrators", default="", help="comma-separated calibrators to add as rows")
    parser.add_argument("--no-peers", action="store_true", help="ptq only (no onnxruntime quantizer, no NNCF)")
    args = parser.parse_args()
    print("| model | quantizer | cosine | top-1 agreement | time |")
    print("|---|---|---:|---:|---:|")
    for name in args.models.split(","):
        for row in bench(name, [c for c in args.calibrators.split(",") if c], not args.no_peers):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
