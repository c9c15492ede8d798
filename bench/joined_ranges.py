"""A YOLOv8-style output that joins pixel boxes with sigmoid scores (issue 24): ptq beside onnxruntime.

    python bench/joined_ranges.py               # 16 calibration, 20 evaluation images
    python bench/joined_ranges.py --calib 32 --eval 50

The model is bench/models/yolo_head.onnx (4 box rows in pixels, 0..320, and 18 sigmoid score rows concatenated
on axis 1 into [1, 22, 2100]); `--transpose` takes yolo_head_t.onnx (then Transposed to [1, 2100, 22]: the
per-part grids follow the channels to axis 2).
On the same arrays (`bench/models/yolo_head.images`), one row each:

- ptq, integer run: `ptq calibrate` defaults (its output gets one grid per part, `ptq.calibration.joined_ranges`);
- ptq, QDQ model in onnxruntime: the model `ptq calibrate` writes from the same table;
- ptq, one 8-bit grid: the same table with the joined output on a single per-tensor grid (what ptq did before);
- onnxruntime quantize_static: QDQ, per-channel weights, MinMax (its default), optimizations off.

Columns: the cosine against the float model of the score rows and of the box rows (the worst image), and the
(anchor, class) pairs scoring >= 0.25 in float that keep a score >= 0.25 (recall) and those the quantized model
adds (false), summed over the images.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.models.yolo_head import BOXES, PATHS, images  # noqa: E402
from ptq.core.graph import load_model  # noqa: E402
from ptq.core.qparams import compute_qparams  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.calibration.pipeline import calibrate  # noqa: E402
from ptq.qdq.export import export_qdq  # noqa: E402
from ptq.table.quant_table import QuantTable, TensorEntry  # noqa: E402

THRESHOLD = 0.25


def _session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _rows(y: np.ndarray, transpose: bool) -> np.ndarray:
    return np.swapaxes(y, 1, 2) if transpose else y


def _single_grid(table: QuantTable, tensors: list[str]) -> QuantTable:
    whole = table.tensors["joined"]
    lo, hi = float(whole.min.min()), float(whole.max.max())
    grid = compute_qparams(lo, hi, 8, symmetric=table.options.symmetric)
    entries = dict(table.tensors)
    for name in tensors:
        entries[name] = TensorEntry("activation", whole.calibrator, lo, hi, grid)
    return QuantTable(table.options, entries)


def _ort_quantizer(model_path: Path, calib: np.ndarray, tmp: Path) -> ort.InferenceSession:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {"image": x[None]}

    out = tmp / "ort.qdq.onnx"
    quantize_static(str(model_path), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    return _session(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib", type=int, default=16)
    parser.add_argument("--eval", type=int, default=20)
    parser.add_argument("--transpose", action="store_true")
    args = parser.parse_args(argv)
    path = PATHS[args.transpose]
    out_name = "output" if args.transpose else "joined"
    calib, held_out = images(args.calib, 1), images(args.eval, 1000)
    model = onnx.load(path)
    graph = load_model(model)
    table = calibrate(model, calib, write_qdq=False).table
    print(f"{path.name}: calibrated on {args.calib} images; output entry: {table.tensors['joined'].why or 'one grid'}")
    single = _single_grid(table, ["joined", "output"] if args.transpose else ["joined"])
    integer, integer_single = prepare(graph, table), prepare(graph, single)
    float_session = _session(model)
    with tempfile.TemporaryDirectory() as tmp:
        runners = {
            "ptq integer run": lambda x: integer.run({"image": x}).outputs[out_name],
            "ptq QDQ in onnxruntime": (lambda s: lambda x: s.run(None, {"image": x})[0])(_session(export_qdq(graph, table))),
            "ptq, one 8-bit grid (before)": lambda x: integer_single.run({"image": x}).outputs[out_name],
            "onnxruntime quantize_static": (lambda s: lambda x: s.run(None, {"image": x})[0])(
                _ort_quantizer(path, calib, Path(tmp))),
        }
        print(f"{'':32s} {'score cos (min)':>16s} {'box cos (min)':>14s} {'recall >=0.25':>14s} {'false >=0.25':>13s}")
        for label, run in runners.items():
            score_cos, box_cos, kept, total, extra = [], [], 0, 0, 0
            for x in held_out:
                ref = _rows(float_session.run(None, {"image": x[None]})[0], args.transpose)
                y = _rows(run(x[None]), args.transpose)
                score_cos.append(_cosine(y[:, BOXES:], ref[:, BOXES:]))
                box_cos.append(_cosine(y[:, :BOXES], ref[:, :BOXES]))
                hit_ref, hit = ref[:, BOXES:] >= THRESHOLD, y[:, BOXES:] >= THRESHOLD
                kept += int(np.count_nonzero(hit_ref & hit))
                total += int(np.count_nonzero(hit_ref))
                extra += int(np.count_nonzero(hit & ~hit_ref))
            print(f"{label:32s} {min(score_cos):16.4f} {min(box_cos):14.4f} {kept:6d}/{total:<7d} {extra:13d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
