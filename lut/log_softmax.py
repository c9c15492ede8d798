"""Integer log-softmax (ONNX LogSoftmax), sharing the softmax exp table and row sum (see lut.softmax):

    log_softmax(x)_i = -d_i * s_x - ln(S / 2^20)

log2(S / 2^20) in Q16 from integers: k = floor(log2 S) by comparisons (2^20 <= S <= 2^32), the 16 bits
below S's leading one through a 257-node interpolated log2(1 + f) table (error < 3e-6), then one combined
rounding of both terms:

    y_i = clamp(zp_y - ((d_i * A + L * B + 2^(P-1)) >> P)),   A ~= s_x / s_y * 2^P,  B ~= ln 2 / (2^16 s_y) * 2^P
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lut.interp import interpolate
from lut.softmax import EXP_ONE_BITS, MAX_ROW, exp_table, exp_terms
from ptq.core.qparams import QParams
from ptq.core.requant import MAX_SHIFT, shift_round

LOG2_FRAC_BITS = 16  # Q16 log2 values
LOG2_INDEX_SHIFT = 8  # 16 mantissa bits -> 256 segments of 2^8
MAX_SUM_BITS = EXP_ONE_BITS + MAX_ROW.bit_length() - 1  # S <= 4096 * 2^20 = 2^32


def _floor_log2(total: np.ndarray) -> np.ndarray:
    """floor(log2 S) for int64 2^20 <= S <= 2^32, by integer comparisons."""
    k = np.full(total.shape, EXP_ONE_BITS, dtype=np.int64)
    for j in range(EXP_ONE_BITS + 1, MAX_SUM_BITS + 1):
        k += total >= (1 << j)
    return k


@dataclass(frozen=True, eq=False)
class LogSoftmaxKernel:
    """Integer log-softmax along `axis`: int codes with `in_qparams` -> codes with `out_qparams`."""

    in_qparams: QParams
    out_qparams: QParams
    exp_table: np.ndarray  # int32, as SoftmaxKernel's
    log2_table: np.ndarray  # int32 Q16 nodes of log2(1 + i/256), i = 0..256
    d_factor: int  # A
    log_factor: int  # B
    shift: int  # P
    axis: int = -1

    def forward(self, q) -> np.ndarray:
        d, _, total = exp_terms(self, q)
        k = _floor_log2(total)
        mantissa = ((total << LOG2_FRAC_BITS) >> k) - (1 << LOG2_FRAC_BITS)  # 16 bits below the leading one
        log2_sum = ((k - EXP_ONE_BITS) << LOG2_FRAC_BITS) + interpolate(self.log2_table, mantissa, LOG2_INDEX_SHIFT, 0)
        acc = d * self.d_factor + log2_sum * self.log_factor
        oq = self.out_qparams
        y = int(oq.zero_point[0]) - shift_round(acc, 1, self.shift)
        return np.clip(y, oq.qmin, oq.qmax).astype(oq.dtype)


def build_log_softmax(in_qparams: QParams, out_qparams: QParams, axis: int = -1) -> LogSoftmaxKernel:
    """Integer log-softmax; `out_qparams` (per-tensor, calibrated) covers values <= 0."""
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
        exp_table(float(in_qparams.scale[0]), in_qparams.qmax - in_qparams.qmin + 1),
        log2_table, int(round(ratio_d * 2.0**shift)), int(round(ratio_log * 2.0**shift)), shift, int(axis),
    )
