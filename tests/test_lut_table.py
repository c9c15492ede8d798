"""lut.build_table: full, half and interpolated tables against dequantize -> f -> quantize computed here."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.optimize import linprog

from lut import FUNCTIONS, build_table, power
from lut.interp import interpolate
from ptq.core.qparams import QParams, compute_qparams

# Float references written independently of lut.functions (python's math module, ONNX default attributes).
SELU_A, SELU_G = 1.67326319217681884765625, 1.05070102214813232421875


def _softplus(x):
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def _safe(fn):
    def wrapped(x):
        try:
            return fn(x)
        except ZeroDivisionError:
            return math.copysign(math.inf, x) if x != 0 else math.inf
        except ValueError:  # math.log(0)
            return -math.inf
    return wrapped


REFERENCE = {
    "sigmoid": lambda x: 1 / (1 + math.exp(-x)),
    "tanh": math.tanh,
    "exp": math.exp,
    "log": _safe(math.log),
    "log_abs": _safe(lambda x: math.log(abs(x))),
    "sqrt": math.sqrt,
    "rsqrt": _safe(lambda x: 1 / math.sqrt(x)),
    "elu": lambda x: x if x > 0 else math.expm1(x),
    "selu": lambda x: SELU_G * (x if x > 0 else SELU_A * math.expm1(x)),
    "softplus": _softplus,
    "bnll": _softplus,
    "softsign": lambda x: x / (1 + abs(x)),
    "hardswish": lambda x: x * max(0.0, min(1.0, x / 6 + 0.5)),
    "cos": math.cos,
    "sin": math.sin,
    "square": lambda x: x * x,
    "reciprocal": _safe(lambda x: 1 / x),
    "pow_3": lambda x: x**3,
    "pow_0.5": lambda x: x**0.5,
}
POSITIVE_DOMAIN = {"log", "sqrt", "rsqrt", "pow_0.5"}


def lut_function(name):
    return power(float(name[4:])) if name.startswith("pow_") else FUNCTIONS[name]


def reference_codes(name, in_q: QParams, out_q: QParams, codes=None) -> np.ndarray:
    codes = np.arange(in_q.qmin, in_q.qmax + 1) if codes is None else codes
    x = (codes.astype(np.int64) - int(in_q.zero_point[0])) * float(in_q.scale[0])
    y = np.array([REFERENCE[name](float(v)) for v in x])
    q = np.rint(y / float(out_q.scale[0])) + int(out_q.zero_point[0])
    return np.clip(q, out_q.qmin, out_q.qmax).astype(np.int64)


def output_qparams(name, in_q: QParams, bits=8, **kw) -> QParams:
    x = (np.arange(in_q.qmin, in_q.qmax + 1) - int(in_q.zero_point[0])) * float(in_q.scale[0])
    y = np.array([REFERENCE[name](float(v)) for v in x])
    y = y[np.isfinite(y)]
    return compute_qparams(y.min(), y.max(), bits, **kw)


def input_qparams(name, kind) -> QParams:
    """8-bit inputs: signed (zp 0 or not) and unsigned (zp 0 or not); positive ranges for log/sqrt/..."""
    if name in POSITIVE_DOMAIN:
        return {
            "signed_zp0": QParams(6 / 127.0, 0, 8, True),  # negative codes allowed only where f is defined
            "signed_asym": QParams(6 / 255.0, -128, 8, True),
            "unsigned_zp0": QParams(6 / 255.0, 0, 8, False),
            "unsigned_asym": QParams(6 / 255.0, 0, 8, False),
        }[kind]
    return {
        "signed_zp0": QParams(8 / 127.5, 0, 8, True),
        "signed_asym": QParams(7 / 255.0, -37, 8, True),
        "unsigned_zp0": QParams(5 / 255.0, 0, 8, False),
        "unsigned_asym": QParams(9 / 255.0, 101, 8, False),
    }[kind]


KINDS = ["signed_zp0", "signed_asym", "unsigned_zp0", "unsigned_asym"]


@pytest.mark.parametrize("name", sorted(REFERENCE))
@pytest.mark.parametrize("kind", KINDS)
def test_full_table_is_exact_for_every_8bit_code(name, kind):
    in_q = input_qparams(name, kind)
    if name in POSITIVE_DOMAIN and kind == "signed_zp0":
        pytest.raises(ValueError, build_table, lut_function(name), in_q, QParams(0.1, 0, 8, False))
        return
    out_q = output_qparams(name, in_q)
    table = build_table(lut_function(name), in_q, out_q)
    codes = np.arange(in_q.qmin, in_q.qmax + 1).astype(in_q.dtype)
    got = table.lookup(codes)
    assert got.dtype == out_q.dtype
    np.testing.assert_array_equal(got.astype(np.int64), reference_codes(name, in_q, out_q))
    rep = table.report()
    assert (rep.entries, rep.bytes, rep.max_error_lsb, rep.half, rep.interpolated) == (256, 256, 0, False, False)


# Odd about 0: a narrow symmetric output ([-127, 127], zp 0) is symmetric about the mirror sum 0.
ODD_ABOUT_ZERO = ["tanh", "softsign", "sin", "reciprocal", "pow_3"]
EVEN = ["cos", "square", "log_abs"]


@pytest.mark.parametrize("name", ODD_ABOUT_ZERO + EVEN + ["sigmoid"])
def test_half_table_is_exact_where_mirroring_is(name):
    in_q = QParams(8 / 127.5, 0, 8, True)
    f = lut_function(name)
    if name == "sigmoid":
        out_q = QParams(1 / 255.0, 0, 8, False)  # mirror sum 2 * 0.5 * 255 = 255 = qmin + qmax
    elif name in ODD_ABOUT_ZERO:
        out_q = output_qparams(name, in_q, narrow=True)
    else:
        out_q = output_qparams(name, in_q)
    table = build_table(f, in_q, out_q, symmetry=f.symmetry, center=f.center)
    rep = table.report()
    assert rep.half and rep.note == "" and rep.entries == 129 and rep.max_error_lsb == 0
    codes = np.arange(-128, 128, dtype=np.int8)
    np.testing.assert_array_equal(table.lookup(codes).astype(np.int64), reference_codes(name, in_q, out_q))


def test_half_table_narrow_signed_input_mirrors_every_code():
    in_q = QParams(3 / 127, 0, 8, True, narrow=True)
    out_q = QParams(1 / 127, 0, 8, True, narrow=True)
    table = build_table("tanh", in_q, out_q, symmetry="odd")
    assert table.report().half and table.report().entries == 128
    np.testing.assert_array_equal(table.lookup(np.arange(-127, 128)), reference_codes("tanh", in_q, out_q))


def test_full_int8_output_range_makes_odd_mirroring_inexact():
    # Output scale 1/128 (full int8 range): tanh(-8) -> -128 but tanh(8) -> 128 clamps to 127, so y(-x) != -y(x).
    in_q = QParams(8 / 127.5, 0, 8, True)
    out_q = QParams(1 / 128, 0, 8, True)
    table = build_table("tanh", in_q, out_q, symmetry="odd")
    rep = table.report()
    assert not rep.half and rep.entries == 256 and "differs from direct quantization" in rep.note
    np.testing.assert_array_equal(table.lookup(np.arange(-128, 128)), reference_codes("tanh", in_q, out_q))


def test_sigmoid_mirror_needs_a_clamp_symmetric_about_the_centre():
    # scale 1/256: mirror sum 2 * 0.5 * 256 = 256 is an integer, but [0, 255] is symmetric about 127.5, not 128:
    # saturated sigmoid(+8) -> 255 mirrors to 1 while direct quantization of sigmoid(-8) gives 0.
    in_q = QParams(8 / 127.5, 0, 8, True)
    out_q = QParams(1 / 256.0, 0, 8, False)
    table = build_table("sigmoid", in_q, out_q, symmetry="odd", center=0.5)
    assert not table.report().half and "256.000000" in table.report().note
    np.testing.assert_array_equal(table.lookup(np.arange(-128, 128)), reference_codes("sigmoid", in_q, out_q))


@pytest.mark.parametrize("scale,exact", [(1 / 200, True), (2 / 511, False)])
def test_sigmoid_mirror_needs_an_integer_mirror_sum(scale, exact):
    # scale 1/200: S = 200 and sigmoid stays inside [0, 200] (no clamp), so y(-x) = 200 - y(x) exactly;
    # scale 2/511: S = 255.5 is not an integer code sum.
    in_q = QParams(8 / 127.5, 0, 8, True)
    out_q = QParams(scale, 0, 8, False)
    table = build_table("sigmoid", in_q, out_q, symmetry="odd", center=0.5)
    assert table.report().half == exact and (exact or "255.5" in table.report().note)
    np.testing.assert_array_equal(table.lookup(np.arange(-128, 128)), reference_codes("sigmoid", in_q, out_q))


def test_half_table_needs_input_zero_point_zero():
    in_q = QParams(8 / 255, 3, 8, True)
    table = build_table("sigmoid", in_q, QParams(1 / 255.0, 0, 8, False), symmetry="odd", center=0.5)
    assert not table.report().half and "zero point 3" in table.report().note


def test_ten_bit_input_gets_a_full_table():
    in_q = compute_qparams(-6, 6, 10)
    out_q = QParams(1 / 255.0, 0, 8, False)
    table = build_table("sigmoid", in_q, out_q)
    assert table.report().entries == 1024 and not table.report().interpolated
    codes = np.arange(-512, 512, dtype=np.int16)
    np.testing.assert_array_equal(table.lookup(codes), reference_codes("sigmoid", in_q, out_q))


# 16-bit inputs over the ranges the whitepaper's notes give (sigmoid +-6, tanh +-3) and exp over [-4, 0.5].
WIDE_CASES = [
    ("sigmoid", compute_qparams(-6, 6, 16), QParams(1 / 65535.0, 0, 16, False)),
    ("tanh", compute_qparams(-3, 3, 16), QParams(1 / 32767.0, 0, 16, True, narrow=True)),
    ("exp", compute_qparams(-4, 0.5, 16, symmetric=False), compute_qparams(0, math.exp(0.5), 16)),
]


@pytest.mark.parametrize("name,in_q,out_q", WIDE_CASES, ids=[c[0] for c in WIDE_CASES])
def test_sixteen_bit_interpolated_table_within_two_lsb(name, in_q, out_q):
    f = FUNCTIONS[name]
    table = build_table(f, in_q, out_q, symmetry=f.symmetry, center=f.center, entries=257)
    codes = np.arange(in_q.qmin, in_q.qmax + 1).astype(in_q.dtype)
    got = table.lookup(codes)
    assert got.dtype == out_q.dtype
    err = np.abs(got.astype(np.int64) - reference_codes(name, in_q, out_q, codes))
    assert err.max() <= 2
    rep = table.report()
    assert rep.interpolated and rep.max_error_lsb == err.max() and rep.error_floor_lsb == err.max()
    assert rep.entries == (129 if rep.half else 257)
    assert rep.half == (name in ("sigmoid", "tanh"))  # exp has no symmetry


def lp_floor(name, in_q: QParams, out_q: QParams, entries: int, level: int) -> int:
    """Least max error any table of `entries` real-valued nodes could reach if it reached at most `level`.

    The lookup rounds v = (1 - w) e[i] + w e[i+1] (half up) and clamps: its code is within k of the reference
    r only if |v - r| <= k + 1/2, a side dropped where the clamp alone keeps it within k (r + k >= qmax
    drops v's upper side). For k <= level, dropping the sides for `level` relaxes those constraints, so with
    t = min over nodes of max |v - r| (an LP) no table has a max error below ceil(t - 1/2)."""
    r = reference_codes(name, in_q, out_q).astype(np.float64)
    a = np.arange(r.size)
    shift = in_q.bits - (entries - 1).bit_length() + 1
    i, w = a >> shift, (a % (1 << shift)) / (1 << shift)
    weights = sp.csr_matrix((np.r_[1 - w, w], (np.r_[a, a], np.r_[i, np.minimum(i + 1, entries - 1)])),
                            shape=(r.size, entries))
    up, down = r + level < out_q.qmax, r - level > out_q.qmin
    t_col = sp.csr_matrix(-np.ones((r.size, 1)))
    a_ub = sp.vstack([sp.hstack([weights[up], t_col[up]]), sp.hstack([-weights[down], t_col[down]])])
    res = linprog(np.r_[np.zeros(entries), 1.0], A_ub=a_ub, b_ub=np.r_[r[up], -r[down]], bounds=(None, None),
                  method="highs")
    assert res.status == 0
    return max(0, math.ceil(res.x[-1] - 0.5 - 1e-6))


# exp over [-5, 0] with 129 entries: least squares alone reaches 7 LSB, one more than the optimum.
# exp over [-8, 0] with 257 entries: 4 LSB is the optimum, 2 LSB is out of reach of any 257-node table.
@pytest.mark.parametrize("lo,hi,entries,best", [(-5, 0, 129, 6), (-8, 0, 257, 4), (-4, 0.5, 257, 2)])
def test_interpolated_exp_reaches_the_least_max_error_of_its_layout(lo, hi, entries, best):
    in_q = compute_qparams(lo, hi, 16, symmetric=False)
    out_q = compute_qparams(0, math.exp(hi), 16)
    rep = build_table("exp", in_q, out_q, entries=entries).report()
    assert rep.max_error_lsb == best
    assert lp_floor("exp", in_q, out_q, entries, level=best - 1) == best == rep.error_floor_lsb
    assert f"max error {best} LSB (floor {best})" in str(rep)
    assert rep.mean_error_lsb < 1.0  # the LP's minimax nodes alone: 4.7 LSB mean over [-5, 0]


def test_sixteen_bit_default_is_257_entries_and_half_keeps_the_spacing():
    in_q, out_q = WIDE_CASES[1][1], WIDE_CASES[1][2]
    full = build_table("tanh", in_q, out_q)
    half = build_table("tanh", in_q, out_q, symmetry="odd")
    assert full.report().entries == 257 and full.table.dtype == np.int32 and full.report().bytes == 257 * 4
    assert half.report().entries == 129
    assert abs(full.report().max_error_lsb - half.report().max_error_lsb) <= 1


def test_interpolation_formula_by_hand():
    # nodes 0 and 10 (8 fractional bits), 4 codes per segment: y(f) = (0*4 + 2560*f + 2^9) >> 10
    table = np.array([0, 10 << 8], dtype=np.int32)
    got = interpolate(table, np.arange(5, dtype=np.int64), shift=2, frac_bits=8)
    np.testing.assert_array_equal(got, [0, 3, 5, 8, 10])  # 2.5 -> 3 and 7.5 -> 8: round half up


def test_interpolated_table_on_an_8bit_input():
    in_q, out_q = QParams(6 / 127.5, 0, 8, True), QParams(1 / 255.0, 0, 8, False)
    table = build_table("sigmoid", in_q, out_q, entries=65)
    err = np.abs(table.lookup(np.arange(-128, 128)).astype(np.int64) - reference_codes("sigmoid", in_q, out_q))
    assert table.report().entries == 65 and err.max() <= 1 and err.max() == table.report().max_error_lsb


def test_lookup_is_integer_only_and_checks_its_input():
    in_q, out_q = QParams(0.05, 0, 8, True), QParams(1 / 255.0, 0, 8, False)
    table = build_table("sigmoid", in_q, out_q)
    with pytest.raises(TypeError):
        table.lookup(np.array([0.5]))
    with pytest.raises(ValueError, match="outside"):
        table.lookup(np.array([200], dtype=np.int16))
    x = np.array([[-128, 0], [5, 127]], dtype=np.int8)
    assert table.lookup(x).shape == (2, 2) and table.lookup(x).dtype == np.uint8
    assert table.lookup(np.array(3, dtype=np.int32)).shape == ()


def test_bad_arguments_are_named():
    q8 = QParams(0.05, 0, 8, True)
    with pytest.raises(ValueError, match="2\\^k \\+ 1"):
        build_table("tanh", q8, q8, entries=100)
    with pytest.raises(ValueError, match="2\\^k \\+ 1"):
        build_table("tanh", q8, q8, entries=257)  # k = 8 is not below the 8 input bits
    with pytest.raises(ValueError, match="per-tensor"):
        build_table("tanh", QParams([0.1, 0.2], [0, 0], 8, True, axis=0), q8)
    with pytest.raises(ValueError, match="symmetry"):
        build_table("tanh", q8, q8, symmetry="mirror")
    with pytest.raises(ValueError, match="NaN"):
        build_table("sqrt", q8, QParams(0.01, 0, 8, False))
    with pytest.raises(ValueError, match="unknown LUT function"):
        build_table("gelu_fast", q8, q8)


def test_plain_callable_is_accepted():
    in_q, out_q = QParams(0.05, 0, 8, True), QParams(0.05, 0, 8, True)
    table = build_table(lambda x: np.clip(x, -1, 1), in_q, out_q)
    x = np.arange(-128, 128)
    np.testing.assert_array_equal(table.lookup(x), np.clip(x, -20, 20))


def test_ties_round_half_even_before_the_zero_point():
    # ONNX: round_half_even(y / s) + zp. y = x/2 at x = 1, 3, 5 gives 0.5, 1.5, 2.5 -> 0, 2, 2; plus zp 1.
    # (Rounding y/s + zp = 1.5, 2.5, 3.5 instead would give 2, 2, 4.)
    table = build_table(lambda x: x / 2, QParams(1.0, 0, 8, True), QParams(1.0, 1, 8, True))
    assert table.lookup(np.array([1, 3, 5])).tolist() == [1, 3, 3]
