"""Benchmark: ptq's integer executor, compiled and numpy backends, against onnxruntime float and int8, same images.

    python3 bench/executor.py [--model M] [--quant Q.json] [--images DIR] [--input-shape input:1,3,320,320]
                              [--backend compiled numpy] [--repeat R] [--profile-top K]

Without `--quant` the model is calibrated first (on examples/calib, at `--input-shape` if given; not timed).
Prints the warm time per image of `IntegerGraph.run` (outputs-only memory mode, as plain inference runs; the
mean over the images of the fastest of `--repeat` passes) for each backend, of onnxruntime CPU sessions on
the float model (default threads, and one thread as ptq's kernels use: OPENBLAS_NUM_THREADS=1 unless set, as
the `ptq` command runs) and of onnxruntime running ptq's own QDQ model of the same table (one thread: its int8
kernels), wall and CPU time (the CPU ratio is the fair one on a machine other jobs load), the ratios, whether
the backends give the same codes on every tensor of every image, the first run
of a new process (`bench/first_run.py`: with an empty numba cache, i.e. compiling every kernel, and with the
on-disk cache), the integer time by op type per backend, and cProfile's top functions of the first backend's
run by own time. All runs see the same preprocessed images, after one warm-up run, alternating image by
image (so a change in machine load hits them alike).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import json
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_EVAL = Path("/work/shared/assets/images/eval")  # the 20 labelled eval photos, where this machine has them
sys.path.insert(0, str(REPO))

from ptq.cli import one_blas_thread  # noqa: E402  (imports no numpy)

one_blas_thread()  # as the `ptq` command runs; before numpy is imported

import numpy as np  # noqa: E402

from ptq.engine.backends import BACKEND_NAMES, get_backend  # noqa: E402
from ptq.calibration.pipeline import calibrate, input_spec  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.engine.float_run import image_input  # noqa: E402
from ptq.core.graph import load_model, parse_input_shapes  # noqa: E402
from ptq.data.images import ImageLog, Preprocess, load_image, select_files  # noqa: E402
from ptq.qdq.export import export_qdq  # noqa: E402
from ptq.table.quant_table import load_quant_table, save_quant_table  # noqa: E402


def numba_target() -> str:
    """The CPU numba compiles for (NUMBA_CPU_NAME, else this host's)."""
    import numba  # reason: imported by the compiled backend already; the numpy-only bench needs no numba
    from llvmlite import binding

    return numba.config.CPU_NAME or binding.get_host_cpu_name()


def _images(folder: Path, graph, pre: Preprocess) -> list[np.ndarray]:
    spec = input_spec(graph, pre)
    return [load_image(p, pre, spec)[None] for p in select_files(folder, ImageLog())]


def _interleaved_times(fns: dict, samples: list[np.ndarray], repeat: int) -> dict[str, tuple[float, float]]:
    """(wall, CPU) seconds per image of each function: the mean over the images of one pass, the smallest over
    `repeat` passes (the pass the machine's other load disturbed least). The functions alternate image by
    image, so that a machine whose load changes during the run slows all of them alike. CPU time
    (`time.process_time`, every thread of this process) is what a one-thread run costs whatever else the
    machine runs; wall time is what a multi-threaded run gains."""
    for fn in fns.values():
        fn(samples[0])  # warm-up (lazy allocations, BLAS threads)
    best = {key: (float("inf"), float("inf")) for key in fns}
    for _ in range(repeat):
        wall = dict.fromkeys(fns, 0.0)
        cpu = dict.fromkeys(fns, 0.0)
        for x in samples:
            for key, fn in fns.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                fn(x)
                cpu[key] += time.process_time() - start_cpu
                wall[key] += time.perf_counter() - start
        best = {key: (min(best[key][0], wall[key] / len(samples)), min(best[key][1], cpu[key] / len(samples)))
                for key in fns}
    return best


def _bit_exact(prepared: dict, name: str, samples: list[np.ndarray]) -> str:
    """Whether every backend gives the first one's codes on every tensor of every sample, as one line."""
    backends = list(prepared)
    if len(backends) < 2:
        return ""
    tensors = 0
    for i, x in enumerate(samples):
        runs = {b: prepared[b].run({name: x}).tensors for b in backends}
        want = runs[backends[0]]
        for b in backends[1:]:
            for tensor, codes in want.items():
                if not np.array_equal(runs[b][tensor], codes) or runs[b][tensor].dtype != codes.dtype:
                    return f"NOT bit-exact: {b} differs from {backends[0]} on {tensor!r}, image {i}"
        tensors += len(want)
    return (f"bit-exact: {', '.join(backends)} give the same codes on every tensor ({tensors // len(samples)}) "
            f"of every image ({len(samples)})")


def _ort_session(ort, model: bytes, threads: int):
    """An onnxruntime CPU session (`threads` 0: its default, one per core). Idle intra-op threads otherwise
    spin for a while after each run, taking a core from the ptq run that follows."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _time_by_op(prepared, name: str, samples: list[np.ndarray]) -> dict[str, float]:
    """CPU seconds per image spent in each op type (steps run one by one through `IntegerGraph.run_step`)."""
    from ops.registry import IntRuntime

    totals: dict[str, float] = {}
    constants = prepared.graph.initializers
    for x in samples:
        values = {name: prepared.qparams[name].quantize(x)}
        runtime = IntRuntime(backend=prepared.backend)
        for step in prepared.steps:
            args = [(values[i] if i in values else constants[i]) if i else None for i in step.node.inputs]
            start = time.process_time()
            outs = prepared.run_step(step, args, runtime)
            key = step.node.op_type + (f"+{step.node.attrs['activation']}" if "activation" in step.node.attrs else "")
            if step.node.op_type == "Conv" and int(step.node.attrs.get("group", 1)) > 1:
                key += " (depthwise)"
            totals[key] = totals.get(key, 0.0) + time.process_time() - start
            values.update(zip(step.node.outputs, outs))
    return {k: v / len(samples) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def _first_runs(args, table, sample: np.ndarray) -> dict[str, dict[str, float]]:
    """`bench/first_run.py` in new processes: the compiled backend with an empty numba cache (a cold
    compile) and with the on-disk cache, and the numpy backend."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        quant, npy = Path(tmp) / "table.quant.json", Path(tmp) / "sample.npy"
        save_quant_table(table, quant)
        np.save(npy, sample)
        command = [sys.executable, str(REPO / "bench" / "first_run.py"), args.model, str(quant), str(npy)]
        command += [f"--input-shape={spec}" for spec in args.input_shape or []]
        runs = [("compiled, empty cache", "compiled", {"NUMBA_CACHE_DIR": str(Path(tmp) / "numba")})]
        runs += [(f"{backend}, cached" if backend == "compiled" else backend, backend, {})
                 for backend in args.backend]
        for label, backend, env in runs:
            if backend not in args.backend:
                continue
            done = subprocess.run(command + ["--backend", backend], env={**os.environ, **env}, check=True,
                                  capture_output=True, text=True)
            results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "efficientnet_lite0.onnx"))
    parser.add_argument("--quant", help="a .quant.json; default: calibrate on --calib first")
    parser.add_argument("--calib", default=str(REPO / "examples" / "calib"))
    parser.add_argument("--images", default=str(SHARED_EVAL if SHARED_EVAL.is_dir() else REPO / "examples" / "calib"))
    parser.add_argument("--input-shape", action="append", metavar="NAME:D0,D1,..",
                        help="fix the input shape (e.g. input:1,3,320,320), for ptq and onnxruntime alike")
    parser.add_argument("--backend", nargs="+", default=["compiled", "numpy"], choices=BACKEND_NAMES,
                        help="integer backends to time (default: both)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="passes over the images; each figure is the fastest pass's mean")
    parser.add_argument("--profile-top", type=int, default=15)
    args = parser.parse_args(argv)

    import onnxruntime as ort

    shapes = parse_input_shapes(args.input_shape)
    graph = load_model(args.model, shapes)
    if args.quant:
        table = load_quant_table(args.quant)
    else:
        print(f"calibrating {Path(args.model).name} on {args.calib} ...", flush=True)
        table = calibrate(args.model, args.calib, write_qdq=False, input_shapes=shapes or None,
                          progress=False).table
    pre = Preprocess(**table.options.preprocess) if table.options.preprocess else Preprocess()
    samples = _images(Path(args.images), graph, pre)
    name = image_input(graph)

    first = _first_runs(args, table, samples[0])
    start = time.perf_counter()
    prepared = {b: prepare(graph, table, backend=get_backend(b)) for b in args.backend}
    prepare_s = (time.perf_counter() - start) / len(args.backend)

    model_bytes = graph.model.SerializeToString()  # the float model at the input shape ptq runs
    sessions = {threads: _ort_session(ort, model_bytes, threads) for threads in (0, 1)}
    # ptq's own QDQ model (the same table), which onnxruntime runs on its int8 kernels (default optimizations)
    qdq = _ort_session(ort, export_qdq(graph, table).SerializeToString(), 1)
    fns = {"ort": lambda x: sessions[0].run(None, {name: x}), "ort1": lambda x: sessions[1].run(None, {name: x}),
           "ort_int8": lambda x: qdq.run(None, {name: x})}
    for b, p in prepared.items():
        fns[b] = (lambda p: lambda x: p.run({name: x}, keep_all=False))(p)
    times = _interleaved_times(fns, samples, args.repeat)
    (t_ort, _), (t_ort1, c_ort1) = times["ort"], times["ort1"]

    shape = "x".join(str(d) for d in samples[0].shape)
    print(f"images: {len(samples)} x {args.repeat} pass(es), model {Path(args.model).name}, input {shape}")
    print(f"onnxruntime {ort.__version__} float, CPUExecutionProvider, no spinning; ptq on one thread "
          f"(OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}); ptq prepare {1000 * prepare_s:.0f} ms once")
    if "compiled" in args.backend:
        from ops.compiled.vnni import INSTRUCTION_NAME  # reason: imports numba, which only the compiled backend needs

        print(f"compiled backend's integer dot products: {INSTRUCTION_NAME} (numba target {numba_target()})")
    print("\n| warm, per image | ms | CPU ms | ptq / onnxruntime one thread | ptq / onnxruntime one thread, CPU "
          "| ptq / onnxruntime default threads |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| onnxruntime float, default threads | {1000 * t_ort:.2f} | {1000 * times['ort'][1]:.2f} | | | |")
    print(f"| onnxruntime float, one thread | {1000 * t_ort1:.2f} | {1000 * c_ort1:.2f} | | | |")
    t_int8, c_int8 = times["ort_int8"]
    print(f"| onnxruntime int8 (ptq's QDQ model), one thread | {1000 * t_int8:.2f} | {1000 * c_int8:.2f} | | | |")
    for b in args.backend:
        wall, cpu = times[b]
        print(f"| ptq integer, `--backend {b}` | {1000 * wall:.2f} | {1000 * cpu:.2f} | {wall / t_ort1:.2f}x | "
              f"{cpu / c_ort1:.2f}x | {wall / t_ort:.2f}x |")
    print("\n| ptq integer, one thread | / onnxruntime int8 | / onnxruntime int8, CPU |")
    print("|---|---:|---:|")
    for b in args.backend:
        wall, cpu = times[b]
        print(f"| `--backend {b}` | {wall / t_int8:.2f}x | {cpu / c_int8:.2f}x |")

    print("\n| first run of a new process | prepare ms | first run ms | second run ms |")
    print("|---|---:|---:|---:|")
    for label, t in first.items():
        print(f"| {label} | {1000 * t['prepare_s']:.0f} | {1000 * t['first_run_s']:.1f} | "
              f"{1000 * t['second_run_s']:.1f} |")
    for p in prepared.values():
        if p.float_nodes:
            print(f"note: {len(p.float_nodes)} node(s) ran in float fallback: "
                  + ", ".join(f"{f.name} ({f.op_type})" for f in p.float_nodes))
            break

    exact = _bit_exact(prepared, name, samples)
    if exact:
        print(exact)

    by_op = {b: _time_by_op(p, name, samples) for b, p in prepared.items()}
    keys = sorted({k for t in by_op.values() for k in t}, key=lambda k: -max(t.get(k, 0.0) for t in by_op.values()))
    print("\n| integer CPU ms per image by op type | " + " | ".join(args.backend) + " |")
    print("|---|" + "---:|" * len(args.backend))
    for key in keys:
        print(f"| {key} | " + " | ".join(f"{1000 * by_op[b].get(key, 0.0):.2f}" for b in args.backend) + " |")
    print("| all steps | " + " | ".join(f"{1000 * sum(by_op[b].values()):.2f}" for b in args.backend) + " |")
    print("| whole run (the steps and the executor around them) | "
          + " | ".join(f"{1000 * times[b][1]:.2f}" for b in args.backend) + " |")

    if args.profile_top:
        first_backend = args.backend[0]
        profiler = cProfile.Profile()
        profiler.enable()
        for x in samples:
            prepared[first_backend].run({name: x}, keep_all=False)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile_top)
        print(f"\ncProfile of the {first_backend} integer run over {len(samples)} images, top {args.profile_top} "
              "by own time:")
        print("\n".join(line for line in out.getvalue().splitlines()
                        if line.strip() and not line.startswith("   Ordered")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
