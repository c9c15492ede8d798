#!/usr/bin/env python3
"""The fixed cost of `ptq report`, each figure beside a bare `python -c pass` (what no code of ours can lower).

    python3 bench/startup.py [--repeat 5] [--quant Q.json] [--tree DIR] [--against DIR] [--images K]

**Fixed cost**, as this script measures it: the wall time (and the CPU time) of
`ptq report MODEL --quant Q --images ONE_IMAGE --out DIR`, from the moment the process is started to the
moment it has ended (interpreter start, imports, the model, the table, the integer graph, numba's first use,
the float session, the image, writing report.json/.csv/.html, the process's exit), **less the cost of its
one image**. Every `ptq ...` is run as the installed `ptq` script runs it (`ptq.cli.entry`, see `PTQ`). The cost of an image is the marginal one: (`--images K` photos - 1 photo) / (K - 1), the many-image
report run with `--isolated-images all` so that every image costs what the one image of a one-image report
costs (its isolated pass included; the default covers the first 2 images); for the best figures from the best
runs of each, for the medians from the medians. Wall times are those of a machine shared by other
jobs: each figure is printed as the best and the median of --repeat fresh processes, with the CPU time
(user + system of the process and its threads, from the rusage of the waited-for child), which load inflates
less. Python bytecode is written and read as for an installed package (PYTHONDONTWRITEBYTECODE is dropped
from the children's environment: without it every run compiles ptq's 140 modules again, 0.3 s of CPU).

Printed, in fresh interpreters (this tree first on sys.path, or the checkout --tree; --against DIR measures a
second checkout the same way, interleaved, e.g. the main branch before a change):
- `python -c pass`, `import ptq`, `ptq --help`, `ptq report --help`;
- the one-image report, the K-image one, the marginal image and the fixed cost, wall and CPU;
- the one-image report's timeline (CPU and wall at each step, best over the runs): interpreter start to the
  first line of the command, imports, model and table (`ptq.api.load`), the integer graph (`prepare`), the
  first image (numba's first use happens there: its CPU target and cached kernels), the report written, and
  the process's end (its exit);
- the imports of the one-image report (the sum of the top-level entries of `python -X importtime`) and numba's
  first use in a report, in order: `import numba`, `scipy.linalg` (numba's target initialization imports it
  to look for BLAS), the rest of that initialization, the 8 cached signatures EfficientNet-Lite0's report calls.
Without --quant the model is calibrated first (examples/calib; not timed).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(os.environ.get("PTQ_ASSETS", REPO.parent / "shared" / "assets"))
if not ASSETS.exists():  # a worktree under /work/wt/NAME: the shared assets are two levels up
    ASSETS = REPO.parents[1] / "shared" / "assets"
EVAL = ASSETS / "images" / "eval"
MODEL = REPO / "examples" / "efficientnet_lite0.onnx"
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

# the `ptq` command with a timeline: (step, wall since this line, process CPU) at each step, written as JSON
# to the file named by the first argument when the process leaves (its exit handlers run with `ptq.cli.leave`)
TIMELINE = """
import atexit, json, os, sys, time
W, C = time.perf_counter, time.process_time
def started():  # seconds since this process started (Linux: /proc, 10 ms ticks), else 0
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0
W0 = W() - started()
marks, out = [("interpreter started", W() - W0, C())], sys.argv.pop(1)
def mark(step):
    marks.append((step, W() - W0, C()))
import ptq.cli as cli
cli.one_blas_thread()  # as `main` does first: before numpy is imported
import ptq.api as api, reports.evaluate as evaluate, reports.image_run as image_run
mark("imports")
def after(owner, name, step):
    inner = getattr(owner, name)
    def wrapped(*args, **kwargs):
        result = inner(*args, **kwargs)
        if step not in [m[0] for m in marks]:
            mark(step)
        return result
    setattr(owner, name, wrapped)
after(api, "load", "model and table")
after(evaluate, "prepare", "integer graph")
after(image_run.ImageRun, "run", "first image")
after(api, "write_report", "report written")
def save():
    with open(out, "w") as f:
        json.dump(marks, f)
