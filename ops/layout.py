"""Data-movement ops: Identity, Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Split, Slice.

Whitepaper 4.57 (Reshape; 4.77 Transpose, 4.65 Slice and 4.71 Split refer to it / to Crop), ONNX convention:
from y_f = T(x_f), (y_q - zp_y) * s_y = T((x_q - zp_x) * s_x); choosing s_y = s_x and zp_y = zp_x gives

    y_q = T(x_q)

so the integer forward moves the codes exactly as the float op moves values, and every output takes the
input's qparams (this rule overrides the quant table's proposal). A per-channel input (a join of widely
different ranges, `ptq.calibration.joined_ranges`) keeps its grid on the output axis that holds its channels whole
(`moved_axis`: Transpose's perm; Identity, Reshape, Flatten, Squeeze, Unsqueeze keep the row-major order, so
the axis whose size and leading product match, from the static shapes); otherwise the rule refuses it.
LSB bound vs the float op on the dequantized input: 0 (exact).

Index inputs (shape, axes, splits, starts/ends/steps) arrive as raw integer arrays, or as attributes in the
opsets that had them there.
"""
from __future__ import annotations

import numpy as np

from ops.base import float_or_index, int_list, normalize_axes, optional_input, require_qparams
from ops.conformance_case import X, Case, int64s
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node
from ptq.core.qparams import QParams


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, (int, np.integer)) and d > 0 for d in shape)


