"""The compiled kernels (`ops.compiled`, the default backend) give exactly the numpy reference kernels' codes.

Every op runs twice on the same quantized node, once with `NumpyBackend` (the reference, itself checked
against independent Python-integer references in test_ops_*.py) and once with `CompiledBackend`; outputs
must be identical in dtype and value, and so must the reported accumulator overflows. Cases cover random
shapes, strides, paddings, dilations, zero points, per-channel parameters, fused activations, 8- and 16-bit
codes, depthwise layers narrow and wide, pre-rounded tiny factors and accumulators that saturate their
register. A few kernels are also checked directly against Python-integer formulas.
"""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import context, random_codes, random_qparams, ref_requant
from ops import get_op
from ops.backend import CompiledBackend, NumpyBackend
from ptq.engine.backends import get_backend
from ops.linear import AccumulatorPlan, finish_accumulator, output_stage
from ops.registry import IntRuntime
from ptq.core.graph import Node
from ptq.core.qparams import QParams


def _both(op, q, inputs) -> list[np.ndarray]:
    """forward_int on the numpy and the compiled backend: equal codes and overflow logs, returns the codes."""
    ref_rt, comp_rt = IntRuntime(NumpyBackend()), IntRuntime(CompiledBackend())
    want = op.forward_int(q, inputs, ref_rt)
    got = op.forward_int(q, inputs, comp_rt)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)
    assert comp_rt.overflows == ref_rt.overflows
    return want


def _conv_case(seed, groups, cin, cout, kernel, stride, pads, dilation, x_bits=8, w_bits=8, per_channel=True,
               activation=None, out_bits=8, spatial=(9, 8), batch=2, bias_scale=0.5):
    rng = np.random.default_rng(seed)
    nd = len(kernel)
    x_f = rng.normal(0.3, 1.5, size=(batch, cin) + tuple(spatial[:nd])).astype(np.float32)
    w_f = rng.normal(0, 0.5, size=(cout, cin // groups) + tuple(kernel)).astype(np.float32)
    b_f = rng.normal(0, bias_scale, size=cout).astype(np.float32)
    x_qp = random_qparams(rng, float(x_f.min()), float(x_f.max()), x_bits, signed=bool(rng.integers(2)))
    if per_channel:
        flat = w_f.reshape(cout, -1)
        w_qp = random_qparams(rng, flat.min(1), flat.max(1), w_bits, signed=True, axis=0)
    else:
        w_qp = random_qparams(rng, float(w_f.min()), float(w_f.max()), w_bits, signed=True)
    y_qp = random_qparams(rng, -3.0 * rng.uniform(0.2, 2), 4.0 * rng.uniform(0.2, 2), out_bits, symmetric=False)
    attrs = {"group": groups, "strides": list(stride), "pads": list(pads), "dilations": list(dilation)}
    if activation:
        attrs["activation"] = activation
        params = {"Clip": [-0.5, 2.0], "LeakyRelu": [float(rng.choice([0.1, -0.2, 0.0]))], "Relu": None}[activation]
        if params is not None:
            attrs["activation_params"] = params
    node = Node("conv", "Conv", ["x", "w", "b"], ["y"], attrs)
    op = get_op("Conv")
    q = op.quantize(context(node, [x_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f}))
    return op, q, [x_qp.quantize(x_f), w_f, b_f]


CONV_CASES = [
    # groups, cin, cout, kernel, stride, pads, dilation
    (4, 4, 4, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),       # depthwise
    (4, 4, 4, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    (3, 3, 6, (5, 5), (1, 1), (2, 2, 2, 2), (1, 1)),       # multiplier 2
    (5, 5, 5, (3, 2), (2, 1), (0, 2, 1, 0), (2, 1)),       # asymmetric pads, dilation
    (6, 6, 12, (3, 3), (1, 3), (2, 0, 0, 2), (1, 2)),
    (2, 4, 6, (3, 2), (1, 2), (1, 0, 1, 1), (2, 1)),       # grouped, 2 channels per group
    (3, 24, 6, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),      # 8 channels per group: still direct
    (2, 20, 4, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),      # 10 per group: BLAS + compiled epilogue
    (1, 3, 4, (3, 3), (2, 2), (0, 1, 1, 0), (1, 1)),       # dense
    (1, 5, 7, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1)),       # pointwise
    (3, 3, 6, (3,), (2,), (1, 2), (1,)),                   # 1-d depthwise
    (1, 3, 6, (3,), (1,), (1, 1), (2,)),                   # 1-d dense
    (2, 2, 4, (2, 2, 2), (1, 1, 1), (1, 0, 1, 0, 1, 0), (1, 1, 1)),  # 3-d: numpy kernel, compiled epilogue
    (4, 4, 12, (2, 3), (3, 2), (3, 0, 4, 2), (2, 1)),      # depthwise: stride past the rows it reads, wide pads
    (5, 5, 5, (4, 1), (1, 1), (0, 1, 3, 0), (3, 2)),       # depthwise: dilated rows, a kernel of width 1
]


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("activation", [None, "Relu", "Clip", "LeakyRelu"])
def test_conv_compiled_equals_numpy(case, activation):
    for seed in range(3):
        op, q, inputs = _conv_case(seed, *case, per_channel=bool(seed % 2 == 0), activation=activation,
                                   out_bits=16 if seed == 2 else 8, spatial=(9, 8, 5))
        _both(op, q, inputs)
        _both(op, q, [_channels_last_view(inputs[0])] + inputs[1:])


def _channels_last_view(x: np.ndarray) -> np.ndarray:
    """x (N, C, *spatial) as the view of channels-last data, the layout the compiled convolutions return."""
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1)


def test_compiled_convolutions_chain_channels_last():
    """A pointwise convolution's channels-last output into a depthwise one, into an Add with a plain tensor
    and with another channels-last one: the same codes as the numpy kernels all along, and the layout kept
    where both operands share it."""
    from ops.compiled.layout import channels_last

    pw_op, pw_q, pw_in = _conv_case(11, 1, 5, 6, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), activation="Clip",
                                    spatial=(7, 9))
    dw_op, dw_q, dw_in = _conv_case(12, 6, 6, 6, (3, 3), (2, 1), (1, 1, 1, 1), (1, 1), spatial=(7, 9))
    rt = IntRuntime(CompiledBackend())
    first = pw_op.forward_int(pw_q, pw_in, rt)[0]
    assert channels_last(first) is not None
    dw_q.in_qparams[0] = pw_q.out_qparams[0]  # the depthwise reads the pointwise output's codes
    second = _both(dw_op, dw_q, [first] + dw_in[1:])[0]
    got = dw_op.forward_int(dw_q, [first] + dw_in[1:], rt)[0]
    assert channels_last(got) is not None
    add_op, add_q, _ = _elementwise("Add", 0, (second.shape, second.shape))
    plain = np.ascontiguousarray(got)
    np.testing.assert_array_equal(second, got)
    _both(add_op, add_q, [got, plain])
    kept = add_op.forward_int(add_q, [got, got], rt)[0]
    assert channels_last(kept) is not None
    np.testing.assert_array_equal(kept, _both(add_op, add_q, [plain, plain])[0])


