#!/usr/bin/env python3
"""The fixed cost of a `ptq` command, each figure beside a bare `python -c pass` (what no code of ours can lower).

    python3 bench/startup.py [--repeat 7] [--quant Q.json] [--tree DIR]

In fresh interpreters (this tree, or the checkout --tree of another commit, first on sys.path), the best and the
median of --repeat runs:
- `python -c pass`, `import ptq`, `ptq --help`, `ptq report --help`, `ptq calibrate --help` (its epilog lists
  the calibrators, which import numpy);
- the imports of a `ptq report` run on the bundled model and the 20 eval photos (the sum of the top-level
  entries of `python -X importtime`: every import, lazy ones included), and how many modules it loads;
- numba's first use in a report, in order: `import numba`, `scipy.linalg` (numba's target initialization
  imports it to look for BLAS), the rest of that initialization, and loading the 8 cached signatures a
  report of EfficientNet-Lite0 calls (`NUMBA_DEBUG_CACHE=1` lists them).
Without --quant the model is calibrated first (examples/calib; not timed).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVAL = REPO.parent / "shared" / "assets" / "images" / "eval"
MODEL = REPO / "examples" / "efficientnet_lite0.onnx"

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


def wall(argv: list[str], tree: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def report_imports(quant: Path, out: Path, tree: Path) -> tuple[float, int]:
    """(seconds importing, modules) of one `ptq report` run."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ptq.cli", "report", str(MODEL), "--quant",
                           str(quant), "--images", str(EVAL), "--out", str(out)], cwd=tree, check=True,
                          capture_output=True, text=True)
    rows = [line.split("|") for line in done.stderr.splitlines()
            if line.startswith("import time:") and "cumulative" not in line]
    top = sum(int(cum) for _, cum, name in rows if not name[1:].startswith(" "))
    return top / 1e6, len(rows)


def line(name: str, values: list[float], bare: float) -> str:
    best, median = min(values), statistics.median(values)
    return f"{name:28s} best {best:6.3f} s  median {median:6.3f} s  (best - bare python {best - bare:+.3f} s)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quant", type=Path, help="a quant table of the bundled model (default: calibrate one)")
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout to measure (default: this one)")
    args = parser.parse_args(argv)
    tree = args.tree.resolve()
    work = Path(tempfile.mkdtemp(prefix="ptq_startup_"))
    quant = args.quant
    if quant is None:
        subprocess.run([sys.executable, "-m", "ptq.cli", "calibrate", str(MODEL), "--images",
                        str(REPO / "examples/calib"), "--out", str(work), "-q"], cwd=tree, check=True,
                       stdout=subprocess.DEVNULL)
        quant = work / "efficientnet_lite0.quant.json"
    report = ["-m", "ptq.cli", "report", str(MODEL), "--quant", str(quant), "--images", str(EVAL), "--out", str(work)]
    wall(report, tree)  # the numba cache of this tree's kernels, written if missing
    commands = {"python -c pass": ["-c", "pass"], "import ptq": ["-c", "import ptq"],
                "ptq --help": ["-m", "ptq.cli", "--help"], "ptq report --help": ["-m", "ptq.cli", "report", "--help"],
                "ptq calibrate --help": ["-m", "ptq.cli", "calibrate", "--help"]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeat):  # interleaved: a busy moment of the machine hits every command alike
        for name, argv_ in commands.items():
            times[name].append(wall(argv_, tree))
    bare = min(times["python -c pass"])
    for name, values in times.items():
        print(line(name, values, bare))
    imports = [report_imports(quant, work, tree) for _ in range(3)]
    print(f"{'ptq report: imports':28s} best {min(s for s, _ in imports):6.3f} s  median "
          f"{statistics.median(s for s, _ in imports):6.3f} s  ({imports[0][1]} modules)")
    try:
        runs = [[float(v) for v in subprocess.run([sys.executable, "-c", NUMBA_FIRST_USE], cwd=tree, check=True,
                                                  capture_output=True, text=True).stdout.split()] for _ in range(3)]
    except subprocess.CalledProcessError:
        print("numba first use: this tree lacks the kernels measured (ops/compiled, reports/value_histogram)")
        return 0
    best = min(runs, key=sum)
    print(f"{'numba first use (best run)':28s} import {best[0]:.3f} s, scipy.linalg {best[1]:.3f} s, rest of target "
          f"init {best[2]:.3f} s, 8 cached signatures {best[3]:.3f} s: {sum(best):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
