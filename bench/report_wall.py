#!/usr/bin/env python3
"""`ptq report` end to end on N images, as a user waits for it, this checkout against another one and beside
onnxruntime float on the same images.

    python3 bench/report_wall.py --base DIR [--counts 1 20 200] [--repeat 3]
    git worktree add /tmp/ptq-44a83ed 44a83ed && python3 bench/report_wall.py --base /tmp/ptq-44a83ed

Every run is a fresh `python -m ptq.cli report MODEL --quant Q --images DIR --out OUT` in the checkout's folder
(that tree's code), timed from outside: interpreter start and exit, imports, numba's first use, loading, every
image, writing the report. Python bytecode is cached as for an installed package. Each checkout calibrates its
own table first (examples/calib; not timed). The N images are the first N of the eval photos, then mirrored and
cropped copies (`bench/scale.make_images`). The checkouts and the onnxruntime run are interleaved and repeated
(--repeat), and the median of each is printed: the machine is shared.

onnxruntime float: a fresh process that imports numpy, onnxruntime and ptq's image loader, creates a default
session on the model, and runs it on the same N images decoded as the report decodes them (graph outputs only):
the least a float evaluation of those images costs. `speed-up` is base / this; `x ort` is this / onnxruntime.
The fixed cost of a run is about its 1-image time: a 20-image report is mostly fixed cost, a 200-image one mostly
the per-image loop.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scale import make_images  # bench/ is the script's folder, first on sys.path

REPO = Path(__file__).resolve().parent.parent

MODEL = REPO / "examples" / "efficientnet_lite0.onnx"

ORT_FLOAT = """
import sys
from pathlib import Path
import onnxruntime as ort
from ptq.data.images import InputSpec, Preprocess, load_image
folder, model = Path(sys.argv[1]), sys.argv[2]
session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
feed = session.get_inputs()[0]
spec, preprocess = InputSpec.from_shape(feed.shape), Preprocess()
for path in sorted(folder.iterdir()):
    session.run(None, {feed.name: load_image(path, preprocess, spec)[None]})
"""


def wall(argv: list[str], cwd: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def calibrate(tree: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "ptq.cli", "calibrate", str(MODEL), "--images",
                    str(REPO / "examples" / "calib"), "--out", str(out), "--quiet"], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL)
    return out / f"{MODEL.stem}.quant.json"


def image_folder(work: Path, count: int) -> Path:
    folder = work / f"images{count}"
    folder.mkdir()
    return make_images(folder, count)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with (another commit)")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 20, 200], help="image counts (default 1 20 200)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs of each (default 3); the median counts")
    args = parser.parse_args(argv)
    trees = {"base": args.base.resolve(), "this": REPO}
    work = Path(tempfile.mkdtemp(prefix="ptq-report-wall-"))
    tables = {key: calibrate(tree, work / key) for key, tree in trees.items()}
    print(f"ptq report end to end, {MODEL.name}; base {trees['base']}; median of {args.repeat} interleaved runs")
    print(f"{'images':>6} {'base s':>8} {'this s':>8} {'speed-up':>9} {'ort s':>7} {'x ort':>6}   load")
    for count in args.counts:
        folder = image_folder(work, count)
        times: dict[str, list[float]] = {"base": [], "this": [], "ort": []}
        loads = []
        for _ in range(args.repeat):
            loads.append(os.getloadavg()[0])
            for key, tree in trees.items():
                times[key].append(wall(["-m", "ptq.cli", "report", str(MODEL), "--quant", str(tables[key]),
                                        "--images", str(folder), "--out", str(work / f"out-{key}")], tree))
            times["ort"].append(wall(["-c", ORT_FLOAT, str(folder), str(MODEL)], REPO))
        base, this, ort = (statistics.median(times[key]) for key in ("base", "this", "ort"))
        print(f"{count:6d} {base:8.2f} {this:8.2f} {base / this:8.2f}x {ort:7.2f} {this / ort:5.2f}x   "
              f"{min(loads):.1f}-{max(loads):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
