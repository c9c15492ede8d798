"""Per-tensor range search: the range kept is the candidate with the lowest consumer-output error, computed
here independently (numpy fake quantization and consumer); the same tensor feeding an elementwise consumer
keeps a clipping range and feeding a ReduceMax keeps its extrema."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from calibrators import required_stats
from ptq.core.graph import load_model
from ptq.engine.float_run import collect_statistics
from ptq.calibration.pipeline import calibrate
from ptq.table.quant_table import CalibrationOptions
from ptq.calibration.range_search import candidate_entries, search_ranges
from tests.tiny_models import make_model

CANDIDATES = ("extrema", "mse")


def consumer_graph(consumer: str) -> onnx.ModelProto:
    """input (N, 4096) -> Add 0 -> t -> consumer (Mul by 2, or ReduceMax keepdims) -> out."""
    inits = [numpy_helper.from_array(np.float32(0), "zero"), numpy_helper.from_array(np.float32(2), "two")]
    use = (helper.make_node("Mul", ["t", "two"], ["out"], name="use") if consumer == "Mul" else
           helper.make_node("ReduceMax", ["t"], ["out"], keepdims=1, name="use"))
    nodes = [helper.make_node("Add", ["input", "zero"], ["t"], name="add"), use]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4096])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4096] if consumer == "Mul" else ["N", 1])
    return make_model(nodes, [inp], [out], inits)


def fake_quant(x, scale, zp, qmin, qmax):
    return ((np.clip(np.round(x.astype(np.float64) / scale) + zp, qmin, qmax) - zp) * scale)


def independent_choice(entries, x, consumer):
    errors = {}
    ref = 2 * x.astype(np.float64) if consumer == "Mul" else x.max(axis=1, keepdims=True).astype(np.float64)
    for name, entry in entries.items():
        qp = entry.qparams
        fq = fake_quant(x, float(qp.scale[0]), int(qp.zero_point[0]), qp.qmin, qp.qmax)
        out = 2 * fq if consumer == "Mul" else fq.max(axis=1, keepdims=True)
        errors[name] = float(np.sum((out - ref) ** 2) / np.sum(ref ** 2))
    return min(errors, key=errors.get)


def search(consumer, x):
    graph = load_model(consumer_graph(consumer))
    stats = collect_statistics(graph, [x], graph.activations, required_stats(CANDIDATES))
    cands = candidate_entries(graph, stats, CalibrationOptions(bits=4), CANDIDATES)
    chosen, log = search_ranges(graph, cands, [x[:2], x[2:]])
    return chosen, log, {name: cands[name]["t"] for name in CANDIDATES}


def outliers(seed):
    """N(0, 1) with one value of 40 per row: at 4 bits clipping it costs less than the coarse grid covering it."""
    x = np.random.default_rng(seed).normal(0, 1, (4, 4096)).astype(np.float32)
    x[:, 7] = 40
    return x


def test_the_consumer_decides_the_range():
    x = outliers(0)
    for consumer, expected in (("Mul", "mse"), ("ReduceMax", "extrema")):
        chosen, log, entries = search(consumer, x)
        assert entries["mse"].qparams != entries["extrema"].qparams
        assert log.images == 4 and "t" in log.chosen
        assert log.chosen["t"] == independent_choice(entries, x, consumer) == expected
        assert chosen["t"] is entries[expected]


def test_calibrate_records_the_search(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(consumer_graph("ReduceMax"), path)
    x = outliers(1)
    result = calibrate(path, x, tmp_path / "out", write_qdq=False, calibrator="mse", bits=4, range_search=True)
    assert result.table.options.range_search and result.table.options.calibrator == "mse"
    entry = result.table.tensors["t"]
    assert entry.calibrator != "mse" and entry.max[0] >= 40 - entry.qparams.scale[0]  # ReduceMax keeps the max