@pytest.mark.parametrize("x_bits, w_bits", [(16, 8), (8, 16), (16, 16)])
@pytest.mark.parametrize("groups, cin, cout", [(4, 4, 4), (1, 3, 5)])
def test_conv_compiled_wide_operands(x_bits, w_bits, groups, cin, cout):
    """16-bit codes: int64 accumulation, 48-bit registers, pre-rounded tiny factors (16 x 16 bits)."""
    for seed in range(2):
        op, q, inputs = _conv_case(seed, groups, cin, cout, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), x_bits, w_bits,
                                   activation="LeakyRelu" if seed else None, out_bits=16 if seed else 8)
        _both(op, q, inputs)


@pytest.mark.parametrize("width", [20, 60])
def test_depthwise_on_wide_layers(width):
    """Rows longer than the channel count (the wide early layers of a network), strides 1 and 2."""
    for stride in (1, 2):
        op, q, inputs = _conv_case(width + stride, 16, 16, 16, (5, 5), (stride, stride), (2, 2, 2, 2), (1, 1),
                                   activation="Clip", spatial=(11, width), batch=1)
        _both(op, q, inputs)


def test_conv_saturating_accumulator_is_counted_alike():
    """A bias saturated at the int32 limit makes the accumulator overflow: same codes, same overflow count."""
    for groups, cin in ((6, 6), (1, 6)):
        op, q, inputs = _conv_case(4, groups, cin, 6, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), bias_scale=1e9)
        assert not q.acc.safe
        _both(op, q, inputs)
        rt = IntRuntime(CompiledBackend())
        op.forward_int(q, inputs, rt)
        assert sum(rt.overflows.values()) > 0


