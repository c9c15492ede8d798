"""The integer dot-product kernels of the compiled backend (`ops.compiled.vnni` tiles under
`ops.compiled.int_dense` and `ops.compiled.int_depthwise`): their int32 accumulators equal an int64 reference
of the formula exactly (random codes, the extreme codes and weights, odd sizes that leave partial tiles and
partial channel groups), the int32 bound is checked where the weight is packed (the layer then keeps the float
path), and the Conv/Gemm ops give the numpy backend's codes with these kernels and without them."""
from __future__ import annotations

import numpy as np
import pytest

import ops.compiled.int_dense as int_dense
import ops.compiled.int_depthwise as int_depthwise
import ops.compiled.int_depthwise16 as int_depthwise16
import ops.compiled.int_wide_weight as int_wide_weight
from ops.backend import CompiledBackend
from ops.compiled.requant import FAST, HI, K, LO, M, N, SUB
from ops.compiled.vnni import WEIGHT_RANGE
from ops.registry import IntRuntime
from test_compiled_kernels import CONV_CASES, _both, _conv_case, _linear

INT32 = np.iinfo(np.int32)


def _unsigned(x: np.ndarray) -> np.ndarray:
    """The unsigned bytes the kernels read, as int64: x_q, or x_q + 128 for int8 codes."""
    return x.astype(np.int64) + (128 if x.dtype == np.int8 else 0)


def _codes(rng, shape, dtype, fill=None) -> np.ndarray:
    info = np.iinfo(dtype)
    if fill == "max":
        return np.full(shape, info.max, dtype=dtype)
    if fill == "min":
        return np.full(shape, info.min, dtype=dtype)
    return rng.integers(info.min, int(info.max) + 1, size=shape, dtype=dtype)


def _weight(rng, shape, fill=None) -> np.ndarray:
    """Centered weights over the instruction's whole range (int8 for vpdpbusd, int16 for vpmaddwd)."""
    if fill == "max":
        return np.full(shape, WEIGHT_RANGE[1], dtype=np.int32)
    if fill == "min":
        return np.full(shape, WEIGHT_RANGE[0], dtype=np.int32)
    return rng.integers(WEIGHT_RANGE[0], WEIGHT_RANGE[1] + 1, size=shape).astype(np.int32)


# pixels, depth, output channels: partial row tiles (6), partial channel groups (16, 32), depths not a multiple of 4
DENSE_SIZES = [(1, 1, 1), (7, 5, 3), (13, 27, 33), (6, 64, 16), (49, 130, 47), (100, 4, 200), (61, 96, 32)]
EXTREMES = [(None, None), ("max", "min"), ("max", "max"), ("min", "min"), ("min", "max")]


@pytest.mark.parametrize("pixels, depth, channels", DENSE_SIZES)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("x_fill, w_fill", EXTREMES)
def test_dense_tiles_equal_the_int64_dot_product(pixels, depth, channels, dtype, x_fill, w_fill):
    rng = np.random.default_rng(pixels * 1000 + depth + channels)
    x = _codes(rng, (pixels, depth), dtype, x_fill)
    w = _weight(rng, (channels, depth), w_fill)
    ops = int_dense.dense_operands(_Node(), w)
    assert ops is not None
    np.testing.assert_array_equal(ops.weight_sum, w.astype(np.int64).sum(axis=1))
    got = int_dense.dense_acc(x, ops)
    assert got.dtype == np.int32 and got.shape == (pixels, channels)
    np.testing.assert_array_equal(got, _unsigned(x) @ w.astype(np.int64).T)


def test_dense_tiles_read_strided_rows():
    """A Gemm's transposed A (not C-contiguous) is copied into rows first: same sums."""
    rng = np.random.default_rng(3)
    x = _codes(rng, (40, 9), np.uint8).T  # (9, 40), strided
    w = _weight(rng, (5, 40))
    ops = int_dense.dense_operands(_Node(), w)
    np.testing.assert_array_equal(int_dense.dense_acc(x, ops), _unsigned(x) @ w.astype(np.int64).T)


