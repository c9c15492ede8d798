"""Benchmark: `--workers N` and `--ray` against one process, for `ptq report`, `ptq calibrate` and `ptq tune`.

    python bench/scale.py                     # report over 200 images: 1, 2, 1, 2 workers, interleaved
    python bench/scale.py --repeat 3 --kinds report calibrate --ray --memory
    python bench/scale.py --images 60 --repeat 1     # quicker
    python bench/scale.py --variants threads lean uniform   # also 2 workers with helper threads on / off, equal shards
    python bench/scale.py --kinds tune        # tune to 0.998 on the 23 bundled photos (16 fitted, 7 deciding)
    python bench/scale.py --images 60 --repeat 1 --costs   # and a worker's costs, projected to 1,000 images

`tune` tunes the table calibrated on examples/calib on those same images (`--images` does not apply); its
img/s counts the validation images scored (the validation samples times the candidates measured).

The 200 images are the eval photos (../shared/assets/images/eval) plus mirrored and cropped copies written
to a temp folder (labels kept in the names). Every run is a fresh subprocess (`--one`). Its wall time is
taken from outside (interpreter start and exit, imports, model loading, worker start-up and shut-down: what a
user waits for) and its CPU time is the user + system time of the process and of its worker processes
(rusage of the waited-for children). The configurations are interleaved (1, 2, 1, 2, ...) and each one's
median is printed, with the load average at the start of each run: the machine is shared, and a run's
wall time depends on how busy it is. Each run also prints its result's digest (every configuration must
print the same one), the merge time in the driver, the peak RSS of the driver and of its largest worker, and
how its workers started (`fork` or `spawn`, `ptq.parallel.workers.start_method`). The report is computed as `ptq report`
computes it: the driver loads the model and hands it to `sharded_evaluate` (forked workers inherit it).

The CPU columns are steadier than the wall times: `cpu/img` is the CPU time per image (start-up included),
`cpu ratio` the CPU time of the configuration over that of one process (the CPU the workers add: start-up,
merge), and `cores` the CPU time over the wall time (how many cores the run kept busy).

`--costs` (for more cores than this machine has): one more report on the same images with forked workers, each
worker's shards timed in CPU, gives the driver's start, a worker's fixed cost (its first shard beyond its
images: numba's target and kernels, the float session, the integer graph), the CPU per image and per shard
(a line through the later shards) and the merge per image; `project` adds them up for 1,000 images on
1/4/8/15 workers, each worker on a core of its own and the driver idle meanwhile (efficiency: the images' CPU
over workers x wall). A projection from CPU times measured here: it assumes the bigger machine's cores run
as fast as these and that the workers do not slow each other down (memory bandwidth, shared caches). One `ptq report` process already keeps about 1.7 cores busy when it has two
to itself (its float and metric threads overlap the integer graph), so on C idle cores N workers can at best
take cpu_ratio x cores_1 / min(N, C) of its time: 0.86 x cpu_ratio for 2 workers on 2 cores.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = REPO / "examples" / "efficientnet_lite0.onnx"
EVAL = Path(os.environ.get("PTQ_ASSETS", REPO.parent / "shared" / "assets")) / "images" / "eval"
CALIB = REPO / "examples" / "calib"
TUNE_TARGET = 0.998


def make_images(folder: Path, count: int) -> Path:
    """The eval photos, their mirror images and corner crops (six sizes, each corner of the photo and of its
    mirror image: 50 views of each photo, 1,000 of the 20), until `count` files."""
    from PIL import Image, ImageOps

    photos = sorted(EVAL.glob("*.jpg"))
    variants = [("orig", lambda im: im), ("flip", ImageOps.mirror)]
    for k, frac in enumerate((0.9, 0.8, 0.7, 0.6, 0.85, 0.75)):
        for corner in range(4):
            right, bottom = corner % 2, corner // 2
            crop = lambda im, f=frac, r=right, b=bottom: im.crop(
                (int(im.width * (1 - f)) * r, int(im.height * (1 - f)) * b,
                 im.width - int(im.width * (1 - f)) * (1 - r), im.height - int(im.height * (1 - f)) * (1 - b)))
            variants.append((f"crop{k}{corner}", crop))
            variants.append((f"fcrop{k}{corner}", lambda im, c=crop: c(ImageOps.mirror(im))))
    if count > len(variants) * len(photos):
        raise SystemExit(f"--images {count}: at most {len(variants) * len(photos)} views of the {len(photos)} eval photos")
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
    kind, images, table, workers, ray, variant = argv[0], argv[1], argv[2], int(argv[3]), argv[4] or None, argv[5]
    if kind == "costs":
        print(json.dumps(worker_costs(Path(images), table, workers)))
        return
    from ptq.parallel import workers as parallel
    from reports import evaluate_shards

    if variant in ("threads", "lean"):  # the report workers' helper threads forced on or off (forked workers see it)
        evaluate_shards.worker_threads = lambda workers, ray: variant == "threads"
    elif variant == "uniform":  # the shards of `shard_batches_for` (8 per worker) instead of shrinking ones
        evaluate_shards.guided_shard_batches = parallel.shard_batches_for

    timings = {"merge": 0.0}
    methods: list[str] = []
    pool_exit = parallel.LocalPool.__exit__

    def recorded_exit(pool, *exc):
        methods.extend(pool.methods)
        return pool_exit(pool, *exc)

    parallel.LocalPool.__exit__ = recorded_exit
    start = time.perf_counter()
    if kind == "report":
        from ptq.core.graph import load_model
        from ptq.data.images import Preprocess
        from ptq.table.quant_table import load_quant_table
        from reports.build import build_report
        from reports.evaluate import evaluate
        from ptq.data.image_source import ImageSet

        merge = evaluate_shards.merge_evaluations

        def timed_merge(parts):
            t = time.perf_counter()
            ev = merge(parts)
            timings["merge"] += time.perf_counter() - t
            return ev

        evaluate_shards.merge_evaluations = timed_merge
        q = load_quant_table(table)
        image_set = ImageSet.from_folder(images, Preprocess(**q.options.preprocess))
        graph = load_model(str(MODEL), q.options.input_shapes)
        if workers == 1 and ray is None:
            ev = evaluate(graph, q, image_set, isolated_images=2)
        else:  # as `ptq report` calls it: the loaded model is given (forked workers inherit it)
            ev = evaluate_shards.sharded_evaluate(graph.model, q, image_set, workers=workers, ray=ray,
                                                  isolated_images=2, graph=graph)
        result = json.dumps(build_report(ev, "m", "q").to_dict(), sort_keys=True)
        count = ev.images
    elif kind == "tune":
        from ptq.core.graph import load_model
        from ptq.data.images import Preprocess
        from ptq.table.quant_table import load_quant_table
        from ptq.tuning.tuner import tune
        from ptq.data.image_source import ImageSet

        q = load_quant_table(table)
        samples = ImageSet.from_folder(images, Preprocess(**q.options.preprocess))
        res = tune(load_model(str(MODEL), q.options.input_shapes), q, samples, TUNE_TARGET, workers=workers, ray=ray)
        result = json.dumps([res.table.to_dict(), res.to_dict()], sort_keys=True)
        count = res.validation_samples * (len(res.steps) + 1)
    else:
        from calibrators.statistics import TensorStatistics
        from ptq.calibration.pipeline import calibrate

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
        "inner_seconds": seconds, "images": count, "merge": timings["merge"],
        "digest": hashlib.sha256(result.encode()).hexdigest()[:12],
        "rss_driver_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "shards_per_worker": parallel.SHARDS_PER_WORKER, "start": "+".join(methods) or "-",
    }))


def worker_costs(images: Path, table: str, workers: int) -> dict:
    """In this process (a fresh one): a `ptq report` over `images` on `workers` forked workers, as `ptq report`
    runs it, with each worker's shards timed in CPU (a forked worker's CPU clock starts at zero), and the
    driver's steps. Returns the costs `project` needs, in CPU seconds:
    driver: before the workers start (imports, table, model, images listed); image: a worker's CPU per image
    and shard: per shard (a line fitted through the shards after each worker's first); worker_fixed: what a
    worker spends beyond that on its first shard (numba's target and cached kernels, the float session, the
    integer graph); merge: the driver's merge per image (timed again on the run's parts repeated to 1,000
    images); after: the report built and written."""
    import multiprocessing
    import pickle

    from ptq.api import write_report
    from ptq.core.graph import load_model
    from ptq.data.image_source import ImageSet
    from ptq.data.images import Preprocess
    from ptq.table.quant_table import load_quant_table
    from reports import evaluate_shards
    from reports.build import build_report

    cpu = time.process_time
    events = multiprocessing.get_context("fork").SimpleQueue()  # forked workers inherit it, and the patches
    job_run = evaluate_shards.ReportJob.run

    def timed_run(job, context, item):
        start = cpu()
        result = job_run(job, context, item)
        events.put((os.getpid(), start, cpu(), item[1].images))
        return result

    evaluate_shards.ReportJob.run = timed_run
    parts: list = []
    merge = evaluate_shards.merge_evaluations
    evaluate_shards.merge_evaluations = lambda shards: (parts.extend(shards), merge(shards))[1]
    q = load_quant_table(table)
    image_set = ImageSet.from_folder(images, Preprocess(**q.options.preprocess))
    graph = load_model(str(MODEL), q.options.input_shapes)
    driver = cpu()
    ev = evaluate_shards.sharded_evaluate(graph.model, q, image_set, workers=workers, isolated_images=2, graph=graph)
    ran = cpu()
    with tempfile.TemporaryDirectory() as out:
        write_report(build_report(ev, "m", "q"), Path(out))
    after = cpu() - ran
    shards: dict[int, list] = {}
    while not events.empty():
        pid, start, end, count = events.get()
        shards.setdefault(pid, []).append((start, end, count))
    later = [(end - start, count) for runs in shards.values() for start, end, count in sorted(runs)[1:]]
    n, sx, sy = len(later), sum(c for _, c in later), sum(t for t, _ in later)
    sxx, sxy = sum(c * c for _, c in later), sum(t * c for t, c in later)
    image = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    shard = max(0.0, (sy - image * sx) / n)
    firsts = [sorted(runs)[0] for runs in shards.values()]
    worker_fixed = statistics.mean(end - count * image - shard for _, end, count in firsts)
    repeats = -(-1000 // ev.images)
    start = cpu()
    merge(parts * repeats)
    merge_per_image = (cpu() - start) / (ev.images * repeats)
    return {"images": ev.images, "workers": workers, "driver": driver, "image": image, "shard": shard,
            "worker_fixed": worker_fixed, "merge": merge_per_image, "after": after,
            "pickled_per_image": sum(len(pickle.dumps(p)) for p in parts) / ev.images,
            "shards": sum(len(r) for r in shards.values())}


def project(costs: dict, images: int, workers: int) -> tuple[float, float]:
    """(wall seconds, parallel efficiency) of a `ptq report` over `images` on `workers` workers, each on a core
    of its own, from the measured CPU costs: the driver's start, a worker's fixed cost, its share of the images
    and of the shards (`ptq.parallel.workers.guided_shard_batches`), the last shard's wait (one image), the merge
    and what follows it. Efficiency: the images' CPU over workers x wall."""
    from ptq.parallel.workers import guided_shard_batches

    shards = len(guided_shard_batches(images, 1, workers))
    work = images * costs["image"] + shards * costs["shard"]
    wall = (costs["driver"] + costs["worker_fixed"] + work / workers + costs["image"] + images * costs["merge"]
            + costs["after"])
    return wall, images * costs["image"] / (workers * wall)


