"""Gather and GatherND (ONNX), whitepaper 4.33 and 4.34, and UpsampleByIndex (ai.ptq, 4.78), ONNX convention.

From y_f = Gather(x_f, idx), (y_q - zp_y) * s_y = Gather((x_q - zp_x) * s_x, idx); with s_y = s_x and
zp_y = zp_x

    y_q = Gather(x_q, idx)

so the codes are gathered and the output keeps the data's qparams. The indices are integers (int32/int64, raw,
never quantized: index-like tensors keep scale 1 and zero point 0, 4.13); negative indices count from the end,
an index outside the axis is an error.

A constant data tensor (an embedding table) is quantized once, per tensor: with its qparams from the quant
table when calibration gave it some, otherwise on its own range [min, max] (asymmetric, the bit width of the
output's proposal, else 8). Its codes are then gathered the same way.

LSB bound vs the float op: 0 for an activation (exact); 0.5 for a constant table (its quantization).

UpsampleByIndex (ai.ptq) scatters instead: it is ONNX MaxUnpool's semantics under the whitepaper's name
(x (N, C, spatial...), input 1 the int64 flat indices into the output that MaxPool's Indices output gives,
optional input 2 the output shape, else (in - 1) * stride + kernel - pads per spatial axis):

    y_q = zp_x everywhere (the code of 0.0), then y_q.flat[indices] = x_q

with the input's qparams (exact, LSB bound 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops.base import activation_qparams, float_or_index, int_list, require_per_tensor
from ops.conformance_case import X, Case, int64s
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams

TABLE_BITS = 8  # a constant table without a table entry or an output proposal


@dataclass
class QuantizedGather(QuantizedNode):
    table_codes: Optional[np.ndarray]  # the codes of a constant data tensor; None: data is an activation


def _indices(value, what: str = "input 1 (indices)") -> np.ndarray:
    if value is None:
        raise ValueError(f"{what} is required")
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got {value.dtype}")
    return value.astype(np.int64)


def _wrapped(idx: np.ndarray, dims, what: str) -> np.ndarray:
    """Negative indices counted from the end; ValueError when one falls outside [-d, d)."""
    dims = np.asarray(dims, dtype=np.int64)
    if np.any(idx < -dims) or np.any(idx >= dims):
        raise ValueError(f"{what} out of range for dimension(s) {dims.tolist()}")
    return np.where(idx < 0, idx + dims, idx)


def table_qparams(ctx: QuantizeContext, table: np.ndarray) -> QParams:
    """The per-tensor qparams of a constant data tensor: its quant-table entry, else its own range."""
    qp = ctx.in_qparams[0] if ctx.in_qparams else None
    if qp is None:
        proposal = ctx.out_qparams[0] if ctx.out_qparams else None
        bits = proposal.bits if proposal is not None else TABLE_BITS
        table = np.asarray(table, dtype=np.float64)
        qp = compute_qparams(table.min(initial=0.0), table.max(initial=0.0), bits, symmetric=False)
    require_per_tensor(qp, "input 0 (the constant data)")
    return qp


class _Gathering(OpDef):
    """Moves data codes by integer indices (input 1): one `gather` serves the float and the integer forward."""

    int_types = "any (indices int32/int64) -> same as input"
    keeps_input_qparams = True

    def gather(self, node: Node, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def forward_float(self, node, inputs):
        x = float_or_index(inputs[0])
        return [self.gather(node, x, _indices(inputs[1] if len(inputs) > 1 else None))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedGather:
        if 0 in ctx.constants:
            qp = table_qparams(ctx, ctx.constants[0])
            codes = qp.quantize(np.asarray(ctx.constants[0], dtype=np.float64))
            return QuantizedGather(ctx.node, [qp, None], [qp], codes)
        qp = ctx.in_qparams[0] if ctx.in_qparams else None
        if not isinstance(qp, QParams):
            raise QuantizationError("input 0 has no qparams")
        require_per_tensor(qp, "input 0")
        return QuantizedGather(ctx.node, [qp, None], [qp], None)

    def forward_int(self, q: QuantizedGather, inputs, runtime: IntRuntime):
        x = q.table_codes if q.table_codes is not None else np.asarray(inputs[0])
        return [self.gather(q.node, x, _indices(inputs[1] if len(inputs) > 1 else None))]


@register
class Gather(_Gathering):
    """ONNX Gather (axis): y = take(x, indices, axis). Module docstring."""

    op_type = "Gather"
    lsb_bound = 0.0
    section = "4.33"
    conformance = Case(inputs=(X, "i"), constants={"i": int64s(0, 2, 2)}, attrs={"axis": 1})

    def gather(self, node, x, indices):
        axis = int(node.attr("axis", 0))
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(f"axis {axis} out of range for rank {x.ndim}")
        axis %= x.ndim
        return np.take(x, _wrapped(indices, x.shape[axis], "input 1 (indices)"), axis=axis)


@register
class GatherND(_Gathering):
    """ONNX GatherND (batch_dims b): output shape x.shape[:b] + indices.shape[b:-1] + x.shape[b + r:], with r
    = indices.shape[-1]; each index tuple selects x[batch..., i_0, ..., i_{r-1}]. Module docstring."""

    op_type = "GatherND"
    lsb_bound = 0.0
    section = "4.34"
    conformance = Case(inputs=(X, "i"), constants={"i": np.array([[0, 1], [0, 2]], np.int64)})

    def gather(self, node, x, indices):
        b = int(node.attr("batch_dims", 0))
        if indices.ndim < 1 or not 0 <= b < min(x.ndim, indices.ndim):
            raise ValueError(f"batch_dims {b} must be below the ranks of data {x.ndim} and indices {indices.ndim}")
        if x.shape[:b] != indices.shape[:b]:
            raise ValueError(f"batch dimensions differ: data {x.shape[:b]}, indices {indices.shape[:b]}")
        r = indices.shape[-1]
        if not 1 <= r <= x.ndim - b:
            raise ValueError(f"indices.shape[-1] = {r} must be in [1, {x.ndim - b}]")
        batch = int(np.prod(x.shape[:b], dtype=np.int64))
        xr = x.reshape((batch,) + x.shape[b:])
        ir = _wrapped(indices.reshape((batch,) + indices.shape[b:]), x.shape[b:b + r], "input 1 (indices)")
        rows = np.arange(batch).reshape((batch,) + (1,) * (ir.ndim - 2))
        y = xr[(rows,) + tuple(ir[..., j] for j in range(r))]
        return y.reshape(x.shape[:b] + indices.shape[b:-1] + x.shape[b + r:])


def _unpool_shape(node: Node, x: np.ndarray, inputs) -> tuple[int, ...]:
    """The output shape: input 2 when given, else MaxUnpool's (in - 1) * stride + kernel - pad_begin - pad_end."""
    shape = int_list(node, inputs, 2, "output_shape")
    if shape is not None:
        if len(shape) != x.ndim or list(shape[:2]) != list(x.shape[:2]):
            raise ValueError(f"input 2 (output_shape) {shape} does not match input {x.shape}")
        return tuple(shape)
    nd = x.ndim - 2
    kernel = [int(k) for k in node.attr("kernel_shape", [])]
    strides = [int(v) for v in node.attr("strides", [1] * nd)]
    pads = [int(v) for v in node.attr("pads", [0] * (2 * nd))]
    if len(kernel) != nd or len(strides) != nd or len(pads) != 2 * nd:
        raise ValueError(f"kernel_shape {kernel}, strides {strides}, pads {pads} do not fit {nd} spatial axes")
    return x.shape[:2] + tuple((n - 1) * s + k - b - e
                               for n, s, k, b, e in zip(x.shape[2:], strides, kernel, pads[:nd], pads[nd:]))