atexit.register(save)
sys.argv = ["ptq"] + sys.argv[1:]
getattr(cli, "entry", lambda: sys.exit(cli.main()))()
"""

# the `ptq` command as its console script runs it (`ptq.cli:entry`: it leaves without the interpreter's teardown;
# `python -m ptq.cli` exits plainly, so that a profiler around it finishes); a checkout without `entry`: `main`
PTQ = ("import sys; import ptq.cli as cli; sys.argv[0] = 'ptq'; "
       "getattr(cli, 'entry', lambda: sys.exit(cli.main()))()")

NUMBA_FIRST_USE = """
import time
T = time.perf_counter
import numpy, onnx
t = T(); import numba; a = T()
import ops.compiled.depthwise as dw, ops.compiled.elementwise as ew, ops.compiled.requant as rq
import reports.channels_first as cf, reports.pair_sums as ps
b = T(); import scipy.linalg; c = T()
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import cpu_target
with global_compiler_lock:
    cpu_target.target_context.refresh()
d = T()
for disp, n in ((rq._finish_lanes, 2), (rq._finish, 1), (ps._compare, 2), (cf._transpose_bytes, 1),
                (dw.depthwise, 1), (ew.add_sub, 1)):
    for key in list(disp._cache._cache_file._load_index())[:n]:
        disp.compile(key[0])
