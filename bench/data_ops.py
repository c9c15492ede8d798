"""Benchmark: the data-movement, index and detection ops' integer forwards vs onnxruntime's float op.

    python bench/data_ops.py [--repeat 5]

Each op runs on a representative size: ptq's `forward_int` on 8-bit codes (quantize rule run once, outside
the timing) beside onnxruntime's float op on the dequantized input, one intra-op thread each; the best of
`--repeat` runs is shown, and the ratio ptq / onnxruntime (above 1: ptq slower).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops import get_op  # noqa: E402
from ops.backend import NumpyBackend  # noqa: E402
from ops.registry import IntRuntime, QuantizeContext  # noqa: E402
from ptq.core.graph import Node  # noqa: E402
from ptq.core.qparams import compute_qparams  # noqa: E402


def _session(op_type, x_shape, attrs, constants, outputs):
    names = ["x"] + list(constants)
    out_names = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op_type, names, out_names, **attrs)
    graph = helper.make_graph([node], "bench", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_empty_tensor_value_info(o) for o in out_names],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _best(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _report(name, t_ptq, t_ort):
    print(f"{name:38s} ptq {t_ptq * 1e3:9.3f} ms   onnxruntime {t_ort * 1e3:9.3f} ms   ratio {t_ptq / t_ort:7.2f}")


def case(name, op_type, x_shape, attrs, constants, outputs=1, repeat=5):
    x_f = np.random.default_rng(0).uniform(0, 1, x_shape).astype(np.float32)
    qp = compute_qparams(float(x_f.min()), float(x_f.max()), 8, symmetric=False)
    x_q = qp.quantize(x_f)
    node = Node(name, op_type, ["x"] + list(constants), [f"y{i}" for i in range(outputs)], attrs)
    op = get_op(op_type)
    q = op.quantize(QuantizeContext(node, [qp] + [None] * len(constants), [qp] * outputs,
                                    {i + 1: v for i, v in enumerate(constants.values())}))
    runtime = IntRuntime(NumpyBackend())
    args = [x_q] + list(constants.values())
    t_ptq = _best(lambda: op.forward_int(q, args, runtime), repeat)
    sess = _session(op_type, list(x_shape), attrs, constants, outputs)
    feed = {"x": qp.dequantize(x_q)}
    t_ort = _best(lambda: sess.run(None, feed), repeat)
    _report(name, t_ptq, t_ort)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    r = parser.parse_args().repeat
    rng = np.random.default_rng(1)
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    case("DepthToSpace 1x64x56x56 b2", "DepthToSpace", (1, 64, 56, 56), {"blocksize": 2}, {}, repeat=r)
    case("SpaceToDepth 1x16x112x112 b2", "SpaceToDepth", (1, 16, 112, 112), {"blocksize": 2}, {}, repeat=r)
    case("Tile 1x64x28x28 x(1,2,2,2)", "Tile", (1, 64, 28, 28), {}, {"r": i64(1, 2, 2, 2)}, repeat=r)
    case("Expand 1x64x1x1 -> 1x64x56x56", "Expand", (1, 64, 1, 1), {}, {"s": i64(1, 64, 56, 56)}, repeat=r)
    case("Gather 30000x256 table, 512 ids", "Gather", (30000, 256), {"axis": 0},
         {"i": rng.integers(0, 30000, 512)}, repeat=r)
    case("ArgMax 1x1000x7x7 axis 1", "ArgMax", (1, 1000, 7, 7), {"axis": 1}, {}, repeat=r)
    case("TopK 1x20000 k=1000", "TopK", (1, 20000), {"axis": -1}, {"k": i64(1000)}, outputs=2, repeat=r)
    case("MaxPool+Indices 1x64x112x112 3x3 s2", "MaxPool", (1, 64, 112, 112),
         {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, {}, outputs=2, repeat=r)
    rois = np.concatenate([rng.integers(0, 1, (300, 1)), rng.uniform(0, 300, (300, 2)),
                           rng.uniform(300, 600, (300, 2))], axis=1).astype(np.float32)
    case("MaxRoiPool 1x256x38x50, 300 rois 7x7", "MaxRoiPool", (1, 256, 38, 50),
         {"pooled_shape": [7, 7], "spatial_scale": 1 / 16}, {"rois": rois}, repeat=r)
    xy = rng.uniform(0, 600, (1, 2000, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(20, 120, (1, 2000, 2))], axis=2).astype(np.float32)
    scores = rng.uniform(0, 1, (1, 4, 2000)).astype(np.float32)
    nms_case(boxes, scores, r)


def nms_case(boxes, scores, repeat):
    """NMS takes two quantized inputs: boxes and scores (its own harness)."""
    b_qp = compute_qparams(float(boxes.min()), float(boxes.max()), 16, symmetric=False)
    s_qp = compute_qparams(0.0, 1.0, 8, symmetric=False)
    b_q, s_q = b_qp.quantize(boxes), s_qp.quantize(scores)
    consts = {"m": np.array([100], np.int64), "iou": np.array([0.5], np.float32), "thr": np.array([0.05], np.float32)}
    node = Node("nms", "NonMaxSuppression", ["b", "s"] + list(consts), ["sel"])
    op = get_op("NonMaxSuppression")
    q = op.quantize(QuantizeContext(node, [b_qp, s_qp, None, None, None], [None],
                                    {i + 2: v for i, v in enumerate(consts.values())}))
    runtime = IntRuntime(NumpyBackend())
    t_ptq = _best(lambda: op.forward_int(q, [b_q, s_q] + list(consts.values()), runtime), repeat)
    graph = helper.make_graph(
        [helper.make_node("NonMaxSuppression", ["b", "s"] + list(consts), ["sel"])], "bench",
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, list(boxes.shape)),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, list(scores.shape))],
        [helper.make_empty_tensor_value_info("sel")],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                  ir_version=8).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])
    feed = {"b": b_qp.dequantize(b_q), "s": s_qp.dequantize(s_q)}
    t_ort = _best(lambda: sess.run(None, feed), repeat)
    name = "NonMaxSuppression 2000 boxes, 4 cls"
    _report(name, t_ptq, t_ort)


if __name__ == "__main__":
    main()
