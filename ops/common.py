"""Helpers shared by the data-movement and averaging ops (layout, pad, pooling, reduce, resize, concat).

- `activation_qparams`: the per-tensor qparams of an op's activation input (whitepaper chapter 4 specifies
  every one of these ops per tensor).
- `int_list`: an integer list (axes, pads, splits, shape) from a constant input (newer opsets) or, when that
  input is absent, from an attribute (older opsets).
- `MeanRequant`: the integer mean y_q = clamp(((sum * M_c + 2^(N_c-1)) >> N_c) + zp_y, qmin, qmax) with
  M_c / 2^N_c ~= s_x / (s_y * c) for a window of c elements: the sum and the 1/c division share one requant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ops.linear import require_per_tensor, require_qparams
from ops.registry import QuantizationError, QuantizeContext, QuantizedNode
from ptq.core.graph import Node
from ptq.core.qparams import QParams
from ptq.core.requant import quantize_multiplier, requantize, saturate_int32


def activation_qparams(ctx: QuantizeContext, index: int = 0) -> QParams:
    """The per-tensor qparams of activation input `index`; QuantizationError when missing or per-channel."""
    qp = require_qparams(ctx.in_qparams[index] if index < len(ctx.in_qparams) else None, f"input {index}", ctx.node)
    require_per_tensor(qp, f"input {index}", ctx.node)
    return qp


def proposed_or(ctx: QuantizeContext, fallback: QParams, index: int = 0) -> QParams:
    """The quant table's proposal for output `index`, else `fallback`; must be per tensor."""
    qp = ctx.out_qparams[index] if index < len(ctx.out_qparams) and ctx.out_qparams[index] is not None else fallback
    require_per_tensor(qp, f"output {index}", ctx.node)
    return qp


def optional_input(inputs: Sequence, index: int):
    """inputs[index], or None when the node has fewer inputs or the optional input is omitted."""
    return inputs[index] if index < len(inputs) else None


def int_list(node: Node, inputs: Sequence, index: int, attr: str) -> Optional[list[int]]:
    """Integers from input `index` when present (opsets that moved the attribute to an input), else from
    attribute `attr`; None when neither is given."""
    value = optional_input(inputs, index)
    if value is not None:
        arr = np.asarray(value)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{node.op_type} {node.name!r}: input {index} ({attr}) must be integers, got {arr.dtype}")
        return [int(v) for v in arr.ravel()]
    value = node.attr(attr)
    return None if value is None else [int(v) for v in np.atleast_1d(value)]


def normalize_axes(axes: Sequence[int], rank: int, node: Node) -> list[int]:
    out = []
    for a in axes:
        if not -rank <= a < rank:
            raise ValueError(f"{node.op_type} {node.name!r}: axis {a} out of range for rank {rank}")
        out.append(a % rank)
    if len(set(out)) != len(out):
        raise ValueError(f"{node.op_type} {node.name!r}: repeated axis in {list(axes)}")
    return out


def centered(x: np.ndarray, qp: QParams, node: Node) -> np.ndarray:
    """x_q - zp_x as int64; TypeError when `x` is not integer codes."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"{node.op_type} {node.name!r}: expected integer codes, got {x.dtype}")
    return x.astype(np.int64) - int(qp.zero_point[0])


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
            try:
                m, n = quantize_multiplier(r, self.mbits)
            except ValueError as err:
                raise QuantizationError(f"mean requant s_x / (s_y * {count}): {err}") from err
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
