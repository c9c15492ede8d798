"""16-bit input codes on the 8-bit integer dot-product kernels as two byte planes (`ops.compiled.int_dense16`,
`ops.compiled.int_depthwise16`): the sums equal an int64 reference of the formula exactly (random and extreme
codes and weights, odd sizes with partial tiles and channel groups, the int32 bound's edge, padding with the
zero point), and Conv/Gemm on 16-bit inputs take these kernels and give the numpy backend's codes and overflow
counts (8- and 16-bit outputs, fused activations, saturating accumulators, channels-last and strided inputs)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ops.compiled.int_dense as int_dense
import ops.compiled.int_dense16 as int_dense16
import ops.compiled.int_depthwise as int_depthwise
import ops.compiled.int_depthwise16 as int_depthwise16
import ops.compiled.int_wide_weight as int_wide_weight
from op_testing import context, random_qparams
from ops.backend import NumpyBackend
from ptq.calibration.pipeline import calibrate, input_spec
from ptq.core.graph import load_model
from ptq.data.images import ImageLog, Preprocess, load_image, select_files
from ptq.engine.executor import prepare
from ops import get_op
from ops.backend import CompiledBackend
from ops.registry import IntRuntime
from ptq.core.graph import Node
from test_compiled_kernels import CONV_CASES, _both, _conv_case
from test_int_kernels import (AVX2_TARGET, DENSE_SIZES, DEPTHWISE_CASES, EXTREMES, INT32, _codes, _depthwise_reference,
                              _identity_stage, _Node, _weight)
from ops.compiled.requant import HI, LO
from ops.compiled.vnni import ELEMENTS, WEIGHT_RANGE


def _unsigned16(x: np.ndarray) -> np.ndarray:
    """The unsigned values the kernel reads, as int64: x_q, or x_q + 32768 for int16 codes."""
    return x.astype(np.int64) + (32768 if x.dtype == np.int16 else 0)


@pytest.mark.parametrize("pixels, depth, channels", DENSE_SIZES)
@pytest.mark.parametrize("dtype", [np.uint16, np.int16])
@pytest.mark.parametrize("x_fill, w_fill", EXTREMES)
def test_byte_planes_equal_the_int64_dot_product(pixels, depth, channels, dtype, x_fill, w_fill):
    rng = np.random.default_rng(pixels * 1000 + depth + channels)
    x = _codes(rng, (pixels, depth), dtype, x_fill)
    w = _weight(rng, (channels, depth), w_fill)
    ops = int_dense.dense_operands(_Node(), w)
    got = int_dense16.dense_acc16(x, ops)
    assert got.dtype == np.int64 and got.shape == (pixels, channels)
    np.testing.assert_array_equal(got, _unsigned16(x) @ w.astype(np.int64).T)


def test_byte_planes_at_the_int32_bound():
    """At the deepest layer the 8-bit bound admits, each byte plane's sum -255 * 128 * K is still exact in int32
    and the combined sum -65535 * 128 * K exceeds int32 by far: the int64 combination is exact."""
    depth = INT32.max // (255 * 128)
    w = np.full((2, depth), -128, dtype=np.int32)
    w[1, :] = 127
    ops = int_dense.dense_operands(_Node(), w)
    x = np.full((7, depth), 32767, dtype=np.int16)
    x[3] = -32768
    got = int_dense16.dense_acc16(x, ops)
    np.testing.assert_array_equal(got, _unsigned16(x) @ w.astype(np.int64).T)
    assert got.min() == -65535 * 128 * depth < INT32.min


def test_byte_planes_read_strided_rows():
    rng = np.random.default_rng(5)
    x = _codes(rng, (40, 9), np.int16).T  # (9, 40), strided
    w = _weight(rng, (5, 40))
    ops = int_dense.dense_operands(_Node(), w)
    np.testing.assert_array_equal(int_dense16.dense_acc16(x, ops), _unsigned16(x) @ w.astype(np.int64).T)


class _Node64(_Node):
    """`_Node` with int64 output codes: the 16-bit sums pass int32 (with `vpmaddwd`'s int16 weights)."""

    def __init__(self, channels: int):
        super().__init__(channels)
        self.stage = _Stage64()


class _Stage64:
    dtype = np.dtype(np.int64)


def _identity_stage64(channels: int) -> tuple[np.ndarray, np.ndarray]:
    """`_identity_stage`, clamped to int64 instead of int32."""
    prm, lim = _identity_stage(channels)
    lim[LO], lim[HI] = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    return prm, lim


def _ran_int_kernels(op, q, inputs) -> bool:
    """Whether the compiled run of this node took the integer kernels (their caches then hold the node)."""
    op.forward_int(q, inputs, IntRuntime(CompiledBackend()))
    return int_dense._OPERANDS.get(id(q)) is not None or int_wide_weight._OPERANDS.get(id(q)) is not None or any(
        key[0] == id(q) and value is not None for key, value in int_depthwise._PACKED.items())


@pytest.mark.parametrize("channels, kernel, strides, dilations, pads, spatial", DEPTHWISE_CASES)
@pytest.mark.parametrize("dtype", [np.uint16, np.int16])
@pytest.mark.parametrize("x_fill, w_fill", EXTREMES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_planes_equal_the_int64_convolution(channels, kernel, strides, dilations, pads, spatial, dtype,
                                                      x_fill, w_fill, channels_last):
    """The padding holds zp_x (its two bytes in the planes): a zero point drawn over the whole 16-bit range."""
    rng = np.random.default_rng(channels + sum(kernel) + sum(spatial))
    x = _codes(rng, (2, channels) + spatial, dtype, x_fill)
    if channels_last:
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    w = _weight(rng, (channels,) + kernel, w_fill)
    info = np.iinfo(dtype)
    zx = int(rng.integers(info.min, int(info.max) + 1))
    want = _depthwise_reference(x, w, zx, strides, dilations, pads)
    done = int_depthwise16.depthwise16(x, _Node64(channels), w, zx, strides, dilations, pads,
                                       _identity_stage64(channels), list(want.shape[2:]))
    assert done is not None
    got, over = done
    assert over == 0 and got.dtype == np.int64
    np.testing.assert_array_equal(got, want)


INT_CASES = [case for case in CONV_CASES if case[0] == 1 or (case[0] == case[1] == case[2] and len(case[3]) <= 2)] + [
    (1, 40, 70, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1)),    # pointwise, partial tiles and channel groups
    (1, 9, 33, (3, 3), (2, 1), (1, 0, 2, 1), (2, 1)),     # dense windows, asymmetric pads, dilation
    (40, 40, 40, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),   # depthwise, a partial channel group
]


@pytest.mark.parametrize("case", INT_CASES)
@pytest.mark.parametrize("activation, out_bits", [(None, 8), ("Relu", 16), ("Clip", 8), ("LeakyRelu", 16)])
def test_conv_16_bit_inputs_equal_numpy(case, activation, out_bits):
    """Dense and depthwise convolutions on 16-bit codes (signed and unsigned at random) with an int8 weight run
    the byte planes and give the numpy codes, 8- and 16-bit outputs."""
    for seed in range(3):
        op, q, inputs = _conv_case(seed, *case, x_bits=16, activation=activation, out_bits=out_bits,
                                   spatial=(9, 8, 5))
        assert inputs[0].dtype.itemsize == 2
        fits = WEIGHT_RANGE[0] <= int(q.weight.min()) and int(q.weight.max()) <= WEIGHT_RANGE[1]
        wide = case[0] == 1 and ELEMENTS == 4  # a centered weight past int8 (asymmetric): int_wide_weight
        assert _ran_int_kernels(op, q, inputs) == (fits or wide)
        _both(op, q, inputs)


def test_conv_16_bit_inputs_channels_last():
    """A pointwise layer reading the channels-last codes a compiled convolution wrote (the planned chain)."""
    op, q, inputs = _conv_case(3, 1, 24, 40, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), x_bits=16, spatial=(7, 6))
    x = inputs[0]
    last = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(_both(op, q, [last] + inputs[1:])[0], _both(op, q, inputs)[0])


