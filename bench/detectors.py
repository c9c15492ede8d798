"""Detector and OCR models: ptq's integer run beside onnxruntime's quantizer and NNCF, on the same arrays.

    python bench/detectors.py [--models yolo,dbnet,crnn] [--calibrator NAME] [--no-ort] [--no-nncf]
                              [--nncf-python PATH]

Models (`bench/models/`, built by the scripts there; the sample arrays are written by
`bench/models/make_samples.py` when missing): a YOLOv8-style detector (DFL Softmax, pixel boxes and sigmoid
scores joined in one output [1, 22, 525]), a DBNet-style text detector (Paddle style, opset 11, Conv biases in
Adds) and a CRNN-style recognizer (opset 11, Softmax over 6,625 classes). Calibration on the 32 calib arrays,
every figure on the 256 eval arrays, each against the float model in onnxruntime:

- ptq: `ptq.calibrate(model, data=calib)` with every default (no flag; `--calibrator` names one), then the
  integer graph;
- ort: `onnxruntime.quantization.quantize_static`, QDQ, per-channel int8 weights, uint8 activations, MinMax,
  run by onnxruntime with graph optimizations off (the arithmetic the QDQ graph describes);
- nncf: `nncf.quantize` with its defaults (`bench/nncf_quantize.py`, in NNCF's own venv), run likewise.
The peers get opset-11 models converted to opset 13 (`onnx.version_converter`), where per-channel weights exist.

When ptq's integer run stops on a node (none of these models does today), the row `ptq*` is the run
with that node in float (`--float-nodes`), as a user would run it, and the error is printed.

Figures: `cosine`, the mean over samples of the output's cosine with float; for the detector the score rows'
and the box rows' cosine and the detections matched to float's (`reports.detections`: score >= 0.25, IoU >= 0.5,
same class, per-class NMS at 0.7 first) as recall / precision; for the recognizer the fraction of samples
whose greedy CTC decode equals float's; for the text detector the IoU of the text maps thresholded at 0.3.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import version_converter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "models"))

from make_samples import write_samples  # noqa: E402
from ptq.adjust.adjusted_model import load_model_for_table  # noqa: E402
from ptq.api import calibrate  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.table.quant_table import load_quant_table  # noqa: E402
from reports.detections import DetectionAgreement, yolo_detections  # noqa: E402

MODELS = {"yolo": "yolo_detector.onnx", "dbnet": "dbnet_detector.onnx", "crnn": "crnn_recognizer.onnx"}
TEXT_THRESHOLD = 0.3
NNCF_PYTHON = "/work/nncfenv/bin/python"
FAILED_OP = re.compile(r"^\w+ '([^']+)':")  # the executor's error prefix: OpType 'node name': ...


def load_arrays(folder: Path) -> list[np.ndarray]:
    return [np.load(f).astype(np.float32) for f in sorted(folder.glob("*.npy"))]


def session_outputs(path: Path, samples: list[np.ndarray], optimize: bool = True) -> list[np.ndarray]:
    options = ort.SessionOptions()
    if not optimize:  # the QDQ arithmetic as written
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return [session.run(None, {name: s})[0] for s in samples]


def ptq_outputs(model: Path, calib: Path, samples: list[np.ndarray], tmp: Path, float_nodes=(), calibrator=None):
    """(outputs, float nodes) of ptq's integer graph calibrated on `calib` with every default, or `calibrator`."""
    named = {} if calibrator is None else {"calibrator": calibrator}
    result = calibrate(model, data=calib, out=tmp / "ptq", quiet=True, **named)
    table = load_quant_table(result.table_path)
    graph = load_model_for_table(model, table, result.table_path, note=False)
    prepared = prepare(graph, table, float_nodes=list(float_nodes))
    name, out = graph.inputs[0], graph.outputs[0]
    outputs = [prepared.run({name: s}, keep_all=False).outputs[out] for s in samples]
    return outputs, [f"{f.name} ({f.op_type}: {f.reason})" for f in prepared.float_nodes]


def ort_outputs(model: Path, calib: list[np.ndarray], samples: list[np.ndarray], tmp: Path) -> list[np.ndarray]:
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, quantize_static

    name = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).get_inputs()[0].name

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            a = next(self.it, None)
            return None if a is None else {name: a}

    out = tmp / f"ort_{model.stem}.onnx"
    quantize_static(str(opset13(model, tmp)), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    calibrate_method=CalibrationMethod.MinMax)
    return session_outputs(out, samples, optimize=False)


def opset13(model: Path, tmp: Path) -> Path:
    """The model at opset 13 or above (`onnx.version_converter`): onnxruntime's per-channel QDQ writes per-axis
    DequantizeLinear nodes, which opset 11 lacks (the quantized opset-11 model does not load)."""
    loaded = onnx.load(model)
    if next(o.version for o in loaded.opset_import if o.domain in ("", "ai.onnx")) >= 13:
        return model
    path = tmp / f"{model.stem}.opset13.onnx"
    onnx.save(version_converter.convert_version(loaded, 13), path)
    return path


