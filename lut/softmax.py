"""Integer softmax (whitepaper 4.66), ONNX Softmax semantics along one axis.

Offline, from the input scale s_x and the row length n (known at prepare from the static shapes):

    exp_table[d] = round(2^E * exp(-d * s_x)),  d = 0 .. qmax - qmin     (exp_table[0] = 2^E)
    E = 20                        for n <= 4096 (the whitepaper's table)
    E = ceil(log2 n) + 8          for longer rows (n <= 2^24): the table's "one" grows with the row

stored up to its first zero entry (larger d read that zero). At run time, per row of n elements, in integers:

    d_i = max_j(x_j) - x_i                         (codes; the zero point cancels)
    e_i = exp_table[min(d_i, len - 1)]
    S   = sum_i e_i                                 (2^E <= S <= n * 2^E)
    y_i = floor(e_i * Q / S) + (2 * (e_i * Q mod S) >= S)      Q = 2^B - 1 (round half up by the remainder)

The output is unsigned B-bit with scale 1/Q and zero point 0, so y_i = Q * e_i / S needs no requant
(M = Q, N = 0 in the whitepaper's Step 3/5).

LSB bound against round(Q * softmax(x)) on the dequantized codes, proven: with t_i = 2^E * exp(-d_i * s_x),
every |e_i - t_i| <= 1/2 (entries past the table's cut are below 1/2 too), so |S - T| <= n/2 and S >= 2^E;
then Q * |e_i / S - t_i / T| <= Q * (1 + n * p_i) / 2^(E+1) <= Q * (n + 1) / 2^(E+1), plus 1/2 for the final
rounding. E makes n <= 2^(E-8) for every row length, so the table error stays <= Q * 2^-9 (+ Q * 2^-(E+1)):
0.5 LSB for 8-bit outputs, whatever the row length (1 LSB in all). Why the table grows rather than only the
sum: with the 2^20 table, a row of 65,536 terms whose other entries each round 0.49 down to 0 loses 3% of
its mass, 8 LSB on the peak.

Accumulator widths: S <= n * 2^E fits int32 for E = 20 and n <= 2047 (2047 * 2^20 < 2^31 - 1; the
whitepaper's "4096 terms" holds for an unsigned 32-bit sum of entries below 2^20). Longer rows use an int64
sum: S <= n * 2^E <= 2^(2 * 24 + 8) = 2^56 and e_i * Q <= 2^(E + 16) = 2^48, so int64 never overflows for
rows up to MAX_ROW = 2^24 terms; a longer row is refused when the kernel is built (the op then runs in
float, reported at prepare). A kernel built without a known row length (dynamic shapes) carries both tables:
the whitepaper's for rows up to 4096, the MAX_ROW one for longer rows. `forward` checks the int32 bound
whenever it claims int32.

Row sums: each y_i - Q * e_i / S lies in (-1/2, 1/2] and sum_i Q * e_i / S = Q exactly, so
-n/2 < sum_i y_i - Q <= P/2, P = number of nonzero outputs in the row. The float reference
round(Q * softmax(x)) has the same kind of deviation (a row of 4096 equal logits sums to 0 in both).
LogSoftmax: see lut.log_softmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ptq.core.qparams import QParams
from ptq.core.requant import INT32_MAX

EXP_ONE_BITS = 20  # the whitepaper's table: 2^20 for exp(0)
ROW_GUARD_BITS = 8  # 2^E >= n * 2^8: a table of E bits serves rows up to 2^(E-8) terms
WHITEPAPER_ROW = 1 << (EXP_ONE_BITS - ROW_GUARD_BITS)  # 4096, the whitepaper's limit for the 2^20 table
MAX_ROW = 1 << 24  # int64 sums and numerators stay below 2^63 (module docstring)
INT32_ROW_LIMIT = INT32_MAX >> EXP_ONE_BITS  # 2047 terms of at most 2^20


def ceil_log2(n: int) -> int:
    return max(int(n) - 1, 0).bit_length()


def exp_one_bits(row_length: int) -> int:
    """E, the table's exp(0) = 2^E, for rows of `row_length` terms (module docstring)."""
    if row_length > MAX_ROW:
        raise ValueError(f"softmax rows are limited to {MAX_ROW} terms (int64 row sums), got {row_length}")
    return max(EXP_ONE_BITS, ceil_log2(row_length) + ROW_GUARD_BITS)


@dataclass(frozen=True, eq=False)
class ExpTable:
    """round(2^one_bits * exp(-d * s_x)) for d = 0.., cut after its first zero; for rows up to `max_row`."""

    one_bits: int
    max_row: int
    values: np.ndarray  # int32 for the 2^20 table, int64 for wider ones


@dataclass(frozen=True, eq=False)
class SoftmaxKernel:
    """Integer softmax along `axis`: int codes with `in_qparams` -> uint codes with `out_qparams`."""

    in_qparams: QParams
    out_qparams: QParams
    tables: tuple  # ExpTable by increasing max_row
    axis: int = -1

    @property
    def exp_table(self) -> np.ndarray:
        """The table of the shortest rows (the only one when the row length was known)."""
        return self.tables[0].values

    def table_for(self, row_length: int) -> ExpTable:
        for table in self.tables:
            if row_length <= table.max_row:
                return table
        raise ValueError(f"softmax rows of this kernel are limited to {self.tables[-1].max_row} terms, got {row_length}")

    def int32_accumulator(self, row_length: int) -> bool:
        """Whether a row of this length is summed in int32 (else int64)."""
        return self.table_for(row_length).one_bits == EXP_ONE_BITS and row_length <= INT32_ROW_LIMIT

    def forward(self, q) -> np.ndarray:
        _, e, total, _ = exp_terms(self, q)
        return divide_rounded(e, total, self.out_qparams)