@pytest.mark.parametrize("groups", [1, 6])
def test_conv_16_bit_saturating_accumulator_is_counted_alike(groups):
    """A bias at the accumulator's limit: the general epilogue on the int64 sums, same codes and overflows."""
    op, q, inputs = _conv_case(4, groups, 6, 6, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), x_bits=16, bias_scale=1e13)
    assert not q.acc.safe
    assert _ran_int_kernels(op, q, inputs)
    _both(op, q, inputs)
    rt = IntRuntime(CompiledBackend())
    op.forward_int(q, inputs, rt)
    assert sum(rt.overflows.values()) > 0


@pytest.mark.parametrize("seed", range(4))
def test_gemm_16_bit_inputs_equal_numpy(seed):
    rng = np.random.default_rng(seed)
    a_f = rng.normal(size=(13, 37)).astype(np.float32)
    w_f = rng.normal(size=(37, 21)).astype(np.float32)
    b_f = rng.normal(size=21).astype(np.float32)
    a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), 16, signed=bool(seed % 2))
    w_qp = random_qparams(rng, w_f.min(0), w_f.max(0), 8, signed=True, symmetric=True, axis=1)
    y_qp = random_qparams(rng, -6.0, 6.0, 16 if seed > 1 else 8, symmetric=False)
    node = Node("g", "Gemm", ["a", "w", "b"], ["y"], {"activation": "Relu"} if seed == 2 else {})
    op = get_op("Gemm")
    q = op.quantize(context(node, [a_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f}))
    inputs = [a_qp.quantize(a_f), w_f, b_f]
    assert inputs[0].dtype.itemsize == 2
    assert _ran_int_kernels(op, q, inputs)
    _both(op, q, inputs)