def nncf_outputs(model: Path, calib: Path, samples: list[np.ndarray], tmp: Path, python: str) -> list[np.ndarray]:
    out = tmp / f"nncf_{model.stem}.onnx"
    subprocess.run([python, str(ROOT / "bench" / "nncf_quantize.py"), str(model), str(calib), str(out)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return session_outputs(out, samples, optimize=False)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    den = np.sqrt((a @ a) * (b @ b))
    return 1.0 if den == 0 and not a.any() and not b.any() else float(a @ b / den) if den else 0.0


def greedy_decode(probs: np.ndarray) -> list[int]:
    """CTC greedy decode of one sample's [T, C] scores: argmax per step, repeats merged, blanks (0) dropped."""
    best = np.asarray(probs).reshape(-1, np.asarray(probs).shape[-1]).argmax(-1)
    return [int(c) for k, c in enumerate(best) if c != 0 and (k == 0 or c != best[k - 1])]


def figures(kind: str, reference: list[np.ndarray], test: list[np.ndarray]) -> dict:
    row = {"cosine": float(np.mean([cosine(r, t) for r, t in zip(reference, test)]))}
    if kind == "yolo":
        row["score cos"] = float(np.mean([cosine(r[:, 4:], t[:, 4:]) for r, t in zip(reference, test)]))
        row["box cos"] = float(np.mean([cosine(r[:, :4], t[:, :4]) for r, t in zip(reference, test)]))
        agreement = DetectionAgreement()
        for r, t in zip(reference, test):
            agreement.update(yolo_detections(r), yolo_detections(t))
        row.update({"recall": agreement.recall, "precision": agreement.precision,
                    "dets": f"{agreement.matched}/{agreement.reference}/{agreement.test}"})
    elif kind == "crnn":
        row["decode agree"] = float(np.mean([greedy_decode(r) == greedy_decode(t) for r, t in zip(reference, test)]))
    elif kind == "dbnet":
        ious = []
        for r, t in zip(reference, test):
            a, b = r > TEXT_THRESHOLD, t > TEXT_THRESHOLD
            ious.append((a & b).sum() / max(1, (a | b).sum()))
        row["text IoU"] = float(np.mean(ious))
    return row


def cell(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="yolo,dbnet,crnn")
    parser.add_argument("--calibrator", help="ptq's activation calibrator (default: ptq's default)")
    parser.add_argument("--no-ort", action="store_true")
    parser.add_argument("--no-nncf", action="store_true")
    parser.add_argument("--nncf-python", default=NNCF_PYTHON)
    args = parser.parse_args(argv)
    folders = write_samples()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for kind in args.models.split(","):
            model = ROOT / "bench" / "models" / MODELS[kind]
            calib_dir, eval_dir = folders[kind]["calib"], folders[kind]["eval"]
            calib, samples = load_arrays(calib_dir), load_arrays(eval_dir)
            reference = session_outputs(model, samples)
            rows = {}
            start = time.perf_counter()
            try:
                outputs, float_nodes = ptq_outputs(model, calib_dir, samples, tmp, calibrator=args.calibrator)
                rows["ptq"] = figures(kind, reference, outputs)
            except ValueError as exc:  # what a user meets; then what they would do: float the op it names
                print(f"\n{kind}: ptq's integer run fails: {exc}")
                op = FAILED_OP.search(str(exc))
                if op is None:
                    raise
                outputs, float_nodes = ptq_outputs(model, calib_dir, samples, tmp, float_nodes=[op.group(1)],
                                                   calibrator=args.calibrator)
                rows["ptq*"] = figures(kind, reference, outputs)
            rows[next(iter(rows))]["seconds"] = time.perf_counter() - start
            if not args.no_ort:
                start = time.perf_counter()
                rows["ort"] = figures(kind, reference, ort_outputs(model, calib, samples, tmp))
                rows["ort"]["seconds"] = time.perf_counter() - start
            if not args.no_nncf:
                start = time.perf_counter()
                rows["nncf"] = figures(kind, reference, nncf_outputs(model, calib_dir, samples, tmp, args.nncf_python))
                rows["nncf"]["seconds"] = time.perf_counter() - start
            print(f"\n{kind}: {model.name}, {len(calib)} calibration / {len(samples)} eval arrays; ptq float nodes: "
                  f"{', '.join(float_nodes) or 'none'}")
            columns = list(next(iter(rows.values())))
            print(f"{'':6}" + "".join(f"{c:>14}" for c in columns))
            for name, row in rows.items():
                print(f"{name:6}" + "".join(f"{cell(row.get(c, '')):>14}" for c in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
