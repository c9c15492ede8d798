"""Sequence and transformer models (issue 25) in ptq's integer run beside onnxruntime's quantizer and NNCF, on
the same calibration and evaluation samples, in one run.

    python bench/sequence_models.py [--models char_tagger,gelu_classifier,gru_tagger] [--eval N] [--no-nncf]
                                    [--more-gru N]

Models and samples come from `bench/models/` (their build scripts; the .onnx and the sample folders are
committed): per model `<name>.onnx` and `<name>_data/{calib,eval}/*.npz`. Each quantizer calibrates on
`calib` only, with its defaults:
- ptq: `ptq.calibrate(model, data=calib)` (what `ptq calibrate --data calib` does, no other flag), then the
  integer run (`ptq.prepare(...).run`);
- onnxruntime: `quantize_static` (QDQ, int8, MinMax), its model run by onnxruntime with graph optimizations off
  (the arithmetic the QDQ graph describes);
- NNCF: `nncf.quantize` (its ONNX backend, default preset), in its own venv (`/work/nncfenv/bin/python`) as a
  subprocess; its model run like onnxruntime's.
Figures on `eval`, against the float model (onnxruntime): the tagger's ArgMax agreement on real (unpadded)
positions, the classifier's top-1 agreement, the per-frame argmax agreement of the GRU tagger, the VAD's speech
decisions (p > 0.5; its samples are streaming steps, each with the state the float model returned before).
`--more-gru N` adds N sequences drawn from the GRU tagger's task (`bench/models/gru_task.py`, seed 5) to its
evaluation samples: its few disagreements need more frames than the committed 200 sequences to tell apart.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "models")]

from ptq.api import calibrate  # noqa: E402
from ptq.core.graph import load_model  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from gru_task import make_batch  # noqa: E402

MODELS = ROOT / "bench" / "models"
NNCF_PYTHON = Path("/work/nncfenv/bin/python")
NNCF_SCRIPT = """
import sys, numpy as np, onnx, nncf
model = onnx.load(sys.argv[1])
files = sys.argv[3:]
samples = [dict(np.load(f)) for f in files]
quantized = nncf.quantize(model, nncf.Dataset(samples), subset_size=len(samples))
onnx.save(quantized, sys.argv[2])
"""


def samples(folder: Path, input_name: str, limit: int = 0) -> list[tuple[Path, dict]]:
    """(path, feeds) of the .npy (one input) / .npz (one array per input) files, in name order."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".npy", ".npz"))[: limit or None]
    return [(path, dict(np.load(path)) if path.suffix == ".npz" else {input_name: np.load(path)}) for path in files]


def session(path, optimize: bool = True) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def agreement(name: str, feeds: dict, want: np.ndarray, got: np.ndarray) -> tuple[int, int]:
    """(agreeing, counted) for one sample."""
    if name == "char_tagger":  # tags on the real positions
        real = feeds["attention_mask"].astype(bool)
        return int(np.count_nonzero(got[real] == want[real])), int(np.count_nonzero(real))
    if name == "vad":  # speech decisions
        return int(np.count_nonzero((got > 0.5) == (want > 0.5))), int(want.size)
    classes_want, classes_got = np.argmax(want, axis=-1), np.argmax(got, axis=-1)
    return int(np.count_nonzero(classes_want == classes_got)), int(classes_want.size)


class Reader:
    """onnxruntime's CalibrationDataReader over the calibration samples."""

    def __init__(self, items):
        self.items = iter([feeds for _, feeds in items])

    def get_next(self):
        return next(self.items, None)


def ort_quantized(model: Path, calib, out: Path) -> Path:
    from onnxruntime.quantization import quantize_static

    path = out / f"{model.stem}.ort.onnx"
    quantize_static(str(model), str(path), Reader(calib))
    return path


def nncf_quantized(model: Path, calib, out: Path) -> Path:
    """NNCF in its own venv on the calibration feeds (written as .npz for it)."""
    path = out / f"{model.stem}.nncf.onnx"
    feeds = out / "nncf_feeds"
    feeds.mkdir(exist_ok=True)
    files = []
    for k, (_, sample) in enumerate(calib):
        files.append(feeds / f"{k:03d}.npz")
        np.savez(files[-1], **sample)
    subprocess.run([str(NNCF_PYTHON), "-c", NNCF_SCRIPT, str(model), str(path), *map(str, files)],
                   check=True, capture_output=True)
    return path