e = T()
print(a - t, c - b, d - c, e - d)
"""


def timed(argv: list[str], tree: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh `python ARGV` in `tree`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=tree, env=ENV, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def report_imports(report: list[str], tree: Path) -> tuple[float, int]:
    """(seconds importing, modules) of one `ptq report` run."""
    done = subprocess.run([sys.executable, "-X", "importtime", *report], cwd=tree, env=ENV, check=True,
                          capture_output=True, text=True)
    rows = [line.split("|") for line in done.stderr.splitlines()
            if line.startswith("import time:") and "cumulative" not in line]
    top = sum(int(cum) for _, cum, name in rows if not name[1:].startswith(" "))
    return top / 1e6, len(rows)


def best_median(values: list[float]) -> str:
    return f"{min(values):6.3f} {statistics.median(values):6.3f}"


class Tree:
    """One checkout's runs: the commands, the reports and the timelines."""

    def __init__(self, tree: Path, quant: Path, work: Path, images: int):
        self.tree, self.work = tree, work
        self.one, self.many = work / "one", work / "many"
        for folder, count in ((self.one, 1), (self.many, images)):
            folder.mkdir(exist_ok=True)
            for photo in sorted(EVAL.glob("*.jpg"))[:count]:
                shutil.copy(photo, folder)
        base = ["-c", PTQ, "report", str(MODEL), "--quant", str(quant), "--out", str(work / "out")]
        self.report = base + ["--images", str(self.one)]
        self.commands = {"python -c pass": ["-c", "pass"], "import ptq": ["-c", "import ptq"],
                         "ptq --help": ["-c", PTQ, "--help"],
                         "ptq report --help": ["-c", PTQ, "report", "--help"],
                         "report, 1 image": self.report,
                         f"report, {images} images": base + ["--images", str(self.many), "--isolated-images", "all"]}
        self.times: dict[str, list[tuple[float, float]]] = {name: [] for name in self.commands}
        self.timelines: list[list] = []
        timed(self.report, tree)  # bytecode and numba's cache of this tree, written if missing

    def round(self) -> None:
        for name, argv in self.commands.items():
            self.times[name].append(timed(argv, self.tree))
        marks = self.work / "timeline.json"
        wall, cpu = timed(["-c", TIMELINE, str(marks)] + self.report[2:], self.tree)
        self.timelines.append([("", 0.0, 0.0)] + json.loads(marks.read_text()) + [("process ended", wall, cpu)])

    def print(self, images: int) -> None:
        bare_wall = min(w for w, _ in self.times["python -c pass"])
        print(f"{'':26s} {'wall s':>13s} {'CPU s':>13s}\n{'':26s} {'best median':>13s} {'best median':>13s}")
        for name, values in self.times.items():
            walls, cpus = [w for w, _ in values], [c for _, c in values]
            print(f"{name:26s} {best_median(walls)} {best_median(cpus)}   (best - bare python "
                  f"{min(walls) - bare_wall:+.3f} s)")
        one, many = self.times["report, 1 image"], self.times[f"report, {images} images"]
        figures = []  # (image, fixed) for wall best, wall median, CPU best, CPU median
        for k in (0, 1):
            for pick in (min, statistics.median):
                first, more = pick([t[k] for t in one]), pick([t[k] for t in many])
                image = (more - first) / (images - 1)
                figures.append((image, first - image))
        for name, j in (("an image (marginal)", 0), ("FIXED COST (1 image - it)", 1)):
            print(f"{name:26s} " + " ".join(f"{figures[i][j]:6.3f}" for i in range(2)) + " "
                  + " ".join(f"{figures[i][j]:6.3f}" for i in range(2, 4)))
        print("timeline of the one-image report (each step: best over the runs of its wall and CPU since the "
              "step before)")
        steps = [m[0] for m in self.timelines[0]]
        for k in range(1, len(steps)):
            walls = [t[k][1] - t[k - 1][1] for t in self.timelines if len(t) == len(steps)]
            cpus = [t[k][2] - t[k - 1][2] for t in self.timelines if len(t) == len(steps)]
            print(f"  {steps[k]:24s} wall {min(walls):6.3f} s  CPU {min(cpus):6.3f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--images", type=int, default=5, help="photos of the many-image report (default 5)")
    parser.add_argument("--quant", type=Path, help="a quant table of the bundled model (default: calibrate one)")
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout to measure (default: this one)")
    parser.add_argument("--against", type=Path, help="another checkout, measured the same way, interleaved")
    args = parser.parse_args(argv)
    if args.images < 2:
        parser.error("--images must be at least 2")
    work = Path(tempfile.mkdtemp(prefix="ptq_startup_"))
    quant = args.quant
    if quant is None:
        subprocess.run([sys.executable, "-m", "ptq.cli", "calibrate", str(MODEL), "--images",
                        str(REPO / "examples/calib"), "--out", str(work), "-q"], cwd=args.tree, env=ENV, check=True,
                       stdout=subprocess.DEVNULL)
        quant = work / "efficientnet_lite0.quant.json"
    trees = {"this": args.tree.resolve()} | ({"against": args.against.resolve()} if args.against else {})
    runs = {}
    for name, tree in trees.items():
        (work / name).mkdir()
        runs[name] = Tree(tree, quant, work / name, args.images)
    load = [os.getloadavg()[0]]
    for _ in range(args.repeat):  # interleaved: a busy moment of the machine hits every command alike
        for run in runs.values():
            run.round()
        load.append(os.getloadavg()[0])
    print(f"{os.cpu_count()} cores, load average {min(load):.1f}-{max(load):.1f}; {args.repeat} rounds")
    for name, run in runs.items():
        print(f"\n== {name}: {run.tree}")
        run.print(args.images)
        imports = [report_imports(run.report, run.tree) for _ in range(3)]
        print(f"{'imports of the report':26s} best {min(s for s, _ in imports):6.3f} s  median "
              f"{statistics.median(s for s, _ in imports):6.3f} s  ({imports[0][1]} modules, python -X importtime)")
        try:
            firsts = [[float(v) for v in subprocess.run([sys.executable, "-c", NUMBA_FIRST_USE], cwd=run.tree,
                                                        env=ENV, check=True, capture_output=True,
                                                        text=True).stdout.split()] for _ in range(3)]
        except subprocess.CalledProcessError:
            print("numba first use: this tree lacks the kernels measured (ops/compiled, reports/pair_sums)")
            continue
        best = min(firsts, key=sum)
        print(f"{'numba first use (best run)':26s} import {best[0]:.3f} s, scipy.linalg {best[1]:.3f} s, rest of "
              f"target init {best[2]:.3f} s, 8 cached signatures {best[3]:.3f} s: {sum(best):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