def _weight16(rng, shape, fill=None) -> np.ndarray:
    if fill == "max":
        return np.full(shape, 32767, dtype=np.int32)
    if fill == "min":
        return np.full(shape, -32768, dtype=np.int32)
    return rng.integers(-32768, 32768, size=shape).astype(np.int32)


@pytest.mark.parametrize("pixels, depth, channels", DENSE_SIZES)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int16])
@pytest.mark.parametrize("x_fill, w_fill", EXTREMES)
def test_wide_weight_planes_equal_the_int64_dot_product(pixels, depth, channels, dtype, x_fill, w_fill):
    """A 16-bit weight as wh, wl - 128 and the row sum (`vpdpbusd` only; other CPUs keep the float path)."""
    rng = np.random.default_rng(pixels * 1000 + depth + channels + 7)
    x = _codes(rng, (pixels, depth), dtype, x_fill)
    w = _weight16(rng, (channels, depth), w_fill)
    ops = int_wide_weight.wide_operands(_Node(), w)
    assert (ops is not None) == (ELEMENTS == 4)
    if ops is not None:
        unsigned = x.astype(np.int64) + {np.int8: 128, np.int16: 32768}.get(x.dtype.type, 0)
        got = int_wide_weight.wide_acc(x, ops)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, unsigned @ w.astype(np.int64).T)


def test_wide_weight_depth_bound_is_checked_at_packing():
    """255 * 128 * K < 2^31 for each plane: at the largest K exact with the extreme codes, one more refused."""
    depth = int_wide_weight.MAX_DEPTH
    w = np.full((2, depth), -32768, dtype=np.int32)
    w[1] = 32767
    ops = int_wide_weight.wide_operands(_Node(), w)
    assert (ops is not None) == (ELEMENTS == 4)
    if ops is not None:
        x = np.full((3, depth), 255, dtype=np.uint8)
        x[1] = 0
        np.testing.assert_array_equal(int_wide_weight.wide_acc(x, ops), x.astype(np.int64) @ w.astype(np.int64).T)
    assert int_wide_weight.wide_operands(_Node(), np.ones((1, depth + 1), dtype=np.int32)) is None
    assert int_wide_weight.wide_operands(_Node(), np.full((1, 4), 32768, dtype=np.int32)) is None


@pytest.mark.parametrize("case", [case for case in INT_CASES if case[0] == 1])
@pytest.mark.parametrize("x_bits", [8, 16])
@pytest.mark.parametrize("activation, out_bits", [(None, 8), ("LeakyRelu", 16)])
def test_conv_16_bit_weights_equal_numpy(case, x_bits, activation, out_bits):
    for seed in range(2):
        op, q, inputs = _conv_case(seed, *case, x_bits=x_bits, w_bits=16, activation=activation, out_bits=out_bits,
                                   spatial=(9, 8, 5))
        fits = -32768 <= int(q.weight.min()) and int(q.weight.max()) <= 32767  # asymmetric: centered past int16
        # vpmaddwd (int16 weights) takes it as the 8-bit kernels' weight where their bound allows
        covered = ELEMENTS == 4 or int_dense._pack(q.weight.reshape(q.weight.shape[0], -1)) is not None
        assert _ran_int_kernels(op, q, inputs) == (fits and covered)
        _both(op, q, inputs)


@pytest.mark.parametrize("x_bits", [8, 16])
def test_gemm_16_bit_weights_equal_numpy(x_bits):
    rng = np.random.default_rng(x_bits)
    a_f = rng.normal(size=(13, 37)).astype(np.float32)
    w_f = rng.normal(size=(37, 21)).astype(np.float32)
    b_f = rng.normal(size=21).astype(np.float32)
    a_qp = random_qparams(rng, float(a_f.min()), float(a_f.max()), x_bits)
    w_qp = random_qparams(rng, w_f.min(0), w_f.max(0), 16, signed=True, symmetric=True, axis=1)
    y_qp = random_qparams(rng, -6.0, 6.0, 8, symmetric=False)
    node = Node("g", "Gemm", ["a", "w", "b"], ["y"], {})
    op = get_op("Gemm")
    q = op.quantize(context(node, [a_qp, w_qp, None], [y_qp], {1: w_f, 2: b_f}))
    inputs = [a_qp.quantize(a_f), w_f, b_f]
    assert _ran_int_kernels(op, q, inputs) == (ELEMENTS == 4 or int_dense._pack(q.weight.T) is not None)
    _both(op, q, inputs)


