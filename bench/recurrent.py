"""Recurrent taggers in integers: ptq beside onnxruntime's quantizer and NNCF, on the same samples.

    python bench/recurrent.py [--calib 32] [--eval 64] [--no-nncf]

Models: bench/models/{lstm,gru}_frame_tagger.onnx (torch exports, trained: bench/models/build_recurrent.py); samples
from `recurrent_task.tagger_data` (calibration seed 1, evaluation seed 2, disjoint). Per model and method: the
frame tags' agreement with the float model (onnxruntime), the frame accuracy against the task's labels, the
logits cosine, and whether the cell ran quantized. ptq: `calibrate` with default options, its integer executor
(and, to isolate the cell's share, the same table with the cell marked float).
onnxruntime: `quantize_static` (QDQ, MinMax, defaults), run by onnxruntime with graph optimizations off.
NNCF: `nncf.quantize` (defaults) in its own environment (/work/nncfenv), run by onnxruntime; a subprocess fed
with .npy arrays.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "models")]

from ptq.engine.executor import prepare  # noqa: E402
from ptq.calibration.pipeline import calibrate  # noqa: E402
from recurrent_task import tagger_data  # noqa: E402

NNCF_PYTHON = Path("/work/nncfenv/bin/python")
NNCF_SCRIPT = """
import sys, numpy as np, onnx, nncf
model = onnx.load(sys.argv[1])
calib = np.load(sys.argv[2])
dataset = nncf.Dataset(list(calib), lambda x: {"x": x})
onnx.save(nncf.quantize(model, dataset, subset_size=len(calib)), sys.argv[3])
"""


def _session(path, optimize=True):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _scores(run, float_logits, labels) -> dict:
    logits = [run(x) for x in float_logits["x"]]
    agree = np.mean([np.mean(q.argmax(-1) == f.argmax(-1)) for q, f in zip(logits, float_logits["logits"])])
    accuracy = np.mean([np.mean(q[0].argmax(-1) == y) for q, y in zip(logits, labels)])
    q, f = np.concatenate([l.ravel() for l in logits]), np.concatenate([l.ravel() for l in float_logits["logits"]])
    return {"agreement": float(agree), "accuracy": float(accuracy), "cosine": float(q @ f / np.linalg.norm(q) / np.linalg.norm(f))}


def _ort_quantizer(model: Path, calib: np.ndarray, out: Path) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{"x": x} for x in calib])

        def get_next(self):
            return next(self.items, None)

    path = out / f"{model.stem}.ort.qdq.onnx"
    quantize_static(str(model), str(path), Reader(), quant_format=QuantFormat.QDQ)
    return path


def _quantized_cell(path: Path) -> str:
    import onnx

    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    cells = [op for op in ops if op in ("LSTM", "GRU", "DynamicQuantizeLSTM")]
    return f"{cells} with {ops.count('QuantizeLinear')} QuantizeLinear"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib", type=int, default=32)
    parser.add_argument("--eval", type=int, default=64)
    parser.add_argument("--no-nncf", action="store_true")
    args = parser.parse_args()
    calib, _ = tagger_data(1, args.calib)
    evaluation, labels = tagger_data(2, args.eval)
    print(f"{'model':12} {'method':16} {'agreement':>9} {'accuracy':>8} {'cosine':>8}  cell")
    for cell in ("lstm", "gru"):
        model = ROOT / "bench" / "models" / f"{cell}_frame_tagger.onnx"
        reference = _session(model)
        floats = {"x": list(evaluation), "logits": [reference.run(None, {"x": x})[0] for x in evaluation]}
        rows = {"float": (_scores(lambda x: reference.run(None, {"x": x})[0], floats, labels), "float")}
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            for k, x in enumerate(calib):
                np.save(tmp / f"s{k:02d}.npy", x)
            result = calibrate(model, data=tmp, write_qdq=False)
            prepared = prepare(result.graph, result.table)
            kind = [s.kind.value for s in prepared.steps if s.node.op_type.upper() == cell.upper()]
            rows["ptq"] = (_scores(lambda x: prepared.run({"x": x}).outputs["logits"], floats, labels),
                           f"{kind}, float nodes {[f.name for f in prepared.float_nodes]}")
            cell_float = prepare(result.graph, result.table, float_nodes=[cell.upper()])
            rows["ptq, cell float"] = (_scores(lambda x: cell_float.run({"x": x}).outputs["logits"], floats, labels),
                                       "the same table, the cell marked float (dequantize -> float -> quantize)")
            ort_path = _ort_quantizer(model, calib, tmp)
            ort_session = _session(ort_path, optimize=False)
            rows["onnxruntime"] = (_scores(lambda x: ort_session.run(None, {"x": x})[0], floats, labels),
                                   _quantized_cell(ort_path))
            if not args.no_nncf and NNCF_PYTHON.exists():
                np.save(tmp / "calib.npy", calib)
                nncf_path = tmp / f"{cell}.nncf.onnx"
                done = subprocess.run([str(NNCF_PYTHON), "-c", NNCF_SCRIPT, str(model), str(tmp / "calib.npy"),
                                       str(nncf_path)], capture_output=True, text=True)
                if done.returncode == 0:
                    nncf_session = _session(nncf_path)
                    rows["nncf"] = (_scores(lambda x: nncf_session.run(None, {"x": x})[0], floats, labels),
                                    _quantized_cell(nncf_path))
                else:
                    print(f"nncf failed on {cell}: {done.stderr.strip().splitlines()[-1]}")
        for method, (score, note) in rows.items():
            print(f"{cell + '_frame_tagger':12} {method:16} {score['agreement']:9.4f} {score['accuracy']:8.4f} "
                  f"{score['cosine']:8.5f}  {note}")
    print(json.dumps({"calib": args.calib, "eval": args.eval}))


if __name__ == "__main__":
    main()
