#!/usr/bin/env python3
"""Wall time of `ptq report` against the float run plus the integer run alone, on the same images.

    python3 bench/report.py [--model M] [--quant Q.json] [--images DIR] [--num-images 20] [--repeat 2]
                            [--blas-threads 1]

Without --quant the model is calibrated first (examples/calib, per-channel int8; not timed). Timed, in one
process:
- decoding and preprocessing the images once (both runs alone need it; the report does it once too);
- float alone: onnxruntime on the model (graph outputs only, default session), on the decoded images;
- integer alone: `IntegerGraph.run` (intermediates dropped as soon as consumed), on the decoded images;
- reports: `evaluate` + `build_report` + the json/csv/html writers (decoding included), once without isolated
  metrics, once with them on the first images as `ptq report` does by default, once with them on every image.
overhead = report / (decode + float alone + integer alone) - 1. The runs are interleaved and repeated (--repeat),
and the best time of each is kept: on a shared machine the minimum is the least disturbed measurement.
The whole process runs with --blas-threads OpenBLAS threads (default 1, as `ptq report` sets them: the integer
graph alone is faster so, and the report's worker thread gets the second core); 0 keeps the library default.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET = 0.30


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "efficientnet_lite0.onnx"))
    parser.add_argument("--quant", help="quant table (default: calibrate on examples/calib)")
    parser.add_argument("--images", default=str(REPO.parent / "shared" / "assets" / "images" / "eval"))
    parser.add_argument("--num-images", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=2, help="interleaved repeats; the best time of each counts")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="OpenBLAS threads for the whole process, as `ptq report` sets them (default 1; 0 = the "
                        "library's default, one per core)")
    args = parser.parse_args(argv)
    if args.blas_threads:
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)  # before numpy is imported
    return run(args)


def run(args) -> int:
    from ptq.commands.report import DEFAULT_ISOLATED_IMAGES
    from ptq.engine.executor import prepare
    from ptq.engine.float_run import FloatRunner, image_input
    from ptq.core.graph import load_model
    from ptq.data.images import Preprocess
    from ptq.table.quant_table import load_quant_table
    from reports.build import build_report
    from reports.evaluate import evaluate
    from ptq.data.image_source import ImageSet
    from reports.html import write_html
    from reports.writers import write_csv, write_json

    work = Path(tempfile.mkdtemp(prefix="ptq-bench-report-"))
    if args.quant:
        table = load_quant_table(args.quant)
    else:
        from ptq.calibration.pipeline import calibrate

        table = calibrate(args.model, REPO / "examples" / "calib", write_qdq=False).table
    graph = load_model(args.model, table.options.input_shapes)
    images = ImageSet.from_folder(args.images, Preprocess(**table.options.preprocess), limit=args.num_images)
    samples = [inputs[image_input(graph)] for _, inputs, _ in images.samples(graph)]
    name = image_input(graph)
    prepared = prepare(graph, table)
    runner = FloatRunner.create(graph, list(graph.outputs))
    for _ in runner.run(samples[0]):  # warm up onnxruntime and the integer graph once
        pass
    prepared.run({name: samples[0]}, keep_all=False)

    def float_alone():
        for sample in samples:
            for _ in runner.run(sample):
                pass

    def int_alone():
        for sample in samples:
            prepared.run({name: sample}, keep_all=False)

    reports = (("report, no isolated", {"isolated": False}),
               (f"report, isolated on {DEFAULT_ISOLATED_IMAGES} (default)", {"isolated_images": DEFAULT_ISOLATED_IMAGES}),
               ("report, isolated on all images", {}))

    def report_fn(kwargs):
        def report():
            ev = evaluate(graph, table, images, prepared=prepared, **kwargs)
            if ev.isolated:
                rep = build_report(ev, args.model, "bench")
                write_json(rep, work / "report.json")
                write_csv(rep, work / "report.csv")
                write_html(rep, work / "report.html")
        return report

    # interleaved repeats, best of each: the machine is shared, so the minimum is the least disturbed run
    best: dict[str, float] = {}
    def decode():
        for _ in images.samples(graph):
            pass

    jobs = [("decode", decode), ("float", float_alone), ("int", int_alone)]
    jobs += [(label, report_fn(kw)) for label, kw in reports]
    for _ in range(args.repeat):
        for label, fn in jobs:
            best[label] = min(best.get(label, float("inf")), _time(fn))
    t_decode, t_float, t_int = best["decode"], best["float"], best["int"]
    base = t_decode + t_float + t_int
    n = len(samples)
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    print(f"{n} images, {Path(args.model).name}, best of {args.repeat}, OpenBLAS threads: {threads}")
    print(f"decode images {t_decode:7.2f} s  ({1000 * t_decode / n:6.1f} ms/img)")
    print(f"float alone   {t_float:7.2f} s  ({1000 * t_float / n:6.1f} ms/img)")
    print(f"integer alone {t_int:7.2f} s  ({1000 * t_int / n:6.1f} ms/img)")
    print(f"decode + float + int {base:7.2f} s")
    for label, _ in reports:
        t = best[label]
        overhead = t / base - 1.0
        verdict = "ok" if overhead <= TARGET else f"over the {TARGET:.0%} target"
        print(f"{label:<31} {t:7.2f} s  overhead {overhead:+6.1%}  ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
