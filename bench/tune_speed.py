"""How long `ptq tune --target-cosine 0.998` takes beside `ptq calibrate --bias-correction` on the same images, and
what the tuned table scores on held-out photos.

    python bench/tune_speed.py                          # the bundled model, examples/calib, the 20 eval photos
    python bench/tune_speed.py MODEL CALIB EVAL [--target 0.998] [--rounds 2] [--tune-args "--workers 2"]
                               [--calibrate-args "--calibrator extrema"]

One run times both commands as the user runs them (`python -m ptq.cli ...` subprocesses, imports and the
QDQ check included): per round, `ptq calibrate MODEL --images CALIB --bias-correction`, then `ptq tune MODEL
--images CALIB --quant <that table> --target-cosine T`; it prints each command's wall time and CPU time (user +
system of the child, `resource.getrusage(RUSAGE_CHILDREN)`: on a shared, loaded machine the wall time depends
on the other jobs, the CPU time much less) and their ratios, with the load average around each command.
Then, on EVAL (held out: neither fitted nor decided on), the mean logits cosine against the float model in
onnxruntime and the top-1 agreement of: the calibrated table's integer run, the tuned table's integer run, and
the tuned QDQ model in onnxruntime with graph optimizations off and on.

Measured (docs/tune.md, "How long it takes"; the 2-core machine quiet, load 0.3-0.8): with the default calibrator
(auto) calibrate 3.9 s wall / 4.2 s CPU, tune 16.1 s / 23.4 s: 4.18x calibrate's wall time (5.57x its CPU: tune's
sample threads use the second core), the tuned table 0.99910 on the eval photos; `--calibrate-args "--calibrator
extrema"`: 2.9 s / 3.2 s against 11.4 s / 15.6 s, 3.92x.
"""
from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.accuracy import BUNDLED, EvalSet, ptq_outputs  # noqa: E402
from ptq.data.images import Preprocess  # noqa: E402


def timed(command: list[str]) -> tuple[float, float, str]:
    """Run `command` (from the repository root); (wall seconds, CPU seconds of the child, its output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):  # tune exits 1 when the target is not reached: still a timing
        sys.exit(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout + done.stderr


def qdq_outputs(path: Path, ev: EvalSet, optimized: bool) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [session.run(None, {ev.input: s})[0].reshape(-1) for s in ev.samples]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="MODEL CALIB EVAL (default: the bundled model and photos)")
    parser.add_argument("--target", type=float, default=0.998, help="tune's --target-cosine (default 0.998)")
    parser.add_argument("--rounds", type=int, default=1, help="calibrate + tune pairs, medians reported (default 1)")
    parser.add_argument("--tune-args", default="", help="more arguments for ptq tune, e.g. \"--workers 2\"")
    parser.add_argument("--calibrate-args", default="",
                        help="more arguments for ptq calibrate, e.g. \"--calibrator extrema\" (tune starts from its table)")
    args = parser.parse_args(argv)
    model, calib, held_out = (Path(p).resolve() for p in args.paths) if args.paths else BUNDLED
    cli = [sys.executable, "-m", "ptq.cli"]
    rows = {"calibrate": [], "tune": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            out = Path(tmp) / f"round{r}"
            load = os.getloadavg()[0]
            wall, cpu, _ = timed(cli + ["calibrate", str(model), "--images", str(calib), "--bias-correction",
                                        "--out", str(out)] + shlex.split(args.calibrate_args))
            rows["calibrate"].append((wall, cpu, load, os.getloadavg()[0]))
            table = out / f"{model.stem}.quant.json"
            load = os.getloadavg()[0]
            wall, cpu, log = timed(cli + ["tune", str(model), "--images", str(calib), "--quant", str(table),
                                          "--target-cosine", str(args.target), "--out", str(out / "tuned")]
                                   + shlex.split(args.tune_args))
            rows["tune"].append((wall, cpu, load, os.getloadavg()[0]))
            summary = [line for line in log.splitlines() if line.startswith(("validation cosine", "QDQ model in"))
                       or "tensor(s) in 16 bits" in line]
        print(f"{model.name}: calibrate and tune on {calib} ({args.rounds} round(s), each a fresh process; "
              f"calibrate {args.calibrate_args or 'with its defaults'}, tune {args.tune_args or 'with its defaults'})")
        print(f"{'command':44s} {'wall s':>7s} {'cpu s':>7s} {'load':>9s}")
        median = {}
        for name, label in (("calibrate", "ptq calibrate --bias-correction"),
                            ("tune", f"ptq tune --target-cosine {args.target}")):
            walls, cpus = [w for w, *_ in rows[name]], [c for _, c, *_ in rows[name]]
            loads = [x for *_, a, b in rows[name] for x in (a, b)]
            median[name] = (statistics.median(walls), statistics.median(cpus))
            print(f"{label:44s} {median[name][0]:7.1f} {median[name][1]:7.1f} {min(loads):4.1f}-{max(loads):<4.1f}")
        print(f"{'ratio tune / calibrate':44s} {median['tune'][0] / median['calibrate'][0]:7.2f} "
              f"{median['tune'][1] / median['calibrate'][1]:7.2f}")
        print("tune (last round): " + "\n  ".join(summary))

        ev = EvalSet(model, held_out, Preprocess())
        tuned_dir = out / "tuned"
        results = {
            "calibrated table, integer run": ptq_outputs(model, table, ev),
            "tuned table, integer run": ptq_outputs(model, tuned_dir / f"{model.stem}.tuned.quant.json", ev),
            "tuned QDQ model, onnxruntime optimizations off": qdq_outputs(
                tuned_dir / f"{model.stem}.tuned.qdq.onnx", ev, optimized=False),
            "tuned QDQ model, onnxruntime optimizations on": qdq_outputs(
                tuned_dir / f"{model.stem}.tuned.qdq.onnx", ev, optimized=True),
        }
        print(f"\non {held_out} ({len(ev.samples)} held-out photos), against the float model in onnxruntime:")
        print(f"{'':48s} {'cosine':>8s} {'min':>8s} {'top1 agr':>8s}")
        for label, outputs in results.items():
            s = ev.score(outputs)
            worst = min(float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
                        for a, b in zip(ev.reference, outputs))
            print(f"{label:48s} {s['cosine']:8.5f} {worst:8.5f} {s['top1_agree']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
