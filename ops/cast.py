"""Cast (whitepaper 4.10), ONNX convention, by the target type `to`:

- float -> float (float16, float, double): s_y = s_x, zp_y = zp_x, y_q = x_q (a no-op on the codes; exact,
  apart from what the narrower float type itself rounds);
- float -> integer or bool (an index output: int64/bool values, no qparams): the whitepaper's table variant,
  T[x_q] = Cast((x_q - zp_x) * s_x) built offline over every input code with the float op's own semantics
  (ONNX/onnxruntime truncate toward zero; bool is x != 0), y = T[x_q] at run time. Exact: 0 difference from the
  float op on the dequantized input;
- integer or bool -> float (an activation computed from an index tensor): y_q = clamp(((x * M + 2^(N-1)) >> N)
  + zp_y, qmin, qmax) with M / 2^N ~= 1 / s_y (x clipped first to just beyond the output range, so the product
  fits int64); bool x takes the two codes quantize(0), quantize(1). LSB bound: 0.5 + |x| * |M / 2^N - 1 / s_y|
  (0.5 for bool).
Integer -> integer casts compute shapes and run in the executor's shape path (`forward_float`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from ops.base import multiplier, require_per_tensor, require_qparams
from ops.conformance_case import Case
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.requant import requantize

FLOAT_TARGETS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE})
INDEX_TARGETS = frozenset({TensorProto.BOOL, TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16,
                           TensorProto.UINT16, TensorProto.INT32, TensorProto.UINT32, TensorProto.INT64,
                           TensorProto.UINT64})


def _target(node) -> tuple[int, np.dtype]:
    to = node.attr("to")
    if to is None:
        raise ValueError("attribute 'to' is missing")
    to = int(to)
    if to not in FLOAT_TARGETS | INDEX_TARGETS:
        raise ValueError(f"attribute to={to} is not a float, integer or bool type")
    return to, np.dtype(helper.tensor_dtype_to_np_dtype(to))


@dataclass
class QuantizedCastTable(QuantizedNode):
    table: np.ndarray  # float -> integer/bool: the target value of every input code, indexed by x_q - qmin


@dataclass
class QuantizedCastFromIndex(QuantizedNode):
    bool_codes: np.ndarray  # bool input: the output codes of False, True
    m: np.ndarray  # integer input: M / 2^N ~= 1 / s_y
    n: np.ndarray
    clip: tuple[int, int]  # integer input clipped to this range first (beyond it the output saturates anyway)


@register
class Cast(OpDef):
    """ONNX Cast. Integer rules and bounds per target type: module docstring."""

    op_type = "Cast"
    lsb_bound = 0.52  # 0.5 + 2^8 * 2^-(mbits-1), 8-bit
    section = "4.10"
    int_types = "int8/uint8/int16 -> same (to float) or int/bool (to index); int/bool -> int8/uint8/int16"
    conformance = Case(attrs={"to": int(TensorProto.INT32)}, note="to int32 (an index output)")

    def index_outputs(self, node):
        to, _ = _target(node)
        return frozenset({0}) if to in INDEX_TARGETS else frozenset()

    def is_noop(self, node):
        """Between float types the codes pass unchanged."""
        return _target(node)[0] in FLOAT_TARGETS

    def forward_float(self, node, inputs):
        _, dtype = _target(node)
        x = np.asarray(inputs[0])
        if dtype == np.bool_:
            return [x != 0]
        with np.errstate(invalid="ignore", over="ignore"):
            return [x.astype(dtype)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        to, dtype = _target(ctx.node)
        x_qp = ctx.in_qparams[0]
        if x_qp is None:
            if to in INDEX_TARGETS:
                raise QuantizationError("input 0 has no qparams (an index-to-index cast runs as a shape node)")
            return self._from_index(ctx)
        require_per_tensor(x_qp, "input 0")
        if to in FLOAT_TARGETS:
            return QuantizedNode(ctx.node, [x_qp], [x_qp])
        codes = np.arange(x_qp.qmin, x_qp.qmax + 1, dtype=np.int64)
        table = self.forward_float(ctx.node, [x_qp.dequantize(codes)])[0]
        return QuantizedCastTable(ctx.node, [x_qp], [None], table)

    @staticmethod
    def _from_index(ctx: QuantizeContext) -> QuantizedCastFromIndex:
        y_qp = require_qparams(ctx.out_qparams[0], "output")
        require_per_tensor(y_qp, "output")
        bool_codes = y_qp.quantize(np.array([0.0, 1.0])).astype(np.int64)
        m, n = multiplier(1.0 / float(y_qp.scale[0]), ctx.options.mbits, "1 / s_y")
        lo, hi = (float(v[0]) for v in y_qp.real_range())
        clip = (int(np.floor(lo)) - 1, int(np.ceil(hi)) + 1)
        return QuantizedCastFromIndex(ctx.node, [None], [y_qp], bool_codes, m, n, clip)

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        if isinstance(q, QuantizedCastTable):
            return [q.table[x.astype(np.int64) - q.in_qparams[0].qmin]]
        if isinstance(q, QuantizedCastFromIndex):
            y_qp = q.out_qparams[0]
            if x.dtype == np.bool_:
                return [q.bool_codes[x.astype(np.int64)].astype(y_qp.dtype)]
            x = np.clip(x.astype(np.int64), *q.clip)
            return [requantize(x, q.m, q.n, y_qp.zero_point[0], y_qp.qmin, y_qp.qmax, dtype=y_qp.dtype)]
        return [x]
