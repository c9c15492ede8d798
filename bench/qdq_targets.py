"""The QDQ model in onnxruntime at every graph-optimization level, per export target, beside ptq's integer run.

    python bench/qdq_targets.py                  # the bundled model, per-channel and per-tensor weights
    python bench/qdq_targets.py MODEL CALIB EVAL [--mean 127 --std 128] [--per-channel-only]

Calibrates on CALIB (extrema, int8), then on EVAL prints the mean logits cosine to the float model of: ptq's
integer run; each target's QDQ model under ORT_DISABLE_ALL / ORT_ENABLE_BASIC / ORT_ENABLE_EXTENDED /
ORT_ENABLE_ALL (the default); the same with 7-bit weights (onnxruntime's `reduce_range`: the table follows, so
ptq's integer run is the same arithmetic); and the time per image of each QDQ model at the default level, on
one thread (best of 3 over 5 images), beside its unoptimized time. Also prints the CPU's VNNI flags: the
saturation depends on them (docs/qdq_targets.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptq.core.graph import load_model  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.engine.float_run import image_input  # noqa: E402
from ptq.data.images import ImageLog, Preprocess, load_image, select_files  # noqa: E402
from ptq.calibration.pipeline import calibrate, input_spec  # noqa: E402
from ptq.qdq.export import export_qdq  # noqa: E402
from ptq.qdq.targets import QDQ_TARGETS  # noqa: E402

BUNDLED = (ROOT / "examples/efficientnet_lite0.onnx", ROOT / "examples/calib", Path("/work/shared/assets/images/eval"))


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    flags = set(text.split())
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni") if f in flags) or "none of avx2/vnni"


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main(argv=None) -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="MODEL CALIB EVAL (default: the bundled model and photos)")
    parser.add_argument("--mean", default="127")
    parser.add_argument("--std", default="128")
    parser.add_argument("--per-channel-only", action="store_true")
    args = parser.parse_args(argv)
    model, calib, held_out = (Path(p) for p in args.paths) if args.paths else BUNDLED
    levels = {"off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}

    def session(m, level, threads=0):
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[level]
        options.intra_op_num_threads = threads
        source = m.SerializeToString() if not isinstance(m, Path) else str(m)
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])

    pre = Preprocess(mean=args.mean, std=args.std)
    graph = load_model(model)
    name = image_input(graph)
    spec = input_spec(graph, pre)
    samples = [load_image(f, pre, spec)[None] for f in select_files(held_out, ImageLog())]
    reference = [session(model, "all").run(None, {name: x})[0] for x in samples]

    def score(outputs) -> float:
        return float(np.mean([cosine(o, r) for o, r in zip(outputs, reference)]))

    print(f"{model.name}, onnxruntime {ort.__version__}, CPU flags: {cpu_flags()}; calibrated on {calib}, "
          f"mean logits cosine to float on {len(samples)} images of {held_out}")
    def ms_per_image(s) -> float:
        s.run(None, {name: samples[0]})  # warm-up
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for x in samples[:5]:
                s.run(None, {name: x})
            best = min(best, (time.perf_counter() - start) / len(samples[:5]))
        return best * 1000

    print(f"{'weights':18s} {'run':26s} " + " ".join(f"{lv:>8s}" for lv in levels)
          + f" {'ms/img all':>10s} {'ms/img off':>10s}")
    rows = [("per-channel", True, 8), ("per-channel 7-bit", True, 7)]
    if not args.per_channel_only:
        rows += [("per-tensor", False, 8), ("per-tensor 7-bit", False, 7)]
    for label, per_channel, weight_bits in rows:
        result = calibrate(model, calib, None, per_channel=per_channel, weight_bits=weight_bits, preprocess=pre,
                           write_qdq=False)
        prepared = prepare(graph, result.table)
        out = graph.outputs[0]
        integer = score([prepared.run({name: x}, keep_all=False).outputs[out] for x in samples])
        print(f"{label:18s} {'ptq integer':26s} {integer:8.4f}", flush=True)
        for target in QDQ_TARGETS:
            qdq = export_qdq(result.graph, result.table, target)
            figures = []
            for level in levels:
                s = session(qdq, level)
                figures.append(score([s.run(None, {name: x})[0] for x in samples]))
            times = [ms_per_image(session(qdq, level, threads=1)) for level in ("all", "off")]
            print(f"{'':18s} {'QDQ ' + target:26s} " + " ".join(f"{f:8.4f}" for f in figures)
                  + f" {times[0]:10.1f} {times[1]:10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
