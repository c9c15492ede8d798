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

import os
import sys
import time

from report_layers import layer_bench  # bench/ is the script's folder, first on sys.path


def main(argv=None) -> int:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as `ptq report` runs
    bench = layer_bench(__doc__.splitlines()[0], argv)
    from reports.grid import grid_bounds
    from reports.pair_sums import compare
    from reports.value_histogram import ValueHistogram

    graph, prepared, specs, runner, images = bench.graph, bench.prepared, bench.specs, bench.runner, bench.images
    names = {s.name for s in specs}
    ranks = {s.name: len(graph.tensors[s.name].shape or ()) for s in specs}
    histograms = {s.name: ValueHistogram.for_grid(prepared.qparams[s.name], ranks[s.name]) for s in specs}
    bounds = {s.name: grid_bounds(prepared.qparams[s.name], ranks[s.name]) for s in specs}
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
