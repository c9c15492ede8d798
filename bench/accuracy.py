"""Accuracy of the calibration methods, one row per method/combination, beside onnxruntime's quantize_static.

    python bench/accuracy.py                      # the bundled model, per-channel and per-tensor
    python bench/accuracy.py MODEL CALIB EVAL     # any model, calibration folder and held-out folder
        [--mean 127 --std 128] [--rows per-tensor+equalize+bias-correction,...] [--no-ort] [--tune-target 0.998]

Row parts: per-channel / per-tensor, equalize, bias-correction, analytic-bias-correction, adaround,
range-search, kld / mse (the activation calibrator), tune (CALIB split into fit and validation parts as `ptq
tune` splits it: calibrate on the fit part, `ptq.tune` to --tune-target deciding on the validation part;
the 16-bit column counts the tensors it moved).
Calibration runs on CALIB; every figure is measured on EVAL (held-out images, never fitted to): mean logits
cosine against the float model (onnxruntime), top-1 agreement with it, top-1 accuracy where files are named
`name_LABEL.jpg`, calibration time and peak resident memory of the calibration (a forked child per row).
onnxruntime's quantize_static (QDQ, int8 weights/uint8 activations, MinMax / Entropy / Percentile) runs on the
same calibration images in the same run, its QDQ model run by onnxruntime with graph optimizations off (the
arithmetic the QDQ graph describes; the fused kernels saturate on CPUs without VNNI, see README).
"""
from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptq.adjust.adjusted_model import load_model_for_table  # noqa: E402
from ptq.core.graph import load_model  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.engine.float_run import image_input  # noqa: E402
from ptq.data.images import ImageLog, Preprocess, load_image, select_files  # noqa: E402
from ptq.calibration.pipeline import calibrate, input_spec  # noqa: E402
from ptq.table.quant_table import load_quant_table  # noqa: E402
from ptq.data.labels import label_from_filename  # noqa: E402

BUNDLED = (ROOT / "examples/efficientnet_lite0.onnx", ROOT / "examples/calib", Path("/work/shared/assets/images/eval"))
DEFAULT_ROWS = ["per-channel", "per-channel+bias-correction", "per-channel+range-search",
                "per-channel+bias-correction+tune", "per-channel+equalize+bias-correction",
                "per-tensor", "per-tensor+equalize", "per-tensor+bias-correction",
                "per-tensor+equalize+bias-correction", "per-tensor+equalize+bias-correction+range-search"]
FLAGS = {"equalize", "bias-correction", "analytic-bias-correction", "adaround", "range-search", "per-tensor",
         "per-channel", "kld", "mse", "tune"}


def row_kwargs(row: str) -> dict:
    parts = row.split("+")
    unknown = set(parts) - FLAGS
    if unknown:
        raise SystemExit(f"unknown row parts {sorted(unknown)} (known: {sorted(FLAGS)})")
    kwargs = {"per_channel": "per-tensor" not in parts, "equalize": "equalize" in parts,
              "bias_correction": "bias-correction" in parts, "adaround": "adaround" in parts,
              "analytic_bias_correction": "analytic-bias-correction" in parts,
              "range_search": "range-search" in parts}
    for cal in ("kld", "mse"):
        if cal in parts:
            kwargs["calibrator"] = cal
    return kwargs


def _calibrate_child(conn, model, calib, out, pre, kwargs, tune_target):
    start = time.perf_counter()
    int16 = None
    if tune_target is None:
        calibrate(model, calib, out, preprocess=pre, write_qdq=False, **kwargs)
    else:
        int16 = calibrate_and_tune(model, calib, out, pre, kwargs, tune_target)
    conn.send((time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, int16))


def calibrate_and_tune(model, calib, out, pre, kwargs, target: float) -> int:
    """CALIB split as `ptq tune` splits it: calibrate on the fit part, tune with the other part as validation
    (images neither calibration nor tuning fitted); the tuned table replaces the calibrated one. Returns the
    number of 16-bit tensors."""
    import dataclasses

    from ptq.adjust.adjusted_model import save_adjusted
    from ptq.table.quant_table import save_quant_table
    from ptq.tuning.tuner import DEFAULT_VALIDATION_FRACTION, tune
    from ptq.tuning.data import split_samples
    from ptq.data.image_source import ImageSet

    fit, validation = split_samples(ImageSet.from_folder(calib, pre), DEFAULT_VALIDATION_FRACTION)
    result = calibrate(model, fit.files, out, preprocess=pre, write_qdq=False, **kwargs)
    table = load_quant_table(result.table_path)
    graph = load_model_for_table(model, table, result.table_path, note=False)
    tuned = tune(graph, table, fit, target, budget_int16=1000, validation=validation,
                 reference=load_model(model, table.options.input_shapes))
    if tuned.table.options.adjusted_model is not None:
        _, relative, digest = save_adjusted(tuned.graph.model, result.table_path)
        tuned.table.options = dataclasses.replace(tuned.table.options, adjusted_model=relative,
                                                  adjusted_sha256=digest)
    save_quant_table(tuned.table, result.table_path)
    return len(tuned.int16_tensors)


