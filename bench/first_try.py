"""A user's first try: `ptq calibrate` with no accuracy flag beside NNCF's and onnxruntime's default quantizers,
on four model families, every tool fed the same arrays.

    python bench/first_try.py [--models efficientnet_lite0,mobilenet_v3_small,dbnet_detector,char_tagger]
                              [--calibrators extrema,mse,kld] [--eval N] [--no-peers] [--lite0-crops N]

Models and arrays (the arrays are written by the build scripts under bench/models/, or here):
- efficientnet_lite0 (the bundled model): the 23 calibration photos and the 20 labelled eval photos,
  preprocessed as `ptq calibrate` does (mean 127, std 128, 224x224); `--lite0-crops N`: held out instead N
  crops of the 20 eval photos (`lite0_crops`, drawn as MobileNetV3-small's 200; the 20 photos cannot tell
  calibrators 5e-4 apart: `bench/range_jitter.py` moves the cosine by 6e-4 shrinking one tensor's range by 1%);
- mobilenet_v3_small (BatchNormalizations kept, hard-swish, squeeze-excitation with hard-sigmoid gates):
  `bench/models/mobilenet_v3_small.py` writes `data/mobilenet_v3_small_calib.npy` (32 crops of the calibration
  photos); held out: 200 crops of the 20 eval photos (`held_out_crops`, seed 1; the 40 the build script writes
  are too few to tell 1e-4 apart: there NNCF led extrema by 1.4e-4, on the 200 it trails by 0.9e-4);
- dbnet_detector (Paddle-style DBNet text detector, opset 11, hard-swish/SE backbone, Conv biases in Adds):
  `bench/models/make_samples.py` writes `data/dbnet/{calib,eval}/NNN.npy` (32 calibration, the first `--eval`
  eval pages);
- char_tagger (a transformer encoder: attention with an additive mask, LayerNormalization, GELU; ArgMax tags):
  the committed `char_tagger_data/{calib,eval}/NNN.npz`;
- gelu_classifier (tf2onnx-style token MLP with written-out LayerNorm/GELU and outlier features): by name.

Figures on the held-out arrays, against the float model in onnxruntime: the mean cosine of the first output and,
for a classifier, top-1 agreement; for the tagger (index output) the agreement of its tags on real positions.

Rows:
- ptq int: `ptq.calibration.pipeline.calibrate(model, data=calib_files)` with its defaults (what
  `ptq calibrate MODEL --data DIR` does), run by ptq's integer executor; ptq QDQ: the QDQ model it writes, in
  onnxruntime with graph optimizations off and on. `--calibrators` adds rows for named calibrators (int run).
- onnxruntime: `quantize_static` QDQ, per-channel int8 weights, uint8 activations, MinMax / Percentile /
  Entropy calibration, optimizations off (opset-11 models converted to 13, where per-axis QDQ exists).
- NNCF 3.4.0 (`/work/nncfenv`, a subprocess): `nncf.quantize` with default settings (preset performance:
  symmetric activations), and with `preset=MIXED` (asymmetric activations); per-channel weights;
  optimizations off.
A summary table follows: per model ptq int, ptq QDQ (off / on), the best onnxruntime row and the best NNCF row.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench" / "models")]

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import version_converter  # noqa: E402

import mobilenet_v3_small  # noqa: E402
from make_samples import write_samples  # noqa: E402
from ptq.calibration.pipeline import calibrate  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402

MODELS = REPO / "bench" / "models"
DATA = MODELS / "data"
NNCF_PYTHON = "/work/nncfenv/bin/python"
PHOTOS = next((p / "shared" / "assets" / "images" for p in REPO.parents if (p / "shared" / "assets").is_dir()),
              Path("/work/shared/assets/images"))  # the main checkout's or a worktree's shared folder
MOBILENET_HELD_OUT = 200
DEFAULT_MODELS = "efficientnet_lite0,mobilenet_v3_small,dbnet_detector,char_tagger"

NNCF_SCRIPT = """
import sys, numpy as np, onnx, nncf
model, out, preset = onnx.load(sys.argv[1]), sys.argv[2], sys.argv[3]
samples = [dict(np.load(f)) for f in sys.argv[4:]]
kwargs = {} if preset == "default" else {"preset": nncf.QuantizationPreset.MIXED}
onnx.save(nncf.quantize(model, nncf.Dataset(samples), subset_size=len(samples), **kwargs), out)
"""

Feeds = dict[str, np.ndarray]


@dataclass
class Samples:
    """A model's calibration and held-out feeds."""

    calib: list[Feeds]
    held_out: list[Feeds]


