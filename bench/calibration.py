"""Benchmark: ptq calibration vs onnxruntime's `quantize_static` on the same model and photos.

    python bench/calibration.py                       # EfficientNet-Lite0, examples/calib, 20 vs 200 images

Every configuration runs in its own fresh subprocess, which reports its calibration wall time and its peak
RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`); small-set runs are repeated (`--repeat`) and the fastest
time is shown, since other processes share the machine; the parent then scores the QDQ model it wrote: mean
cosine of its logits to the float model's on the eval photos, with onnxruntime's graph optimizations off
(the QDQ graph's own arithmetic; see README, "Measuring accuracy") and on (onnxruntime's integer kernels).
The 200-image set is the calibration photos plus flipped, cropped and rotated copies in a temp dir.
Both tools get identical inputs: onnxruntime's data reader uses ptq's preprocessing, one image at a time.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ptq.data.images import InputSpec, Preprocess, find_files, load_image  # noqa: E402

PRE = Preprocess(mean=127, std=128)
SPEC = InputSpec("NCHW", 3, 224, 224)
PTQ_CALIBRATORS = ("extrema", "mean", "3std", "99.99percentile", "kld", "mse")
ORT_METHODS = ("MinMax", "Entropy", "Percentile")
# measured on EfficientNet-Lite0: onnxruntime's histogram calibrators keep every activation of every image
# (~60 MB per image; 70 MB leaves a margin); its MinMax folds each batch. Used to skip runs that would exhaust
# the machine's memory.
ORT_BYTES_PER_IMAGE = {"MinMax": 0.0, "Entropy": 70e6, "Percentile": 70e6, "Distribution": 70e6}


# ---------------------------------------------------------------- image sets


def augment(sources: list[Path], count: int, out: Path) -> list[Path]:
    """`count` images: the sources, then flipped / cropped / rotated variants of them, as JPEG files."""
    from PIL import Image, ImageOps

    variants = [
        lambda im: im,
        ImageOps.mirror,
        lambda im: im.crop((im.width // 10, im.height // 10, im.width * 9 // 10, im.height * 9 // 10)),
        lambda im: im.rotate(12, resample=Image.BILINEAR, expand=False),
        lambda im: ImageOps.mirror(im).rotate(-9, resample=Image.BILINEAR),
        lambda im: im.crop((0, 0, im.width * 3 // 4, im.height * 3 // 4)),
        lambda im: ImageOps.flip(im),
        lambda im: im.rotate(90, expand=True),
        lambda im: ImageOps.mirror(im.crop((im.width // 4, 0, im.width, im.height))),
    ]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(count):
        src, variant = sources[k % len(sources)], variants[(k // len(sources)) % len(variants)]
        with Image.open(src) as im:
            img = variant(ImageOps.exif_transpose(im).convert("RGB"))
        path = out / f"{k:03d}_{src.stem}.jpg"
        img.save(path, quality=92)
        paths.append(path)
    return paths


def image_dir(paths: list[Path], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for p in paths:
        (out / p.name).symlink_to(p.resolve())
    return out


# ---------------------------------------------------------------- workers (one per subprocess)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def work_ptq(cfg: dict) -> dict:
    from ptq.calibration.pipeline import calibrate

    start = time.perf_counter()
    result = calibrate(cfg["model"], cfg["images"], cfg["out"], calibrator=cfg["calibrator"],
                       symmetric=cfg.get("symmetric", False), preprocess=PRE)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "images": result.images_used, "qdq": str(result.qdq_path)}


def work_ort(cfg: dict) -> dict:
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType
    from onnxruntime.quantization import quantize_static

    files = find_files(cfg["images"])

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(files)

        def get_next(self):
            path = next(self.it, None)
            return None if path is None else {"input": load_image(path, PRE, SPEC)[None]}

    out = Path(cfg["out"]) / "ort.qdq.onnx"
    start = time.perf_counter()
    quantize_static(cfg["model"], str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=getattr(CalibrationMethod, cfg["method"]))
    return {"seconds": time.perf_counter() - start, "images": len(files), "qdq": str(out)}


def worker(cfg: dict) -> None:
    import logging

    logging.disable(logging.WARNING)
    result = work_ptq(cfg) if cfg["tool"] == "ptq" else work_ort(cfg)
    result["peak_rss_mb"] = peak_rss_mb()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_seconds"] = usage.ru_utime + usage.ru_stime
    print(json.dumps(result))


def run_config(cfg: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- accuracy


def logits(model_path: Path, x: np.ndarray, optimized: bool) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i : i + 1]})[0] for i in range(len(x))])


def mean_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def available_memory_bytes() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return float("inf")


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=str(REPO / "examples" / "efficientnet_lite0.onnx"))
    parser.add_argument("--images", default=str(REPO / "examples" / "calib"))
    parser.add_argument("--eval", default=str(REPO.parent / "shared" / "assets" / "images" / "eval"))
    parser.add_argument("--small", type=int, default=20)
    parser.add_argument("--large", type=int, default=200)
    parser.add_argument("--calibrators", default=",".join(PTQ_CALIBRATORS))
    parser.add_argument("--ort-methods", default=",".join(ORT_METHODS))
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each small-set configuration; the table shows the fastest (the machine is shared)")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    eval_files = sorted(Path(args.eval).glob("*.jpg"))
    x_eval = np.stack([load_image(f, PRE, SPEC) for f in eval_files])
    ref = logits(Path(args.model), x_eval, optimized=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ptq-bench-") as tmp:
        tmp = Path(tmp)
        sources = find_files(args.images)
        sets = {
            args.small: image_dir(sources[: args.small], tmp / "small"),
            args.large: image_dir(augment(sources, args.large, tmp / "augmented"), tmp / "large"),
        }
        configs = []
        for name in args.calibrators.split(","):
            configs += [("ptq", name, n, {"tool": "ptq", "calibrator": name}) for n in sets]
        for method in args.ort_methods.split(","):
            for n in sets:
                configs.append(("onnxruntime", method, n, {"tool": "ort", "method": method}))
        for k, (tool, name, n, cfg) in enumerate(configs):
            out = tmp / f"out{k}"
            out.mkdir()
            cfg.update(model=args.model, images=str(sets[n]), out=str(out))
            need = n * ORT_BYTES_PER_IMAGE.get(name, 70e6) if tool == "onnxruntime" else 0.0
            if need > 0.5 * available_memory_bytes():
                rows.append({"tool": tool, "calibrator": name, "images": n, "skipped": f"not run (~{need / 1e9:.0f} GB)"})
                print(f"skipping {tool} {name} on {n} images: needs ~{need / 1e9:.0f} GB", file=sys.stderr)
                continue
            print(f"[{k + 1}/{len(configs)}] {tool} {name} on {n} images ...", file=sys.stderr, flush=True)
            runs = [run_config(cfg) for _ in range(args.repeat if n == args.small else 1)]
            res = min(runs, key=lambda r: r["seconds"])
            res["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
            row = {"tool": tool, "calibrator": name, "images": res["images"], "seconds": res["seconds"],
                   "cpu_seconds": res["cpu_seconds"], "peak_rss_mb": res["peak_rss_mb"]}
            if n == args.small:
                row["cosine"] = mean_cosine(ref, logits(Path(res["qdq"]), x_eval, optimized=False))
                row["cosine_ort_kernels"] = mean_cosine(ref, logits(Path(res["qdq"]), x_eval, optimized=True))
            rows.append(row)
    print_table(rows, args.small, args.large)
    return 0


def print_table(rows: list[dict], small: int, large: int) -> None:
    by_key = {(r["tool"], r["calibrator"], r["images"]): r for r in rows}
    header = (f"| tool | calibrator | wall time, {small} img (s) | CPU time (s) | peak RSS, {small} img (MB) "
              f"| peak RSS, {large} img (MB) | RSS ratio | cosine | cosine, ORT int kernels |")
    print(header)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["images"] != small:
            continue
        big = by_key.get((r["tool"], r["calibrator"], large), {})
        big_rss = big.get("peak_rss_mb")
        ratio = f"{big_rss / r['peak_rss_mb']:.2f}x" if big_rss else "-"
        big_text = f"{big_rss:.0f}" if big_rss else big.get("skipped", "-")
        print(f"| {r['tool']} | {r['calibrator']} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | {r['peak_rss_mb']:.0f} "
              f"| {big_text} | {ratio} "
              f"| {r['cosine']:.4f} | {r['cosine_ort_kernels']:.4f} |")
    ratios = [by_key[("ptq", r["calibrator"], large)]["peak_rss_mb"] / r["peak_rss_mb"]
              for r in rows if r["tool"] == "ptq" and r["images"] == small and ("ptq", r["calibrator"], large) in by_key]
    if ratios:
        verdict = "flat" if max(ratios) <= 1.2 else "NOT flat"
        print(f"\nptq peak RSS, {large} vs {small} images: at most {max(ratios):.2f}x ({verdict}: limit 1.2x)")


if __name__ == "__main__":
    sys.exit(main())