def _stage_cases():
    rng = np.random.default_rng(9)
    y8 = QParams(scale=0.05, zero_point=-7, bits=8, signed=True)
    y16 = QParams(scale=1.0, zero_point=100, bits=16, signed=True)
    scales = rng.uniform(1e-4, 1e-2, 6)
    yield output_stage(scales, y8, 15, 1), 1
    yield output_stage(scales[:1], y8, 15, 1, "LeakyRelu", [0.25]), 1
    yield output_stage(scales, y8, 15, 1, "LeakyRelu", [-0.5]), 1
    yield output_stage(scales, y8, 15, 1, "Clip", [-0.1, 0.2]), 1
    yield output_stage(scales * 1e-4, y16, 15, 1), 1           # pre-rounded
    yield output_stage(scales * 1e-4, y16, 31, 1, "LeakyRelu", [0.1]), 1
    yield output_stage(scales, y8, 15, -1, "Relu"), -1          # channels last (Gemm)


@pytest.mark.parametrize("bits", [32, 48])
def test_requant_epilogue_at_accumulator_extremes(bits):
    """int64 accumulators around the register limits (saturated and counted) through every stage variant,
    compiled against the numpy path, and per element against a Python-integer requant."""
    rng = np.random.default_rng(bits)
    limit = 1 << (bits - 1)
    for stage, axis in _stage_cases():
        shape = (2, 6, 5) if axis == 1 else (4, 3, 6)
        acc = rng.integers(-2 * limit, 2 * limit, size=shape, dtype=np.int64)
        acc.flat[:4] = [limit - 1, limit, -limit, -limit - 1]
        offset = rng.integers(-1000, 1000, size=6).reshape((1, 6, 1) if axis == 1 else (6,))
        plan = AccumulatorPlan(bits, False)
        node = Node("n", "Conv", [], ["y"])
        rts = IntRuntime(NumpyBackend()), IntRuntime(CompiledBackend())
        want, got = (finish_accumulator(acc, offset, plan, stage, node, rt) for rt in rts)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype
        assert rts[0].overflows == rts[1].overflows and rts[1].overflows["n"] > 0
        if stage.neg_m is None and stage.pre_shift is None:
            sat = np.clip(acc + offset, -limit, limit - 1)
            per = (1, 6, 1) if axis == 1 else (6,)
            m = np.broadcast_to(stage.m, 6).reshape(per)
            n = np.broadcast_to(stage.n, 6).reshape(per)
            np.testing.assert_array_equal(got, ref_requant(sat, m, n, stage.zp, stage.lo, stage.hi))
    int32_acc = rng.integers(-(1 << 31), (1 << 31) - 1, size=(2, 6, 7), dtype=np.int64).astype(np.int32)
    stage = output_stage(rng.uniform(1e-6, 1e-4, 6), QParams(scale=0.05, zero_point=3, bits=8, signed=True), 15, 1)
    rts = IntRuntime(NumpyBackend()), IntRuntime(CompiledBackend())
    safe = AccumulatorPlan(32, True)
    want, got = (finish_accumulator(int32_acc, None, safe, stage, Node("n", "Conv", [], ["y"]), rt) for rt in rts)
    np.testing.assert_array_equal(got, want)


def _fast_stage(rng, channels):
    """Packed parameters (`ops.compiled.requant.pack_stage` layout) of a stage the vectorized loop takes: M
    up to 2^31 - 1, N over [1, 62], zero points and offsets of both signs."""
    from ops.compiled import requant

    prm = np.zeros((8, channels), dtype=np.int64)
    prm[requant.M] = rng.integers(1, 1 << 31, channels)
    prm[requant.M, 0] = (1 << 31) - 1
    prm[requant.N] = rng.integers(1, 63, channels)
    prm[requant.N, :2] = (1, 62)
    zp = int(rng.integers(-100, 100))
    prm[requant.K] = ((1 << prm[requant.N]) >> 1) + zp * (1 << prm[requant.N])
    prm[requant.SUB] = 1 << (63 - prm[requant.N])
    lim = np.array([-(1 << 40), 1 << 40, 0, 0, 0, 0, 1], dtype=np.int64)
    return prm, lim


