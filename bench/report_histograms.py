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

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "efficientnet_lite0.onnx"))
    parser.add_argument("--quant", help="quant table (default: calibrate on examples/calib)")
    parser.add_argument("--images", default=str(REPO.parent / "shared" / "assets" / "images" / "eval"))
    parser.add_argument("--num-images", type=int, default=8)
    args = parser.parse_args(argv)

    from ptq.core.graph import load_model
    from ptq.executor import prepare
    from ptq.images import Preprocess
    from ptq.pipeline import calibrate
    from ptq.quant_table import load_quant_table
    from reports.float_reference import float_reference
    from reports.image_source import ImageSet
    from reports.layer_specs import layer_specs
    from reports.value_histogram import ValueHistogram

    with tempfile.TemporaryDirectory() as tmp:
        quant = args.quant or calibrate(args.model, REPO / "examples" / "calib", tmp, write_qdq=False,
                                        preprocess=Preprocess(mean=127, std=128)).table_path
        table = load_quant_table(quant)
    graph = load_model(args.model, table.options.input_shapes)
    prepared = prepare(graph, table)
    specs = layer_specs(prepared, graph.activations)
    runner = float_reference(graph, [s.name for s in specs])
    histograms = {s.name: ValueHistogram.for_grid(prepared.qparams[s.name], len(graph.tensors[s.name].shape or ()))
                  for s in specs}
    images = ImageSet.from_folder(args.images, Preprocess(**(table.options.preprocess or {})), None, args.num_images)
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
