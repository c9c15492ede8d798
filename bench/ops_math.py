"""Benchmark and error survey of the elementwise math / logic ops (ops/unary_lut.py, unary_exact.py, minmax.py,
pow.py, logical.py, cast.py): ptq's integer forward beside onnxruntime's float op.

    python bench/ops_math.py              # 1x64x56x56 tensors, best of 5 runs each

Per op: the integer forward's time and onnxruntime's on the same (dequantized) tensor, their ratio, and the
worst error in output LSB of the integer result against onnxruntime's float result on the dequantized input
(clamped to the output range), over every input code of an 8-bit and of a 16-bit (every 7th code) grid for
the unary ops, over the benchmark tensor for the binary ones (bool / int64 outputs: the share of results
that differ from onnxruntime's).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from op_testing import context, lsb_error, ort_single, random_codes, runtime  # noqa: E402
from ops.registry import get_op  # noqa: E402
from ptq.core.graph import Node  # noqa: E402
from ptq.core.qparams import compute_qparams  # noqa: E402

SHAPE = (1, 64, 56, 56)
REPEAT = 5
# op -> (input range, attributes, constant second input or None)
UNARY = {
    "Exp": ((-4, 3), {}), "Log": ((0, 6), {}), "Erf": ((-3, 3), {}), "Sin": ((-4, 4), {}), "Cos": ((-4, 4), {}),
    "Sqrt": ((0, 9), {}), "Elu": ((-4, 3), {}), "Selu": ((-4, 3), {}), "Softplus": ((-6, 6), {}),
    "Softsign": ((-8, 8), {}), "Abs": ((-3, 2), {}), "Neg": ((-3, 2), {}), "Sign": ((-3, 2), {}),
}
WIDE_REFUSED = {"Log", "Sqrt"}  # singular at 0: 16-bit inputs are refused


def best_time(fn) -> float:
    times = []
    for _ in range(REPEAT):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def quantized(op_type, x_qp, y_float, bits, constants=None, node_inputs=("x",), in_qps=None):
    finite = y_float[np.isfinite(y_float)]
    y_qp = compute_qparams(float(finite.min()), float(finite.max()), bits, symmetric=False)
    node = Node(op_type.lower(), op_type, list(node_inputs), ["y"])
    op = get_op(op_type)
    q = op.quantize(context(node, in_qps or [x_qp], [y_qp], constants))
    return op, q


def unary_error(op_type, lo, hi, attrs, bits) -> float:
    x_qp = compute_qparams(lo, hi, bits, symmetric=False)
    codes = np.arange(x_qp.qmin, x_qp.qmax + 1, 1 if bits == 8 else 7).astype(x_qp.dtype)
    y_float = ort_single(op_type, {"x": x_qp.dequantize(codes)}, attrs)[0]
    op, q = quantized(op_type, x_qp, y_float, bits)
    y = op.forward_int(q, [codes], runtime())[0]
    return lsb_error(q.out_qparams[0], y, y_float)


def unary_speed(op_type, lo, hi, attrs) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    x_qp = compute_qparams(lo, hi, 8, symmetric=False)
    codes = random_codes(rng, x_qp, SHAPE)
    x = x_qp.dequantize(codes)
    y_float = ort_single(op_type, {"x": x}, attrs)[0]
    op, q = quantized(op_type, x_qp, y_float, 8)
    rt = runtime()
    t_int = best_time(lambda: op.forward_int(q, [codes], rt))
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node(op_type, ["x"], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    t_ort = best_time(lambda: sess.run(None, {"x": x}))
    return t_int, t_ort


def ort_session(op_type, inputs: dict, constants: dict, attrs=None, out_type=None):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    tensor = helper.np_dtype_to_tensor_dtype
    graph = helper.make_graph(
        [helper.make_node(op_type, list(inputs) + list(constants), ["out"], **(attrs or {}))], "g",
        [helper.make_tensor_value_info(k, tensor(v.dtype), v.shape) for k, v in inputs.items()],
        [helper.make_tensor_value_info("out", out_type or TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def binary_cases():
    """(label, op type, [(codes, qparams) or raw array per input], constants {index: array}, attrs, out_type)."""
    from onnx import TensorProto

    rng = np.random.default_rng(1)
    a_qp, b_qp = compute_qparams(-3, 2, 8, symmetric=False), compute_qparams(-1, 3.5, 8, symmetric=False)
    pos_qp = compute_qparams(0.3, 4, 8, symmetric=False)
    a, b, pos = random_codes(rng, a_qp, SHAPE), random_codes(rng, b_qp, SHAPE), random_codes(rng, pos_qp, SHAPE)
    pos[pos_qp.dequantize(pos) < 0.3] = pos_qp.quantize(np.array([1.0]))[0]
    exp_qp = compute_qparams(-1.5, 2, 8, symmetric=False)
    cond = rng.integers(0, 2, SHAPE).astype(bool)
    two = np.array(2.0, np.float32)
    return [
        ("Max", "Max", [(a, a_qp), (b, b_qp)], {}, {}, None),
        ("Min", "Min", [(a, a_qp), (b, b_qp)], {}, {}, None),
        ("Greater", "Greater", [(a, a_qp), (b, b_qp)], {}, {}, TensorProto.BOOL),
        ("Equal", "Equal", [(a, a_qp), (a, a_qp)], {}, {}, TensorProto.BOOL),
        ("Where", "Where", [cond, (a, a_qp), (b, b_qp)], {}, {}, None),
        ("Pow x^2", "Pow", [(a, a_qp), two], {1: two}, {}, None),
        ("Pow x^y", "Pow", [(pos, pos_qp), (random_codes(rng, exp_qp, SHAPE), exp_qp)], {}, {}, None),
        ("Cast i64", "Cast", [(a, a_qp)], {}, {"to": TensorProto.INT64}, TensorProto.INT64),
    ]


def binary_row(label, op_type, args, constants, attrs, out_type) -> str:
    names = [f"i{k}" for k in range(len(args))]
    floats, codes, in_qps = {}, [], []
    for k, arg in enumerate(args):
        if isinstance(arg, tuple):
            floats[names[k]] = arg[1].dequantize(arg[0])
            codes.append(arg[0])
            in_qps.append(arg[1])
        else:
            codes.append(arg)
            in_qps.append(None)
            if k not in constants:
                floats[names[k]] = arg
    sess = ort_session(op_type, floats, {names[k]: v for k, v in constants.items()}, attrs, out_type)
    y_float = sess.run(None, floats)[0]
    node = Node(label, op_type, names, ["y"], dict(attrs))
    op = get_op(op_type)
    index_output = bool(op.index_outputs(node))
    y_qp = None if index_output else compute_qparams(float(y_float.min()), float(y_float.max()), 8, symmetric=False)
    q = op.quantize(context(node, in_qps, [y_qp], constants))
    rt = runtime()
    y = op.forward_int(q, codes, rt)
    t_int = best_time(lambda: op.forward_int(q, codes, rt))
    t_ort = best_time(lambda: sess.run(None, floats))
    if index_output:
        err = f"{np.mean(y[0] != y_float) * 100:.3f}%"  # share of differing results
    else:
        err = f"{lsb_error(q.out_qparams[0], y[0], y_float):.3f}"
    return f"{label:10s} {t_int * 1e3:8.2f} {t_ort * 1e3:8.2f} {t_int / t_ort:6.2f} {err:>9s}"


def main() -> None:
    print(f"{'op':10s} {'int ms':>8s} {'ort ms':>8s} {'ratio':>6s} {'err8 LSB':>9s} {'err16 LSB':>10s}")
    for op_type, ((lo, hi), attrs) in UNARY.items():
        t_int, t_ort = unary_speed(op_type, lo, hi, attrs)
        e8 = unary_error(op_type, lo, hi, attrs, 8)
        e16 = "refused" if op_type in WIDE_REFUSED else f"{unary_error(op_type, lo, hi, attrs, 16):.3f}"
        print(f"{op_type:10s} {t_int * 1e3:8.2f} {t_ort * 1e3:8.2f} {t_int / t_ort:6.2f} {e8:9.3f} {e16:>10s}")
    print(f"\n{'op':10s} {'int ms':>8s} {'ort ms':>8s} {'ratio':>6s} {'err8':>9s}   (random 8-bit codes; index "
          "outputs: % of results differing)")
    for case in binary_cases():
        print(binary_row(*case))


if __name__ == "__main__":
    main()