def test_vectorized_requant_shift_at_int64_extremes():
    """The FAST loop's logical shift, v >> N = ((v + 2^63) >>> N) - 2^(63-N), against Python integers for
    products acc * M + k near both ends of int64, every channel's N from 1 to 62, per row and channels-last."""
    from ops.compiled import requant

    rng = np.random.default_rng(5)
    channels = 12
    prm, lim = _fast_stage(rng, channels)
    offset = rng.integers(-1000, 1000, channels)
    for c in range(channels):
        m, k = int(prm[requant.M, c]), int(prm[requant.K, c])
        edge = ((1 << 63) - 1 - abs(k) - 1000 * m) // m  # |acc + offset| * M + |k| stays inside int64
        acc = np.concatenate([[edge, -edge, 0, 1, -1], rng.integers(-edge, edge, 200)]).astype(np.int64)
        out = np.empty(acc.size, dtype=np.int64)
        assert requant.requant_row(acc, int(offset[c]), c, prm, lim, out) == 0
        want = [min(max(((int(a) + int(offset[c])) * m + k) >> int(prm[requant.N, c]), int(lim[0])), int(lim[1]))
                for a in acc]
        assert out.tolist() == want
    acc = rng.integers(-(1 << 31), 1 << 31, size=(7, channels)).astype(np.int64)
    slow = lim.copy()
    slow[requant.FAST] = 0
    got, ref = np.empty((7, channels), np.int64), np.empty((7, channels), np.int64)
    requant.requant_positions(acc, offset, prm, lim, requant.lane_params(offset, prm), got)
    requant.requant_positions(acc, offset, prm, slow, requant.lane_params(offset, prm), ref)
    want = [[min(max(((int(acc[p, c]) + int(offset[c])) * int(prm[requant.M, c]) + int(prm[requant.K, c]))
                     >> int(prm[requant.N, c]), int(lim[0])), int(lim[1])) for c in range(channels)] for p in range(7)]
    assert got.tolist() == want and ref.tolist() == want


