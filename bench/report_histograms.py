#!/usr/bin/env python3
"""Cost of the report's value histograms (`reports.value_histogram`): one per layer, every image.

    python3 bench/report_histograms.py [--model M] [--quant Q.json] [--images DIR] [--num-images 8]

Without --quant the model is calibrated first (examples/calib; not timed). Per image, in CPU time of the calling
thread (robust to a loaded machine; the float reference runs onnxruntime on one thread, in this one):
the float run with every layer tensor as an output (`reports.float_reference`, what the report runs anyway) and
binning all those tensors into their histograms. Prints both, their ratio, the values binned per image and the
memory the histograms hold (their counts), which does not grow with the number of images.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from report_layers import layer_bench  # bench/ is the script's folder, first on sys.path


def main(argv=None) -> int:
    bench = layer_bench(__doc__.splitlines()[0], argv)
    from reports.value_histogram import ValueHistogram

    graph, prepared, specs, runner, images = bench.graph, bench.prepared, bench.specs, bench.runner, bench.images
    histograms = {s.name: ValueHistogram.for_grid(prepared.qparams[s.name], len(graph.tensors[s.name].shape or ()))
                  for s in specs}
    # the kernel loads from numba's cache (or compiles) on its first call: not timed
    ValueHistogram(low=-1.0, high=1.0, inner=4, steps_per_bin=1.0).update(np.zeros(1, dtype=np.float32))
    float_s = bin_s = 0.0
    values = count = 0
    for _path, sample, _label in images.samples(graph):
        start = time.thread_time()
        floats = runner.run_dict(sample)
        float_s += time.thread_time() - start
        start = time.thread_time()
        for s in specs:
            histograms[s.name].update(floats[s.name])
        bin_s += time.thread_time() - start
        values += sum(floats[s.name].size for s in specs)
        count += 1
    memory = sum(h.counts.nbytes for h in histograms.values())
    print(f"{len(specs)} layers, {count} images, {values / count / 1e6:.2f} M values per image")
    print(f"float run (every layer tensor out): {1e3 * float_s / count:7.1f} ms/image")
    print(f"binning into the histograms:        {1e3 * bin_s / count:7.1f} ms/image  "
          f"({bin_s / float_s:.3f} x the float run)")
    print(f"histogram memory: {memory / 1024:.1f} KiB ({memory // len(specs)} bytes per layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