def model_path(name: str) -> Path:
    return REPO / "examples" / "efficientnet_lite0.onnx" if name == "efficientnet_lite0" else MODELS / f"{name}.onnx"


def input_name(path: Path) -> str:
    return onnx.load(str(path), load_external_data=False).graph.input[0].name


def split(x: np.ndarray, name: str) -> list[Feeds]:
    return [{name: x[k:k + 1]} for k in range(len(x))]


def photo_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The bundled model's calibration and eval photos, preprocessed as `ptq calibrate` does (cached in data/)."""
    from ptq.data.images import InputSpec, Preprocess, load_image  # reason: only the bundled model needs photos

    calib, held_out = DATA / "efficientnet_lite0_calib.npy", DATA / "efficientnet_lite0_eval.npy"
    if not calib.exists():
        pre, spec = Preprocess(mean=127, std=128), InputSpec("NCHW", 3, 224, 224)
        DATA.mkdir(exist_ok=True)
        for folder, path in ((REPO / "examples" / "calib", calib), (PHOTOS / "eval", held_out)):
            files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
            np.save(path, np.stack([load_image(f, pre, spec) for f in files]).astype(np.float32))
    return np.load(calib), np.load(held_out)


def lite0_crops(count: int, seed: int = 1) -> np.ndarray:
    """`count` 224x224 crops of the 20 eval photos (`count // 20` per photo; side 0.5-0.9 of the shorter edge,
    nearest-neighbour, as `mobilenet_v3_small.crop` draws held-out crops), preprocessed as `ptq calibrate` does."""
    held_out = mobilenet_v3_small.photos(PHOTOS / "eval", DATA / "eval_photos.npz")
    rng = np.random.default_rng(seed)
    per_photo = max(1, count // len(held_out))
    out = []
    for k in range(per_photo * len(held_out)):
        photo = held_out[k // per_photo]
        h, w = photo.shape[:2]
        side = int(min(h, w) * rng.uniform(0.5, 0.9))
        y, x = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
        idx = ((np.arange(224) + 0.5) * side / 224).astype(int)
        patch = photo[y + idx][:, x + idx].astype(np.float32)
        out.append(((patch - 127.0) / 128.0).transpose(2, 0, 1))
    return np.stack(out).astype(np.float32)


def folder_feeds(folder: Path, name: str, limit: int = 0) -> list[Feeds]:
    files = sorted(p for p in folder.iterdir() if p.suffix in (".npy", ".npz"))[: limit or None]
    return [dict(np.load(f)) if f.suffix == ".npz" else {name: np.load(f).astype(np.float32)} for f in files]


def samples(name: str, eval_limit: int, lite0_crops_count: int = 0) -> Samples:
    path = model_path(name)
    if name == "efficientnet_lite0":
        calib, held_out = photo_arrays()
        if lite0_crops_count:
            held_out = lite0_crops(lite0_crops_count)
        return Samples(split(calib, input_name(path)), split(held_out, input_name(path)))
    if name == "dbnet_detector":
        folders = write_samples(DATA)["dbnet"]
        return Samples(folder_feeds(folders["calib"], input_name(path)),
                       folder_feeds(folders["eval"], input_name(path), eval_limit))
    if (MODELS / f"{name}_data").is_dir():
        data = MODELS / f"{name}_data"
        return Samples(folder_feeds(data / "calib", input_name(path)),
                       folder_feeds(data / "eval", input_name(path), eval_limit))
    calib, held_out = DATA / f"{name}_calib.npy", DATA / f"{name}_eval.npy"
    if not calib.exists():
        raise SystemExit(f"{calib} is missing: run bench/models/{name}.py first")
    if name == "mobilenet_v3_small":  # 200 held-out crops instead of the build script's 40 (its docstring)
        held_out = DATA / f"{name}_eval{MOBILENET_HELD_OUT}.npy"
        if not held_out.exists():
            np.save(held_out, mobilenet_v3_small.held_out_crops(MOBILENET_HELD_OUT))
    return Samples(split(np.load(calib), input_name(path)), split(np.load(held_out), input_name(path)))


def session(model: onnx.ModelProto, optimized: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not optimized:  # the arithmetic the QDQ graph describes
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ort_outputs(model: onnx.ModelProto, feeds: list[Feeds], optimized: bool = False) -> list[np.ndarray]:
    s = session(model, optimized)
    return [s.run(None, f)[0] for f in feeds]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    den = np.sqrt((a @ a) * (b @ b))
    return float(a @ b / den) if den else float(not a.any() and not b.any())


@dataclass
class Score:
    """Mean first-output cosine (None for an index output) and agreement (top-1, or tags on real positions)."""

    cosine: float | None
    agreement: float | None

    def key(self) -> float:
        return self.cosine if self.cosine is not None else self.agreement

    def cells(self) -> str:
        return " | ".join("—" if v is None else f"{v:.6f}" for v in (self.cosine, self.agreement))


def score(got: list[np.ndarray], ref: list[np.ndarray], feeds: list[Feeds]) -> Score:
    if np.issubdtype(ref[0].dtype, np.integer):  # tags: agreement on the real (unmasked) positions
        agree = counted = 0
        for g, r, f in zip(got, ref, feeds):
            real = f["attention_mask"].astype(bool) if "attention_mask" in f else np.ones(r.shape, bool)
            agree, counted = agree + np.count_nonzero(g[real] == r[real]), counted + np.count_nonzero(real)
        return Score(None, agree / max(counted, 1))
    mean_cos = float(np.mean([cosine(g, r) for g, r in zip(got, ref)]))
    is_classifier = ref[0].ndim == 2 and ref[0].shape[1] > 1
    top1 = float(np.mean([g.argmax() == r.argmax() for g, r in zip(got, ref)])) if is_classifier else None
    return Score(mean_cos, top1)


def integer_outputs(graph, table, feeds: list[Feeds]) -> list[np.ndarray]:
    plan = prepare(graph, table)
    out = graph.outputs[0]
    return [plan.run(f, keep_all=False).outputs[out] for f in feeds]


def write_feeds(feeds: list[Feeds], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"{k:03d}.npz" for k in range(len(feeds))]
    for f, sample in zip(files, feeds):
        np.savez(f, **sample)
    return files


def opset13(path: Path, tmp: Path) -> Path:
    """The model at opset 13 or above: per-axis QDQ (per-channel weights) needs 13; an opset-11 model is
    converted (`onnx.version_converter`) for the peers, as bench/detectors.py does."""
    loaded = onnx.load(str(path))
    if next(o.version for o in loaded.opset_import if o.domain in ("", "ai.onnx")) >= 13:
        return path
    converted = tmp / f"{path.stem}.opset13.onnx"
    onnx.save(version_converter.convert_version(loaded, 13), str(converted))
    return converted


class Reader:
    """onnxruntime's CalibrationDataReader over the calibration feeds."""

    def __init__(self, feeds: list[Feeds]):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


def ort_quantized(path: Path, calib: list[Feeds], method: str, out: Path) -> onnx.ModelProto:
    from onnxruntime.quantization import (  # reason: peers only (--no-peers skips them)
        CalibrationMethod, QuantFormat, QuantType, quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process  # reason: as above

    pre = out.parent / f"{path.stem}.pre.onnx"
    if not pre.exists():
        quant_pre_process(str(opset13(path, out.parent)), str(pre), skip_symbolic_shape=True)
    quantize_static(str(pre), str(out), Reader(calib), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=getattr(CalibrationMethod, method))
    return onnx.load(str(out))


def nncf_quantized(path: Path, calib_files: list[Path], preset: str, out: Path) -> onnx.ModelProto:
    subprocess.run([NNCF_PYTHON, "-c", NNCF_SCRIPT, str(opset13(path, out.parent)), str(out), preset,
                    *map(str, calib_files)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return onnx.load(str(out))


@dataclass
class Row:
    quantizer: str
    score: Score
    seconds: float | None = None


def bench(name: str, calibrators: list[str], peers: bool, eval_limit: int, lite0_crops_count: int = 0) -> list[Row]:
    path = model_path(name)
    data = samples(name, eval_limit, lite0_crops_count)
    model = onnx.load(str(path))
    ref = ort_outputs(model, data.held_out, optimized=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        calib_files = write_feeds(data.calib, tmp / "calib")
        for calibrator in ["default", *calibrators]:
            kwargs = {} if calibrator == "default" else {"calibrator": calibrator}
            start = time.perf_counter()
            result = calibrate(str(path), data=calib_files, out_dir=tmp / calibrator, **kwargs)
            seconds = time.perf_counter() - start
            if calibrator == "default":
                print(result.summary(), file=sys.stderr)
            got = integer_outputs(result.graph, result.table, data.held_out)
            rows.append(Row(f"ptq {calibrator} (int)", score(got, ref, data.held_out), seconds))
            if calibrator == "default":
                qdq = onnx.load(str(result.qdq_path))
                for optimized in (False, True):
                    rows.append(Row(f"ptq default (QDQ, ort opt {'on' if optimized else 'off'})",
                                    score(ort_outputs(qdq, data.held_out, optimized), ref, data.held_out)))
        if peers:
            for method in ("MinMax", "Percentile", "Entropy"):
                start = time.perf_counter()
                try:
                    quantized = ort_quantized(path, data.calib, method, tmp / f"ort_{method}.onnx")
                except ValueError as exc:  # Entropy's histogram of an additive mask's -3.4e38 has no bins
                    print(f"{name}: onnxruntime {method} failed: {exc}", file=sys.stderr)
                    continue
                rows.append(Row(f"onnxruntime {method}", score(ort_outputs(quantized, data.held_out), ref,
                                                               data.held_out), time.perf_counter() - start))
            for preset in ("default", "mixed"):
                start = time.perf_counter()
                quantized = nncf_quantized(path, calib_files, preset, tmp / f"nncf_{preset}.onnx")
                rows.append(Row(f"NNCF {preset}", score(ort_outputs(quantized, data.held_out), ref, data.held_out),
                                time.perf_counter() - start))
    return rows


def best(rows: list[Row], prefix: str) -> str:
    peers = [r for r in rows if r.quantizer.startswith(prefix)]
    if not peers:
        return "—"
    top = max(peers, key=lambda r: r.score.key())
    return f"{top.score.key():.6f} ({top.quantizer.split()[-1]})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--calibrators", default="", help="comma-separated calibrators to add as rows")
    parser.add_argument("--eval", type=int, default=0, help="held-out samples per model at most (default 0: all)")
    parser.add_argument("--no-peers", action="store_true", help="ptq only (no onnxruntime quantizer, no NNCF)")
    parser.add_argument("--lite0-crops", type=int, default=0,
                        help="efficientnet_lite0 held out: N crops of the eval photos (default 0: the 20 photos)")
    args = parser.parse_args()
    print("| model | quantizer | cosine | agreement | time |")
    print("|---|---|---:|---:|---:|")
    results = {}
    for name in args.models.split(","):
        results[name] = bench(name, [c for c in args.calibrators.split(",") if c], not args.no_peers, args.eval,
                              args.lite0_crops)
        for row in results[name]:
            seconds = "" if row.seconds is None else f"{row.seconds:.1f} s"
            print(f"| {name} | {row.quantizer} | {row.score.cells()} | {seconds} |", flush=True)
    print("\nFigure: first-output cosine (tags: agreement on real positions)")
    print("| model | ptq int | ptq QDQ (ort opt off / on) | onnxruntime best | NNCF best | ptq calibrate time |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rows in results.items():
        by = {r.quantizer: r for r in rows}
        qdq = " / ".join(f"{by[f'ptq default (QDQ, ort opt {o})'].score.key():.6f}" for o in ("off", "on"))
        default = by["ptq default (int)"]
        print(f"| {name} | {default.score.key():.6f} | {qdq} | {best(rows, 'onnxruntime')} | {best(rows, 'NNCF')} "
              f"| {default.seconds:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
