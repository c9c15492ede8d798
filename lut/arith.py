"""Division and power through tables (whitepaper 4.23 Div, 4.51 Pow with a variable exponent).

Div, y = a / b: a reciprocal table r_q = R(b_q) quantizes 1/b_f to a 16-bit symmetric narrow-range code
(scale s_r = (1/s_b) / 32767, so |b_q - zp_b| = 1 maps to 32767), odd, hence a half table when zp_b = 0. Then

    y_q = clamp(((a_q - zp_a) * r_q * M + 2^(N-1)) >> N) + zp_y),   M / 2^N ~= s_a * s_r / s_y

b_f = 0 (b_q = zp_b) gives y = qmax for a_f > 0, qmin for a_f < 0 and zp_y for a_f = 0, whatever the
table holds there (a_f / 0 is +-inf in float; the saturated reciprocal times a small |a_c| would not saturate).
LSB bound vs the float a_f / b_f (clamped to y's range), 8-bit a and b, 8-bit y: 0.5 (final rounding) +
|y_c| * (0.5 * |b_c| / 32767 (reciprocal code rounding) + 2^-(mbits-1) (multiplier)) <= 1.0 LSB.

Pow, z = x^y with a variable exponent:  z = sign(x)^y * exp(y * log|x|)

    L_q = LOG(x_q)                                  table of log|x_f|, 16-bit (whitepaper: widen L)
    v_q = clamp(((y_q - zp_y) * (L_q - zp_L) * M + 2^(N-1)) >> N) + zp_v),   M / 2^N ~= s_y * s_L / s_v
    m_q = EXP(v_q)                                  |z| in z's scale with zero point 0 (interpolated table)
    z_q = clamp(zp_z + sign * m_q)

v covers [log(s_z / 4), log(max|z_f|)]: below, |z| rounds to 0; above, z saturates. sign = -1 when x_f < 0
and the exponent is odd; that parity is only known in integers when y is integer-valued (s_y = 1), so a
negative base with any other exponent scale gives z_f = 0 (the whitepaper's rule; float gives NaN).
A zero base follows ONNX: 0^y = 0 for y > 0, 1 for y = 0, saturated +max for y < 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lut.functions import FUNCTIONS
from lut.table import MAX_FULL_TABLE_BITS, LookupTable, build_table
from ptq.core.qparams import QParams, compute_qparams
from ptq.core.requant import DEFAULT_MBITS, quantize_multiplier, requantize

RECIPROCAL_BITS = 16
LOG_BITS = 16
V_BITS = 16
DEFAULT_EXP_ENTRIES = 513


def _per_tensor(qp: QParams, what: str) -> None:
    if not isinstance(qp, QParams) or qp.per_channel:
        raise ValueError(f"{what} must be a per-tensor QParams")


def _table_input(qp: QParams, what: str) -> None:
    if qp.bits > MAX_FULL_TABLE_BITS:
        raise ValueError(f"{what} has {qp.bits} bits: its table needs a full table of at most "
                         f"{MAX_FULL_TABLE_BITS}-bit codes (interpolating 1/x or log|x| near 0 is not accurate)")


def _int_codes(q, what: str) -> np.ndarray:
    q = np.asarray(q)
    if not np.issubdtype(q.dtype, np.integer):
        raise TypeError(f"{what} must hold integer codes, got dtype {q.dtype}")
    return q.astype(np.int64)


@dataclass(frozen=True, eq=False)
class Divider:
    """y = a / b with a reciprocal table on b; build it with `build_divider`."""

    a_qparams: QParams
    b_qparams: QParams
    out_qparams: QParams
    reciprocal: LookupTable
    multiplier: int
    shift: int

    def forward(self, a_q, b_q) -> np.ndarray:
        a = _int_codes(a_q, "a")
        b = _int_codes(b_q, "b")
        r = self.reciprocal.lookup(b).astype(np.int64)
        oq = self.out_qparams
        a_c = a - int(self.a_qparams.zero_point[0])
        y = requantize(a_c * r, self.multiplier, self.shift, oq.zero_point[0], oq.qmin, oq.qmax, dtype=oq.dtype)
        # b_f = 0: a_f / 0 is +-inf in float; the saturated reciprocal times a small a_c would land near zero
        zero_divisor = b == int(self.b_qparams.zero_point[0])
        if np.any(zero_divisor):
            saturated = np.where(a_c > 0, oq.qmax, np.where(a_c < 0, oq.qmin, int(oq.zero_point[0])))
            y = np.where(zero_divisor, saturated, y).astype(oq.dtype)
        return y


def reciprocal_table(b_qparams: QParams, recip_q: QParams) -> LookupTable:
    """R(b_q) = round_half_away(R_MAX / b_c), b_c = b_q - zp_b, R_MAX = 2^(RECIPROCAL_BITS-1) - 1, computed in
    integers (1 / b_f in units of s_r = 1 / (s_b * R_MAX) is exactly R_MAX / b_c; a float build would round its
    ties, e.g. 32767 / 14 = 2340.5, either way). R(zp_b) = R_MAX. Odd in b_c: a half table when zp_b = 0."""
    r_max = (1 << (recip_q.bits - 1)) - 1
    zp = int(b_qparams.zero_point[0])
    half = zp == 0 and b_qparams.signed
    b_c = np.arange(0, -b_qparams.qmin + 1, dtype=np.int64) if half else \
        np.arange(b_qparams.qmin, b_qparams.qmax + 1, dtype=np.int64) - zp
    magnitude, rem = np.divmod(r_max, np.maximum(np.abs(b_c), 1))
    magnitude = magnitude + (2 * rem >= np.abs(b_c))
    values = np.where(b_c == 0, r_max, np.sign(b_c) * magnitude)
    return LookupTable(b_qparams, recip_q, values.astype(recip_q.dtype), half=half, mirror="odd" if half else None)


def build_divider(a_qparams: QParams, b_qparams: QParams, out_qparams: QParams, *,
                  mbits: int = DEFAULT_MBITS) -> Divider:
    """Div with a reciprocal table: b of at most 10 bits (a full or half table)."""
    for qp, what in ((a_qparams, "a_qparams"), (b_qparams, "b_qparams"), (out_qparams, "out_qparams")):
        _per_tensor(qp, what)
    _table_input(b_qparams, "b_qparams")
    recip_q = QParams(scale=1.0 / (float(b_qparams.scale[0]) * ((1 << (RECIPROCAL_BITS - 1)) - 1)),
                      zero_point=0, bits=RECIPROCAL_BITS, signed=True, narrow=True)
    table = reciprocal_table(b_qparams, recip_q)
    factor = float(a_qparams.scale[0]) * float(recip_q.scale[0]) / float(out_qparams.scale[0])
    m, n = quantize_multiplier(factor, mbits)
    return Divider(a_qparams, b_qparams, out_qparams, table, int(m[0]), int(n[0]))


@dataclass(frozen=True, eq=False)
class PowKernel:
    """z = x^y for a variable exponent y; build it with `build_pow`."""

    x_qparams: QParams
    y_qparams: QParams
    out_qparams: QParams
    log_table: LookupTable  # x_q -> L_q, L = log|x|
    exp_table: LookupTable  # v_q -> |z| code (scale s_z, zero point 0)
    multiplier: int  # M / 2^N ~= s_y * s_L / s_v
    shift: int
    one_code: int  # z_q of 1.0 (0^0)

    @property
    def integer_exponent(self) -> bool:
        return float(self.y_qparams.scale[0]) == 1.0

    def forward(self, x_q, y_q) -> np.ndarray:
        x = _int_codes(x_q, "x")
        y = _int_codes(y_q, "y") - int(self.y_qparams.zero_point[0])
        x, y = np.broadcast_arrays(x, y)
        lq = self.log_table.out_qparams
        vq = self.exp_table.in_qparams
        log_x = self.log_table.lookup(x).astype(np.int64) - int(lq.zero_point[0])
        v = requantize(y * log_x, self.multiplier, self.shift, vq.zero_point[0], vq.qmin, vq.qmax)
        magnitude = self.exp_table.lookup(v).astype(np.int64)
        x_centered = x - int(self.x_qparams.zero_point[0])
        negative = x_centered < 0
        if self.integer_exponent:
            sign = np.where(negative & ((y & 1) == 1), -1, 1)
        else:
            sign = np.where(negative, 0, 1)
        oq = self.out_qparams
        zp = int(oq.zero_point[0])
        z = zp + sign * magnitude
        zero_base = np.where(y > 0, zp, np.where(y == 0, self.one_code, oq.qmax))
        z = np.where(x_centered == 0, zero_base, z)
        return np.clip(z, oq.qmin, oq.qmax).astype(oq.dtype)


def build_pow(x_qparams: QParams, y_qparams: QParams, out_qparams: QParams, *,
              exp_entries: int = DEFAULT_EXP_ENTRIES, mbits: int = DEFAULT_MBITS) -> PowKernel:
    """Pow with a variable exponent: a log|x| table (x of at most 10 bits), an integer product requantized
    to a 16-bit v, and an interpolated exp table of `exp_entries` nodes."""
    for qp, what in ((x_qparams, "x_qparams"), (y_qparams, "y_qparams"), (out_qparams, "out_qparams")):
        _per_tensor(qp, what)
    _table_input(x_qparams, "x_qparams")
    sx = float(x_qparams.scale[0])
    x_lo, x_hi = (float(v[0]) for v in x_qparams.real_range())
    log_lo, log_hi = np.log(sx), np.log(max(abs(x_lo), abs(x_hi)))
    log_q = compute_qparams(log_lo, log_hi, LOG_BITS, symmetric=False, signed=True)
    f = FUNCTIONS["log_abs"]
    log_table = build_table(f, x_qparams, log_q, symmetry=f.symmetry, center=f.center)

    sz = float(out_qparams.scale[0])
    z_lo, z_hi = (float(v[0]) for v in out_qparams.real_range())
    v_lo, v_hi = np.log(sz / 4), np.log(max(abs(z_lo), abs(z_hi)))
    v_q = compute_qparams(v_lo, v_hi, V_BITS, symmetric=False, signed=True)
    magnitude_q = QParams(scale=sz, zero_point=0, bits=min(16, out_qparams.bits + 1), signed=False)
    exp_table = build_table("exp", v_q, magnitude_q, entries=exp_entries)

    factor = float(y_qparams.scale[0]) * float(log_q.scale[0]) / float(v_q.scale[0])
    m, n = quantize_multiplier(factor, mbits)
    one_code = int(out_qparams.quantize(np.array([1.0]))[0])
    return PowKernel(x_qparams, y_qparams, out_qparams, log_table, exp_table, int(m[0]), int(n[0]), one_code)