def run(kind: str, images: Path, table: Path, workers: int, ray: str = "", variant: str = "") -> dict:
    """One configuration in a fresh subprocess: its JSON line, with the wall time and CPU time measured here."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--one", kind, str(images), str(table), str(workers), ray, variant],
                         check=True, capture_output=True, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(seconds=wall, load=load, cpu=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    return row


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def config_name(workers: int, cluster: str, variant: str = "") -> str:
    name = f"ray x{workers}" if cluster else f"{workers} worker{'s' if workers > 1 else ''}"
    return f"{name} {variant}" if variant else name


def print_costs(images: Path, table: Path, workers: int) -> None:
    """`worker_costs` in a fresh process, and the projection it gives (`project`)."""
    out = subprocess.run([sys.executable, __file__, "--one", "costs", str(images), str(table), str(workers), "", ""],
                         check=True, capture_output=True, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    costs = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\ncosts, CPU seconds ({costs['workers']} forked workers, {costs['images']} images, "
          f"{costs['shards']} shards): "
          f"driver before the workers {costs['driver']:.3f}, per worker {costs['worker_fixed']:.3f} (its first shard "
          f"beyond the images), per image {costs['image']:.4f}, per shard {costs['shard']:.4f}, merge per image "
          f"{costs['merge'] * 1e3:.3f} ms ({costs['pickled_per_image'] / 1e3:.0f} kB pickled per image), after the "
          f"merge {costs['after']:.3f}")
    print("projected `ptq report` on 1,000 images, each worker on a core of its own (driver + worker start + "
          "images/workers + shards/workers + last image + merge + report):")
    print(f"{'workers':>8} {'wall s':>7} {'speed-up':>8} {'efficiency':>10}")
    one, _ = project(costs, 1000, 1)
    for workers in (1, 4, 8, 15):
        wall, efficiency = project(costs, 1000, workers)
        print(f"{workers:8d} {wall:7.1f} {one / wall:8.2f} {efficiency:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds over the configurations (default 2)")
    parser.add_argument("--ray", action="store_true", help="also a local Ray cluster of 2 worker processes")
    parser.add_argument("--memory", action="store_true", help="also the 2-worker report over a quarter of the images")
    parser.add_argument("--kinds", nargs="+", choices=("report", "calibrate", "tune"), default=["report"])
    parser.add_argument("--variants", nargs="+", choices=("threads", "lean", "uniform"), default=[],
                        help="also 2 workers with their helper threads on (threads) or off (lean) whatever the cores, "
                        "or with 8 equal shards per worker (uniform)")
    parser.add_argument("--costs", action="store_true",
                        help="also measure a worker's fixed cost, the CPU per image and shard, the merge, and project "
                        "the report's wall time and efficiency on 1,000 images and 1/4/8/15 workers")
    parser.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one(args.one)
    import importlib.util

    if args.ray and importlib.util.find_spec("ray") is None:
        parser.error("--ray needs Ray: pip install 'ptq[ray]'")
    print(f"{os.cpu_count()} cores, load average {tuple(round(x, 2) for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "full").mkdir()
        full = make_images(tmp / "full", args.images) if set(args.kinds) - {"tune"} else None
        from ptq.calibration.pipeline import calibrate

        table = calibrate(MODEL, CALIB, tmp / "table", write_qdq=False).table_path
        configs = ([(w, "", "") for w in args.workers] + [(2, "", v) for v in args.variants]
                   + ([(2, "local", "")] if args.ray else []))
        for kind in args.kinds:
            images = CALIB if kind == "tune" else full
            run(kind, images, table, 1)  # not counted: compiles the kernels if numba's cache is cold
            print(f"\n{kind}, {len(list(images.iterdir()))} images, {args.repeat} interleaved rounds")
            print(f"{'config':>17} {'wall s':>7} {'img/s':>6} {'cpu s':>6} {'cpu/img':>7} {'cores':>5} {'merge s':>7} "
                  f"{'driver MB':>9} {'worker MB':>9} {'digest':>13} {'start':>5} {'load':>5}")
            rows: dict = {c: [] for c in configs}
            for _ in range(args.repeat):
                for config in configs:
                    row = run(kind, images, table, *config)
                    rows[config].append(row)
                    print(f"{config_name(*config):>17} {row['seconds']:7.1f} {row['images'] / row['seconds']:6.2f} "
                          f"{row['cpu']:6.1f} {row['cpu'] / row['images']:7.3f} {row['cpu'] / row['seconds']:5.2f} "
                          f"{row['merge']:7.3f} "
                          f"{row['rss_driver_mb']:9.0f} {row['rss_worker_mb']:9.0f} {row['digest']:>13} "
                          f"{row['start']:>5} {row['load']:5.1f}", flush=True)
            base = configs[0]
            wall1, cpu1 = median([r["seconds"] for r in rows[base]]), median([r["cpu"] for r in rows[base]])
            print(f"medians (ratio: wall time over {config_name(*base)}'s)")
            print(f"{'config':>17} {'wall s':>7} {'img/s':>6} {'ratio':>6} {'cpu s':>6} {'cpu/img':>7} "
                  f"{'cpu ratio':>9} {'merge s':>7} {'load':>9}")
            for config in configs:
                wall = median([r["seconds"] for r in rows[config]])
                cpu = median([r["cpu"] for r in rows[config]])
                loads = [r["load"] for r in rows[config]]
                print(f"{config_name(*config):>17} {wall:7.1f} {rows[config][0]['images'] / wall:6.2f} "
                      f"{wall / wall1:6.2f} {cpu:6.1f} {cpu / rows[config][0]['images']:7.3f} {cpu / cpu1:9.2f} "
                      f"{median([r['merge'] for r in rows[config]]):7.3f} {min(loads):4.1f}-{max(loads):.1f}",
                      flush=True)
            if kind == "report" and args.costs:
                print_costs(full, table, max(2, max(args.workers)))
            if kind == "report" and args.memory:
                (tmp / "quarter").mkdir()
                row = run(kind, make_images(tmp / "quarter", args.images // 4), table, 2)
                print(f"memory check, 2 workers over {row['images']} images: driver {row['rss_driver_mb']:.0f} MB, "
                      f"worker {row['rss_worker_mb']:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