def test_dense_int32_bound_is_checked_at_packing():
    """255 * max_m sum_k |w[m, k]| < 2^31 or the layer is not packed: at the largest depth the bound allows,
    the extreme sum -255 * 128 * K is still exact; one more term and the weight is refused."""
    depth = (INT32.max) // (255 * 128)
    w = np.full((2, depth), -128, dtype=np.int32)
    w[1, :] = 127
    ops = int_dense.dense_operands(_Node(), w)
    assert ops is not None
    x = np.full((3, depth), 255, dtype=np.uint8)
    got = int_dense.dense_acc(x, ops)
    np.testing.assert_array_equal(got, _unsigned(x) @ w.astype(np.int64).T)
    assert got.min() == -255 * 128 * depth
    wider = np.full((1, depth + 1), -128, dtype=np.int32)
    assert int_dense.dense_operands(_Node(), wider) is None


@pytest.mark.parametrize("past", [1, -1, 100])
def test_dense_weight_outside_the_instruction_range_is_refused(past):
    """int8 weights for vpdpbusd, int16 for vpmaddwd: one value past the range and the layer keeps the float
    path."""
    w = np.zeros((4, 8), dtype=np.int32)
    w[2, 5] = WEIGHT_RANGE[1] + past if past > 0 else WEIGHT_RANGE[0] + past
    assert int_dense.dense_operands(_Node(), w) is None
    w[2, 5] = WEIGHT_RANGE[1] if past > 0 else WEIGHT_RANGE[0]
    assert int_dense.dense_operands(_Node(), w) is not None


class _Node:
    """A stand-in for a quantized node: the kernels cache their packed operands per node object, and need
    only its bias (zeros) and output dtype (int32, below)."""

    def __init__(self, channels: int = 0):
        self.bias = np.zeros(channels, dtype=np.int64)
        self.stage = _Stage()


class _Stage:
    dtype = np.dtype(np.int32)


