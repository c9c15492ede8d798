"""Integer softmax (whitepaper 4.66), ONNX Softmax semantics along one axis.

Offline, from the input scale s_x only (softmax(x) = softmax(x - max), and x - max <= 0):

    exp_table[d] = round(2^20 * exp(-d * s_x)),  d = 0 .. qmax - qmin     (exp_table[0] = 2^20)

stored up to its first zero entry (larger d read that zero). At run time, per row of n elements, in integers:

    d_i = max_j(x_j) - x_i                         (codes; the zero point cancels)
    e_i = exp_table[min(d_i, len - 1)]
    S   = sum_i e_i                                 (2^20 <= S <= n * 2^20)
    y_i = floor(e_i * Q / S) + (2 * (e_i * Q mod S) >= S)      Q = 2^B - 1 (round half up by the remainder)

The output is unsigned B-bit with scale 1/Q and zero point 0, so y_i = Q * e_i / S needs no requant
(M = Q, N = 0 in the whitepaper's Step 3/5).

Accumulator widths: S <= n * 2^20 fits int32 for n <= 2047 (2047 * 2^20 < 2^31 - 1; the whitepaper's
"4096 terms" holds for an unsigned 32-bit sum of entries below 2^20). Rows of 2048 to 4096 terms use an
int64 sum; rows longer than 4096 are rejected (the whitepaper's restriction). The numerator e_i * Q fits
int32 for B <= 11 and uses int64 above. `forward` checks the int32 bound whenever it claims int32.

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

EXP_ONE_BITS = 20
MAX_ROW = 4096
INT32_ROW_LIMIT = INT32_MAX >> EXP_ONE_BITS  # 2047 terms of at most 2^20


@dataclass(frozen=True, eq=False)
class SoftmaxKernel:
    """Integer softmax along `axis`: int codes with `in_qparams` -> uint codes with `out_qparams`."""

    in_qparams: QParams
    out_qparams: QParams
    exp_table: np.ndarray  # int32
    axis: int = -1

    def int32_accumulator(self, row_length: int) -> bool:
        """Whether a row of this length is summed in int32 (else int64)."""
        return row_length <= INT32_ROW_LIMIT

    def forward(self, q) -> np.ndarray:
        _, e, total = exp_terms(self, q)
        qmax = self.out_qparams.qmax
        num = e * qmax
        quotient = num // total
        y = quotient + (2 * (num - quotient * total) >= total)
        return y.astype(self.out_qparams.dtype)


def exp_terms(kernel, q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d, e, S) for the rows of `q` along `kernel.axis` (int64, S with keepdims), after checking the input;
    `kernel` has `in_qparams`, `exp_table` and `axis`."""
    q = np.asarray(q)
    if not np.issubdtype(q.dtype, np.integer):
        raise TypeError(f"softmax forward takes integer codes, got dtype {q.dtype}")
    if q.ndim == 0:
        raise ValueError("softmax forward needs at least one axis")
    iq = kernel.in_qparams
    x = q.astype(np.int64)
    if x.size and (x.min() < iq.qmin or x.max() > iq.qmax):
        raise ValueError(f"softmax forward: codes outside the input range [{iq.qmin}, {iq.qmax}]")
    n = x.shape[kernel.axis]
    if n > MAX_ROW:
        raise ValueError(f"softmax rows are limited to {MAX_ROW} terms (whitepaper 4.66), got {n}")
    d = x.max(axis=kernel.axis, keepdims=True) - x
    e = kernel.exp_table[np.minimum(d, kernel.exp_table.size - 1)].astype(np.int64)
    total = e.sum(axis=kernel.axis, keepdims=True)
    if n <= INT32_ROW_LIMIT:
        assert int(total.max(initial=0)) <= INT32_MAX, "softmax row sum overflowed int32"
    return d, e, total


def softmax_out_qparams(out_bits: int = 8) -> QParams:
    """Unsigned `out_bits` output with scale 1/(2^B - 1) and zero point 0."""
    return QParams(scale=1.0 / ((1 << out_bits) - 1), zero_point=0, bits=out_bits, signed=False)


def zero_entry_gap(in_scale: float) -> int:
    """The smallest gap d whose table entry round(2^20 * exp(-d * in_scale)) is 0 (exp < 2^-21)."""
    return int(np.ceil((EXP_ONE_BITS + 1) * np.log(2.0) / float(in_scale)))


def exp_table(in_scale: float, codes: int) -> np.ndarray:
    """round(2^20 * exp(-d * in_scale)) for d = 0..codes-1, cut after the first zero entry (int32)."""
    d = np.arange(codes, dtype=np.float64)
    table = np.rint(np.exp(-d * float(in_scale)) * (1 << EXP_ONE_BITS)).astype(np.int32)
    zeros = np.flatnonzero(table == 0)
    return table[: zeros[0] + 1] if zeros.size else table


def build_softmax(in_qparams: QParams, out_bits: int = 8, axis: int = -1,
                  exp_codes: Optional[int] = None) -> SoftmaxKernel:
    """The integer softmax kernel for a per-tensor quantized input (any zero point, signed or not). The exp
    table covers the gaps the input's codes can make, or `exp_codes` gaps (AddSoftmax: logits with a bias
    added spread beyond the input's range)."""
    if not isinstance(in_qparams, QParams) or in_qparams.per_channel:
        raise ValueError("build_softmax: in_qparams must be a per-tensor QParams")
    if not 2 <= out_bits <= 16:
        raise ValueError(f"build_softmax: out_bits must be in [2, 16], got {out_bits}")
    codes = in_qparams.qmax - in_qparams.qmin + 1 if exp_codes is None else exp_codes
    table = exp_table(float(in_qparams.scale[0]), codes)
    return SoftmaxKernel(in_qparams, softmax_out_qparams(out_bits), table, int(axis))
