"""The first integer run of a fresh process: what a user's first `ptq run` pays before the warm speed.

    python3 bench/first_run.py MODEL QUANT.json SAMPLE.npy [--backend compiled|numpy] [--input-shape N:D,..]

Prints one line of JSON: seconds for `prepare`, the first run (compiling the kernels, or loading them from
numba's on-disk cache) and the second run. `bench/executor.py` runs it twice with an empty cache
(NUMBA_CACHE_DIR set to a new folder: a cold compile) and with the usual cache.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ptq.cli import one_blas_thread  # noqa: E402  (imports no numpy)

one_blas_thread()

import numpy as np  # noqa: E402

from ptq.engine.backends import get_backend  # noqa: E402
from ptq.core.graph import load_model, parse_input_shapes  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.engine.float_run import image_input  # noqa: E402
from ptq.table.quant_table import load_quant_table  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("quant")
    parser.add_argument("sample", help="a preprocessed input (.npy)")
    parser.add_argument("--backend", default="compiled")
    parser.add_argument("--input-shape", action="append")
    args = parser.parse_args(argv)
    graph = load_model(args.model, parse_input_shapes(args.input_shape))
    table = load_quant_table(args.quant)
    x = np.load(args.sample)
    name = image_input(graph)
    times = {}
    start = time.perf_counter()
    prepared = prepare(graph, table, backend=get_backend(args.backend))
    times["prepare_s"] = time.perf_counter() - start
    for key in ("first_run_s", "second_run_s"):
        start = time.perf_counter()
        prepared.run({name: x}, keep_all=False)
        times[key] = time.perf_counter() - start
    print(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