def divide_rounded(e: np.ndarray, total: np.ndarray, out_qparams: QParams) -> np.ndarray:
    """floor(e * Q / S) + (2 * (e * Q mod S) >= S), Q = the output's qmax, in int64."""
    num = e * out_qparams.qmax
    quotient = num // total
    return (quotient + (2 * (num - quotient * total) >= total)).astype(out_qparams.dtype)


def row_terms(kernel: SoftmaxKernel, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(d, e, S, E) for int64 `logits` along `kernel.axis`: gaps to the row max, table entries, row sums
    (keepdims) and the table's exp(0) bits, with the int32 bound checked where the sum claims int32."""
    n = logits.shape[kernel.axis]
    table = kernel.table_for(n)
    d = logits.max(axis=kernel.axis, keepdims=True) - logits
    e = table.values[np.minimum(d, table.values.size - 1)].astype(np.int64)
    total = e.sum(axis=kernel.axis, keepdims=True)
    if kernel.int32_accumulator(n) and int(total.max(initial=0)) > INT32_MAX:
        raise ValueError("softmax row sum overflowed int32")
    return d, e, total, table.one_bits


def exp_terms(kernel: SoftmaxKernel, q) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """`row_terms` of the codes `q`, after checking them; `kernel` has `in_qparams`, `tables` and `axis`."""
    q = np.asarray(q)
    if not np.issubdtype(q.dtype, np.integer):
        raise TypeError(f"softmax forward takes integer codes, got dtype {q.dtype}")
    if q.ndim == 0:
        raise ValueError("softmax forward needs at least one axis")
    iq = kernel.in_qparams
    x = q.astype(np.int64)
    if x.size and (x.min() < iq.qmin or x.max() > iq.qmax):
        raise ValueError(f"softmax forward: codes outside the input range [{iq.qmin}, {iq.qmax}]")
    return row_terms(kernel, x)


def softmax_out_qparams(out_bits: int = 8) -> QParams:
    """Unsigned `out_bits` output with scale 1/(2^B - 1) and zero point 0."""
    return QParams(scale=1.0 / ((1 << out_bits) - 1), zero_point=0, bits=out_bits, signed=False)


def zero_entry_gap(in_scale: float, one_bits: int = EXP_ONE_BITS) -> int:
    """The smallest gap d whose table entry round(2^E * exp(-d * in_scale)) is 0 (exp < 2^-(E+1))."""
    return int(np.ceil((one_bits + 1) * np.log(2.0) / float(in_scale)))


def exp_table(in_scale: float, codes: int, one_bits: int = EXP_ONE_BITS) -> np.ndarray:
    """round(2^E * exp(-d * in_scale)) for d = 0..codes-1, cut after the first zero entry (int32 for E <= 30)."""
    d = np.arange(codes, dtype=np.float64)
    dtype = np.int32 if one_bits <= 30 else np.int64
    table = np.rint(np.exp(-d * float(in_scale)) * float(1 << one_bits)).astype(dtype)
    zeros = np.flatnonzero(table == 0)
    return table[: zeros[0] + 1] if zeros.size else table


def exp_tables(in_scale: float, codes: int, row_length: Optional[int]) -> tuple:
    """The ExpTables for rows of `row_length` (one table), or for any row up to MAX_ROW when it is unknown
    (the whitepaper's 2^20 table up to 4096 terms, a 2^32 one beyond). `codes`: the gaps to cover, or None
    for gaps up to each table's first zero entry."""
    lengths = (WHITEPAPER_ROW, MAX_ROW) if row_length is None else (max(int(row_length), 1),)
    tables = []
    for max_row in lengths:
        bits = exp_one_bits(max_row)
        gaps = zero_entry_gap(in_scale, bits) + 1 if codes is None else codes
        tables.append(ExpTable(bits, 1 << (bits - ROW_GUARD_BITS), exp_table(in_scale, gaps, bits)))
    return tuple(tables)


def build_softmax(in_qparams: QParams, out_bits: int = 8, axis: int = -1, row_length: Optional[int] = None,
                  cover_gaps: bool = False) -> SoftmaxKernel:
    """The integer softmax kernel for a per-tensor quantized input (any zero point, signed or not), for rows
    of `row_length` terms (None: any length up to MAX_ROW). The exp table covers the gaps the input's codes
    can make, or (`cover_gaps`, AddSoftmax: logits with a bias added spread beyond the input's range) every
    gap up to its first zero entry. A row longer than MAX_ROW is a ValueError here, not at run time."""
    if not isinstance(in_qparams, QParams) or in_qparams.per_channel:
        raise ValueError("build_softmax: in_qparams must be a per-tensor QParams")
    if not 2 <= out_bits <= 16:
        raise ValueError(f"build_softmax: out_bits must be in [2, 16], got {out_bits}")
    codes = None if cover_gaps else in_qparams.qmax - in_qparams.qmin + 1
    tables = exp_tables(float(in_qparams.scale[0]), codes, row_length)
    return SoftmaxKernel(in_qparams, softmax_out_qparams(out_bits), tables, int(axis))
