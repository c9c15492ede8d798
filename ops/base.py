"""The ground floor of the op modules: the checks and small readers every quantize rule and kernel shares.

Errors raised here (and by the op modules) name the input or attribute at fault but not the node: the
executor prefixes every op error with the node's op type and name, once (`ptq.engine.executor`).

- `require_qparams` / `require_per_tensor` / `activation_qparams` / `proposed_or`: the qparams a rule needs;
- `multiplier`: `quantize_multiplier` with the factor's meaning in the error;
- `optional_input`, `int_list`, `normalize_axes`: inputs that newer opsets moved from attributes;
- `centered`: x_q - zp_x as int64.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ops.registry import QuantizationError, QuantizeContext
from ptq.core.graph import Node
from ptq.core.qparams import QParams
from ptq.core.requant import quantize_multiplier


def require_qparams(qp: Optional[QParams], what: str) -> QParams:
    if not isinstance(qp, QParams):
        raise QuantizationError(f"{what} has no qparams")
    return qp


def require_per_tensor(qp: QParams, what: str) -> None:
    if qp.per_channel:
        raise QuantizationError(
            f"{what} must be quantized per tensor, got axis={qp.axis}")


def multiplier(r, mbits: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(M, N) with M / 2^N ~= r (`ptq.core.requant.quantize_multiplier`); QuantizationError naming `what`
    (e.g. "s_a * s_b / s_y") when r cannot be represented."""
    try:
        return quantize_multiplier(r, mbits)
    except ValueError as err:
        raise QuantizationError(f"{what}: {err}") from err


def activation_qparams(ctx: QuantizeContext, index: int = 0) -> QParams:
    """The per-tensor qparams of activation input `index`; QuantizationError when missing or per-channel."""
    qp = require_qparams(ctx.in_qparams[index] if index < len(ctx.in_qparams) else None, f"input {index}")
    require_per_tensor(qp, f"input {index}")
    return qp


def proposed_or(ctx: QuantizeContext, fallback: QParams, index: int = 0) -> QParams:
    """The quant table's proposal for output `index`, else `fallback`; must be per tensor."""
    qp = ctx.out_qparams[index] if index < len(ctx.out_qparams) and ctx.out_qparams[index] is not None else fallback
    require_per_tensor(qp, f"output {index}")
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
            raise ValueError(f"input {index} ({attr}) must be integers, got {arr.dtype}")
        return [int(v) for v in arr.ravel()]
    value = node.attr(attr)
    return None if value is None else [int(v) for v in np.atleast_1d(value)]


def normalize_axes(axes: Sequence[int], rank: int) -> list[int]:
    out = []
    for a in axes:
        if not -rank <= a < rank:
            raise ValueError(f"axis {a} out of range for rank {rank}")
        out.append(a % rank)
    if len(set(out)) != len(out):
        raise ValueError(f"repeated axis in {list(axes)}")
    return out


def centered(x: np.ndarray, qp: QParams) -> np.ndarray:
    """x_q - zp_x as int64 (per-tensor zero point)."""
    return np.asarray(x).astype(np.int64) - int(qp.zero_point[0])


def float_or_index(x) -> np.ndarray:
    """A float forward's data input: float32, except integer and bool tensors (indices and shapes moved by a
    layout op in a shape subgraph), which keep their dtype."""
    x = np.asarray(x)
    return x if x.dtype.kind in "iub" else x.astype(np.float32)
