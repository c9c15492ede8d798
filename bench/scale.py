"""Benchmark: `--workers N` and `--ray` against one process, for `ptq report` and `ptq calibrate`.

    python bench/scale.py                        # EfficientNet-Lite0, 200 report images, 1 / 2 / N workers, Ray
    python bench/scale.py --images 60 --no-ray --kinds report   # quicker

The 200 images are the eval photos (../shared/assets/images/eval) plus mirrored and cropped copies written
to a temp folder (labels kept in the names). Every configuration runs in a fresh subprocess (`--one`), which
prints its wall time (model loading and worker start-up included: what a user waits for), its result's
digest (every configuration must print the same one), the merge time, and the peak RSS of the driver and of
its largest worker process (`ru_maxrss` of self and of the waited-for children). Memory flat in the number of
images is checked by the 2-worker report over a quarter of the images. The load average before and after
each run is printed: the machine is shared.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = REPO / "examples" / "efficientnet_lite0.onnx"
EVAL = Path(os.environ.get("PTQ_ASSETS", REPO.parent / "shared" / "assets")) / "images" / "eval"


def make_images(folder: Path, count: int) -> Path:
    """The eval photos, their mirror images and centre/corner crops, until `count` files."""
    from PIL import Image, ImageOps

    photos = sorted(EVAL.glob("*.jpg"))
    variants = [("orig", lambda im: im), ("flip", ImageOps.mirror)]
    for k, frac in enumerate((0.9, 0.8, 0.7, 0.6)):
        variants.append((f"crop{k}", lambda im, f=frac: im.crop((0, 0, int(im.width * f), int(im.height * f)))))
        variants.append((f"fcrop{k}", lambda im, f=frac: ImageOps.mirror(im).crop(
            (int(im.width * (1 - f)), int(im.height * (1 - f)), im.width, im.height))))
    written = 0
    for name, make in variants:
        for photo in photos:
            if written == count:
                return folder
            stem, label = photo.stem.rsplit("_", 1)
            with Image.open(photo) as im:
                make(im.convert("RGB")).save(folder / f"{stem}_{name}_{label}.jpg", quality=95)
            written += 1
    return folder


def one(argv: list[str]) -> None:
    """One configuration in this process: prints a JSON line."""
    kind, images, table, workers, ray = argv[0], argv[1], argv[2], int(argv[3]), argv[4] or None
    from ptq import parallel

    timings = {"merge": 0.0}
    start = time.perf_counter()
    if kind == "report":
        from ptq.core.graph import load_model
        from ptq.images import Preprocess
        from ptq.quant_table import load_quant_table
        from reports import evaluate_shards
        from reports.build import build_report
        from reports.evaluate import evaluate
        from reports.image_source import ImageSet

        merge = evaluate_shards.merge_evaluations

        def timed_merge(parts):
            t = time.perf_counter()
            ev = merge(parts)
            timings["merge"] += time.perf_counter() - t
            return ev

        evaluate_shards.merge_evaluations = timed_merge
        q = load_quant_table(table)
        image_set = ImageSet.from_folder(images, Preprocess(**q.options.preprocess))
        if workers == 1 and ray is None:
            ev = evaluate(load_model(str(MODEL), q.options.input_shapes), q, image_set, isolated_images=2)
        else:
            ev = evaluate_shards.sharded_evaluate(MODEL, q, image_set, workers=workers, ray=ray, isolated_images=2)
        result = json.dumps(build_report(ev, "m", "q").to_dict(), sort_keys=True)
        count = ev.images
    else:
        from calibrators.statistics import TensorStatistics
        from ptq.pipeline import calibrate

        merge_stats = TensorStatistics.merge

        def timed_merge_stats(self, other):
            t = time.perf_counter()
            merged = merge_stats(self, other)
            timings["merge"] += time.perf_counter() - t
            return merged

        TensorStatistics.merge = timed_merge_stats
        res = calibrate(MODEL, images, None, calibrator="3std", write_qdq=False, workers=workers, ray=ray)
        result, count = json.dumps(res.table.to_dict(), sort_keys=True), res.images_used
    seconds = time.perf_counter() - start
    print(json.dumps({
        "seconds": seconds, "images": count, "merge": timings["merge"],
        "digest": hashlib.sha256(result.encode()).hexdigest()[:12],
        "rss_driver_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "shards_per_worker": parallel.SHARDS_PER_WORKER,
    }))


def run(kind: str, images: Path, table: Path, workers: int, ray: str = "") -> dict:
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, __file__, "--one", kind, str(images), str(table), str(workers), ray],
                         check=True, capture_output=True, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["load"] = (load, os.getloadavg()[0])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=sorted({1, 2, os.cpu_count() or 2}))
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--kinds", nargs="+", choices=("report", "calibrate"), default=["report", "calibrate"])
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one(args.one)
    import importlib.util

    has_ray = not args.no_ray and importlib.util.find_spec("ray") is not None
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "full").mkdir()
        (tmp / "quarter").mkdir()
        full = make_images(tmp / "full", args.images)
        quarter = make_images(tmp / "quarter", args.images // 4)
        from ptq.pipeline import calibrate

        table = calibrate(MODEL, REPO / "examples" / "calib", tmp / "table", write_qdq=False).table_path
        configs = [(w, "") for w in args.workers] + ([(2, "local")] if has_ray else [])
        for kind in args.kinds:
            print(f"\n{kind}, {args.images} images (wall time includes model loading and worker start-up)")
            print(f"{'config':>10} {'s':>7} {'img/s':>7} {'speed-up':>8} {'merge s':>8} {'driver MB':>9} "
                  f"{'worker MB':>9} {'digest':>13} load before/after")
            base = None
            for workers, cluster in configs:
                row = run(kind, full, table, workers, cluster)
                base = base or row["seconds"]
                name = f"ray x{workers}" if cluster else f"{workers} worker{'s' if workers > 1 else ''}"
                print(f"{name:>10} {row['seconds']:7.1f} {row['images'] / row['seconds']:7.2f} "
                      f"{base / row['seconds']:7.2f}x {row['merge']:8.3f} {row['rss_driver_mb']:9.0f} "
                      f"{row['rss_worker_mb']:9.0f} {row['digest']:>13} {row['load'][0]:.1f}/{row['load'][1]:.1f}",
                      flush=True)
            if kind == "report":
                row = run(kind, quarter, table, 2)
                print(f"memory check, 2 workers over {row['images']} images: driver {row['rss_driver_mb']:.0f} MB, "
                      f"worker {row['rss_worker_mb']:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
