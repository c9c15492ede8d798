"""Integer log-softmax (ONNX LogSoftmax), sharing the softmax exp table and row sum (see lut.softmax: the
table's exp(0) is 2^E, E = 20 for rows up to 4096 terms, ceil(log2 n) + 8 for longer rows up to 2^24):

    log_softmax(x)_i = -d_i * s_x - ln(S / 2^E)

log2(S / 2^E) in Q16 from integers: k = floor(log2 S) by comparisons (2^E <= S <= n * 2^E), the 16 bits
below S's leading one through a 257-node interpolated log2(1 + f) table (error < 3e-6), then one combined
rounding of both terms:

    y_i = clamp(zp_y - ((d_i * A + L * B + 2^(P-1)) >> P)),   A ~= s_x / s_y * 2^P,  B ~= ln 2 / (2^16 s_y) * 2^P

LSB bound vs the float log-softmax of the dequantized input: 1 LSB -- the final rounding (1/2) plus the
table's share, which the row length does not grow: |ln S - ln T| <= (n/2) / (2^E - 1/2) < 2^-8.9 (in value)
since n <= 2^(E-8) (lut.softmax), the log2 table's 3e-6 and the rounding of A and B (P as large as
2^30 / max(A, B) allows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from lut.interp import interpolate
from lut.softmax import SoftmaxKernel, ceil_log2, exp_tables, exp_terms
from ptq.core.qparams import QParams
from ptq.core.requant import MAX_SHIFT, shift_round

LOG2_FRAC_BITS = 16  # Q16 log2 values
LOG2_INDEX_SHIFT = 8  # 16 mantissa bits -> 256 segments of 2^8


def _floor_log2(total: np.ndarray, one_bits: int, row_length: int) -> np.ndarray:
    """floor(log2 S) for int64 2^E <= S <= n * 2^E, by integer comparisons."""
    k = np.full(total.shape, one_bits, dtype=np.int64)
    for j in range(one_bits + 1, one_bits + ceil_log2(row_length) + 1):
        k += total >= (1 << j)
    return k


@dataclass(frozen=True, eq=False)
class LogSoftmaxKernel:
    """Integer log-softmax along `axis`: int codes with `in_qparams` -> codes with `out_qparams`."""

    in_qparams: QParams
    out_qparams: QParams
    tables: tuple  # lut.softmax.ExpTable, as SoftmaxKernel's
    log2_table: np.ndarray  # int32 Q16 nodes of log2(1 + i/256), i = 0..256
    d_factor: int  # A
    log_factor: int  # B
    shift: int  # P
    axis: int = -1

    exp_table = SoftmaxKernel.exp_table
    table_for = SoftmaxKernel.table_for
    int32_accumulator = SoftmaxKernel.int32_accumulator

    def forward(self, q) -> np.ndarray:
        d, _, total, one_bits = exp_terms(self, q)
        k = _floor_log2(total, one_bits, np.asarray(q).shape[self.axis])
        # the 16 bits below the leading one (k >= E >= 20 > 16, so a right shift: no int64 overflow)
        mantissa = (total >> (k - LOG2_FRAC_BITS)) - (1 << LOG2_FRAC_BITS)
        log2_sum = ((k - one_bits) << LOG2_FRAC_BITS) + interpolate(self.log2_table, mantissa, LOG2_INDEX_SHIFT, 0)
        acc = d * self.d_factor + log2_sum * self.log_factor
        oq = self.out_qparams
        y = int(oq.zero_point[0]) - shift_round(acc, 1, self.shift)
        return np.clip(y, oq.qmin, oq.qmax).astype(oq.dtype)


def build_log_softmax(in_qparams: QParams, out_qparams: QParams, axis: int = -1,
                      row_length: Optional[int] = None) -> LogSoftmaxKernel:
    """Integer log-softmax for rows of `row_length` terms (None: any up to MAX_ROW, as `build_softmax`);
    `out_qparams` (per-tensor, calibrated) covers values <= 0."""
    for qp, what in ((in_qparams, "in_qparams"), (out_qparams, "out_qparams")):
        if not isinstance(qp, QParams) or qp.per_channel:
            raise ValueError(f"build_log_softmax: {what} must be a per-tensor QParams")
    sy = float(out_qparams.scale[0])
    ratio_d = float(in_qparams.scale[0]) / sy
    ratio_log = np.log(2.0) / ((1 << LOG2_FRAC_BITS) * sy)
    shift = int(min(MAX_SHIFT, np.floor(np.log2((1 << 30) / max(ratio_d, ratio_log)))))
    if shift < 8:
        raise ValueError(f"build_log_softmax: output scale {sy:g} is too fine for the input scale")
    segments = 1 << (LOG2_FRAC_BITS - LOG2_INDEX_SHIFT)
    log2_table = np.rint(np.log2(1 + np.arange(segments + 1) / segments) * (1 << LOG2_FRAC_BITS)).astype(np.int32)
    return LogSoftmaxKernel(
        in_qparams, out_qparams,
        exp_tables(float(in_qparams.scale[0]), in_qparams.qmax - in_qparams.qmin + 1, row_length),
        log2_table, int(round(ratio_d * 2.0**shift)), int(round(ratio_log * 2.0**shift)), shift, int(axis),
    )