def _identity_stage(channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Packed epilogue parameters that return the accumulator itself: M = 2, N = 1, no zero point,
    (2A + 1) >> 1 = A, clamped to int32 (the FAST case)."""
    prm = np.zeros((8, channels), dtype=np.int64)
    prm[M], prm[N], prm[K], prm[SUB] = 2, 1, 1, 1 << 62
    lim = np.zeros(7, dtype=np.int64)
    lim[LO], lim[HI], lim[FAST] = INT32.min, INT32.max, 1
    return prm, lim


def _depthwise_reference(x, w, zx, strides, dilations, pads) -> np.ndarray:
    """sum_{kh, kw} (x_q[c, oh*sh + kh*dh - pt, ow*sw + kw*dw - pl] - zx) * w[c, kh, kw], the padding x_q = zx,
    in int64 (N, C, OH, OW)."""
    n, c, h, wd = x.shape
    kh, kw = w.shape[1:]
    xp = np.full((n, c, h + pads[0] + pads[2], wd + pads[1] + pads[3]), zx, dtype=np.int64)
    xp[:, :, pads[0]:pads[0] + h, pads[1]:pads[1] + wd] = x
    oh = (xp.shape[2] - (kh - 1) * dilations[0] - 1) // strides[0] + 1
    ow = (xp.shape[3] - (kw - 1) * dilations[1] - 1) // strides[1] + 1
    out = np.zeros((n, c, oh, ow), dtype=np.int64)
    for i in range(kh):
        for j in range(kw):
            rows = xp[:, :, i * dilations[0]:i * dilations[0] + (oh - 1) * strides[0] + 1:strides[0],
                      j * dilations[1]:j * dilations[1] + (ow - 1) * strides[1] + 1:strides[1]]
            out += (rows - zx) * w[None, :, i, j, None, None].astype(np.int64)
    return out


# channels, kernel, strides, dilations, pads (top, left, bottom, right), spatial
DEPTHWISE_CASES = [
    (16, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), (9, 11)),
    (20, (3, 3), (2, 2), (1, 1), (0, 1, 1, 0), (10, 9)),      # a partial channel group, stride 2
    (33, (5, 5), (1, 1), (1, 1), (2, 2, 2, 2), (7, 6)),       # two quads per kernel row
    (5, (2, 7), (1, 3), (2, 1), (1, 3, 0, 2), (8, 13)),       # odd kernel, stride 3, dilated rows
    (1, (4, 1), (1, 1), (3, 2), (0, 1, 3, 0), (9, 5)),        # one channel, a kernel of width 1
    (48, (3, 3), (1, 1), (1, 2), (1, 2, 1, 2), (5, 9)),       # dilated columns
    (7, (1, 1), (2, 1), (1, 1), (0, 0, 0, 0), (3, 4)),
]


@pytest.mark.parametrize("channels, kernel, strides, dilations, pads, spatial", DEPTHWISE_CASES)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("x_fill, w_fill", EXTREMES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_quads_equal_the_int64_convolution(channels, kernel, strides, dilations, pads, spatial, dtype,
                                                     x_fill, w_fill, channels_last):
    rng = np.random.default_rng(channels + sum(kernel) + sum(spatial))
    x = _codes(rng, (2, channels) + spatial, dtype, x_fill)
    if channels_last:
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    w = _weight(rng, (channels,) + kernel, w_fill)
    info = np.iinfo(dtype)
    zx = int(rng.integers(info.min, int(info.max) + 1))
    want = _depthwise_reference(x, w, zx, strides, dilations, pads)
    done = int_depthwise.depthwise_int(x, _Node(channels), w, zx, strides, dilations, pads,
                                       _identity_stage(channels), list(want.shape[2:]))
    assert done is not None
    got, over = done
    assert over == 0 and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


def test_depthwise_weight_outside_the_instruction_range_keeps_the_other_kernel():
    w = np.zeros((4, 3, 3), dtype=np.int32)
    w[1, 2, 0] = WEIGHT_RANGE[1] + 1
    x = np.zeros((1, 4, 5, 5), dtype=np.uint8)
    assert int_depthwise.depthwise_int(x, _Node(4), w, 0, (1, 1), (1, 1), (1, 1, 1, 1), _identity_stage(4),
                                       [5, 5]) is None
    wide = np.zeros((1, 4, 5, 5), dtype=np.int16)
    assert int_depthwise.depthwise_int(wide, _Node(4), np.zeros((4, 3, 3), np.int32), 0, (1, 1), (1, 1),
                                       (1, 1, 1, 1), _identity_stage(4), [5, 5]) is None


@pytest.fixture
def without_int_kernels(monkeypatch):
    """The compiled backend as on a CPU without VNNI: the float-BLAS dense path and the int32 depthwise kernel
    (every integer dot-product module's LANES 0, as `ops.compiled.vnni` sets it there)."""
    monkeypatch.setattr(int_dense, "LANES", 0)
    monkeypatch.setattr(int_depthwise, "LANES", 0)
    monkeypatch.setattr(int_wide_weight, "LANES", 0)
    monkeypatch.setattr(int_depthwise16, "LANES", 0)


def _ran_int_kernels(op, q, inputs) -> bool:
    """Whether the compiled run of this node went through the integer dot-product kernels (their caches
    hold the node once it did)."""
    op.forward_int(q, inputs, IntRuntime(CompiledBackend()))
    return any(key == id(q) or (isinstance(key, tuple) and key[0] == id(q))
               for cache in (int_dense._OPERANDS, int_depthwise._PACKED) for key, value in cache.items()
               if value is not None)


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_codes_equal_numpy_with_and_without_the_int_kernels(case, monkeypatch):
    """Every convolution case of test_compiled_kernels once more: 8-bit dense and depthwise ones whose
    centered weight fits int8 run on the integer kernels (and give the numpy codes); with the kernels off
    (a CPU without VNNI), the other compiled paths give the same codes."""
    for seed, activation in ((7, None), (9, "Clip"), (10, None)):
        op, q, inputs = _conv_case(seed, *case, activation=activation, spatial=(9, 8, 5))
        groups, cin, cout = case[:3]
        fits = WEIGHT_RANGE[0] <= int(q.weight.min()) and int(q.weight.max()) <= WEIGHT_RANGE[1]
        expected = fits and len(case[3]) <= 2 and (groups == 1 or (groups == cin == cout))
        assert _ran_int_kernels(op, q, inputs) == expected, case
        _both(op, q, inputs)
    with monkeypatch.context() as patch:
        patch.setattr(int_dense, "LANES", 0)
        patch.setattr(int_depthwise, "LANES", 0)
        patch.setattr(int_wide_weight, "LANES", 0)
        patch.setattr(int_depthwise16, "LANES", 0)
        op, q, inputs = _conv_case(8, *case, spatial=(9, 8, 5))
        assert not _ran_int_kernels(op, q, inputs)
        _both(op, q, inputs)


def test_gemm_codes_equal_numpy_without_the_int_kernels(without_int_kernels):
    """Gemm on a CPU without VNNI: the float-BLAS path, the numpy codes."""
    op, q, inputs = _linear("Gemm", 5)
    _both(op, q, inputs)
    assert not _ran_int_kernels(op, q, inputs)


def test_gemm_codes_equal_numpy_with_the_int_kernels():
    for seed in range(4):
        op, q, inputs = _linear("Gemm", seed)
        _both(op, q, inputs)
        fits = WEIGHT_RANGE[0] <= int(q.weight.min()) and int(q.weight.max()) <= WEIGHT_RANGE[1]
        assert _ran_int_kernels(op, q, inputs) == (fits and seed != 3)  # seed 3: a 2-D bias, the numpy path


def test_the_conv_cases_run_the_int_kernels():
    """The cases above are a real test of the integer kernels: a good share of them take them."""
    runs = [_ran_int_kernels(*_conv_case(seed, *case, spatial=(9, 8, 5)))
            for case in CONV_CASES for seed in (7, 9, 10)]
    assert sum(runs) >= 8


def _fast_params(rng, channels, m_max=(1 << 15) - 1, n_range=(16, 47), k_max=(1 << 46) - 1):
    """Packed FAST-case parameters (`ops.compiled.requant` rows) with M, N and the folded constant K drawn up
    to the 32-bit lanes' limits; the offset is 0, K carries the rest."""
    prm = np.zeros((8, channels), dtype=np.int64)
    prm[M] = rng.integers(0, m_max + 1, channels)
    prm[M, :2] = (0, m_max)
    prm[N] = rng.integers(n_range[0], n_range[1] + 1, channels)
    prm[N, :2] = n_range
    prm[K] = rng.integers(-k_max, k_max + 1, channels)
    prm[K, 2:4] = (-k_max, k_max)
    prm[SUB] = np.int64(1) << (63 - prm[N])
    return prm


@pytest.mark.parametrize("seed", range(6))
def test_epilogue_32_bit_lanes_equal_the_int64_formula(seed):
    """The 32-bit epilogue (`ops.compiled.epilogue`) at its limits: floor((A * M + K) / 2^N) clamped, for
    accumulators at the int32 extremes and M, N, K at the edges of its conditions, equals Python integers and
    the 64-bit lanes."""
    from ops.compiled.epilogue import _rows32, _rows64, params32
    from ops.compiled.requant import lane_params

    rng = np.random.default_rng(seed)
    channels, rows = 37, 9
    prm = _fast_params(rng, channels)
    offset = np.zeros(channels, dtype=np.int64)
    acc = rng.integers(INT32.min, INT32.max + 1, size=(rows, channels), dtype=np.int64).astype(np.int32)
    acc[0], acc[1], acc[2, :4] = INT32.min, INT32.max, (0, -1, 1, -(1 << 16))
    lanes32 = params32(offset, prm)
    assert lanes32[0]
    lo, hi = (-128, 127) if seed % 2 else (INT32.min, INT32.max)
    want = [[min(max((int(a) * int(prm[M, c]) + int(prm[K, c])) >> int(prm[N, c]), lo), hi)
             for c, a in enumerate(row)] for row in acc]
    got32 = np.zeros(rows * channels, dtype=np.int64)
    got64 = np.zeros(rows * channels, dtype=np.int64)
    _rows32(acc.reshape(-1), channels, rows, channels, lanes32, lo, hi, got32, 0)
    _rows64(acc.reshape(-1), channels, rows, channels, lane_params(offset, prm), prm[SUB], lo, hi, got64, 0)
    np.testing.assert_array_equal(got32.reshape(rows, channels), np.array(want, dtype=np.int64))
    np.testing.assert_array_equal(got64, got32)


@pytest.mark.parametrize("m_max, n_range, k_max", [(1 << 15, (16, 47), 1 << 40), ((1 << 15) - 1, (15, 40), 1 << 40),
                                                   ((1 << 15) - 1, (16, 48), 1 << 40),
                                                   ((1 << 15) - 1, (16, 47), 1 << 46)])
def test_epilogue_32_bit_lanes_refuse_parameters_past_their_limits(m_max, n_range, k_max):
    from ops.compiled.epilogue import params32

    prm = _fast_params(np.random.default_rng(0), 8, m_max, n_range, k_max)
    assert not params32(np.zeros(8, dtype=np.int64), prm)[0]


AVX2_TARGET = {"NUMBA_CPU_NAME": "haswell",
               "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+lzcnt,+mmx,+movbe,+popcnt,"
                                     "+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave"}


def test_vpmaddwd_kernels_on_an_avx2_target():
    """A CPU without VNNI (numba compiling for an AVX2 Haswell): the kernels take `vpmaddwd` on 16-bit pairs, and
    the exactness tests above pass on them too (a child process: numba's target is fixed per process, and its
    on-disk cache is keyed on it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, **AVX2_TARGET}
    chosen = subprocess.run([sys.executable, "-c", "import ops.compiled.vnni as v; print(v.INSTRUCTION, v.LANES)"],
                            cwd=root, env=env, capture_output=True, text=True, check=True)
    assert chosen.stdout.split() == ["llvm.x86.avx2.pmadd.wd", "8"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "dense_tiles_equal or depthwise_quads_equal or int32_bound or conv_codes_equal"],
                         cwd=root, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_scratch_views_share_one_growing_buffer_per_name():
    """`ops.compiled.scratch` hands out its cached views: every view of a name shares one buffer, also after
    a larger request grew it (the views of the smaller buffer are dropped)."""
    from ops.compiled.scratch import scratch

    small = scratch("test_scratch", (4,), np.int32)
    assert scratch("test_scratch", (4,), np.int32) is small
    square = scratch("test_scratch", (2, 2), np.int32)
    assert square.shape == (2, 2) and np.shares_memory(small, square)
    large = scratch("test_scratch", (64,), np.int32)
    again = scratch("test_scratch", (4,), np.int32)
    assert np.shares_memory(again, large) and not np.shares_memory(again, small)
    assert np.shares_memory(scratch("test_scratch", (2, 2), np.int32), large)
    assert not np.shares_memory(scratch("test_scratch", (4,), np.int64), large)


@pytest.mark.parametrize("bits, signed, zero_point", [(8, True, -3), (8, False, 131), (16, True, 7)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_input_quantization_equals_qparams_quantize(bits, signed, zero_point, dtype):
    """The compiled quantization of a graph input (`ops.compiled.quantize`) gives `QParams.quantize`'s codes:
    random values, exact halves (round half to even), values far past the range on both sides."""
    from ops.compiled.quantize import quantize_per_tensor
    from ptq.core.qparams import QParams

    qp = QParams(scale=0.0173, zero_point=zero_point, bits=bits, signed=signed)
    rng = np.random.default_rng(bits + zero_point)
    x = rng.normal(0, 3, size=(2, 3, 17, 19))
    x.flat[:40] = (np.arange(-20, 20) + 0.5) * 0.0173  # halves of a step
    x.flat[40:44] = (-1e6, 1e6, -0.0, 0.0)
    x = x.astype(dtype)
    got = quantize_per_tensor(qp, x)
    want = qp.quantize(x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    assert quantize_per_tensor(qp, x.transpose(0, 1, 3, 2)) is None  # not C-contiguous: QParams.quantize