@pytest.mark.parametrize("channels, kernel, strides, dilations, pads, spatial", DEPTHWISE_CASES)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int16])
@pytest.mark.parametrize("x_fill, w_fill", EXTREMES)
def test_depthwise_wide_weight_equals_the_int64_convolution(channels, kernel, strides, dilations, pads, spatial,
                                                           dtype, x_fill, w_fill):
    """A 16-bit depthwise weight as three int8 packs (`vpdpbusd` only), on 8- and 16-bit codes, channels-last."""
    rng = np.random.default_rng(channels + sum(kernel) + sum(spatial) + 3)
    x = _codes(rng, (2, channels) + spatial, dtype, x_fill)
    x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    w = _weight16(rng, (channels,) + kernel, w_fill)
    info = np.iinfo(dtype)
    zx = int(rng.integers(info.min, int(info.max) + 1))
    want = _depthwise_reference(x, w, zx, strides, dilations, pads)
    done = int_depthwise16.depthwise_wide(x, _Node64(channels), w, zx, strides, dilations, pads,
                                          _identity_stage64(channels), list(want.shape[2:]))
    assert (done is not None) == (ELEMENTS == 4)
    if done is not None:
        got, over = done
        assert over == 0 and got.dtype == np.int64
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", [case for case in INT_CASES if case[0] > 1])
@pytest.mark.parametrize("x_bits", [8, 16])
def test_depthwise_16_bit_weights_equal_numpy(case, x_bits):
    for seed, activation in ((0, None), (1, "LeakyRelu")):
        op, q, inputs = _conv_case(seed, *case, x_bits=x_bits, w_bits=16, activation=activation, spatial=(9, 8))
        fits = -32768 <= int(q.weight.min()) and int(q.weight.max()) <= 32767
        _both(op, q, inputs)
        if ELEMENTS == 4:
            assert (int_depthwise16._WIDE.get((id(q), _zp_u(q, inputs[0]))) is not None) == fits


def _zp_u(q, x) -> int:
    zx = int(q.in_qparams[0].zero_point[0])
    return zx + {np.int8: 128, np.int16: 32768}.get(x.dtype.type, 0)


@pytest.mark.parametrize("bits, weight_bits", [(16, 8), (16, 16), (8, 16)])
def test_efficientnet_16_bit_tables_identical_on_both_backends(model_path, calib_dir, eval_dir, tmp_path, bits,
                                                                weight_bits):
    """EfficientNet-Lite0 calibrated with 16-bit activations and/or weights: every Conv and Gemm takes the
    16-bit integer kernels, and every tensor's codes equal the numpy backend's on three eval photos."""
    table = calibrate(model_path, calib_dir, tmp_path, write_qdq=False, bits=bits, weight_bits=weight_bits).table
    graph = load_model(model_path)
    pre = Preprocess(**table.options.preprocess)
    spec = input_spec(graph, pre)
    reference = prepare(graph, table, backend=NumpyBackend())
    compiled = prepare(graph, table)
    for path in select_files(eval_dir, ImageLog())[:3]:
        x = load_image(path, pre, spec)[None]
        want, got = reference.run({"input": x}), compiled.run({"input": x})
        for name, codes in want.tensors.items():
            assert got.tensors[name].dtype == codes.dtype, name
            np.testing.assert_array_equal(got.tensors[name], codes, err_msg=f"{path.name}: {name}")
        assert got.overflows == want.overflows
    if ELEMENTS == 4:
        ran = [q for q in (step.quantized for step in compiled.steps) if q is not None and _took_16_bit_kernels(q)]
        assert len(ran) == 50  # its 34 dense Conv/Gemm and 16 depthwise Conv


def _took_16_bit_kernels(q) -> bool:
    keys = [key for key, value in int_depthwise._PACKED.items() if value is not None and key[0] == id(q)]
    keys += [key for key, value in int_depthwise16._WIDE.items() if value is not None and key[0] == id(q)]
    wide = int_wide_weight._OPERANDS.get(id(q)) is not None
    return wide or bool(keys) or (int_dense._OPERANDS.get(id(q)) is not None and q.in_qparams[0].bits == 16)


def test_byte_planes_on_an_avx2_target():
    """A CPU without VNNI (`vpmaddwd`, int16 weights, uint16 planes): the exactness tests above pass there too
    (a child process: numba's target is fixed per process)."""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "int64 or int32_bound or depth_bound or strided or 16_bit"],
                         cwd=root, env={**os.environ, **AVX2_TARGET}, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