def evaluate(name: str, eval_items, run) -> float:
    agree = counted = 0
    for _path, feeds in eval_items:
        a, c = run(feeds)
        agree, counted = agree + a, counted + c
    return agree / max(counted, 1)


def bench_model(name: str, eval_limit: int, use_nncf: bool, more: int = 0) -> dict:
    model = MODELS / f"{name}.onnx"
    data = MODELS / f"{name}_data"
    float_session = session(model)
    input_name = float_session.get_inputs()[0].name
    calib, evals = samples(data / "calib", input_name), samples(data / "eval", input_name, eval_limit)
    if more:
        drawn, _ = make_batch(np.random.default_rng(5), more)
        evals += [(Path(f"drawn/{k:04d}"), {input_name: drawn[k:k + 1]}) for k in range(more)]
    output = float_session.get_outputs()[0].name
    want = {path: float_session.run([output], feeds)[0] for path, feeds in evals}
    row = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        try:
            result = calibrate(model, data=str(data / "calib"), out=tmp, quiet=True)
            graph = load_model(model, result.table.options.input_shapes)
            prepared = prepare(graph, result.table)
            row["ptq_float_nodes"] = [f.name for f in prepared.float_nodes]

            def run_ptq(feeds, path_of={id(f): p for p, f in evals}):
                got = prepared.run(feeds, keep_all=False).outputs[output]
                return agreement(name, feeds, want[path_of[id(feeds)]], got)

            row["ptq"] = evaluate(name, evals, run_ptq)
        except (ValueError, RuntimeError) as exc:  # ptq's errors are one-line ValueErrors
            row["ptq"], row["ptq_float_nodes"] = f"failed: {str(exc)[:200]}", []
        row["ptq_seconds"] = time.perf_counter() - start
        for label, build in (("onnxruntime", lambda: ort_quantized(model, calib, Path(tmp))),
                             ("nncf", lambda: nncf_quantized(model, calib, Path(tmp)))):
            if label == "nncf" and not (use_nncf and NNCF_PYTHON.exists()):
                continue
            try:
                quantized = session(build(), optimize=False)
            except (subprocess.CalledProcessError, RuntimeError, ValueError) as exc:
                row[label] = f"failed: {str(getattr(exc, 'stderr', b'') or exc)[-200:]}"
                continue

            def run_ort(feeds, s=quantized, path_of={id(f): p for p, f in evals}):
                return agreement(name, feeds, want[path_of[id(feeds)]], s.run([output], feeds)[0])

            row[label] = evaluate(name, evals, run_ort)
    return row


METRICS = {"char_tagger": "ArgMax agreement on real positions", "gelu_classifier": "top-1 agreement",
           "gru_tagger": "per-frame argmax agreement", "vad": "speech decisions (p > 0.5) agreement"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(METRICS))
    parser.add_argument("--eval", type=int, default=0, help="evaluation samples per model (default: all)")
    parser.add_argument("--no-nncf", action="store_true")
    parser.add_argument("--more-gru", type=int, default=0, help="gru_tagger: N more drawn evaluation sequences")
    args = parser.parse_args()
    print(f"{'model':<18} {'metric':<38} {'ptq':>8} {'onnxruntime':>12} {'nncf':>8}")
    for name in args.models.split(","):
        row = bench_model(name, args.eval, not args.no_nncf, args.more_gru if name == "gru_tagger" else 0)
        cells = [f"{row[k]:.4f}" if isinstance(row.get(k), float) else "failed" if k in row else "-"
                 for k in ("ptq", "onnxruntime", "nncf")]
        label = f"{name} +{args.more_gru}" if name == "gru_tagger" and args.more_gru else name
        print(f"{label:<18} {METRICS[name]:<38} {cells[0]:>8} {cells[1]:>12} {cells[2]:>8}"
              f"   (ptq calibrate+run {row['ptq_seconds']:.1f} s; float nodes: {row['ptq_float_nodes'] or 'none'})")
        for k in ("ptq", "onnxruntime", "nncf"):
            if isinstance(row.get(k), str):
                print(f"    {k} {row[k]}")


if __name__ == "__main__":
    main()