def _linear(op_type, seed, **kw):
    rng = np.random.default_rng(seed)
    if op_type == "Gemm":
        a_f = rng.normal(size=(5, 7)).astype(np.float32)
        w_f = rng.normal(size=(7, 4)).astype(np.float32)
        b_f = rng.normal(size=(5, 4) if seed == 3 else 4).astype(np.float32)  # a 2-D C: the numpy path
        a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), 8)
        w_qp = random_qparams(rng, w_f.min(0), w_f.max(0), 8, signed=True, axis=1) if seed % 2 else \
            random_qparams(rng, float(w_f.min()), float(w_f.max()), 8, signed=True)
        y_qp = random_qparams(rng, -6.0, 6.0, 8, symmetric=False)
        attrs = {"activation": "Relu"} if seed % 3 == 0 else {}
        node = Node("g", "Gemm", ["a", "w", "b"], ["y"], attrs)
        op = get_op("Gemm")
        return op, op.quantize(context(node, [a_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f})), [a_qp.quantize(a_f), w_f, b_f]
    if op_type == "MatMul":
        a_f = rng.normal(size=(2, 3, 6)).astype(np.float32)
        b_f = rng.normal(size=(2, 6, 4)).astype(np.float32)
        a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), 8)
        b_qp = random_qparams(rng, float(b_f.min()), float(b_f.max()), 8)
        y_qp = random_qparams(rng, -8.0, 8.0, 8, symmetric=False)
        node = Node("m", "MatMul", ["a", "b"], ["y"])
        op = get_op("MatMul")
        return op, op.quantize(context(node, [a_qp, b_qp], [y_qp])), [a_qp.quantize(a_f), b_qp.quantize(b_f)]
    x_f = rng.normal(size=(2, 4, 3, 5)).astype(np.float32)
    consts = {i: rng.uniform(0.5, 1.5, 4).astype(np.float32) if i in (1, 4) else rng.normal(size=4).astype(np.float32)
              for i in range(1, 5)}
    x_qp = random_qparams(rng, float(x_f.min()), float(x_f.max()), 8)
    y_qp = random_qparams(rng, -5.0, 5.0, 8, symmetric=False)
    node = Node("bn", "BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])
    op = get_op("BatchNormalization")
    q = op.quantize(context(node, [x_qp, None, None, None, None], [y_qp], consts))
    return op, q, [x_qp.quantize(x_f)] + [consts[i] for i in range(1, 5)]


@pytest.mark.parametrize("op_type", ["Gemm", "MatMul", "BatchNormalization"])
def test_linear_ops_compiled_epilogue_equals_numpy(op_type):
    for seed in range(4):
        op, q, inputs = _linear(op_type, seed)
        _both(op, q, inputs)


def _elementwise(op_type, seed, shapes, bits=8, constant=None):
    rng = np.random.default_rng(seed)
    floats = [rng.normal(size=s).astype(np.float32) for s in shapes]
    qps = [random_qparams(rng, float(f.min()), float(f.max()), bits) for f in floats]
    y_qp = random_qparams(rng, -4.0, 4.0, bits, symmetric=False)
    consts = {constant: floats[constant]} if constant is not None else {}
    in_qp = [None if i == constant else qp for i, qp in enumerate(qps)]
    node = Node("e", op_type, ["a", "b"], ["y"])
    op = get_op(op_type)
    q = op.quantize(context(node, in_qp, [y_qp], consts))
    inputs = [floats[i] if i == constant else qps[i].quantize(floats[i]) for i in (0, 1)]
    return op, q, inputs


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul"])
@pytest.mark.parametrize("shapes, constant", [
    (((2, 5, 4, 3), (2, 5, 4, 3)), None),
    (((2, 5, 4, 3), (1,)), None),
    (((), (3, 4)), None),
    (((3, 4), (3, 4)), 0),
    (((3, 4), (1, 1)), 1),
    (((2, 5, 4, 3), (5, 1, 1)), None),  # a broadcast the kernel leaves to numpy
])
@pytest.mark.parametrize("bits", [8, 16])
def test_elementwise_compiled_equals_numpy(op_type, shapes, constant, bits):
    for seed in range(2):
        _both(*_elementwise(op_type, seed, shapes, bits, constant))


POOL_CASES = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [0, 1, 1, 0], "dilations": [2, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER", "strides": [2, 1]},
    {"kernel_shape": [3], "strides": [2], "pads": [1, 1]},  # 1-d: numpy path
]


@pytest.mark.parametrize("attrs", POOL_CASES)
@pytest.mark.parametrize("op_type", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("bits, signed", [(8, True), (8, False), (16, True)])
def test_pooling_compiled_equals_numpy(attrs, op_type, bits, signed):
    rng = np.random.default_rng(bits + signed)
    nd = len(attrs["kernel_shape"])
    x_qp = random_qparams(rng, -2.0, 3.0, bits, signed=signed)
    x = random_codes(rng, x_qp, (2, 3) + (9, 8)[:nd])
    y_qp = random_qparams(rng, -1.0, 2.0, bits, symmetric=False)
    for include_pad in (0, 1):
        node = Node("p", op_type, ["x"], ["y"], dict(attrs, count_include_pad=include_pad))
        op = get_op(op_type)
        q = op.quantize(context(node, [x_qp], [y_qp]))
        _both(op, q, [x])


@pytest.mark.parametrize("op_type, x_bits, signed", [
    ("Sigmoid", 8, True), ("Tanh", 8, True), ("HardSwish", 8, False), ("Sigmoid", 16, True), ("Tanh", 16, True),
])
def test_lut_compiled_equals_numpy(op_type, x_bits, signed):
    rng = np.random.default_rng(x_bits)
    x_qp = random_qparams(rng, -5.0, 5.0, x_bits, signed=signed, symmetric=True)
    y_qp = random_qparams(rng, -1.0, 1.0, x_bits, signed=True, symmetric=op_type == "Tanh")
    node = Node("l", op_type, ["x"], ["y"])
    op = get_op(op_type)
    q = op.quantize(context(node, [x_qp], [y_qp]))
    codes = np.arange(x_qp.qmin, x_qp.qmax + 1).astype(x_qp.dtype).reshape(1, -1)
    _both(op, q, [codes])


def test_lut_compiled_refuses_codes_outside_the_input_range():
    x_qp = QParams(scale=0.01, zero_point=0, bits=4, signed=True)
    node = Node("l", "Sigmoid", ["x"], ["y"])
    op = get_op("Sigmoid")
    q = op.quantize(context(node, [x_qp], [QParams(scale=1 / 255, zero_point=0, bits=8, signed=False)]))
    with pytest.raises(ValueError, match="outside the input range"):
        op.forward_int(q, [np.array([0, 9], dtype=np.int8)], IntRuntime(CompiledBackend()))


def test_backend_names():
    assert get_backend("compiled").compiled and not get_backend("numpy").compiled
    with pytest.raises(ValueError, match="unknown backend 'dsp'"):
        get_backend("dsp")


def test_the_compiled_kernels_cover_the_cases_they_claim():
    """The equality tests above compare real compiled runs: the wrappers take these cases (and leave the
    others to numpy, returning None)."""
    from ops.compiled.depthwise import conv2d_grouped
    from ops.compiled.elementwise import add_sub_codes
    from ops.conv_kernels import conv_geometry

    for case, covered in ((CONV_CASES[0], True), (CONV_CASES[5], True), (CONV_CASES[6], True),
                          (CONV_CASES[10], True), (CONV_CASES[7], False), (CONV_CASES[8], False),
                          (CONV_CASES[12], False)):
        _, q, inputs = _conv_case(0, *case, spatial=(9, 8, 5))
        geom = conv_geometry(q.node.attrs, inputs[0].shape[2:], q.weight.shape[2:])
        assert (conv2d_grouped(inputs[0], q, geom, None) is not None) == covered, case
    _, q, inputs = _elementwise("Add", 0, ((2, 3), (2, 3)))
    y_qp = q.out_qparams[0]
    assert add_sub_codes(inputs[0], inputs[1], (0, 0), q.m, q.n, q.shift, 1, y_qp) is not None
    assert add_sub_codes(np.zeros((2, 3), np.int8), np.zeros((3,), np.int8), (0, 0), q.m, q.n, q.shift, 1,
                         y_qp) is None


@pytest.mark.parametrize("nonzero, want", [(1032, np.float32), (1100, np.float64)])
def test_dense_conv_at_the_float_exactness_bound(nonzero, want, monkeypatch):
    """A 2000-deep pointwise convolution whose weight rows have `nonzero` taps of 127 (the rest 0) on inputs
    of -127: the dot product is -127 * 127 * nonzero, next to 2^24 (odd products: partial sums past 2^24
    would round in float32). The compiled GEMM (the path without the integer multiply-add kernels, turned
    off here as on a CPU without them) picks float32 while 128 (the int8 bound) * row L1 norm <= 2^24, float64
    above; the bias cancels the sum and the requant factor is exactly 1, so an accumulator one unit off would
    change the output code."""
    import ops.compiled.int_dense as int_dense
    import ops.compiled.int_wide_weight as int_wide_weight
    from ops.compiled.pointwise import FLOAT32_EXACT, _row_l1, conv_dense
    from ops.conv_kernels import conv_geometry

    monkeypatch.setattr(int_dense, "LANES", 0)
    monkeypatch.setattr(int_wide_weight, "LANES", 0)

    depth = 2000
    w_f = np.zeros((2, depth, 1, 1), dtype=np.float32)
    w_f[:, :nonzero] = 1.0
    w_qp = QParams(scale=1 / 127, zero_point=0, bits=8, signed=True, narrow=True)
    x_qp = QParams(scale=1 / 64, zero_point=0, bits=8, signed=True)
    x = np.full((1, depth, 2, 3), -127, dtype=np.int8)
    x[0, :7, 1, 2] = 127  # one position with another sum
    s_acc = float(np.float32(x_qp.scale[0]) * np.float32(w_qp.scale[0]))
    y_qp = QParams(scale=s_acc, zero_point=0, bits=16, signed=True)
    b_f = np.array([127 * 127 * nonzero + 5, 127 * 127 * nonzero - 9], dtype=np.float64) * s_acc
    node = Node("pw", "Conv", ["x", "w", "b"], ["y"], {})
    op = get_op("Conv")
    q = op.quantize(context(node, [x_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f.astype(np.float32)}))
    assert (q.stage.m[0], q.stage.n[0]) == (1 << 14, 14)  # M / 2^N = 1
    assert (128 * _row_l1(q) <= FLOAT32_EXACT) == (want is np.float32)
    geom = conv_geometry(q.node.attrs, x.shape[2:], q.weight.shape[2:])
    assert conv_dense(x, q, geom, None if q.acc.safe else q.acc.bits) is not None
    assert int_dense.dense_operands(q, q.weight.reshape(2, -1)) is None  # the float GEMM ran
    y = _both(op, q, [x, w_f, b_f.astype(np.float32)])[0]
    acc = -127 * 127 * nonzero + q.bias.reshape(1, 2, 1, 1)
    assert np.abs(acc).max() < 1000  # the sums land near zero, where every unit shows
    np.testing.assert_array_equal(y[:, :, 0, 0], acc[:, :, 0, 0])