def calibrate_row(model, calib, out, pre, kwargs, tune_target=None) -> tuple[float, float, Optional[int]]:
    """(seconds, peak RSS in MB, 16-bit tensors after tuning or None) of one calibration (and tuning), run in a
    fresh child process."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_calibrate_child,
                       args=(child, str(model), str(calib), str(out), pre, kwargs, tune_target))
    proc.start()
    result = parent.recv()
    proc.join()
    return result


class EvalSet:
    """The held-out samples, the float logits (onnxruntime on the original model) and the labels."""

    def __init__(self, model: Path, folder: Path, pre: Preprocess):
        import onnxruntime as ort

        graph = load_model(model)
        spec = input_spec(graph, pre)
        self.files = select_files(folder, ImageLog())
        self.samples = [load_image(f, pre, spec)[None] for f in self.files]
        self.labels = [label_from_filename(f) for f in self.files]
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        name = image_input(graph)
        self.input = name
        self.reference = [session.run(None, {name: s})[0].reshape(-1) for s in self.samples]

    def score(self, outputs: list[np.ndarray]) -> dict:
        cos = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(self.reference, outputs)]
        agree = [int(np.argmax(a) == np.argmax(b)) for a, b in zip(self.reference, outputs)]
        labelled = [(int(np.argmax(b)) == lab) for lab, b in zip(self.labels, outputs) if lab is not None]
        return {"cosine": float(np.mean(cos)), "top1_agree": float(np.mean(agree)),
                "accuracy": float(np.mean(labelled)) if labelled else None, "labelled": len(labelled)}


def ptq_outputs(model: Path, table_path: Path, ev: EvalSet) -> list[np.ndarray]:
    table = load_quant_table(table_path)
    graph = load_model_for_table(model, table, table_path, note=False)
    prepared = prepare(graph, table)
    out = graph.outputs[0]
    return [prepared.run({ev.input: s}, keep_all=False).outputs[out].reshape(-1) for s in ev.samples]


def ort_row(model: Path, calib: Path, pre: Preprocess, method: str, per_channel: bool, ev: EvalSet, tmp: Path):
    """onnxruntime quantize_static on the same calibration images, QDQ, evaluated with onnxruntime."""
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, quantize_static

    graph = load_model(model)
    spec = input_spec(graph, pre)
    files = select_files(calib, ImageLog())
    name = ev.input

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(files)

        def get_next(self):
            f = next(self.it, None)
            return None if f is None else {name: load_image(f, pre, spec)[None]}

    out = tmp / f"ort_{method}_{per_channel}.onnx"
    start = time.perf_counter()
    quantize_static(str(model), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                    calibrate_method=getattr(CalibrationMethod, method))
    seconds = time.perf_counter() - start
    options = ort.SessionOptions()  # optimizations off: the QDQ arithmetic as written (README, Measuring accuracy)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    return ev.score([session.run(None, {name: s})[0].reshape(-1) for s in ev.samples]), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="MODEL CALIB EVAL (default: the bundled model and photos)")
    parser.add_argument("--mean", default="127")
    parser.add_argument("--std", default="128")
    parser.add_argument("--rows", help="comma-separated rows, e.g. per-tensor+equalize+bias-correction (none: only onnxruntime)")
    parser.add_argument("--no-ort", action="store_true", help="skip onnxruntime's quantize_static rows")
    parser.add_argument("--tune-target", type=float, default=0.998, help="target cosine of the tune rows")
    args = parser.parse_args(argv)
    model, calib, held_out = (Path(p) for p in args.paths) if args.paths else BUNDLED
    pre = Preprocess(mean=args.mean, std=args.std)
    rows = [] if args.rows == "none" else args.rows.split(",") if args.rows else DEFAULT_ROWS
    ev = EvalSet(model, held_out, pre)
    print(f"{model.name}: calibrate on {calib} ({len(select_files(calib, ImageLog()))} images), "
          f"evaluate on {held_out} ({len(ev.samples)} images, {sum(l is not None for l in ev.labels)} labelled)")
    print(f"{'method':46s} {'cosine':>8s} {'top1 agr':>8s} {'acc':>6s} {'cal s':>7s} {'peak MB':>8s} {'16-bit':>6s}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for row in rows:
            out = tmp / row
            tune_target = args.tune_target if "tune" in row.split("+") else None
            seconds, peak, int16 = calibrate_row(model, calib, out, pre, row_kwargs(row), tune_target)
            s = ev.score(ptq_outputs(model, out / f"{model.stem}.quant.json", ev))
            acc = "-" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
            label = "ptq " + row + (f" {tune_target}" if tune_target is not None else "")
            print(f"{label:46s} {s['cosine']:8.4f} {s['top1_agree']:8.3f} {acc:>6s} {seconds:7.1f} {peak:8.0f} "
                  f"{int16 or 0:6d}", flush=True)
        if not args.no_ort:
            for per_channel in (True, False):
                for method in ("MinMax", "Entropy", "Percentile"):
                    label = f"onnxruntime {method} {'per-channel' if per_channel else 'per-tensor'}"
                    try:
                        s, seconds = ort_row(model, calib, pre, method, per_channel, ev, tmp)
                    except Exception as exc:  # noqa: BLE001  (a failing baseline is a row, not a crash)
                        print(f"{label:46s} failed: {str(exc).splitlines()[0][:80]}")
                        continue
                    acc = "-" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
                    print(f"{label:46s} {s['cosine']:8.4f} {s['top1_agree']:8.3f} {acc:>6s} {seconds:7.1f} {'':>8s}",
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