def unpool(node: Node, x: np.ndarray, indices: np.ndarray, inputs, zero) -> np.ndarray:
    """y = `zero` everywhere, then y.flat[indices] = x."""
    if x.ndim < 3:
        raise ValueError(f"expected an (N, C, spatial...) input, got shape {x.shape}")
    if indices.shape != x.shape:
        raise ValueError(f"input 1 (indices) has shape {indices.shape}, the input {x.shape}")
    shape = _unpool_shape(node, x, inputs)
    y = np.full(int(np.prod(shape, dtype=np.int64)), zero, dtype=x.dtype)
    y[_wrapped(indices.ravel(), y.size, "input 1 (indices)")] = x.ravel()
    return y.reshape(shape)


def _unpool_reference(x, idx):
    """The conformance case's numpy formula: MaxUnpool to (N, C, 4, 4), indices into the flattened output."""
    out = np.zeros(x.shape[:2] + (4, 4), np.float32)
    out.reshape(-1)[idx.ravel()] = x.ravel()
    return [out]


@register
class UpsampleByIndex(OpDef):
    """ai.ptq UpsampleByIndex: ONNX MaxUnpool on the codes, zeros as zp_x (module docstring). Whitepaper 4.78."""

    op_type = "UpsampleByIndex"
    lsb_bound = 0.0
    domain = "ai.ptq"
    section = "4.78"
    int_types = "any (indices int64) -> same as input"
    keeps_input_qparams = True
    conformance = Case(path="direct", reference=_unpool_reference, shape=(1, 2, 2, 2), inputs=(X, "i"),
                       constants={"i": np.array([[[[0, 3], [9, 14]], [[21, 22], [24, 31]]]], np.int64)},
                       attrs={"kernel_shape": [2, 2], "strides": [2, 2]})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        return [unpool(node, x, _indices(inputs[1] if len(inputs) > 1 else None), inputs, np.float32(0))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [activation_qparams(ctx)])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        indices = _indices(inputs[1] if len(inputs) > 1 else None)
        return [unpool(q.node, x, indices, inputs, x.dtype.type(q.in_qparams[0].zero_point[0]))]
