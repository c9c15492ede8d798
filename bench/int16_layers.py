"""Benchmark: Conv and Gemm layers with 16-bit operands, the compiled backend's byte-plane integer kernels
(`ops.compiled.int_dense16`, `int_depthwise16`, `int_wide_weight`) against its former paths, beside onnxruntime.

    python bench/int16_layers.py [--repeat 20] [--input-bits 16] [--weight-bits 8]

Per layer (EfficientNet-Lite0's shapes: its stem, depthwise and pointwise layers of each stage, the head and
the classifier; int16 input codes and int8 per-channel weights unless --input-bits/--weight-bits say
otherwise, int8 output codes, Clip fused as the model has it): the CPU time per call (time.process_time, the
fastest of --repeat calls, one thread: OPENBLAS_NUM_THREADS=1 as the `ptq` command runs) of `forward_int`
with the byte-plane kernels, with the path 16-bit operands took before them (float BLAS for dense layers, the
int64 per-tap loop for depthwise ones: the byte-plane kernels turned off; with 8-bit inputs and weights, the
8-bit kernels themselves), of the numpy reference backend, and of an onnxruntime session (one thread) running
the float op on the same float input; and whether the three ptq paths give the same codes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import ops.compiled.depthwise as depthwise  # noqa: E402
import ops.compiled.pointwise as pointwise  # noqa: E402
from ops import get_op  # noqa: E402
from ops.backend import CompiledBackend, NumpyBackend  # noqa: E402
from ops.compiled.vnni import INSTRUCTION_NAME  # noqa: E402
from ops.registry import IntRuntime  # noqa: E402
from ptq.core.graph import Node  # noqa: E402
from ptq.core.qparams import compute_qparams  # noqa: E402
from tests.ops.op_testing import context  # noqa: E402

# name, (cin, cout, kernel, stride, pad, spatial[, groups]) for Conv; (K, N) for Gemm
LAYERS = [("stem 3x3/2 3->32 @224", (3, 32, 3, 2, 1, 224)),
          ("pointwise 32->16 @112", (32, 16, 1, 1, 0, 112)),
          ("depthwise 3x3 32 @112", (32, 32, 3, 1, 1, 112, 32)),
          ("pointwise 96->24 @56", (96, 24, 1, 1, 0, 56)),
          ("depthwise 3x3 144 @56", (144, 144, 3, 1, 1, 56, 144)),
          ("depthwise 5x5/2 144 @56", (144, 144, 5, 2, 2, 56, 144)),
          ("pointwise 24->144 @56", (24, 144, 1, 1, 0, 56)),
          ("pointwise 240->40 @28", (240, 40, 1, 1, 0, 28)),
          ("pointwise 480->80 @14", (480, 80, 1, 1, 0, 14)),
          ("pointwise 672->112 @14", (672, 112, 1, 1, 0, 14)),
          ("depthwise 5x5 672 @14", (672, 672, 5, 1, 2, 14, 672)),
          ("pointwise 1152->192 @7", (1152, 192, 1, 1, 0, 7)),
          ("head 320->1280 @7", (320, 1280, 1, 1, 0, 7)),
          ("Gemm 1280->1000", (1280, 1000))]


def _conv(rng, weight_bits, cin, cout, kernel, stride, pad, spatial, groups=1):
    x_f = np.clip(rng.normal(0.0, 1.0, (1, cin, spatial, spatial)), -4, 4).astype(np.float32)
    fan_in = cin // groups * kernel * kernel
    w_f = rng.normal(0, 1.0 / np.sqrt(fan_in), (cout, cin // groups, kernel, kernel)).astype(np.float32)
    b_f = rng.normal(0, 0.1, cout).astype(np.float32)
    attrs = {"group": groups, "strides": [stride, stride], "pads": [pad] * 4, "dilations": [1, 1],
             "kernel_shape": [kernel, kernel]}
    node = Node("conv", "Conv", ["x", "w", "b"], ["y"], dict(attrs, activation="Clip", activation_params=[0.0, 6.0]))
    flat = w_f.reshape(cout, -1)
    w_qp = compute_qparams(flat.min(1), flat.max(1), weight_bits, symmetric=True, signed=True, axis=0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs), helper.make_node("Clip", ["c", "lo", "hi"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_f.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w_f, "w"), numpy_helper.from_array(b_f, "b"),
         numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")])
    return "Conv", node, x_f, w_f, b_f, w_qp, graph


def _gemm(rng, weight_bits, k, n):
    x_f = rng.normal(0, 1.0, (1, k)).astype(np.float32)
    w_f = rng.normal(0, 1.0 / np.sqrt(k), (k, n)).astype(np.float32)
    b_f = rng.normal(0, 0.1, n).astype(np.float32)
    node = Node("gemm", "Gemm", ["x", "w", "b"], ["y"], {})
    w_qp = compute_qparams(w_f.min(0), w_f.max(0), weight_bits, symmetric=True, signed=True, axis=1)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_f.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w_f, "w"), numpy_helper.from_array(b_f, "b")])
    return "Gemm", node, x_f, w_f, b_f, w_qp, graph


def _fastest(call, repeat: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        call()
        best = min(best, time.process_time() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--input-bits", type=int, choices=(8, 16), default=16)
    parser.add_argument("--weight-bits", type=int, choices=(8, 16), default=8)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    print(f"int{args.input_bits} input codes, int{args.weight_bits} weights; instruction {INSTRUCTION_NAME}; "
          f"CPU ms per call, fastest of {args.repeat}")
    print(f"{'layer':28s} {'int kernels':>11s} {'before':>10s} {'speedup':>8s} {'numpy':>8s} {'ort float':>9s}"
          f"  same codes")
    dense_operands, wide_operands = pointwise.dense_operands, pointwise.wide_operands
    depthwise16, depthwise_wide = depthwise.depthwise16, depthwise.depthwise_wide
    for name, shape in LAYERS:
        op_type, node, x_f, w_f, b_f, w_qp, graph = (_conv if len(shape) >= 6 else _gemm)(rng, args.weight_bits, *shape)
        x_qp = compute_qparams(float(x_f.min()), float(x_f.max()), args.input_bits, symmetric=True, signed=True)
        y_qp = compute_qparams(0.0, 6.0, 8, symmetric=False, signed=False)
        op = get_op(op_type)
        q = op.quantize(context(node, [x_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f}))
        inputs = [x_qp.quantize(x_f), w_f, b_f]
        compiled, reference = IntRuntime(CompiledBackend()), IntRuntime(NumpyBackend())
        new = op.forward_int(q, inputs, compiled)[0]
        t_new = _fastest(lambda: op.forward_int(q, inputs, compiled), args.repeat)
        # the layer as before the byte-plane kernels: float BLAS, resp. the int64 per-tap loop
        pointwise.dense_operands = pointwise.wide_operands = lambda *a: None
        depthwise.depthwise16 = depthwise.depthwise_wide = lambda *a: None
        if args.input_bits == args.weight_bits == 8:
            pointwise.dense_operands = dense_operands
        try:
            old = op.forward_int(q, inputs, compiled)[0]
            t_old = _fastest(lambda: op.forward_int(q, inputs, compiled), args.repeat)
        finally:
            pointwise.dense_operands, pointwise.wide_operands = dense_operands, wide_operands
            depthwise.depthwise16, depthwise.depthwise_wide = depthwise16, depthwise_wide
        ref = op.forward_int(q, inputs, reference)[0]
        t_ref = _fastest(lambda: op.forward_int(q, inputs, reference), max(1, args.repeat // 4))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        t_ort = _fastest(lambda: session.run(None, {"x": x_f}), args.repeat)
        same = np.array_equal(new, ref) and np.array_equal(old, ref) and new.dtype == ref.dtype
        print(f"{name:28s} {t_new * 1e3:11.3f} {t_old * 1e3:10.3f} {t_old / t_new:7.2f}x {t_ref * 1e3:8.2f}"
              f" {t_ort * 1e3:9.3f}  {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
