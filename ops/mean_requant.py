"""The integer mean shared by the averaging ops (AveragePool, GlobalAveragePool, ReduceMean).

`MeanRequant`: the integer mean y_q = clamp(((sum * M_c + 2^(N_c-1)) >> N_c) + zp_y, qmin, qmax) with
  M_c / 2^N_c ~= s_x / (s_y * c) for a window of c elements: the sum and the 1/c division share one requant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from ops.base import activation_qparams, multiplier, proposed_or
from ops.registry import QuantizeContext, QuantizedNode
from ptq.core.qparams import QParams
from ptq.core.requant import requantize, saturate_int32


@dataclass
class MeanRequant:
    """Mean of integer windows with the 1/count folded into the output requant (whitepaper 4.4, 4.53):

        acc   = saturate_int32(sum over the window of (x_q - zp_x))
        y_q   = clamp(((acc * M_c + 2^(N_c-1)) >> N_c) + zp_y, qmin, qmax),   M_c / 2^N_c ~= s_x / (s_y * c)

    The (M, N) pair of a count is derived once (counts depend on the input shape, known at run time) and
    cached. LSB bound vs the float mean: 0.5 + |mean_f| / s_y * 2^-mbits (rounding plus the multiplier's
    relative error, quantize_multiplier's bound).
    """

    x_qp: QParams
    y_qp: QParams
    mbits: int
    _pairs: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)

    def pair(self, count: int) -> tuple[int, int]:
        if count not in self._pairs:
            if count <= 0:
                raise ValueError(f"mean over an empty window (count {count})")
            r = float(self.x_qp.scale[0]) / (float(self.y_qp.scale[0]) * count)
            m, n = multiplier(r, self.mbits, f"mean requant s_x / (s_y * {count})")
            self._pairs[count] = (int(m[0]), int(n[0]))
        return self._pairs[count]

    def apply(self, acc: np.ndarray, counts, runtime_record) -> np.ndarray:
        """Requantize window sums `acc` (int64) whose element counts are `counts` (an int or an int array
        broadcastable to `acc`); `runtime_record(count)` receives the number of saturated sums."""
        acc, overflow = saturate_int32(acc)
        runtime_record(overflow)
        counts = np.asarray(counts, dtype=np.int64)
        if counts.ndim == 0:
            m, n = self.pair(int(counts))
        else:
            uniq, inverse = np.unique(counts, return_inverse=True)
            pairs = np.array([self.pair(int(c)) for c in uniq], dtype=np.int64).reshape(-1, 2)
            m = pairs[:, 0][inverse].reshape(counts.shape)
            n = pairs[:, 1][inverse].reshape(counts.shape)
        y = self.y_qp
        return requantize(acc, m, n, y.zero_point[0], y.qmin, y.qmax, dtype=y.dtype)


@dataclass
class QuantizedMean(QuantizedNode):
    mean: MeanRequant


def quantize_mean(ctx: QuantizeContext) -> QuantizedMean:
    """The averaging ops' rule: per-tensor input, output = the table's proposal (else the input's)."""
    x_qp = activation_qparams(ctx)
    y_qp = proposed_or(ctx, x_qp)
    return QuantizedMean(ctx.node, list(ctx.in_qparams), [y_qp], MeanRequant(x_qp, y_qp, ctx.options.mbits))
