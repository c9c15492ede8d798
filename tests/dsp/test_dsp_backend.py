"""DspBackend.matmul against int64 numpy matmul, its operand checks, lane accounting and the name resolver."""
import numpy as np
import pytest

from dsp.backend import DspBackend
from ptq.engine.backends import BACKEND_NAMES, get_backend

SHAPES = [
    ((5, 7), (7, 9)),  # odd rows and columns
    ((4, 1), (1, 6)),  # K = 1
    ((1, 40), (40, 1000)),  # Gemm: one row
    ((3, 1, 9), (2, 3, 9, 33)),  # depthwise conv: one output channel per group, pixels on the last axis
    ((2, 1, 4, 33), (1, 3, 33, 6)),  # broadcast batch dimensions on both sides
    ((6, 300), (300, 5)),  # long dot products: many chains
]
RANGES = {"int8": [(-128, 127), (0, 255)], "int4": [(-8, 7), (0, 15)]}


def reference(a, b):
    return np.matmul(a.astype(np.int64), b.astype(np.int64))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape_a, shape_b", SHAPES)
def test_exact_matmul_equals_int64_reference(scheme, shape_a, shape_b):
    rng = np.random.default_rng([len(scheme), *shape_a])
    backend = DspBackend(scheme)
    for (alo, ahi) in RANGES[scheme]:
        for (blo, bhi) in RANGES[scheme]:
            a = rng.integers(alo, ahi + 1, shape_a)
            b = rng.integers(blo, bhi + 1, shape_b)
            a.flat[0], b.flat[-1] = alo, blo  # the extremes
            out = backend.matmul(a, b)
            assert out.dtype == np.int64
            assert np.array_equal(out, reference(a, b))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_worst_case_operands_over_long_dot_products_stay_exact(scheme):
    """Every product at the extreme that limits the chain depth, K far beyond it: the chunking keeps lanes exact."""
    umax, smin = RANGES[scheme][1][1], RANGES[scheme][0][0]
    a = np.full((4, 301), umax)
    b = np.full((301, 3), smin)
    assert np.array_equal(DspBackend(scheme).matmul(a, b), reference(a, b))
    assert np.array_equal(DspBackend(scheme).matmul(b.T, a.T), reference(b.T, a.T))


def test_matmul_returns_a_new_array_and_accepts_narrow_dtypes():
    a = np.array([[1, -2], [3, 4]], dtype=np.int8)
    b = np.array([[200, 0], [17, 255]], dtype=np.uint8)
    out = DspBackend("int8").matmul(a, b)
    assert out.dtype == np.int64 and np.array_equal(out, reference(a, b))
    out[...] = 0
    assert a[0, 0] == 1 and b[0, 0] == 200


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_naive_mode_is_off_where_a_lower_lane_is_negative(scheme):
    rng = np.random.default_rng(9)
    (slo, shi), (ulo, uhi) = RANGES[scheme]
    a, b = rng.integers(ulo, uhi + 1, (6, 20)), rng.integers(slo, shi + 1, (20, 8))
    diff = DspBackend(scheme, "naive").matmul(a, b) - reference(a, b)
    assert diff.max() <= 0 and diff.min() < 0  # bit slicing only ever loses borrows
    unsigned = DspBackend(scheme, "naive").matmul(a, np.abs(b))
    assert np.array_equal(unsigned, reference(a, np.abs(b)))  # unsigned lanes need no correction


@pytest.mark.parametrize("scheme, a, message", [
    ("int4", np.array([[100, -3]]),
     r"operand a has codes in \[-3, 100\]; this scheme takes int4 \[-8, 7\] or uint4 \[0, 15\]"),
    ("int8", np.array([[300, 2]], dtype=np.int16), r"int8 \[-128, 127\] or uint8 \[0, 255\]"),
    ("int8", np.array([[-129, 2]]), r"codes in \[-129, 2\]"),
])
def test_operands_outside_the_scheme_raise_naming_the_range(scheme, a, message):
    with pytest.raises(ValueError, match=message):
        DspBackend(scheme).matmul(a, np.ones((2, 2), dtype=np.int64))


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="integer array"):
        DspBackend("int8").matmul(np.ones((2, 2)), np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="inner dimensions"):
        DspBackend("int8").matmul(np.ones((2, 3), dtype=np.int64), np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="do not broadcast"):
        DspBackend("int8").matmul(np.ones((2, 2, 3), dtype=np.int64), np.ones((3, 3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="unknown DSP packing scheme 'int16'"):
        DspBackend("int16")
    with pytest.raises(ValueError, match="unknown lane extraction mode"):
        DspBackend("int8", "approx")


def test_lane_accounting_counts_padding_and_short_chains():
    backend = DspBackend("int8")
    a = np.ones((3, 10), dtype=np.int64)  # 3 rows pack into 2 slices: 1 lane of 4 padded
    b = np.ones((10, 1), dtype=np.uint8)  # uint8 x uint8: chains of 4, 10 = 4 + 4 + 2 -> 12 slots
    backend.matmul(a, b)
    stats = backend.stats
    assert (stats.macs, stats.ops, stats.chain_ops, stats.lane_slots) == (30, 20, 24, 40)
    assert stats.padding_loss == pytest.approx(0.25) and stats.chain_loss == pytest.approx(4 / 24)
    backend4 = DspBackend("int4")
    backend4.matmul(np.ones((3, 8), dtype=np.int64), -np.ones((8, 3), dtype=np.int64))  # 2x2 slices, 9 of 16 lanes
    assert backend4.stats.lane_slots == 4 * 4 * 8 and backend4.stats.macs == 9 * 8 and backend4.stats.chain_loss == 0


def test_get_backend_resolves_every_name_and_rejects_others():
    for name in BACKEND_NAMES:
        assert get_backend(name).name == name
    assert get_backend(None).name == "compiled"
    assert get_backend("dsp:int4").direct_depthwise is False
    with pytest.raises(ValueError, match="unknown backend 'dsp:int2'; choose one of compiled, numpy, dsp:int8"):
        get_backend("dsp:int2")