class _Layout(OpDef):
    """An op that only moves elements: the same `apply` serves the float and the integer forward."""

    int_types = "any -> same as input"
    section = "4.57"
    keeps_input_qparams = True

    def apply(self, node: Node, x: np.ndarray, inputs: list) -> list[np.ndarray]:
        raise NotImplementedError

    def forward_float(self, node, inputs):
        x = float_or_index(inputs[0])
        return [np.asarray(y, dtype=x.dtype) for y in self.apply(node, x, inputs)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        x_qp = require_qparams(ctx.in_qparams[0] if ctx.in_qparams else None, "input 0")
        out_qps = []
        for index, name in enumerate(ctx.node.outputs):
            qp = x_qp
            if name and x_qp.per_channel:
                axis = self.moved_axis(ctx.node, x_qp.axis, ctx.in_shape(0), ctx.out_shape(index))
                if axis is None:
                    raise QuantizationError(f"input 0 is quantized per channel along axis {x_qp.axis}, which this "
                                            "node does not keep whole along one output axis")
                qp = QParams(scale=x_qp.scale, zero_point=x_qp.zero_point, bits=x_qp.bits, signed=x_qp.signed,
                             axis=axis, narrow=x_qp.narrow)
            out_qps.append(qp if name else None)
        return QuantizedNode(ctx.node, list(ctx.in_qparams), out_qps)

    def moved_axis(self, node, axis, in_shape, out_shape):
        """The output axis of the same size whose leading dimensions hold as many elements as the input's before
        `axis` (row-major order kept: Identity, Reshape, Flatten, Squeeze, Unsqueeze); None without static
        shapes or such an axis."""
        if not _static(in_shape) or not _static(out_shape) or not -len(in_shape) <= axis < len(in_shape):
            return None
        axis %= len(in_shape)
        before = int(np.prod(in_shape[:axis], dtype=np.int64))
        for candidate, size in enumerate(out_shape):
            if size == in_shape[axis] and int(np.prod(out_shape[:candidate], dtype=np.int64)) == before:
                return candidate
        return None

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        return self.apply(q.node, x, inputs)


@register
class Identity(_Layout):
    """ONNX Identity: y_q = x_q, output qparams = input's."""

    op_type = "Identity"
    rearranges = True
    lsb_bound = 0.0
    preserves_channel_mean = True
    conformance = Case()

    def is_noop(self, node):
        return True

    def apply(self, node, x, inputs):
        return [x]


@register
class Dropout(_Layout):
    """ONNX Dropout at inference (training_mode absent or false): y_q = x_q, output qparams = input's. The mask
    output, when a model asks for it, is all True (nothing is dropped) and carries no qparams."""

    op_type = "Dropout"
    lsb_bound = 0.0
    conformance = Case()

    def is_noop(self, node):
        return True

    def index_outputs(self, node):
        return frozenset({1}) if len(node.outputs) > 1 and node.outputs[1] else frozenset()

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        if len(ctx.node.inputs) > 2 and ctx.node.inputs[2]:
            value = ctx.constants.get(2)
            if value is None or bool(np.asarray(value)):
                raise QuantizationError("training_mode must be a constant false at inference")
        q = super().quantize(ctx)
        q.out_qparams[1:] = [None] * (len(q.out_qparams) - 1)
        return q

    def forward_float(self, node, inputs):
        return self.apply(node, float_or_index(inputs[0]), inputs)

    def apply(self, node, x, inputs):
        return [x, np.ones(x.shape, dtype=bool)][:len(node.outputs)]


@register
class Reshape(_Layout):
    """ONNX Reshape (0 copies the input dimension unless allowzero=1, -1 is inferred): y_q = reshape(x_q)."""

    op_type = "Reshape"
    rearranges = True
    lsb_bound = 0.0
    conformance = Case(inputs=(X, "s"), constants={"s": int64s(1, 12, 5)})

    def apply(self, node, x, inputs):
        shape = int_list(node, inputs, 1, "shape")
        if shape is None:
            raise ValueError("no target shape")
        if not node.attr("allowzero", 0):
            if any(d == 0 for d in shape[x.ndim:]):
                raise ValueError(f"0 at position >= input rank {x.ndim} in shape {shape}")
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        try:
            return [x.reshape(shape)]
        except ValueError as err:
            raise ValueError(f"cannot reshape {x.shape} to {shape}") from err


@register
class Flatten(_Layout):
    """ONNX Flatten: (d_0 * ... * d_{axis-1}, d_axis * ... * d_{n-1})."""

    op_type = "Flatten"
    rearranges = True
    lsb_bound = 0.0
    preserves_channel_mean = True  # over (N, C, 1, ...) inputs, the only ones analytic bias correction meets
    conformance = Case()

    def apply(self, node, x, inputs):
        axis = int(node.attr("axis", 1))
        if not -x.ndim <= axis <= x.ndim:
            raise ValueError(f"axis {axis} out of range for rank {x.ndim}")
        axis = axis + x.ndim if axis < 0 else axis
        outer = int(np.prod(x.shape[:axis], dtype=np.int64))
        inner = int(np.prod(x.shape[axis:], dtype=np.int64))
        return [x.reshape(outer, inner)]


@register
class Squeeze(_Layout):
    """ONNX Squeeze: drop the given size-1 axes (all size-1 axes when none are given)."""

    op_type = "Squeeze"
    rearranges = True
    lsb_bound = 0.0
    conformance = Case(shape=(1, 3, 1, 5), inputs=(X, "a"), constants={"a": int64s(2)})

    def apply(self, node, x, inputs):
        axes = int_list(node, inputs, 1, "axes")
        if axes is None:
            return [x.reshape([d for d in x.shape if d != 1])]
        axes = normalize_axes(axes, x.ndim)
        bad = [a for a in axes if x.shape[a] != 1]
        if bad:
            raise ValueError(f"axes {bad} of shape {x.shape} are not of size 1")
        return [np.squeeze(x, axis=tuple(axes))]


@register
class Unsqueeze(_Layout):
    """ONNX Unsqueeze: insert size-1 axes at the given positions of the output."""

    op_type = "Unsqueeze"
    rearranges = True
    lsb_bound = 0.0
    conformance = Case(inputs=(X, "a"), constants={"a": int64s(1)})

    def apply(self, node, x, inputs):
        axes = int_list(node, inputs, 1, "axes")
        if not axes:
            raise ValueError("no axes")
        return [np.expand_dims(x, tuple(normalize_axes(axes, x.ndim + len(axes))))]


@register
class Transpose(_Layout):
    """ONNX Transpose (default perm: reversed axes). Whitepaper 4.77."""

    op_type = "Transpose"
    rearranges = True
    lsb_bound = 0.0
    section = "4.77"
    conformance = Case(attrs={"perm": [0, 2, 3, 1]})

    def moved_axis(self, node, axis, in_shape, out_shape):
        """perm.index(axis): the output axis that now holds the input's `axis`."""
        if in_shape is None or not -len(in_shape) <= axis < len(in_shape):
            return None
        perm = node.attr("perm")
        perm = list(range(len(in_shape)))[::-1] if perm is None else [int(p) % len(in_shape) for p in perm]
        return perm.index(axis % len(in_shape)) if axis % len(in_shape) in perm else None

    def apply(self, node, x, inputs):
        perm = node.attr("perm")
        perm = list(range(x.ndim))[::-1] if perm is None else [int(p) for p in perm]
        if sorted(normalize_axes(perm, x.ndim)) != list(range(x.ndim)):
            raise ValueError(f"perm {perm} is not a permutation of rank {x.ndim}")
        return [np.transpose(x, perm)]


@register
class Split(_Layout):
    """ONNX Split: sizes from the `split` input (opset >= 13) or attribute, else equal parts (the last one
    smaller when `num_outputs` does not divide the axis, opset 18). Whitepaper 4.71."""

    op_type = "Split"
    lsb_bound = 0.0
    section = "4.71"
    conformance = Case(inputs=(X, "sp"), constants={"sp": int64s(2, 3)}, attrs={"axis": 3}, outputs=2)

    def moved_axis(self, node, axis, in_shape, out_shape):
        return None  # it cuts the tensor: a per-channel grid would not follow its channels

    def apply(self, node, x, inputs):
        axis = normalize_axes([int(node.attr("axis", 0))], x.ndim)[0]
        dim = x.shape[axis]
        sizes = int_list(node, inputs, 1, "split")
        if sizes is None:
            parts = int(node.attr("num_outputs", len(node.outputs)))
            chunk = -(-dim // parts)
            sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(parts)]
        if len(sizes) != len(node.outputs) or sum(sizes) != dim or min(sizes) < 0:
            raise ValueError(f"sizes {sizes} do not split dim {dim} "
                             f"into {len(node.outputs)} outputs")
        return np.split(x, np.cumsum(sizes)[:-1], axis=axis)


@register
class Slice(_Layout):
    """ONNX Slice: starts/ends/axes/steps from inputs 1-4 (opset >= 10) or attributes (opset 1), with ONNX
    clamping (start to [0, d] / [0, d-1], end to [0, d] / [-1, d-1] for positive / negative steps).
    Whitepaper 4.65."""

    op_type = "Slice"
    lsb_bound = 0.0
    section = "4.65"
    conformance = Case(inputs=(X, "st", "en", "ax"),
                       constants={"st": int64s(1, 0), "en": int64s(4, 3), "ax": int64s(2, 3)})

    def moved_axis(self, node, axis, in_shape, out_shape):
        return None  # it cuts the tensor: a per-channel grid would not follow its channels

    def apply(self, node, x, inputs):
        starts = int_list(node, inputs, 1, "starts")
        ends = int_list(node, inputs, 2, "ends")
        if starts is None or ends is None or len(starts) != len(ends):
            raise ValueError(f"starts {starts} and ends {ends} must be given, of equal length")
        axes = int_list(node, inputs, 3, "axes")
        axes = list(range(len(starts))) if axes is None else axes
        steps = optional_input(inputs, 4)
        steps = [1] * len(starts) if steps is None else [int(s) for s in np.asarray(steps).ravel()]
        if not len(axes) == len(steps) == len(starts):
            raise ValueError("starts/ends/axes/steps lengths differ")
        index = [slice(None)] * x.ndim
        for start, end, axis, step in zip(starts, ends, normalize_axes(axes, x.ndim), steps):
            if step == 0:
                raise ValueError(f"step 0 on axis {axis}")
            dim = x.shape[axis]
            start, end = (v + dim if v < 0 else v for v in (start, end))
            if step > 0:
                start, end = min(max(start, 0), dim), min(max(end, 0), dim)
            else:
                start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
            index[axis] = slice(start, None if end < 0 else end, step)
        return [x[tuple(index)]]
