#!/usr/bin/env python3
"""Cost of the report's per-tensor comparison (`reports.pair_sums.compare`: similarity sums, clipped counts and
value histogram in one pass over the float tensor and the integer codes), beside the float and integer runs.

    python3 bench/report_compare.py [--model M] [--quant Q.json] [--images DIR] [--num-images 8]

Without --quant the model is calibrated first (examples/calib; not timed). Per image, in CPU time of the calling
thread (robust to a loaded machine): the float run with every layer tensor as an output (`reports.float_reference`,
one onnxruntime thread), the integer run (`IntegerGraph.run`, the codes of every layer kept as the executor hands
them over: channels-last views from the compiled convolutions) and comparing every layer's codes with its float
tensor as the report's worker thread does. Prints each, and the comparison as a ratio of the float run.
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "efficientnet_lite0.onnx"))
    parser.add_argument("--quant", help="quant table (default: calibrate on examples/calib)")
    parser.add_argument("--images", default=str(REPO.parent / "shared" / "assets" / "images" / "eval"))
    parser.add_argument("--num-images", type=int, default=8)
    args = parser.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as `ptq report` runs

    from ptq.core.graph import load_model
    from ptq.executor import prepare
    from ptq.images import Preprocess
    from ptq.pipeline import calibrate
    from ptq.quant_table import load_quant_table
    from reports.float_reference import float_reference
    from reports.grid import grid_bounds
    from reports.image_source import ImageSet
    from reports.layer_specs import layer_specs
    from reports.pair_sums import compare
    from reports.value_histogram import ValueHistogram

    with tempfile.TemporaryDirectory() as tmp:
        quant = args.quant or calibrate(args.model, REPO / "examples" / "calib", tmp, write_qdq=False,
                                        preprocess=Preprocess(mean=127, std=128)).table_path
        table = load_quant_table(quant)
    graph = load_model(args.model, table.options.input_shapes)
    prepared = prepare(graph, table)
    specs = layer_specs(prepared, graph.activations)
    names = {s.name for s in specs}
    runner = float_reference(graph, [s.name for s in specs])
    ranks = {s.name: len(graph.tensors[s.name].shape or ()) for s in specs}
    histograms = {s.name: ValueHistogram.for_grid(prepared.qparams[s.name], ranks[s.name]) for s in specs}
    bounds = {s.name: grid_bounds(prepared.qparams[s.name], ranks[s.name]) for s in specs}
    images = ImageSet.from_folder(args.images, Preprocess(**(table.options.preprocess or {})), None, args.num_images)
    float_s = int_s = compare_s = 0.0
    values = count = 0
    for _path, sample, _label in images.samples(graph):
        start = time.thread_time()
        floats = runner.run_dict(sample)
        float_s += time.thread_time() - start
        codes = {}
        start = time.thread_time()
        prepared.run(sample, keep_all=False, on_tensor=lambda name, c: codes.__setitem__(name, c) if name in names
                     else None)
        int_s += time.thread_time() - start
        if count == 0:  # the kernels load from numba's cache (or compile) on their first calls: not timed
            for s in specs:
                compare(floats[s.name], codes[s.name], prepared.qparams[s.name], histogram=histograms[s.name],
                        grid=bounds[s.name])
        start = time.thread_time()
        for s in specs:
            compare(floats[s.name], codes[s.name], prepared.qparams[s.name], histogram=histograms[s.name],
                    grid=bounds[s.name])
        compare_s += time.thread_time() - start
        values += sum(floats[s.name].size for s in specs)
        count += 1
    print(f"{len(specs)} layers, {count} images, {values / count / 1e6:.2f} M values per image (CPU time per image)")
    print(f"float run (every layer tensor out): {1e3 * float_s / count:7.1f} ms")
    print(f"integer run:                        {1e3 * int_s / count:7.1f} ms")
    print(f"comparing every layer (one pass):   {1e3 * compare_s / count:7.1f} ms  "
          f"({compare_s / float_s:.2f} x the float run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
