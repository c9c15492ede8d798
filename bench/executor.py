"""Benchmark: ptq's integer executor against onnxruntime float on EfficientNet-Lite0, same images.

    python3 bench/executor.py [--model M] [--quant Q.json] [--images DIR] [--repeat R] [--profile-top K]

Without `--quant` the model is calibrated first (on examples/calib; not timed). Prints the mean time per
image of `IntegerGraph.run` (outputs-only memory mode, as plain inference runs) and of onnxruntime CPU
sessions on the float model (default threads, and one thread as ptq's kernels use: OPENBLAS_NUM_THREADS=1
unless set, as the `ptq` command runs), the ratios, the integer time by op type, and cProfile's top functions of the
integer run by own time (the kernels). Both sides run on the same preprocessed images, after one warm-up
run, alternating image by image (so a change in machine load hits both alike).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ptq.cli import one_blas_thread  # noqa: E402  (imports no numpy)

one_blas_thread()  # as the `ptq` command runs; before numpy is imported

import numpy as np  # noqa: E402

from ptq.pipeline import calibrate, input_spec  # noqa: E402
from ptq.executor import prepare  # noqa: E402
from ptq.float_run import image_input  # noqa: E402
from ptq.core.graph import load_model  # noqa: E402
from ptq.images import ImageLog, Preprocess, load_image, select_files  # noqa: E402
from ptq.quant_table import load_quant_table  # noqa: E402


def _images(folder: Path, graph, pre: Preprocess) -> list[np.ndarray]:
    spec = input_spec(graph, pre)
    return [load_image(p, pre, spec)[None] for p in select_files(folder, ImageLog())]


def _interleaved_times(fns: dict, samples: list[np.ndarray], repeat: int) -> dict[str, float]:
    """Mean seconds per image of each function; the functions alternate image by image, so that a machine
    whose load changes during the run slows all of them alike."""
    for fn in fns.values():
        fn(samples[0])  # warm-up (lazy allocations, BLAS threads)
    totals = dict.fromkeys(fns, 0.0)
    for _ in range(repeat):
        for x in samples:
            for key, fn in fns.items():
                start = time.perf_counter()
                fn(x)
                totals[key] += time.perf_counter() - start
    return {key: total / (repeat * len(samples)) for key, total in totals.items()}


def _ort_session(ort, model: str, threads: int):
    """An onnxruntime CPU session (`threads` 0: its default, one per core). Idle intra-op threads otherwise
    spin for a while after each run, taking a core from the ptq run that follows."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _time_by_op(prepared, name: str, samples: list[np.ndarray]) -> dict[str, float]:
    """Seconds per image spent in each op type (steps run one by one through `IntegerGraph.run_step`)."""
    from ops.registry import IntRuntime

    totals: dict[str, float] = {}
    constants = prepared.graph.initializers
    for x in samples:
        values = {name: prepared.qparams[name].quantize(x)}
        runtime = IntRuntime(backend=prepared.backend)
        for step in prepared.steps:
            args = [(values[i] if i in values else constants[i]) if i else None for i in step.node.inputs]
            start = time.perf_counter()
            outs = prepared.run_step(step, args, runtime)
            key = step.node.op_type + (f"+{step.node.attrs['activation']}" if "activation" in step.node.attrs else "")
            if step.node.op_type == "Conv" and int(step.node.attrs.get("group", 1)) > 1:
                key += " (depthwise)"
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
            values.update(zip(step.node.outputs, outs))
    return {k: v / len(samples) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "efficientnet_lite0.onnx"))
    parser.add_argument("--quant", help="a .quant.json; default: calibrate on --calib first")
    parser.add_argument("--calib", default=str(REPO / "examples" / "calib"))
    parser.add_argument("--images", default=str(REPO.parent / "shared" / "assets" / "images" / "eval"))
    parser.add_argument("--repeat", type=int, default=1, help="passes over the images per measurement")
    parser.add_argument("--profile-top", type=int, default=15)
    args = parser.parse_args(argv)

    import onnxruntime as ort

    graph = load_model(args.model)
    if args.quant:
        table = load_quant_table(args.quant)
    else:
        print(f"calibrating {Path(args.model).name} on {args.calib} ...", flush=True)
        table = calibrate(args.model, args.calib, write_qdq=False).table
    pre = Preprocess(**table.options.preprocess) if table.options.preprocess else Preprocess()
    samples = _images(Path(args.images), graph, pre)
    name = image_input(graph)

    start = time.perf_counter()
    prepared = prepare(graph, table)
    prepare_s = time.perf_counter() - start

    sessions = {threads: _ort_session(ort, args.model, threads) for threads in (0, 1)}
    times = _interleaved_times(
        {
            "ort": lambda x: sessions[0].run(None, {name: x}),
            "ort1": lambda x: sessions[1].run(None, {name: x}),
            "ptq": lambda x: prepared.run({name: x}, keep_all=False),
        },
        samples,
        args.repeat,
    )
    t_ort, t_ort1, t_ptq = times["ort"], times["ort1"], times["ptq"]

    print(f"images: {len(samples)} x {args.repeat} pass(es), model {Path(args.model).name}")
    print(f"ptq prepare (rewrites + quantize rules): {1000 * prepare_s:.0f} ms, once")
    print(f"onnxruntime {ort.__version__} float, CPUExecutionProvider, no spinning:")
    print(f"  default threads : {1000 * t_ort:8.2f} ms/image")
    print(f"  one thread      : {1000 * t_ort1:8.2f} ms/image")
    print(f"ptq integer       : {1000 * t_ptq:8.2f} ms/image (backend {prepared.backend.name}, one thread, "
          f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']})")
    print(f"ratio ptq / onnxruntime float: {t_ptq / t_ort:.2f}x (default threads), {t_ptq / t_ort1:.2f}x (one thread)")
    if prepared.float_nodes:
        print(f"note: {len(prepared.float_nodes)} node(s) ran in float fallback: "
              + ", ".join(f"{f.name} ({f.op_type})" for f in prepared.float_nodes))

    print("\ninteger time per image by op type:")
    for op_type, seconds in _time_by_op(prepared, name, samples).items():
        print(f"  {op_type:28s} {1000 * seconds:8.2f} ms")

    profiler = cProfile.Profile()
    profiler.enable()
    for x in samples:
        prepared.run({name: x}, keep_all=False)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile_top)
    print(f"\ncProfile of the integer run over {len(samples)} images, top {args.profile_top} by own time:")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip() and not line.startswith("   Ordered")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
